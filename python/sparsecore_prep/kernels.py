"""CPU stand-ins for the reference's SparseCore kernels, for JAX training loops without a TPU.

:func:`sparse_dense_matmul` and :func:`sparse_dense_matmul_grad` take the
arguments of the reference's
``jax_tpu_embedding.sparsecore.lib.nn.embedding.tpu_sparse_dense_matmul`` and
``tpu_sparse_dense_matmul_grad`` and return the same structures: per-feature
activations, and per-stack updated ``EmbeddingVariables`` (the table followed
by its slot variables) after one step of the optimizer named by each stack's
optimizer spec. Together with
:func:`sparsecore_prep.preprocess_sparse_dense_matmul_input`, a model written
against the reference trains on a CPU by swapping three functions.

The math runs in the Rust CPU backend (crate ``sparsecore-kernel``) through
``jax.pure_callback``, so both work eagerly and inside ``jax.jit`` on the CPU
backend; every output shape is known from the specs. There is no
``shard_map``: the arrays are the *global* view of the local devices: buffers
as the preprocessing call returns them (``[L * RP]`` / ``[L * C]`` or with a
leading ``L`` dimension), each stacked table ``[N * R, D]`` with all ``N = G *
S`` shards (python/README.md, "CPU kernels", shows the layout and the helpers
:func:`stack_tables` / :func:`unstack_tables` that build and read it), and
per-feature activations ``[local batch, embedding_dim]``.

Errors are the package's typed exceptions, raised while tracing (shapes,
slots, hyper-parameters known then): :class:`~sparsecore_prep.ConfigError`
for tables whose shapes do not match the specs, missing slot variables,
non-finite hyper-parameters or limits (``location`` names the stack, the
message its tables), :class:`~sparsecore_prep.InvalidInputError` for
activation gradients of the wrong shape (``feature`` names the feature).
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import _native
from ._errors import ConfigError, FeatureSpecError, InvalidInputError
from ._results import _REFERENCE_EMBEDDING
from ._specs import _spec_tuples

__all__ = [
    "EmbeddingVariables",
    "sparse_dense_matmul",
    "sparse_dense_matmul_grad",
    "stack_tables",
    "unstack_tables",
]


class EmbeddingVariables(NamedTuple):
  """A stacked table and its slot variables (the reference's class of this name)."""

  table: Any
  slot: tuple


def _embedding_variables_type():
  import sys
  ref = sys.modules.get(_REFERENCE_EMBEDDING)
  return getattr(ref, "EmbeddingVariables", EmbeddingVariables) if ref is not None else EmbeddingVariables


# ---------------------------------------------------------------------------
# Plans, cached per specs and layout (the specs are re-read on every call, so
# a spec changed in place gets a new plan).
# ---------------------------------------------------------------------------

_CACHE: dict = {}
_CACHE_SIZE = 8


class _Setup(NamedTuple):
  native: Any
  layout: dict
  leaves: list
  treedef: Any


def _setup(feature_specs, local_devices: int, global_devices: int, num_sc: int, minibatching: bool) -> _Setup:
  leaves, treedef = jax.tree.flatten(feature_specs)
  specs = _spec_tuples(leaves, feature_specs)
  key = (tuple(specs), local_devices, global_devices, num_sc, bool(minibatching))
  hit = _CACHE.pop(key, None)
  if hit is None:
    native = _native.NativeKernels(specs, local_devices, global_devices, num_sc, bool(minibatching))
    hit = (native, native.layout())
  _CACHE[key] = hit
  while len(_CACHE) > _CACHE_SIZE:
    _CACHE.pop(next(iter(_CACHE)))
  return _Setup(hit[0], hit[1], leaves, treedef)


def _check_options(sharding_strategy, num_sc_per_device, global_device_count) -> None:
  if not isinstance(sharding_strategy, str) or sharding_strategy.upper() != "MOD":
    raise ConfigError(f"Unsupported sharding strategy: {sharding_strategy}. Only MOD is supported.",
                      field="sharding_strategy")
  if num_sc_per_device is None:
    raise ConfigError("num_sc_per_device must be given (there is no TPU to detect it from)", field="num_sc_per_device")
  if global_device_count is None:
    raise ConfigError("global_device_count must be given", field="global_device_count")


def _unpack(preprocessed_inputs):
  """(row pointers, ids, samples, gains, num_minibatches) of either input class."""
  inner = getattr(preprocessed_inputs, "sparse_dense_matmul_input", None)
  if inner is None:  # the deprecated SparseDenseMatmulInput 4-tuple
    return (*tuple(preprocessed_inputs), np.array(1))
  return (*tuple(inner), preprocessed_inputs.num_minibatches)


def _local_devices(num_minibatches, global_device_count: int) -> int:
  """L: ``num_minibatches`` is ``np.full(L, M)`` (or ``[L, 1]``); a scalar means L = G."""
  shape = np.shape(num_minibatches)
  return int(shape[0]) if len(shape) >= 1 and shape[0] > 0 else int(global_device_count)


def _stack_names(setup: _Setup) -> list[str]:
  return [s["name"] for s in setup.layout["stacks"]]


def _check_keys(what: str, got, setup: _Setup) -> None:
  want = set(_stack_names(setup))
  if set(got) != want:
    raise InvalidInputError(f"{what} has stacks {sorted(got)}, the feature specs have {sorted(want)}")


def _buffers(rp, eid, sid, gains, names):
  """Every stack's four buffers, flat and of the kernels' dtypes, in plan order."""
  out = []
  for name in names:
    out += [jnp.ravel(jnp.asarray(rp[name], jnp.int32)), jnp.ravel(jnp.asarray(eid[name], jnp.int32)),
            jnp.ravel(jnp.asarray(sid[name], jnp.int32)), jnp.ravel(jnp.asarray(gains[name], jnp.float32))]
  return out


def _group(flat_arrays, k: int):
  return [tuple(np.ascontiguousarray(a) for a in flat_arrays[4 * i:4 * i + 4]) for i in range(k)]


def _tables_label(stack: dict) -> str:
  return ", ".join(f"`{t[0]}` [{t[1]}, {t[2]}]" for t in stack["tables"])


def _variables(embedding_variables, stack: dict):
  """The leaves `[table, *slots]` of one stack's variables and their treedef; the table's
  shape is checked against the specs."""
  name = stack["name"]
  leaves, treedef = jax.tree.flatten(embedding_variables[name])
  want = (stack["vocab"], stack["dim"])
  if not leaves:
    raise ConfigError(f"stack `{name}`: embedding_variables has no table", field="embedding_variables",
                      location=f"stack `{name}`")
  for i, leaf in enumerate(leaves):
    shape = tuple(np.shape(leaf))
    if math.prod(shape) != want[0] * want[1] or (shape and shape[-1] != want[1]):
      what = "table" if i == 0 else f"slot variable {i - 1}"
      raise ConfigError(
          f"stack `{name}`: {what} of shape {list(shape)} does not match the specs: expected the stacked "
          f"table's [{want[0]}, {want[1]}] (N * R rows of the padded dim) for tables {_tables_label(stack)}",
          field="embedding_variables", location=f"stack `{name}`")
  return leaves, treedef


# ---------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------


def sparse_dense_matmul(
    preprocessed_inputs,
    embedding_variables: Mapping[str, Any],
    feature_specs,
    *,
    global_device_count: int,
    sharding_strategy: str = "MOD",
    num_sc_per_device: int | None = None,
    enable_minibatching: bool = False,
    perform_unstacking: bool = True,
    use_activation_unstack_primitive: bool = False,
):
  """The reference's ``tpu_sparse_dense_matmul``, computed on the CPU.

  Args:
    preprocessed_inputs: what the (drop-in or reference) preprocessing call
      returns, a ``PreprocessedInput`` (or the deprecated
      ``SparseDenseMatmulInput``), for the local devices.
    embedding_variables: per stack, the table followed by its slot variables
      (``EmbeddingVariables(table, slot)``); only the table is read. The table
      is the global ``[N * R, D]`` array (see :func:`stack_tables`).
    feature_specs: the stacked feature specs (read by duck typing, as the
      drop-in preprocessing call reads them).
    global_device_count: G.
    sharding_strategy: only "MOD".
    num_sc_per_device: S (required: there is no TPU to ask).
    enable_minibatching: as given to preprocessing.
    perform_unstacking: per-feature activations (True) or per-stack stacked
      activations ``[L * bsd, D]`` (False).
    use_activation_unstack_primitive: accepted for compatibility; the result
      is the same either way.

  Returns:
    Per-feature activations ``[local batch, embedding_dim]`` in the structure
    of ``feature_specs`` (local batch = L * global batch / G, samples in input
    order), or a dict of stacked activations.
  """
  del use_activation_unstack_primitive
  _check_options(sharding_strategy, num_sc_per_device, global_device_count)
  rp, eid, sid, gains, num_minibatches = _unpack(preprocessed_inputs)
  local = _local_devices(num_minibatches, global_device_count)
  setup = _setup(feature_specs, local, int(global_device_count), int(num_sc_per_device), enable_minibatching)
  names = _stack_names(setup)
  _check_keys("lhs_row_pointers", rp.keys(), setup)
  _check_keys("embedding_variables", embedding_variables.keys(), setup)
  tables = []
  for stack in setup.layout["stacks"]:
    leaves, _ = _variables(embedding_variables, stack)
    tables.append(jnp.reshape(jnp.asarray(leaves[0], jnp.float32), (stack["vocab"], stack["dim"])))
  if perform_unstacking:
    shapes = [jax.ShapeDtypeStruct((rows, dim), jnp.float32) for _, _, rows, dim in setup.layout["features"]]
  else:
    shapes = [jax.ShapeDtypeStruct((local * s["batch_per_device"], s["dim"]), jnp.float32)
              for s in setup.layout["stacks"]]
  native, k = setup.native, len(names)

  def callback(m, *arrays):
    m = int(np.ravel(np.asarray(m))[0]) if np.size(m) else 1
    out = native.forward(_group(arrays[:4 * k], k), m, [np.ascontiguousarray(t) for t in arrays[4 * k:]],
                         bool(perform_unstacking))
    return tuple(out)

  operands = [jnp.asarray(num_minibatches, jnp.int32)] + _buffers(rp, eid, sid, gains, names) + tables
  out = jax.pure_callback(callback, tuple(shapes), *operands)
  if perform_unstacking:
    return jax.tree.unflatten(setup.treedef, list(out))
  return dict(zip(names, out))


# ---------------------------------------------------------------------------
# Optimizers
# ---------------------------------------------------------------------------

# Short name -> (hyper-parameter attributes after the learning rate, the flag attribute).
_OPTIMIZERS = {
    "sgd": ((), None),
    "adagrad": ((), None),
    "adagrad_momentum": (("momentum", "beta2", "epsilon", "exponent"), "use_nesterov"),
    "adam": (("beta_1", "beta_2", "epsilon"), None),
    "ftrl": (("learning_rate_power", "l1_regularization_strength", "l2_regularization_strength", "beta"),
             "multiply_linear_by_learning_rate"),
    "laprop": (("b1", "b2", "eps"), None),
}
# Class names of the reference's specs, for specs without short_name().
_CLASS_NAMES = {
    "SGDOptimizerSpec": "sgd", "AdagradOptimizerSpec": "adagrad", "AdagradMomentumOptimizerSpec": "adagrad_momentum",
    "AdamOptimizerSpec": "adam", "FTRLOptimizerSpec": "ftrl", "LaPropOptimizerSpec": "laprop",
}
# Slot initial values per optimizer when the spec has no slot_variables_initializers():
# (attribute, default) per slot.
_SLOT_DEFAULTS = {
    "sgd": (),
    "adagrad": (("initial_accumulator_value", 0.1),),
    "adagrad_momentum": (("initial_accumulator_value", 0.1), ("initial_momentum_value", 0.0)),
    "adam": ((None, 0.0), (None, 0.0)),
    "ftrl": (("initial_accumulator_value", 0.1), ("initial_linear_value", 0.0)),
    "laprop": (("initial_slot_value", 0.0), ("initial_slot_value", 0.0)),
}


def _optimizer_spec(spec):
  stacked = getattr(getattr(spec, "table_spec", None), "stacked_table_spec", None)
  opt = getattr(stacked, "optimizer", None)
  if opt is None:
    opt = getattr(getattr(spec, "table_spec", None), "optimizer", None)
  if opt is None:
    raise FeatureSpecError(f"feature `{getattr(spec, 'name', '?')}`: no optimizer spec at "
                           "`table_spec.stacked_table_spec.optimizer` or `table_spec.optimizer`",
                           feature=str(getattr(spec, "name", "?")), attribute="table_spec.stacked_table_spec.optimizer")
  return opt


def _optimizer_kind(opt, stack: str) -> str:
  kind = None
  if callable(getattr(opt, "short_name", None)):
    kind = opt.short_name()
  if kind not in _OPTIMIZERS:
    kind = _CLASS_NAMES.get(type(opt).__name__, kind)
  if kind not in _OPTIMIZERS:
    raise ConfigError(f"stack `{stack}`: optimizer {type(opt).__name__} ({kind!r}) is not one of "
                      f"{', '.join(_OPTIMIZERS)} (custom optimizers need a TPU)", field="optimizer",
                      location=f"stack `{stack}`")
  return kind


def _learning_rate(opt, step):
  if callable(getattr(opt, "get_learning_rate", None)):
    return opt.get_learning_rate(step)
  lr = opt.learning_rate
  if callable(lr):
    return lr(step) if step is not None else lr()
  return lr


def _concrete(x):
  """A Python float when ``x`` is known while tracing, else None."""
  try:
    return float(np.asarray(x))
  except (TypeError, jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
    return None


def _optimizer(stack: dict, leaves, step):
  """(kind, hyper-parameter operands, flag, slot names) for one stack."""
  name = stack["name"]
  opt = _optimizer_spec(leaves[stack["features"][0]])
  kind = _optimizer_kind(opt, name)
  attrs, flag_attr = _OPTIMIZERS[kind]
  hyper = [("learning_rate", _learning_rate(opt, step))] + [(a, getattr(opt, a)) for a in attrs]
  for attr, value in hyper:
    v = _concrete(value)
    if v is not None and not math.isfinite(v):
      raise ConfigError(f"stack `{name}` (tables {_tables_label(stack)}): {kind} hyper-parameter {attr} = {v}; "
                        "hyper-parameters must be finite", field=attr, location=f"stack `{name}`")
  flag = bool(getattr(opt, flag_attr)) if flag_attr else False
  return kind, [jnp.asarray(v, jnp.float32) for _, v in hyper], flag, opt


def _slot_count(kind: str) -> int:
  return len(_SLOT_DEFAULTS[kind])


# ---------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------


def sparse_dense_matmul_grad(
    activation_gradients,
    preprocessed_inputs,
    embedding_variables: Mapping[str, Any],
    feature_specs,
    *,
    global_device_count: int | None = None,
    sharding_strategy: str = "MOD",
    label: str = "",
    step=None,
    num_sc_per_device: int | None = None,
    enable_minibatching: bool = False,
    perform_stacking: bool = True,
    use_gradient_stacking_primitive: bool = False,
    embedding_var_limits: Mapping[str, tuple[float | None, float | None]] | None = None,
):
  """The reference's ``tpu_sparse_dense_matmul_grad``, computed on the CPU.

  Accumulates every referenced row's gradient over all slots of the buffers,
  then applies one step of each stack's optimizer (its feature specs'
  ``table_spec.stacked_table_spec.optimizer``: SGD, Adagrad,
  Adagrad-momentum, Adam, FTRL or LaProp, with the reference's
  hyper-parameters; ``step`` feeds learning-rate schedules and Adam's and
  LaProp's bias corrections) to those rows; other rows are unchanged. The
  updated table is clipped to ``embedding_var_limits[stack]`` when given.

  Args:
    activation_gradients: per-feature gradients in the structure of
      ``feature_specs`` (each the feature's activations' shape), or with
      ``perform_stacking=False`` a dict of per-stack ``[L * bsd, D]``.
    preprocessed_inputs, embedding_variables, feature_specs,
    sharding_strategy, num_sc_per_device, enable_minibatching: as in
      :func:`sparse_dense_matmul`; ``embedding_variables[stack]`` must hold
      the table and every slot variable of the stack's optimizer.
    global_device_count: G (default: L, one host).
    label: accepted for compatibility (names the TPU computation).
    step: the step number (an int or a traced scalar), or None.
    perform_stacking: see ``activation_gradients``.
    use_gradient_stacking_primitive: accepted for compatibility.
    embedding_var_limits: per stack ``(min, max)``, either None.

  Returns:
    Per stack, the updated variables, in the structure they came in.
  """
  del label, use_gradient_stacking_primitive
  rp, eid, sid, gains, num_minibatches = _unpack(preprocessed_inputs)
  if global_device_count is None:
    global_device_count = _local_devices(num_minibatches, 1)
  _check_options(sharding_strategy, num_sc_per_device, global_device_count)
  local = _local_devices(num_minibatches, global_device_count)
  setup = _setup(feature_specs, local, int(global_device_count), int(num_sc_per_device), enable_minibatching)
  names = _stack_names(setup)
  _check_keys("lhs_row_pointers", rp.keys(), setup)
  _check_keys("embedding_variables", embedding_variables.keys(), setup)

  # Activation gradients, checked against the specs.
  if perform_stacking:
    g_leaves, g_treedef = jax.tree.flatten(activation_gradients)
    if g_treedef != setup.treedef and len(g_leaves) != len(setup.leaves):
      raise InvalidInputError(f"activation_gradients has {len(g_leaves)} leaves, feature_specs "
                              f"{len(setup.leaves)}: the structures must match")
    grads = []
    for (fname, _, rows, dim), g in zip(setup.layout["features"], g_leaves):
      shape = tuple(np.shape(g))
      if math.prod(shape) != rows * dim or (shape and shape[-1] != dim):
        raise InvalidInputError(f"feature `{fname}`: activation gradient of shape {list(shape)}, expected "
                                f"[{rows}, {dim}] (the feature's activations)", feature=fname)
      grads.append(jnp.reshape(jnp.asarray(g, jnp.float32), (rows, dim)))
  else:
    _check_keys("activation_gradients", activation_gradients.keys(), setup)
    grads = []
    for s in setup.layout["stacks"]:
      want = (local * s["batch_per_device"], s["dim"])
      g = activation_gradients[s["name"]]
      if tuple(np.shape(g)) != want:
        raise InvalidInputError(f"stack `{s['name']}`: stacked activation gradient of shape {list(np.shape(g))}, "
                                f"expected {list(want)}")
      grads.append(jnp.asarray(g, jnp.float32))

  # Variables, optimizers, limits.
  variables, treedefs, kinds, flags, hypers, limits = [], [], [], [], [], []
  for s in setup.layout["stacks"]:
    name = s["name"]
    kind, hyper, flag, _ = _optimizer(s, setup.leaves, step)
    leaves, treedef = _variables(embedding_variables, s)
    if len(leaves) != 1 + _slot_count(kind):
      raise ConfigError(
          f"stack `{name}` (tables {_tables_label(s)}): {kind} needs the table and {_slot_count(kind)} slot "
          f"variables, embedding_variables has {len(leaves) - 1} slot variables", field="embedding_variables",
          location=f"stack `{name}`")
    lo, hi = (None, None) if embedding_var_limits is None else tuple(embedding_var_limits[name])
    lo = -math.inf if lo is None else float(lo)
    hi = math.inf if hi is None else float(hi)
    if math.isnan(lo) or math.isnan(hi) or lo > hi:
      raise ConfigError(f"stack `{name}`: embedding_var_limits ({lo}, {hi}) must be min <= max, not NaN",
                        field="embedding_var_limits", location=f"stack `{name}`")
    variables.append([jnp.reshape(jnp.asarray(v, jnp.float32), (s["vocab"], s["dim"])) for v in leaves])
    treedefs.append((treedef, [np.shape(v) for v in leaves]))
    kinds.append(kind)
    flags.append(flag)
    hypers.append(hyper)
    limits.append((lo, hi))

  native, k = setup.native, len(names)
  counts = [len(v) for v in variables]
  hyper_counts = [len(h) for h in hypers]
  has_step = step is not None
  n_grads = len(grads)

  def callback(m, step_value, *arrays):
    m = int(np.ravel(np.asarray(m))[0]) if np.size(m) else 1
    i = 0
    bufs = _group(arrays[:4 * k], k)
    i = 4 * k
    g = [np.ascontiguousarray(a) for a in arrays[i:i + n_grads]]
    i += n_grads
    var = []
    for c in counts:
      var.append([np.ascontiguousarray(a) for a in arrays[i:i + c]])
      i += c
    opts = []
    st = int(np.asarray(step_value)) if has_step else None
    for kind, flag, hc in zip(kinds, flags, hyper_counts):
      opts.append((kind, [float(np.asarray(a)) for a in arrays[i:i + hc]], st, flag))
      i += hc
    out = native.backward(bufs, m, g, var, opts, limits, not perform_stacking)
    return tuple(a for stack in out for a in stack)

  operands = ([jnp.asarray(num_minibatches, jnp.int32), jnp.asarray(0 if step is None else step, jnp.int32)]
              + _buffers(rp, eid, sid, gains, names) + grads + [v for vs in variables for v in vs]
              + [h for hs in hypers for h in hs])
  shapes = tuple(jax.ShapeDtypeStruct((s["vocab"], s["dim"]), jnp.float32)
                 for s, c in zip(setup.layout["stacks"], counts) for _ in range(c))
  flat = list(jax.pure_callback(callback, shapes, *operands))
  result = {}
  for name, c, (treedef, in_shapes) in zip(names, counts, treedefs):
    leaves = [jnp.reshape(a, shp) for a, shp in zip(flat[:c], in_shapes)]
    flat = flat[c:]
    result[name] = jax.tree.unflatten(treedef, leaves)
  return result


# ---------------------------------------------------------------------------
# Table layout helpers
# ---------------------------------------------------------------------------


def _layout_setup(feature_specs, global_device_count, num_sc_per_device) -> _Setup:
  _check_options("MOD", num_sc_per_device, global_device_count)
  return _setup(feature_specs, int(global_device_count), int(global_device_count), int(num_sc_per_device), False)


def _slot_initial_values(opt, kind: str, shape):
  """The slot arrays, and the spec's initializers (or None)."""
  inits = None
  if callable(getattr(opt, "slot_variables_initializers", None)):
    inits = opt.slot_variables_initializers()
  if inits is not None and len(tuple(inits)) == _slot_count(kind):
    key = jax.random.key(0)
    return [np.asarray(init(key, shape, jnp.float32), np.float32) for init in tuple(inits)], inits
  return [np.full(shape, float(getattr(opt, a, d) if a else d), np.float32) for a, d in _SLOT_DEFAULTS[kind]], None



def stack_tables(tables: Mapping[str, Any], feature_specs, *, global_device_count: int, num_sc_per_device: int,
                 with_slots: bool = True) -> dict:
  """Builds ``embedding_variables`` from per-table arrays.

  Args:
    tables: table name -> ``[vocabulary_size, embedding_dim]`` array, for every
      table of ``feature_specs``.
    feature_specs: the stacked feature specs.
    global_device_count, num_sc_per_device: G and S.
    with_slots: add each stack's slot variables, initialised as its optimizer
      spec says (``slot_variables_initializers()``, else the reference's
      initial values).

  Returns:
    stack name -> ``EmbeddingVariables(table [N * R, D], slot)`` of numpy
    arrays; padding rows and columns are 0.
  """
  setup = _layout_setup(feature_specs, global_device_count, num_sc_per_device)
  out = {}
  ev = _embedding_variables_type()
  for i, s in enumerate(setup.layout["stacks"]):
    arrays = []
    for tname, vocab, dim in s["tables"]:
      if tname not in tables:
        raise ConfigError(f"stack `{s['name']}`: no array for table `{tname}`", field="tables",
                          location=f"table `{tname}`")
      a = np.ascontiguousarray(tables[tname], np.float32)
      if a.shape != (vocab, dim):
        raise ConfigError(f"table `{tname}`: array of shape {list(a.shape)}, the specs say [{vocab}, {dim}]",
                          field="tables", location=f"table `{tname}`")
      arrays.append(a)
    table = setup.native.stack_table(i, arrays)
    slot: Any = ()
    if with_slots:
      opt = _optimizer_spec(setup.leaves[s["features"][0]])
      kind = _optimizer_kind(opt, s["name"])
      values, inits = _slot_initial_values(opt, kind, table.shape)
      slot = tuple(values)
      if inits is not None and hasattr(type(inits), "_fields"):
        slot = type(inits)(*values)
    out[s["name"]] = ev(table, slot)
  return out


def unstack_tables(embedding_variables: Mapping[str, Any], feature_specs, *, global_device_count: int,
                   num_sc_per_device: int, variable: int = 0) -> dict:
  """Reads per-table arrays back out of ``embedding_variables`` (the inverse of :func:`stack_tables`).

  Args:
    embedding_variables: stack name -> the table followed by its slot
      variables (numpy or jax arrays).
    feature_specs, global_device_count, num_sc_per_device: as for
      :func:`stack_tables`.
    variable: 0 for the tables, ``i`` for slot variable ``i - 1``.

  Returns:
    table name -> ``[vocabulary_size, embedding_dim]`` numpy array.
  """
  setup = _layout_setup(feature_specs, global_device_count, num_sc_per_device)
  out = {}
  for i, s in enumerate(setup.layout["stacks"]):
    leaves, _ = _variables(embedding_variables, s)
    if variable >= len(leaves):
      raise ConfigError(f"stack `{s['name']}`: no variable {variable} ({len(leaves)} given)",
                        field="embedding_variables", location=f"stack `{s['name']}`")
    a = np.ascontiguousarray(np.reshape(np.asarray(leaves[variable], np.float32), (s["vocab"], s["dim"])))
    for (tname, _, _), arr in zip(s["tables"], setup.native.unstack_table(i, a)):
      out[tname] = arr
  return out
