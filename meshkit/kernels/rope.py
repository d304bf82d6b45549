"""Rotary position embedding from explicit positions: Triton kernel, torch reference, custom op, autograd,
and the rotary tables (:func:`rope_cos_sin`) and eager rotation (:func:`apply_rope`) models use.

For each pair ``(x1, x2)`` and angle ``a = position * theta ** (-2i / head_dim)``:
``(x1 cos a - x2 sin a, x2 cos a + x1 sin a)``. Pairs are ``(x[i], x[i + D/2])`` (HF rotate-half, default)
or ``(x[2i], x[2i + 1])`` (Meta's interleaved layout). The backward is the rotation by ``-a``.
Positions are given, not assumed ``0..T-1``, so context-parallel shards and packed sequences are right.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from ._backend import HAS_TRITON, block_size, check_float, check_same, is_dtensor, tl, triton, use_triton

__all__ = ["rope", "rope_cos_sin", "apply_rope", "half_cos_sin", "rotate_with_cos_sin"]

if HAS_TRITON:

    @triton.jit
    def _rope_kernel(
        X, COS, SIN, Y,
        stride_xb, stride_xt, stride_xh, stride_cb, stride_ct,
        T, H, HALF, sign,
        INTERLEAVED: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        # One program per (batch, token): all heads of x (B, T, H, 2*HALF) -> y contiguous (B, T, H, 2*HALF).
        pid = tl.cast(tl.program_id(0), tl.int64)
        b = pid // T
        t = pid % T
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        dmask = d < HALF
        mask = (h < H) & dmask
        c = tl.load(COS + b * stride_cb + t * stride_ct + d, mask=dmask, other=0.0)
        s = tl.load(SIN + b * stride_cb + t * stride_ct + d, mask=dmask, other=0.0) * tl.cast(sign, tl.float32)
        if INTERLEAVED:
            i1 = 2 * d
            i2 = 2 * d + 1
        else:
            i1 = d
            i2 = d + HALF
        src = X + b * stride_xb + t * stride_xt + h * stride_xh
        x1 = tl.cast(tl.load(src + i1, mask=mask, other=0.0), tl.float32)
        x2 = tl.cast(tl.load(src + i2, mask=mask, other=0.0), tl.float32)
        dst = Y + (pid * H + h) * (2 * HALF)
        tl.store(dst + i1, tl.cast(x1 * c - x2 * s, Y.dtype.element_ty), mask=mask)
        tl.store(dst + i2, tl.cast(x2 * c + x1 * s, Y.dtype.element_ty), mask=mask)


def _rotate_reference(x, cos, sin, interleaved, sign):
    c, s = cos[:, :, None, :], sin[:, :, None, :] * sign  # (Bc, T, 1, HALF)
    xf = x.float()
    x1, x2 = (xf[..., 0::2], xf[..., 1::2]) if interleaved else xf.chunk(2, dim=-1)
    y1, y2 = x1 * c - x2 * s, x2 * c + x1 * s
    y = torch.stack([y1, y2], dim=-1).flatten(-2) if interleaved else torch.cat([y1, y2], dim=-1)
    return y.to(x.dtype).contiguous()


def _launch(heads: int, head_dim: int) -> dict[str, int]:
    """Blocks and warps of the rotation kernel for ``heads`` of ``head_dim`` (also what the occupancy report measures)."""
    return {"BLOCK_H": block_size(heads), "BLOCK_D": block_size(head_dim // 2), "num_warps": 4}


@torch.library.custom_op("meshkit::rope_rotate", mutates_args=())
def _rope_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, inverse: bool) -> torch.Tensor:
    """Rotate x (B, T, H, D) by angles with cos/sin (1 or B, T, D/2) fp32; ``inverse`` rotates by -angle."""
    sign = -1.0 if inverse else 1.0
    if not use_triton(x):
        return _rotate_reference(x, cos, sin, interleaved, sign)
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    B, T, H, D = x.shape
    y = torch.empty((B, T, H, D), dtype=x.dtype, device=x.device)
    if x.numel():
        stride_cb = cos.stride(0) if cos.shape[0] > 1 else 0
        _rope_kernel[(B * T,)](
            x, cos, sin, y, x.stride(0), x.stride(1), x.stride(2), stride_cb, cos.stride(1),
            T, H, D // 2, sign, INTERLEAVED=interleaved, **_launch(H, D),
        )  # fmt: skip
    return y


@_rope_rotate.register_fake
def _(x, cos, sin, interleaved, inverse):
    return x.new_empty(x.shape)


def _setup_context(ctx, inputs, output):
    _, cos, sin, ctx.interleaved, ctx.inverse = inputs
    ctx.save_for_backward(cos, sin)


def _backward(ctx, dy):
    cos, sin = ctx.saved_tensors
    return _rope_rotate(dy, cos, sin, ctx.interleaved, not ctx.inverse), None, None, None, None


_rope_rotate.register_autograd(_backward, setup_context=_setup_context)


def _angles(positions: torch.Tensor, head_dim: int, theta: float) -> torch.Tensor:
    """Rotary angles ``position * theta ** (-2i / head_dim)`` (..., T, head_dim/2) fp32: the one formula."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    return positions.to(torch.float32)[..., None] * inv_freq


def _half_table(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (Bc, T, head_dim/2) fp32 for positions (T,) or (B, T): the kernel's input."""
    angles = _angles(positions, head_dim, theta)
    if angles.dim() == 2:
        angles = angles[None]
    return angles.cos(), angles.sin()


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles for explicit ``positions`` (T,) or (B, T) -> (..., T, head_dim) fp32.

    Rotate-half layout, as HF: both halves of the last dim hold the same angles. Feed them to
    :func:`apply_rope` (torch) or, halved by :func:`half_cos_sin`, to :func:`rotate_with_cos_sin` (kernel).

    Example::

        >>> import torch
        >>> from meshkit.kernels import rope_cos_sin
        >>> cos, sin = rope_cos_sin(torch.arange(5), head_dim=8, theta=10000.0)
        >>> cos.shape, bool(cos[0].eq(1).all())
        (torch.Size([5, 8]), True)
    """
    angles = _angles(positions, head_dim, theta)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Eager torch rope: rotate ``x`` (B, T, H, D) by :func:`rope_cos_sin` tables (T, D) or (B, T, D).

    HF rotate-half convention, fp32 inside, written independently of the kernel's reference so tests
    can check one against the other. The demo model's unpatched attention runs this.

    Example::

        >>> import torch
        >>> from meshkit.kernels import apply_rope, rope_cos_sin
        >>> x = torch.randn(1, 3, 2, 8)
        >>> cos, sin = rope_cos_sin(torch.zeros(3, dtype=torch.long), 8, 10000.0)
        >>> torch.equal(apply_rope(x, cos, sin), x)  # position 0: no rotation
        True
    """
    if cos.dim() == 2:
        cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    else:
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated.float() * sin).type_as(x)


def half_cos_sin(cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half cos/sin (T, D) or (B, T, D) -> (Bc, T, D/2) for :func:`rotate_with_cos_sin`.

    Both halves of a rotate-half table hold the same angles, so the first half is kept.
    """
    cos, sin = cos[..., : head_dim // 2], sin[..., : head_dim // 2]
    return (cos[None], sin[None]) if cos.dim() == 2 else (cos, sin)


def rotate_with_cos_sin(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Fused rope of ``x`` (B, T, H, D) given half-width cos/sin (Bc, T, D/2) (see :func:`half_cos_sin`).

    A DTensor ``x`` (e.g. heads-sharded projections with ``use_local_output=False``) is rotated locally
    and keeps its placements. Model patching (:mod:`meshkit.integrations`) calls this.
    """
    if is_dtensor(x):
        y = _rope_rotate(x.to_local(), cos.float(), sin.float(), interleaved, False)
        return DTensor.from_local(y, x.device_mesh, x.placements, run_check=False, shape=x.shape, stride=x.stride())
    return _rope_rotate(x, cos.float(), sin.float(), interleaved, False)


def _check(q, k, positions) -> None:
    fn = "rope"
    check_float("q", q, fn)
    check_float("k", k, fn)
    check_same(fn, ("q", "k"), (q, k), "dtype")
    if q.dim() != 4 or k.dim() != 4 or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3] or q.shape[3] % 2:
        raise ValueError(
            f"rope: `q.shape={tuple(q.shape)}` and `k.shape={tuple(k.shape)}` must be (batch, seq, heads, head_dim) "
            "with equal batch, seq and an even head_dim (heads may differ: grouped-query attention)."
        )
    B, T = q.shape[:2]
    if not isinstance(positions, torch.Tensor) or tuple(positions.shape) not in ((T,), (B, T)):
        shape = tuple(positions.shape) if isinstance(positions, torch.Tensor) else type(positions).__name__
        raise ValueError(f"rope: `positions.shape={shape}` must be ({T},) or ({B}, {T}) for q of shape {tuple(q.shape)}.")
    if positions.is_floating_point() or positions.is_complex():
        raise ValueError(f"rope: `positions.dtype={positions.dtype}` must be an integer dtype (token positions).")


def rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, *, theta: float = 10000.0, interleaved: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of ``q`` (B, T, Hq, D) and ``k`` (B, T, Hk, D) at ``positions`` (T,) or (B, T).

    HF's rotate-half pairs by default, Meta's interleaved pairs with ``interleaved=True``; fp32 inside.
    DTensors keep their placements; when ``q``/``k`` are sharded on batch or sequence (context parallel),
    plain ``positions`` are taken as the global ones and sliced to the local shard.

    Example::

        >>> import torch
        >>> from meshkit.kernels import rope
        >>> q = k = torch.randn(1, 3, 2, 8)
        >>> q2, _ = rope(q, k, torch.zeros(3, dtype=torch.long))  # position 0: no rotation
        >>> torch.allclose(q2, q)
        True
    """
    _check(q, k, positions)
    if not (is_dtensor(q) or is_dtensor(k)):
        cos, sin = _half_table(positions, q.shape[-1], theta)
        return (_rope_rotate(q, cos, sin, interleaved, False), _rope_rotate(k, cos, sin, interleaved, False))
    if not (is_dtensor(q) and is_dtensor(k)) or q.device_mesh != k.device_mesh:
        raise ValueError("rope: `q` and `k` must both be DTensors on one mesh, or both plain tensors.")
    mesh = q.device_mesh
    pos_place = []
    for pq, pk in zip(q.placements, k.placements):
        if isinstance(pq, Partial) or isinstance(pk, Partial) or any(
            isinstance(p, Shard) and p.dim % 4 == 3 for p in (pq, pk)
        ):
            raise ValueError(f"rope: placements {q.placements}/{k.placements} must not be Partial or shard head_dim.")
        seq_like = [p.dim % 4 for p in (pq, pk) if isinstance(p, Shard) and p.dim % 4 in (0, 1)]
        if seq_like and (pq != pk):
            raise ValueError(f"rope: `q.placements={q.placements}` and `k.placements={k.placements}` must shard batch/seq alike.")
        d = seq_like[0] if seq_like else None
        if d is None or (d == 0 and positions.dim() == 1):
            pos_place.append(Replicate())
        else:
            pos_place.append(Shard(d - (2 - positions.dim())))
    if is_dtensor(positions):
        positions = positions.redistribute(mesh, pos_place).to_local()
    else:
        positions = DTensor.from_local(positions, mesh, [Replicate()] * mesh.ndim, run_check=False)
        positions = positions.redistribute(mesh, pos_place).to_local()
    cos, sin = _half_table(positions, q.shape[-1], theta)
    out = []
    for t in (q, k):
        y = _rope_rotate(t.to_local(), cos, sin, interleaved, False)
        out.append(DTensor.from_local(y, mesh, t.placements, run_check=False, shape=t.shape,
                                      stride=torch.empty(t.shape, device="meta").stride()))  # fmt: skip
    return out[0], out[1]
