"""meshkit.integrations: model-family patching that swaps meshkit's fused kernels into existing models.

- :func:`apply_fused_kernels` patches meshkit's demo model, torchtitan-style modules, ``torch.nn.RMSNorm``
  and HF Llama / Mistral / Qwen2 / Qwen3 in place (one module per family, :mod:`.fused` dispatches);
- :func:`fused_lm_loss` is the fused LM loss from final hidden states; :func:`uses_fused_loss` tells
  whether a model's root forward was patched to return it.

See docs/kernels.md.

Example::

    >>> from meshkit.models import LlamaConfig, Transformer
    >>> from meshkit.integrations import apply_fused_kernels
    >>> apply_fused_kernels(Transformer(LlamaConfig.tiny()))
    {'rms_norm': 9, 'swiglu': 4, 'rope': 4, 'loss': 1}
"""

from .fused import apply_fused_kernels, uses_fused_loss
from .loss import fused_lm_loss

__all__ = ["apply_fused_kernels", "fused_lm_loss", "uses_fused_loss"]
