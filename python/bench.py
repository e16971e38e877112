"""Times our drop-in call against the reference's on the same numpy inputs.

    python python/bench.py [--workloads criteo long] [--batch-size B] [--untuned] [--repeat 11] [--warmup 2] [--json]

Workloads are `../shared/peer/make_workload.py`'s `criteo` and `long` profiles (default sizes, or
B samples a batch with `--batch-size`, as a data loader calls it per batch; layout 1/1/4, no
weights), generated into `target/peer/` once. `--untuned` raises every table's limits to 65536
(or keeps a larger one) with no suggested buffer, as before FDO has tuned anything. Their Arrow batches become what
the reference takes: ragged numpy object arrays of int32 ids, one per feature (as
`run_peer.py` builds them), and the reference's own FeatureSpecs, stacked by
`prepare_feature_specs_for_training`. Both calls get exactly these objects, and both timings
include the call's Python-side argument handling (pytree flattening, spec reading, result
objects): `embedding.preprocess_sparse_dense_matmul_input(...)` against
`sparsecore_prep.preprocess_sparse_dense_matmul_input(...)`, interleaved pass by pass, with the
default thread counts of both (one thread per CPU). The outputs are checked to be identical
inside the reference's written ranges before anything is timed. Reported: median wall time and
median CPU time (all threads) per call; on a shared machine the CPU time is the steadier number.
"""

from __future__ import annotations

import argparse
import json
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


def workload(name: str, batch_size: int | None) -> tuple[str, str]:
  out = os.path.join(ROOT, "target", "peer")
  os.makedirs(out, exist_ok=True)
  stem = f"bench_{name}" if batch_size is None else f"bench_{name}_b{batch_size}"
  arrow, cfg = os.path.join(out, f"{stem}.arrow"), os.path.join(out, f"{stem}.json")
  if not (os.path.exists(arrow) and os.path.exists(cfg)):
    size = [] if batch_size is None else ["--batch-size", str(batch_size)]
    subprocess.run([sys.executable, os.path.join(SHARED, "peer", "make_workload.py"), "--profile", name,
                    "--out", arrow, "--config-out", cfg, *size], check=True, stdout=subprocess.DEVNULL)
  return arrow, cfg


def numpy_inputs(arrow: str, config: dict):
  """Ragged object arrays of int32 ids per feature (dict by feature name), from the first batch."""
  import pyarrow as pa

  with pa.memory_map(arrow) as src:
    rb = pa.ipc.open_file(src).get_batch(0)
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


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--workloads", nargs="+", default=["criteo", "long"])
  p.add_argument("--batch-size", type=int, default=None, help="samples a batch (default: the profile's)")
  p.add_argument("--untuned", action="store_true", help="limits 65536, no suggested buffer (before FDO)")
  p.add_argument("--repeat", type=int, default=11)
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--json", action="store_true", help="one JSON line per workload instead of a table")
  args = p.parse_args(argv)

  import reference as ref
  from jax_tpu_embedding.sparsecore.lib.nn import embedding

  import sparsecore_prep as scp

  if not args.json:
    print(f"{'workload':<10} {'ids':>10} {'reference ms':>13} {'ours ms':>9} {'speed-up':>9} {'CPU ms ref/ours':>17}")
  for name in args.workloads:
    arrow, cfg_path = workload(name, args.batch_size)
    with open(cfg_path) as fh:
      config = json.load(fh)
    if args.untuned:
      for t in config["tables"]:
        for limit in ("max_ids_per_partition", "max_unique_ids_per_partition"):
          t[limit] = max(65536, t[limit])
        t["suggested_coo_buffer_size_per_device"] = None
    feats, rows = numpy_inputs(arrow, config)
    case = case_of(config, rows)
    specs = ref.build_specs(case)
    opts = ref.call_options(case)
    opts["batch_number"] = 1  # as run_peer.py: no periodic logging
    num_ids = sum(sum(len(r) for r in v) for v in feats.values())

    def reference_call():
      return embedding.preprocess_sparse_dense_matmul_input(feats, None, specs, **opts)

    def our_call():
      return scp.preprocess_sparse_dense_matmul_input(feats, None, specs, **opts)

    # Same answer before timing (valid ranges of each SparseCore segment).
    want, got = ref.plain(reference_call()), ref.plain(our_call())
    ref.compare(case, want, got)

    times = {"reference": [], "ours": []}
    cpu = {"reference": [], "ours": []}
    for i in range(args.warmup + args.repeat):
      for side, fn in (("reference", reference_call), ("ours", our_call)):
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        if i >= args.warmup:
          times[side].append(dt * 1e3)
          cpu[side].append(dc * 1e3)
    ref_ms, our_ms = float(np.median(times["reference"])), float(np.median(times["ours"]))
    ref_cpu, our_cpu = float(np.median(cpu["reference"])), float(np.median(cpu["ours"]))
    if args.json:
      print(json.dumps({"workload": name, "ids": num_ids, "rows": rows * len(feats), "repeat": args.repeat,
                        "reference_median_ms": ref_ms, "ours_median_ms": our_ms,
                        "reference_min_ms": min(times["reference"]), "ours_min_ms": min(times["ours"]),
                        "speedup": ref_ms / our_ms, "reference_cpu_ms": ref_cpu, "ours_cpu_ms": our_cpu,
                        "cpu_ratio": ref_cpu / our_cpu, "load_1min": os.getloadavg()[0]}))
    else:
      print(f"{name:<10} {num_ids:>10,} {ref_ms:>13.1f} {our_ms:>9.1f} {ref_ms / our_ms:>8.2f}x"
            f" {ref_cpu:>8.1f}/{our_cpu:<8.1f}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
