"""The dispatcher: find each module's family patch, install it once, count what was patched.

Families are tried in order: meshkit's demo model (:mod:`.meshkit_llama`), the generic torch /
torchtitan modules (:mod:`.common`), HF transformers (:mod:`.hf`). Modules are matched by class and
patched per instance, so module FQNs, parameter names, state dicts and TP/FSDP plans are unaffected,
and the patched modules accept DTensor weights.
"""

from __future__ import annotations

from torch import nn

from . import common, hf, meshkit_llama
from .common import MARK, Patch

__all__ = ["apply_fused_kernels", "uses_fused_loss"]

_FAMILIES = (meshkit_llama.match, common.match, hf.match)


def _match(m: nn.Module) -> tuple[str, Patch] | None:
    for match in _FAMILIES:
        found = match(m)
        if found is not None:
            return found
    return None


def uses_fused_loss(model: nn.Module) -> bool:
    """True when ``model`` (or its ``model`` attribute, e.g. a LightningModule's) has the fused-loss patch,
    i.e. its root forward accepts ``labels=`` and then returns the loss instead of the logits.

    Example::

        >>> from meshkit.models import LlamaConfig, Transformer
        >>> from meshkit.integrations import apply_fused_kernels, uses_fused_loss
        >>> m = Transformer(LlamaConfig.tiny())
        >>> uses_fused_loss(m), uses_fused_loss(apply_fused_kernels(m) and m)
        (False, True)
    """
    inner = getattr(model, "model", None)
    return getattr(model, MARK, None) == "loss" or (isinstance(inner, nn.Module) and getattr(inner, MARK, None) == "loss")


def apply_fused_kernels(
    model: nn.Module, *, rms_norm: bool = True, swiglu: bool = True, rope: bool = True, loss: bool = True
) -> dict[str, int]:
    """Patch the supported modules of ``model`` in place; return how many of each kind were patched.

    Call it on the plain model, before tensor parallelism, FSDP and ``torch.compile``; calling it twice is
    harmless. The keyword flags turn single kinds off. The loss patch changes nothing until the caller
    passes ``labels`` to the root forward (see :func:`fused_lm_loss` and docs/kernels.md).

    Example::

        >>> from meshkit.models import LlamaConfig, Transformer
        >>> from meshkit.integrations import apply_fused_kernels
        >>> apply_fused_kernels(Transformer(LlamaConfig.tiny()))
        {'rms_norm': 9, 'swiglu': 4, 'rope': 4, 'loss': 1}
    """
    enabled = {"rms_norm": rms_norm, "swiglu": swiglu, "rope": rope, "loss": loss}
    counts = {k: 0 for k in enabled}
    found = 0
    for m in model.modules():
        match = _match(m)
        if match is None:
            continue
        found += 1
        kind, patch = match
        if not enabled[kind] or getattr(m, MARK, None) is not None:
            continue
        patch(m)
        setattr(m, MARK, kind)
        counts[kind] += 1
    if not found:
        raise ValueError(
            f"apply_fused_kernels: `model` ({type(model).__name__}) has no supported module (meshkit/torchtitan "
            "RMSNorm, FeedForward, Attention, Transformer; torch.nn.RMSNorm; HF Llama/Mistral/Qwen2/Qwen3)."
        )
    return counts
