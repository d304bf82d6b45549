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
from typing import TYPE_CHECKING, Any, Callable, Literal, Mapping, Union

from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

from meshkit.plugins.context_parallel import check_cp_heads
from meshkit.plugins.dims import ParallelDims
from meshkit.plugins.fsdp import find_blocks, mixed_precision_policy
from meshkit.plugins.tensor_parallel import _is_hf, _style, tp_widths

if TYPE_CHECKING:
    from meshkit.plugins.parallelize import ParallelConfig

__all__ = [
    "Preset", "PRESETS", "Size", "resolve_dims", "resolve_layout", "auto_tp", "check_launch", "check_front_door",
    "register_names",
]

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
    heads, kv_heads, hidden = tp_widths(model) if model is not None else (None, None, None)
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
    elif num_nodes > 1 and _tp_straddles(dims, per_node):
        rank_zero_warn(
            f"NDParallelStrategy: with `order={dims.order}` and {per_node} devices per node some tp groups of "
            f"`tp={dims.tp}` span two nodes, so tensor-parallel traffic crosses the slow inter-node link. "
            "Put tp innermost in `order` and use a tp that divides the devices per node."
        )
    if preset.tp and sizes["tp"] == "auto" and dims.tp == 1 and per_node > 1:
        rank_zero_warn(
            f"NDParallelStrategy: preset `{preset.name}` turns tensor parallelism on, but no tp in 2..{per_node} "
            f"divides the {per_node} devices per node and the model's heads={heads}, kv_heads={kv_heads}, "
            f"hidden={hidden}, so tp=1 (no tensor parallelism). Use a device count per node that is a multiple "
            "of 2 (e.g. devices=2 or 4), pass `tp=` explicitly, or choose a preset without tp."
        )
    return dims


def _tp_straddles(dims: ParallelDims, per_node: int) -> bool:
    """True if some tp group holds ranks of two nodes (ranks laid out in ``dims.order``, node = rank // per_node)."""
    import torch

    grid = torch.arange(dims.world_size).reshape([getattr(dims, a) for a in dims.order])
    groups = grid.movedim(dims.order.index("tp"), -1).reshape(-1, dims.tp) // per_node
    return bool((groups != groups[:, :1]).any())


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
    ``planner()`` for a planner preset with every size "auto"), global batch, the pp × cp and
    pp × ``configure_model`` refusals and the Ulysses head count.

    Example::

        >>> from meshkit.plugins.parallelize import ParallelConfig
        >>> auto = dict.fromkeys(("dp_replicate", "dp_shard", "pp", "cp", "tp"), "auto")
        >>> resolve_layout(PRESETS["pp"], {**auto, "cp": 2}, ParallelConfig(), world_size=4, num_nodes=1)
        Traceback (most recent call last):
        ...
        ValueError: NDParallelStrategy: `pp=2` with `cp=2` is not supported yet: ...
    """
    mixed_precision_policy(config.precision)  # raises for unsupported precision
    _check_batch_size(config.global_batch_size)
    if preset.planner and planner is not None and all(v == "auto" for v in sizes.values()):
        dims = planner()
    else:
        dims = resolve_dims(preset, sizes, world_size=world_size, num_nodes=num_nodes, model=model)
    if config.global_batch_size is not None:
        dims.check_batch(config.global_batch_size)
    if config.loss_parallel and not dims.tp_enabled:
        raise ValueError(
            f"NDParallelStrategy: `loss_parallel=True` needs tensor parallelism, but `tp={dims.tp}`: the logits are "
            "sharded over tp, so with tp=1 there is nothing to parallelize and the option would be ignored. "
            "Drop `loss_parallel=True`, or use tp > 1."
        )
    if dims.pp_enabled and dims.cp_enabled:
        raise ValueError(
            f"NDParallelStrategy: `pp={dims.pp}` with `cp={dims.cp}` is not supported yet: the pipeline stages do not "
            "shard sequences. Use cp=1 with pp, or pp=1 with cp."
        )
    if dims.pp_enabled and model is not None and _has_configure_model(model):
        raise ValueError(
            f"NDParallelStrategy: `pp={dims.pp}` with a `configure_model` in {type(model).__name__}: meshkit cuts "
            "pipeline stages only when it parallelizes the model itself, and it does not split a model that "
            "`configure_model` builds, so every rank of a pp group would train the whole model on the same batches "
            "(nothing pipelined, and nothing checked between those ranks). Remove `configure_model` and let meshkit "
            "split and shard the model (`tp_plan=` sets your own TP styles), or use `pp=1`."
        )
    if config.sequence_parallel and dims.pp_enabled and model is not None and _is_hf(model):
        raise ValueError(
            f"NDParallelStrategy: `sequence_parallel=True` with `pp={dims.pp}` is not supported for transformers "
            "models: their sequence is cut at the first decoder layer of the model, and a later pipeline stage "
            "receives it already cut. Use `sequence_parallel=False` with pp, or pp=1."
        )
    if dims.cp_enabled and model is not None:  # Ulysses splits each TP rank's heads over cp
        heads, kv_heads, _ = tp_widths(model)
        if heads is not None:
            check_cp_heads(heads, kv_heads, dims.tp, dims.cp, config.cp_attention, owner="NDParallelStrategy")
    if model is not None and not _has_configure_model(model):  # the automatic path will parallelize it
        _check_tp_plan(model, config.tp_plan, dims)
        if dims.fsdp_enabled and not find_blocks(model):
            rank_zero_warn(
                f"NDParallelStrategy: {type(model).__name__} has no repeated blocks (no ModuleList / ModuleDict of "
                "one class), so FSDP2 shards it as one unit: every rank gathers all parameters at once and the "
                "peak memory is the unsharded model's. Keep the layers in an `nn.ModuleList`, or write a "
                "`configure_model` that calls `fully_shard` per block."
            )
    return dims


def _check_batch_size(global_batch_size: object) -> None:
    if global_batch_size is None:
        return
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size < 1:
        raise ValueError(
            f"NDParallelStrategy: `global_batch_size={global_batch_size!r}` must be a positive int (sequences per "
            "optimizer step over all data-parallel ranks), or None to skip the check."
        )


def _has_configure_model(model: nn.Module) -> bool:
    from lightning.pytorch import LightningModule
    from lightning.pytorch.utilities.model_helpers import is_overridden

    return isinstance(model, LightningModule) and is_overridden("configure_model", model)


def _check_tp_plan(model: nn.Module, tp_plan: dict | None, dims: ParallelDims) -> None:
    """Every ``tp_plan`` pattern must match a module; a plan with tp=1 is unused."""
    import fnmatch

    if tp_plan is None:
        return
    if not isinstance(tp_plan, dict) or not all(isinstance(p, str) for p in tp_plan):
        raise ValueError(
            f"NDParallelStrategy: `tp_plan={tp_plan!r}` must be a dict {{fnmatch pattern: 'colwise' | 'rowwise' | "
            "'replicate' | ParallelStyle}}."
        )
    for pattern, entry in tp_plan.items():
        _style(entry, pattern)  # raises for an unknown style
    if not tp_plan:
        return
    if not dims.tp_enabled:
        rank_zero_warn(f"NDParallelStrategy: `tp_plan` is given but `tp={dims.tp}`: the plan is not used.")
        return
    names = [n for n, _ in model.named_modules() if n]
    dead = [p for p in tp_plan if not any(fnmatch.fnmatchcase(n, p) for n in names)]
    if dead:
        linears = [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))][:4]
        raise ValueError(
            f"NDParallelStrategy: `tp_plan` pattern(s) {dead} match no module of {type(model).__name__}. Patterns "
            f"are fnmatch patterns over full module names, e.g. {linears}; use '*' for the layer index "
            "(`'model.layers.*.attention.wq'`)."
        )


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


def check_launch(
    devices: int, num_nodes: int, environ: Mapping[str, str], initialized_world: int | None = None
) -> None:
    """Raise if the launcher started another job than the Trainer describes (before any collective).

    ``environ`` is what torchrun / SLURM / Lightning's launcher set (``WORLD_SIZE``, ``RANK``,
    ``LOCAL_RANK``, ``NODE_RANK``); ``initialized_world`` the size of an existing process group.

    Example::

        >>> check_launch(2, 1, {"WORLD_SIZE": "4"})
        Traceback (most recent call last):
        ...
        ValueError: NDParallelStrategy: the launcher started `WORLD_SIZE=4` processes but the Trainer ...
    """
    want = devices * num_nodes
    fix = (
        f"Make the Trainer's `devices` (per node) × `num_nodes` equal the processes you launch: e.g. "
        f"`torchrun --nnodes {num_nodes} --nproc-per-node {devices}`, or Trainer(devices=N, num_nodes=M) "
        "for N×M processes."
    )
    ints = {k: environ[k] for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK") if k in environ}
    for key, value in ints.items():
        if not value.isdigit():
            raise ValueError(f"NDParallelStrategy: the launcher set `{key}={value!r}`, which is not a rank count.")
    if "WORLD_SIZE" in ints and int(ints["WORLD_SIZE"]) != want:
        raise ValueError(
            f"NDParallelStrategy: the launcher started `WORLD_SIZE={ints['WORLD_SIZE']}` processes but the Trainer "
            f"has `devices={devices}` × `num_nodes={num_nodes}` = {want}. {fix}"
        )
    if initialized_world is not None and initialized_world != want:  # not the launcher's: a group from before
        raise ValueError(
            f"NDParallelStrategy: this process already holds a process group of {initialized_world} rank(s) (an "
            f"earlier fit's, or an `init_process_group` of your own), but the Trainer has `devices={devices}` × "
            f"`num_nodes={num_nodes}` = {want}"
            + (f" and the launcher started `WORLD_SIZE={want}`" if "WORLD_SIZE" in ints else "")
            + ": that group is stale. Call `torch.distributed.destroy_process_group()` on every rank before this "
            f"fit (meshkit then starts one of {want}), or give the Trainer the group's size."
        )
    if "LOCAL_RANK" in ints and int(ints["LOCAL_RANK"]) >= devices:
        raise ValueError(
            f"NDParallelStrategy: this process has `LOCAL_RANK={ints['LOCAL_RANK']}` but the Trainer has "
            f"`devices={devices}` per node: more processes run on this node than the Trainer expects. {fix}"
        )
    if "NODE_RANK" in ints and int(ints["NODE_RANK"]) >= num_nodes:
        raise ValueError(
            f"NDParallelStrategy: this process has `NODE_RANK={ints['NODE_RANK']}` but the Trainer has "
            f"`num_nodes={num_nodes}`. {fix}"
        )
    if {"RANK", "LOCAL_RANK", "NODE_RANK"} <= set(ints):
        derived = int(ints["NODE_RANK"]) * devices + int(ints["LOCAL_RANK"])
        if derived != int(ints["RANK"]):
            raise ValueError(
                f"NDParallelStrategy: the launcher's `RANK={ints['RANK']}` is not `NODE_RANK={ints['NODE_RANK']}` × "
                f"`devices={devices}` + `LOCAL_RANK={ints['LOCAL_RANK']}` = {derived}: the nodes run different "
                f"numbers of processes than `devices`. {fix}"
            )


def check_front_door(owner: str, preset: Union[str, Preset], timeout: object) -> Preset:
    """The preset named ``preset`` (or ``preset`` itself, a row), after checking it and ``timeout`` (a positive
    ``timedelta`` or None): what :class:`~meshkit.plugins.options.NDParallelOptions` checks first for both front
    doors, with the same messages. Raises ValueError naming the fix.

    >>> from datetime import timedelta
    >>> check_front_door("NDParallelStrategy", "hsdp_tp", timedelta(minutes=5)).name
    'hsdp_tp'
    """
    from datetime import timedelta

    if timeout is not None and (not isinstance(timeout, timedelta) or timeout <= timedelta(0)):
        seconds = timeout if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) else None
        example = f"timedelta(seconds={seconds})" if seconds and seconds > 0 else "timedelta(minutes=10)"
        raise ValueError(
            f"{owner}: `timeout={timeout!r}` must be a positive `datetime.timedelta` (how long a collective waits "
            f"for a missing rank), e.g. `timeout={example}`"
            + ("; 0 would fail every collective at once, blaming ranks that are there." if seconds == 0
               or timeout == timedelta(0) else ".")
        )
    if isinstance(preset, Preset):
        return preset
    if preset not in PRESETS:
        raise ValueError(
            f"{owner}: unknown `preset={preset!r}`; choose one of {sorted(PRESETS)} "
            "or pass explicit sizes (dp_replicate=, dp_shard=, tp=, ...)."
        )
    return PRESETS[preset]


def register_names(registry: Any, strategy: type, what: str) -> None:
    """Register every preset name in ``registry`` (Lightning's or Fabric's) as ``strategy(preset=name)``.

    ``what`` names the registry in the error when another package holds a name already.
    """
    for name, preset in PRESETS.items():
        if name in registry and registry[name]["strategy"] is not strategy:
            raise RuntimeError(f"meshkit: {what} name {name!r} is already registered by another package.")
        registry.register(name, strategy, description=preset.description, override=True, preset=name)
