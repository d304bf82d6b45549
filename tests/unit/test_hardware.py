"""The GPU catalog: one matcher for real device strings and old table names, the views built on it."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

from meshkit import hardware
from meshkit.hardware import CATALOG, find_gpu, gpu, register_gpu

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "device, name, bf16, memory_gb, hbm, sms",
    [
        ("NVIDIA H100 80GB HBM3", "H100-SXM", 989.4e12, 80, 3350, 132),
        ("NVIDIA H100 PCIe", "H100-PCIe", 756e12, 80, 2000, 114),
        ("NVIDIA H200", "H200-SXM", 989.4e12, 141, 4800, 132),
        ("NVIDIA A100-SXM4-80GB", "A100-SXM4-80GB", 312e12, 80, 2039, 108),
        ("NVIDIA A100-SXM4-40GB", "A100-SXM4-40GB", 312e12, 40, 1555, 108),
        ("NVIDIA B200", "B200", 2.25e15, 180, 8000, 148),
        ("NVIDIA L40S", "L40S", 362.05e12, 48, 864, 142),
        ("AMD Instinct MI300X", "MI300X", 1307.4e12, 192, 5300, None),
    ],
)
def test_one_row_per_device_holds_every_fact(device, name, bf16, memory_gb, hbm, sms):
    row = gpu(device)
    assert (row.name, row.peaks["bf16"], row.memory_gb, row.hbm_bw_gbs, row.sms) == (name, bf16, memory_gb, hbm, sms)
    assert row.source and row.memory_source and (sms is None or row.sm_source)


def test_old_table_names_resolve_through_the_one_matcher():
    # the planner's keys and occupancy's model names are names of catalog rows
    for old, new in {"h100-sxm": "H100-SXM", "h100-pcie": "H100-PCIe", "h200": "H200-SXM",
                     "a100-40gb": "A100-SXM4-40GB",
                     "a100-80gb": "A100-SXM4-80GB", "mi300x": "MI300X", "l40s": "L40S", "b200": "B200",
                     "A100": "A100-SXM4-80GB", "A100-SXM": "A100-SXM4-80GB", "A100-PCIE": "A100-PCIe-80GB",
                     "H100": "H100-SXM", "H200": "H200-SXM", "A10": "A10", "A30": "A30", "L4": "L4"}.items():
        assert gpu(old).name == new, old


def test_names_and_keys_are_unique_and_every_fact_is_sourced():
    assert len({r.name for r in CATALOG}) == len({r.key for r in CATALOG}) == len(CATALOG)
    for row in CATALOG:
        assert not row.peaks or row.source, row.name
        assert row.memory_gb is None or row.memory_source, row.name
        assert (row.sms is None) == (row.arch is None) and (row.sms is None or row.sm_source), row.name


def test_has_matches_only_rows_that_know_the_fact():
    assert find_gpu("NVIDIA H100 NVL").name == "H100-NVL"  # its own peaks (835.5) and memory (94 GB)
    assert find_gpu("NVIDIA H100 NVL", has=("sms",)).name == "H100-SXM"  # the same 132-SM GH100
    assert find_gpu("NVIDIA A30").peaks == {}
    assert find_gpu("NVIDIA A30", has=("peaks",)) is None
    assert find_gpu("NVIDIA GeForce RTX 4090", has=("memory_gb",)) is None
    assert find_gpu("sm_90") is None and find_gpu("90") is None  # arch spellings are no device


def test_unknown_name_lists_the_known_ones():
    assert find_gpu("Banana GPU") is None
    with pytest.raises(ValueError, match=r"name='Banana GPU'.*known: .*H100-SXM.*register_gpu"):
        gpu("Banana GPU")


def test_register_gpu_shadows_and_validates(monkeypatch):
    monkeypatch.setattr(hardware, "_USER_GPUS", [])
    row = register_gpu("H200-capped", patterns=(r"\bH200\b",), peaks={"bf16-mixed": 700e12}, memory_gb=141)
    assert row.peaks == {"bf16": 700e12} and row.key == "h200-capped"
    assert gpu("NVIDIA H200") is row
    assert find_gpu("NVIDIA H200", has=("sms",)).name == "H200-SXM"  # facts it does not know fall through
    with pytest.raises(ValueError, match=r"peaks\['bf16'\]=0"):
        register_gpu("bad", peaks={"bf16": 0})
    with pytest.raises(ValueError, match=r"sms=-1"):
        register_gpu("bad", sms=-1)
    with pytest.raises(ValueError, match=r"unknown: \['tflops'\]"):
        register_gpu("bad", tflops=1)


def test_ridge():
    assert gpu("h100-sxm").ridge() == pytest.approx(989.4e12 / 3.35e12)  # 295 FLOP/B
    assert round(gpu("a100-80gb").ridge()) == 153 and round(gpu("mi300x").ridge("bf16")) == 247
    with pytest.raises(ValueError, match=r"V100-SXM2 has no `dtype='bf16'` peak"):
        gpu("Tesla V100-SXM2-16GB").ridge("bf16")


def test_views_are_derived_from_the_catalog():
    from meshkit import planner as pl
    from meshkit.profiling import flops as F
    from meshkit.profiling import occupancy as occ

    assert F.PEAK_TABLE == tuple(r for r in CATALOG if r.peaks) and all(
        any(r is c for c in CATALOG) for r in F.PEAK_TABLE)
    assert set(pl.GPU_TABLE) == {r.key for r in CATALOG if r.memory_gb is not None}
    assert set(occ.GPUS) == {r.name for r in CATALOG if r.sms}
    for key, spec in pl.GPU_TABLE.items():
        row = gpu(key)
        assert (spec.memory_gb, spec.hbm_bw_gbs, spec.intra_bw_gbs, spec.inter_bw_gbs) == (
            row.memory_gb, row.hbm_bw_gbs, row.intra_bw_gbs, row.inter_bw_gbs)
        if row.peaks:  # the planner's peak is the same row's
            assert F.peak_flops(spec.peak_name, "bf16") == row.peaks["bf16"]
    assert pl.DEFAULT_RIDGE == 300.0 == round(gpu("h100-sxm").ridge(), -2)


def test_variants_the_planner_used_to_fold_into_another_row():
    # The planner's catch-all patterns sent these devices to another model's row; the catalog has their own.
    from meshkit import planner as pl

    nvl = pl.plan(pl.ModelSpec(layers=4, hidden=64, heads=4), seq_len=64, global_batch=8, gpus_per_node=2,
                  gpu="NVIDIA H100 NVL")
    assert nvl.inputs["gpu"] == "h100-nvl"
    assert nvl.inputs["peak_tflops"] == pytest.approx(835.5)  # was 989.4, the SXM5 peak
    assert (nvl.inputs["memory_gb"], nvl.inputs["intra_bw_gbs"]) == (94, 300)  # was 80 GB, 450 GB/s
    assert pl.gpu_spec("NVIDIA A100 80GB PCIe").hbm_bw_gbs == 1935  # was 2039, the SXM4 figure
    with pytest.raises(ValueError, match="not in the planner's GPU table"):
        pl.gpu_spec("NVIDIA GH200 480GB")  # peaks known (H200's GPU), memory varies by variant


def test_ground_floor_imports_nothing_heavy():
    for name in ("hardware", "modelspec"):
        tree = ast.parse((ROOT / "meshkit" / f"{name}.py").read_text())
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not {m for m in imported if m.startswith(("meshkit.plugins", "meshkit.profiling", "lightning"))}
    code = ("import importlib.util, sys\n"
            "for n in ('hardware', 'modelspec'):\n"
            f"    spec = importlib.util.spec_from_file_location(n, {str(ROOT / 'meshkit')!r} + f'/{{n}}.py')\n"
            "    mod = importlib.util.module_from_spec(spec); sys.modules[n] = mod; spec.loader.exec_module(mod)\n"
            "print(sorted(m for m in ('torch', 'lightning', 'meshkit') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"
