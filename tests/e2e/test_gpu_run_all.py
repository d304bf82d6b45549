"""benchmarks/gpu/run_all.sh --cpu: every section of the prepared GPU run, on CPU at tiny sizes.

The dry run takes the same code paths as the H200 run (section subprocesses with their own limits,
the kernel benchmark with every provider, the MFU fit, the offline register compile, pytest on
tests/gpu, one JSON) with CUDA hidden. ~65 s of CPU in all (four fresh interpreters importing torch);
its wall time grows with the machine's load, hence the generous limit.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.timeout(960)
def test_dry_run_writes_every_section(tmp_path):
    out = tmp_path / "figures.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([os.path.join(ROOT, "benchmarks", "gpu", "run_all.sh"), "--cpu", str(out)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=900)
    res = json.loads(out.read_text())
    sections = res["sections"]
    assert proc.returncode == 0, {k: (v["status"], v.get("error", "")[-1500:]) for k, v in sections.items()}
    assert list(sections) == ["tests_gpu", "registers", "kernels", "mfu_8b"]
    assert res["environment"]["mode"] == "cpu dry run" and "liger_kernel_installed" in res["environment"]
    tests = sections["tests_gpu"]["figures"]
    assert tests["skipped"] >= 30 and tests["failed"] == tests["errors"] == 0  # no CUDA: every GPU test skips
    regs = sections["registers"]["figures"]
    assert regs["fixtures"]["row_sum_squares"]["offline"]["registers"] > 0
    assert regs["fixtures"]["row_sum_squares"]["loaded"] is None
    kern = sections["kernels"]["figures"]
    assert {"eager", "compile", "meshkit"} <= set(kern["providers"])
    assert not [r for r in kern["rows"] if "error" in r] and all(c["ok"] for c in kern["bf16"])
    mfu = sections["mfu_8b"]["figures"]["variants"]["meshkit+compile"]
    assert mfu["fit"]["per_layer_s"] > 0 and 0 < mfu["mfu_extrapolated_32"] < 1
    assert mfu["rows"][0]["patched"] == {"rms_norm": 3, "swiglu": 1, "rope": 1, "loss": 1}
