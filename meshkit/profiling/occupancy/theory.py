"""Theoretical warp occupancy by CUDA's rules (the ones ``cuda_occupancy.h`` implements), and grid waves.

Registers are allocated per warp in units of 256 and split over 4 SM sub-partitions; shared memory is
allocated per block in units of 128 bytes plus a 1 KiB per-block reservation (sm_80 on); the SM's warp,
block and thread caps apply. :func:`theoretical_occupancy` returns an :class:`Occupancy` with the limiter
and a hint saying what would lift it; :func:`grid_waves` says how a grid fills each GPU model.

Shared memory per SM is taken at the maximum carveout, as the driver configures it when a kernel's
shared memory needs it; a kernel launched with a smaller preferred carveout can reach fewer blocks.

>>> theoretical_occupancy("sm_90", registers_per_thread=168, num_warps=8).occupancy
0.125
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from meshkit.profiling.occupancy.arch import GPUS, ArchSpec, _find_gpu, resolve_arch

__all__ = ["LIMITERS", "GridWaves", "Occupancy", "grid_waves", "theoretical_occupancy"]

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

