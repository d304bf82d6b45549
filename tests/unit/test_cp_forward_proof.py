"""cp's forward proof (``check_cp_forward``): the tiny float64 twin cut into cp shards as meshkit cuts it, in one
process, against the twin's own logits; refused on a mismatch, before any collective, with the fix named and run.

The sweep found CamemBERT silently wrong under cp (update error 1): RoBERTa-style learned positions count from
``padding_idx + 1`` and skip padding, a rule over the whole sequence that a rank's shard cannot apply. cp now
computes the family's own positions before it cuts (meshkit.families.position_ids_of), and the proof shows it.
The same families on 4 gloo ranks: the sweep's cp cells (tests/distributed/test_family_sweep.py runs camembert).
"""

from __future__ import annotations

import pytest
import torch

import meshkit.families as families
import meshkit.plugins.context_parallel.integration as I
from meshkit.families import register_position_ids
from meshkit.plugins.context_parallel.integration import check_cp_forward
from tests.distributed import hf_models as H

pytest.importorskip("transformers")

OWN_POSITIONS = ["auto:camembert", "auto:roberta", "auto:xlm-roberta", "auto:data2vec-text",
                 "auto:roberta-prelayernorm"]
"""Families whose embeddings derive position ids from the token ids (RoBERTa's create_position_ids_from_input_ids)."""


@pytest.fixture(autouse=True)
def fresh_proofs(monkeypatch):
    monkeypatch.setattr(I, "_PROVED", {})  # every test proves afresh


@pytest.mark.parametrize("family", OWN_POSITIONS)
def test_a_family_deriving_positions_from_ids_is_exact_with_its_rule_and_refused_without(family, monkeypatch):
    model = H.build(family).model
    assert families.position_ids_of(model) is not None
    check_cp_forward(model)  # the family's own positions, computed on the whole sequence: exact
    check_cp_forward(model, cp=4, layout="contiguous")
    monkeypatch.setattr(I, "_PROVED", {})
    monkeypatch.setattr(families, "position_ids_of", lambda _model: None)  # what cp fed before: 0..T-1
    with pytest.raises(ValueError, match=rf"cannot show that {type(model).__name__} under cp=2 computes what it "
                                         r"computes in one process.*position ids meshkit feeds: the global ones.*"
                                         r"differ from its own by \d\.\de[-+]\d\d.*cp=1"):
        check_cp_forward(model)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "auto:gpt2", "auto:opt", "auto:bert", "auto:biogpt",
                                    "auto:gpt_neox", "auto:gpt_bigcode"])
def test_neighbours_with_learned_or_rotary_positions_pass(family):
    model = H.build(family).model
    check_cp_forward(model)
    check_cp_forward(model, cp=4)


def test_the_proof_alone_catches_an_attention_soft_cap_cp_would_drop(monkeypatch):
    # Without the argument check, cp attention would drop Gemma2's soft-cap: the proof's logits show it.
    monkeypatch.setattr(I, "check_hf_attention_args", lambda *args: None)
    model = H.build("gemma2").model
    with pytest.raises(ValueError, match=r"cannot show that Gemma2ForCausalLM under cp=2.*differ from its own"):
        check_cp_forward(model)
    check_cp_forward(H.build("gemma2", overrides={"attn_logit_softcapping": None}).model)  # the named fix passes


def test_with_the_argument_check_the_soft_cap_is_refused_by_name_and_the_fix_passes():
    with pytest.raises(ValueError, match=r"Gemma2Attention passes `softcap=50.0`.*attn_logit_softcapping=None"):
        check_cp_forward(H.build("gemma2").model)
    check_cp_forward(H.build("gemma2", overrides={"attn_logit_softcapping": None}).model)


def _doubled(ids: torch.Tensor) -> torch.Tensor:
    return 2 * torch.arange(ids.shape[1]).expand_as(ids)


class DoubledPositions(__import__("transformers").LlamaForCausalLM):
    """A family whose positions, when it is handed none, are 0, 2, 4, ...: no meshkit rule knows it."""

    def forward(self, input_ids=None, position_ids=None, **kwargs):
        if position_ids is None:
            position_ids = _doubled(input_ids)
        return super().forward(input_ids=input_ids, position_ids=position_ids, **kwargs)


def test_an_unknown_position_rule_is_refused_and_registering_it_is_the_fix(monkeypatch):
    model = DoubledPositions(H._config("llama")).to(torch.float64)
    with pytest.raises(ValueError, match=r"DoubledPositions under cp=2.*register_position_ids"):
        check_cp_forward(model)
    monkeypatch.setitem(families.positions._REGISTERED, DoubledPositions, lambda _model: _doubled)
    monkeypatch.setattr(I, "_PROVED", {})
    register_position_ids(DoubledPositions, lambda _model: _doubled)  # the fix the refusal names
    check_cp_forward(model)


@pytest.mark.parametrize("family,why", [
    ("auto:deepseek_v3", r"context_parallel_attention: .*value heads of another width.*cp=1"),  # MLA's v_head_dim
    ("auto:glm_moe_dsa", r"GlmMoeDsaForCausalLM under cp=2.*sharded forward raised TypeError.*cp=1"),  # DSA indexer
])
def test_families_cp_cannot_run_are_refused_in_one_process_naming_cp_1(family, why):
    with pytest.raises(ValueError, match=why):
        check_cp_forward(H.build(family).model)


def test_the_position_hook_refuses_tokens_without_the_family_positions():
    model = H.build("auto:camembert").model
    setattr(model, I.CP_POSITION_IDS, families.position_ids_of(model))
    hook = I._position_hook(None, "load_balanced", "position_ids", has_rule=True)
    with pytest.raises(ValueError, match=r"derives its position ids from the whole sequence.*shard_batch"):
        hook(model, (), {"input_ids": torch.zeros(1, 8, dtype=torch.long)})
    ids = torch.zeros(1, 8, dtype=torch.long)
    ids._meshkit_cp_positions = torch.arange(8)[None] + 2
    assert hook(model, (), {"input_ids": ids})[1]["position_ids"].tolist() == [list(range(2, 10))]


def test_a_window_is_recorded_and_held_against_each_batch_before_any_collective():
    # The window refusal needs the sequence length: it comes when the strategy cuts a batch (check_cp_batch), not
    # at the first attention call after FSDP's all-gathers. The fix it names is the one the installed transformers
    # accepts for per-layer windows, with the real model's layer count (the twin has 2).
    from tests.unit.test_cp_hf_arguments import SLIDING_QWEN2

    overrides = {**SLIDING_QWEN2, "num_hidden_layers": 3, "layer_types": ["full_attention", "sliding_attention"] * 1
                 + ["sliding_attention"]}
    model = H.build("qwen2", overrides=overrides).model
    check_cp_forward(model)
    assert getattr(model, I.CP_WINDOW) == (4, "Qwen2Attention")
    I.check_cp_batch(model, {"input_ids": torch.zeros(2, 2, dtype=torch.long)}, cp=2)  # 4 tokens: within the window
    with pytest.raises(ValueError, match=r"Qwen2Attention attends within `sliding_window=4` tokens, but the sequences "
                                         r"are 8 long.*`config\.layer_types = \[\"full_attention\"\] \* 3`") as e:
        I.check_cp_batch(model, {"input_ids": torch.zeros(2, 4, dtype=torch.long)}, cp=2)
    fixed = H.build("qwen2", overrides={**overrides, **H.suggested_config(str(e.value))}).model  # the named fix
    check_cp_forward(fixed)
    assert not hasattr(fixed, I.CP_WINDOW)
    I.check_cp_batch(fixed, {"input_ids": torch.zeros(2, 4, dtype=torch.long)}, cp=2)
    with pytest.raises(ValueError, match=r"the batch's `attention_mask` pads some tokens"):
        I.check_cp_batch(fixed, {"input_ids": torch.zeros(2, 4, dtype=torch.long),
                                 "attention_mask": torch.tensor([[1, 1, 1, 0]] * 2)}, cp=2)
    # What the front doors hold per batch: the record resolved once (CPApplied), checked without a module walk;
    # the mask is refused on its own (NDParallelStrategy: on the host, before the transfer) and skipped with mask=False
    record = I.CPApplied("load_balanced", None, I._window_of(model))
    assert record.window == (4, "Qwen2Attention", model.config)
    with pytest.raises(ValueError, match=r"Qwen2Attention attends within `sliding_window=4` tokens, but the sequences "
                                         r"are 8 long.*`config\.layer_types = \[\"full_attention\"\] \* 3`"):
        I.check_cp_batch(record, {"input_ids": torch.zeros(2, 4, dtype=torch.long)}, cp=2)
    padded = {"input_ids": torch.zeros(2, 1, dtype=torch.long), "attention_mask": torch.tensor([[1, 0]] * 2)}
    I.check_cp_batch(record, padded, cp=2, mask=False)
    with pytest.raises(ValueError, match=r"the batch's `attention_mask` pads some tokens"):
        I.check_cp_mask(padded, cp=2)
