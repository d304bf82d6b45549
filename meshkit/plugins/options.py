"""NDParallelOptions: every constructor setting of meshkit's two front doors, in one frozen record.

:class:`~meshkit.plugins.strategy.NDParallelStrategy` (the Trainer) and
:class:`~meshkit.plugins.fabric.NDParallelFabricStrategy` (Fabric) take the same keyword arguments: the
fields below. Each builds one :class:`NDParallelOptions` from them (:func:`build_options`), validated
once in ``__post_init__`` (before any process group, with messages naming the class the user called),
and exposes it as ``strategy.options``. A front door that cannot honour a field refuses a non-default
value of it (:data:`FABRIC_UNSUPPORTED`), so nothing is accepted and ignored.

Example::

    >>> from meshkit.plugins.options import NDParallelOptions
    >>> opts = NDParallelOptions(dp_shard=2, tp=2, sequence_parallel=True)
    >>> opts.preset.name, opts.sizes["tp"], opts.parallel_config().sequence_parallel
    ('hsdp_tp', 2, True)
    >>> NDParallelOptions(tp_pan={"*": "colwise"})
    Traceback (most recent call last):
    ...
    TypeError: NDParallelOptions.__init__() got an unexpected keyword argument 'tp_pan'
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Iterable, Mapping, Optional, Union

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout

from meshkit.plugins.activation_checkpoint import ACMode
from meshkit.plugins.parallelize import ParallelConfig
from meshkit.plugins.dims import AXES
from meshkit.plugins.presets import Preset, Size, check_front_door
from meshkit.plugins.tensor_parallel import PlanEntry
from meshkit.schedules import resolve_virtual_stages

__all__ = ["NDParallelOptions", "build_options", "front_door_signature", "FABRIC_UNSUPPORTED"]


@dataclass(frozen=True)
class NDParallelOptions:
    """The settings of a meshkit strategy: the layout, the automatic path, checkpoints, the process group, the pipeline.

    Validated when built (any ``dataclasses.replace`` too); the strategy resolves ``"auto"`` sizes later, in
    ``setup_environment`` (they need the world size and the model).
    """

    preset: Union[str, Preset] = "hsdp_tp"
    """A name from :data:`~meshkit.plugins.presets.PRESETS` (``"fsdp2" "hsdp" "tp" "hsdp_tp" "cp" ...``): which axes
    ``"auto"`` turns on. Held as its :class:`~meshkit.plugins.presets.Preset` row once built."""
    dp_replicate: Size = "auto"
    """Replicas of the FSDP shards (HSDP across nodes), or ``"auto"``. The product of the five sizes is the world."""
    dp_shard: Size = "auto"
    """Ranks one FSDP2 shard group spans, or ``"auto"`` (whatever the other axes leave)."""
    pp: Size = "auto"
    """Pipeline stages (ranks), or ``"auto"`` (2 for a pipeline preset, else 1)."""
    cp: Size = "auto"
    """Context-parallel ranks a sequence is cut over, or ``"auto"``."""
    tp: Size = "auto"
    """Tensor-parallel ranks, or ``"auto"`` (the largest size within a node that divides heads, kv heads, hidden)."""
    tp_plan: Optional[dict[str, PlanEntry]] = None
    """Extra or overriding TP rules, ``{fnmatch pattern: "colwise" | "rowwise" | "replicate" | style}``."""
    sequence_parallel: bool = False
    """Shard norms and the residual stream on the sequence dim between the TP blocks."""
    loss_parallel: bool = False
    """Keep logits vocab-sharded; the loss and its backward run under ``loss_parallel()`` (the Trainer enters it
    around ``training_step``/``backward``; a Fabric loop enters ``fabric.strategy.loss_context()``)."""
    activation_checkpointing: ACMode = "none"
    """``"none" | "full" | "selective"``."""
    compile: bool = False
    """``torch.compile`` each block."""
    reshard_after_forward: bool = True
    """FSDP2 frees gathered block parameters after forward (ZeRO-3); False = ZeRO-2."""
    global_batch_size: Optional[int] = None
    """If given, checked to be divisible by the data-parallel size (and, under the Trainer, against the first batch)."""
    save_distributed_checkpoint: bool = True
    """DCP-sharded checkpoints (default) or one consolidated file (Trainer only: Fabric always writes DCP)."""
    allow_unverified: bool = False
    """Load a checkpoint that has no integrity record (a folder without ``meshkit.json``, a file without its
    sidecar): refused by default, since nothing can check its bytes."""
    cp_attention: str = "ring"
    """Context-parallel attention when cp > 1: ``"ring" | "allgather" | "ulysses"``."""
    cp_layout: str = "load_balanced"
    """How sequences are cut over cp: ``"load_balanced"`` (chunks r and 2cp-1-r) or ``"contiguous"``."""
    fused_kernels: bool = False
    """Swap in meshkit's Triton RMSNorm, SwiGLU, RoPE and fused linear cross-entropy before parallelizing."""
    process_group_backend: Optional[str] = None
    """``"gloo"`` / ``"nccl"``; None: Lightning's choice for the accelerator."""
    timeout: Optional[timedelta] = default_pg_timeout
    """How long a collective waits for a missing rank (a positive ``timedelta``); every sub-group gets it."""
    pp_schedule: str = "1f1b"
    """Pipeline schedule (pp > 1), a name from :data:`meshkit.schedules.SCHEDULE_NAMES` or an alias."""
    pp_microbatches: Optional[int] = None
    """Micro-batches per step (pp > 1); None: the schedule's default for the stage count."""
    pp_virtual_stages: Optional[int] = None
    """Stages per rank of a multi-stage schedule; None: its default."""
    pp_split_points: Optional[list[int]] = None
    """Block indices where a new stage starts; None: balanced by parameter count."""
    pp_timeline_dir: Optional[str] = None
    """Where each rank writes its pipeline timeline (read by ``meshkit bubble``); None: not written."""
    owner: str = field(default="NDParallelOptions", repr=False, compare=False)
    """The class whose constructor built these options: the name its error messages start with."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "preset", check_front_door(self.owner, self.preset, self.timeout))
        for name in ("allow_unverified", "save_distributed_checkpoint"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"{self.owner}: `{name}={value!r}` must be True or False. " + _BOOL_HELP[name])
        self.parallel_config()  # validates activation_checkpointing, cp_attention and cp_layout
        resolve_virtual_stages(self.pp_schedule, self.pp_virtual_stages)
        m = self.pp_microbatches
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise ValueError(f"{self.owner}: `pp_microbatches={m!r}` must be a positive int (or None: the default).")

    @property
    def sizes(self) -> dict[str, Size]:
        """``{axis: size or "auto"}`` in mesh order (``dp_replicate dp_shard pp cp tp``)."""
        return {axis: getattr(self, axis) for axis in AXES}

    def parallel_config(self, precision: str = "32-true") -> ParallelConfig:
        """The automatic path's settings (:class:`~meshkit.plugins.parallelize.ParallelConfig`) at ``precision``."""
        names = {f.name for f in dataclasses.fields(ParallelConfig)} - {"precision"}
        return ParallelConfig(precision=precision, **{n: getattr(self, n) for n in names})

    def non_default(self, names: Iterable[str]) -> list[str]:
        """Those of ``names`` whose value differs from the field's default, in order."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        return [n for n in names if getattr(self, n) != defaults[n]]


_BOOL_HELP = {
    "allow_unverified": "(True loads a checkpoint that has no integrity record, unverified.)",
    "save_distributed_checkpoint": "(True: a DCP-sharded folder; False: one consolidated file.)",
}

FABRIC_UNSUPPORTED: dict[str, str] = {
    "save_distributed_checkpoint": "Fabric's checkpoints are always DCP folders",
    "pp_schedule": "pp is refused under Fabric",
    "pp_microbatches": "pp is refused under Fabric",
    "pp_virtual_stages": "pp is refused under Fabric",
    "pp_split_points": "pp is refused under Fabric",
    "pp_timeline_dir": "pp is refused under Fabric",
}
"""The fields NDParallelFabricStrategy refuses at any value but the default, and why (the Trainer takes them)."""

_FIELDS = tuple(f.name for f in dataclasses.fields(NDParallelOptions) if f.name != "owner")


def build_options(owner: str, preset: Optional[str], options: Optional[NDParallelOptions],
                  settings: Mapping[str, Any]) -> NDParallelOptions:
    """A front door's options: ``options`` (or the defaults) with ``preset`` and the keyword ``settings`` over them.

    An unknown keyword is a TypeError naming the closest field; every value is checked by
    :class:`NDParallelOptions`.

    >>> build_options("NDParallelStrategy", "fsdp2", None, {"dp_shard": 4}).sizes["dp_shard"]
    4
    """
    unknown = [k for k in settings if k not in _FIELDS]
    if unknown:
        close = difflib.get_close_matches(unknown[0], _FIELDS, n=1)
        hint = f" (did you mean `{close[0]}`?)" if close else ""
        raise TypeError(
            f"{owner}() got an unexpected keyword argument {unknown[0]!r}{hint}; its settings are the fields of "
            f"meshkit.plugins.options.NDParallelOptions: {', '.join(_FIELDS)}."
        )
    if options is not None and not isinstance(options, NDParallelOptions):
        raise TypeError(f"{owner}: `options=` takes an NDParallelOptions, got {type(options).__name__}.")
    given = dict(settings)
    if preset is not None:
        given["preset"] = preset
    if options is None:
        return NDParallelOptions(**given, owner=owner)
    return dataclasses.replace(options, **given, owner=owner)


def front_door_signature(cls: type) -> inspect.Signature:
    """``cls.__init__``'s signature as a user reads it (``help()``, IDEs): ``preset``, ``options`` and every field."""
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
              inspect.Parameter("preset", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None,
                                annotation="Optional[str]"),
              inspect.Parameter("options", inspect.Parameter.KEYWORD_ONLY, default=None,
                                annotation="Optional[NDParallelOptions]")]
    for f in dataclasses.fields(NDParallelOptions):
        if f.name not in ("preset", "owner"):
            params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default,
                                            annotation=f.type))
    return inspect.Signature(params, return_annotation="None")
