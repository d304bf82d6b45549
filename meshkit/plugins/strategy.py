"""NDParallelStrategy: one Lightning strategy for HSDP × TP (× PP × CP), configured by ParallelDims.

``import meshkit`` registers the presets, so an unmodified LightningModule trains with::

    trainer = L.Trainer(strategy="hsdp_tp", accelerator="cpu", devices=4)

or with explicit sizes::

    trainer = L.Trainer(strategy=meshkit.NDParallelStrategy(dp_replicate=2, dp_shard=2, tp=2), devices=8)

Without a ``configure_model`` in the LightningModule the strategy parallelizes it itself with
:func:`meshkit.plugins.parallelize.parallelize` (torchtitan's order: fused kernels -> TP plan -> CP ->
activation checkpointing -> per-block compile -> ``fully_shard`` per block and root), then
materializes meta parameters and builds the optimizers. With a ``configure_model`` it calls that
instead; the module sees ``self.device_mesh`` (axes ``dp_replicate dp_shard pp cp tp``).

The strategy is Lightning glue: presets and every pre-process-group check live in
:mod:`meshkit.plugins.presets`, the settings in :class:`~meshkit.plugins.parallelize.ParallelConfig`,
checkpoint code in :mod:`meshkit.plugins.checkpointing`, the pipeline side in ``PipelineHooks``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import sys
import threading
import time
from datetime import timedelta
from typing import Any, Generator, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from typing_extensions import override

from meshkit.plugins import checkpointing as _ckpt
from meshkit.plugins import context_parallel as _cp
from meshkit.plugins import fsdp as _fsdp
from meshkit.plugins.activation_checkpoint import ACMode
from meshkit.plugins.dims import ParallelDims
from meshkit.plugins.parallelize import ParallelConfig, parallelize
from meshkit.plugins.pipeline.lightning import PipelineHooks
from meshkit.plugins.presets import PRESETS, Size, check_launch, resolve_layout
from meshkit.plugins.tensor_parallel import PlanEntry

__all__ = ["NDParallelStrategy", "register_presets"]

log = logging.getLogger(__name__)


class NDParallelStrategy(ModelParallelStrategy):
    """HSDP (FSDP2 over a replicate × shard mesh) × tensor parallel × (pipeline, context) for Lightning.

    Args:
        preset: a name from :data:`PRESETS` (``"fsdp2" "hsdp" "tp" "hsdp_tp" "cp" "hsdp_cp" "hsdp_tp_cp"``):
            which axes ``"auto"`` turns on.
        dp_replicate, dp_shard, pp, cp, tp: sizes of each mesh axis, or ``"auto"`` (resolved from devices,
            num_nodes and the model in ``setup_environment``). Their product must be the world size.
        tp_plan: extra or overriding TP rules, ``{fnmatch pattern: "colwise" | "rowwise" | "replicate" | style}``.
        sequence_parallel: shard norms and the residual stream on the sequence dim (torchtitan-style models).
        loss_parallel: keep logits vocab-sharded; ``training_step``/``backward`` run under ``loss_parallel()``.
        activation_checkpointing: ``"none" | "full" | "selective"``.
        compile: ``torch.compile`` each block.
        reshard_after_forward: FSDP2 frees gathered block parameters after forward (ZeRO-3); False = ZeRO-2.
        global_batch_size: if given, checked to be divisible by the data-parallel size.
        save_distributed_checkpoint: DCP-sharded checkpoints (default) or one consolidated file.
        cp_attention: context-parallel attention when cp > 1: ``"ring" | "allgather" | "ulysses"``.
        cp_layout: how sequences are cut over cp: ``"load_balanced"`` (chunks r and 2cp-1-r) or ``"contiguous"``.
        fused_kernels: swap in meshkit's Triton RMSNorm, SwiGLU, RoPE and fused linear cross-entropy
            (:func:`meshkit.integrations.apply_fused_kernels`) before parallelizing.
        pp_schedule, pp_microbatches, pp_virtual_stages, pp_split_points, pp_timeline_dir: pipeline options
            (pp > 1), see :mod:`meshkit.plugins.pipeline` and :mod:`meshkit.plugins.pipeline.lightning`.

    Example::

        >>> import lightning as L, meshkit
        >>> strategy = meshkit.NDParallelStrategy(dp_shard=2, tp=2)
        >>> trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=4, max_steps=1)  # doctest: +SKIP
    """

    strategy_name = "nd_parallel"

    def __init__(
        self,
        preset: str = "hsdp_tp",
        *,
        dp_replicate: Size = "auto",
        dp_shard: Size = "auto",
        pp: Size = "auto",
        cp: Size = "auto",
        tp: Size = "auto",
        tp_plan: Optional[dict[str, PlanEntry]] = None,
        sequence_parallel: bool = False,
        loss_parallel: bool = False,
        activation_checkpointing: ACMode = "none",
        compile: bool = False,
        reshard_after_forward: bool = True,
        global_batch_size: Optional[int] = None,
        save_distributed_checkpoint: bool = True,
        cp_attention: str = "ring",
        cp_layout: str = "load_balanced",
        fused_kernels: bool = False,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        pp_schedule: str = "1f1b",
        pp_microbatches: Optional[int] = None,
        pp_virtual_stages: Optional[int] = None,
        pp_split_points: Optional[list[int]] = None,
        pp_timeline_dir: Optional[str] = None,
    ) -> None:
        if preset not in PRESETS:
            raise ValueError(
                f"NDParallelStrategy: unknown `preset={preset!r}`; choose one of {sorted(PRESETS)} "
                "or pass explicit sizes (dp_replicate=, dp_shard=, tp=, ...)."
            )
        # Validates activation_checkpointing, cp_attention and cp_layout (before Lightning's own setup).
        config = ParallelConfig(
            tp_plan=tp_plan, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel,
            activation_checkpointing=activation_checkpointing, compile=compile,
            reshard_after_forward=reshard_after_forward, fused_kernels=fused_kernels, cp_attention=cp_attention,
            cp_layout=cp_layout, global_batch_size=global_batch_size,
        )
        super().__init__(
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.preset = PRESETS[preset]
        self._sizes: dict[str, Size] = {
            "dp_replicate": dp_replicate, "dp_shard": dp_shard, "pp": pp, "cp": cp, "tp": tp,
        }
        self.parallel_config = config
        """Every setting of the automatic path; ``precision`` is filled in ``setup_environment``."""
        self._parallel_dims: Optional[ParallelDims] = None
        # Pipeline parallelism: inactive unless pp > 1 (meshkit.plugins.pipeline.lightning).
        self._pipeline = PipelineHooks(pp_schedule, pp_microbatches, pp_virtual_stages, pp_split_points, pp_timeline_dir)

    # ---- layout ---------------------------------------------------------------------------------
    @property
    def parallel_dims(self) -> ParallelDims:
        """The resolved degrees and the mesh (available from ``setup_environment`` on)."""
        if self._parallel_dims is None:
            raise RuntimeError("NDParallelStrategy.parallel_dims is resolved in `setup_environment`; not yet.")
        return self._parallel_dims

    def _resolve(self) -> ParallelDims:
        """Every check that needs no collective (:func:`~meshkit.plugins.presets.resolve_layout`), on every rank."""
        precision = getattr(self.precision_plugin, "precision", "32-true")
        self.parallel_config = dataclasses.replace(self.parallel_config, precision=precision)
        world = self.num_nodes * self.num_processes
        return resolve_layout(
            self.preset, self._sizes, self.parallel_config, world_size=world, num_nodes=self.num_nodes,
            model=self.lightning_module, planner=lambda: self._planned_dims(world),
        )

    def _planned_dims(self, world: int) -> ParallelDims:
        """``auto_nd``: ask the planner for this world, device and model; it logs its table and choice."""
        from meshkit.plugins.planner import auto_nd_dims

        dev, c = self.root_device, self.parallel_config
        return auto_nd_dims(
            self.lightning_module, world_size=world, num_nodes=self.num_nodes,
            device="cpu" if dev.type == "cpu" else torch.cuda.get_device_name(dev),
            memory_gb=None if dev.type == "cpu" else torch.cuda.get_device_properties(dev).total_memory / 2**30,
            global_batch=c.global_batch_size, reshard_after_forward=c.reshard_after_forward,
            sequence_parallel=c.sequence_parallel, activation_checkpointing=c.activation_checkpointing,
            log=rank_zero_info,
        )

    @override
    def setup_environment(self) -> None:
        # Launcher vs Trainer, then the layout: every check before the first collective, on every rank.
        external = self.cluster_environment.creates_processes_externally
        initialized = torch.distributed.get_world_size() if torch.distributed.is_initialized() else None
        check_launch(self.num_processes, self.num_nodes, os.environ if external else {}, initialized)
        dims = self._resolve()
        _exit_with_launcher(self.cluster_environment)
        world = self.num_nodes * self.num_processes
        env = self.cluster_environment
        where = f"{env.main_address}:{env.main_port}"
        missing: list[int] = []
        try:
            if initialized is None and world > 1:  # who is missing, named, before torch's silent wait
                rank = self.node_rank * self.num_processes + self.local_rank
                missing, store = _roll_call(env.main_address, env.main_port, rank, world, self._timeout,
                                            per_node=self.num_processes)
            if not missing:
                self._setup_distributed()  # on rank 0 torch's store shares the roll call's server
        except RuntimeError as e:  # torch's DistStoreError / DistError are RuntimeErrors
            # A timeout, or the store's host giving up first (the peers then see the connection close).
            if not (_is_timeout(e) or isinstance(e, torch.distributed.DistNetworkError)):
                raise
            raise RuntimeError(self._rendezvous_failed(where, None, e)) from e
        if missing:
            raise RuntimeError(self._rendezvous_failed(where, missing))
        dims.build_mesh(self.root_device.type, timeout=self._timeout)  # every sub-group gets `timeout=`
        self._parallel_dims = dims
        self._device_mesh = dims.mesh
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = dims.mesh
        rank_zero_info(f"meshkit: {self.preset.name} layout {dims} on {self.num_nodes} node(s)")

    def _rendezvous_failed(self, where: str, missing: Optional[list[int]], cause: Any = None) -> str:
        """The error every rank raises when the rendezvous does not complete: who is missing and the fix."""
        world = self.num_nodes * self.num_processes
        if missing:
            arrived = sorted(set(range(world)) - set(missing))
            who = f"{_ranges(missing)} of {world} did not join at {where} ({_ranges(arrived)} did)"
        else:  # e.g. the store's host (rank 0) never came up: the others could not even ask
            who = f"{world} processes were expected at {where}, and not all arrived ({cause})"
        return (
            f"NDParallelStrategy: the process-group rendezvous did not complete within `timeout={self._timeout}`: "
            f"{who}. `devices={self.num_processes}` × `num_nodes={self.num_nodes}` need {world} processes: start "
            f"`devices` processes on each of the `num_nodes` nodes (e.g. `torchrun --nnodes {self.num_nodes} "
            f"--nproc-per-node {self.num_processes}`), with NODE_RANK set per node, or lower `num_nodes`."
        )

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        dp = self.parallel_dims.submesh("dp")
        return {"num_replicas": dp.size(), "rank": dp.get_local_rank()}

    # ---- model --------------------------------------------------------------------------------
    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        # validate/test after fit set up the same, already parallelized module again: do it once.
        if not is_overridden("configure_model", self.lightning_module) and not _is_parallelized(self.model):
            self.model = self.precision_plugin.convert_module(self.model)
            self.parallelize(self.model)
            self.model._meshkit_parallelized = True  # type: ignore[assignment]
        _materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._patch_gradient_clipping()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def parallelize(self, module: nn.Module) -> nn.Module:
        """The automatic path on ``module`` (in place): :func:`~meshkit.plugins.parallelize.parallelize`."""
        dims, config = self.parallel_dims, self.parallel_config
        if dims.pp_enabled:  # split into stages first, then the same order per stage
            return self._pipeline.parallelize(module, dims, config, self.root_device)
        return parallelize(module, dims, config)

    # ---- steps --------------------------------------------------------------------------------
    def _loss_context(self) -> contextlib.AbstractContextManager:
        if self.parallel_config.loss_parallel and self.parallel_dims.tp_enabled:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline.active:  # the schedule runs forward and backward of every micro-batch
            return self._pipeline.training_step(self.lightning_module, args[0])
        with self._loss_context():
            output = super().training_step(*args, **kwargs)
            _cp.per_rank_mean_warning(args[0] if args else None)  # cp: warns once if the loss was a per-rank mean
            return self._cp_loss(output)

    @override
    def backward(self, closure_loss: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self._pipeline.active:  # backward ran inside the schedule; its gradients land now
            self._pipeline.backward()
            return closure_loss
        with self._loss_context():
            return super().backward(closure_loss, *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline.active:
            return self._pipeline.eval_step(self.lightning_module, args[0], "val_loss")
        return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline.active:
            return self._pipeline.eval_step(self.lightning_module, args[0], "test_loss")
        return super().test_step(*args, **kwargs)

    @contextlib.contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Accumulation micro-steps: FSDP2 skips its gradient reduce-scatter / all-reduce."""
        from torch.distributed.fsdp import FSDPModule

        assert self.model is not None
        modules = [m for m in self.model.modules() if isinstance(m, FSDPModule)]
        for m in modules:
            m.set_requires_gradient_sync(False, recurse=False)
        try:
            yield
        finally:
            for m in modules:
                m.set_requires_gradient_sync(True, recurse=False)

    def _patch_gradient_clipping(self) -> None:
        """Lightning's norm clipping calls ``clip_grad_norm_``; ours takes the norm over every mesh axis."""
        plugin = self.precision_plugin

        def clip_grad_by_norm(optimizer: torch.optim.Optimizer, clip_val: Union[int, float]) -> None:
            params = [p for g in optimizer.param_groups for p in g["params"]]
            if self._pipeline.active:  # the norm spans every pipeline stage
                self._pipeline.clip(params, float(clip_val))
                return
            _fsdp.clip_grad_norm_(params, float(clip_val))

        plugin.clip_grad_by_norm = clip_grad_by_norm  # type: ignore[method-assign]

    # ---- context parallelism --------------------------------------------------------------------
    @override
    def batch_to_device(self, batch: Any, device: Optional[torch.device] = None, dataloader_idx: int = 0) -> Any:
        """With cp > 1 each rank keeps its part of every sequence: ``{"input_ids", "labels", "positions", ...}``."""
        batch = super().batch_to_device(batch, device, dataloader_idx)
        if self._parallel_dims is not None and self._parallel_dims.cp_enabled:
            batch = _cp.shard_batch(batch, self._parallel_dims.submesh("cp"), layout=self.parallel_config.cp_layout)
        return batch

    def _cp_loss(self, output: Any) -> Any:
        """Report the loss averaged over dp × cp; its gradient stays the local one (FSDP averages those)."""
        if self._parallel_dims is None or not self._parallel_dims.cp_enabled:
            return output
        loss = output["loss"] if isinstance(output, dict) else output
        if not isinstance(loss, torch.Tensor):
            return output
        mean = loss.detach().clone()
        group = self._parallel_dims.submesh("dp_cp").get_group()
        torch.distributed.all_reduce(mean, op=torch.distributed.ReduceOp.AVG, group=group)
        loss = loss + (mean - loss.detach())
        return {**output, "loss": loss} if isinstance(output, dict) else loss

    @override
    def on_exception(self, exception: BaseException) -> None:
        """A collective that timed out gets a note naming the collective, the group and its ranks."""
        built = self._parallel_dims is not None and self._parallel_dims._mesh is not None  # else: the rendezvous
        if built and _is_timeout(exception) and hasattr(exception, "add_note"):
            exception.add_note(_timeout_note(exception, self._parallel_dims, self._timeout, self.global_rank))
        super().on_exception(exception)

    # ---- checkpoints --------------------------------------------------------------------------
    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None
    ) -> None:
        """Atomic and hashed: a crash mid-save leaves the previous one (see :mod:`meshkit.plugins.checkpointing`)."""
        if storage_options is not None:
            raise TypeError(
                f"`{type(self).__name__}.save_checkpoint(..., storage_options=...)` is not supported: "
                "meshkit writes checkpoints itself, not through a CheckpointIO plugin."
            )
        _ckpt.save_checkpoint(self, checkpoint, filepath)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        load_file = functools.partial(_ckpt.load_full_checkpoint, self)  # tied names filled in, as for folders
        return _ckpt.load_checkpoint(self, checkpoint_path, weights_only, load_file)

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return _ckpt.optimizer_state(self, optimizer, super().optimizer_state)


def _is_timeout(exception: BaseException) -> bool:
    text = str(exception).lower()
    return isinstance(exception, RuntimeError) and ("timed out" in text or "timeout" in text)


def _timeout_note(exception: BaseException, dims: Optional[ParallelDims], timeout: Any, rank: int) -> str:
    """Which collective and group the timed-out call was in: read from torch.distributed's frames."""
    from torch.distributed import ProcessGroup, get_process_group_ranks

    names = {}
    if dims is not None and dims._mesh is not None:
        for axis in dims.order + tuple(dims._flat):
            names[dims.submesh(axis).get_group().group_name] = axis
    collective, group = "a collective", None
    tb = exception.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_globals.get("__name__", "").startswith("torch.distributed"):
            collective = f"`{frame.f_code.co_name}`"
            found = [v for v in frame.f_locals.values() if isinstance(v, ProcessGroup)]
            group = found[0] if found else group
        tb = tb.tb_next
    if group is not None:
        axis = names.get(group.group_name, group.group_desc or group.group_name)
        where = f" on group `{axis}` (ranks {get_process_group_ranks(group)})"
    else:  # e.g. a functional collective's wait_tensor keeps no group: list this rank's groups
        axes = {a: dims.submesh(a) for a in dims.order} if dims is not None and dims._mesh is not None else {}
        where = " on one of this rank's groups " + ", ".join(
            f"`{a}` {get_process_group_ranks(m.get_group())}" for a, m in axes.items() if m.size() > 1
        )
    return (
        f"meshkit (rank {rank}): {collective}{where} timed out after `timeout={timeout}`: another rank in that group "
        "stopped responding (crashed, frozen, out of memory, or it runs other collectives). Look for the rank that "
        "stopped in its own log; raise `timeout=` only if a step legitimately takes longer."
    )


_roll_calls = 0  # per process: a second rendezvous on the same store (after destroy_process_group) asks anew


_VERDICT_GRACE = timedelta(seconds=30)  # how much later than rank 0 the others may give up waiting for its verdict


def _roll_call(
    address: str, port: int, rank: int, world: int, timeout: Optional[timedelta], per_node: int = 1
) -> tuple[list[int], Any]:
    """Every rank signs in on the store torch's rendezvous is about to use: ``(ranks that never did, the store)``.

    Rank 0 hosts the TCPStore as torch's ``env://`` rendezvous does (multi-tenant: torch's own store in
    this process then shares its server, no second port), or, under torchrun's agent store, every
    rank is a client of the agent's. Keys live under ``meshkit/roll_call/<restart>/<n>/``. Each rank
    sets its key; rank 0 waits up to ``timeout`` for all ``world`` of them and publishes the missing
    ranks (none: milliseconds); the others wait for that verdict and tell rank 0 they read it, so
    every rank raises the same error before rank 0's exit closes the store. Rank 0 also waits (up to
    ``_VERDICT_GRACE``) for its node's ``per_node`` ranks that came late (a slow start-up under
    Lightning's launcher), so they too read the verdict. Keep the store until the process group
    exists (rank 0's server lives in it).
    """
    global _roll_calls
    from torch.distributed import TCPStore

    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    wait = timeout if timeout is not None else default_pg_timeout
    store = TCPStore(address, int(port), None, is_master=rank == 0 and not agent, timeout=wait,
                     wait_for_workers=False, multi_tenant=True)
    prefix = f"meshkit/roll_call/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{_roll_calls}/"
    _roll_calls += 1
    keys = [f"{prefix}{r}" for r in range(world)]
    store.set(keys[rank], "1")

    def absent() -> list[int]:
        return [r for r, key in enumerate(keys) if not store.check([key])]

    if rank == 0:
        missing = [] if _waited(store, keys, wait) else absent()
        store.set(f"{prefix}verdict", ",".join(map(str, missing)))
        if missing:  # keep the store up until the others (and late node-mates) have read it, or a short while
            readers = [r for r in range(1, world) if r not in missing or r < per_node]
            _waited(store, [f"{prefix}read/{r}" for r in readers], _VERDICT_GRACE)
        return missing, store
    if not _waited(store, [f"{prefix}verdict"], wait + _VERDICT_GRACE):
        return absent(), store  # rank 0 never gave one (it is missing itself, under an agent's store)
    verdict = store.get(f"{prefix}verdict").decode()
    store.set(f"{prefix}read/{rank}", "1")
    return [int(r) for r in verdict.split(",") if r], store


def _waited(store: Any, keys: list[str], timeout: timedelta) -> bool:
    try:
        store.wait(keys, timeout)
    except RuntimeError as e:  # DistStoreError: "wait timeout after ...ms"
        if not _is_timeout(e):
            raise
        return False
    return True


def _ranges(ranks: list[int]) -> str:
    """``[2, 3]`` -> ``"ranks 2, 3"``, ``[0]`` -> ``"rank 0"``, long runs ``[0..7]`` -> ``"ranks 0-7"``."""
    parts, start = [], None
    for i, r in enumerate(ranks):
        start = r if start is None else start
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(str(r) if r == start else f"{start}, {r}" if r == start + 1 else f"{start}-{r}")
            start = None
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(parts)


def _exit_with_launcher(environment: Any) -> None:
    """Ranks that Lightning's own launcher started exit when rank 0 (their parent) dies.

    Without this they wait in their next collective until `timeout` (issue 14: orphans alive 100 s
    later). Such a rank runs under the plain LightningEnvironment with LOCAL_RANK > 0 and its parent
    is a Python process (torchrun and SLURM have their own environments and agents). One watcher per
    process: a process that runs many fits started one per fit before.
    """
    from lightning.fabric.plugins.environments import LightningEnvironment

    global _launcher_watch
    if type(environment) is not LightningEnvironment or environment.local_rank() == 0:
        return
    if _launcher_watch is not None and _launcher_watch.is_alive():
        return
    parent = os.getppid()
    try:
        if os.readlink(f"/proc/{parent}/exe") != os.readlink("/proc/self/exe"):
            return
    except OSError:  # not Linux, or the parent is gone already
        return

    rank = environment.global_rank()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        print(f"meshkit (rank {rank}): the launching process (rank 0, pid {parent}) died; "
              "exiting.", file=sys.stderr, flush=True)
        os._exit(1)

    _launcher_watch = threading.Thread(target=watch, name="meshkit-launcher-watch", daemon=True)
    _launcher_watch.start()


_launcher_watch: Optional[threading.Thread] = None


def _is_parallelized(module: nn.Module) -> bool:
    return bool(getattr(module, "_meshkit_parallelized", False))


def register_presets(registry: Any = None) -> None:
    """Register every preset name with Lightning's StrategyRegistry (done on ``import meshkit``)."""
    from lightning.pytorch.strategies import StrategyRegistry

    registry = registry if registry is not None else StrategyRegistry
    for name, preset in PRESETS.items():
        if name in registry and registry[name]["strategy"] is not NDParallelStrategy:
            raise RuntimeError(f"meshkit: strategy name {name!r} is already registered by another package.")
        registry.register(name, NDParallelStrategy, description=preset.description, override=True, preset=name)

