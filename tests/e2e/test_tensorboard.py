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
