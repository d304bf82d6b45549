"""L.Fabric(strategy="hsdp_tp") on a transformers Llama: 4 gloo processes against one process.

A hand-written Fabric loop (``fabric.setup``, ``setup_dataloaders``, ``backward``, ``clip_gradients``) under
meshkit's Fabric strategy trains as one process does: the losses at rtol 1e-4, every parameter (same names) at
update error <= 1e-3. A ``fabric.save`` -> a fresh 4-process job at another layout ``fabric.load``s it (DCP
reshards) -> 2 more steps equals those 2 steps in one process, optimizer momentum included. FabricMFU writes
MFUMonitor's tags, its MFU the formula by hand. The same loop under ``"hsdp_cp"`` (``shard_batch`` /
``loss_mean``, ``clip_val=``), and under tp with ``loss_parallel=True`` and ``no_backward_sync`` accumulation.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

from tests.dist_pool import ProcessPool
from tests.distributed import hf_models as H
from tests.distributed import training as T

FAMILY = "llama"
STEPS = 4
MAX_LOSS_RTOL = 1e-4
MAX_UPDATE_ERROR = 1e-3
"""In float64 a correct layout lands near 1e-13 (docs/models.md); a wrong gradient at lr 2 is >= 1e-2."""
CLIP = 0.5
"""Below the gradient norms of these steps (the test asserts it clipped), so the norm over the mesh matters."""
PEAK = 1e12  # FLOP/s: a fixed peak, so MFU by hand needs no CPU calibration
CLIP_VALUE = 2e-3
"""Elementwise clip: below the largest gradient entries of these steps (the reference asserts it clips)."""


@pytest.fixture(scope="module")
def pool():
    with ProcessPool(world_size=4) as p:
        yield p


def _loss(model: torch.nn.Module, batch) -> torch.Tensor:
    if isinstance(batch, dict):  # {"input_ids"} dicts (under cp: this rank's part): the transformers idiom
        return model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
    logits = model(input_ids=batch[:, :-1]).logits  # (B, T, V), float64; a vocab-sharded DTensor under loss_parallel
    return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())


def _value(loss: torch.Tensor) -> float:
    from torch.distributed.tensor import DTensor

    loss = loss.detach()
    return float(loss.full_tensor() if isinstance(loss, DTensor) else loss)


def _rows(seed: int, steps: int, world: int = 4) -> torch.Tensor:
    from meshkit.models.llama import synthetic_tokens

    return synthetic_tokens(steps * T.PER_RANK_BATCH * world, T.SEQ, T.VOCAB, seed=seed)


def fabric_fit(rank: int, world: int, strategy: dict | str, steps: int, *, seed: int = 1, momentum: float = 0.0,
               joint: bool = True, clip: float | None = None, clip_val: float | None = None, accumulate: int = 1,
               ids: bool = False, save: str | None = None, load: str | None = None, logdir: str | None = None) -> dict:
    """A Fabric loop of ``steps`` steps on the tiny float64 Llama; ``save``/``load``: a checkpoint folder.

    Every batch goes through ``strategy.shard_batch`` and the loss through ``loss_context`` and ``loss_mean``
    (no-ops unless cp / loss_parallel: one loop for every preset). ``ids``: ``{"input_ids"}`` dicts and the
    transformers loss idiom; ``accumulate``: micro-batches per step, all but the last under ``no_backward_sync``."""
    import lightning as L
    from lightning.fabric.loggers import TensorBoardLogger
    from torch.distributed.tensor import DTensor
    from torch.utils.data import DataLoader

    import meshkit
    from meshkit.profiling.fabric import FabricMFU

    T.launcher_env(rank, world)
    chosen = strategy if isinstance(strategy, str) else meshkit.NDParallelFabricStrategy(**strategy)
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=chosen,
                      loggers=TensorBoardLogger(logdir, name="fabric") if logdir else None)
    fabric.launch()
    model = H.build(FAMILY).model  # seeded: the reference's initial parameters
    if joint:  # the optimizer built on the unsharded parameters; the strategy re-points it
        model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=H.LR, momentum=momentum))
    else:
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=H.LR, momentum=momentum))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    if load:
        fabric.load(load, state)
    at_load = T.full_params(model.module)
    rows = _rows(seed, steps * accumulate, world)
    data = H.IdsDicts(rows) if ids else rows
    loader = iter(fabric.setup_dataloaders(DataLoader(data, batch_size=T.PER_RANK_BATCH, shuffle=True)))
    mfu = FabricMFU(fabric, model, max_steps=steps, log_every=1, profile_every=0, peak_flops=PEAK) if logdir else None
    strat = fabric.strategy
    losses, norms, parts, grad_none_after_first_micro, logits_placements = [], [], [], None, None
    for i in range(steps):
        total, raw = 0.0, [next(loader) for _ in range(accumulate)]
        with mfu.step(raw[0]) if mfu else _nothing():
            for micro in range(accumulate):
                with fabric.no_backward_sync(model, enabled=micro < accumulate - 1):
                    batch = strat.shard_batch(raw[micro])
                    with strat.loss_context():
                        loss = _loss(model, batch) / accumulate
                        fabric.backward(loss)
                if micro == 0 and accumulate > 1 and i == 0:  # FSDP2 kept the gradients unsharded, unreduced
                    grad_none_after_first_micro = all(p.grad is None for p in model.parameters())
                parts.append(_value(loss))
                total += _value(strat.loss_mean(loss, batch))
            if clip is not None:
                norms.append(float(fabric.clip_gradients(model, optimizer, max_norm=clip)))
            if clip_val is not None:
                fabric.clip_gradients(model, optimizer, clip_val=clip_val)
            if mfu:
                mfu.before_optimizer_step()
            optimizer.step()
            optimizer.zero_grad()
        losses.append(total)
    if strat.parallel_config.loss_parallel:
        from torch.distributed.tensor import DTensor

        with torch.no_grad():
            logits = model(input_ids=rows[:1, :-1]).logits
        logits_placements = [str(p) for p in logits.placements] if isinstance(logits, DTensor) else None
    if mfu:
        mfu.close()
    if save:
        fabric.save(save, {**state, "step": state["step"] + steps})
    dp = fabric.strategy.parallel_dims.submesh("dp")
    q = dict(model.module.named_parameters())["model.layers.0.self_attn.q_proj.weight"]
    return {
        "losses": losses, "norms": norms, "dp_rank": dp.get_local_rank(), "dp_size": dp.size(),
        "degrees": fabric.strategy.parallel_dims.degrees, "step": state["step"],
        "q_placements": dict(zip(q.device_mesh.mesh_dim_names, map(str, q.placements))) if isinstance(q, DTensor) else None,
        "optimizer_holds_model_params": all(
            any(p is m for m in model.module.parameters()) for g in optimizer.param_groups for p in g["params"]),
        "at_load": at_load, "params": T.full_params(model.module), "parts": parts,
        "grad_none_after_first_micro": grad_none_after_first_micro, "logits_placements": logits_placements,
        "mfu": [(m.step, m.step_time_s, m.mfu, m.tokens_per_s) for m in mfu.history] if mfu else [],
    }


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def reference(phases: list[tuple[int, int, int]], *, momentum: float = 0.0, clip: float | None = None,
              clip_val: float | None = None, accumulate: int = 1, ids: bool = False) -> dict:
    """One process: for each ``(seed, dp, steps)`` the global batches a dp-way sampler deals, on one model and SGD
    (``accumulate`` of them per step, each loss divided by it)."""
    model = H.build(FAMILY).model
    optimizer = torch.optim.SGD(model.parameters(), lr=H.LR, momentum=momentum)
    snap = lambda: {n: p.detach().clone() for n, p in model.named_parameters()}  # noqa: E731
    out: dict = {"losses": [], "params": [snap()], "norms": [], "clipped": []}
    for seed, dp, steps in phases:
        rows = _rows(seed, steps * accumulate, world=4)
        micro = T.step_batches(len(rows), dp, steps * accumulate)
        for s in range(steps):
            optimizer.zero_grad()
            total = 0.0
            for idx in micro[s * accumulate:(s + 1) * accumulate]:
                batch = {"input_ids": rows[idx, :T.SEQ]} if ids else rows[idx]
                loss = _loss(model, batch) / accumulate
                loss.backward()
                total += loss.item()
            if clip is not None:
                out["norms"].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
            if clip_val is not None:
                out["clipped"].append(sum(int((p.grad.abs() > clip_val).sum()) for p in model.parameters()))
                torch.nn.utils.clip_grad_value_(model.parameters(), clip_val)
            optimizer.step()
            out["losses"].append(total)
        out["params"].append(snap())
    return out


def _check(results: list[dict], want_losses: list[float], init: dict, want: dict) -> float:
    got = torch.tensor(T.global_losses(results), dtype=torch.float64)
    torch.testing.assert_close(got, torch.tensor(want_losses, dtype=torch.float64), rtol=MAX_LOSS_RTOL, atol=0)
    errors = H.update_errors(results[0]["params"], init, want)  # the same names as one process, or it fails
    worst = max(errors, key=errors.get)
    assert errors[worst] <= MAX_UPDATE_ERROR, (worst, errors[worst])
    for r in results[1:]:
        assert r["params"].keys() == results[0]["params"].keys()
    return errors[worst]


def test_fabric_hsdp_tp_matches_one_process(pool, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from meshkit.modelspec import find_config
    from meshkit.profiling.flops import model_flops_per_token
    from meshkit.profiling.report import step_scalars

    results = pool.run(fabric_fit, "hsdp_tp", STEPS, clip=CLIP, logdir=str(tmp_path / "tb"))
    r0 = results[0]
    assert r0["degrees"] == {"dp_replicate": 1, "dp_shard": 2, "pp": 1, "cp": 1, "tp": 2}
    assert r0["q_placements"] == {"dp_shard": "_S(0, 2)", "tp": "S(0)"}, r0["q_placements"]  # colwise TP, FSDP on it
    assert all(r["optimizer_holds_model_params"] for r in results)
    ref = reference([(1, r0["dp_size"], STEPS)], clip=CLIP)
    worst = _check(results, ref["losses"], ref["params"][0], ref["params"][1])
    print(f"fabric hsdp_tp: worst update error {worst:.1e}")
    assert max(ref["norms"]) > CLIP, ref["norms"]  # clipping changed the steps
    torch.testing.assert_close(torch.tensor(r0["norms"]), torch.tensor(ref["norms"]), rtol=1e-9, atol=0)
    # FabricMFU: MFUMonitor's tags, and its MFU by hand (tokens once per dp replica, tp peers share them).
    tokens = r0["dp_size"] * T.PER_RANK_BATCH * T.SEQ
    fpt = model_flops_per_token(find_config(H.build(FAMILY).model), seq_len=T.SEQ)
    assert len(r0["mfu"]) == STEPS - 2  # the steps after the FLOP-counted batch 1 (as MFUMonitor)
    for _, t, mfu, tps in r0["mfu"]:
        assert mfu == pytest.approx(tokens * fpt / (t * 4 * PEAK), rel=1e-9)
        assert tps == pytest.approx(tokens / t, rel=1e-9)
    (run,) = [os.path.join(d, v) for d in [str(tmp_path / "tb" / "fabric")] for v in os.listdir(d)]
    acc = EventAccumulator(run)
    acc.Reload()
    want_tags = set(step_scalars(0.1, 0.1, {}, step_time_s=1, tflops_per_device=1, hardware_tflops_per_device=1,
                                 tokens_per_s=1, tokens_per_s_per_device=1))
    assert want_tags <= set(acc.Tags()["scalars"]), sorted(want_tags - set(acc.Tags()["scalars"]))


def test_fabric_save_then_fresh_job_loads_and_continues(pool, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    first = pool.run(fabric_fit, dict(dp_shard=2, tp=2), 2, momentum=0.9, joint=False, save=ckpt)
    manifest = json.loads((tmp_path / "ckpt" / "meshkit.json").read_text())
    assert manifest["world_size"] == 4, manifest
    with ProcessPool(world_size=4) as fresh:  # new processes: nothing of the first job survives but the folder
        second = fresh.run(fabric_fit, dict(dp_shard=4, tp=1), 2, seed=2, momentum=0.9, load=ckpt)
    assert all(r["step"] == 2 for r in second) and second[0]["degrees"]["dp_shard"] == 4  # resharded: 2x2 -> 4
    ref = reference([(1, first[0]["dp_size"], 2), (2, second[0]["dp_size"], 2)], momentum=0.9)
    _check(first, ref["losses"][:2], ref["params"][0], ref["params"][1])
    for name, value in second[0]["at_load"].items():  # the loaded weights are the saved ones, exactly
        torch.testing.assert_close(value, first[0]["params"][name], rtol=0, atol=0)
    worst = _check(second, ref["losses"][2:], ref["params"][1], ref["params"][2])  # error of the 2 resumed steps
    print(f"fabric resume: worst update error {worst:.1e}")


def test_fabric_cp_matches_one_process(pool):
    # dp_shard=2 × cp=2. {"input_ids"} rows of 16 tokens: each cp rank holds 8 of every row, and 7 or 8 targets
    # (the last token has none), so only the group's count gives the one-process mean.
    results = pool.run(fabric_fit, dict(preset="hsdp_cp", dp_shard=2, cp=2), STEPS, ids=True, clip_val=CLIP_VALUE)
    r0 = results[0]
    assert r0["degrees"] == {"dp_replicate": 1, "dp_shard": 2, "pp": 1, "cp": 2, "tp": 1}, r0["degrees"]
    ref = reference([(1, r0["dp_size"], STEPS)], clip_val=CLIP_VALUE, ids=True)
    assert min(ref["clipped"]) > 0, ref["clipped"]  # clip_val= changed every step
    worst = _check(results, ref["losses"], ref["params"][0], ref["params"][1])
    print(f"fabric hsdp_cp: worst update error {worst:.1e}")
    # each cp rank's own loss is its part of the replica's (not the loss): loss_mean is what made them agree
    peers = [r for r in results if r["dp_rank"] == r0["dp_rank"]]
    assert len(peers) == 2 and all(abs(a - b) > 1e-3 for a, b in zip(peers[0]["parts"], peers[1]["parts"]))


def test_fabric_loss_parallel_and_no_backward_sync_accumulation_match_one_process(pool):
    strategy = dict(dp_shard=2, tp=2, loss_parallel=True)
    results = pool.run(fabric_fit, strategy, 2, accumulate=2, clip=CLIP)
    r0 = results[0]
    assert r0["logits_placements"] == ["S(2)"], r0["logits_placements"]  # the logits stayed vocab-sharded
    assert all(r["grad_none_after_first_micro"] for r in results)  # no reduce-scatter on the first micro-step
    ref = reference([(1, r0["dp_size"], 2)], accumulate=2, clip=CLIP)
    assert max(ref["norms"]) > CLIP, ref["norms"]
    torch.testing.assert_close(torch.tensor(r0["norms"]), torch.tensor(ref["norms"]), rtol=1e-9, atol=0)
    worst = _check(results, ref["losses"], ref["params"][0], ref["params"][1])
    print(f"fabric loss_parallel + accumulation: worst update error {worst:.1e}")


def _forward_without_shard_batch(rank: int, world: int) -> str:
    import lightning as L

    T.launcher_env(rank, world)
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy="hsdp_cp")
    fabric.launch()
    model = fabric.setup_module(H.build(FAMILY).model)
    try:
        model(input_ids=_rows(1, 1)[:2, :T.SEQ])
    except ValueError as e:
        return str(e)
    return "no error"


def test_fabric_cp_forward_before_shard_batch_is_refused(pool):
    for message in pool.run(_forward_without_shard_batch):  # every rank, before FSDP's first all-gather
        assert "the model was called before any batch went through `fabric.strategy.shard_batch(batch)`" in message
