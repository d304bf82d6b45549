"""Small reference models: the demo's Llama-style transformer and its LightningModule."""

from meshkit.models.llama import LlamaConfig, LlamaLM, Transformer, synthetic_tokens

__all__ = ["LlamaConfig", "LlamaLM", "Transformer", "synthetic_tokens"]
