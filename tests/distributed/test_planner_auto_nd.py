"""strategy="auto_nd" glue on 4 gloo processes: the planner's layout, chosen on every rank independently,
trains the demo model and matches one process.

``strategy="auto_nd"`` makes the strategy's ``_resolve`` ask :func:`meshkit.plugins.dims.auto_nd_dims`
instead of the preset rules.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.dist_pool import ProcessPool
from tests.distributed import training as T

STEPS = 2


@pytest.fixture(scope="module")
def pool():
    with ProcessPool(world_size=4) as p:
        yield p


def _fit_auto(rank: int, world: int, devices: int, num_nodes: int) -> dict[str, Any]:
    import logging

    logged: list[str] = []

    class _Grab(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            logged.append(record.getMessage())

    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    handler = _Grab()
    logger.addHandler(handler)
    try:
        out = T.fit(rank, world, "auto_nd", devices=devices, num_nodes=num_nodes, steps=STEPS)
    finally:
        logger.removeHandler(handler)
    out["logged"] = [m for m in logged if "best: " in m]
    return out


def test_auto_nd_layout_trains_like_one_process(pool):
    from meshkit.plugins.dims import auto_nd_dims

    results = pool.run(_fit_auto, 2, 2)  # 2 simulated nodes of 2 ranks
    degrees = results[0]["degrees"]
    # every rank planned on its own and got the same layout: the planner's answer for this world and model
    assert all(r["degrees"] == degrees for r in results)
    want = auto_nd_dims(T.build_module("meshkit"), world_size=4, num_nodes=2, device="cpu")
    assert degrees == want.degrees
    # rank 0 logs the planner's table and its choice
    assert results[0]["logged"], "the planner's choice was not logged"
    losses = T.global_losses(results)
    want_losses, want_params = T.reference("meshkit", STEPS, results[0]["dp_size"])
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-4, atol=0)
    T.assert_params_close(results[0]["params"], want_params)
