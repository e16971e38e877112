"""sparsecore_prep.kernels: the CPU stand-ins for the reference's tpu_sparse_dense_matmul / _grad.

Activations and updated tables (and slots) are checked against a plain numpy embedding bag
over the raw input samples (combiner-weighted sums of table rows; the row gradients summed
over every (sample, id); one optimizer step on each touched row with the reference's formulas
and the reference's own `get_hyperparameters`), never against our own output. The specs are
the reference's own TableSpec / FeatureSpec, stacked by its `auto_stack_tables`.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax_tpu_embedding.sparsecore.lib.nn import embedding, embedding_spec  # noqa: E402

import sparsecore_prep  # noqa: E402
from sparsecore_prep import kernels  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# name, vocabulary, dim, combiner
LIMIT_SPLIT = 16  # splits the minibatching case's batch (hot ids need more than 8)
TABLES = [("ta", 50, 8, "sum"), ("tb", 70, 8, "sum"), ("tc", 40, 8, "mean"), ("td", 30, 8, "sqrtn")]
# name, table
FEATURES = [("f0", "ta"), ("f1", "tb"), ("f2", "ta"), ("f3", "tc"), ("f4", "td")]


def optimizer(kind: str):
  if kind == "sgd":
    return embedding_spec.SGDOptimizerSpec(learning_rate=0.5)
  if kind == "adagrad":
    return embedding_spec.AdagradOptimizerSpec(learning_rate=0.3, initial_accumulator_value=0.2)
  if kind == "adagrad_momentum":
    return embedding_spec.AdagradMomentumOptimizerSpec(learning_rate=0.2, momentum=0.8, beta2=0.9, epsilon=1e-6,
                                                       exponent=2.0, use_nesterov=True)
  if kind == "adam":
    return embedding_spec.AdamOptimizerSpec(learning_rate=0.1)
  if kind == "ftrl":
    return embedding_spec.FTRLOptimizerSpec(learning_rate=0.3, l1_regularization_strength=0.01,
                                            l2_regularization_strength=0.02, beta=0.1)
  if kind == "laprop":
    return embedding_spec.LaPropOptimizerSpec(learning_rate=0.1)
  raise ValueError(kind)


def make_specs(g: int, s: int, batch: int, opt, limit: int = 256):
  tables = {
      n: embedding_spec.TableSpec(name=n, vocabulary_size=v, embedding_dim=d, initializer=jax.nn.initializers.zeros,
                                  optimizer=opt, combiner=c, max_ids_per_partition=limit,
                                  max_unique_ids_per_partition=limit)
      for n, v, d, c in TABLES
  }
  specs = {
      f: embedding_spec.FeatureSpec(name=f, table_spec=tables[t], input_shape=[batch, 1],
                                    output_shape=[batch, tables[t].embedding_dim])
      for f, t in FEATURES
  }
  embedding.auto_stack_tables(specs, global_device_count=g, num_sc_per_device=s,
                              stack_to_max_ids_per_partition=lambda n, b: limit,
                              stack_to_max_unique_ids_per_partition=lambda n, b: limit)
  embedding.prepare_feature_specs_for_training(specs, global_device_count=g, num_sc_per_device=s)
  return specs


def make_batch(batch: int, seed: int):
  rng = np.random.default_rng(seed)
  vocab = {n: v for n, v, _, _ in TABLES}
  ids, weights = {}, {}
  for f, t in FEATURES:
    rows, ws = [], []
    for _ in range(batch):
      n = int(rng.integers(1, 5))
      hot = rng.random(n) < 0.4  # repeated rows across samples and devices
      rows.append(np.where(hot, rng.integers(0, 3, n), rng.integers(0, vocab[t], n)).astype(np.int32))
      ws.append((rng.integers(1, 9, n) / 4).astype(np.float32))
    ids[f] = np.array(rows + [None], dtype=object)[:-1]
    weights[f] = np.array(ws + [None], dtype=object)[:-1]
  return ids, weights


# ---------------------------------------------------------------------------
# The numpy embedding bag
# ---------------------------------------------------------------------------


def combiner_of(feature):
  t = dict(FEATURES)[feature]
  return next(c for n, _, _, c in TABLES if n == t)


def gains(w, combiner):
  w = w.astype(np.float64)
  if combiner == "mean":
    return w / w.sum()
  if combiner == "sqrtn":
    return w / np.sqrt((w * w).sum())
  return w


def bag_forward(ids, weights, table, combiner):
  out = np.zeros((len(ids), table.shape[1]))
  for i, (r, w) in enumerate(zip(ids, weights)):
    out[i] = (gains(w, combiner)[:, None] * table[r]).sum(0)
  return out


def bag_grads(features, ids, weights, dacts, tname, vocab, dim):
  """The gradient of every row of table `tname`, summed over every (sample, id) of its features."""
  g = np.zeros((vocab, dim))
  touched = np.zeros(vocab, bool)
  for f in features:
    if dict(FEATURES)[f] != tname:
      continue
    for i, (r, w) in enumerate(zip(ids[f], weights[f])):
      np.add.at(g, r, gains(w, combiner_of(f))[:, None] * dacts[f][i][None, :])
      touched[r] = True
  return g, touched


def numpy_step(kind, opt, w, slots, g, step):
  """One step of the reference's optimizer on rows `w` (float64), with the reference's hyper-parameters."""
  hp = [np.asarray(h, np.float64) for h in opt.get_hyperparameters(step)]
  if kind == "sgd":
    return w - hp[0] * g, []
  if kind == "adagrad":
    a = slots[0] + g * g
    return w - hp[0] * g / np.sqrt(a), [a]
  if kind == "adagrad_momentum":
    lr, mom, beta2, eps, exponent, nesterov = hp
    a = slots[0] + g * g if beta2 == 1.0 else beta2 * slots[0] + (1 - beta2) * g * g
    scaled = (a + eps) ** (-1.0 / exponent) * g
    m = mom * slots[1] + scaled
    update = mom * m + scaled if nesterov else m
    return w - lr * update, [a, m]
  if kind == "adam":
    alpha, b1, b2, eps = hp
    m = slots[0] + (1 - b1) * (g - slots[0])
    v = slots[1] + (1 - b2) * (g * g - slots[1])
    return w - alpha * m / (np.sqrt(v) + eps), [m, v]
  if kind == "ftrl":
    lr, power, l1, l2, beta = hp
    acc_new = slots[0] + g * g
    dp = acc_new ** (-power) - slots[0] ** (-power)
    lin = slots[1] + g - dp / lr * w
    num = -lin if l1 == 0 else np.clip(lin, -l1, l1) - lin
    den = (acc_new ** (-power) + beta) / lr + 2 * l2
    return num / den, [acc_new, lin]
  if kind == "laprop":
    lr, b1, decay, eps = hp
    nu = decay * slots[1] + (1 - decay) * (g * g + eps)
    mu = b1 * slots[0] + np.sqrt(1 - b1 * b1) * (g / np.sqrt(nu))
    return w - lr * mu, [mu, nu]
  raise ValueError(kind)


def initial_slots(kind, shape):
  return {
      "sgd": [], "adagrad": [np.full(shape, 0.2)], "adagrad_momentum": [np.full(shape, 0.1), np.zeros(shape)],
      "adam": [np.zeros(shape), np.zeros(shape)], "ftrl": [np.full(shape, 0.1), np.zeros(shape)],
      "laprop": [np.zeros(shape), np.zeros(shape)],
  }[kind]


def close(got, want, what):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert got.shape == want.shape, (what, got.shape, want.shape)
  err = np.max(np.abs(got - want) / np.maximum(1.0, np.abs(want))) if got.size else 0.0
  assert err <= 1e-5, f"{what}: max relative error {err}"


# ---------------------------------------------------------------------------
# Against the numpy bag
# ---------------------------------------------------------------------------


def run_case(kind, g, s, batch, seed, jit, step=None, minibatching=False, limit=256):
  opt = optimizer(kind)
  specs = make_specs(g, s, batch, opt, limit)
  stacks = {sp.table_spec.stacked_table_spec.stack_name for sp in specs.values()}
  ids, weights = make_batch(batch, seed)
  rng = np.random.default_rng(seed + 1)
  tables = {n: rng.uniform(-1, 1, (v, d)).astype(np.float32) for n, v, d, _ in TABLES}
  ev = kernels.stack_tables(tables, specs, global_device_count=g, num_sc_per_device=s)
  assert set(ev) == stacks
  for n, t in kernels.unstack_tables(ev, specs, global_device_count=g, num_sc_per_device=s).items():
    np.testing.assert_array_equal(t, tables[n])  # the layout round-trips exactly
  pre, _ = sparsecore_prep.preprocess_sparse_dense_matmul_input(ids, weights, specs, local_device_count=g,
                                                               global_device_count=g, num_sc_per_device=s,
                                                               enable_minibatching=minibatching)

  def fwd(pre, ev):
    return kernels.sparse_dense_matmul(pre, ev, specs, global_device_count=g, num_sc_per_device=s,
                                       enable_minibatching=minibatching)

  def bwd(grads, pre, ev, step):
    return kernels.sparse_dense_matmul_grad(grads, pre, ev, specs, global_device_count=g, num_sc_per_device=s,
                                            step=step, enable_minibatching=minibatching)

  if jit:
    fwd, bwd = jax.jit(fwd), jax.jit(bwd)
  acts = fwd(pre, ev)
  for f, t in FEATURES:
    close(acts[f], bag_forward(ids[f], weights[f], tables[t].astype(np.float64), combiner_of(f)), f"{kind} act {f}")
  dacts = {f: rng.uniform(-1, 1, np.shape(acts[f])).astype(np.float32) for f, _ in FEATURES}
  new = bwd(dacts, pre, ev, step)
  assert set(new) == stacks and type(new[next(iter(stacks))]) is type(ev[next(iter(stacks))])
  got_tables = kernels.unstack_tables(new, specs, global_device_count=g, num_sc_per_device=s)
  got_slots = [kernels.unstack_tables(new, specs, global_device_count=g, num_sc_per_device=s, variable=i + 1)
               for i in range(len(initial_slots(kind, (1, 1))))]
  dact64 = {f: d.astype(np.float64) for f, d in dacts.items()}
  for n, v, d, _ in TABLES:
    grad, touched = bag_grads([f for f, _ in FEATURES], ids, weights, dact64, n, v, d)
    w = tables[n].astype(np.float64)
    slots = initial_slots(kind, (v, d))
    want_w, want_slots = numpy_step(kind, opt, w[touched], [x[touched] for x in slots], grad[touched], step)
    w = w.copy()
    w[touched] = want_w
    close(got_tables[n], w, f"{kind} table {n}")
    for i, ws in enumerate(want_slots):
      full = slots[i].copy()
      full[touched] = ws
      close(got_slots[i][n], full, f"{kind} slot {i} of {n}")
    assert touched.sum() > 0
  return pre


@pytest.mark.parametrize("kind", ["sgd", "adagrad", "adagrad_momentum", "adam", "ftrl", "laprop"])
def test_every_optimizer_matches_numpy_under_jit(kind):
  run_case(kind, g=2, s=2, batch=16, seed=3, jit=True, step=4)


@pytest.mark.parametrize("g,s", [(1, 2), (1, 4), (2, 4), (4, 2)])
def test_layouts_match_numpy(g, s):
  run_case("adagrad", g=g, s=s, batch=8 * g * s, seed=g * 10 + s, jit=False)


def test_minibatching_matches_numpy():
  # Limits below what the batch needs: preprocessing splits it into minibatches.
  pre = run_case("adagrad", g=2, s=2, batch=64, seed=5, jit=True, minibatching=True, limit=LIMIT_SPLIT)
  assert int(np.ravel(pre.num_minibatches)[0]) > 1


def test_stacks_hold_several_tables():
  specs = make_specs(2, 2, 16, optimizer("sgd"))
  members = {}
  for sp in specs.values():
    members.setdefault(sp.table_spec.stacked_table_spec.stack_name, set()).add(sp.table_spec.name)
  assert any(len(m) > 1 for m in members.values()), members


def test_step_none_and_limits():
  """Without a step (LaProp: decay b2; Adam: step 0) and with embedding_var_limits clipping the table."""
  run_case("laprop", g=1, s=2, batch=8, seed=7, jit=True, step=None)
  g, s, batch = 1, 2, 8
  specs = make_specs(g, s, batch, optimizer("sgd"))
  ids, weights = make_batch(batch, 9)
  tables = {n: np.zeros((v, d), np.float32) for n, v, d, _ in TABLES}
  ev = kernels.stack_tables(tables, specs, global_device_count=g, num_sc_per_device=s)
  pre, _ = sparsecore_prep.preprocess_sparse_dense_matmul_input(ids, weights, specs, local_device_count=g,
                                                               global_device_count=g, num_sc_per_device=s)
  grads = {f: -100.0 * np.ones((batch, 8), np.float32) for f, _ in FEATURES}
  limits = {k: (-0.5, 0.25) for k in ev}
  new = kernels.sparse_dense_matmul_grad(grads, pre, ev, specs, global_device_count=g, num_sc_per_device=s,
                                         embedding_var_limits=limits)
  out = kernels.unstack_tables(new, specs, global_device_count=g, num_sc_per_device=s)
  for n, t in out.items():
    touched = np.unique(np.concatenate([np.concatenate(list(ids[f])) for f, tt in FEATURES if tt == n]))
    np.testing.assert_array_equal(t[touched], 0.25)  # 0 + 0.5 * 100 * gain, clipped at max
    untouched = np.setdiff1d(np.arange(t.shape[0]), touched)
    np.testing.assert_array_equal(t[untouched], 0.0)


def test_perform_unstacking_false_gives_stacked_activations():
  g, s, batch = 2, 2, 16
  specs = make_specs(g, s, batch, optimizer("sgd"))
  ids, weights = make_batch(batch, 11)
  tables = {n: np.ones((v, d), np.float32) for n, v, d, _ in TABLES}
  ev = kernels.stack_tables(tables, specs, global_device_count=g, num_sc_per_device=s)
  pre, _ = sparsecore_prep.preprocess_sparse_dense_matmul_input(ids, weights, specs, local_device_count=g,
                                                               global_device_count=g, num_sc_per_device=s)
  stacked = kernels.sparse_dense_matmul(pre, ev, specs, global_device_count=g, num_sc_per_device=s,
                                        perform_unstacking=False)
  for name, a in stacked.items():
    st = next(sp.table_spec.stacked_table_spec for sp in specs.values()
              if sp.table_spec.stacked_table_spec.stack_name == name)
    assert a.shape == (st.total_sample_count, st.stack_embedding_dim)
  # With all-ones tables a sum-combined sample's activation is the sum of its weights.
  act = kernels.sparse_dense_matmul(pre, ev, specs, global_device_count=g, num_sc_per_device=s)
  np.testing.assert_allclose(np.asarray(act["f0"])[:, 0], [w.sum() for w in weights["f0"]], rtol=1e-6)


# ---------------------------------------------------------------------------
# Typed errors
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small():
  g, s, batch = 1, 2, 8
  specs = make_specs(g, s, batch, optimizer("adagrad"))
  ids, weights = make_batch(batch, 13)
  tables = {n: np.zeros((v, d), np.float32) for n, v, d, _ in TABLES}
  ev = kernels.stack_tables(tables, specs, global_device_count=g, num_sc_per_device=s)
  pre, _ = sparsecore_prep.preprocess_sparse_dense_matmul_input(ids, weights, specs, local_device_count=g,
                                                               global_device_count=g, num_sc_per_device=s)
  grads = {f: np.zeros((batch, 8), np.float32) for f, _ in FEATURES}
  return specs, ev, pre, grads


def test_table_shape_mismatch_names_the_stack_and_tables(small):
  specs, ev, pre, grads = small
  name = next(iter(ev))
  bad = dict(ev)
  bad[name] = ev[name]._replace(table=np.zeros((7, 8), np.float32))
  with pytest.raises(sparsecore_prep.ConfigError, match=rf"stack `{name}`: table of shape \[7, 8\] does not match") as e:
    kernels.sparse_dense_matmul(pre, bad, specs, global_device_count=1, num_sc_per_device=2)
  assert e.value.location == f"stack `{name}`" and e.value.field == "embedding_variables"
  assert "`ta`" in str(e.value) or "`tc`" in str(e.value) or "`td`" in str(e.value)
  with pytest.raises(sparsecore_prep.ConfigError, match="does not match the specs"):
    jax.jit(lambda ev: kernels.sparse_dense_matmul_grad(grads, pre, ev, specs, global_device_count=1,
                                                        num_sc_per_device=2))(bad)


def test_missing_slot_variables_name_the_stack(small):
  specs, ev, pre, grads = small
  name = next(iter(ev))
  bad = dict(ev)
  bad[name] = kernels.EmbeddingVariables(ev[name].table, ())
  with pytest.raises(sparsecore_prep.ConfigError, match=rf"stack `{name}`.*adagrad needs the table and 1 slot variables, "
                     "embedding_variables has 0") as e:
    kernels.sparse_dense_matmul_grad(grads, pre, bad, specs, global_device_count=1, num_sc_per_device=2)
  assert e.value.location == f"stack `{name}`"


def test_nan_hyper_parameter_names_the_stack():
  g, s, batch = 1, 2, 8
  specs = make_specs(g, s, batch, embedding_spec.AdagradMomentumOptimizerSpec(learning_rate=0.1, momentum=float("nan")))
  ids, weights = make_batch(batch, 17)
  tables = {n: np.zeros((v, d), np.float32) for n, v, d, _ in TABLES}
  ev = kernels.stack_tables(tables, specs, global_device_count=g, num_sc_per_device=s)
  pre, _ = sparsecore_prep.preprocess_sparse_dense_matmul_input(ids, weights, specs, local_device_count=g,
                                                               global_device_count=g, num_sc_per_device=s)
  grads = {f: np.zeros((batch, 8), np.float32) for f, _ in FEATURES}
  with pytest.raises(sparsecore_prep.ConfigError, match=r"stack `.*`.*adagrad_momentum hyper-parameter momentum = nan") as e:
    jax.jit(lambda ev: kernels.sparse_dense_matmul_grad(grads, pre, ev, specs, global_device_count=g,
                                                        num_sc_per_device=s))(ev)
  assert e.value.field == "momentum"


def test_activation_gradient_of_the_wrong_shape_names_the_feature(small):
  specs, ev, pre, grads = small
  bad = dict(grads)
  bad["f3"] = np.zeros((8, 4), np.float32)
  with pytest.raises(sparsecore_prep.InvalidInputError, match=r"feature `f3`: activation gradient of shape \[8, 4\], "
                     r"expected \[8, 8\]") as e:
    kernels.sparse_dense_matmul_grad(bad, pre, ev, specs, global_device_count=1, num_sc_per_device=2)
  assert e.value.feature == "f3"


def test_bad_limits_and_options_are_config_errors(small):
  specs, ev, pre, grads = small
  with pytest.raises(sparsecore_prep.ConfigError, match="embedding_var_limits"):
    kernels.sparse_dense_matmul_grad(grads, pre, ev, specs, global_device_count=1, num_sc_per_device=2,
                                     embedding_var_limits={k: (1.0, 0.0) for k in ev})
  with pytest.raises(sparsecore_prep.ConfigError, match="num_sc_per_device must be given"):
    kernels.sparse_dense_matmul(pre, ev, specs, global_device_count=1)


# ---------------------------------------------------------------------------
# The example
# ---------------------------------------------------------------------------


def test_train_jax_cpu_example_learns_and_matches_numpy():
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "python"), os.environ.get("PYTHONPATH", "")]),
             JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "train_jax_cpu.py"), "--steps", "30"],
                        capture_output=True, text=True, env=env, timeout=600)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  losses = [float(x) for x in re.findall(r"^step +\d+ +loss ([0-9.]+)", proc.stdout, re.M)]
  assert len(losses) == 30, proc.stdout
  first, last = np.mean(losses[:5]), np.mean(losses[-5:])
  assert last < 0.9 * first, f"loss did not fall: {first} -> {last}"
  m = re.search(r"numpy check: activations max error ([0-9.e+-]+), tables max error ([0-9.e+-]+)", proc.stdout)
  assert m, proc.stdout
  assert float(m.group(1)) <= 1e-5 and float(m.group(2)) <= 1e-5, m.group(0)
