"""A tiny twin of a transformers model: the same class, its config shrunk, float64, deterministic weights.

A mechanism that rearranges a family's forward (the pipeline's stages, ...) checks itself on the twin in one
process, against the family's own forward, before it touches the real model or any process group: what the
family's code does is then what the check measured, whatever the family (a logit scale, a soft-cap, an embedding
multiplier, per-layer rotary tables), not what meshkit expects of it.

Example::

    >>> import transformers
    >>> config = tiny_config(transformers.LlamaConfig(num_key_value_heads=8))
    >>> (config.num_hidden_layers, config.hidden_size, config.num_key_value_heads)
    (2, 32, 2)
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

__all__ = ["tiny_config", "tiny_twin", "TINY", "TWIN_RTOL", "TWIN_RTOL_FLOAT32", "relative_error", "unit_weights"]

TINY: dict[str, int] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "head_dim": 8,
    "vocab_size": 96,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "q_lora_rank": 16,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 8,
}
"""The widths a twin gets, for every one of these attributes its config has (a config without one keeps none)."""


TWIN_RTOL = 1e-9
"""How far (relative to the largest logit) a rearrangement of a float64 twin's forward (pipeline stages, cp shards)
may differ from its own forward: it runs the family's own operations on the same numbers, so it agrees to rounding
(0 to 1e-15 on every family seen); a dropped logit scale, soft-cap or position offset is off by 1e-2 or more."""

TWIN_RTOL_FLOAT32 = 1e-5
"""The same, for a twin whose forward has no float64 kernel on CPU (grouped MoE matmuls) and runs in float32."""


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (inf when the shapes differ): what :data:`TWIN_RTOL` bounds.

    >>> relative_error(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 4.0]))
    0.5
    """
    if got.shape != want.shape:
        return float("inf")
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-300))


def _pick_layers(layer_types: list | None, num_layers: int, layers: int) -> list[int]:
    """Which of the original layers the twin keeps: one of each distinct layer type first (full and sliding...)."""
    if not layer_types:
        return list(range(min(layers, num_layers)))
    firsts = list(dict.fromkeys(layer_types))
    picked = [layer_types.index(kind) for kind in firsts][:layers]
    picked += [i for i in range(num_layers) if i not in picked][: layers - len(picked)]
    return sorted(picked)


def _set(config: Any, key: str, value: Any) -> None:
    """``config.key = value``, unless ``key`` is a property the config computes (Falcon's ``head_dim``)."""
    if isinstance(getattr(type(config), key, None), property):
        return
    setattr(config, key, value)


def tiny_config(config: Any, layers: int = 2) -> Any:
    """A copy of the HF ``config`` with ``layers`` layers of :data:`TINY` widths, "eager" attention and experts, no
    dropout.

    Per-layer lists (``layer_types`` and any list as long as the layer count) keep the entries of the layers
    kept, one layer of each distinct type first, so a sliding/full family stays both. Token ids outside the
    tiny vocabulary become None (the last tiny id where a strict config wants one; lists keep their tiny ids).
    Properties the config computes (Falcon's ``head_dim``) are left to it; ``head_dim`` or
    ``num_key_value_heads`` of None, which some families read as numbers, get the tiny ones.
    """
    config = copy.deepcopy(config)
    n = int(getattr(config, "num_hidden_layers"))
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None)
    picked = _pick_layers(getattr(config, "layer_types", None), n, layers)
    for key, value in list(vars(config).items()):
        if isinstance(value, (list, tuple)) and len(value) == n and n > 1 and not key.startswith("_"):
            setattr(config, key, type(value)(value[i] for i in picked))
    config.num_hidden_layers = len(picked)
    for key, value in TINY.items():
        # head_dim None (Ministral's default) is read as a number by the family: it gets the tiny one too
        if isinstance(getattr(config, key, None), int) or (key == "head_dim" and key in vars(config)):
            _set(config, key, value)
    if isinstance(kv, int) and isinstance(heads, int):  # keep grouped-query attention grouped, MHA full
        config.num_key_value_heads = 2 if kv < heads else TINY["num_attention_heads"]
    elif kv is None and "num_key_value_heads" in vars(config):  # None: as many as the query heads (Nemotron)
        config.num_key_value_heads = TINY["num_attention_heads"]
    for key, value in list(vars(config).items()):
        if key.endswith("_token_id") and isinstance(value, (int, list)) and not isinstance(value, bool):
            ids = value if isinstance(value, list) else [value]
            kept = [i for i in ids if isinstance(i, int) and 0 <= i < TINY["vocab_size"]]
            if kept == ids:
                continue
            try:  # a list keeps its tiny ids; an id outside the tiny vocabulary becomes None
                setattr(config, key, kept if isinstance(value, list) and kept else None)
            except Exception:  # noqa: BLE001 -- a strict config (CWM) wants ids: the last tiny one
                last = TINY["vocab_size"] - 1
                setattr(config, key, [last] if isinstance(value, list) else last)
        elif ("dropout" in key or "pdrop" in key) and isinstance(value, float):  # hidden_dropout_prob, attn_pdrop...
            setattr(config, key, 0.0)
    config._attn_implementation = "eager"
    if "_experts_implementation" in dir(config):  # MoE: the family's own per-expert loop (float64 on CPU; torch's
        config._experts_implementation = "eager"  # grouped matmul has no float64 kernel there)
    return config


def tiny_twin(model: nn.Module, layers: int = 2, seed: int = 0, **overrides: Any) -> nn.Module:
    """``type(model)`` built from :func:`tiny_config` of ``model.config`` (then ``overrides`` set on it), float64,
    eval mode, seeded weights. The caller's random state is left as it was.
    """
    config = tiny_config(model.config, layers)
    for key, value in overrides.items():
        setattr(config, key, value)
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):  # even inside a meta-device init context
        torch.manual_seed(seed)
        twin = type(model)(config)
    return twin.to(torch.float64).eval()


def unit_weights(model: nn.Module, seed: int = 0) -> nn.Module:
    """Redraw every weight matrix of ``model`` (a twin) at unit scale, ``N(0, 1/fan_in)``; vectors (norms, biases)
    stay. The families' own init (std 0.02) gives attention scores of a few hundredths, where a dropped soft-cap
    of 50 (Gemma2's) moves the twin's logits by less than 1e-9; at unit scale, as in trained weights, by 1.2e-5. In place, seeded,
    the caller's random state left as it was; returns ``model``.
    """
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        for p in model.parameters():
            if p.dim() >= 2 and p.is_floating_point():
                p.normal_(0.0, p.shape[-1] ** -0.5)
    return model
