"""``meshkit demo``: a small Llama-style model trained on CPU gloo processes with ``strategy="hsdp_tp"``.

Lightning launches the processes (``devices`` of them on this machine), shows its progress bar,
and writes TensorBoard logs; the last lines printed are the ``tensorboard --logdir`` command and the tab
and tags to open (:func:`meshkit.profiling.report.where_to_look`).

Example::

    meshkit demo --devices 4 --steps 40
"""

from __future__ import annotations

import argparse
import os
from typing import Any

__all__ = ["run_demo", "configure_parser", "run_cli"]


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--devices", type=int, default=4, help="gloo processes on this machine (default 4)")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps (default 40)")
    parser.add_argument("--strategy", default="hsdp_tp", help="a meshkit preset (default hsdp_tp)")
    parser.add_argument("--logdir", default="meshkit_logs", help="TensorBoard root (default ./meshkit_logs)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default 128)")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per data-parallel rank (default 4)")


def run_demo(
    devices: int = 4,
    steps: int = 40,
    strategy: str = "hsdp_tp",
    logdir: str = "meshkit_logs",
    seq_len: int = 128,
    batch_size: int = 4,
) -> Any:
    """Train the demo model; returns the Trainer (on every rank)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # several processes share the cores
    import lightning as L
    import torch
    from lightning.pytorch.loggers import TensorBoardLogger

    import meshkit
    from meshkit.models import LlamaConfig, LlamaLM, TokenDataModule

    torch.set_num_threads(1)
    if strategy not in meshkit.PRESETS:
        raise ValueError(f"meshkit demo: `--strategy {strategy}` is not a preset; use one of {sorted(meshkit.PRESETS)}.")
    L.seed_everything(0, verbose=False)
    config = LlamaConfig(vocab_size=256, dim=128, n_layers=4, n_heads=8, n_kv_heads=4, max_seq_len=seq_len)
    # no hp_metric placeholder: TensorBoard's first screen then shows only what the run measured
    logger = TensorBoardLogger(logdir, name="demo", default_hp_metric=False)
    callbacks = _profiling_callbacks()
    # The data holds `steps` batches for every rank (enough when all ranks are data parallel); ranks of one
    # tp/cp/pp group share batches, so a rank's sampler sees more than `steps`. limit_train_batches makes the
    # epoch exactly `steps` batches on every preset, and the progress bar ends at steps/steps.
    # No Lightning model summary: its FLOPs column needs a forward of `example_input_array` on rank 0 alone, which
    # a sharded model cannot run (it showed "FLOPs 0"); the demo prints parameters and model FLOPs itself.
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, max_epochs=1, logger=logger,
        log_every_n_steps=1, enable_checkpointing=False, callbacks=callbacks, limit_val_batches=0,
        limit_train_batches=steps, enable_model_summary=False,
    )
    data = TokenDataModule(num_sequences=steps * batch_size * devices, seq_len=seq_len, batch_size=batch_size)
    module = LlamaLM(config, lr=3e-3)
    if trainer.is_global_zero:
        from meshkit.profiling.flops import model_flops_per_token

        params = sum(p.numel() for p in module.parameters())
        print(f"meshkit demo: Llama-style model, {params / 1e6:.2f} M parameters, "
              f"{model_flops_per_token(module.model, seq_len) / 1e6:.1f} MFLOPs per token trained "
              f"(6N + 12·L·H·Q·T, PaLM appendix B)")
    trainer.fit(module, data)
    if trainer.is_global_zero:
        print(f"\nmeshkit demo: {trainer.strategy.parallel_dims} trained {trainer.global_step} steps, "
              f"final loss {float(trainer.callback_metrics['train_loss']):.3f}")
        from meshkit.profiling.report import where_to_look

        print(where_to_look(os.path.abspath(logdir)))
    return trainer


def _profiling_callbacks() -> list[Any]:
    """MFU, HFU and the MFU breakdown every step; a torch.profiler window every 10 steps from step 5."""
    from meshkit.profiling.mfu import MFUMonitor

    # LlamaLM batches are (B, T+1) tokens: inputs and shifted labels, so B·T tokens are trained on.
    return [MFUMonitor(profile_every=10, profile_start=5, tokens_fn=lambda batch: batch[:, :-1].numel())]


def run_cli(args: argparse.Namespace) -> int:
    run_demo(args.devices, args.steps, args.strategy, args.logdir, args.seq_len, args.batch_size)
    return 0
