"""Balanced entity sharding (BESS) for knowledge-graph embeddings on SparseCores.

The Python face of the ``sparsecore-bess`` crate: the same objects, bit-exact
with Graphcore's besskge (``shared/bess/SPEC.md``), with numpy arrays out and
numpy or Arrow in.

- :class:`NumpyRng`: numpy's ``default_rng(seed)`` (SeedSequence + PCG64) and
  the draws besskge makes; :func:`seed_words`.
- :class:`Sharding`: ``Sharding.create``, the four mapping arrays, ``.npz`` in
  and out (files exchange with besskge's ``Sharding.save`` / ``load``).
- :class:`PartitionedTriples`: triples sorted stably by shard pair (``ht``) or
  shard (``h_shard`` / ``t_shard``), optional inverse triples.
- :class:`BatchSampler` (``random``; ``rigid`` exact without shuffling) with a
  :class:`RandomNegativeSampler`, :class:`TypeBasedNegativeSampler` or
  :class:`TripleBasedNegativeSampler`; ``sampler.sample(step)`` returns
  besskge's dict of arrays.
- :class:`BessStream`: the SparseCore layout (shard ``s`` is global SparseCore
  ``s``): pyarrow record batches that the unchanged
  :class:`sparsecore_prep.Preprocessor` runs, and ``config_json``, the config
  whose limits are the exact per-cell counts::

      stream = bess.BessStream((head, relation, tail), n_entity=1000,
                               shard_batch_size=8, negatives=3, seed=1234,
                               steps=2)
      prep = sparsecore_prep.Preprocessor(stream.config_json)
      for batch in stream:            # pyarrow.RecordBatch
          result, stats = prep(batch)  # every cell holds exactly the limit

Every bad value raises a subclass of :class:`BessError` naming the column and
the value (never a crash). Errors of the pipeline itself inside a BESS call
(a device layout it refuses, ...) keep their classes and are BESS errors too
(:class:`PipelineConfigError` is both a :class:`sparsecore_prep.ConfigError`
and a :class:`BessError`); a file that cannot be read or written raises
:class:`BessIOError`, both an ``OSError`` and a :class:`BessError`. A negative
count, size, step or device count is refused by Python's int conversion
before any BESS code runs: ``OverflowError`` (not a :class:`BessError`).
"""

from __future__ import annotations

from ._errors import ConfigError, InputTypeError, InvalidInputError, LimitExceededError, SparseCorePrepError
from ._native import _bess  # type: ignore[attr-defined]

BatchSampler = _bess.BatchSampler
BessStream = _bess.BessStream
NumpyRng = _bess.NumpyRng
PartitionedTriples = _bess.PartitionedTriples
RandomNegativeSampler = _bess.RandomNegativeSampler
Sharding = _bess.Sharding
TripleBasedNegativeSampler = _bess.TripleBasedNegativeSampler
TypeBasedNegativeSampler = _bess.TypeBasedNegativeSampler
seed_words = _bess.seed_words

__all__ = [
    "BatchSampler",
    "BessError",
    "BessIOError",
    "BessStream",
    "ColumnTypeError",
    "EmptyPartitionError",
    "EntityOutOfRangeError",
    "InvalidParameterError",
    "LengthMismatchError",
    "MissingColumnError",
    "NullValueError",
    "NumpyRng",
    "PartitionedTriples",
    "PipelineConfigError",
    "PipelineInputTypeError",
    "PipelineInvalidInputError",
    "PipelineLimitExceededError",
    "RandomNegativeSampler",
    "RelationOutOfRangeError",
    "ShardCountMismatchError",
    "Sharding",
    "ShardingFileError",
    "TooLargeError",
    "TripleBasedNegativeSampler",
    "TypeBasedNegativeSampler",
    "ZeroTriplesPerBlockError",
    "seed_words",
]


class BessError(SparseCorePrepError, ValueError):
  """Base class of the BESS errors (the Rust crate's ``BessError``).

  Each variant of the Rust enum is a subclass below, with its facts as fields.
  Raised as this base class itself only for an Arrow failure building a batch.
  """


class EntityOutOfRangeError(BessError):
  """An entity id is negative or not below ``n_entity``.

  Fields: ``column`` (``head``, ``tail``, ``neg_heads``, ...), ``row``,
  ``value``, ``n_entity``.
  """

  fields = ("column", "row", "value", "n_entity")


class RelationOutOfRangeError(BessError):
  """A relation id is negative, or not below ``n_relation`` when that is given.

  Fields: ``column``, ``row``, ``value``, ``n_relation``.
  """

  fields = ("column", "row", "value", "n_relation")


class LengthMismatchError(BessError):
  """Two columns (or lists) that need one value per triple differ in length.

  Fields: ``column`` (the one that is off), ``got``, ``other``, ``expected``.
  """

  fields = ("column", "got", "other", "expected")


class MissingColumnError(BessError):
  """A record batch (or mapping) lacks ``head``, ``relation`` or ``tail``.

  Fields: ``column``.
  """

  fields = ("column",)


class ColumnTypeError(BessError, TypeError):
  """A column of ids is not integer (Arrow Int32/Int64, numpy int/uint).

  Fields: ``column``, ``found`` (the type found).
  """

  fields = ("column", "found")


class NullValueError(BessError):
  """A column of ids holds a null. Fields: ``column``, ``row``."""

  fields = ("column", "row")


class EmptyPartitionError(BessError):
  """A partition (shard pair or shard) has no triples where a sampler needs
  some, or a shard (or shard and type) has no entities to draw negatives from.

  besskge silently samples another partition here. Fields: ``sampler``,
  ``partition`` (as text).
  """

  fields = ("sampler", "partition")


class ZeroTriplesPerBlockError(BessError):
  """The shard batch size gives zero triples per partition block.

  Fields: ``shard_bs``, ``ppp``, ``n_shard``, ``duplicate_batch``,
  ``corruption``, ``minimum`` (the smallest shard batch size that works).
  """

  fields = ("shard_bs", "ppp", "n_shard", "duplicate_batch", "corruption", "minimum")


class ShardCountMismatchError(BessError):
  """The sharding's ``n`` is not the layout's ``N = G * S`` SparseCores.

  Fields: ``n_shard``, ``num_sparsecores``, ``global_devices``,
  ``sc_per_device``.
  """

  fields = ("n_shard", "num_sparsecores", "global_devices", "sc_per_device")


class InvalidParameterError(BessError):
  """A parameter is out of range (a seed, ``n_shard``, ``type_offsets``, a
  sampler name, ``sample_idx``, a sharding's arrays that disagree, ...).

  Fields: ``name``, ``value`` (as text), ``reason``.
  """

  fields = ("name", "value", "reason")


class ShardingFileError(BessError):
  """A sharding ``.npz`` is malformed. Fields: ``path``, ``reason``."""

  fields = ("path", "reason")


class TooLargeError(BessError):
  """A stream's step needs more memory than the allocator gives: refused
  before anything is drawn (instead of the process aborting).

  Fields: ``what`` (the step, with the layout, shard batch size and negatives
  it follows from), ``bytes`` (at least that many), ``reason``.
  """

  fields = ("what", "bytes", "reason")


class BessIOError(BessError, OSError):
  """A file (a sharding ``.npz``) cannot be opened, read or written: both an
  ``OSError`` and a :class:`BessError`. Fields: ``context`` (what was being
  done, with the path); the message adds the system's error.
  """

  fields = ("context",)


class PipelineConfigError(BessError, ConfigError):
  """The pipeline's :class:`sparsecore_prep.ConfigError` raised inside a BESS
  call (e.g. ``devices=(0, 0, 0)``, or S not a power of two): both classes,
  with ``ConfigError``'s fields."""


class PipelineInvalidInputError(BessError, InvalidInputError):
  """The pipeline's :class:`sparsecore_prep.InvalidInputError` raised inside a
  BESS call: both classes, with its fields."""


class PipelineLimitExceededError(BessError, LimitExceededError):
  """The pipeline's :class:`sparsecore_prep.LimitExceededError` raised inside
  a BESS call: both classes, with its fields."""


class PipelineInputTypeError(BessError, InputTypeError):
  """The pipeline's :class:`sparsecore_prep.InputTypeError` raised inside a
  BESS call: both classes, with its fields."""


# The native classes document themselves as members of this module, and so do the errors
# (pickle finds them here).
for _cls in (BessError, EntityOutOfRangeError, RelationOutOfRangeError, LengthMismatchError, MissingColumnError,
             ColumnTypeError, NullValueError, EmptyPartitionError, ZeroTriplesPerBlockError, ShardCountMismatchError,
             InvalidParameterError, ShardingFileError, TooLargeError, BessIOError, PipelineConfigError,
             PipelineInvalidInputError, PipelineLimitExceededError, PipelineInputTypeError):
  _cls.__module__ = __name__
del _cls
