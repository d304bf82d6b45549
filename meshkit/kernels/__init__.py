"""meshkit.kernels: Triton fused kernels for parallel training, each with a torch reference and autograd.

Pure compute: no model knowledge (model-family patching lives in :mod:`meshkit.integrations`).

- :func:`rms_norm`, :func:`add_rms_norm`, :func:`swiglu`, :func:`rope` (explicit positions),
  :func:`fused_linear_cross_entropy` (chunked, vocab-parallel on a TP mesh);
- :func:`rope_cos_sin` / :func:`apply_rope`: the rotary tables and the eager torch rotation models use;
- :func:`kernel_backend` picks Triton or the torch reference; :func:`builtin_kernel_specs` describes
  the Triton kernels for ahead-of-time compilation;
- model-family patching (``apply_fused_kernels``, ``fused_lm_loss``, ``uses_fused_loss``) lives in
  :mod:`meshkit.integrations`, which imports this package, never the other way round.

CUDA tensors run compiled Triton; CPU tensors run the torch reference, or the Triton code under
Triton's interpreter when ``TRITON_INTERPRET=1`` is set before import. ``MESHKIT_KERNELS=reference``
(or ``kernel_backend("reference")``) forces the reference. See docs/kernels.md.
"""

from typing import Any

from ._backend import kernel_backend
from .cross_entropy import fused_linear_cross_entropy
from .rms_norm import add_rms_norm, rms_norm
from .rope import apply_rope, rope, rope_cos_sin
from .specs import builtin_kernel_specs
from .swiglu import swiglu

__all__ = [
    "rms_norm",
    "add_rms_norm",
    "swiglu",
    "rope",
    "rope_cos_sin",
    "apply_rope",
    "fused_linear_cross_entropy",
    "kernel_backend",
    "builtin_kernel_specs",
]

_MOVED = ("apply_fused_kernels", "fused_lm_loss", "uses_fused_loss")


def __getattr__(name: str) -> Any:  # a clear error for the patching names, which live in meshkit.integrations
    if name in _MOVED:
        raise AttributeError(
            f"meshkit.kernels.{name} moved to meshkit.integrations.{name} (kernels/ holds no model knowledge): "
            f"use `from meshkit.integrations import {name}`."
        )
    raise AttributeError(f"module 'meshkit.kernels' has no attribute {name!r}")
