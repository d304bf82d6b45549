"""Context-parallel attention's CUDA kernels (flash for bf16/fp16, efficient for fp32): the block identities."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_cp_blocks import check_blocks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("hkv", [4, 2])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-4), (torch.bfloat16, 3e-2)])
def test_blocks_merge_to_full_attention_cuda(dtype, atol, causal, hkv):
    check_blocks("cuda", dtype, causal, hkv, atol)
