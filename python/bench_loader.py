"""End-to-end loader speed: Parquet -> Grain -> SparseCore buffers, ours against the way users
feed the reference today.

    python python/bench_loader.py [--batches 48] [--files 1] [--workers 0 2] [--repeat 3]

The data: a criteo-like dataset (26 ragged int32 id features f00..f25 over tables of 1e3..1e7
rows, 1 to 5 ids a sample, Zipf-skewed; a float32 label), written once as `--files` Parquet files
(default 1: fewer files than workers) with row groups of 16,384 rows, under `--data-dir`.
Batches of 4,096 samples (the local batch), layout L=1, G=1, S=4; the specs are the reference's
FeatureSpecs, their limits tuned on the data first (`sparsecore_prep.grain.tune`, headroom 1.1).

* ours: `grain.MapDataset.source(ParquetBatches(paths, 4096)).map(Preprocess(specs, ...))`, then
  `.to_iter_dataset().mp_prefetch(workers)`;
* the reference: `grain.experimental.ParquetIterDataset(paths)` (per-row dicts), `.batch(4096,
  batch_fn=...)` stacking the rows into ragged object arrays, a `grain.transforms.Map` calling
  `embedding.preprocess_sparse_dense_matmul_input`, `.mp_prefetch(workers)`.

Each measurement builds a fresh pipeline and iterates it over every batch (the row-group cache of
this process emptied first); the rate is that of batches 2..n, the time to the first batch
(spawning workers, which import Grain and so jax, and the reference) is printed beside it. Grain's Parquet source hands each worker whole files and fails when a worker gets none,
so the reference runs with at most one worker per file (with the default single file, one
worker, where ours uses all of them). Ours and the reference alternate, `--repeat` times per
worker count (the VM is noisy); the medians are printed, as samples/s, and the last line is the
end-to-end speed-up of the last worker count: `end-to-end speed-up: X.XXx`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import grain  # noqa: E402
import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from sparsecore_prep import grain as sg  # noqa: E402
from sparsecore_prep.grain import ParquetBatches, Preprocess, tune  # noqa: E402

FEATURES = 26
BATCH = 4096
L, G, S = 1, 1, 4
ROW_GROUP = 16384


def vocab(i: int) -> int:
  return int(round(10 ** (3 + 4 * i / (FEATURES - 1))))


def write_data(directory: str, batches: int, files: int, seed: int) -> list[str]:
  """The dataset's files (written on the first run with these sizes, then reused)."""
  rows = batches * BATCH
  per_file = -(-rows // files)
  paths = [os.path.join(directory, f"criteo-{rows}-{files}-{seed}-{k}.parquet") for k in range(files)]
  if all(os.path.exists(p) for p in paths):
    return paths
  rng = np.random.default_rng(seed)
  for k, path in enumerate(paths):
    n = min(per_file, rows - k * per_file)
    cols = {}
    for i in range(FEATURES):
      v = vocab(i)
      lengths = rng.integers(1, 2 + i % 5, n)
      total = int(lengths.sum())
      ranks = np.minimum(rng.zipf(1.1, total) - 1, 2**40)
      ids = ((ranks * 2654435761 + 12345) % v).astype(np.int32)
      offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
      cols[f"f{i:02d}"] = pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids))
    cols["label"] = pa.array((rng.random(n) < 0.25).astype(np.float32))
    pq.write_table(pa.table(cols), path + ".tmp", row_group_size=ROW_GROUP)
    os.replace(path + ".tmp", path)
  return paths


def make_specs():
  import jax
  from jax_tpu_embedding.sparsecore.lib.nn import embedding, embedding_spec

  specs = {}
  for i in range(FEATURES):
    name = f"f{i:02d}"
    table = embedding_spec.TableSpec(
        name=f"t{i:02d}", vocabulary_size=vocab(i), embedding_dim=16, initializer=jax.nn.initializers.zeros,
        optimizer=embedding_spec.SGDOptimizerSpec(), combiner="sum", max_ids_per_partition=4096,
        max_unique_ids_per_partition=4096)
    specs[name] = embedding_spec.FeatureSpec(name=name, table_spec=table, input_shape=[BATCH * G // L, 1],
                                             output_shape=[BATCH * G // L, 16])
  embedding.prepare_feature_specs_for_training(specs, global_device_count=G, num_sc_per_device=S)
  return specs


class ReferencePreprocess(grain.transforms.Map):
  """The reference's call as a Grain map over a batch of ragged features."""

  def __init__(self, specs):
    self.specs = specs

  def map(self, batch):
    from jax_tpu_embedding.sparsecore.lib.nn import embedding

    features, labels = batch
    preprocessed, stats = embedding.preprocess_sparse_dense_matmul_input(
        features, None, self.specs, L, G, num_sc_per_device=S)
    return preprocessed, stats, {"label": labels}


def ragged_rows(rows):
  """Grain's per-row dicts (each id list an int32 array) as the reference's ragged features."""
  features = {}
  for i in range(FEATURES):
    name = f"f{i:02d}"
    col = np.empty(len(rows), dtype=object)
    col[:] = [r[name] for r in rows]
    features[name] = col
  return features, np.array([r["label"] for r in rows], np.float32)


def pipeline(kind: str, paths, specs, workers: int):
  if kind == "ours":
    ds = (grain.MapDataset.source(ParquetBatches(paths, BATCH))
          .map(Preprocess(specs, local_device_count=L, global_device_count=G, num_sc_per_device=S))
          .to_iter_dataset())
  else:
    ds = (grain.experimental.ParquetIterDataset(paths)
          .batch(BATCH, drop_remainder=True, batch_fn=ragged_rows)
          .map(ReferencePreprocess(specs)))
  if workers:
    ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
  return ds


def measure(kind: str, paths, specs, workers: int) -> tuple[float, float, int]:
  """Samples per second from the first batch to the last, the seconds from building the
  pipeline to its first batch (worker start-up), and the batches seen."""
  sg._ROW_GROUPS = sg._RowGroupCache(sg._ROW_GROUPS.capacity)  # no row group decoded by an earlier run
  t0 = time.perf_counter()
  it = iter(pipeline(kind, paths, specs, workers))
  n, first = 0, None
  for pre, stats, rest in it:
    n += 1
    assert rest["label"].shape == (BATCH,)
    if first is None:
      first = time.perf_counter()
  end = time.perf_counter()
  if hasattr(it, "close"):
    it.close()
  return (n - 1) * BATCH / (end - first), first - t0, n


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--batches", type=int, default=48)
  ap.add_argument("--files", type=int, default=1)
  ap.add_argument("--workers", type=int, nargs="+", default=[0, 2])
  ap.add_argument("--repeat", type=int, default=3)
  ap.add_argument("--seed", type=int, default=7)
  ap.add_argument("--data-dir", default=os.path.join(tempfile.gettempdir(), "sparsecore-bench-loader"))
  args = ap.parse_args()

  os.makedirs(args.data_dir, exist_ok=True)
  paths = write_data(args.data_dir, args.batches, args.files, args.seed)
  specs = make_specs()
  t = time.perf_counter()
  tune(paths, specs, headroom=1.1, local_device_count=L, global_device_count=G, num_sc_per_device=S)
  print(f"data: {len(paths)} file(s), {args.batches} batches of {BATCH} samples, {FEATURES} features; "
        f"tuned the limits in {time.perf_counter() - t:.2f} s")
  ratio = None
  for workers in args.workers:
    rates = {"ours": [], "reference": []}
    startup = {"ours": [], "reference": []}
    # ParquetIterDataset hands each worker whole files: a worker without a file fails (IndexError
    # in Grain's interleave), so the reference runs with at most one worker per file.
    ref_workers = min(workers, len(paths))
    if ref_workers != workers:
      print(f"workers {workers}: the reference runs {ref_workers} worker(s) ({len(paths)} file(s); "
            f"ParquetIterDataset fails with more workers than files)")
    for _ in range(args.repeat):
      for kind in ("ours", "reference"):
        rate, start, n = measure(kind, paths, specs, workers if kind == "ours" else ref_workers)
        if n != args.batches:
          print(f"{kind}: saw {n} batches, expected {args.batches}", file=sys.stderr)
          return 1
        rates[kind].append(rate)
        startup[kind].append(start)
    ours, theirs = statistics.median(rates["ours"]), statistics.median(rates["reference"])
    ratio = ours / theirs
    print(f"workers {workers}: ours {ours:,.0f} samples/s, reference {theirs:,.0f} samples/s, {ratio:.2f}x "
          f"(runs: ours {', '.join(f'{r:,.0f}' for r in rates['ours'])}; "
          f"reference {', '.join(f'{r:,.0f}' for r in rates['reference'])}); first batch after "
          f"{statistics.median(startup['ours']):.1f} s / {statistics.median(startup['reference']):.1f} s",
          flush=True)
  print(f"end-to-end speed-up: {ratio:.2f}x")
  return 0


if __name__ == "__main__":
  sys.exit(main())
