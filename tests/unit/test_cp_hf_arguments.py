"""Context-parallel attention for transformers models implements every argument it is handed, or refuses it.

One process: :func:`check_hf_attention_args` on the arguments transformers' attention modules pass (softcap,
sinks, a position bias, dropout in training, windows shorter than the sequence), and the fix the window
refusal names, run in one process on the installed transformers (per-layer ``layer_types`` families and the
others). The same refusals and fixes on 4 gloo ranks are in tests/distributed/test_model_matrix.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from meshkit.plugins.context_parallel.integration import check_cp_forward, check_hf_attention_args
from tests.distributed import hf_models as H
from tests.distributed import training as T

SLIDING_QWEN2 = {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1,
                 "layer_types": ["full_attention", "sliding_attention"], "tie_word_embeddings": False}
"""Qwen2 as the current transformers configures windows: per layer (one full, one sliding of 4 tokens)."""


class _Attention(nn.Module):
    def __init__(self, config: object = None) -> None:
        super().__init__()
        self.config = config


@pytest.mark.parametrize("key,value,shown", [
    ("softcap", 50.0, "softcap=50.0"),  # Gemma2
    ("s_aux", nn.Parameter(torch.zeros(4)), r"s_aux=Parameter of shape \(4,\)"),  # gpt-oss attention sinks
    ("sinks", torch.zeros(4), r"sinks=Tensor of shape \(4,\)"),
    ("position_bias", torch.zeros(1, 4, 8, 8), r"position_bias=Tensor of shape \(1, 4, 8, 8\)"),
    ("output_attentions", True, "output_attentions=True"),
    ("some_future_argument", 3, "some_future_argument=3"),  # unknown: refused, not ignored
])
def test_an_argument_cp_does_not_implement_is_refused(key, value, shown):
    with pytest.raises(ValueError, match=rf"_Attention passes `{shown}` to its attention, which context-parallel "
                                         r"attention does not implement.*without cp \(cp=1\)"):
        check_hf_attention_args(_Attention(), 16, None, 0.0, {key: value})


def test_defaults_and_implemented_arguments_pass():
    module = _Attention()
    check_hf_attention_args(module, 16, None, 0.0, {"softcap": None, "s_aux": None, "output_attentions": False,
                                                    "sliding_window": 16, "position_ids": torch.arange(16),
                                                    "use_cache": True, "output_router_logits": True})
    module.eval()
    check_hf_attention_args(module, 16, None, 0.1, {})  # dropout is off in eval mode
    module.train()
    with pytest.raises(ValueError, match=r"`dropout=0.1` in training"):
        check_hf_attention_args(module, 16, None, 0.1, {})
    with pytest.raises(ValueError, match=r"`attention_mask`"):
        check_hf_attention_args(module, 16, torch.ones(1, 16), 0.0, {})


@pytest.mark.parametrize("family,overrides,fix", [
    ("qwen2", SLIDING_QWEN2, r'`config.layer_types = \["full_attention"\] \* 2`'),
    ("gemma2", {"sliding_window": 4}, r'`config.layer_types = \["full_attention"\] \* 2`'),
    ("mistral", {"sliding_window": 4}, r"`config.sliding_window=None`"),
])
def test_the_window_refusal_names_a_fix_that_runs_in_one_process(family, overrides, fix):
    model = H.build(family, overrides=overrides).model
    attention = model.model.layers[1].self_attn  # a sliding layer in every case
    with pytest.raises(ValueError, match=rf"attends within `sliding_window=4` tokens, but the sequences are 16 long.*{fix}") as e:
        check_hf_attention_args(attention, 16, None, 0.0, {"sliding_window": 4})
    fixed = H.build(family, overrides={**overrides, **H.suggested_config(str(e.value))}).model
    ids = T.tokens(2)[:, : T.SEQ]
    with torch.no_grad():
        got = fixed(input_ids=ids).logits  # the fix builds and runs on the installed transformers
        full = H.build(family, overrides={k: v for k, v in overrides.items() if k != "sliding_window"}
                       if family == "mistral" else {"tie_word_embeddings": overrides.get("tie_word_embeddings", True)}).model
        windowed = model(input_ids=ids).logits
    torch.testing.assert_close(got, full(input_ids=ids).logits, rtol=1e-12, atol=0)  # it is full causal attention
    assert (got - windowed).abs().max() > 1e-3  # and the window did matter


@pytest.mark.parametrize("family", ["auto:bloom", "auto:cpmant"])
def test_a_family_computing_attention_outside_the_interface_is_refused(family):
    # Bloom (ALiBi) and CPM-Ant (position bias) trained silently under cp (the sweep: update errors 1 and 2).
    model = H.build(family).model
    with pytest.raises(ValueError, match=rf"{type(model).__name__} computes its attention without transformers' "
                                         r"attention interface \(its 2-layer twin called it 0 times\).*cp=1"):
        check_cp_forward(model)
