"""FLOPs of each rank's local work, tokens without the label column, and the CPU peak's calibration."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from meshkit.profiling import flops as F
from meshkit.profiling.mfu import _batch_seq_len, batch_tokens

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_dtensor_matmul_is_counted_at_its_local_shape():
    """A 1-rank mesh's DTensor sharded over a dim of size 1 is its own local shard; a fake shard of
    half the rows must count half: the counter reads ``_local_tensor``, not the global shape."""

    class Half(torch.Tensor):  # stands in for a DTensor: global shape (8, 4), local shard (4, 4)
        pass

    a, b = torch.ones(8, 4), torch.ones(4, 3)
    count = F._local_shapes(lambda x, y, out_val=None: x.shape[0] * x.shape[1] * y.shape[1] * 2)
    x = a.as_subclass(Half)
    x._local_tensor = a[:4]
    assert count(a, b) == 2 * 8 * 4 * 3 and count(x, b) == 2 * 4 * 4 * 3
    with F.flop_counter() as c:
        torch.mm(a, b)
    assert c.get_total_flops() == 2 * 8 * 4 * 3


def test_tokens_exclude_the_label_shift():
    batch = torch.zeros(4, 129, dtype=torch.long)  # (B, T + 1): inputs and the shifted label
    assert batch_tokens(batch) == 4 * 128 and _batch_seq_len(batch) == 128
    assert batch_tokens({"input_ids": torch.zeros(4, 128, dtype=torch.long)}) == 512
    assert _batch_seq_len({"input_ids": torch.zeros(4, 128, dtype=torch.long)}) == 128
    assert batch_tokens(torch.zeros(2, 17)) == 34  # not a token tensor: every element


def test_cpu_peak_key_names_the_machine_and_torch():
    key = F.cpu_peak_key("fp32", 2)
    model, cores, dtype, threads, version = key.split("|")
    assert model and cores == f"cores={os.cpu_count()}" and dtype == "fp32" and threads == "threads=2"
    assert version == f"torch={torch.__version__}"


_CHILD = """
import json, sys, time
sys.path.insert(0, {root!r})
from meshkit.profiling import flops as F
calls = []
real = F._calibrate_cpu
def slow(dt):
    calls.append(time.time())
    time.sleep(0.5)  # long enough that the two processes would overlap if not serialised
    return real(dt, n=32, min_time_s=0.001)
F._calibrate_cpu = slow
t0 = time.time()
v = F.measured_cpu_peak("fp32")
print(json.dumps({{"calls": len(calls), "value": v, "t0": t0, "t1": time.time()}}))
"""


def test_cpu_peak_is_calibrated_by_one_process_while_the_others_wait(tmp_path):
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", _CHILD.format(root=ROOT)], stdout=subprocess.PIPE, text=True,
                              env=env) for _ in range(2)]
    outs = [json.loads(p.communicate(timeout=600)[0].strip().splitlines()[-1]) for p in procs]
    assert sorted(o["calls"] for o in outs) == [0, 1]  # one calibrated, the other waited and read the cache
    assert outs[0]["value"] == outs[1]["value"]
    cache = json.loads((tmp_path / "meshkit" / "cpu_peak.json").read_text())
    assert list(cache) == [next(iter(cache))] and "|cores=" in next(iter(cache))
