"""``hf_models.Float64Math``: the float64 comparisons run a family's own float32 steps in float64.

The matrix and the family sweep compare 4 ranks with one process in float64, so that rounding is far below what a
wrong layout moves (1e-14 against 1e-2). A family computing part of its math in float32 on purpose (Gemma's
``x.float()`` norms, eager attention's float32 softmax, rotary tables, MoE routers) rounds there to 1e-7, and a
1e-16 difference between equal computations in another order then flips that rounding: gemma3_text came out at
1e-6 under fsdp2 and 3e-5 under cp, "MISMATCH" for a layout that is right. The mode turns each float32 the code asks
for into float64; these tests show that no float32 tensor is left in a family's forward and backward under it, and
that outside it nothing changes.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.distributed import hf_models as H
from tests.distributed import training as T


class _Float32Seen(TorchDispatchMode):
    """Records the aten ops that produce a float32 tensor (below autograd: backward ops too)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.ops.add(str(func))
        return out


def test_each_kind_of_float32_request_becomes_float64_and_only_inside():
    x = torch.randn(3, 4, dtype=torch.float64)
    ids = torch.arange(4)
    mode = H.Float64Math()
    with mode:
        got = [x.float(), x.to(torch.float32), x.type(torch.float32), ids.float(), ids.to(dtype=torch.float32),
               torch.softmax(x, -1, dtype=torch.float32), torch.arange(3, dtype=torch.float), torch.zeros(2, dtype=torch.float32)]
    assert [t.dtype for t in got] == [torch.float64] * len(got)
    assert mode.casts == len(got)
    assert torch.equal(got[5], torch.softmax(x, -1))  # the same math, in float64
    assert x.float().dtype == torch.float32 and torch.softmax(x, -1, dtype=torch.float32).dtype == torch.float32
    assert ids.to(torch.bfloat16).dtype == torch.bfloat16  # only float32 is changed
    with H.float64_math(torch.float32):  # a float32 run keeps the family's casts
        assert x.float().dtype == torch.float32


@pytest.mark.parametrize("family", ["gemma3_text", "gemma2", "qwen3_moe", "llama"])
def test_a_family_forward_and_backward_makes_no_float32_tensor_under_it(family):
    # gemma3_text: norms in x.float(); gemma2: eager attention's float32 softmax and its norms; qwen3_moe: the
    # router's float32 softmax (experts in their own per-expert loop); llama: the rotary table's .float()
    module, tokens = H.build(H.AUTO + family), T.tokens(2)
    seen = _Float32Seen()
    with seen:
        module.loss(tokens).backward()
    assert seen.ops, f"{family} computes nothing in float32 without the mode: the case this test is for is gone"
    module.zero_grad()
    seen = _Float32Seen()
    with H.Float64Math() as mode, seen:
        loss = module.loss(tokens)
        loss.backward()
    assert seen.ops == set() and mode.casts > 0
    assert loss.dtype == torch.float64 and all(p.grad.dtype == torch.float64 for p in module.parameters()
                                                if p.grad is not None)


def test_the_tp_forward_check_runs_both_sides_under_the_same_thread_state():
    # check_tp_forward runs the tp ranks' copies of a block in threads; the whole block ran in the caller's thread,
    # so a caller's thread-local mode (this one, autocast) reached one side only: qwen3's per-head norms then
    # differed by float32 rounding (2.5e-8 of the output) and a right plan was refused. Both sides run in threads.
    from meshkit.plugins.tensor_parallel import check_tp_forward

    model = H.build("qwen3").model
    with H.Float64Math():
        assert check_tp_forward(model, 2) == ["model.layers.0.self_attn", "model.layers.0.mlp"]


def test_the_one_process_floor_tells_a_family_s_own_rounding_from_a_layout():
    # noise_floor: the same steps with each batch summed in two halves. Llama's float64 rounding stays at 6e-15;
    # BioGPT (post-LayerNorm) amplifies it ~5,000x (3e-11..5e-11) with no layout at all.
    llama, biogpt = H.noise_floor("llama", 3, dp=2), H.noise_floor(H.AUTO + "biogpt", 3, dp=2)
    assert llama < 1e-13 and 1e-12 < biogpt < 1e-8 and biogpt > 100 * llama
