"""The fused LM loss from final hidden states and a model's (or a head's) LM head weight."""

from __future__ import annotations

import torch
from torch import nn

from meshkit.kernels import fused_linear_cross_entropy

__all__ = ["fused_lm_loss"]


def fused_lm_loss(
    model_or_head: nn.Module,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """Cross-entropy of the LM head applied to ``hidden`` (B, T, H) against ``labels`` (B, T), fused.

    ``model_or_head`` is the head (an ``nn.Linear``) or a model holding it as ``output`` (torchtitan,
    meshkit) or ``lm_head`` (HF). ``labels`` are aligned with ``hidden`` (shift them before calling).
    Under tensor parallelism with the head column-sharded (vocab split) the loss is vocab-parallel; pass
    sequence-parallel hidden states as a DTensor. Equals ``F.cross_entropy(head(hidden).flatten(0, 1),
    labels.flatten())`` without the logits.

    Example::

        >>> import torch
        >>> from meshkit.integrations import fused_lm_loss
        >>> head = torch.nn.Linear(8, 32, bias=False)
        >>> fused_lm_loss(head, torch.randn(2, 5, 8), torch.randint(0, 32, (2, 5))).shape
        torch.Size([])
    """
    head = _find_head(model_or_head)
    return fused_linear_cross_entropy(hidden, head.weight, labels, ignore_index=ignore_index, reduction=reduction)


def _find_head(m: nn.Module) -> nn.Module:
    if isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.dim() == 2:
        if getattr(m, "bias", None) is not None:
            raise ValueError(f"fused_lm_loss: the head `{type(m).__name__}` has a bias; only bias-free heads are fused.")
        return m
    for name in ("output", "lm_head"):
        if isinstance(getattr(m, name, None), nn.Module):
            return _find_head(getattr(m, name))
    raise ValueError(
        f"fused_lm_loss: `model_or_head` ({type(m).__name__}) is neither a bias-free Linear head nor a model with an "
        "`output` or `lm_head` head; pass the head module."
    )
