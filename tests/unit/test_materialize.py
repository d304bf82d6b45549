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
def _family_pair(family: str) -> tuple[nn.Module, nn.Module]:
    """(built for real, built on meta then materialized), both in float64 from the same RNG state."""
    from tests.distributed import hf_models as H

    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # built in float64: no float32 rounding of a buffer before a cast
    try:
        torch.manual_seed(0)
        real = H.CausalLM(family)
        with torch.device("meta"):  # what `trainer.init_module(empty_init=True)` builds under
            empty = H.CausalLM(family)
        torch.manual_seed(0)
        materialize(empty, torch.device("cpu"))
    finally:
        torch.set_default_dtype(default)
    return real, empty


DRAWN_IN_INIT = {"gpt2": "transformers' Conv1D draws its weight in `__init__` (no `reset_parameters()` replays it)"}
"""Families whose build draws random numbers outside any init meshkit can replay: the RNG streams part there, so
their random tensors are compared by distribution (every other family: bit for bit)."""


def _families() -> tuple[str, ...]:
    from tests.distributed.hf_models import FAMILIES

    return FAMILIES


@pytest.mark.parametrize("family", _families())
def test_an_empty_init_model_of_every_family_is_the_one_its_own_init_builds(family):
    real, empty = _family_pair(family)
    want = dict(real.named_buffers(remove_duplicate=False))
    got = dict(empty.named_buffers(remove_duplicate=False))
    assert want.keys() == got.keys()
    assert [n for n in want if not torch.equal(want[n], got[n])] == []  # rotary tables, embed scales: bit for bit
    ties = [n for n, _ in real.named_parameters(remove_duplicate=False) if n not in dict(real.named_parameters())]
    assert ties == [n for n, _ in empty.named_parameters(remove_duplicate=False)
                    if n not in dict(empty.named_parameters())]  # a tied head stays tied (to_empty unties it)
    want, got = dict(real.named_parameters()), dict(empty.named_parameters())
    assert want.keys() == got.keys()
    if family not in DRAWN_IN_INIT:
        assert [n for n in want if not torch.equal(want[n], got[n])] == []
        return
    for name, w in want.items():
        g = got[name].detach()
        if float(w.std()) == 0.0:  # constants (norms, biases): exactly
            assert torch.equal(w, g), name
            continue
        n = w.numel()  # a sample std's relative error is ~1/sqrt(2n); a mean's is std/sqrt(n): 6 sigma
        assert abs(float(g.std()) / float(w.std()) - 1) < 6 / (2 * n) ** 0.5, (name, float(g.std()), float(w.std()))
        assert abs(float(g.mean()) - float(w.mean())) < 6 * float(w.std()) * (2 / n) ** 0.5, name
