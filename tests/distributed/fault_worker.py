"""One rank of a fault-injection job, a process of its own (torchrun's environment), started as below: forked by
tests.distributed.jobs's fork server, which runs this module as ``__main__`` as ``python -m`` would.

    python -m tests.distributed.fault_worker save   CKPT_DIR PHASE KILL_RANK   # 4 steps, last.ckpt at 2 and 4; SIGKILL at PHASE of the 2nd last.ckpt save
    python -m tests.distributed.fault_worker resume CKPT_PATH OUT_DIR [LAYERS [unverified]] # restore CKPT_PATH, no training; write params + step
    python -m tests.distributed.fault_worker resume_each CKPT OUT [CKPT OUT ...] # resume each in turn, one job
    python -m tests.distributed.fault_worker freeze STOP_RANK                  # dp_shard=2 x tp=2, timeout=20 s; STOP_RANK SIGSTOPs itself
    python -m tests.distributed.fault_worker mismatch                          # Trainer(devices=2) under a bigger launch
    python -m tests.distributed.fault_worker launcher PID_DIR rank0_dies|rendezvous|child_freezes   # Lightning's own launcher

Every process writes ``OUT_DIR/rank{r}.pt`` (resume) or touches ``CKPT_DIR/killed`` before it kills itself.
"""

from __future__ import annotations

import os
import signal
import sys
from datetime import timedelta
from pathlib import Path

import torch

from tests.distributed import training as T


def _trainer(strategy, **kwargs):
    import lightning as L

    world = int(os.environ["WORLD_SIZE"])
    return L.Trainer(accelerator="cpu", devices=world, strategy=strategy, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, **kwargs)


def _data(steps: int, world: int):
    from torch.utils.data import DataLoader

    return DataLoader(T.tokens(steps * T.PER_RANK_BATCH * world), batch_size=T.PER_RANK_BATCH)


def save(ckpt_dir: str, phase: str, kill_rank: str) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    import meshkit
    from meshkit.plugins.checkpoint import sharded

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    seen: list[str] = []

    def hook(name: str, path: Path) -> None:
        if path.name == "last.ckpt" and name == "partial_created":
            seen.append(name)
        if len(seen) == 2 and name == phase and rank == int(kill_rank):
            Path(ckpt_dir, "killed").touch()
            os.kill(os.getpid(), signal.SIGKILL)

    sharded._fault_hook = hook
    ckpt = ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1, every_n_train_steps=2, save_last=True)
    strategy = meshkit.NDParallelStrategy(dp_shard=world, tp=1, timeout=timedelta(seconds=30))
    trainer = _trainer(strategy, max_steps=4, callbacks=[ckpt])
    trainer.fit(T.build_module("mha"), _data(4, world))


def resume(ckpt_path: str, out_dir: str, layers: str = "4", verify: str = "verified") -> None:
    """Restore ``ckpt_path`` into a fresh module (another seed) without training; write params + step or the error.
    ``verify="unverified"``: the strategy's ``allow_unverified=True`` (a folder without its manifest)."""
    import meshkit
    from meshkit.models.llama import LlamaConfig, LlamaLM

    world = int(os.environ["WORLD_SIZE"])
    torch.manual_seed(123)  # another init: everything must come from the checkpoint
    module = LlamaLM(LlamaConfig.tiny(vocab_size=T.VOCAB, n_kv_heads=4, n_layers=int(layers)), lr=0.5, optimizer="sgd")
    strategy = meshkit.NDParallelStrategy(dp_shard=world, tp=1, timeout=timedelta(seconds=30),
                                          allow_unverified=verify == "unverified")
    trainer = _trainer(strategy, max_steps=2, enable_checkpointing=False)
    try:
        trainer.fit(module, _data(2, world), ckpt_path=ckpt_path)
    except Exception as e:  # noqa: BLE001 - the test reads what each rank saw
        torch.save({"error": f"{type(e).__name__}: {e}"}, Path(out_dir, f"rank{os.environ['RANK']}.pt"))
        raise
    params = T.full_params(module)
    torch.save({"params": params, "global_step": trainer.global_step}, Path(out_dir, f"rank{os.environ['RANK']}.pt"))


def resume_each(*pairs: str) -> None:
    """``resume`` for each ``CKPT_PATH OUT_DIR`` pair in turn, in this one job (a fresh module and Trainer each)."""
    launch_env = dict(os.environ)
    for ckpt_path, out_dir in zip(pairs[::2], pairs[1::2]):
        os.environ.update(launch_env)  # Lightning's teardown deletes WORLD_SIZE: each restore starts as launched
        resume(ckpt_path, out_dir)


def freeze(stop_rank: str) -> None:
    import lightning as L

    import meshkit

    rank = int(os.environ["RANK"])

    class Stop(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, idx):
            if idx == 2 and rank == int(stop_rank):
                print("frozen", flush=True)
                os.kill(os.getpid(), signal.SIGSTOP)

    strategy = meshkit.NDParallelStrategy(dp_shard=2, tp=2, timeout=timedelta(seconds=20))
    trainer = _trainer(strategy, max_steps=1000, enable_checkpointing=False, callbacks=[Stop()])
    trainer.fit(T.build_module("mha"), _data(1000, 2))


def mismatch() -> None:
    """The launcher started WORLD_SIZE processes; the Trainer says devices=2."""
    import lightning as L

    import meshkit

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=meshkit.NDParallelStrategy(dp_shard=2, tp=1),
                        max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(T.build_module("mha"), _data(1, 2))


def launcher(pid_dir: str, what: str) -> None:
    """Lightning's own launcher (no torchrun environment): ``rank0_dies``, ``rendezvous`` (num_nodes=2, one node) or
    ``child_freezes`` (rank 1, rank 0's child, SIGSTOPs itself; timeout=10 s)."""
    import lightning as L

    import meshkit

    class Pids(L.Callback):
        def setup(self, trainer, pl_module, stage):
            Path(pid_dir, f"rank{trainer.global_rank}").write_text(str(os.getpid()))

        def on_train_batch_start(self, trainer, pl_module, batch, idx):
            if idx == 2 and trainer.global_rank == 0 and what == "rank0_dies":
                Path(pid_dir, "rank0_killed").touch()
                os.kill(os.getpid(), signal.SIGKILL)
            if idx == 2 and trainer.global_rank == 1 and what == "child_freezes":
                Path(pid_dir, "rank1_frozen").touch()
                os.kill(os.getpid(), signal.SIGSTOP)

    nodes = 2 if what == "rendezvous" else 1
    timeout = timedelta(seconds=10) if what in ("rendezvous", "child_freezes") else timedelta(minutes=30)
    trainer = L.Trainer(accelerator="cpu", devices=2, num_nodes=nodes, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, max_steps=1000, callbacks=[Pids()],
                        strategy=meshkit.NDParallelStrategy(dp_replicate=1, dp_shard=2 * nodes, tp=1, timeout=timeout))
    trainer.fit(T.build_module("mha"), _data(1000, 2))


if __name__ == "__main__":
    torch.set_num_threads(1)
    {"save": save, "resume": resume, "resume_each": resume_each, "freeze": freeze, "mismatch": mismatch, "launcher": launcher}[sys.argv[1]](*sys.argv[2:])
