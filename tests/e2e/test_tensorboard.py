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
import urllib.parse
import urllib.request

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
    for tag in (R.MFU_TAG, R.HFU_TAG, "MFU_details/tokens_per_s", R.breakdown_tag("compute"), R.points_lost_tag("other"),
                R.window_tag("mfu_pct")):
        assert tag in tags[run], sorted(tags[run])
    # one MFU group: TIME SERIES groups tags by the part before the first "/"; no two differ only in case
    # (issue 26 saw an `MFU` and an `mfu` group)
    groups = {t.split("/")[0] for t in tags[run]}
    assert len({g.lower() for g in groups}) == len(groups), sorted(groups)
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
    ``MFU_details/window/*`` scalars (percent) carry the same numbers (the image is compared with a re-rendering
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
    (img_event,) = [e for e in acc.Images(R.WATERFALL_TAG) if e.step == step]
    img = np.asarray(Image.open(io.BytesIO(img_event.encoded_image_string)).convert("RGB")).astype(int)
    parts = ("peak", *R.WATERFALL_PARTS, "achieved")
    points = [{"part": p, "points": scal[R.waterfall_tag(p)][step]} for p in parts]
    assert points[-1]["points"] == pytest.approx(mfu_pct, abs=1e-4)  # the waterfall ends at the window's MFU
    assert 100 - sum(p["points"] for p in points[1:-1]) == pytest.approx(mfu_pct, abs=1e-3)
    same = R.waterfall_image(points, title).astype(int)
    moved = [dict(p, points=p["points"] + (5 if p["part"] == "host_other" else -5 if p["part"] == "non_matmul"
                                           else 0)) for p in points]
    other = R.waterfall_image(moved, title).astype(int)
    assert img.shape == same.shape
    assert np.abs(img - same).mean() < 0.5 < np.abs(img - other).mean()
    assert "peak FLOP/s: measured" in text  # the CPU peak says where it comes from


def test_pytorch_profiler_tab_lists_the_run_and_serves_its_trace(tensorboard_port, tb_run):
    """`pip install meshkit[tb-profiler]` (in the test extra): TensorBoard's PyTorch Profiler tab finds the traces
    MFUMonitor keeps under <log_dir>/profiler (one run, a worker per rank named from `rank{R}.{batch}.pt.trace.json`)
    and serves each view and the raw trace its Trace view draws."""
    import gzip

    root, log_dir = tb_run
    run = os.path.relpath(os.path.join(log_dir, "profiler"), str(root))
    base = "/data/plugin/pytorch_profiler"
    assert tb_get(tensorboard_port, "/data/plugins_listing")["pytorch_profiler"]["enabled"]
    wait_for(lambda: run in tb_get(tensorboard_port, f"{base}/runs")["runs"], 90, "the profiler tab's run")
    views = wait_for(lambda: tb_get(tensorboard_port, f"{base}/views", run=run), 60, "the profiler tab's views")
    assert {"Overview", "Operator", "Trace"} <= set(views), views
    # a worker per rank that left a trace file (README: "the workers rank0 to rank3" for the 4-rank demo)
    ranks = sorted({f.split(".")[0] for f in os.listdir(os.path.join(log_dir, "profiler")) if f.endswith(".pt.trace.json")})
    assert ranks and tb_get(tensorboard_port, f"{base}/workers", run=run, view="Overview") == ranks
    (span,) = tb_get(tensorboard_port, f"{base}/spans", run=run, worker="rank0")
    url = f"http://127.0.0.1:{tensorboard_port}{base}/trace?" + urllib.parse.urlencode(
        dict(run=run, worker="rank0", span=span))
    with urllib.request.urlopen(url, timeout=30) as r:
        trace = json.loads(gzip.decompress(r.read()))
    assert any(e.get("name", "").startswith("ProfilerStep#") for e in trace["traceEvents"])


# the README's offline statement for the tab, in one table: page the plugin serves -> the scripts it loads from
# outside this TensorBoard (its charts: Google Charts; its Trace view's iframe: the web-components polyfill)
PROFILER_TAB_EXTERNAL_SCRIPTS = {
    "index.html": {"https://www.gstatic.com/charts/loader.js"},
    "trace_embedding.html": {"https://cdnjs.cloudflare.com/ajax/libs/webcomponentsjs/0.7.24/webcomponents.min.js"},
    "trace_viewer_full.html": set(),  # the trace viewer itself is vendored; it needs the polyfill above
}


def test_pytorch_profiler_tab_pages_load_only_the_scripts_the_readme_names(tensorboard_port):
    """README: offline the tab draws nothing beyond its left pane, because its pages load Google Charts from
    www.gstatic.com and (Trace view) a polyfill from cdnjs.cloudflare.com. Read from the pages TensorBoard serves:
    a plugin release that vendors them, or loads more, fails here, and the README's sentence is revised with it."""
    import re

    base = f"http://127.0.0.1:{tensorboard_port}/data/plugin/pytorch_profiler"
    readme = " ".join(open(os.path.join(ROOT, "README.md"), encoding="utf-8").read().split())
    for page, wanted in PROFILER_TAB_EXTERNAL_SCRIPTS.items():
        with urllib.request.urlopen(f"{base}/{page}", timeout=30) as r:
            html = r.read().decode("utf-8", "replace")
        external = set(re.findall(r"<script[^>]*\bsrc=[\"']?(https?://[^\"' >]+)", html))
        assert external == wanted, (page, external)
        for url in wanted:
            assert urllib.parse.urlparse(url).hostname in readme, (url, "not named in README.md")
    assert "loading spinner that never ends" in readme and "chrome://chrome-urls" in readme
