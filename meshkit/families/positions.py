"""The position ids a family gives a whole sequence of token ids when it is handed none.

Context parallelism cuts each sequence over the cp ranks and hands every rank's model the global position ids of
its tokens: 0..T-1 by default. A family that derives its positions from the token ids (RoBERTa's learned positions
count from ``padding_idx + 1`` and skip padding tokens: a cumulative sum over the whole sequence) must get those
instead, computed on the whole sequence before it is cut. :func:`position_ids_of` finds the family's own rule;
meshkit's cp proof (``meshkit.plugins.context_parallel.integration.check_cp_forward``) then shows on the family's
tiny twin that the positions it feeds give the one-process logits, or refuses.

- generic: an embedding module with RoBERTa's ``create_position_ids_from_input_ids`` method and a ``padding_idx``
  (RoBERTa, XLM-RoBERTa, CamemBERT, Data2Vec-Text, X-MOD, ...: the method transformers copies between them);
- :func:`register_position_ids`: any other family (its class and a function of the (B, T) token ids).

Example::

    >>> import torch, transformers
    >>> config = transformers.RobertaConfig(vocab_size=16, hidden_size=8, num_hidden_layers=1,
    ...                                     num_attention_heads=2, intermediate_size=8, is_decoder=True)
    >>> rule = position_ids_of(transformers.RobertaForCausalLM(config))
    >>> rule(torch.tensor([[5, 6, 1, 7]])).tolist()  # padding_idx 1: counted from 2, the pad keeps 1
    [[2, 3, 1, 4]]
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import nn

__all__ = ["PositionIds", "position_ids_of", "register_position_ids"]

PositionIds = Callable[[torch.Tensor], torch.Tensor]
"""(B, T) token ids of whole sequences -> (B, T) the position ids the family gives them."""

_REGISTERED: dict[type, Callable[[nn.Module], PositionIds]] = {}


def register_position_ids(cls: type, rule: Callable[[nn.Module], PositionIds]) -> None:
    """Tell meshkit how ``cls`` (a model class) derives position ids from token ids: ``rule(model)`` returns a
    :data:`PositionIds` function. cp still proves it on the twin before training (see the module docstring).

    >>> register_position_ids(nn.Identity, lambda model: lambda ids: torch.arange(ids.shape[1]).expand_as(ids) + 3)
    >>> position_ids_of(nn.Identity())(torch.zeros(1, 3, dtype=torch.long)).tolist()
    [[3, 4, 5]]
    >>> del _REGISTERED[nn.Identity]
    """
    _REGISTERED[cls] = rule


def position_ids_of(model: nn.Module) -> PositionIds | None:
    """The family's rule for the position ids of whole sequences, or None where they are 0..T-1 (the default)."""
    for cls in type(model).__mro__:
        if cls in _REGISTERED:
            return _REGISTERED[cls](model)
    for module in model.modules():
        make = getattr(type(module), "create_position_ids_from_input_ids", None)
        padding_idx = getattr(module, "padding_idx", None)
        if callable(make) and isinstance(padding_idx, int):
            return functools.partial(make, padding_idx=padding_idx)  # picklable, unlike a lambda
    return None
