"""ParallelDims, preset resolution, the TP plan and every config error, in one process."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch import nn

import meshkit
from meshkit.models import LlamaConfig, Transformer
from meshkit.plugins.dims import ParallelDims
from meshkit.plugins.fsdp import find_blocks, mixed_precision_policy
from meshkit.plugins.presets import PRESETS, resolve_dims
from meshkit.plugins.tensor_parallel import infer_tp_plan, tp_widths

AUTO = dict.fromkeys(("dp_replicate", "dp_shard", "pp", "cp", "tp"), "auto")


def test_dp_shard_fills_the_world():
    dims = ParallelDims(dp_replicate=2, tp=2, world_size=16)
    assert dims.degrees == {"dp_replicate": 2, "dp_shard": 4, "pp": 1, "cp": 1, "tp": 2}
    assert dims.dp_size == 8 and dims.fsdp_enabled and dims.tp_enabled and not dims.pp_enabled


def test_product_must_equal_world_size():
    with pytest.raises(ValueError, match=r"`dp_replicate=2`, `dp_shard=2`, `pp=1`, `cp=1`, `tp=4` multiplied \(16\) "
                                         r"should equal the world size \(8\)"):
        ParallelDims(dp_replicate=2, dp_shard=2, tp=4, world_size=8)


def test_fill_impossible():
    with pytest.raises(ValueError, match=r"multiply to 3, which does not divide the world size \(8\)"):
        ParallelDims(tp=3, world_size=8)


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_degrees_must_be_positive_ints(bad):
    with pytest.raises(ValueError, match="tp="):
        ParallelDims(tp=bad, world_size=8)


def test_tp_must_divide_heads_kv_heads_and_hidden():
    dims = ParallelDims(tp=4, world_size=4)
    with pytest.raises(ValueError, match=r"`tp=4` must divide the model's `num_kv_heads=2`.*Use tp in \[1, 2\]"):
        dims.check_model_shape(heads=4, kv_heads=2, hidden=64)
    dims.check_model_shape(heads=8, kv_heads=4, hidden=64)  # fine


def test_global_batch_must_divide_by_dp():
    dims = ParallelDims(dp_replicate=2, dp_shard=3, world_size=6)
    with pytest.raises(ValueError, match=r"`global_batch_size=10` is not divisible by the data-parallel size .*6"):
        dims.check_batch(10)


def test_unknown_preset():
    listed = re.escape(str(sorted(meshkit.PRESETS)))
    with pytest.raises(ValueError, match=rf"unknown `preset='hsdp_tpp'`; choose one of {listed}"):
        meshkit.NDParallelStrategy("hsdp_tpp")


@pytest.mark.parametrize("precision", ["16-mixed", "64-true", "transformer-engine"])
def test_unsupported_precision(precision):
    with pytest.raises(ValueError, match=rf"`precision='{precision}'` is not supported"):
        mixed_precision_policy(precision)


def test_unsupported_precision_raised_by_the_trainer_before_any_process_group():
    import lightning as L

    trainer = L.Trainer(strategy="hsdp_tp", accelerator="cpu", devices=1, precision="64-true", max_steps=1,
                        logger=False, enable_checkpointing=False)
    with pytest.raises(ValueError, match="`precision='64-true'` is not supported"):
        trainer.fit(meshkit.models.LlamaLM())
    assert not torch.distributed.is_initialized()


def test_bad_activation_checkpointing():
    with pytest.raises(ValueError, match="`activation_checkpointing='some'` must be 'none', 'full' or 'selective'"):
        meshkit.NDParallelStrategy(activation_checkpointing="some")


@pytest.mark.parametrize(
    "preset, world, nodes, want",
    [
        ("fsdp2", 8, 1, dict(dp_replicate=1, dp_shard=8, tp=1)),
        ("hsdp", 8, 2, dict(dp_replicate=2, dp_shard=4, tp=1)),
        ("tp", 8, 1, dict(dp_replicate=1, dp_shard=4, tp=2)),  # kv heads = 2 caps tp
        ("hsdp_tp", 4, 1, dict(dp_replicate=1, dp_shard=2, tp=2)),
        ("hsdp_tp", 16, 2, dict(dp_replicate=2, dp_shard=4, tp=2)),
    ],
)
def test_auto_sizes(preset, world, nodes, want):
    dims = resolve_dims(PRESETS[preset], AUTO, world_size=world, num_nodes=nodes, model=Transformer(LlamaConfig.tiny()))
    assert {k: dims.degrees[k] for k in want} == want


def test_auto_tp_respects_a_big_model_node():
    cfg = LlamaConfig(dim=1024, n_heads=16, n_kv_heads=8, n_layers=1, vocab_size=32)
    dims = resolve_dims(PRESETS["hsdp_tp"], AUTO, world_size=64, num_nodes=8, model=Transformer(cfg))
    assert dims.degrees == {"dp_replicate": 8, "dp_shard": 2, "pp": 1, "cp": 1, "tp": 4}


def test_explicit_sizes_win_and_tp_fills():
    dims = resolve_dims(PRESETS["hsdp_tp"], {**AUTO, "dp_replicate": 2, "dp_shard": 2}, world_size=8, num_nodes=1)
    assert dims.degrees["tp"] == 2


def test_explicit_tp_not_dividing_heads_is_an_error():
    with pytest.raises(ValueError, match=r"`tp=4` must divide the model's `num_kv_heads=2`"):
        resolve_dims(PRESETS["tp"], {**AUTO, "tp": 4}, world_size=4, num_nodes=1, model=Transformer(LlamaConfig.tiny()))


def test_tp_across_nodes_warns():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resolve_dims(PRESETS["tp"], {**AUTO, "tp": 4}, world_size=8, num_nodes=4)
    assert any("larger than the 2 devices of a node" in str(w.message) for w in caught)


def test_uneven_nodes_is_an_error():
    with pytest.raises(ValueError, match="world size 6 is not divisible by `num_nodes=4`"):
        resolve_dims(PRESETS["hsdp"], AUTO, world_size=6, num_nodes=4)


# ---- TP plan ----------------------------------------------------------------------------------

def test_plan_for_torchtitan_names():
    plan = infer_tp_plan(Transformer(LlamaConfig.tiny()))
    kinds = {name: type(style).__name__ for name, style in plan.items()}
    assert kinds["tok_embeddings"] == "RowwiseParallel"
    assert kinds["output"] == "ColwiseParallel"
    for proj in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
        assert kinds[f"layers.3.{proj}"] == "ColwiseParallel"
    for proj in ("attention.wo", "feed_forward.w2"):
        assert kinds[f"layers.3.{proj}"] == "RowwiseParallel"
    assert len(plan) == 2 + 4 * 7


def test_plan_for_hf_llama_with_biases():
    from transformers import LlamaConfig as HFConfig, LlamaForCausalLM

    model = LlamaForCausalLM(HFConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, attention_bias=True))
    kinds = {name: type(style).__name__ for name, style in infer_tp_plan(model).items()}
    assert kinds["model.layers.0.self_attn.q_proj"] == "ColwiseParallel"
    assert kinds["model.layers.0.self_attn.o_proj"] == "RowwiseParallel"
    assert kinds["model.layers.0.mlp.down_proj"] == "RowwiseParallel"
    assert kinds["model.embed_tokens"] == "RowwiseParallel" and kinds["lm_head"] == "ColwiseParallel"
    assert tp_widths(model) == (4, 2, 32)


class _Odd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.router = nn.Linear(8, 4)
        self.w1 = nn.Linear(8, 16)


def test_unplaceable_linears_are_listed_with_the_fix():
    # The old suggestion ("qkv": "colwise") fails for fused or consecutive projections (issue 13 item 5): the fix
    # now keeps the blocks holding them whole.
    # Modules outside any layer block are named alone (a "*" glob would replicate an embedding or LM head too).
    with pytest.raises(ValueError, match=r"cannot place these projections: qkv \(8->24\), router \(8->4\)\. "
                                         r".*tp_plan=\{\"qkv\": \"replicate\", \"router\": \"replicate\"\}"):
        infer_tp_plan(_Odd())
    assert set(infer_tp_plan(_Odd(), user_plan={"qkv": "replicate", "router": "replicate"})) == {"w1"}  # the fix


def test_user_plan_places_them():
    plan = infer_tp_plan(_Odd(), user_plan={"qkv": "colwise", "rout*": "replicate"})
    assert set(plan) == {"qkv", "w1"}


def test_user_plan_rejects_unknown_style():
    with pytest.raises(ValueError, match=r"`qkv='diagonal'` is not a ParallelStyle"):
        infer_tp_plan(_Odd(), user_plan={"qkv": "diagonal"})


def test_blocks_found_in_hf_and_torchtitan_models():
    from transformers import LlamaConfig as HFConfig, LlamaForCausalLM

    hf = LlamaForCausalLM(HFConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2))
    assert [n for n, _ in find_blocks(hf)] == ["model.layers.0", "model.layers.1", "model.layers.2"]
    assert len(find_blocks(Transformer(LlamaConfig.tiny()))) == 4


def test_presets_registered_with_lightning():
    from lightning.pytorch.strategies import StrategyRegistry

    for name in ("fsdp2", "hsdp", "tp", "hsdp_tp"):
        assert StrategyRegistry[name]["strategy"] is meshkit.NDParallelStrategy
        assert StrategyRegistry[name]["init_params"] == {"preset": name}


# ---- every collective-free check, before any process group -------------------------------------------------


def test_pp_with_cp_is_refused_before_any_process_group():
    from meshkit.plugins.parallelize import ParallelConfig
    from meshkit.plugins.presets import resolve_layout

    with pytest.raises(ValueError, match=r"`pp=2` with `cp=2` is not supported yet.*Use cp=1 with pp, or pp=1 with cp"):
        resolve_layout(PRESETS["pp"], {**AUTO, "cp": 2}, ParallelConfig(), world_size=4, num_nodes=1,
                       model=Transformer(LlamaConfig.tiny()))
    assert not torch.distributed.is_initialized()


def test_layout_checks_precision_batch_and_ulysses_heads():
    from meshkit.plugins.parallelize import ParallelConfig
    from meshkit.plugins.presets import resolve_layout

    with pytest.raises(ValueError, match=r"`precision='16-mixed'` is not supported"):
        resolve_layout(PRESETS["fsdp2"], AUTO, ParallelConfig(precision="16-mixed"), world_size=4, num_nodes=1)
    with pytest.raises(ValueError, match=r"`global_batch_size=6` is not divisible by the data-parallel size"):
        resolve_layout(PRESETS["fsdp2"], AUTO, ParallelConfig(global_batch_size=6), world_size=4, num_nodes=1)
    model = Transformer(LlamaConfig.tiny(dim=48, n_heads=6, n_kv_heads=6))
    with pytest.raises(ValueError, match=r"`cp_attention='ulysses'` with `cp=4` and `tp=1` needs the heads per TP rank \(6\)"):
        resolve_layout(PRESETS["cp"], AUTO, ParallelConfig(cp_attention="ulysses"), world_size=4, num_nodes=1,
                       model=model)
    dims = resolve_layout(PRESETS["hsdp_tp"], AUTO, ParallelConfig(global_batch_size=8), world_size=8, num_nodes=2)
    assert dims.degrees == {"dp_replicate": 2, "dp_shard": 2, "pp": 1, "cp": 1, "tp": 2}
    assert not torch.distributed.is_initialized()


def test_parallel_config_rejects_bad_settings():
    from meshkit.plugins.parallelize import ParallelConfig

    with pytest.raises(ValueError, match="`activation_checkpointing='some'` must be 'none', 'full' or 'selective'"):
        ParallelConfig(activation_checkpointing="some")
    with pytest.raises(ValueError, match=r"`cp_attention='tree'` must be one of"):
        ParallelConfig(cp_attention="tree")
    assert ParallelConfig(precision="bf16-mixed").mp_policy.param_dtype == torch.bfloat16


def test_one_rank_groups_fall_back_to_torch_s_own_where_its_gloo_internals_are_missing():
    # _singleton_groups_share_a_device uses private torch internals (checked on torch 2.6-2.13); a torch without
    # any of them gets torch's own one-rank groups, not an AttributeError in the middle of building the mesh.
    import types

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from meshkit.plugins import dims as D

    class Options:  # the internals as torch 2.13 has them
        def __init__(self) -> None:
            self._devices = self._threads = self._timeout = None

    class Gloo:
        _Options = Options

        def __init__(self) -> None:
            self.options = types.SimpleNamespace(_devices=["tcp device"])

    class NoThreads(Options):
        def __init__(self) -> None:
            self._devices = self._timeout = None

    class WithoutThreads(Gloo):
        _Options = NoThreads

    class WithoutOptions:
        def __init__(self) -> None:
            self.options = types.SimpleNamespace(_devices=["tcp device"])

    class WithoutDevices(Gloo):
        def __init__(self) -> None:
            self.options = types.SimpleNamespace()

    assert D._gloo_devices(Gloo, Gloo()) == ["tcp device"]
    for cls in (WithoutThreads, WithoutOptions, WithoutDevices):
        assert D._gloo_devices(cls, cls()) is None, cls.__name__
    assert D._gloo_devices(Gloo, object()) is None  # the default group is no gloo group
    assert D._gloo_devices(None, Gloo()) is None  # torch built without gloo

    gloo = c10d.ProcessGroupGloo
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:  # this torch: the internals are there, and the one-rank class is swapped in only inside the context
        assert D._gloo_devices(gloo, c10d._get_default_group()._get_backend(torch.device("cpu")))
        with D._singleton_groups_share_a_device():
            assert c10d.ProcessGroupGloo is not gloo
        assert c10d.ProcessGroupGloo is gloo
    finally:
        dist.destroy_process_group()
