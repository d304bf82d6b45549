"""Where did my MFU go? MFUMonitor on a run whose DataLoader is deliberately slow.

The collate function sleeps, as a loader that decodes or tokenizes on the main process would, so every
step waits for data. MFUMonitor splits each step's wall time into compute, recompute, exposed
communication, pipeline bubble, data wait, optimizer and other (percentages of the step that sum to 100)
and logs them to TensorBoard; this script then reads the logged data-wait percentage back from the event
file and says which tab and tag to open.

    python examples/mfu_breakdown.py                   # 60 steps, 50 ms of sleep per batch
    python examples/mfu_breakdown.py --tiny            # 8 steps (what CI runs)
    tensorboard --logdir mfu_logs                      # then open the tab it prints
"""

from __future__ import annotations

import argparse
import glob
import os
import time

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import meshkit
from meshkit.models import LlamaConfig, LlamaLM
from meshkit.profiling.report import breakdown_tag, where_to_look

DATA_WAIT_TAG = breakdown_tag("data_wait")  # "MFU_breakdown_pct/data_wait": percent of the step time


def slow_collate(sleep_s: float):
    """Stack (T+1,) token rows into a (B, T+1) batch, after `sleep_s` of pretend preprocessing."""

    def collate(rows: list[torch.Tensor]) -> torch.Tensor:
        time.sleep(sleep_s)  # the deliberate bottleneck: the breakdown shows it as data_wait
        return torch.stack(rows)

    return collate


def read_scalar(log_dir: str, tag: str) -> list[float]:
    """Every value logged under `tag` in the run's TensorBoard event files."""
    values = []
    for path in sorted(glob.glob(os.path.join(log_dir, "events.out.tfevents.*"))):
        events = EventAccumulator(path, size_guidance={"scalars": 0})
        events.Reload()
        if tag in events.Tags()["scalars"]:
            values += [e.value for e in events.Scalars(tag)]
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="8 steps (CI)")
    parser.add_argument("--sleep", type=float, default=0.05, help="seconds collate sleeps per batch (default 0.05)")
    parser.add_argument("--logdir", default="mfu_logs", help="TensorBoard root (default ./mfu_logs)")
    args = parser.parse_args()
    steps = 8 if args.tiny else 60
    L.seed_everything(0, verbose=False)
    torch.set_num_threads(1)

    config = LlamaConfig.tiny() if args.tiny else LlamaConfig(vocab_size=256, dim=128, n_layers=4, n_heads=8,
                                                               n_kv_heads=4, max_seq_len=128)
    seq_len = 32 if args.tiny else 128
    tokens = torch.randint(0, config.vocab_size, (steps * 4, seq_len + 1))  # LlamaLM batches: (B, T+1)
    loader = torch.utils.data.DataLoader(list(tokens), batch_size=4, collate_fn=slow_collate(args.sleep))

    monitor = meshkit.MFUMonitor(
        tokens_fn=lambda batch: batch[:, :-1].numel(),  # tokens trained on per batch
        profile_every=0 if args.tiny else 20, profile_start=5,  # a torch.profiler window every 20 steps
    )
    # no hp_metric placeholder: TensorBoard's first screen then shows only what the run measured
    logger = TensorBoardLogger(args.logdir, name="mfu", default_hp_metric=False)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, max_epochs=1, logger=logger,
                        callbacks=[monitor], log_every_n_steps=1, enable_checkpointing=False,
                        enable_model_summary=False)
    # two validation batches (no sleep) at the epoch's end: LlamaLM has a validation_step, and without a loader
    # Lightning says so ("You defined a `validation_step` but have no `val_dataloader`"); the breakdown counts it
    # in its `validation` part
    val_loader = torch.utils.data.DataLoader(list(tokens[:8]), batch_size=4)
    trainer.fit(LlamaLM(config), loader, val_loader)

    data_wait = read_scalar(trainer.log_dir, DATA_WAIT_TAG)
    if not data_wait:
        raise SystemExit(f"mfu_breakdown: no `{DATA_WAIT_TAG}` scalars under {trainer.log_dir}")
    mean = sum(data_wait) / len(data_wait)
    print(f"\nmfu_breakdown: data_wait was {mean:.1f}% of the step time on average over {len(data_wait)} logged "
          f"steps ({DATA_WAIT_TAG}, mean of the logged percentages).")
    print(where_to_look(os.path.abspath(args.logdir)))

if __name__ == "__main__":
    main()
