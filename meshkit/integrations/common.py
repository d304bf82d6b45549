"""What every family shares: the patch marker, forward binding, and the RMSNorm / SwiGLU forwards.

Also the generic family: ``torch.nn.RMSNorm`` and torchtitan's ``FeedForward`` (``w1, w2, w3``).
"""

from __future__ import annotations

import types
from typing import Any, Callable

import torch
from torch import nn

from meshkit.kernels import rms_norm, swiglu

MARK = "_meshkit_fused"
"""Attribute set on every patched module (value: its kind) and on installed shims; makes patching idempotent."""

Patch = Callable[[nn.Module], None]
"""Installs a fused forward on one module instance."""


def bind_forward(forward: Callable[..., Any], name: str = "forward") -> Patch:
    """A patch that binds ``forward`` as the instance attribute ``name`` (the class stays untouched)."""

    def patch(m: nn.Module) -> None:
        setattr(m, name, types.MethodType(forward, m))

    return patch


def rmsnorm_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    eps = getattr(self, "eps", None)
    if eps is None:  # torch.nn.RMSNorm: None means finfo(x.dtype).eps; HF: variance_epsilon
        eps = getattr(self, "variance_epsilon", None) or torch.finfo(x.dtype).eps
    return rms_norm(x, self.weight, eps)


def feed_forward_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return self.w2(swiglu(self.w1(x), self.w3(x)))


def match(m: nn.Module) -> tuple[str, Patch] | None:
    """``torch.nn.RMSNorm`` with a weight, and torchtitan-style ``FeedForward`` (w1, w2, w3 Linears)."""
    if isinstance(m, nn.RMSNorm) and m.weight is not None and len(m.normalized_shape) == 1:
        return "rms_norm", bind_forward(rmsnorm_forward)
    if type(m).__name__ == "FeedForward" and all(isinstance(getattr(m, w, None), nn.Linear) for w in ("w1", "w2", "w3")):
        return "swiglu", bind_forward(feed_forward_forward)
    return None
