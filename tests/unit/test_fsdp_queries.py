"""meshkit.plugins.fsdp's queries read, never change, the module (issue 28: ``unsynced_parameters`` resharded
every FSDP unit as a side effect; the strategy now reshards first, then asks). One-rank gloo mesh."""

from __future__ import annotations

import pytest
import torch
from torch import nn


@pytest.fixture()
def one_rank_mesh():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",))
    finally:
        dist.destroy_process_group()


def test_unsynced_parameters_is_a_pure_query(one_rank_mesh):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from meshkit.plugins.fsdp import reshard, unsynced_parameters

    torch.manual_seed(0)
    model = nn.ModuleDict({"block": nn.Linear(4, 4), "head": nn.Linear(4, 2)})
    fully_shard(model["block"], mesh=one_rank_mesh)  # "head" is left to no dp wrapper
    registered = lambda: [p for _, p in model.named_parameters()]  # noqa: E731
    assert unsynced_parameters(model, {0}) == ["head.weight", "head.bias"]
    model["block"].unshard()  # what an eval forward of a reshard_after_forward=False unit leaves
    unsharded = registered()
    assert not any(isinstance(p, DTensor) for p in unsharded[:2])
    assert unsynced_parameters(model, {0}) == ["head.weight", "head.bias"]
    after = registered()
    assert all(a is b for a, b in zip(after, unsharded)) and len(after) == len(unsharded)  # nothing resharded
    reshard(model)  # the caller's step (NDParallelStrategy._check_gradient_sync)
    assert all(isinstance(p, DTensor) for p in registered()[:2])
    assert unsynced_parameters(model, {0}) == ["head.weight", "head.bias"]
