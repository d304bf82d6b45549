"""FLOPs per step (analytic and measured) and peak FLOP/s per device.

Three questions, three small parts:

1. *What can this device do?* :func:`peak_flops` reads the **dense** (not 2:4-sparse)
   tensor-core peaks per GPU model and dtype of meshkit's GPU catalog (:mod:`meshkit.hardware`,
   one datasheet per row) and matches real device strings (``torch.cuda.get_device_name()``) to
   it. On CPU it measures a matmul peak once and caches it (labelled ``"measured"``). Users can
   override any of it.
2. *How much work is the model?* :func:`model_flops_per_token` gives PaLM's
   ``6N + 12·L·H·Q·T`` from anything :func:`meshkit.modelspec.read_shape` reads (a meshkit
   ``LlamaConfig``, a Hugging Face config or model, torchtitan-style args).
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
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping


from meshkit.hardware import CATALOG, Gpu, find_gpu, normalize_dtype, normalize_name, register_gpu, rows
from meshkit.modelspec import TransformerShape, read_shape

__all__ = [
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
    "model_flops_split",
    "StepFlops",
    "measure_step_flops",
    "flop_counter",
]

# --------------------------------------------------------------------------------------- peaks

PEAK_TABLE: tuple[Gpu, ...] = tuple(row for row in CATALOG if row.peaks)
"""The rows of meshkit's GPU catalog (:data:`meshkit.hardware.CATALOG`) that have dense peaks, in match order."""


@dataclass(frozen=True)
class PeakInfo:
    """A resolved peak: the value, the table row it came from, and how it was obtained."""

    flops: float
    row: str
    dtype: str
    kind: str
    """``"datasheet"``, ``"measured"`` (CPU calibration) or ``"override"``."""
    source: str


def register_peak(name: str, peaks: Mapping[str, float], patterns: tuple[str, ...] = (),
                  source: str = "user") -> Gpu:
    """Add (or shadow) a peak row (:func:`meshkit.hardware.register_gpu`); matched before the built-in ones.

    >>> _ = register_peak("MyChip", {"bf16": 100e12}, patterns=(r"\\bMYCHIP\\b",))
    >>> peak_flops("Acme MyChip v2", "bf16")
    100000000000000.0
    """
    return register_gpu(name, patterns=patterns, peaks=peaks, source=source)


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
    if "CPU" in normalize_name(device_name).split():
        return PeakInfo(measured_cpu_peak(key), "cpu", key, "measured", "matmul calibration on this host")
    row = find_gpu(device_name, has=("peaks",))
    if row is None:
        known = ", ".join(r.name for r in rows(has=("peaks",)))
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
    import torch  # here, not at the top: peak lookups (meshkit plan) need no torch
    threads = torch.get_num_threads() if threads is None else threads
    return f"{_cpu_model()}|cores={os.cpu_count()}|{normalize_dtype(dtype)}|threads={threads}|torch={torch.__version__}"


def _calibrate_cpu(dtype: torch.dtype, n: int = 256, min_time_s: float = 0.05) -> float:
    import torch  # here, not at the top: peak lookups (meshkit plan) need no torch
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
    import torch  # here, not at the top: peak lookups (meshkit plan) need no torch
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


def _palm_params(s: TransformerShape) -> int:
    attn = s.hidden * s.heads * s.head_dim * 2 + s.hidden * s.kv_heads * s.head_dim * 2  # wq, wo, wk, wv
    mlp = (3 if s.gated_mlp else 2) * s.hidden * s.ffn  # SwiGLU w1, w2, w3 (GPT-2: fc, proj)
    norms = 2 * s.hidden
    return s.layers * (attn + mlp + norms) + s.hidden + s.vocab * s.hidden  # + final norm + LM head


def model_shape(config: Any) -> ModelShape:
    """Read a :class:`ModelShape` with :func:`meshkit.modelspec.read_shape`: from a meshkit ``LlamaConfig``,
    a Hugging Face config (object or dict), torchtitan-style args (``dim``, ``n_layers``, ``n_heads``,
    ``n_kv_heads``, ``multiple_of``, ``ffn_dim_multiplier``), or an ``nn.Module`` (its parameters counted;
    the shape read from the ``config`` it holds).

    >>> from meshkit.models import LlamaConfig
    >>> model_shape(LlamaConfig.tiny()).n_layers
    4
    """
    if isinstance(config, ModelShape):
        return config
    s = read_shape(config)
    if s.params is not None:  # a module: its own parameters, the embedding tables out unless one is the head
        n = s.params - s.embedding_params + (s.embedding_params if s.tied_embeddings else 0)
    else:
        n = _palm_params(s)
    return ModelShape(int(n), s.layers, s.heads, s.head_dim, s.max_seq_len)


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
    matmul, attention = model_flops_split(config, seq_len, causal=causal)
    return matmul + attention


def model_flops_split(config: Any, seq_len: int | None = None, *, causal: bool = False) -> tuple[float, float]:
    """:func:`model_flops_per_token`'s two terms per token: ``(6·N, 12·L·H·Q·T)``, the weight matmuls and
    attention's score and value matmuls (the waterfall's ``matmul_efficiency`` and ``attention_efficiency``
    set each against the time its kernels took).

    >>> from meshkit.profiling.flops import ModelShape
    >>> model_flops_split(ModelShape(n_params=1000, n_layers=2, n_heads=4, head_dim=8), seq_len=16)
    (6000.0, 12288.0)
    """
    shape = model_shape(config)
    t = seq_len if seq_len is not None else shape.seq_len
    if not isinstance(t, int) or t < 1:
        raise ValueError(f"model_flops_per_token: `seq_len={t!r}` must be a positive int (the training length).")
    attn = 12 * shape.n_layers * shape.n_heads * shape.head_dim * t  # PaLM appendix B: 12·L·H·Q·T
    return float(6 * shape.n_params), float(attn / 2 if causal else attn)


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
    import torch  # here, not at the top: peak lookups (meshkit plan) need no torch
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
    import torch  # here, not at the top: peak lookups (meshkit plan) need no torch
    if isinstance(x, torch.Tensor):
        return mode.from_tensor(x)
    if isinstance(x, (list, tuple)):
        return type(x)(_to_fake(v, mode) for v in x)
    if isinstance(x, Mapping):
        return {k: _to_fake(v, mode) for k, v in x.items()}
    return x


_TRACKER: Any = None


def _in_backward() -> bool:
    """Whether the autograd engine is running a backward pass on this thread (recompute included).

    ``ModuleTracker.is_bw`` is torch's public spelling of it (the engine's graph task id; checked on
    torch 2.6-2.13); a tracker that is never entered installs no hooks.
    """
    global _TRACKER
    if _TRACKER is None:
        from torch.utils.module_tracker import ModuleTracker

        _TRACKER = ModuleTracker()
    return bool(_TRACKER.is_bw)


def _local_shapes(formula: Callable[..., int], tally: dict[str, int] | None = None) -> Callable[..., int]:
    """Run a registry formula on each DTensor argument's local shard, so every rank counts its own work.

    FlopCounterMode sees a DTensor op before DTensor dispatches it to the local shards (a mode runs
    before a tensor subclass), so torch's formulas would count a tensor-parallel matmul at its full
    (global) size on every TP rank. ``_local_tensor`` is DTensor's shard (no public accessor that
    does not record autograd; checked on torch 2.6-2.13). With ``tally``, each count is also added
    to ``tally["backward"]`` inside a backward pass, else to ``tally["forward"]``.
    """
    import torch  # here, not at the top: peak lookups (meshkit plan) need no torch
    from torch.utils._pytree import tree_map

    def local(x: Any) -> Any:
        inner = getattr(x, "_local_tensor", None)
        return inner if isinstance(inner, torch.Tensor) else x

    def counted(*args: Any, out_val: Any = None, **kwargs: Any) -> int:
        flops = formula(*tree_map(local, args), out_val=tree_map(local, out_val), **tree_map(local, kwargs))
        if tally is not None:
            tally["backward" if _in_backward() else "forward"] += int(flops)
        return flops

    counted._get_raw = True  # type: ignore[attr-defined]  # FlopCounterMode passes tensors, not shapes
    return counted


def flop_counter() -> Any:
    """A ``FlopCounterMode`` that counts each rank's local work and CPU flash attention.

    - DTensor arguments are counted at their local shard's shape (:func:`_local_shapes`), so under
      tensor parallelism the ranks' counts add up to the one-process count instead of TP times it
      (before: 1.85x too many FLOPs per rank under ``hsdp_tp``).
    - ``counter.flops_by_pass`` (a dict) splits the total into ``"forward"`` and ``"backward"`` (what the
      autograd engine ran, activation recompute included) by when each op ran, not by hook order: a
      pipeline schedule runs every micro-batch's forward and backward inside ``training_step``.
    - torch's registry (checked on 2.6–2.13) has no formula for
      ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward, so SDPA on CPU tensors
      would count 0 FLOPs; we map them to torch's own ``sdpa_flop_count`` /
      ``sdpa_backward_flop_count`` (same formula as the CUDA flash kernels).

    >>> import torch
    >>> with flop_counter() as c:
    ...     _ = torch.ones(2, 3) @ torch.ones(3, 4)
    >>> c.get_total_flops(), c.flops_by_pass
    (48, {'forward': 48, 'backward': 0})
    """
    import torch  # here, not at the top: peak lookups (meshkit plan) need no torch
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
    tally = {"forward": 0, "backward": 0}
    mapping = {op: _local_shapes(f, tally) for op, f in registry.items()}
    counter = fc.FlopCounterMode(display=False, custom_mapping=mapping)
    counter.flops_by_pass = tally  # type: ignore[attr-defined]
    return counter


def measure_step_flops(model: torch.nn.Module, *inputs: Any,
                       loss_fn: Callable[[Any], torch.Tensor] | None = None) -> StepFlops:
    """Count one forward + backward of ``model(*inputs)`` on fake tensors (no memory, no compute).

    The model is cloned with fake parameters and buffers on the real device (no memory is
    copied), so kernels are chosen as in a real step and the real model is untouched. Flash
    attention's backward recomputes the attention scores (torch counts 2.5× its forward), which
    shows up as recompute, as it does on the hardware. Activation checkpointing inside ``model`` re-runs its
    forward during backward and is counted in ``backward`` (hence in :attr:`StepFlops.hardware`).
    ``loss_fn`` maps the output to a scalar (default: ``output.float().sum()``).

    >>> import torch
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
