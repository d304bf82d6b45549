"""Stage split for layer-stack models: find the blocks, balance them, cut the model into stage copies.

Private to :mod:`meshkit.plugins.pipeline`, which re-exports the public names.

A stage is a deep copy of the whole model with the other stages' blocks deleted and the pieces it
does not own (embedding on all but the first stage; final norm and head on all but the last) set to
None, so every parameter keeps its full-model FQN (torchtitan's approach; ``layers.5.attention.wq.weight``
is the same name at pp=1, 2 or 4, which is what lets a checkpoint move between pipeline sizes).
A ModuleList of blocks becomes a ModuleDict keyed by the original indices for the same reason.

The model's own forward usually does not skip None modules, so each stage gets a *stage forward*
bound as its instance ``forward`` (:data:`STAGE_FORWARDS`): it takes the first stage's inputs (token
ids) or the previous stage's hidden states and returns hidden states, or logits on the last stage.
A transformers causal LM's stage forward runs the family's own ``forward`` (never a re-implementation
of its math), and :func:`check_stage_forward` proves that on the family's tiny twin before anything is
split, or refuses the model naming what differs and the fixes (a ``pipeline_stage_forward`` hook, or
``configure_model``).
"""

from __future__ import annotations

import copy
import types
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn


@dataclass(frozen=True)
class LayerStack:
    """Where a layer-stack model keeps its pieces (FQNs relative to the model)."""

    blocks: str
    """The ModuleList / ModuleDict of repeated blocks, e.g. "layers" or "model.layers"."""
    block_names: tuple[str, ...]
    """The blocks' keys in forward order ("0", "1", ...)."""
    first: tuple[str, ...]
    """Modules that run before the blocks and go to the first stage (embeddings)."""
    last: tuple[str, ...]
    """Modules that run after the blocks and go to the last stage (final norm, LM head)."""
    family: str
    """Which stage forward runs the pieces: a key of :data:`STAGE_FORWARDS`, or "native"."""


# ---- stage forwards: (stage module, input) -> output; they skip the pieces set to None -----------------


def _meshkit_stage_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """meshkit ``Transformer``: tokens (B, T) or hidden (B, T, D) -> hidden (B, T, D) or logits (B, T, V).

    Positions are 0..T-1 (the model's default); rotary angles are recomputed on every stage.
    """
    h = self.tok_embeddings(x) if self.tok_embeddings is not None else x  # (B, T, D)
    h = self.forward_blocks(h)  # this stage's blocks
    if self.norm is not None:
        h = self.norm(h)
    return self.output(h) if self.output is not None else h


class _StageExit(Exception):
    """Raised by the first block position past this stage's blocks: carries the stage's output hidden states."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__("pipeline stage output")
        self.hidden = hidden


class _Elsewhere(nn.Module):
    """Stands, for one forward, at the block positions another stage holds.

    Before this stage's blocks it returns the stage's input (the previous stage's hidden states, whatever the
    family computed from its placeholder embeddings); after them it ends the forward with the hidden states it
    is handed (:class:`_StageExit`).
    """

    def __init__(self, stage_input: torch.Tensor | None, attention_type: str | None) -> None:
        super().__init__()
        self.stage_input = stage_input
        self.attention_type = attention_type  # what a family's loop may read off a block (its layer type)

    def forward(self, hidden_states: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        if self.stage_input is None:
            raise _StageExit(hidden_states)
        return self.stage_input


def _hf_stage_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """HF ``*ForCausalLM``: input ids or hidden states -> hidden states or logits, by the family's own forward.

    The family's ``forward`` (``type(self).forward``: its embedding-side work, masks, rotary tables per layer
    type, its loop over ``model.layers``, final norm, head and head-side work such as a logit scale or a
    soft-cap) runs with ``model.layers`` set, for this call, to the full-length list of block positions:
    this stage's blocks at their own indices and :class:`_Elsewhere` at the others. A stage after the first
    is called with zero ``inputs_embeds`` of the incoming shape (its embedding is None) and the positions
    before its blocks hand on ``x``; a stage before the last ends at the first position past its blocks.
    Nothing of the family's math is re-implemented; what this cannot reproduce (a forward that reads the
    token ids past the embedding, or carries more than the hidden states between blocks) is found by
    :func:`check_stage_forward` on the family's tiny twin, which refuses it.
    """
    inner = self.model
    stored = inner._modules["layers"]  # the ModuleDict of this stage's blocks, keyed by their original index
    present = sorted(int(k) for k in stored.keys())
    total = getattr(self, "_meshkit_num_blocks", None) or int(inner.config.num_hidden_layers)
    kinds = getattr(inner.config, "layer_types", None) or [None] * total
    stage_input = x if inner.embed_tokens is None else None
    positions = [
        stored[str(i)] if str(i) in stored else _Elsewhere(stage_input if i < present[0] else None, kinds[i])
        for i in range(total)
    ]
    first = inner.embed_tokens is not None
    inputs = dict(input_ids=x) if first else dict(inputs_embeds=torch.zeros_like(x))
    inner._modules["layers"] = nn.ModuleList(positions)
    try:
        out = type(self).forward(self, **inputs, use_cache=False)
    except _StageExit as done:
        return done.hidden
    finally:
        inner._modules["layers"] = stored
    return out.logits


STAGE_FORWARDS: dict[str, Callable[..., torch.Tensor]] = {
    "meshkit": _meshkit_stage_forward,
    "hf_causal_lm": _hf_stage_forward,
}
"""Stage forwards by model family. "native" (torchtitan-style models, whose forward already skips
None modules, or a model defining ``pipeline_stage_forward``) keeps the model's own method."""


# ---- finding the stack -----------------------------------------------------------------------------------


def _same_class_children(module: nn.Module) -> bool:
    kids = list(module.children())
    return len(kids) >= 2 and len({type(k) for k in kids}) == 1


def _block_containers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and _same_class_children(m)
    ]


def _has(model: nn.Module, path: str) -> bool:
    try:
        model.get_submodule(path)
        return True
    except AttributeError:
        return False


def _unsplittable(model: nn.Module, why: str) -> ValueError:
    found = [f"{n} ({len(list(m.children()))} × {type(next(m.children())).__name__})" for n, m in _block_containers(model)]
    return ValueError(
        f"pipeline: cannot split `model` ({type(model).__name__}) into stages: {why}. meshkit splits layer-stack "
        "models; the model must expose (1) its repeated blocks as one nn.ModuleList or nn.ModuleDict of modules of one "
        "class, each taking and returning the hidden states; (2) the embedding(s) before the blocks and the final norm "
        "and LM head after them as attributes; (3) a forward that runs on any stage. Recognised layouts: meshkit's "
        "Transformer; HF *ForCausalLM with model.embed_tokens / model.layers / model.norm / lm_head; torchtitan-style "
        "tok_embeddings / layers / norm / output whose forward skips the ones set to None. Any other model can define "
        "`pipeline_stage_forward(self, x)` next to torchtitan names. "
        f"Block containers found: {found or 'none'}."
    )


_HF_PATHS = ("model.embed_tokens", "model.layers", "model.norm", "lm_head")


def _is_hf_causal_lm(model: nn.Module) -> bool:
    return hasattr(getattr(model, "config", None), "num_hidden_layers") and all(_has(model, p) for p in _HF_PATHS)


def _hf_stack(model: nn.Module) -> LayerStack:
    return _checked_stack(model, "model.layers", ("model.embed_tokens",), ("model.norm", "lm_head"), "hf_causal_lm")


def _checked_stack(model: nn.Module, blocks: str, first: tuple[str, ...], last: tuple[str, ...], family: str) -> LayerStack:
    container = model.get_submodule(blocks)
    if not isinstance(container, (nn.ModuleList, nn.ModuleDict)) or not _same_class_children(container):
        raise _unsplittable(model, f"`{blocks}` is not a ModuleList/ModuleDict of at least 2 blocks of one class")
    names = tuple(container.keys()) if isinstance(container, nn.ModuleDict) else tuple(str(i) for i in range(len(container)))
    return LayerStack(blocks, names, first, last, family)


def find_layer_stack(model: nn.Module) -> LayerStack:
    """Locate the repeated blocks, the pre-block and the post-block modules of ``model``.

    >>> from meshkit.models import LlamaConfig, Transformer
    >>> find_layer_stack(Transformer(LlamaConfig.tiny())).first
    ('tok_embeddings',)
    """
    from meshkit.models.llama import Transformer

    if isinstance(model, Transformer):
        blocks, first, last, family = "layers", ("tok_embeddings",), ("norm", "output"), "meshkit"
    elif _is_hf_causal_lm(model):
        head, emb = model.get_submodule("lm_head"), model.get_submodule("model.embed_tokens")
        if getattr(head, "weight", None) is not None and head.weight is getattr(emb, "weight", None):
            raise ValueError(
                f"pipeline: `model` ({type(model).__name__}) ties lm_head.weight to model.embed_tokens.weight, but the "
                "embedding lives on the first stage and the head on the last. Build it with `tie_word_embeddings=False`."
            )
        if hasattr(model, "pipeline_stage_forward"):  # the family's own stage hook: it answers for itself
            return _checked_stack(model, "model.layers", ("model.embed_tokens",), ("model.norm", "lm_head"), "native")
        stack = _hf_stack(model)
        check_stage_forward(model)
        return stack
    elif all(_has(model, p) for p in ("tok_embeddings", "layers", "norm", "output")):
        blocks, first, last, family = "layers", ("tok_embeddings",), ("norm", "output"), "native"
    else:
        raise _unsplittable(model, "its layout is not one meshkit knows")
    return _checked_stack(model, blocks, first, last, family)


# ---- the proof on the family's tiny twin ---------------------------------------------------------------------

_CHECKED: dict[tuple[type, str], str | None] = {}


def check_stage_forward(model: nn.Module) -> None:
    """Refuse an HF causal LM whose stages would not compute its own forward, before anything is split.

    Builds the family's tiny twin (:func:`meshkit.families.tiny_twin`: same class, 2 layers, float64), cuts it
    into two stages of one block and compares, on fixed token ids, the first stage's output with the output of
    ``model.layers.0`` in the twin's own forward and the chained logits with its own logits. A mismatch, or any
    error the stage forward raises, is a ``ValueError`` naming the class, the side that differs and the fixes.
    One check per class and config.

    >>> import transformers
    >>> check_stage_forward(transformers.LlamaForCausalLM(transformers.LlamaConfig(
    ...     vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)))
    """
    key = (type(model), model.config.to_json_string(use_diff=False))
    if key not in _CHECKED:
        _CHECKED[key] = _stage_forward_mismatch(model)
    if _CHECKED[key] is not None:
        raise ValueError(_CHECKED[key])


def _stage_forward_mismatch(model: nn.Module) -> str | None:
    from meshkit.families.twin import TWIN_RTOL, TWIN_RTOL_FLOAT32, relative_error, tiny_twin

    name = type(model).__name__
    head = f"pipeline: meshkit cannot show that its stages of `{name}` compute {name}.forward"
    fix = (
        f"Give {name} a per-family stage hook: a subclass defining `pipeline_stage_forward(self, x)` (token ids on "
        "the first stage or the previous stage's hidden states in; hidden states, or logits on the last stage, out; "
        "`model.embed_tokens` is None on all stages but the first, `model.norm` and `lm_head` on all but the last, "
        "`model.layers` holds the stage's blocks by their original index), or parallelize the model yourself in "
        "`configure_model` without pp."
    )
    try:
        twin = tiny_twin(model)
        stack = _hf_stack(twin)
    except Exception as e:  # noqa: BLE001 -- any failure to build the twin means nothing was shown
        return f"{head}: its 2-layer twin (to check the split on) could not be built ({type(e).__name__}: {e}). {fix}"
    vocab = int(twin.config.vocab_size)
    ids = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(0))
    seen: dict[str, torch.Tensor] = {}

    def capture(_m: nn.Module, _a: object, out: object) -> None:
        seen["block0"] = out[0] if isinstance(out, tuple) else out

    first_block = twin.get_submodule(f"{stack.blocks}.{stack.block_names[0]}")
    rtol = TWIN_RTOL
    with torch.no_grad():
        hook = first_block.register_forward_hook(capture)
        try:
            try:
                want = twin(input_ids=ids, use_cache=False).logits
            except RuntimeError:  # e.g. grouped MoE matmuls have no float64 kernel on CPU: the same check in float32
                twin, rtol = twin.float(), TWIN_RTOL_FLOAT32
                want = twin(input_ids=ids, use_cache=False).logits
        except Exception as e:  # noqa: BLE001
            return f"{head}: its 2-layer twin's own forward failed ({type(e).__name__}: {e}). {fix}"
        finally:
            hook.remove()
        try:
            stages = [build_stage_module(twin, stack, i, 2, [1]) for i in (0, 1)]
            mid = stages[0](ids)
            got = stages[1](mid)
        except Exception as e:  # noqa: BLE001 -- e.g. a rotary embedding or a block taking arguments meshkit does not pass
            return f"{head}: on its 2-layer twin the stage forward raised {type(e).__name__}: {e}. {fix}"

    off = relative_error
    block0 = f"{stack.blocks}.{stack.block_names[0]}"
    if "block0" not in seen or off(mid, seen["block0"]) > rtol:
        err = off(mid, seen["block0"]) if "block0" in seen else float("nan")
        return (
            f"{head}: on its 2-layer twin the first stage's output differs from `{block0}`'s output in the "
            f"model's own forward (relative error {err:.1e}): its forward passes {block0} more than the embedding "
            f"side's hidden states, or its blocks return more than them. {fix}"
        )
    if off(got, want) > rtol:
        return (
            f"{head}: on its 2-layer twin the chained stages' logits differ from the model's own "
            f"(relative error {off(got, want):.1e}) while the first stage agrees with `{block0}`: a later stage "
            "does not see what the model's own forward hands its later blocks, norm or `lm_head` (e.g. the token "
            f"ids, or state carried beside the hidden states). {fix}"
        )
    return None


# ---- cost model and balanced split -------------------------------------------------------------------------


def _cost(module: nn.Module, cost: str) -> float:
    if cost == "params":
        return float(sum(p.numel() for p in module.parameters()))
    if cost == "flops":
        # Forward FLOPs per token of the matmuls, 2·(in·out) per Linear (attention scores are left out:
        # they are equal per block, so they do not move a split). Embedding lookups cost nothing.
        return float(sum(2 * m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear)))
    raise ValueError(f"pipeline: `cost={cost!r}` must be 'params' or 'flops'.")


def stack_costs(model: nn.Module, stack: LayerStack, cost: str = "params") -> tuple[list[float], float, float]:
    """(per-block costs, first-stage extra, last-stage extra) under the cost model ``cost``."""
    container = model.get_submodule(stack.blocks)
    blocks = [_cost(container[n] if isinstance(container, nn.ModuleDict) else container[int(n)], cost) for n in stack.block_names]
    first = sum(_cost(model.get_submodule(p), cost) for p in stack.first)
    last = sum(_cost(model.get_submodule(p), cost) for p in stack.last)
    return blocks, first, last


def balanced_split_points(block_costs: list[float], num_stages: int, first_cost: float = 0.0, last_cost: float = 0.0) -> list[int]:
    """Block indices where stages 1..S-1 start, minimising the costliest stage (each stage ≥ 1 block).

    The first stage also pays ``first_cost`` (embeddings) and the last ``last_cost`` (norm + head), so
    they get fewer blocks when those are heavy. Exact: dynamic programming over contiguous splits.

    >>> balanced_split_points([1.0] * 8, 4, first_cost=2.0, last_cost=2.0)
    [1, 4, 7]
    """
    n = len(block_costs)
    if num_stages > n:
        raise ValueError(
            f"pipeline: the model has {n} blocks but the pipeline needs `num_stages={num_stages}` (pp × pp_virtual_stages) "
            "stages of at least one block each. Lower pp or pp_virtual_stages, or use a deeper model."
        )
    prefix = [0.0]
    for c in block_costs:
        prefix.append(prefix[-1] + c)

    def load(s: int, i: int, j: int) -> float:  # stage s holds blocks i..j-1
        return prefix[j] - prefix[i] + (first_cost if s == 0 else 0.0) + (last_cost if s == num_stages - 1 else 0.0)

    inf = float("inf")
    # best[s][j]: smallest max-load placing blocks 0..j-1 on stages 0..s-1; cut[s][j]: where stage s-1 starts.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for j in range(s, n - (num_stages - s) + 1):
            for i in range(s - 1, j):
                cand = max(best[s - 1][i], load(s - 1, i, j))
                if cand < best[s][j] - 1e-9:
                    best[s][j], cut[s][j] = cand, i
    points, j = [], n
    for s in range(num_stages, 1, -1):
        j = cut[s][j]
        points.append(j)
    return sorted(points)


def check_split_points(split_points: list[int], num_blocks: int, num_stages: int) -> list[int]:
    """Validate user ``pp_split_points`` (block indices where stages 1..S-1 start)."""
    pts = list(split_points)
    ok = (
        len(pts) == num_stages - 1
        and all(isinstance(p, int) and not isinstance(p, bool) for p in pts)
        and all(a < b for a, b in zip([0] + pts, pts + [num_blocks]))
    )
    if not ok:
        raise ValueError(
            f"pipeline: `pp_split_points={pts}` must be {num_stages - 1} strictly increasing block indices in "
            f"1..{num_blocks - 1} (where stages 1..{num_stages - 1} start, every stage at least one block), for "
            f"{num_blocks} blocks and {num_stages} stages; e.g. {balanced_split_points([1.0] * num_blocks, num_stages) if num_stages <= num_blocks else '[]'}."
        )
    return pts


# ---- cutting the model -------------------------------------------------------------------------------------


def _set_submodule(model: nn.Module, path: str, value: nn.Module | None) -> None:
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, value)


def _cut(model: nn.Module, stack: LayerStack, keep: set[str], has_first: bool, has_last: bool) -> nn.Module:
    """A deep copy of ``model`` with only the blocks in ``keep`` (a ModuleDict keyed by their original names)."""
    container = model.get_submodule(stack.blocks)
    _set_submodule(model, stack.blocks, None)  # deep-copy without the blocks, then copy only the kept ones
    try:
        module = copy.deepcopy(model)
    finally:
        _set_submodule(model, stack.blocks, container)
    kept = nn.ModuleDict()
    for name in stack.block_names:
        if name in keep:
            kept[name] = copy.deepcopy(container[name] if isinstance(container, nn.ModuleDict) else container[int(name)])
    _set_submodule(module, stack.blocks, kept)
    for paths, owned in ((stack.first, has_first), (stack.last, has_last)):
        if not owned:
            for path in paths:
                _set_submodule(module, path, None)
    return module


def _stage_blocks(stack: LayerStack, stage: int, split_points: list[int]) -> set[str]:
    bounds = [0] + list(split_points) + [len(stack.block_names)]
    return set(stack.block_names[bounds[stage] : bounds[stage + 1]])


def _bind_stage_forward(module: nn.Module, stack: LayerStack) -> nn.Module:
    module._meshkit_num_blocks = len(stack.block_names)  # the block positions the family's own loop walks
    if stack.family in STAGE_FORWARDS:
        module.forward = types.MethodType(STAGE_FORWARDS[stack.family], module)
    elif hasattr(module, "pipeline_stage_forward"):
        module.forward = module.pipeline_stage_forward
    return module


def build_stage_module(model: nn.Module, stack: LayerStack, stage: int, num_stages: int, split_points: list[int]) -> nn.Module:
    """A copy of ``model`` holding only stage ``stage``'s blocks (and the embedding / head if first / last)."""
    module = _cut(model, stack, _stage_blocks(stack, stage, split_points), stage == 0, stage == num_stages - 1)
    return _bind_stage_forward(module, stack)


def build_rank_module(
    model: nn.Module, stack: LayerStack, stages: tuple[int, ...], num_stages: int, split_points: list[int]
) -> nn.Module:
    """One copy of ``model`` holding every block of ``stages`` (this rank's): the module a Lightning
    strategy keeps in place of the model, so optimizers and checkpoints see full-model FQNs."""
    keep = set().union(*(_stage_blocks(stack, s, split_points) for s in stages))
    return _cut(model, stack, keep, 0 in stages, num_stages - 1 in stages)


def _shallow(module: nn.Module) -> nn.Module:
    view = copy.copy(module)
    for key, value in list(vars(view).items()):
        if isinstance(value, dict):  # _modules, _parameters, _buffers, hook dicts: the view's own
            setattr(view, key, type(value)(value) if type(value) is not dict else dict(value))
    return view


def stage_view(rank_module: nn.Module, stack: LayerStack, stage: int, num_stages: int, split_points: list[int]) -> nn.Module:
    """Stage ``stage`` of a :func:`build_rank_module` module, sharing its blocks and parameters.

    Only the modules on the paths to the blocks, embedding, norm and head are shallow-copied, so
    TP or FSDP applied to the rank module's blocks is what the stage runs.
    """
    view = _shallow(rank_module)
    copied = {"": view}

    def parent_of(path: str) -> nn.Module:
        parent, _, _ = path.rpartition(".")
        parts = parent.split(".") if parent else []
        for i in range(len(parts)):
            prefix = ".".join(parts[: i + 1])
            if prefix not in copied:
                copied[prefix] = _shallow(getattr(copied[".".join(parts[:i])], parts[i]))
                setattr(copied[".".join(parts[:i])], parts[i], copied[prefix])
        return copied[parent]

    container = rank_module.get_submodule(stack.blocks)
    blocks = nn.ModuleDict({n: container[n] for n in stack.block_names if n in _stage_blocks(stack, stage, split_points)})
    setattr(parent_of(stack.blocks), stack.blocks.rpartition(".")[2], blocks)
    for paths, owned in ((stack.first, stage == 0), (stack.last, stage == num_stages - 1)):
        if not owned:
            for path in paths:
                setattr(parent_of(path), path.rpartition(".")[2], None)
    return _bind_stage_forward(view, stack)
