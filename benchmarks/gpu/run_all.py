"""Every GPU check of meshkit in one unattended run, writing ONE JSON of figures.

Sections, each a subprocess with its own timeout (a hang or a crash is recorded and the next section
still runs); the whole run is held under ``--budget-s`` (default 450 s, under 8 minutes on one H200):

===========  =====  ======================================================================================
section      limit  what
===========  =====  ======================================================================================
tests_gpu    160 s  ``pytest tests/gpu`` (compiled Triton vs reference in fp32/fp16/bf16, CP attention on
                    CUDA, offline occupancy vs the loaded kernel): pass / fail / skip counts and failures
registers     60 s  benchmarks/gpu/registers.py: offline compile's registers vs the loaded kernel's n_regs
kernels      110 s  benchmarks/kernels.py: meshkit vs eager, torch.compile and Liger-Kernel (Liger only if
                    ``liger_kernel`` imports; the GPU machine has no network, so it is optional and the
                    JSON says whether it was there)
mfu_8b       120 s  benchmarks/gpu/mfu_8b.py: Llama-3-8B width, 2 and 4 layers, meshkit kernels + compile;
                    measured, per-layer and 32-layer extrapolated MFU (see that file)
===========  =====  ======================================================================================

Usage::

    benchmarks/gpu/run_all.sh                    # -> $OUT/gpu_figures.json (or ./gpu_figures.json)
    benchmarks/gpu/run_all.sh figures.json       # -> figures.json
    benchmarks/gpu/run_all.sh --cpu figures.json # dry run: same sections and code paths, tiny sizes, CUDA
                                                 # hidden, fp32, torch.compile with backend "eager"

Each section's record: ``status`` (ok | failed | timeout | error), ``seconds``, ``limit_s``,
``returncode``, ``figures`` (the JSON the section wrote) and, when not ok, ``error`` (stderr's tail).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from typing import Any, Callable

__all__ = ["SECTIONS", "run_section", "main"]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.join(ROOT, "benchmarks", "gpu")

# name -> (limit on GPU in s, limit in --cpu mode in s)
SECTIONS: dict[str, tuple[float, float]] = {
    "tests_gpu": (160, 120),
    "registers": (60, 120),
    "kernels": (110, 120),
    "mfu_8b": (120, 120),
}


def _command(name: str, out: str, cpu: bool) -> list[str]:
    py = sys.executable
    if name == "tests_gpu":
        return [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:hypothesispytest",
                os.path.join(ROOT, "tests", "gpu"), f"--junitxml={out}"]
    if name == "registers":
        return [py, os.path.join(HERE, "registers.py"), "--json", out] + (["--cpu"] if cpu else [])
    if name == "kernels":
        cmd = [py, os.path.join(ROOT, "benchmarks", "kernels.py"), "--json", out]
        return cmd + (["--device", "cpu", "--kernels", "rms_norm,flce", "--no-memory", "--compile-on-cpu",
                       "--compile-backend", "eager"] if cpu else ["--device", "cuda"])
    if name == "mfu_8b":
        cmd = [py, os.path.join(HERE, "mfu_8b.py"), "--json", out]
        # depths 1 and 3, median of 5 steps: two blocks' time (~10 ms) stands clear of one-step noise on CPU
        dry = ["--cpu", "--variants", "meshkit+compile", "--depths", "1,3", "--steps", "5", "--warmup", "1"]
        return cmd + (dry if cpu else ["--budget-s", "80"])
    raise ValueError(f"run_all: `section={name!r}` is unknown; choose from {', '.join(SECTIONS)}.")


def _junit(path: str) -> dict[str, Any]:
    """pass / fail / error / skip counts and the failing test ids of a pytest junit XML file."""
    root = ET.parse(path).getroot()
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures = []
    for case in root.iter("testcase"):
        test_id = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        if "failure" in kinds:
            counts["failed"] += 1
            failures.append({"test": test_id, "message": (case.find("failure").get("message") or "")[:300]})
        elif "error" in kinds:
            counts["errors"] += 1
            failures.append({"test": test_id, "message": (case.find("error").get("message") or "")[:300]})
        elif "skipped" in kinds:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return {**counts, "failures": failures}


_READERS: dict[str, Callable[[str], Any]] = {"tests_gpu": _junit}


def _read(name: str, path: str) -> Any:
    if not os.path.exists(path) or not os.path.getsize(path):
        return None
    reader = _READERS.get(name)
    if reader is not None:
        return reader(path)
    with open(path) as f:
        return json.load(f)


def _tail(text: str | bytes | None, n: int = 3000) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return (text or "")[-n:]


def _run_group(cmd: list[str], env: dict[str, str], limit_s: float, log: str) -> tuple[int | None, str, str]:
    """Run ``cmd`` in its own process group with output to files; (exit code or None on timeout, out, err).

    Files, not pipes: worker processes a section leaves behind (compile pools) would hold a pipe open
    and stall the reader past the section's end. The whole group is killed when the section ends.
    """
    with open(log + ".out", "w") as out, open(log + ".err", "w") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=err, start_new_session=True)
        try:
            code: int | None = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    with open(log + ".out", errors="replace") as out, open(log + ".err", errors="replace") as err:
        return code, out.read(), err.read()


def run_section(name: str, limit_s: float, cpu: bool, workdir: str) -> dict[str, Any]:
    """Run one section in a subprocess under ``limit_s``; never raises: errors become the record."""
    out = os.path.join(workdir, f"{name}.{'xml' if name == 'tests_gpu' else 'json'}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled Triton on the GPU
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the dry run takes the CPU paths even on a GPU machine
    rec: dict[str, Any] = {"limit_s": limit_s}
    t0 = time.perf_counter()
    try:
        cmd = _command(name, out, cpu)
        rec["command"] = " ".join(os.path.relpath(c, ROOT) if c.startswith(ROOT) else c for c in cmd)
        code, stdout, stderr = _run_group(cmd, env, limit_s, os.path.join(workdir, name))
        rec["returncode"] = code
        if code is None:
            rec.update(status="timeout", error=f"no exit within {limit_s:.0f} s; stderr tail: {_tail(stderr)}")
        else:
            rec["status"] = "ok" if code == 0 else "failed"
            if code:
                rec["error"] = _tail(stderr) or _tail(stdout)
        rec["stdout_tail"] = _tail(stdout, 1500)
    except Exception as exc:  # noqa: BLE001 - the runner itself must not stop the next section
        rec.update(status="error", returncode=None, error=f"{type(exc).__name__}: {exc}")
    rec["seconds"] = round(time.perf_counter() - t0, 2)
    try:
        rec["figures"] = _read(name, out)
    except Exception as exc:  # noqa: BLE001 - a half-written file
        rec["figures"] = None
        rec["error"] = (rec.get("error", "") + f"\nreading {out}: {type(exc).__name__}: {exc}").strip()
    if rec["status"] == "ok" and rec["figures"] is None:
        rec.update(status="failed", error=f"the section exited 0 but wrote no figures to {out}")
    return rec


def _environment(cpu: bool) -> dict[str, Any]:
    env: dict[str, Any] = {"mode": "cpu dry run" if cpu else "gpu", "python": platform.python_version(),
                           "host": platform.node(),
                           "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                           "liger_kernel_installed": importlib.util.find_spec("liger_kernel") is not None}
    for dist in ("torch", "triton"):  # versions without importing them (seconds of CPU each)
        try:
            env[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            env[dist] = None
    if not cpu:
        try:
            import torch

            env["cuda"] = torch.version.cuda
            if torch.cuda.is_available():
                env["device"] = torch.cuda.get_device_name()
                env["capability"] = list(torch.cuda.get_device_capability())
        except Exception as exc:  # noqa: BLE001
            env["device"] = f"unavailable: {exc}"
    return env


def _default_out() -> str:
    return os.path.join(os.environ.get("OUT") or os.getcwd(), "gpu_figures.json")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", default=None, help="the JSON to write (default $OUT/gpu_figures.json)")
    ap.add_argument("--cpu", "--dry-run", dest="cpu", action="store_true",
                    help="tiny sizes on CPU with CUDA hidden: the same sections and code paths")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {', '.join(SECTIONS)}")
    ap.add_argument("--budget-s", type=float, default=450.0, help="the whole run's limit; sections share it")
    a = ap.parse_args(argv)
    path = a.out or _default_out()
    names = [s for s in a.sections.split(",") if s]
    unknown = [s for s in names if s not in SECTIONS]
    if unknown:
        ap.error(f"`--sections` has unknown {unknown}; choose from {', '.join(SECTIONS)}")
    result: dict[str, Any] = {"environment": _environment(a.cpu), "sections": {}}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="meshkit-gpu-run-") as work:
        for name in names:
            left = a.budget_s - (time.perf_counter() - t0)
            limit = min(SECTIONS[name][1 if a.cpu else 0], left)
            if limit < 5:
                result["sections"][name] = {"status": "timeout", "error": f"--budget-s {a.budget_s:.0f} spent"}
                continue
            print(f"[run_all] {name} (limit {limit:.0f} s) ...", file=sys.stderr, flush=True)
            rec = run_section(name, limit, a.cpu, work)
            result["sections"][name] = rec
            print(f"[run_all] {name}: {rec['status']} in {rec['seconds']:.1f} s", file=sys.stderr, flush=True)
            _write(path, result, t0)  # after every section: a killed run still leaves what it had
    _write(path, result, t0)
    print(path)
    return 0 if all(r.get("status") == "ok" for r in result["sections"].values()) else 1


def _write(path: str, result: dict[str, Any], t0: float) -> None:
    result["total_s"] = round(time.perf_counter() - t0, 2)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str)


if __name__ == "__main__":
    raise SystemExit(main())
