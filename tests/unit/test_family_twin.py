"""The generic tiny shrink (meshkit.families.tiny_config) on configs it used to break, one process.

Falcon computes ``head_dim`` (a property: no setter), CWM's strict config wants int token ids, Ministral's default
``head_dim`` is None and Nemotron's ``num_key_value_heads`` is None while their modules read them as numbers: the
sweep skipped all four ("tiny config does not build"). Each now builds and trains a float64 step, and the cp
forward proof decides it (tests/unit/test_cp_forward_proof.py tells what that proves): Falcon's attention does not
go through transformers' attention interface, so it is refused; the others pass.
"""

from __future__ import annotations

import pytest
import transformers

from meshkit.families import tiny_config
from meshkit.plugins.context_parallel.integration import check_cp_forward
from tests.distributed import hf_models as H
from tests.distributed import training as T


@pytest.mark.parametrize("family", ["falcon", "cwm", "ministral", "nemotron"])
def test_a_config_the_shrink_used_to_break_builds_trains_and_passes_the_cp_proof(family):
    config = tiny_config(transformers.AutoConfig.for_model(family))
    assert (config.num_hidden_layers, config.hidden_size) == (2, 32)
    module = H.build(H.AUTO + family)
    loss = module.loss(T.tokens(2))
    loss.backward()
    assert loss.isfinite() and all(p.grad is not None for p in module.parameters() if p.requires_grad)
    if family == "falcon":
        with pytest.raises(ValueError, match=r"FalconForCausalLM computes its attention without transformers' "
                                             r"attention interface.*cp=1"):
            check_cp_forward(module.model)
        return
    check_cp_forward(module.model)


def test_a_strict_config_keeps_token_ids_inside_the_tiny_vocabulary():
    config = tiny_config(transformers.AutoConfig.for_model("cwm"))
    ids = {k: v for k, v in vars(config).items() if k.endswith("_token_id") and v is not None}
    assert ids and all(0 <= v < 96 for v in (x for v in ids.values() for x in (v if isinstance(v, list) else [v])))
