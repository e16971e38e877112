"""Preprocessor.balance: the permutation is a bijection, every column moves with its row, the
result is the CLI's `sparsecore-prep balance` output on the same input (row for row), the
balanced batches preprocess to the stats the CLI reports, no batch gets worse, and bad windows
are typed errors.

The CLI is `$SPARSECORE_PREP_CLI`, else target/{release,debug}/sparsecore-prep; it is a
failure, not a skip, when none is there (scripts/ci_python.sh builds it).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

import sparsecore_prep as scp

ROOT = pathlib.Path(__file__).resolve().parents[2]
S = 4  # SparseCores (1 device): 4 slices per batch, 4 partitions
ROWS = 256  # 64 rows per slice
LIMIT = 4096  # high, so that preprocessing never drops; the balancer only compares ratios

CONFIG = {
    "config": {"local_device_count": 1, "global_device_count": 1, "num_sc_per_device": S,
               "allow_id_dropping": False, "stacking": "feature"},
    "tables": [
        {"name": "t0", "vocabulary_size": 1 << 14, "embedding_dim": 8, "combiner": "sum",
         "max_ids_per_partition": LIMIT, "max_unique_ids_per_partition": LIMIT},
        {"name": "t1", "vocabulary_size": 1000, "embedding_dim": 8, "combiner": "mean",
         "max_ids_per_partition": LIMIT, "max_unique_ids_per_partition": LIMIT},
    ],
    "features": [
        {"name": "f0", "table": "t0", "column": "f0", "weights_column": "w0"},
        {"name": "f1", "table": "t1", "column": "f1"},
    ],
}


def _cli():
  for path in (os.environ.get("SPARSECORE_PREP_CLI"), ROOT / "target" / "release" / "sparsecore-prep",
               ROOT / "target" / "debug" / "sparsecore-prep"):
    if path and os.path.exists(path):
      return str(path)
  pytest.fail("no sparsecore-prep binary (cargo build -p sparsecore-cli) and SPARSECORE_PREP_CLI unset")


def _batches(n=8, seed=0):
  """Skewed CTR batches: the samples of slice s send most of their f0 ids to partition s (so the
  input order loads one cell per slice), with power-law lengths, weights, a label and a row id."""
  rng = np.random.default_rng(seed)
  out = []
  row_id = 0
  for _ in range(n):
    f0, w0, f1 = [], [], []
    for row in range(ROWS):
      k = int(min(40, 1 + rng.pareto(1.2)))
      home = (row // (ROWS // S) + int(rng.integers(0, 2))) % S
      ids = rng.integers(0, (1 << 14) // S, k) * S + home
      f0.append(ids.tolist())
      w0.append(rng.random(k).astype(np.float32).tolist())
      f1.append(rng.integers(0, 1000, int(rng.integers(1, 4))).tolist())
    out.append(pa.record_batch({
        "f0": pa.array(f0, pa.list_(pa.int64())),
        "w0": pa.array(w0, pa.list_(pa.float32())),
        "f1": pa.array(f1, pa.list_(pa.int32())),
        "label": pa.array(rng.random(ROWS), pa.float64()),
        "row_id": pa.array(np.arange(row_id, row_id + ROWS), pa.int64()),
    }))
    row_id += ROWS
  return out


BATCHES = _batches()


def _loads(prep, batch):
  """Per stack: (max_ids_per_partition, max_unique_ids_per_partition, required buffer per device)."""
  _res, st = prep(batch)
  return {k: (int(np.max(st.max_ids_per_partition[k])), int(np.max(st.max_unique_ids_per_partition[k])),
              st.get_required_buffer_size_per_device(k, S)) for k in st.max_ids_per_partition}


def _worst(loads):
  out = {}
  for per in loads:
    for k, v in per.items():
      out[k] = tuple(max(a, b) for a, b in zip(out.get(k, (0, 0, 0)), v))
  return out


@pytest.mark.parametrize("window", [1, 4, 3])
def test_permutation_is_a_bijection_and_columns_move_together(window):
  prep = scp.Preprocessor(CONFIG)
  out, perm = prep.balance(BATCHES, window=window)
  total = len(BATCHES) * ROWS
  assert perm.dtype == np.int64 and perm.shape == (total,)
  np.testing.assert_array_equal(np.sort(perm), np.arange(total))
  assert [b.num_rows for b in out] == [b.num_rows for b in BATCHES]
  assert all(b.schema == BATCHES[0].schema for b in out)
  # Each output batch holds rows of its own window only.
  for k, b in enumerate(out):
    src = perm[k * ROWS:(k + 1) * ROWS] // ROWS
    assert np.all(src // window == k // window)
  # Every column (ids, weights, label, row id) is the input's row `perm[j]`.
  pooled = pa.Table.from_batches(BATCHES).combine_chunks()
  got = pa.Table.from_batches(out).combine_chunks()
  assert got.equals(pooled.take(pa.array(perm)))
  np.testing.assert_array_equal(np.asarray(got.column("row_id")), perm)
  assert not np.array_equal(perm, np.arange(total)), "the skewed input was left as it was"


@pytest.mark.parametrize("window,refine", [(1, "worst-cell"), (4, "worst-cell"), (1, "every-stack"), (4, "every-stack"),
                                          (1, "unique-ids"), (4, "unique-ids")])
def test_equals_the_cli_and_its_reported_stats(tmp_path, window, refine):
  cli = _cli()
  src, dst, cfg = tmp_path / "in.arrow", tmp_path / "out.arrow", tmp_path / "config.json"
  cfg.write_text(json.dumps(CONFIG))
  with ipc.new_file(str(src), BATCHES[0].schema) as w:
    for b in BATCHES:
      w.write_batch(b)
  run = subprocess.run([cli, "balance", "--config", str(cfg), "--input", str(src), "--out", str(dst),
                        "--window", str(window), "--refine", refine, "--json"], capture_output=True, text=True, check=True)
  report = json.loads(run.stdout.strip().splitlines()[-1])
  with ipc.open_file(str(dst)) as r:
    theirs = [r.get_batch(i) for i in range(r.num_record_batches)]

  prep = scp.Preprocessor(CONFIG)
  ours, perm, windows = prep.balance(BATCHES, window=window, refine=refine, with_report=True)
  assert len(theirs) == len(ours) == len(BATCHES)
  for a, b in zip(ours, theirs):
    assert a.equals(b)
  np.testing.assert_array_equal(np.concatenate([np.asarray(b.column("row_id")) for b in theirs]), perm)
  assert report["window"] == window and report["batches"] == len(BATCHES) and report["refine"] == refine
  assert report["windows"] == len(windows) == -(-len(BATCHES) // window)
  assert report["reordered_windows"] == sum(w["reordered"] for w in windows) > 0
  # Every window says why it kept its input order, as the CLI counts them.
  names = [s["name"] for s in windows[0]["stacks"]]
  kept = {}
  for w in windows:
    assert w["reordered"] == (w["outcome"] == "reordered")
    assert w["outcome_stack"] is None or w["outcome_stack"] in names
    if not w["reordered"]:
      kept.setdefault(w["outcome"], 0)
      kept[w["outcome"]] += 1
  assert {k: v["windows"] for k, v in report["kept_windows"].items()} == kept

  # Preprocessing the balanced (and the input) batches gives the stats the CLI reports.
  after = _worst(_loads(prep, b) for b in ours)
  before = _worst(_loads(prep, b) for b in BATCHES)
  assert {s["name"] for s in report["stacks"]} == set(after) == {"t0", "t1"}
  for s in report["stacks"]:
    name = s["name"]
    assert (s["after"]["max_ids_per_partition"], s["after"]["max_unique_ids_per_partition"],
            s["after"]["required_buffer"]) == after[name], name
    assert (s["before"]["max_ids_per_partition"], s["before"]["max_unique_ids_per_partition"],
            s["before"]["required_buffer"]) == before[name], name
  # The skew is mostly in t0's partitions, and balancing lowers its worst cell.
  assert after["t0"][0] < before["t0"][0]


@pytest.mark.parametrize("window", [1, 4])
def test_no_batch_gets_worse(window):
  prep = scp.Preprocessor(CONFIG)
  out, _perm = prep.balance(BATCHES, window=window)
  worst = lambda b: max(v[0] for v in _loads(prep, b).values())  # limits are equal: max_ids is the ratio
  before = [worst(b) for b in BATCHES]
  after = [worst(b) for b in out]
  for k in range(len(BATCHES)):
    # W = 1: against its own input batch; W > 1: against the worst input batch of its window.
    w0 = k // window * window
    bound = before[k] if window == 1 else max(before[w0:w0 + window])
    assert after[k] <= bound, (k, after[k], bound)
  assert max(after) < max(before)


def test_balanced_batches_preprocess_like_the_same_rows_in_that_order():
  prep = scp.Preprocessor(CONFIG)
  out, perm = prep.balance(BATCHES[:2], window=2)
  pooled = pa.Table.from_batches(BATCHES[:2]).combine_chunks()
  for k, b in enumerate(out):
    same = pooled.take(pa.array(perm[k * ROWS:(k + 1) * ROWS])).to_batches()[0]
    r1, s1 = prep(b)
    r2, s2 = prep(same)
    for stack in r1.lhs_row_pointers:
      np.testing.assert_array_equal(r1.lhs_row_pointers[stack], r2.lhs_row_pointers[stack])
      np.testing.assert_array_equal(r1.lhs_embedding_ids[stack], r2.lhs_embedding_ids[stack])
      np.testing.assert_array_equal(r1.lhs_sample_ids[stack], r2.lhs_sample_ids[stack])
      np.testing.assert_array_equal(r1.lhs_gains[stack], r2.lhs_gains[stack])


def test_empty_input():
  out, perm = scp.Preprocessor(CONFIG).balance([], window=2)
  assert out == [] and perm.shape == (0,)


def test_typed_errors():
  prep = scp.Preprocessor(CONFIG)
  other = BATCHES[1].drop_columns(["label"])
  with pytest.raises(scp.InvalidInputError) as e:
    prep.balance([BATCHES[0], other], window=2)
  assert e.value.feature is None and "balancing window: batch 1 has another schema" in str(e.value)
  missing = BATCHES[0].drop_columns(["f1"])
  with pytest.raises(scp.InvalidInputError) as e:
    prep.balance([missing], window=1)
  assert e.value.feature == "f1"
  with pytest.raises(scp.ConfigError) as e:
    prep.balance(BATCHES, window=0)
  assert e.value.field == "window"
  # One batch (or table) for the sequence, a fractional window, a column for a batch: type
  # errors, not a panic and not a batch of columns.
  for one in (BATCHES[0], pa.Table.from_batches(BATCHES)):
    with pytest.raises(TypeError, match="not one: wrap it in a list"):
      prep.balance(one, window=1)
  with pytest.raises(TypeError):
    prep.balance(BATCHES, window=1.5)
  with pytest.raises(TypeError, match="got an Arrow array of type Int64"):
    prep.balance([pa.array([1, 2, 3], pa.int64())], window=1)
  with pytest.raises(TypeError, match="got an Arrow array of type"):
    prep(pa.array([[1], [2]], pa.list_(pa.int64())))
  with pytest.raises(scp.ConfigError) as e:
    prep.balance(BATCHES, refine="thorough")
  assert e.value.field == "refine" and "unique-ids" in str(e.value)
  with pytest.raises(scp.InputTypeError):
    prep.balance([{"f0": [1]}])
