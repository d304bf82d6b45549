"""Model integration of context parallelism: route a model's attention to cp attention, feed global positions.

:func:`apply_context_parallel` swaps attention in place: a ``TorchFunctionMode`` scoped to each attention
module's forward for torchtitan-style models, a registered ``AttentionInterface`` function for
transformers models; forward pre-hooks fill in the global positions of the local tokens. The top layer
of :mod:`meshkit.plugins.context_parallel` (imports :mod:`.layout` and :mod:`.attention`).

Example::

    >>> model = apply_context_parallel(Transformer(LlamaConfig.tiny()), mesh["cp"])  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup
from torch.overrides import TorchFunctionMode

from meshkit.loss import num_items
from meshkit.plugins.context_parallel.attention import CP_ATTENTIONS, _check_attention, context_parallel_attention
from meshkit.plugins.context_parallel.layout import (
    CP_LAYOUTS,
    POSITION_KEYS,
    Group,
    layout_index,
    process_group,
    sequence_positions,
    shard_sequence,
)

__all__ = [
    "CPApplied", "apply_context_parallel", "check_cp_batch", "check_cp_forward", "check_cp_mask", "cp_applied",
    "context_parallel_layout", "cp_position_ids",
]

CP_APPLIED = "_meshkit_context_parallel"
"""The attribute :func:`apply_context_parallel` sets on the model it made context-parallel: its :class:`CPApplied`."""


@dataclasses.dataclass(frozen=True)
class CPApplied:
    """What :func:`apply_context_parallel` made of a model, resolved once when it is applied, so that cutting a
    batch (:func:`~meshkit.plugins.context_parallel.step_batch`, every step) walks no modules: the ``layout``, the
    family's position rule (:func:`cp_position_ids`, or None: 0..T-1), and the smallest sliding window of its
    attention as ``(window, attention class, config)`` (see :data:`CP_WINDOW`; None: no window).

    >>> CPApplied("load_balanced", None, None).layout
    'load_balanced'
    """

    layout: str
    position_ids: Callable | None
    window: tuple[int, str, Any] | None


class _SDPAToCP(TorchFunctionMode):
    """Routes ``F.scaled_dot_product_attention`` calls to :func:`context_parallel_attention` while active."""

    def __init__(self, group: ProcessGroup, attention: str, layout: str) -> None:
        super().__init__()
        self.group, self.attention, self.layout = group, attention, layout

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        params = dict(zip(names, args))
        params.update(kwargs)
        if params.get("attn_mask") is not None or params.get("dropout_p", 0.0):
            raise ValueError(
                "apply_context_parallel: the model calls scaled_dot_product_attention with an `attn_mask` or "
                "`dropout_p>0`; context-parallel attention supports causal or full attention without dropout only."
            )
        return context_parallel_attention(
            params["query"], params["key"], params["value"], self.group,
            causal=bool(params.get("is_causal", False)), attention=self.attention, layout=self.layout,
            scale=params.get("scale"),
        )  # fmt: skip


_HF_NO_ATTENTION_MATH = frozenset({"position_ids", "use_cache", "cache", "past_key_values", "cache_position",
                                    "output_router_logits", "output_hidden_states", "num_items_in_batch",
                                    "shift_labels"})
"""Keyword arguments transformers' attention modules hand the attention function that carry no attention math
(positions are already in q/k through rotary; caches are unused in training; router logits are the MLP's; the
loss's ``num_items_in_batch``/``shift_labels`` ride along with the model's keyword arguments)."""

_HF_IMPLEMENTED = ("dropout", "scaling", "is_causal", "sliding_window")
"""The arguments cp attention implements: ``scaling`` (the softmax scale), ``is_causal``, ``dropout`` (0, or any
value in eval mode), ``sliding_window`` (None, or at least the whole sequence: then it is full causal attention).
Every other argument must be None or False (a soft-cap, attention sinks ``s_aux``/``sinks``, a position bias,
``output_attentions=True``, packed-sequence offsets ...): anything else is refused, never ignored."""


def _full_attention_fix(config: Any) -> str:
    """The config change that makes ``config``'s family attend fully, as the installed transformers accepts it."""
    if getattr(config, "layer_types", None) is not None:  # per-layer windows: sliding_window=None raises there
        n = len(config.layer_types)
        return f'`config.layer_types = ["full_attention"] * {n}`'
    return "`config.sliding_window=None`"


def _window_refusal(name: str, window: int, seq_len: int, config: Any) -> str:
    return (
        f"apply_context_parallel: {name} attends within `sliding_window={window}` tokens, but the sequences are "
        f"{seq_len} long and context-parallel attention attends to every earlier token. Train with sequences of at "
        f"most {window} tokens, or set {_full_attention_fix(config)} (full causal attention) if that is the model "
        "you mean."
    )


_MASK_REFUSAL = (
    "only unpadded causal batches without attention dropout are supported (set the config's attention dropout to "
    "0.0, and train on unpadded batches)."
)


def check_hf_attention_args(module: nn.Module, seq_len: int, attention_mask: Any, dropout: float, kwargs: dict) -> None:
    """Refuse any argument of a transformers attention call that cp attention does not implement (see
    :data:`_HF_IMPLEMENTED`), naming it, its value and the fix; ``seq_len`` is the whole sequence's length.

    >>> check_hf_attention_args(nn.Module(), 16, None, 0.0, {"softcap": None, "position_ids": 0})
    >>> check_hf_attention_args(nn.Module(), 16, None, 0.0, {"softcap": 50.0})
    Traceback (most recent call last):
    ...
    ValueError: apply_context_parallel: Module passes `softcap=50.0` to its attention, which context-parallel attention does not implement (it implements dropout, scaling, is_causal, sliding_window). Train this family without cp (cp=1), or configure the model so that the argument is None (e.g. Gemma2's `config.attn_logit_softcapping=None`) if that is the model you mean.
    """
    name = type(module).__name__
    window = kwargs.get("sliding_window")
    if window is not None and window < seq_len:
        raise ValueError(_window_refusal(name, window, seq_len, getattr(module, "config", None)))
    if attention_mask is not None or (dropout and module.training):
        raise ValueError(
            f"apply_context_parallel: {name} passed an `attention_mask` or `dropout={dropout}` in training to "
            f"context-parallel attention; {_MASK_REFUSAL}"
        )
    for key, value in kwargs.items():
        if key in _HF_NO_ATTENTION_MATH or key in _HF_IMPLEMENTED or value is None or value is False:
            continue
        shown = f"{type(value).__name__} of shape {tuple(value.shape)}" if hasattr(value, "shape") else repr(value)
        raise ValueError(
            f"apply_context_parallel: {name} passes `{key}={shown}` to its attention, which context-parallel attention "
            f"does not implement (it implements {', '.join(_HF_IMPLEMENTED)}). Train this family without cp (cp=1), or "
            "configure the model so that the argument is None (e.g. Gemma2's `config.attn_logit_softcapping=None`) if "
            "that is the model you mean."
        )


class _SoftmaxInInputDtype(TorchFunctionMode):
    """A softmax asked for in float32 of a float64 input is taken in float64 (transformers' eager attention takes
    its softmax in float32): while active, the twin's own attention is float64 throughout, as cp attention is."""

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in (F.softmax, torch.softmax, torch.Tensor.softmax) and args and kwargs.get("dtype") is not None:
            if args[0].dtype == torch.float64:
                kwargs = {**kwargs, "dtype": torch.float64}
        return func(*args, **kwargs)


def _attention_in_float64(model: nn.Module) -> list[Any]:
    """Scope :class:`_SoftmaxInInputDtype` to the forwards of ``model``'s attention modules (``*Attention``);
    returns the hooks' handles."""
    handles = []
    for module in model.modules():
        if type(module).__name__.endswith("Attention"):
            active: list[TorchFunctionMode] = []
            handles.append(module.register_forward_pre_hook(
                lambda _m, _a, active=active: active.append(_SoftmaxInInputDtype().__enter__())))
            handles.append(module.register_forward_hook(
                lambda _m, _a, _o, active=active: active.pop().__exit__(None, None, None), always_call=True))
    return handles


_PROVED: dict[tuple, str | None] = {}
_WINDOWS: dict[tuple, tuple[int, str] | None] = {}

PROOF_TOKENS_PER_CHUNK = 4
"""The proof's sequences hold this many tokens per layout chunk (16 tokens at cp=2, load-balanced), 2 rows."""


def check_cp_forward(model: nn.Module, cp: int = 2, layout: str = "load_balanced") -> None:
    """Refuse a transformers model that cp would not train as one process does, in one process, before any collective.

    The model's tiny twin (:func:`meshkit.families.tiny_twin`: same class, 2 layers, float64) runs once on whole
    sequences, as one process runs it, and once as meshkit runs it under ``cp``: every cp rank's shard of the
    sequences (cut by ``layout``, stacked along the batch), with the position ids meshkit feeds (the global ones,
    or the family's own rule of :func:`meshkit.families.position_ids_of` computed on the whole sequence), through
    meshkit's attention function, which checks every argument it is handed (:func:`check_hf_attention_args`) and
    attends over every rank's keys as context-parallel attention does. The logits must agree to
    :data:`~meshkit.families.twin.TWIN_RTOL`; anything the family computes from a shard alone (positions or masks
    derived from the token ids, attention outside transformers' attention interface, an argument cp would drop)
    shows. A mismatch, or an error, is a ``ValueError`` naming the class and the fix. One proof per class, config,
    ``cp`` and ``layout``. A sliding window the twin's attention passes is recorded on ``model`` (:data:`CP_WINDOW`)
    for :func:`check_cp_batch`: a window only refuses sequences longer than it, which only a batch shows.

    >>> import transformers
    >>> check_cp_forward(transformers.LlamaForCausalLM(transformers.LlamaConfig(
    ...     vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)))
    """
    key = _proof_key(model, cp, layout)
    if key not in _PROVED:
        _PROVED[key] = _cp_forward_mismatch(model, cp, layout)
    if _PROVED[key] is not None:
        raise ValueError(_PROVED[key])
    if _WINDOWS.get(key) is not None:  # the real sequences meet the smallest window when a batch is cut
        setattr(model, CP_WINDOW, _WINDOWS[key])


def _proof_key(model: nn.Module, cp: int, layout: str) -> tuple:
    config = getattr(model, "config", None)
    return (type(model), config.to_json_string(use_diff=False) if hasattr(config, "to_json_string") else "", cp, layout)


def _cp_forward_mismatch(model: nn.Module, cp: int, layout: str) -> str | None:
    from transformers import AttentionInterface

    from meshkit.families import position_ids_of, tiny_twin
    from meshkit.families.twin import TWIN_RTOL, TWIN_RTOL_FLOAT32, relative_error, unit_weights

    name = type(model).__name__
    head = f"apply_context_parallel: meshkit cannot show that {name} under cp={cp} computes what it computes in one process"
    fix = (
        f"Train {name} without cp (cp=1); or, if it derives its position ids from the token ids, tell meshkit its "
        "rule with `meshkit.families.register_position_ids` (cp feeds them, computed on the whole sequence)."
    )
    chunks = 2 * cp if layout == "load_balanced" else cp
    seq, rows = PROOF_TOKENS_PER_CHUNK * chunks, 2
    # A window shorter than the proof's sequences is the batch's question (check_cp_batch: the real sequences meet
    # the real window); the twin attends within one as long as its sequences, full attention on both sides.
    window = getattr(model.config, "sliding_window", None)
    wider = {"sliding_window": seq} if isinstance(window, int) and window < seq else {}
    try:
        twin = unit_weights(tiny_twin(model, **wider))  # at unit scale a dropped soft-cap or bias shows
    except Exception as e:  # noqa: BLE001 -- any failure to build the twin means nothing was shown
        return f"{head}: its 2-layer twin (to check the cp shards on) could not be built ({type(e).__name__}: {e}). {fix}"
    ids = torch.randint(0, int(twin.config.vocab_size), (rows, seq), generator=torch.Generator().manual_seed(0))
    rule = position_ids_of(twin)
    whole = rule(ids) if rule is not None else torch.arange(seq).expand(rows, seq)
    shards = torch.cat([shard_sequence(ids, r, cp, 1, layout) for r in range(cp)])  # (cp*rows, seq/cp)
    shards._meshkit_cp_positions = torch.cat([shard_sequence(whole, r, cp, 1, layout) for r in range(cp)])
    order = torch.argsort(layout_index(seq, cp, layout))
    calls: list[int] = []
    windows: list[tuple[int, str]] = []

    def attend(module: nn.Module, query, key_, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kw):
        """What meshkit's cp attention function does, with every rank's shard of the batch at hand."""
        calls.append(1)
        if attention_mask is not None:  # the proof hands the twin no mask: this one is the family's own
            raise ValueError(
                f"apply_context_parallel: {type(module).__name__} builds an attention mask of its own (its 2-layer "
                "twin passed one to the attention function on an unpadded batch), which each cp rank would build "
                f"from its shard alone and context-parallel attention does not take. Train {name} without cp (cp=1)."
            )
        if kw.get("sliding_window") is not None:  # the model's own window (the twin's may be widened)
            windows.append((int(window if wider else kw["sliding_window"]), type(module).__name__))
        check_hf_attention_args(module, cp * query.shape[2], attention_mask, dropout, kw)
        _check_attention(query, key_, value, cp, "ring", layout)  # the shape rule (the heads rule is ulysses')

        def unshard(x):  # (cp*rows, H, seq/cp, D) -> (rows, H, seq, D) in natural order
            b, h, t, d = x.shape
            x = x.reshape(cp, b // cp, h, t, d).permute(1, 2, 0, 3, 4).reshape(b // cp, h, cp * t, d)
            return x.index_select(2, order)

        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        out = F.scaled_dot_product_attention(
            unshard(query), unshard(key_), unshard(value), is_causal=causal, scale=scaling, enable_gqa=True
        )
        b, h, _, d = out.shape
        out = out.index_select(2, layout_index(seq, cp, layout)).reshape(b, h, cp, seq // cp, d)
        out = out.permute(2, 0, 1, 3, 4).reshape(cp * b, h, seq // cp, d)
        return out.transpose(1, 2).contiguous(), None

    forward_kw: dict[str, Any] = {}  # called as training calls it: the config's own use_cache (Dory's loops read it)
    rtol = TWIN_RTOL
    with torch.no_grad():
        handles = _attention_in_float64(twin)  # the one-process side: the family's own attention, in float64 as cp's
        try:
            try:
                want = twin(input_ids=ids, **forward_kw).logits
            except RuntimeError:  # e.g. grouped MoE matmuls have no float64 kernel on CPU: the same proof in float32
                twin, rtol = twin.float(), TWIN_RTOL_FLOAT32
                want = twin(input_ids=ids, **forward_kw).logits
        except Exception as e:  # noqa: BLE001
            return f"{head}: its 2-layer twin's own forward failed ({type(e).__name__}: {e}). {fix}"
        finally:
            for handle in handles:
                handle.remove()
        AttentionInterface.register("meshkit_cp_proof", attend)
        twin.set_attn_implementation("meshkit_cp_proof")
        for module in _outermost(twin, lambda m: _position_key(m) is not None):
            hook = _position_hook(None, layout, _position_key(module), has_rule=False)  # a fresh twin: no rule
            module.register_forward_pre_hook(hook, with_kwargs=True)
        try:
            got = twin(input_ids=shards, **forward_kw).logits
        except ValueError as e:
            if str(e).startswith(("apply_context_parallel:", "context_parallel")):  # meshkit's own refusal
                return str(e)
            return f"{head}: on its 2-layer twin the sharded forward raised ValueError: {e}. {fix}"
        except Exception as e:  # noqa: BLE001
            return f"{head}: on its 2-layer twin the sharded forward raised {type(e).__name__}: {e}. {fix}"
    layers = int(twin.config.num_hidden_layers)
    if len(calls) < layers:
        return (
            f"apply_context_parallel: {name} computes its attention without transformers' attention "
            f"interface (its 2-layer twin called it {len(calls)} times), so context-parallel attention "
            "cannot replace it and each rank would attend only within its own shard. Train this family without cp "
            "(cp=1)."
        )
    rows_out = got.shape[0] // cp
    got = torch.cat([got[r * rows_out:(r + 1) * rows_out] for r in range(cp)], dim=1).index_select(1, order)
    err = relative_error(got, want)
    _WINDOWS[_proof_key(model, cp, layout)] = min(windows) if windows else None
    if err > rtol:
        return (
            f"{head}: its 2-layer twin, cut into {cp} shards as meshkit cuts it (each rank's tokens with the "
            f"position ids meshkit feeds: {'the family rule of meshkit.families.position_ids_of' if rule else 'the global ones, 0..T-1'}), "
            f"gives logits that differ from its own by {err:.1e} (relative): the family computes something from a "
            "shard alone that depends on the whole sequence (position ids or masks derived from the token ids, ...). "
            f"{fix}"
        )
    return None


def _hf_attention_fn(group: ProcessGroup, attention: str, layout: str) -> Callable:
    """An attention function for transformers' AttentionInterface (signature of its sdpa_attention_forward).

    Every argument it is handed is implemented or checked by :func:`check_hf_attention_args` first, on every
    rank alike, before this call's first collective."""

    def forward(module: nn.Module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kw):
        check_hf_attention_args(module, dist.get_world_size(group) * query.shape[2], attention_mask, dropout, kw)
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        out = context_parallel_attention(
            query, key, value, group, causal=causal, attention=attention, layout=layout, scale=scaling
        )
        return out.transpose(1, 2).contiguous(), None  # (B, T, H, D), as sdpa_attention_forward returns

    return forward


_HF_NAMES = itertools.count()


def _position_hook(group: ProcessGroup | None, layout: str, key: str, has_rule: bool) -> Callable:
    """Fill ``key`` (the module's position argument) when the call gives none: the positions :func:`shard_batch`
    attached to the token ids (the family's own rule where it has one, computed on the whole sequence), else the
    global positions of this rank's tokens. A module whose family has a rule (``has_rule``, resolved when the hook
    is registered) and tokens without them is refused."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if kwargs.get(key) is not None or len(args) > 1:
            return None
        tokens = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs_embeds", kwargs.get("tokens")))
        positions = getattr(tokens, "_meshkit_cp_positions", None)
        if positions is None:
            if has_rule:
                raise ValueError(
                    f"apply_context_parallel: {type(module).__name__} derives its position ids from the whole "
                    "sequence's token ids, and these token ids carry none: feed it the `input_ids` of "
                    "`shard_batch(batch, cp_mesh, position_ids=cp_position_ids(model))` (NDParallelStrategy does), "
                    "or pass `position_ids=` yourself."
                )
            cp, rank = dist.get_world_size(group), dist.get_rank(group)
            positions = sequence_positions(cp * tokens.shape[1], rank, cp, layout, device=tokens.device)
            positions = positions[None].expand(tokens.shape[0], -1)
        kwargs[key] = positions
        return args, kwargs

    return hook


CP_WINDOW = "_meshkit_cp_window"
"""The attribute :func:`check_cp_forward` sets on a model whose attention has a sliding window: (the smallest
window, its attention class); :func:`check_cp_batch` holds each batch's sequence length against it."""


def check_cp_batch(model: nn.Module | CPApplied, batch: Any, cp: int, mask: bool = True) -> None:
    """Refuse, when a batch is cut (NDParallelStrategy: before the step's first collective, on every rank alike),
    what only the batch shows: sequences longer than a model's sliding window (see :data:`CP_WINDOW`), or (unless
    ``mask=False``: checked before, :func:`check_cp_mask`) an ``attention_mask`` that pads. ``model`` is the cp
    model or its :class:`CPApplied` (no module walk); ``batch`` a :func:`shard_batch` batch (this rank's part),
    ``cp`` the cp size. Without this check the same refusals come from the attention call (after FSDP's
    all-gathers)."""
    local = batch.get("input_ids") if isinstance(batch, dict) else None
    if not isinstance(local, torch.Tensor):
        return
    seq_len = cp * local.shape[1]
    window = model.window if isinstance(model, CPApplied) else _window_of(model)
    if window is not None and window[0] < seq_len:
        raise ValueError(_window_refusal(window[1], window[0], seq_len, window[2]))
    if mask:
        check_cp_mask(batch, cp)


def check_cp_mask(batch: Any, cp: int) -> None:
    """Refuse a batch whose ``attention_mask`` pads some tokens (cp computes unpadded causal attention). On a
    host tensor it costs nothing; on an accelerator it waits for the device, so NDParallelStrategy checks the
    batch before moving it (``batch_to_device``).

    >>> check_cp_mask({"attention_mask": torch.ones(1, 4, dtype=torch.bool)}, cp=2)
    """
    mask = batch.get("attention_mask") if isinstance(batch, dict) else None
    if isinstance(mask, torch.Tensor) and not bool(mask.all()):
        raise ValueError(f"NDParallelStrategy(cp={cp}): the batch's `attention_mask` pads some tokens; {_MASK_REFUSAL}")


def _window_of(model: nn.Module) -> tuple[int, str, Any] | None:
    """The smallest :data:`CP_WINDOW` inside ``model``, with the config of the module that holds it."""
    limits = [(*getattr(m, CP_WINDOW), getattr(m, "config", None)) for m in model.modules()
              if getattr(m, CP_WINDOW, None) is not None]
    return min(limits, key=lambda limit: limit[0]) if limits else None


CP_POSITION_IDS = "_meshkit_cp_position_ids"
"""The attribute :func:`apply_context_parallel` sets on a transformers model whose family has a position rule
(:func:`meshkit.families.position_ids_of`); :func:`cp_position_ids` reads it."""


def cp_position_ids(module: nn.Module) -> Callable | None:
    """The position rule of the first cp model inside ``module`` that has one (for :func:`shard_batch`), else None."""
    return _first_mark(module, CP_POSITION_IDS)


def cp_applied(model: nn.Module) -> CPApplied | None:
    """The :class:`CPApplied` record of the first module in ``model`` (itself first) that
    :func:`apply_context_parallel` made context-parallel, or None. One module walk: resolve it once, at set-up.

    >>> cp_applied(nn.Linear(2, 2)) is None
    True
    """
    return _first_mark(model, CP_APPLIED)


def _first_mark(module: nn.Module, name: str) -> Any:
    """The first non-empty ``name`` attribute among ``module`` and its submodules (a mark cp set), else None."""
    return next((getattr(m, name) for m in module.modules() if getattr(m, name, None)), None)


def _shifted_labels_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """``labels=batch["input_ids"]`` or ``labels=batch["labels"]`` of a :func:`shard_batch` batch: pass the
    shifted labels as ``shift_labels`` (transformers would shift this rank's load-balanced shard otherwise),
    and the cp group's mean count of targets as ``num_items_in_batch`` (the ranks hold different counts when
    some targets are ignored, e.g. after each row's last token)."""
    labels = kwargs.get("labels")
    shifted = getattr(labels, "_meshkit_cp_shifted", None)
    if shifted is None or kwargs.get("shift_labels") is not None:
        return None
    kwargs["shift_labels"] = shifted
    if kwargs.get("num_items_in_batch") is None:
        kwargs["num_items_in_batch"] = num_items(labels)  # the cp group's targets / cp (shard_batch's record)
    return args, kwargs


def apply_context_parallel(
    model: nn.Module,
    cp_mesh: Group,
    attention: str = "ring",
    layout: str = "load_balanced",
    attention_modules: Callable[[str, nn.Module], bool] | None = None,
) -> nn.Module:
    """Make ``model`` attend over the whole sequence while each cp rank holds ``T / cp`` of it; in place.

    - transformers models (``config._attn_implementation``), at the root or inside (e.g. in a LightningModule):
      a meshkit attention function is registered in transformers' ``AttentionInterface`` and selected, after
      :func:`check_cp_forward` has shown on the family's tiny twin, in this process, that cp computes what one
      process computes (refused before any collective otherwise). A family deriving its position ids from the
      token ids (:func:`meshkit.families.position_ids_of`) is fed them from :func:`shard_batch`'s
      ``position_ids=`` (:func:`cp_position_ids` of the model), computed on the whole sequence.
    - other models (torchtitan-style, e.g. :class:`meshkit.models.llama.Transformer`): inside each attention
      module's forward (classes named ``*Attention``, or those ``attention_modules(name, module)`` selects),
      calls to ``F.scaled_dot_product_attention`` go to :func:`context_parallel_attention`. The swap is a
      TorchFunctionMode scoped to those forwards, so activation-checkpoint recomputation sees it too.
    - a transformers ``...ForCausalLM`` called with ``labels=`` a :func:`shard_batch` batch's ``input_ids``
      or ``labels`` gets ``shift_labels=`` the batch's (already shifted) labels, so the HF idiom
      ``model(input_ids=ids, labels=ids).loss`` gives the one-process loss.
    - where the model (or its outermost submodule taking ``positions``/``position_ids``, e.g. a
      LightningModule's inner Transformer) is called without positions, they are filled with the global
      positions of the local tokens, so rotary embeddings are right.

    Feed it the batches of :func:`shard_batch` (same ``layout``). Returns ``model``.

    Example::

        >>> model = Transformer(LlamaConfig.tiny())                                  # doctest: +SKIP
        >>> model = apply_context_parallel(model, mesh["cp"], attention="ring")      # doctest: +SKIP
        >>> local = shard_batch(tokens, mesh["cp"])  # (B, T+1) tokens -> T/cp each  # doctest: +SKIP
        >>> logits = model(local["input_ids"], local["positions"])                   # doctest: +SKIP
    """
    if attention not in CP_ATTENTIONS:
        raise ValueError(f"apply_context_parallel: `attention={attention!r}` is not one of {CP_ATTENTIONS}.")
    if layout not in CP_LAYOUTS:
        raise ValueError(f"apply_context_parallel: `layout={layout!r}` is not one of {CP_LAYOUTS}.")
    group = process_group(cp_mesh)
    hf_models = _outermost(model, lambda m: hasattr(getattr(m, "config", None), "_attn_implementation"))
    for hf_model in hf_models:
        check_cp_forward(hf_model, dist.get_world_size(group), layout)  # one process, before any collective
    for hf_model in hf_models:
        from meshkit.families import position_ids_of

        setattr(hf_model, CP_POSITION_IDS, position_ids_of(hf_model))
        _use_hf_attention(hf_model, group, attention, layout)
        if hasattr(hf_model, "loss_function"):  # a ...ForCausalLM: `labels=` must not shift the local shard
            hf_model.register_forward_pre_hook(_shifted_labels_hook, with_kwargs=True)
    in_hf = {id(m) for hf_model in hf_models for m in hf_model.modules()}
    select = attention_modules or (lambda _name, m: type(m).__name__.endswith("Attention"))
    targets = [m for n, m in model.named_modules() if id(m) not in in_hf and select(n, m)]
    if not hf_models and not targets:
        raise ValueError(
            f"apply_context_parallel: found no attention module in {type(model).__name__} (no transformers model, "
            "no class named '*Attention'); pass `attention_modules=lambda name, module: ...` to choose them."
        )
    for module in targets:
        _install_mode(module, group, attention, layout)
    for module in _outermost(model, lambda m: _position_key(m) is not None):
        has_rule = _first_mark(module, CP_POSITION_IDS) is not None
        hook = _position_hook(group, layout, _position_key(module), has_rule)
        module.register_forward_pre_hook(hook, with_kwargs=True)
    setattr(model, CP_APPLIED, CPApplied(layout, cp_position_ids(model), _window_of(model)))
    return model


def context_parallel_layout(model: nn.Module) -> str | None:
    """The ``layout`` :func:`apply_context_parallel` made ``model`` (or a module inside it) context-parallel
    with, or None when nothing in it was: its attention would see only this rank's share of each sequence.

    >>> import torch.nn as nn
    >>> context_parallel_layout(nn.Linear(2, 2)) is None
    True
    """
    applied = cp_applied(model)
    return applied.layout if applied is not None else None


def _use_hf_attention(model: nn.Module, group: ProcessGroup, attention: str, layout: str) -> None:
    """Register a cp attention function with transformers and select it for ``model``."""
    from transformers import AttentionInterface

    name = f"meshkit_cp_{attention}_{next(_HF_NAMES)}"
    AttentionInterface.register(name, _hf_attention_fn(group, attention, layout))
    if hasattr(model, "set_attn_implementation"):  # transformers >= 4.56: also updates sub-configs
        model.set_attn_implementation(name)
    else:
        model.config._attn_implementation = name


def _position_key(module: nn.Module) -> str | None:
    params = inspect.signature(module.forward).parameters
    return next((k for k in POSITION_KEYS if k in params), None)


def _outermost(model: nn.Module, pred: Callable[[nn.Module], bool]) -> list[nn.Module]:
    """The modules satisfying ``pred`` with no ancestor satisfying it (e.g. a LightningModule's inner
    Transformer taking ``positions``, or a transformers ...ForCausalLM but not its inner model)."""
    found, todo = [], [model]
    while todo:
        module = todo.pop(0)
        if pred(module):
            found.append(module)
        else:
            todo.extend(module.children())
    return found


def _install_mode(module: nn.Module, group: ProcessGroup, attention: str, layout: str) -> None:
    active: list[_SDPAToCP] = []

    def enter(_m: nn.Module, _args: Any) -> None:
        mode = _SDPAToCP(group, attention, layout)
        mode.__enter__()
        active.append(mode)

    def leave(_m: nn.Module, _args: Any, _out: Any) -> None:
        active.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)
