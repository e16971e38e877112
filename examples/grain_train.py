"""Trains a CTR model from Parquet through a Grain pipeline, on a CPU.

    PYTHONPATH=python python examples/grain_train.py [--epochs 3] [--workers 0]

The loader is sparsecore_prep.grain's: `ParquetBatches` (random-access batches of Parquet rows)
-> `Preprocess` (the features' Arrow columns to SparseCore buffers, the label column beside
them), shuffled and repeated by Grain, optionally in `--workers` worker processes. The model is
written against jax-tpu-embedding's API (`TableSpec` / `FeatureSpec`, Adagrad,
`prepare_feature_specs_for_training`); `sparsecore_prep.kernels` stands in for
`tpu_sparse_dense_matmul(_grad)`, under `jax.jit`, on 2 emulated devices of 2 SparseCores.

The data (written to a temporary directory): Zipf-skewed ids of four features, and labels from a
planted logistic model (every id has a fixed score; a sample's logit is the sum over features of
the mean score of its ids). The limits come from `sparsecore_prep.grain.tune` over the training
files. Training is a few epochs; then the held-out file goes through the same loader for the
forward pass only. The last line is `held-out AUC: 0.xx`; the exit status is non-zero unless the
loss fell by 10% (last epoch against the first steps) and the AUC is at least 0.70.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import grain  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from jax_tpu_embedding.sparsecore.lib.nn import embedding, embedding_spec  # noqa: E402

from sparsecore_prep import kernels  # noqa: E402
from sparsecore_prep.grain import ParquetBatches, Preprocess, tune  # noqa: E402

DEVICES, SC_PER_DEVICE = 2, 2  # one host feeding 2 devices: L = G = 2
LAYOUT = dict(local_device_count=DEVICES, global_device_count=DEVICES, num_sc_per_device=SC_PER_DEVICE)
DIM = 8
LEARNING_RATE = 0.2
# name, vocabulary, combiner, most ids per sample
FEATURES = [("user", 500, "sum", 1), ("item", 1000, "sum", 1), ("category", 50, "mean", 3), ("query", 300, "sqrtn", 4)]


def write_parquet(directory: str, rows: int, files: int, seed: int, scores) -> list[str]:
  """`rows` samples in `files` files (row groups of 1000 rows): one List<Int32> column per feature and
  a float32 label drawn from the planted model."""
  rng = np.random.default_rng(seed)
  paths, per_file = [], -(-rows // files)
  for k in range(files):
    n = min(per_file, rows - k * per_file)
    cols, logit = {}, np.zeros(n)
    for name, vocab, _, most in FEATURES:
      lengths = rng.integers(1, most + 1, n)
      ids = ((rng.zipf(1.2, int(lengths.sum())) - 1) % vocab).astype(np.int32)
      offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
      cols[name] = pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids))
      logit += np.add.reduceat(scores[name][ids], offsets[:-1]) / lengths
    cols["label"] = pa.array((rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.float32))
    path = os.path.join(directory, f"part-{seed}-{k}.parquet")
    pq.write_table(pa.table(cols), path, row_group_size=1000)
    paths.append(path)
  return paths


def make_specs(batch: int):
  adagrad = embedding_spec.AdagradOptimizerSpec(learning_rate=LEARNING_RATE)
  specs = {}
  for name, vocab, combiner, _ in FEATURES:
    table = embedding_spec.TableSpec(
        name=f"{name}_table", vocabulary_size=vocab, embedding_dim=DIM, initializer=jax.nn.initializers.zeros,
        optimizer=adagrad, combiner=combiner, max_ids_per_partition=batch, max_unique_ids_per_partition=batch)
    specs[name] = embedding_spec.FeatureSpec(name=name, table_spec=table, input_shape=[batch, 1],
                                             output_shape=[batch, DIM])
  embedding.prepare_feature_specs_for_training(specs, global_device_count=DEVICES, num_sc_per_device=SC_PER_DEVICE)
  return specs


def logits(activations, head):
  pooled = jnp.concatenate([activations[name] for name, _, _, _ in FEATURES], axis=1)
  return pooled @ head["w"] + head["b"]


def log_loss(activations, head, labels):
  z = logits(activations, head)
  return jnp.mean(jnp.maximum(z, 0) - z * labels + jnp.log1p(jnp.exp(-jnp.abs(z))))


def make_fns(specs):
  layout = dict(global_device_count=DEVICES, num_sc_per_device=SC_PER_DEVICE)

  @jax.jit
  def train_step(preprocessed, variables, head, labels, step):
    activations = kernels.sparse_dense_matmul(preprocessed, variables, specs, **layout)
    loss, (act_grads, head_grads) = jax.value_and_grad(log_loss, argnums=(0, 1))(activations, head, labels)
    variables = kernels.sparse_dense_matmul_grad(act_grads, preprocessed, variables, specs, step=step, **layout)
    head = jax.tree.map(lambda p, g: p - 0.1 * g, head, head_grads)
    return loss, variables, head

  @jax.jit
  def predict(preprocessed, variables, head):
    return logits(kernels.sparse_dense_matmul(preprocessed, variables, specs, **layout), head)

  return train_step, predict


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
  """The area under the ROC curve: the chance a positive outranks a negative (ties count half)."""
  order = np.argsort(scores, kind="stable")
  ranks = np.empty(len(scores))
  s = scores[order]
  ranks[order] = np.arange(1, len(scores) + 1)
  for v in np.unique(s[np.r_[False, s[1:] == s[:-1]]]):  # average the ranks of ties
    tied = scores == v
    ranks[tied] = ranks[tied].mean()
  pos = labels > 0.5
  n_pos, n_neg = int(pos.sum()), int((~pos).sum())
  return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--epochs", type=int, default=3)
  ap.add_argument("--batch", type=int, default=512, help="the global (= local) batch")
  ap.add_argument("--train-rows", type=int, default=24576)
  ap.add_argument("--workers", type=int, default=0, help="Grain worker processes (mp_prefetch)")
  ap.add_argument("--seed", type=int, default=20240611)
  args = ap.parse_args()
  t0 = time.perf_counter()

  planted = np.random.default_rng(args.seed)
  scores = {name: planted.normal(0, 1.5, vocab) for name, vocab, _, _ in FEATURES}
  with tempfile.TemporaryDirectory() as tmp:
    train = write_parquet(tmp, args.train_rows, 2, args.seed + 1, scores)
    held_out = write_parquet(tmp, 8192, 1, args.seed + 2, scores)

    specs = make_specs(args.batch)
    tune(train, specs, headroom=1.2, **LAYOUT)  # limits and buffer sizes from the training data
    stage = Preprocess(specs, **LAYOUT)
    source = ParquetBatches(train, args.batch)
    ds = (grain.MapDataset.source(source).shuffle(seed=args.seed).repeat(args.epochs)
          .map(stage).to_iter_dataset())
    if args.workers:
      ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=args.workers))

    rng = np.random.default_rng(args.seed + 3)
    tables = {f"{name}_table": rng.normal(0, 0.01, (vocab, DIM)).astype(np.float32) for name, vocab, _, _ in FEATURES}
    variables = kernels.stack_tables(tables, specs, global_device_count=DEVICES, num_sc_per_device=SC_PER_DEVICE)
    head = {"w": jnp.full((DIM * len(FEATURES),), 0.5, jnp.float32), "b": jnp.zeros((), jnp.float32)}
    train_step, predict = make_fns(specs)

    losses = []
    for step, (preprocessed, _, rest) in enumerate(ds):
      loss, variables, head = train_step(preprocessed, variables, head, jnp.asarray(rest["label"]), step)
      losses.append(float(loss))
      if step % len(source) == 0 or step == len(source) * args.epochs - 1:
        print(f"epoch {step // len(source)}  step {step:4d}  loss {losses[-1]:.4f}", flush=True)

    got, labels = [], []
    for preprocessed, _, rest in grain.MapDataset.source(ParquetBatches(held_out, args.batch)).map(stage):
      got.append(np.asarray(predict(preprocessed, variables, head)))
      labels.append(rest["label"])
    score = auc(np.concatenate(got), np.concatenate(labels))

  k = min(5, len(losses))
  first, last = float(np.mean(losses[:k])), float(np.mean(losses[-len(source):]))
  print(f"loss: first {k} steps {first:.4f}, last epoch {last:.4f} ({100 * (1 - last / first):.1f}% lower); "
        f"{len(losses)} steps in {time.perf_counter() - t0:.1f} s")
  ok = last <= 0.9 * first and score >= 0.70
  if not ok:
    print("FAILED: the loss must fall by 10% and the held-out AUC reach 0.70", file=sys.stderr)
  print(f"held-out AUC: {score:.2f}")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
