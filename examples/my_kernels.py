"""A user's own Triton kernel, in its own file: what ``examples/occupancy_my_kernel.py`` profiles.

Nothing here knows about meshkit. Kernels are defined at module level (meshkit's occupancy compiler
may import this file by name in a worker process).
"""

import triton
import triton.language as tl


@triton.jit
def row_softmax(X, Y, N, stride, BLOCK: tl.constexpr):
    """Y[row] = softmax(X[row, :N]) in fp32: one program per row, the whole row in one BLOCK (>= N)."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * stride + cols, mask=mask, other=float("-inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))
    tl.store(Y + row * stride + cols, e / tl.sum(e, axis=0), mask=mask)
