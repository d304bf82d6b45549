"""FLOPs of each rank's local work, tokens without the label column, and the CPU peak's calibration."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from fractions import Fraction

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


def _counted_fraction_by_hand(cp: int, attention: str, layout: str) -> Fraction:
    """Causal attention's counted score FLOPs summed over the cp ranks / one process's T×T call (docs/profiling.md)."""
    if attention == "allgather" and layout == "load_balanced":
        return Fraction(2 * cp + 1, 4 * cp)  # 2cp chunks of c: chunk k attends k·c keys in full + a c×c diagonal
    return Fraction(cp + 1, 2 * cp)  # cp causal diagonal blocks counted in full + the cp(cp-1)/2 blocks below them


@pytest.mark.parametrize("attention", ["ring", "allgather"])
@pytest.mark.parametrize("layout", ["load_balanced", "contiguous"])
@pytest.mark.parametrize("cp", [2, 3, 4])
def test_causal_cp_plans_count_the_documented_fraction_of_one_process(cp, attention, layout):
    """torch charges each SDPA call 4·B·H·Tq·Tk·hd whatever its mask: the cp plans' blocks, counted so and
    summed over the ranks, are the stated fraction of one process's causal T×T call; every causal pair
    (query i, key j <= i) is in exactly one block (so the model work is the same), masked blocks are skipped."""
    from meshkit.plugins.context_parallel.attention import allgather_plan, ring_plan
    from meshkit.plugins.context_parallel.layout import layout_index

    t = 8 * cp
    t_loc = t // cp
    order = layout_index(t, cp, layout).view(cp, t_loc)  # rank r's local row i is global position order[r, i]
    counted, pairs = 0, []
    for rank in range(cp):
        if attention == "ring":
            blocks = [(p, (rank - s) % cp) for s in range(cp) if (p := ring_plan(s, rank, cp, True, layout, t_loc))]
            blocks = [(qs, order[src][ks], c) for (qs, ks, c), src in blocks]
        else:
            natural = torch.arange(t)
            blocks = [(qs, natural[ks], c) for qs, ks, c in allgather_plan(rank, cp, True, layout, t_loc)]
        for qs, keys, causal in blocks:
            queries = order[rank][qs]
            with F.flop_counter() as c:  # what the counter charges one block: B=1, H=1, hd=1
                torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    torch.zeros(1, 1, len(queries), 1), torch.zeros(1, 1, len(keys), 1),
                    torch.zeros(1, 1, len(keys), 1), 0.0, causal)
            counted += c.get_total_flops()
            # the pairs the block computes: all of them, or its own lower triangle when causal
            pairs += [(int(i), int(j)) for a, i in enumerate(queries) for b, j in enumerate(keys)
                      if not causal or b <= a]
    assert sorted(pairs) == [(i, j) for i in range(t) for j in range(i + 1)]  # each causal pair once, no other
    assert counted == 4 * t * t * _counted_fraction_by_hand(cp, attention, layout)
