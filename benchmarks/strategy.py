"""hsdp_tp vs the same FSDP2+TP written by hand: step time and per-rank parameter+optimizer memory.

Three providers, same model, dims (dp_shard=2 × tp=2), batch and optimizer (AdamW), in one run on 4
gloo processes, interleaved round by round so machine noise hits all three alike:

- ``meshkit``        Trainer(strategy=NDParallelStrategy(dp_shard=2, tp=2)) on an unmodified LightningModule
- ``torch``          a plain training loop: ``parallelize_module`` with a hand-written plan, ``fully_shard``
                     per block and root, no Lightning (the floor)
- ``lightning_mp``   Lightning's ModelParallelStrategy with a hand-written ``configure_model`` doing the same

Step time is the median over the measured steps of each round, then the median over rounds. Memory is
the bytes each rank holds for parameters, gradients and AdamW state (fp32), against 16·Ψ/(dp_shard·tp).

    python benchmarks/strategy.py [--steps 30] [--rounds 3] [--dim 256] [--seq 128]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WARMUP = 5


def _config(dim: int, seq: int) -> Any:
    from meshkit.models import LlamaConfig

    return LlamaConfig(vocab_size=1024, dim=dim, n_layers=4, n_heads=8, n_kv_heads=4, max_seq_len=seq)


def _hand_parallelize(model: Any, mesh: Any) -> None:
    """FSDP2 + TP written by hand with torch APIs (what a user would write in configure_model)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp, dp = mesh["tp"], mesh["dp_shard"]
    parallelize_module(model, tp, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
        "output": ColwiseParallel(output_layouts=Replicate()),
    })
    for block in model.layers.values():
        parallelize_module(block, tp, {
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(), "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(),
        })
        fully_shard(block, mesh=dp)
    fully_shard(model, mesh=dp, reshard_after_forward=False)


def _state_bytes(params: list, optimizer: Any) -> int:
    from torch.distributed.tensor import DTensor

    def local(t: Any) -> Any:
        return t.to_local() if isinstance(t, DTensor) else t

    total = sum(local(p).numel() * local(p).element_size() for p in params)
    total += sum(local(p.grad).numel() * local(p.grad).element_size() for p in params if p.grad is not None)
    for state in optimizer.state.values():
        total += sum(local(v).numel() * local(v).element_size() for v in state.values() if hasattr(v, "numel")
                     and local(v).dim() > 0)
    return total


def _step_timer() -> Any:
    import lightning as L

    class Timer(L.Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []
            self.bytes = 0

        def on_train_batch_start(self, *args: Any) -> None:
            self.starts.append(time.perf_counter())

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            self.starts.append(time.perf_counter())
            self.bytes = _state_bytes(list(pl_module.parameters()), trainer.optimizers[0])

    return Timer()


def _run(rank: int, world: int, provider: str, steps: int, dim: int, seq: int) -> dict:
    import lightning as L
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    import meshkit
    from meshkit.models import LlamaLM, Transformer, synthetic_tokens

    os.environ["LOCAL_RANK"], os.environ["NODE_RANK"] = str(rank), "0"
    cfg = _config(dim, seq)
    data = synthetic_tokens(steps * 4 * 2, seq, cfg.vocab_size)
    torch.manual_seed(0)
    if provider == "torch":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
        model = Transformer(cfg)
        _hand_parallelize(model, mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        mine = data[mesh["dp_shard"].get_local_rank()::2]
        starts = []
        for s in range(steps):
            starts.append(time.perf_counter())
            batch = mine[s * 4:(s + 1) * 4]
            loss = F.cross_entropy(model(batch[:, :-1]).flatten(0, 1).float(), batch[:, 1:].flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
        starts.append(time.perf_counter())
        nbytes = _state_bytes(list(model.parameters()), opt)
        numel = sum(p.numel() for p in model.parameters())
    else:
        if provider == "meshkit":
            module: Any = LlamaLM(cfg, lr=1e-3)
            strategy: Any = meshkit.NDParallelStrategy(dp_shard=2, tp=2)
        else:
            class HandWritten(LlamaLM):
                def configure_model(self) -> None:
                    if not getattr(self, "_done", False):
                        mesh = self.device_mesh
                        _hand_parallelize(self.model, {"tp": mesh["tensor_parallel"],
                                                       "dp_shard": mesh["data_parallel"]})
                        self._done = True

            module = HandWritten(cfg, lr=1e-3)
            strategy = L.pytorch.strategies.ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2)
        timer = _step_timer()
        trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=steps, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            callbacks=[timer])
        trainer.fit(module, DataLoader(data, batch_size=4))
        starts, nbytes = timer.starts, timer.bytes
        numel = sum(p.numel() for p in module.parameters())
    step_times = [b - a for a, b in zip(starts[WARMUP:-1], starts[WARMUP + 1:])]
    return {"step_s": statistics.median(step_times), "bytes": nbytes, "numel": numel}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args()
    from tests.dist_pool import ProcessPool

    providers = ["meshkit", "torch", "lightning_mp"]
    times: dict[str, list[float]] = {p: [] for p in providers}
    memory: dict[str, int] = {}
    numel = 0
    with ProcessPool(4, timeout=900) as pool:
        for _ in range(args.rounds):
            for p in providers:
                res = pool.run(_run, p, args.steps, args.dim, args.seq)
                times[p].append(max(r["step_s"] for r in res))  # a step ends when the slowest rank does
                memory[p] = max(r["bytes"] for r in res)
                numel = res[0]["numel"]
    ideal = 16 * numel / 4  # 16 bytes per parameter (fp32 param + grad + Adam m, v) / (dp_shard * tp)
    med = {p: statistics.median(v) for p, v in times.items()}
    report = {
        "dims": "dp_shard=2 x tp=2 (4 gloo processes)", "params": numel,
        "step_ms": {p: round(1e3 * v, 2) for p, v in med.items()},
        "ratio_meshkit_vs_torch": round(med["meshkit"] / med["torch"], 3),
        "ratio_meshkit_vs_lightning_mp": round(med["meshkit"] / med["lightning_mp"], 3),
        "state_bytes_per_rank": memory, "ideal_16psi_over_dp_tp": int(ideal),
        "memory_ratio_vs_ideal": {p: round(b / ideal, 3) for p, b in memory.items()},
        "rounds": {p: [round(1e3 * x, 2) for x in v] for p, v in times.items()},
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
