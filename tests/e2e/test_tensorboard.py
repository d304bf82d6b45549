"""End to end: a small run with MFUMonitor, then `tensorboard --logdir` serves everything it wrote.

Starts TensorBoard on a free 127.0.0.1 port, waits a bounded time, queries its HTTP API for the
scalars, the "MFU breakdown" custom-scalar layout, the text table, the images and the
pytorch_profiler run, and kills it at the end. Also runs `meshkit analyze --json` on the traces.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import pytest

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    import lightning as L
    import torch
    from lightning.pytorch.loggers import TensorBoardLogger

    from meshkit.models import LlamaConfig, LlamaLM, synthetic_tokens
    from meshkit.profiling.mfu import MFUMonitor

    root = tmp_path_factory.mktemp("tb")
    loader = torch.utils.data.DataLoader(synthetic_tokens(16, 16, 256), batch_size=2)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=6, logger=TensorBoardLogger(str(root), name="demo"),
                        callbacks=[MFUMonitor(profile_every=3, profile_start=2, profile_steps=1, log_every=1)],
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(LlamaLM(LlamaConfig.tiny()), loader)
    return root, trainer.log_dir


def _get(port: int, path: str, **params):
    url = f"http://127.0.0.1:{port}{path}" + ("?" + urllib.parse.urlencode(params) if params else "")
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read().decode())


def _wait(fn, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            value = fn()
            if value:
                return value
        except OSError as exc:  # not listening yet
            last = exc
        time.sleep(1.0)
    raise AssertionError(f"TensorBoard did not serve {what} within {timeout_s} s (last error: {last})")


def test_tensorboard_serves_everything(run_dir):
    root, log_dir = run_dir
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(root), "--host", "127.0.0.1",
                             "--port", str(port), "--reload_interval", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        plugins = _wait(lambda: _get(port, "/data/plugins_listing"), 90, "the plugin listing")
        for name in ("scalars", "custom_scalars", "text", "images", "pytorch_profiler"):
            assert name in plugins, sorted(plugins)
        tags = _wait(lambda: _get(port, "/data/plugin/scalars/tags"), 60, "scalars")
        run = next(iter(tags))
        for tag in ("mfu/mfu", "mfu/hfu", "mfu/tokens_per_s", "mfu/breakdown/compute", "mfu/points_lost/other"):
            assert tag in tags[run], sorted(tags[run])
        series = _get(port, "/data/plugin/scalars/scalars", run=run, tag="mfu/mfu")
        assert series and all(0 < point[2] < 1 for point in series)
        layout = _wait(lambda: _get(port, "/data/plugin/custom_scalars/layout"), 30, "the custom-scalar layout")
        assert [c["title"] for c in layout["category"]] == ["MFU breakdown"]
        text_tags = _wait(lambda: _get(port, "/data/plugin/text/tags"), 30, "text")
        (text_tag,) = [t for t in text_tags[run] if t.startswith("mfu/breakdown_table")]  # torch adds /text_summary
        table = _get(port, "/data/plugin/text/text", run=run, tag=text_tag)
        assert "achieved MFU" in json.dumps(table) and "exposed_comm" in json.dumps(table)
        images = _wait(lambda: _get(port, "/data/plugin/images/tags"), 30, "images")
        assert "mfu/waterfall" in images[run]
        runs = _wait(lambda: _get(port, "/data/plugin/pytorch_profiler/runs").get("runs"), 90, "the profiler run")
        assert any("profiler" in r for r in runs), runs
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_analyze_cli_reads_the_run(run_dir):
    _, log_dir = run_dir
    out = subprocess.run([sys.executable, "-m", "meshkit.profiling.overlap", os.path.join(log_dir, "profiler"),
                          "--json"], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["ranks"]["0"]["steps"] >= 1 and result["ranks"]["0"]["compute_ms"] > 0


def test_table_waterfall_and_scalars_show_the_same_window(run_dir):
    """Read the event file back: the window's markdown table, its waterfall image and its
    ``mfu/window/*`` scalars carry the same numbers (the image is compared with a re-rendering of
    the scalars; a breakdown moved by 5 points renders differently)."""
    import io
    import re

    import numpy as np
    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from meshkit.profiling.report import BREAKDOWN_PARTS, figure_to_array, waterfall_figure

    _, log_dir = run_dir
    acc = EventAccumulator(log_dir, size_guidance={"tensors": 0, "images": 0, "scalars": 0})
    acc.Reload()
    (tag,) = [t for t in acc.Tags()["tensors"] if t.startswith("mfu/breakdown_table")]
    events = acc.Tensors(tag)
    step = events[0].step
    text = events[0].tensor_proto.string_val[0].decode()
    scal = {t: {e.step: e.value for e in acc.Scalars(t)} for t in acc.Tags()["scalars"] if t.startswith("mfu/window/")}
    fractions = {p: scal[f"mfu/window/breakdown/{p}"][step] for p in BREAKDOWN_PARTS}
    mfu = scal["mfu/window/mfu"][step]
    assert sum(fractions.values()) == pytest.approx(1.0, abs=1e-5)
    for p in BREAKDOWN_PARTS:  # the table's percentages are the scalars, to its 2 decimals
        m = re.search(rf"\| {p} \| ([0-9.]+) % \|", text)
        assert m and float(m.group(1)) == pytest.approx(100 * fractions[p], abs=0.006), (p, text)
    assert f"**{100 * mfu:.2f} %**" in text
    title = text.splitlines()[0].strip("*")
    (img_event,) = [e for e in acc.Images("mfu/waterfall") if e.step == step]
    img = np.asarray(Image.open(io.BytesIO(img_event.encoded_image_string)).convert("RGB")).astype(int)
    same = figure_to_array(waterfall_figure(fractions, mfu, title)).astype(int)
    moved = dict(fractions, compute=fractions["compute"] - 0.05, other=fractions["other"] + 0.05)
    other = figure_to_array(waterfall_figure(moved, mfu, title)).astype(int)
    assert img.shape == same.shape
    assert np.abs(img - same).mean() < 0.5 < np.abs(img - other).mean()
    assert "peak FLOP/s: measured" in text  # the CPU peak says where it comes from
