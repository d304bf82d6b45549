"""Shared bodies for the strategy tests: a Lightning fit on a gloo pool and its one-process reference."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F

VOCAB, SEQ, PER_RANK_BATCH = 256, 16, 2


def tokens(num_sequences: int) -> torch.Tensor:
    from meshkit.models.llama import synthetic_tokens

    return synthetic_tokens(num_sequences, SEQ, VOCAB, seed=1)


def build_module(kind: str = "meshkit", seed: int = 0, lr: float = 0.5) -> Any:
    """SGD, not Adam: Adam's update ignores the gradient's scale, so it would hide a gradient counted twice."""
    from meshkit.models.llama import LlamaConfig, LlamaLM

    torch.manual_seed(seed)
    if kind == "meshkit":
        return LlamaLM(LlamaConfig.tiny(vocab_size=VOCAB), lr=lr, optimizer="sgd")
    if kind == "meshkit1":  # one block: under TRITON_INTERPRET every Triton program of the fused kernels runs in Python
        return LlamaLM(LlamaConfig.tiny(vocab_size=VOCAB, n_layers=1), lr=lr, optimizer="sgd")
    if kind == "mha":  # 4 kv heads, so tp=4 divides them
        return LlamaLM(LlamaConfig.tiny(vocab_size=VOCAB, n_kv_heads=4), lr=lr, optimizer="sgd")
    if kind == "hf":
        return HFLlamaLM(lr=lr)
    raise ValueError(kind)


def hf_config() -> Any:
    from transformers import LlamaConfig as HFConfig

    return HFConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attn_implementation="sdpa", tie_word_embeddings=False,
    )


def _lightning_base() -> type:
    import lightning as L

    return L.LightningModule


class HFLlamaLM(_lightning_base()):  # type: ignore[misc]
    """A plain LightningModule around transformers' LlamaForCausalLM: no configure_model."""

    def __init__(self, lr: float = 0.5) -> None:
        super().__init__()
        from transformers import LlamaForCausalLM

        self.lr = lr
        self.model = LlamaForCausalLM(hf_config())

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self.model(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def module_loss(module: Any, batch: torch.Tensor) -> torch.Tensor:
    if isinstance(module, HFLlamaLM):
        logits = module.model(input_ids=batch[:, :-1]).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
    return module._loss(batch)


def step_batches(num_samples: int, dp: int, steps: int, per_rank: int = PER_RANK_BATCH) -> list[torch.Tensor]:
    """Sample indices of each step's global batch, as Lightning's DistributedSampler(shuffle=True, seed=0) deals them."""
    perm = torch.randperm(num_samples, generator=torch.Generator().manual_seed(0)).tolist()
    per_rank_idx = [perm[r::dp] for r in range(dp)]
    return [
        torch.tensor([i for r in range(dp) for i in per_rank_idx[r][s * per_rank:(s + 1) * per_rank]])
        for s in range(steps)
    ]


def reference(
    kind: str, steps: int, dp: int, *, clip: float | None = None, accumulate: int = 1, world: int = 4,
    clip_value: float | None = None,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same model, data and optimizer in one process, fed each step's global batch.

    Returns the loss of every micro-batch and the final parameters.
    """
    module = build_module(kind)
    opt = module.configure_optimizers()
    data = tokens(steps * accumulate * PER_RANK_BATCH * world)
    batches = step_batches(len(data), dp, steps * accumulate)
    losses = []
    for s in range(steps):
        opt.zero_grad()
        for m in range(accumulate):
            loss = module_loss(module, data[batches[s * accumulate + m]])
            (loss / accumulate).backward()
            losses.append(loss.item())
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
        if clip_value is not None:
            torch.nn.utils.clip_grad_value_(module.parameters(), clip_value)
        opt.step()
    return losses, {n: p.detach().clone() for n, p in module.named_parameters()}


def _full(named: Any) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {n: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone() for n, t in named}


def full_params(module: Any) -> dict[str, torch.Tensor]:
    """Every parameter as a full tensor (a collective for DTensors: call on every rank)."""
    return _full(module.named_parameters())


def full_buffers(module: Any) -> dict[str, torch.Tensor]:
    """Every buffer as a full tensor, each name of a shared one (a collective for DTensors: call on every rank)."""
    return _full(module.named_buffers(remove_duplicate=False))


def assert_params_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rtol: float = 1e-4) -> None:
    assert got.keys() == want.keys(), set(got) ^ set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=rtol, atol=1e-5, msg=lambda m: f"{name}: {m}")


class LossRecorder:
    def __new__(cls) -> Any:  # a Lightning Callback built lazily (Lightning imported in workers only)
        import lightning as L

        class _Recorder(L.Callback):
            def __init__(self) -> None:
                self.losses: list[float] = []

                self.grad_none_at_0: bool | None = None

            def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
                self.losses.append(float(outputs["loss"]))
                if idx == 0:  # with accumulation this is before the first optimizer step
                    self.grad_none_at_0 = all(p.grad is None for p in pl_module.parameters())

        return _Recorder()


def launcher_env(rank: int, devices: int) -> None:
    """What torchrun would set for a job of ``devices`` processes per node."""
    os.environ["LOCAL_RANK"] = str(rank % devices)
    os.environ["NODE_RANK"] = str(rank // devices)


def fit(
    rank: int,
    world: int,
    strategy: Any,
    *,
    devices: int,
    num_nodes: int = 1,
    steps: int = 10,
    kind: str = "meshkit",
    precision: str = "32-true",
    **trainer_kwargs: Any,
) -> dict[str, Any]:
    """Fit ``steps`` steps; return this rank's losses, its dp coordinate and parameter placements."""
    import lightning as L
    from torch.distributed.tensor import DTensor
    from torch.utils.data import DataLoader

    import meshkit  # noqa: F401  (registers the presets)
    from meshkit.integrations.common import MARK
    from meshkit.kernels._backend import use_triton

    launcher_env(rank, devices)
    module = build_module(kind)
    recorder = LossRecorder()
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, num_nodes=num_nodes, strategy=strategy, max_steps=steps,
        precision=precision, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[recorder], **trainer_kwargs,
    )
    data = tokens(steps * trainer_kwargs.get("accumulate_grad_batches", 1) * PER_RANK_BATCH * world)
    trainer.fit(module, DataLoader(data, batch_size=PER_RANK_BATCH))
    st = trainer.strategy
    dims = st.parallel_dims
    dp = dims.submesh("dp")
    placements = {
        name: (tuple(p.device_mesh.mesh_dim_names), tuple(str(x) for x in p.placements))
        for name, p in module.named_parameters()
        if isinstance(p, DTensor)
    }
    return {
        "losses": recorder.losses,
        "dp_rank": dp.get_local_rank(),
        "dp_size": dp.size(),
        "degrees": dims.degrees,
        "placements": placements,
        "non_dtensor": [n for n, p in module.named_parameters() if not isinstance(p, DTensor)],
        "params": full_params(module),
        "grad_none_after_first_microstep": recorder.grad_none_at_0,
        "triton": use_triton(torch.empty(0)),  # what a fused module's kernel call on CPU runs
        "fused": sorted(getattr(m, MARK) for m in module.modules() if isinstance(getattr(m, MARK, None), str)),
    }


def global_losses(results: list[dict[str, Any]]) -> list[float]:
    """Mean over dp ranks of each step's loss (tp/cp ranks in one dp group agree; checked)."""
    by_dp: dict[int, list[float]] = {}
    for r in results:
        seen = by_dp.setdefault(r["dp_rank"], r["losses"])
        assert torch.allclose(torch.tensor(seen), torch.tensor(r["losses"]), rtol=1e-6), "ranks of one dp group differ"
    per_dp = torch.tensor(list(by_dp.values()))
    return per_dp.mean(0).tolist()


def _configure_model_base() -> type:
    from meshkit.models.llama import LlamaLM

    return LlamaLM


class ConfigureModelLM(_configure_model_base()):  # type: ignore[misc]
    """Builds its network on meta in ``configure_model`` and shards it itself over ``self.device_mesh``."""

    def __init__(self) -> None:
        from meshkit.models.llama import LlamaConfig

        super().__init__(LlamaConfig.tiny(vocab_size=VOCAB), lr=0.5, optimizer="sgd")
        self.model = None  # type: ignore[assignment]
        self.configured_with: tuple[str, ...] | None = None

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        from meshkit.models.llama import Transformer

        if self.model is not None:
            return
        with torch.device("meta"):
            self.model = Transformer(self.config)
        mesh = self.device_mesh
        self.configured_with = tuple(mesh.mesh_dim_names)
        for block in self.model.layers.values():
            fully_shard(block, mesh=mesh["dp_shard"])
        fully_shard(self.model, mesh=mesh["dp_shard"])
