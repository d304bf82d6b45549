"""One catalog of accelerators: dense peaks with sources, memory, HBM and link bandwidths, arch, SMs.

Ground floor: both :mod:`meshkit.planner` and :mod:`meshkit.profiling` (MFU peaks,
occupancy waves) read their device facts here, through one name matcher. Each row is one product
variant; a field a row does not know is ``None`` (empty ``peaks``), and the views built on the
catalog skip such rows: ``meshkit.profiling.flops.PEAK_TABLE`` (rows with peaks),
``meshkit.planner.GPU_TABLE`` (rows with memory and links), ``meshkit.profiling.occupancy.GPUS``
(rows with an SM count). Pure Python, no torch.

Example::

    >>> from meshkit.hardware import gpu
    >>> h100 = gpu("NVIDIA H100 80GB HBM3")
    >>> h100.name, h100.peaks["bf16"], h100.memory_gb, h100.sms
    ('H100-SXM', 989400000000000.0, 80, 132)
    >>> round(h100.ridge("bf16"))   # FLOP per byte of HBM traffic
    295
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

__all__ = ["Gpu", "CATALOG", "rows", "find_gpu", "gpu", "register_gpu", "normalize_dtype", "normalize_name"]

T = 1e12  # TFLOP/s
P = 1e15  # PFLOP/s


@dataclass(frozen=True)
class Gpu:
    """One accelerator model. Every figure is per device (one GPU, not a node)."""

    name: str
    """Canonical name, e.g. ``"H100-SXM"`` (what reports print)."""
    patterns: tuple[str, ...] = ()
    """Regexes searched in the normalized device string (:func:`normalize_name`: upper case, separators as
    spaces), e.g. ``torch.cuda.get_device_name()``; the first row that matches wins."""
    peaks: Mapping[str, float] = field(default_factory=dict)
    """dtype (``bf16``, ``fp16``, ``fp32``, ``tf32``, ``fp8``) -> dense (not 2:4-sparse) FLOP/s.
    ``fp32`` is the non-tensor FP32 peak; ``tf32`` the tensor-core one."""
    source: str = ""
    """Where the peaks come from (sparse datasheet figures are halved)."""
    key: str = ""
    """Short lower-case name (the planner's and ``meshkit plan --gpu``'s): ``"h100-sxm"``; default
    the lower-cased ``name``."""
    memory_gb: float | None = None
    """Device memory in GiB, as the product name gives it."""
    hbm_bw_gbs: float | None = None
    """Device-memory bandwidth, GB/s (decimal, as datasheets give it)."""
    intra_bw_gbs: float | None = None
    """Per-direction bandwidth to a GPU in the same node (NVLink / Infinity Fabric / PCIe), GB/s."""
    inter_bw_gbs: float | None = None
    """Per-direction bandwidth to other nodes (one NIC per GPU), GB/s."""
    memory_source: str = ""
    """Where memory and bandwidths come from."""
    arch: str | None = None
    """CUDA architecture, ``"sm_90"`` (NVIDIA only)."""
    sms: int | None = None
    """Streaming multiprocessors."""
    sm_source: str = ""
    """Where the SM count comes from."""

    def __post_init__(self) -> None:
        if not self.key:
            object.__setattr__(self, "key", self.name.lower())

    def ridge(self, dtype: Any = "bf16") -> float:
        """Roofline ridge point: dense peak over HBM bandwidth, FLOP per byte.

        >>> round(gpu("h200").ridge())
        206
        """
        key = normalize_dtype(dtype)
        if key not in self.peaks or not self.hbm_bw_gbs:
            raise ValueError(
                f"Gpu.ridge: {self.name} has no `dtype={key!r}` peak or no HBM bandwidth "
                f"(peaks: {sorted(self.peaks)}, hbm_bw_gbs={self.hbm_bw_gbs}). Pick a dtype it has."
            )
        return self.peaks[key] / (self.hbm_bw_gbs * 1e9)


# ------------------------------------------------------------------------------------------ sources

_NV_A100 = "NVIDIA A100 datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4), dense column"
_NV_H100 = "NVIDIA H100 Tensor Core GPU Architecture whitepaper v1.04, table 'H100 SXM5/PCIe', dense"
_NV_H100NVL = "NVIDIA H100 NVL product brief / H100 datasheet (2024), sparse figures / 2"
_NV_H200 = "NVIDIA H200 datasheet (hpc-datasheet-sc23-h200), sparse figures / 2 (same SMs and clocks as H100 SXM5)"
_NV_GH200 = "NVIDIA GH200 Grace Hopper datasheet: its GPU is the H200 SXM's GH100 (" + _NV_H200 + ")"
_NV_B200 = "NVIDIA HGX B200 datasheet (8-GPU totals / 8), sparse figures / 2"
_NV_GB200 = "NVIDIA GB200 NVL72 datasheet (72-GPU totals / 72), sparse figures / 2"
_NV_L4 = "NVIDIA L4 datasheet (L4 Tensor Core GPU, 2023), sparse figures / 2"
_NV_L40S = "NVIDIA L40S datasheet (2023), dense column"
_NV_L40 = "NVIDIA L40 datasheet (2022), dense column"
_NV_A10 = "NVIDIA A10 datasheet (2021), dense column"
_NV_V100 = "NVIDIA V100 datasheet (volta-v100-datasheet-update-us-1165301-r5)"
_NV_T4 = "NVIDIA T4 datasheet (Tesla T4, 2019)"
_NV_ADA = "NVIDIA Ada Lovelace architecture whitepaper v1.1, appendix A, FP32 accumulate, dense"
_NV_GA102 = "NVIDIA Ampere GA102 whitepaper v2.1, tables 9/10, FP32 accumulate, dense"
_AMD_MI300X = "AMD Instinct MI300X data sheet (2023), dense (without sparsity)"
_AMD_MI325X = "AMD Instinct MI325X data sheet (2024), dense (without sparsity)"
_AMD_MI250X = "AMD Instinct MI250X data sheet (2021), matrix peaks"

# Memory and its bandwidth: vendor datasheets (A100 40 GB 1.555 TB/s, 80 GB SXM 2.039, 80 GB PCIe 1.935;
# H100 SXM 3.35, PCIe 2.0, NVL 94 GB at 3.9; H200 (SXM and NVL) 4.8; B200 8; MI300X 5.3; L40S 0.864).
# Links: NVLink per direction, half the bidirectional figure NVIDIA quotes (NVLink4 900 GB/s -> 450,
# NVLink3 600 -> 300 (A100 PCIe: the 2-GPU NVLink bridge), NVLink5 1.8 TB/s -> 900, H100 NVL bridge
# 600 -> 300, H200 NVL bridge 900 -> 450), PCIe Gen5 x16 ~ 64 GB/s, Infinity Fabric 7 x 64 GB/s on MI300X;
# inter-node one 400 Gb/s NIC per GPU (ConnectX-7) -> 50 GB/s, 200 Gb/s HDR on A100 pods -> 25 GB/s.
_MEM = "vendor datasheets; links per direction (see meshkit/hardware.py)"
_CPU_MEM = ("nominal gloo rank: shared memory in a node, 10 GbE between nodes, a 20 GB/s share of DDR; "
            "the planner takes the memory from the host when planning for a CPU world")

_SM_A100 = "NVIDIA A100 Tensor Core GPU Architecture whitepaper (2020): 108 SMs"
_SM_H100 = "NVIDIA H100 Tensor Core GPU Architecture whitepaper (2022): SXM5 132 SMs, PCIe 114 SMs"

_A100 = dict(bf16=312 * T, fp16=312 * T, tf32=156 * T, fp32=19.5 * T)
_H100_SXM5 = dict(bf16=989.4 * T, fp16=989.4 * T, fp8=1978.9 * T, tf32=494.7 * T, fp32=66.9 * T)
_NVL = dict(bf16=835.5 * T, fp16=835.5 * T, fp8=1670.5 * T, tf32=417.5 * T, fp32=60 * T)
_MI300 = dict(bf16=1307.4 * T, fp16=1307.4 * T, fp8=2614.9 * T, tf32=653.7 * T, fp32=163.4 * T)


def _links(memory_gb: float, hbm: float, intra: float, inter: float, source: str = _MEM) -> dict[str, Any]:
    return dict(memory_gb=memory_gb, hbm_bw_gbs=hbm, intra_bw_gbs=intra, inter_bw_gbs=inter, memory_source=source)


def _sm(arch: str, sms: int, source: str) -> dict[str, Any]:
    return dict(arch=arch, sms=sms, sm_source=source)


# Order matters: the first row whose pattern matches wins, so variants (PCIe, NVL) come before the
# bare model name.
CATALOG: tuple[Gpu, ...] = (
    Gpu("A100-PCIe-40GB", (r"\bA100\b.*\bPCIE\b.*\b40GB\b", r"\bA100\b.*\b40GB\b.*\bPCIE\b"), _A100, _NV_A100,
        "a100-pcie-40gb", **_links(40, 1555, 300, 25), **_sm("sm_80", 108, _SM_A100)),
    Gpu("A100-PCIe-80GB", (r"\bA100\b.*\bPCIE\b",), _A100, _NV_A100,
        "a100-pcie-80gb", **_links(80, 1935, 300, 25), **_sm("sm_80", 108, _SM_A100)),
    Gpu("A100-SXM4-40GB", (r"\bA100\b.*\b40GB\b",), _A100, _NV_A100,
        "a100-40gb", **_links(40, 1555, 300, 25), **_sm("sm_80", 108, _SM_A100)),
    Gpu("A100-SXM4-80GB", (r"\bA100\b",), _A100, _NV_A100,
        "a100-80gb", **_links(80, 2039, 300, 25), **_sm("sm_80", 108, _SM_A100)),
    Gpu("H100-NVL", (r"\bH100\b.*\bNVL\b",), _NVL, _NV_H100NVL, **_links(94, 3900, 300, 50)),
    Gpu("H100-PCIe", (r"\bH100\b.*\bPCIE\b",),
        dict(bf16=756 * T, fp16=756 * T, fp8=1513 * T, tf32=378 * T, fp32=51.2 * T), _NV_H100,
        **_links(80, 2000, 64, 50), **_sm("sm_90", 114, _SM_H100)),
    Gpu("H100-SXM", (r"\bH100\b", r"\bH800\b"), _H100_SXM5, _NV_H100,
        **_links(80, 3350, 450, 50), **_sm("sm_90", 132, _SM_H100)),
    Gpu("H200-NVL", (r"\bH200\b.*\bNVL\b",), _NVL, _NV_H200, **_links(141, 4800, 450, 50)),
    Gpu("H200-SXM", (r"\bH200\b",), _H100_SXM5, _NV_H200, "h200", **_links(141, 4800, 450, 50),
        **_sm("sm_90", 132, "NVIDIA H200 datasheet: GH100 with 141 GB HBM3e, same 132-SM SXM5 die")),
    Gpu("GH200", (r"\bGH200\b",), _H100_SXM5, _NV_GH200),
    Gpu("GB200", (r"\bGB200\b",), dict(bf16=2.5 * P, fp16=2.5 * P, fp8=5 * P, tf32=1.25 * P, fp32=80 * T), _NV_GB200),
    Gpu("B200", (r"\bB200\b",), dict(bf16=2.25 * P, fp16=2.25 * P, fp8=4.5 * P, tf32=1.125 * P, fp32=75 * T),
        _NV_B200, **_links(180, 8000, 900, 50),
        **_sm("sm_100", 148, "NVIDIA Blackwell architecture technical brief: B200 has 148 SMs")),
    Gpu("L40S", (r"\bL40S\b",), dict(bf16=362.05 * T, fp16=362.05 * T, fp8=733 * T, tf32=183 * T, fp32=91.6 * T),
        _NV_L40S, **_links(48, 864, 32, 25),
        **_sm("sm_89", 142, "NVIDIA L40S datasheet: 18176 CUDA cores / 128 per SM = 142 SMs")),
    Gpu("L40", (r"\bL40\b",), dict(bf16=181.05 * T, fp16=181.05 * T, fp8=362 * T, tf32=90.5 * T, fp32=90.5 * T),
        _NV_L40),
    Gpu("L4", (r"\bL4\b",), dict(bf16=121 * T, fp16=121 * T, fp8=242.5 * T, tf32=60 * T, fp32=30.3 * T), _NV_L4,
        **_sm("sm_89", 58, "NVIDIA L4 datasheet: 7424 CUDA cores / 128 per SM = 58 SMs")),
    Gpu("A10", (r"\bA10\b",), dict(bf16=125 * T, fp16=125 * T, tf32=62.5 * T, fp32=31.2 * T), _NV_A10,
        **_sm("sm_86", 72, "NVIDIA A10 datasheet: 72 RT cores, one per SM (9216 FP32 cores / 128)")),
    Gpu("A30", (r"\bA30\b",), **_sm("sm_80", 56, "NVIDIA A30 datasheet: 3584 FP32 cores / 64 per SM = 56 SMs")),
    Gpu("A40", (r"\bA40\b",),
        **_sm("sm_86", 84, "NVIDIA A40 datasheet: 84 RT cores, one per SM (10752 FP32 cores / 128)")),
    Gpu("V100-PCIe", (r"\bV100\b.*\bPCIE\b",), dict(fp16=112 * T, fp32=14 * T), _NV_V100),
    Gpu("V100-SXM2", (r"\bV100\b",), dict(fp16=125 * T, fp32=15.7 * T), _NV_V100),
    Gpu("T4", (r"\bT4\b",), dict(fp16=65 * T, fp32=8.1 * T), _NV_T4),
    Gpu("RTX-4090", (r"\bRTX 4090\b",),
        dict(bf16=165.2 * T, fp16=165.2 * T, fp8=330.3 * T, tf32=82.6 * T, fp32=82.6 * T), _NV_ADA),
    Gpu("RTX-3090", (r"\bRTX 3090\b",), dict(bf16=71 * T, fp16=71 * T, tf32=35.6 * T, fp32=35.6 * T), _NV_GA102),
    Gpu("MI325X", (r"\bMI325X\b",), _MI300, _AMD_MI325X),
    Gpu("MI300X", (r"\bMI300X\b",), _MI300, _AMD_MI300X, **_links(192, 5300, 448, 50)),
    Gpu("MI250X", (r"\bMI250X?\b",), dict(bf16=383 * T, fp16=383 * T, fp32=95.7 * T), _AMD_MI250X),
    # Not a GPU: a CPU rank as the planner sees it. Its peak is measured (meshkit.profiling.flops).
    Gpu("cpu", (r"\bCPU\b",), **_links(16, 20, 10, 1.25, _CPU_MEM)),
)
"""Built-in rows, matched after the user's (:func:`register_gpu`)."""

_USER_GPUS: list[Gpu] = []

_DTYPE_ALIASES = {
    "bf16": "bf16", "bfloat16": "bf16", "bf16-mixed": "bf16", "bf16-true": "bf16", "torch.bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "16": "fp16", "16-mixed": "fp16", "16-true": "fp16",
    "torch.float16": "fp16",
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "32": "fp32", "32-true": "fp32", "torch.float32": "fp32",
    "tf32": "tf32",
    "fp8": "fp8", "float8": "fp8", "float8_e4m3fn": "fp8", "float8_e5m2": "fp8", "transformer-engine": "fp8",
    "torch.float8_e4m3fn": "fp8", "torch.float8_e5m2": "fp8",
}


def normalize_dtype(dtype: Any) -> str:
    """Map a dtype spelling (``torch.bfloat16``, ``"bf16-mixed"``, ``"half"``, ...) to a peak key.

    >>> normalize_dtype("bf16-mixed"), normalize_dtype("torch.float16")
    ('bf16', 'fp16')
    """
    key = str(dtype).strip().lower()
    if key not in _DTYPE_ALIASES:
        raise ValueError(
            f"normalize_dtype: `dtype={dtype!r}` is not a known dtype. "
            f"Use one of {sorted(set(_DTYPE_ALIASES.values()))} (or a torch dtype / Lightning precision string)."
        )
    return _DTYPE_ALIASES[key]


def normalize_name(device_name: str) -> str:
    """Upper case, every run of non-alphanumerics one space: what :attr:`Gpu.patterns` are matched against.

    >>> normalize_name("NVIDIA A100-SXM4-80GB")
    'NVIDIA A100 SXM4 80GB'
    """
    return " ".join(re.sub(r"[^A-Z0-9]+", " ", str(device_name).upper()).split())


def rows(*, has: tuple[str, ...] = ()) -> tuple[Gpu, ...]:
    """Every row in match order (user rows first) that knows the :class:`Gpu` fields named in ``has``.

    >>> [r.name for r in rows(has=("sms",))][:2]
    ['A100-PCIe-40GB', 'A100-PCIe-80GB']
    """
    return tuple(r for r in (*_USER_GPUS, *CATALOG) if all(getattr(r, f) not in (None, {}, "") for f in has))


def find_gpu(name: str, *, has: tuple[str, ...] = ()) -> Gpu | None:
    """The row for a canonical name, a key (``"h100-sxm"``) or a real device string, else ``None``.

    User rows come first; within each list the first row whose name, key or a pattern matches wins.
    ``has`` names :class:`Gpu` fields the row must know (``("peaks",)``, ``("sms", "arch")``): rows that
    do not are skipped, so a view of the catalog (the peak table, the planner's, occupancy's) matches
    only among its own rows, and a user row that knows only some facts shadows only those.

    >>> find_gpu("NVIDIA A100-SXM4-40GB").name, find_gpu("AMD Instinct MI300X").key
    ('A100-SXM4-40GB', 'mi300x')
    >>> find_gpu("NVIDIA H100 NVL").name, find_gpu("NVIDIA H100 NVL", has=("sms",)).name
    ('H100-NVL', 'H100-SXM')
    >>> find_gpu("Banana GPU") is None
    True
    """
    norm = normalize_name(name)
    for row in rows(has=has):
        if norm in (normalize_name(row.name), normalize_name(row.key)) or any(re.search(p, norm) for p in row.patterns):
            return row
    return None


def gpu(name: str) -> Gpu:
    """Like :func:`find_gpu`, but an unknown name raises ``ValueError`` listing the known ones.

    >>> gpu("NVIDIA L4").sms
    58
    """
    row = find_gpu(name)
    if row is None:
        known = ", ".join(r.name for r in rows())
        raise ValueError(
            f"gpu: `name={name!r}` matches no row of meshkit's GPU catalog (known: {known}). "
            "Use one of those names or a device string naming one, or add a row with meshkit.hardware.register_gpu()."
        )
    return row


def register_gpu(name: str, *, patterns: tuple[str, ...] = (), peaks: Mapping[str, float] | None = None,
                 source: str = "user", **facts: Any) -> Gpu:
    """Add (or shadow) a catalog row; user rows are matched before the built-in ones.

    ``facts`` are any other :class:`Gpu` fields (``key``, ``memory_gb``, ``hbm_bw_gbs``, ``intra_bw_gbs``,
    ``inter_bw_gbs``, ``arch``, ``sms``, ...). Peaks are dense FLOP/s per dtype.

    >>> row = register_gpu("MyChip", patterns=(r"\\bMYCHIP\\b",), peaks={"bf16": 100e12}, memory_gb=64)
    >>> find_gpu("Acme MyChip v2") is row
    True
    """
    unknown = set(facts) - set(Gpu.__dataclass_fields__)
    if unknown or not isinstance(name, str) or not name.strip():
        raise ValueError(
            f"register_gpu: `name={name!r}` must be a non-empty string and the facts must be Gpu fields "
            f"(unknown: {sorted(unknown)}; known: {sorted(Gpu.__dataclass_fields__)})."
        )
    clean: dict[str, float] = {}
    for dtype, value in (peaks or {}).items():
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ValueError(f"register_gpu: `peaks[{dtype!r}]={value!r}` must be a positive number of FLOP/s.")
        clean[normalize_dtype(dtype)] = float(value)
    for fname in ("memory_gb", "hbm_bw_gbs", "intra_bw_gbs", "inter_bw_gbs", "sms"):
        value = facts.get(fname)
        if value is not None and not (isinstance(value, (int, float)) and value > 0):
            raise ValueError(f"register_gpu: `{fname}={value!r}` must be a positive number (or None: unknown).")
    row = Gpu(name, tuple(patterns), clean, source, **facts)
    _USER_GPUS.insert(0, row)
    return row
