"""The package's exceptions.

They are defined here, in Python, and exported by ``sparsecore_prep`` (the
Rust extension looks them up there to raise them), so that they pickle: a
``ProcessPoolExecutor``, Ray or Spark worker that raises one hands the parent
the same class with the same message and fields.

Each derives from :class:`SparseCorePrepError` and from the standard exception
code written against the reference already catches (``ValueError`` or
``TypeError``). Fields the error does not know are ``None``.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ConfigError",
    "FeatureSpecError",
    "InputTypeError",
    "InvalidInputError",
    "LimitExceededError",
    "SparseCorePrepError",
]


class SparseCorePrepError(Exception):
  """Base class of the package's exceptions: a message, and named fields.

  ``str(e)`` is the message; the fields (listed in ``fields``) are attributes.
  Pickling keeps both.
  """

  fields: tuple[str, ...] = ()

  def __init__(self, message: str = "", **fields: Any):
    super().__init__(message)
    unknown = sorted(set(fields) - set(self.fields))
    if unknown:
      raise TypeError(f"{type(self).__name__} has no field {', '.join(unknown)} (fields: {', '.join(self.fields)})")
    for name in self.fields:
      setattr(self, name, fields.get(name))

  @property
  def message(self) -> str:
    """The message (``str(e)``)."""
    return str(self.args[0]) if self.args else ""

  def field_values(self) -> dict[str, Any]:
    """The fields as a dict."""
    return {name: getattr(self, name, None) for name in self.fields}

  def __reduce__(self):
    return (_rebuild, (type(self), self.message, self.field_values()))


def _rebuild(cls, message, fields):
  return cls(message, **fields)


class ConfigError(SparseCorePrepError, ValueError):
  """A config, an option or a stats file the pipeline cannot use.

  An unknown field (a typo such as ``max_ids_per_partitions``), a bad value
  (a combiner, a limit, a device layout that is not a power of two), a
  suggested buffer size above the theoretical maximum, unparsable JSON.

  Fields: ``field`` (the field or option, when one is to blame), ``location``
  (where it is: "table `t03`", "`config`", "stack `s0`"), ``suggestion``
  (for an unknown field, the closest known one, or None).
  """

  fields = ("field", "location", "suggestion")


class InvalidInputError(SparseCorePrepError, ValueError):
  """An input batch the pipeline cannot use (the reference aborts or misreads).

  An id outside ``[0, vocabulary_size)`` or outside the range of ids, a
  non-finite weight, weights of another shape, unsorted COO indices, a batch
  that does not split over the SparseCores, a missing Arrow column.

  Fields: ``feature``, ``row`` (the sample row in the feature's local batch)
  and ``id`` (exactly as given), when known.
  """

  fields = ("feature", "row", "id")


class LimitExceededError(SparseCorePrepError, ValueError):
  """A partition received more ids than its limit and ``allow_id_dropping`` is off.

  The reference aborts the process here. Fields: ``stack``, ``limit_name``
  ("max_ids_per_partition" or "max_unique_ids_per_partition"), ``observed``,
  ``limit``, ``device``, ``sparsecore`` (local) and ``partition`` (global
  SparseCore), of the largest count observed.
  """

  fields = ("stack", "limit_name", "observed", "limit", "device", "sparsecore", "partition")


class InputTypeError(SparseCorePrepError, TypeError):
  """An input of an unusable type or dtype: float ids, a 1-D array that is not
  ``dtype=object``, an Arrow column of the wrong type.

  Fields: ``feature``, and ``column`` for Arrow input.
  """

  fields = ("feature", "column")


class FeatureSpecError(SparseCorePrepError, TypeError):
  """A feature spec lacks an attribute the drop-in call reads, or holds a
  value of the wrong type (see python/README.md for the attributes read).

  Fields: ``feature`` (its name, or its position in the pytree when it has no
  name) and ``attribute`` (the dotted path, e.g. "table_spec.embedding_dim").
  """

  fields = ("feature", "attribute")


# Pickle finds the classes where users see them.
for _cls in (SparseCorePrepError, ConfigError, InvalidInputError, LimitExceededError, InputTypeError, FeatureSpecError):
  _cls.__module__ = "sparsecore_prep"
del _cls
