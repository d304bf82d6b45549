"""Family knowledge about transformers models that several mechanisms share.

- :mod:`meshkit.families.twin`: a tiny twin of a model (same class, its config shrunk to a few layers of tiny
  width, float64), on which a mechanism proves, in one process and before any collective, that its
  rearrangement of the family's forward equals the family's own forward (the pipeline stage split and cp do).
- :mod:`meshkit.families.positions`: the position ids a family gives a whole sequence of token ids (RoBERTa's
  padding offset, ...), which cp computes before it cuts the sequence.

Imports only the ground floor (transformers lazily).
"""

from __future__ import annotations

from meshkit.families.positions import PositionIds, position_ids_of, register_position_ids
from meshkit.families.twin import tiny_config, tiny_twin

__all__ = ["PositionIds", "position_ids_of", "register_position_ids", "tiny_config", "tiny_twin"]
