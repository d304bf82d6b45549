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
the process-group start, roll call and fault notes in :mod:`meshkit.plugins.rendezvous`, checkpoint files in
:mod:`meshkit.plugins.checkpoint` (plain functions the strategy hands its states to), the pipeline side in
``PipelineHooks``.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Generator, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from typing_extensions import override

from meshkit.plugins import checkpoint as _ckpt
from meshkit.plugins import context_parallel as _cp
from meshkit.plugins import fsdp as _fsdp
from meshkit.plugins.console import report_once
from meshkit.plugins.checkpoint.state import MODEL, OPTIMIZERS
from meshkit.plugins.dims import ParallelDims
from meshkit.plugins.materialize import materialize
from meshkit.plugins.parallelize import ParallelConfig, loss_context, parallelize
from meshkit.plugins.pipeline.lightning import PipelineHooks
from meshkit.plugins.options import NDParallelOptions, build_options, front_door_signature
from meshkit.plugins.presets import check_launch, register_names, resolve_layout
from meshkit.plugins.rendezvous import (
    end_stopped_children, exit_with_parent, heartbeat, is_timeout, rendezvous, stopped_ranks, timeout_note,
)
from meshkit.quiet import quiet_lightning_pytree

__all__ = ["NDParallelStrategy", "register_presets"]


log = logging.getLogger(__name__)


class NDParallelStrategy(ModelParallelStrategy):
    """HSDP (FSDP2 over a replicate × shard mesh) × tensor parallel × (pipeline, context) for Lightning.

    Args:
        preset: a name from :data:`~meshkit.plugins.presets.PRESETS` (``"fsdp2" "hsdp" "tp" "hsdp_tp" "cp" "hsdp_cp" "hsdp_tp_cp"``):
            which axes ``"auto"`` turns on (default ``"hsdp_tp"``, or ``options.preset``).
        options: an :class:`~meshkit.plugins.options.NDParallelOptions`; the keyword arguments override it.
        **settings: any field of :class:`~meshkit.plugins.options.NDParallelOptions` by keyword, each
            documented there: the sizes ``dp_replicate dp_shard pp cp tp`` (or ``"auto"``), ``tp_plan``,
            ``sequence_parallel``, ``loss_parallel``, ``activation_checkpointing``, ``compile``,
            ``reshard_after_forward``, ``global_batch_size``, ``save_distributed_checkpoint``, ``allow_unverified``,
            ``cp_attention``, ``cp_layout``, ``fused_kernels``, ``process_group_backend``, ``timeout`` and the
            pipeline's ``pp_schedule pp_microbatches pp_virtual_stages pp_split_points pp_timeline_dir``
            (see :mod:`meshkit.plugins.pipeline.lightning`). Validated once, before any process group;
            the result is :attr:`options`.

    Example::

        >>> import lightning as L, meshkit
        >>> strategy = meshkit.NDParallelStrategy(dp_shard=2, tp=2)
        >>> trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=4, max_steps=1)  # doctest: +SKIP
    """

    strategy_name = "nd_parallel"

    def __init__(
        self, preset: Optional[str] = None, *, options: Optional[NDParallelOptions] = None, **settings: Any
    ) -> None:
        opts = build_options(type(self).__name__, preset, options, settings)
        super().__init__(
            save_distributed_checkpoint=opts.save_distributed_checkpoint,
            process_group_backend=opts.process_group_backend,
            timeout=opts.timeout,
        )
        quiet_lightning_pytree()
        self.options = opts
        """The settings this strategy was built with (frozen, validated)."""
        self.preset = opts.preset
        self.parallel_config = opts.parallel_config()
        """Every setting of the automatic path; ``precision`` is filled in ``setup_environment``."""
        self._parallel_dims: Optional[ParallelDims] = None
        self._cp_applied: Optional[_cp.CPApplied] = None  # under cp: the model's record, resolved in setup
        # Pipeline parallelism: inactive unless pp > 1 (meshkit.plugins.pipeline.lightning).
        self._pipeline = PipelineHooks(opts.pp_schedule, opts.pp_microbatches, opts.pp_virtual_stages,
                                       opts.pp_split_points, opts.pp_timeline_dir)

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
        self.parallel_config = self.options.parallel_config(precision)
        world = self.num_nodes * self.num_processes
        return resolve_layout(
            self.preset, self.options.sizes, self.parallel_config, world_size=world, num_nodes=self.num_nodes,
            model=self.lightning_module, planner=lambda: self._planned_dims(world),
        )

    def _planned_dims(self, world: int) -> ParallelDims:
        """``auto_nd``: ask the planner for this world, device and model; it logs its table and choice."""
        from meshkit.plugins.dims import auto_nd_dims

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
        env = self.cluster_environment
        try:
            check_launch(self.num_processes, self.num_nodes, os.environ if external else {}, initialized)
            dims = self._resolve()
        except ValueError as exc:  # every rank raises it alike: one traceback per machine, one line from the others
            report_once(exc, job=f"{env.main_address}:{env.main_port}")
            raise
        if type(env) is LightningEnvironment and env.local_rank() > 0:  # started by Lightning's launcher (rank 0)
            exit_with_parent(env.global_rank())
        rendezvous(self._setup_distributed, address=env.main_address, port=env.main_port,
                   rank=self.node_rank * self.num_processes + self.local_rank, devices=self.num_processes,
                   num_nodes=self.num_nodes, timeout=self._timeout, initialized=initialized is not None)
        if self.world_size > 1:  # after a timeout: whose process stopped (timeout_note)
            heartbeat(env.main_address, env.main_port, self.global_rank)
        dims.build_mesh(self.root_device.type, timeout=self._timeout)  # every sub-group gets `timeout=`
        self._parallel_dims = dims
        self._device_mesh = dims.mesh
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = dims.mesh
        rank_zero_info(f"meshkit: {self.preset.name} layout {dims} on {self.num_nodes} node(s)")

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
        self._check_gradient_sync()
        self._check_cp_applied()
        materialize(self.model, self.root_device)  # empty_init: the model's own init, or a clear error
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._patch_gradient_clipping()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            self._check_optimizers()
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _check_gradient_sync(self) -> None:
        """Every trainable parameter's gradient is reduced over the ranks that see different data (dp, and cp),
        or a clear error on every rank."""
        dims = self.parallel_dims
        if dims.dp_size * dims.cp == 1:
            return
        # the ranks that see different data: dp, and with cp each rank's share of the sequence (batch_to_device)
        sync = "dp_cp" if dims.cp_enabled else "dp"
        dp_ranks = set(torch.distributed.get_process_group_ranks(dims.submesh(sync).get_group()))
        stages = self._pipeline.views if self._pipeline.active else ()  # pp: sharded outside the module's tree
        for root in (self.model, *stages):  # after validate's forward a root holds gathered tp-only parameters
            _fsdp.reshard(root)
        unsynced = _fsdp.unsynced_parameters(self.model, dp_ranks, stages)
        if unsynced and self._pipeline.active:  # every rank of a stage holds the same modules: the same verdict
            raise ValueError(
                f"NDParallelStrategy: with `pp={dims.pp}` meshkit splits `{self._pipeline.model_attr}` into pipeline "
                f"stages and shards each stage over the data-parallel ranks (`dp_replicate*dp_shard={dims.dp_size}`); "
                f"{len(unsynced)} trainable parameter(s) lie outside it: {unsynced[:3]}. Nothing reduces their "
                "gradients over the dp ranks, so each rank's copy would drift apart. Move them into "
                f"`{self._pipeline.model_attr}` (a stage then holds them), or freeze them with `requires_grad_(False)`."
            )
        if unsynced:  # the same module on every rank: the same verdict, no collective needed
            where = "`configure_model`" if is_overridden("configure_model", self.lightning_module) else "the model"
            shard = "dp_shard_cp" if dims.cp_enabled else "dp_shard"
            mesh = f'`self.device_mesh["{shard}"]`' if dims.dp_replicate == 1 else (
                f'`self.device_mesh["dp_replicate", "{shard}"]`')
            ranks = (f"data- and context-parallel ranks (`dp_replicate*dp_shard*cp={dims.dp_size * dims.cp}`: each cp "
                     "rank trains on its own share of the sequence)") if dims.cp_enabled else (
                f"data-parallel ranks (`dp_replicate*dp_shard={dims.dp_size}`)")
            raise ValueError(
                f"NDParallelStrategy: {where} left {len(unsynced)} trainable parameter(s) without gradient sync over "
                f"the {ranks}: {unsynced[:3]}. Each of those ranks "
                f"would train its own copy and the copies drift apart. In `configure_model`, `fully_shard` each "
                f"block and then the root over {mesh}, or remove `configure_model` and let meshkit parallelize "
                "the model."
            )

    def _check_cp_applied(self) -> None:
        """With cp > 1 the strategy cuts every batch over the cp ranks: the model's attention must be meshkit's
        context-parallel attention (with the same layout), or each rank would attend within its own share of every
        sequence and train silently wrong. meshkit applies it when it parallelizes the model; a ``configure_model``
        must. The same module on every rank: the same verdict, no collective."""
        dims, layout = self.parallel_dims, self.parallel_config.cp_layout
        if not dims.cp_enabled:
            return
        stages = self._pipeline.views if self._pipeline.active else ()
        record = next(filter(None, map(_cp.cp_applied, (self.model, *stages))), None)
        applied = record.layout if record is not None else None
        if applied == layout:
            self._cp_applied = record  # what every batch's cut reads (batch_to_device): resolved here, once
            return
        where = "`configure_model`" if is_overridden("configure_model", self.lightning_module) else "the model"
        found = "applies no context-parallel attention" if applied is None else f"applies it with `layout={applied!r}`"
        raise ValueError(
            f"NDParallelStrategy: with `cp={dims.cp}` meshkit gives each rank `1/{dims.cp}` of every sequence "
            f"(`cp_layout={layout!r}`), but {where} {found}: each rank's attention would see only its own tokens "
            "and the model would train on something else than the one-process model, without an error. In "
            "`configure_model`, call `meshkit.apply_context_parallel(self.model, self.device_mesh[\"cp\"], "
            f"layout={layout!r})` before sharding, or remove `configure_model` and let meshkit parallelize the model."
        )

    def _check_optimizers(self) -> None:
        """An optimizer built before sharding holds the replaced parameters: it would train nothing."""
        stale = _fsdp.stale_optimizer_parameters(self.model, self.optimizers)
        if stale:
            i, kind, n, total = stale[0]
            raise ValueError(
                f"NDParallelStrategy: optimizer {i} ({kind}) holds {n} of its {total} parameter(s) that are not the "
                "model's any more: meshkit sharded the model after the optimizer was created, replacing every "
                "parameter, so it would step tensors the model no longer uses and train nothing. Create the "
                "optimizer in `configure_optimizers` from `self.parameters()` (Lightning calls it after sharding), "
                "not in `__init__`."
            )

    def parallelize(self, module: nn.Module) -> nn.Module:
        """The automatic path on ``module`` (in place): :func:`~meshkit.plugins.parallelize.parallelize`."""
        dims, config = self.parallel_dims, self.parallel_config
        if dims.pp_enabled:  # split into stages first, then the same order per stage
            return self._pipeline.parallelize(module, dims, config, self.root_device)
        return parallelize(module, dims, config)

    # ---- steps --------------------------------------------------------------------------------
    def _loss_context(self) -> contextlib.AbstractContextManager:
        return loss_context(self.parallel_dims, self.parallel_config)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._check_step_batch(args[0] if args else None)
        if self._pipeline.active:  # the schedule runs forward and backward of every micro-batch
            return self._pipeline.training_step(self.lightning_module, args[0])
        with self._loss_context():
            output = super().training_step(*args, **kwargs)
            # cp: the dp × cp mean (and a warning, once, if the loss was a per-rank mean); else unchanged
            return _cp.step_loss(output, args[0] if args else None, self._parallel_dims)

    def _check_step_batch(self, batch: Any) -> None:
        """The first training batch against a declared ``global_batch_size`` (each rank sees the same sizes)."""
        declared = self.parallel_config.global_batch_size
        if declared is None or getattr(self, "_batch_checked", False):
            return
        self._batch_checked = True
        per_rank = _batch_size(batch)
        if per_rank is not None:
            accumulate = int(getattr(self.lightning_module.trainer, "accumulate_grad_batches", 1) or 1)
            self.parallel_dims.check_step_batch(declared, per_rank, accumulate)

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
        """With cp > 1 each rank keeps its part of every sequence: ``{"input_ids", "labels", "positions", ...}``.
        A padding mask is refused on the host, before the transfer (no device sync)."""
        applied = self._cp_applied
        if applied is not None:
            _cp.check_cp_mask(batch, self._parallel_dims.cp)
        batch = super().batch_to_device(batch, device, dataloader_idx)
        return _cp.step_batch(batch, self._parallel_dims, self.parallel_config.cp_layout, applied, mask=False)

    @override
    def on_exception(self, exception: BaseException) -> None:
        """A collective that timed out gets a note naming the collective, the group and its ranks."""
        built = self._parallel_dims is not None and self._parallel_dims._mesh is not None  # else: the rendezvous
        if built and is_timeout(exception) and hasattr(exception, "add_note"):
            env = self.cluster_environment
            stopped = stopped_ranks(env.main_address, env.main_port, self.world_size)
            children = getattr(self.launcher, "procs", None) or []  # Lightning's launcher: ranks it started here
            ended = end_stopped_children(children, stopped, self.global_rank + 1) if children else []
            exception.add_note(timeout_note(exception, self._parallel_dims, self._timeout, self.global_rank, stopped,
                                            ended))
        super().on_exception(exception)

    # ---- checkpoints: the states gathered here, the files written by meshkit.plugins.checkpoint --------------
    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None
    ) -> None:
        """Atomic and hashed: a crash mid-save leaves the previous one (see :mod:`meshkit.plugins.checkpoint`)."""
        if storage_options is not None:
            raise TypeError(
                f"`{type(self).__name__}.save_checkpoint(..., storage_options=...)` is not supported: "
                "meshkit writes checkpoints itself, not through a CheckpointIO plugin."
            )
        module = self.lightning_module
        rest = {k: v for k, v in checkpoint.items() if k not in (MODEL, OPTIMIZERS)}
        _ckpt.save_checkpoint(
            self.broadcast(filepath), checkpoint[MODEL], checkpoint.get(OPTIMIZERS), rest,
            tied=_ckpt.tied_aliases(module) if module is not None else None,
            sharded=self._save_distributed_checkpoint, rank=self.global_rank, barrier=self.barrier,
        )

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        dims = self._parallel_dims  # pipeline stages hold different keys: the pp group gathers them
        pp_group = dims.submesh("pp").get_group() if dims is not None and dims.pp_enabled else None
        return _ckpt.load_checkpoint(
            self.broadcast(checkpoint_path), self.model, self.optimizers, weights_only=weights_only,
            strict=self.lightning_module.strict_loading, rank=self.global_rank, world_size=self.world_size,
            barrier=self.barrier, pp_group=pp_group, allow_unverified=self.options.allow_unverified,
        )

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        if self._save_distributed_checkpoint:  # FQN-keyed: pipeline stages' states never collide
            return _ckpt.flat_optimizer_state(self.model, optimizer)
        return super().optimizer_state(optimizer)


NDParallelStrategy.__init__.__signature__ = front_door_signature(NDParallelStrategy)  # type: ignore[attr-defined]


def _batch_size(batch: Any) -> Optional[int]:
    """The leading dim of a batch's first tensor (``input_ids`` first in a dict), or None."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else None
    if isinstance(batch, dict):
        values = [batch["input_ids"]] if "input_ids" in batch else list(batch.values())
    elif isinstance(batch, (list, tuple)):
        values = list(batch)
    else:
        return None
    return next((n for n in map(_batch_size, values) if n is not None), None)


def _is_parallelized(module: nn.Module) -> bool:
    return bool(getattr(module, "_meshkit_parallelized", False))


def register_presets(registry: Any = None) -> None:
    """Register every preset name with Lightning's StrategyRegistry (done on ``import meshkit``)."""
    from lightning.pytorch.strategies import StrategyRegistry

    register_names(registry if registry is not None else StrategyRegistry, NDParallelStrategy, "strategy")

