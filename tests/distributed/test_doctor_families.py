"""The doctor's FSDP-unit check on the model matrix's stock families, as meshkit wraps them (4 gloo ranks).

Each family of ``tests/distributed/hf_models.py`` (``FAMILIES``) is parallelized the way the strategy does it
(``meshkit.parallelize`` on the LightningModule) under the matrix's ``fsdp2`` and ``hsdp_tp`` layouts, and the
Doctor's own reading of the wrapped model (``fsdp_units`` -> ``one_fsdp_unit``) must find nothing above "info":
once at the matrix's widths, once with a 1024-token vocabulary that outweighs the blocks (there the root unit
holds the embeddings and LM head, and before issue 26 that was a false "warning" telling the user to put blocks
that were already wrapped in an nn.ModuleList). No training: the check reads the wrapped module only.
"""

from __future__ import annotations

import pytest

from tests.dist_pool import ProcessPool
from tests.distributed import hf_models as H
from tests.distributed.test_model_matrix import PRESETS, REFUSED_UNDER_TP

BIG_VOCAB = {"vocab_size": 1024}


@pytest.fixture(scope="module")
def pool():
    with ProcessPool(world_size=4) as p:
        yield p


def _tp_plan(family: str) -> dict | None:
    """The plan the automatic path's refusal names, for the families it refuses under tp (tested in the matrix)."""
    from meshkit.plugins.tensor_parallel import infer_tp_plan

    if family not in REFUSED_UNDER_TP:
        return None
    try:
        infer_tp_plan(H.build(family))
    except ValueError as refusal:
        return H.suggested_plan(str(refusal))
    raise AssertionError(f"{family}: the automatic TP plan no longer refuses it; drop it from REFUSED_UNDER_TP")


def _findings(rank: int, world: int, families: tuple, overrides: dict | None) -> dict:
    """{(family, preset): (severity, fix) or None} for the Doctor's one_fsdp_unit on each wrapped family."""
    import meshkit
    from meshkit.doctor.callback import fsdp_units
    from meshkit.doctor.checks import one_fsdp_unit

    out = {}
    for preset, degrees in sorted(PRESETS.items()):
        dims = meshkit.ParallelDims(**degrees, world_size=world)
        dims.build_mesh("cpu")
        for family in families:
            plan = _tp_plan(family) if dims.tp_enabled else None
            module = meshkit.parallelize(H.build(family, overrides=overrides), dims, meshkit.ParallelConfig(tp_plan=plan))
            units = fsdp_units(module)
            assert sum(u.parameters for u in units) == sum(p.numel() for p in module.parameters()), family
            f = one_fsdp_unit(units, dims.fsdp_enabled)
            out[family, preset] = None if f is None else (f.severity, f.fix)
    return out


@pytest.mark.parametrize("overrides", [None, BIG_VOCAB], ids=["matrix_widths", "vocab_1024"])
def test_doctor_quiet_on_stock_families(pool, overrides):
    results = pool.run(_findings, H.FAMILIES, overrides)
    assert all(r == results[0] for r in results[1:])  # every rank reads the same units
    loud = {cell: f for cell, f in results[0].items() if f is not None and f[0] != "info"}
    assert not loud, loud
    if overrides:  # the vocabulary outweighs the blocks: said, at "info", naming the root unit
        infos = {cell: f for cell, f in results[0].items() if f is not None}
        assert infos and all("`model` holds the embeddings" in fix for _, fix in infos.values()), infos
