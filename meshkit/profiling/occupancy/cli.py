"""``meshkit occupancy``: registers, spills, shared memory and warp occupancy of Triton kernels on any
NVIDIA target, from this CPU. Prints a table, ``--json`` or TensorBoard output.

    meshkit occupancy tests/fixtures/occupancy_kernels.py:row_sum_squares \\
        --signature "X=*fp32,OUT=*fp32,N=i32,stride=i32" --constexpr BLOCK=1024 --arch sm_80,H100
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from typing import Any, Sequence

from meshkit.profiling.occupancy.arch import ARCHS, GPUS
from meshkit.profiling.occupancy.compile import import_file
from meshkit.profiling.occupancy.report import (KernelReport, kernel_occupancy, occupancy_text,
                                                sweep_occupancy, write_occupancy_tensorboard)

__all__ = ["configure_parser", "load_kernel", "run_cli"]


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Flags of ``meshkit occupancy``.

    >>> parser = argparse.ArgumentParser(prog="meshkit occupancy")
    >>> configure_parser(parser)
    >>> parser.parse_args(["mod:kern", "--arch", "sm_90"]).arch
    'sm_90'
    """
    parser.add_argument("target", nargs="?",
                        help="MODULE:KERNEL or path/to/file.py:KERNEL (a @triton.jit function)")
    parser.add_argument("--builtin", action="store_true", help="report every kernel in meshkit.kernels")
    parser.add_argument("--signature", help='argument types, e.g. "X=*fp32,W=*fp32,N=i32"')
    parser.add_argument("--constexpr", action="append", default=[], metavar="NAME=VALUE",
                        help="a tl.constexpr value (repeatable)")
    parser.add_argument("--num-warps", help="comma list, e.g. 4,8 (default: the launch's own or autotune configs, else 4)")
    parser.add_argument("--num-stages", help="comma list (default: the launch's own or autotune configs, else 3)")
    parser.add_argument("--arch", default="sm_80,sm_90",
                        help=f"comma list of archs or GPU models ({', '.join(ARCHS)}; {', '.join(GPUS)})")
    parser.add_argument("--grid", help="blocks, e.g. 4096 or 64x32: adds waves and tail per GPU model")
    parser.add_argument("--gpu", help="comma list of GPU models for --grid (default: all of each arch)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--tensorboard", metavar="DIR",
                        help="also write a table and bar charts to this run dir")
    parser.add_argument("--cache-dir", help="result cache (default $MESHKIT_CACHE_DIR or ~/.cache/meshkit)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def _int_list(name: str, text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise ValueError(f"{name}={text!r} must be a comma list of ints, e.g. 4,8.") from None


def _parse_constexprs(items: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"--constexpr {item!r} must read NAME=VALUE, e.g. --constexpr BLOCK=1024.")
        out[name.strip()] = _literal(value.strip())
    return out


def _literal(text: str) -> Any:
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return {"True": True, "False": False}.get(text, text)


def load_kernel(target: str) -> tuple[str, Any]:
    """Import ``MODULE:KERNEL`` or ``path/file.py:KERNEL``; returns (display name, kernel object).

    >>> load_kernel("tests/fixtures/occupancy_kernels.py:row_sum_squares")[0]  # doctest: +SKIP
    'row_sum_squares'
    """
    mod_part, sep, name = target.rpartition(":")
    if not sep or not mod_part or not name:
        raise ValueError(f"target={target!r} must read MODULE:KERNEL or path/to/file.py:KERNEL.")
    if mod_part.endswith(".py") or os.sep in mod_part:
        if not os.path.isfile(mod_part):
            raise ValueError(f"target={target!r}: no file {mod_part!r}.")
        module = import_file(mod_part)
    else:
        if os.getcwd() not in sys.path and "" not in sys.path:  # as `python -m` would: the console script's
            sys.path.insert(0, os.getcwd())                    # sys.path[0] is its bin/ folder, not the cwd
        try:
            module = importlib.import_module(mod_part)
        except ImportError as exc:
            raise ValueError(f"target={target!r}: cannot import module {mod_part!r} ({exc}).") from None
    if not hasattr(module, name):
        raise ValueError(f"target={target!r}: module {mod_part!r} has no attribute {name!r}.")
    return name, getattr(module, name)


def _builtin_specs() -> list[dict[str, Any]]:
    try:
        kernels = importlib.import_module("meshkit.kernels")
        specs = kernels.builtin_kernel_specs
    except (ImportError, AttributeError):
        raise ValueError("--builtin needs meshkit.kernels.builtin_kernel_specs(), which this meshkit does "
                         "not have yet; name a kernel instead: meshkit occupancy MODULE:KERNEL "
                         "--signature ...") from None
    return list(specs())


def run_cli(args: argparse.Namespace) -> int:
    """Entry of ``meshkit occupancy``; returns the exit status (a usage error raises ValueError; ``meshkit.cli`` reports it).

    >>> run_cli(parser.parse_args(["--builtin", "--arch", "sm_90", "--json"]))  # doctest: +SKIP
    0
    """
    reports = _run(args)  # a ValueError: meshkit.cli prints it (``meshkit occupancy: error: ...``), exit 2
    if args.json:
        print(json.dumps({"reports": [r.to_dict() for r in reports]}, indent=1))
    else:
        print(occupancy_text(reports))
    if args.tensorboard:
        write_occupancy_tensorboard(reports, args.tensorboard)
    return 0


def _run(args: argparse.Namespace) -> list[KernelReport]:
    if bool(args.builtin) == bool(args.target):
        raise ValueError("give either a target MODULE:KERNEL or --builtin (exactly one).")
    archs = [a for a in args.arch.split(",") if a.strip()]
    grid = None
    if args.grid:
        try:
            grid = [int(x) for x in args.grid.lower().replace(",", "x").split("x")]
        except ValueError:
            raise ValueError(f"--grid={args.grid!r} must be ints joined by x, e.g. 4096 or 64x32.") from None
    gpus = args.gpu.split(",") if args.gpu else None
    common = dict(num_warps=_int_list("--num-warps", args.num_warps),
                  num_stages=_int_list("--num-stages", args.num_stages), archs=archs, grid=grid, gpus=gpus,
                  cache_dir=args.cache_dir, progress=not args.no_progress)
    if args.builtin:
        if args.signature or args.constexpr:
            raise ValueError("--builtin takes each kernel's own signature; drop --signature/--constexpr.")
        return sweep_occupancy(_builtin_specs(), **common)
    _, kernel = load_kernel(args.target)
    if args.signature is None:
        raise ValueError("--signature is required for a named kernel, e.g. --signature 'X=*fp32,N=i32'.")
    return kernel_occupancy(kernel, signature=args.signature, constexprs=_parse_constexprs(args.constexpr),
                            **common)
