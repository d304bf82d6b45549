"""FLOPs per step (analytic and measured) and peak FLOP/s per device.

Three questions, three small parts:

1. *What can this device do?* :func:`peak_flops` reads a table of **dense** (not 2:4-sparse)
   tensor-core peaks per GPU model and dtype, one datasheet per row, and matches real device
   strings (``torch.cuda.get_device_name()``) to it. On CPU it measures a matmul peak once and
   caches it (labelled ``"measured"``). Users can override any of it.
2. *How much work is the model?* :func:`model_flops_per_token` gives PaLM's
   ``6N + 12·L·H·Q·T`` from a meshkit ``LlamaConfig``, a Hugging Face config or torchtitan-style
   args.
3. *How much work did a step really do?* :func:`measure_step_flops` runs forward and backward
   under :class:`torch.utils.flop_counter.FlopCounterMode` on meta tensors, so activation
   recompute is counted (hardware FLOPs, for HFU) next to the model FLOPs (for MFU).

Example::

    >>> from meshkit.profiling.flops import peak_flops, model_flops_per_token
    >>> peak_flops("NVIDIA H100 80GB HBM3", "bf16")
    989400000000000.0
    >>> from meshkit.models import LlamaConfig
    >>> model_flops_per_token(LlamaConfig.tiny(), seq_len=16) > 0
    True
"""

from __future__ import annotations

import copy
import json
import math
import os
import platform
import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

__all__ = [
    "PeakRow",
    "PeakInfo",
    "PEAK_TABLE",
    "peak_flops",
    "peak_info",
    "register_peak",
    "normalize_dtype",
    "measured_cpu_peak",
    "cpu_peak_key",
    "ModelShape",
    "model_shape",
    "model_flops_per_token",
    "StepFlops",
    "measure_step_flops",
    "flop_counter",
]

T = 1e12  # TFLOP/s
P = 1e15  # PFLOP/s

# --------------------------------------------------------------------------------------- peaks


@dataclass(frozen=True)
class PeakRow:
    """One device model: dense peak FLOP/s per dtype and the datasheet they come from."""

    name: str
    """Canonical name, e.g. ``"H100-SXM"``."""
    patterns: tuple[str, ...]
    """Regexes matched against the normalized device string (upper case, separators as spaces)."""
    peaks: Mapping[str, float]
    """dtype (``bf16``, ``fp16``, ``fp32``, ``tf32``, ``fp8``) -> dense FLOP/s."""
    source: str
    """Where the figures come from (sparse datasheet figures are halved)."""


@dataclass(frozen=True)
class PeakInfo:
    """A resolved peak: the value, the table row it came from, and how it was obtained."""

    flops: float
    row: str
    dtype: str
    kind: str
    """``"datasheet"``, ``"measured"`` (CPU calibration) or ``"override"``."""
    source: str


_NV_A100 = "NVIDIA A100 datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4), dense column"
_NV_H100 = "NVIDIA H100 Tensor Core GPU Architecture whitepaper v1.04, table 'H100 SXM5/PCIe', dense"
_NV_H100NVL = "NVIDIA H100 NVL product brief / H100 datasheet (2024), sparse figures / 2"
_NV_H200 = "NVIDIA H200 datasheet (hpc-datasheet-sc23-h200), sparse figures / 2 (same SMs and clocks as H100 SXM5)"
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


def _row(name: str, patterns: tuple[str, ...], source: str, **peaks: float) -> PeakRow:
    return PeakRow(name, patterns, dict(peaks), source)


# Order matters: the first row whose pattern matches wins, so variants (PCIe, NVL) come before
# the bare model name. "fp32" is the non-tensor FP32 peak (torch's default matmul precision);
# "tf32" is the tensor-core TF32 peak (torch.backends.cuda.matmul.allow_tf32 = True).
PEAK_TABLE: tuple[PeakRow, ...] = (
    _row("A100-PCIe-40GB", (r"\bA100\b.*\bPCIE\b.*\b40GB\b", r"\bA100\b.*\b40GB\b.*\bPCIE\b"), _NV_A100,
         bf16=312 * T, fp16=312 * T, tf32=156 * T, fp32=19.5 * T),
    _row("A100-PCIe-80GB", (r"\bA100\b.*\bPCIE\b",), _NV_A100,
         bf16=312 * T, fp16=312 * T, tf32=156 * T, fp32=19.5 * T),
    _row("A100-SXM4-40GB", (r"\bA100\b.*\b40GB\b",), _NV_A100,
         bf16=312 * T, fp16=312 * T, tf32=156 * T, fp32=19.5 * T),
    _row("A100-SXM4-80GB", (r"\bA100\b",), _NV_A100,
         bf16=312 * T, fp16=312 * T, tf32=156 * T, fp32=19.5 * T),
    _row("H100-NVL", (r"\bH100\b.*\bNVL\b",), _NV_H100NVL,
         bf16=835.5 * T, fp16=835.5 * T, fp8=1670.5 * T, tf32=417.5 * T, fp32=60 * T),
    _row("H100-PCIe", (r"\bH100\b.*\bPCIE\b",), _NV_H100,
         bf16=756 * T, fp16=756 * T, fp8=1513 * T, tf32=378 * T, fp32=51.2 * T),
    _row("H100-SXM", (r"\bH100\b", r"\bH800\b"), _NV_H100,
         bf16=989.4 * T, fp16=989.4 * T, fp8=1978.9 * T, tf32=494.7 * T, fp32=66.9 * T),
    _row("H200-NVL", (r"\bH200\b.*\bNVL\b",), _NV_H200,
         bf16=835.5 * T, fp16=835.5 * T, fp8=1670.5 * T, tf32=417.5 * T, fp32=60 * T),
    _row("H200-SXM", (r"\bH200\b", r"\bGH200\b"), _NV_H200,
         bf16=989.4 * T, fp16=989.4 * T, fp8=1978.9 * T, tf32=494.7 * T, fp32=66.9 * T),
    _row("GB200", (r"\bGB200\b",), _NV_GB200,
         bf16=2.5 * P, fp16=2.5 * P, fp8=5 * P, tf32=1.25 * P, fp32=80 * T),
    _row("B200", (r"\bB200\b",), _NV_B200,
         bf16=2.25 * P, fp16=2.25 * P, fp8=4.5 * P, tf32=1.125 * P, fp32=75 * T),
    _row("L40S", (r"\bL40S\b",), _NV_L40S,
         bf16=362.05 * T, fp16=362.05 * T, fp8=733 * T, tf32=183 * T, fp32=91.6 * T),
    _row("L40", (r"\bL40\b",), _NV_L40,
         bf16=181.05 * T, fp16=181.05 * T, fp8=362 * T, tf32=90.5 * T, fp32=90.5 * T),
    _row("L4", (r"\bL4\b",), _NV_L4,
         bf16=121 * T, fp16=121 * T, fp8=242.5 * T, tf32=60 * T, fp32=30.3 * T),
    _row("A10", (r"\bA10\b",), _NV_A10,
         bf16=125 * T, fp16=125 * T, tf32=62.5 * T, fp32=31.2 * T),
    _row("V100-PCIe", (r"\bV100\b.*\bPCIE\b",), _NV_V100, fp16=112 * T, fp32=14 * T),
    _row("V100-SXM2", (r"\bV100\b",), _NV_V100, fp16=125 * T, fp32=15.7 * T),
    _row("T4", (r"\bT4\b",), _NV_T4, fp16=65 * T, fp32=8.1 * T),
    _row("RTX-4090", (r"\bRTX 4090\b",), _NV_ADA,
         bf16=165.2 * T, fp16=165.2 * T, fp8=330.3 * T, tf32=82.6 * T, fp32=82.6 * T),
    _row("RTX-3090", (r"\bRTX 3090\b",), _NV_GA102,
         bf16=71 * T, fp16=71 * T, tf32=35.6 * T, fp32=35.6 * T),
    _row("MI325X", (r"\bMI325X\b",), _AMD_MI325X,
         bf16=1307.4 * T, fp16=1307.4 * T, fp8=2614.9 * T, tf32=653.7 * T, fp32=163.4 * T),
    _row("MI300X", (r"\bMI300X\b",), _AMD_MI300X,
         bf16=1307.4 * T, fp16=1307.4 * T, fp8=2614.9 * T, tf32=653.7 * T, fp32=163.4 * T),
    _row("MI250X", (r"\bMI250X?\b",), _AMD_MI250X, bf16=383 * T, fp16=383 * T, fp32=95.7 * T),
)

_USER_ROWS: list[PeakRow] = []

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
    """Map a dtype spelling (``torch.bfloat16``, ``"bf16-mixed"``, ``"half"``, ...) to a table key.

    >>> normalize_dtype("bf16-mixed"), normalize_dtype(torch.float16)
    ('bf16', 'fp16')
    """
    key = str(dtype).strip().lower()
    if key not in _DTYPE_ALIASES:
        raise ValueError(
            f"normalize_dtype: `dtype={dtype!r}` is not a known dtype. "
            f"Use one of {sorted(set(_DTYPE_ALIASES.values()))} (or a torch dtype / Lightning precision string)."
        )
    return _DTYPE_ALIASES[key]


def _normalize_name(device_name: str) -> str:
    return " ".join(re.sub(r"[^A-Z0-9]+", " ", device_name.upper()).split())


def _match_row(device_name: str) -> PeakRow | None:
    norm = _normalize_name(device_name)
    for row in (*_USER_ROWS, *PEAK_TABLE):
        if _normalize_name(row.name) == norm or any(re.search(p, norm) for p in row.patterns):
            return row
    return None


def register_peak(name: str, peaks: Mapping[str, float], patterns: tuple[str, ...] = (),
                  source: str = "user") -> PeakRow:
    """Add (or shadow) a table row; user rows are matched before the built-in ones.

    >>> _ = register_peak("MyChip", {"bf16": 100e12}, patterns=(r"\\bMYCHIP\\b",))
    >>> peak_flops("Acme MyChip v2", "bf16")
    100000000000000.0
    """
    clean: dict[str, float] = {}
    for dtype, value in peaks.items():
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ValueError(f"register_peak: `peaks[{dtype!r}]={value!r}` must be a positive number of FLOP/s.")
        clean[normalize_dtype(dtype)] = float(value)
    row = PeakRow(name, tuple(patterns), clean, source)
    _USER_ROWS.insert(0, row)
    return row


def peak_info(device_name: str, dtype: Any = "bf16", *, override: float | None = None) -> PeakInfo:
    """Resolve the dense peak FLOP/s of one device for ``dtype``, with its provenance.

    ``override`` (FLOP/s) wins over everything; so does the ``MESHKIT_PEAK_FLOPS`` environment
    variable. ``device_name="cpu"`` (or any name containing "CPU") returns a measured matmul peak.
    """
    key = normalize_dtype(dtype)
    env = os.environ.get("MESHKIT_PEAK_FLOPS")
    if override is None and env:
        try:
            override = float(env)
        except ValueError:
            raise ValueError(f"peak_info: `MESHKIT_PEAK_FLOPS={env!r}` must be a number of FLOP/s, e.g. 989.4e12.")
    if override is not None:
        if not (isinstance(override, (int, float)) and math.isfinite(override) and override > 0):
            raise ValueError(f"peak_info: `override={override!r}` must be a positive number of FLOP/s.")
        return PeakInfo(float(override), device_name, key, "override", "user override")
    if not isinstance(device_name, str) or not device_name.strip():
        raise ValueError(f"peak_info: `device_name={device_name!r}` must be a non-empty device string.")
    if "CPU" in _normalize_name(device_name).split() or _normalize_name(device_name) == "CPU":
        return PeakInfo(measured_cpu_peak(key), "cpu", key, "measured", "matmul calibration on this host")
    row = _match_row(device_name)
    if row is None:
        known = ", ".join(r.name for r in (*_USER_ROWS, *PEAK_TABLE))
        raise ValueError(
            f"peak_flops: `device_name={device_name!r}` matches no row of the peak table (known: {known}). "
            "Pass `override=<FLOP/s>`, set MESHKIT_PEAK_FLOPS, or add a row with register_peak()."
        )
    if key not in row.peaks:
        raise ValueError(
            f"peak_flops: device {row.name} has no `dtype={key!r}` peak (it has {sorted(row.peaks)}). "
            "Pick one of those dtypes or pass `override=<FLOP/s>`."
        )
    return PeakInfo(row.peaks[key], row.name, key, "datasheet", row.source)


def peak_flops(device_name: str, dtype: Any = "bf16", *, override: float | None = None) -> float:
    """Dense peak FLOP/s of one device (one GPU, not a node) for ``dtype``.

    Matches real device strings ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "NVIDIA L4",
    "AMD Instinct MI300X"); raises ``ValueError`` listing the known rows for an unknown name.

    >>> peak_flops("NVIDIA H200", "bf16")
    989400000000000.0
    >>> peak_flops("NVIDIA A100-SXM4-40GB", "tf32")
    156000000000000.0
    """
    return peak_info(device_name, dtype, override=override).flops


# --------------------------------------------------------------------------- CPU calibration

_CPU_PEAK_CACHE: dict[tuple[str, int], float] = {}


def _cpu_cache_path() -> str:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "meshkit", "cpu_peak.json")


def _cpu_model() -> str:
    """The processor's model name (``/proc/cpuinfo`` on Linux), else what ``platform`` says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown cpu"


def cpu_peak_key(dtype: Any = "fp32", threads: int | None = None) -> str:
    """The calibration's cache key: CPU model, core count, dtype, threads and torch version.

    >>> cpu_peak_key("fp32", 1).count("|")
    4
    """
    threads = torch.get_num_threads() if threads is None else threads
    return f"{_cpu_model()}|cores={os.cpu_count()}|{normalize_dtype(dtype)}|threads={threads}|torch={torch.__version__}"


def _calibrate_cpu(dtype: torch.dtype, n: int = 256, min_time_s: float = 0.05) -> float:
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    torch.mm(a, b)  # warm-up
    best, iters = 0.0, 1
    for _ in range(4):
        start = time.perf_counter()
        for _ in range(iters):
            torch.mm(a, b)
        elapsed = time.perf_counter() - start
        best = max(best, 2 * n**3 * iters / elapsed)
        if elapsed < min_time_s:
            iters *= 2
    return best


class _HostLock:
    """An exclusive lock on this host (``flock`` of a file next to the cache), so that processes
    calibrate one at a time while the others wait idle instead of competing for the cores."""

    def __init__(self, path: str) -> None:
        self.path, self._f = path + ".lock", None

    def __enter__(self) -> "_HostLock":
        try:
            import fcntl

            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            self._f = open(self.path, "w")
            fcntl.flock(self._f, fcntl.LOCK_EX)
        except (ImportError, OSError):
            self._f = None  # no flock (Windows, read-only home): calibrate unserialised
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._f is not None:
            self._f.close()  # closing releases the lock


def _read_disk(path: str) -> dict[str, float]:
    try:
        with open(path) as f:
            disk = json.load(f)
        return disk if isinstance(disk, dict) else {}
    except (OSError, ValueError):
        return {}


def measured_cpu_peak(dtype: Any = "fp32", *, recalibrate: bool = False) -> float:
    """Measured matmul FLOP/s of this CPU at the current ``torch.get_num_threads()``.

    Calibrated once per :func:`cpu_peak_key` (CPU model, core count, dtype, threads, torch
    version) and cached in memory and in ``~/.cache/meshkit/cpu_peak.json``. Processes on one
    host calibrate one at a time under a file lock, the others waiting (idle) and then reading
    the cached figure, so that the peak does not depend on how many ranks calibrated at once
    (four at once measured 62 GFLOP/s where one alone measures 97–103). This is a *measured*
    peak, not a datasheet one: MFU on CPU is relative to what torch's matmul reaches.
    """
    key = normalize_dtype(dtype)
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(key, torch.float32)
    threads = torch.get_num_threads()
    cache_key = (key, threads)
    if not recalibrate and cache_key in _CPU_PEAK_CACHE:
        return _CPU_PEAK_CACHE[cache_key]
    disk_key = cpu_peak_key(key, threads)
    path = _cpu_cache_path()
    with _HostLock(path):
        disk = _read_disk(path)
        if not recalibrate and isinstance(disk.get(disk_key), (int, float)) and disk[disk_key] > 0:
            value = float(disk[disk_key])
        else:
            value = _calibrate_cpu(torch_dtype)
            disk[disk_key] = value
            try:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path + f".{os.getpid()}.tmp", "w") as f:
                    json.dump(disk, f)
                os.replace(path + f".{os.getpid()}.tmp", path)
            except OSError:
                pass  # a read-only home only costs a recalibration next process
    _CPU_PEAK_CACHE[cache_key] = value
    return value


# ------------------------------------------------------------------------- analytic model FLOPs


@dataclass(frozen=True)
class ModelShape:
    """What PaLM's formula needs from a decoder-only transformer."""

    n_params: int
    """N: parameters excluding the input-embedding table (the LM head counts, tied or not)."""
    n_layers: int
    """L."""
    n_heads: int
    """H: query heads."""
    head_dim: int
    """Q: size of one head."""
    seq_len: int | None = None
    """T if the source knows it (max sequence length); callers usually pass the training one."""


def _llama_ffn(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    # torchtitan / Meta Llama rule: 2/3 of 4·dim, scaled, rounded up to a multiple.
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def _llama_params(dim: int, n_layers: int, n_heads: int, n_kv_heads: int, head_dim: int, ffn: int,
                  vocab: int) -> int:
    attn = dim * n_heads * head_dim * 2 + dim * n_kv_heads * head_dim * 2  # wq, wo, wk, wv
    mlp = 3 * dim * ffn  # SwiGLU w1, w2, w3
    norms = 2 * dim
    return n_layers * (attn + mlp + norms) + dim + vocab * dim  # + final norm + LM head


def _get(obj: Any, *names: str, default: Any = None) -> Any:
    for name in names:
        value = obj.get(name) if isinstance(obj, Mapping) else getattr(obj, name, None)
        if value is not None:
            return value
    return default


def model_shape(config: Any) -> ModelShape:
    """Read a :class:`ModelShape` from a meshkit ``LlamaConfig``, a Hugging Face config (object or
    dict; Llama-style SwiGLU MLP assumed when counting parameters), torchtitan-style args
    (``dim``, ``n_layers``, ``n_heads``, ``n_kv_heads``, ``multiple_of``, ``ffn_dim_multiplier``),
    or an ``nn.Module`` (parameters counted; shape read from its ``config`` attribute).

    >>> from meshkit.models import LlamaConfig
    >>> model_shape(LlamaConfig.tiny()).n_layers
    4
    """
    if isinstance(config, ModelShape):
        return config
    if isinstance(config, torch.nn.Module):
        inner = _get(config, "config", "model_args", "args")
        if inner is None and hasattr(config, "model"):
            inner = _get(config.model, "config", "model_args", "args")
        if inner is None:
            raise ValueError(
                f"model_shape: `config={type(config).__name__}` is a module without a `config` attribute; "
                "pass its config (HF, torchtitan args or LlamaConfig) or a ModelShape."
            )
        base = model_shape(inner)
        seen: set[int] = set()
        total = embed = 0
        for mod in config.modules():
            for p in mod.parameters(recurse=False):
                if id(p) in seen:
                    continue
                seen.add(id(p))
                total += p.numel()
                if isinstance(mod, torch.nn.Embedding):
                    embed += p.numel()
        tied = any(isinstance(m, torch.nn.Linear) and id(m.weight) in
                   {id(e.weight) for e in config.modules() if isinstance(e, torch.nn.Embedding)}
                   for m in config.modules())
        n = total - embed + (embed if tied else 0)
        return ModelShape(n, base.n_layers, base.n_heads, base.head_dim, base.seq_len)
    dim = _get(config, "hidden_size", "dim", "d_model", "n_embd")
    n_layers = _get(config, "num_hidden_layers", "n_layers", "num_layers", "n_layer")
    n_heads = _get(config, "num_attention_heads", "n_heads", "n_head")
    vocab = _get(config, "vocab_size")
    if None in (dim, n_layers, n_heads, vocab):
        raise ValueError(
            f"model_shape: `config={type(config).__name__}` lacks one of hidden size (hidden_size/dim), "
            f"layers (num_hidden_layers/n_layers), heads (num_attention_heads/n_heads) or vocab_size "
            f"(got dim={dim}, n_layers={n_layers}, n_heads={n_heads}, vocab_size={vocab}). Pass a ModelShape."
        )
    n_kv = _get(config, "num_key_value_heads", "n_kv_heads", default=n_heads)
    head_dim = _get(config, "head_dim", default=None)
    if not isinstance(head_dim, int):  # LlamaConfig.head_dim is a property, HF may set None
        head_dim = dim // n_heads
    ffn = _get(config, "intermediate_size", "ffn_dim", "hidden_dim")
    if ffn is None:
        ffn = _llama_ffn(dim, _get(config, "multiple_of", default=256), _get(config, "ffn_dim_multiplier"))
    n = _llama_params(dim, n_layers, n_heads, n_kv, head_dim, ffn, vocab)
    seq = _get(config, "max_seq_len", "max_position_embeddings", "seq_len")
    return ModelShape(int(n), int(n_layers), int(n_heads), int(head_dim), seq)


def model_flops_per_token(config: Any, seq_len: int | None = None, *, causal: bool = False) -> float:
    """Training FLOPs per token, forward + backward: ``6·N + 12·L·H·Q·T``.

    PaLM (Chowdhery et al. 2022) appendix B. Conventions, stated because they move MFU:

    - N excludes the input-embedding table (a lookup, no FLOPs) and includes the LM head
      (a matmul), once, even when it is tied to the embedding; norm weights are included
      (they are < 0.01% of N), as torchtitan counts.
    - The attention term counts the full T×T score and value matmuls (``causal=False``), as PaLM,
      torchtitan and published MFU figures do, although a causal kernel skips about half;
      ``causal=True`` halves it (``6·L·H·Q·T``).
    - Recompute is not model work: use :func:`measure_step_flops` for hardware FLOPs (HFU).

    >>> from meshkit.profiling.flops import ModelShape
    >>> model_flops_per_token(ModelShape(n_params=1000, n_layers=2, n_heads=4, head_dim=8), seq_len=16)
    18288.0
    """
    shape = model_shape(config)
    t = seq_len if seq_len is not None else shape.seq_len
    if not isinstance(t, int) or t < 1:
        raise ValueError(f"model_flops_per_token: `seq_len={t!r}` must be a positive int (the training length).")
    attn = 12 * shape.n_layers * shape.n_heads * shape.head_dim * t
    return float(6 * shape.n_params + (attn / 2 if causal else attn))


# ------------------------------------------------------------------------ measured step FLOPs


@dataclass(frozen=True)
class StepFlops:
    """FLOPs of one training step as counted by ``FlopCounterMode``."""

    forward: float
    """Forward pass."""
    backward: float
    """Backward pass, including any activation recompute it triggers."""

    @property
    def hardware(self) -> float:
        """Everything executed: forward + backward (+ recompute). HFU's numerator."""
        return self.forward + self.backward

    @property
    def model(self) -> float:
        """Model FLOPs by the usual 'backward = 2 × forward' rule: 3 × forward. MFU's numerator."""
        return 3 * self.forward

    @property
    def recompute(self) -> float:
        """Hardware minus model FLOPs (0 without activation checkpointing)."""
        return max(self.hardware - self.model, 0.0)


def _fake_clone(model: torch.nn.Module, mode: Any) -> torch.nn.Module:
    # deepcopy with every parameter and buffer pre-mapped to a fake twin (same device, no storage):
    # no real memory is copied, kernels are chosen as for the real device (e.g. CPU flash attention),
    # and activation recompute in backward runs on the same fake weights.
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = torch.nn.Parameter(mode.from_tensor(p.detach()), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = mode.from_tensor(b)
    return copy.deepcopy(model, memo)


def _fake_mode() -> Any:
    # torch has no public fake-tensor entry point; FakeTensorMode is the one torch.compile and
    # torch.distributed's tools use (checked on torch 2.6-2.13).
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=False)


def _to_fake(x: Any, mode: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return mode.from_tensor(x)
    if isinstance(x, (list, tuple)):
        return type(x)(_to_fake(v, mode) for v in x)
    if isinstance(x, Mapping):
        return {k: _to_fake(v, mode) for k, v in x.items()}
    return x


def _local_shapes(formula: Callable[..., int]) -> Callable[..., int]:
    """Run a registry formula on each DTensor argument's local shard, so every rank counts its own work.

    FlopCounterMode sees a DTensor op before DTensor dispatches it to the local shards (a mode runs
    before a tensor subclass), so torch's formulas would count a tensor-parallel matmul at its full
    (global) size on every TP rank. ``_local_tensor`` is DTensor's shard (no public accessor that
    does not record autograd; checked on torch 2.6-2.13).
    """
    from torch.utils._pytree import tree_map

    def local(x: Any) -> Any:
        inner = getattr(x, "_local_tensor", None)
        return inner if isinstance(inner, torch.Tensor) else x

    def counted(*args: Any, out_val: Any = None, **kwargs: Any) -> int:
        return formula(*tree_map(local, args), out_val=tree_map(local, out_val), **tree_map(local, kwargs))

    counted._get_raw = True  # type: ignore[attr-defined]  # FlopCounterMode passes tensors, not shapes
    return counted


def flop_counter() -> Any:
    """A ``FlopCounterMode`` that counts each rank's local work and CPU flash attention.

    - DTensor arguments are counted at their local shard's shape (:func:`_local_shapes`), so under
      tensor parallelism the ranks' counts add up to the one-process count instead of TP times it
      (before: 1.85x too many FLOPs per rank under ``hsdp_tp``).
    - torch's registry (checked on 2.6–2.13) has no formula for
      ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward, so SDPA on CPU tensors
      would count 0 FLOPs; we map them to torch's own ``sdpa_flop_count`` /
      ``sdpa_backward_flop_count`` (same formula as the CUDA flash kernels).

    >>> with flop_counter() as c:
    ...     _ = torch.ones(2, 3) @ torch.ones(3, 4)
    >>> c.get_total_flops()
    48
    """
    from torch.utils import flop_counter as fc

    aten = torch.ops.aten
    extra: dict[Any, Callable[..., int]] = {}
    fwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    bwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    if fwd is not None and fwd not in fc.flop_registry:
        extra[fwd] = fc.shape_wrapper(lambda q, k, v, *args, out_shape=None, **kw: fc.sdpa_flop_count(q, k, v))
    if bwd is not None and bwd not in fc.flop_registry:
        extra[bwd] = fc.shape_wrapper(
            lambda g, q, k, v, *args, out_shape=None, **kw: fc.sdpa_backward_flop_count(g, q, k, v))
    registry = {**fc.flop_registry, **extra}
    return fc.FlopCounterMode(display=False, custom_mapping={op: _local_shapes(f) for op, f in registry.items()})


def measure_step_flops(model: torch.nn.Module, *inputs: Any,
                       loss_fn: Callable[[Any], torch.Tensor] | None = None) -> StepFlops:
    """Count one forward + backward of ``model(*inputs)`` on fake tensors (no memory, no compute).

    The model is cloned with fake parameters and buffers on the real device (no memory is
    copied), so kernels are chosen as in a real step and the real model is untouched. Flash
    attention's backward recomputes the attention scores (torch counts 2.5× its forward), which
    shows up as recompute, as it does on the hardware. Activation checkpointing inside ``model`` re-runs its
    forward during backward and is counted in ``backward`` (hence in :attr:`StepFlops.hardware`).
    ``loss_fn`` maps the output to a scalar (default: ``output.float().sum()``).

    >>> from meshkit.models import LlamaConfig, Transformer
    >>> f = measure_step_flops(Transformer(LlamaConfig.tiny()), torch.zeros(2, 16, dtype=torch.long))
    >>> f.backward >= 2 * f.forward
    True
    """
    mode = _fake_mode()
    fake_model = _fake_clone(model, mode)
    fake_inputs = _to_fake(inputs, mode)
    with mode:
        counter = flop_counter()
        with counter:
            out = fake_model(*fake_inputs)
        forward = counter.get_total_flops()
        loss = loss_fn(out) if loss_fn is not None else (out[0] if isinstance(out, (tuple, list)) else out).float().sum()
        counter = flop_counter()
        with counter:
            loss.backward()
    return StepFlops(float(forward), float(counter.get_total_flops()))
