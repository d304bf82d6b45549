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
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Generator, Literal, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from typing_extensions import override

from meshkit.plugins import fsdp as _fsdp
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


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("fsdp2", "FSDP2: every parameter sharded over all ranks"),
        Preset("hsdp", "HSDP: sharded within a node, replicated across nodes", replicate=True),
        Preset("tp", "Tensor parallel within a node (FSDP2 over whatever is left)", tp=True),
        Preset("hsdp_tp", "Tensor parallel within a node, HSDP over the rest", replicate=True, tp=True),
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
    out["pp"] = 1 if sizes["pp"] == "auto" else int(sizes["pp"])
    out["cp"] = 1 if sizes["cp"] == "auto" else int(sizes["cp"])
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


class NDParallelStrategy(ModelParallelStrategy):
    """HSDP (FSDP2 over a replicate × shard mesh) × tensor parallel × (pipeline, context) for Lightning.

    Args:
        preset: a name from :data:`PRESETS` (``"fsdp2" "hsdp" "tp" "hsdp_tp"``): which axes ``"auto"`` turns on.
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
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
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
        dims = resolve_dims(
            self.preset, self._sizes, world_size=world, num_nodes=self.num_nodes, model=self.lightning_module
        )
        if self._global_batch_size is not None:
            dims.check_batch(self._global_batch_size)
        return dims

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
        """The automatic path on ``module`` (in place): TP -> AC -> compile -> FSDP2."""
        dims = self.parallel_dims
        if dims.tp_enabled:
            plan = infer_tp_plan(
                module,
                user_plan=self._tp_plan,
                sequence_parallel=self._sequence_parallel,
                loss_parallel=self._loss_parallel,
            )
            apply_tp(module, dims.mesh["tp"], plan)
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
        with self._loss_context():
            return super().training_step(*args, **kwargs)

    @override
    def backward(self, closure_loss: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        with self._loss_context():
            return super().backward(closure_loss, *args, **kwargs)

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
            _fsdp.clip_grad_norm_(params, float(clip_val))

        plugin.clip_grad_by_norm = clip_grad_by_norm  # type: ignore[method-assign]

    # ---- checkpoints --------------------------------------------------------------------------
    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        # Never unpickle arbitrary objects from a checkpoint's metadata.
        return super().load_checkpoint(checkpoint_path, weights_only=True if weights_only is None else weights_only)


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

