"""Compile-time descriptions of meshkit's Triton kernels, for ahead-of-time compilation and occupancy.

Each spec gives the ``@triton.jit`` function, a Triton type string for every runtime argument and a
representative value for every ``tl.constexpr`` (shapes of a Llama-3-8B-like layer: hidden 4096,
32 query heads of 128, vocab 128256 split in 4096-column steps; RMSNorm's column-split backward, which only
hidden sizes above 4096 launch, at Llama-3-405B's 16384).
"""

from __future__ import annotations

from typing import Any

from ._backend import HAS_TRITON

__all__ = ["builtin_kernel_specs"]

_HIDDEN, _HEADS, _HEAD_DIM, _VOCAB = 4096, 32, 128, 128256
"""The representative layer: Llama-3-8B's hidden size, query heads, head size and vocabulary."""
_WIDE_HIDDEN = 16384
"""Llama-3-405B's hidden size: RMSNorm's backward takes its column-split path there (any hidden above 4096 launches
the same two kernels alike, ``rms_norm._bwd_launch``)."""


def builtin_kernel_specs() -> list[dict[str, Any]]:
    """The Triton kernels of meshkit.kernels as ``{"name", "kernel", "signature", "constexprs"}`` dicts.

    ``signature`` maps every non-constexpr argument to a type string ("*fp32", "*fp16", "i32", "i64",
    "fp32"); ``constexprs`` maps every constexpr to an int; ``configs`` holds the one launch config (num_warps)
    that meshkit's launcher uses for this shape, from the launcher's own ``_launch``, so the report measures what
    runs. Empty when Triton is not installed.

    Example::

        >>> from meshkit.kernels import builtin_kernel_specs
        >>> sorted(s["name"] for s in builtin_kernel_specs())[:2]
        ['ce_grad', 'ce_stats']
    """
    if not HAS_TRITON:
        return []
    import importlib

    # The modules, not the package's functions of the same names (meshkit.kernels.rms_norm is the function).
    rn, ce, rope, swiglu = (importlib.import_module(f"{__package__}.{m}")
                            for m in ("rms_norm", "cross_entropy", "rope", "swiglu"))

    bf, f32 = "*bf16", "*fp32"
    return [
        _spec("rms_norm_fwd", rn._rms_norm_fwd_kernel, rn._launch(_HIDDEN), {"HAS_RES": 1},
              {"X": bf, "RES": bf, "W": bf, "Y": bf, "RES_OUT": bf, "RSTD": f32, "stride_x": "i32",
               "stride_res": "i32", "stride_y": "i32", "stride_res_out": "i32", "N": "i32", "eps": "fp32"}),
        _spec("rms_norm_bwd", rn._rms_norm_bwd_kernel, rn._bwd_launch(_HIDDEN)["rows"], {"HAS_DRES": 1},
              {"DY": bf, "X": bf, "W": bf, "RSTD": f32, "DRES": bf, "DX": bf, "DW_PART": f32, "stride_dy": "i32",
               "stride_x": "i32", "stride_dres": "i32", "stride_dx": "i32", "n_rows": "i32", "N": "i32",
               "rows_per_program": "i32"}),
        _spec("rms_norm_bwd_dot", rn._rms_norm_bwd_dot_kernel, rn._bwd_launch(_WIDE_HIDDEN)["dot"], {},
              {"DY": bf, "X": bf, "W": bf, "RSTD": f32, "DOT": f32, "stride_dy": "i32", "stride_x": "i32",
               "N": "i32"}),
        _spec("rms_norm_bwd_cols", rn._rms_norm_bwd_cols_kernel, rn._bwd_launch(_WIDE_HIDDEN)["cols"], {"HAS_DRES": 1},
              {"DY": bf, "X": bf, "W": bf, "RSTD": f32, "DOT": f32, "DRES": bf, "DX": bf, "DW_PART": f32,
               "stride_dy": "i32", "stride_x": "i32", "stride_dres": "i32", "stride_dx": "i32", "n_rows": "i32",
               "N": "i32", "rows_per_program": "i32"}),
        _spec("swiglu_fwd", swiglu._swiglu_fwd_kernel, swiglu._LAUNCH, {}, {"G": bf, "U": bf, "Y": bf, "n": "i32"}),
        _spec("swiglu_bwd", swiglu._swiglu_bwd_kernel, swiglu._LAUNCH, {},
              {"DY": bf, "G": bf, "U": bf, "DG": bf, "DU": bf, "n": "i32"}),
        _spec("rope", rope._rope_kernel, rope._launch(_HEADS, _HEAD_DIM), {"INTERLEAVED": 0},
              {"X": bf, "COS": f32, "SIN": f32, "Y": bf, "stride_xb": "i32", "stride_xt": "i32", "stride_xh": "i32",
               "stride_cb": "i32", "stride_ct": "i32", "T": "i32", "H": "i32", "HALF": "i32", "sign": "fp32"}),
        _spec("ce_stats", ce._ce_stats_kernel, ce._launch(_VOCAB), {},
              {"Z": bf, "TARGET": "*i64", "M": f32, "S": f32, "ZT": f32, "stride_z": "i32", "V": "i32",
               "vocab_start": "i32"}),
        _spec("ce_grad", ce._ce_grad_kernel, ce._launch(_VOCAB), {},
              {"Z": bf, "TARGET": "*i64", "LSE": f32, "SCALE": f32, "stride_z": "i32", "V": "i32",
               "vocab_start": "i32"}),
    ]


def _spec(name: str, kernel: Any, launch: dict[str, int], constexprs: dict[str, int],
          signature: dict[str, str]) -> dict[str, Any]:
    """One spec: the launch's blocks become constexprs, its ``num_warps`` the one config measured."""
    blocks = {k: v for k, v in launch.items() if k != "num_warps"}
    return {"name": name, "kernel": kernel, "signature": signature, "constexprs": {**constexprs, **blocks},
            "configs": [{"num_warps": launch["num_warps"]}]}
