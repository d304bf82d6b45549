"""A small Llama-style transformer with torchtitan's module names.

Names follow torchtitan (``tok_embeddings``, ``layers.<i>.attention.wq``, ``feed_forward.w1``,
``norm``, ``output``) so meshkit's automatic TP plan, stage split and FLOP counter treat it like
any torchtitan-style model. Attention infers its local head count from the projected tensor
(``view(B, T, -1, head_dim)``) so it runs unchanged when ``wq`` is column-sharded by TP.

Example::

    >>> import torch
    >>> from meshkit.models import LlamaConfig, Transformer
    >>> model = Transformer(LlamaConfig.tiny())
    >>> model(torch.randint(0, 256, (2, 16))).shape
    torch.Size([2, 16, 256])
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from meshkit.kernels.rope import apply_rope, rope_cos_sin
from meshkit.loss import cross_entropy

__all__ = ["LlamaConfig", "Transformer", "LlamaLM", "TokenDataModule", "synthetic_tokens"]


@dataclass
class LlamaConfig:
    vocab_size: int = 256
    """Tokens in the vocabulary."""
    dim: int = 64
    """Hidden size."""
    n_layers: int = 4
    """Transformer blocks."""
    n_heads: int = 4
    """Attention (query) heads."""
    n_kv_heads: int | None = None
    """Key/value heads (grouped-query attention); None means ``n_heads``."""
    ffn_dim: int | None = None
    """SwiGLU hidden size; None means the Llama rule (8/3 · dim rounded up to a multiple of 32)."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    rope_theta: float = 10000.0
    """Rotary embedding base."""
    max_seq_len: int = 2048
    """Longest sequence the model is meant for (used by FLOP counting and the planner)."""

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.ffn_dim is None:
            self.ffn_dim = 32 * ((8 * self.dim // 3 + 31) // 32)
        if self.dim % self.n_heads:
            raise ValueError(f"LlamaConfig: `dim={self.dim}` must be divisible by `n_heads={self.n_heads}`.")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"LlamaConfig: `n_heads={self.n_heads}` must be divisible by `n_kv_heads={self.n_kv_heads}`."
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @classmethod
    def tiny(cls, **overrides: Any) -> "LlamaConfig":
        """The demo's and the tests' size: 4 layers, hidden 64, 4 heads (2 kv heads), vocab 256."""
        return cls(**{"vocab_size": 256, "dim": 64, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, **overrides})


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.n_rep = cfg.n_heads // cfg.n_kv_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def rotate(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary embedding of q, k (B, T, H, D); ``meshkit.integrations`` swaps the fused kernel in here."""
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        # -1: the local head count, which TP divides.
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)  # (B, T, nh, hd)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)  # (B, T, nkv, hd)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        q, k = self.rotate(q, k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hd)
        if self.n_rep > 1:
            k = k.repeat_interleave(self.n_rep, dim=1)
            v = v.repeat_interleave(self.n_rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        assert cfg.ffn_dim is not None
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Decoder-only Llama: embeddings, ``n_layers`` blocks in ``layers`` (a ModuleDict), norm, LM head."""

    fused_loss: bool = False
    """True on an instance whose forward was patched (``meshkit.integrations.apply_fused_kernels``) to
    accept ``labels=`` and return the fused loss; :class:`LlamaLM` reads it."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (B, T) -> logits (B, T, vocab). ``positions`` (T,) or (B, T) default to 0..T-1."""
        return self.output(self.final_hidden(tokens, positions))

    def final_hidden(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (B, T) -> normed hidden states (B, T, dim) before the LM head (the fused loss starts here).

        ``positions`` default to 0..T-1 of the tokens (not of the embeddings, which sequence
        parallelism shards).
        """
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.norm(self.forward_blocks(self.tok_embeddings(tokens), positions))  # (B, T, dim)

    def forward_blocks(self, h: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Run every block in ``layers`` on hidden states ``h`` (B, T, dim) -> (B, T, dim).

        The one block loop: :meth:`forward` (through :meth:`final_hidden`), the pipeline stage forward
        (on a stage holding some of the blocks) and the fused-loss root forward of
        :mod:`meshkit.integrations` all call it. ``positions`` (T,) or (B, T) default to 0..T-1 with
        T = ``h.shape[1]``; the rotary tables are built once for all blocks.
        """
        if positions is None:
            positions = torch.arange(h.shape[1], device=h.device)
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta)  # (..., T, head_dim)
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        return h


class LlamaLM(L.LightningModule):
    """Next-token prediction with :class:`Transformer`: the demo's and the tests' LightningModule.

    Batches are ``{"input_ids": (B, T), "labels": (B, T)}`` or a (B, T+1) token tensor.
    It has no ``configure_model``: meshkit's automatic path parallelizes it.
    """

    def __init__(
        self, config: LlamaConfig | None = None, lr: float = 3e-3, weight_decay: float = 0.0, optimizer: str = "adamw"
    ) -> None:
        super().__init__()
        if optimizer not in ("adamw", "sgd"):
            raise ValueError(f"LlamaLM: `optimizer={optimizer!r}` must be 'adamw' or 'sgd'.")
        self.config = config or LlamaConfig.tiny()
        self.save_hyperparameters(
            {"config": asdict(self.config), "lr": lr, "weight_decay": weight_decay, "optimizer": optimizer}
        )
        self.lr, self.weight_decay, self.optimizer_name = lr, weight_decay, optimizer
        self.model = Transformer(self.config)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)

    def _loss(self, batch: Any) -> torch.Tensor:
        if isinstance(batch, dict):
            inputs, labels = batch["input_ids"], batch["labels"]
        else:
            inputs, labels = batch[:, :-1], batch[:, 1:]
        if self.model.fused_loss:
            # meshkit.integrations patched the root: the fused loss never materializes the (tokens × vocab) logits.
            return self.model(inputs, labels=labels)
        # the mean over the valid targets of the whole sequences, also under cp (meshkit.loss)
        return cross_entropy(self(inputs), labels)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("val_loss", loss, sync_dist=True)
        return loss

    def test_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("test_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)


def synthetic_tokens(num_sequences: int, seq_len: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    """A learnable synthetic corpus: (num_sequences, seq_len + 1) tokens of noisy arithmetic progressions."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab_size, (num_sequences, 1), generator=g)
    step = torch.randint(1, 5, (num_sequences, 1), generator=g)
    seq = (start + step * torch.arange(seq_len + 1)) % vocab_size
    noise = torch.rand(seq.shape, generator=g) < 0.05
    return torch.where(noise, torch.randint(0, vocab_size, seq.shape, generator=g), seq)


class TokenDataModule(L.LightningDataModule):
    """Batches of :func:`synthetic_tokens`: (B, seq_len + 1) token tensors for :class:`LlamaLM`."""

    def __init__(
        self, num_sequences: int = 512, seq_len: int = 64, vocab_size: int = 256, batch_size: int = 4, seed: int = 0
    ) -> None:
        super().__init__()
        self.num_sequences, self.seq_len, self.vocab_size = num_sequences, seq_len, vocab_size
        self.batch_size, self.seed = batch_size, seed

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        data = synthetic_tokens(self.num_sequences, self.seq_len, self.vocab_size, self.seed)
        return torch.utils.data.DataLoader(data, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> torch.utils.data.DataLoader:
        data = synthetic_tokens(max(8, self.num_sequences // 8), self.seq_len, self.vocab_size, self.seed + 1)
        return torch.utils.data.DataLoader(data, batch_size=self.batch_size)
