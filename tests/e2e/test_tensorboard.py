"""End to end: a small run with MFUMonitor, then `tensorboard --logdir` serves everything it wrote.

The run and the TensorBoard serving it (a free 127.0.0.1 port, bounded waits, killed at the end)
are the session fixtures of tests/e2e/conftest.py, shared with the browser test. This file queries
TensorBoard's HTTP API for the scalars (in percent, under the tags of meshkit.profiling.report),
the custom-scalar layout, the text table and the images; runs `meshkit analyze --json` on the
traces; and reads the event file back to check that a window's table, waterfall and scalars agree.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from meshkit.profiling import report as R
from tests.e2e.conftest import tb_get, wait_for

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_tensorboard_serves_everything(tensorboard_port):
    port = tensorboard_port
    plugins = tb_get(port, "/data/plugins_listing")
    for name in ("timeseries", "scalars", "custom_scalars", "text", "images"):
        assert name in plugins, sorted(plugins)
    tags = tb_get(port, "/data/plugin/scalars/tags")
    run = next(iter(tags))
    for tag in (R.MFU_TAG, R.HFU_TAG, "mfu/tokens_per_s", R.breakdown_tag("compute"), R.points_lost_tag("other"),
                R.window_tag("mfu_pct")):
        assert tag in tags[run], sorted(tags[run])
    series = tb_get(port, "/data/plugin/scalars/scalars", run=run, tag=R.MFU_TAG)
    assert series and all(0 < point[2] < 100 for point in series)
    for p in R.BREAKDOWN_PARTS:  # percent of the step
        assert all(0 <= point[2] <= 100 for point in tb_get(port, "/data/plugin/scalars/scalars", run=run,
                                                             tag=R.breakdown_tag(p)))
    layout = wait_for(lambda: tb_get(port, "/data/plugin/custom_scalars/layout"), 30, "the custom-scalar layout")
    assert [c["title"] for c in layout["category"]] == [R.LAYOUT_TITLE]
    charts = layout["category"][0]["chart"]
    assert all(len(c["multiline"]["tag"]) == 1 for c in charts)  # one series per chart: one line, one name
    text_tags = wait_for(lambda: tb_get(port, "/data/plugin/text/tags"), 30, "text")
    (text_tag,) = [t for t in text_tags[run] if t.startswith(R.TABLE_TAG)]  # torch adds /text_summary
    table = json.dumps(tb_get(port, "/data/plugin/text/text", run=run, tag=text_tag))
    assert "achieved MFU" in table and "exposed_comm" in table
    images = wait_for(lambda: tb_get(port, "/data/plugin/images/tags"), 30, "images")
    assert R.WATERFALL_TAG in images[run]


def test_analyze_cli_reads_the_run(tb_run):
    _, log_dir = tb_run
    out = subprocess.run([sys.executable, "-m", "meshkit", "analyze", os.path.join(log_dir, "profiler"),
                          "--json"], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["ranks"]["0"]["steps"] >= 1 and result["ranks"]["0"]["compute_ms"] > 0


def test_table_waterfall_and_scalars_show_the_same_window(tb_run):
    """Read the event file back: the window's markdown table, its waterfall image and its
    ``mfu/window/*`` scalars (percent) carry the same numbers (the image is compared with a re-rendering
    of the scalars; a breakdown moved by 5 points renders differently)."""
    import io
    import re

    import numpy as np
    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, log_dir = tb_run
    acc = EventAccumulator(log_dir, size_guidance={"tensors": 0, "images": 0, "scalars": 0})
    acc.Reload()
    (tag,) = [t for t in acc.Tags()["tensors"] if t.startswith(R.TABLE_TAG)]
    events = acc.Tensors(tag)
    step = events[0].step
    text = events[0].tensor_proto.string_val[0].decode()
    scal = {t: {e.step: e.value for e in acc.Scalars(t)} for t in acc.Tags()["scalars"]}
    pct = {p: scal[R.window_tag(f"breakdown_pct/{p}")][step] for p in R.BREAKDOWN_PARTS}
    mfu_pct = scal[R.window_tag("mfu_pct")][step]
    assert sum(pct.values()) == pytest.approx(100.0, abs=1e-3)
    for p in R.BREAKDOWN_PARTS:  # the table's percentages are the scalars, to its 2 decimals
        m = re.search(rf"\| {p} \| ([0-9.]+) % \|", text)
        assert m and float(m.group(1)) == pytest.approx(pct[p], abs=0.006), (p, text)
    assert f"**{mfu_pct:.2f} %**" in text
    title = text.splitlines()[0].strip("*")
    fractions, mfu = {p: v / 100 for p, v in pct.items()}, mfu_pct / 100
    (img_event,) = [e for e in acc.Images(R.WATERFALL_TAG) if e.step == step]
    img = np.asarray(Image.open(io.BytesIO(img_event.encoded_image_string)).convert("RGB")).astype(int)
    same = R.waterfall_image(fractions, mfu, title).astype(int)
    moved = dict(fractions, compute=fractions["compute"] - 0.05, other=fractions["other"] + 0.05)
    other = R.waterfall_image(moved, mfu, title).astype(int)
    assert img.shape == same.shape
    assert np.abs(img - same).mean() < 0.5 < np.abs(img - other).mean()
    assert "peak FLOP/s: measured" in text  # the CPU peak says where it comes from
