"""Occupancy of your own Triton kernel on A100 (sm_80) and H100 (sm_90), without a GPU.

meshkit compiles the kernel for each target on this CPU (Triton's CUDA backend and the ptxas its wheel
ships), reads registers, spills and shared memory from the cubin and applies CUDA's occupancy rules.
The kernel lives in its own file, ``my_kernels.py`` next to this script. First from Python, then the
same report from the command line.

    python examples/occupancy_my_kernel.py            # BLOCK 1024 and 4096, 4 and 8 warps
    python examples/occupancy_my_kernel.py --tiny     # BLOCK 1024, 4 warps (what CI runs)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import meshkit
from my_kernels import row_softmax  # this script's folder is on sys.path when run as a script

HERE = os.path.dirname(os.path.abspath(__file__))
# The argument types as Triton's launcher would see them: fp16 pointers, N and stride 16-divisible ints.
SIGNATURE = "X=*fp16,Y=*fp16,N=i32:16,stride=i32:16"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="one block size and warp count (CI)")
    args = parser.parse_args()
    blocks, warps = ([1024], [4]) if args.tiny else ([1024, 4096], [4, 8])
    rows = 8192  # grid: one program per row of a (8192, BLOCK) activation

    # 1. From Python: one report per arch x config.
    print(f"{'arch':6} {'BLOCK':>5} {'warps':>5} {'regs':>4} {'smem B':>7} {'occupancy':>9}  limiter")
    for block in blocks:
        reports = meshkit.kernel_occupancy(row_softmax, signature=SIGNATURE, constexprs={"BLOCK": block},
                                           num_warps=warps, archs=["sm_80", "sm_90"], grid=rows)
        for r in reports:
            occ = r.occupancy
            print(f"{r.arch:6} {block:5d} {r.num_warps:5d} {r.registers_per_thread:4d} {r.shared_bytes:7d} "
                  f"{occ.occupancy:9.1%}  {occ.limiter}: {occ.hint}")

    # 2. The same from the CLI, run from this folder: MODULE:KERNEL (or path/to/file.py:KERNEL).
    cmd = ["meshkit", "occupancy", "my_kernels:row_softmax", "--signature", SIGNATURE,
           "--constexpr", f"BLOCK={blocks[0]}", "--num-warps", ",".join(map(str, warps)),
           "--arch", "sm_80,sm_90", "--grid", str(rows)]
    print("\n$ cd examples && " + " ".join(f'"{c}"' if "," in c or "=" in c else c for c in cmd))
    # `python -m meshkit` is the `meshkit` console script, run with this interpreter.
    subprocess.run([sys.executable, "-m", "meshkit", *cmd[1:]], cwd=HERE, check=True)


if __name__ == "__main__":
    main()
