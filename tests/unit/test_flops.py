"""Peak table, device-name matching, FLOPs per token by hand, measured FLOPs on meta tensors."""

from __future__ import annotations

import pytest
import torch

from meshkit import hardware
from meshkit.profiling import flops as F
from meshkit.profiling.flops import peak_flops, peak_info, register_peak


@pytest.mark.parametrize(
    "name, dtype, expected, row",
    [
        ("NVIDIA H200", "bf16", 989.4e12, "H200-SXM"),  # dense; 1979 TF is the 2:4-sparse figure
        ("NVIDIA H200 NVL", "bf16", 835.5e12, "H200-NVL"),
        ("NVIDIA H100 80GB HBM3", "bf16", 989.4e12, "H100-SXM"),
        ("NVIDIA H100 80GB HBM3", "fp8", 1978.9e12, "H100-SXM"),
        ("NVIDIA H100 PCIe", "bf16", 756e12, "H100-PCIe"),
        ("NVIDIA H100 NVL", "fp16", 835.5e12, "H100-NVL"),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312e12, "A100-SXM4-80GB"),
        ("NVIDIA A100-SXM4-40GB", "tf32", 156e12, "A100-SXM4-40GB"),
        ("NVIDIA A100-PCIE-40GB", "fp32", 19.5e12, "A100-PCIe-40GB"),
        ("NVIDIA A100 80GB PCIe", "bf16", 312e12, "A100-PCIe-80GB"),
        ("NVIDIA B200", "bf16", 2.25e15, "B200"),
        ("NVIDIA L4", "bf16", 121e12, "L4"),  # must not match L40 / L40S
        ("NVIDIA L40S", "bf16", 362.05e12, "L40S"),
        ("NVIDIA L40", "fp8", 362e12, "L40"),
        ("NVIDIA A10", "fp16", 125e12, "A10"),  # must not match A100
        ("AMD Instinct MI300X", "bf16", 1307.4e12, "MI300X"),
        ("Tesla V100-SXM2-16GB", "fp16", 125e12, "V100-SXM2"),
        ("NVIDIA GeForce RTX 4090", "bf16", 165.2e12, "RTX-4090"),
    ],
)
def test_real_device_strings_match_dense_rows(name, dtype, expected, row):
    info = peak_info(name, dtype)
    assert info.row == row
    assert info.flops == pytest.approx(expected)
    assert info.kind == "datasheet" and info.source


def test_every_row_has_source_and_sane_ratios():
    for row in F.PEAK_TABLE:
        assert row.source and row.patterns, row.name
        if "bf16" in row.peaks and "fp8" in row.peaks:
            assert row.peaks["fp8"] == pytest.approx(2 * row.peaks["bf16"], rel=0.02), row.name
        if "tf32" in row.peaks and "bf16" in row.peaks and row.name != "RTX-4090":
            assert row.peaks["tf32"] == pytest.approx(row.peaks["bf16"] / 2, rel=0.02), row.name


def test_dtype_spellings():
    assert peak_flops("NVIDIA H100 80GB HBM3", torch.bfloat16) == peak_flops("NVIDIA H100 80GB HBM3", "bf16-mixed")
    assert peak_flops("NVIDIA H100 80GB HBM3", "16-mixed") == 989.4e12
    with pytest.raises(ValueError, match=r"dtype='int4'.*not a known dtype"):
        peak_flops("NVIDIA H100 80GB HBM3", "int4")


def test_unknown_device_lists_known_rows():
    with pytest.raises(ValueError, match=r"device_name='Banana GPU'.*known: .*H200-SXM.*override"):
        peak_flops("Banana GPU")


def test_missing_dtype_for_row():
    with pytest.raises(ValueError, match=r"V100-SXM2 has no `dtype='bf16'`"):
        peak_flops("Tesla V100-SXM2-32GB", "bf16")


def test_overrides(monkeypatch):
    assert peak_flops("anything at all", override=1e12) == 1e12
    monkeypatch.setenv("MESHKIT_PEAK_FLOPS", "2e12")
    assert peak_info("NVIDIA H200").kind == "override"
    assert peak_flops("NVIDIA H200") == 2e12
    monkeypatch.setenv("MESHKIT_PEAK_FLOPS", "fast")
    with pytest.raises(ValueError, match="MESHKIT_PEAK_FLOPS='fast'"):
        peak_flops("NVIDIA H200")
    monkeypatch.delenv("MESHKIT_PEAK_FLOPS")
    with pytest.raises(ValueError, match=r"override=-1"):
        peak_flops("NVIDIA H200", override=-1)


def test_register_peak_shadows_builtin(monkeypatch):
    monkeypatch.setattr(hardware, "_USER_GPUS", [])  # the catalog's user rows (register_peak adds one)
    register_peak("H200-SXM-capped", {"bf16": 700e12}, patterns=(r"\bH200\b",), source="power-capped fleet")
    assert peak_info("NVIDIA H200").row == "H200-SXM-capped"
    assert peak_flops("NVIDIA H200") == 700e12
    with pytest.raises(ValueError, match=r"peaks\['bf16'\]=0"):
        register_peak("bad", {"bf16": 0})


def test_cpu_peak_is_measured_and_cached(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(F, "_CPU_PEAK_CACHE", {})
    calls = []
    real = F._calibrate_cpu
    monkeypatch.setattr(F, "_calibrate_cpu", lambda dt: calls.append(dt) or real(dt, n=64, min_time_s=0.005))
    info = peak_info("cpu", "fp32")
    assert info.kind == "measured" and info.flops > 1e8
    assert peak_flops("cpu", "fp32") == info.flops  # in-memory cache
    monkeypatch.setattr(F, "_CPU_PEAK_CACHE", {})
    assert peak_flops("cpu", "fp32") == info.flops  # disk cache, no recalibration
    assert len(calls) == 1
    assert (tmp_path / "meshkit" / "cpu_peak.json").exists()


# ------------------------------------------------------------------------------ FLOPs per token

LLAMA3_8B_TITAN = dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256,
                       multiple_of=1024, ffn_dim_multiplier=1.3, rope_theta=500000)


def _llama3_8b_n_by_hand() -> int:
    d, kv, ffn, vocab = 4096, 8 * 128, 14336, 128256
    per_layer = 2 * d * d + 2 * d * kv + 3 * d * ffn + 2 * d  # wq wo, wk wv, SwiGLU, two RMSNorms
    n = 32 * per_layer + d + vocab * d  # + final norm + LM head; the embedding table is excluded
    assert n + vocab * d == 8_030_261_248  # the published Llama-3-8B parameter count
    return n


def test_llama3_8b_torchtitan_args_by_hand():
    n = _llama3_8b_n_by_hand()
    shape = F.model_shape(LLAMA3_8B_TITAN)
    assert (shape.n_params, shape.n_layers, shape.n_heads, shape.head_dim) == (n, 32, 32, 128)
    t = 8192
    expected = 6 * n + 12 * 32 * 32 * 128 * t  # = 57_914_449_920
    assert expected == 57_914_449_920
    assert F.model_flops_per_token(LLAMA3_8B_TITAN, seq_len=t) == expected
    assert F.model_flops_per_token(LLAMA3_8B_TITAN, seq_len=t, causal=True) == 6 * n + 6 * 32 * 32 * 128 * t


# Meta-Llama-3-8B's config.json fields (importing transformers costs ~15 s on this machine; the
# reader only uses attribute / key access, checked both ways).
HF_LLAMA3_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                "max_position_embeddings": 8192, "tie_word_embeddings": False, "model_type": "llama"}


def test_llama3_8b_hf_config_matches():
    import types

    for cfg in (HF_LLAMA3_8B, types.SimpleNamespace(**HF_LLAMA3_8B, head_dim=None)):
        assert F.model_shape(cfg).n_params == _llama3_8b_n_by_hand()
        assert F.model_flops_per_token(cfg) == 57_914_449_920  # T from max_position_embeddings


def test_tiny_meshkit_config_by_hand():
    from meshkit.models import LlamaConfig, Transformer

    cfg = LlamaConfig.tiny()  # dim 64, 4 layers, 4 heads (hd 16), 2 kv heads, vocab 256, ffn 32*ceil(170/32)=192
    assert cfg.ffn_dim == 192
    per_layer = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 192 + 2 * 64
    n = 4 * per_layer + 64 + 256 * 64
    assert F.model_shape(cfg).n_params == n == 213_568
    assert F.model_flops_per_token(cfg, seq_len=16) == 6 * n + 12 * 4 * 4 * 16 * 16
    # Counting the module's own parameters gives the same N (embedding excluded, head kept).
    assert F.model_shape(Transformer(cfg)).n_params == n


def test_bad_inputs():
    with pytest.raises(ValueError, match=r"seq_len=0.*positive int"):
        F.model_flops_per_token(LLAMA3_8B_TITAN, seq_len=0)
    with pytest.raises(ValueError, match=r"lacks one of hidden size"):
        F.model_shape({"dim": 8})
    with pytest.raises(ValueError, match=r"module without a `config`"):
        F.model_shape(torch.nn.Linear(2, 2))


class _Checkpointed(torch.nn.Module):
    """The tiny Llama with every block under non-reentrant activation checkpointing."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.config = inner, inner.config

    def forward(self, tokens):
        from torch.utils.checkpoint import checkpoint

        m = self.inner
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        from meshkit.kernels import rope_cos_sin

        cos, sin = rope_cos_sin(pos, m.config.head_dim, m.config.rope_theta)
        h = m.tok_embeddings(tokens)
        for layer in m.layers.values():
            h = checkpoint(layer, h, cos, sin, use_reentrant=False)
        return m.output(m.norm(h))


def test_measured_flops_match_formula_and_count_recompute():
    from meshkit.models import LlamaConfig, Transformer

    cfg = LlamaConfig.tiny()
    model = Transformer(cfg)
    b, t = 2, 16
    tokens = torch.zeros(b, t, dtype=torch.long)
    plain = F.measure_step_flops(model, tokens)
    # CPU flash attention: forward 4·B·H·T²·hd per layer; its backward recomputes the scores and
    # torch counts 2.5× the forward, i.e. half a forward more than the 2× rule.
    attn = 4 * (4 * b * 4 * t * t * 16)
    assert plain.backward == 2 * plain.forward + attn / 2
    assert plain.recompute == attn / 2
    # The formula's N includes norm weights, which do no matmul work: 6 * 576 per token.
    norm_params = 4 * 2 * 64 + 64
    assert F.model_flops_per_token(cfg, seq_len=t) * b * t - plain.model == 6 * norm_params * b * t
    ckpt = F.measure_step_flops(_Checkpointed(model), tokens)
    # The blocks' forward is re-run in backward, except (a) the LM head, outside any checkpoint:
    # 2·B·T·dim·vocab, and (b) each block's last matmul w2 (2·B·T·ffn·dim): non-reentrant
    # checkpointing stops recomputing once every saved tensor is back, and w2's output is not saved.
    head = 2 * b * t * 64 * 256
    w2 = 4 * 2 * b * t * 192 * 64
    assert ckpt.model == plain.model
    assert ckpt.recompute == plain.forward - head - w2 + attn / 2
    assert ckpt.hardware == plain.hardware + plain.forward - head - w2
    assert all(p.device.type == "cpu" and type(p) is torch.nn.Parameter for p in model.parameters())
