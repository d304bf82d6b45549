"""The automatic tensor-parallel plan: module names and shapes -> ``parallelize_module`` styles.

Recognised (the last component of each module's name):

====================  ==========================================================
colwise (Shard(0))    ``q_proj k_proj v_proj gate_proj up_proj`` (HF Llama family),
                      ``wq wk wv w1 w3`` (torchtitan)
rowwise (Shard(1))    ``o_proj down_proj`` (HF), ``wo w2`` (torchtitan)
embedding (rowwise)   any ``nn.Embedding`` whose rows are the vocabulary
LM head (colwise)     ``lm_head`` (HF), ``output`` (torchtitan)
====================  ==========================================================

A Linear it cannot place raises, listing every such module and how to place it with
``tp_plan={"<pattern>": "colwise" | "rowwise" | "replicate" | ParallelStyle}`` (fnmatch patterns
over the module names the error prints).

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
from typing import Union

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from meshkit.modelspec import read_shape

__all__ = ["infer_tp_plan", "apply_tp", "model_shape", "PlanEntry"]

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


def infer_tp_plan(
    model: nn.Module,
    *,
    user_plan: dict[str, PlanEntry] | None = None,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
) -> dict[str, ParallelStyle]:
    """Build a ``parallelize_module`` plan (module FQN -> style) for every Linear and Embedding.

    ``user_plan`` entries (fnmatch patterns) win over the automatic rules; ``"replicate"`` leaves a
    module unsharded. ``sequence_parallel`` shards norms and the residual stream on the sequence dim
    (torchtitan-style models). ``loss_parallel`` leaves the LM head's logits sharded on the vocab dim
    (the loss must then run under ``torch.distributed.tensor.parallel.loss_parallel()``, which the
    strategy does around ``training_step`` and ``backward``).
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
    unplaced: list[str] = []
    block_inputs: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        if not name:
            continue
        leaf = name.rsplit(".", 1)[-1]
        matched = [p for p in user_plan if fnmatch.fnmatchcase(name, p)]
        if matched:
            style = _style(user_plan[matched[0]], matched[0])
            if style is not None:
                plan[name] = style
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
            parent = name.rsplit(".", 1)[0] if "." in name else ""
            block_inputs[parent] = model.get_submodule(parent)
        elif isinstance(module, nn.Linear) and leaf in ROWWISE:
            plan[name] = RowwiseParallel(output_layouts=seq)
        elif isinstance(module, nn.Linear):
            unplaced.append(f"{name} ({module.in_features}->{module.out_features})")
        elif sequence_parallel and type(module).__name__.endswith(_NORM_TYPES):
            plan[name] = SequenceParallel()
    if unplaced:
        example = ", ".join(f'"{u.split(" ")[0]}": "colwise"' for u in unplaced[:2])
        raise ValueError(
            "tp_plan: the automatic tensor-parallel plan cannot place these Linear modules: "
            + ", ".join(unplaced)
            + ". Pass `tp_plan=` to the strategy with a style for each (fnmatch patterns allowed), e.g. "
            f"`NDParallelStrategy(tp_plan={{{example}}})`, using 'colwise', 'rowwise', 'replicate' (keep whole) "
            "or a torch ParallelStyle."
        )
    if sequence_parallel:
        for parent, module in block_inputs.items():
            # The attention / MLP block gathers the sequence-sharded residual stream before its projections.
            n_pos = _positional_arity(module)
            plan[parent] = PrepareModuleInput(
                input_layouts=(Shard(1),) + (None,) * (n_pos - 1),
                desired_input_layouts=(Replicate(),) + (None,) * (n_pos - 1),
            )
    return plan


def _positional_arity(module: nn.Module) -> int:
    params = inspect.signature(module.forward).parameters.values()
    return sum(1 for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, plan: dict[str, ParallelStyle]) -> nn.Module:
    """Apply ``plan`` to ``model`` over the 1-D ``tp_mesh`` (in place); returns ``model``."""
    if plan:
        parallelize_module(model, tp_mesh, plan)
    return model
