"""The conformance sweep's fixed CI subset (benchmarks/family_sweep.py): every verdict kind on 4 gloo ranks.

Llama must be exact under every preset; GPT-2 (Conv1D projections, no HF layer stack) is refused under tp with a
plan the sweep applies and checks ("refused, fix exact"), and refused under pp with the stage hook it cannot apply.
No cell may be a MISMATCH (silent) or a raw error. CamemBERT under cp (RoBERTa-style positions derived from the token
ids over the whole sequence: silently wrong before cp computed them before cutting) must be exact. About a minute
on 2 cores.
"""

from __future__ import annotations

import pytest

from tests.dist_pool import ProcessPool
from tests.distributed import hf_models as H

pytest.importorskip("transformers")


def test_ci_subset_of_the_family_sweep(tmp_path):
    sweep = H.family_sweep()
    with ProcessPool(world_size=4) as pool:
        table = sweep.sweep(["llama", "gpt2"], list(sweep.PRESETS), steps=2, pool=pool)
        camembert_cp = sweep.run_cell(pool, "auto:camembert", "cp", steps=2)
    assert camembert_cp.startswith("exact"), camembert_cp
    counts = sweep.summary(table)
    assert counts["MISMATCH"] == counts["refused, fix MISMATCH"] == counts["raw error"] == 0, table
    assert all(cell.startswith("exact") for cell in table["llama"].values()), table["llama"]
    assert table["gpt2"]["hsdp_tp"].startswith("refused, fix exact"), table["gpt2"]
    assert table["gpt2"]["tp_pp"].startswith("refused: pipeline: cannot split"), table["gpt2"]
    docs = tmp_path / "models.md"
    docs.write_text("# models\n")
    meta = dict(transformers="x", torch="y", steps=2, registered=2, seconds=1.0)
    sweep.write_docs(table, meta, docs)
    sweep.write_docs(table, meta, docs)  # idempotent: the block is replaced, not appended
    text = docs.read_text()
    assert text.count(sweep.BEGIN) == 1 and "| llama | exact" in text
