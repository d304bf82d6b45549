"""Cold vs warm time of an occupancy sweep: kernels x 4 archs x 3 num_warps, compiled on this CPU.

Targets (issue 7): < 60 s cold, < 5 s warm on a 2-core machine. Cold = empty result cache (each compile
runs Triton's full pipeline and ptxas in the worker processes); warm = every result read from the cache.

    python benchmarks/occupancy.py                      # meshkit's builtin kernels, else the test fixtures
    python benchmarks/occupancy.py --kernels fixtures --archs sm_80,sm_86,sm_89,sm_90 --num-warps 2,4,8
    python benchmarks/occupancy.py --interpret          # as under TRITON_INTERPRET=1: worker processes
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if "--interpret" in sys.argv:  # as in a CPU run or the test suite: compiles go to worker processes
    os.environ["TRITON_INTERPRET"] = "1"

from meshkit.profiling.occupancy import sweep_occupancy  # noqa: E402


def _fixture_specs():
    from tests.fixtures.occupancy_kernels import matmul_kernel, row_sum_squares

    mm_sig = {"A": "*fp16", "B": "*fp16", "C": "*fp16", "M": "i32:16", "N": "i32:16", "K": "i32:16",
              "stride_am": "i32:16", "stride_bk": "i32:16", "stride_cm": "i32:16"}
    return [
        {"name": "row_sum_squares", "kernel": row_sum_squares,
         "signature": {"X": "*fp32", "OUT": "*fp32", "N": "i32", "stride": "i32"},
         "constexprs": {"BLOCK": 1024}},
        {"name": "matmul_64x64x32", "kernel": matmul_kernel, "signature": mm_sig,
         "constexprs": {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8, "stride_ak": 1,
                        "stride_bn": 1, "stride_cn": 1}},
    ]


def _specs(which: str):
    if which in ("builtin", "auto"):
        try:
            from meshkit.kernels import builtin_kernel_specs
            return "builtin", list(builtin_kernel_specs())
        except ImportError:
            if which == "builtin":
                raise
    return "fixtures", _fixture_specs()


def _cpu_seconds() -> float:
    """CPU time of this process and its finished children (ptxas, cuobjdump, compile workers)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def sweep(specs, archs, warps, cache_dir) -> tuple[float, float, int]:
    t0, c0 = time.perf_counter(), _cpu_seconds()
    n = len(sweep_occupancy(specs, num_warps=warps, archs=archs, cache_dir=cache_dir, progress=True))
    return time.perf_counter() - t0, _cpu_seconds() - c0, n


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernels", choices=["auto", "builtin", "fixtures"], default="auto")
    p.add_argument("--archs", default="sm_80,sm_86,sm_89,sm_90")
    p.add_argument("--num-warps", default="2,4,8")
    p.add_argument("--interpret", action="store_true",
                   help="set TRITON_INTERPRET=1 first, so compiles run in worker processes "
                        "(the CPU-run path)")
    a = p.parse_args()
    archs = a.archs.split(",")
    warps = [int(w) for w in a.num_warps.split(",")]
    which, specs = _specs(a.kernels)
    with tempfile.TemporaryDirectory(prefix="meshkit-occ-bench-") as cache:
        cold, cold_cpu, n = sweep(specs, archs, warps, cache)
        warm, warm_cpu, n2 = sweep(specs, archs, warps, cache)
    assert n == n2
    print(f"kernels={which} ({', '.join(s['name'] for s in specs)}), archs={archs}, num_warps={warps}: "
          f"{n} compiles, cpus={os.cpu_count()}, load={os.getloadavg()[0]:.1f}, "
          f"{'worker processes (TRITON_INTERPRET=1)' if a.interpret else 'in-process compile'}")
    # on a shared machine wall time counts other people's load; CPU seconds are what the sweep itself costs
    print(f"cold: {cold:6.1f} s wall, {cold_cpu:6.1f} s CPU  (target < 60 s) "
          f"{'OK' if cold < 60 else 'MISSED'}")
    print(f"warm: {warm:6.2f} s wall, {warm_cpu:6.2f} s CPU  (target <  5 s) {'OK' if warm < 5 else 'MISSED'}"
          f"   cold/warm = {cold / warm:.0f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
