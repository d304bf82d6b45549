"""meshkit's demo model (:mod:`meshkit.models.llama`): RMSNorm, FeedForward, Attention.rotate, the root loss.

The root ``Transformer`` gains ``forward(tokens, positions=None, labels=None)``: with ``labels`` it runs
the model up to its final norm (:meth:`Transformer.final_hidden`, the same block loop) and returns the
fused loss instead of the logits, and its ``fused_loss`` marker becomes True (``LlamaLM`` reads it).
"""

from __future__ import annotations

import torch
from torch import nn

from meshkit.kernels.rope import half_cos_sin, rotate_with_cos_sin
from meshkit.loss import num_items
from meshkit.models.llama import Attention, FeedForward, RMSNorm, Transformer

from .common import Patch, bind_forward, feed_forward_forward, rmsnorm_forward
from .loss import fused_lm_loss


def _rotate(self: Attention, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """``Attention.rotate`` with the fused rope (installed as ``rotate``, not ``forward``)."""
    c, s = half_cos_sin(cos, sin, self.head_dim)
    return rotate_with_cos_sin(q, c, s), rotate_with_cos_sin(k, c, s)


def _root_forward(self: Transformer, tokens: torch.Tensor, positions: torch.Tensor | None = None, labels=None):
    """Transformer.forward; with ``labels`` (B, T) aligned to ``tokens`` it returns the fused loss."""
    if labels is None:
        return type(self).forward(self, tokens, positions)
    total = fused_lm_loss(self.output, self.final_hidden(tokens, positions), labels, reduction="sum")
    return total / num_items(labels).clamp_min(1.0)  # the token mean of the whole sequences, also under cp


def _patch_root(m: nn.Module) -> None:
    bind_forward(_root_forward)(m)
    m.fused_loss = True


_PATCHES: dict[type, tuple[str, Patch]] = {
    RMSNorm: ("rms_norm", bind_forward(rmsnorm_forward)),
    FeedForward: ("swiglu", bind_forward(feed_forward_forward)),
    Attention: ("rope", bind_forward(_rotate, "rotate")),
    Transformer: ("loss", _patch_root),
}


def match(m: nn.Module) -> tuple[str, Patch] | None:
    """The patch for a demo-model module of exactly one of the patched classes."""
    return _PATCHES.get(type(m))
