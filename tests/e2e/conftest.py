"""Shared by tests/e2e/test_tensorboard*.py: one small MFUMonitor run and one TensorBoard serving it; shared by
test_readme.py and test_console.py: one ``meshkit demo`` run as a user starts it (``demo_run``).

Both are session-scoped so the HTTP test and the browser test pay for one training run and one
TensorBoard start between them. TensorBoard listens on a free 127.0.0.1 port and is killed at the
end of the session; every wait is bounded.
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
from types import SimpleNamespace
from typing import Any, Callable

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(fn: Callable[[], Any], timeout_s: float, what: str, every_s: float = 1.0) -> Any:
    """Call ``fn`` until it returns something truthy; fail (naming ``what``) after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = fn()
            if value:
                return value
        except OSError as exc:  # not listening yet
            last = exc
        time.sleep(every_s)
    raise AssertionError(f"{what} did not arrive within {timeout_s} s (last error: {last})")


def tb_get(port: int, path: str, **params: Any) -> Any:
    url = f"http://127.0.0.1:{port}{path}" + ("?" + urllib.parse.urlencode(params) if params else "")
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read().decode())


@pytest.fixture(scope="session")
def tb_run(tmp_path_factory):
    """(TensorBoard root, the run's log_dir): 6 steps of the tiny model, a profiler window at batches 2-3.
    Lightning's default ``hp_metric`` and its ``epoch`` scalar are left in, as a user's run has them."""
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


@pytest.fixture(scope="session")
def tensorboard_port(tb_run):
    """The port of a ``tensorboard --logdir <root>`` on 127.0.0.1 that has loaded the run's scalars."""
    root, _ = tb_run
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(root), "--host", "127.0.0.1",
                             "--port", str(port), "--reload_interval", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: tb_get(port, "/data/plugins_listing"), 90, "TensorBoard's plugin listing")
        wait_for(lambda: tb_get(port, "/data/plugin/scalars/tags"), 60, "TensorBoard's scalars")
        yield port
    finally:
        proc.kill()
        proc.wait(timeout=30)


DEMO_STEPS = 12
"""README's `meshkit demo` at 12 steps instead of 40: one profiler window (steps 5-6), ~60 s on 2 busy cores."""


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory):
    """``meshkit demo --steps 12`` in a fresh folder, as a user's shell runs it: (cwd, console, seconds).
    ``console`` is stdout and stderr interleaved as a terminal shows them."""
    cwd = tmp_path_factory.mktemp("demo")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTHONWARNINGS")}
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    start = time.monotonic()
    proc = subprocess.run(["meshkit", "demo", "--steps", str(DEMO_STEPS)], cwd=cwd, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=600)
    seconds = time.monotonic() - start
    assert proc.returncode == 0, f"meshkit demo exited {proc.returncode}:\n{proc.stdout[-4000:]}"
    return SimpleNamespace(cwd=str(cwd), console=proc.stdout, seconds=seconds)
