"""The MFU breakdown against injected truth: 4 gloo ranks, ``hsdp_tp``, the tiny demo model.

A run without delays (the noise floor), one where every rank's DataLoader collate sleeps
(-> data_wait), optimizer step sleeps after its closure (-> optimizer) and validation step sleeps
(-> validation), and one where rank 2 sleeps before its backward (-> exposed comm "waiting for
rank 2" on ranks 0, 1, 3; other, i.e. host idle, on rank 2); 300 ms per batch each. The phase
delays hit every rank at the same point of the step, so they share one run; the straggler
changes who waits for whom (and, on a 2-core machine, who gets the CPU), so it has its own. Each bucket's change over the profiled batches must match what was
injected into it within 25 % of the injected amount, every other bucket must stay within the same
tolerance (the baseline run is the noise floor), and the straggler report must name rank 2 in the
delayed run and nobody in the baseline. The truth table is printed (``pytest -s``).
"""

from __future__ import annotations

import json
import os

import pytest

from tests.dist_pool import ProcessPool

SEQ, BATCH, STEPS, DELAY_S = 16, 2, 7, 0.3
WINDOW = [4, 5, 6]  # profile_start=3 is the warm-up batch; 4, 5 and 6 are profiled
SLOW_RANK = 2


@pytest.fixture(scope="module")
def pool():
    with ProcessPool(world_size=4, timeout=600) as p:
        yield p


def _run(rank, world_size, root, phase_s, straggler_s):
    import time

    import lightning as L
    import torch
    from lightning.pytorch.loggers import TensorBoardLogger
    from torch.utils.data import DataLoader, default_collate

    from meshkit.models import LlamaConfig, LlamaLM, synthetic_tokens
    from meshkit.profiling.mfu import MFUMonitor

    class SlowAdamW(torch.optim.AdamW):
        def step(self, closure=None):
            loss = closure() if closure is not None else None  # Lightning's training closure: forward + backward
            time.sleep(phase_s)
            super().step()
            return loss

    class Injected(LlamaLM):
        def on_before_backward(self, loss):
            if self.global_rank == SLOW_RANK:
                time.sleep(straggler_s)

        def validation_step(self, batch, batch_idx):
            time.sleep(phase_s)
            return super().validation_step(batch, batch_idx)

        def configure_optimizers(self):
            return SlowAdamW(self.parameters(), lr=self.lr)

    def collate(items):
        time.sleep(phase_s)
        return default_collate(items)

    torch.manual_seed(0)
    train = DataLoader(synthetic_tokens(world_size * BATCH * STEPS, SEQ, 256), batch_size=BATCH, collate_fn=collate)
    val = DataLoader(synthetic_tokens(BATCH, SEQ, 256), batch_size=BATCH)
    mon = MFUMonitor(profile_every=100, profile_start=3, profile_steps=3, profile_budget=None, log_every=1,
                     measure_flops=False)
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy="hsdp_tp", max_steps=STEPS,
                        val_check_interval=1, limit_val_batches=1, num_sanity_val_steps=0,
                        logger=TensorBoardLogger(root, name="run"), callbacks=[mon], enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Injected(LlamaConfig.tiny(n_layers=2), lr=1e-3), train, val)
    per_batch = {m.step: {k: 1e3 * m.step_time_s * v for k, v in m.breakdown.items()} for m in mon.history}
    return {"per_batch": per_batch, "trace_dir": mon.trace_dir, "summaries": mon.window_summaries,
            "trace_ms": mon._in_window}


def _window_ms(result):
    """Per bucket, the median ms per batch over the profiled batches (an injected delay adds to every
    batch; a neighbour's job on the shared machine to one now and then)."""
    rows = [result["per_batch"][b] for b in WINDOW]
    return {k: float(sorted(r[k] for r in rows)[len(rows) // 2]) for k in rows[0]}


def _expected(case, rank):
    inj = 1e3 * DELAY_S
    if case == "phases":
        return {"data_wait": inj, "optimizer": inj, "validation": inj}
    return {"other" if rank == SLOW_RANK else "exposed_comm": inj}


def test_injected_delays_land_in_their_buckets(pool, tmp_path):
    from meshkit.profiling.overlap import analyze

    runs = {"base": pool.run(_run, str(tmp_path / "base"), 0.0, 0.0),
            "phases": pool.run(_run, str(tmp_path / "phases"), DELAY_S, 0.0),
            "straggler": pool.run(_run, str(tmp_path / "straggler"), 0.0, DELAY_S)}
    tol = 0.25 * 1e3 * DELAY_S
    table, failures = [], []
    for case in ("phases", "straggler"):
        for rank in range(4):
            b, s = _window_ms(runs["base"][rank]), _window_ms(runs[case][rank])
            want = _expected(case, rank)
            for k in b:
                delta = s[k] - b[k]
                expected = want.get(k)
                table.append((case, rank, k, expected or 0.0, round(delta, 1), round(b[k], 1)))
                if expected is not None and abs(delta - expected) > tol:
                    failures.append(f"{case}: rank {rank} {k}: injected {expected:.0f} ms, reported change {delta:.1f}")
                if expected is None and delta > tol:  # the injected time is not also charged to another bucket
                    failures.append(f"{case}: rank {rank} {k}: nothing injected, reported change {delta:.1f} ms")
    res = {case: analyze(runs[case][0]["trace_dir"]) for case in runs}
    waits = {r: res["straggler"]["ranks"][str(r)].get("waiting_for_ms", {}) for r in range(4)}
    print("\ntruth table (ms per batch, median over profiled batches %s; case, rank, bucket, injected, reported"
          " change, baseline):" % WINDOW)
    for row in table:
        if row[3] or abs(row[4]) > 1:
            print("  ", row)
    print("waiting_for_ms (straggler run, summed over the window):", json.dumps(waits))
    for case in runs:
        print(f"straggler verdict, {case} run:", res[case]["straggler"], "noise floor",
              res[case]["windows"][0]["noise_floor_ms"])
    out = os.environ.get("MESHKIT_TRUTH_OUT")
    if out:
        with open(out, "w") as f:
            json.dump({"runs": runs, "table": table, "waits": waits}, f, default=str)
    assert not failures, failures
    # Who they waited for: most of each waiting rank's extra blocked time is attributed to rank 2 (a wait
    # in a collective whose lateness stays under the noise floor is attributed to nobody).
    steps = len(WINDOW)
    for r in range(4):
        if r != SLOW_RANK:
            assert 0.5 * 1e3 * DELAY_S <= waits[r].get(str(SLOW_RANK), 0.0) / steps <= 1e3 * DELAY_S + tol, waits
    assert res["straggler"]["straggler"] is not None and res["straggler"]["straggler"]["rank"] == SLOW_RANK
    assert res["base"]["straggler"] is None and res["phases"]["straggler"] is None, res["base"]["straggler"]
    for case in runs:
        assert res[case]["windows_used"] == [3] and not res[case]["partial"], res[case]["problems"]


# ------------------------------------------------------------------ fit: time between and inside the steps

FIT_D = 0.8  # s per injection (a real save varies by up to 0.35 s: the checkpoint part is held to the calls' timing)
FIT_BATCHES, FIT_EPOCHS = 3, 3  # batches 0-2, 3-5, 6-8; validation and a save at each epoch's end
INNER_SAVE, SLOW_END = 4, 4  # a save from training_step at batch 4; rank 2 slow at batch 4's end
FIT_WINDOW = [4, 5]  # profile_start=3: warm-up 3, profiled 4 (the inner save) and 5 (the stop-signal wait)


def _fit_run(rank, world_size, root, d):
    import time

    import lightning as L
    import torch
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from lightning.pytorch.loggers import TensorBoardLogger
    from torch.utils.data import DataLoader

    from meshkit.models import LlamaConfig, LlamaLM, synthetic_tokens
    from meshkit.profiling.mfu import MFUMonitor

    class Injected(LlamaLM):
        def training_step(self, batch, batch_idx):
            if self.trainer.global_step == INNER_SAVE:  # its wall time is the truth the batch's part is held to
                t = time.perf_counter()
                self.trainer.save_checkpoint(os.path.join(root, "inner.ckpt"))
                self.inner_save_s = time.perf_counter() - t
            return super().training_step(batch, batch_idx)

        def validation_step(self, batch, batch_idx):
            time.sleep(d)
            return super().validation_step(batch, batch_idx)

        def on_save_checkpoint(self, checkpoint):
            time.sleep(d)

        def on_train_batch_end(self, outputs, batch, batch_idx):  # after every callback's: between the batches
            if self.global_rank == SLOW_RANK and self.trainer.global_step == SLOW_END + 1:
                time.sleep(d)

    class SlowDelete(Callback):  # before the monitor, which wraps it
        def setup(self, trainer, pl_module, stage):
            original = trainer.strategy.remove_checkpoint

            def remove_checkpoint(filepath):  # every rank calls it; Strategy.remove_checkpoint deletes on rank 0
                t = time.perf_counter()
                try:
                    if trainer.is_global_zero:  # the first delete (epoch 1's end) slow, the last (no step after) not
                        if not self.deleted:
                            time.sleep(d)
                        self.deleted.append(os.path.basename(str(filepath)))
                    return original(filepath)
                finally:
                    self.saving_s += time.perf_counter() - t

            save = trainer.save_checkpoint

            def save_checkpoint(*args, **kwargs):
                t = time.perf_counter()
                try:
                    return save(*args, **kwargs)
                finally:
                    self.saving_s += time.perf_counter() - t

            self.deleted, self.saving_s = [], 0.0
            trainer.strategy.remove_checkpoint = remove_checkpoint
            trainer.save_checkpoint = save_checkpoint

    torch.manual_seed(0)
    train = DataLoader(synthetic_tokens(world_size * BATCH * FIT_BATCHES, SEQ, 256), batch_size=BATCH)
    val = DataLoader(synthetic_tokens(world_size * BATCH, SEQ, 256), batch_size=BATCH)
    slow = SlowDelete()
    mon = MFUMonitor(profile_every=100, profile_start=3, profile_steps=2, profile_budget=None, log_every=1,
                     measure_flops=False)
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy="hsdp_tp", max_epochs=FIT_EPOCHS,
                        limit_train_batches=FIT_BATCHES, limit_val_batches=1, num_sanity_val_steps=0,
                        logger=TensorBoardLogger(root, name="run"), enable_progress_bar=False,
                        callbacks=[slow, mon, ModelCheckpoint(dirpath=os.path.join(root, "ckpt"), save_top_k=1)],
                        enable_model_summary=False)
    t0 = time.perf_counter()
    model = Injected(LlamaConfig.tiny(n_layers=2), lr=1e-3)
    trainer.fit(model, train, val)
    outside = time.perf_counter() - t0
    per_batch = {m.step: {"step_ms": 1e3 * m.step_time_s,
                          **{k: 1e3 * m.step_time_s * v for k, v in m.breakdown.items()}} for m in mon.history}
    return {"fit": mon.fit_time_s, "outside_s": outside, "per_batch": per_batch, "trace_dir": mon.trace_dir,
            "deleted": slow.deleted, "inner_save_s": model.inner_save_s, "saving_s": slow.saving_s}


def _fit_parts(fit):
    """Per part, s over the whole fit: the steps' phases and the between-steps parts of the same name summed."""
    out = dict(fit["steps"])
    for k, v in fit["between_steps"].items():
        out[k] = out.get(k, 0.0) + v
    return out


def _fit_expected(rank, d):
    """Injected s per part: validation at 3 epoch ends and 4 saves (3 epoch ends + training_step's) on every
    rank, rank 0's slow delete of the old checkpoint (at epoch 1's end), rank 2's slow batch end (its own
    data_wait: the loop between batches). Who waits for whom is checked apart: ``stop_signal`` (a wait for
    the broadcast's root, rank 0, is certain there; one for rank 2 may land there or in forward+backward's
    first collective, and forward+backward's total over a fit is jitter: see the batch checks)."""
    want = {"validation": 3 * d, "checkpoint": 4 * d + (d if rank == 0 else 0.0)}
    if rank == SLOW_RANK:
        want["data_wait"] = d
    return want


def test_fit_time_lands_once_in_its_part(pool, tmp_path):
    """Every second of 4 ranks' fit in a step phase or a between-steps part, once, against injected time
    (``FIT_D`` each) and a baseline run without it: each part's change over the fit matches what was
    injected into it within 25 % of that (the checkpoint part: the saves' and deletes' own wall time, timed
    around the calls in the same run, within 2 %), the rest stays within half of one injection; the stop-signal
    wait holds rank 0's lateness on every other rank; the parts add up to the monitor's wall time and that
    to fit()'s within 2 % (a part counted twice fails this). Forward+backward's total is not compared
    (over a fit it moved by 0.25 s between two runs of the same code); per batch instead, in the profiled
    window: the save from training_step is not also forward+backward (batch 4), the wait for rank 2 is
    exposed comm once (batch 5: the stop-signal broadcast's or forward+backward's, not both) and, in the
    trace, waiting for rank 2."""
    from meshkit.profiling.overlap import analyze

    # The first fit in fresh pool processes pays one-time costs (measured: 0.5 s of compute and 0.3 s of
    # optimizer state in its first batch, 0.2 s of setup, up to 0.65 s of rendezvous before the monitor's
    # setup hook): a warm-up fit, discarded, so that the baseline is a repeat of the injected run.
    pool.run(_fit_run, str(tmp_path / "warm"), 0.0)
    runs = {"base": pool.run(_fit_run, str(tmp_path / "base"), 0.0),
            "fit": pool.run(_fit_run, str(tmp_path / "fit"), FIT_D)}
    failures, table = [], []
    for case, res in runs.items():
        for rank, r in enumerate(res):
            f = r["fit"]
            if abs(f["accounted"] - f["wall"]) > 0.02 * f["wall"] or not 0.98 * r["outside_s"] <= f["wall"] <= \
                    r["outside_s"]:
                failures.append(f"{case} rank {rank}: accounted {f['accounted']:.3f} s, monitor's wall "
                                f"{f['wall']:.3f} s, fit() {r['outside_s']:.3f} s")
    tol = 0.25 * FIT_D
    for rank in range(4):
        b, s = _fit_parts(runs["base"][rank]["fit"]), _fit_parts(runs["fit"][rank]["fit"])
        want = _fit_expected(rank, FIT_D)
        for k in b:
            delta, expected = s[k] - b[k], want.get(k)
            table.append((rank, k, expected or 0.0, round(delta, 3), round(b[k], 3)))
            if k in ("stop_signal", "forward_backward"):
                continue  # (below, and the batch checks)
            if k == "checkpoint":  # held to the saves' and deletes' own wall time, timed around the calls in the
                for case, part in (("base", b[k]), ("fit", s[k])):  # run: a real save varies up to 0.35 s
                    saving = runs[case][rank]["saving_s"]
                    if abs(part - saving) > max(0.05, 0.02 * saving):
                        failures.append(f"{case} rank {rank} checkpoint: {part:.3f} s, saves and deletes took "
                                        f"{saving:.3f} s")
                if runs["fit"][rank]["saving_s"] < expected:  # the sleeps alone are that long
                    failures.append(f"rank {rank}: the saves and deletes took {runs['fit'][rank]['saving_s']:.3f} "
                                    f"s with {expected:.2f} s injected")
                continue
            if expected is not None and abs(delta - expected) > max(tol, 0.25 * expected):
                failures.append(f"rank {rank} {k}: injected {expected:.2f} s, reported change {delta:.3f}")
            if expected is None and delta > FIT_D / 2:  # injections come in FIT_D: one misplaced moves a part by
                # that much; real work (the profiler's export: 0.2 s, and as much again in one run of five) less
                failures.append(f"rank {rank} {k}: nothing injected, reported change {delta:.3f} s")
        stop = s["stop_signal"] - b["stop_signal"]  # rank 0's slow delete: the others wait in its broadcast
        if not (FIT_D - tol if rank != 0 else -tol) <= stop <= (2 if rank != 0 else 1) * FIT_D + tol:
            failures.append(f"rank {rank}: stop-signal wait grew {stop:.3f} s (rank 0 {FIT_D} s late after the "
                            f"epoch 1 save, rank 2 {FIT_D} s late after batch {SLOW_END})")
    out = os.environ.get("MESHKIT_TRUTH_OUT")
    if out:
        with open(out + ".fit.json", "w") as f:
            json.dump({"runs": runs, "table": table}, f, default=str)
    print("\nfit truth table (s over the fit; rank, part, injected, reported change, baseline):")
    for row in table:
        print("  ", row)
    for rank in range(4):
        got = runs["fit"][rank]["per_batch"]
        base = runs["base"][rank]["per_batch"]
        # batch 4 saved from training_step: the parts of its forward+backward are as without the save (a save
        # counted there too would be compute: the trace gives exposed comm, bubble and other, compute the rest)
        core = lambda v: v["compute"] + v["recompute"] + v["bubble"] + v["other"]  # noqa: E731
        if core(got[INNER_SAVE]) - max(core(base[INNER_SAVE]), core(got[SLOW_END + 1])) > 1e3 * tol:
            failures.append(f"rank {rank} batch {INNER_SAVE}: forward+backward {core(got[INNER_SAVE]):.0f} ms, "
                            f"{core(base[INNER_SAVE]):.0f} without the save: it holds the save")
        # ... and its checkpoint part is the save's own wall time, timed around the call in the same run (a
        # save's real cost on a loaded host varies by more than the tolerance between two runs: CI saw 0.13 s
        # against a baseline's 0.33 s); counted twice or not at all, it is off by the save's whole time (>= 0.2 s)
        for case in runs:
            saved, part = 1e3 * runs[case][rank]["inner_save_s"], runs[case][rank]["per_batch"][INNER_SAVE]
            if abs(part["checkpoint"] - saved) > 50.0:  # measured: equal to the ms; 50 ms for a loaded host
                failures.append(f"{case} rank {rank} batch {INNER_SAVE}: checkpoint {part['checkpoint']:.0f} ms, "
                                f"the save took {saved:.0f} ms")
        if runs["fit"][rank]["inner_save_s"] < FIT_D:
            failures.append(f"rank {rank}: the injected save took {runs['fit'][rank]['inner_save_s']:.3f} s")
        # batch 5: the stop-signal wait is exposed comm, once (the timers', not also the trace's)
        exp = 1e3 * FIT_D if rank != SLOW_RANK else 0.0
        delta = got[SLOW_END + 1]["exposed_comm"] - base[SLOW_END + 1]["exposed_comm"]
        if abs(delta - exp) > 1e3 * tol:
            failures.append(f"rank {rank} batch {SLOW_END + 1}: exposed comm change {delta:.0f} ms, "
                            f"injected {exp:.0f}")
    res = analyze(runs["fit"][0]["trace_dir"])
    waits = {r: res["ranks"][str(r)].get("waiting_for_ms", {}) for r in range(4)}
    print("waiting_for_ms (fit run's window, batches %s):" % FIT_WINDOW, json.dumps(waits))
    for r in range(4):
        if r != SLOW_RANK and abs(waits[r].get(str(SLOW_RANK), 0.0) - 1e3 * FIT_D) > 1e3 * tol:
            failures.append(f"rank {r}: waited {waits[r]} in the window, not {1e3 * FIT_D:.0f} ms for "
                            f"rank {SLOW_RANK}")
    assert res["windows_used"] == [3] and not res["partial"], res["problems"]
    assert len(runs["fit"][0]["deleted"]) == 2 and not any(runs["fit"][r]["deleted"] for r in (1, 2, 3))
    assert not failures, failures
