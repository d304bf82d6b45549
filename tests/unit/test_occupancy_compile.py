"""Compile-and-measure on CPU: Triton kernels compiled for sm_80 / sm_90 without a GPU, read from the cubin.

Compiles are slow on a 2-core machine, so every compiled result is made once per module (one cache
directory) and the later tests read it back from that cache.
"""

import json
import os
import re
import sys

import pytest
import torch

import meshkit.kernels
from meshkit.profiling import occupancy as occ_mod
from meshkit.profiling.occupancy import kernel_occupancy, sweep_occupancy, theoretical_occupancy
from meshkit.profiling.occupancy.compile import KernelCompileError, build_signature, launch_configs
from tests.fixtures.occupancy_kernels import autotuned_scale, broken_kernel, matmul_kernel, row_sum_squares

RED_SIG = "X=*fp32,OUT=*fp32,N=i32,stride=i32"
WARPS = [1, 2, 4, 8, 16]
# a launcher specialises M, N, K and the leading strides of 4096x4096 fp16 matrices as 16-divisible and
# the unit strides as the constant 1; we give the same specialisation explicitly
MM_SIG = {"A": "*fp16", "B": "*fp16", "C": "*fp16", "M": "i32:16", "N": "i32:16", "K": "i32:16",
          "stride_am": "i32:16", "stride_bk": "i32:16", "stride_cm": "i32:16"}
MM_CONST = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "stride_ak": 1, "stride_bn": 1,
            "stride_cn": 1}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("occ-cache"))


@pytest.fixture(scope="module")
def compiled(cache_dir):
    """Both fixture kernels in one sweep (one pool of compile workers): 10 + 2 compiles."""
    specs = [
        {"kernel": row_sum_squares, "signature": RED_SIG, "constexprs": {"BLOCK": 1024},
         "configs": [{"num_warps": w} for w in WARPS]},
        {"kernel": matmul_kernel, "signature": MM_SIG, "constexprs": MM_CONST,
         "configs": [{"num_warps": 8, "num_stages": 4}]},
    ]
    return sweep_occupancy(specs, archs=["sm_80", "sm_90"], grid=4096, cache_dir=cache_dir)


@pytest.fixture(scope="module")
def reduction(compiled):
    return [r for r in compiled if r.kernel == "row_sum_squares"]


@pytest.fixture(scope="module")
def matmul(compiled):
    return [r for r in compiled if r.kernel == "matmul_kernel"]


def test_reduction_registers_and_occupancy(reduction):
    reps = reduction
    assert [(r.arch, r.num_warps) for r in reps] == [(a, w) for a in ("sm_80", "sm_90") for w in WARPS]
    for arch in ("sm_80", "sm_90"):
        by_w = {r.num_warps: r for r in reps if r.arch == arch}
        # one warp holds the whole BLOCK=1024 fp32 accumulator: 1024 / 32 = 32 values per thread
        assert by_w[1].registers_per_thread >= 32
        assert by_w[16].registers_per_thread < by_w[1].registers_per_thread
        # one warp per block: the 32-block cap (or registers) leaves at most half the 64 warp slots
        assert by_w[1].occupancy.occupancy <= 0.5
        for w, r in by_w.items():
            assert r.spill_bytes == 0 and r.registers_per_thread > 0
            # the cross-warp tl.sum keeps one fp32 partial per warp in shared memory
            assert r.dynamic_shared_bytes == (4 * w if w > 1 else 0)
            # the report is the calculator applied to the cubin's figures
            assert r.occupancy == theoretical_occupancy(arch, r.registers_per_thread, w, r.shared_bytes)
            assert {x.gpu for x in r.waves} == {g.name for g in occ_mod.GPUS.values() if g.arch == arch}
            for x in r.waves:
                assert x.blocks_per_wave == x.sms * r.occupancy.active_blocks_per_sm


def test_results_come_back_from_the_cache(reduction, cache_dir):
    first = reduction
    again = kernel_occupancy(row_sum_squares, signature=RED_SIG, constexprs={"BLOCK": 1024}, num_warps=WARPS,
                             archs=["sm_80", "sm_90"], grid=4096, cache_dir=cache_dir)
    assert all(r.cached for r in again) and not any(r.cached for r in first)
    assert [r.to_dict() for r in again] == [r.to_dict() for r in first]
    # a different config is a different key: one new entry for 16-divisible N
    before = len(os.listdir(cache_dir))
    (new,) = kernel_occupancy(row_sum_squares, signature=RED_SIG.replace("N=i32", "N=i32:16"),
                              constexprs={"BLOCK": 1024}, num_warps=4, archs=["sm_90"], cache_dir=cache_dir)
    assert not new.cached and len(os.listdir(cache_dir)) == before + 1


def test_tiled_matmul_is_limited_by_shared_memory_or_registers(matmul):
    for r in matmul:
        # 4 stages keep 3 in flight: 3 x (128x64 + 64x128) fp16 tiles = 3 x 32 KiB
        assert r.shared_bytes >= 3 * (128 * 64 + 64 * 128) * 2
        assert r.occupancy.limiter in ("registers", "shared_memory")
        assert r.occupancy.active_blocks_per_sm == 1 and r.occupancy.occupancy == pytest.approx(8 / 64)
        # a second block needs 2 x (shared + 1 KiB) within the SM's shared memory and 2 x 8 warps of registers
        spec = occ_mod.ARCHS[r.arch]
        smem_ok = 2 * (r.shared_bytes + 1024) <= spec.shared_per_sm_bytes
        regs_per_warp = -(-r.registers_per_thread * 32 // 256) * 256
        reg_ok = (65536 // 4) // regs_per_warp * 4 >= 2 * 8
        assert not (smem_ok and reg_ok)
        assert ("shared_memory" in r.occupancy.limiters) == (not smem_ok)
        assert ("registers" in r.occupancy.limiters) == (not reg_ok)


def test_signature_from_example_args():
    x = torch.empty(4, 1024)
    out = torch.empty(4)
    sig = build_signature(row_sum_squares, args=[x, out, 1000, 1024], constexprs={"BLOCK": 1024})
    assert sig.types == {"X": "*fp32", "OUT": "*fp32", "N": "i32", "stride": "i32"}
    # 1024 is 16-divisible, 1000 is not; fresh torch allocations are 16-byte aligned
    assert set(sig.divisible) == {"X", "OUT", "stride"}
    half = build_signature(row_sum_squares, args=[x.half(), out, 2**40, 1.5], constexprs={"BLOCK": 64})
    assert half.types == {"X": "*fp16", "OUT": "*fp32", "N": "i64", "stride": "fp32"}


def test_autotune_configs_are_the_default():
    cfgs = launch_configs(autotuned_scale)
    got = [(c.num_warps, c.num_stages, c.constexprs) for c in cfgs]
    assert got == [(2, 2, {"BLOCK": 256}), (8, 3, {"BLOCK": 1024})]
    explicit = launch_configs(autotuned_scale, num_warps=[4, 8])
    assert [(c.num_warps, c.num_stages) for c in explicit] == [(4, 3), (8, 3)]
    (cfg,) = launch_configs(row_sum_squares, configs=[{"num_warps": 2, "BLOCK": 64}])
    assert (cfg.num_warps, cfg.num_stages, cfg.constexprs) == (2, 3, {"BLOCK": 64})
    with pytest.raises(ValueError, match="give configs= or num_warps=/num_stages=, not both"):
        launch_configs(row_sum_squares, configs=[{"num_warps": 2}], num_warps=4)


@pytest.mark.parametrize("kwargs, match", [
    (dict(signature=RED_SIG, constexprs={"BLOCK": 1024}, archs=["sm_75"]), r"Unknown arch='sm_75'"),
    (dict(signature="X=*fp32,Y=*fp32,N=i32,stride=i32", constexprs={"BLOCK": 8}),
     r"row_sum_squares has no parameter\(s\) Y; its parameters are X, OUT, N, stride, BLOCK"),
    (dict(signature="X=*fp32,N=i32,stride=i32", constexprs={"BLOCK": 8}), r"parameter OUT has no type"),
    (dict(signature=RED_SIG + ",BLOCK=i32"), r"BLOCK is a tl.constexpr; pass its value as a constexpr"),
    (dict(signature=RED_SIG), r"tl.constexpr BLOCK has no value"),
    (dict(signature="X=*float,OUT=*fp32,N=i32,stride=i32", constexprs={"BLOCK": 8}),
     r"X='\*float' is not a Triton type"),
    (dict(signature="X=*fp32,OUT=*fp32,N=i32:8,stride=i32", constexprs={"BLOCK": 8}),
     r"the only hint is ':16'"),
    (dict(args=[torch.empty(4)], constexprs={"BLOCK": 8}), r"takes 4 runtime arguments .* got len\(args\)=1"),
    (dict(signature=RED_SIG, constexprs={"BLOCK": 8}, num_warps=3), r"num_warps=3 must be a power of two"),
])
def test_bad_input_is_named(kwargs, match, cache_dir):
    with pytest.raises(ValueError, match=match):
        kernel_occupancy(row_sum_squares, cache_dir=cache_dir, **kwargs)


def test_kernel_that_fails_to_compile(cache_dir):
    match = r"(?s)broken_kernel failed to compile for sm_90 .*power of 2"
    with pytest.raises(KernelCompileError, match=match):
        kernel_occupancy(broken_kernel, signature="X=*fp32,N=i32", constexprs={"BLOCK": 100}, archs=["sm_90"],
                         cache_dir=cache_dir)


def test_nested_kernel_is_rejected(cache_dir):
    import triton
    import triton.language as tl

    @triton.jit
    def inner(X, BLOCK: tl.constexpr):
        tl.store(X + tl.arange(0, BLOCK), 0.0)

    with pytest.raises(ValueError, match="defined inside a function .* define it at module level"):
        kernel_occupancy(inner, signature="X=*fp32", constexprs={"BLOCK": 16}, cache_dir=cache_dir)


def _cli(argv):
    import argparse

    parser = argparse.ArgumentParser()
    occ_mod.configure_parser(parser)
    return occ_mod.run_cli(parser.parse_args(argv))


def test_cli_json_shape(reduction, cache_dir, capsys):
    reps = reduction
    rc = _cli(["tests.fixtures.occupancy_kernels:row_sum_squares", "--signature", RED_SIG, "--constexpr",
               "BLOCK=1024", "--num-warps", "1,2,4,8,16", "--arch", "sm_80,H100", "--grid", "4096", "--json",
               "--cache-dir", cache_dir, "--no-progress"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["reports"]) == 10
    types = {"kernel": str, "arch": str, "num_warps": int, "num_stages": int, "registers_per_thread": int,
             "spill_bytes": int, "shared_bytes": int, "active_blocks_per_sm": int, "active_warps_per_sm": int,
             "occupancy": float, "limiter": str}
    for rec, rep in zip(out["reports"], reps):
        assert all(isinstance(rec[k], t) for k, t in types.items()), rec
        assert rec == json.loads(json.dumps(rep.to_dict()))


def test_cli_table_tensorboard_and_errors(reduction, cache_dir, capsys, tmp_path):
    rc = _cli(["tests/fixtures/occupancy_kernels.py:row_sum_squares", "--signature", RED_SIG, "--constexpr",
               "BLOCK=1024", "--num-warps", "4", "--arch", "sm_90", "--cache-dir", cache_dir, "--no-progress",
               "--tensorboard", str(tmp_path / "tb")])
    out = capsys.readouterr().out
    assert rc == 0 and "limiter" in out.splitlines()[0] and "row_sum_squares sm_90 w4 s3:" in out
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"images": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()
    assert "occupancy/table/text_summary" in tags["tensors"]
    assert tags["images"] == ["occupancy/row_sum_squares/sm_90/w4_s3_BLOCK1024/limits"]

    from meshkit.cli import main  # user errors: the one catch in meshkit.cli

    assert main(["occupancy", "nosuch.module:k", "--signature", "X=*fp32"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshkit occupancy: error: ") and "cannot import module 'nosuch.module'" in err
    assert main(["occupancy", "tests.fixtures.occupancy_kernels:row_sum_squares", "--arch", "sm_90"]) == 2
    assert "--signature is required" in capsys.readouterr().err


def test_cli_builtin(reduction, cache_dir, capsys, monkeypatch):
    monkeypatch.delattr(meshkit.kernels, "builtin_kernel_specs", raising=False)
    from meshkit.cli import main

    assert main(["occupancy", "--builtin", "--arch", "sm_90", "--json"]) == 2
    assert "meshkit.kernels.builtin_kernel_specs()" in capsys.readouterr().err
    spec = {"name": "sum_sq", "kernel": row_sum_squares,
            "signature": {"X": "*fp32", "OUT": "*fp32", "N": "i32", "stride": "i32"},
            "constexprs": {"BLOCK": 1024}}
    monkeypatch.setattr(meshkit.kernels, "builtin_kernel_specs", lambda: [spec], raising=False)
    assert _cli(["--builtin", "--arch", "sm_80", "--num-warps", "2", "--json", "--cache-dir", cache_dir,
                 "--no-progress"]) == 0
    (rec,) = json.loads(capsys.readouterr().out)["reports"]
    assert (rec["kernel"], rec["arch"], rec["num_warps"]) == ("sum_sq", "sm_80", 2)
    (fixture,) = [r for r in reduction if r.arch == "sm_80" and r.num_warps == 2]
    assert rec["registers_per_thread"] == fixture.registers_per_thread


def test_in_process_compile_matches_the_worker(reduction, tmp_path):
    """Without TRITON_INTERPRET the compile runs in the calling process; its figures equal the worker's."""
    import subprocess
    import sys

    script = (
        "import json, sys\n"
        "from meshkit.profiling.occupancy import compile as oc\n"
        "from meshkit.profiling.occupancy import kernel_occupancy\n"
        "from tests.fixtures.occupancy_kernels import row_sum_squares\n"
        "assert not oc._interpreting()\n"
        f"r = kernel_occupancy(row_sum_squares, signature={RED_SIG!r}, constexprs={{'BLOCK': 1024}},\n"
        f"                     num_warps=4, grid=4096, archs=['sm_90'], cache_dir={str(tmp_path)!r})[0]\n"
        "print(json.dumps(r.to_dict()))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.getcwd()
    env["MESHKIT_OCCUPANCY_WORKERS"] = ""
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    here = json.loads(proc.stdout.strip().splitlines()[-1])
    (worker,) = [r for r in reduction if r.arch == "sm_90" and r.num_warps == 4]
    assert here == worker.to_dict()


def test_given_warps_or_stages_replace_a_specs_own_configs():
    """`--num-warps` with `--builtin` measures the warps given, never silently the spec's (each value kept else)."""
    from meshkit.profiling.occupancy.report import _override

    own = [{"num_warps": 16, "num_stages": 3}]
    assert _override(own) == own
    assert _override(own, num_warps=[4, 8], num_stages=None) == [{"num_warps": 4, "num_stages": 3},
                                                                  {"num_warps": 8, "num_stages": 3}]
    assert _override(own, num_warps=None, num_stages=2) == [{"num_warps": 16, "num_stages": 2}]


def _terminal_lines(raw: str) -> list[str]:
    """What a terminal shows for ``raw``: ``\\r`` returns to column 0 and later text overwrites (the pty's
    ``\\r\\n`` included); CSI escapes are dropped (tqdm draws position 0 without them)."""
    lines, buf, col = [], [], 0
    for ch in re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", raw):
        if ch == "\n":
            lines.append("".join(buf).rstrip())
            buf, col = [], 0
        elif ch == "\r":
            col = 0
        else:
            buf[col:col + 1] = [ch]
            col += 1
    return lines + (["".join(buf).rstrip()] if buf else [])


def test_terminal_lines_overwrite_like_a_terminal():
    assert _terminal_lines("bar 10%\rbar 99%\r       \rhead\r\nrow\n") == ["head", "row"]
    assert _terminal_lines("bar 10%  warn\nhead") == ["bar 10%  warn", "head"]


# the CLI in a fresh interpreter (no TRITON_INTERPRET: the in-process compile, where Triton's own warnings
# are raised), with one more warning raised mid-compile as any compiler warning would be
_CLI_WITH_A_WARNING = (
    "import sys, warnings\n"
    "from meshkit.profiling.occupancy import compile as oc\n"
    "real = oc._compile_one\n"
    "def warned(*a, **k):\n"
    "    warnings.warn('a compiler warning', UserWarning)\n"
    "    return real(*a, **k)\n"
    "oc._compile_one = warned\n"
    "from meshkit.cli import main\n"
    "raise SystemExit(main(sys.argv[1:]))\n"
)


def _occupancy_cli_argv(cache: str) -> list[str]:
    return [sys.executable, "-c", _CLI_WITH_A_WARNING, "occupancy",
            "tests/fixtures/occupancy_kernels.py:row_sum_squares", "--signature", RED_SIG, "--constexpr",
            "BLOCK=1024", "--num-warps", "4,8", "--arch", "sm_90", "--cache-dir", cache]


def _cli_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITON_DEFAULT_FP_FUSION")}
    env.update(PYTHONPATH=os.getcwd(), MESHKIT_OCCUPANCY_WORKERS="")
    return env


def test_cli_on_a_terminal_progress_and_warnings_stay_off_the_table(tmp_path):
    """Issue 26: the progress bar and a Triton warning ran into the table header. On a terminal (a pty as
    stdout and stderr) the bar is drawn and erased, the warning shown after it, the finished line follows,
    and the table starts on a line of its own; Triton 3.9's FP-fusion warning is not raised at all."""
    import fcntl
    import pty
    import select
    import struct
    import subprocess
    import termios
    import time

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 100, 0, 0))  # 100 columns, as a terminal
    proc = subprocess.Popen(_occupancy_cli_argv(str(tmp_path)), stdout=follower, stderr=follower,
                            env=_cli_env())
    os.close(follower)
    raw, deadline = b"", time.monotonic() + 300
    try:
        while True:
            ready, _, _ = select.select([leader], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                proc.kill()
                pytest.fail(f"the CLI printed nothing more for 300 s:\n{raw.decode()[-3000:]}")
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            raw += chunk
    finally:
        os.close(leader)
    assert proc.wait(timeout=60) == 0, raw.decode()[-3000:]
    text = raw.decode()
    assert "compiling:" in text  # the bar was drawn (a terminal) ...
    lines = [ln for ln in _terminal_lines(text) if ln]
    assert not any("compiling" in ln for ln in lines), lines  # ... and erased
    assert "FP_FUSION" not in text and "TRITON_DEFAULT_FP_FUSION" not in text, text
    head = next(i for i, ln in enumerate(lines) if ln.split()[:2] == ["kernel", "arch"])
    assert lines[head].split() == ["kernel", "arch", "warps", "stages", "regs", "spill", "B", "smem", "B",
                                   "blocks/SM", "warps/SM", "occ", "limiter"], lines
    assert re.fullmatch(r"2 kernel config\(s\): 2 compiled in [\d.]+ s, 0 from the cache \(.*\)",
                        lines[head - 1]), lines
    warned = [i for i, ln in enumerate(lines) if "UserWarning: a compiler warning" in ln]
    assert warned and max(warned) < head - 1, lines
    assert [ln.split()[:2] for ln in lines[head + 1:head + 3]] == [["row_sum_squares", "sm_90"]] * 2, lines


def test_cli_piped_table_alone_on_stdout(tmp_path):
    """Piped (a log, `| less`): stdout is the table alone; stderr holds the warning and the finished line, no
    bar remnants (the bar is drawn on terminals only)."""
    import subprocess

    argv = _occupancy_cli_argv(str(tmp_path))
    proc = subprocess.run(argv, capture_output=True, text=True, env=_cli_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout.splitlines()
    assert out[0].split()[:2] == ["kernel", "arch"] and len(out) == 5, out  # header, 2 rows, 2 hints
    assert "\r" not in proc.stderr and "compiling" not in proc.stderr, proc.stderr
    err = proc.stderr.splitlines()
    assert "UserWarning: a compiler warning" in proc.stderr and err[-1].startswith("2 kernel config(s): 2 compiled")
