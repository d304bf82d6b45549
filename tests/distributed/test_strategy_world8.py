"""hsdp_tp at world 8 (2 simulated nodes × 4 processes): 2 × 2 × 2 against one process."""

from __future__ import annotations

import pytest
import torch

from tests.dist_pool import ProcessPool
from tests.distributed import training as T

STEPS = 5


@pytest.fixture(scope="module")
def pool():
    with ProcessPool(world_size=8, devices_per_node=4) as p:
        yield p


def _fit_with_groups(rank: int, world: int) -> dict:
    import lightning as L
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    import meshkit  # noqa: F401

    T.launcher_env(rank, 4)
    module = T.build_module("meshkit")
    recorder = T.LossRecorder()
    trainer = L.Trainer(
        accelerator="cpu", devices=4, num_nodes=2, strategy="hsdp_tp", max_steps=STEPS, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[recorder],
    )
    trainer.fit(module, DataLoader(T.tokens(STEPS * T.PER_RANK_BATCH * world), batch_size=T.PER_RANK_BATCH))
    dims = trainer.strategy.parallel_dims
    groups = {a: dist.get_process_group_ranks(dims.mesh[a].get_group()) for a in ("dp_replicate", "dp_shard", "tp")}
    wq = module.model.layers["0"].attention.wq.weight
    return {
        "losses": recorder.losses, "degrees": dims.degrees, "dp_rank": dims.submesh("dp").get_local_rank(),
        "groups": groups, "params": T.full_params(module),
        "wq": (tuple(wq.device_mesh.mesh_dim_names), tuple(str(p) for p in wq.placements)),
    }


def test_hsdp_tp_2x2x2_matches_one_process(pool):
    results = pool.run(_fit_with_groups)
    assert results[0]["degrees"] == {"dp_replicate": 2, "dp_shard": 2, "pp": 1, "cp": 1, "tp": 2}
    # tp pairs are consecutive ranks inside a node; dp_shard stays inside a node; dp_replicate crosses nodes.
    assert results[0]["groups"] == {"dp_replicate": [0, 4], "dp_shard": [0, 2], "tp": [0, 1]}
    assert results[5]["groups"] == {"dp_replicate": [1, 5], "dp_shard": [5, 7], "tp": [4, 5]}
    assert results[0]["wq"] == (("dp_replicate", "dp_shard", "tp"), ("R", "_S(0, 2)", "S(0)"))
    want_losses, want_params = T.reference("meshkit", STEPS, 4, world=8)
    torch.testing.assert_close(torch.tensor(T.global_losses(results)), torch.tensor(want_losses), rtol=1e-4, atol=0)
    T.assert_params_close(results[0]["params"], want_params)


# ---- context parallelism (meshkit.plugins.context_parallel) -------------------------------------------
def _fit_hsdp_tp_cp(rank: int, world: int) -> dict:
    return T.fit(rank, world, "hsdp_tp_cp", devices=4, num_nodes=2, steps=STEPS)


def test_hsdp_tp_cp_2x2x2_matches_one_process(pool):
    results = pool.run(_fit_hsdp_tp_cp)
    assert results[0]["degrees"] == {"dp_replicate": 2, "dp_shard": 1, "pp": 1, "cp": 2, "tp": 2}
    axes, places = results[0]["placements"]["model.layers.0.attention.wq.weight"]
    assert axes == ("dp_replicate", "dp_shard_cp", "tp") and places[1:] == ("_S(0, 2)", "S(0)"), (axes, places)
    want_losses, want_params = T.reference("meshkit", STEPS, 2, world=8)
    torch.testing.assert_close(torch.tensor(T.global_losses(results)), torch.tensor(want_losses), rtol=1e-4, atol=0)
    T.assert_params_close(results[0]["params"], want_params)


PP_CASES = [
    # (id, strategy kwargs, expected degrees) on 2 simulated nodes × 4 processes
    ("tp_pp", dict(preset="tp_pp", dp_shard=2, pp=2, tp=2), dict(dp_replicate=1, dp_shard=2, pp=2, tp=2)),
    ("hsdp_tp_pp", dict(preset="hsdp_tp_pp"), dict(dp_replicate=2, dp_shard=1, pp=2, tp=2)),
]


def _fit_pp(rank: int, world: int, strategy: dict) -> dict:
    import meshkit

    return T.fit(rank, world, meshkit.NDParallelStrategy(**strategy), devices=4, num_nodes=2, steps=STEPS)


@pytest.mark.parametrize("case", PP_CASES, ids=[c[0] for c in PP_CASES])
def test_pipeline_compositions_match_one_process(pool, case):
    _, strategy, degrees = case
    results = pool.run(_fit_pp, strategy)
    assert {k: results[0]["degrees"][k] for k in degrees} == degrees
    want_losses, want_params = T.reference("meshkit", STEPS, results[0]["dp_size"], world=8)
    torch.testing.assert_close(torch.tensor(T.global_losses(results)), torch.tensor(want_losses), rtol=1e-4, atol=0)
    merged: dict[str, torch.Tensor] = {}
    for r in results:  # each pipeline stage holds its own blocks, under the full model's names
        merged.update(r["params"])
    T.assert_params_close(merged, want_params)
