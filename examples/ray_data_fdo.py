"""FDO statistics of a Parquet dataset with Ray Data, merged and turned into tuned limits.

    python examples/ray_data_fdo.py --config cfg.json --data data/ --batch-size 4096 \
        --stats-out stats.json --tuned-out tuned.json [--headroom 1.1] [--concurrency 2] \
        [--num-cpus 2 | --address ray://...] [--cpus-per-worker 1]

Ray Data reads the Parquet files (`ray.data.read_parquet`) and runs our preprocessor on every
local batch in parallel worker processes (`map_batches(FdoStatsMapper, ...)`: the class is
built once per worker from the pickled config). Each batch yields its FDO statistics; the
driver merges them (element-wise max, summed drops) with `FdoStats.merge_all`, writes them in
the format of `sparsecore-prep stats`, and tunes the config's limits and buffer sizes from them
as `sparsecore-prep fdo tune` does. One batch is `--batch-size` rows, as one record batch or
Parquet row group is for the CLI; write the data with row groups of that size so that both see
the same batches. Scale-out is Ray's: point `ray.init` at a cluster (`--address`) to use many
machines. Workers must leave CPUs for Ray's read tasks: with `--num-cpus 2` and two workers, give
each `--cpus-per-worker 0.5`, or the read tasks wait forever for a CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--config", required=True, help="our config JSON (SPEC Part 1, section 1.1)")
  p.add_argument("--data", required=True, help="a Parquet file or directory")
  p.add_argument("--batch-size", type=int, required=True, help="rows per local batch")
  p.add_argument("--stats-out", required=True, help="where to write the merged stats JSON")
  p.add_argument("--tuned-out", help="where to write the tuned config")
  p.add_argument("--headroom", type=float, default=1.0, help="tuned limits = observed * headroom")
  p.add_argument("--concurrency", type=int, default=2, help="Ray workers running the preprocessor")
  p.add_argument("--cpus-per-worker", type=float, default=1.0,
                 help="CPUs Ray reserves per preprocessor worker; leave some for the Parquet read tasks")
  p.add_argument("--num-cpus", type=int, default=2, help="CPUs of the local Ray instance")
  p.add_argument("--address", help="an existing Ray cluster (default: start a local one)")
  args = p.parse_args(argv)

  import ray

  import sparsecore_prep as scp

  with open(args.config) as fh:
    config = json.load(fh)
  start = time.perf_counter()
  if args.address:
    ray.init(address=args.address)
  else:
    ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
  try:
    ds = ray.data.read_parquet(args.data)
    per_batch = ds.map_batches(
        scp.FdoStatsMapper,
        fn_constructor_args=(config,),
        fn_constructor_kwargs={"threads": 1},  # Ray runs one batch per worker CPU
        batch_format="pyarrow",
        batch_size=args.batch_size,
        concurrency=args.concurrency,
        num_cpus=args.cpus_per_worker,
    )
    stats = scp.FdoStats.merge_all(scp.FdoStats.from_json(row["fdo_stats"]) for row in per_batch.iter_rows())
  finally:
    ray.shutdown()
  stats.write(args.stats_out)
  summary = {"batches": stats.batches, "stats": args.stats_out, "seconds": round(time.perf_counter() - start, 2)}
  if args.tuned_out:
    tuned = stats.tune(config, args.headroom)
    with open(args.tuned_out, "w") as fh:
      json.dump(tuned, fh, indent=2)
    summary["tuned"] = args.tuned_out
  print(json.dumps(summary))
  return 0


if __name__ == "__main__":
  sys.exit(main())
