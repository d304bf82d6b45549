"""Occupancy reports: a kernel's compiled resources composed with the occupancy they allow, as data,
text and markdown tables, TensorBoard, and a Lightning callback that reports a run's Triton kernels.

:func:`kernel_occupancy` / :func:`sweep_occupancy` compile (:mod:`~meshkit.profiling.occupancy.compile`)
and apply the calculator (:mod:`~meshkit.profiling.occupancy.theory`). Drawing is kept apart from the
analysis: :func:`occupancy_text` and :func:`occupancy_markdown` are pure functions of the reports;
:func:`write_occupancy_tensorboard` adds a text table and one bar chart per kernel x arch x config.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

try:  # Lightning is a dependency of meshkit; keep this module importable for the CLI without it
    from lightning.pytorch.callbacks import Callback
except ImportError:  # pragma: no cover
    Callback = object  # type: ignore[misc,assignment]

from typing_extensions import override

from meshkit.profiling.occupancy.arch import ARCHS, _gpu_arch, resolve_arch
from meshkit.profiling.occupancy.compile import KernelResources, build_signature, compile_many, launch_configs
from meshkit.profiling.occupancy.theory import (LIMITERS, GridWaves, Occupancy, grid_waves,
                                                theoretical_occupancy)
from meshkit.profiling.report import text_table
from meshkit.quiet import quiet_lightning_pytree

__all__ = [
    "KernelReport",
    "LaunchedKernel",
    "TritonKernelReport",
    "kernel_occupancy",
    "occupancy_markdown",
    "occupancy_text",
    "sweep_occupancy",
    "write_occupancy_tensorboard",
]


def _resource(name: str) -> property:
    """A read-only :class:`KernelReport` attribute that reads ``self.resources.<name>``."""
    return property(lambda self: getattr(self.resources, name),
                    doc=f"``resources.{name}`` (see :class:`KernelResources`).")


@dataclass(frozen=True)
class KernelReport:
    """One kernel x arch x launch config: its compiled :class:`KernelResources` and the occupancy they allow.

    The resource figures read through: ``report.registers_per_thread`` is
    ``report.resources.registers_per_thread``, and ``report.spill_bytes`` is
    ``report.resources.spill_store_bytes`` (spill loads: ``spill_load_bytes``). ``kernel`` is a
    spec's ``name`` where one was given, else the function's. :meth:`to_dict` is the ``--json`` record.

    >>> rep = kernel_occupancy(kernel, signature="X=*fp32,N=i32", archs=["sm_90"])[0]  # doctest: +SKIP
    >>> rep.registers_per_thread, rep.occupancy.limiter  # doctest: +SKIP
    (16, 'warps')
    """

    resources: KernelResources
    occupancy: Occupancy
    waves: tuple[GridWaves, ...] = ()

    kernel = _resource("kernel")
    arch = _resource("arch")
    num_warps = _resource("num_warps")
    num_stages = _resource("num_stages")
    constexprs = _resource("constexprs")
    registers_per_thread = _resource("registers_per_thread")
    spill_bytes = _resource("spill_store_bytes")
    spill_load_bytes = _resource("spill_load_bytes")
    local_bytes = _resource("local_bytes")
    static_shared_bytes = _resource("static_shared_bytes")
    dynamic_shared_bytes = _resource("dynamic_shared_bytes")
    shared_bytes = _resource("shared_bytes")
    cached = _resource("cached")

    @property
    def hint(self) -> str:
        """What to change first: the spills if there are any (they cost more than occupancy: every spilled value
        is a store and a load through local memory, i.e. the L1/L2 and DRAM), then the occupancy hint."""
        if not self.spill_bytes:
            return self.occupancy.hint
        return (f"spills {self.spill_bytes} B of registers per thread to local memory "
                f"({self.registers_per_thread} registers live): fix this first, with fewer live values per thread "
                f"(a smaller BLOCK, fewer num_stages, or num_warps above {self.num_warps} to spread the tile); "
                f"then: {self.occupancy.hint}")

    def to_dict(self) -> dict[str, Any]:
        """Flat JSON-able record (the ``--json`` shape)."""
        occ = self.occupancy
        return {
            "kernel": self.kernel, "arch": self.arch, "num_warps": self.num_warps,
            "num_stages": self.num_stages,
            "constexprs": dict(self.constexprs),
            "registers_per_thread": self.registers_per_thread, "spill_bytes": self.spill_bytes,
            "spill_load_bytes": self.spill_load_bytes, "local_bytes": self.local_bytes,
            "shared_bytes": self.shared_bytes, "static_shared_bytes": self.static_shared_bytes,
            "dynamic_shared_bytes": self.dynamic_shared_bytes,
            "active_blocks_per_sm": occ.active_blocks_per_sm, "active_warps_per_sm": occ.active_warps_per_sm,
            "max_warps_per_sm": occ.max_warps_per_sm, "occupancy": occ.occupancy, "limiter": occ.limiter,
            "block_limits": dict(occ.block_limits), "hint": self.hint,
            "waves": [{k: (v if not isinstance(v, float) or math.isfinite(v) else None)
                       for k, v in dataclasses.asdict(w).items()} for w in self.waves],
        }


def kernel_occupancy(
    kernel: Any,
    args: Sequence[Any] | None = None,
    *,
    signature: str | Mapping[str, str] | None = None,
    constexprs: Mapping[str, Any] | None = None,
    num_warps: int | Sequence[int] | None = None,
    num_stages: int | Sequence[int] | None = None,
    configs: Sequence[Any] | None = None,
    archs: Sequence[str] = ("sm_80", "sm_90"),
    grid: int | Sequence[int] | None = None,
    gpus: Sequence[str] | None = None,
    cache_dir: str | os.PathLike | None = None,
    progress: bool = False,
) -> list[KernelReport]:
    """Compile ``kernel`` for each arch and launch config on this machine and report its occupancy.

    Give the argument types as example ``args`` (tensors become pointers, ints ``i32``/``i64``, floats
    ``fp32``) or as ``signature`` (``"X=*fp32,N=i32"`` or a dict; ``"i32:16"`` marks a 16-divisible int as
    Triton's launcher would), and the ``tl.constexpr`` values in ``constexprs``. Configs are the
    product of ``num_warps`` x ``num_stages`` (defaults 4 and 3), or ``configs`` (``triton.Config``
    objects or dicts with ``num_warps``, ``num_stages`` and constexpr values), or, for an
    ``@triton.autotune`` kernel given neither, its own configs. Results are cached on disk
    (:mod:`meshkit.profiling.occupancy.compile`). Reports come in arch-major order.

    >>> import triton, triton.language as tl
    >>> @triton.jit
    ... def scale(X, N, BLOCK: tl.constexpr):
    ...     offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ...     tl.store(X + offs, tl.load(X + offs, mask=offs < N) * 2, mask=offs < N)
    >>> reps = kernel_occupancy(scale, signature="X=*fp32,N=i32", constexprs={"BLOCK": 1024},
    ...                         archs=["sm_90"])  # doctest: +SKIP
    >>> reps[0].occupancy.limiter  # doctest: +SKIP
    'warps'
    """
    spec = {"kernel": kernel, "args": args, "signature": signature, "constexprs": constexprs,
            "configs": configs}
    return sweep_occupancy([spec], num_warps=num_warps, num_stages=num_stages, archs=archs, grid=grid,
                           gpus=gpus, cache_dir=cache_dir, progress=progress)


def _override(configs: Sequence[Any], **given: int | Sequence[int] | None) -> list[Any]:
    """A spec's configs with the caller's num_warps / num_stages (each value given) in place of their own."""
    lists = {k: [v] if isinstance(v, int) else list(v) for k, v in given.items() if v is not None}
    out = [c for c in configs]
    for key, values in lists.items():
        out = [{**(dict(c) if isinstance(c, Mapping) else {"num_warps": c.num_warps, "num_stages": c.num_stages,
                                                            **c.kwargs}), key: v} for c in out for v in values]
    return out


def sweep_occupancy(
    specs: Sequence[Mapping[str, Any]],
    *,
    num_warps: int | Sequence[int] | None = None,
    num_stages: int | Sequence[int] | None = None,
    archs: Sequence[str] = ("sm_80", "sm_90"),
    grid: int | Sequence[int] | None = None,
    gpus: Sequence[str] | None = None,
    cache_dir: str | os.PathLike | None = None,
    progress: bool = False,
) -> list[KernelReport]:
    """:func:`kernel_occupancy` for many kernels in one worker pool (one progress bar).

    Each spec is a dict with ``kernel`` and ``signature`` (or ``args``), optional ``constexprs``,
    ``configs`` and ``name`` (the reports' kernel name; default the function's) — the shape of
    ``meshkit.kernels.builtin_kernel_specs()``. ``num_warps`` / ``num_stages``, when given, replace that value
    in each spec's configs (a spec without configs: the grid of both, as :func:`kernel_occupancy`).

    >>> specs = [{"kernel": scale, "signature": "X=*fp32,N=i32", "constexprs": {"BLOCK": 1024}},
    ...          {"kernel": matmul, "signature": MM_SIG, "name": "mm"}]  # doctest: +SKIP
    >>> [r.kernel for r in sweep_occupancy(specs, archs=["sm_90"])]  # doctest: +SKIP
    ['scale', 'mm']
    """
    arch_specs = list({s.name: s for s in (resolve_arch(a) for a in archs)}.values())  # "sm_90,H100" once
    if not arch_specs:
        raise ValueError("archs=[] is empty: name at least one target, e.g. archs=['sm_90'].")
    if gpus is not None:
        for g in gpus:
            _gpu_arch(g)
    entries = []
    for spec in specs:
        kernel = spec["kernel"]
        sig = build_signature(kernel, args=spec.get("args"), signature=spec.get("signature"),
                              constexprs=spec.get("constexprs"))
        cfgs = spec.get("configs")
        if cfgs is None:
            launch = launch_configs(kernel, num_warps=num_warps, num_stages=num_stages)
        else:
            launch = launch_configs(kernel, configs=_override(cfgs, num_warps=num_warps, num_stages=num_stages))
        entries.append((kernel, sig, launch))
    measured = compile_many(entries, [s.name for s in arch_specs], cache_dir=cache_dir, progress=progress)
    reports = []
    names = [spec.get("name") for spec in specs]
    for name, res in ((n, r) for n, per_kernel in zip(names, measured) for r in per_kernel):
        occ = theoretical_occupancy(res.arch, res.registers_per_thread, res.num_warps, res.shared_bytes)
        waves: tuple[GridWaves, ...] = ()
        if grid is not None:
            waves = tuple(grid_waves(occ, grid, None if gpus is None else
                                     [g for g in gpus if _gpu_arch(g) == res.arch]))
        reports.append(KernelReport(dataclasses.replace(res, kernel=name) if name else res, occ, waves))
    return reports


def occupancy_text(reports: Sequence[KernelReport]) -> str:
    """The plain-text table ``meshkit occupancy`` prints: one row per report, then each hint and its waves."""
    head = ["kernel", "arch", "warps", "stages", "regs", "spill B", "smem B", "blocks/SM", "warps/SM", "occ",
            "limiter"]
    rows = [[r.kernel, r.arch, r.num_warps, r.num_stages, r.registers_per_thread, r.spill_bytes,
             r.shared_bytes, r.occupancy.active_blocks_per_sm, r.occupancy.active_warps_per_sm,
             f"{r.occupancy.occupancy:.0%}", r.occupancy.limiter] for r in reports]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    lines = ["  ".join(str(x).rjust(w) for x, w in zip(row, widths)) for row in [head, *rows]]
    for r in reports:
        lines.append(f"{r.kernel} {r.arch} w{r.num_warps} s{r.num_stages}: {r.hint}")
        for w in r.waves:
            lines.append(f"    {w.gpu}: {w.blocks} blocks, {w.blocks_per_wave}/wave -> {w.waves:.2f} waves, "
                         f"tail {w.tail_utilisation:.0%}, efficiency {w.efficiency:.0%}")
    return "\n".join(lines)


_TABLE_HEADER = ("kernel", "arch", "warps", "stages", "constexprs", "regs/thread", "spill B", "smem B", "blocks/SM",
                 "warps/SM", "occupancy", "limiter", "hint")


def _table_rows(reports: Sequence[KernelReport]) -> list[list[str]]:
    """One row per kernel x arch x config, in the order of :data:`_TABLE_HEADER`."""
    rows = []
    for r in reports:
        occ = r.occupancy
        consts = ", ".join(f"{k}={v}" for k, v in r.constexprs.items())
        rows.append([r.kernel, r.arch, str(r.num_warps), str(r.num_stages), consts, str(r.registers_per_thread),
                     str(r.spill_bytes), str(r.shared_bytes), str(occ.active_blocks_per_sm),
                     f"{occ.active_warps_per_sm}/{occ.max_warps_per_sm}", f"{occ.occupancy:.1%}", occ.limiter,
                     r.hint])
    return rows


def occupancy_markdown(reports: Sequence[KernelReport]) -> str:
    """A markdown table: one row per kernel x arch x config."""
    lines = ["| " + " | ".join(_TABLE_HEADER) + " |", "|" + "|".join(["---"] * len(_TABLE_HEADER)) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in _table_rows(reports)]
    return "\n".join(lines)


def _bar_figure(report: KernelReport):
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    occ = report.occupancy
    # warps per SM each resource alone would allow, capped at the SM's warp slots
    values = [min(occ.block_limits[k] * report.num_warps, occ.max_warps_per_sm) for k in LIMITERS]
    fig, ax = plt.subplots(figsize=(5, 3))
    colors = ["tab:red" if k in occ.limiters else "tab:blue" for k in LIMITERS]
    ax.bar(LIMITERS, values, color=colors)
    ax.axhline(occ.max_warps_per_sm, color="gray", linestyle="--", linewidth=1)
    ax.set_ylabel("warps/SM allowed")
    ax.set_title(f"{report.kernel} {report.arch} w{report.num_warps} s{report.num_stages}: "
                 f"{occ.occupancy:.0%} ({occ.limiter})", fontsize=9)
    fig.tight_layout()
    return fig


def _tag(report: KernelReport) -> str:
    consts = "_".join(f"{k}{v}" for k, v in report.constexprs.items())
    cfg = f"w{report.num_warps}_s{report.num_stages}_{consts}".rstrip("_")
    return f"occupancy/{report.kernel}/{report.arch}/{cfg}"


def write_occupancy_tensorboard(reports: Sequence[KernelReport], log_dir_or_writer: Any, step: int = 0,
                                empty_note: str = "no kernels to report") -> None:
    """Write the table (tag ``occupancy/table``, pre-formatted text), an occupancy scalar and a bar chart per report.

    ``log_dir_or_writer`` is a run directory or an open ``SummaryWriter``.

    >>> write_occupancy_tensorboard([], "/tmp/meshkit-occ-doc")  # doctest: +SKIP
    """
    from torch.utils.tensorboard import SummaryWriter

    own = isinstance(log_dir_or_writer, (str, os.PathLike))
    writer = SummaryWriter(os.fspath(log_dir_or_writer)) if own else log_dir_or_writer
    try:
        # 13 columns: pre-formatted text, which TensorBoard's TEXT dashboard does not wrap letter by letter
        writer.add_text("occupancy/table", text_table(_TABLE_HEADER, _table_rows(reports)) if reports else empty_note,
                        step)
        for r in reports:
            writer.add_scalar(_tag(r) + "/occupancy", r.occupancy.occupancy, step)
            writer.add_figure(_tag(r) + "/limits", _bar_figure(r), step, close=True)
        writer.flush()
    finally:
        if own:
            writer.close()


@dataclass
class LaunchedKernel:
    """A Triton kernel a run compiled and launched, as Triton's hooks describe it."""

    module: str
    name: str
    signature: dict[str, str]
    constexprs: dict[str, Any]
    num_warps: int
    num_stages: int
    kernel: Any = field(default=None, repr=False)


def _add_grid_to_launch_metadata():
    """Make Triton's launch-hook metadata carry the grid (it holds name, function and stream only).

    Wraps the private ``CompiledKernel.launch_metadata`` (checked on triton 3.8.0); returns the undo.
    """
    from triton.compiler.compiler import CompiledKernel

    original = CompiledKernel.launch_metadata

    def launch_metadata(self, grid, stream, *args):
        ret = original(self, grid, stream, *args)
        if ret is not None and isinstance(getattr(ret, "data", None), dict):
            dims = tuple(int(g) for g in grid) + (1, 1, 1)
            ret.data["meshkit_grid"] = dims[:3]
        return ret

    CompiledKernel.launch_metadata = launch_metadata
    return lambda: setattr(CompiledKernel, "launch_metadata", original)


class TritonKernelReport(Callback):
    """Reports, at fit end, every Triton kernel the run compiled and launched, with its occupancy per arch.

    It listens to Triton's ``jit_post_compile_hook`` (what was compiled: signature, constexprs, warps,
    stages) and ``launch_enter_hook`` (how often each kernel ran, with which grid: ``self.grids``); each
    report gets the waves of its kernel's most frequent grid on the GPU models of its arch. Under
    ``TRITON_INTERPRET=1`` (CPU runs) Triton compiles and launches nothing, so the report is empty and
    says so. Reports go to the trainer's TensorBoard logger (or ``log_dir``) and stay on
    ``self.reports``.

    Example::

        trainer = L.Trainer(callbacks=[TritonKernelReport(archs=["sm_90"])])
    """

    def __init__(self, archs: Sequence[str] | None = None, log_dir: str | None = None,
                 cache_dir: str | None = None) -> None:
        self.archs = list(archs) if archs is not None else None
        self.log_dir = log_dir
        self.cache_dir = cache_dir
        self.kernels: dict[tuple, LaunchedKernel] = {}
        self.launches: dict[str, int] = {}
        self.grids: dict[str, Counter] = {}
        self._undo_grid_patch = None
        self.reports: list[KernelReport] = []
        self.note = ""
        self._prev_compile_hook = None
        self._installed = False

    # -- Triton hooks ------------------------------------------------------------------------------------
    def _on_compile(self, *, key, repr, fn, compile, is_manual_warmup, already_compiled):  # noqa: A002
        jit = fn.jit_function
        consts = {}
        for path, value in (compile.get("constants") or {}).items():
            idx = path[0] if isinstance(path, tuple) else path
            name = jit.arg_names[idx] if isinstance(idx, int) else str(idx)
            consts[name] = value
        sig = {(k if isinstance(k, str) else getattr(k, "name", str(k))): v
               for k, v in (compile.get("signature") or {}).items()}
        sig = {k: v for k, v in sig.items() if v != "constexpr" and k not in consts}
        attrs = (compile.get("configs") or [{}])[0] or {}
        for path, items in attrs.items():
            idx = path[0] if isinstance(path, tuple) else path
            name = jit.arg_names[idx] if isinstance(idx, int) and idx < len(jit.arg_names) else None
            if name in sig and not sig[name].startswith("*") and ["tt.divisibility", 16] in list(items):
                sig[name] = sig[name] + ":16"
        k = (fn.module, fn.name, tuple(sorted(sig.items())),
             tuple(sorted((a, str(b)) for a, b in consts.items())),
             compile["num_warps"], compile["num_stages"])
        self.kernels.setdefault(k, LaunchedKernel(fn.module, fn.name, sig, consts, compile["num_warps"],
                                                  compile["num_stages"], kernel=jit))
        if self._prev_compile_hook is not None:
            return self._prev_compile_hook(key=key, repr=repr, fn=fn, compile=compile,
                                           is_manual_warmup=is_manual_warmup,
                                           already_compiled=already_compiled)
        return None

    def _on_launch(self, metadata) -> None:
        data = metadata.get()
        name = data["name"]
        self.launches[name] = self.launches.get(name, 0) + 1
        if "meshkit_grid" in data:
            self.grids.setdefault(name, Counter())[data["meshkit_grid"]] += 1

    def install(self) -> None:
        """Start listening (done at fit start)."""
        from triton import knobs

        if self._installed:
            return
        self._prev_compile_hook = knobs.runtime.jit_post_compile_hook
        knobs.runtime.jit_post_compile_hook = self._on_compile
        knobs.runtime.launch_enter_hook.add(self._on_launch)
        self._undo_grid_patch = _add_grid_to_launch_metadata()
        self._installed = True

    def uninstall(self) -> None:
        """Stop listening and restore any previous compile hook."""
        from triton import knobs

        if not self._installed:
            return
        knobs.runtime.jit_post_compile_hook = self._prev_compile_hook
        knobs.runtime.launch_enter_hook.remove(self._on_launch)
        self._undo_grid_patch()
        self._installed = False

    # -- Lightning hooks ---------------------------------------------------------------------------------
    @override
    def on_fit_start(self, trainer, pl_module) -> None:
        quiet_lightning_pytree()  # Lightning's own LeafSpec warning, also in a one-device run (meshkit.quiet)
        self.archs = [resolve_arch(a).name for a in (self.archs or self._default_archs())]  # fail early
        self.install()

    @override
    def on_fit_end(self, trainer, pl_module) -> None:
        self.uninstall()
        self.reports = self.measure()
        if trainer.is_global_zero:
            self._write(trainer)

    def _default_archs(self) -> list[str]:
        import torch

        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            arch = f"sm_{major}{minor}"
            if arch not in ARCHS:
                raise ValueError(f"TritonKernelReport: this GPU is {arch}, which the occupancy table lacks "
                                 f"({', '.join(ARCHS)}); pass archs=[...] with targets from the table.")
            return [arch]
        return ["sm_90"]

    def measure(self) -> list[KernelReport]:
        """Offline occupancy of every recorded kernel for ``archs`` (default: this GPU's arch, else sm_90)."""
        import triton

        if not self.kernels:
            interp = bool(triton.knobs.runtime.interpret)
            self.note = ("no Triton kernels were compiled or launched during fit"
                         + (" (TRITON_INTERPRET=1: kernels ran in Triton's interpreter, which compiles "
                            "nothing)" if interp else ""))
            return []
        archs = self.archs or self._default_archs()
        specs = [{"kernel": rec.kernel, "signature": rec.signature, "constexprs": rec.constexprs,
                  "configs": [{"num_warps": rec.num_warps, "num_stages": rec.num_stages}]}
                 for rec in self.kernels.values()]
        reports = sweep_occupancy(specs, archs=archs, cache_dir=self.cache_dir)
        for i, rep in enumerate(reports):
            if self.grids.get(rep.kernel):
                grid = self.grids[rep.kernel].most_common(1)[0][0]
                reports[i] = dataclasses.replace(rep, waves=tuple(grid_waves(rep.occupancy, grid)))
        self.note = f"{len(self.kernels)} kernel specialisation(s), launches: {self.launches}"
        return reports

    def _write(self, trainer) -> None:
        writer = None
        logger = trainer.logger
        exp = getattr(logger, "experiment", None) if logger is not None else None
        if self.log_dir is None and exp is not None and hasattr(exp, "add_text"):
            writer = exp
        target = writer if writer is not None else (self.log_dir or trainer.default_root_dir)
        write_occupancy_tensorboard(self.reports, target, step=trainer.global_step, empty_note=self.note)
