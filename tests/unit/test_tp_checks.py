"""The TP plan against each block's own forward, in one process, before any collective (issue 23 item 4), and the
sequence-parallel plan of transformers models (issue 29). The multi-process runs are in
tests/distributed/test_tp_sp.py."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch import nn

from meshkit.plugins.tensor_parallel import (
    LocalShardNorm,
    PrepareHidden,
    check_tp_forward,
    infer_tp_plan,
)
from tests.distributed import hf_models as H


def _fix(error: str) -> dict:
    return H.suggested_plan(error)


class _PerHeadAttention(nn.Module):
    """Attention with one LayerNorm per head in a ModuleList, applied by position (StableLM's form, with the local
    head count read from the projection): under TP each rank would zip its heads with the first heads' norms."""

    def __init__(self, dim: int = 16, heads: int = 4) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)
        self.q_norms = nn.ModuleList(nn.LayerNorm(self.head_dim) for _ in range(heads))
        with torch.no_grad():
            for n in self.q_norms:  # distinct per head, so taking another head's norm shows
                n.weight.uniform_(0.5, 1.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, -1, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        q = torch.stack([norm(h) for norm, h in zip(self.q_norms, q.unbind(1))], dim=1)  # (B, nh, T, hd)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class _PerHeadLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok_embeddings = nn.Embedding(32, 16)
        self.layers = nn.ModuleList(_PerHeadAttention() for _ in range(2))
        self.output = nn.Linear(16, 32, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = h + layer(h)
        return self.output(h)


def test_a_per_head_norm_container_is_refused_with_a_plan_that_keeps_its_block_whole():
    with pytest.raises(ValueError, match=r"hold their parameters in submodules.*layers\.0\.q_norms \(ModuleList") as e:
        infer_tp_plan(_PerHeadLM())
    fix = _fix(str(e.value))
    assert fix == {"layers.*.*": "replicate"}
    assert check_tp_forward(_PerHeadLM(), 2, user_plan=fix) == []  # nothing left sharded in the blocks


def test_the_forward_check_catches_per_head_norms_applied_by_position():
    # What the plan used to do silently (LocalShardNorm on the wrapper): the names cannot tell, the forward does.
    forced = {"layers.*.q_norms": LocalShardNorm(shard_params=False)}
    with pytest.raises(ValueError, match=r"`layers\.0` \(_PerHeadAttention\) does not compute.*sum to something else"
                                         r".*tp_plan=\{\"layers\.\*\.\*\": \"replicate\"\}"):
        check_tp_forward(_PerHeadLM(), 2, user_plan=forced)


def test_a_family_that_reshapes_with_the_global_head_count_is_refused_not_a_raw_error():
    # StableLM's attention views q with config.num_attention_heads: a raw reshape error under TP before.
    model = H.build("stablelm_noqk").model
    with pytest.raises(ValueError, match=r"`model\.layers\.0\.self_attn` \(StableLmAttention\).*raised RuntimeError: "
                                         r"shape .* is invalid") as e:
        check_tp_forward(model, 2)
    fix = _fix(str(e.value))
    assert fix == {"model.layers.*.self_attn.*": "replicate"}
    assert check_tp_forward(model, 2, user_plan=fix) == ["model.layers.0.mlp"]


def test_stablelm_per_head_layernorms_are_refused_with_the_same_fix():
    with pytest.raises(ValueError, match=r"q_layernorm \(StableLmLayerNormPerHead.*norms\.0\.weight") as e:
        infer_tp_plan(H.build("stablelm").model)
    assert _fix(str(e.value)) == {"model.layers.*.self_attn.*": "replicate"}


CHECKED = [(f, 2) for f in ("llama", "qwen2", "qwen3", "gemma", "mistral", "olmo2")] + [("qwen3", 4), ("olmo2", 4)]
"""(family, tp); tp=4 with 4 kv heads, so each rank keeps one."""


@pytest.mark.parametrize("family,tp", CHECKED, ids=[f"{f}-tp{t}" for f, t in CHECKED])
def test_the_forward_check_passes_the_families_the_matrix_trains(family, tp):
    # No false refusals: per-head (qwen3) and full-width (olmo2, every rank's columns gathered) norms included.
    overrides = {"num_key_value_heads": 4} if tp == 4 else None
    model = H.build(family, overrides=overrides).model
    assert check_tp_forward(model, tp) == ["model.layers.0.self_attn", "model.layers.0.mlp"]
    assert check_tp_forward(model, tp, sequence_parallel=True) == ["model.layers.0.self_attn", "model.layers.0.mlp"]


def test_the_check_runs_before_any_collective():
    # No process group exists in this process, and the mesh is never built: the refusal comes first.
    import torch.distributed as dist

    from meshkit.plugins import ParallelDims
    from meshkit.plugins.parallelize import parallelize

    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="does not compute on its rank's share"):
        parallelize(H.build("stablelm_noqk"), ParallelDims(dp_shard=2, tp=2, world_size=4))


def test_a_model_it_cannot_call_is_sharded_by_names_and_says_so():
    class Blocks(nn.Module):  # no token embedding to feed
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.ModuleDict({"q_proj": nn.Linear(4, 4), "o_proj": nn.Linear(4, 4)})

    with pytest.warns(UserWarning, match=r"forward check did not run on Blocks \(no transformers model"):
        assert check_tp_forward(Blocks(), 2) == []
    with torch.device("meta"):
        meta = H.build("llama").model
    with pytest.warns(UserWarning, match="meta device"):
        assert check_tp_forward(meta, 2) == []


def test_sequence_parallel_plan_of_a_transformers_model():
    plan = infer_tp_plan(H.build("qwen3").model, sequence_parallel=True)
    styles = {n: repr(s) for n, s in plan.items()}
    # The embedding output stays whole (mask, positions and rotary tables from the global length) and the first
    # decoder layer takes its rank's rows; each block gathers the sequence, its rowwise projection reduce-scatters.
    assert styles["model.embed_tokens"].endswith("output_layouts=(Replicate(),), use_local_output=True)")
    assert styles["model.layers.0"] == "PrepareHidden(R -> S(1))" and "model.layers.1" not in styles
    assert styles["model.layers.1.self_attn"] == styles["model.layers.1.mlp"] == "PrepareHidden(S(1) -> R)"
    assert "output_layouts=(Shard(dim=1),)" in styles["model.layers.1.self_attn.o_proj"]
    norms = [n for n, s in styles.items() if s.startswith("SequenceParallel")]
    assert norms == [f"model.layers.{i}.{n}" for i in (0, 1) for n in ("input_layernorm", "post_attention_layernorm")] \
        + ["model.norm"]
    # Inside the layers the norms hand on plain (B, T/tp, H) tensors (the residual adds); the norm after them hands
    # on a sequence-sharded DTensor, which the LM head gathers and the fused loss (fused_kernels=True) takes whole.
    assert [plan[n].use_local_output for n in norms] == [True] * 4 + [False]
    assert styles["model.layers.0.self_attn.q_norm"] == "LocalShardNorm(shard_params=False)"  # inside a block
    assert "input_layouts=(Shard(dim=1),)" in styles["lm_head"]


def test_sequence_parallel_refuses_blocks_kept_whole():
    # phi3's fused projections are kept whole by the fix its refusal names; whole blocks would see T/tp rows.
    with pytest.raises(ValueError, match="cannot place these projections") as e:
        infer_tp_plan(H.build("phi3").model)
    fix = _fix(str(e.value))
    with pytest.raises(ValueError, match=r"keeps these modules whole \(replicated\): model\.layers\.0\.self_attn\.o_proj, "
                                         r"model\.layers\.0\.self_attn\.qkv_proj.*sequence_parallel=False"):
        infer_tp_plan(H.build("phi3").model, user_plan=fix, sequence_parallel=True)
    infer_tp_plan(H.build("phi3").model, user_plan=fix)  # the fix it names


def test_sequence_parallel_refuses_a_norm_before_the_decoder_layers():
    # A transformers model keeps the embedding output whole under SP; a norm between it and the first layer (an
    # embedding layernorm, e.g. BLOOM's) would read the whole sequence as one rank's rows.
    from collections import OrderedDict

    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    model = H.build("llama").model
    inner = model.model
    inner._modules = OrderedDict([("embed_tokens", inner.embed_tokens), ("embed_norm", LlamaRMSNorm(32)),
                                  *((k, v) for k, v in inner._modules.items() if k != "embed_tokens")])
    with pytest.raises(ValueError, match=r"these norms come before the layers: model\.embed_norm \(LlamaRMSNorm\)\. "
                                         r".*Use `sequence_parallel=False`"):
        infer_tp_plan(model, sequence_parallel=True)
    assert "model.embed_norm" not in infer_tp_plan(model)  # the fix it names


def test_sequence_parallel_refuses_other_parameters_between_the_blocks():
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(16))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.scale

    model = _PerHeadLM()
    for layer in model.layers:
        del layer.q_norms
    model.gate = Scaled()
    with pytest.raises(ValueError, match=r"neither a norm nor a projection: gate \(Scaled\)"):
        infer_tp_plan(model, sequence_parallel=True)
    assert "gate" not in infer_tp_plan(model)


def test_sequence_parallel_with_pp_is_refused_for_transformers_models_before_the_process_group():
    from meshkit.plugins.parallelize import ParallelConfig
    from meshkit.plugins.presets import PRESETS, resolve_layout

    sizes = {"dp_replicate": 1, "dp_shard": 1, "pp": 2, "cp": 1, "tp": 2}
    with pytest.raises(ValueError, match=r"`sequence_parallel=True` with `pp=2` is not supported for transformers"):
        resolve_layout(PRESETS["tp_pp"], sizes, ParallelConfig(sequence_parallel=True), world_size=4, num_nodes=1,
                       model=H.build("llama", overrides={"tie_word_embeddings": False}))


def test_sequence_parallel_needs_the_sequence_to_divide_by_tp():
    hidden = PrepareHidden(torch.distributed.tensor.Replicate(), torch.distributed.tensor.Shard(1))

    class Mesh:
        def size(self) -> int:
            return 2

    with pytest.raises(ValueError, match=re.escape("cuts the sequence into tp=2 equal parts, but the hidden states are "
                                                   "(1, 15, 8)")):
        hidden._convert(torch.zeros(1, 15, 8), Mesh())


def test_the_forward_check_tells_a_full_width_norm_from_a_per_head_one():
    # OLMo2's q_norm spans every head: the per-head style applies its whole weight to one rank's columns.
    wrong = {"model.layers.*.self_attn.q_norm": LocalShardNorm(shard_params=False)}
    with pytest.raises(ValueError, match=r"`model\.layers\.0\.self_attn` \(Olmo2Attention\) does not compute.*"
                                         r"raised RuntimeError: The size of tensor a \(32\) must match"):
        check_tp_forward(H.build("olmo2").model, 2, user_plan=wrong)


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_checkpointed_transformers_blocks_run_without_the_kv_cache(mode):
    # transformers builds a key/value cache in training too (use_cache defaults on): the recomputation appended
    # the keys again, and selective checkpointing failed in backward ("aten.slice.Tensor invocation index 4 ...
    # not found in storage") in one process, under fsdp2 and under TP alike.
    from meshkit.plugins.activation_checkpoint import apply_ac
    from meshkit.plugins.fsdp import find_blocks

    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    ref = H.build("llama").model
    ref(input_ids=ids, labels=ids).loss.backward()
    model = H.build("llama").model
    assert model.config.use_cache
    apply_ac(find_blocks(model), mode)
    model(input_ids=ids, labels=ids).loss.backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=0, msg=name)


def test_the_replicate_plan_never_reaches_a_tied_embedding():
    # OPT's decoder holds project_in/out beside its (tied) embed_tokens: the suggested plan used to glob
    # "model.model.decoder.*", replicating the embedding while the tied LM head stayed sharded (refused by the tie
    # check). The modules outside the layer blocks are now named alone, and the plan is accepted end to end.
    module = H.build("auto:opt")
    with pytest.raises(ValueError, match=r"cannot place these projections: model\.model\.decoder\.project_out") as e:
        check_tp_forward(module, 2)
    fix = _fix(str(e.value))
    assert fix == {"model.model.decoder.layers.*.*": "replicate", "model.model.decoder.layers.*.self_attn.*": "replicate",
                   "model.model.decoder.project_in": "replicate", "model.model.decoder.project_out": "replicate"}
    assert check_tp_forward(module, 2, user_plan=fix) == []
    plan = infer_tp_plan(module, user_plan=fix)  # the tie check passes: the embedding and LM head stay vocab-sharded
    assert {"model.model.decoder.embed_tokens", "model.lm_head"} <= set(plan)
    # OPT's learned positions take the attention mask as their first input (the ids are made inside): the
    # embedding style would make the mask a DTensor and embed plain ids with a DTensor weight (a raw error on 4
    # ranks), so they stay whole.
    assert "model.model.decoder.embed_positions" not in plan


class _ScalesItsEmbedding(nn.Module):
    """CTRL's forward: ``inputs_embeds *= sqrt(d_model)``, in place on the embedding's output."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(16, 8)
        self.lm_head = nn.Linear(8, 16, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(ids)
        h *= 2.0
        return self.lm_head(h)


def test_a_family_scaling_its_sharded_embedding_output_in_place_trains(tmp_path):
    # Under tp the embedding's local output was to_local's view, which autograd forbids modifying in place (the
    # sweep's CTRL hsdp_tp cell: a raw RuntimeError); apply_tp gives it a tensor of its own. One rank: the same view.
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from meshkit.plugins.tensor_parallel import apply_tp

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model, ids = _ScalesItsEmbedding(), torch.randint(0, 16, (2, 4))
        want = model(ids)
        want.sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        apply_tp(model, init_device_mesh("cpu", (1,), mesh_dim_names=("tp",)), infer_tp_plan(model))
        got = model(ids)
        got.sum().backward()
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad.full_tensor(), grads[n], rtol=0, atol=0)
    finally:
        dist.destroy_process_group()


def test_an_embedding_holding_modules_of_its_own_stays_whole():
    # Inkling's embedding holds a norm (InklingNormedEmbedding.embed_norm): the embedding style sharded every
    # parameter of the module as vocabulary rows (a raw "parameter name can't contain '.'" KeyError on 4 ranks,
    # found by the family sweep), and the norm would have normalized one rank's partial rows. It stays whole.
    module = H.build("auto:inkling_text")
    plan = infer_tp_plan(module, user_plan={"model.model.layers.*.self_attn.*": "replicate"})
    assert type(module.model.model.embed_tokens).__name__ == "InklingNormedEmbedding"
    assert "model.model.embed_tokens" not in plan
    assert "model.model.embed_tokens" in infer_tp_plan(H.build("llama"))  # a plain embedding is still sharded
