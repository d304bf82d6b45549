"""Pipeline config checks and the stage split, in one process (no process group)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from meshkit.models import LlamaConfig, Transformer
from meshkit.plugins.pipeline import (
    balanced_split_points,
    find_layer_stack,
    plan_split,
    resolve_microbatches,
    resolve_virtual_stages,
    split_model,
    stage_ids_on_rank,
    theoretical_bubble,
)


# ---- balanced split ---------------------------------------------------------------------------------


def test_split_uniform_blocks_no_extras_is_even():
    assert balanced_split_points([1.0] * 8, 4) == [2, 4, 6]


def test_split_gives_first_and_last_stage_fewer_blocks():
    # 8 unit blocks, embedding 2 and head 2: total 12 over 4 stages = 3 each, so 1 + 3 + 3 + 1 blocks.
    assert balanced_split_points([1.0] * 8, 4, first_cost=2.0, last_cost=2.0) == [1, 4, 7]


def test_split_cost_model_params_vs_flops():
    # vocab 4096, dim 64, 6 blocks, 2 stages. Per block: attention 64·64 + 2·64·32 + 64·64 = 12288,
    # SwiGLU 3·64·192 = 36864 (ffn_dim = 32·ceil((8·64//3)/32) = 192), 2 norms 128 -> 49280 params.
    # params: embedding 4096·64 = 262144 on stage 0, head 262144 + norm 64 on stage 1 -> symmetric, 3 | 3.
    # flops: 2·49152 = 98304 per block, embedding 0, head 2·262144 = 524288: stage 1 = (6-k)·98304 + 524288,
    # stage 0 = k·98304 -> k = 5 gives max(491520, 622592), k = 4 gives 720896: split [5].
    model = Transformer(LlamaConfig.tiny(n_layers=6, vocab_size=4096))
    assert plan_split(model, 2, cost="params")[1] == [3]
    assert plan_split(model, 2, cost="flops")[1] == [5]


def test_split_points_override_and_stage_contents():
    model = Transformer(LlamaConfig.tiny(n_layers=8))
    stages = split_model(model, (0, 1, 2, 3), 4, split_points=[1, 2, 7])
    assert [list(s.layers.keys()) for s in stages] == [["0"], ["1"], ["2", "3", "4", "5", "6"], ["7"]]
    assert stages[0].tok_embeddings is not None and stages[0].output is None
    assert stages[3].tok_embeddings is None and stages[3].norm is not None and stages[3].output is not None
    # Full-model FQNs: the stages' state dicts partition the model's.
    keys = [k for s in stages for k in s.state_dict()]
    assert sorted(keys) == sorted(model.state_dict())


@pytest.mark.parametrize("points", [[2, 2, 6], [0, 4, 6], [2, 4], [2, 4, 8]])
def test_bad_split_points_raise(points):
    with pytest.raises(ValueError, match=r"pp_split_points=.*strictly increasing"):
        plan_split(Transformer(LlamaConfig.tiny(n_layers=8)), 4, split_points=points)


def test_layers_fewer_than_stages_raise():
    with pytest.raises(ValueError, match=r"has 4 blocks .* needs 8 stages"):
        plan_split(Transformer(LlamaConfig.tiny(n_layers=4)), 8)


# ---- stage forwards reproduce the model --------------------------------------------------------------


def _chain(stages: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    for s in stages:
        x = s(x)
    return x


def test_meshkit_stages_chain_to_model():
    torch.manual_seed(0)
    model = Transformer(LlamaConfig.tiny(n_layers=5))
    x = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(_chain(split_model(model, (0, 1, 2), 3), x), model(x), rtol=0, atol=1e-6)


def test_hf_llama_stages_chain_to_model():
    from transformers import LlamaConfig as HFConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = HFConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    x = torch.randint(0, 256, (2, 16))
    stages = split_model(model, (0, 1, 2), 3)
    assert find_layer_stack(model).family == "hf_causal_lm"
    torch.testing.assert_close(_chain(stages, x), model(x).logits, rtol=0, atol=1e-5)
    assert sorted(k for s in stages for k in s.state_dict()) == sorted(model.state_dict())
    tied = LlamaForCausalLM(HFConfig(**{**cfg.to_dict(), "tie_word_embeddings": True}))
    with pytest.raises(ValueError, match="tie_word_embeddings=False"):
        find_layer_stack(tied)


class _TitanStyle(nn.Module):
    """torchtitan's convention: a forward that skips the pieces set to None."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(32, 8)
        self.layers = nn.ModuleDict({str(i): nn.Linear(8, 8) for i in range(4)})
        self.norm = nn.LayerNorm(8)
        self.output = nn.Linear(8, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for layer in self.layers.values():
            h = torch.tanh(layer(h))
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


def test_torchtitan_style_model_keeps_its_forward():
    torch.manual_seed(0)
    model = _TitanStyle()
    x = torch.randint(0, 32, (3, 5))
    assert find_layer_stack(model).family == "native"
    torch.testing.assert_close(_chain(split_model(model, (0, 1), 2), x), model(x))


def test_unsplittable_model_says_what_to_expose():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"cannot split `model` \(Sequential\).*ModuleList or nn.ModuleDict.*pipeline_stage_forward"):
        find_layer_stack(model)


# ---- placement, virtual stages, micro-batches ---------------------------------------------------------------


def test_stage_placement_looped_and_v():
    assert stage_ids_on_rank(1, 4, 2) == (1, 5)
    assert stage_ids_on_rank(3, 4, 3) == (3, 7, 11)
    assert stage_ids_on_rank(0, 4, 2, "v") == (0, 7)
    assert stage_ids_on_rank(1, 4, 2, "v") == (1, 6)


def test_virtual_stages_rules():
    assert resolve_virtual_stages("1f1b", None) == 1
    assert resolve_virtual_stages("interleaved_1f1b", None) == 2
    assert resolve_virtual_stages("looped_bfs", 3) == 3
    with pytest.raises(ValueError, match=r"`pp_virtual_stages=2` needs a multi-stage schedule.*'gpipe'"):
        resolve_virtual_stages("gpipe", 2)
    with pytest.raises(ValueError, match=r"'zbv_zero_bubble'.*exactly 2 stages per rank.*pp_virtual_stages=3"):
        resolve_virtual_stages("zbv_zero_bubble", 3)
    with pytest.raises(ValueError, match=r"`pp_schedule='pipedream'` is not a known schedule"):
        resolve_virtual_stages("pipedream", None)


def test_default_microbatches():
    assert resolve_microbatches("1f1b", pp=4, batch_size=8) == 8  # smallest m >= 2p dividing 8
    assert resolve_microbatches("1f1b", pp=4, batch_size=24) == 8
    assert resolve_microbatches("gpipe", pp=4, batch_size=6) == 6  # no m >= 8 divides 6: the largest that does
    assert resolve_microbatches("interleaved_1f1b", pp=2, batch_size=12) == 4
    assert resolve_microbatches("dualpipev", pp=2, batch_size=8) == 4  # 2p = 4 = the stage count


def test_few_microbatches_warn_with_bubble():
    # gpipe, p = 4, m = 2: (p-1)/(m+p-1) = 3/5.
    with pytest.warns(UserWarning, match=r"`pp_microbatches=2` is below `pp=4`.*60%"):
        assert resolve_microbatches("gpipe", pp=4, batch_size=8, microbatches=2) == 2


@pytest.mark.parametrize(
    "schedule,pp,batch,m,match",
    [
        ("1f1b", 4, 8, 3, r"`pp_microbatches=3` cannot run: it must divide the per-rank batch size `batch_size=8`"),
        ("1f1b", 4, 8, 2, r"`pp_microbatches=2` cannot run: .*at least one micro-batch per stage \(4 stages\)"),
        ("interleaved_1f1b", 4, 18, 9, r"`pp_microbatches=9` cannot run: .*multiple of max\(1, m // pp\) = 2"),
        ("zbv_zero_bubble", 4, 16, 4, r"at least one micro-batch per stage \(8 stages\)"),
        ("gpipe", 4, 8, 0, r"`pp_microbatches=0` must be a positive int"),
    ],
)
def test_impossible_microbatches_raise(schedule, pp, batch, m, match):
    with pytest.raises(ValueError, match=match):
        resolve_microbatches(schedule, pp=pp, batch_size=batch, microbatches=m)


def test_batch_too_small_for_schedule_raises():
    with pytest.raises(ValueError, match=r"no micro-batch count suits `batch_size=2` .*'dualpipev'.*at least 4"):
        resolve_microbatches("dualpipev", pp=2, batch_size=2)


def test_theoretical_bubble_formulas():
    assert theoretical_bubble("gpipe", 4, 8) == pytest.approx(3 / 11)
    assert theoretical_bubble("1f1b", 4, 16) == pytest.approx(3 / 19)
    assert theoretical_bubble("interleaved_1f1b", 4, 8, 2) == pytest.approx(3 / 19)
    assert theoretical_bubble("gpipe", 4, 8, 2) == pytest.approx(3 / 11)  # v ignored for single-stage schedules
