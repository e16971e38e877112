"""FeatureSpecs, read by duck typing (SPEC Part 2, section 2.6): the reference's own spec
objects, or any object with the attributes python/README.md lists under "Feature specs"."""

from __future__ import annotations

import math
import operator
import sys

from . import _native
from ._errors import FeatureSpecError
from ._pytree import _leaves_with_paths


# What a feature spec must have (python/README.md, "Feature specs", lists the same).
_SPEC_HELP = (
    "a feature spec needs `name`, `table_spec.name`, `table_spec.vocabulary_size`, "
    "`table_spec.setting_in_stack.stack_name` and `table_spec.stacked_table_spec.combiner`, "
    "`.max_ids_per_partition`, `.max_unique_ids_per_partition` and `.suggested_coo_buffer_size_per_device` "
    "(None allowed); optional: `_id_transformation` (`row_offset`, `col_offset`, `col_shift`), "
    "`table_spec.embedding_dim`, `output_shape` or `input_shape` (see python/README.md, \"Feature specs\")")

_REQUIRED = object()
_NO_FIELD = object()


class _SpecProblem(Exception):
  """An attribute of a feature spec that is missing or unusable (turned into FeatureSpecError)."""

  def __init__(self, attribute: str, problem: str):
    super().__init__(attribute, problem)
    self.attribute, self.problem = attribute, problem


def _attr(obj, dotted: str, default=_REQUIRED):
  """`obj.a.b.c` for `dotted` "a.b.c"; `default` if a part is missing (or _SpecProblem)."""
  value = obj
  for part in dotted.split("."):
    try:
      value = getattr(value, part)
    except AttributeError:
      if default is _REQUIRED:
        raise _SpecProblem(dotted, "is missing") from None
      return default
  return value


def _count(value, dotted: str) -> int:
  """A non-negative integer (ints and numpy integers; a float is an error, not truncated)."""
  try:
    n = operator.index(value)
  except TypeError:
    raise _SpecProblem(dotted, f"is {value!r}, not an integer") from None
  if n < 0:
    raise _SpecProblem(dotted, f"is {n}, must not be negative")
  return n


def _spec_tuple(spec) -> tuple:
  """What preprocessing reads of one FeatureSpec, as the native call takes it (_SpecProblem if
  an attribute is missing or unusable)."""
  stacked = "table_spec.stacked_table_spec"
  # The reference's FeatureSpec keeps the transformation in `_id_transformation` (None until
  # stacking sets it) and its `id_transformation` property asserts it is set: that property is
  # read only from specs without the field.
  path = "_id_transformation"
  if not hasattr(spec, path):
    path = "id_transformation"
  row_offset = col_offset = col_shift = 0
  if _attr(spec, path, None) is not None:
    row_offset, col_offset, col_shift = (_count(_attr(spec, f"{path}.{a}"), f"{path}.{a}")
                                         for a in ("row_offset", "col_offset", "col_shift"))
  shape_path = "output_shape"
  if _attr(spec, shape_path, None) is None:
    shape_path = "input_shape"
  shape = _attr(spec, shape_path, None)
  global_batch = 0
  if shape is not None:
    try:
      dims = [_count(d, shape_path) for d in shape]
    except TypeError:
      raise _SpecProblem(shape_path, f"is {shape!r}, not a sequence of integers") from None
    global_batch = math.prod(dims[:-1]) if len(dims) > 1 else (dims[0] if dims else 0)
  dim = _attr(spec, "table_spec.embedding_dim", None)
  suggested = _attr(spec, f"{stacked}.suggested_coo_buffer_size_per_device")
  return (
      (
          str(_attr(spec, "name")),
          str(_attr(spec, "table_spec.name")),
          _count(_attr(spec, "table_spec.vocabulary_size"), "table_spec.vocabulary_size"),
          0 if dim is None else _count(dim, "table_spec.embedding_dim"),
          global_batch,
      ),
      (str(_attr(spec, "table_spec.setting_in_stack.stack_name")), row_offset, col_offset, col_shift),
      (
          str(_attr(spec, f"{stacked}.combiner")),
          _count(_attr(spec, f"{stacked}.max_ids_per_partition"), f"{stacked}.max_ids_per_partition"),
          _count(_attr(spec, f"{stacked}.max_unique_ids_per_partition"), f"{stacked}.max_unique_ids_per_partition"),
          None if suggested is None else _count(suggested, f"{stacked}.suggested_coo_buffer_size_per_device"),
      ),
  )


def _nonneg(value) -> int:
  n = operator.index(value)
  if n < 0:
    raise ValueError(n)
  return n


def _spec_tuple_fast(spec) -> tuple:
  """_spec_tuple by plain attribute access (it runs for every feature of every call); any
  problem makes _spec_tuples ask _spec_tuple, which names it."""
  table = spec.table_spec
  stacked = table.stacked_table_spec
  transform = getattr(spec, "_id_transformation", _NO_FIELD)
  if transform is _NO_FIELD:
    transform = getattr(spec, "id_transformation", None)
  offsets = (0, 0, 0) if transform is None else (
      _nonneg(transform.row_offset), _nonneg(transform.col_offset), _nonneg(transform.col_shift))
  shape = getattr(spec, "output_shape", None)
  if shape is None:
    shape = getattr(spec, "input_shape", None)
  global_batch = 0
  if shape is not None:
    dims = [_nonneg(d) for d in shape]
    global_batch = math.prod(dims[:-1]) if len(dims) > 1 else (dims[0] if dims else 0)
  dim = getattr(table, "embedding_dim", None)
  suggested = stacked.suggested_coo_buffer_size_per_device
  return (
      (str(spec.name), str(table.name), _nonneg(table.vocabulary_size), 0 if dim is None else _nonneg(dim),
       global_batch),
      (str(table.setting_in_stack.stack_name),) + offsets,
      (str(stacked.combiner), _nonneg(stacked.max_ids_per_partition), _nonneg(stacked.max_unique_ids_per_partition),
       None if suggested is None else _nonneg(suggested)),
  )


def _leaf_path(tree, i: int) -> str:
  """`feature_specs['f']`-style path of leaf `i` of `tree`, for messages."""
  try:
    paths, _ = _leaves_with_paths(tree)
    path = paths[i]
    jax = sys.modules.get("jax")
    if jax is not None:
      return "feature_specs" + jax.tree_util.keystr(path)
    return "feature_specs" + "".join(f"[{k!r}]" for k in path)
  except Exception:  # a message must not fail: fall back to the leaf's position
    return f"feature_specs leaf {i}"


def _spec_tuples(leaves, tree):
  """The spec tuples of all leaves; FeatureSpecError names the spec and the attribute.

  The native reader takes the specs whose attributes are exact strs and non-negative ints (the
  reference's own, read on every call of every feature); it leaves anything else to
  _spec_tuple_fast and _spec_tuple, which accept what `operator.index` and `str` accept and
  name the spec and the attribute in errors."""
  if type(leaves) is list:
    fast = _native.spec_tuples(leaves)
    if fast is not None:
      return fast
  out = []
  for i, spec in enumerate(leaves):
    try:
      try:
        out.append(_spec_tuple_fast(spec))
      except (AttributeError, TypeError, ValueError):
        out.append(_spec_tuple(spec))  # raises _SpecProblem, naming the attribute
    except _SpecProblem as e:
      where = _leaf_path(tree, i)
      name = getattr(spec, "name", None)
      feature = str(name) if name is not None else where
      label = f"{where} (feature `{name}`)" if name is not None else where
      raise FeatureSpecError(f"{label}: `{e.attribute}` {e.problem}; {_SPEC_HELP}", feature=feature,
                             attribute=e.attribute) from None
  return out
