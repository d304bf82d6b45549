"""Peak table, device-name matching, FLOPs per token by hand, measured FLOPs on meta tensors."""

from __future__ import annotations

import pytest
import torch

from meshkit.profiling import flops as F
from meshkit.profiling.flops import peak_flops, peak_info, register_peak


@pytest.mark.parametrize(
    "name, dtype, expected, row",
    [
        ("NVIDIA H200", "bf16", 989.4e12, "H200-SXM"),  # dense; 1979 TF is the 2:4-sparse figure
        ("NVIDIA H200 NVL", "bf16", 835.5e12, "H200-NVL"),
        ("NVIDIA H100 80GB HBM3", "bf16", 989.4e12, "H100-SXM"),
        ("NVIDIA H100 80GB HBM3", "fp8", 1978.9e12, "H100-SXM"),
        ("NVIDIA H100 PCIe", "bf16", 756e12, "H100-PCIe"),
        ("NVIDIA H100 NVL", "fp16", 835.5e12, "H100-NVL"),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312e12, "A100-SXM4-80GB"),
        ("NVIDIA A100-SXM4-40GB", "tf32", 156e12, "A100-SXM4-40GB"),
        ("NVIDIA A100-PCIE-40GB", "fp32", 19.5e12, "A100-PCIe-40GB"),
        ("NVIDIA A100 80GB PCIe", "bf16", 312e12, "A100-PCIe-80GB"),
        ("NVIDIA B200", "bf16", 2.25e15, "B200"),
        ("NVIDIA L4", "bf16", 121e12, "L4"),  # must not match L40 / L40S
        ("NVIDIA L40S", "bf16", 362.05e12, "L40S"),
        ("NVIDIA L40", "fp8", 362e12, "L40"),
        ("NVIDIA A10", "fp16", 125e12, "A10"),  # must not match A100
        ("AMD Instinct MI300X", "bf16", 1307.4e12, "MI300X"),
        ("Tesla V100-SXM2-16GB", "fp16", 125e12, "V100-SXM2"),
        ("NVIDIA GeForce RTX 4090", "bf16", 165.2e12, "RTX-4090"),
    ],
)
def test_real_device_strings_match_dense_rows(name, dtype, expected, row):
    info = peak_info(name, dtype)
    assert info.row == row
    assert info.flops == pytest.approx(expected)
    assert info.kind == "datasheet" and info.source


def test_every_row_has_source_and_sane_ratios():
    for row in F.PEAK_TABLE:
        assert row.source and row.patterns, row.name
        if "bf16" in row.peaks and "fp8" in row.peaks:
            assert row.peaks["fp8"] == pytest.approx(2 * row.peaks["bf16"], rel=0.02), row.name
        if "tf32" in row.peaks and "bf16" in row.peaks and row.name != "RTX-4090":
            assert row.peaks["tf32"] == pytest.approx(row.peaks["bf16"] / 2, rel=0.02), row.name


def test_dtype_spellings():
    assert peak_flops("NVIDIA H100 80GB HBM3", torch.bfloat16) == peak_flops("NVIDIA H100 80GB HBM3", "bf16-mixed")
    assert peak_flops("NVIDIA H100 80GB HBM3", "16-mixed") == 989.4e12
    with pytest.raises(ValueError, match=r"dtype='int4'.*not a known dtype"):
        peak_flops("NVIDIA H100 80GB HBM3", "int4")


def test_unknown_device_lists_known_rows():
    with pytest.raises(ValueError, match=r"device_name='Banana GPU'.*known: .*H200-SXM.*override"):
        peak_flops("Banana GPU")


def test_missing_dtype_for_row():
    with pytest.raises(ValueError, match=r"V100-SXM2 has no `dtype='bf16'`"):
        peak_flops("Tesla V100-SXM2-32GB", "bf16")


def test_overrides(monkeypatch):
    assert peak_flops("anything at all", override=1e12) == 1e12
    monkeypatch.setenv("MESHKIT_PEAK_FLOPS", "2e12")
    assert peak_info("NVIDIA H200").kind == "override"
    assert peak_flops("NVIDIA H200") == 2e12
    monkeypatch.setenv("MESHKIT_PEAK_FLOPS", "fast")
    with pytest.raises(ValueError, match="MESHKIT_PEAK_FLOPS='fast'"):
        peak_flops("NVIDIA H200")
    monkeypatch.delenv("MESHKIT_PEAK_FLOPS")
    with pytest.raises(ValueError, match=r"override=-1"):
        peak_flops("NVIDIA H200", override=-1)


def test_register_peak_shadows_builtin(monkeypatch):
    monkeypatch.setattr(F, "_USER_ROWS", [])
    register_peak("H200-SXM-capped", {"bf16": 700e12}, patterns=(r"\bH200\b",), source="power-capped fleet")
    assert peak_info("NVIDIA H200").row == "H200-SXM-capped"
    assert peak_flops("NVIDIA H200") == 700e12
    with pytest.raises(ValueError, match=r"peaks\['bf16'\]=0"):
        register_peak("bad", {"bf16": 0})


def test_cpu_peak_is_measured_and_cached(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(F, "_CPU_PEAK_CACHE", {})
    calls = []
    real = F._calibrate_cpu
    monkeypatch.setattr(F, "_calibrate_cpu", lambda dt: calls.append(dt) or real(dt, n=64, min_time_s=0.005))
    info = peak_info("cpu", "fp32")
    assert info.kind == "measured" and info.flops > 1e8
    assert peak_flops("cpu", "fp32") == info.flops  # in-memory cache
    monkeypatch.setattr(F, "_CPU_PEAK_CACHE", {})
    assert peak_flops("cpu", "fp32") == info.flops  # disk cache, no recalibration
    assert len(calls) == 1
    assert (tmp_path / "meshkit" / "cpu_peak.json").exists()
