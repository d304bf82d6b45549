"""Per-architecture SM limits (:data:`ARCHS`) and SM counts per GPU model (:data:`GPUS`), each row citing
its source.

The ground floor of :mod:`meshkit.profiling.occupancy`: it imports nothing else of meshkit.

>>> resolve_arch("H100").name, ARCHS["sm_80"].max_warps_per_sm
('sm_90', 64)
"""

from __future__ import annotations

from dataclasses import dataclass

from meshkit.hardware import CATALOG, Gpu, find_gpu

__all__ = ["ARCHS", "GPUS", "ArchSpec", "resolve_arch"]

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


_SM_FACTS = ("arch", "sms")

GPUS: dict[str, Gpu] = {row.name: row for row in CATALOG if row.arch and row.sms}
"""The rows of meshkit's GPU catalog (:class:`meshkit.hardware.Gpu`, one record type) that know their
architecture and SM count (``arch``, ``sms``, ``sm_source``), by name."""


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


def _find_gpu(name: str) -> Gpu | None:
    return find_gpu(name, has=_SM_FACTS)


