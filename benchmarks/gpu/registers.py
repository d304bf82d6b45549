"""Offline vs loaded register counts: meshkit occupancy's CPU-side compile against the driver's ``n_regs``.

Two sets of kernels:

- ``fixtures`` (tests/fixtures/occupancy_kernels.py, the same specialisations as
  tests/gpu/test_occupancy_gpu.py): launched on the GPU, the returned kernel's ``n_regs`` /
  ``n_spills`` / shared bytes beside :func:`meshkit.profiling.occupancy.kernel_occupancy` compiled
  for the same arch from its signature. These must be equal.
- ``builtin`` (meshkit.kernels): the kernels a bf16 Llama-3-8B-width forward + backward of each
  op loads, read from Triton's per-device JIT cache, each compiled offline again from the loaded
  specialisation's own signature, constexprs, num_warps and num_stages. Best effort: the cache's
  layout is Triton-internal (checked on triton 3.8), so a kernel it cannot read is listed with the reason.

    python benchmarks/gpu/registers.py --json regs.json        # on a CUDA machine
    python benchmarks/gpu/registers.py --cpu --json regs.json  # offline side only, sm_90, one kernel
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from meshkit.profiling.occupancy import kernel_occupancy  # noqa: E402
from tests.fixtures.occupancy_kernels import matmul_kernel, row_sum_squares  # noqa: E402
from tests.gpu.test_occupancy_gpu import MM_CONST, MM_SIG, RED_SIG  # noqa: E402  (the specialisations tested)

__all__ = ["offline", "fixture_rows", "builtin_rows", "main"]




def offline(kernel: Any, arch: str, cache: str, **spec: Any) -> dict[str, Any]:
    """One offline compile for ``arch``: registers, spills (local bytes / 4, as Triton's ``n_spills``),
    dynamic shared bytes and the occupancy they give."""
    (rep,) = kernel_occupancy(kernel, archs=[arch], cache_dir=cache, **spec)
    return {"registers": rep.registers_per_thread, "spills": rep.local_bytes // 4,
            "shared_bytes": rep.dynamic_shared_bytes, "active_blocks_per_sm": rep.occupancy.active_blocks_per_sm}


def _loaded(k: Any) -> dict[str, Any]:
    return {"registers": k.n_regs, "spills": k.n_spills, "shared_bytes": k.metadata.shared}


def _compare(off: dict[str, Any], got: dict[str, Any] | None) -> dict[str, Any]:
    row: dict[str, Any] = {"offline": off, "loaded": got}
    if got is not None:
        row["match"] = all(off[key] == got[key] for key in ("registers", "spills", "shared_bytes"))
    return row


def fixture_rows(arch: str, cache: str, cuda: bool, small: bool) -> dict[str, Any]:
    """The two fixture kernels, offline vs launched (offline only without CUDA)."""
    rows: dict[str, Any] = {}
    red_spec = {"signature": RED_SIG, "constexprs": {"BLOCK": 1024}, "num_warps": 4}
    got = None
    if cuda:
        x, y = torch.randn(64, 1000, device="cuda"), torch.empty(64, device="cuda")
        got = _loaded(row_sum_squares[(64,)](x, y, 1000, x.stride(0), BLOCK=1024, num_warps=4))
    rows["row_sum_squares"] = _compare(offline(row_sum_squares, arch, cache, **red_spec), got)
    if small:
        return rows
    got = None
    if cuda:
        a, b, c = (torch.randn(512, 512, device="cuda", dtype=torch.float16) for _ in range(3))
        got = _loaded(matmul_kernel[(16,)](a, b, c, 512, 512, 512, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                                           c.stride(0), c.stride(1), BLOCK_M=128, BLOCK_N=128, BLOCK_K=64,
                                           GROUP_M=8, num_warps=8, num_stages=4))
    rows["matmul"] = _compare(offline(matmul_kernel, arch, cache, signature=MM_SIG, constexprs=MM_CONST,
                                      num_warps=8, num_stages=4), got)
    return rows


def _run_builtin_ops() -> None:
    """One bf16 forward + backward of each meshkit op at Llama-3-8B width, so Triton loads its kernels (and RMSNorm
    at Llama-3-405B's 16384, for its column-split backward)."""
    import meshkit.kernels as mk

    def r(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    x, w = r(256, 4096), r(4096)
    mk.add_rms_norm(x, r(256, 4096), w, 1e-5)[0].sum().backward()
    mk.rms_norm(x, w, 1e-5).sum().backward()
    mk.add_rms_norm(r(64, 16384), r(64, 16384), r(16384), 1e-5)[0].sum().backward()
    mk.swiglu(r(256, 14336), r(256, 14336)).sum().backward()
    q, k = mk.rope(r(2, 128, 32, 128), r(2, 128, 8, 128), torch.arange(128, device="cuda"), theta=500000.0)
    (q.sum() + k.sum()).backward()
    target = torch.randint(0, 128256, (256,), device="cuda")
    mk.fused_linear_cross_entropy(r(256, 4096), r(128256, 4096), target).backward()
    torch.cuda.synchronize()


def _cached_kernels(fn: Any) -> list[Any]:
    """The CompiledKernels in a JITFunction's per-device cache (Triton-internal layout, triton 3.x)."""
    found = []
    for entry in getattr(fn, "device_caches", {}).values():
        cache = entry[0] if isinstance(entry, tuple) else entry
        found.extend(cache.values())
    return found


def _spec_of(fn: Any, k: Any) -> dict[str, Any]:
    """signature / constexprs / num_warps / num_stages of a loaded kernel, for :func:`offline`."""
    sig = {name: ty for name, ty in k.src.signature.items() if ty != "constexpr"}
    names = list(fn.arg_names)
    for key, attrs in getattr(k.src, "attrs", {}).items():  # {(index,): [["tt.divisibility", 16]]}
        name = names[key[0]]
        if name in sig and not sig[name].startswith("*") and ["tt.divisibility", 16] in [list(x) for x in attrs]:
            sig[name] += ":16"  # the launcher's 16-divisible int specialisation (pointers are always aligned)
    constexprs = {}
    for key, val in k.src.constants.items():
        name = names[key[0]] if isinstance(key, tuple) else (names[key] if isinstance(key, int) else key)
        if name not in sig:
            constexprs[name] = int(val) if isinstance(val, bool) else val
    return {"signature": sig, "constexprs": constexprs, "num_warps": k.metadata.num_warps,
            "num_stages": k.metadata.num_stages}


def builtin_rows(arch: str, cache: str) -> dict[str, Any]:
    """meshkit's own kernels as a training step loads them, offline vs loaded (needs CUDA)."""
    from meshkit.kernels import builtin_kernel_specs

    _run_builtin_ops()
    rows: dict[str, Any] = {}
    for spec in builtin_kernel_specs():
        fn = spec["kernel"]
        loaded = _cached_kernels(fn)
        if not loaded:
            rows[spec["name"]] = {"error": "not in Triton's JIT cache after the ops ran"}
        for i, k in enumerate(loaded):
            key = f"{spec['name']}#{i}"
            try:
                s = _spec_of(fn, k)
                rows[key] = {**_compare(offline(fn, arch, cache, **s), _loaded(k)),
                             "num_warps": s["num_warps"], "constexprs": s["constexprs"]}
            except Exception as exc:  # noqa: BLE001 - one unreadable specialisation is a figure, not a crash
                rows[key] = {"loaded": _loaded(k), "error": f"{type(exc).__name__}: {exc}"[:500]}
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="offline side only (sm_90, row_sum_squares)")
    ap.add_argument("--arch", default=None, help="offline target (default: this GPU's, or sm_90)")
    ap.add_argument("--json", help="write the figures here")
    a = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not a.cpu
    if a.arch:
        arch = a.arch
    elif cuda:
        major, minor = torch.cuda.get_device_capability()
        arch = f"sm_{major}{minor}"
    else:
        arch = "sm_90"
    out: dict[str, Any] = {"arch": arch, "loaded_side": "this GPU" if cuda else "none (no CUDA: offline only)"}
    failed = False
    with tempfile.TemporaryDirectory(prefix="meshkit-regs-") as cache:
        out["fixtures"] = fixture_rows(arch, cache, cuda, small=not cuda)
        if cuda:
            try:
                out["builtin"] = builtin_rows(arch, cache)
            except Exception as exc:  # noqa: BLE001
                out["builtin"] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
    failed = any(r.get("match") is False for r in out["fixtures"].values())
    out["fixtures_all_match"] = None if not cuda else not failed
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    print(json.dumps(out, default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
