"""Benchmark: how long the layout planner takes to enumerate, evaluate and rank every layout.

Target (issue 8): all layouts of 64 GPUs ranked in < 1 s. Also timed: one 8-GPU node (the baseline the
ratios are against), the 64-GPU search with the kernel-shape model off (``roofline_ridge=0``: what the
per-(cp, tp) efficiencies cost; they are computed once per pair, not per layout) and Llama-3-405B on
16,384 GPUs (the largest search the tests run).

    python benchmarks/planner.py [--repeat 5]

Exits 1 if the 64-GPU plan takes 1 s or more (best of ``--repeat`` runs).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from meshkit.planner import ModelSpec, plan  # noqa: E402

LLAMA3_70B = ModelSpec(layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256)
LLAMA3_405B = ModelSpec(layers=126, hidden=16384, heads=128, kv_heads=8, ffn=53248, vocab=128256)
CASES = {
    "70B on 1x8 (baseline)": (LLAMA3_70B, dict(seq_len=4096, global_batch=256, nodes=1, gpus_per_node=8)),
    "70B on 8x8 = 64 GPUs": (LLAMA3_70B, dict(seq_len=4096, global_batch=256, nodes=8, gpus_per_node=8)),
    "  same, kernel shapes off": (LLAMA3_70B, dict(seq_len=4096, global_batch=256, nodes=8, gpus_per_node=8,
                                                   roofline_ridge=0)),
    "405B on 2048x8 = 16,384 GPUs": (LLAMA3_405B, dict(seq_len=8192, global_batch=2048, nodes=2048, gpus_per_node=8)),
}


def _best_of(repeat: int, model: ModelSpec, kwargs: dict) -> tuple[float, int]:
    times, count = [], 0
    for _ in range(repeat):
        start = time.perf_counter()
        result = plan(model, gpu="h100-sxm", peak_tflops=989.4, **kwargs)
        times.append(time.perf_counter() - start)
        count = len(result.layouts)
    return min(times), count


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    rows = []
    for name, (model, kwargs) in CASES.items():
        seconds, count = _best_of(args.repeat if "16,384" not in name else max(1, args.repeat // 2), model, kwargs)
        rows.append((name, seconds, count))
    base = rows[0][1]
    print(f"{'case':<32} {'layouts':>8} {'best s':>9} {'µs/layout':>10} {'× baseline':>11}")
    for name, seconds, count in rows:
        print(f"{name:<32} {count:>8} {seconds:>9.4f} {1e6 * seconds / max(count, 1):>10.1f} {seconds / base:>11.1f}")
    t64 = rows[1][1]
    verdict = "PASS" if t64 < 1.0 else "FAIL"
    print(f"{verdict}: 64 GPUs ranked in {t64:.3f} s (target < 1 s)")
    return 0 if t64 < 1.0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
