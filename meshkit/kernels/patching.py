"""Swap meshkit's fused kernels into Llama-family models by patching forwards (names stay unchanged).

Supported modules (matched by class, then patched per instance, so module FQNs, parameter names,
state dicts and TP/FSDP plans are unaffected, and the patched modules accept DTensor weights):

- meshkit demo / torchtitan-style: ``RMSNorm`` (meshkit.models.llama) and ``torch.nn.RMSNorm`` ->
  :func:`rms_norm`; ``FeedForward`` with ``w1, w2, w3`` -> :func:`swiglu`; meshkit's ``Attention`` ->
  fused rope; the ``Transformer`` root gains ``forward(tokens, positions=None, labels=None)``: with
  ``labels`` it returns the fused loss instead of the logits.
- HF transformers (Llama, Mistral, Qwen2, Qwen3): ``*RMSNorm``, ``*MLP`` with SiLU, the attention's
  ``apply_rotary_pos_emb`` (only inside patched attention modules), and ``*ForCausalLM.forward``: with
  ``labels`` the loss comes from :func:`fused_linear_cross_entropy` and ``logits`` is None.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import types
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from ._backend import is_dtensor
from .cross_entropy import fused_linear_cross_entropy
from .rms_norm import rms_norm
from .rope import rotate_with_cos_sin
from .swiglu import swiglu

__all__ = ["apply_fused_kernels", "fused_lm_loss", "uses_fused_loss"]

_MARK = "_meshkit_fused"
_HF_FAMILIES = ("Llama", "Mistral", "Qwen2", "Qwen3")
_state = threading.local()


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
        >>> from meshkit.kernels import fused_lm_loss
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


# ------------------------------------------------------------------------------------------ forwards


def _rmsnorm_forward(self, x: torch.Tensor) -> torch.Tensor:
    eps = getattr(self, "eps", None)
    if eps is None:  # torch.nn.RMSNorm: None means finfo(x.dtype).eps; HF: variance_epsilon
        eps = getattr(self, "variance_epsilon", None) or torch.finfo(x.dtype).eps
    return rms_norm(x, self.weight, eps)


def _feed_forward_forward(self, x: torch.Tensor) -> torch.Tensor:
    return self.w2(swiglu(self.w1(x), self.w3(x)))


def _hf_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


def _half_cos_sin(cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half cos/sin (T, D) or (B, T, D) -> (Bc, T, D/2): both halves hold the same angles."""
    cos, sin = cos[..., : head_dim // 2], sin[..., : head_dim // 2]
    return (cos[None], sin[None]) if cos.dim() == 2 else (cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    if is_dtensor(x):  # heads-sharded projections with use_local_output=False
        y = rotate_with_cos_sin(x.to_local(), cos, sin, False)
        return DTensor.from_local(y, x.device_mesh, x.placements, run_check=False, shape=x.shape, stride=x.stride())
    return rotate_with_cos_sin(x, cos, sin, False)


def _demo_rotate(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """meshkit.models.llama.Attention.rotate with the fused rope (installed as ``rotate``, not ``forward``)."""
    c, s = _half_cos_sin(cos, sin, self.head_dim)
    return _rotate(q, c, s), _rotate(k, c, s)


def _demo_root_forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None, labels=None):
    """Transformer.forward; with ``labels`` (B, T) aligned to ``tokens`` it returns the fused loss."""
    if labels is None:
        return type(self).forward(self, tokens, positions)
    from meshkit.models.llama import rope_cos_sin

    if positions is None:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
    h = self.tok_embeddings(tokens)
    cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta)
    for layer in self.layers.values():
        h = layer(h, cos, sin)
    return fused_lm_loss(self.output, self.norm(h), labels)


@contextlib.contextmanager
def _fused_rope_scope() -> Iterator[None]:
    old = getattr(_state, "rope", False)
    _state.rope = True
    try:
        yield
    finally:
        _state.rope = old


def _install_hf_rope_shim(module_name: str) -> None:
    """Route ``<modeling module>.apply_rotary_pos_emb`` to the fused rope inside patched attention only."""
    mod = sys.modules[module_name]
    original = getattr(mod, "apply_rotary_pos_emb", None)
    if original is None or getattr(original, _MARK, False):
        return

    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        unsqueeze_dim = args[-1] if args else kwargs.get("unsqueeze_dim", 1)
        if not getattr(_state, "rope", False) or unsqueeze_dim != 1 or q.shape[-1] != cos.shape[-1]:
            return original(q, k, cos, sin, *args, **kwargs)
        c, s = _half_cos_sin(cos, sin, q.shape[-1])  # q, k: (B, H, T, D)
        return _rotate(q.transpose(1, 2), c, s).transpose(1, 2), _rotate(k.transpose(1, 2), c, s).transpose(1, 2)

    setattr(apply_rotary_pos_emb, _MARK, True)
    mod.apply_rotary_pos_emb = apply_rotary_pos_emb


def _hf_attention_forward(self, *args, **kwargs):
    with _fused_rope_scope():
        return type(self).forward(self, *args, **kwargs)


def _keep_signature(forward: Callable[..., Any], module: nn.Module) -> Callable[..., Any]:
    # TP plans read forward signatures (e.g. PrepareModuleInput's arity): show the original one.
    if forward in (_hf_attention_forward, _hf_causal_lm_forward):
        return functools.wraps(type(module).forward)(lambda self, *a, **k: forward(self, *a, **k))
    return forward


def _hf_causal_lm_forward(self, input_ids=None, attention_mask=None, position_ids=None, *args, labels=None, **kwargs):
    """*ForCausalLM.forward; with ``labels`` the loss is fused (HF's shift and ``num_items_in_batch`` rule)."""
    if labels is None or args:
        return type(self).forward(self, input_ids, attention_mask, position_ids, *args, labels=labels, **kwargs)
    from transformers.modeling_outputs import CausalLMOutputWithPast

    num_items = kwargs.pop("num_items_in_batch", None)
    kwargs.pop("logits_to_keep", None)
    outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
    hidden = outputs.last_hidden_state
    shift = F.pad(labels, (0, 1), value=-100)[..., 1:].to(hidden.device)
    if num_items is None:
        loss = fused_lm_loss(self.lm_head, hidden, shift)
    else:
        loss = fused_lm_loss(self.lm_head, hidden, shift, reduction="sum") / num_items
    extra = {k: getattr(outputs, k, None) for k in ("cache", "hidden_states", "attentions")}
    return CausalLMOutputWithPast(loss=loss, logits=None, **extra)


# ------------------------------------------------------------------------------------------ matching


def _kind(m: nn.Module) -> tuple[str, Callable[..., Any]] | None:
    cls = type(m).__name__
    mod = type(m).__module__
    if mod == "meshkit.models.llama":
        return {
            "RMSNorm": ("rms_norm", _rmsnorm_forward),
            "FeedForward": ("swiglu", _feed_forward_forward),
            "Attention": ("rope", _demo_rotate),
            "Transformer": ("loss", _demo_root_forward),
        }.get(cls)
    if isinstance(m, nn.RMSNorm) and m.weight is not None and len(m.normalized_shape) == 1:
        return "rms_norm", _rmsnorm_forward
    if cls == "FeedForward" and all(isinstance(getattr(m, w, None), nn.Linear) for w in ("w1", "w2", "w3")):
        return "swiglu", _feed_forward_forward  # torchtitan's FeedForward
    if mod.startswith("transformers.") and any(cls.startswith(f) for f in _HF_FAMILIES):
        suffix = cls[len(next(f for f in _HF_FAMILIES if cls.startswith(f))) :]
        if suffix == "RMSNorm":
            return "rms_norm", _rmsnorm_forward
        if suffix == "MLP" and getattr(getattr(m, "config", None), "hidden_act", None) in ("silu", "swish"):
            return "swiglu", _hf_mlp_forward
        if suffix == "Attention":
            return "rope", _hf_attention_forward
        if suffix == "ForCausalLM" and getattr(m.lm_head, "bias", None) is None:
            return "loss", _hf_causal_lm_forward
    return None


def uses_fused_loss(model: nn.Module) -> bool:
    """True when ``model`` (or its ``model`` attribute, e.g. a LightningModule's) has the fused-loss patch,
    i.e. its root forward accepts ``labels=`` and then returns the loss instead of the logits.

    Example::

        >>> from meshkit.models import LlamaConfig, Transformer
        >>> from meshkit.kernels import apply_fused_kernels, uses_fused_loss
        >>> m = Transformer(LlamaConfig.tiny())
        >>> uses_fused_loss(m), uses_fused_loss(apply_fused_kernels(m) and m)
        (False, True)
    """
    inner = getattr(model, "model", None)
    return getattr(model, _MARK, None) == "loss" or (isinstance(inner, nn.Module) and getattr(inner, _MARK, None) == "loss")


def apply_fused_kernels(
    model: nn.Module, *, rms_norm: bool = True, swiglu: bool = True, rope: bool = True, loss: bool = True
) -> dict[str, int]:
    """Patch the supported modules of ``model`` in place; return how many of each kind were patched.

    Call it on the plain model, before tensor parallelism, FSDP and ``torch.compile``; calling it twice is
    harmless. The keyword flags turn single kinds off. The loss patch changes nothing until the caller
    passes ``labels`` to the root forward (see :func:`fused_lm_loss` and docs/kernels.md).

    Example::

        >>> from meshkit.models import LlamaConfig, Transformer
        >>> from meshkit.kernels import apply_fused_kernels
        >>> apply_fused_kernels(Transformer(LlamaConfig.tiny()))
        {'rms_norm': 9, 'swiglu': 4, 'rope': 4, 'loss': 1}
    """
    enabled = {"rms_norm": rms_norm, "swiglu": swiglu, "rope": rope, "loss": loss}
    counts = {k: 0 for k in enabled}
    found = 0
    for m in model.modules():
        match = _kind(m)
        if match is None:
            continue
        found += 1
        kind, forward = match
        if not enabled[kind] or getattr(m, _MARK, None) is not None:
            continue
        if forward is _hf_attention_forward:
            _install_hf_rope_shim(type(m).__module__)
        if forward is _demo_rotate:
            m.rotate = types.MethodType(forward, m)
        else:
            m.forward = types.MethodType(_keep_signature(forward, m), m)
        setattr(m, _MARK, kind)
        counts[kind] += 1
    if not found:
        raise ValueError(
            f"apply_fused_kernels: `model` ({type(model).__name__}) has no supported module (meshkit/torchtitan "
            "RMSNorm, FeedForward, Attention, Transformer; torch.nn.RMSNorm; HF Llama/Mistral/Qwen2/Qwen3)."
        )
    return counts
