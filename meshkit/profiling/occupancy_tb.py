"""TensorBoard output for occupancy reports, and a Lightning callback that reports a run's Triton kernels.

Drawing is kept apart from the analysis: :func:`occupancy_markdown` is a pure function of the reports;
:func:`write_occupancy_tensorboard` adds a text table and one bar chart per kernel x arch x config.
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

try:  # Lightning is a dependency of meshkit; keep this module importable for the CLI without it
    from lightning.pytorch.callbacks import Callback
except ImportError:  # pragma: no cover
    Callback = object  # type: ignore[misc,assignment]

from typing_extensions import override

from meshkit.profiling.occupancy import (ARCHS, LIMITERS, KernelReport, grid_waves, resolve_arch,
                                        sweep_occupancy)

__all__ = ["LaunchedKernel", "TritonKernelReport", "occupancy_markdown", "write_occupancy_tensorboard"]


def occupancy_markdown(reports: Sequence[KernelReport]) -> str:
    """A markdown table: one row per kernel x arch x config."""
    head = ("| kernel | arch | warps | stages | constexprs | regs/thread | spill B | smem B | blocks/SM | "
            "warps/SM | occupancy | limiter | hint |")
    lines = [head, "|" + "|".join(["---"] * 13) + "|"]
    for r in reports:
        occ = r.occupancy
        consts = ", ".join(f"{k}={v}" for k, v in r.constexprs.items())
        lines.append(f"| {r.kernel} | {r.arch} | {r.num_warps} | {r.num_stages} | {consts} | "
                     f"{r.registers_per_thread} | {r.spill_bytes} | {r.shared_bytes} | "
                     f"{occ.active_blocks_per_sm} | {occ.active_warps_per_sm}/{occ.max_warps_per_sm} | "
                     f"{occ.occupancy:.1%} | {occ.limiter} | {occ.hint} |")
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
    """Write the markdown table (tag ``occupancy/table``), an occupancy scalar and a bar chart per report.

    ``log_dir_or_writer`` is a run directory or an open ``SummaryWriter``.

    >>> write_occupancy_tensorboard([], "/tmp/meshkit-occ-doc")  # doctest: +SKIP
    """
    from torch.utils.tensorboard import SummaryWriter

    own = isinstance(log_dir_or_writer, (str, os.PathLike))
    writer = SummaryWriter(os.fspath(log_dir_or_writer)) if own else log_dir_or_writer
    try:
        writer.add_text("occupancy/table", occupancy_markdown(reports) if reports else empty_note, step)
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
