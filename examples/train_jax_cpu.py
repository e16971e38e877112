"""Trains a small CTR model written against jax-tpu-embedding's API, on a CPU.

    PYTHONPATH=python python examples/train_jax_cpu.py [--steps 40]

The model is written the way the reference's users write it: `TableSpec` /
`FeatureSpec` with an Adagrad optimizer spec, `prepare_feature_specs_for_training`,
then per step: preprocess the batch, `tpu_sparse_dense_matmul` for the pooled
embeddings, a dense head and the log loss, `jax.grad` for the activation
gradients, and `tpu_sparse_dense_matmul_grad` to update the tables. Those
three calls need a TPU; here they are swapped for sparsecore_prep's
(`preprocess_sparse_dense_matmul_input`, `kernels.sparse_dense_matmul`,
`kernels.sparse_dense_matmul_grad`), which run on the CPU, inside `jax.jit`.
Nothing else changes.

The labels come from a planted logistic model over the ids (every id of every
table has a fixed score; a sample's logit is the sum of its ids' scores), so
the loss can fall. The run emulates 2 devices of 2 SparseCores each.

It prints the loss of every step, and then checks the kernels against a plain
numpy embedding bag of the same math on the first steps: activations
(combiner-weighted sums of table rows) and the tables after one Adagrad step
on every touched row (`a += g^2; w -= lr * g / sqrt(a)`). It exits non-zero
unless the loss fell by at least 10% (mean of the last five steps against the
first five) and both checks agree to 1e-5.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax_tpu_embedding.sparsecore.lib.nn import embedding, embedding_spec  # noqa: E402

import sparsecore_prep  # noqa: E402
from sparsecore_prep import kernels  # noqa: E402

# The swap: on a TPU these would be embedding.preprocess_sparse_dense_matmul_input,
# embedding.tpu_sparse_dense_matmul and embedding.tpu_sparse_dense_matmul_grad.
preprocess = sparsecore_prep.preprocess_sparse_dense_matmul_input
sparse_dense_matmul = kernels.sparse_dense_matmul
sparse_dense_matmul_grad = kernels.sparse_dense_matmul_grad

GLOBAL_DEVICES, SC_PER_DEVICE = 2, 2
DIM = 16
LEARNING_RATE = 0.1
# name, vocabulary, combiner, ids per sample
FEATURES = [("user", 2000, "sum", 1), ("item", 5000, "sum", 1), ("category", 200, "mean", 3), ("query", 3000, "sqrtn", 4)]
CHECK_STEPS = 3


def make_specs(batch: int):
  adagrad = embedding_spec.AdagradOptimizerSpec(learning_rate=LEARNING_RATE)
  specs = {}
  for name, vocab, combiner, _ in FEATURES:
    table = embedding_spec.TableSpec(
        name=f"{name}_table", vocabulary_size=vocab, embedding_dim=DIM, initializer=jax.nn.initializers.zeros,
        optimizer=adagrad, combiner=combiner, max_ids_per_partition=1024, max_unique_ids_per_partition=1024)
    specs[name] = embedding_spec.FeatureSpec(name=name, table_spec=table, input_shape=[batch, 1],
                                             output_shape=[batch, DIM])
  embedding.prepare_feature_specs_for_training(specs, global_device_count=GLOBAL_DEVICES,
                                               num_sc_per_device=SC_PER_DEVICE)
  return specs


class Data:
  """Zipf-skewed ids and labels from a planted logistic model."""

  def __init__(self, seed: int):
    self.rng = np.random.default_rng(seed)
    planted = np.random.default_rng(seed + 1)
    self.scores = {name: planted.normal(0, 1, vocab) for name, vocab, _, _ in FEATURES}

  def batch(self, size: int):
    ids, weights, logit = {}, {}, np.zeros(size)
    for name, vocab, combiner, per_sample in FEATURES:
      rows, ws = [], []
      for i in range(size):
        r = (self.rng.zipf(1.3, per_sample) - 1) % vocab
        w = np.ones(per_sample, np.float32)
        rows.append(r.astype(np.int32))
        ws.append(w)
        logit[i] += self.scores[name][r].mean()
      ids[name] = np.array(rows + [None], dtype=object)[:-1]
      weights[name] = np.array(ws + [None], dtype=object)[:-1]
    labels = (self.rng.random(size) < 1 / (1 + np.exp(-2.0 * logit))).astype(np.float32)
    return ids, weights, labels


def head_logits(activations, head):
  pooled = jnp.concatenate([activations[name] for name, _, _, _ in FEATURES], axis=1)
  return pooled @ head["w"] + head["b"]


def loss_fn(activations, head, labels):
  z = head_logits(activations, head)
  return jnp.mean(jnp.maximum(z, 0) - z * labels + jnp.log1p(jnp.exp(-jnp.abs(z))))


def make_step(specs):
  def step(preprocessed, embedding_variables, head, labels, step_number):
    activations = sparse_dense_matmul(preprocessed, embedding_variables, specs, global_device_count=GLOBAL_DEVICES,
                                      num_sc_per_device=SC_PER_DEVICE)
    loss, (act_grads, head_grads) = jax.value_and_grad(loss_fn, argnums=(0, 1))(activations, head, labels)
    new_variables = sparse_dense_matmul_grad(act_grads, preprocessed, embedding_variables, specs,
                                             global_device_count=GLOBAL_DEVICES, num_sc_per_device=SC_PER_DEVICE,
                                             step=step_number)
    new_head = jax.tree.map(lambda p, g: p - 0.5 * g, head, head_grads)
    return loss, activations, act_grads, new_variables, new_head

  return jax.jit(step)


# ---------------------------------------------------------------------------
# The plain numpy embedding bag the kernels are checked against.
# ---------------------------------------------------------------------------


def bag_gains(w, combiner):
  w = w.astype(np.float64)
  return {"sum": w, "mean": w / w.sum(), "sqrtn": w / np.sqrt((w * w).sum())}[combiner]


def numpy_forward(tables, ids, weights):
  out = {}
  for name, _, combiner, _ in FEATURES:
    t = tables[f"{name}_table"].astype(np.float64)
    out[name] = np.stack([(bag_gains(w, combiner)[:, None] * t[r]).sum(0) for r, w in zip(ids[name], weights[name])])
  return out


def numpy_adagrad(tables, accumulators, ids, weights, act_grads):
  new = {}
  for name, vocab, combiner, _ in FEATURES:
    key = f"{name}_table"
    g = np.zeros((vocab, DIM))
    touched = np.zeros(vocab, bool)
    dact = np.asarray(act_grads[name], np.float64)
    for i, (r, w) in enumerate(zip(ids[name], weights[name])):
      np.add.at(g, r, bag_gains(w, combiner)[:, None] * dact[i][None, :])
      touched[r] = True
    w, a = tables[key].astype(np.float64), accumulators[key].astype(np.float64)
    a[touched] += g[touched] ** 2
    w[touched] -= LEARNING_RATE * g[touched] / np.sqrt(a[touched])
    new[key] = w
  return new


def max_rel_error(got: dict, want: dict) -> float:
  return max(float(np.max(np.abs(np.asarray(got[k], np.float64) - want[k]) / np.maximum(1.0, np.abs(want[k]))))
             for k in want)


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=40)
  parser.add_argument("--batch", type=int, default=512)
  parser.add_argument("--seed", type=int, default=20240611)
  args = parser.parse_args()

  specs = make_specs(args.batch)
  rng = np.random.default_rng(args.seed + 2)
  tables = {f"{name}_table": rng.normal(0, 0.01, (vocab, DIM)).astype(np.float32) for name, vocab, _, _ in FEATURES}
  layout = dict(global_device_count=GLOBAL_DEVICES, num_sc_per_device=SC_PER_DEVICE)
  embedding_variables = kernels.stack_tables(tables, specs, **layout)
  # A non-zero head, so that the embeddings get gradients from the first step.
  head = {"w": jnp.full((DIM * len(FEATURES),), 0.5, jnp.float32), "b": jnp.zeros((), jnp.float32)}
  step_fn = make_step(specs)
  data = Data(args.seed)

  losses, act_error, table_error = [], 0.0, 0.0
  for step in range(args.steps):
    ids, weights, labels = data.batch(args.batch)
    preprocessed, _ = preprocess(ids, weights, specs, local_device_count=GLOBAL_DEVICES, **layout)
    loss, activations, act_grads, new_variables, head = step_fn(preprocessed, embedding_variables, head,
                                                                jnp.asarray(labels), step)
    if step < CHECK_STEPS:
      before = kernels.unstack_tables(embedding_variables, specs, **layout)
      accumulators = kernels.unstack_tables(embedding_variables, specs, variable=1, **layout)
      act_error = max(act_error, max_rel_error(activations, numpy_forward(before, ids, weights)))
      after = kernels.unstack_tables(new_variables, specs, **layout)
      table_error = max(table_error, max_rel_error(after, numpy_adagrad(before, accumulators, ids, weights, act_grads)))
    embedding_variables = new_variables
    losses.append(float(loss))
    print(f"step {step:3d}  loss {float(loss):.6f}", flush=True)

  print(f"numpy check: activations max error {act_error:.3g}, tables max error {table_error:.3g} "
        f"(first {min(CHECK_STEPS, args.steps)} steps, relative to max(1, |x|))")
  k = min(5, len(losses))
  first, last = float(np.mean(losses[:k])), float(np.mean(losses[-k:]))
  print(f"loss: first {k} steps {first:.4f}, last {k} steps {last:.4f} ({100 * (1 - last / first):.1f}% lower)")
  ok = last <= 0.9 * first and act_error <= 1e-5 and table_error <= 1e-5
  if not ok:
    print("FAILED: the loss must fall by 10% and the kernels must match numpy to 1e-5", file=sys.stderr)
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
