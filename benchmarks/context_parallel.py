"""Context-parallel attention on CPU (gloo): step time, bytes sent per rank, saved activation memory per rank.

For each variant (ring, allgather, ulysses) and cp in {1, 2, 4}, ``cp`` processes run forward + backward of
causal attention over a sequence of ``--seq`` tokens (load-balanced layout) and report, per rank:

- step time (forward + backward, median of ``--iters``; on a shared 2-core machine cp ranks compete
  for the cores, so compare variants at the same cp rather than across cp);
- bytes sent, counted at the call sites (isend payloads; collectives by the ring algorithm's
  (cp-1)/cp share of the gathered / scattered / exchanged tensor), next to the closed-form formula;
- attention activation memory: bytes the attention call saves for backward (saved-tensor hooks,
  distinct storages), as a ratio to the same variant at cp=1 (target at cp=4: <= 0.3) and to plain
  full-sequence SDPA (the named baseline).

    python benchmarks/context_parallel.py --seq 8192 --heads 4 --kv-heads 2 --head-dim 16
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from meshkit.plugins.context_parallel import (  # noqa: E402
    CP_ATTENTIONS,
    check_cp_heads,
    context_parallel_attention,
    shard_sequence,
)

# torch 2.13 names the tensor collectives *_single; older torch has only the *_tensor names. Wrap whichever exist.
_GATHERS = [n for n in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, n)]
_SCATTERS = [n for n in ("reduce_scatter_single", "reduce_scatter_tensor") if hasattr(dist, n)]


def formula_bytes(variant: str, cp: int, b: int, h: int, hkv: int, t: int, d: int, elem: int) -> float:
    """Bytes one rank sends for one attention forward + backward (fp32/fp64: accumulators share the dtype)."""
    if cp == 1:
        return 0.0
    kv = 2 * b * hkv * (t // cp) * d * elem  # local K and V
    if variant == "ring":  # fwd: cp-1 K/V hops; bwd: cp-1 K/V hops + cp dK/dV accumulator hops
        return (cp - 1) * kv + (cp - 1) * kv + cp * kv
    if variant == "allgather":  # fwd all-gather; bwd all-gather again + reduce-scatter of dK/dV
        return 3 * (cp - 1) * kv
    q = b * h * (t // cp) * d * elem
    kv_rep = 2 * b * max(hkv, cp) * (t // cp) * d * elem  # kv heads replicated up to cp when fewer
    # fwd: all-to-all of q, k, v and of the output back; bwd: the same four, reversed
    return 2 * (cp - 1) / cp * (q + kv_rep + q)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _share(group) -> float:
    """The (n-1)/n share of a collective's full tensor each rank sends under the ring algorithm."""
    n = dist.get_world_size(group)
    return (n - 1) / n


class _Counter:
    """Counts bytes a rank sends, by wrapping the torch.distributed entry points the cp attention calls."""

    def __init__(self) -> None:
        self.sent = 0.0
        self._wrap("batch_isend_irecv", lambda ops: sum(_nbytes(op.tensor) for op in ops if op.op is dist.isend))
        for name in _GATHERS:  # counted on the gathered output
            self._wrap(name, lambda out, inp, *a, group=None, **kw: _share(group) * _nbytes(out))
        for name in (*_SCATTERS, "all_to_all_single"):  # counted on the input
            self._wrap(name, lambda out, inp, *a, group=None, **kw: _share(group) * _nbytes(inp))

    def _wrap(self, name: str, count) -> None:
        orig = getattr(dist, name)

        def wrapped(*args, **kwargs):
            self.sent += count(*args, **kwargs)
            return orig(*args, **kwargs)

        setattr(dist, name, wrapped)


def _saved_bytes(fn) -> tuple[torch.Tensor, int]:
    """Run ``fn()`` recording the distinct storages autograd saves for backward; (output, bytes)."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(storages.values())


def _worker(rank: int, cp: int, port: int, args: argparse.Namespace, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=cp, timeout=timedelta(seconds=600))
    counter = _Counter()
    group = dist.group.WORLD
    g = torch.Generator().manual_seed(0)
    b, t, d = 1, args.seq, args.head_dim
    q = torch.randn(b, args.heads, t, d, generator=g)
    k, v = (torch.randn(b, args.kv_heads, t, d, generator=g) for _ in range(2))
    local = [shard_sequence(x, rank, cp, dim=2) for x in (q, k, v)]
    rows = []
    h, hkv = args.heads, args.kv_heads
    try:
        check_cp_heads(h, hkv, None, cp, "ulysses")
        ulysses_fits = True
    except ValueError:
        ulysses_fits = False
    variants = [name for name in args.variants if name != "ulysses" or ulysses_fits]
    for variant in variants:
        times, sent, saved = [], 0.0, 0
        for it in range(args.iters + 1):  # the first is a warm-up
            xs = [x.detach().requires_grad_() for x in local]
            dist.barrier()
            counter.sent = 0.0
            t0 = time.perf_counter()
            out, saved = _saved_bytes(lambda: context_parallel_attention(*xs, group, causal=True, attention=variant))
            out.sum().backward()
            if it:
                times.append(time.perf_counter() - t0)
            sent = counter.sent
        rows.append(
            {
                "variant": variant, "cp": cp, "rank": rank, "step_s": statistics.median(times), "sent_bytes": sent,
                "formula_bytes": formula_bytes(variant, cp, b, args.heads, args.kv_heads, t, d, 4), "saved_bytes": saved,
            }
        )  # fmt: skip
    if rank == 0 and cp == 1:  # the named baseline: full-sequence SDPA on one rank
        xs = [x.detach().requires_grad_() for x in (q, k, v)]
        t0 = time.perf_counter()
        out, saved = _saved_bytes(lambda: F.scaled_dot_product_attention(*xs, is_causal=True, enable_gqa=True))
        out.sum().backward()
        rows.append({"variant": "sdpa", "cp": 1, "rank": 0, "step_s": time.perf_counter() - t0, "sent_bytes": 0.0,
                     "formula_bytes": 0.0, "saved_bytes": saved})  # fmt: skip
    results.put(rows)
    dist.destroy_process_group()


def run(args: argparse.Namespace) -> list[dict]:
    ctx = mp.get_context("spawn")
    rows: list[dict] = []
    for cp in args.cps:
        results = ctx.Queue()
        with socket.socket() as s:  # a free port for this world
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = [ctx.Process(target=_worker, args=(r, cp, port, args, results)) for r in range(cp)]
        for p in procs:
            p.start()
        for _ in range(cp):
            rows.extend(results.get(timeout=1800))
        for p in procs:
            p.join(timeout=60)
    return rows


def report(rows: list[dict], seq: int) -> str:
    """A markdown table: per variant and cp, the worst rank's figures and the memory ratios."""
    base = {r["variant"]: r["saved_bytes"] for r in rows if r["cp"] == 1}
    sdpa = base.get("sdpa")
    lines = [
        f"seq={seq}: attention fwd+bwd per rank (max over ranks)",
        "| variant | cp | step s | sent MiB | formula MiB | saved MiB | vs cp=1 | vs sdpa |",
        "|---|---|---|---|---|---|---|---|",
    ]
    keys = sorted({(r["variant"], r["cp"]) for r in rows}, key=lambda k: (k[0] == "sdpa", k[0], k[1]))
    for variant, cp in keys:
        rs = [r for r in rows if r["variant"] == variant and r["cp"] == cp]
        step, sent = max(r["step_s"] for r in rs), max(r["sent_bytes"] for r in rs)
        saved, form = max(r["saved_bytes"] for r in rs), rs[0]["formula_bytes"]
        ratio = saved / base[variant] if base.get(variant) else float("nan")
        vs = saved / sdpa if sdpa else float("nan")
        mib = 2**20
        figures = f"{step:.3f} | {sent / mib:.2f} | {form / mib:.2f} | {saved / mib:.2f} | {ratio:.3f} | {vs:.3f}"
        lines.append(f"| {variant} | {cp} | {figures} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=16)
    p.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--variants", nargs="+", default=list(CP_ATTENTIONS), choices=CP_ATTENTIONS)
    p.add_argument("--iters", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args(argv)
    rows = run(args)
    print(report(rows, args.seq))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
