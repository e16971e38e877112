"""Times our drop-in calls against the reference's on the same numpy inputs.

    python python/bench.py --sweep [--json]        # the whole table below, one command
    python python/bench.py [--workloads criteo long] [--batch-size B] [--untuned] [--repeat 11] [--warmup 2] [--json]

Loader workloads: `../shared/peer/make_workload.py`'s `criteo` and `long` profiles (default
sizes, or B samples a batch with `--batch-size`, as a data loader calls it per batch; layout
1/1/4, no weights), generated into `target/peer/` once. Tuned: the generated config's limits and
suggested COO buffer (the exact maxima, as FDO converges to). `--untuned` raises every table's
limits to 65536 (or keeps a larger one) with no suggested buffer, as before FDO has tuned
anything. Their Arrow batches become what the reference takes: ragged numpy object arrays of
int32 ids, one per feature (as `run_peer.py` builds them), and the reference's own FeatureSpecs,
stacked by `prepare_feature_specs_for_training`.

The reference's own benchmark shape (`refbench`; jax-tpu-embedding's
`jax_tpu_embedding/sparsecore/lib/nn/tests/preprocess_input_benchmarks.py`, the Python benchmark
of the drop-in entry points; its C++ micro-benchmark `input_preprocessing_benchmark.cc` times
internal stages, not these calls): 100 features, each with a table of its own (vocabulary 1,024,
dim 16, sum, limits 1,024, one stack per table), 16,000 samples a batch, 1 to 31 ids per sample
(uniform, mean 16: about 25.6 M ids a batch), ids uniform in [0, 1024), int32; local 4 devices of
16, 4 SparseCores each. Ragged: object arrays of the rows `np.split` cuts from one id array.
COO (`refbench-coo`): per feature `[nnz, 2]` int64 indices (row, position), `[nnz]` int32 values,
dense shape `[16000, 1024]`, through both packages'
`preprocess_sparse_dense_matmul_input_from_sparse_tensor` (the reference 0.1.0 has this entry
point). As there, the first call runs with `allow_id_dropping` and its stats tune the specs
(`update_preprocessing_parameters`, headroom 1.0) before anything is timed. Same seed-driven ids
on both sides, not the reference's random stream.

Both calls get exactly these objects, and both timings include the call's Python-side argument
handling (pytree flattening, spec reading, result objects), with the default thread counts of
both (one thread per CPU). The outputs are checked to be identical inside the reference's written
ranges before anything is timed. Calls alternate: a pass times a block of k calls of the
reference, then k of ours (k such that a block takes about 50 ms); reported are the medians over
passes of the time per call, wall and CPU (all threads; on a shared machine the CPU time is the
steadier number), and their ratios reference/ours.

`--sweep` runs 64, 512 and 4,096 samples, tuned and untuned, of criteo and long; one run with 4
caller threads (`--threads`) calling concurrently, each on a batch of its own (as keras-rs's MLPerf
loader calls the drop-in from 4 threads), whose ratio is of the aggregate throughput (calls of all
threads per second of wall time, the reference's phase against ours, alternated); and `refbench`
and `refbench-coo` (`--no-refbench` leaves them out).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SHARED = os.environ.get("SPARSECORE_SHARED", os.path.join(ROOT, "..", "shared"))
sys.path.insert(0, os.path.join(HERE, "tests"))

os.environ.setdefault("JAX_PLATFORMS", "cpu")

SWEEP_SIZES = (64, 512, 4096)


def workload(name: str, batch_size: int | None, num_batches: int = 1) -> tuple[str, str]:
  out = os.path.join(ROOT, "target", "peer")
  os.makedirs(out, exist_ok=True)
  stem = f"bench_{name}" if batch_size is None else f"bench_{name}_b{batch_size}"
  if num_batches > 1:
    stem += f"_k{num_batches}"
  arrow, cfg = os.path.join(out, f"{stem}.arrow"), os.path.join(out, f"{stem}.json")
  if not (os.path.exists(arrow) and os.path.exists(cfg)):
    size = [] if batch_size is None else ["--batch-size", str(batch_size)]
    subprocess.run([sys.executable, os.path.join(SHARED, "peer", "make_workload.py"), "--profile", name,
                    "--out", arrow, "--config-out", cfg, "--num-batches", str(num_batches), *size],
                   check=True, stdout=subprocess.DEVNULL)
  return arrow, cfg


def numpy_inputs(arrow: str, config: dict, batch: int = 0):
  """Ragged object arrays of int32 ids per feature (dict by feature name), from record batch
  `batch`."""
  import pyarrow as pa

  with pa.memory_map(arrow) as src:
    rb = pa.ipc.open_file(src).get_batch(batch)
  feats = {}
  for f in config["features"]:
    col = rb.column(f.get("column") or f["name"])
    offsets = col.offsets.to_numpy()
    ids = col.values.to_numpy().astype(np.int32)
    rows = np.empty(len(col), dtype=object)
    for i in range(len(col)):
      rows[i] = ids[offsets[i]:offsets[i + 1]]
    feats[f["name"]] = rows
  return feats, rb.num_rows


def case_of(config: dict, rows: int) -> dict:
  c = config["config"]
  l, g = c["local_device_count"], c["global_device_count"]
  return {"local_device_count": l, "global_device_count": g, "num_sc_per_device": c["num_sc_per_device"],
          "stacking": c.get("stacking", "feature"), "allow_id_dropping": c.get("allow_id_dropping", False),
          "tables": config["tables"],
          "features": [{"name": f["name"], "table": f["table"], "global_batch_size": rows * g // l}
                       for f in config["features"]]}


class Point:
  """One row of the table: both sides' calls on the same inputs, and what they are."""

  def __init__(self, label: dict, num_ids: int, reference_call, our_call, case: dict):
    self.label, self.num_ids = label, num_ids
    self.reference_call, self.our_call, self.case = reference_call, our_call, case

  def check(self) -> None:
    """Same answer before timing (valid ranges of each SparseCore segment)."""
    import reference as ref
    ref.compare(self.case, ref.plain(self.reference_call()), ref.plain(self.our_call()))


def loader_point(name: str, batch_size: int | None, untuned: bool, batch: int = 0, num_batches: int = 1) -> Point:
  """criteo or long at `batch_size` samples (record batch `batch` of `num_batches`)."""
  import reference as ref
  from jax_tpu_embedding.sparsecore.lib.nn import embedding

  import sparsecore_prep as scp

  arrow, cfg_path = workload(name, batch_size, num_batches)
  with open(cfg_path) as fh:
    config = json.load(fh)
  if untuned:
    for t in config["tables"]:
      for limit in ("max_ids_per_partition", "max_unique_ids_per_partition"):
        t[limit] = max(65536, t[limit])
      t["suggested_coo_buffer_size_per_device"] = None
  feats, rows = numpy_inputs(arrow, config, batch)
  case = case_of(config, rows)
  specs = ref.build_specs(case)
  opts = ref.call_options(case)
  opts["batch_number"] = 1  # as run_peer.py: no periodic logging
  num_ids = sum(sum(len(r) for r in v) for v in feats.values())
  label = {"workload": name, "samples": rows, "limits": "untuned" if untuned else "tuned", "input": "ragged"}
  return Point(label, num_ids,
               lambda: embedding.preprocess_sparse_dense_matmul_input(feats, None, specs, **opts),
               lambda: scp.preprocess_sparse_dense_matmul_input(feats, None, specs, **opts), case)


REFBENCH = {"features": 100, "samples": 16000, "vocab": 1024, "dim": 16, "limit": 1024, "max_ids_per_sample": 31,
            "local_device_count": 4, "global_device_count": 16, "num_sc_per_device": 4}


def refbench_points(features: int, samples: int, seed: int = 0) -> list[Point]:
  """The reference benchmark's shape (module docs), ragged and COO, on FDO-tuned specs."""
  import jax
  from jax_tpu_embedding.sparsecore.lib.nn import embedding, embedding_spec

  import sparsecore_prep as scp

  rb = REFBENCH
  l, g, s = rb["local_device_count"], rb["global_device_count"], rb["num_sc_per_device"]
  specs = []
  for i in range(features):
    table = embedding_spec.TableSpec(
        name=f"table_{i}", vocabulary_size=rb["vocab"], embedding_dim=rb["dim"],
        initializer=jax.nn.initializers.zeros, optimizer=embedding_spec.SGDOptimizerSpec(learning_rate=0.001),
        combiner="sum", max_ids_per_partition=rb["limit"], max_unique_ids_per_partition=rb["limit"])
    specs.append(embedding_spec.FeatureSpec(name=f"feature_spec_{i}", table_spec=table,
                                            input_shape=[samples, 1], output_shape=[samples, rb["dim"]]))
  embedding.prepare_feature_specs_for_training(specs, global_device_count=g, num_sc_per_device=s)

  rng = np.random.default_rng(seed)
  ragged, indices, values, shapes = [], [], [], []
  for _ in range(features):
    counts = rng.integers(1, rb["max_ids_per_sample"] + 1, size=samples)
    ids = rng.integers(0, rb["vocab"], size=int(counts.sum()), dtype=np.int32)
    rows = np.empty(samples, dtype=object)
    rows[:] = np.split(ids, np.cumsum(counts)[:-1])
    ragged.append(rows)
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    indices.append(np.stack([np.repeat(np.arange(samples), counts), np.arange(ids.size) - starts],
                            axis=1).astype(np.int64))
    values.append(ids)
    shapes.append(np.array([samples, rb["vocab"]], dtype=np.int64))
  num_ids = sum(int(v.size) for v in values)

  opts = dict(local_device_count=l, global_device_count=g, num_sc_per_device=s, allow_id_dropping=True,
              batch_number=0)
  # As the reference's benchmark: the first batch (ids over the limits dropped) tunes the specs.
  stats = embedding.preprocess_sparse_dense_matmul_input(ragged, None, specs, **opts)[1]
  for per_stack in (stats.max_ids_per_partition, stats.max_unique_ids_per_partition,
                    stats.required_buffer_size_per_sc):
    for stack, v in per_stack.items():
      per_stack[stack] = np.array([int(np.max(v))])
  embedding.update_preprocessing_parameters(specs, stats, num_sc_per_device=s)
  opts.update(allow_id_dropping=False, batch_number=1)
  case = {"local_device_count": l, "global_device_count": g, "num_sc_per_device": s}
  label = {"workload": "refbench", "samples": samples, "limits": "fdo"}
  return [
      Point(dict(label, input="ragged"), num_ids,
            lambda: embedding.preprocess_sparse_dense_matmul_input(ragged, None, specs, **opts),
            lambda: scp.preprocess_sparse_dense_matmul_input(ragged, None, specs, **opts), case),
      Point(dict(label, workload="refbench-coo", input="coo"), num_ids,
            lambda: embedding.preprocess_sparse_dense_matmul_input_from_sparse_tensor(
                indices, values, shapes, specs, **opts),
            lambda: scp.preprocess_sparse_dense_matmul_input_from_sparse_tensor(
                indices, values, shapes, specs, **opts), case),
  ]


def timed(point: Point, repeat: int, warmup: int, block_s: float = 0.05) -> dict:
  """Alternating blocks of k calls, reference then ours; medians of the per-call times."""
  point.check()
  t0 = time.perf_counter()
  point.reference_call()
  k = max(1, int(block_s / max(time.perf_counter() - t0, 1e-6)))
  wall = {"reference": [], "ours": []}
  cpu = {"reference": [], "ours": []}
  for i in range(warmup + repeat):
    for side, fn in (("reference", point.reference_call), ("ours", point.our_call)):
      c0, t0 = time.process_time(), time.perf_counter()
      for _ in range(k):
        fn()
      dt, dc = time.perf_counter() - t0, time.process_time() - c0
      if i >= warmup:
        wall[side].append(dt / k * 1e3)
        cpu[side].append(dc / k * 1e3)
  return summary(point, wall, cpu, repeat, k)


def timed_threads(points: list[Point], repeat: int, warmup: int, block_s: float = 0.2) -> dict:
  """len(points) caller threads at once, each calling on its own point's batch, k calls each;
  reference phases alternate with ours. Per-call figures are phase time / (threads * k)."""
  n = len(points)
  for p in points:
    p.check()
  t0 = time.perf_counter()
  for p in points:
    p.reference_call()
  k = max(1, int(block_s / max(time.perf_counter() - t0, 1e-6)))

  def loop(fn):
    for _ in range(k):
      fn()

  wall = {"reference": [], "ours": []}
  cpu = {"reference": [], "ours": []}
  with concurrent.futures.ThreadPoolExecutor(max_workers=n) as pool:
    for i in range(warmup + repeat):
      for side in ("reference", "ours"):
        fns = [p.reference_call if side == "reference" else p.our_call for p in points]
        c0, t0 = time.process_time(), time.perf_counter()
        for f in [pool.submit(loop, fn) for fn in fns]:
          f.result()
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        if i >= warmup:
          wall[side].append(dt / (n * k) * 1e3)
          cpu[side].append(dc / (n * k) * 1e3)
  head = points[0]
  merged = Point(dict(head.label, threads=n), sum(p.num_ids for p in points) // n, None, None, head.case)
  return summary(merged, wall, cpu, repeat, k)


def summary(point: Point, wall: dict, cpu: dict, repeat: int, k: int) -> dict:
  ref_ms, our_ms = float(np.median(wall["reference"])), float(np.median(wall["ours"]))
  ref_cpu, our_cpu = float(np.median(cpu["reference"])), float(np.median(cpu["ours"]))
  return dict(point.label, ids=point.num_ids, repeat=repeat, calls_per_block=k,
              reference_median_ms=ref_ms, ours_median_ms=our_ms,
              reference_min_ms=min(wall["reference"]), ours_min_ms=min(wall["ours"]),
              speedup=ref_ms / our_ms, reference_cpu_ms=ref_cpu, ours_cpu_ms=our_cpu, cpu_ratio=ref_cpu / our_cpu,
              load_1min=os.getloadavg()[0])


HEADER = (f"{'workload':<13} {'samples':>8} {'limits':<8} {'input':<6} {'ids':>11} {'reference ms':>13} "
          f"{'ours ms':>9} {'speed-up':>9} {'CPU ratio':>10}")


def row(r: dict) -> str:
  samples = f"{r.get('threads', 1)}x{r['samples']}" if r.get("threads") else f"{r['samples']:,}"
  return (f"{r['workload']:<13} {samples:>8} {r['limits']:<8} {r['input']:<6} {r['ids']:>11,} "
          f"{r['reference_median_ms']:>13.3f} {r['ours_median_ms']:>9.3f} {r['speedup']:>8.2f}x "
          f"{r['cpu_ratio']:>9.2f}x")


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--sweep", action="store_true",
                 help="criteo and long at --batch-sizes, tuned and untuned; --threads callers; refbench")
  p.add_argument("--workloads", nargs="+", default=["criteo", "long"])
  p.add_argument("--batch-size", type=int, default=None, help="samples a batch (default: the profile's)")
  p.add_argument("--batch-sizes", type=int, nargs="+", default=list(SWEEP_SIZES), help="--sweep's sizes")
  p.add_argument("--untuned", action="store_true", help="limits 65536, no suggested buffer (before FDO)")
  p.add_argument("--threads", type=int, default=4, help="--sweep's concurrent callers (0: none)")
  p.add_argument("--threads-workload", default="criteo")
  p.add_argument("--threads-batch-size", type=int, default=512)
  p.add_argument("--scaling", action="store_true",
                 help="only 1, 2 and 4 caller threads on --threads-workload at --threads-batch-size (untuned with "
                      "--untuned): per-call times and each side's throughput against its own one thread")
  p.add_argument("--no-refbench", action="store_true", help="--sweep without the reference benchmark's shape")
  p.add_argument("--refbench", action="store_true", help="only the reference benchmark's shape")
  p.add_argument("--refbench-features", type=int, default=REFBENCH["features"])
  p.add_argument("--refbench-samples", type=int, default=REFBENCH["samples"])
  p.add_argument("--repeat", type=int, default=11)
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--json", action="store_true", help="one JSON line per row instead of a table")
  args = p.parse_args(argv)

  jobs = []  # (label for progress, thunk returning a row)
  if args.scaling:
    return scaling(args)
  if args.sweep or not args.refbench:
    sizes = args.batch_sizes if args.sweep else [args.batch_size]
    modes = (False, True) if args.sweep else (args.untuned,)
    for name in args.workloads:
      for size in sizes:
        for untuned in modes:
          jobs.append(lambda name=name, size=size, untuned=untuned:
                      [timed(loader_point(name, size, untuned), args.repeat, args.warmup)])
  if args.sweep and args.threads > 0:
    n, size, name = args.threads, args.threads_batch_size, args.threads_workload
    jobs.append(lambda: [timed_threads([loader_point(name, size, False, b, n) for b in range(n)],
                                       args.repeat, args.warmup)])
  if args.refbench or (args.sweep and not args.no_refbench):
    repeat = max(3, math.ceil(args.repeat / 2))
    jobs.append(lambda: [timed(pt, repeat, 1) for pt in refbench_points(args.refbench_features,
                                                                          args.refbench_samples)])

  rows = []
  if not args.json:
    print(HEADER, flush=True)
  for job in jobs:
    for r in job():
      rows.append(r)
      print(json.dumps(r) if args.json else row(r), flush=True)
  if not args.json and len(rows) > 1:
    ratios = [r["speedup"] for r in rows]
    print(f"speed-up: min {min(ratios):.2f}x, geometric mean {math.exp(np.mean(np.log(ratios))):.2f}x, "
          f"points below 4x: {sum(x < 4 for x in ratios)} of {len(ratios)}")
  return 0


def scaling(args) -> int:
  """1, 2 and 4 callers, each on its own batch, as a loader's threads call: both sides' per-call
  wall time and their throughput relative to their own single caller."""
  name, size = args.threads_workload, args.threads_batch_size
  rows = []
  for n in (1, 2, 4):
    r = timed_threads([loader_point(name, size, args.untuned, b, 4) for b in range(n)], args.repeat, args.warmup)
    rows.append(r)
  base = rows[0]
  if args.json:
    for r in rows:
      print(json.dumps(r))
    return 0
  print(f"{name}, {size} samples a call, {'untuned' if args.untuned else 'tuned'}; calls/s = callers / per-call time")
  print(f"{'callers':>7} {'reference ms':>13} {'ours ms':>9} {'speed-up':>9} {'reference x1':>13} {'ours x1':>9}")
  for r in rows:
    print(f"{r['threads']:>7} {r['reference_median_ms']:>13.3f} {r['ours_median_ms']:>9.3f} {r['speedup']:>8.2f}x "
          f"{base['reference_median_ms'] / r['reference_median_ms']:>12.2f}x "
          f"{base['ours_median_ms'] / r['ours_median_ms']:>8.2f}x")
  return 0


if __name__ == "__main__":
  sys.exit(main())
