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

__all__ = ["infer_tp_plan", "apply_tp", "model_shape", "PlanEntry", "LocalShardNorm", "quiet_local_logits_warning"]

PlanEntry = Union[str, ParallelStyle]

COLWISE = frozenset({"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "wq", "wk", "wv", "w1", "w3"})
ROWWISE = frozenset({"o_proj", "down_proj", "wo", "w2"})
LM_HEADS = frozenset({"lm_head", "output"})
_NORM_TYPES = ("RMSNorm", "LayerNorm")


def model_shape(model: nn.Module) -> tuple[int | None, int | None, int | None]:
    """(attention heads, kv heads, hidden size) of the config ``model`` holds
    (:func:`meshkit.modelspec.read_shape`), else Nones.

    >>> from meshkit.models import LlamaConfig, Transformer
    >>> model_shape(Transformer(LlamaConfig.tiny()))
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
    module unsharded. ``sequence_parallel`` shards norms and the residual stream on the sequence dim
    (torchtitan-style models). ``loss_parallel`` leaves the LM head's logits sharded on the vocab dim
    (the loss must then run under ``torch.distributed.tensor.parallel.loss_parallel()``, which the
    strategy does around ``training_step`` and ``backward``). ``prefix`` is ``model``'s FQN in the
    module the user names (``"model."`` for a pipeline rank module inside a LightningModule):
    ``user_plan`` patterns and error messages use ``prefix + name``, so one ``tp_plan`` works at any pp;
    the returned plan's keys stay relative to ``model``.

    Example::

        >>> plan = infer_tp_plan(hf_model, user_plan={"model.layers.*.mlp.*": "replicate"})  # doctest: +SKIP
    """
    user_plan = dict(user_plan or {})
    if sequence_parallel and _is_hf(model):
        raise ValueError(
            "tp_plan: `sequence_parallel=True` is not supported for transformers models: they build the attention "
            "mask and position ids from the embedding output's length, which sequence parallelism shards. "
            "Use `sequence_parallel=False` (the default) or a torchtitan-style model."
        )
    seq = Shard(1) if sequence_parallel else Replicate()
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
        if isinstance(module, nn.Embedding):
            plan[name] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
        elif isinstance(module, nn.Linear) and leaf in LM_HEADS:
            plan[name] = ColwiseParallel(
                input_layouts=seq,
                output_layouts=Shard(-1) if loss_parallel else Replicate(),
                use_local_output=not loss_parallel,
            )
        elif isinstance(module, nn.Linear) and leaf in COLWISE:
            plan[name] = ColwiseParallel()
            block_inputs[_parent(name)] = model.get_submodule(_parent(name))
        elif isinstance(module, nn.Linear) and leaf in ROWWISE:
            plan[name] = RowwiseParallel(output_layouts=seq)
        elif isinstance(module, nn.Linear):
            unplaced.append(f"{prefix}{name} ({module.in_features}->{module.out_features})")
        elif type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None:
            # transformers' GPT-2 projection: a Linear with a transposed (in, out) weight.
            unplaced.append(f"{prefix}{name} (Conv1D {module.weight.shape[0]}->{module.weight.shape[1]})")
        elif sequence_parallel and type(module).__name__.endswith(_NORM_TYPES):
            plan[name] = SequenceParallel()
    if unplaced:
        _refuse_unplaced(unplaced)
    _plan_local_params(model, plan, {**regions, **block_inputs}, user_placed)
    _check_ties(model, plan)
    if sequence_parallel:
        for parent, module in block_inputs.items():
            # The attention / MLP block gathers the sequence-sharded residual stream before its projections.
            n_pos = _positional_arity(module)
            plan[parent] = PrepareModuleInput(
                input_layouts=(Shard(1),) + (None,) * (n_pos - 1),
                desired_input_layouts=(Replicate(),) + (None,) * (n_pos - 1),
            )
    return plan


def _parent(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def _refuse_unplaced(unplaced: list[str]) -> None:
    """Raise naming every projection the plan cannot place, with a plan that keeps their blocks whole."""
    blocks = sorted({re.sub(r"\.\d+(?=\.|$)", ".*", _parent(u.split(" ")[0])) for u in unplaced})
    example = ", ".join(f'"{b}.*": "replicate"' if b else '"*": "replicate"' for b in blocks)
    raise ValueError(
        "tp_plan: the automatic tensor-parallel plan cannot place these projections: " + ", ".join(unplaced) + ". "
        "A fused projection (qkv_proj, gate_up_proj, GPT-2 c_attn) or an unknown one cannot be split by rows "
        "alone: its block slices the output assuming every head and column, and its partner projections must "
        "match. Keep the blocks holding them whole (every projection in them replicated; the embedding and LM "
        f"head stay sharded): `NDParallelStrategy(tp_plan={{{example}}})`, or give each projection of those "
        "blocks a style that keeps each rank's heads and MLP columns whole ('colwise' for one producing whole "
        "heads, 'rowwise' for the one consuming them, or a torch ParallelStyle)."
    )


def _plan_local_params(
    model: nn.Module, plan: dict[str, ParallelStyle], blocks: dict[str, nn.Module], user_placed: set[str]
) -> None:
    """Place the parameters of TP blocks that no projection style owns: they see TP-local activations."""
    refused: list[str] = []
    for parent, block in blocks.items():
        prefix = f"{parent}." if parent else ""
        widths = {
            m.out_features for n, m in block.named_children()
            if isinstance(plan.get(prefix + n), ColwiseParallel) and isinstance(m, nn.Linear)
        }
        direct = [n for n, _ in block.named_parameters(recurse=False)]
        if direct:
            refused.append(f"{parent} (parameters {direct} on the block itself)")
        for n, child in block.named_children():
            name = prefix + n
            params = list(child.parameters())
            if name in plan or name in user_placed or not params:
                continue
            sizes = {tuple(p.shape) for p in params}
            size = next(iter(sizes))[0] if len(sizes) == 1 and len(next(iter(sizes))) == 1 else None
            if size is not None and size in widths:
                plan[name] = LocalShardNorm(shard_params=True)  # full width: statistics over every head
            elif size is not None and any(w % size == 0 for w in widths):
                plan[name] = LocalShardNorm(shard_params=False)  # one head's width: replicated, grads summed
            else:
                refused.append(f"{name} ({type(child).__name__}, parameter shapes {sorted(sizes)})")
    if refused:
        raise ValueError(
            "tp_plan: these parameters sit inside tensor-parallel blocks, where each rank sees only its own heads, "
            "and the automatic plan knows no sharding for them: " + ", ".join(refused) + ". Left replicated they "
            "would get each rank's partial gradient and drift apart. Give each a style in `tp_plan=` "
            "(e.g. `meshkit.plugins.tensor_parallel.LocalShardNorm(shard_params=False)` for one applied per head), "
            'or keep the block whole: `tp_plan={"<block>.*": "replicate"}`.'
        )


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


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, plan: dict[str, ParallelStyle]) -> nn.Module:
    """Apply ``plan`` to ``model`` over the 1-D ``tp_mesh`` (in place); returns ``model``.

    Tied parameters stay one parameter: ``parallelize_module`` distributes each module's copy
    separately, so every alias is pointed at the first one's DTensor afterwards.
    """
    if not plan:
        return model
    ties = _tied_groups(model)
    parallelize_module(model, tp_mesh, plan)
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
