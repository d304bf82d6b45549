"""hsdp_tp vs Lightning's ModelParallelStrategy with the same plan: step time, alternating, in one run.

Same transformers ``LlamaForCausalLM`` (random init), dims (dp_shard=2 × tp=2 on 4 gloo processes), batch,
data and optimizer (AdamW) for every provider:

- ``meshkit``        ``Trainer(strategy=NDParallelStrategy(dp_shard=2, tp=2))`` on a LightningModule with no
                     ``configure_model`` (meshkit's automatic plan)
- ``lightning_mp``   Lightning's ``ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2)`` with a
                     ``configure_model`` that applies the same plan by hand: colwise q/k/v/gate/up, rowwise
                     o/down, rowwise embedding, colwise LM head with replicated logits, ``fully_shard`` per
                     decoder layer, then the model as root with ``reshard_after_forward=False``
- ``torch``          (``--providers``) the same plan in a plain loop, no Lightning: the floor
- ``meshkit_group_per_axis`` (``--providers``, with ``--launcher lightning``) meshkit with its mesh built as
                     before issue 28's fix: one gloo group per mesh axis and flattened name (10), not per rank set (3)
- ``meshkit_singleton_own_device`` (``--providers``, with ``--launcher lightning``) meshkit with its one-rank
                     group (the size-1 axes) on its own gloo device, as before: an event loop and 2 workers more per rank

Rounds alternate the order (meshkit first in even rounds, last in odd ones) so drift and machine noise
hit both alike. A round's figure is the median step time of its measured steps (after ``--warmup``),
the slowest rank's; the ratio is taken per round (meshkit / lightning_mp of the same round) and reported
as median, min and max over rounds. Beside wall time, the CPU seconds of all four ranks per step (median)
and their ratio: on a shared machine the other load moves wall time far more than the work each provider
does. The same table is in docs/benchmarks.md.

    python benchmarks/strategy.py [--steps 25] [--rounds 6] [--providers meshkit,lightning_mp,meshkit_group_per_axis]
    python benchmarks/strategy.py --launcher pool --providers meshkit,lightning_mp,torch   # one pool, with the floor
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BATCH = 4
"""Sequences per dp rank per step."""


def _hf_config(dim: int, layers: int, seq: int) -> Any:
    import transformers as tf

    config = tf.LlamaConfig(
        vocab_size=1024, hidden_size=dim, intermediate_size=int(dim * 8 / 3) // 16 * 16, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=seq, tie_word_embeddings=False,
        pad_token_id=None, bos_token_id=None, eos_token_id=None,
    )
    config._attn_implementation = "sdpa"
    return config


def hand_parallelize(model: Any, tp: Any, dp: Any) -> None:
    """The plan meshkit infers for a transformers Llama, written by hand with torch APIs (``configure_model``)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    parallelize_module(model, tp, {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    })
    for block in model.model.layers:
        parallelize_module(block, tp, {
            "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel(),
        })
        fully_shard(block, mesh=dp)
    fully_shard(model, mesh=dp, reshard_after_forward=False)


def _modules(config: Any) -> tuple[type, type]:
    import lightning as L
    import torch
    import torch.nn.functional as F
    from transformers import LlamaForCausalLM

    class HFLlama(L.LightningModule):
        """A plain LightningModule: no configure_model (meshkit parallelizes it)."""

        def __init__(self) -> None:
            super().__init__()
            self.model = LlamaForCausalLM(config)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            logits = self.model(input_ids=batch[:, :-1]).logits
            return F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    class HandWritten(HFLlama):
        """The same module with the plan written by hand for ModelParallelStrategy."""

        def configure_model(self) -> None:
            if not getattr(self, "_done", False):
                mesh = self.device_mesh
                hand_parallelize(self.model, mesh["tensor_parallel"], mesh["data_parallel"])
                self._done = True

    return HFLlama, HandWritten


def _clocks() -> tuple[float, float]:
    """(wall, this process's CPU time over all its threads): CPU time is what the machine's other load disturbs least."""
    return time.perf_counter(), time.process_time()


def _step_timer() -> Any:
    import lightning as L

    class Timer(L.Callback):
        def __init__(self) -> None:
            self.starts: list[tuple[float, float]] = []

        def on_train_batch_start(self, *args: Any) -> None:
            self.starts.append(_clocks())

        def on_train_end(self, *args: Any) -> None:
            self.starts.append(_clocks())

    return Timer()


def run_provider(rank: int, world: int, provider: str, steps: int, warmup: int, dim: int, layers: int, seq: int,
                 profile: str | None = None) -> dict:
    """One fit of ``provider`` on this rank: its median step time (s) over steps after ``warmup``."""
    import lightning as L
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    import meshkit
    from meshkit.models import synthetic_tokens

    config = _hf_config(dim, layers, seq)
    data = synthetic_tokens(steps * BATCH * 2, seq, config.vocab_size)
    torch.manual_seed(0)
    profiler = None
    if profile is not None and rank == 0:
        import cProfile

        profiler = cProfile.Profile()
    if provider == "torch":
        from torch.distributed.device_mesh import init_device_mesh
        from transformers import LlamaForCausalLM

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
        model = LlamaForCausalLM(config)
        hand_parallelize(model, mesh["tp"], mesh["dp_shard"])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        mine = data[mesh["dp_shard"].get_local_rank()::2]
        starts = []
        if profiler is not None:
            profiler.enable()
        for s in range(steps):
            starts.append(_clocks())
            batch = mine[s * BATCH:(s + 1) * BATCH]
            logits = model(input_ids=batch[:, :-1]).logits
            loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
        starts.append(_clocks())
    else:
        plain, hand = _modules(config)
        if provider in ("meshkit", "meshkit_group_per_axis", "meshkit_singleton_own_device"):
            from meshkit.plugins import dims

            if provider == "meshkit_group_per_axis":  # the mesh as meshkit built it before: a group per axis
                dims._one_group_per_rank_set = contextlib.nullcontext
            if provider == "meshkit_singleton_own_device":  # the one-rank group's own device and threads, as before
                dims._singleton_groups_share_a_device = contextlib.nullcontext
            module: Any = plain()
            strategy: Any = meshkit.NDParallelStrategy(dp_shard=2, tp=2)
        elif provider == "lightning_mp":
            module = hand()
            strategy = L.pytorch.strategies.ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2)
        else:
            raise ValueError(f"benchmarks/strategy.py: unknown provider {provider!r}")
        timer = _step_timer()
        trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=steps, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            callbacks=[timer])
        if profiler is not None:
            profiler.enable()
        trainer.fit(module, DataLoader(data, batch_size=BATCH))
        starts = timer.starts
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(os.path.join(profile, f"{provider}.prof"))
    measured = list(zip(starts[warmup:-1], starts[warmup + 1:]))
    return {
        "step_s": statistics.median(b[0] - a[0] for a, b in measured),
        "cpu_s": statistics.median(b[1] - a[1] for a, b in measured),
        "threads": len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else None,
    }


def _launched(provider: str, args: argparse.Namespace) -> None:
    """``--worker``: one fit as a user runs it (Lightning's launcher starts ranks 1-3 from this command line);
    rank 0 prints every rank's figures on one ``RESULT`` line."""
    import torch.distributed as dist

    rank = int(os.environ.get("LOCAL_RANK", "0"))
    mine = run_provider(rank, 4, provider, args.steps, args.warmup, args.dim, args.layers, args.seq, args.profile)
    every: list[Any] = [None] * 4
    dist.all_gather_object(every, mine)
    if rank == 0:
        print("RESULT " + json.dumps(every), flush=True)


def _round_launched(provider: str, args: argparse.Namespace) -> list[dict]:
    import subprocess

    flags = ["--steps", args.steps, "--warmup", args.warmup, "--dim", args.dim, "--layers", args.layers,
             "--seq", args.seq] + (["--profile", args.profile] if args.profile else [])
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "LOCAL_RANK", "RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"  # as the pool's ranks: one intra-op thread per rank
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", provider, *map(str, flags)],
                          capture_output=True, text=True, timeout=900, env=env)
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"benchmarks/strategy.py: the {provider} fit failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--providers", default="meshkit,lightning_mp",
                        help="comma-separated, meshkit and lightning_mp first (their ratio is the figure)")
    parser.add_argument("--launcher", choices=("pool", "lightning"), default="lightning",
                        help="lightning (default): each fit is a fresh `python` whose Trainer starts its ranks with "
                             "Lightning's launcher, as a user runs it; pool: one 4-rank gloo pool runs every fit "
                             "(faster, but the fits share the processes' groups and threads, so per-process costs "
                             "such as idle gloo groups do not show)")
    parser.add_argument("--profile", default=None, help="a folder: cProfile rank 0 of each provider's last round")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        _launched(args.worker, args)
        return
    providers = args.providers.split(",")
    if args.launcher == "lightning" and "torch" in providers:
        parser.error("--launcher lightning runs Lightning strategies only; drop `torch` from --providers")
    for p in ("meshkit_group_per_axis", "meshkit_singleton_own_device"):
        if args.launcher == "pool" and p in providers:
            parser.error(f"{p} needs fresh processes per fit: use --launcher lightning")
    times: dict[str, list[float]] = {p: [] for p in providers}
    cpu: dict[str, list[float]] = {p: [] for p in providers}
    threads: dict[str, int] = {}
    with contextlib.ExitStack() as stack:
        pool = None
        if args.launcher == "pool":
            from tests.dist_pool import ProcessPool

            pool = stack.enter_context(ProcessPool(4, timeout=900))
        for r in range(args.rounds):
            order = providers if r % 2 == 0 else providers[::-1]
            for p in order:
                profile = args.profile if r == args.rounds - 1 else None
                if pool is not None:
                    res = pool.run(run_provider, p, args.steps, args.warmup, args.dim, args.layers, args.seq, profile)
                else:
                    res = _round_launched(p, argparse.Namespace(**{**vars(args), "profile": profile}))
                times[p].append(max(x["step_s"] for x in res))  # a step ends when the slowest rank's does
                cpu[p].append(sum(x["cpu_s"] for x in res))  # CPU seconds of all 4 ranks per step
                threads[p] = res[0]["threads"]
    def spread(xs: list[float]) -> dict[str, float]:
        return {"median": round(statistics.median(xs), 3), "min": round(min(xs), 3), "max": round(max(xs), 3)}

    def per_round(table: dict[str, list[float]], p: str) -> list[float]:
        return [a / b for a, b in zip(table[p], table["lightning_mp"])]  # the same round's pair

    others = [p for p in providers if p not in ("lightning_mp", "torch")]
    report = {
        "model": f"transformers LlamaForCausalLM dim={args.dim} layers={args.layers} seq={args.seq} "
                 f"batch={BATCH}/dp rank, AdamW",
        "dims": "dp_shard=2 x tp=2 (4 gloo processes)",
        "launcher": args.launcher,
        "steps": f"{args.steps} per fit, median of the last {args.steps - args.warmup}",
        "step_ms_median": {p: round(1e3 * statistics.median(v), 2) for p, v in times.items()},
        "cpu_ms_per_step_median": {p: round(1e3 * statistics.median(v), 2) for p, v in cpu.items()},
        **{f"ratio_{p}_vs_lightning_mp": spread(per_round(times, p)) for p in others},
        **{f"cpu_ratio_{p}_vs_lightning_mp": spread(per_round(cpu, p)) for p in others},
        "threads_rank0_after_fit": threads,
        "rounds_ms": {p: [round(1e3 * x, 2) for x in v] for p, v in times.items()},
        "rounds_cpu_ms": {p: [round(1e3 * x, 2) for x in v] for p, v in cpu.items()},
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
