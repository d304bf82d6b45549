"""Theoretical warp occupancy of Triton kernels on any NVIDIA target, computed without that GPU.

Three layers, each usable alone:

* :data:`ARCHS` / :data:`GPUS` — per-architecture SM limits and SM counts per GPU model, each row citing
  its source.
* :func:`theoretical_occupancy` — CUDA's occupancy rules (the ones ``cuda_occupancy.h`` implements):
  registers allocated per warp in units of 256 and split over 4 SM sub-partitions, shared memory
  allocated per block in units of 128 bytes plus a 1 KiB per-block reservation (sm_80 on), and the warp,
  block and thread caps of the SM. Returns an :class:`Occupancy` with the limiter and a hint.
* :func:`kernel_occupancy` — compiles a ``@triton.jit`` kernel for each target arch on this machine
  (Triton's CUDA backend and the ``ptxas``/``cuobjdump`` its wheel ships; no GPU needed), reads registers,
  spills and shared memory from the cubin (see :mod:`meshkit.profiling.occupancy_compile`) and feeds the
  calculator. With a grid it adds waves and tail utilisation per GPU model.

The CLI verb ``meshkit occupancy`` prints a table, ``--json`` or TensorBoard output.

Shared memory per SM is taken at the maximum carveout, as the driver configures it when a kernel's
shared memory needs it; a kernel launched with a smaller preferred carveout can reach fewer blocks.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
import math
import os
import sys
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from meshkit.hardware import CATALOG, Gpu, find_gpu

__all__ = [
    "ARCHS",
    "GPUS",
    "ArchSpec",
    "GpuModel",
    "GridWaves",
    "KernelReport",
    "Occupancy",
    "grid_waves",
    "kernel_occupancy",
    "resolve_arch",
    "sweep_occupancy",
    "theoretical_occupancy",
    "configure_parser",
    "run_cli",
]

_KIB = 1024

# Sources (NVIDIA documentation; the per-arch numbers below are copied from these tables by hand).
_SRC_CC_TABLE = ("CUDA C++ Programming Guide, 'Technical Specifications per Compute Capability' "
                 "(docs.nvidia.com/cuda/cuda-c-programming-guide/#features-and-technical-specifications)")
_SRC_OCC_H = ("cuda_occupancy.h (CUDA toolkit): register allocation granularity 256 per warp, "
              "4 sub-partitions per SM, shared-memory allocation granularity 128 B (cc >= 7.0)")
_SRC_AMPERE = ("NVIDIA Ampere GPU Architecture Tuning Guide, §Occupancy and §Increased Memory Capacity "
               "(docs.nvidia.com/cuda/ampere-tuning-guide/): 164 KB smem/SM and 163 KB/block on cc 8.0, "
               "100 KB and 99 KB on cc 8.6, 32 / 16 blocks per SM, 1 KB reserved per block")
_SRC_ADA = ("NVIDIA Ada GPU Architecture Tuning Guide, §Occupancy (docs.nvidia.com/cuda/ada-tuning-guide/): "
            "48 warps and 24 blocks per SM, 100 KB smem/SM, 99 KB/block")
_SRC_HOPPER = ("NVIDIA Hopper Tuning Guide, §Occupancy and §Shared memory (docs.nvidia.com/cuda/"
               "hopper-tuning-guide/): 64 warps and 32 blocks per SM, 228 KB smem/SM, 227 KB/block")
_SRC_BLACKWELL = ("NVIDIA Blackwell Tuning Guide, §Occupancy "
                  "(docs.nvidia.com/cuda/blackwell-tuning-guide/): "
                  "cc 10.0 keeps Hopper's 64 warps, 32 blocks, 64K registers and 228 KB smem per SM")


@dataclass(frozen=True)
class ArchSpec:
    """Per-SM limits of one compute capability.

    Field values count per SM unless the name says otherwise; ``*_bytes`` are bytes.
    """

    name: str
    """``"sm_90"``: the ptxas ``--gpu-name`` family."""
    capability: int
    """Compute capability as Triton's ``GPUTarget`` spells it: 90 for 9.0."""
    max_warps_per_sm: int
    max_blocks_per_sm: int
    max_threads_per_block: int
    registers_per_sm: int
    """32-bit registers in the SM's register file."""
    max_registers_per_block: int
    max_registers_per_thread: int
    register_allocation_unit: int
    """Registers are allocated per warp, rounded up to this many."""
    register_sub_partitions: int
    """The register file is split evenly over this many schedulers; a warp's registers live in one."""
    shared_per_sm_bytes: int
    """Shared memory per SM at the maximum carveout."""
    shared_per_block_bytes: int
    """Most a single block may use (the opt-in limit), reservation excluded."""
    shared_allocation_unit_bytes: int
    reserved_shared_per_block_bytes: int
    """System reservation added to every block (1 KiB from sm_80 on)."""
    sources: tuple[str, ...]

    @property
    def max_threads_per_sm(self) -> int:
        return self.max_warps_per_sm * 32


def _arch(name, cap, warps, blocks, smem_sm_kib, smem_block_kib, sources) -> ArchSpec:
    return ArchSpec(
        name=name, capability=cap, max_warps_per_sm=warps, max_blocks_per_sm=blocks,
        max_threads_per_block=1024,
        registers_per_sm=64 * _KIB, max_registers_per_block=64 * _KIB, max_registers_per_thread=255,
        register_allocation_unit=256, register_sub_partitions=4,
        shared_per_sm_bytes=smem_sm_kib * _KIB, shared_per_block_bytes=smem_block_kib * _KIB,
        shared_allocation_unit_bytes=128, reserved_shared_per_block_bytes=_KIB,
        sources=(_SRC_CC_TABLE, _SRC_OCC_H, *sources),
    )


ARCHS: dict[str, ArchSpec] = {
    # name        cc  warps blocks smem/SM KiB  smem/block KiB
    "sm_80": _arch("sm_80", 80, 64, 32, 164, 163, (_SRC_AMPERE,)),   # A100, A30
    "sm_86": _arch("sm_86", 86, 48, 16, 100, 99, (_SRC_AMPERE,)),    # A10, A40, RTX 3090
    "sm_89": _arch("sm_89", 89, 48, 24, 100, 99, (_SRC_ADA,)),       # L4, L40S, RTX 4090
    "sm_90": _arch("sm_90", 90, 64, 32, 228, 227, (_SRC_HOPPER,)),   # H100, H200
    # B200; Triton's wheel compiles it with its second ptxas (ptxas-blackwell)
    "sm_100": _arch("sm_100", 100, 64, 32, 228, 227, (_SRC_BLACKWELL,)),
}
"""Architecture table, keyed by ``"sm_XY"``."""


@dataclass(frozen=True)
class GpuModel:
    """A GPU product: its architecture and SM count (a view of a :class:`meshkit.hardware.Gpu` row)."""

    name: str
    arch: str
    sms: int
    source: str


def _model(row: Gpu) -> GpuModel:
    return GpuModel(row.name, row.arch, row.sms, row.sm_source)


_SM_FACTS = ("arch", "sms")

GPUS: dict[str, GpuModel] = {row.name: _model(row) for row in CATALOG if row.arch and row.sms}
"""SM counts per GPU model: the rows of meshkit's GPU catalog (:data:`meshkit.hardware.CATALOG`) that know them."""


def resolve_arch(arch: str | int) -> ArchSpec:
    """The :class:`ArchSpec` for ``"sm_90"``, ``"sm90"``, ``"sm_90a"``, ``90``, ``"9.0"`` or a GPU model name.

    >>> resolve_arch("H100").name
    'sm_90'
    """
    key = str(arch).strip()
    gpu = _find_gpu(key)
    if gpu is not None:
        return ARCHS[gpu.arch]
    digits = key.lower().removeprefix("sm").lstrip("_").rstrip("a").replace(".", "")
    name = f"sm_{digits}"
    if name not in ARCHS:
        raise ValueError(
            f"Unknown arch={arch!r}: the table holds {', '.join(ARCHS)} and the GPU models "
            f"{', '.join(GPUS)}. Pass one of those (e.g. arch='sm_90').")
    return ARCHS[name]


def _gpu_arch(name: str) -> str:
    gpu = _find_gpu(name)
    if gpu is None:
        raise ValueError(f"Unknown gpu={name!r}; known models: {', '.join(GPUS)}.")
    return gpu.arch


def _find_gpu(name: str) -> GpuModel | None:
    row = find_gpu(name, has=_SM_FACTS)
    return _model(row) if row is not None else None


# ---------------------------------------------------------------------------------------------------------
# Calculator
# ---------------------------------------------------------------------------------------------------------

LIMITERS = ("warps", "blocks", "registers", "shared_memory")


@dataclass(frozen=True)
class GridWaves:
    """How a grid of blocks fills one GPU model: ``waves = blocks / (SMs x active blocks per SM)``."""

    gpu: str
    sms: int
    blocks: int
    blocks_per_wave: int
    waves: float
    """Fractional number of waves; ``ceil(waves)`` waves are run."""
    tail_utilisation: float
    """Fraction of the SMs' block slots the last wave fills (1.0 when the grid divides evenly)."""
    efficiency: float
    """``blocks / (ceil(waves) x blocks_per_wave)``: slot use over the whole launch."""


@dataclass(frozen=True)
class Occupancy:
    """Theoretical occupancy of one kernel configuration on one architecture."""

    arch: str
    registers_per_thread: int
    num_warps: int
    shared_bytes: int
    """Static + dynamic shared memory the kernel asks for per block (reservation excluded)."""
    active_blocks_per_sm: int
    active_warps_per_sm: int
    max_warps_per_sm: int
    occupancy: float
    """``active_warps_per_sm / max_warps_per_sm``, 0..1."""
    limiter: str
    """The resource that caps resident blocks: one of ``"warps"``, ``"blocks"``, ``"registers"``,
    ``"shared_memory"`` (the first of those in that order when several tie)."""
    limiters: tuple[str, ...]
    """Every resource whose limit equals the active block count."""
    block_limits: dict[str, int]
    """Blocks per SM each resource alone would allow."""
    registers_allocated_per_block: int
    shared_allocated_per_block: int
    """Bytes per block after reservation and rounding to the allocation unit."""
    hint: str
    """What change would lift occupancy (or why it cannot)."""

    def waves(self, grid: int | Sequence[int], gpus: Iterable[str] | None = None) -> list[GridWaves]:
        """Waves and tail utilisation of ``grid`` on every GPU model of this arch (or the ones named)."""
        return grid_waves(self, grid, gpus)


def _round_up(x: int, unit: int) -> int:
    return -(-x // unit) * unit


def _register_block_limit(spec: ArchSpec, regs: int, num_warps: int) -> tuple[int, int]:
    """(blocks per SM allowed by registers, registers allocated per block); cuda_occupancy.h's rules."""
    per_warp = _round_up(regs * 32, spec.register_allocation_unit)
    per_block = per_warp * num_warps
    if per_warp == 0:
        return 10**9, 0
    # the launch check rounds the block's warps up to a multiple of the sub-partition count
    assumed = per_warp * _round_up(num_warps, spec.register_sub_partitions)
    if regs > spec.max_registers_per_thread or max(per_block, assumed) > spec.max_registers_per_block:
        return 0, per_block
    warps_per_partition = (spec.registers_per_sm // spec.register_sub_partitions) // per_warp
    return warps_per_partition * spec.register_sub_partitions // num_warps, per_block


def _shared_block_limit(spec: ArchSpec, shared_bytes: int) -> tuple[int, int]:
    allocated = _round_up(shared_bytes + spec.reserved_shared_per_block_bytes,
                          spec.shared_allocation_unit_bytes)
    if shared_bytes > spec.shared_per_block_bytes:
        return 0, allocated
    return spec.shared_per_sm_bytes // allocated, allocated


def theoretical_occupancy(arch: str | int, registers_per_thread: int, num_warps: int,
                          shared_bytes: int = 0) -> Occupancy:
    """Resident blocks and warps per SM for a kernel using these resources, by CUDA's occupancy rules.

    ``shared_bytes`` is what the kernel itself uses per block (static + dynamic); the per-block
    reservation is added here.

    >>> occ = theoretical_occupancy("sm_80", registers_per_thread=128, num_warps=4, shared_bytes=0)
    >>> occ.active_warps_per_sm, occ.occupancy, occ.limiter
    (16, 0.25, 'registers')
    """
    spec = resolve_arch(arch)
    _check_int("registers_per_thread", registers_per_thread, 0, spec.max_registers_per_thread,
               "ptxas never allocates more; pass the REG figure of the cubin")
    _check_int("num_warps", num_warps, 1, spec.max_threads_per_block // 32,
               f"a block holds at most {spec.max_threads_per_block} threads on {spec.name}")
    _check_int("shared_bytes", shared_bytes, 0, None, "pass static + dynamic shared bytes per block")

    reg_blocks, reg_alloc = _register_block_limit(spec, registers_per_thread, num_warps)
    smem_blocks, smem_alloc = _shared_block_limit(spec, shared_bytes)
    limits = {
        "warps": spec.max_warps_per_sm // num_warps,
        "blocks": spec.max_blocks_per_sm,
        "registers": reg_blocks,
        "shared_memory": smem_blocks,
    }
    blocks = min(limits.values())
    tied = tuple(k for k in LIMITERS if limits[k] == blocks)
    warps = blocks * num_warps
    occ = warps / spec.max_warps_per_sm
    limits = {k: min(v, 10**9) for k, v in limits.items()}
    hint = _hint(spec, registers_per_thread, num_warps, shared_bytes, limits, blocks, tied)
    return Occupancy(
        arch=spec.name, registers_per_thread=registers_per_thread, num_warps=num_warps,
        shared_bytes=shared_bytes,
        active_blocks_per_sm=blocks, active_warps_per_sm=warps, max_warps_per_sm=spec.max_warps_per_sm,
        occupancy=occ, limiter=tied[0], limiters=tied, block_limits=limits,
        registers_allocated_per_block=reg_alloc, shared_allocated_per_block=smem_alloc, hint=hint,
    )


def _check_int(name: str, value: Any, lo: int, hi: int | None, why: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        rng = f"an int in [{lo}, {hi}]" if hi is not None else f"an int >= {lo}"
        raise ValueError(f"{name}={value!r} must be {rng}: {why}.")


def _max_regs_for(spec: ArchSpec, num_warps: int, blocks: int) -> int:
    """Largest registers/thread that still lets ``blocks`` blocks of ``num_warps`` warps fit (0 if none)."""
    for regs in range(spec.max_registers_per_thread, 0, -1):
        if _register_block_limit(spec, regs, num_warps)[0] >= blocks:
            return regs
    return 0


def _hint(spec: ArchSpec, regs: int, num_warps: int, smem: int, limits: dict[str, int], blocks: int,
          tied: tuple[str, ...]) -> str:
    if blocks == 0:
        if limits["registers"] == 0:
            return (f"cannot launch: {regs} registers x {num_warps * 32} threads exceed the "
                    f"{spec.max_registers_per_block} registers of a block; use fewer warps or cap registers")
        return (f"cannot launch: {smem} B of shared memory exceed the {spec.shared_per_block_bytes} B "
                f"a block may use on {spec.name}; use smaller tiles or fewer num_stages")
    if blocks * num_warps == spec.max_warps_per_sm:
        return "full occupancy: every warp slot of the SM is used"
    others = [k for k in LIMITERS if k not in tied]
    # what the next resource allows once every tied limiter is lifted
    ceiling = min(limits[k] for k in others) if others else blocks
    want = blocks + 1
    if "warps" in tied:
        fits = [w for w in (1, 2, 4, 8, 16, 32) if spec.max_warps_per_sm % w == 0 and w <= num_warps]
        return (f"num_warps={num_warps} does not divide the {spec.max_warps_per_sm} warp slots of "
                f"{spec.name}; num_warps={max(fits)} would fill them")
    if ceiling < want:
        return f"{' and '.join(tied)} tie at {blocks} blocks/SM: lifting one alone does not help"
    steps = []
    gain = (min(ceiling, want) * num_warps) / spec.max_warps_per_sm
    if "registers" in tied:
        target = _max_regs_for(spec, num_warps, want)
        steps.append(f"cut registers from {regs} to <= {target} per thread (smaller tiles, fewer live "
                     f"values, or maxnreg)")
    if "shared_memory" in tied:
        budget = (spec.shared_per_sm_bytes // want) // spec.shared_allocation_unit_bytes \
            * spec.shared_allocation_unit_bytes - spec.reserved_shared_per_block_bytes
        steps.append(f"cut shared memory from {smem} to <= {budget} B per block (fewer num_stages or smaller "
                     f"tiles)")
    if "blocks" in tied:
        steps.append(f"raise num_warps above {num_warps}: at most {spec.max_blocks_per_sm} blocks fit an SM")
    return " and ".join(steps) + f" -> {want} blocks/SM, occupancy {gain:.0%}"


def grid_waves(occ: Occupancy, grid: int | Sequence[int],
               gpus: Iterable[str] | None = None) -> list[GridWaves]:
    """Waves of a grid on each GPU model of ``occ.arch`` (or on the models named in ``gpus``).

    >>> occ = theoretical_occupancy("sm_90", 32, 4, 0)   # 16 blocks/SM
    >>> w = grid_waves(occ, 4224, ["H100-SXM"])[0]       # 132 SMs x 16 = 2112 blocks per wave
    >>> w.waves, w.tail_utilisation
    (2.0, 1.0)
    """
    dims = [grid] if isinstance(grid, int) else list(grid)
    if not dims or any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in dims):
        raise ValueError(f"grid={grid!r} must be a positive int or a sequence of positive ints "
                         f"(blocks per axis).")
    blocks = math.prod(dims)
    if gpus is None:
        models = [g for g in GPUS.values() if g.arch == occ.arch]
    else:
        models = []
        for name in gpus:
            gpu = _find_gpu(name)
            if gpu is None:
                raise ValueError(f"Unknown gpu={name!r}; known models: {', '.join(GPUS)}.")
            models.append(gpu)
    out = []
    for gpu in models:
        per_wave = gpu.sms * occ.active_blocks_per_sm
        if per_wave == 0:
            out.append(GridWaves(gpu.name, gpu.sms, blocks, 0, math.inf, 0.0, 0.0))
            continue
        waves = blocks / per_wave
        rem = blocks % per_wave
        tail = rem / per_wave if rem else 1.0
        out.append(GridWaves(gpu.name, gpu.sms, blocks, per_wave, waves, tail,
                             blocks / (math.ceil(waves) * per_wave)))
    return out


# ---------------------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KernelReport:
    """One kernel x arch x launch config: compiled resources and the occupancy they allow."""

    kernel: str
    arch: str
    num_warps: int
    num_stages: int
    constexprs: dict[str, Any]
    registers_per_thread: int
    spill_bytes: int
    """Bytes of spill stores ptxas reports (``ptxas -v``); spill loads are in ``spill_load_bytes``."""
    spill_load_bytes: int
    local_bytes: int
    """Local memory per thread from the cubin (stack frame incl. spills)."""
    static_shared_bytes: int
    dynamic_shared_bytes: int
    occupancy: Occupancy
    waves: tuple[GridWaves, ...] = ()
    cached: bool = False

    @property
    def shared_bytes(self) -> int:
        return self.static_shared_bytes + self.dynamic_shared_bytes

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
            "block_limits": dict(occ.block_limits), "hint": occ.hint,
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
    (:mod:`meshkit.profiling.occupancy_compile`). Reports come in arch-major order.

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
    ``meshkit.kernels.builtin_kernel_specs()``.
    """
    from meshkit.profiling import occupancy_compile as oc

    arch_specs = list({s.name: s for s in (resolve_arch(a) for a in archs)}.values())  # "sm_90,H100" once
    if not arch_specs:
        raise ValueError("archs=[] is empty: name at least one target, e.g. archs=['sm_90'].")
    if gpus is not None:
        for g in gpus:
            _gpu_arch(g)
    entries = []
    for spec in specs:
        kernel = spec["kernel"]
        sig = oc.build_signature(kernel, args=spec.get("args"), signature=spec.get("signature"),
                                 constexprs=spec.get("constexprs"))
        cfgs = spec.get("configs")
        launch = oc.launch_configs(kernel, num_warps=None if cfgs is not None else num_warps,
                                   num_stages=None if cfgs is not None else num_stages, configs=cfgs)
        entries.append((kernel, sig, launch))
    measured = oc.compile_many(entries, [s.name for s in arch_specs], cache_dir=cache_dir, progress=progress)
    reports = []
    names = [spec.get("name") for spec in specs]
    for name, res in ((n, r) for n, per_kernel in zip(names, measured) for r in per_kernel):
        occ = theoretical_occupancy(res.arch, res.registers_per_thread, res.num_warps,
                                    res.static_shared_bytes + res.dynamic_shared_bytes)
        waves: tuple[GridWaves, ...] = ()
        if grid is not None:
            waves = tuple(grid_waves(occ, grid, None if gpus is None else
                                     [g for g in gpus if _gpu_arch(g) == res.arch]))
        reports.append(KernelReport(
            kernel=name or res.kernel, arch=res.arch, num_warps=res.num_warps, num_stages=res.num_stages,
            constexprs=res.constexprs, registers_per_thread=res.registers_per_thread,
            spill_bytes=res.spill_store_bytes, spill_load_bytes=res.spill_load_bytes,
            local_bytes=res.local_bytes,
            static_shared_bytes=res.static_shared_bytes, dynamic_shared_bytes=res.dynamic_shared_bytes,
            occupancy=occ, waves=waves, cached=res.cached,
        ))
    return reports


# ---------------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------------


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Flags of ``meshkit occupancy``."""
    parser.add_argument("target", nargs="?",
                        help="MODULE:KERNEL or path/to/file.py:KERNEL (a @triton.jit function)")
    parser.add_argument("--builtin", action="store_true", help="report every kernel in meshkit.kernels")
    parser.add_argument("--signature", help='argument types, e.g. "X=*fp32,W=*fp32,N=i32"')
    parser.add_argument("--constexpr", action="append", default=[], metavar="NAME=VALUE",
                        help="a tl.constexpr value (repeatable)")
    parser.add_argument("--num-warps", help="comma list, e.g. 4,8 (default: autotune configs, else 4)")
    parser.add_argument("--num-stages", help="comma list (default: autotune configs, else 3)")
    parser.add_argument("--arch", default="sm_80,sm_90",
                        help=f"comma list of archs or GPU models ({', '.join(ARCHS)}; {', '.join(GPUS)})")
    parser.add_argument("--grid", help="blocks, e.g. 4096 or 64x32: adds waves and tail per GPU model")
    parser.add_argument("--gpu", help="comma list of GPU models for --grid (default: all of each arch)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--tensorboard", metavar="DIR",
                        help="also write a table and bar charts to this run dir")
    parser.add_argument("--cache-dir", help="result cache (default $MESHKIT_CACHE_DIR or ~/.cache/meshkit)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def _int_list(name: str, text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise ValueError(f"{name}={text!r} must be a comma list of ints, e.g. 4,8.") from None


def _parse_constexprs(items: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"--constexpr {item!r} must read NAME=VALUE, e.g. --constexpr BLOCK=1024.")
        out[name.strip()] = _literal(value.strip())
    return out


def _literal(text: str) -> Any:
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return {"True": True, "False": False}.get(text, text)


def load_kernel(target: str) -> tuple[str, Any]:
    """Import ``MODULE:KERNEL`` or ``path/file.py:KERNEL``; returns (display name, kernel object)."""
    mod_part, sep, name = target.rpartition(":")
    if not sep or not mod_part or not name:
        raise ValueError(f"target={target!r} must read MODULE:KERNEL or path/to/file.py:KERNEL.")
    if mod_part.endswith(".py") or os.sep in mod_part:
        if not os.path.isfile(mod_part):
            raise ValueError(f"target={target!r}: no file {mod_part!r}.")
        from meshkit.profiling.occupancy_compile import import_file
        module = import_file(mod_part)
    else:
        try:
            module = importlib.import_module(mod_part)
        except ImportError as exc:
            raise ValueError(f"target={target!r}: cannot import module {mod_part!r} ({exc}).") from None
    if not hasattr(module, name):
        raise ValueError(f"target={target!r}: module {mod_part!r} has no attribute {name!r}.")
    return name, getattr(module, name)


def _builtin_specs() -> list[dict[str, Any]]:
    try:
        kernels = importlib.import_module("meshkit.kernels")
        specs = kernels.builtin_kernel_specs
    except (ImportError, AttributeError):
        raise ValueError("--builtin needs meshkit.kernels.builtin_kernel_specs(), which this meshkit does "
                         "not have yet; name a kernel instead: meshkit occupancy MODULE:KERNEL "
                         "--signature ...") from None
    return list(specs())


def _format_table(reports: Sequence[KernelReport]) -> str:
    head = ["kernel", "arch", "warps", "stages", "regs", "spill B", "smem B", "blocks/SM", "warps/SM", "occ",
            "limiter"]
    rows = [[r.kernel, r.arch, r.num_warps, r.num_stages, r.registers_per_thread, r.spill_bytes,
             r.shared_bytes, r.occupancy.active_blocks_per_sm, r.occupancy.active_warps_per_sm,
             f"{r.occupancy.occupancy:.0%}", r.occupancy.limiter] for r in reports]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    lines = ["  ".join(str(x).rjust(w) for x, w in zip(row, widths)) for row in [head, *rows]]
    for r in reports:
        lines.append(f"{r.kernel} {r.arch} w{r.num_warps} s{r.num_stages}: {r.occupancy.hint}")
        for w in r.waves:
            lines.append(f"    {w.gpu}: {w.blocks} blocks, {w.blocks_per_wave}/wave -> {w.waves:.2f} waves, "
                         f"tail {w.tail_utilisation:.0%}, efficiency {w.efficiency:.0%}")
    return "\n".join(lines)


def run_cli(args: argparse.Namespace) -> int:
    """Entry of ``meshkit occupancy``; returns the exit status."""
    try:
        reports = _run(args)
    except ValueError as exc:
        print(f"meshkit occupancy: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"reports": [r.to_dict() for r in reports]}, indent=1))
    else:
        print(_format_table(reports))
    if args.tensorboard:
        from meshkit.profiling.occupancy_tb import write_occupancy_tensorboard
        write_occupancy_tensorboard(reports, args.tensorboard)
    return 0


def _run(args: argparse.Namespace) -> list[KernelReport]:
    if bool(args.builtin) == bool(args.target):
        raise ValueError("give either a target MODULE:KERNEL or --builtin (exactly one).")
    archs = [a for a in args.arch.split(",") if a.strip()]
    grid = None
    if args.grid:
        try:
            grid = [int(x) for x in args.grid.lower().replace(",", "x").split("x")]
        except ValueError:
            raise ValueError(f"--grid={args.grid!r} must be ints joined by x, e.g. 4096 or 64x32.") from None
    gpus = args.gpu.split(",") if args.gpu else None
    common = dict(num_warps=_int_list("--num-warps", args.num_warps),
                  num_stages=_int_list("--num-stages", args.num_stages), archs=archs, grid=grid, gpus=gpus,
                  cache_dir=args.cache_dir, progress=not args.no_progress)
    if args.builtin:
        if args.signature or args.constexpr:
            raise ValueError("--builtin takes each kernel's own signature; drop --signature/--constexpr.")
        return sweep_occupancy(_builtin_specs(), **common)
    _, kernel = load_kernel(args.target)
    if args.signature is None:
        raise ValueError("--signature is required for a named kernel, e.g. --signature 'X=*fp32,N=i32'.")
    return kernel_occupancy(kernel, signature=args.signature, constexprs=_parse_constexprs(args.constexpr),
                            **common)
