"""meshkit.kernels: Triton fused kernels for parallel training, each with a torch reference and autograd.

- :func:`rms_norm`, :func:`add_rms_norm`, :func:`swiglu`, :func:`rope` (explicit positions),
  :func:`fused_linear_cross_entropy` (chunked, vocab-parallel on a TP mesh);
- :func:`apply_fused_kernels` patches Llama-family models, :func:`fused_lm_loss` is the fused LM loss;
- :func:`kernel_backend` picks Triton or the torch reference; :func:`builtin_kernel_specs` describes
  the Triton kernels for ahead-of-time compilation.

CUDA tensors run compiled Triton; CPU tensors run the torch reference, or the Triton code under
Triton's interpreter when ``TRITON_INTERPRET=1`` is set before import. ``MESHKIT_KERNELS=reference``
(or ``kernel_backend("reference")``) forces the reference. See docs/kernels.md.
"""

from ._backend import kernel_backend
from .cross_entropy import fused_linear_cross_entropy
from .patching import apply_fused_kernels, fused_lm_loss, uses_fused_loss
from .rms_norm import add_rms_norm, rms_norm
from .rope import rope
from .specs import builtin_kernel_specs
from .swiglu import swiglu

__all__ = [
    "rms_norm",
    "add_rms_norm",
    "swiglu",
    "rope",
    "fused_linear_cross_entropy",
    "apply_fused_kernels",
    "fused_lm_loss",
    "uses_fused_loss",
    "kernel_backend",
    "builtin_kernel_specs",
]
