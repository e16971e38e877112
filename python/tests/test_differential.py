"""Differential test: our drop-in call against the reference itself, on random inputs.

Random cases cover ragged (int32 rows, empty samples) and dense (int32, int64) features, weights or
none, the three combiners, feature and auto stacking, L/G in {1/1, 2/2, 4/4}, S in {2, 4},
id dropping with small limits, and suggested buffer sizes that overflow. For each case both
sides get the reference's own FeatureSpecs; the arrays must be identical inside the ranges the
reference writes (gains by bit pattern), ours must hold zeros everywhere else (the tails),
and the stats must be identical. Configurations where the reference aborts the process are
run too: the reference must die, and ours must raise.

The sparse COO entry point (`preprocess_sparse_dense_matmul_input_from_sparse_tensor`) gets the
same random configurations with COO features: rows with gaps in their positions, leading,
trailing and all-empty rows, int32/int64 indices and ids.

DIFF_CASES (default 240) sets the number of random cases of each entry point, DIFF_SEED the seed.
REQUIRE_REFERENCE=1 turns a missing reference into a failure instead of a skip (CI).
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest

import reference as ref
from reference import compare, round_up
import sparsecore_prep as scp

if not ref.reference_available():
  if os.environ.get("REQUIRE_REFERENCE") == "1":
    raise RuntimeError("REQUIRE_REFERENCE=1 but jax_tpu_embedding is not importable")
  pytest.skip("the reference (jax-tpu-embedding) is not installed", allow_module_level=True)

NUM_CASES = int(os.environ.get("DIFF_CASES", "240"))
SEED = int(os.environ.get("DIFF_SEED", "20261122"))
LAYOUTS = [(1, 1), (2, 2), (4, 4)]


@pytest.fixture(scope="module")
def worker():
  w = ref.ReferenceWorker()
  yield w
  w.close()


def random_ids(rng: np.random.Generator, n: int, vocab: int) -> np.ndarray:
  """Ids with duplicates: half from a small hot set, half uniform."""
  hot = rng.integers(0, min(vocab, 8), size=n)
  cold = rng.integers(0, vocab, size=n)
  return np.where(rng.random(n) < 0.5, hot, cold)


def random_weights(rng: np.random.Generator, n: int) -> np.ndarray:
  """k/16 for k in -8..64 (exact in f32): some zero and negative weights."""
  return (rng.integers(-8, 65, size=n) / 16.0).astype(np.float32)


def make_case(seed: int, scale: int = 1) -> dict:
  """A random case; `scale` multiplies every feature's batch (the layout, tables and limits
  come from the same draws; the ids do not)."""
  r = random.Random(seed)
  rng = np.random.default_rng(seed)
  l, g = r.choice(LAYOUTS)
  s = r.choice([2, 4])
  n = g * s
  stacking = r.choice(["feature", "auto"])
  weighted = r.random() < 0.5
  allow_drop = r.random() < 0.4
  # Auto stacking groups tables by (padded dim, combiner): few choices so that stacks form.
  combiners = ["sum", "mean", "sqrtn"]
  num_tables = r.randint(1, 3)
  tables = []
  for t in range(num_tables):
    vocab = r.choice([r.randint(1, 40), r.randint(40, 3000), r.randint(3000, 200000)])
    if allow_drop:
      max_ids, max_unique = r.randint(1, 24), r.randint(1, 24)
    else:
      max_ids, max_unique = 4096, 4096
    table = {"name": f"t{t}", "vocabulary_size": vocab, "embedding_dim": r.choice([8, 16, 12]),
             "combiner": r.choice(combiners if r.random() < 0.5 else combiners[:1]),
             "max_ids_per_partition": max_ids, "max_unique_ids_per_partition": max_unique}
    if r.random() < 0.3:
      theoretical = round_up(max_ids, 8) * s * n
      table["suggested_coo_buffer_size_per_device"] = r.randint(1, theoretical)
    tables.append(table)
  features = []
  for i in range(r.randint(1, 4)):
    t = tables[r.randrange(num_tables)] if i >= num_tables else tables[i]
    local = l * s * r.randint(1, 6) * scale
    dense = r.random() < 0.35
    if dense:
      valency = r.randint(1, 6)
      ids = random_ids(rng, local * valency, t["vocabulary_size"]).reshape(local, valency)
      ids = ids.astype(r.choice([np.int32, np.int64]))
      w = random_weights(rng, ids.size).reshape(ids.shape) if weighted else None
    else:
      # Ragged rows are int32: the reference reinterprets int64 rows' memory as int32 (garbage
      # ids, half of them zeros), where ours converts them exactly; test_api covers int64 rows.
      dtype = np.int32
      lens = rng.integers(0, 9, size=local)
      ids = np.empty(local, dtype=object)
      w = np.empty(local, dtype=object) if weighted else None
      for row, k in enumerate(lens):
        ids[row] = random_ids(rng, int(k), t["vocabulary_size"]).astype(dtype)
        if weighted:
          w[row] = random_weights(rng, int(k))
    features.append({"name": f"f{i}", "table": t["name"], "global_batch_size": local * g // l,
                     "ids": ids, "weights": w})
  # Weights for all features or none, as the reference takes them.
  if weighted:
    for f in features:
      assert f["weights"] is not None
  case = {"local_device_count": l, "global_device_count": g, "num_sc_per_device": s,
          "stacking": stacking, "allow_id_dropping": allow_drop, "tables": tables,
          "features": features, "has_leading_dimension": r.random() < 0.2}
  if stacking == "auto":
    case["stack_limits"] = (r.randint(1, 32), r.randint(1, 32)) if allow_drop else (4096, 4096)
  return case


def make_coo_case(seed: int) -> dict:
  """make_case's configuration with every feature as sparse COO input (no weights).

  Each sample row's ids keep their order; their positions (column 1, which the reference
  ignores) are increasing with random gaps; `dense_shape` is `[batch, width]` with any width
  above the positions. Indices and ids are int32 or int64 arrays (lists would be pytree nodes).
  """
  case = make_case(seed)
  r = random.Random(seed ^ 0xC00)
  rng = np.random.default_rng(seed ^ 0xC00)
  case["coo"] = True
  for f in case["features"]:
    rows = list(f["ids"]) if f["ids"].dtype == object else [row for row in f["ids"]]
    if r.random() < 0.1:
      rows = [row[:0] for row in rows]  # an all-empty feature (nnz = 0)
    entries, width = [], 1
    for i, row in enumerate(rows):
      positions = np.cumsum(rng.integers(1, 3 if r.random() < 0.5 else 2, size=len(row))) - 1
      entries.extend((i, int(p), int(v)) for p, v in zip(positions, row))
      width = max(width, int(positions[-1]) + 1 if len(row) else 1)
    index_type, value_type = r.choice([np.int64, np.int32]), r.choice([np.int32, np.int64])
    indices = np.array([[i, p] for i, p, _ in entries], dtype=index_type).reshape(-1, 2)
    values = np.array([v for _, _, v in entries], dtype=value_type)
    shape = np.array([len(rows), width + r.randint(0, 3)], dtype=np.int64)
    f.update(ids=None, weights=None, indices=indices, values=values, dense_shape=shape)
  return case


def run_ours(case):
  specs = ref.build_specs(case)
  if case.get("coo"):
    return ref.plain(scp.preprocess_sparse_dense_matmul_input_from_sparse_tensor(
        *ref.coo_inputs(case), specs, **ref.call_options(case)))
  feats, weights = ref.inputs(case)
  return ref.plain(scp.preprocess_sparse_dense_matmul_input(feats, weights, specs, **ref.call_options(case)))


def check_case(worker, case: dict, label: str) -> dict:
  """The reference's output of `case`, after checking ours against it (`label` names the case
  in a failure)."""
  want = worker.run(case)
  got = run_ours(case)
  try:
    compare(case, want, got)
  except AssertionError as e:
    raise AssertionError(f"{label} ({describe(case)}): {e}") from None
  return want


def test_random_cases_match_the_reference(worker):
  seeds = [SEED + i for i in range(NUM_CASES)]
  checked = dropped = weighted = auto = 0
  for seed in seeds:
    case = make_case(seed)
    # Never aborts: limits are generous unless dropping is allowed.
    want = check_case(worker, case, f"case seed {seed}")
    checked += 1
    dropped += any(want["id_drop_counters"].values())
    weighted += case["features"][0]["weights"] is not None
    auto += case["stacking"] == "auto"
  print(f"differential: {checked}/{len(seeds)} cases identical ({dropped} with drops, {weighted} weighted, "
        f"{auto} auto-stacked)")
  # The generator must really exercise these paths.
  assert dropped >= NUM_CASES // 10 and weighted >= NUM_CASES // 4 and auto >= NUM_CASES // 4


def test_large_random_cases_match_the_reference(worker):
  # Batches of SMALL_BATCH_IDS ids and more run on the package's threads, and 2,048 ragged rows and more
  # are gathered there; smaller ones (every case above) run on the calling thread.
  parallel = gathered = 0
  for seed in range(SEED + 900000, SEED + 900016):
    case = make_case(seed, scale=32)
    check_case(worker, case, f"large case seed {seed}")
    ragged = [f["ids"] for f in case["features"] if f["ids"].dtype == object]
    ids = sum(sum(len(r) for r in f) for f in ragged) + sum(f["ids"].size for f in case["features"] if f["ids"].dtype != object)
    parallel += ids >= scp._native.SMALL_BATCH_IDS
    gathered += sum(len(f) for f in ragged) >= scp._native.GATHER_ON_CALLER_MAX_ROWS
  print(f"differential (large): 16/16 cases identical, {parallel} run on the threads, {gathered} gathered there")
  assert parallel >= 2 and gathered >= 2


def test_random_coo_cases_match_the_reference(worker):
  seeds = [SEED + 500000 + i for i in range(NUM_CASES)]
  checked = dropped = auto = empty = 0
  for seed in seeds:
    case = make_coo_case(seed)
    want = check_case(worker, case, f"COO case seed {seed}")
    checked += 1
    dropped += any(want["id_drop_counters"].values())
    auto += case["stacking"] == "auto"
    empty += any(len(f["values"]) == 0 for f in case["features"])
  print(f"differential (COO): {checked}/{len(seeds)} cases identical ({dropped} with drops, {auto} auto-stacked, "
        f"{empty} with an all-empty feature)")
  assert dropped >= NUM_CASES // 10 and auto >= NUM_CASES // 4 and empty >= 1


def describe(case) -> str:
  if case.get("coo"):
    layouts = {"coo"}
    weighted = False
  else:
    layouts = {("dense" if f["ids"].dtype != object else "ragged") for f in case["features"]}
    weighted = case["features"][0]["weights"] is not None
  return (f"L/G/S {case['local_device_count']}/{case['global_device_count']}/{case['num_sc_per_device']}, "
          f"{case['stacking']} stacking, {len(case['tables'])} tables, {len(case['features'])} features "
          f"{sorted(layouts)}, weights {weighted}, "
          f"drop {case['allow_id_dropping']}")


def abort_cases():
  """Configurations where the reference aborts the process, with the exception ours raises."""
  base = make_case(SEED + 100000)
  base["allow_id_dropping"] = False
  yield "limits exceeded without dropping", scp.LimitExceededError, _exceed(base)
  yield "batch not divisible by S", scp.InvalidInputError, _indivisible(base)
  yield "suggested buffer above the theoretical maximum", ValueError, _oversized(base)


def _single_feature(case, ids, weights=None, **table):
  case = dict(case)
  t = dict(case["tables"][0], **table)
  t.pop("suggested_coo_buffer_size_per_device", None)
  t.update({k: v for k, v in table.items()})
  case["tables"] = [t]
  case["stacking"] = "feature"
  local = len(ids)
  g, l = case["global_device_count"], case["local_device_count"]
  case["features"] = [{"name": "f0", "table": t["name"], "global_batch_size": local * g // l, "ids": ids,
                       "weights": weights}]
  return case


def _exceed(base):
  l, s = base["local_device_count"], base["num_sc_per_device"]
  ids = np.zeros((l * s * 4, 4), dtype=np.int32) + np.arange(4, dtype=np.int32) * 64
  return _single_feature(base, ids, vocabulary_size=1000, max_ids_per_partition=2, max_unique_ids_per_partition=64)


def _indivisible(base):
  l, s = base["local_device_count"], base["num_sc_per_device"]
  ids = np.arange(l * (s + 1), dtype=np.int32).reshape(-1, 1)
  return _single_feature(base, ids, vocabulary_size=1000, max_ids_per_partition=64, max_unique_ids_per_partition=64)


def _oversized(base):
  l, s = base["local_device_count"], base["num_sc_per_device"]
  n = base["global_device_count"] * s
  ids = np.arange(l * s * 2, dtype=np.int32).reshape(-1, 1)
  return _single_feature(base, ids, vocabulary_size=1000, max_ids_per_partition=8, max_unique_ids_per_partition=8,
                         suggested_coo_buffer_size_per_device=8 * s * n + 8 * s)


@pytest.mark.parametrize("what", ["limits exceeded without dropping", "batch not divisible by S",
                                  "suggested buffer above the theoretical maximum"])
def test_where_the_reference_aborts_ours_raises(worker, what):
  [(name, exc, case)] = [c for c in abort_cases() if c[0] == what]
  with pytest.raises(ref.Abort) as aborted:
    worker.run(case)
  assert aborted.value.returncode == -6, aborted.value  # SIGABRT
  with pytest.raises(exc) as raised:
    run_ours(case)
  print(f"{name}: reference aborted; ours raised {type(raised.value).__name__}: {raised.value}")


def _as_dtype(case: dict, dtype) -> dict:
  """`case` with every feature's ids (ragged rows or dense arrays) converted to `dtype`."""
  out = dict(case, features=[])
  for f in case["features"]:
    ids = f["ids"]
    if ids.dtype == object:
      conv = np.empty(len(ids), dtype=object)
      for i, row in enumerate(ids):
        conv[i] = np.asarray(row).astype(dtype)
    else:
      conv = ids.astype(dtype)
    out["features"].append(dict(f, ids=conv))
  return out


def test_int64_and_uint64_rows_are_exact(worker):
  # Rows parsed from TFRecord Int64List (keras-rs passes their dtype through) are int64. The
  # reference reads ragged int64 rows' memory as int32 (python/README.md, "Where we differ"), so
  # it runs on the int32 twin of each case; ours must give its answer for every dtype, and the
  # very same bytes as for int32 rows.
  ragged = dense = 0
  for seed in range(SEED + 700000, SEED + 700000 + max(8, NUM_CASES // 8)):
    case = make_case(seed)
    want = worker.run(case)
    base = run_ours(case)
    for dtype in (np.int64, np.uint64):
      got = run_ours(_as_dtype(case, dtype))
      try:
        compare(case, want, got)
      except AssertionError as e:
        raise AssertionError(f"{np.dtype(dtype).name} rows, case seed {seed} ({describe(case)}): {e}") from None
      for field in ("row_pointers", "embedding_ids", "sample_ids", "gains"):
        for stack, arr in base[field].items():
          np.testing.assert_array_equal(got[field][stack], arr, err_msg=f"{field} {stack} seed {seed}")
    ragged += any(f["ids"].dtype == object for f in case["features"])
    dense += any(f["ids"].dtype != object for f in case["features"])
  assert ragged and dense
