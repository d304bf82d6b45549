"""Compile a Triton kernel for a CUDA target on a machine without that GPU and read its resources.

Triton's CUDA backend lowers a ``@triton.jit`` function to PTX and runs the ``ptxas`` its wheel ships,
for any ``GPUTarget("cuda", capability, 32)``, with no driver involved. From the cubin we read
registers per thread, local (stack + spill) bytes and static shared memory with the wheel's
``cuobjdump --dump-resource-usage``; dynamic shared memory is Triton's ``metadata.shared`` (what its
launcher passes at launch), and spill stores/loads come from ``ptxas -v``. Each kernel x arch x config
gives one :class:`KernelResources`, the record the reports compose.

Compiles run in this process, or, when this process set ``TRITON_INTERPRET=1`` before importing
triton (as the test suite and CPU runs do), in worker subprocesses (fresh interpreters): in interpreter
mode ``tl.sum`` & co. are interpreter versions that Triton's compiler cannot lower. A
worker imports the kernel by module name (or file path) and qualname, so the kernel must be defined at
module level, and a script that defines one must keep its own work under
``if __name__ == "__main__":`` (the worker imports the file).

Results are cached on disk, one JSON file per key: the kernel's source and its module file's text,
its qualname, the triton version, the arch, the launch config, the signature and the constexprs.
Helpers imported from *other* files are not part of the key: clear the cache (``cache_dir``) after
editing them.

>>> sig = build_signature(kernel, signature="X=*fp32,N=i32", constexprs={"BLOCK": 1024})  # doctest: +SKIP
>>> (res,) = compile_resources(kernel, sig, launch_configs(kernel), ["sm_90"])  # doctest: +SKIP
>>> res.registers_per_thread, res.spill_store_bytes  # doctest: +SKIP
(16, 0)
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import inspect
import io
import json
import os
import queue
import re
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

__all__ = [
    "KernelCompileError",
    "KernelResources",
    "KernelSignature",
    "LaunchConfig",
    "build_signature",
    "compile_many",
    "compile_resources",
    "default_cache_dir",
    "import_file",
    "launch_configs",
]

_SCALAR_TYPES = {"i1", "i8", "i16", "i32", "i64", "u1", "u8", "u16", "u32", "u64", "fp8e4nv", "fp8e5", "fp16",
                 "bf16", "fp32", "fp64"}
_TORCH_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64", "int8": "i8",
                 "int16": "i16", "int32": "i32", "int64": "i64", "uint8": "u8", "bool": "i1",
                 "float8_e4m3fn": "fp8e4nv", "float8_e5m2": "fp8e5"}
_WORKER_TIMEOUT_S = 600.0
# a compile worker: JSON jobs on stdin, one JSON line per job on stdout; `-c`, not `-m`, because the
# package's __init__ imports this module first (runpy would warn and run a second copy)
_WORKER_ARGS = ("-c", "from meshkit.profiling.occupancy.compile import _worker_main; "
                      "raise SystemExit(_worker_main())")


class KernelCompileError(ValueError):
    """Triton or ptxas rejected the kernel for a target; the message names kernel, arch and config."""


@dataclass(frozen=True)
class KernelSignature:
    """Argument types of one kernel specialisation."""

    types: dict[str, str]
    """Non-constexpr parameter -> Triton type string (``"*fp32"``, ``"i32"``)."""
    constexprs: dict[str, Any]
    divisible: tuple[str, ...]
    """Parameters known to be 16-divisible (pointers: 16-byte aligned), as Triton's launcher marks them."""


@dataclass(frozen=True)
class LaunchConfig:
    num_warps: int
    num_stages: int
    constexprs: dict[str, Any] = field(default_factory=dict)
    """Constexpr values this config sets (an autotune config's kwargs)."""


@dataclass(frozen=True)
class KernelResources:
    """What the cubin of one kernel x arch x config uses: the one resources record.

    Its fields are also the on-disk cache format (one JSON object per entry).
    """

    kernel: str
    """The kernel's function name."""
    arch: str
    """``"sm_90"``."""
    num_warps: int
    num_stages: int
    constexprs: dict[str, Any]
    """Every ``tl.constexpr`` value the kernel was compiled with (signature's and config's)."""
    registers_per_thread: int
    """Cubin ``REG`` (what the driver reports as ``n_regs``)."""
    spill_store_bytes: int
    """Bytes of spill stores ptxas reports (``ptxas -v``)."""
    spill_load_bytes: int
    """Bytes of spill loads ptxas reports (``ptxas -v``)."""
    local_bytes: int
    """Local memory per thread from the cubin (stack frame incl. spills)."""
    stack_bytes: int
    static_shared_bytes: int
    """Cubin ``SHARED``."""
    dynamic_shared_bytes: int
    """Triton's ``metadata.shared``: what its launcher passes at launch."""
    compile_seconds: float
    cached: bool = False
    """True when read back from the cache instead of compiled."""

    @property
    def shared_bytes(self) -> int:
        """Static + dynamic shared memory per block (the CUDA reservation excluded)."""
        return self.static_shared_bytes + self.dynamic_shared_bytes


# ---------------------------------------------------------------------------------------------------------
# Kernel introspection
# ---------------------------------------------------------------------------------------------------------


def _python_fn(kernel: Any) -> Any:
    """The plain Python function under a JITFunction / InterpretedFunction / Autotuner / Heuristics."""
    obj, seen = kernel, 0
    while hasattr(obj, "fn") and seen < 8:
        obj, seen = obj.fn, seen + 1
    if not inspect.isfunction(obj) or seen == 0:
        raise ValueError(f"kernel={kernel!r} is not a @triton.jit function (nor an autotuned or "
                         f"heuristics one).")
    return obj


def _kernel_name(kernel: Any) -> str:
    return _python_fn(kernel).__name__


def _is_constexpr_annotation(ann: Any) -> bool:
    if isinstance(ann, str):
        return ann.split(".")[-1] == "constexpr"
    return getattr(ann, "__name__", "") == "constexpr"


def kernel_params(kernel: Any) -> list[tuple[str, bool, Any]]:
    """(name, is_constexpr, default or inspect.Parameter.empty) for each parameter, in order."""
    fn = _python_fn(kernel)
    return [(p.name, _is_constexpr_annotation(p.annotation), p.default)
            for p in inspect.signature(fn).parameters.values()]


def _parse_signature_text(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        name, sep, ty = item.partition("=")
        if not sep:
            raise ValueError(f"signature entry {item!r} must read NAME=TYPE, e.g. 'X=*fp32,N=i32'.")
        out[name.strip()] = ty.strip()
    return out


def _check_type(name: str, ty: str) -> str:
    base = ty.lstrip("*")
    if base not in _SCALAR_TYPES or ty.count("*") > 1:
        raise ValueError(f"signature type {name}={ty!r} is not a Triton type: use a scalar "
                         f"({', '.join(sorted(_SCALAR_TYPES))}) or a pointer '*fp32'.")
    return ty


def _type_of_arg(name: str, value: Any) -> tuple[str, bool]:
    """(Triton type, 16-divisible) of an example argument, as Triton's launcher would specialise it."""
    if hasattr(value, "data_ptr") and hasattr(value, "dtype"):
        dt = str(value.dtype).removeprefix("torch.")
        if dt not in _TORCH_DTYPES:
            raise ValueError(f"argument {name} has dtype={value.dtype}, which has no Triton pointer type "
                             f"here.")
        return "*" + _TORCH_DTYPES[dt], value.data_ptr() % 16 == 0
    if isinstance(value, bool):
        return "i1", False
    if isinstance(value, int):
        return ("i32" if -2**31 <= value < 2**31 else "i64"), value % 16 == 0
    if isinstance(value, float):
        return "fp32", False
    raise ValueError(f"argument {name}={value!r} ({type(value).__name__}) is not a tensor, int, float or "
                     f"bool; pass signature= instead.")


def build_signature(kernel: Any, *, args: Sequence[Any] | None = None,
                    signature: str | Mapping[str, str] | None = None,
                    constexprs: Mapping[str, Any] | None = None) -> KernelSignature:
    """Check ``args`` or ``signature`` and ``constexprs`` against the kernel's parameters.

    Without example args every pointer is taken as 16-byte aligned (true of torch allocations) and an
    int as 16-divisible only when its type carries Triton's ``:16`` hint (``"stride=i32:16"``), as the
    launcher would specialise a stride of 64; such hints change vectorisation, pipelining and registers.
    """
    params = kernel_params(kernel)
    names = [p[0] for p in params]
    kname = _kernel_name(kernel)
    constexprs = dict(constexprs or {})
    if (args is None) == (signature is None):
        raise ValueError(f"kernel {kname}: give exactly one of args= (example arguments) or signature= "
                         f"(e.g. '{','.join(f'{n}=*fp32' for n in names[:2])}').")
    divisible: list[str] = []
    if signature is not None:
        raw = _parse_signature_text(signature) if isinstance(signature, str) else dict(signature)
        types = {}
        for n, ty in raw.items():
            ty, colon, hint = str(ty).strip().partition(":")
            if colon and hint != "16":
                raise ValueError(f"signature type {n}={raw[n]!r}: the only hint is ':16' (16-divisible int "
                                 f"or 16-byte aligned pointer), as in Triton's AOT compiler.")
            types[n] = _check_type(n, ty)
            if ty.startswith("*") or colon:
                divisible.append(n)
    else:
        runtime = [n for n, is_c, _ in params if not is_c and n not in constexprs]
        if len(args) != len(runtime):
            raise ValueError(f"kernel {kname} takes {len(runtime)} runtime arguments ({', '.join(runtime)}) "
                             f"besides its constexprs; got len(args)={len(args)}.")
        types = {}
        for n, v in zip(runtime, args):
            types[n], div = _type_of_arg(n, v)
            if div:
                divisible.append(n)
    unknown = [n for n in [*types, *constexprs] if n not in names]
    if unknown:
        raise ValueError(f"kernel {kname} has no parameter(s) {', '.join(unknown)}; its parameters are "
                         f"{', '.join(names)}. Fix the signature/constexpr names.")
    both = [n for n in types if n in constexprs]
    if both:
        raise ValueError(f"kernel {kname}: {', '.join(both)} given both a type and a constexpr value; "
                         f"give one.")
    for n, is_c, default in params:
        if is_c and n in types:
            raise ValueError(f"kernel {kname}: parameter {n} is a tl.constexpr; pass its value as a "
                             f"constexpr (--constexpr {n}=...), not a type {n}={types[n]!r}.")
        if is_c and n not in constexprs:
            if default is inspect.Parameter.empty:
                raise ValueError(f"kernel {kname}: tl.constexpr {n} has no value; pass "
                                 f"constexprs={{'{n}': ...}} (CLI: --constexpr {n}=...).")
            constexprs[n] = default
        if not is_c and n not in types and n not in constexprs:
            raise ValueError(f"kernel {kname}: parameter {n} has no type in the signature; add e.g. "
                             f"{n}=*fp32 or {n}=i32.")
    return KernelSignature(types=types, constexprs=constexprs, divisible=tuple(divisible))


def launch_configs(kernel: Any, *, num_warps: int | Sequence[int] | None = None,
                   num_stages: int | Sequence[int] | None = None,
                   configs: Sequence[Any] | None = None) -> list[LaunchConfig]:
    """Launch configs to measure: ``configs``, else num_warps x num_stages, else an autotuner's configs."""
    if configs is not None and (num_warps is not None or num_stages is not None):
        raise ValueError("give configs= or num_warps=/num_stages=, not both.")
    if configs is None and num_warps is None and num_stages is None and hasattr(kernel, "configs"):
        configs = kernel.configs
    if configs is not None:
        out = []
        for cfg in configs:
            if isinstance(cfg, Mapping):
                cfg = dict(cfg)
                w, s = cfg.pop("num_warps", 4), cfg.pop("num_stages", 3)
                out.append(LaunchConfig(_positive("num_warps", w), _positive("num_stages", s), cfg))
            else:
                out.append(LaunchConfig(_positive("num_warps", cfg.num_warps),
                                        _positive("num_stages", cfg.num_stages), dict(cfg.kwargs)))
        if not out:
            raise ValueError("configs=[] is empty; give at least one config.")
        return out
    warps = [4] if num_warps is None else ([num_warps] if isinstance(num_warps, int) else list(num_warps))
    stages = [3] if num_stages is None else (
        [num_stages] if isinstance(num_stages, int) else list(num_stages))
    for w in warps:
        _positive("num_warps", w)
        if w & (w - 1) or w > 32:
            raise ValueError(f"num_warps={w} must be a power of two in [1, 32] (Triton's rule).")
    return [LaunchConfig(w, _positive("num_stages", s)) for w in warps for s in stages]


def _positive(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name}={v!r} must be a positive int.")
    return v


def _kernel_ref(kernel: Any) -> dict[str, str]:
    """How the worker finds the kernel: {"module": ...} or {"file": ...}, plus "name"."""
    fn = _python_fn(kernel)
    name = fn.__qualname__
    if "<locals>" in name:
        raise ValueError(f"kernel {fn.__name__} is defined inside a function ({name}); define it at module "
                         f"level so the compile worker can import it.")
    module = fn.__module__
    mod = sys.modules.get(module)
    if module != "__main__" and mod is not None and getattr(mod, name, None) is not None:
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            spec = None
        if spec is not None and not module.startswith("_meshkit_file_"):
            return {"module": module, "name": name}
    path = inspect.getsourcefile(fn)
    if path is None or not os.path.isfile(path):
        raise ValueError(f"kernel {fn.__name__}: its source file cannot be found; define it in a .py file.")
    return {"file": os.path.abspath(path), "name": name}


def _source_hash(kernel: Any) -> str:
    fn = _python_fn(kernel)
    h = hashlib.sha256(fn.__qualname__.encode())
    path = inspect.getsourcefile(fn)
    h.update(Path(path).read_bytes() if path and os.path.isfile(path) else inspect.getsource(fn).encode())
    return h.hexdigest()


def import_file(path: str) -> Any:
    """Import a .py file as a fresh module (name derived from its path)."""
    path = os.path.abspath(path)
    name = "_meshkit_file_" + hashlib.sha1(path.encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------------------------------------
# Cache + worker pool
# ---------------------------------------------------------------------------------------------------------


def default_cache_dir() -> Path:
    """``$MESHKIT_CACHE_DIR/occupancy``, else ``~/.cache/meshkit/occupancy``."""
    root = os.environ.get("MESHKIT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "meshkit")
    return Path(root) / "occupancy"


def _jsonable(v: Any) -> Any:
    return v if isinstance(v, (int, float, str, bool)) or v is None else str(v)


def _triton_version() -> str:
    try:
        from importlib.metadata import version
        return version("triton")
    except Exception:  # noqa: BLE001 - metadata missing: fall back to a constant key part
        return "unknown"


def compile_resources(kernel: Any, sig: KernelSignature, configs: Sequence[LaunchConfig],
                      archs: Sequence[str],
                      *, cache_dir: str | os.PathLike | None = None, progress: bool = False,
                      workers: int | None = None) -> list[KernelResources]:
    """Resources of ``kernel`` for every arch x config, from the cache or compiled in worker processes.

    Results come back in arch-major order. ``workers``: 0 compiles in this process (the default unless
    Triton is in interpreter mode), N >= 1 in N worker processes (default ``min(2, cpu count)`` under
    ``TRITON_INTERPRET=1``); ``$MESHKIT_OCCUPANCY_WORKERS`` overrides the default.
    """
    return compile_many([(kernel, sig, configs)], archs, cache_dir=cache_dir, progress=progress,
                        workers=workers)[0]


def compile_many(entries: Sequence[tuple[Any, KernelSignature, Sequence[LaunchConfig]]], archs: Sequence[str],
                 *, cache_dir: str | os.PathLike | None = None, progress: bool = False,
                 workers: int | None = None) -> list[list[KernelResources]]:
    """:func:`compile_resources` for several kernels at once: one worker pool and one progress bar."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    tver, fp_fusion = _triton_version(), _default_fp_fusion()
    jobs, results, keys, slots, objects = [], {}, {}, [], {}
    for kernel, sig, configs in entries:
        ref, kname, src_hash = _kernel_ref(kernel), _kernel_name(kernel), _source_hash(kernel)
        mine = []
        for arch in archs:
            for cfg in configs:
                consts = {**sig.constexprs, **cfg.constexprs}
                job = {
                    "ref": ref, "kernel": kname, "arch": arch, "num_warps": cfg.num_warps,
                    "num_stages": cfg.num_stages, "types": sig.types,
                    "constexprs": {k: _jsonable(v) for k, v in consts.items()},
                    "divisible": list(sig.divisible), "enable_fp_fusion": fp_fusion,
                }
                key_src = json.dumps({**job, "ref": None, "source": src_hash, "triton": tver}, sort_keys=True)
                idx = len(keys)
                keys[idx] = hashlib.sha256(key_src.encode()).hexdigest()[:32]
                mine.append(idx)
                hit = cache / f"{keys[idx]}.json"
                if hit.is_file():
                    try:
                        results[idx] = KernelResources(**{**json.loads(hit.read_text()), "cached": True})
                        continue
                    except (ValueError, TypeError):
                        pass  # unreadable entry: recompile
                jobs.append({**job, "id": idx})
                objects[idx] = kernel
        slots.append(mine)
    t0 = time.perf_counter()
    # a warning raised while the progress bar is drawn would break its line and run into what follows:
    # held, then shown after the bar is gone, then the finished line (all on stderr; the table is stdout's)
    try:
        with warnings.catch_warnings(record=True) as held:
            for idx, res in _run_workers(jobs, objects, progress, workers) if jobs else ():
                results[idx] = res
                cache.mkdir(parents=True, exist_ok=True)
                tmp = cache / f".{keys[idx]}.{os.getpid()}.tmp"
                tmp.write_text(json.dumps(asdict(res)))
                os.replace(tmp, cache / f"{keys[idx]}.json")
    finally:
        for w in held:  # through the filters already (catch_warnings keeps them): shown as they came
            warnings.showwarning(w.message, w.category, w.filename, w.lineno, w.file, w.line)
    if progress:
        print(f"{len(keys)} kernel config(s): {len(jobs)} compiled in {time.perf_counter() - t0:.1f} s, "
              f"{len(keys) - len(jobs)} from the cache ({cache})", file=sys.stderr, flush=True)
    return [[results[i] for i in mine] for mine in slots]


def _default_fp_fusion() -> bool:
    """FP fusion as Triton's launcher chooses it when a launch names none (triton 3.8 and 3.9: on unless
    ``TRITON_DEFAULT_FP_FUSION=0`` or 3.9's ``TRITON_FORCE_DISABLE_FP_FUSION=1``), so the offline compile
    measures what runs. Passed explicitly: left unset, triton 3.9 warns (its FP_FUSION_DEFAULT_WARNING)
    that it is choosing, a warning about the user's launches that this compile need not raise."""
    from triton import knobs

    lang = knobs.language
    return bool(lang.default_fp_fusion) and not bool(getattr(lang, "force_disable_fp_fusion", False))


def _worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # the worker must import triton in compile mode
    paths = [p if p else os.getcwd() for p in sys.path]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


def _interpreting() -> bool:
    import triton

    return bool(triton.knobs.runtime.interpret)


def _run_in_process(jobs: list[dict], objects: Mapping[int, Any], progress: bool):
    """Compile here: no worker start-up and the kernel modules are already imported."""
    bar = _progress_bar(len(jobs)) if progress else None
    failures = []
    try:
        for msg in _compile_iter(jobs, objects):
            yield from _take(msg, bar, failures)
    finally:
        if bar is not None:
            bar.close()
    _raise_failures(failures)


def _take(msg: dict, bar: Any, failures: list[str]):
    """One finished compile job: advance the progress bar, yield (id, resources) or note the failure."""
    if bar is not None:
        bar.update(1)
        bar.set_postfix_str(f"{msg['kernel']} {msg['arch']} w{msg['num_warps']}", refresh=False)
    if msg["ok"]:
        yield msg["id"], KernelResources(**msg["result"])
    else:
        failures.append(msg["error"])


def _raise_failures(failures: list[str]) -> None:
    if failures:
        more = f"\n({len(failures) - 1} more failure(s))" if len(failures) > 1 else ""
        raise KernelCompileError(failures[0] + more)


def _run_workers(jobs: list[dict], objects: Mapping[int, Any], progress: bool, workers: int | None):
    """Compile in this process (``workers=0``, the default when Triton is not in interpreter mode) or in
    worker processes (the default under ``TRITON_INTERPRET=1``, where it is the only way)."""
    env_n = os.environ.get("MESHKIT_OCCUPANCY_WORKERS")
    n = workers if workers is not None else (int(env_n) if env_n else None)
    if n is None:
        n = min(2, os.cpu_count() or 1) if _interpreting() else 0
    if n == 0:
        if _interpreting():
            raise ValueError("workers=0 (compile in this process) is impossible under TRITON_INTERPRET=1: "
                             "triton.language was imported in interpreter mode. Use workers >= 1.")
        yield from _run_in_process(jobs, objects, progress)
        return
    yield from _run_pool(jobs, progress, n)


def _run_pool(jobs: list[dict], progress: bool, n: int):
    n = max(1, min(n, len(jobs)))
    chunks = [jobs[i::n] for i in range(n)]
    out: queue.Queue = queue.Queue()
    procs = []
    for chunk in chunks:
        proc = subprocess.Popen([sys.executable, *_WORKER_ARGS],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=_worker_env(), text=True)
        procs.append(proc)
        threading.Thread(target=_pump, args=(proc, chunk, out), daemon=True).start()
    bar = _progress_bar(len(jobs)) if progress else None
    done, failures, dead = 0, [], 0
    try:
        while done < len(jobs) and dead < len(procs):
            try:
                msg = out.get(timeout=_WORKER_TIMEOUT_S)
            except queue.Empty:
                raise RuntimeError(f"occupancy compile worker produced nothing for "
                                   f"{_WORKER_TIMEOUT_S:.0f} s") from None
            if msg.get("dead"):
                dead += 1
                if msg["missing"]:
                    failures.append(f"compile worker exited with status {msg['rc']} before finishing "
                                    f"{msg['missing']} job(s):\n{msg['stderr'][-3000:]}")
                continue
            done += 1
            yield from _take(msg, bar, failures)
    finally:
        if bar is not None:
            bar.close()
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    _raise_failures(failures)


def _pump(proc: subprocess.Popen, chunk: list[dict], out: queue.Queue) -> None:
    stderr_chunks: list[str] = []
    t = threading.Thread(target=lambda: stderr_chunks.append(proc.stderr.read()), daemon=True)
    t.start()
    try:
        proc.stdin.write(json.dumps(chunk))
        proc.stdin.close()
    except BrokenPipeError:
        pass
    seen = 0
    for line in proc.stdout:
        if line.startswith("{"):
            seen += 1
            out.put(json.loads(line))
    proc.wait()
    t.join(timeout=5)
    out.put({"dead": True, "rc": proc.returncode, "missing": len(chunk) - seen,
             "stderr": "".join(stderr_chunks)})


def _progress_bar(total: int):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    # disable=None: drawn on a terminal only (in a log or a pipe its carriage returns leave a line of
    # bar remnants that the next line is glued to); leave=False: erased when done, the finished line follows
    return tqdm(total=total, desc="compiling", unit="kernel", file=sys.stderr, leave=False, disable=None)


# ---------------------------------------------------------------------------------------------------------
# Worker side (runs with TRITON_INTERPRET unset)
# ---------------------------------------------------------------------------------------------------------

_RES_RE = re.compile(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)")
_SPILL_RE = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def _cubin_usage(cubin: bytes, fn_name: str, cuobjdump: str) -> dict[str, int]:
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        text = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], check=True, capture_output=True,
                              text=True).stdout
    finally:
        os.remove(f.name)
    blocks = re.split(r"\n\s*Function ", text)
    chosen = None
    for block in blocks[1:]:
        name, _, rest = block.partition(":")
        m = _RES_RE.search(rest)
        if m and (chosen is None or name.strip() == fn_name):
            chosen = m
    if chosen is None:
        raise RuntimeError(f"cuobjdump printed no resource usage for {fn_name}:\n{text}")
    reg, stack, shared, local = map(int, chosen.groups())
    return {"registers_per_thread": reg, "stack_bytes": stack, "static_shared_bytes": shared,
            "local_bytes": local}


def _unwrap_jit(obj: Any, where: str) -> Any:
    from triton.runtime.jit import JITFunction

    seen = 0
    while not isinstance(obj, JITFunction) and hasattr(obj, "fn") and seen < 8:
        obj, seen = obj.fn, seen + 1
    if not isinstance(obj, JITFunction):
        raise ValueError(f"{where} is not a @triton.jit function once imported without TRITON_INTERPRET")
    return obj


def _load_jit(ref: dict[str, str], cache: dict) -> Any:
    key = (ref.get("module"), ref.get("file"), ref["name"])
    if key not in cache:
        module = importlib.import_module(ref["module"]) if ref.get("module") else import_file(ref["file"])
        obj: Any = module
        for part in ref["name"].split("."):
            obj = getattr(obj, part)
        cache[key] = _unwrap_jit(obj, f"{ref['name']} in {ref.get('module') or ref.get('file')}")
    return cache[key]


def _compile_one(job: dict, fn: Any, cuobjdump: str) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    cap = int(job["arch"].removeprefix("sm_"))
    names = fn.arg_names
    sig = {n: (job["types"][n] if n in job["types"] else "constexpr") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in job["divisible"]}
    log = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(log):
        compiled = triton.compile(ASTSource(fn, sig, job["constexprs"], attrs),
                                  target=GPUTarget("cuda", cap, 32),
                                  options={"num_warps": job["num_warps"], "num_stages": job["num_stages"],
                                           "enable_fp_fusion": job["enable_fp_fusion"]})
    seconds = time.perf_counter() - t0
    usage = _cubin_usage(compiled.asm["cubin"], compiled.metadata.name, cuobjdump)
    spills = _SPILL_RE.search(log.getvalue())
    stores, loads = (int(spills.group(1)), int(spills.group(2))) if spills else (usage["local_bytes"], 0)
    return asdict(KernelResources(
        kernel=job["kernel"], arch=job["arch"], num_warps=job["num_warps"], num_stages=job["num_stages"],
        constexprs=job["constexprs"], spill_store_bytes=stores, spill_load_bytes=loads,
        dynamic_shared_bytes=int(compiled.metadata.shared), compile_seconds=seconds, **usage))


def _compile_iter(jobs: Sequence[dict], objects: Mapping[int, Any] | None = None):
    """Compile each job in this process (triton must be in compile mode); yields one message per job.

    ``objects`` maps job ids to kernel objects already at hand (in-process use); others are imported.
    """
    from triton import knobs

    kernels: dict = {}
    with knobs.nvidia.scope(), knobs.compilation.scope(), knobs.cache.scope(), \
            tempfile.TemporaryDirectory(prefix="meshkit-triton-") as tdir:
        knobs.nvidia.dump_ptxas_log = True       # ptxas -v output -> spill stores / loads
        knobs.compilation.always_compile = True  # so the log is printed even when a triton cache has it
        knobs.cache.dir = tdir
        cuobjdump = knobs.nvidia.cuobjdump.path
        for job in jobs:
            head = {"id": job["id"], "kernel": job["kernel"], "arch": job["arch"],
                    "num_warps": job["num_warps"]}
            try:
                obj = (objects or {}).get(job["id"])
                fn = _unwrap_jit(obj, job["kernel"]) if obj is not None else _load_jit(job["ref"], kernels)
                msg = {**head, "ok": True, "result": _compile_one(job, fn, cuobjdump)}
            except Exception as exc:  # noqa: BLE001 - any compiler failure is reported to the caller
                cfg = (f"num_warps={job['num_warps']}, num_stages={job['num_stages']}, "
                       f"constexprs={job['constexprs']}")
                text = f"{type(exc).__name__}: {exc}".strip()
                if len(text) > 4000:
                    text = text[:2000] + "\n...\n" + text[-2000:]
                msg = {**head, "ok": False,
                       "error": f"kernel {job['kernel']} failed to compile for {job['arch']} "
                                f"({cfg}):\n{text}"}
            yield msg


def _worker_main() -> int:
    jobs = json.loads(sys.stdin.read())
    real_stdout = sys.stdout
    for msg in _compile_iter(jobs):
        real_stdout.write(json.dumps(msg) + "\n")
        real_stdout.flush()
    return 0
