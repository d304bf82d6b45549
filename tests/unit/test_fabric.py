"""The Fabric front door in one process: the registry, the refusals before any collective, the optimizer rules,
and fabric.save/load's record of the state's entries (a one-rank gloo group)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import meshkit
from meshkit.plugins.fabric import NDParallelFabricStrategy, _check_fresh, _names_of, rebind_optimizer

PIPELINE = {name for name, p in meshkit.PRESETS.items() if p.pp}


def _fabric(strategy, devices: int = 4):
    import lightning as L

    return L.Fabric(accelerator="cpu", devices=devices, strategy=strategy)


@pytest.mark.parametrize("name", sorted(meshkit.PRESETS))
def test_every_preset_name_builds_the_fabric_strategy(name):
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    assert STRATEGY_REGISTRY[name]["strategy"] is NDParallelFabricStrategy
    strategy = _fabric(name).strategy
    assert type(strategy) is NDParallelFabricStrategy and strategy.preset.name == name
    if name in PIPELINE:  # refused on every rank before the rendezvous, naming the Trainer and the pp=1 fix
        with pytest.raises(ValueError, match=rf"`pp=\d` is not supported under Fabric.*schedule.step.*"
                                             rf"L.Trainer\(strategy='{name}'\).*NDParallelFabricStrategy\('{name}', pp=1"):
            strategy._resolve(None)
    else:
        dims = strategy._resolve(None)
        assert dims.world_size == 4 and dims.cp_enabled == meshkit.PRESETS[name].cp


def test_an_unknown_preset_is_refused():
    with pytest.raises(ValueError, match=r"unknown `preset='hsdp_tpp'`; choose one of"):
        NDParallelFabricStrategy("hsdp_tpp")


def test_the_fix_of_the_refusal_works():
    # the refusal's fix: pp=1 (explicit sizes) with a pipeline preset
    dims = _fabric(NDParallelFabricStrategy("hsdp_tp_pp", pp=1, tp=2)).strategy._resolve(None)
    assert (dims.pp, dims.tp) == (1, 2)


def test_cp_and_loss_parallel_options_reach_the_config():
    strategy = NDParallelFabricStrategy("hsdp_tp_cp", cp=2, tp=2, loss_parallel=True, cp_attention="allgather",
                                        cp_layout="contiguous")
    c = strategy.parallel_config
    assert (c.loss_parallel, c.cp_attention, c.cp_layout) == (True, "allgather", "contiguous")
    with pytest.raises(ValueError, match=r"`cp_attention='rings'` must be one of"):
        NDParallelFabricStrategy("hsdp_cp", cp_attention="rings")
    with pytest.raises(ValueError, match=r"`loss_parallel=True` needs tensor parallelism, but `tp=1`"):
        _fabric(NDParallelFabricStrategy("fsdp2", loss_parallel=True)).strategy._resolve(None)


def test_rebind_optimizer_follows_names_and_ties():
    emb, head = nn.Embedding(4, 2), nn.Linear(2, 4, bias=False)
    head.weight = emb.weight
    model = nn.ModuleDict({"emb": emb, "head": head, "norm": nn.LayerNorm(2)})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    names = _names_of(model)
    _check_fresh(opt, names, "NDParallelFabricStrategy")
    emb.weight = nn.Parameter(emb.weight.detach().clone())  # what parallelize does (sharded)
    head.weight = emb.weight
    model["norm"].weight = nn.Parameter(model["norm"].weight.detach().clone())
    rebind_optimizer(opt, names, model)
    held = opt.param_groups[0]["params"]
    assert len(held) == 3 and held[0] is emb.weight and held[1] is model["norm"].weight


def test_a_stepped_or_foreign_optimizer_is_refused():
    model = nn.Linear(2, 2)
    names = _names_of(model)
    foreign = torch.optim.SGD([*model.parameters(), nn.Parameter(torch.ones(1))], lr=0.1)
    with pytest.raises(ValueError, match=r"1 parameter\(s\) of SGD \(positions \[2\]\) are not parameters of the model"):
        _check_fresh(foreign, names, "NDParallelFabricStrategy")
    stepped = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    stepped.step()
    with pytest.raises(ValueError, match=r"already holds state for 2 parameter\(s\).*fabric.load"):
        _check_fresh(stepped, names, "NDParallelFabricStrategy")


def test_setup_optimizers_refuses_an_optimizer_built_before_setup_module():
    strategy = NDParallelFabricStrategy(dp_shard=1, tp=1)
    model = nn.Linear(2, 2)
    stale = torch.optim.SGD(model.parameters(), lr=0.1)
    strategy._modules.append(model)
    assert strategy.setup_optimizer(stale) is stale  # the set-up model's own parameters pass
    model.weight = nn.Parameter(model.weight.detach().clone())  # setup_module replaced it
    with pytest.raises(ValueError, match=r"Build the optimizer from `model.parameters\(\)` after `fabric.setup_module"):
        strategy.setup_optimizer(stale)


@pytest.fixture()
def fabric_settings() -> dict:
    """The strategy's settings for :func:`one_rank_fabric` (a test parametrizes it to change them)."""
    return {}


@pytest.fixture()
def one_rank_fabric(tmp_path, monkeypatch, fabric_settings):
    """A launched one-process Fabric under the meshkit strategy (a one-rank gloo group, torn down after)."""
    import torch.distributed as dist

    from tests.dist_pool import free_port

    for key in ("LOCAL_RANK", "NODE_RANK", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    fabric = _fabric(NDParallelFabricStrategy(dp_shard=1, tp=1, **fabric_settings), devices=1)
    fabric.launch()
    try:
        yield fabric
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_save_load_checks_the_state_entries(one_rank_fabric, tmp_path):
    from meshkit.plugins.checkpoint import CheckpointError

    fabric = one_rank_fabric
    torch.manual_seed(0)
    model = fabric.setup_module(nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3)))
    opt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    model(torch.ones(2, 3)).sum().backward()
    opt.step()
    path = tmp_path / "ckpt"
    with pytest.raises(ValueError, match=r"filter=.*not supported"):
        fabric.save(path, {"model": model}, filter={"model": lambda k, v: True})
    fabric.save(path, {"model": model, "optimizer": opt, "step": 7})
    assert (path / "meshkit.json").is_file()
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    state = {"model": model, "optimizer": opt, "step": 0}
    assert fabric.load(path, state) == {}
    assert state["step"] == 7
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, saved[k], rtol=0, atol=0)
    with pytest.raises(CheckpointError, match=r"saved from the state entries model 'model' and optimizers \['optimizer'\]"):
        fabric.load(path, {"net": model, "optimizer": opt})
    with pytest.raises(KeyError, match="epoch"):
        fabric.load(path, {"model": model, "optimizer": opt, "epoch": 0})
    # no unpickling: an object outside torch's weights_only allowlist is refused unless the caller trusts the file
    import argparse

    from meshkit.plugins.checkpoint import UnsafeCheckpointError

    fabric.save(path, {"model": model, "args": argparse.Namespace(lr=0.1)})
    with pytest.raises(UnsafeCheckpointError, match=r"fabric.load\(path, state, weights_only=False\)"):
        fabric.load(path, {"model": model, "args": None})
    trusted = {"model": model, "args": None}
    fabric.load(path, trusted, weights_only=False)
    assert trusted["args"].lr == 0.1
    with pytest.raises(ValueError, match=r"needs exactly one model in the state \(found none\)"):
        fabric.save(path, {"step": 1})
    with pytest.raises(ValueError, match=r"needs the state to restore"):
        fabric.load(path)


@pytest.mark.parametrize("fabric_settings", [{}, {"allow_unverified": True}], ids=["default", "allow_unverified"])
def test_fabric_load_honours_allow_unverified(one_rank_fabric, fabric_settings, tmp_path):
    """A folder without its integrity record: refused, naming the Fabric opt-in; loaded with it (it was ignored)."""
    from meshkit.plugins.checkpoint import CheckpointError

    fabric = one_rank_fabric
    torch.manual_seed(0)
    model = fabric.setup_module(nn.Linear(3, 3))
    fabric.save(tmp_path / "ckpt", {"model": model})
    (tmp_path / "ckpt" / "meshkit.json").unlink()
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    if not fabric_settings:
        with pytest.raises(CheckpointError, match=r"NDParallelFabricStrategy\(allow_unverified=True\)` for `fabric.load"):
            fabric.load(tmp_path / "ckpt", {"model": model})
        return
    assert fabric.load(tmp_path / "ckpt", {"model": model}) == {}
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, saved[k], rtol=0, atol=0)


def test_fabric_mfu_times_fabric_save_and_validation(one_rank_fabric, tmp_path):
    import time

    from meshkit.profiling.fabric import FabricMFU

    fabric = one_rank_fabric
    model = fabric.setup_module(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)))
    opt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    mfu = FabricMFU(fabric, model, profile_every=0, peak_flops=1e12, tokens_fn=lambda b: b.shape[0])
    with pytest.raises(ValueError, match="must be 'validation' or 'checkpoint'"):
        with mfu.phase("eval"):
            pass
    for b in range(5):
        if b == 3:
            fabric.save(tmp_path / "ckpt", {"model": model, "optimizer": opt})  # timed: the checkpoint bucket
        if b == 4:
            with mfu.phase("validation"):
                time.sleep(0.02)
        batch = torch.ones(4, 8)
        with mfu.step(batch):
            fabric.backward(model(batch).sum())
            mfu.before_optimizer_step()
            opt.step()
            opt.zero_grad()
    mfu.close()
    assert "save" not in vars(fabric)  # fabric.save is the class's method again
    steps = {m.step: m.breakdown for m in mfu.history}
    assert sorted(steps) == [2, 3, 4]  # after the FLOP-counted batch 1, as MFUMonitor
    assert steps[3]["checkpoint"] > 0 and steps[2]["checkpoint"] == steps[4]["checkpoint"] == 0
    assert steps[4]["validation"] > 0 and steps[3]["validation"] == 0
    assert all(m.mfu > 0 and sum(m.breakdown.values()) == pytest.approx(1.0) for m in mfu.history)
    fit = mfu.monitor.fit_time_s  # every second since FabricMFU began, in a step or between steps, once
    assert fit["n_steps"] == 4 and abs(fit["accounted"] - fit["wall"]) <= 1e-6 + 0.02 * fit["wall"], fit
    assert fit["steps"]["checkpoint"] > 0 and fit["steps"]["validation"] >= 0.02 and fit["between_steps"]["setup"] > 0
