"""Sequence parallelism on an unmodified transformers model: hsdp_tp with ``sequence_parallel=True``.

Between the tensor-parallel blocks (attention, MLP) each of the tp ranks keeps only its T/tp rows of the
residual stream and of every norm's input: the activations tensor parallelism alone would hold whole on each
rank. The LightningModule is the hsdp_tp example's, imported unchanged; the only change is the strategy's ``sequence_parallel=True``.
The script trains a few steps with SP off, then on, and prints how many rows of each sequence a decoder
layer's norm saw on rank 0. The memory this saves is measured by benchmarks/sequence_parallel_memory.py
(table in docs/models.md).

Runs on CPU with 4 gloo processes that Lightning launches itself (dp_shard=2 x tp=2); on a GPU node use
``accelerator="gpu", devices=8``.

    python examples/sequence_parallel_transformers.py            # hidden 256, sequences of 512, ~1 min on CPU
    python examples/sequence_parallel_transformers.py --tiny     # tiny model (what CI runs)
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # 4 processes share the cores

import lightning as L
import torch
import transformers
from hsdp_tp_transformers import CausalLM  # the same ordinary LightningModule (examples/ is the script's sys.path[0])

import meshkit


class RowsSeen(L.Callback):
    """Records how many rows (sequence positions) each decoder layer's input norm sees on this rank."""

    def __init__(self) -> None:
        self.rows: set[int] = set()

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        for name, m in module.named_modules():
            if name.endswith("input_layernorm"):
                m.register_forward_pre_hook(self._record)

    def _record(self, _: torch.nn.Module, args: tuple) -> None:
        x = args[0]
        self.rows.add((x.to_local() if hasattr(x, "to_local") else x).shape[1])  # (B, T or T/tp, hidden)


def model_config(tiny: bool) -> transformers.LlamaConfig:
    size = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2) if tiny else dict(
        hidden_size=256, intermediate_size=688, num_hidden_layers=4)
    return transformers.LlamaConfig(vocab_size=512, num_attention_heads=8, num_key_value_heads=4,
                                    max_position_embeddings=512, tie_word_embeddings=False, **size)


def run(sequence_parallel: bool, tiny: bool, root: str) -> tuple[L.Trainer, RowsSeen]:
    seq_len, steps = (32, 2) if tiny else (512, 4)  # the sequence length must divide by tp
    tokens = torch.randint(0, 512, (4 * steps, seq_len), generator=torch.Generator().manual_seed(0))
    recorder = RowsSeen()
    trainer = L.Trainer(
        strategy=meshkit.NDParallelStrategy(dp_shard=2, tp=2, sequence_parallel=sequence_parallel),
        accelerator="cpu", devices=4, max_steps=steps, default_root_dir=root, callbacks=[recorder],
        enable_checkpointing=False, enable_model_summary=False, logger=False, enable_progress_bar=False,
    )
    L.seed_everything(0, verbose=False)
    trainer.fit(CausalLM(model_config(tiny)), torch.utils.data.DataLoader(tokens, batch_size=2))
    return trainer, recorder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny model (CI)")
    parser.add_argument("--root", default="sp_logs", help="Lightning's folder (default ./sp_logs)")
    args = parser.parse_args()
    results = {sp: run(sp, args.tiny, args.root) for sp in (False, True)}
    trainer, _ = results[True]
    if trainer.is_global_zero:
        (_, off), (_, on) = results[False], results[True]
        print(f"sequence_parallel example: {trainer.strategy.parallel_dims}; rows a decoder-layer norm saw per "
              f"sequence on rank 0: {sorted(off.rows)} without SP, {sorted(on.rows)} with SP; final loss "
              f"{float(trainer.callback_metrics['train_loss']):.3f}")


if __name__ == "__main__":
    main()
