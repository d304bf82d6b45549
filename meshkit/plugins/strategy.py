"""NDParallelStrategy: one Lightning strategy for HSDP × TP (× PP × CP), configured by ParallelDims.

``import meshkit`` registers the presets, so an unmodified LightningModule trains with::

    trainer = L.Trainer(strategy="hsdp_tp", accelerator="cpu", devices=4)

or with explicit sizes::

    trainer = L.Trainer(strategy=meshkit.NDParallelStrategy(dp_replicate=2, dp_shard=2, tp=2), devices=8)

Without a ``configure_model`` in the LightningModule the strategy parallelizes it itself (automatic
path, torchtitan's order): TP plan -> activation checkpointing -> per-block compile -> ``fully_shard``
per block and root -> materialize meta parameters -> optimizers. With a ``configure_model`` it calls
that instead; the module sees ``self.device_mesh`` (axes ``dp_replicate dp_shard pp cp tp``).
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Generator, Literal, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies.model_parallel import _is_sharded_checkpoint
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from typing_extensions import override

from meshkit.plugins import context_parallel as _cp
from meshkit.plugins import fsdp as _fsdp
from meshkit.plugins.pipeline.lightning import PipelineHooks, flat_optimizer_state, load_sharded_checkpoint
from meshkit.plugins.dims import ParallelDims, auto_tp
from meshkit.plugins.tensor_parallel import PlanEntry, apply_tp, infer_tp_plan, model_shape

__all__ = ["NDParallelStrategy", "Preset", "PRESETS", "register_presets", "resolve_dims"]

log = logging.getLogger(__name__)

Size = Union[int, Literal["auto"]]


@dataclass(frozen=True)
class Preset:
    """A named layout: which axes "auto" turns on. Explicit sizes always win."""

    name: str
    description: str
    replicate: bool = False
    """dp_replicate = num_nodes (HSDP across nodes)."""
    tp: bool = False
    """tp = the largest size within a node that divides the model's heads, kv heads and hidden size."""
    cp: bool = False
    """cp = the node's devices (2 when tp is also on): sequences split over cp ranks inside a node."""
    planner: bool = False
    """Sizes come from meshkit's layout planner (memory, bandwidth and bubble math) for this world."""
    pp: bool = False
    """pp = 2 pipeline stages (pass ``pp=`` for more); see meshkit.plugins.pipeline."""


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("fsdp2", "FSDP2: every parameter sharded over all ranks"),
        Preset("hsdp", "HSDP: sharded within a node, replicated across nodes", replicate=True),
        Preset("tp", "Tensor parallel within a node (FSDP2 over whatever is left)", tp=True),
        Preset("hsdp_tp", "Tensor parallel within a node, HSDP over the rest", replicate=True, tp=True),
        Preset("cp", "Context parallel: sequences split over a node's ranks (FSDP2 over dp_shard × cp)", cp=True),
        Preset("hsdp_cp", "Context parallel within a node, HSDP across nodes", replicate=True, cp=True),
        Preset(
            "hsdp_tp_cp", "Tensor × context parallel within a node, HSDP across nodes", replicate=True, tp=True, cp=True
        ),
        Preset("auto_nd", "Layout chosen by meshkit's planner from memory, bandwidth and bubble math", planner=True),
        # Pipeline presets (meshkit.plugins._pp_lightning): pp "auto" = 2 stages.
        Preset("pp", "Pipeline parallel (2 stages unless pp= is given), FSDP2 over the rest", pp=True),
        Preset("tp_pp", "Tensor parallel within a node inside each pipeline stage", tp=True, pp=True),
        Preset("hsdp_pp", "Pipeline stages, HSDP over each stage's replicas", replicate=True, pp=True),
        Preset("hsdp_tp_pp", "Tensor parallel inside each pipeline stage, HSDP over the rest",
               replicate=True, tp=True, pp=True),
    )
}


def resolve_dims(
    preset: Preset,
    sizes: dict[str, Size],
    *,
    world_size: int,
    num_nodes: int,
    model: nn.Module | None = None,
) -> ParallelDims:
    """Turn "auto" sizes into numbers (rules in :class:`Preset`), validate, and return ParallelDims.

    >>> resolve_dims(PRESETS["hsdp_tp"], dict.fromkeys(("dp_replicate", "dp_shard", "pp", "cp", "tp"), "auto"),
    ...              world_size=8, num_nodes=2).degrees
    {'dp_replicate': 2, 'dp_shard': 2, 'pp': 1, 'cp': 1, 'tp': 2}
    """
    for axis, value in sizes.items():
        if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            if not (axis == "dp_shard" and value == -1):
                raise ValueError(f"NDParallelStrategy: `{axis}={value!r}` must be a positive int or 'auto'.")
    if world_size % num_nodes:
        raise ValueError(
            f"NDParallelStrategy: world size {world_size} is not divisible by `num_nodes={num_nodes}`; "
            "every node must run the same number of processes."
        )
    per_node = world_size // num_nodes
    heads, kv_heads, hidden = model_shape(model) if model is not None else (None, None, None)
    out: dict[str, int] = {}
    out["pp"] = (2 if preset.pp else 1) if sizes["pp"] == "auto" else int(sizes["pp"])
    if sizes["cp"] == "auto":
        out["cp"] = _auto_cp(preset, per_node // out["pp"] if per_node % out["pp"] == 0 else 1)
    else:
        out["cp"] = int(sizes["cp"])
    if sizes["dp_replicate"] == "auto":
        out["dp_replicate"] = num_nodes if preset.replicate else 1
    else:
        out["dp_replicate"] = int(sizes["dp_replicate"])
    if sizes["tp"] == "auto" and sizes["dp_shard"] not in ("auto", -1):
        # Every data axis was given: tp takes what is left of the world.
        rest = out["dp_replicate"] * int(sizes["dp_shard"]) * out["pp"] * out["cp"]
        out["tp"] = world_size // rest if rest and world_size % rest == 0 else 1
    elif sizes["tp"] == "auto":
        if preset.tp:
            room = per_node // max(1, out["pp"] * out["cp"]) if per_node % max(1, out["pp"] * out["cp"]) == 0 else 1
            # Keep at least 2-way sharding inside a node when the preset also shards data there.
            cap = room // 2 if preset.replicate and room >= 4 else room
            out["tp"] = auto_tp(room, heads, kv_heads, hidden, cap=max(1, cap))
        else:
            out["tp"] = 1
    else:
        out["tp"] = int(sizes["tp"])
    out["dp_shard"] = -1 if sizes["dp_shard"] == "auto" else int(sizes["dp_shard"])
    dims = ParallelDims(world_size=world_size, **out)
    dims.check_model_shape(heads, kv_heads, hidden)
    if dims.tp > per_node:
        rank_zero_warn(
            f"NDParallelStrategy: `tp={dims.tp}` is larger than the {per_node} devices of a node, so tensor-parallel "
            "traffic crosses the slow inter-node link. Use tp <= devices per node and put pp or dp across nodes."
        )
    return dims


def _auto_cp(preset: Preset, room: int) -> int:
    """Context parallel size for "auto": the node's ``room`` devices, or 2 of them when TP shares the node."""
    if not preset.cp:
        return 1
    if preset.tp:
        return 2 if room % 2 == 0 and room > 1 else 1
    return room


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
            (:func:`meshkit.kernels.apply_fused_kernels`) before parallelizing.
        pp_schedule, pp_microbatches, pp_virtual_stages, pp_split_points, pp_timeline_dir: pipeline options
            (pp > 1), see :mod:`meshkit.plugins.pipeline` and :mod:`meshkit.plugins._pp_lightning`.

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
        activation_checkpointing: _fsdp.ACMode = "none",
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
        if activation_checkpointing not in ("none", "full", "selective"):
            raise ValueError(
                f"NDParallelStrategy: `activation_checkpointing={activation_checkpointing!r}` must be "
                "'none', 'full' or 'selective'."
            )
        if cp_attention not in _cp.CP_ATTENTIONS or cp_layout not in _cp.CP_LAYOUTS:
            raise ValueError(
                f"NDParallelStrategy: `cp_attention={cp_attention!r}` must be one of {_cp.CP_ATTENTIONS} and "
                f"`cp_layout={cp_layout!r}` one of {_cp.CP_LAYOUTS}."
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
        self._tp_plan = tp_plan
        self._sequence_parallel = sequence_parallel
        self._loss_parallel = loss_parallel
        self._ac = activation_checkpointing
        self._compile = compile
        self._reshard_after_forward = reshard_after_forward
        self._global_batch_size = global_batch_size
        self._parallel_dims: Optional[ParallelDims] = None
        self._cp_attention, self._cp_layout = cp_attention, cp_layout
        self._fused_kernels = fused_kernels
        # Pipeline parallelism: inactive unless pp > 1 (meshkit.plugins._pp_lightning).
        self._pipeline = PipelineHooks(pp_schedule, pp_microbatches, pp_virtual_stages, pp_split_points, pp_timeline_dir)

    # ---- layout ---------------------------------------------------------------------------------
    @property
    def parallel_dims(self) -> ParallelDims:
        """The resolved degrees and the mesh (available from ``setup_environment`` on)."""
        if self._parallel_dims is None:
            raise RuntimeError("NDParallelStrategy.parallel_dims is resolved in `setup_environment`; not yet.")
        return self._parallel_dims

    def _resolve(self) -> ParallelDims:
        """Every check that needs no collective: runs on every rank before the process group exists."""
        precision = getattr(self.precision_plugin, "precision", "32-true")
        _fsdp.mixed_precision_policy(precision)  # raises for unsupported precision
        world = self.num_nodes * self.num_processes
        if self.preset.planner and all(v == "auto" for v in self._sizes.values()):
            dims = self._planned_dims(world)
        else:
            dims = resolve_dims(
                self.preset, self._sizes, world_size=world, num_nodes=self.num_nodes, model=self.lightning_module
            )
        if self._global_batch_size is not None:
            dims.check_batch(self._global_batch_size)
        self._check_cp(dims)
        return dims

    def _planned_dims(self, world: int) -> ParallelDims:
        """``auto_nd``: ask the planner for this world, device and model; it logs its table and choice."""
        from meshkit.plugins.planner import auto_nd_dims

        dev = self.root_device
        return auto_nd_dims(
            self.lightning_module, world_size=world, num_nodes=self.num_nodes,
            device="cpu" if dev.type == "cpu" else torch.cuda.get_device_name(dev),
            memory_gb=None if dev.type == "cpu" else torch.cuda.get_device_properties(dev).total_memory / 2**30,
            global_batch=self._global_batch_size, reshard_after_forward=self._reshard_after_forward,
            sequence_parallel=self._sequence_parallel, activation_checkpointing=self._ac, log=rank_zero_info,
        )

    @override
    def setup_environment(self) -> None:
        dims = self._resolve()
        self._setup_distributed()
        dims.build_mesh(self.root_device.type)
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
        """The automatic path on ``module`` (in place): fused kernels -> TP -> CP -> AC -> compile -> FSDP2."""
        dims = self.parallel_dims
        if self._fused_kernels:  # on the plain model: the patched forwards then work on DTensor weights
            from meshkit.kernels import apply_fused_kernels

            apply_fused_kernels(module)
        if dims.pp_enabled:  # split into stages first, then TP / AC / FSDP per stage
            return self._pipeline.parallelize(self, module)
        if dims.tp_enabled:
            plan = infer_tp_plan(
                module,
                user_plan=self._tp_plan,
                sequence_parallel=self._sequence_parallel,
                loss_parallel=self._loss_parallel,
            )
            apply_tp(module, dims.mesh["tp"], plan)
        if dims.cp_enabled:  # after TP (attention sees its local heads), before AC (recomputation is routed too)
            _cp.apply_context_parallel(
                module, dims.submesh("cp"), attention=self._cp_attention, layout=self._cp_layout
            )
        blocks = _fsdp.find_blocks(module)
        _fsdp.apply_ac(blocks, self._ac)
        if self._compile:
            _fsdp.apply_compile(blocks)
        if dims.fsdp_enabled:
            mp = _fsdp.mixed_precision_policy(getattr(self.precision_plugin, "precision", "32-true"))
            _fsdp.apply_fsdp(
                module, blocks, dims.fsdp_mesh(), mp_policy=mp, reshard_after_forward=self._reshard_after_forward
            )
        return module

    # ---- steps --------------------------------------------------------------------------------
    def _loss_context(self) -> contextlib.AbstractContextManager:
        if self._loss_parallel and self.parallel_dims.tp_enabled:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline.active:  # the schedule runs forward and backward of every micro-batch
            return self._pipeline.training_step(self.lightning_module, args[0])
        with self._loss_context():
            return self._cp_loss(super().training_step(*args, **kwargs))

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
    def _check_cp(self, dims: ParallelDims) -> None:
        """Ulysses needs each TP rank's heads divisible by cp; raised on every rank before any collective."""
        if not dims.cp_enabled or self._cp_attention != "ulysses" or self.lightning_module is None:
            return
        heads, kv_heads, _ = model_shape(self.lightning_module)
        if heads is None:
            return
        local, local_kv = heads // dims.tp, max(1, (kv_heads or heads) // dims.tp)
        if local % dims.cp or (local_kv % dims.cp and dims.cp % local_kv):
            raise ValueError(
                f"NDParallelStrategy: `cp_attention='ulysses'` with `cp={dims.cp}` and `tp={dims.tp}` needs the "
                f"heads per TP rank ({local}) divisible by cp and the kv heads per TP rank ({local_kv}) a multiple "
                "or divisor of cp. Use cp_attention='ring' or 'allgather', or a smaller cp."
            )

    @override
    def batch_to_device(self, batch: Any, device: Optional[torch.device] = None, dataloader_idx: int = 0) -> Any:
        """With cp > 1 each rank keeps its part of every sequence: ``{"input_ids", "labels", "positions", ...}``."""
        batch = super().batch_to_device(batch, device, dataloader_idx)
        if self._parallel_dims is not None and self._parallel_dims.cp_enabled:
            batch = _cp.shard_batch(batch, self._parallel_dims.submesh("cp"), layout=self._cp_layout)
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

    # ---- checkpoints --------------------------------------------------------------------------
    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        # Never unpickle arbitrary objects from a checkpoint's metadata.
        weights_only = True if weights_only is None else weights_only
        if self._save_distributed_checkpoint and _is_sharded_checkpoint(Path(self.broadcast(checkpoint_path))):
            # optimizer states keyed by parameter FQN: loads at any pp / layout (meshkit.plugins._pp_lightning)
            return load_sharded_checkpoint(self, checkpoint_path, weights_only)
        return super().load_checkpoint(checkpoint_path, weights_only=weights_only)

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        if self._save_distributed_checkpoint:  # FQN-keyed, so pipeline stages' states do not collide
            return flat_optimizer_state(self.model, optimizer)
        return super().optimizer_state(optimizer)


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

