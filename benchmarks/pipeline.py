"""Balanced CPU pipeline under every torch schedule: step time, measured idle per rank, theory.

    python benchmarks/pipeline.py                 # p=4, m in (8, 16), all schedules
    python benchmarks/pipeline.py --schedules gpipe 1f1b --microbatches 8 --steps 3

Spawns ``--pp`` gloo processes (one thread each). The model is the same stack of ``--layers`` identical MLP blocks for every schedule
(torchtitan-style names; embedding and head are identity-cost Linear layers counted in stage 0 and
the last stage), split evenly with explicit split points so every stage costs the same. Each
schedule runs ``--warmup`` + ``--steps`` steps with the pipeline timeline on
(``pp_timeline_rank{R}.jsonl``); for each measured step and rank, idle = 1 - (union of that rank's
action intervals) / (the step's span over all ranks). Theory: (p-1)/(m+p-1) for gpipe and 1f1b,
(p-1)/(v·m+p-1) for multi-stage schedules (an upper bound for the zero-bubble ones).
On a machine with fewer cores than ``--pp`` the ranks time-share cores and idle is understated:
say so when quoting figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshkit.plugins.pipeline import SCHEDULES, build_pipeline, pipeline_step, read_timeline, theoretical_bubble  # noqa: E402


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(torch.nn.functional.gelu(self.w1(x)))


class BalancedStack(nn.Module):
    """torchtitan-style: the forward skips pieces set to None, so stages run it unchanged."""

    def __init__(self, d: int, n_layers: int) -> None:
        super().__init__()
        self.tok_embeddings = nn.Linear(d, d, bias=False)
        self.layers = nn.ModuleDict({str(i): Block(d) for i in range(n_layers)})
        self.norm = nn.LayerNorm(d)
        self.output = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for layer in self.layers.values():
            h = layer(h)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out, target)


def idle_fractions(events: list[dict], pp: int, skip_steps: int) -> list[float]:
    """Per rank, mean over steps >= skip_steps of 1 - busy/span (busy: union of action intervals)."""
    out = []
    steps = sorted({e["step"] for e in events if e["step"] >= skip_steps})
    for r in range(pp):
        fr = []
        for s in steps:
            step_ev = [e for e in events if e["step"] == s]
            span = max(e["end_ns"] for e in step_ev) - min(e["start_ns"] for e in step_ev)
            iv = sorted((e["start_ns"], e["end_ns"]) for e in step_ev if e["rank"] == r)
            busy, cur_s, cur_e = 0, None, None
            for a, b in iv:
                if cur_e is None or a > cur_e:
                    busy += 0 if cur_e is None else cur_e - cur_s
                    cur_s, cur_e = a, b
                else:
                    cur_e = max(cur_e, b)
            busy += 0 if cur_e is None else cur_e - cur_s
            fr.append(1 - busy / span if span else 0.0)
        out.append(statistics.mean(fr) if fr else float("nan"))
    return out


def _worker(rank: int, pp: int, init_file: str, args: argparse.Namespace, results: dict) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=pp,
                            timeout=__import__("datetime").timedelta(seconds=120))
    group = dist.new_group(list(range(pp)))
    for schedule in args.schedules:
        v = 2 if SCHEDULES[schedule].multi_stage else 1
        n_layers = args.layers  # the same model for every schedule: pp·v equal stages
        if n_layers % (pp * v):
            raise ValueError(f"--layers={n_layers} must be a multiple of pp·v = {pp * v} for equal stages.")
        per_stage = n_layers // (pp * v)
        for m in args.microbatches:
            torch.manual_seed(0)
            model = BalancedStack(args.dim, n_layers)
            batch = m * args.mb_rows
            tdir = tempfile.mkdtemp() if rank == 0 else None
            holder = [tdir]
            dist.broadcast_object_list(holder, src=0)
            pipe = build_pipeline(
                model, group, schedule=schedule, batch_size=batch, microbatches=m, virtual_stages=v if v > 1 else None,
                split_points=list(range(per_stage, n_layers, per_stage)), loss_fn=_mse, timeline_dir=holder[0],
            )
            opt = torch.optim.SGD(pipe.parameters(), lr=1e-3)
            x, y = torch.randn(batch, args.dim), torch.randn(batch, args.dim)
            times = []
            for i in range(args.warmup + args.steps):
                dist.barrier(group=group)
                t0 = time.perf_counter()
                pipeline_step(pipe, x, y)
                opt.step()
                opt.zero_grad()
                times.append(time.perf_counter() - t0)
            dist.barrier(group=group)
            if rank == 0:
                idle = idle_fractions(read_timeline(holder[0]), pp, args.warmup)
                results[(schedule, m)] = {
                    "schedule": schedule, "pp": pp, "v": v, "microbatches": m,
                    "step_ms": 1e3 * statistics.median(times[args.warmup:]),
                    "idle_per_rank": [round(f, 3) for f in idle],
                    "idle_mean": statistics.mean(idle),
                    "theory": theoretical_bubble(schedule, pp, m, v),
                }
                r = results[(schedule, m)]
                print(f"{schedule:24s} m={m:3d} v={v}  step {r['step_ms']:8.1f} ms  idle/rank {r['idle_per_rank']}"
                      f"  mean {r['idle_mean']:.3f}  theory {r['theory']:.3f}", flush=True)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--microbatches", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--schedules", nargs="+", default=list(SCHEDULES))
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=16, help="identical blocks (a multiple of pp·v)")
    ap.add_argument("--mb-rows", type=int, default=32, help="rows per micro-batch")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args(argv)
    with mp.Manager() as manager:
        results = manager.dict()
        init_file = tempfile.mktemp()
        mp.spawn(_worker, args=(args.pp, init_file, args, results), nprocs=args.pp, join=True)
        rows = list(results.values())
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
