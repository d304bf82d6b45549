"""Issue 27 on 4 gloo processes: what used to complete and mean nothing, or hang, is refused on every rank.

Checkpoints through meshkit.plugins.checkpoint's functions (what any front door calls) and through the
Trainer; every run bounded by the pool's timeouts (a hang fails the test, it does not stall the suite).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.dist_pool import ProcessPool
from tests.distributed import training as T

RUN_TIMEOUT_S = 60  # a hang (the collective timeout is 90 s) fails here first


@pytest.fixture(scope="module")
def pool():
    with ProcessPool(world_size=4) as p:
        yield p


# ---- checkpoints whose integrity cannot be established -----------------------------------------------------
def _net(world: int, seed: int) -> tuple:
    from meshkit.models.llama import LlamaConfig, Transformer
    from meshkit.plugins.dims import ParallelDims
    from meshkit.plugins.parallelize import parallelize

    torch.manual_seed(seed)
    dims = ParallelDims(dp_shard=world, world_size=world)
    dims.build_mesh("cpu")
    return parallelize(Transformer(LlamaConfig.tiny(vocab_size=T.VOCAB, n_kv_heads=4)), dims)


def _save(root: str, world: int) -> tuple[str, dict]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from meshkit.plugins import checkpoint as ckpt

    net = _net(world, 0)
    path = os.path.join(root, "plain.ckpt")
    ckpt.save_checkpoint(path, get_model_state_dict(net), None, {"step": 1})
    return path, T.full_params(net)


def _damage_then_load(rank: int, world: int, root: str, damage: str, allow_unverified: bool = False) -> dict:
    """Save on every rank; rank 0 damages the folder (``damage``); every rank loads. Each rank's outcome."""
    import torch.distributed as dist

    from meshkit.plugins import checkpoint as ckpt

    path, saved = _save(root, world)
    if rank == 0:
        manifest = Path(path, ckpt.MANIFEST)
        if damage == "entry_without_crc32":  # the entry of the file rank 2 checks (files split over the ranks)
            record = json.loads(manifest.read_text())
            name = sorted(record["files"])[2]
            del record["files"][name]["crc32"]
            manifest.write_text(json.dumps(record))
        elif damage in ("no_manifest", "no_manifest_flipped"):
            manifest.unlink()
            if damage == "no_manifest_flipped":  # a tensor byte of rank 1's shard
                shard = Path(path, "__1_0.distcp")
                data = bytearray(shard.read_bytes())
                data[len(data) // 2] ^= 0x40
                shard.write_bytes(bytes(data))
        elif damage == "partial":
            shutil.copytree(path, os.path.join(root, ".plain.ckpt.partial"))
            path = os.path.join(root, ".plain.ckpt.partial")
    dist.barrier()
    path = os.path.join(root, ".plain.ckpt.partial") if damage == "partial" else path
    fresh = _net(world, 1)
    before = T.full_params(fresh)
    out: dict[str, Any] = {"error": None}
    try:
        ckpt.load_checkpoint(path, fresh, **({"allow_unverified": True} if allow_unverified else {}))
    except Exception as e:  # noqa: BLE001 - the test reads what each rank saw
        out["error"] = f"{type(e).__name__}: {e}"
    got = T.full_params(fresh)
    out["equal"] = sorted(n for n in saved if torch.equal(saved[n], got[n]))
    out["names"] = sorted(saved)
    out["untouched"] = all(torch.equal(before[n], got[n]) for n in before)
    dist.barrier()  # every rank is done before the next task's rank 0 rewrites the folder
    return out


@pytest.mark.parametrize("damage, match", [
    # issue 27 item 6: a raw KeyError on rank 2 while ranks 0, 1 and 3 waited in the gather until the timeout
    ("entry_without_crc32", r"CheckpointError: checkpoint `.*plain.ckpt` is not usable: `meshkit.json` is garbled: "
                            r"its entry `__\d_0.distcp` has no `crc32`"),
    # item 5: a lost manifest switched every check off (a flipped byte loaded)
    ("no_manifest", r"CheckpointError: .* it has no `meshkit.json`, so none of its files can be checked .*"
                    r"`allow_unverified=True`"),
    ("no_manifest_flipped", r"it has no `meshkit.json`, so none of its files can be checked"),
    # item 6: the hidden folder of an interrupted save (a raw EOFError)
    ("partial", r"CheckpointError: `ckpt_path='.*/.plain.ckpt.partial'` is meshkit's temporary unfinished copy of a "
                r"save to `plain.ckpt`, not a checkpoint. Pass `.*/plain.ckpt`"),
])
def test_a_checkpoint_meshkit_cannot_verify_is_refused_on_every_rank(pool, tmp_path, damage, match):
    got = pool.run(_damage_then_load, str(tmp_path), damage, timeout=RUN_TIMEOUT_S)
    import re

    assert all(r["error"] is not None and re.search(match, r["error"]) for r in got), [r["error"] for r in got]
    assert len({r["error"] for r in got}) == 1  # the same error on every rank: agreed before anyone acted
    assert all(r["untouched"] for r in got)  # refused before any weight was touched


def test_the_opt_in_loads_a_folder_without_its_manifest(pool, tmp_path):
    got = pool.run(_damage_then_load, str(tmp_path), "no_manifest", True, timeout=RUN_TIMEOUT_S)
    assert all(r["error"] is None and r["equal"] == r["names"] for r in got), got


# ---- 1: empty_init materializes buffers and parameters the way the model's own init would ---------------------
def _trainer(strategy: Any, steps: int = 2, **kwargs: Any) -> Any:
    import lightning as L

    return L.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=steps, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **kwargs)


EMPTY_INIT_LAYOUTS = ({"dp_shard": 2, "tp": 2}, {"dp_shard": 4, "tp": 1})
"""The sharded layouts each family's ``empty_init`` build is materialized under (tp shards q/k/v, o, the MLP)."""


def _empty_init_families(rank: int, world: int, cells: list[tuple[str, dict]]) -> list[dict]:
    """Per ``(family, strategy)`` cell: ``trainer.init_module(empty_init=True)``, then a 2-step fit. What the model holds
    after setup (materialized, sharded, before the first step): every buffer (this rank's) and every parameter (full,
    gathered from the shards); the tensors still on the meta device after the build; the losses; the ties."""
    import lightning as L
    from torch.utils.data import DataLoader

    import meshkit
    from tests.distributed import hf_models as H

    T.launcher_env(rank, 4)
    seen: dict[str, Any] = {}

    class AtStart(L.Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            seen.update(buffers=T.full_buffers(pl_module), params=T.full_params(pl_module),
                        tied=H._tied_names(pl_module))

    out = []
    for family, strategy in cells:
        seen.clear()
        recorder = T.LossRecorder()
        trainer = _trainer(meshkit.NDParallelStrategy(**strategy), callbacks=[recorder, AtStart()])
        with trainer.init_module(empty_init=True):
            module = H.CausalLM(family)
        not_meta = [n for n, t in (*module.named_parameters(), *module.named_buffers()) if not t.is_meta]
        torch.manual_seed(0)  # the meta build drew nothing: materialize draws from the state the real build had
        trainer.fit(module, DataLoader(T.tokens(16), batch_size=T.PER_RANK_BATCH))
        out.append({"family": family, "strategy": strategy, "not_meta": not_meta, "losses": recorder.losses, **seen})
    return out


def _with_plan(family: str, layout: dict) -> dict:
    """``layout``, and under tp the ``tp_plan`` the automatic plan's refusal names for a family it cannot shard
    (GPT-2's Conv1D, Phi-3's fused projections: test_model_matrix.py checks the refusal)."""
    from meshkit.plugins.tensor_parallel import infer_tp_plan
    from tests.distributed import hf_models as H

    if layout["tp"] > 1:
        try:
            infer_tp_plan(H.build(family))
        except ValueError as refusal:
            return {**layout, "tp_plan": H.suggested_plan(str(refusal))}
    return layout


def test_empty_init_materializes_every_family_sharded_as_its_own_init_would(pool):
    # Issue 27 item 1: a transformers Llama's inv_freq came out as 1.8e20 (uninitialized memory) and the loss was NaN;
    # fit completed. Every family of the model matrix, under dp_shard x tp and dp_shard alone, in one run of the pool.
    from tests.distributed import hf_models as H

    truth = {f: H.own_init(f, torch.float32) for f in H.FAMILIES}  # one process, built for real (32-true's dtype)
    want = {f: H.init_tensors(m) for f, m in truth.items()}
    # A family drawing in `__init__` equals its own init by distribution only (tests/unit/test_materialize.py), which
    # shards that are copies of one another pass: it equals the one-process empty_init build bit for bit as well.
    one = {f: H.init_tensors(H.empty_init(f, torch.float32)) for f in H.DRAWN_IN_INIT}
    cells = [(f, _with_plan(f, layout)) for layout in EMPTY_INIT_LAYOUTS for f in H.FAMILIES]
    got = pool.run(_empty_init_families, cells, timeout=600)
    bad = {}
    for rank, results in enumerate(got):
        assert [(r["family"], r["strategy"]) for r in results] == cells
        for r in results:
            cell = (rank, r["family"], r["strategy"].get("tp"))
            f, built = r["family"], (r["buffers"], r["params"])
            wrong = H.init_mismatches(want[f], built, f in H.DRAWN_IN_INIT)
            wrong += [f"{line} (one-process empty_init)" for line in H.init_mismatches(one[f], built)] if f in one else []
            if r["not_meta"]:
                wrong.append(f"built off the meta device: {r['not_meta']}")
            if r["tied"] != H._tied_names(truth[f]):
                wrong.append(f"ties {r['tied']}, its own init's {H._tied_names(truth[f])}")
            if not (len(r["losses"]) == 2 and all(torch.isfinite(torch.tensor(r["losses"])))):
                wrong.append(f"losses {r['losses']}")
            if wrong:
                bad[cell] = wrong
    assert not bad, "\n".join(f"{cell}: {line}" for cell, lines in bad.items() for line in lines)


def _unfilled_buffer(rank: int, world: int) -> dict:
    from torch.utils.data import DataLoader

    import meshkit

    T.launcher_env(rank, 4)
    trainer = _trainer(meshkit.NDParallelStrategy(dp_shard=4, tp=1))
    with trainer.init_module(empty_init=True):
        module = T.build_module("meshkit")
        module.model.register_buffer("scale", torch.full((4,), 2.0), persistent=False)  # no init recomputes it
    try:
        trainer.fit(module, DataLoader(T.tokens(16), batch_size=T.PER_RANK_BATCH))
    except ValueError as e:
        return {"error": str(e), "steps": trainer.global_step}
    return {"error": None, "steps": trainer.global_step}


def test_empty_init_refuses_a_buffer_nothing_initializes_on_every_rank(pool):
    got = pool.run(_unfilled_buffer, timeout=120)
    for r in got:
        assert r["steps"] == 0 and r["error"] is not None, r
        assert "nothing initializes `model.scale` (Transformer)" in r["error"], r
        assert "Give those modules a `reset_parameters()`" in r["error"], r


# ---- 2-4: a fit that would complete and mean nothing is refused before the first step, on every rank ----------
def _lm_class(kind: str) -> type:
    """LightningModules as a new user writes them (built in the worker: Lightning is imported there)."""
    from meshkit.models.llama import LlamaConfig, LlamaLM, Transformer

    class NoSharding(LlamaLM):  # a configure_model that builds the network and shards nothing
        def __init__(self) -> None:
            super().__init__(LlamaConfig.tiny(vocab_size=T.VOCAB), lr=0.5, optimizer="sgd")
            self.model = None

        def configure_model(self) -> None:
            if self.model is None:
                self.model = Transformer(self.config)

    class EarlyOptimizer(LlamaLM):  # the optimizer made in __init__, before meshkit shards the model
        def __init__(self) -> None:
            super().__init__(LlamaConfig.tiny(vocab_size=T.VOCAB), lr=0.5, optimizer="sgd")
            self.opt = torch.optim.SGD(self.parameters(), lr=0.5)

        def configure_optimizers(self) -> Any:
            return self.opt

    class OutsideParameter(LlamaLM):  # under pp: a trainable parameter beside the model the stages are cut from
        def __init__(self) -> None:
            super().__init__(LlamaConfig.tiny(vocab_size=T.VOCAB), lr=0.5, optimizer="sgd")
            self.temperature = torch.nn.Parameter(torch.ones(()))

        def pipeline_loss(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.cross_entropy(output.flatten(0, 1).float() * self.temperature, labels.flatten())

    class ShardedOver(NoSharding):  # a configure_model that shards over one mesh axis (SHARD_OVER)
        SHARD_OVER = "dp_shard"

        def before_sharding(self) -> None:
            """What the configure_model does to the network before it shards it (here: nothing)."""

        def configure_model(self) -> None:
            from torch.distributed.fsdp import fully_shard

            if self.model is None:
                super().configure_model()
                self.before_sharding()
                mesh = self.device_mesh[self.SHARD_OVER]
                for block in self.model.layers.children():
                    fully_shard(block, mesh=mesh)
                fully_shard(self, mesh=mesh)

    class ShardedOverDpCp(ShardedOver):  # the cp sync message's mesh, without cp attention: refused (cut batches)
        SHARD_OVER = "dp_shard_cp"

    class ContextParallelDpCp(ShardedOverDpCp):  # the fix both cp messages name: cp attention, then dp_shard_cp
        def before_sharding(self) -> None:
            import meshkit

            meshkit.apply_context_parallel(self.model, self.device_mesh["cp"], layout="load_balanced")

    class FrozenOutsideParameter(OutsideParameter):  # the fix that message names
        def __init__(self) -> None:
            super().__init__()
            self.temperature.requires_grad_(False)

    return {"no_sharding": NoSharding, "early_optimizer": EarlyOptimizer, "outside_parameter": OutsideParameter,
            "frozen_outside_parameter": FrozenOutsideParameter, "dp_only_sharding": ShardedOver,
            "dp_cp_sharding": ShardedOverDpCp, "cp_attention_dp_cp_sharding": ContextParallelDpCp}[kind]


def _refused_fit(rank: int, world: int, kind: str, strategy: dict, batch: int = T.PER_RANK_BATCH) -> dict:
    from torch.utils.data import DataLoader

    import meshkit

    T.launcher_env(rank, 4)
    torch.manual_seed(0)
    module = T.build_module("meshkit") if kind == "plain" else _lm_class(kind)()
    trainer = _trainer(meshkit.NDParallelStrategy(**strategy), steps=1)
    try:
        trainer.fit(module, DataLoader(T.tokens(16), batch_size=batch))
    except ValueError as e:
        return {"error": str(e), "steps": trainer.global_step}
    return {"error": None, "steps": trainer.global_step}


@pytest.mark.parametrize("kind, strategy, batch, match", [
    # item 2: the dp ranks drifted apart without a word
    ("no_sharding", dict(preset="fsdp2"), T.PER_RANK_BATCH,
     r"`configure_model` left \d+ trainable parameter\(s\) without gradient sync over the data-parallel ranks "
     r"\(`dp_replicate\*dp_shard=4`\): \['model.tok_embeddings.weight', .*`fully_shard` each block and then the "
     r"root over `self.device_mesh\[\"dp_shard\"\]`"),
    # item 3: 0 of 21 parameters changed in a completed fit
    ("early_optimizer", dict(dp_shard=2, tp=2), T.PER_RANK_BATCH,
     r"optimizer 0 \(SGD\) holds \d+ of its \d+ parameter\(s\) that are not the model's any more: .* Create the "
     r"optimizer in `configure_optimizers`"),
    # item 4: a declared global batch was never compared with what a step trains on
    ("plain", dict(dp_shard=2, tp=2, global_batch_size=16), T.PER_RANK_BATCH,
     r"`global_batch_size=16` but a step trains on 4 sequences: batch 2 per rank x `dp_replicate\*dp_shard=2` x "
     r"`accumulate_grad_batches=1`. Use a DataLoader `batch_size=8`, or `global_batch_size=4`"),
    # item 2 under pp: a configure_model's model is never split (each pp rank trained all of it), and a
    # parameter beside the split model went unchecked (the check skipped pp: the stage views are outside the tree)
    ("no_sharding", dict(preset="tp_pp"), T.PER_RANK_BATCH,
     r"`pp=2` with a `configure_model` in NoSharding: meshkit cuts pipeline stages only when it parallelizes the "
     r"model itself.*Remove `configure_model` and let meshkit split and shard the model"),
    ("no_sharding", dict(preset="pp"), T.PER_RANK_BATCH, r"`pp=2` with a `configure_model` in NoSharding"),
    ("outside_parameter", dict(preset="pp"), T.PER_RANK_BATCH,
     r"with `pp=2` meshkit splits `self.model` into pipeline stages and shards each stage over the data-parallel "
     r"ranks \(`dp_replicate\*dp_shard=2`\); 1 trainable parameter\(s\) lie outside it: \['temperature'\].* Move "
     r"them into `self.model`"),
    # item 2 under cp: sharded over dp_shard only, the cp ranks (each its own share of every sequence) drifted
    ("dp_only_sharding", dict(preset="cp", dp_shard=2, cp=2, tp=1), T.PER_RANK_BATCH,
     r"`configure_model` left \d+ trainable parameter\(s\) without gradient sync over the data- and context-parallel "
     r"ranks \(`dp_replicate\*dp_shard\*cp=4`: each cp rank trains on its own share of the sequence\): .* `fully_shard` "
     r"each block and then the root over `self.device_mesh\[\"dp_shard_cp\"\]`"),
    # cp with a configure_model that syncs over dp x cp but never makes attention context-parallel: the strategy
    # cuts every batch, so each rank attended within its own share of every sequence, without an error
    ("dp_cp_sharding", dict(preset="cp", dp_shard=2, cp=2, tp=1), T.PER_RANK_BATCH,
     r"with `cp=2` meshkit gives each rank `1/2` of every sequence \(`cp_layout='load_balanced'`\), but "
     r"`configure_model` applies no context-parallel attention: .* call `meshkit.apply_context_parallel\(self.model, "
     r"self.device_mesh\[\"cp\"\], layout='load_balanced'\)` before sharding"),
], ids=["configure_model_without_sharding", "optimizer_before_sharding", "global_batch_vs_loader",
        "tp_pp_configure_model", "pp_configure_model", "pp_parameter_outside_the_stages", "cp_sharded_over_dp_only",
        "cp_without_cp_attention"])
def test_a_fit_that_would_train_wrongly_is_refused_on_every_rank(pool, kind, strategy, batch, match):
    import re

    got = pool.run(_refused_fit, kind, strategy, batch, timeout=180)
    for r in got:
        assert r["steps"] == 0 and r["error"] is not None and re.search(match, r["error"]), r


def test_the_frozen_parameter_the_pp_message_names_trains(pool):
    got = pool.run(_refused_fit, "frozen_outside_parameter", dict(preset="pp"), timeout=180)
    assert all(r == {"error": None, "steps": 1} for r in got), got


def test_the_fix_the_cp_messages_name_trains(pool):
    got = pool.run(_refused_fit, "cp_attention_dp_cp_sharding", dict(preset="cp", dp_shard=2, cp=2, tp=1), timeout=180)
    assert all(r == {"error": None, "steps": 1} for r in got), got


def test_the_global_batch_the_message_names_trains(pool):
    got = pool.run(_refused_fit, "plain", dict(dp_shard=2, tp=2, global_batch_size=16), 8, timeout=180)
    assert all(r == {"error": None, "steps": 1} for r in got), got


# ---- 9: a timed-out collective's note names the rank whose process stopped ---------------------------------
PERIOD_S = 0.5
"""The heartbeat period here: a live rank ticks 3 times in the 1.5 s window (the default 1 s made it 3 s, twice)."""


def _heartbeats(rank: int, world: int, stop_rank: int) -> dict:
    import torch.distributed as dist

    from meshkit.plugins import rendezvous as R

    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if R._heartbeat is not None:  # an earlier fit's ticker (1 s): this test's runs at PERIOD_S
        R._heartbeat[2].set()
        R._heartbeat[1].join(timeout=5)
    assert R.heartbeat(address, port, rank, period=PERIOD_S)
    dist.barrier()
    if rank == stop_rank:  # what SIGSTOP does to the ticker (the fault job freezes a whole process)
        R._heartbeat[2].set()
        R._heartbeat[1].join(timeout=5)
    dist.barrier()
    out = {"stopped": None if rank == stop_rank else R.stopped_ranks(address, port, world, period=PERIOD_S)}
    dist.barrier()
    if rank == stop_rank:
        assert R.heartbeat(address, port, rank, period=PERIOD_S)  # a new ticker: the next task sees every rank alive
    dist.barrier()
    out["again"] = R.stopped_ranks(address, port, world, period=PERIOD_S)
    return out


def test_heartbeats_name_the_rank_whose_process_stopped(pool):
    from meshkit.plugins.rendezvous import timeout_note

    got = pool.run(_heartbeats, 2, timeout=120)
    assert [r["stopped"] for r in got] == [[2], [2], None, [2]] and [r["again"] for r in got] == [[]] * 4
    note = timeout_note(RuntimeError("Timed out"), None, "0:00:20", 0, [2])
    assert "rank 2 stopped responding (no heartbeat for 3 s: frozen, killed or out of memory)" in note
    assert note.endswith("This rank exits with an error; meshkit ends no other rank's process (it may run on another "
                         "node): the launcher ends it (torchrun's agent stops the other workers when one exits, SIGKILL "
                         "after 30 s; under SLURM run `srun --kill-on-bad-exit=1`; Lightning's own launcher kills its "
                         "processes when one fails; a stopped launching process itself needs `kill -9`).")
    assert "every rank's process is alive" in timeout_note(RuntimeError("Timed out"), None, "0:00:20", 0, [])


# ---- 9: gradient clipping by value under tp equals one process -------------------------------------------------
def _fit_clip_value(rank: int, world: int) -> dict:
    import meshkit

    return T.fit(rank, world, meshkit.NDParallelStrategy(dp_shard=2, tp=2), devices=4, steps=3, kind="meshkit",
                 gradient_clip_val=0.002, gradient_clip_algorithm="value")


def test_gradient_clipping_by_value_under_tp_matches_one_process(pool):
    # Issue 27 item 9: value clipping under tp. 0.002 is below most gradient entries: every step clips.
    results = pool.run(_fit_clip_value, timeout=180)
    want_losses, want_params = T.reference("meshkit", 3, results[0]["dp_size"], clip_value=0.002)
    torch.testing.assert_close(torch.tensor(T.global_losses(results)), torch.tensor(want_losses), rtol=1e-4, atol=0)
    T.assert_params_close(results[0]["params"], want_params)


# ---- 9: a process group left from before: reused when every rank holds it, else the same error on every rank ----
def _fit_over_a_group_from_before(rank: int, world: int, case: str, ports: list[int]) -> dict:
    from datetime import timedelta

    import torch.distributed as dist
    from torch.utils.data import DataLoader

    import meshkit
    from tests.dist_pool import COLLECTIVE_TIMEOUT_S

    T.launcher_env(rank, 4)
    port = os.environ["MASTER_PORT"]
    if case == "destroyed_on_rank_3" and rank == 3 or case in ("destroyed_everywhere", "foreign"):
        dist.destroy_process_group()
    if case == "destroyed_everywhere":  # a store of its own: torch's keys of the pool's group may outlive it there
        os.environ["MASTER_PORT"] = str(ports[0])
    if case == "foreign":  # two groups of 2 (another job's layout), each on its own store
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[rank // 2]}", rank=rank % 2,
                                world_size=2, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    torch.manual_seed(0)
    trainer = _trainer(meshkit.NDParallelStrategy(dp_shard=4, tp=1, timeout=timedelta(seconds=RUN_TIMEOUT_S)), steps=1)
    out: dict[str, Any] = {"error": None}
    try:
        trainer.fit(T.build_module("meshkit"), DataLoader(T.tokens(16), batch_size=T.PER_RANK_BATCH))
    except Exception as e:  # noqa: BLE001 - the test reads what each rank saw
        out["error"] = f"{type(e).__name__}: {e}"
    out["steps"] = trainer.global_step
    if dist.is_initialized():  # leave the pool as it was: one group of 4 with its timeout, on every rank (a fresh
        dist.destroy_process_group()  # store: the old one may outlive its group on rank 0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[2]}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    os.environ["MASTER_PORT"] = port
    return out


@pytest.mark.parametrize("case, match", [
    # rank 3's group destroyed, ranks 0-2 keep theirs: rank 3 waited in a roll call the others skipped ("ranks 0-2
    # did not join") while they waited in their group's first collective for the rank that had left it
    ("destroyed_on_rank_3", r"RuntimeError: NDParallelStrategy: the ranks do not hold the same process group: ranks "
                            r"0-2 keep one from before \(an earlier fit's, or an `init_process_group` of their own\) "
                            r"and rank 3 has none .* Call `torch.distributed.destroy_process_group\(\)` on every rank"),
    # a group of another job's layout: "the launcher started `WORLD_SIZE=2`" blamed the launcher
    ("foreign", r"ValueError: NDParallelStrategy: this process already holds a process group of 2 rank\(s\) .* and the "
                r"launcher started `WORLD_SIZE=4`: that group is stale"),
])
def test_a_process_group_from_before_that_is_not_this_jobs_is_refused_on_every_rank(pool, case, match):
    import re

    from tests.dist_pool import free_port

    got = pool.run(_fit_over_a_group_from_before, case, [free_port() for _ in range(3)], timeout=RUN_TIMEOUT_S * 2)
    assert all(r["steps"] == 0 and r["error"] and re.search(match, r["error"]) for r in got), [r["error"] for r in got]
    assert len({r["error"] for r in got}) == 1  # one verdict, agreed on every rank before any collective


def test_a_process_group_destroyed_on_every_rank_is_started_anew(pool):
    from tests.dist_pool import free_port

    got = pool.run(_fit_over_a_group_from_before, "destroyed_everywhere", [free_port(), 0, free_port()],
                   timeout=RUN_TIMEOUT_S * 2)
    assert all(r == {"error": None, "steps": 1} for r in got), got
