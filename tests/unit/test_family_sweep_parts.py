"""benchmarks/family_sweep.py's own parts that decide a row without a pool: the tiny-size skip, the floor column."""

from __future__ import annotations

import torch
from torch import nn

from tests.distributed import hf_models as H


def test_the_skip_names_the_part_that_holds_the_parameters():
    sweep = H.family_sweep()
    towers = nn.Module()
    towers.vision, towers.text = nn.Linear(100, 100), nn.Linear(2, 2)
    model = nn.Sequential(nn.ModuleDict({"towers": towers}))
    assert sweep._largest_child(model) == ("0.towers.vision", 100 * 100 + 100)
    even = nn.ModuleDict({"a": nn.Linear(10, 10), "b": nn.Linear(10, 10)})
    assert sweep._largest_child(even) == ("", 220)  # no part holds 90 %: the module itself


def test_the_floor_column_is_measured_where_exact_cells_reach_above_its_threshold():
    sweep = H.family_sweep()
    row = {"fsdp2": "exact (2e-08)", "hsdp_tp": "refused, fix exact (5e-08)", "cp": "refused: ...",
           "tp_pp": "skipped: ..."}
    assert sweep.worst_exact(row) == 5e-08
    assert sweep.worst_exact({"fsdp2": "MISMATCH (3e-05)", "cp": "exact (1e-14)"}) == 1e-14
    meta = dict(transformers="x", torch=torch.__version__, steps=3, registered=2, seconds=1.0)
    text = sweep.markdown({"biogpt": row, "llama": {"fsdp2": "exact (1e-14)"}}, meta, {"biogpt": 5.1e-08})
    assert "| biogpt | exact (2e-08) | refused, fix exact (5e-08) | refused: ... | skipped: ... | 5e-08 |" in text
    assert "| llama | exact (1e-14) | not run | not run | not run |  |" in text


def test_a_mismatch_is_read_against_the_family_s_own_floor():
    sweep = H.family_sweep()
    row = {"fsdp2": "MISMATCH (3e+00)", "hsdp_tp": "refused, fix MISMATCH (9e-01)", "cp": "exact (1e-14)"}
    assert sweep.against_floor(row, 1e-13) == row  # a floor at rounding: the mismatch stays a finding
    judged = sweep.against_floor(row, 1.1)  # PhiMoE: a batch split in two changes its step by 1e0
    assert judged == {"fsdp2": "batch-dependent (3e+00; one-process floor 1e+00)",
                      "hsdp_tp": "batch-dependent (9e-01; one-process floor 1e+00)", "cp": "exact (1e-14)"}
    assert sweep.summary({"phimoe": judged})["batch-dependent"] == 2
