"""Occupancy calculator: hand-derived cases per architecture (the arithmetic is written next to each).

Rules (cuda_occupancy.h): registers per warp = roundup(regs x 32, 256); warps that fit the registers =
4 x floor((65536 / 4) / regs_per_warp); shared per block = roundup(shared + 1024 reserved, 128);
blocks = min(max_warps // num_warps, max_blocks, reg_warps // num_warps, smem_per_sm // smem_per_block).
"""

import math

import pytest

from meshkit.profiling.occupancy import ARCHS, GPUS, grid_waves, resolve_arch, theoretical_occupancy

KIB = 1024


def _check(occ, blocks, warps, occupancy, limiter):
    assert (occ.active_blocks_per_sm, occ.active_warps_per_sm, occ.limiter) == (blocks, warps, limiter)
    assert occ.occupancy == pytest.approx(occupancy)


# --- sm_80 (A100): 64 warps, 32 blocks, 164 KiB smem/SM, 163 KiB/block -----------------------------------

def test_sm80_register_limited():
    # 128 x 32 = 4096 regs/warp; 16384 // 4096 = 4 warps per sub-partition -> 16 warps -> 16 // 4 = 4 blocks
    occ = theoretical_occupancy("sm_80", 128, 4, 0)
    _check(occ, 4, 16, 16 / 64, "registers")
    assert occ.block_limits == {"warps": 64 // 4, "blocks": 32, "registers": 4,
                                "shared_memory": 167936 // 1024}
    # 5 blocks need 5 warps per sub-partition: 16384 // 5 = 3276 -> 3072 regs/warp -> 96 regs/thread
    assert "cut registers from 128 to <= 96" in occ.hint and "5 blocks/SM" in occ.hint


def test_sm80_register_granularity_and_sub_partitions():
    # 33 regs: 33 x 32 = 1056 -> rounded up to 1280; 16384 // 1280 = 12 -> 48 warps -> 12 blocks of 4 warps
    _check(theoretical_occupancy("sm_80", 33, 4, 0), 12, 48, 48 / 64, "registers")
    # 200 regs, 1 warp: 6400 regs/warp; 16384 // 6400 = 2 per sub-partition -> 8 warps -> 8 blocks
    # (a whole-SM division, 65536 // 6400 = 10, would be wrong)
    _check(theoretical_occupancy("sm_80", 200, 1, 0), 8, 8, 8 / 64, "registers")


def test_sm80_shared_memory_limited():
    # 48 KiB + 1 KiB reserved = 50176 B (a multiple of 128); 167936 // 50176 = 3 blocks -> 12 warps
    occ = theoretical_occupancy("sm_80", 32, 4, 48 * KIB)
    _check(occ, 3, 12, 12 / 64, "shared_memory")
    assert occ.shared_allocated_per_block == 50176
    # 4 blocks: 167936 // 4 = 41984 (already a multiple of 128) - 1024 reserved = 40960 B
    assert "cut shared memory from 49152 to <= 40960 B" in occ.hint


def test_sm80_warp_limited():
    # 24 regs: 768 regs/warp; 16384 // 768 = 21 -> 84 warps; the warp slots (64 // 8 = 8 blocks) bind first
    occ = theoretical_occupancy("sm_80", 24, 8, 0)
    _check(occ, 8, 64, 1.0, "warps")
    assert occ.limiters == ("warps",) and "full occupancy" in occ.hint


def test_sm80_block_limited():
    # one warp per block: 32 blocks/SM cap -> 32 of 64 warps
    occ = theoretical_occupancy("sm_80", 32, 1, 0)
    _check(occ, 32, 32, 0.5, "blocks")
    assert "raise num_warps" in occ.hint


def test_sm80_block_cannot_launch():
    # 255 regs -> 8160 -> 8192 regs/warp x 16 warps = 131072 > 65536 registers per block
    occ = theoretical_occupancy("sm_80", 255, 16, 0)
    _check(occ, 0, 0, 0.0, "registers")
    assert occ.hint.startswith("cannot launch")


# --- sm_86 (A10): 48 warps, 16 blocks, 100 KiB smem/SM, 99 KiB/block --------------------------------------

def test_sm86_cases():
    # registers: 96 x 32 = 3072; 16384 // 3072 = 5 -> 20 warps -> 5 blocks of 4
    _check(theoretical_occupancy("sm_86", 96, 4, 0), 5, 20, 20 / 48, "registers")
    # shared: 32 KiB + 1 KiB = 33792 B; 102400 // 33792 = 3 blocks -> 12 warps
    _check(theoretical_occupancy("sm_86", 32, 4, 32 * KIB), 3, 12, 12 / 48, "shared_memory")
    # blocks: 16 blocks of 1 warp -> 16 / 48
    _check(theoretical_occupancy("sm_86", 32, 1, 0), 16, 16, 16 / 48, "blocks")
    # warps: 48 // 32 = 1 block of 32 warps (registers would allow 64 // 32 = 2)
    occ = theoretical_occupancy("sm_86", 32, 32, 0)
    _check(occ, 1, 32, 32 / 48, "warps")
    assert "num_warps=16" in occ.hint
    # over the 99 KiB per-block limit: cannot launch
    occ = theoretical_occupancy("sm_86", 32, 4, 100 * KIB)
    _check(occ, 0, 0, 0.0, "shared_memory")
    assert "cannot launch" in occ.hint


# --- sm_89 (L4, L40S): 48 warps, 24 blocks, 100 KiB smem/SM -----------------------------------------------

def test_sm89_cases():
    # registers: 64 x 32 = 2048; 16384 // 2048 = 8 -> 32 warps -> 4 blocks of 8 (warp slots allow 6)
    _check(theoretical_occupancy("sm_89", 64, 8, 0), 4, 32, 32 / 48, "registers")
    # shared: 16 KiB + 1 KiB = 17408 B; 102400 // 17408 = 5 blocks of 2 warps
    _check(theoretical_occupancy("sm_89", 32, 2, 16 * KIB), 5, 10, 10 / 48, "shared_memory")
    # blocks: 24 blocks of 1 warp
    _check(theoretical_occupancy("sm_89", 32, 1, 0), 24, 24, 24 / 48, "blocks")
    # warps: 48 // 4 = 12 blocks (registers allow 64 // 4 = 16)
    _check(theoretical_occupancy("sm_89", 32, 4, 0), 12, 48, 1.0, "warps")


# --- sm_90 (H100, H200) and sm_100 (B200): 64 warps, 32 blocks, 228 KiB smem/SM, 227 KiB/block ------------

@pytest.mark.parametrize("arch", ["sm_90", "sm_100"])
def test_sm90_sm100_cases(arch):
    # registers: 168 x 32 = 5376; 16384 // 5376 = 3 -> 12 warps -> 1 block of 8
    _check(theoretical_occupancy(arch, 168, 8, 0), 1, 8, 8 / 64, "registers")
    # shared: 100000 + 1024 = 101024 -> rounded to 128: 101120; 233472 // 101120 = 2 blocks of 4 warps
    occ = theoretical_occupancy(arch, 32, 4, 100000)
    _check(occ, 2, 8, 8 / 64, "shared_memory")
    assert occ.shared_allocated_per_block == 101120
    # blocks: 32 blocks of 1 warp
    _check(theoretical_occupancy(arch, 16, 1, 0), 32, 32, 0.5, "blocks")
    # warps: 64 // 16 = 4 blocks (24 regs -> 768/warp -> 84 warps -> registers allow 5)
    _check(theoretical_occupancy(arch, 24, 16, 0), 4, 64, 1.0, "warps")
    # the whole 227 KiB per block fits exactly once (227 + 1 = 228 KiB); one byte more cannot launch
    _check(theoretical_occupancy(arch, 32, 4, 227 * KIB), 1, 4, 4 / 64, "shared_memory")
    _check(theoretical_occupancy(arch, 32, 4, 227 * KIB + 1), 0, 0, 0.0, "shared_memory")


def test_ties_report_every_limiter():
    # sm_80, 64 regs, 1 warp: registers allow 16384 // 2048 = 8 per sub-partition -> 32 blocks = the block cap
    occ = theoretical_occupancy("sm_80", 64, 1, 0)
    assert occ.limiters == ("blocks", "registers") and occ.limiter == "blocks"
    assert "and" in occ.hint  # both must move to gain a block


def test_grid_waves_by_hand():
    occ = theoretical_occupancy("sm_90", 32, 4, 0)  # 16 blocks/SM (warps), H100 SXM: 132 x 16 = 2112 per wave
    (w,) = grid_waves(occ, 5000, ["H100-SXM"])
    assert w.blocks_per_wave == 2112
    assert w.waves == pytest.approx(5000 / 2112)
    assert w.tail_utilisation == pytest.approx((5000 - 2 * 2112) / 2112)
    assert w.efficiency == pytest.approx(5000 / (3 * 2112))
    (w,) = grid_waves(occ, (66, 64), ["H100-SXM"])  # 4224 = exactly 2 waves
    assert (w.waves, w.tail_utilisation, w.efficiency) == (2.0, 1.0, 1.0)
    # default: every model of the arch (H100 SXM, H100 PCIe, H200)
    hopper = sorted(g.name for g in GPUS.values() if g.arch == "sm_90")
    assert sorted(x.gpu for x in occ.waves(5000)) == hopper
    # a kernel that cannot launch never finishes a wave
    (w,) = grid_waves(theoretical_occupancy("sm_86", 32, 4, 100 * KIB), 10, ["A10"])
    assert (w.blocks_per_wave, w.waves, w.tail_utilisation) == (0, math.inf, 0.0)
    with pytest.raises(ValueError, match="grid=0 must be a positive int"):
        grid_waves(occ, 0)
    with pytest.raises(ValueError, match="Unknown gpu='V100'"):
        grid_waves(occ, 10, ["V100"])


def test_arch_table_and_names():
    for name, spec in ARCHS.items():
        assert spec.name == name and len(spec.sources) >= 3
        assert spec.shared_per_block_bytes + spec.reserved_shared_per_block_bytes == spec.shared_per_sm_bytes
    assert all(g.arch in ARCHS and g.sms > 0 and g.sm_source for g in GPUS.values())
    for alias in ("sm_90", "sm90", "90", 90, "sm_90a", "9.0", "H100", "h200"):
        assert resolve_arch(alias).name == "sm_90"
    assert math.isclose(ARCHS["sm_86"].max_threads_per_sm, 1536)


@pytest.mark.parametrize("kwargs, match", [
    (dict(arch="sm_75", registers_per_thread=32, num_warps=4), r"Unknown arch='sm_75'"),
    (dict(arch="sm_80", registers_per_thread=256, num_warps=4),
     r"registers_per_thread=256 must be an int in \[0, 255\]"),
    (dict(arch="sm_80", registers_per_thread=32, num_warps=0), r"num_warps=0 must be an int in \[1, 32\]"),
    (dict(arch="sm_80", registers_per_thread=32, num_warps=64), r"num_warps=64"),
    (dict(arch="sm_80", registers_per_thread=32, num_warps=4, shared_bytes=-1), r"shared_bytes=-1"),
])
def test_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        theoretical_occupancy(**kwargs)


def test_load_kernel_module_form_resolves_from_the_current_folder(tmp_path, monkeypatch):
    # The `meshkit` console script's sys.path[0] is its bin/ folder; MODULE:KERNEL must still find ./MODULE.py.
    import sys

    from meshkit.profiling.occupancy.cli import load_kernel

    (tmp_path / "my_mod_for_load_test.py").write_text("def my_kernel():\n    return 7\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    name, kernel = load_kernel("my_mod_for_load_test:my_kernel")
    assert (name, kernel()) == ("my_kernel", 7)
    with pytest.raises(ValueError, match="cannot import module 'no_such_mod_xyz'"):
        load_kernel("no_such_mod_xyz:k")


def test_the_hint_puts_spills_first():
    """Issue 26: a kernel spilling 436 B got only its occupancy hint; spills cost more (local-memory traffic)."""
    from meshkit.profiling.occupancy.compile import KernelResources
    from meshkit.profiling.occupancy.report import KernelReport, occupancy_text
    from meshkit.profiling.occupancy.theory import theoretical_occupancy

    def report(spill: int) -> KernelReport:
        res = KernelResources("k", "sm_90", 4, 3, {"BLOCK": 4096}, 255, spill, spill, spill, 0, 0, 0, 0.0)
        return KernelReport(res, theoretical_occupancy("sm_90", registers_per_thread=255, num_warps=4))

    spilling, clean = report(436), report(0)
    assert spilling.hint.startswith("spills 436 B of registers per thread to local memory (255 registers live)")
    assert "num_warps above 4" in spilling.hint and spilling.hint.endswith("then: " + clean.occupancy.hint)
    assert clean.hint == clean.occupancy.hint and "spill" not in clean.hint
    assert spilling.to_dict()["hint"] == spilling.hint
    assert "k sm_90 w4 s3: spills 436 B" in occupancy_text([spilling])
