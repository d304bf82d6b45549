"""NDParallelStrategy on 4 gloo processes: every preset and Trainer flag against one process."""

from __future__ import annotations

import os
import tempfile
from typing import Any

import pytest
import torch

from tests.dist_pool import ProcessPool
from tests.distributed import training as T

STEPS = 5


@pytest.fixture(scope="module")
def pool():
    with ProcessPool(world_size=4) as p:
        yield p


def _fit(rank: int, world: int, strategy: Any, devices: int, num_nodes: int, kind: str, kwargs: dict,
         steps: int = STEPS) -> dict:
    import meshkit

    if isinstance(strategy, dict):
        strategy = meshkit.NDParallelStrategy(**strategy)
    return T.fit(rank, world, strategy, devices=devices, num_nodes=num_nodes, steps=steps, kind=kind, **kwargs)


# (id, strategy, devices per node, nodes, model, expected degrees, param -> (mesh axes, placements))
CASES = [
    ("fsdp2", "fsdp2", 4, 1, "meshkit", dict(dp_replicate=1, dp_shard=4, tp=1),
     {"model.layers.0.attention.wq.weight": (("dp_shard",), ("S(0)",))}),
    ("hsdp", "hsdp", 2, 2, "meshkit", dict(dp_replicate=2, dp_shard=2, tp=1),
     {"model.layers.0.attention.wq.weight": (("dp_replicate", "dp_shard"), ("R", "S(0)"))}),
    ("tp", {"preset": "tp", "tp": 4}, 4, 1, "mha", dict(dp_replicate=1, dp_shard=1, tp=4),
     {"model.layers.0.attention.wq.weight": (("tp",), ("S(0)",)),
      "model.layers.0.attention.wo.weight": (("tp",), ("S(1)",)),
      "model.tok_embeddings.weight": (("tp",), ("S(0)",))}),
    ("hsdp_tp", "hsdp_tp", 4, 1, "meshkit", dict(dp_replicate=1, dp_shard=2, tp=2),
     {"model.layers.0.attention.wq.weight": (("dp_shard", "tp"), ("_S(0, 2)", "S(0)")),
      "model.layers.0.feed_forward.w2.weight": (("dp_shard", "tp"), ("S(0)", "S(1)")),
      "model.norm.weight": (("dp_shard",), ("S(0)",))}),
    ("hf_hsdp_tp", "hsdp_tp", 4, 1, "hf", dict(dp_replicate=1, dp_shard=2, tp=2),
     {"model.model.layers.0.self_attn.q_proj.weight": (("dp_shard", "tp"), ("_S(0, 2)", "S(0)")),
      "model.lm_head.weight": (("dp_shard", "tp"), ("_S(0, 2)", "S(0)"))}),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_preset_matches_one_process(pool, case):
    _, strategy, devices, nodes, kind, degrees, placements = case
    results = pool.run(_fit, strategy, devices, nodes, kind, {})
    for key, value in degrees.items():
        assert results[0]["degrees"][key] == value
    losses = T.global_losses(results)
    want_losses, want_params = T.reference(kind, STEPS, results[0]["dp_size"])
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-4, atol=0)
    T.assert_params_close(results[0]["params"], want_params)
    for name, (axes, places) in placements.items():
        got_axes, got_places = results[0]["placements"][name]
        assert got_axes == axes and tuple(p.replace("Replicate()", "R") for p in got_places) == places, (
            name, got_axes, got_places)


OPTION_CASES = [
    ("sequence_parallel", dict(dp_shard=2, tp=2, sequence_parallel=True), {}, "meshkit", STEPS),
    ("loss_parallel", dict(dp_shard=2, tp=2, loss_parallel=True), {}, "meshkit", STEPS),
    ("ac_full", dict(dp_shard=2, tp=2, activation_checkpointing="full"), {}, "meshkit", STEPS),
    ("ac_selective", dict(dp_shard=2, tp=2, activation_checkpointing="selective"), {}, "meshkit", STEPS),
    ("zero2", dict(dp_shard=4, tp=1, reshard_after_forward=False), {}, "meshkit", STEPS),
    # The kernels themselves are checked under TP/SP/FSDP in test_kernels_tp.py; this case proves the option
    # wires them in. Under TRITON_INTERPRET every program runs in Python (5 steps of 4 blocks took ~100 s), so
    # one block and 2 steps: step 2's loss is computed with step 1's update, the final parameters hold both.
    ("fused_kernels", dict(dp_shard=2, tp=2, fused_kernels=True), {}, "meshkit1", 2),
]
FUSED_ONE_BLOCK = ["loss", "rms_norm", "rms_norm", "rms_norm", "rope", "swiglu"]
"""What apply_fused_kernels patches in meshkit's Llama with one block (two block norms and the final norm)."""


@pytest.mark.parametrize("case", OPTION_CASES, ids=[c[0] for c in OPTION_CASES])
def test_options_match_one_process(pool, case):
    _, strategy, trainer_kwargs, kind, steps = case
    results = pool.run(_fit, strategy, 4, 1, kind, trainer_kwargs, steps=steps)
    want_losses, want_params = T.reference(kind, steps, results[0]["dp_size"])
    torch.testing.assert_close(torch.tensor(T.global_losses(results)), torch.tensor(want_losses), rtol=1e-4, atol=0)
    T.assert_params_close(results[0]["params"], want_params)
    fused = strategy.get("fused_kernels", False)
    for r in results:  # the kernels really ran: modules patched, and Triton (the interpreter on CPU) chosen for them
        assert r["fused"] == (FUSED_ONE_BLOCK if fused else []), r["fused"]
        assert r["triton"] or not fused


def test_gradient_clipping_uses_global_norm(pool):
    # 0.05 is far below the gradient norm, so every step clips: a per-rank norm would give other updates.
    results = pool.run(_fit, dict(dp_shard=2, tp=2), 4, 1, "meshkit", {"gradient_clip_val": 0.05})
    want_losses, want_params = T.reference("meshkit", STEPS, results[0]["dp_size"], clip=0.05)
    torch.testing.assert_close(torch.tensor(T.global_losses(results)), torch.tensor(want_losses), rtol=1e-4, atol=0)
    T.assert_params_close(results[0]["params"], want_params)


def test_accumulate_grad_batches_skips_reduction(pool):
    results = pool.run(_fit, dict(dp_shard=2, tp=2), 4, 1, "meshkit", {"accumulate_grad_batches": 2})
    want_losses, want_params = T.reference("meshkit", STEPS, results[0]["dp_size"], accumulate=2)
    # Lightning reports each micro-batch's loss already divided by accumulate_grad_batches.
    got = torch.tensor(T.global_losses(results)) * 2
    torch.testing.assert_close(got, torch.tensor(want_losses), rtol=1e-4, atol=0)
    T.assert_params_close(results[0]["params"], want_params)
    # After the first micro-step FSDP2 has reduced nothing: sharded gradients do not exist yet.
    assert all(r["grad_none_after_first_microstep"] for r in results)


# ---- checkpoints -------------------------------------------------------------------------------

def _epochs(rank: int, world: int, dims: dict, ckpt_dir: str, resume: str | None) -> dict:
    """Two epochs of 3 steps (dp=2, 2 sequences per rank), a sharded checkpoint after each."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader

    import meshkit

    T.launcher_env(rank, 4)
    module = T.build_module("mha")
    recorder = T.LossRecorder()
    ckpt = ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1, every_n_epochs=1)
    trainer = L.Trainer(
        accelerator="cpu", devices=4, strategy=meshkit.NDParallelStrategy(**dims), max_epochs=2, logger=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[recorder, ckpt],
    )
    dp = dims.get("dp_shard", 1)
    trainer.fit(module, DataLoader(T.tokens(3 * T.PER_RANK_BATCH * dp), batch_size=T.PER_RANK_BATCH), ckpt_path=resume)
    return {"losses": recorder.losses, "params": T.full_params(module), "global_step": trainer.global_step}


def _load_only(rank: int, world: int, dims: dict, path: str) -> dict:
    """Restore ``path`` under another layout without training further (max_steps already reached)."""
    import lightning as L
    from torch.utils.data import DataLoader

    import meshkit

    T.launcher_env(rank, 4)
    module = T.build_module("mha", seed=123)  # different init: everything must come from the checkpoint
    trainer = L.Trainer(
        accelerator="cpu", devices=4, strategy=meshkit.NDParallelStrategy(**dims), max_steps=6, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    )
    trainer.fit(module, DataLoader(T.tokens(16), batch_size=T.PER_RANK_BATCH), ckpt_path=path)
    return {"params": T.full_params(module), "degrees": trainer.strategy.parallel_dims.degrees,
            "global_step": trainer.global_step}


@pytest.fixture(scope="module")
def saved_run(pool, tmp_path_factory):
    ckpt_dir = str(tmp_path_factory.mktemp("ckpt"))
    full = pool.run(_epochs, dict(dp_shard=2, tp=2), ckpt_dir, None)
    return ckpt_dir, full


def test_resume_is_bitwise_identical(pool, saved_run):
    ckpt_dir, full = saved_run
    first = os.path.join(ckpt_dir, "epoch=0-step=3.ckpt")
    assert os.path.isdir(first), os.listdir(ckpt_dir)
    with tempfile.TemporaryDirectory() as other:
        resumed = pool.run(_epochs, dict(dp_shard=2, tp=2), other, first)
    for a, b in zip(full, resumed):
        assert b["global_step"] == 6
        assert b["losses"] == a["losses"][3:], (a["losses"], b["losses"])
        for name, tensor in a["params"].items():
            assert torch.equal(tensor, b["params"][name]), name


@pytest.mark.parametrize("dims", [dict(dp_shard=4, tp=1), dict(dp_shard=1, tp=4), dict(dp_replicate=2, dp_shard=2)],
                         ids=["dp_shard4", "tp4", "hsdp2x2"])
def test_resume_under_another_layout(pool, saved_run, dims):
    ckpt_dir, full = saved_run
    last = os.path.join(ckpt_dir, "epoch=1-step=6.ckpt")
    loaded = pool.run(_load_only, dims, last)
    assert loaded[0]["global_step"] == 6
    for name, tensor in full[0]["params"].items():
        assert torch.equal(tensor, loaded[0]["params"][name]), name


def test_consolidate_checkpoint_for_export(saved_run, tmp_path):
    from meshkit.cli import main
    from meshkit.models.llama import LlamaConfig, Transformer

    ckpt_dir, full = saved_run
    out = tmp_path / "model.pt"
    assert main(["consolidate", os.path.join(ckpt_dir, "epoch=1-step=6.ckpt"), str(out), "--strip-prefix", "model."]) == 0
    weights = torch.load(out, weights_only=True)
    net = Transformer(LlamaConfig.tiny(vocab_size=T.VOCAB, n_kv_heads=4))
    net.load_state_dict(weights)  # strict: every name present, nothing extra
    for name, tensor in full[0]["params"].items():
        assert torch.equal(weights[name.removeprefix("model.")], tensor), name


def test_consolidate_rejects_a_non_checkpoint(tmp_path):
    from meshkit.plugins.checkpoint import consolidate_checkpoint

    with pytest.raises(ValueError, match="not a sharded .DCP. checkpoint folder"):
        consolidate_checkpoint(tmp_path)


# ---- meta init, configure_model, eval loops, LightningCLI -------------------------------------

def _meta_init(rank: int, world: int) -> dict:
    import lightning as L
    from torch.distributed.tensor import DTensor
    from torch.utils.data import DataLoader

    import meshkit

    T.launcher_env(rank, 4)
    trainer = L.Trainer(
        accelerator="cpu", devices=4, strategy=meshkit.NDParallelStrategy(dp_shard=2, tp=2), max_steps=2,
        logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    )
    with trainer.init_module(empty_init=True):
        module = T.build_module("meshkit")
    was_meta = all(p.is_meta for p in module.parameters())
    recorder = T.LossRecorder()
    trainer.callbacks.append(recorder)
    trainer.fit(module, DataLoader(T.tokens(16), batch_size=T.PER_RANK_BATCH))
    params = T.full_params(module)
    return {
        "was_meta": was_meta,
        "any_meta": any(p.is_meta for p in module.parameters()),
        "all_dtensor": all(isinstance(p, DTensor) for p in module.parameters()),
        "losses": recorder.losses,
        "norm_weight": params["model.norm.weight"],
        "wq_std": float(params["model.layers.0.attention.wq.weight"].std()),
    }


def test_meta_device_init_materializes_per_shard(pool):
    results = pool.run(_meta_init)
    for r in results:
        assert r["was_meta"] and not r["any_meta"] and r["all_dtensor"]
        assert all(torch.isfinite(torch.tensor(r["losses"])))
        # reset_parameters ran on each shard: nn.Linear's kaiming-uniform bound 1/sqrt(64) gives std 0.072
        assert 0.05 < r["wq_std"] < 0.1, r["wq_std"]
    # the first step's update moved the norm weight away from its reset value of 1, the same on every rank
    assert not torch.equal(results[0]["norm_weight"], torch.ones(64))
    assert all(torch.equal(r["norm_weight"], results[0]["norm_weight"]) for r in results)


def _configure_model(rank: int, world: int) -> dict:
    import lightning as L
    from torch.distributed.tensor import DTensor
    from torch.utils.data import DataLoader

    import meshkit

    T.launcher_env(rank, 4)
    module = T.ConfigureModelLM()
    recorder = T.LossRecorder()
    trainer = L.Trainer(
        accelerator="cpu", devices=4, strategy="fsdp2", max_steps=2, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, callbacks=[recorder],
    )
    trainer.fit(module, DataLoader(T.tokens(16), batch_size=T.PER_RANK_BATCH))
    return {
        "mesh": module.configured_with,
        "placements": {str(p.placements) for p in module.parameters() if isinstance(p, DTensor)},
        "losses": recorder.losses,
        "meta": any(p.is_meta for p in module.parameters()),
    }


def test_configure_model_is_called_with_the_mesh(pool):
    results = pool.run(_configure_model)
    assert results[0]["mesh"] == ("dp_replicate", "dp_shard", "pp", "cp", "tp")
    assert results[0]["placements"] == {"(Shard(dim=0),)"}
    assert not results[0]["meta"] and len(results[0]["losses"]) == 2


def _eval_loops(rank: int, world: int) -> dict:
    import lightning as L
    from torch.utils.data import DataLoader

    import meshkit

    T.launcher_env(rank, 4)
    module = T.build_module("meshkit")
    trainer = L.Trainer(
        accelerator="cpu", devices=4, strategy=meshkit.NDParallelStrategy(dp_shard=2, tp=2), max_steps=STEPS,
        logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    )
    trainer.fit(module, DataLoader(T.tokens(STEPS * 8), batch_size=T.PER_RANK_BATCH))
    val_data = T.tokens(8 + 40)[40:]
    val = trainer.validate(module, DataLoader(val_data, batch_size=T.PER_RANK_BATCH), verbose=False)
    test = trainer.test(module, DataLoader(val_data, batch_size=T.PER_RANK_BATCH), verbose=False)
    return {"val": val[0]["val_loss"], "test": test[0]["test_loss"]}


def test_validation_and_test_loops_match_one_process(pool):
    results = pool.run(_eval_loops)
    _, params = T.reference("meshkit", STEPS, 2)
    ref = T.build_module("meshkit")
    ref.load_state_dict(params)
    with torch.no_grad():
        want = float(T.module_loss(ref, T.tokens(8 + 40)[40:]))
    for r in results:
        assert r["val"] == pytest.approx(want, rel=1e-4)
        assert r["test"] == pytest.approx(want, rel=1e-4)


def _cli(rank: int, world: int) -> dict:
    from lightning.pytorch.cli import LightningCLI

    import meshkit  # noqa: F401
    from meshkit.models.llama import LlamaLM, TokenDataModule

    T.launcher_env(rank, 4)
    cli = LightningCLI(
        LlamaLM, TokenDataModule, save_config_callback=None,
        args=["fit", "--trainer.strategy=hsdp_tp", "--trainer.accelerator=cpu", "--trainer.devices=4",
              "--trainer.max_steps=2", "--trainer.logger=false", "--trainer.enable_checkpointing=false",
              "--trainer.enable_progress_bar=false", "--data.num_sequences=32", "--data.seq_len=16",
              "--data.batch_size=2"],
    )
    return {"type": type(cli.trainer.strategy).__name__, "degrees": cli.trainer.strategy.parallel_dims.degrees,
            "step": cli.trainer.global_step}


def test_lightning_cli_strategy_flag(pool):
    results = pool.run(_cli)
    assert results[0] == {"type": "NDParallelStrategy", "step": 2,
                          "degrees": {"dp_replicate": 1, "dp_shard": 2, "pp": 1, "cp": 1, "tp": 2}}


# ---- the roll call among real ranks (meshkit.plugins.rendezvous, no Trainer) ---------------------------------

def _roll_call(rank: int, world: int, port: int, arrive: list[int], devices: int, timeout_s: float) -> Any:
    """``rendezvous`` on a fresh store at ``port`` by the ranks in ``arrive`` (the others never come)."""
    from datetime import timedelta

    from meshkit.plugins.rendezvous import rendezvous

    if rank not in arrive:
        return None
    started: list[int] = []

    def init_process_group() -> None:  # as torch's does on the same store: rank 0's server stays until all joined
        import time

        from torch.distributed import TCPStore

        store = TCPStore("127.0.0.1", port, None, is_master=rank == 0, timeout=timedelta(seconds=30),
                         wait_for_workers=False, multi_tenant=True)
        joined = store.add("test/joined", 1)
        while rank == 0 and joined < len(arrive):
            time.sleep(0.01)
            joined = store.add("test/joined", 0)
        started.append(rank)

    try:
        rendezvous(init_process_group, address="127.0.0.1", port=port, rank=rank, devices=devices,
                   num_nodes=world // devices, timeout=timedelta(seconds=timeout_s))
    except RuntimeError as e:
        return {"error": str(e), "started": started}
    return {"started": started}


def test_roll_call_of_every_rank_starts_the_process_group(pool):
    from tests.dist_pool import free_port

    assert pool.run(_roll_call, free_port(), [0, 1, 2, 3], 4, 30) == [{"started": [r]} for r in range(4)]


def test_roll_call_names_the_ranks_that_never_came_on_every_rank_that_did(pool):
    # num_nodes=2 with node 1 never started: ranks 2, 3 missing; ranks 0 and 1 raise the same error, start nothing
    from tests.dist_pool import free_port

    got = pool.run(_roll_call, free_port(), [0, 1], 2, 3)
    assert got[2:] == [None, None] and got[0] == got[1] and got[0]["started"] == []
    assert got[0]["error"].startswith("NDParallelStrategy: the process-group rendezvous did not complete within "
                                      "`timeout=0:00:03`: ranks 2, 3 of 4 did not join at 127.0.0.1:")
    assert "(ranks 0, 1 did). `devices=2` × `num_nodes=2` need 4 processes" in got[0]["error"]
    # then the whole job on another store completes: each store counts its own roll calls, so the ranks that came
    # to the first one and those that did not agree on the second's keys (a per-process count made them differ)
    assert pool.run(_roll_call, free_port(), [0, 1, 2, 3], 4, 30) == [{"started": [r]} for r in range(4)]


# ---- the checkpoint functions without a Trainer (what a Fabric strategy calls) ----------------------------

def _plain_save_then_load(rank: int, world: int, root: str) -> dict:
    """Save at dp_shard=4 with meshkit.plugins.checkpoint's functions alone, load at dp_shard=2 x tp=2."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from meshkit.models.llama import LlamaConfig, Transformer
    from meshkit.plugins import checkpoint as ckpt
    from meshkit.plugins.dims import ParallelDims
    from meshkit.plugins.parallelize import parallelize

    def build(seed: int, **sizes: int) -> tuple:
        torch.manual_seed(seed)
        dims = ParallelDims(**sizes, world_size=world)
        dims.build_mesh("cpu")
        net = parallelize(Transformer(LlamaConfig.tiny(vocab_size=T.VOCAB, n_kv_heads=4)), dims)
        return net, torch.optim.AdamW(net.parameters(), lr=1e-2)

    net, opt = build(0, dp_shard=4)
    net(T.tokens(2)[:, :-1]).float().pow(2).mean().backward()
    opt.step()  # optimizer state to save
    path = os.path.join(root, "plain.ckpt")
    ckpt.save_checkpoint(path, get_model_state_dict(net), [ckpt.flat_optimizer_state(net, opt)], {"step": 1},
                         tied=ckpt.tied_aliases(net))
    saved = T.full_params(net)
    fresh, fresh_opt = build(1, dp_shard=2, tp=2)
    meta = ckpt.load_checkpoint(path, fresh, [fresh_opt])
    got = T.full_params(fresh)
    return {"meta": meta, "equal": sorted(n for n in saved if torch.equal(saved[n], got[n])), "names": sorted(saved),
            "steps": sorted({int(s["step"]) for s in fresh_opt.state.values()})}


def test_checkpoint_functions_save_and_reshard_without_a_trainer(pool, tmp_path):
    got = pool.run(_plain_save_then_load, str(tmp_path))  # one machine: every rank sees tmp_path
    assert got[0]["meta"] == {"step": 1, "meshkit_tied_weights": {}}
    for r in got:
        assert r["equal"] == r["names"] and r["steps"] == [1], r


def _mesh_groups(rank: int, world: int, timeout_s: int) -> dict:
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from meshkit.plugins.dims import AXES, ParallelDims

    before = set(c10d._world.pg_map)
    dims = ParallelDims(dp_shard=2, tp=2, world_size=world)
    dims.build_mesh("cpu", timeout=timedelta(seconds=timeout_s))  # a timeout no other test uses: a new mesh
    made = set(c10d._world.pg_map) - before
    axes = {a: dims.submesh(a) for a in AXES + ("dp", "dp_shard_cp", "dp_cp")}
    axes.update({a: dims.mesh[a] for a in ("data_parallel", "tensor_parallel")})
    sums = {}
    for name, mesh in axes.items():  # each axis's group reduces over exactly that axis's ranks
        x = torch.tensor([float(rank)])
        dist.all_reduce(x, group=mesh.get_group())
        sums[name] = (x.item(), float(sum(mesh.mesh.flatten().tolist())))
    cpu = torch.device("cpu")
    default_device = c10d._get_default_group()._get_backend(cpu).options._devices[0]
    shares = {a: m.get_group()._get_backend(cpu).options._devices[0] is default_device for a, m in axes.items()}
    return {"made": len(made), "sums": sums, "shares_default_device": shares,
            "timeouts": {a: m.get_group()._get_backend(torch.device("cpu")).options._timeout.total_seconds()
                         for a, m in axes.items()}}


def test_mesh_makes_one_group_per_rank_set(pool):
    # dp_shard=2 x tp=2: every axis is in the mesh and dp, dp_shard_cp, dp_cp, data_parallel span dp_shard's ranks,
    # so 3 rank sets (this rank alone, its dp_shard pair, its tp pair) need 3 groups; torch made 10 (each gloo group's
    # event loop wakes every 10 ms, idle or not: issue 28's step-time regression).
    for r in pool.run(_mesh_groups, 77):
        assert r["made"] == 3, r
        assert all(got == want for got, want in r["sums"].values()), r["sums"]
        assert set(r["timeouts"].values()) == {77.0}, r["timeouts"]  # Lightning's names get `timeout=` too
        # the one-rank group (dp_replicate, pp, cp) runs on the default group's gloo device: no event loop of its
        # own; the 2-rank groups connect, on their own devices
        shared = {a for a, same in r["shares_default_device"].items() if same}
        assert shared == {"dp_replicate", "pp", "cp"}, r["shares_default_device"]
