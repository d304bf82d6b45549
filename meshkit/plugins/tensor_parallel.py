"""The automatic tensor-parallel plan: module names and shapes -> ``parallelize_module`` styles.

Recognised (the last component of each module's name):

====================  ==========================================================
colwise (Shard(0))    ``q_proj k_proj v_proj gate_proj up_proj`` (HF Llama family),
                      ``wq wk wv w1 w3`` (torchtitan)
rowwise (Shard(1))    ``o_proj down_proj`` (HF), ``wo w2`` (torchtitan)
embedding (rowwise)   any ``nn.Embedding`` whose rows are the vocabulary
LM head (colwise)     ``lm_head`` (HF), ``output`` (torchtitan)
====================  ==========================================================

Inside each attention / MLP block the projections leave TP-local heads, so the block's other
parameters see only their rank's part of the activations: per-head norms (Qwen3 / Gemma 3
``q_norm``, weight of one head's width) are replicated and get their gradient summed over tp;
full-width norms (OLMo2 ``q_norm``, weight as wide as the projection) gather the heads to normalize.
A tied embedding / LM head stays one parameter, vocab-sharded (``Shard(0)``) for both uses.

A projection it cannot place (any other Linear, a GPT-2 ``Conv1D``, a fused ``qkv_proj`` /
``gate_up_proj`` whose slicing assumes all heads) raises, listing every such module and a plan
that works: keep the blocks holding them whole, ``tp_plan={"model.layers.*.mlp.*": "replicate"}``
(fnmatch patterns over the module names the error prints), or pass your own ``ParallelStyle``.

Example::

    >>> from meshkit.models import LlamaConfig, Transformer
    >>> from meshkit.plugins.tensor_parallel import infer_tp_plan
    >>> plan = infer_tp_plan(Transformer(LlamaConfig.tiny()))
    >>> type(plan["layers.0.attention.wq"]).__name__, type(plan["layers.0.attention.wo"]).__name__
    ('ColwiseParallel', 'RowwiseParallel')
"""

from __future__ import annotations

import fnmatch
import inspect
import re
from typing import Any, Union

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from meshkit.modelspec import read_shape

__all__ = [
    "infer_tp_plan", "apply_tp", "check_tp_forward", "tp_widths", "PlanEntry", "LocalShardNorm", "PrepareHidden",
    "quiet_local_logits_warning",
]

PlanEntry = Union[str, ParallelStyle]

COLWISE = frozenset({"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "wq", "wk", "wv", "w1", "w3"})
ROWWISE = frozenset({"o_proj", "down_proj", "wo", "w2"})
LM_HEADS = frozenset({"lm_head", "output"})
_NORM_TYPES = ("RMSNorm", "LayerNorm")


def tp_widths(model: nn.Module) -> tuple[int | None, int | None, int | None]:
    """The widths tp must divide: (attention heads, kv heads, hidden size) of the config ``model`` holds
    (:func:`meshkit.modelspec.read_shape`), else Nones. (A model's full shape is ``read_shape``'s record;
    :func:`meshkit.profiling.flops.model_shape` is the FLOPs view of it.)

    >>> from meshkit.models import LlamaConfig, Transformer
    >>> tp_widths(Transformer(LlamaConfig.tiny()))
    (4, 2, 64)
    """
    try:
        shape = read_shape(model)
    except ValueError:
        return None, None, None
    return shape.heads, shape.kv_heads, shape.hidden


def _style(entry: PlanEntry, name: str) -> ParallelStyle | None:
    if isinstance(entry, ParallelStyle):
        return entry
    table = {"colwise": ColwiseParallel(), "rowwise": RowwiseParallel(), "replicate": None}
    if entry not in table:
        raise ValueError(
            f"tp_plan: `{name}={entry!r}` is not a ParallelStyle nor one of 'colwise', 'rowwise', 'replicate'."
        )
    return table[entry]


def _is_hf(model: nn.Module) -> bool:
    return any(type(m).__module__.startswith("transformers.") for m in model.modules())


class LocalShardNorm(ParallelStyle):
    """A norm inside a TP block, applied to the rank's local heads (what the colwise projections leave).

    ``shard_params=False`` (per-head norm, weight of one head's width, e.g. Qwen3 ``q_norm``): the
    input is read as sharded on its heads (dim -2), the weight stays replicated and its gradient is
    summed over tp. ``shard_params=True`` (full-width norm, e.g. OLMo2 ``q_norm`` over all heads):
    the local columns are all-gathered, normalized with the whole (replicated) weight, and the rank's
    columns taken back, so the statistics span every head. The output is the local tensor again.

    Example::

        >>> plan = {"model.layers.*.self_attn.q_norm": LocalShardNorm(shard_params=False)}  # doctest: +SKIP
    """

    def __init__(self, *, shard_params: bool) -> None:
        super().__init__()
        self.shard_params = shard_params

    @staticmethod
    def _partition(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for p_name, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(p_name, nn.Parameter(distribute_tensor(param, mesh, [Replicate()])))

    def _input(self, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        x, rest = inputs[0], inputs[1:]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [Shard(x.ndim - (1 if self.shard_params else 2))], run_check=False)
        # Full width: gather the columns (the norm's mean runs over all of them); per head: stay local.
        return (x.redistribute(placements=[Replicate()]) if self.shard_params else x, *rest)

    def _output(self, module: nn.Module, outputs: Any, mesh: DeviceMesh) -> Any:
        if not isinstance(outputs, DTensor):
            return outputs
        if self.shard_params:
            outputs = outputs.redistribute(placements=[Shard(outputs.ndim - 1)])
        return outputs.to_local()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, self._partition, self._input, self._output)

    def __repr__(self) -> str:
        return f"LocalShardNorm(shard_params={self.shard_params})"


def infer_tp_plan(
    model: nn.Module,
    *,
    user_plan: dict[str, PlanEntry] | None = None,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
    prefix: str = "",
) -> dict[str, ParallelStyle]:
    """Build a ``parallelize_module`` plan (module FQN -> style) for every projection, embedding and
    the parameters inside TP blocks; raises (before any collective) for what it cannot place.

    ``user_plan`` entries (fnmatch patterns) win over the automatic rules; ``"replicate"`` leaves a
    module unsharded. ``sequence_parallel`` shards the norms and the residual stream between the TP
    blocks on the sequence dim (see :func:`_sequence_parallel_plan`). ``loss_parallel`` leaves the LM head's
    logits sharded on the vocab dim (the loss must then run under
    ``torch.distributed.tensor.parallel.loss_parallel()``, which the strategy does around ``training_step``
    and ``backward``). ``prefix`` is ``model``'s FQN in the module the user names (``"model."`` for a
    pipeline rank module inside a LightningModule): ``user_plan`` patterns and error messages use
    ``prefix + name``, so one ``tp_plan`` works at any pp; the returned plan's keys stay relative to ``model``.

    Example::

        >>> plan = infer_tp_plan(hf_model, user_plan={"model.layers.*.mlp.*": "replicate"})  # doctest: +SKIP
    """
    user_plan = dict(user_plan or {})
    hf = _is_hf(model)
    # transformers models build the mask and positions from the embedding output: it stays whole (see below).
    seq = Shard(1) if sequence_parallel and not hf else Replicate()
    plan: dict[str, ParallelStyle] = {}
    user_placed: set[str] = set()
    unplaced: list[str] = []
    block_inputs: dict[str, nn.Module] = {}  # blocks holding colwise projections: their activations are TP-local
    regions: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        if not name:
            continue
        leaf = name.rsplit(".", 1)[-1]
        matched = [p for p in user_plan if fnmatch.fnmatchcase(prefix + name, p)]
        if matched:
            style = _style(user_plan[matched[0]], matched[0])
            user_placed.add(name)
            if style is not None:
                plan[name] = style
            if isinstance(style, ColwiseParallel):
                regions[_parent(name)] = model.get_submodule(_parent(name))
            continue
        if isinstance(module, nn.Embedding) and _positional_arity(module) == 1 and not any(module.children()):
            # RowwiseParallel takes the first input as the ids; an embedding whose forward takes others (OPT's
            # learned positions: the attention mask first, the ids computed inside) stays whole (replicated), and
            # so does one holding modules of its own (Inkling's norm inside its embedding: the style would shard
            # the norm's weight as rows, a raw KeyError, and the norm would see one rank's partial rows).
            plan[name] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
        elif isinstance(module, nn.Linear) and leaf in LM_HEADS:
            plan[name] = ColwiseParallel(
                input_layouts=Shard(1) if sequence_parallel else Replicate(),
                output_layouts=Shard(-1) if loss_parallel else Replicate(),
                use_local_output=not loss_parallel,
            )
        elif isinstance(module, nn.Linear) and leaf in COLWISE:
            plan[name] = ColwiseParallel()
            block_inputs[_parent(name)] = model.get_submodule(_parent(name))
        elif isinstance(module, nn.Linear) and leaf in ROWWISE:
            plan[name] = RowwiseParallel(output_layouts=Shard(1) if sequence_parallel else Replicate())
        elif isinstance(module, nn.Linear):
            unplaced.append(f"{prefix}{name} ({module.in_features}->{module.out_features})")
        elif type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None:
            # transformers' GPT-2 projection: a Linear with a transposed (in, out) weight.
            unplaced.append(f"{prefix}{name} (Conv1D {module.weight.shape[0]}->{module.weight.shape[1]})")
    if unplaced:
        _refuse_unplaced(unplaced)
    _plan_local_params(model, plan, {**regions, **block_inputs}, user_placed, prefix)
    _check_ties(model, plan)
    if sequence_parallel:
        _sequence_parallel_plan(model, plan, block_inputs, regions, user_placed, prefix, hf)
    return plan


def _sequence_parallel_plan(
    model: nn.Module, plan: dict[str, ParallelStyle], block_inputs: dict[str, nn.Module],
    regions: dict[str, nn.Module], user_placed: set[str], prefix: str, hf: bool,
) -> None:
    """Add sequence parallelism to ``plan``: between the TP blocks each rank holds T/tp rows of the residual stream.

    Every module outside the TP blocks that holds parameters is a norm run as torch's ``SequenceParallel``
    (its parameters replicated, their gradients summed over tp), or refused. Each TP block gathers the
    sequence before its projections (its rowwise projection reduce-scatters it back). Where the sequence is
    cut: meshkit's and torchtitan-style models read positions from the tokens, so the embedding's output is
    reduce-scattered on the sequence. A transformers model builds the causal mask, the position ids and the
    rotary tables from its embedding output's length, so that output stays whole (all-reduced, as without SP)
    and the first decoder layer takes its rank's rows: mask and positions come from the global length, and
    the layers see the same tensors as one process.
    """
    blocks = {**regions, **block_inputs}
    inside = tuple(f"{b}." for b in blocks)
    stacks = tuple(f"{s}." for s, _ in _layer_stacks(model, blocks)) if hf else ()
    outside: list[str] = []
    whole: list[str] = []
    early: list[str] = []  # transformers: norms registered before the layers, which get the whole embedding output
    reached = not stacks
    for name, module in model.named_modules():
        reached = reached or f"{name}." in stacks
        if not name or name in plan or name in blocks or name.startswith(inside):
            continue
        if not any(True for _ in module.parameters(recurse=False)):
            continue
        if name in user_placed:
            whole.append(prefix + name)  # `tp_plan` "replicate": it would see only its rank's T/tp rows
        elif type(module).__name__.endswith(_NORM_TYPES):
            # Inside a transformers decoder layer, a local output: the residual adds, dropouts and post-norms around
            # it all see plain (B, T/tp, H) tensors. The norm after the layers (``model.norm``) hands on a DTensor
            # sharded on the sequence, so what reads the last hidden state knows they are this rank's rows: the LM
            # head gathers them, the fused loss (``fused_kernels=True``) takes them as they are.
            if not reached:
                early.append(f"{prefix}{name} ({type(module).__name__})")
            plan[name] = SequenceParallel(use_local_output=hf and name.startswith(stacks))
        else:
            outside.append(f"{prefix}{name} ({type(module).__name__})")
    if whole:
        raise ValueError(
            "tp_plan: `sequence_parallel=True` shards the residual stream on the sequence dim between the "
            "tensor-parallel blocks, and `tp_plan` keeps these modules whole (replicated): " + ", ".join(whole) + ". "
            "Each rank would run them on its T/tp rows only. Use `sequence_parallel=False` with that `tp_plan`."
        )
    if early:
        raise ValueError(
            "tp_plan: `sequence_parallel=True` on a transformers model keeps the embedding output whole and cuts the "
            "sequence at the first decoder layer, and these norms come before the layers: " + ", ".join(early) + ". "
            "They would take the whole sequence for one rank's T/tp rows. Use `sequence_parallel=False`."
        )
    if outside:
        raise ValueError(
            "tp_plan: `sequence_parallel=True` shards the residual stream on the sequence dim between the "
            "tensor-parallel blocks, and these modules there hold parameters that are neither a norm nor a "
            "projection: " + ", ".join(outside) + ". Each rank would see only its T/tp rows and get a partial "
            "gradient for them. Use `sequence_parallel=False`, or give each a style in `tp_plan=` (e.g. torch's "
            "`SequenceParallel()` for one applied row by row)."
        )
    for parent, module in blocks.items():
        # The attention / MLP block gathers the sequence-sharded residual stream before its projections.
        if hf:
            plan[parent] = PrepareHidden(Shard(1), Replicate())
        else:
            n_pos = _positional_arity(module)
            plan[parent] = PrepareModuleInput(
                input_layouts=(Shard(1),) + (None,) * (n_pos - 1),
                desired_input_layouts=(Replicate(),) + (None,) * (n_pos - 1),
            )
    if hf:
        layers = [first for _, first in _layer_stacks(model, blocks)]
        if not layers:
            raise ValueError(
                f"tp_plan: `sequence_parallel=True` on {type(model).__name__}: no decoder layer stack (a ModuleList "
                "of one class holding the tensor-parallel blocks) was found to cut the sequence at. Use "
                "`sequence_parallel=False`."
            )
        for name in layers:
            plan[name] = PrepareHidden(Replicate(), Shard(1), use_local_output=True)


def _layer_stacks(model: nn.Module, blocks: dict[str, nn.Module]) -> list[tuple[str, str]]:
    """(name, first entry's name) of each layer stack (ModuleList/ModuleDict of one class) holding TP blocks."""
    stacks = []
    for name, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            children = list(module.named_children())
            if len(children) < 1 or len({type(c) for _, c in children}) != 1:
                continue
            first = f"{name}.{children[0][0]}" if name else children[0][0]
            if any(b.startswith(f"{first}.") for b in blocks):
                stacks.append((name, first))
    return stacks


class PrepareHidden(ParallelStyle):
    """Re-lay the hidden states a module is called with: its first positional input, or the keyword
    argument named after its ``forward``'s first parameter (transformers' layers pass ``hidden_states=``).

    ``PrepareHidden(Shard(1), Replicate())`` gathers the sequence-sharded residual stream before a TP block;
    ``PrepareHidden(Replicate(), Shard(1), use_local_output=True)`` hands a decoder layer its rank's rows of the
    whole embedding output (the sequence length must divide by tp). torch's ``PrepareModuleInput`` needs to
    know which of the two call forms a module gets; this one takes either.

    Example::

        >>> from torch.distributed.tensor import Replicate, Shard
        >>> PrepareHidden(Shard(1), Replicate())
        PrepareHidden(S(1) -> R)
    """

    def __init__(self, input_layout: Any, desired_layout: Any, *, use_local_output: bool = False) -> None:
        super().__init__()
        self.input_layout, self.desired_layout, self.use_local_output = input_layout, desired_layout, use_local_output

    def _convert(self, x: Any, mesh: DeviceMesh) -> Any:
        if not isinstance(x, DTensor):
            if isinstance(self.desired_layout, Shard) and x.shape[self.desired_layout.dim] % mesh.size():
                raise ValueError(
                    f"NDParallelStrategy: `sequence_parallel=True` cuts the sequence into tp={mesh.size()} equal "
                    f"parts, but the hidden states are {tuple(x.shape)} (dim {self.desired_layout.dim} holds the "
                    "sequence). Pad or cut the sequences to a multiple of tp, or use `sequence_parallel=False`."
                )
            x = DTensor.from_local(x, mesh, [self.input_layout], run_check=False)
        if x.placements != (self.desired_layout,):
            x = x.redistribute(placements=[self.desired_layout])
        return x.to_local() if self.use_local_output else x

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        first = next(iter(inspect.signature(module.forward).parameters), None)

        def hook(_: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if args and isinstance(args[0], torch.Tensor):
                return (self._convert(args[0], device_mesh), *args[1:]), kwargs
            if first in kwargs and isinstance(kwargs[first], torch.Tensor):
                return args, {**kwargs, first: self._convert(kwargs[first], device_mesh)}
            raise ValueError(
                f"NDParallelStrategy: `sequence_parallel=True`: {type(module).__name__} was called without its hidden "
                f"states (neither a first positional tensor nor `{first}=`); use `sequence_parallel=False`."
            )

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module

    def __repr__(self) -> str:
        return f"PrepareHidden({self.input_layout} -> {self.desired_layout})"


def _parent(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


_LAYER_INDEX = re.compile(r"(?:^|(?<=\.))\d+(?=\.|$)")


def _replicate_fix(names: list[str], blocks: tuple[str, ...] = ()) -> str:
    """The ``tp_plan`` that keeps whole the layer blocks holding ``names`` (module FQNs; layer indices as ``*``).

    A module outside every layer block (no layer index in its parent's path, e.g. OPT's ``decoder.project_in``
    beside ``decoder.embed_tokens``) is named alone: a glob over its parent would replicate the embedding or the
    LM head too, and a tied pair then gets two placements (refused). ``blocks`` are kept whole entirely.

    >>> _replicate_fix(["model.layers.0.mlp.fc1", "model.decoder.project_in"])
    '{"model.decoder.project_in": "replicate", "model.layers.*.mlp.*": "replicate"}'
    """
    keys = {_LAYER_INDEX.sub("*", b) + ".*" for b in blocks}
    for name in names:
        parent = _parent(name)
        keys.add(_LAYER_INDEX.sub("*", parent) + ".*" if _LAYER_INDEX.search(parent) else name)
    return "{" + ", ".join(f'"{k}": "replicate"' for k in sorted(keys)) + "}"


def _refuse_unplaced(unplaced: list[str]) -> None:
    """Raise naming every projection the plan cannot place, with a plan that keeps their blocks whole."""
    example = _replicate_fix([u.split(" ")[0] for u in unplaced])
    raise ValueError(
        "tp_plan: the automatic tensor-parallel plan cannot place these projections: " + ", ".join(unplaced) + ". "
        "A fused projection (qkv_proj, gate_up_proj, GPT-2 c_attn) or an unknown one cannot be split by rows "
        "alone: its block slices the output assuming every head and column, and its partner projections must "
        "match. Keep the blocks holding them whole (every projection in them replicated; the embedding and LM "
        f"head stay sharded): `NDParallelStrategy(tp_plan={example})`, or give each projection of those "
        "blocks a style that keeps each rank's heads and MLP columns whole ('colwise' for one producing whole "
        "heads, 'rowwise' for the one consuming them, or a torch ParallelStyle)."
    )


def _plan_local_params(
    model: nn.Module, plan: dict[str, ParallelStyle], blocks: dict[str, nn.Module], user_placed: set[str],
    prefix_user: str = "",
) -> None:
    """Place the parameters of TP blocks that no projection style owns: they see TP-local activations."""
    refused: list[str] = []
    containers: list[str] = []
    for parent, block in blocks.items():
        prefix = f"{parent}." if parent else ""
        widths = {
            m.out_features for n, m in block.named_children()
            if isinstance(plan.get(prefix + n), ColwiseParallel) and isinstance(m, nn.Linear)
        }
        direct = [n for n, _ in block.named_parameters(recurse=False)]
        if direct:
            refused.append(f"{prefix_user}{parent}.{direct[0]} (parameters {direct} on the block {parent or type(block).__name__} itself)")
        for n, child in block.named_children():
            name = prefix + n
            params = list(child.parameters())
            if name in plan or name in user_placed or not params:
                continue
            nested = sorted(f"{name}.{n}" for n, _ in child.named_parameters() if "." in n)
            if nested:
                # A container (e.g. a ModuleList of one norm per head): a style on it would reach none of its
                # members, and each rank would apply the first heads' members to its own heads.
                containers.append(f"{prefix_user}{name} ({type(child).__name__}, parameters {nested[:2]}"
                                  f"{' ...' if len(nested) > 2 else ''})")
                continue
            sizes = {tuple(p.shape) for p in params}
            size = next(iter(sizes))[0] if len(sizes) == 1 and len(next(iter(sizes))) == 1 else None
            if size is not None and size in widths:
                plan[name] = LocalShardNorm(shard_params=True)  # full width: statistics over every head
            elif size is not None and any(w % size == 0 for w in widths):
                plan[name] = LocalShardNorm(shard_params=False)  # one head's width: replicated, grads summed
            else:
                refused.append(f"{prefix_user}{name} ({type(child).__name__}, parameter shapes {sorted(sizes)})")
    if containers:
        raise ValueError(
            "tp_plan: these modules inside tensor-parallel blocks hold their parameters in submodules, e.g. one "
            "norm per head: " + ", ".join(containers[:3]) + (f" and {len(containers) - 3} more" if len(containers) > 3
                                                             else "") + ". Each rank holds only its own heads, so a container of "
            "per-head members would apply the first heads' members to the rank's heads (or index past them); the "
            "automatic plan does not shard containers. Keep the blocks holding them whole: "
            f"`NDParallelStrategy(tp_plan={_replicate_fix([c.split(' ')[0] for c in containers])})`."
        )
    if refused:
        raise ValueError(
            "tp_plan: these parameters sit inside tensor-parallel blocks, where each rank sees only its own heads, "
            "and the automatic plan knows no sharding for them: " + ", ".join(refused) + ". Left replicated they "
            "would get each rank's partial gradient and drift apart. Give each a style in `tp_plan=` "
            "(e.g. `meshkit.plugins.tensor_parallel.LocalShardNorm(shard_params=False)` for one applied per head), "
            f"or keep the block whole: `NDParallelStrategy(tp_plan={_replicate_fix([r.split(' ')[0] for r in refused])})`."
        )


# --- the one-process check of the plan's forward -------------------------------------------------------------

PROBE_TOKENS = 8
"""Sequence length of the probe forward :func:`check_tp_forward` captures the blocks' inputs from (batch of 1)."""
PROBE_RTOL = 1e-9
"""The tp ranks' summed outputs against the whole block, relative to its largest output, in float64."""


def check_tp_forward(
    module: nn.Module,
    tp: int,
    *,
    user_plan: dict[str, PlanEntry] | None = None,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
) -> list[str]:
    """Check, in this process and before any collective, that every block the TP plan shards computes on its
    ranks' heads what it computes whole; raise naming the block and the ``tp_plan`` that keeps it whole if not.

    One forward of the model (a batch of one sequence of :data:`PROBE_TOKENS` tokens, no gradient) records
    each TP block's inputs; then each block (one per class and shape) is run as the plan lays it out on each
    of the ``tp`` ranks, in float64 on copies: colwise projections keep their rank's rows, rowwise ones its
    columns (the bias once), per-head norms stay whole, full-width norms see every rank's columns. The ranks'
    outputs must sum to the whole block's output (what the rowwise projection's reduction computes). This
    catches what the names cannot: an attention that reshapes with the config's global head count (a raw
    reshape error under TP), per-head parameters applied by position, anything else a block does with the
    full width. Blocks holding a style meshkit does not know (a user's ``ParallelStyle``) are the user's and
    are not run. Returns the names of the blocks checked. A model meshkit cannot call (it looks for a
    transformers model, or a module whose direct child is the token embedding), or one on the meta device,
    is not checked, with a warning saying so.

    Example::

        >>> from meshkit.models import LlamaConfig, Transformer
        >>> check_tp_forward(Transformer(LlamaConfig.tiny()), 2)[:2]
        ['layers.0.attention', 'layers.0.feed_forward']
    """
    import warnings

    plan = infer_tp_plan(
        module, user_plan=user_plan, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel
    )
    blocks = _sharded_blocks(module, plan)
    if not blocks:
        return []
    root, call = _probe_root(module)
    why = None
    if root is None:
        why = "no transformers model nor module holding the token embedding was found to call"
    elif any(p.is_meta for p in root.parameters()):
        why = "its parameters are on the meta device"
    captured: dict[str, tuple[tuple, dict]] = {}
    if why is None:
        handles = [
            block.register_forward_pre_hook(_capture(captured, name), with_kwargs=True)
            for name, block in blocks.items()
        ]
        training = [m.training for m in root.modules()]
        try:
            root.eval()
            with torch.no_grad():
                call(root, _probe_ids(root))
        except Exception as e:  # noqa: BLE001 - the unsharded model itself: not the plan's business
            why = f"its forward on {PROBE_TOKENS} tokens raised {type(e).__name__}: {e}"
        finally:
            for h in handles:
                h.remove()
            for m, t in zip(root.modules(), training):
                m.training = t
    if why is not None:
        warnings.warn(
            f"NDParallelStrategy: the tensor-parallel plan's forward check did not run on {type(module).__name__} "
            f"({why}); the blocks are sharded by their module names only.", stacklevel=2,
        )
        return []
    checked, seen = [], set()
    for name, block in blocks.items():
        styles = {n: plan.get(f"{name}.{n}") for n, _ in block.named_children()}
        if name not in captured or any(s is not None and type(s) not in _SIMULATED for s in styles.values()):
            continue
        key = (type(block), tuple((n, tuple(p.shape)) for n, p in block.named_parameters()),
               tuple(repr(s) for s in styles.values()))
        if key in seen:
            continue
        seen.add(key)
        args, kwargs = _to64(captured[name])
        want = _whole_in_a_thread(block, args, kwargs)
        outs, error = _run_ranks(block, styles, tp, args, kwargs)
        if error is None:
            diff = float((sum(outs) - want).abs().max())
            scale = float(want.abs().max().clamp_min(1e-30))
            if diff > PROBE_RTOL * scale:
                error = (f"its {tp} ranks' outputs sum to something else than the whole block's (max difference "
                         f"{diff:.2e}, {diff / scale:.1e} of its largest output)")
        if error is not None:
            raise ValueError(
                f"tp_plan: `{name}` ({type(block).__name__}) does not compute on its rank's share of the heads "
                f"what it computes whole, as the tensor-parallel plan runs it on tp={tp} ranks: {error}. A block "
                "that reshapes with the config's global head count, or applies per-head parameters by position, "
                f"cannot be split by its projections alone. Keep it whole (its projections replicated; the "
                f"embedding and LM head stay sharded): `NDParallelStrategy(tp_plan={_replicate_fix([], blocks=(name,))})`"
                ", or write `configure_model` with styles of your own."
            )
        checked.append(name)
    return checked


_SIMULATED = (ColwiseParallel, RowwiseParallel, LocalShardNorm)


def _sharded_blocks(model: nn.Module, plan: dict[str, ParallelStyle]) -> dict[str, nn.Module]:
    """Modules holding a colwise-sharded projection (the LM head excepted): each rank sees its heads there."""
    blocks: dict[str, nn.Module] = {}
    for name, style in plan.items():
        if type(style) is ColwiseParallel and name.rsplit(".", 1)[-1] not in LM_HEADS and "." in name:
            if isinstance(model.get_submodule(name), nn.Linear):
                blocks.setdefault(_parent(name), model.get_submodule(_parent(name)))
    return blocks


def _probe_root(module: nn.Module) -> tuple[nn.Module | None, Any]:
    """The outermost module meshkit can call with token ids, and how (transformers: ``input_ids=``)."""
    for m in module.modules():
        if type(m).__module__.startswith("transformers.") and hasattr(m, "get_input_embeddings"):
            return m, lambda root, ids: root(input_ids=ids, use_cache=False)
        if any(isinstance(c, nn.Embedding) for c in m.children()) and not hasattr(m, "training_step"):
            return m, lambda root, ids: root(ids)
    return None, None


def _probe_ids(root: nn.Module) -> torch.Tensor:
    emb = next(m for m in root.modules() if isinstance(m, nn.Embedding))
    param = next(root.parameters())
    return (torch.arange(PROBE_TOKENS, device=param.device) * 7 % emb.num_embeddings).unsqueeze(0)  # (1, T)


def _capture(store: dict, name: str) -> Any:
    def hook(_: nn.Module, args: tuple, kwargs: dict) -> None:
        store.setdefault(name, (args, kwargs))  # the first call (a block called twice: its first inputs)

    return hook


def _to64(value: Any) -> Any:
    """Floating tensors in ``value`` (nested tuples, lists, dicts) as float64 copies; the rest as is."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(torch.float64) if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(_to64(v) for v in value)
    if isinstance(value, dict):
        return {k: _to64(v) for k, v in value.items()}
    return value


def _first_tensor(out: Any) -> torch.Tensor:
    while isinstance(out, (tuple, list)):
        out = out[0]
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"returned {type(out).__name__}, not a tensor")
    return out


class _Gathered(nn.Module):
    """A full-width norm in the simulation: every simulated rank's columns, normalized, this rank's back."""

    def __init__(self, norm: nn.Module, rank: int, tp: int, meet: Any) -> None:
        super().__init__()
        self.norm, self.rank, self.tp, self.meet = norm, rank, tp, meet

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = self.meet(self.rank, x)  # every rank's local columns, in rank order
        return self.norm(torch.cat(parts, dim=-1)).chunk(self.tp, dim=-1)[self.rank]


def _rank_block(block: nn.Module, styles: dict, rank: int, tp: int, meet: Any) -> nn.Module:
    """A float64 copy of ``block`` as rank ``rank`` of ``tp`` holds it under ``styles`` (child name -> style)."""
    import copy

    memo: dict[int, Any] = {}
    for n, style in styles.items():
        child = getattr(block, n)
        if isinstance(style, (ColwiseParallel, RowwiseParallel)) and isinstance(child, nn.Linear):
            dim = 0 if isinstance(style, ColwiseParallel) else 1
            memo[id(child.weight)] = nn.Parameter(child.weight.detach().chunk(tp, dim=dim)[rank].clone())
            if child.bias is not None:
                bias = child.bias.detach()
                keep = bias.chunk(tp)[rank] if dim == 0 else (bias if rank == 0 else torch.zeros_like(bias))
                memo[id(child.bias)] = nn.Parameter(keep.clone())
    local = copy.deepcopy(block, memo).to(torch.float64).eval()
    for n, style in styles.items():
        if isinstance(style, LocalShardNorm) and style.shard_params:
            setattr(local, n, _Gathered(getattr(local, n), rank, tp, meet))
    return local


def _whole_in_a_thread(block: nn.Module, args: tuple, kwargs: dict) -> torch.Tensor:
    """The whole block's float64 output, computed in a fresh thread as :func:`_run_ranks` computes the ranks':
    thread-local state of the caller (a ``TorchFunctionMode``, autocast) then reaches neither side, so the two
    sides run the same math (a caller's mode that makes float32 float64 would otherwise reach only this one)."""
    import copy
    import threading

    out: list[Any] = [None]

    def run() -> None:
        try:
            with torch.no_grad():
                out[0] = _first_tensor(copy.deepcopy(block).to(torch.float64).eval()(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - raised in the caller's thread below
            out[0] = e

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


def _run_ranks(block: nn.Module, styles: dict, tp: int, args: tuple, kwargs: dict) -> tuple[list, str | None]:
    """Run the ``tp`` rank copies of ``block`` (in threads, which meet where a full-width norm gathers)."""
    import threading

    barrier = threading.Barrier(tp, timeout=60)
    slots: list[Any] = [None] * tp

    def meet(rank: int, x: torch.Tensor) -> list[torch.Tensor]:
        slots[rank] = x
        barrier.wait()
        parts = list(slots)
        barrier.wait()
        return parts

    outs: list[Any] = [None] * tp
    errors: list[tuple[int, BaseException]] = []

    def run(rank: int) -> None:
        try:
            with torch.no_grad():
                outs[rank] = _first_tensor(_rank_block(block, styles, rank, tp, meet)(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - reported as the refusal's reason
            errors.append((rank, e))
            barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    real = [(r, e) for r, e in errors if not isinstance(e, threading.BrokenBarrierError)] or errors
    if real:
        rank, e = min(real, key=lambda x: x[0])
        return outs, f"on rank {rank} its forward raised {type(e).__name__}: {e}"
    return outs, None


def _tied_groups(model: nn.Module) -> list[list[tuple[str, str]]]:
    """Parameters used under several names: each group's (module FQN, parameter name) pairs."""
    groups: dict[int, list[tuple[str, str]]] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for p_name, param in module.named_parameters(recurse=False, remove_duplicate=False):
            groups.setdefault(id(param), []).append((mod_name, p_name))
    return [g for g in groups.values() if len(g) > 1]


def _tp_placement(style: ParallelStyle | None, module: nn.Module) -> str:
    """How ``style`` places ``module.weight`` over tp ("?" for a style meshkit does not know)."""
    if style is None:
        return "Replicate"
    embedding = isinstance(module, nn.Embedding)
    if type(style) is ColwiseParallel:
        return "Shard(1)" if embedding else "Shard(0)"
    if type(style) is RowwiseParallel:
        return "Shard(0)" if embedding else "Shard(1)"
    return "?"


def _check_ties(model: nn.Module, plan: dict[str, ParallelStyle]) -> None:
    """A tied parameter (embedding / LM head) must get one placement from every module using it."""
    for group in _tied_groups(model):
        places = {f"{m}.{p}": _tp_placement(plan.get(m), model.get_submodule(m)) for m, p in group}
        if len(set(places.values())) > 1 and "?" not in places.values():
            raise ValueError(
                "tp_plan: " + " and ".join(f"`{n}`" for n in places) + " are one tied parameter, but the plan places "
                "it as " + ", ".join(f"{v} for `{n}`" for n, v in places.items()) + ". A tied embedding and LM head "
                "must be sharded the same way (the automatic plan vocab-shards both, Shard(0)): drop the `tp_plan` "
                "entries that differ, or untie them in the model config (`tie_word_embeddings=False`)."
            )


def _positional_arity(module: nn.Module) -> int:
    params = inspect.signature(module.forward).parameters.values()
    return sum(1 for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


def _own_output(_module: nn.Module, _args: Any, output: Any) -> Any:
    """The local tensor TP's output layout returns is a view made by a custom autograd Function (``to_local``),
    which autograd forbids modifying in place ("Output 0 of _ToTorchTensor is a view and is being modified
    inplace"); a family that scales its embedding output in place then dies under tp alone. One copy of the
    embedding's output per step gives it a tensor of its own, with the same values and gradient."""
    if isinstance(output, torch.Tensor) and not isinstance(output, DTensor) and output._is_view():
        return output.clone()
    return None


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, plan: dict[str, ParallelStyle]) -> nn.Module:
    """Apply ``plan`` to ``model`` over the 1-D ``tp_mesh`` (in place); returns ``model``.

    Tied parameters stay one parameter: ``parallelize_module`` distributes each module's copy
    separately, so every alias is pointed at the first one's DTensor afterwards. A sharded embedding hands back a
    tensor of its own (:func:`_own_output`): a family may scale its output in place (CTRL's ``*= sqrt(d)``).
    """
    if not plan:
        return model
    ties = _tied_groups(model)
    parallelize_module(model, tp_mesh, plan)
    for module_name, module in model.named_modules():
        if isinstance(module, nn.Embedding) and any(fnmatch.fnmatchcase(module_name, key) for key in plan):
            module.register_forward_hook(_own_output)
    for (first_mod, first_name), *others in ties:
        param = getattr(model.get_submodule(first_mod), first_name)
        for mod, name in others:
            other = getattr(model.get_submodule(mod), name)
            if getattr(other, "placements", None) != getattr(param, "placements", None):
                raise ValueError(
                    f"tp_plan: `{first_mod}.{first_name}` and `{mod}.{name}` are one tied parameter, but the plan's "
                    f"styles place it as {getattr(param, 'placements', 'plain')} and "
                    f"{getattr(other, 'placements', 'plain')}. Give both modules styles that shard it the same way."
                )
            setattr(model.get_submodule(mod), name, param)
    return model


def quiet_local_logits_warning(model: nn.Module, plan: dict[str, ParallelStyle]) -> list[str]:
    """Silence FSDP2's "returned a view tensor" warning for the units whose output is the LM head's logits.

    ``ColwiseParallel(use_local_output=True)`` hands back ``DTensor.to_local()``, which is a view made by a
    custom autograd Function (torch 2.4-2.13 checked). FSDP2 warns on every rank, every step, that an in-place
    op on a returned view would silently drop its pre-backward hook; for this view that cannot happen:
    autograd refuses in-place ops on views made by custom Functions with a RuntimeError. A copy would cost one
    more (B, T, vocab) buffer per step, so the message is silenced instead, for exactly those FSDP units
    (``FSDP<class>`` of every module on the path to the head, which are what return the logits). Call after
    ``apply_tp``; returns the class names silenced.

    Example::

        >>> quiet_local_logits_warning(lightning_module, plan)  # doctest: +SKIP
        ['FSDPCausalLM', 'FSDPLlamaForCausalLM']
    """
    import warnings

    heads = [
        n for n, style in plan.items()
        if n.rsplit(".", 1)[-1] in LM_HEADS and isinstance(style, ColwiseParallel) and style.use_local_output
    ]
    names: set[str] = set()
    for head in heads:
        parts = head.split(".")
        for i in range(len(parts)):
            name = type(model.get_submodule(".".join(parts[:i]))).__name__
            names.add(name if name.startswith("FSDP") else f"FSDP{name}")
    for name in sorted(names):
        warnings.filterwarnings(
            "ignore", category=UserWarning,
            message=rf"FSDP2-wrapped module \((?:[^)]*, )?{re.escape(name)}(?:, [^)]*)?\) returned a view tensor",
        )
    return sorted(names)
