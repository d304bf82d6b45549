"""meshkit.Doctor in real gloo runs: one 4-rank pool as 2 simulated nodes × 2 ranks for the module.

Each run is a tiny fit of a few steps; one test per finding CPU can show (tp across nodes, an
unbalanced pp split with m < 2p, a sleeping rank, an unused parameter, identical batches on every
dp rank, one FSDP unit, a changed global batch between two runs in one log dir), each asserting the
id and the evidence, and a healthy run asserting nothing above "info"."""

from __future__ import annotations

import json
import os
import time

import pytest

from tests.dist_pool import ProcessPool

NODES, PER_NODE = 2, 2
SEQ, BATCH, LR = 16, 2, 0.5


@pytest.fixture(scope="module")
def pool():
    with ProcessPool(world_size=NODES * PER_NODE, devices_per_node=PER_NODE) as p:
        yield p


def _fit(module, strategy, root, data, steps, callbacks=(), **kw):
    import lightning as L
    from lightning.pytorch.loggers import TensorBoardLogger

    import meshkit

    doctor = meshkit.Doctor(print_report=False)
    trainer = L.Trainer(accelerator="cpu", devices=PER_NODE, num_nodes=NODES, strategy=strategy, max_steps=steps,
                        logger=TensorBoardLogger(root, name="run"), callbacks=[*callbacks, doctor],
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        log_every_n_steps=1, limit_val_batches=0, **kw)
    trainer.fit(module, data)
    return {"findings": [f.to_dict() for f in doctor.findings], "log_dir": doctor._log_dir}


def _llama(**cfg):
    import torch

    from meshkit.models import LlamaConfig, LlamaLM

    torch.manual_seed(0)
    return LlamaLM(LlamaConfig.tiny(**cfg), lr=LR, optimizer="sgd")


def _tokens(n):
    import torch

    from meshkit.models import synthetic_tokens

    return torch.utils.data.DataLoader(synthetic_tokens(n, SEQ, 256), batch_size=BATCH)


def _by_id(result):
    return {f["id"]: f for f in result["findings"]}


# ---- bodies (module level: the pool imports them by name) -----------------------------------------------


def _tp_across(rank, world, root):
    import meshkit

    strategy = meshkit.NDParallelStrategy(dp_replicate=1, dp_shard=1, tp=4)  # tp=4 over 2 nodes of 2
    return _fit(_llama(n_kv_heads=4), strategy, root, _tokens(8 * BATCH), steps=2)


def _healthy(rank, world, root):
    import meshkit

    mon = meshkit.MFUMonitor(profile_every=0, tokens_fn=lambda b: b[:, :-1].numel())
    # hsdp_tp on 2 nodes x 2: dp_replicate=2 across nodes, tp=2 inside each node
    return _fit(_llama(), "hsdp_tp", root, _tokens(2 * 8 * BATCH), steps=8, callbacks=[mon])


class _Slow:
    """A map-style dataset whose rank-3 reads sleep: that rank arrives late at every step."""

    def __init__(self, data, rank, sleep_s):
        self.data, self.sleep = data, sleep_s if rank == 3 else 0.0

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        time.sleep(self.sleep / BATCH)
        return self.data[i]


def _sick_module():
    import lightning as L
    import torch
    from torch import nn

    class Flat(L.LightningModule):
        """No repeated blocks (one FSDP unit), and a parameter forward never uses."""

        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
            self.unused = nn.Linear(4, 4)

        def training_step(self, batch, batch_idx):
            return self.net(batch).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR)

    torch.manual_seed(0)
    return Flat()


def _sick(rank, world, root):
    import torch

    import meshkit

    torch.manual_seed(0)
    data = _Slow(torch.randn(64, 8), rank, sleep_s=0.25)
    loader = torch.utils.data.DataLoader(data, batch_size=2 * BATCH)  # global batch 4 ranks x 4 = 16
    # use_distributed_sampler=False: every rank reads the same batches
    return _fit(_sick_module(), meshkit.NDParallelStrategy("fsdp2"), root, loader, steps=6,
                use_distributed_sampler=False)


def _pipeline(rank, world, root):
    import meshkit

    # 8 layers cut after the first: stage 0 holds 1 block, stage 1 seven; 2 micro-batches < 2p = 4
    strategy = meshkit.NDParallelStrategy("pp", pp=2, pp_microbatches=2, pp_split_points=[1],
                                          pp_timeline_dir=os.path.join(root, "pp_timeline"))
    return _fit(_llama(n_layers=8), strategy, root, _tokens(2 * 6 * BATCH), steps=6)


# ---- tests -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(pool, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("doctor"))
    out = {"tp": pool.run(_tp_across, os.path.join(root, "tp"))[0],
           "healthy": pool.run(_healthy, os.path.join(root, "same"))[0],
           "sick": pool.run(_sick, os.path.join(root, "same"))[0],  # the second run in that log dir
           "pp": pool.run(_pipeline, os.path.join(root, "pp"))[0]}
    return out


def test_healthy_run_reports_nothing_above_info(runs):
    r = runs["healthy"]
    assert [f for f in r["findings"] if f["severity"] != "info"] == [], r["findings"]
    assert "mfu_band" in _by_id(r)  # MFUMonitor ran: on CPU the peak is measured, so it is info
    assert _by_id(r)["mfu_band"]["evidence"]["peak"] == "measured"
    with open(os.path.join(r["log_dir"], "doctor.json")) as f:
        assert json.load(f)["run"]["global_batch"] == 2 * BATCH  # per-rank 2 x dp_replicate 2 (tp shares)


def test_tp_across_simulated_nodes(runs):
    f = _by_id(runs["tp"])["tp_across_nodes"]
    assert f["severity"] == "warning"
    assert f["evidence"]["tp"] == 4 and f["evidence"]["devices_per_node"] == PER_NODE
    assert f["evidence"]["example_group"] == [0, 1, 2, 3] and f["evidence"]["example_nodes"] == [0, 0, 1, 1]


def test_sleeping_rank_is_a_straggler(runs):
    f = _by_id(runs["sick"])["straggler"]
    assert f["rank"] == 3 and f["severity"] == "warning"
    assert f["evidence"]["late_ms"] > 150 and f["evidence"]["late_ms"] > f["evidence"]["noise_floor_ms"]


def test_unused_parameter(runs):
    f = _by_id(runs["sick"])["unused_parameters"]
    assert f["rank"] is None  # the same on every rank
    assert f["evidence"]["parameters"] == ["unused.weight", "unused.bias"] and f["evidence"]["numel"] == 20


def test_identical_batches_on_every_dp_rank(runs):
    f = _by_id(runs["sick"])["identical_batches"]
    assert f["evidence"]["ranks_with_same_batches"] == [[0, 1, 2, 3]] and f["evidence"]["batches_hashed"] == 2


def test_one_fsdp_unit(runs):
    f = _by_id(runs["sick"])["one_fsdp_unit"]
    # net (16·8+16 + 16+1 = 161) and unused (4·4+4 = 20) are the two roots: net holds 161/181
    assert f["evidence"]["fsdp_units"] == 2 and f["evidence"]["largest_unit_parameters"] == 161


def test_global_batch_changed_between_two_runs_in_one_log_dir(runs):
    f = _by_id(runs["sick"])["global_batch_changed"]
    assert f["severity"] == "warning"  # the lr stayed 0.5
    assert f["evidence"]["previous_global_batch"] == 2 * BATCH and f["evidence"]["global_batch"] == 16
    assert f["evidence"]["previous_lr"] == f["evidence"]["lr"] == LR


def test_unbalanced_pp_split_and_few_microbatches(runs):
    by = _by_id(runs["pp"])
    f = by["pp_unbalanced"]
    assert f["evidence"]["slowest_stage"] == 1 and f["evidence"]["imbalance_pct"] > 20
    assert f["evidence"]["excess_pct"] > f["evidence"]["noise_floor_pct"]
    m = by["few_microbatches"]
    assert m["evidence"]["pp"] == 2 and m["evidence"]["microbatches"] == 2 and m["evidence"]["needed"] == 4


def test_cli_prints_the_same(runs, capsys):
    from meshkit.cli import main

    assert main(["doctor", runs["sick"]["log_dir"], "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["findings"] == runs["sick"]["findings"]
