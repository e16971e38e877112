"""FDO statistics merged over batches, workers and hosts, and the config tuned from them."""

from __future__ import annotations

import json
import os
from typing import Iterable

from . import _native
from ._config import _config_json


class FdoStats:
  """FDO statistics merged over batches, workers and hosts.

  Element-wise maxima of the per-partition and per-SparseCore arrays, sums of
  dropped ids and of batches; the JSON format is the CLI's ``stats.json``, so
  ``sparsecore-prep fdo merge`` / ``fdo tune`` read it too.
  """

  def __init__(self, native: "_native.NativeFdoStats"):
    self._native = native

  @classmethod
  def from_json(cls, text: str) -> "FdoStats":
    """Parses stats JSON (ours or the CLI's)."""
    return cls(_native.NativeFdoStats.from_json(text))

  @classmethod
  def read(cls, path) -> "FdoStats":
    """Reads a stats JSON file."""
    with open(path) as fh:
      return cls.from_json(fh.read())

  @classmethod
  def merge_all(cls, stats: Iterable["FdoStats"]) -> "FdoStats":
    """Merges any number of stats (at least one) into new stats."""
    it = iter(stats)
    try:
      first = next(it)
    except StopIteration:
      raise ValueError("no FDO stats to merge") from None
    out = cls.from_json(first.to_json())
    for s in it:
      out.merge(s)
    return out

  def merge(self, other: "FdoStats") -> "FdoStats":
    """Merges ``other`` into these stats (in place) and returns them. Safe from many threads
    at once (each merge runs whole, under the GIL); merging stats into themselves counts their
    batches twice, as merging a copy would."""
    if other is self:
      other = FdoStats.from_json(self.to_json())
    self._native.merge(other._native)
    return self

  @property
  def batches(self) -> int:
    """Batches merged in."""
    return self._native.batches

  def to_json(self) -> str:
    """The stats as JSON."""
    return self._native.to_json()

  def to_dict(self) -> dict:
    """The stats as a dict (the JSON, parsed)."""
    return json.loads(self.to_json())

  def write(self, path) -> None:
    """Writes the JSON to ``path`` atomically (temporary name, then rename)."""
    tmp = f"{os.fspath(path)}.tmp-{os.getpid()}"
    with open(tmp, "w") as fh:
      fh.write(self.to_json())
    os.replace(tmp, path)

  def tune(self, config, headroom: float = 1.0) -> dict:
    """A copy of ``config`` with limits and buffer sizes from these stats.

    The rule of ``sparsecore-prep fdo tune``: observed maxima times
    ``headroom``, rounded up to 8 (buffers to 8 * S).
    """
    return json.loads(self._native.tune(_config_json(config), float(headroom)))

  def __eq__(self, other) -> bool:
    return isinstance(other, FdoStats) and self._native == other._native

  def __reduce__(self):
    return (FdoStats.from_json, (self.to_json(),))

  def __repr__(self) -> str:
    d = self.to_dict()
    return f"FdoStats({d['batches']} batches, stacks {sorted(d['stacks'])})"


# Pickle and repr name the class where users import it from, sparsecore_prep, the path that
# existing pickles hold (tests/test_pickle_compat.py).
FdoStats.__module__ = "sparsecore_prep"
