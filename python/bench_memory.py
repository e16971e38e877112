"""Resident memory of results a caller holds: ours against the reference's, untuned.

    python python/bench_memory.py [--workload criteo] [--batch-size 512] [--hold 4] [--limit 65536]

A data loader keeps several results in flight (a prefetch queue; keras-rs's MLPerf loader up to a
dozen from 4 threads). Before FDO has tuned anything, every table's limits are large
(`--limit`, default 65536, with no suggested buffer), so each COO buffer is sized for the worst
case while a batch writes a small part of it. Each side runs in a process of its own: one call
to warm up (imports, thread pools), then `--hold` calls whose results are all kept, and the
growth of the process's resident set (VmRSS) over those calls is what the results hold. The
inputs are `bench.py`'s (ragged numpy object arrays of the profile's first batch, the
reference's own FeatureSpecs). The last line is `rss growth ours/reference: X.XXx`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "tests"))
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def rss_bytes() -> int:
  with open("/proc/self/status") as fh:
    for line in fh:
      if line.startswith("VmRSS:"):
        return int(line.split()[1]) * 1024
  raise RuntimeError("no VmRSS in /proc/self/status")


def measure(side: str, workload: str, batch_size: int, hold: int, limit: int) -> dict:
  """Runs in the child process: the RSS growth of holding `hold` results of `side`'s call."""
  import bench
  import reference as ref

  arrow, cfg_path = bench.workload(workload, batch_size)
  with open(cfg_path) as fh:
    config = json.load(fh)
  for t in config["tables"]:
    t["max_ids_per_partition"] = t["max_unique_ids_per_partition"] = max(limit, t["max_ids_per_partition"])
    t["suggested_coo_buffer_size_per_device"] = None
  feats, rows = bench.numpy_inputs(arrow, config)
  case = bench.case_of(config, rows)
  specs = ref.build_specs(case)
  opts = ref.call_options(case)
  opts["batch_number"] = 1
  if side == "reference":
    from jax_tpu_embedding.sparsecore.lib.nn import embedding

    call = embedding.preprocess_sparse_dense_matmul_input
  else:
    import sparsecore_prep as scp

    call = scp.preprocess_sparse_dense_matmul_input
  call(feats, None, specs, **opts)  # warm up: imports, pools, caches
  before = rss_bytes()
  held = [call(feats, None, specs, **opts) for _ in range(hold)]
  grown = rss_bytes() - before
  spanned = 0
  for out, _ in held:
    m = out.sparse_dense_matmul_input
    for part in (m.lhs_row_pointers, m.lhs_embedding_ids, m.lhs_sample_ids, m.lhs_gains):
      spanned += sum(a.nbytes for a in part.values())
  return {"side": side, "rss_growth_bytes": grown, "array_bytes": spanned, "hold": hold}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--workload", default="criteo")
  p.add_argument("--batch-size", type=int, default=512)
  p.add_argument("--hold", type=int, default=4)
  p.add_argument("--limit", type=int, default=65536)
  p.add_argument("--side", choices=["ours", "reference"], help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.side:
    print(json.dumps(measure(args.side, args.workload, args.batch_size, args.hold, args.limit)))
    return 0
  results = {}
  for side in ("reference", "ours"):
    out = subprocess.run([sys.executable, __file__, "--side", side, "--workload", args.workload,
                          "--batch-size", str(args.batch_size), "--hold", str(args.hold),
                          "--limit", str(args.limit)], check=True, capture_output=True, text=True)
    results[side] = json.loads(out.stdout.strip().splitlines()[-1])
  mb = 1 << 20
  print(f"{args.workload}, {args.batch_size} samples, limits {args.limit}, no suggested buffer, "
        f"{args.hold} results held")
  for side in ("reference", "ours"):
    r = results[side]
    print(f"{side:<10} arrays {r['array_bytes'] / mb:>9.1f} MB   rss growth {r['rss_growth_bytes'] / mb:>8.1f} MB")
  ratio = results["ours"]["rss_growth_bytes"] / max(results["reference"]["rss_growth_bytes"], 1)
  print(f"rss growth ours/reference: {ratio:.2f}x")
  return 0


if __name__ == "__main__":
  sys.exit(main())
