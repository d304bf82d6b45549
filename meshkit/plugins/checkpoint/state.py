"""What a checkpoint holds under which name: the model entry, FQN-keyed optimizer states, tied weights once.

Both formats (a DCP folder, a single file) store the model's state dict under :data:`MODEL` with one
entry per tied parameter (its first name; the others recorded under :data:`TIED_WEIGHTS`, as
transformers saves them), and every optimizer's state. In a folder an optimizer's state is flattened and
keyed by parameter FQN (:func:`flat_optimizer_state`, under :func:`optimizer_key`), so ranks holding
different pipeline stages save disjoint keys and a checkpoint saved at one pp size loads at another
(torchtitan does the same); a single file holds torch's own optimizer state dicts under :data:`OPTIMIZERS`.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = [
    "MODEL", "OPTIMIZERS", "TIED_WEIGHTS", "FABRIC_STATE", "optimizer_key", "flat_optimizer_state", "tied_aliases",
    "without_aliases", "with_tied_aliases", "tied_load_plan",
]

MODEL = "state_dict"
"""The model's entry (Lightning's name for it): a folder's ``state_dict.<fqn>`` tensors, a file's dict."""
OPTIMIZERS = "optimizer_states"
"""A single file's list of optimizer state dicts (Lightning's name; absent in a weights-only checkpoint)."""
TIED_WEIGHTS = "meshkit_tied_weights"
"""The metadata entry ``{alias FQN: saved FQN}`` of the tied parameters a checkpoint stores once."""
FABRIC_STATE = "meshkit_fabric_state"
"""The metadata entry ``{"module": key, "optimizers": [key, ...]}`` of a ``fabric.save``: which entries of the
Fabric state were the model and the optimizers (``optimizer_0``, ... in this order); ``fabric.load`` checks them."""


def optimizer_key(index: int) -> str:
    """A folder's entry for the ``index``-th optimizer's FQN-keyed state: ``optimizer_0``, ``optimizer_1``, ..."""
    return f"optimizer_{index}"


def flat_optimizer_state(model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """DCP optimizer state with ``flatten_optimizer_state_dict=True``: every entry, param-group settings
    included, keyed by the parameter's FQN, so ranks holding different stages save disjoint keys and
    a checkpoint saved at one pp size loads at another (torchtitan does the same)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    opts = StateDictOptions(cpu_offload=True, flatten_optimizer_state_dict=True)
    return get_optimizer_state_dict(model, getattr(optimizer, "_optimizer", optimizer), options=opts)


# ---- tied weights: one FQN in the checkpoint, as in transformers' saved state dicts -------------------------


def tied_aliases(module: nn.Module) -> dict[str, str]:
    """``{alias: canonical}`` FQNs of parameters used under several names (the first name is canonical).

    Example::

        >>> m = nn.ModuleDict({"emb": nn.Embedding(4, 2), "head": nn.Linear(2, 4, bias=False)})
        >>> m["head"].weight = m["emb"].weight
        >>> tied_aliases(m)
        {'head.weight': 'emb.weight'}
    """
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        aliases.update({name: first[id(param)]} if id(param) in first else {})
        first.setdefault(id(param), name)
    return aliases


def without_aliases(state: dict[str, Any], aliases: dict[str, str]) -> dict[str, Any]:
    """``state`` less the entries named in ``aliases`` (``{alias: canonical}``, :func:`tied_aliases`)."""
    return {k: v for k, v in state.items() if k not in aliases}


def with_tied_aliases(
    state: dict[str, Any], module: nn.Module, saved_aliases: dict[str, str]
) -> dict[str, Any]:
    """A full state dict saved with one entry per tied parameter (:func:`without_aliases`), with every name
    ``module`` has.

    The file's one entry of a tied parameter is filled in under its other names: the model's own
    aliases (tied: the same parameter, loaded twice) and the checkpoint's (untied: the head gets the
    embedding, as :func:`tied_load_plan` does for a folder).
    """
    sources = {**tied_aliases(module), **saved_aliases}
    return {**state, **{k: state[v] for k, v in sources.items() if k not in state and v in state}}


def tied_load_plan(
    full: dict[str, Any], module: nn.Module, saved_aliases: dict[str, str]
) -> tuple[dict[str, Any], dict[str, str]]:
    """``(entries to load by their own name, {model key: checkpoint key} to load from another entry)``.

    A tied model loads its canonical entry only (the alias is the same parameter); an untied model
    loads a tied checkpoint's alias (e.g. ``lm_head.weight``) from the entry it was saved as, as
    transformers does when it unties a checkpoint.
    """
    aliases = tied_aliases(module)
    load = {k: v for k, v in full.items() if k not in aliases and k not in saved_aliases}
    fill = {k: saved_aliases[k] for k in full if k in saved_aliases and k not in aliases}
    return load, fill
