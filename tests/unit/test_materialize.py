"""plugins/materialize.py in one process: what the model's own init computes is there, what nothing computes is
refused, and what was never on the meta device survives ``to_empty``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from meshkit.plugins.materialize import has_meta_tensors, materialize


class Rotary(nn.Module):
    """A buffer computed in __init__ and recomputed by reset_parameters (what meshkit asks of a module)."""

    def __init__(self, dim: int = 8, recompute: bool = True) -> None:
        super().__init__()
        self.dim, self.recompute = dim, recompute
        self.register_buffer("inv_freq", self._table(), persistent=False)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def _table(self) -> torch.Tensor:
        return 1.0 / (10000 ** (torch.arange(0, self.dim, 2, dtype=torch.float32) / self.dim))

    def reset_parameters(self) -> None:
        if self.recompute:
            self.inv_freq.copy_(self._table())
            self.steps.zero_()


def test_reset_parameters_fill_what_the_init_computed():
    with torch.device("meta"):
        net = nn.Sequential(nn.Linear(4, 4), Rotary())
    materialize(net, torch.device("cpu"))
    assert not has_meta_tensors(net)
    assert torch.equal(net[1].inv_freq, Rotary().inv_freq) and int(net[1].steps) == 0
    assert bool(torch.isfinite(net[0].weight).all()) and float(net[0].weight.abs().max()) <= 0.5  # kaiming, 1/sqrt(4)


def test_what_nothing_initializes_is_refused_by_name():
    with torch.device("meta"):
        net = nn.Sequential(nn.Linear(4, 4), Rotary(recompute=False))
    with pytest.raises(ValueError, match=r"nothing initializes `1.inv_freq` \(Rotary\), `1.steps` \(Rotary\) once it "
                                         r"is materialized: neither a `reset_parameters\(\)` of \['Rotary'\]"):
        materialize(net, torch.device("cpu"))


def test_tensors_that_were_never_meta_keep_their_values():
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    before = net[0].weight.detach().clone()
    net[1].to_empty(device="meta")
    materialize(net, torch.device("cpu"))
    assert torch.equal(net[0].weight.detach(), before)  # to_empty alone would have discarded it
    assert bool(torch.isfinite(net[1].weight).all())


def test_a_model_without_meta_tensors_is_left_alone():
    net = nn.Linear(3, 3)
    before = net.weight.detach().clone()
    materialize(net, torch.device("cpu"))
    assert torch.equal(net.weight.detach(), before)


# ---- every family of the model matrix: the meta build, materialized, is the model its own build makes ----------
def _families() -> tuple[str, ...]:
    from tests.distributed.hf_models import FAMILIES

    return FAMILIES


@pytest.mark.parametrize("family", _families())
def test_an_empty_init_model_of_every_family_is_the_one_its_own_init_builds(family):
    from tests.distributed import hf_models as H

    real, empty = H.own_init(family), H.empty_init(family)  # float64, from the same RNG state
    ties = [n for n, _ in real.named_parameters(remove_duplicate=False) if n not in dict(real.named_parameters())]
    assert ties == [n for n, _ in empty.named_parameters(remove_duplicate=False)
                    if n not in dict(empty.named_parameters())]  # a tied head stays tied (to_empty unties it)
    assert H.init_mismatches(H.init_tensors(real), H.init_tensors(empty), family in H.DRAWN_IN_INIT) == []
