"""examples/ray_data_fdo.py on a tiny Parquet dataset equals the single-process CLI.

The dataset (three features over two tables, one weighted, 6 batches of 64 rows in two files of
row groups of 64) goes through the Ray example with a local Ray (2 CPUs) and through
`sparsecore-prep stats` (the binary, one process, one batch per row group). The merged stats
JSON must be identical, and the tuned config must drop nothing when rerun without dropping.

The CLI is `$SPARSECORE_PREP_CLI`, else target/{release,debug}/sparsecore-prep. REQUIRE_RAY=1
turns a missing Ray or CLI into a failure instead of a skip (CI).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import sparsecore_prep as scp

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
EXAMPLE = os.path.join(ROOT, "examples", "ray_data_fdo.py")
REQUIRED = os.environ.get("REQUIRE_RAY") == "1"
BATCH = 64


def cli() -> str | None:
  for path in (os.environ.get("SPARSECORE_PREP_CLI"), os.path.join(ROOT, "target", "release", "sparsecore-prep"),
               os.path.join(ROOT, "target", "debug", "sparsecore-prep")):
    if path and os.path.exists(path):
      return path
  return None


def missing(what):
  if REQUIRED:
    raise RuntimeError(f"REQUIRE_RAY=1 but {what}")
  pytest.skip(what)


CONFIG = {
    "config": {"local_device_count": 1, "global_device_count": 2, "num_sc_per_device": 4,
               "allow_id_dropping": True},
    "tables": [
        {"name": "users", "vocabulary_size": 5000, "embedding_dim": 16, "combiner": "sum",
         "max_ids_per_partition": 2, "max_unique_ids_per_partition": 2},
        {"name": "items", "vocabulary_size": 300, "embedding_dim": 8, "combiner": "mean",
         "max_ids_per_partition": 8, "max_unique_ids_per_partition": 8},
    ],
    "features": [
        {"name": "user", "table": "users"},
        {"name": "clicked", "table": "items", "weights_column": "clicked_w"},
        {"name": "viewed", "table": "items"},
    ],
}


def write_dataset(directory):
  rng = np.random.default_rng(7)
  os.makedirs(directory)
  for part in range(2):
    batches = []
    for _ in range(3):
      cols = {}
      for name, vocab, top in (("user", 5000, 3), ("clicked", 300, 12), ("viewed", 300, 30)):
        lens = rng.integers(0, top, size=BATCH)
        hot = rng.random(lens.sum()) < 0.6
        ids = np.where(hot, rng.integers(0, 20, lens.sum()), rng.integers(0, vocab, lens.sum()))
        cols[name] = pa.ListArray.from_arrays(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32), ids)
        if name == "clicked":
          w = (rng.integers(1, 33, lens.sum()) / 16).astype(np.float32)
          cols["clicked_w"] = pa.ListArray.from_arrays(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32), w)
      batches.append(pa.RecordBatch.from_pydict(cols))
    pq.write_table(pa.Table.from_batches(batches), os.path.join(directory, f"part-{part}.parquet"),
                   row_group_size=BATCH)


def test_ray_example_equals_the_cli(tmp_path):
  try:
    import ray  # noqa: F401
  except ImportError:
    missing("ray is not installed")
  binary = cli()
  if binary is None:
    missing("no sparsecore-prep binary (cargo build) and SPARSECORE_PREP_CLI unset")
  cfg = tmp_path / "cfg.json"
  cfg.write_text(json.dumps(CONFIG))
  data = tmp_path / "data"
  write_dataset(str(data))

  ray_stats, tuned = tmp_path / "ray_stats.json", tmp_path / "tuned.json"
  run = subprocess.run([sys.executable, EXAMPLE, "--config", str(cfg), "--data", str(data), "--batch-size",
                        str(BATCH), "--stats-out", str(ray_stats), "--tuned-out", str(tuned), "--headroom", "1.0",
                        "--num-cpus", "2", "--concurrency", "2", "--cpus-per-worker", "0.5"],
                       capture_output=True, text=True, timeout=600)
  assert run.returncode == 0, run.stderr[-3000:]

  # The CLI reads one file: the same rows, as one Parquet file with the same row groups.
  merged = tmp_path / "all.parquet"
  pq.write_table(pa.concat_tables([pq.read_table(data / f"part-{i}.parquet") for i in range(2)]), merged,
                 row_group_size=BATCH)
  cli_stats = tmp_path / "cli_stats.json"
  run = subprocess.run([binary, "stats", "--config", str(cfg), "--input", str(merged), "--out", str(cli_stats)],
                       capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stderr[-3000:]

  got, want = json.loads(ray_stats.read_text()), json.loads(cli_stats.read_text())
  assert want["batches"] == 6
  assert got == want
  assert any(s["dropped_id_count"] > 0 for s in want["stacks"].values())  # the limits bite

  # The tuned config keeps every batch without drops.
  tuned_cfg = json.loads(tuned.read_text())
  tuned_cfg["config"]["allow_id_dropping"] = False
  prep = scp.Preprocessor(tuned_cfg)
  for rb in pq.read_table(merged).to_batches(max_chunksize=BATCH):
    _, stats = prep(rb)
    assert all(v == 0 for v in stats.id_drop_counters.values())
