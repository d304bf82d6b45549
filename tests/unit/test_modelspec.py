"""One model-shape reader: HF configs and models built locally, torchtitan-style args, meshkit's Llama;
and the five places that used to read models on their own now agree."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from meshkit.modelspec import TransformerShape, find_config, llama_ffn, read_shape


@dataclass
class TitanArgs:
    """torchtitan's Llama ModelArgs fields (no ffn_dim: the FFN size comes from multiple_of)."""

    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = 8
    vocab_size: int = 128256
    multiple_of: int = 1024
    ffn_dim_multiplier: float | None = 1.3
    norm_eps: float = 1e-5
    rope_theta: float = 500000
    max_seq_len: int = 8192


def _key(s: TransformerShape) -> tuple:
    return s.layers, s.hidden, s.heads, s.kv_heads, s.head_dim, s.ffn, s.vocab


def test_torchtitan_args_everywhere():
    from meshkit.planner import ModelSpec
    from meshkit.plugins.tensor_parallel import tp_widths
    from meshkit.profiling.flops import model_shape

    args = TitanArgs()
    assert _key(read_shape(args)) == (32, 4096, 32, 8, 128, 14336, 128256) and read_shape(args).max_seq_len == 8192
    assert llama_ffn(4096, 1024, 1.3) == 14336
    # ModelSpec.from_config used to raise AttributeError: 'TitanArgs' object has no attribute 'ffn_dim'
    spec = ModelSpec.from_config(args)
    assert (spec.layers, spec.hidden, spec.heads, spec.kv_heads, spec.ffn, spec.vocab) == (
        32, 4096, 32, 8, 14336, 128256)
    assert spec.total_params == 8_030_261_248  # the published Llama-3-8B count
    assert model_shape(args).n_layers == 32
    holder = torch.nn.Module()
    holder.model_args = args
    assert tp_widths(holder) == (32, 8, 4096)
    assert find_config(SimpleNamespace(args=args)) is args


def test_meshkit_config_model_and_lightning_module():
    from meshkit.models import LlamaConfig, LlamaLM, Transformer

    cfg = LlamaConfig.tiny(max_seq_len=64)
    by_config = read_shape(cfg)
    assert _key(by_config) == (4, 64, 4, 2, 16, 192, 256) and by_config.params is None
    for obj in (Transformer(cfg), LlamaLM(cfg)):
        s = read_shape(obj)
        assert _key(s) == _key(by_config) and s.max_seq_len == 64
        assert s.params == sum(p.numel() for p in obj.parameters()) and s.embedding_params == 256 * 64
        assert not s.tied_embeddings and s.qk_norm is None and s.fused == ()


def _tiny(cls, **kw):
    base = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=96, vocab_size=128, max_position_embeddings=32)
    return cls(**{**base, **kw})


def test_hf_configs_built_locally():
    t = pytest.importorskip("transformers")
    llama = read_shape(_tiny(t.LlamaConfig))
    assert _key(llama) == (2, 64, 4, 2, 16, 96, 128) and llama.family == "llama" and llama.gated_mlp
    assert _key(read_shape(_tiny(t.MistralConfig))) == _key(llama)
    assert read_shape(_tiny(t.Qwen2Config)).head_dim == 16  # head_dim None: hidden // heads
    qwen3 = read_shape(_tiny(t.Qwen3Config, head_dim=32))  # Qwen3 sets head_dim apart from hidden // heads
    assert (qwen3.head_dim, qwen3.qk_norm) == (32, "per_head")
    gemma = read_shape(_tiny(t.GemmaConfig, head_dim=24))
    assert (gemma.head_dim, gemma.tied_embeddings, gemma.gated_mlp) == (24, True, True)
    assert read_shape(_tiny(t.Olmo2Config)).qk_norm == "full"
    assert read_shape(_tiny(t.Phi3Config)).fused == ("qkv_proj", "gate_up_proj")
    gpt2 = read_shape(t.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_inner=None, vocab_size=128, n_positions=32))
    assert _key(gpt2) == (2, 64, 4, 4, 16, 256, 128)  # n_inner None: 4 * n_embd
    assert (gpt2.gated_mlp, gpt2.tied_embeddings, gpt2.fused, gpt2.max_seq_len) == (False, True, ("c_attn",), 32)
    # GPT-2's config.json as a dict
    raw = {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "n_inner": 128, "vocab_size": 128,
           "n_positions": 32}
    assert _key(read_shape(raw)) == (2, 64, 4, 4, 16, 128, 128) and not read_shape(raw).gated_mlp


def test_hf_models_built_locally_show_norms_ties_and_fused_projections():
    t = pytest.importorskip("transformers")
    torch.manual_seed(0)
    qwen3 = read_shape(t.Qwen3ForCausalLM(_tiny(t.Qwen3Config, head_dim=32)))
    assert (qwen3.qk_norm, qwen3.head_dim) == ("per_head", 32)  # q_norm weight has head_dim entries
    olmo = read_shape(t.Olmo2ForCausalLM(_tiny(t.Olmo2Config)))
    assert olmo.qk_norm == "full"  # q_norm over all heads * head_dim
    gpt2_model = t.GPT2LMHeadModel(t.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32))
    gpt2 = read_shape(gpt2_model)
    assert gpt2.tied_embeddings and gpt2.fused == ("c_attn",)
    assert gpt2.params == sum(p.numel() for p in gpt2_model.parameters())  # shared head counted once
    assert gpt2.embedding_params == (128 + 32) * 64  # wte and wpe
    phi3 = read_shape(t.Phi3ForCausalLM(_tiny(t.Phi3Config, pad_token_id=0)))
    assert phi3.fused == ("qkv_proj", "gate_up_proj") and not phi3.tied_embeddings


def test_lightning_module_holding_an_hf_model_under_any_name():
    t = pytest.importorskip("transformers")
    import lightning as L

    class Wrapper(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = t.LlamaForCausalLM(_tiny(t.LlamaConfig))

    module = Wrapper()
    assert find_config(module) is module.net.config
    assert _key(read_shape(module)) == (2, 64, 4, 2, 16, 96, 128)


def test_the_five_readers_agree():
    t = pytest.importorskip("transformers")
    from meshkit.models import LlamaConfig, LlamaLM
    from meshkit import planner as pl
    from meshkit.plugins.tensor_parallel import tp_widths
    from meshkit.profiling.flops import model_shape

    for obj in (LlamaLM(LlamaConfig.tiny(max_seq_len=32)), t.LlamaForCausalLM(_tiny(t.LlamaConfig))):
        s = read_shape(obj)
        f, spec = model_shape(obj), pl.ModelSpec.from_config(obj)
        assert (f.n_layers, f.n_heads, f.head_dim, f.seq_len) == (s.layers, s.heads, s.head_dim, s.max_seq_len)
        assert (spec.layers, spec.hidden, spec.heads, spec.kv_heads, spec.ffn, spec.vocab) == (
            s.layers, s.hidden, s.heads, s.kv_heads, s.ffn, s.vocab)
        assert tp_widths(obj) == (s.heads, s.kv_heads, s.hidden)
        assert find_config(obj) is (obj.config)
        # auto_nd's seq_len default is the config's
        assert pl.auto_nd_layout(obj, world_size=2, num_nodes=1, device="cpu").world_size == 2


def test_errors_name_what_is_missing():
    with pytest.raises(ValueError, match=r"lacks one of hidden size.*dim=8, n_layers=None"):
        read_shape({"dim": 8})
    with pytest.raises(ValueError, match=r"module without a `config`"):
        read_shape(torch.nn.Linear(2, 2))
    assert find_config(torch.nn.Linear(2, 2)) is None and find_config({"dim": 8}) is None
    from meshkit.plugins.tensor_parallel import tp_widths

    assert tp_widths(torch.nn.Linear(2, 2)) == (None, None, None)
