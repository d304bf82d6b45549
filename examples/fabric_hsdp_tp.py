"""Train a transformers model with HSDP + tensor (or context) parallelism from a hand-written Lightning Fabric loop.

The same preset names as the Trainer work in ``L.Fabric(strategy=...)`` (``import meshkit`` registers them with
Fabric too). ``fabric.setup(model, optimizer)`` applies meshkit's ``parallelize()`` (the TP plan for the HF
projection names, FSDP2 over the rest) and re-points the optimizer at the sharded parameters; the loop below
is an ordinary Fabric loop: ``fabric.backward``, ``fabric.clip_gradients``, ``fabric.save`` / ``fabric.load``
(a sharded DCP folder: atomic, verified on load, resharded into any layout) and ``meshkit.FabricMFU``, which
writes the same TensorBoard tags as the Trainer's ``MFUMonitor``.

The loop is the same for every preset: ``fabric.strategy.shard_batch(batch)`` cuts each sequence over the cp
ranks under a context-parallel preset (``--preset hsdp_cp``: each rank holds T/cp tokens of every row, and
the model's attention runs over the whole sequence), and ``fabric.strategy.loss_mean(loss, batch)`` is the
loss to log (each cp rank's own loss is only its part); without cp both hand back their input.

Runs on CPU with 4 gloo processes that Fabric launches itself (``accelerator="cpu", devices=4``); on a GPU
node use ``accelerator="gpu", devices=8``. It trains, saves, loads the checkpoint into a fresh model and
optimizer, and trains on from there.

    python examples/fabric_hsdp_tp.py            # ~30 M params, a few minutes on CPU
    python examples/fabric_hsdp_tp.py --tiny     # tiny model, 2 + 2 steps (what CI runs)
    python examples/fabric_hsdp_tp.py --tiny --preset hsdp_cp   # the same loop, context parallel (cp=4)
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # 4 processes share the cores

import lightning as L
import torch
import transformers
from lightning.fabric.loggers import TensorBoardLogger

import meshkit  # registers strategy="hsdp_tp" (and the other presets) with Fabric and the Trainer


def model_config(tiny: bool) -> transformers.LlamaConfig:
    size = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2) if tiny else dict(
        hidden_size=512, intermediate_size=1408, num_hidden_layers=8)
    return transformers.LlamaConfig(vocab_size=512, num_attention_heads=8, num_key_value_heads=4,
                                    max_position_embeddings=128, tie_word_embeddings=False, **size)


def loader(sequences: int, seq_len: int, batch_size: int) -> torch.utils.data.DataLoader:
    # Random tokens as {"input_ids"} dicts (what an HF collator without labels yields); fabric.setup_dataloaders
    # adds a sampler over the data-parallel ranks (tp and cp peers share batches).
    tokens = torch.randint(0, 512, (sequences, seq_len), generator=torch.Generator().manual_seed(0))
    rows = [{"input_ids": row} for row in tokens]
    return torch.utils.data.DataLoader(rows, batch_size=batch_size, shuffle=True)


def build(fabric: L.Fabric, config: transformers.LlamaConfig) -> tuple:
    model = transformers.LlamaForCausalLM(config)  # random init, no download; the same on every rank (seeded)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return fabric.setup(model, optimizer)  # parallelize(): TP plan -> FSDP2, and the optimizer re-pointed


def train(fabric: L.Fabric, model, optimizer, data, steps: int, mfu: meshkit.FabricMFU) -> float:
    loss = torch.tensor(float("nan"))
    for _, batch in zip(range(steps), data):
        batch = fabric.strategy.shard_batch(batch)  # cp: this rank's T/cp tokens of every row; else the batch
        with mfu.step(batch):  # the batch the model sees (MFUMonitor multiplies a cp shard's tokens by cp)
            ids = batch["input_ids"]
            loss = model(input_ids=ids, labels=ids).loss  # labels shifted over the whole sequence, not the shard
            fabric.backward(loss)
            fabric.clip_gradients(model, optimizer, max_norm=1.0)  # the norm over every mesh axis
            mfu.before_optimizer_step()
            optimizer.step()
            optimizer.zero_grad()
        loss = fabric.strategy.loss_mean(loss, batch)  # cp: the mean over dp × cp ranks (one all-reduce)
    return loss.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny model, 2 + 2 steps (CI)")
    parser.add_argument("--root", default="fabric_hsdp_tp_logs", help="logs and checkpoint folder")
    parser.add_argument("--preset", default="hsdp_tp", choices=("hsdp_tp", "hsdp_cp", "hsdp_tp_cp"),
                        help="a meshkit preset name (the pipeline presets need the Trainer)")
    args = parser.parse_args()
    sequences, seq_len, batch_size, steps = (16, 16, 2, 2) if args.tiny else (640, 128, 4, 40)
    fabric = L.Fabric(strategy=args.preset, accelerator="cpu", devices=4, loggers=TensorBoardLogger(args.root))
    fabric.launch()
    fabric.seed_everything(0)
    config = model_config(args.tiny)
    data = fabric.setup_dataloaders(loader(sequences, seq_len, batch_size))
    ckpt = os.path.join(args.root, "checkpoint")  # a folder: one DCP shard per rank and meshkit.json

    model, optimizer = build(fabric, config)
    mfu = meshkit.FabricMFU(fabric, model, max_steps=2 * steps, log_every=1, profile_every=0)
    first = train(fabric, model, optimizer, data, steps, mfu)
    fabric.save(ckpt, {"model": model, "optimizer": optimizer, "step": steps})

    # Resume: a fresh model and optimizer; fabric.load restores the weights, the AdamW state and the step.
    model, optimizer = build(fabric, config)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    fabric.load(ckpt, state)
    last = train(fabric, model, optimizer, data, steps, mfu)
    mfu.close()
    if fabric.is_global_zero:
        print(f"fabric {args.preset} example: {fabric.strategy.parallel_dims}; trained {steps} steps (loss {first:.3f}), "
              f"saved {ckpt}, resumed at step {state['step']}, trained to step {state['step'] + steps} "
              f"(loss {last:.3f}); MFU {100 * mfu.last.mfu:.3f} % ({mfu.monitor.peak_source})")


if __name__ == "__main__":
    main()
