"""Pipeline stages of transformers causal LMs run the family's own forward, proven on its tiny twin, or refuse.

One process: a model cut into stages and chained must give the model's own logits in float64; a family whose
forward the stages cannot reproduce is refused by :func:`check_stage_forward`, naming the class and the fixes,
and the per-family stage hook it names is run here and gives the model's logits.
"""

from __future__ import annotations

import pytest
import torch

from meshkit.plugins.pipeline import find_layer_stack, split_model
from meshkit.plugins.pipeline.split import check_stage_forward

transformers = pytest.importorskip("transformers")

_TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, tie_word_embeddings=False, pad_token_id=None, bos_token_id=None, eos_token_id=None)

FAMILIES = {
    "llama": lambda: transformers.LlamaConfig(**_TINY),
    "cohere": lambda: transformers.CohereConfig(**_TINY, logit_scale=0.25),  # logits * logit_scale after the head
    # a soft-cap on the final logits and in attention, sqrt(hidden) embedding multiplier, sliding/full layers
    "gemma2": lambda: transformers.Gemma2Config(**_TINY, head_dim=8, final_logit_softcapping=0.05, sliding_window=4),
    "qwen2": lambda: transformers.Qwen2Config(**{**_TINY, "num_hidden_layers": 4}, use_sliding_window=True,
                                               sliding_window=4, max_window_layers=2),  # layer_types: full, sliding
    "gemma3_text": lambda: transformers.Gemma3TextConfig(**_TINY, head_dim=8, sliding_window=4),  # rotary per layer type
}


def _model(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = FAMILIES[family]()
    config._attn_implementation = "eager"
    return transformers.AutoModelForCausalLM.from_config(config).to(torch.float64).eval()


def _chain(stages: list[torch.nn.Module], x: torch.Tensor) -> torch.Tensor:
    for stage in stages:
        x = stage(x)
    return x


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_stages_chain_to_the_familys_own_logits(family):
    model = _model(family)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        got = _chain(split_model(model, (0, 1, 2), 3), ids)  # 4 blocks on 3 stages: first, middle and last work
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)


def test_the_head_side_work_matters_here():
    # The control for the cells above: without Cohere's logit scale or Gemma2's soft-cap the logits differ.
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        cohere = _model("cohere")
        scaled = cohere(input_ids=ids).logits
        assert (scaled / cohere.logit_scale - scaled).abs().max() > 1e-2
        gemma2 = _model("gemma2")
        capped = gemma2(input_ids=ids).logits
        raw = gemma2.lm_head(gemma2.model(input_ids=ids)[0])
        assert capped.abs().max() <= 0.05 and (capped - raw).abs().max() > 1e-2


class _ReadsIdsAtTheHead(transformers.LlamaForCausalLM):
    """Adds a bias looked up from the token ids after the head: the ids exist on the first stage only."""

    def forward(self, input_ids=None, inputs_embeds=None, **kwargs):
        out = super().forward(input_ids=input_ids, inputs_embeds=inputs_embeds, **kwargs)
        out.logits = out.logits + 0.1 * input_ids[..., None].to(out.logits.dtype)
        return out


class _ScalesByTheEmbeddings(transformers.LlamaForCausalLM):
    """Scales the logits by a statistic of the input embeddings: a later stage sees its placeholder zeros instead."""

    def forward(self, input_ids=None, inputs_embeds=None, **kwargs):
        embeds = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        out = super().forward(inputs_embeds=embeds, **kwargs)
        out.logits = out.logits * (1.0 + embeds.abs().mean())
        return out


def _custom(cls: type) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**_TINY)
    config._attn_implementation = "eager"
    return cls(config).to(torch.float64).eval()


@pytest.mark.parametrize("cls,match", [
    (_ReadsIdsAtTheHead, r"the stage forward raised TypeError"),
    (_ScalesByTheEmbeddings, r"chained stages' logits differ from the model's own \(relative error [0-9.e+-]+\)"),
])
def test_a_forward_the_stages_cannot_reproduce_is_refused_with_its_fixes(cls, match):
    name = cls.__name__
    with pytest.raises(ValueError, match=rf"cannot show that its stages of `{name}` compute {name}.forward.*{match}") as e:
        find_layer_stack(_custom(cls))
    assert "pipeline_stage_forward(self, x)" in str(e.value) and "configure_model" in str(e.value)


class _ReadsIdsWithAHook(_ReadsIdsAtTheHead):
    """The fix the refusal names: a per-family stage hook (here: the ids ride along as the hidden states' partner)."""

    def pipeline_stage_forward(self, x):
        ids, h = (x, None) if self.model.embed_tokens is not None else (x[0], x[1])
        if h is None:
            h = self.model.embed_tokens(ids)
        pos = torch.arange(ids.shape[1])[None]
        mask = transformers.masking_utils.create_causal_mask(
            config=self.config, inputs_embeds=h, attention_mask=None, cache=None, position_ids=pos)
        emb = self.model.rotary_emb(h, position_ids=pos)
        for layer in self.model.layers.values():
            h = layer(h, attention_mask=mask, position_embeddings=emb, position_ids=pos)
        if self.lm_head is None:
            return (ids, h)
        return self.lm_head(self.model.norm(h)) + 0.1 * ids[..., None].to(h.dtype)


def test_the_stage_hook_the_refusal_names_gives_the_models_logits():
    model = _custom(_ReadsIdsWithAHook)
    assert find_layer_stack(model).family == "native"  # the hook answers for itself: no twin check
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(_chain(split_model(model, (0, 1), 2), ids), model(input_ids=ids).logits,
                                   rtol=1e-12, atol=0)


def test_the_check_runs_once_per_class_and_config(monkeypatch):
    from meshkit.plugins.pipeline import split

    model, calls = _model("llama"), []
    monkeypatch.setattr(split, "_CHECKED", {})
    original = split._stage_forward_mismatch
    monkeypatch.setattr(split, "_stage_forward_mismatch", lambda m: calls.append(1) or original(m))
    for _ in range(3):
        check_stage_forward(model)
    assert calls == [1]
