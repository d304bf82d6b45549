"""Every second of ``fit`` in one place, once: MFUMonitor's step phases and between-steps parts against
injected time, one process (the stop-signal broadcast needs ranks: tests/distributed/test_mfu_truth.py).

Injected with sleeps of ``D`` each (all inside what they are injected into, so each part must hold at
least its injections): epoch-end validation (Lightning's default, 2 epochs: the first epoch's lands in the
next step, the last one's after the last step), ModelCheckpoint's epoch-end saves (``on_save_checkpoint``),
a save called from ``training_step`` (it ran inside forward+backward: counted once, as checkpoint), a save
from ``on_validation_epoch_end`` (inside validation: counted once, as checkpoint), and a slow delete of the
previous checkpoint (ModelCheckpoint's ``save_top_k=1`` at the second epoch's end). Nothing lands twice:
the steps' phases and the between-steps parts add up to the monitor's wall time of ``fit`` (a save counted
twice would add ``D``, 5-8 % of it), and data wait stays below one injection.
"""

from __future__ import annotations

import time

import pytest
import torch

D = 0.2
BATCHES, EPOCHS, INNER_SAVE_AT = 3, 2, 4  # the save from training_step: global batch 4 (epoch 1, its second)


def _fit(tmp_path):
    import lightning as L
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint

    from meshkit.models import LlamaConfig, LlamaLM, synthetic_tokens
    from meshkit.profiling.mfu import MFUMonitor

    class Injected(LlamaLM):
        def training_step(self, batch, batch_idx):
            if self.trainer.global_step == INNER_SAVE_AT:
                self.trainer.save_checkpoint(str(tmp_path / "inner.ckpt"))
            return super().training_step(batch, batch_idx)

        def validation_step(self, batch, batch_idx):
            time.sleep(D)
            return super().validation_step(batch, batch_idx)

        def on_validation_epoch_end(self):
            if not self.trainer.sanity_checking and self.current_epoch == 0:
                self.trainer.save_checkpoint(str(tmp_path / "in_validation.ckpt"))

        def on_save_checkpoint(self, checkpoint):
            time.sleep(D)

    class SlowDelete(Callback):  # before the monitor: it wraps the slow delete
        def setup(self, trainer, pl_module, stage):
            original = trainer.strategy.remove_checkpoint

            def remove_checkpoint(filepath):
                time.sleep(D)
                self.deleted.append(filepath)
                return original(filepath)

            self.deleted = []
            trainer.strategy.remove_checkpoint = remove_checkpoint

    torch.manual_seed(0)
    data = torch.utils.data.DataLoader(synthetic_tokens(2 * BATCHES, 16, 256), batch_size=2)
    val = torch.utils.data.DataLoader(synthetic_tokens(2, 16, 256), batch_size=2)
    slow, mon = SlowDelete(), MFUMonitor(profile_every=0, measure_flops=False, peak_flops=1e12, log_every=1)
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_top_k=1)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=EPOCHS, limit_val_batches=1, num_sanity_val_steps=1,
                        logger=False, default_root_dir=str(tmp_path), callbacks=[slow, mon, ckpt],
                        enable_progress_bar=False, enable_model_summary=False)
    t0 = time.perf_counter()
    trainer.fit(Injected(LlamaConfig.tiny(n_layers=1), lr=1e-3), data, val)
    return mon, slow, time.perf_counter() - t0


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    return _fit(tmp_path_factory.mktemp("fit"))


def test_every_second_of_fit_is_counted_once(fitted):
    mon, slow, outside_s = fitted
    f = mon.fit_time_s
    steps, between = f["steps"], f["between_steps"]
    print("\nfit as the monitor saw it (s):", {k: round(v, 4) for k, v in f.items() if isinstance(v, float)},
          "\n  steps:", {k: round(v, 4) for k, v in steps.items()},
          "\n  between steps:", {k: round(v, 4) for k, v in between.items()}, "\n  fit() from outside:", outside_s)
    assert f["n_steps"] == BATCHES * EPOCHS and len(slow.deleted) == 1
    # nothing missing, nothing twice: the parts tile the monitor's view of fit (a save counted twice: + D)
    assert abs(f["accounted"] - f["wall"]) <= 0.02 * f["wall"], f
    # and the monitor sees fit() (setup hook -> teardown hook) but Lightning's own set-up and tear-down
    assert f["wall"] <= outside_s and f["wall"] >= 0.98 * outside_s, (f["wall"], outside_s)
    # validation at each epoch's end: the first epoch's in the next step, the last one's after the last step
    assert steps["validation"] >= D and between["validation"] >= D
    # the sanity check (one validation batch, its D) is its own part, not validation
    assert between["sanity_check"] >= D and steps["validation"] + between["validation"] < 2 * D + D / 2
    # checkpoint: 2 epoch-end saves + the one from training_step + the one from validation (4 D) + the delete (D)
    assert steps["checkpoint"] + between["checkpoint"] >= 5 * D
    assert steps["data_wait"] < D / 2 and between["other"] < D / 2, (steps, between)  # the delete is not data wait


def test_a_save_inside_training_step_is_its_steps_checkpoint(fitted):
    """The step whose training_step saved: its checkpoint share holds the save, its other parts do not: its
    time minus the save is that of a plain step (the median of the others, within one injection)."""
    mon, _, _ = fitted
    hist = {m.step: m for m in mon.history}
    saved = hist[INNER_SAVE_AT]
    ckpt_s = saved.breakdown["checkpoint"] * saved.step_time_s
    assert ckpt_s >= D
    plain = sorted(m.step_time_s for b, m in hist.items() if b not in (INNER_SAVE_AT, BATCHES))  # BATCHES: epoch 2's
    median = plain[len(plain) // 2]                                                             # first (validation)
    assert saved.step_time_s - ckpt_s < median + D / 2, (saved.step_time_s, ckpt_s, median)
    assert sum(saved.breakdown.values()) == pytest.approx(1.0)
