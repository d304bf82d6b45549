"""Speed, memory and bf16 correctness of meshkit's fused kernels against eager, torch.compile and Liger.

One unattended command on a CUDA machine (Llama-3-8B-like shapes, bf16)::

    python benchmarks/kernels.py                 # -> markdown tables on stdout, --json FILE for the raw rows

Providers: ``eager`` (plain torch, HF's formulas), ``compile`` (torch.compile of eager), ``meshkit``
(Triton), ``liger`` (Liger-Kernel, when installed). Modes: ``fwd``, ``bwd`` (backward alone, graph
retained; for the fused losses,
which form gradients in the forward, full - fwd), ``full`` (forward + backward); time is the median of triton.testing.do_bench, memory the
peak CUDA allocation above the inputs during ``full``. The bf16 check compares each provider's outputs
and gradients with fp32 eager on the same (bf16-rounded) inputs; meshkit passes when its error is at
most twice eager bf16's (plus 1e-3), and the script exits 1 if any check fails.

CPU smoke mode (no GPU needed; what CI and this repo's authors could run)::

    python benchmarks/kernels.py --device cpu    # small shapes, meshkit = torch reference path,
                                                 # + the FLCE peak-memory benchmark below
    python benchmarks/kernels.py --device cpu --no-memory --compile-on-cpu --compile-backend eager
                                                 # benchmarks/gpu/run_all.sh --cpu: every provider's path

The CPU memory benchmark runs ``fused_linear_cross_entropy`` and ``F.cross_entropy(h @ W.T)`` forward
and backward (grads of h and W in both) in separate processes at 4096 tokens, vocab 32000, and
reports the peak RSS growth of each and their ratio (the target is <= 0.3).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import meshkit.kernels as mk  # noqa: E402

# ------------------------------------------------------------------------------------------ problems


def _rms_eager(x, w):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


def _rope_eager(q, k, cos, sin):  # HF: q, k (B, H, T, D), cos/sin (B, T, D)
    def rot(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([-x2, x1], dim=-1)

    c, s = cos[:, None], sin[:, None]
    return q * c + rot(q) * s, k * c + rot(k) * s


def _liger(name: str) -> Callable | None:
    try:
        if name == "rms_norm":
            from liger_kernel.ops.rms_norm import LigerRMSNormFunction

            return lambda x, w: LigerRMSNormFunction.apply(x, w, 1e-6)
        if name == "swiglu":
            from liger_kernel.ops.swiglu import LigerSiLUMulFunction

            return LigerSiLUMulFunction.apply
        if name == "rope":
            from liger_kernel.transformers import liger_rotary_pos_emb

            return liger_rotary_pos_emb
        if name == "flce":
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

            loss = LigerFusedLinearCrossEntropyLoss()
            return lambda h, w, t: loss(w, h, t)
    except Exception:  # noqa: BLE001 - not installed or API changed: the provider is left out
        return None
    return None


def problems(device: str, dtype: torch.dtype, small: bool) -> dict[str, dict[str, Any]]:
    """name -> {"inputs": [...], "grad": indices of differentiable inputs, "providers": {name: fn}}."""
    g = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

    T, H, F_, V = (64, 128, 344, 1000) if small else (4096, 4096, 14336, 128256)
    B, S, NH, D = (2, 16, 4, 32) if small else (4, 1024, 32, 128)
    pos = torch.arange(S, device=device)
    inv = 1.0 / (500000.0 ** (torch.arange(0, D, 2, device=device).float() / D))
    ang = (pos[:, None].float() * inv).repeat(1, 2)[None].expand(B, S, D)
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    target = torch.randint(0, V, (T,), generator=g).to(device)
    out: dict[str, dict[str, Any]] = {
        "rms_norm": {
            "inputs": [rnd(T, H), 1 + rnd(H, scale=0.1)],
            "providers": {"eager": _rms_eager, "meshkit": lambda x, w: mk.rms_norm(x, w, 1e-6)},
        },
        "swiglu": {
            "inputs": [rnd(T, F_), rnd(T, F_)],
            "providers": {"eager": lambda a, b: F.silu(a) * b, "meshkit": mk.swiglu},
        },
        "rope": {  # (B, H, T, D) as HF passes them; meshkit takes the (B, T, H, D) view
            "inputs": [rnd(B, NH, S, D), rnd(B, NH // 4, S, D)],
            "providers": {
                "eager": lambda q, k: _rope_eager(q, k, cos, sin),
                "meshkit": lambda q, k: tuple(
                    t.transpose(1, 2) for t in mk.rope(q.transpose(1, 2), k.transpose(1, 2), pos, theta=500000.0)
                ),
            },
        },
        "flce": {
            "inputs": [rnd(T, H), rnd(V, H, scale=1 / math.sqrt(H))],
            "providers": {
                "eager": lambda h, w: F.cross_entropy((h @ w.t()).float(), target),
                "meshkit": lambda h, w: mk.fused_linear_cross_entropy(h, w, target),
            },
        },
    }
    for name, p in out.items():
        p["grad"] = list(range(len(p["inputs"])))
        lig = _liger(name) if device == "cuda" else None
        if lig is not None:
            if name == "rope":
                p["providers"]["liger"] = lambda q, k, f=lig: f(q, k, cos, sin)
            elif name == "flce":
                p["providers"]["liger"] = lambda h, w, f=lig: f(h, w, target)
            else:
                p["providers"]["liger"] = lig
    return out


# ------------------------------------------------------------------------------------------- measuring


def _outputs(fn, inputs):
    out = fn(*inputs)
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _timer(device: str):
    if device == "cuda":
        import triton.testing

        return lambda f: triton.testing.do_bench(f, warmup=25, rep=100, quantiles=[0.5])
    def cpu(f, reps=5):
        f()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            f()
            ts.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(ts)

    return cpu


def measure(name: str, prob: dict, provider: str, fn: Callable, device: str) -> dict[str, Any]:
    inputs = [x.detach().clone().requires_grad_() for x in prob["inputs"]]
    bench = _timer(device)
    outs = _outputs(fn, inputs)
    cots = [torch.randn_like(o) for o in outs]
    row: dict[str, Any] = {"kernel": name, "provider": provider}
    row["fwd_ms"] = bench(lambda: _outputs(fn, inputs))

    def full():
        o = _outputs(fn, inputs)
        torch.autograd.grad(o, inputs, [torch.ones_like(t) if t.dim() == 0 else c for t, c in zip(o, cots)])

    row["full_ms"] = bench(full)
    if name == "flce":  # fused losses form gradients in the forward and hand them over once: bwd = full - fwd
        row["bwd_ms"] = row["full_ms"] - row["fwd_ms"]
    else:
        row["bwd_ms"] = bench(lambda: torch.autograd.grad(outs, inputs, cots, retain_graph=True))
    if device == "cuda":
        del outs
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        full()
        torch.cuda.synchronize()
        row["full_peak_mb"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    return row


def bf16_check(name: str, prob: dict, fn: Callable, eager: Callable) -> tuple[float, float]:
    """(provider error, eager-bf16 error) vs fp32 eager, normwise over outputs and gradients."""

    def run(f, dtype):
        xs = [x.detach().to(dtype).requires_grad_() for x in prob["inputs"]]
        outs = _outputs(f, xs)
        gen = torch.Generator(device="cpu").manual_seed(1)
        loss = sum((o.float() * torch.randn(o.shape, generator=gen).to(o.device)).sum() for o in outs)
        return [o.detach().float() for o in outs] + [x.float() for x in torch.autograd.grad(loss, xs)]

    ref = run(eager, torch.float32)

    def err(vals):
        return max(((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item() for a, b in zip(vals, ref))

    return err(run(fn, torch.bfloat16)), err(run(eager, torch.bfloat16))


# ------------------------------------------------------------------------------- CPU memory benchmark


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _memory_child(kind: str, tokens: int, vocab: int, hidden: int) -> None:
    torch.manual_seed(0)
    h = torch.randn(tokens, hidden, requires_grad=True)
    w = (torch.randn(vocab, hidden) / math.sqrt(hidden)).requires_grad_()
    t = torch.randint(0, vocab, (tokens,))
    try:  # reset the high-water mark to now (Linux >= 4.0); else it includes start-up
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    base = _rss_kb("VmRSS")
    t0 = time.perf_counter()
    if kind == "flce":
        loss = mk.fused_linear_cross_entropy(h, w, t)
    else:
        loss = F.cross_entropy(h @ w.t(), t)
    loss.backward()
    seconds = time.perf_counter() - t0
    print(json.dumps({"kind": kind, "peak_mb": (_rss_kb("VmHWM") - base) / 1024, "seconds": seconds,
                      "loss": loss.item()}))  # fmt: skip


def cpu_memory_benchmark(tokens: int, vocab: int, hidden: int) -> dict[str, Any]:
    # glibc would keep freed chunk-sized blocks in its heap (RSS then measures fragmentation, not tensors):
    # a fixed mmap threshold returns every block >= 64 KiB to the OS on free, for both variants alike.
    env = {**os.environ, "MESHKIT_KERNELS": "reference", "TRITON_INTERPRET": "0", "OMP_NUM_THREADS": "1",
           "MALLOC_MMAP_THRESHOLD_": "65536"}  # fmt: skip
    res = {}
    for kind in ("baseline", "flce"):
        cmd = [sys.executable, os.path.abspath(__file__), "--memory-child", kind, "--tokens", str(tokens),
               "--vocab", str(vocab), "--hidden", str(hidden)]  # fmt: skip
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
        res[kind] = json.loads(out.stdout.strip().splitlines()[-1])
    logits_mb = tokens * vocab * 4 / 2**20
    ratio = res["flce"]["peak_mb"] / res["baseline"]["peak_mb"]
    return {"tokens": tokens, "vocab": vocab, "hidden": hidden, "logits_mb": logits_mb,
            "baseline_peak_mb": res["baseline"]["peak_mb"], "flce_peak_mb": res["flce"]["peak_mb"],
            "ratio": ratio, "loss_diff": abs(res["flce"]["loss"] - res["baseline"]["loss"]),
            "baseline_s": res["baseline"]["seconds"], "flce_s": res["flce"]["seconds"]}  # fmt: skip


# ---------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    ap.add_argument("--kernels", default="rms_norm,swiglu,rope,flce")
    ap.add_argument("--compile-on-cpu", action="store_true", help="include torch.compile in CPU smoke mode")
    ap.add_argument("--compile-backend", default="inductor",
                    help="torch.compile backend of the 'compile' provider ('eager': dynamo only, for dry runs)")
    ap.add_argument("--memory", action=argparse.BooleanOptionalAction, default=None,
                    help="run the CPU FLCE memory benchmark (default: on with --device cpu)")  # fmt: skip
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--hidden", type=int, default=2048, help="memory benchmark hidden size (TinyLlama: 2048)")
    ap.add_argument("--json", help="write all rows to this file")
    ap.add_argument("--memory-child", choices=["flce", "baseline"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.memory_child:
        _memory_child(args.memory_child, args.tokens, args.vocab, args.hidden)
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device; use --device cpu for the smoke mode")
    cpu = args.device == "cpu"
    if cpu:  # one thread: on a shared CPU, intra-op threads spin against other processes and swamp the timings
        torch.set_num_threads(1)
    dtype = torch.float32 if cpu else torch.bfloat16
    probs = problems(args.device, dtype, small=cpu)
    rows, checks, failed = [], [], False
    print(f"# meshkit kernels on {torch.cuda.get_device_name() if not cpu else 'CPU (smoke: torch reference path)'}"
          f", {dtype}\n")  # fmt: skip
    for name in [k for k in args.kernels.split(",") if k]:
        prob = probs[name]
        providers = dict(prob["providers"])
        if not cpu or args.compile_on_cpu:
            providers["compile"] = torch.compile(providers["eager"], backend=args.compile_backend)
        for pname, fn in providers.items():
            try:
                rows.append(measure(name, prob, pname, fn, args.device))
            except Exception as e:  # noqa: BLE001 - one broken provider must not stop the run
                rows.append({"kernel": name, "provider": pname, "error": f"{type(e).__name__}: {e}"[:200]})
        for pname in [p for p in ("meshkit", "liger") if p in providers]:
            e_p, e_eager = bf16_check(name, prob, providers[pname], providers["eager"])
            ok = e_p <= 2 * e_eager + 1e-3
            failed |= pname == "meshkit" and not ok
            checks.append({"kernel": name, "provider": pname, "bf16_err": e_p, "eager_bf16_err": e_eager, "ok": ok})
    cols = ["kernel", "provider", "fwd_ms", "bwd_ms", "full_ms"] + ([] if cpu else ["full_peak_mb"])
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        cells = [r.get(c) for c in cols]
        txt = [f"{c:.3f}" if isinstance(c, float) else str(c if c is not None else r.get("error", "")) for c in cells]
        print("| " + " | ".join(txt) + " |")
    print("\n| kernel | provider | bf16 rel. error vs fp32 | eager bf16 error | ok |\n|---|---|---|---|---|")
    for c in checks:
        print(f"| {c['kernel']} | {c['provider']} | {c['bf16_err']:.2e} | {c['eager_bf16_err']:.2e} | {c['ok']} |")
    mem = None
    if args.memory if args.memory is not None else cpu:
        mem = cpu_memory_benchmark(args.tokens, args.vocab, args.hidden)
        print(f"\nFLCE CPU peak memory, {mem['tokens']} tokens x vocab {mem['vocab']}, hidden {mem['hidden']}, fp32 "
              f"(logits alone {mem['logits_mb']:.0f} MiB): F.cross_entropy(h @ W.T) {mem['baseline_peak_mb']:.0f} MiB, "
              f"fused {mem['flce_peak_mb']:.0f} MiB, ratio {mem['ratio']:.3f} (target <= 0.3); "
              f"|loss diff| {mem['loss_diff']:.1e}; time {mem['baseline_s']:.1f}s vs {mem['flce_s']:.1f}s")  # fmt: skip
        failed |= mem["ratio"] > 0.3
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "dtype": str(dtype), "compile_backend": args.compile_backend,
                   "providers": sorted({r["provider"] for r in rows}), "rows": rows, "bf16": checks,
                   "memory": mem}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
