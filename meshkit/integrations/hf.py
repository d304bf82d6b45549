"""HF transformers Llama, Mistral, Qwen2, Qwen3: ``*RMSNorm``, ``*MLP`` (SiLU), rope inside ``*Attention``,
``*ForCausalLM.forward`` (with ``labels`` the loss is fused and ``logits`` is None).

Rope is swapped by routing the modeling module's ``apply_rotary_pos_emb`` to the fused kernel, but only
while a patched attention module runs (a thread-local scope), so unpatched models are untouched.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from typing import Any, Callable, Iterator

import torch.nn.functional as F
from torch import nn

from meshkit.kernels import swiglu
from meshkit.kernels.rope import half_cos_sin, rotate_with_cos_sin

from .common import MARK, Patch, bind_forward, rmsnorm_forward
from .loss import fused_lm_loss

FAMILIES = ("Llama", "Mistral", "Qwen2", "Qwen3")
"""HF model-class prefixes whose modules are patched."""

_state = threading.local()


def _mlp_forward(self, x):
    return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


@contextlib.contextmanager
def _fused_rope_scope() -> Iterator[None]:
    old = getattr(_state, "rope", False)
    _state.rope = True
    try:
        yield
    finally:
        _state.rope = old


def _install_rope_shim(module_name: str) -> None:
    """Route ``<modeling module>.apply_rotary_pos_emb`` to the fused rope inside patched attention only."""
    mod = sys.modules[module_name]
    original = getattr(mod, "apply_rotary_pos_emb", None)
    if original is None or getattr(original, MARK, False):
        return

    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        unsqueeze_dim = args[-1] if args else kwargs.get("unsqueeze_dim", 1)
        if not getattr(_state, "rope", False) or unsqueeze_dim != 1 or q.shape[-1] != cos.shape[-1]:
            return original(q, k, cos, sin, *args, **kwargs)
        c, s = half_cos_sin(cos, sin, q.shape[-1])  # q, k: (B, H, T, D)
        rot = rotate_with_cos_sin
        return rot(q.transpose(1, 2), c, s).transpose(1, 2), rot(k.transpose(1, 2), c, s).transpose(1, 2)

    setattr(apply_rotary_pos_emb, MARK, True)
    mod.apply_rotary_pos_emb = apply_rotary_pos_emb


def _attention_forward(self, *args, **kwargs):
    with _fused_rope_scope():
        return type(self).forward(self, *args, **kwargs)


def _causal_lm_forward(self, input_ids=None, attention_mask=None, position_ids=None, *args, labels=None, **kwargs):
    """*ForCausalLM.forward; with ``labels`` the loss is fused (HF's shift, ``shift_labels`` and
    ``num_items_in_batch`` rules)."""
    if labels is None or args:
        return type(self).forward(self, input_ids, attention_mask, position_ids, *args, labels=labels, **kwargs)
    from transformers.modeling_outputs import CausalLMOutputWithPast

    num_items = kwargs.pop("num_items_in_batch", None)
    shift = kwargs.pop("shift_labels", None)  # already shifted (e.g. by meshkit under cp): used as they are
    kwargs.pop("logits_to_keep", None)
    outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
    hidden = outputs.last_hidden_state
    shift = (F.pad(labels, (0, 1), value=-100)[..., 1:] if shift is None else shift).to(hidden.device)
    if num_items is None:
        loss = fused_lm_loss(self.lm_head, hidden, shift)
    else:
        loss = fused_lm_loss(self.lm_head, hidden, shift, reduction="sum") / num_items
    extra = {k: getattr(outputs, k, None) for k in ("cache", "hidden_states", "attentions")}
    return CausalLMOutputWithPast(loss=loss, logits=None, **extra)


def _bind_keeping_signature(forward: Callable[..., Any]) -> Patch:
    # TP plans read forward signatures (e.g. PrepareModuleInput's arity): show the original one.
    def patch(m: nn.Module) -> None:
        bind_forward(functools.wraps(type(m).forward)(lambda self, *a, **k: forward(self, *a, **k)))(m)

    return patch


def _patch_attention(m: nn.Module) -> None:
    _install_rope_shim(type(m).__module__)
    _bind_keeping_signature(_attention_forward)(m)


def match(m: nn.Module) -> tuple[str, Patch] | None:
    """The patch for an HF module of one of :data:`FAMILIES`, or None."""
    cls = type(m).__name__
    if not type(m).__module__.startswith("transformers."):
        return None
    family = next((f for f in FAMILIES if cls.startswith(f)), None)
    if family is None:
        return None
    suffix = cls[len(family) :]
    if suffix == "RMSNorm":
        return "rms_norm", bind_forward(rmsnorm_forward)
    if suffix == "MLP" and getattr(getattr(m, "config", None), "hidden_act", None) in ("silu", "swish"):
        return "swiglu", bind_forward(_mlp_forward)
    if suffix == "Attention":
        return "rope", _patch_attention
    if suffix == "ForCausalLM" and getattr(m.lm_head, "bias", None) is None:
        return "loss", _bind_keeping_signature(_causal_lm_forward)
    return None
