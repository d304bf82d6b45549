"""Pipeline parallelism on gloo, world 4: every torch schedule matches one process.

One ProcessPool(4) for the module. The reference is one process training the same model on the
same batches (full batch, no micro-batches); the pipeline must reproduce its 5 losses within rtol
1e-4 (fp32) and its parameters after the last step. SGD, so that equal parameters mean equal
gradients (Adam's g/sqrt(v) would amplify rounding in near-zero gradients).
"""

from __future__ import annotations

import json
import tempfile
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from meshkit.models import LlamaConfig, Transformer, synthetic_tokens
from meshkit.plugins.pipeline import build_pipeline, causal_lm_loss, pipeline_eval, pipeline_step
from tests.dist_pool import ProcessPool

STEPS, BATCH, SEQ, LR = 5, 8, 16, 0.5
CFG = dict(n_layers=8)

SCHEDULE_CASES = [
    ("gpipe", None),
    ("1f1b", None),
    ("interleaved_1f1b", 2),
    ("looped_bfs", 2),
    ("interleaved_zero_bubble", 2),
    ("zbv_zero_bubble", 2),
    ("dualpipev", 2),
]


def _model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(LlamaConfig.tiny(**CFG))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    data = synthetic_tokens(STEPS * BATCH, SEQ, 256, seed=1)
    return [(d[:, :-1], d[:, 1:]) for d in data.split(BATCH)]


def _reference() -> tuple[list[float], dict[str, torch.Tensor], float]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for x, y in _batches():
        loss = causal_lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    with torch.no_grad():
        x, y = _batches()[0]
        val = causal_lm_loss(model(x), y).item()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, val


_MESH = None


def _pp_mesh(world_size: int):
    global _MESH
    if _MESH is None:
        from torch.distributed.device_mesh import init_device_mesh

        _MESH = init_device_mesh("cpu", (world_size,), mesh_dim_names=("pp",))
    return _MESH["pp"]


def _train(rank: int, world_size: int, schedule: str, v: int | None, timeline_dir: str) -> dict:
    pipe = build_pipeline(
        _model(), _pp_mesh(world_size), schedule=schedule, batch_size=BATCH, virtual_stages=v, timeline_dir=timeline_dir
    )
    opt = torch.optim.SGD(pipe.parameters(), lr=LR)
    losses = []
    for x, y in _batches():
        losses.append(pipeline_step(pipe, x, y).item())
        opt.step()
        opt.zero_grad()
    x, y = _batches()[0]
    val = pipeline_eval(pipe, x, y).item()
    return {
        "losses": losses,
        "val": val,
        "state": {k: t.detach().clone() for k, t in pipe.state_dict().items()},
        "stage_ids": pipe.stage_ids,
        "microbatches": pipe.microbatches,
    }


@pytest.fixture(scope="module")
def pool():
    with ProcessPool(world_size=4) as p:
        yield p


@pytest.fixture(scope="module")
def reference():
    return _reference()


@pytest.mark.parametrize("schedule,v", SCHEDULE_CASES)
def test_schedule_matches_one_process(pool, reference, schedule, v):
    ref_losses, ref_state, ref_val = reference
    with tempfile.TemporaryDirectory() as tmp:
        out = pool.run(_train, schedule, v, tmp)
        events = [json.loads(line) for r in range(4) for line in (Path(tmp) / f"pp_timeline_rank{r}.jsonl").read_text().splitlines()]
    # Every rank reports the last stage's loss; it equals one process's full-batch loss.
    for r in range(4):
        torch.testing.assert_close(torch.tensor(out[r]["losses"]), torch.tensor(ref_losses), rtol=1e-4, atol=0)
        assert out[r]["val"] == pytest.approx(ref_val, rel=1e-4)
    # Stages partition the model: every parameter exactly once, under its full-model name.
    merged: dict[str, torch.Tensor] = {}
    for r in range(4):
        assert not set(merged) & set(out[r]["state"])
        merged.update(out[r]["state"])
    assert set(merged) == set(ref_state)
    for k, t in ref_state.items():
        torch.testing.assert_close(merged[k], t, rtol=1e-4, atol=1e-5, msg=k)
    # The timeline: every (stage, micro-batch) forwarded once and backwarded once per step.
    m, stages = out[0]["microbatches"], 4 * (v or 1)
    kinds = Counter(e["action"] for e in events)
    assert kinds["F"] == STEPS * stages * m
    assert kinds["B"] + kinds["I"] == STEPS * stages * m
    assert kinds["W"] == kinds["I"]
    if "zero_bubble" in schedule:
        assert kinds["I"] > 0
    assert {e["step"] for e in events} == set(range(STEPS))
    assert all(e["end_ns"] >= e["start_ns"] and e["stage"] in out[e["rank"]]["stage_ids"] for e in events)


# ---- Lightning: NDParallelStrategy with pp > 1 (same pool) ---------------------------------------------------

LIGHTNING_STEPS = 4

# (id, strategy kwargs, model kind, trainer kwargs, expected degrees)
LIGHTNING_CASES = [
    ("pp_fsdp", dict(preset="pp"), "meshkit", {}, dict(pp=2, dp_shard=2, tp=1)),
    ("pp4_clip", dict(preset="pp", dp_shard=1, pp=4, pp_schedule="gpipe"), "meshkit", dict(gradient_clip_val=0.05), dict(pp=4, dp_shard=1, tp=1)),
    ("pp_accumulate", dict(preset="pp"), "meshkit", dict(accumulate_grad_batches=2), dict(pp=2, dp_shard=2, tp=1)),
    ("tp_pp", dict(preset="tp_pp"), "meshkit", {}, dict(pp=2, dp_shard=1, tp=2)),
    ("hf_tp_pp", dict(preset="tp_pp", pp_schedule="gpipe"), "hf", {}, dict(pp=2, dp_shard=1, tp=2)),
]


def _lightning_fit(rank: int, world: int, strategy: dict, kind: str, kwargs: dict) -> dict:
    import meshkit
    from tests.distributed import training as T

    return T.fit(rank, world, meshkit.NDParallelStrategy(**strategy), devices=4, steps=LIGHTNING_STEPS, kind=kind, **kwargs)


@pytest.mark.parametrize("case", LIGHTNING_CASES, ids=[c[0] for c in LIGHTNING_CASES])
def test_lightning_pipeline_matches_one_process(pool, case):
    from tests.distributed import training as T

    _, strategy, kind, trainer_kwargs, degrees = case
    results = pool.run(_lightning_fit, strategy, kind, trainer_kwargs)
    assert {k: results[0]["degrees"][k] for k in degrees} == degrees
    clip = trainer_kwargs.get("gradient_clip_val")
    accumulate = trainer_kwargs.get("accumulate_grad_batches", 1)
    want_losses, want_params = T.reference(kind, LIGHTNING_STEPS, results[0]["dp_size"], clip=clip, accumulate=accumulate)
    # The logged loss is the same on every rank of a dp group (pp and tp ranks included): checked here.
    # Lightning's batch output is the returned loss divided by accumulate_grad_batches (its ClosureResult).
    got = torch.tensor(T.global_losses(results)) * accumulate
    torch.testing.assert_close(got, torch.tensor(want_losses), rtol=1e-4, atol=0)
    merged: dict[str, torch.Tensor] = {}
    for r in results:
        merged.update(r["params"])
    T.assert_params_close(merged, want_params)


# ---- checkpoints: saved at pp=2, resumed at pp=4 and pp=1 -----------------------------------------------------


def _ckpt_trainer(rank: int, strategy: dict, **kwargs):
    import lightning as L

    import meshkit
    from tests.distributed import training as T

    T.launcher_env(rank, 4)
    return L.Trainer(
        accelerator="cpu", devices=4, strategy=meshkit.NDParallelStrategy(**strategy), logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, **kwargs,
    )


def _save_pp2(rank: int, world: int, path: str) -> dict:
    from torch.utils.data import DataLoader

    from tests.distributed import training as T

    module = T.build_module("meshkit")
    trainer = _ckpt_trainer(rank, dict(preset="pp", pp=2, dp_shard=2), max_steps=3)
    trainer.fit(module, DataLoader(T.tokens(3 * T.PER_RANK_BATCH * 2), batch_size=T.PER_RANK_BATCH))
    trainer.save_checkpoint(path)
    return {"params": T.full_params(module)}


def _load(rank: int, world: int, strategy: dict, path: str) -> dict:
    from torch.utils.data import DataLoader

    from tests.distributed import training as T

    module = T.build_module("meshkit", seed=123)  # a different init: everything must come from the checkpoint
    trainer = _ckpt_trainer(rank, strategy, max_steps=3)  # already reached: restore only
    trainer.fit(module, DataLoader(T.tokens(16), batch_size=T.PER_RANK_BATCH), ckpt_path=path)
    return {"params": T.full_params(module), "global_step": trainer.global_step,
            "degrees": trainer.strategy.parallel_dims.degrees}


def _merged(results: list[dict]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for r in results:
        out.update(r["params"])
    return out


@pytest.fixture(scope="module")
def pp2_checkpoint(pool, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("pp_ckpt") / "pp2.ckpt")
    return path, _merged(pool.run(_save_pp2, path))


@pytest.mark.parametrize(
    "strategy,pp",
    [(dict(preset="pp", pp=4, dp_shard=1, pp_schedule="gpipe"), 4), (dict(preset="fsdp2", dp_shard=4), 1),
     (dict(preset="pp", pp=2, dp_shard=2), 2)],  # strict keys gathered over each pp group, two dp groups
    ids=["pp4", "pp1", "pp2_dp2"],
)
def test_checkpoint_from_pp2_resumes_at_other_pp(pool, pp2_checkpoint, strategy, pp):
    path, saved = pp2_checkpoint
    loaded = pool.run(_load, strategy, path)
    assert loaded[0]["degrees"]["pp"] == pp and loaded[0]["global_step"] == 3
    got = _merged(loaded)
    assert got.keys() == saved.keys() and len(saved) == 2 + 4 * 9 + 1  # embedding, 4 blocks × 9, norm + head
    for name, tensor in saved.items():
        assert torch.equal(got[name], tensor), name


def _validate(rank: int, world: int) -> float:
    from torch.utils.data import DataLoader

    from tests.distributed import training as T

    trainer = _ckpt_trainer(rank, dict(preset="pp", pp=2, dp_shard=2))
    out = trainer.validate(T.build_module("meshkit"), DataLoader(T.tokens(8), batch_size=T.PER_RANK_BATCH), verbose=False)
    return out[0]["val_loss"]


def test_lightning_validation_is_forward_only_through_the_stages(pool):
    from tests.distributed import training as T

    got = pool.run(_validate)
    # 8 sequences of equal length over dp=2 ranks, 2 per batch: the epoch's val_loss (mean of dp-synced batch
    # means) is the token-mean cross-entropy over all 8 sequences in one process.
    want = T.module_loss(T.build_module("meshkit"), T.tokens(8)).item()
    assert got == pytest.approx([want] * 4, rel=1e-5)


# ---- measured bubble vs the simulator (same pool) ---------------------------------------------------------------

DEVICE_MS = 25.0  # emulated device time per layer forward; backward 2x


class _DeviceTime(torch.autograd.Function):
    """Identity that holds the host ``ms`` in forward and ``2·ms`` in backward, as a rank does while
    its accelerator runs a kernel: p ranks then measure the pipeline, not the 2 CPU cores they share."""

    @staticmethod
    def forward(ctx, x, ms):
        ctx.ms = ms
        time.sleep(ms / 1e3)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(2 * ctx.ms / 1e3)
        return grad, None


def _bubble_run(rank: int, world_size: int, timeline_dir: str, steps: int) -> None:
    model = _model()
    for layer in model.layers.values():
        layer.register_forward_hook(lambda mod, args, out: _DeviceTime.apply(out, DEVICE_MS))
    pipe = build_pipeline(model, _pp_mesh(world_size), schedule="1f1b", batch_size=BATCH, microbatches=8,
                          timeline_dir=timeline_dir)
    x, y = _batches()[0]
    for _ in range(steps):
        pipeline_step(pipe, x, y)


def test_measured_bubble_matches_simulator_pp4_m8_1f1b(pool, tmp_path):
    """pp=4, m=8, 1F1B, 2 layers per stage: the measured bubble (idle ÷ span × ranks, from the
    timeline) is within 3 points of the simulator replaying the run with its measured F and B
    times, and that replay gives the closed form (p-1)/(m+p-1) = 3/11 for these balanced stages."""
    from meshkit.profiling.bubble import measured_bubble, read_timeline, simulate_from_timeline
    from meshkit.schedules import theoretical_bubble

    pool.run(_bubble_run, str(tmp_path), 3)
    records = read_timeline(str(tmp_path))
    assert {(r.action, r.stage) for r in records} == {(a, s) for a in "FB" for s in range(4)}
    measured = measured_bubble(records, skip_steps=1)
    simulated = simulate_from_timeline(records, skip_steps=1)
    forward = [r.duration_ns / 1e6 for r in records if r.action == "F"]
    assert min(forward) >= 2 * DEVICE_MS  # the emulated kernels are inside the recorded actions
    assert simulated.bubble_fraction == pytest.approx(theoretical_bubble("1f1b", 4, 8), abs=0.01)
    assert measured.bubble_fraction == pytest.approx(simulated.bubble_fraction, abs=0.03), (
        measured.per_step, simulated.bubble_fraction)
