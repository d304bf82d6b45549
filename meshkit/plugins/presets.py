"""Named presets, "auto" resolution, and every config check that needs no collective.

A preset says which axes ``"auto"`` turns on; :func:`resolve_dims` turns ``"auto"`` sizes into
numbers from the world size, the nodes and the model; :func:`resolve_layout` runs every check the
strategy makes before the process group exists (on every rank, so a bad config fails instead of
hanging). To add a preset, add one :class:`Preset` line to :data:`PRESETS`: ``import meshkit``
registers every name with Lightning's StrategyRegistry.

Example::

    >>> from meshkit.plugins.presets import PRESETS, resolve_dims
    >>> auto = dict.fromkeys(("dp_replicate", "dp_shard", "pp", "cp", "tp"), "auto")
    >>> resolve_dims(PRESETS["hsdp"], auto, world_size=8, num_nodes=2).degrees
    {'dp_replicate': 2, 'dp_shard': 4, 'pp': 1, 'cp': 1, 'tp': 1}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Literal, Union

from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

from meshkit.plugins.context_parallel import check_cp_heads
from meshkit.plugins.dims import ParallelDims
from meshkit.plugins.fsdp import mixed_precision_policy
from meshkit.plugins.tensor_parallel import model_shape

if TYPE_CHECKING:
    from meshkit.plugins.parallelize import ParallelConfig

__all__ = ["Preset", "PRESETS", "Size", "resolve_dims", "resolve_layout", "auto_tp"]

Size = Union[int, Literal["auto"]]


@dataclass(frozen=True)
class Preset:
    """A named layout: which axes "auto" turns on. Explicit sizes always win."""

    name: str
    description: str
    replicate: bool = False
    """dp_replicate = num_nodes (HSDP across nodes)."""
    tp: bool = False
    """tp = the largest size within a node that divides the model's heads, kv heads and hidden size."""
    cp: bool = False
    """cp = the node's devices (2 when tp is also on): sequences split over cp ranks inside a node."""
    planner: bool = False
    """Sizes come from meshkit's layout planner (memory, bandwidth and bubble math) for this world."""
    pp: bool = False
    """pp = 2 pipeline stages (pass ``pp=`` for more); see meshkit.plugins.pipeline."""


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("fsdp2", "FSDP2: every parameter sharded over all ranks"),
        Preset("hsdp", "HSDP: sharded within a node, replicated across nodes", replicate=True),
        Preset("tp", "Tensor parallel within a node (FSDP2 over whatever is left)", tp=True),
        Preset("hsdp_tp", "Tensor parallel within a node, HSDP over the rest", replicate=True, tp=True),
        Preset("cp", "Context parallel: sequences split over a node's ranks (FSDP2 over dp_shard × cp)", cp=True),
        Preset("hsdp_cp", "Context parallel within a node, HSDP across nodes", replicate=True, cp=True),
        Preset(
            "hsdp_tp_cp", "Tensor × context parallel within a node, HSDP across nodes", replicate=True, tp=True, cp=True
        ),
        Preset("auto_nd", "Layout chosen by meshkit's planner from memory, bandwidth and bubble math", planner=True),
        # Pipeline presets (meshkit.plugins.pipeline): pp "auto" = 2 stages.
        Preset("pp", "Pipeline parallel (2 stages unless pp= is given), FSDP2 over the rest", pp=True),
        Preset("tp_pp", "Tensor parallel within a node inside each pipeline stage", tp=True, pp=True),
        Preset("hsdp_pp", "Pipeline stages, HSDP over each stage's replicas", replicate=True, pp=True),
        Preset("hsdp_tp_pp", "Tensor parallel inside each pipeline stage, HSDP over the rest",
               replicate=True, tp=True, pp=True),
    )
}


def resolve_dims(
    preset: Preset,
    sizes: dict[str, Size],
    *,
    world_size: int,
    num_nodes: int,
    model: nn.Module | None = None,
) -> ParallelDims:
    """Turn "auto" sizes into numbers (rules in :class:`Preset`), validate, and return ParallelDims.

    >>> resolve_dims(PRESETS["hsdp_tp"], dict.fromkeys(("dp_replicate", "dp_shard", "pp", "cp", "tp"), "auto"),
    ...              world_size=8, num_nodes=2).degrees
    {'dp_replicate': 2, 'dp_shard': 2, 'pp': 1, 'cp': 1, 'tp': 2}
    """
    for axis, value in sizes.items():
        if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            if not (axis == "dp_shard" and value == -1):
                raise ValueError(f"NDParallelStrategy: `{axis}={value!r}` must be a positive int or 'auto'.")
    if world_size % num_nodes:
        raise ValueError(
            f"NDParallelStrategy: world size {world_size} is not divisible by `num_nodes={num_nodes}`; "
            "every node must run the same number of processes."
        )
    per_node = world_size // num_nodes
    heads, kv_heads, hidden = model_shape(model) if model is not None else (None, None, None)
    out: dict[str, int] = {}
    out["pp"] = (2 if preset.pp else 1) if sizes["pp"] == "auto" else int(sizes["pp"])
    if sizes["cp"] == "auto":
        out["cp"] = _auto_cp(preset, per_node // out["pp"] if per_node % out["pp"] == 0 else 1)
    else:
        out["cp"] = int(sizes["cp"])
    if sizes["dp_replicate"] == "auto":
        out["dp_replicate"] = num_nodes if preset.replicate else 1
    else:
        out["dp_replicate"] = int(sizes["dp_replicate"])
    if sizes["tp"] == "auto" and sizes["dp_shard"] not in ("auto", -1):
        # Every data axis was given: tp takes what is left of the world.
        rest = out["dp_replicate"] * int(sizes["dp_shard"]) * out["pp"] * out["cp"]
        out["tp"] = world_size // rest if rest and world_size % rest == 0 else 1
    elif sizes["tp"] == "auto":
        if preset.tp:
            room = per_node // max(1, out["pp"] * out["cp"]) if per_node % max(1, out["pp"] * out["cp"]) == 0 else 1
            # Keep at least 2-way sharding inside a node when the preset also shards data there.
            cap = room // 2 if preset.replicate and room >= 4 else room
            out["tp"] = auto_tp(room, heads, kv_heads, hidden, cap=max(1, cap))
        else:
            out["tp"] = 1
    else:
        out["tp"] = int(sizes["tp"])
    out["dp_shard"] = -1 if sizes["dp_shard"] == "auto" else int(sizes["dp_shard"])
    dims = ParallelDims(world_size=world_size, **out)
    dims.check_model_shape(heads, kv_heads, hidden)
    if dims.tp > per_node:
        rank_zero_warn(
            f"NDParallelStrategy: `tp={dims.tp}` is larger than the {per_node} devices of a node, so tensor-parallel "
            "traffic crosses the slow inter-node link. Use tp <= devices per node and put pp or dp across nodes."
        )
    return dims


def resolve_layout(
    preset: Preset,
    sizes: dict[str, Size],
    config: "ParallelConfig",
    *,
    world_size: int,
    num_nodes: int,
    model: nn.Module | None = None,
    planner: Callable[[], ParallelDims] | None = None,
) -> ParallelDims:
    """Every check that needs no collective, then the resolved :class:`ParallelDims`.

    Runs on every rank before the process group exists: precision, sizes (:func:`resolve_dims`, or
    ``planner()`` for a planner preset with every size "auto"), global batch, the pp × cp refusal
    and the Ulysses head count.

    Example::

        >>> from meshkit.plugins.parallelize import ParallelConfig
        >>> auto = dict.fromkeys(("dp_replicate", "dp_shard", "pp", "cp", "tp"), "auto")
        >>> resolve_layout(PRESETS["pp"], {**auto, "cp": 2}, ParallelConfig(), world_size=4, num_nodes=1)
        Traceback (most recent call last):
        ...
        ValueError: NDParallelStrategy: `pp=2` with `cp=2` is not supported yet: ...
    """
    mixed_precision_policy(config.precision)  # raises for unsupported precision
    if preset.planner and planner is not None and all(v == "auto" for v in sizes.values()):
        dims = planner()
    else:
        dims = resolve_dims(preset, sizes, world_size=world_size, num_nodes=num_nodes, model=model)
    if config.global_batch_size is not None:
        dims.check_batch(config.global_batch_size)
    if dims.pp_enabled and dims.cp_enabled:
        raise ValueError(
            f"NDParallelStrategy: `pp={dims.pp}` with `cp={dims.cp}` is not supported yet: the pipeline stages do not "
            "shard sequences. Use cp=1 with pp, or pp=1 with cp."
        )
    if dims.cp_enabled and model is not None:  # Ulysses splits each TP rank's heads over cp
        heads, kv_heads, _ = model_shape(model)
        if heads is not None:
            check_cp_heads(heads, kv_heads, dims.tp, dims.cp, config.cp_attention, owner="NDParallelStrategy")
    return dims


def auto_tp(devices_per_node: int, heads: int | None, kv_heads: int | None, hidden: int | None, cap: int) -> int:
    """The largest tp ≤ ``cap`` that divides ``devices_per_node`` and the model's heads, kv heads and hidden."""
    best = 1
    for d in range(1, min(cap, devices_per_node) + 1):
        if devices_per_node % d == 0 and all(v is None or v % d == 0 for v in (heads, kv_heads, hidden)):
            best = d
    return best


def _auto_cp(preset: Preset, room: int) -> int:
    """Context parallel size for "auto": the node's ``room`` devices, or 2 of them when TP shares the node."""
    if not preset.cp:
        return 1
    if preset.tp:
        return 2 if room % 2 == 0 and room > 1 else 1
    return room
