"""Small reference models: the demo's Llama-style transformer and its LightningModule."""

from meshkit.models.llama import LlamaConfig, LlamaLM, TokenDataModule, Transformer, synthetic_tokens

__all__ = ["LlamaConfig", "LlamaLM", "TokenDataModule", "Transformer", "synthetic_tokens"]
