"""sparsecore_prep.bess: every besskge reference case through the Python API, a BessStream ->
Preprocessor round trip, and each typed error.

The cases (``../shared/bess/cases`` or under ``SPARSECORE_SHARED``, and ``BESS_CASES_DIR`` when
set) are real outputs of besskge (see their README); this mirrors
``crates/sparsecore-bess/tests/bess/bess_cases.rs``: every array must match exactly. A missing
cases folder fails here (the Rust test reports it as not run, and fails only under ``CI``).
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import pickle

import numpy as np
import pyarrow as pa
import pytest

import sparsecore_prep
from sparsecore_prep import bess

ROOT = pathlib.Path(__file__).resolve().parents[2]
CASES = pathlib.Path(os.environ.get("SPARSECORE_SHARED", ROOT.parent / "shared")) / "bess" / "cases"


def _case_dirs():
  roots = [CASES]
  if os.environ.get("BESS_CASES_DIR"):
    roots.append(pathlib.Path(os.environ["BESS_CASES_DIR"]))
  dirs = []
  for root in roots:
    assert root.is_dir(), f"cases folder {root} is missing"
    found = sorted(p for p in root.iterdir() if (p / "input.json").is_file())
    assert found, f"cases folder {root} holds no case"
    dirs.extend(found)
  return dirs


CASE_DIRS = _case_dirs()


def _words(seed):
  return seed["words"]


def _check(name, exp, got):
  """`got` (array-like) against an expected array: shape, then values or their sha256."""
  got = np.asarray(got)
  assert list(got.shape) == exp["shape"], f"{name}: shape {got.shape}, expected {exp['shape']}"
  values = got.astype(np.int64).ravel()
  if "data" in exp:
    want = np.asarray(exp["data"], dtype=np.int64)
    if not np.array_equal(values, want):
      first = int(np.flatnonzero(values != want)[0])
      raise AssertionError(f"{name}: values differ at flat index {first}: got {values[first]}, expected {want[first]}")
  if "sha256" in exp:
    digest = hashlib.sha256(values.astype("<i8").tobytes()).hexdigest()
    assert digest == exp["sha256"], f"{name}: sha256 differs"
  assert "data" in exp or "sha256" in exp, f"{name}: expected array without data or sha256"


def _array(v):
  assert "data" in v, "input array given as sha256"
  return np.asarray(v["data"], dtype=np.int64).reshape(v["shape"])


def _check_sharding(s: bess.Sharding, exp):
  assert s.max_entity_per_shard == exp["max_entity_per_shard"]
  _check("shard_and_idx_to_entity", exp["shard_and_idx_to_entity"], s.shard_and_idx_to_entity)
  _check("entity_to_shard", exp["entity_to_shard"], s.entity_to_shard)
  _check("entity_to_idx", exp["entity_to_idx"], s.entity_to_idx)
  _check("shard_counts", exp["shard_counts"], s.shard_counts)
  for k in ("entity_type_counts", "entity_type_offsets"):
    got = getattr(s, k)
    assert (k in exp) == (got is not None), f"{k}: presence differs"
    if got is not None:
      _check(k, exp[k], got)


def run_case(d: pathlib.Path):
  inp = json.loads((d / "input.json").read_text())
  exp = json.loads((d / "expected.json").read_text())
  kind, n_entity, n_shard = inp["kind"], inp["n_entity"], inp["n_shard"]
  offsets = inp.get("type_offsets")
  if kind == "sharding":
    s = bess.Sharding.create(n_entity, n_shard, _words(inp["seed"]), type_offsets=offsets)
    _check_sharding(s, exp["sharding"])
    return
  sharding = bess.Sharding.create(n_entity, n_shard, _words(inp["sharding_seed"]), type_offsets=offsets)
  _check_sharding(sharding, exp["sharding"])
  t = _array(inp["triples"])
  neg_heads = _array(inp["neg_heads"]) if inp.get("neg_heads") is not None else None
  neg_tails = _array(inp["neg_tails"]) if inp.get("neg_tails") is not None else None
  part = bess.PartitionedTriples(sharding, t[:, 0], t[:, 1], t[:, 2], mode=inp["partition_mode"],
                                 n_relation=inp["n_relation"], inverse_triples=inp["add_inverse_triples"],
                                 type_offsets=offsets, neg_heads=neg_heads, neg_tails=neg_tails)
  ep = exp["partition"]
  for k in ("triple_counts", "triple_offsets", "triple_sort_idx", "triples"):
    _check(k, ep[k], getattr(part, k))
  for k in ("types", "neg_heads", "neg_tails"):
    got = getattr(part, k)
    assert (k in ep) == (got is not None), f"partition {k}: presence differs"
    if got is not None:
      _check(k, ep[k], got)
  if kind == "partition":
    return
  neg = inp["negative"]
  scheme = neg["corruption_scheme"]
  if neg["kind"] == "random":
    negative = bess.RandomNegativeSampler(neg["n_negative"], _words(neg["seed"]), scheme, neg["local_sampling"],
                                          neg["flat_negative_format"])
  elif neg["kind"] == "type_based":
    negative = bess.TypeBasedNegativeSampler(neg["n_negative"], _words(neg["seed"]), scheme, neg["local_sampling"])
  elif neg["kind"] == "triple_based":
    negative = bess.TripleBasedNegativeSampler(part, scheme, neg["mask_on_gather"], neg["return_sort_idx"])
    st = exp["triple_based_state"]
    assert st["flat_negative_format"] == negative.flat_negative_format
    assert st["N"] == negative.rows
    assert st["n_negative"] == negative.n_negative
    assert st["padded_shard_length"] == negative.padded_shard_length
    tables = {"h": [("", negative.heads)], "t": [("", negative.tails)],
              "ht": [("h", negative.heads), ("t", negative.tails)]}[scheme]
    for sfx, tab in tables:
      assert tab is not None
      names = (("sort_neg_idx", "padded_negatives", "mask") if not sfx else
               (f"sort_neg_{sfx}_idx", f"padded_negatives_{sfx}", f"mask_{sfx}"))
      for name, key in zip(names, ("sort_idx", "padded", "mask")):
        _check(name, st[name], tab[key])
  else:
    raise AssertionError(f"unknown negative kind {neg['kind']!r}")
  s = inp["sampler"]
  assert s["kind"] in ("random", "rigid")
  assert not (s["kind"] == "rigid" and s.get("shuffle")), "rigid with shuffle=True is not a reference case"
  sampler = bess.BatchSampler(part, s["shard_bs"], sampler=s["kind"], seed=_words(s["seed"]),
                              batches_per_step=s["batches_per_step"], duplicate_batch=s["duplicate_batch"],
                              return_triple_idx=s["return_triple_idx"], negative_sampler=negative)
  es = exp["sampler"]
  assert sampler.positive_per_partition == es["positive_per_partition"]
  assert sampler.partition_sample_size == es["partition_sample_size"]
  assert len(sampler) == es["len"]
  steps = exp["steps"]
  assert len(steps) == s["n_steps"]
  pss = sampler.partition_sample_size
  for k, st in enumerate(steps):
    idx = st["idx"]
    if len(idx) == 1:
      step = idx[0]
    else:
      a, b = idx
      assert b == a + pss and a % pss == 0, f"step {k}: unexpected idx {idx}"
      step = a // pss
    out = sampler.sample(step)
    assert set(out) == set(st["outputs"]), f"step {k}: output keys {sorted(out)}, expected {sorted(st['outputs'])}"
    for name, value in out.items():
      _check(f"step {k} {name}", st["outputs"][name], value)


@pytest.mark.parametrize("case", CASE_DIRS, ids=lambda p: p.name)
def test_reference_case(case):
  run_case(case)


def test_every_case_is_collected():
  # The shared folder holds 37 cases today; no case may be dropped by the collection above.
  assert len([p for p in CASES.iterdir() if (p / "input.json").is_file()]) >= 37


# --- The generator ----------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1234, 2**32 + 1, 2**64 - 1, 2**130 + 99])
def test_numpy_rng_matches_numpy(seed):
  ours = bess.NumpyRng(seed)
  ref = np.random.default_rng(seed)
  np.testing.assert_array_equal(ours.permutation(1000), ref.permutation(1000))
  np.testing.assert_array_equal(ours.integers(2**63, 50), ref.integers(2**63, size=50))
  # 32-bit draws share numpy's buffered half-word across calls: an odd count, then more.
  np.testing.assert_array_equal(ours.integers(2**31, 7), ref.integers(2**31, size=7))
  np.testing.assert_array_equal(ours.integers(2**31, 4), ref.integers(2**31, size=4))
  np.testing.assert_array_equal(ours.random_raw(3), ref.bit_generator.random_raw(3))


def test_seed_words():
  assert bess.seed_words(0) == [0]
  assert bess.seed_words(1234) == [1234]
  assert bess.seed_words(2**32 + 1) == [1, 1]
  assert bess.seed_words(2**64 - 1) == [2**32 - 1, 2**32 - 1]
  assert bess.NumpyRng([1, 1]).permutation(50).tolist() == bess.NumpyRng(2**32 + 1).permutation(50).tolist()
  assert bess.seed_words(np.uint64(2**63)) == [0, 2**31]
  with pytest.raises(bess.InvalidParameterError):
    bess.NumpyRng(1.5)
  with pytest.raises(bess.InvalidParameterError):
    bess.NumpyRng([2**32])
  # Sizes no memory holds: MemoryError, as numpy raises, not an abort of the interpreter.
  rng = bess.NumpyRng(1)
  for draw in (lambda: rng.random_raw(2**61), lambda: rng.integers(2**31, 2**61), lambda: rng.permutation(2**61)):
    with pytest.raises(MemoryError, match="cannot allocate 2305843009213693952 draws"):
      draw()
  np.testing.assert_array_equal(rng.random_raw(2), bess.NumpyRng(1).random_raw(2))


# --- Sharding files -----------------------------------------------------------------------------


def test_sharding_npz_round_trip_and_besskge_layout(tmp_path):
  s = bess.Sharding.create(1001, 8, 5, type_offsets=[0, 300, 900])
  path = tmp_path / "sharding.npz"
  s.save_npz(path)
  # besskge's Sharding.load reads the dataclass fields by name with np.load.
  with np.load(path) as d:
    assert int(d["n_shard"]) == 8
    np.testing.assert_array_equal(d["entity_to_shard"], s.entity_to_shard)
    np.testing.assert_array_equal(d["shard_and_idx_to_entity"], s.shard_and_idx_to_entity)
    np.testing.assert_array_equal(d["entity_type_offsets"], s.entity_type_offsets)
  back = bess.Sharding.load_npz(path)
  assert back == s
  # A file written by numpy (as besskge's Sharding.save does, int32 here) loads too.
  other = tmp_path / "np.npz"
  np.savez(other, n_shard=np.int64(8), entity_to_shard=s.entity_to_shard.astype(np.int32),
           entity_to_idx=s.entity_to_idx, shard_and_idx_to_entity=s.shard_and_idx_to_entity,
           shard_counts=s.shard_counts, entity_type_counts=s.entity_type_counts,
           entity_type_offsets=s.entity_type_offsets)
  assert bess.Sharding.load_npz(other) == s
  again = bess.Sharding.from_arrays(8, s.entity_to_shard, s.entity_to_idx, s.shard_and_idx_to_entity, s.shard_counts,
                                    s.entity_type_counts, s.entity_type_offsets)
  assert again == s
  assert s.locate(17) == (int(s.entity_to_shard[17]), int(s.entity_to_idx[17]))


def test_partition_from_arrow_equals_from_numpy():
  rng = np.random.default_rng(3)
  h, r, t = rng.integers(0, 200, 500), rng.integers(0, 5, 500), rng.integers(0, 200, 500)
  s = bess.Sharding.create(200, 4, 1)
  a = bess.PartitionedTriples(s, h, r, t, mode="ht")
  rb = pa.record_batch({"head": pa.array(h, pa.int32()), "relation": pa.array(r), "tail": pa.array(t)})
  b = bess.PartitionedTriples.from_arrow(s, rb, mode="ht_shardpair")
  np.testing.assert_array_equal(a.triples, b.triples)
  np.testing.assert_array_equal(a.triple_sort_idx, b.triple_sort_idx)
  assert a.triple_counts.shape == (4, 4) and int(a.triple_counts.sum()) == 500 == len(a)
  # Unsigned and narrow ids are the same ids.
  c = bess.PartitionedTriples(s, h.astype(np.uint16), r.astype(np.int8), t.astype(np.uint64), mode="ht")
  np.testing.assert_array_equal(a.triples, c.triples)


# --- BessStream -> Preprocessor -----------------------------------------------------------------


def _graph(n_entity=1000, n_rel=10, n=20_000, seed=1):
  rng = np.random.default_rng(seed)
  return rng.integers(0, n_entity, n), rng.integers(0, n_rel, n), rng.integers(0, n_entity, n)


def test_stream_round_trip_through_preprocessor():
  h, r, t = _graph()
  stream = bess.BessStream((h, r, t), n_entity=1000, shard_batch_size=8, devices=(1, 1, 4), negatives=3,
                           corruption_scheme="t", flat_negatives=True, seed=1234, steps=3, annotations=True)
  counts = stream.counts
  # 4 shards; 8 triples per SparseCore = 2 per shard pair; one flat list of 3 tail negatives from
  # every shard.
  assert counts["positive_per_partition"] == 2
  assert counts["max_ids_per_partition"] == 2 * 2 + 3 == 7
  config = json.loads(stream.config_json)
  assert config["tables"][0]["max_ids_per_partition"] == 7
  assert [f["name"] for f in config["features"]] == ["head", "tail", "negative"]
  prep = sparsecore_prep.Preprocessor(stream.config_json)
  part = stream.partitioned
  n = stream.num_sparsecores
  seen = 0
  for step in range(3):
    rb, arrays = stream.draw_annotated(step)
    assert isinstance(rb, pa.RecordBatch)
    assert rb.num_rows == 4 * counts["rows_per_sparsecore"]
    _result, stats = prep(rb)
    # Every (SparseCore, partition) cell gets exactly the precomputed count: max = min.
    assert np.asarray(stats.max_ids_per_partition["entities"]).tolist() == [7] * n
    assert stats.id_drop_counters["entities"] == 0
    # The physical ids are the sampled triples' (shard, local) through the layout, row by row.
    sidx = arrays["sample_idx"].reshape(n, -1)
    heads = np.asarray(rb.column("head").flatten()).reshape(n, -1)
    local_heads = part.triples[sidx, 0]
    shard_of_block = np.repeat(np.arange(n), counts["positive_per_partition"])
    np.testing.assert_array_equal(heads, local_heads * n + shard_of_block[None, :])
    np.testing.assert_array_equal(np.asarray(rb.column("triple_idx"))[:sidx.shape[1]], sidx[0])
    seen += 1
  assert seen == 3
  # Iterating yields the remaining steps of a fresh stream as pyarrow batches too.
  again = bess.BessStream((h, r, t), n_entity=1000, shard_batch_size=8, negatives=3, flat_negatives=True, seed=1234,
                          steps=2)
  batches = list(again)
  assert len(batches) == 2 == len(again)
  assert all(b.schema.names == ["head", "tail", "relation", "triple_mask", "negative"] for b in batches)


def _cell_loads(row_pointers, local_devices, sc_per_device, n):
  """Ids per (local SparseCore, partition) cell from a stack's row pointers: partition p of a
  SparseCore's segment starts at roundup(rp[p - 1], 8) and ends at rp[p]."""
  rp = np.asarray(row_pointers).reshape(local_devices, -1)
  per_sc = rp.shape[1] // sc_per_device
  cells = []
  for d in range(local_devices):
    for sc in range(sc_per_device):
      seg = rp[d, sc * per_sc:sc * per_sc + n]
      starts = np.concatenate([[0], (seg[:-1] + 7) // 8 * 8])
      cells.append(seg - starts)
  return np.array(cells)


@pytest.mark.parametrize("devices", [(1, 1, 4), (2, 2, 4)])
def test_positives_only_stream_loads_every_cell_exactly(devices):
  # --negatives 0: every (SparseCore, partition) cell of every batch holds exactly 2 * ppp ids.
  l, g, s = devices
  h, r, t = _graph(n_entity=2000, n=40_000, seed=4)
  stream = bess.BessStream((h, r, t), n_entity=2000, shard_batch_size=16, devices=devices, seed=5, steps=3)
  n = g * s
  ppp = stream.counts["positive_per_partition"]
  assert ppp == -(-16 // n) and stream.counts["max_ids_per_partition"] == 2 * ppp
  prep = sparsecore_prep.Preprocessor(stream.config_json)
  for rb in stream:
    res, stats = prep(rb)
    cells = _cell_loads(res.lhs_row_pointers["entities"], l, s, n)
    assert cells.shape == (l * s, n)
    assert cells.min() == cells.max() == 2 * ppp
    assert stats.id_drop_counters["entities"] == 0


def test_stream_positions_are_physical_ids_of_the_sharding():
  h, r, t = _graph(n_entity=300, n=5000, seed=2)
  table = pa.table({"head": h, "relation": r.astype(np.int32), "tail": t})
  stream = bess.BessStream(table, n_entity=300, shard_batch_size=4, devices=(1, 1, 4), seed=9, steps=1,
                           sampler="rigid")
  sh = stream.sharding
  ent = np.arange(300)
  phys = stream.physical_ids(ent)
  np.testing.assert_array_equal(phys, sh.entity_to_idx * 4 + sh.entity_to_shard)
  # Rigid: positives only, every cell gets 2 * ppp ids, and the stream's padding fraction is besskge's.
  rb = stream.draw(0)
  prep = sparsecore_prep.Preprocessor(stream.config_json)
  _res, stats = prep(rb)
  assert np.all(np.asarray(stats.max_ids_per_partition["entities"]) == stream.counts["max_ids_per_partition"])
  assert 0.0 <= stream.rigid_padding_fraction < 1.0


def test_rigid_shuffle_is_seeded_and_covers_each_epoch():
  h, r, t = _graph(n_entity=200, n=3000, seed=6)
  part = bess.PartitionedTriples(bess.Sharding.create(200, 4, 1), h, r, t)
  plain = bess.BatchSampler(part, 16, sampler="rigid", return_triple_idx=True)
  a = bess.BatchSampler(part, 16, sampler="rigid", shuffle=True, seed=7, return_triple_idx=True)
  b = bess.BatchSampler(part, 16, sampler="rigid", shuffle=True, seed=7, return_triple_idx=True)
  steps = a.steps_per_epoch
  assert steps == plain.steps_per_epoch > 1
  epoch_a = [a.sample(k) for k in range(steps)]
  for k in range(steps):
    np.testing.assert_array_equal(epoch_a[k]["triple_idx"], b.sample(k)["triple_idx"])
  # An epoch reads every triple of every partition (the masked-in positions), in another order.
  def real(outs):
    return np.sort(np.concatenate([o["triple_idx"][o["triple_mask"]] for o in outs]))
  plain_epoch = [plain.sample(k) for k in range(steps)]
  np.testing.assert_array_equal(real(epoch_a), real(plain_epoch))
  np.testing.assert_array_equal(real(plain_epoch), np.arange(len(part)))
  assert not all(np.array_equal(x["triple_idx"], y["triple_idx"]) for x, y in zip(epoch_a, plain_epoch))


@pytest.mark.parametrize("kind", ["type_based", "triple_based"])
def test_stream_with_other_negative_samplers(kind):
  h, r, t = _graph(n_entity=400, n=8000, seed=8)
  rng = np.random.default_rng(9)
  extra = ({"type_offsets": [0, 150, 300]} if kind == "type_based" else
           {"neg_tails": rng.integers(0, 400, (1, 12))})
  stream = bess.BessStream((h, r, t), n_entity=400, shard_batch_size=8, negatives=2, negative_sampler=kind,
                           seed=3, steps=2, flat_negatives=kind == "triple_based", **extra)
  assert stream.config == json.loads(stream.config_json)
  prep = sparsecore_prep.Preprocessor(stream.config)
  limit = stream.counts["max_ids_per_partition"]
  for rb in stream:
    assert ("negative_mask" in rb.schema.names) == (kind == "triple_based")
    _res, stats = prep(rb)
    # Duplicates inside a negative list merge, so a cell may fall below the limit, never above.
    assert np.max(stats.max_ids_per_partition["entities"]) <= limit
    assert stats.id_drop_counters["entities"] == 0


# --- Typed errors -------------------------------------------------------------------------------


def _sharding():
  return bess.Sharding.create(100, 4, 1)


def test_error_entity_out_of_range():
  with pytest.raises(bess.EntityOutOfRangeError) as e:
    bess.PartitionedTriples(_sharding(), [1, 2, 100], [0, 0, 0], [3, 4, 5])
  assert (e.value.column, e.value.row, e.value.value, e.value.n_entity) == ("head", 2, 100, 100)
  assert isinstance(e.value, ValueError) and isinstance(e.value, bess.BessError)
  with pytest.raises(bess.EntityOutOfRangeError) as e:
    bess.PartitionedTriples(_sharding(), [1], [0], [-1])
  assert (e.value.column, e.value.value) == ("tail", -1)


def test_error_relation_out_of_range():
  with pytest.raises(bess.RelationOutOfRangeError) as e:
    bess.PartitionedTriples(_sharding(), [1, 2], [0, 7], [3, 4], n_relation=5)
  assert (e.value.column, e.value.row, e.value.value, e.value.n_relation) == ("relation", 1, 7, 5)


def test_error_length_mismatch():
  with pytest.raises(bess.LengthMismatchError) as e:
    bess.PartitionedTriples(_sharding(), [1, 2, 3], [0, 0], [3, 4, 5])
  assert (e.value.column, e.value.got, e.value.other, e.value.expected) == ("relation", 2, "head", 3)


def test_error_missing_column_and_column_type_and_null():
  with pytest.raises(bess.MissingColumnError) as e:
    bess.PartitionedTriples.from_arrow(_sharding(), pa.record_batch({"head": [1], "tail": [2]}))
  assert e.value.column == "relation"
  with pytest.raises(bess.ColumnTypeError) as e:
    bess.PartitionedTriples.from_arrow(_sharding(), pa.record_batch({"head": [1.0], "relation": [0], "tail": [2]}))
  assert e.value.column == "head" and isinstance(e.value, TypeError)
  with pytest.raises(bess.ColumnTypeError) as e:
    bess.PartitionedTriples(_sharding(), np.array([1.5]), [0], [2])
  assert e.value.column == "head"
  with pytest.raises(bess.NullValueError) as e:
    bess.PartitionedTriples.from_arrow(_sharding(), pa.record_batch({"head": [1, None], "relation": [0, 0], "tail": [2, 3]}))
  assert (e.value.column, e.value.row) == ("head", 1)


def test_error_empty_partition_under_rigid_stream_and_random_sampler():
  # All triples in shard pair (s(0), s(1)): every other pair is empty.
  sh = _sharding()
  with pytest.raises(bess.EmptyPartitionError) as e:
    bess.BessStream(([0] * 10, [0] * 10, [1] * 10), n_entity=100, shard_batch_size=8, sampler="rigid", sharding=sh)
  assert e.value.sampler == "rigid batch sampler" and "shard" in e.value.partition
  part = bess.PartitionedTriples(sh, [0] * 10, [0] * 10, [1] * 10)
  with pytest.raises(bess.EmptyPartitionError):
    bess.BatchSampler(part, 8, sampler="random", seed=1)


def test_error_zero_triples_per_block():
  part = bess.PartitionedTriples(_sharding(), *_graph(100, 3, 2000))
  with pytest.raises(bess.ZeroTriplesPerBlockError) as e:
    bess.BatchSampler(part, 1, sampler="rigid", negative_sampler=bess.RandomNegativeSampler(2, 1, "ht"))
  assert (e.value.shard_bs, e.value.ppp, e.value.n_shard, e.value.minimum) == (1, 0, 4, 5)


def test_error_shard_count_mismatch():
  with pytest.raises(bess.ShardCountMismatchError) as e:
    bess.BessStream(_graph(100, 3, 2000), n_entity=100, shard_batch_size=8, devices=(1, 1, 4),
                    sharding=bess.Sharding.create(100, 8, 1))
  assert (e.value.n_shard, e.value.num_sparsecores, e.value.global_devices, e.value.sc_per_device) == (8, 4, 1, 4)


def test_error_invalid_parameter_and_sample_idx():
  with pytest.raises(bess.InvalidParameterError) as e:
    bess.Sharding.create(100, 0, 1)
  assert (e.value.name, e.value.value) == ("n_shard", "0")
  with pytest.raises(bess.InvalidParameterError) as e:
    bess.NumpyRng(-1)
  assert e.value.name == "seed"
  with pytest.raises(bess.InvalidParameterError) as e:
    bess.PartitionedTriples(_sharding(), [1], [0], [2], mode="diagonal")
  assert e.value.name == "partition_mode"
  part = bess.PartitionedTriples(_sharding(), *_graph(100, 3, 200))
  neg = bess.RandomNegativeSampler(2, 1)
  with pytest.raises(bess.InvalidParameterError) as e:
    neg.sample(part, np.full((1, 4, 4, 2), len(part)))
  assert e.value.name == "sample_idx"
  with pytest.raises(bess.InvalidParameterError):
    neg.sample(part, np.zeros((1, 4, 2), dtype=np.int64))  # ht_shardpair needs (bps, n, n, q)
  with pytest.raises(bess.InvalidParameterError) as e:
    bess.Sharding.from_arrays(4, [0, 1], [0, 1], [[0], [1], [2], [3]], [1, 1, 0, 0])
  assert e.value.name == "entity_to_shard"


def test_error_sharding_file(tmp_path):
  bad = tmp_path / "bad.npz"
  bad.write_bytes(b"not a zip")
  with pytest.raises(bess.ShardingFileError) as e:
    bess.Sharding.load_npz(bad)
  assert e.value.path == str(bad) and "zip" in e.value.reason
  with pytest.raises(OSError) as e:
    bess.Sharding.load_npz(tmp_path / "missing.npz")
  # Also a BessError, and says which file.
  assert isinstance(e.value, bess.BessIOError) and isinstance(e.value, bess.BessError)
  assert e.value.context == f"opening {tmp_path / 'missing.npz'}" and "No such file" in str(e.value)
  # A 2-D entity_to_shard is refused, not flattened.
  sh = bess.Sharding.create(40, 4, 1)
  arrays = {k: getattr(sh, k) for k in ("entity_to_shard", "entity_to_idx", "shard_and_idx_to_entity", "shard_counts")}
  arrays["entity_to_shard"] = arrays["entity_to_shard"].reshape(4, 10)
  np.savez(tmp_path / "flat2d.npz", n_shard=4, **arrays)
  with pytest.raises(bess.ShardingFileError) as e:
    bess.Sharding.load_npz(tmp_path / "flat2d.npz")
  assert e.value.reason == "entity_to_shard = an array of shape [4, 10]: must be 1-D"


def test_errors_pickle():
  try:
    bess.PartitionedTriples(_sharding(), [1, 2, 100], [0, 0, 0], [3, 4, 5])
  except bess.EntityOutOfRangeError as e:
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is bess.EntityOutOfRangeError and str(back) == str(e) and back.value == 100
  else:
    raise AssertionError("no error")


def test_pipeline_errors_keep_their_classes():
  # A stream whose config the pipeline refuses (S not a power of two) is the pipeline's ConfigError,
  # and a BessError too.
  with pytest.raises(sparsecore_prep.ConfigError) as e:
    bess.BessStream(_graph(100, 3, 2000), n_entity=100, shard_batch_size=8, devices=(1, 1, 3))
  assert type(e.value) is bess.PipelineConfigError and isinstance(e.value, bess.BessError)
  with pytest.raises(bess.BessError) as e:
    bess.BessStream(_graph(100, 3, 2000), n_entity=100, shard_batch_size=8, devices=(0, 0, 0))
  assert isinstance(e.value, sparsecore_prep.ConfigError) and e.value.field == "local_device_count"
  back = pickle.loads(pickle.dumps(e.value))
  assert type(back) is bess.PipelineConfigError and str(back) == str(e.value) and back.field == e.value.field
  # Negative counts never reach BESS: Python's int conversion refuses them (documented).
  with pytest.raises(OverflowError):
    bess.BessStream(_graph(100, 3, 2000), n_entity=100, shard_batch_size=-1)


def test_default_negatives_are_per_triple_as_in_besskge_and_the_cli():
  h, r, t = _graph(n=4000)
  per_triple = bess.BessStream((h, r, t), n_entity=1000, shard_batch_size=8, negatives=3, seed=1, steps=1)
  # One list of 3 per triple (8 per SparseCore) from each of the 4 shards: 2 + 2 + 8 * 3 ids a cell.
  assert per_triple.counts["max_ids_per_partition"] == 28
  assert per_triple.counts["rows_per_sparsecore"] == 4 * 8 * 3
  flat = bess.BessStream((h, r, t), n_entity=1000, shard_batch_size=8, negatives=3, seed=1, steps=1,
                         flat_negatives=True)
  assert flat.counts["max_ids_per_partition"] == 2 + 2 + 3


def test_zero_steps_are_refused():
  with pytest.raises(bess.InvalidParameterError) as e:
    bess.BessStream(_graph(100, 3, 2000), n_entity=100, shard_batch_size=8, steps=0)
  assert (e.value.name, e.value.value, e.value.reason) == ("steps", "0", "must be at least 1")


def test_a_step_the_process_cannot_hold_is_too_large_error():
  # In a child with 3 GB of address space: 10 M negatives per list per triple need ~26 GB a step.
  import resource
  import subprocess
  import sys

  code = """
import numpy as np
from sparsecore_prep import bess
rng = np.random.default_rng(1)
h, r, t = rng.integers(0, 100, 2000), rng.integers(0, 3, 2000), rng.integers(0, 100, 2000)
try:
  bess.BessStream((h, r, t), n_entity=100, shard_batch_size=8, negatives=10_000_000, steps=1)
except bess.TooLargeError as e:
  print(e.bytes, e.reason)
"""

  def limit():
    resource.setrlimit(resource.RLIMIT_AS, (3_000_000_000, 3_000_000_000))

  out = subprocess.run([sys.executable, "-c", code], preexec_fn=limit, capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  assert out.stdout.split()[0] == str(4 * (320_000_000 * 12 + 8 * 20 + 320_000_000 * 8)), out.stdout
  assert "the allocator refuses that much" in out.stdout


def test_max_step_bytes_refuses_a_larger_step():
  h, r, t = _graph(64, 3, 2000)
  stream = lambda cap: bess.BessStream((h, r, t), n_entity=64, shard_batch_size=8, negatives=2, steps=1, max_step_bytes=cap)
  # 4 slices * (rows*12 + T*20 + NEG*8) bytes: T = 8 triples per SparseCore, 8 lists of 2 negatives from each
  # of 4 shards, NEG = 64 negative rows, one output row each (as in the test above).
  need = 4 * (64 * 12 + 8 * 20 + 64 * 8)
  with pytest.raises(bess.TooLargeError) as e:
    stream(need - 1)
  assert e.value.bytes == need and f"more than max_step_bytes = {need - 1}" in e.value.reason
  assert stream(need).step_bytes == need


def test_stub_declares_the_public_api():
  """bess.pyi declares every name of bess.__all__, and every public method and property of the
  native classes."""
  import ast

  tree = ast.parse((ROOT / "python" / "sparsecore_prep" / "bess.pyi").read_text())
  declared = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
  assert set(bess.__all__) <= set(declared), set(bess.__all__) - set(declared)
  for name in bess.__all__:
    obj = getattr(bess, name)
    if isinstance(obj, type) and not issubclass(obj, BaseException):
      runtime = {a for a in dir(obj) if not a.startswith("_")}
      stub = {n.name for n in declared[name].body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")}
      assert runtime == stub, (name, runtime ^ stub)
