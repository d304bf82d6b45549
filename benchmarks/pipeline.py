"""Balanced pipeline under every torch schedule: step time, measured bubble, the simulator, theory.

    python benchmarks/pipeline.py                 # p=4, m in (8, 16), all schedules, CPU compute
    python benchmarks/pipeline.py --schedules 1f1b --microbatches 8 --device-ms 20   # emulated device

Spawns ``--pp`` gloo processes (one thread each). The model is the same stack of ``--layers``
identical MLP blocks for every schedule (torchtitan-style names; embedding and head are cheap
Linear layers in stage 0 and the last stage), split evenly with explicit split points so every
stage costs the same. Each schedule runs ``--warmup`` + ``--steps`` steps with the pipeline
timeline on (``pp_timeline_rank{R}.jsonl``) and reports, over the measured steps:

- **measured**: :func:`meshkit.profiling.bubble.measured_bubble` (idle ÷ span × ranks);
- **simulated**: :func:`meshkit.profiling.bubble.simulate_from_timeline`, the schedule replayed
  with the measured mean F/B/I/W time of each stage and no communication; **simulated+hops**
  the same with every P2P hop costing the measured median hop (:func:`hop_latency_ns`);
- **theory**: :func:`meshkit.schedules.theoretical_bubble` (F = I = W): (p-1)/(m+p-1) for gpipe and
  1f1b, (p-1)/(v·m+p-1) for interleaved_1f1b and looped_bfs, (p-1)/(3·v·m+p-1) for the zero-bubble schedules.

``--device-ms T`` emulates an accelerator: every block's forward also spends T ms, and its
backward 2T ms, "on the device" (the host sleeps, as it does in ``cuda.synchronize``), so p ranks
measure the pipeline and not a CPU they share. Without it the blocks compute on the CPU; on a
machine with fewer cores than ``--pp`` the ranks then time-share cores and the measured idle
reflects the scheduler: say so when quoting those figures.
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

from meshkit.plugins.pipeline import SCHEDULES, build_pipeline, pipeline_step  # noqa: E402
from meshkit.profiling.bubble import hop_latency_ns, measured_bubble, read_timeline, simulate_from_timeline  # noqa: E402
from meshkit.schedules import theoretical_bubble  # noqa: E402


class DeviceTime(torch.autograd.Function):
    """Identity that holds the host for ``ms`` in forward and ``2·ms`` in backward: an emulated kernel."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, ms: float) -> torch.Tensor:  # type: ignore[override]
        ctx.ms = ms
        time.sleep(ms / 1e3)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        time.sleep(2 * ctx.ms / 1e3)
        return grad, None


class Block(nn.Module):
    def __init__(self, d: int, device_ms: float = 0.0) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.device_ms = device_ms

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.w2(torch.nn.functional.gelu(self.w1(x)))
        return DeviceTime.apply(h, self.device_ms) if self.device_ms else h


class BalancedStack(nn.Module):
    """torchtitan-style: the forward skips pieces set to None, so stages run it unchanged."""

    def __init__(self, d: int, n_layers: int, device_ms: float = 0.0) -> None:
        super().__init__()
        self.tok_embeddings = nn.Linear(d, d, bias=False)
        self.layers = nn.ModuleDict({str(i): Block(d, device_ms) for i in range(n_layers)})
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
            model = BalancedStack(args.dim, n_layers, args.device_ms)
            batch = m * args.mb_rows
            tdir = tempfile.mkdtemp(prefix="pp_timeline_") if rank == 0 else None
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
                records = read_timeline(holder[0])
                measured = measured_bubble(records, skip_steps=args.warmup)
                simulated = simulate_from_timeline(records, skip_steps=args.warmup)
                hop = hop_latency_ns(records, skip_steps=args.warmup)
                with_hops = simulate_from_timeline(records, skip_steps=args.warmup, comm=hop)
                results[(schedule, m)] = {
                    "schedule": schedule, "pp": pp, "v": v, "microbatches": m, "device_ms": args.device_ms,
                    "step_ms": 1e3 * statistics.median(times[args.warmup:]),
                    "idle_per_rank": [round(measured.per_rank[r].bubble_fraction, 3) for r in sorted(measured.per_rank)],
                    "measured": measured.bubble_fraction,
                    "simulated": simulated.bubble_fraction,
                    "hop_ms": hop / 1e6,
                    "simulated_with_hops": with_hops.bubble_fraction,
                    "theory": theoretical_bubble(schedule, pp, m, v),
                }
                r = results[(schedule, m)]
                print(f"{schedule:24s} m={m:3d} v={v}  step {r['step_ms']:8.1f} ms  idle/rank {r['idle_per_rank']}"
                      f"  measured {r['measured']:.3f}  simulated {r['simulated']:.3f}"
                      f" (diff {100 * (r['measured'] - r['simulated']):+.1f} pts)  hop {r['hop_ms']:.2f} ms"
                      f"  simulated+hops {r['simulated_with_hops']:.3f}  theory {r['theory']:.3f}", flush=True)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--microbatches", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--schedules", nargs="+", default=list(SCHEDULES))
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=16, help="identical blocks (a multiple of pp·v)")
    ap.add_argument("--mb-rows", type=int, default=32, help="rows per micro-batch")
    ap.add_argument("--device-ms", type=float, default=0.0,
                    help="emulated device time per block forward (backward 2x); 0 computes on the CPU")
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
