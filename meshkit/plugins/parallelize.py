"""``parallelize(module, dims, config)``: the automatic path, in torchtitan's order, in one place.

The strategy calls it on the LightningModule when there is no ``configure_model``; under pp the
pipeline hooks call it with a ``split`` hook, so every stage runs the same order on its own blocks.
:class:`ParallelConfig` holds every setting the order reads.

Example (after ``torch.distributed`` is initialised on 4 gloo ranks)::

    >>> from meshkit.models import LlamaConfig, Transformer
    >>> from meshkit.plugins import ParallelDims
    >>> from meshkit.plugins.parallelize import ParallelConfig, parallelize
    >>> dims = ParallelDims(dp_shard=2, tp=2, world_size=4)
    >>> dims.build_mesh("cpu")  # doctest: +SKIP
    >>> parallelize(Transformer(LlamaConfig.tiny()), dims, ParallelConfig(activation_checkpointing="full"))  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Optional

from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from meshkit.plugins import context_parallel as _cp
from meshkit.plugins.activation_checkpoint import ACMode, apply_ac, check_ac_mode
from meshkit.plugins.dims import ParallelDims
from meshkit.plugins.fsdp import apply_fsdp, apply_fsdp_stages, find_blocks, mixed_precision_policy
from meshkit.plugins.tensor_parallel import (
    PlanEntry,
    apply_tp,
    check_tp_forward,
    infer_tp_plan,
    quiet_local_logits_warning,
)

__all__ = ["ParallelConfig", "parallelize", "apply_compile", "loss_context", "Split"]

Split = Callable[[nn.Module], tuple[nn.Module, Callable[[], list[nn.Module]]]]
"""Pipeline hook: ``split(module) -> (rank_module, views)``. ``rank_module`` (this rank's blocks) is what
TP, AC and compile go over; ``views()``, called just before FSDP, returns the stage views to shard."""


@dataclass
class ParallelConfig:
    """Every setting of the automatic path besides the degrees (those are :class:`ParallelDims`)."""

    tp_plan: Optional[dict[str, PlanEntry]] = None
    """Extra or overriding TP rules, ``{fnmatch pattern: "colwise" | "rowwise" | "replicate" | style}``.
    None: the automatic plan only."""
    sequence_parallel: bool = False
    """Shard norms and the residual stream on the sequence dim between the TP blocks (tp > 1): meshkit's,
    torchtitan-style and transformers causal LMs (the sequence length must divide by tp)."""
    loss_parallel: bool = False
    """Keep logits vocab-sharded; the loss and its backward run under :func:`loss_context` (the Trainer's strategy
    enters it around ``training_step`` and ``backward``; a Fabric loop around its loss and ``fabric.backward``)."""
    activation_checkpointing: ACMode = "none"
    """``"none"``, ``"full"`` (recompute each block) or ``"selective"`` (keep matmul / attention outputs)."""
    compile: bool = False
    """``torch.compile`` each block (after activation checkpointing, before FSDP)."""
    reshard_after_forward: bool = True
    """FSDP2 frees gathered block parameters after forward (ZeRO-3); False keeps them (ZeRO-2).
    Pipeline stages always keep them (a stage runs forward several times before backward)."""
    fused_kernels: bool = False
    """Swap in meshkit's Triton RMSNorm, SwiGLU, RoPE and fused linear cross-entropy first."""
    cp_attention: str = "ring"
    """Context-parallel attention when cp > 1: ``"ring"``, ``"allgather"`` or ``"ulysses"``."""
    cp_layout: str = "load_balanced"
    """How sequences are cut over cp: ``"load_balanced"`` (chunks r and 2cp-1-r) or ``"contiguous"``."""
    precision: str = "32-true"
    """Lightning precision string; sets FSDP2's mixed-precision policy (``"bf16-mixed"``: bf16 compute,
    fp32 gradient reduction and master weights; ``"32-true"`` / ``"bf16-true"``: none)."""
    global_batch_size: Optional[int] = None
    """If given, checked (before the process group) to be divisible by the data-parallel size. None: no check."""

    def __post_init__(self) -> None:
        check_ac_mode(self.activation_checkpointing)
        if self.cp_attention not in _cp.CP_ATTENTIONS or self.cp_layout not in _cp.CP_LAYOUTS:
            raise ValueError(
                f"NDParallelStrategy: `cp_attention={self.cp_attention!r}` must be one of {_cp.CP_ATTENTIONS} and "
                f"`cp_layout={self.cp_layout!r}` one of {_cp.CP_LAYOUTS}."
            )

    @property
    def mp_policy(self) -> MixedPrecisionPolicy | None:
        """FSDP2's policy for :attr:`precision` (raises for an unsupported one)."""
        return mixed_precision_policy(self.precision)


def loss_context(dims: ParallelDims, config: ParallelConfig) -> contextlib.AbstractContextManager:
    """``torch.distributed.tensor.parallel.loss_parallel()`` when ``config.loss_parallel`` and tp > 1 (the logits
    are then vocab-sharded DTensors, and cross-entropy must run under it), else a context that does nothing."""
    if config.loss_parallel and dims.tp_enabled:
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()
    return contextlib.nullcontext()


def parallelize(
    module: nn.Module, dims: ParallelDims, config: ParallelConfig | None = None, *, split: Split | None = None
) -> nn.Module:
    """Parallelize ``module`` in place over ``dims.mesh`` (built) and return it.

    ``split`` (pipeline stages, pp > 1) cuts this rank's blocks out after the fused kernels; see
    :data:`Split`. Stages are always sharded (a size-1 dp mesh included: DCP needs DTensors).

    Example::

        >>> parallelize(model, dims, ParallelConfig(compile=True))  # doctest: +SKIP
    """
    config = config if config is not None else ParallelConfig()
    # 0. The TP plan's blocks, run in this process on each rank's share: refused here, before any collective,
    #    if one does not compute what the whole model does (on the unsplit, unpatched model: one forward).
    if dims.tp_enabled:
        check_tp_forward(
            module, dims.tp, user_plan=config.tp_plan, sequence_parallel=config.sequence_parallel,
            loss_parallel=config.loss_parallel,
        )
    # 1. Fused kernels, on the plain model: the patched forwards then work on DTensor weights.
    if config.fused_kernels:
        from meshkit.integrations import apply_fused_kernels

        apply_fused_kernels(module)
    # 2. Pipeline split: everything below runs on this rank's stages only.
    target, views = split(module) if split is not None else (module, None)
    # 3. Tensor parallel plan.
    if dims.tp_enabled:
        plan = infer_tp_plan(
            target,
            user_plan=config.tp_plan,
            sequence_parallel=config.sequence_parallel,
            loss_parallel=config.loss_parallel,
            prefix=_prefix_of(module, target),  # the user's tp_plan names modules from `module`, at any pp
        )
        apply_tp(target, dims.mesh["tp"], plan)
        quiet_local_logits_warning(target, plan)  # FSDP2 warns of the logits view: harmless, see there
    # 4. Context parallel: after TP (attention sees its local heads), before AC (recomputation is routed too).
    if dims.cp_enabled:
        _cp.apply_context_parallel(target, dims.submesh("cp"), attention=config.cp_attention, layout=config.cp_layout)
    # 5. Activation checkpointing, then 6. per-block compile: after AC wrapping and before FSDP.
    blocks = find_blocks(target)
    apply_ac(blocks, config.activation_checkpointing)
    if config.compile:
        apply_compile(blocks)
    # 7. fully_shard per block, then the root(s).
    if views is not None:
        apply_fsdp_stages(views(), dims.fsdp_mesh(), mp_policy=config.mp_policy)
    elif dims.fsdp_enabled:
        apply_fsdp(
            target, blocks, dims.fsdp_mesh(), mp_policy=config.mp_policy,
            reshard_after_forward=config.reshard_after_forward,
        )
    return module


def _prefix_of(module: nn.Module, target: nn.Module) -> str:
    """``target``'s FQN inside ``module`` plus a dot ("" when it is ``module``)."""
    if target is module:
        return ""
    return next(f"{name}." for name, m in module.named_modules() if m is target)


def apply_compile(blocks: list[tuple[str, nn.Module]]) -> None:
    """``torch.compile`` each block in place (``nn.Module.compile`` keeps parameter names)."""
    for _, block in blocks:
        block.compile()
