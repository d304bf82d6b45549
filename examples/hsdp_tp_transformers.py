"""Train an existing LightningModule around a transformers model with HSDP + tensor parallelism.

The LightningModule below is the kind you already have: it wraps an unmodified
``transformers.LlamaForCausalLM``, has no ``configure_model`` and knows nothing about meshkit.
The only change for N-D parallel training is ``strategy="hsdp_tp"`` on the Trainer (and ``import meshkit``,
which registers the name with Lightning). meshkit finds the HF projection names, plans tensor
parallelism inside a node, shards the rest with FSDP2 and saves sharded (DCP) checkpoints.

Runs on CPU with 4 gloo processes that Lightning launches itself (``accelerator="cpu", devices=4``);
on a GPU node use ``accelerator="gpu", devices=8``. It trains, saves a checkpoint, then a second
Trainer resumes from it and trains a second epoch.

    python examples/hsdp_tp_transformers.py            # 24 M params, 2 x 40 steps, ~5 min on 2 busy cores
    python examples/hsdp_tp_transformers.py --tiny     # tiny model, 2 steps an epoch (what CI runs)
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # 4 processes share the cores

import lightning as L
import torch
import transformers

import meshkit  # noqa: F401  registers strategy="hsdp_tp" (and the other presets) with Lightning
from meshkit.models import synthetic_tokens


class CausalLM(L.LightningModule):
    """An ordinary LightningModule: a transformers model, its loss, an optimizer. Nothing meshkit-specific."""

    def __init__(self, config: transformers.LlamaConfig, lr: float = 1e-3) -> None:
        super().__init__()
        self.model = transformers.LlamaForCausalLM(config)  # random init, no download
        self.lr = lr
        self.first_loss: float | None = None

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss  # HF shifts the labels itself
        self.log("train_loss", loss, prog_bar=True)
        if self.first_loss is None:
            self.first_loss = float(loss.detach())  # float() of a tensor that requires grad warns (torch 2.13)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def model_config(tiny: bool) -> transformers.LlamaConfig:
    size = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2) if tiny else dict(
        hidden_size=512, intermediate_size=1408, num_hidden_layers=8)
    return transformers.LlamaConfig(
        vocab_size=512, num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=128, **size,
        # Tied, as Llama-3.2-1B/3B ship: under tensor parallelism the embedding and the LM head stay one parameter
        # (tests/distributed/test_model_matrix.py checks llama_tied against one process).
        tie_word_embeddings=True,
    )


def loader(sequences: int, seq_len: int, batch_size: int) -> torch.utils.data.DataLoader:
    # A tiny learnable corpus (noisy arithmetic progressions of token ids), so the loss curve means something:
    # random tokens would stay at ln(512) = 6.24. Lightning adds a sampler over the data-parallel ranks (here
    # dp_shard=2: the two ranks of a tp group read the same batches), so an epoch is
    # sequences / (2 * batch_size) steps.
    tokens = synthetic_tokens(sequences, seq_len - 1, 512)  # (sequences, seq_len)
    return torch.utils.data.DataLoader(tokens, batch_size=batch_size)


def trainer(max_epochs: int, root: str) -> L.Trainer:
    return L.Trainer(
        strategy="hsdp_tp",  # <- the one argument added to an existing Trainer
        accelerator="cpu", devices=4, max_epochs=max_epochs,
        default_root_dir=root, enable_checkpointing=False, enable_model_summary=False, log_every_n_steps=1,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny model, 2 steps an epoch (CI)")
    parser.add_argument("--root", default="hsdp_tp_logs", help="logs and checkpoint folder (default ./hsdp_tp_logs)")
    args = parser.parse_args()
    sequences, seq_len, batch_size = (8, 16, 2) if args.tiny else (320, 128, 4)
    L.seed_everything(0, verbose=False)
    config = model_config(args.tiny)
    ckpt = os.path.join(args.root, "checkpoint")  # a folder: one DCP shard per rank

    first = trainer(1, args.root)
    module = CausalLM(config)
    first.fit(module, loader(sequences, seq_len, batch_size))
    # at the end of epoch 0; weights_only=False: a full, resumable checkpoint (optimizer, loops), said explicitly
    # (without it Lightning logs "`weights_only` was not set, defaulting to `False`"; loading stays safe: meshkit
    # reads DCP shards and never unpickles arbitrary objects)
    first.save_checkpoint(ckpt, weights_only=False)

    # Resume: a new Trainer and a fresh module; ckpt_path restores weights, optimizer state, epoch and step.
    second = trainer(2, args.root)
    second.fit(CausalLM(config), loader(sequences, seq_len, batch_size), ckpt_path=ckpt)
    if second.is_global_zero:
        print(f"hsdp_tp example: {second.strategy.parallel_dims}; trained {first.global_step} steps, saved "
              f"{ckpt}, resumed to step {second.global_step}, "
              f"loss {module.first_loss:.3f} at the first step -> "
              f"{float(second.callback_metrics['train_loss']):.3f} at the last")


if __name__ == "__main__":
    main()
