"""Compile-time descriptions of meshkit's Triton kernels, for ahead-of-time compilation and occupancy.

Each spec gives the ``@triton.jit`` function, a Triton type string for every runtime argument and a
representative value for every ``tl.constexpr`` (shapes of a Llama-3-8B-like layer: hidden 4096,
32 query heads of 128, vocab 128256 split in 4096-column steps).
"""

from __future__ import annotations

from typing import Any

from ._backend import HAS_TRITON

__all__ = ["builtin_kernel_specs"]


def builtin_kernel_specs() -> list[dict[str, Any]]:
    """The Triton kernels of meshkit.kernels as ``{"name", "kernel", "signature", "constexprs"}`` dicts.

    ``signature`` maps every non-constexpr argument to a type string ("*fp32", "*fp16", "i32", "i64",
    "fp32"); ``constexprs`` maps every constexpr to an int. Empty when Triton is not installed.

    Example::

        >>> from meshkit.kernels import builtin_kernel_specs
        >>> sorted(s["name"] for s in builtin_kernel_specs())[:2]
        ['ce_grad', 'ce_stats']
    """
    if not HAS_TRITON:
        return []
    from .cross_entropy import _ce_grad_kernel, _ce_stats_kernel
    from .rms_norm import _rms_norm_bwd_kernel, _rms_norm_fwd_kernel
    from .rope import _rope_kernel
    from .swiglu import _swiglu_bwd_kernel, _swiglu_fwd_kernel

    bf, f32 = "*bf16", "*fp32"
    return [
        {
            "name": "rms_norm_fwd",
            "kernel": _rms_norm_fwd_kernel,
            "signature": {"X": bf, "RES": bf, "W": bf, "Y": bf, "RES_OUT": bf, "RSTD": f32,
                          "stride_x": "i32", "stride_res": "i32", "stride_y": "i32", "stride_res_out": "i32",
                          "N": "i32", "eps": "fp32"},
            "constexprs": {"HAS_RES": 1, "BLOCK_N": 4096},
        },
        {
            "name": "rms_norm_bwd",
            "kernel": _rms_norm_bwd_kernel,
            "signature": {"DY": bf, "X": bf, "W": bf, "RSTD": f32, "DRES": bf, "DX": bf, "DW_PART": f32,
                          "stride_dy": "i32", "stride_x": "i32", "stride_dres": "i32", "stride_dx": "i32",
                          "n_rows": "i32", "N": "i32", "rows_per_program": "i32"},
            "constexprs": {"HAS_DRES": 1, "BLOCK_N": 4096},
        },
        {
            "name": "swiglu_fwd",
            "kernel": _swiglu_fwd_kernel,
            "signature": {"G": bf, "U": bf, "Y": bf, "n": "i32"},
            "constexprs": {"BLOCK": 1024},
        },
        {
            "name": "swiglu_bwd",
            "kernel": _swiglu_bwd_kernel,
            "signature": {"DY": bf, "G": bf, "U": bf, "DG": bf, "DU": bf, "n": "i32"},
            "constexprs": {"BLOCK": 1024},
        },
        {
            "name": "rope",
            "kernel": _rope_kernel,
            "signature": {"X": bf, "COS": f32, "SIN": f32, "Y": bf, "stride_xb": "i32", "stride_xt": "i32",
                          "stride_xh": "i32", "stride_cb": "i32", "stride_ct": "i32", "T": "i32", "H": "i32",
                          "HALF": "i32", "sign": "fp32"},
            "constexprs": {"INTERLEAVED": 0, "BLOCK_H": 32, "BLOCK_D": 64},
        },
        {
            "name": "ce_stats",
            "kernel": _ce_stats_kernel,
            "signature": {"Z": bf, "TARGET": "*i64", "M": f32, "S": f32, "ZT": f32, "stride_z": "i32",
                          "V": "i32", "vocab_start": "i32"},
            "constexprs": {"BLOCK_V": 4096},
        },
        {
            "name": "ce_grad",
            "kernel": _ce_grad_kernel,
            "signature": {"Z": bf, "TARGET": "*i64", "LSE": f32, "SCALE": f32, "stride_z": "i32", "V": "i32",
                          "vocab_start": "i32"},
            "constexprs": {"BLOCK_V": 4096},
        },
    ]
