"""One reader of model shapes: HF configs and models, torchtitan-style args, meshkit's Llama.

Ground floor: the FLOP formula (:mod:`meshkit.profiling.flops`), the planner, the TP checks and
MFUMonitor all read a model through :func:`read_shape`. It accepts

- a Hugging Face config, object or ``config.json`` dict (Llama, Mistral, Qwen2, Qwen3, Gemma 1-3,
  GPT-2's ``n_layer / n_embd / n_head / n_inner``, Phi-3, OLMo2, ...; a multimodal config's
  ``text_config``),
- torchtitan-style args (``dim``, ``n_layers``, ``n_heads``, ``n_kv_heads``, ``ffn_dim`` or
  ``multiple_of`` / ``ffn_dim_multiplier``, ``vocab_size``), meshkit's ``LlamaConfig``,
- an ``nn.Module`` holding one of these as ``config`` / ``model_args`` / ``args`` anywhere in its tree
  (an HF model, meshkit's ``Transformer``, a LightningModule around either): its parameters are then
  counted and ties, per-head norms and fused projections are read from the modules themselves.

Nothing heavy is imported: torch is only touched when handed a module.

Example::

    >>> from meshkit.modelspec import read_shape
    >>> s = read_shape({"dim": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 8, "vocab_size": 128256,
    ...                 "multiple_of": 1024, "ffn_dim_multiplier": 1.3})   # Llama 3 8B, torchtitan args
    >>> s.layers, s.kv_heads, s.head_dim, s.ffn
    (32, 8, 128, 14336)
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from typing import Any, Mapping

__all__ = ["TransformerShape", "read_shape", "find_config", "llama_ffn", "FUSED_PROJECTIONS"]

_LAYERS = ("num_hidden_layers", "n_layers", "num_layers", "n_layer")
_HIDDEN = ("hidden_size", "dim", "d_model", "n_embd")
_HEADS = ("num_attention_heads", "n_heads", "n_head")
_KV_HEADS = ("num_key_value_heads", "n_kv_heads")
_FFN = ("intermediate_size", "ffn_dim", "hidden_dim", "n_inner")
_SEQ = ("max_seq_len", "max_position_embeddings", "seq_len", "n_positions")
_TIED = ("tie_word_embeddings", "tie_embeddings")
_HOLDERS = ("config", "model_args", "args", "text_config")

FUSED_PROJECTIONS = ("qkv_proj", "gate_up_proj", "c_attn")
"""Module names of fused projections: Phi-3's q|k|v and gate|up, GPT-2's q|k|v (a Conv1D)."""

# Facts a config states only through its family (HF ``model_type``); a module shows them directly.
_QK_NORM = {"qwen3": "per_head", "qwen3_moe": "per_head", "gemma3": "per_head", "gemma3_text": "per_head",
            "olmo2": "full"}
_FUSED = {"phi3": ("qkv_proj", "gate_up_proj"), "gpt2": ("c_attn",)}
_UNGATED = {"gpt2"}  # MLP is fc -> act -> proj (two matrices of hidden x 4·hidden), not SwiGLU / GeGLU


@dataclass(frozen=True)
class TransformerShape:
    """The shape of a decoder-only transformer, as every part of meshkit needs it."""

    layers: int
    """Transformer blocks."""
    hidden: int
    """Model width (residual stream)."""
    heads: int
    """Query heads."""
    kv_heads: int
    """Key/value heads (== ``heads`` without GQA)."""
    head_dim: int
    """Size of one head; Qwen3 and Gemma set it apart from ``hidden // heads``."""
    ffn: int
    """MLP hidden size: one of the gate / up halves when ``gated_mlp``."""
    vocab: int
    """Vocabulary size."""
    gated_mlp: bool = True
    """Three MLP matrices (SwiGLU / GeGLU: gate, up, down); False: two (GPT-2's fc, proj)."""
    tied_embeddings: bool = False
    """The LM head is the input embedding matrix."""
    qk_norm: str | None = None
    """Norm on queries and keys: ``"per_head"`` (over head_dim: Qwen3, Gemma 3), ``"full"`` (over all heads
    at once: OLMo2), or None."""
    fused: tuple[str, ...] = ()
    """Fused projections present (names from :data:`FUSED_PROJECTIONS`)."""
    max_seq_len: int | None = None
    """Longest sequence the config declares, if it does."""
    params: int | None = None
    """Parameters counted on the module (each shared tensor once); None when read from a config alone."""
    embedding_params: int | None = None
    """Of which in ``nn.Embedding`` tables (token and, e.g. GPT-2, position); None from a config alone."""
    family: str | None = None
    """HF ``model_type`` ("llama", "qwen3", "gpt2", ...), if the config says."""


def llama_ffn(dim: int, multiple_of: int = 256, ffn_dim_multiplier: float | None = None) -> int:
    """torchtitan / Meta Llama FFN size: 2/3 of 4·dim, scaled, rounded up to a multiple.

    >>> llama_ffn(4096, 1024, 1.3)   # Llama 3 8B
    14336
    """
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def _get(obj: Any, *names: str, default: Any = None) -> Any:
    for name in names:
        value = obj.get(name) if isinstance(obj, Mapping) else getattr(obj, name, None)
        if value is not None:
            return value
    return default


def _is_config(obj: Any) -> bool:
    return obj is not None and not isinstance(obj, (str, bytes, int, float)) and _get(obj, *_HEADS) is not None


def _module_type() -> Any:
    torch = sys.modules.get("torch")  # a module can only exist if torch is imported
    return torch.nn.Module if torch is not None else None


def find_config(obj: Any) -> Any | None:
    """The config (HF, torchtitan-style args, meshkit ``LlamaConfig``) ``obj`` is or holds, else None.

    Looks at ``obj`` itself, then its ``config`` / ``model_args`` / ``args`` / ``text_config``, then (a module)
    those of every submodule in ``modules()`` order; the first that names attention heads wins.

    >>> from types import SimpleNamespace
    >>> find_config(SimpleNamespace(args=SimpleNamespace(n_heads=4))).n_heads
    4
    """
    module = _module_type()
    is_module = module is not None and isinstance(obj, module)
    if not is_module and _is_config(obj):
        return obj
    holders = [obj, *(m for m in obj.modules() if m is not obj)] if is_module else [obj]
    for holder in holders:
        for attr in _HOLDERS:
            cfg = _get(holder, attr)
            if cfg is not holder and _is_config(cfg):
                return cfg
    return None


def _from_config(cfg: Any) -> TransformerShape:
    hidden, layers, heads, vocab = _get(cfg, *_HIDDEN), _get(cfg, *_LAYERS), _get(cfg, *_HEADS), _get(cfg, "vocab_size")
    if None in (hidden, layers, heads, vocab):
        raise ValueError(
            f"read_shape: `config={type(cfg).__name__}` lacks one of hidden size (hidden_size/dim/n_embd), "
            f"layers (num_hidden_layers/n_layers/n_layer), heads (num_attention_heads/n_heads/n_head) or vocab_size "
            f"(got dim={hidden}, n_layers={layers}, n_heads={heads}, vocab_size={vocab}). Pass an HF config, "
            "torchtitan-style args or a meshkit LlamaConfig (or a module holding one as `config`)."
        )
    family = _get(cfg, "model_type")
    family = family if isinstance(family, str) else None
    head_dim = _get(cfg, "head_dim")
    if not isinstance(head_dim, int):  # LlamaConfig.head_dim is a property, HF may set None
        head_dim = hidden // heads
    gated = family not in _UNGATED
    ffn = _get(cfg, *_FFN)
    if ffn is None:
        ffn = 4 * hidden if not gated else llama_ffn(hidden, _get(cfg, "multiple_of", default=256),
                                                     _get(cfg, "ffn_dim_multiplier"))
    return TransformerShape(
        layers=int(layers), hidden=int(hidden), heads=int(heads), kv_heads=int(_get(cfg, *_KV_HEADS, default=heads)),
        head_dim=int(head_dim), ffn=int(ffn), vocab=int(vocab), gated_mlp=gated,
        tied_embeddings=bool(_get(cfg, *_TIED, default=False)), qk_norm=_QK_NORM.get(family or ""),
        fused=_FUSED.get(family or "", ()), max_seq_len=_get(cfg, *_SEQ), family=family,
    )


def _from_module(shape: TransformerShape, model: Any) -> TransformerShape:
    import torch

    seen: set[int] = set()
    total = embed = 0
    for mod in model.modules():
        for p in mod.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel()
                embed += p.numel() if isinstance(mod, torch.nn.Embedding) else 0
    tables = {id(e.weight) for e in model.modules() if isinstance(e, torch.nn.Embedding)}
    tied = any(isinstance(m, torch.nn.Linear) and id(m.weight) in tables for m in model.modules())
    names = {name.rsplit(".", 1)[-1]: mod for name, mod in model.named_modules()}
    q_norm = getattr(names.get("q_norm"), "weight", None)
    qk_norm = shape.qk_norm
    if q_norm is not None:
        qk_norm = "per_head" if q_norm.numel() == shape.head_dim else "full"
    fused = tuple(n for n in FUSED_PROJECTIONS if n in names) or shape.fused
    return replace(shape, params=total, embedding_params=embed, tied_embeddings=tied, qk_norm=qk_norm, fused=fused)


def read_shape(obj: Any) -> TransformerShape:
    """Read a :class:`TransformerShape` from a config (object or dict), torchtitan-style args, a meshkit
    ``LlamaConfig``, or an ``nn.Module`` / LightningModule holding one (see the module docstring).

    Raises ``ValueError`` naming the missing fields, or a module's missing ``config``.

    >>> from meshkit.models import LlamaConfig
    >>> read_shape(LlamaConfig.tiny()).kv_heads
    2
    """
    if isinstance(obj, TransformerShape):
        return obj
    module = _module_type()
    is_module = module is not None and isinstance(obj, module)
    cfg = find_config(obj)
    if cfg is None and is_module:
        raise ValueError(
            f"read_shape: `config={type(obj).__name__}` is a module without a `config` attribute (nor `model_args` "
            "/ `args`) on it or any submodule; set one (HF config, torchtitan args or LlamaConfig) or pass it."
        )
    shape = _from_config(cfg if cfg is not None else obj)
    return _from_module(shape, obj) if is_module else shape
