"""sparsecore_prep.grain: the Parquet batch source, the preprocessing stage and tune.

Three Parquet files of 100, 37 and 150 rows (row groups of 16, 10 and 64 rows) are one sequence
of 287 rows; batches of 32 rows cross both file and row-group boundaries. Three features over
two tables (two features share table `t0`, feature-stacked; `c` is weighted) and two other
columns (`row`, the row's position in the sequence, and `label`).

Checked: the source's rows and the row groups it reads, pickling, sharding, Grain pipelines with
0 and 2 worker processes, the stage's results against the drop-in call and the reference on the
same rows (ragged numpy), Grain's per-row dicts, typed errors (also raised in a worker), the
minibatching error in a worker, two host processes agreeing on minibatches under Grain, and
`tune` against the reference's `update_preprocessing_parameters`.

REQUIRE_GRAIN=1 turns a missing Grain into a failure instead of a skip (CI).
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import socket
import subprocess
import sys
import textwrap
from types import SimpleNamespace as NS

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import reference as ref
import sparsecore_prep as scp

if os.environ.get("REQUIRE_GRAIN") == "1":
  import grain
else:
  grain = pytest.importorskip("grain")

from sparsecore_prep import grain as sg  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
L, G, S = 1, 2, 2
B = 32  # local batch
FILES = [(100, 16), (37, 10), (150, 64)]  # rows, row-group size
TOTAL = sum(n for n, _ in FILES)
VOCAB = {"t0": 500, "t1": 64}
OPTIONS = dict(local_device_count=L, global_device_count=G, num_sc_per_device=S)
LAYOUT_CASE = dict(OPTIONS)  # what reference.compare reads of a case


def ns_specs(limit=64):
  """Duck-typed specs as prepare_feature_specs_for_training leaves them: `a` and `b` stacked on
  table t0 (b's samples after a's), `c` alone on t1."""
  st = {t: NS(combiner=c, max_ids_per_partition=limit, max_unique_ids_per_partition=limit,
              suggested_coo_buffer_size_per_device=None, stack_name=t) for t, c in (("t0", "sum"), ("t1", "mean"))}
  tables = {t: NS(name=t, vocabulary_size=v, embedding_dim=8, setting_in_stack=NS(stack_name=t),
                  stacked_table_spec=st[t]) for t, v in VOCAB.items()}
  gb = B * G // L
  return {"a": NS(name="a", table_spec=tables["t0"], output_shape=[gb, 8],
                  _id_transformation=NS(row_offset=0, col_offset=0, col_shift=0)),
          "b": NS(name="b", table_spec=tables["t0"], output_shape=[gb, 8],
                  _id_transformation=NS(row_offset=gb, col_offset=0, col_shift=0)),
          "c": NS(name="c", table_spec=tables["t1"], output_shape=[gb, 8],
                  _id_transformation=NS(row_offset=0, col_offset=0, col_shift=0))}


def reference_specs(stacking="feature", limit=64):
  import jax
  from jax_tpu_embedding.sparsecore.lib.nn import embedding, embedding_spec

  tables = {t: embedding_spec.TableSpec(
      name=t, vocabulary_size=v, embedding_dim=8, initializer=jax.nn.initializers.zeros,
      optimizer=embedding_spec.SGDOptimizerSpec(), combiner="sum" if t == "t0" else "mean",
      max_ids_per_partition=limit, max_unique_ids_per_partition=limit) for t, v in VOCAB.items()}
  specs = {f: embedding_spec.FeatureSpec(name=f, table_spec=tables[t], input_shape=[B * G // L, 1],
                                         output_shape=[B * G // L, 8]) for f, t in (("a", "t0"), ("b", "t0"), ("c", "t1"))}
  if stacking == "auto":
    embedding.auto_stack_tables(specs, global_device_count=G, num_sc_per_device=S)
  embedding.prepare_feature_specs_for_training(specs, global_device_count=G, num_sc_per_device=S)
  return specs


def make_table(n, start, seed):
  rng = np.random.default_rng(seed)
  cols = {}
  for f, t in (("a", "t0"), ("b", "t0"), ("c", "t1")):
    lengths = rng.integers(0, 5, n)
    rows = [rng.integers(0, VOCAB[t], k).tolist() for k in lengths]
    cols[f] = pa.array(rows, pa.list_(pa.int64()))
    if f == "c":
      cols["c_w"] = pa.array([(rng.integers(1, 64, k) / 16).tolist() for k in lengths], pa.list_(pa.float32()))
  cols["row"] = pa.array(np.arange(start, start + n, dtype=np.int64))
  cols["label"] = pa.array(rng.random(n).astype(np.float32))
  return pa.table(cols)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  d = tmp_path_factory.mktemp("parquet")
  paths, tables, start = [], [], 0
  for i, (n, rg) in enumerate(FILES):
    t = make_table(n, start, i)
    p = str(d / f"part-{i}.parquet")
    pq.write_table(t, p, row_group_size=rg)
    paths.append(p)
    tables.append(t)
    start += n
  return paths, pa.concat_tables(tables)


def ragged(table, features=("a", "b", "c")):
  """The batch as users feed the drop-in call: object arrays of per-sample numpy arrays."""
  out = {}
  for f in features:
    rows = table.column(f).to_pylist()
    out[f] = np.array([np.asarray(r, np.int32) for r in rows] + [None], dtype=object)[:-1]
  return out


def ragged_weights(table):
  w = {}
  for f in ("a", "b"):
    w[f] = np.array([np.ones(len(r), np.float32) for r in table.column(f).to_pylist()] + [None], dtype=object)[:-1]
  w["c"] = np.array([np.asarray(r, np.float32) for r in table.column("c_w").to_pylist()] + [None], dtype=object)[:-1]
  return w


def assert_same(got, want):
  (gp, gs), (wp, ws) = got, want
  for field in ("lhs_row_pointers", "lhs_embedding_ids", "lhs_sample_ids", "lhs_gains"):
    g, w = getattr(gp, field), getattr(wp, field)
    assert sorted(g) == sorted(w), field
    for k in w:
      np.testing.assert_array_equal(np.asarray(g[k]), np.asarray(w[k]), err_msg=f"{field}[{k}]")
  np.testing.assert_array_equal(gp.num_minibatches, wp.num_minibatches)
  for field in ("max_ids_per_partition", "max_unique_ids_per_partition", "required_buffer_size_per_sc"):
    g, w = getattr(gs, field), getattr(ws, field)
    assert sorted(g) == sorted(w), field
    for k in w:
      np.testing.assert_array_equal(np.asarray(g[k]), np.asarray(w[k]), err_msg=f"{field}[{k}]")
  assert {k: int(v) for k, v in gs.id_drop_counters.items()} == {k: int(v) for k, v in ws.id_drop_counters.items()}


# ---------------------------------------------------------------------------------------------
# ParquetBatches
# ---------------------------------------------------------------------------------------------


def test_batches_cross_files_and_row_groups(files):
  paths, whole = files
  src = sg.ParquetBatches(paths, B)
  assert len(src) == TOTAL // B == 8 and src.num_rows == TOTAL
  for i in range(len(src)):
    t = src[i]
    assert t.to_pydict() == whole.slice(i * B, B).to_pydict()
  assert src[-1].column("row").to_pylist() == list(range(7 * B, 8 * B))
  # Batch 3 is rows 96..127: the last 4 rows of file 0, all 37 of file 1 would be too many: 28 of them.
  origin = json.loads(src[3].schema.metadata[sg._ORIGIN_KEY])
  assert origin == {"step": 3, "rows": [[paths[0], 96, 100], [paths[1], 0, 28]]}
  tail = sg.ParquetBatches(paths, B, drop_remainder=False)
  assert len(tail) == 9 and tail[8].column("row").to_pylist() == list(range(256, TOTAL))
  with pytest.raises(IndexError):
    src[8]
  only = sg.ParquetBatches(paths, B, columns=["row", "a"])
  assert only[0].column_names == ["row", "a"]


def test_reads_only_the_row_groups_it_needs(files, monkeypatch):
  paths, _ = files
  src = sg.ParquetBatches(paths, B)
  reads = []
  real = sg.ParquetBatches._read

  def spy(self, f, g):
    reads.append((f, g))
    return real(self, f, g)

  monkeypatch.setattr(sg.ParquetBatches, "_read", spy)
  monkeypatch.setattr(sg, "_ROW_GROUPS", sg._RowGroupCache(8))
  src[3]  # rows 96..127: file 0's row group 6 (96..99), file 1's groups 0, 1, 2 (100..127)
  assert reads == [(0, 6), (1, 0), (1, 1), (1, 2)]
  reads.clear()
  src[4]  # rows 128..159: file 1's group 2 again (cached), group 3, file 2's group 0
  assert reads == [(1, 3), (2, 0)]


def test_source_pickles_small_and_shards(files):
  paths, whole = files
  src = sg.ParquetBatches(paths, B)
  blob = pickle.dumps(src)
  assert len(blob) < 1000, len(blob)
  back = pickle.loads(blob)
  assert back[5].to_pydict() == src[5].to_pydict()
  parts = [sg.ParquetBatches(paths, B, shard=(k, 3)) for k in range(3)]
  assert [len(p) for p in parts] == [2, 2, 2]  # 8 batches: each host 8 // 3, in step
  assert parts[1][1].column("row").to_pylist() == list(range(4 * B, 5 * B))  # batch 1 * 3 + 1
  opts = grain.sharding.ShardOptions(shard_index=1, shard_count=2)
  half = sg.ParquetBatches(paths, B, shard=opts)
  assert len(half) == 4 and half[3].column("row")[0].as_py() == 7 * B
  assert json.loads(half[3].schema.metadata[sg._ORIGIN_KEY])["step"] == 3


# ---------------------------------------------------------------------------------------------
# Preprocess
# ---------------------------------------------------------------------------------------------


def stage_of(specs, **kw):
  return sg.Preprocess(specs, weights={"c": "c_w"}, **OPTIONS, **kw)


def test_preprocess_equals_the_drop_in(files):
  paths, _ = files
  specs = ns_specs()
  stage = stage_of(specs)
  assert stage.arrow_native(B)  # the Arrow path, checked against the drop-in call
  src = sg.ParquetBatches(paths, B, drop_remainder=False)
  for i in range(len(src) - 1):
    t = src[i]
    pre, stats, rest = stage.map(t)
    want = scp.preprocess_sparse_dense_matmul_input(ragged(t), ragged_weights(t), specs, L, G, S)
    assert_same((pre, stats), want)
    assert sorted(rest) == ["label", "row"]
    np.testing.assert_array_equal(rest["row"], np.arange(i * B, min((i + 1) * B, TOTAL)))
    assert rest["label"].dtype == np.float32
  # The last batch, 31 rows, does not split over the 2 SparseCores: the drop-in's error, located.
  with pytest.raises(scp.InvalidInputError) as e:
    stage.map(src[len(src) - 1])
  assert f"batch 8 ({paths[2]} rows 119..150)" in str(e.value)
  with pytest.raises(scp.InvalidInputError):
    scp.preprocess_sparse_dense_matmul_input(ragged(src[8]), ragged_weights(src[8]), specs, L, G, S)


def test_preprocess_thread_safe(files):
  import concurrent.futures

  paths, _ = files
  specs = ns_specs()
  stage = stage_of(specs)
  src = sg.ParquetBatches(paths, B)
  want = [stage.map(src[i]) for i in range(len(src))]
  with concurrent.futures.ThreadPoolExecutor(8) as pool:
    got = list(pool.map(lambda i: stage.map(src[i]), list(range(len(src))) * 4))
  for i, g in enumerate(got):
    assert_same(g[:2], want[i % len(src)][:2])


@pytest.mark.skipif(not ref.reference_available(), reason="needs the reference (jax-tpu-embedding)")
@pytest.mark.parametrize("stacking", ["feature", "auto"])
def test_preprocess_equals_the_reference(files, stacking):
  from jax_tpu_embedding.sparsecore.lib.nn import embedding

  paths, _ = files
  specs = reference_specs(stacking)
  stage = stage_of(specs)
  if stacking == "feature":
    assert stage.arrow_native(B)
  src = sg.ParquetBatches(paths, B)
  for i in (0, 3, 7):
    t = src[i]
    theirs = embedding.preprocess_sparse_dense_matmul_input(ragged(t), ragged_weights(t), specs, L, G,
                                                            num_sc_per_device=S)
    # Equal where the reference writes; it leaves the segments' tails uninitialised.
    ref.compare(LAYOUT_CASE, ref.plain(theirs), ref.plain(stage.map(t)[:2]))


def test_per_row_dicts_through_ragged_batch(files):
  paths, whole = files
  stage = stage_of(ns_specs())
  rows = [{k: (np.asarray(v) if isinstance(v, list) else v) for k, v in r.items()} for r in whole.to_pylist()]
  ds = grain.MapDataset.source(rows).batch(B, drop_remainder=True, batch_fn=sg.ragged_batch).map(stage)
  src = sg.ParquetBatches(paths, B)
  for i, (pre, stats, rest) in enumerate(ds):
    assert_same((pre, stats), stage.map(src[i])[:2])
    np.testing.assert_array_equal(rest["row"], np.arange(i * B, (i + 1) * B))


def test_preprocess_from_a_config(files):
  paths, _ = files
  config = {"config": {"local_device_count": 1, "global_device_count": 1, "num_sc_per_device": 4},
            "tables": [{"name": "t1", "vocabulary_size": 64, "embedding_dim": 8, "combiner": "mean"}],
            "features": [{"name": "c", "table": "t1"}]}
  stage = sg.Preprocess(config, weights={"c": "c_w"})
  t = sg.ParquetBatches(paths, B)[2]
  pre, stats, rest = stage.map(t)
  cfg = copy.deepcopy(config)
  cfg["features"][0]["weights_column"] = "c_w"
  assert_same((pre, stats), scp.Preprocessor(cfg)(t))
  assert sorted(rest) == ["a", "b", "label", "row"]


def test_pipeline_with_0_and_2_workers(files):
  paths, _ = files
  specs = ns_specs()
  stage = stage_of(specs)
  src = sg.ParquetBatches(paths, B)
  want = {i: stage.map(src[i]) for i in range(len(src))}
  blob = pickle.dumps(stage)
  assert len(blob) < 4000, len(blob)
  for workers in (0, 2):
    ds = (grain.MapDataset.source(src).shuffle(seed=1).map(stage).to_iter_dataset()
          .mp_prefetch(grain.MultiprocessingOptions(num_workers=workers)))
    seen = []
    for pre, stats, rest in ds:
      i = int(rest["row"][0]) // B
      seen.append(i)
      assert_same((pre, stats), want[i][:2])
    assert sorted(seen) == list(range(len(src))), workers


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


def test_source_errors(files, tmp_path):
  paths, _ = files
  with pytest.raises(scp.ConfigError) as e:
    sg.ParquetBatches(paths, 0)
  assert e.value.field == "batch_size"
  bad = tmp_path / "not.parquet"
  bad.write_text("not parquet")
  with pytest.raises(sg.DataSourceError) as e:
    sg.ParquetBatches([paths[0], str(bad)], B)
  assert e.value.path == str(bad) and str(bad) in str(e.value)
  with pytest.raises(sg.DataSourceError) as e:
    sg.ParquetBatches(paths, B, columns=["a", "clicks"])
  assert (e.value.path, e.value.column) == (paths[0], "clicks") and "`clicks`" in str(e.value)
  other = tmp_path / "other.parquet"
  pq.write_table(pa.table({"a": pa.array(["x"] * 40), "row": np.arange(40)}), other)
  with pytest.raises(sg.DataSourceError) as e:
    sg.ParquetBatches([paths[0], str(other)], B, columns=["a", "row"])
  assert (e.value.path, e.value.column) == (str(other), "a")
  back = pickle.loads(pickle.dumps(e.value))
  assert type(back) is sg.DataSourceError and back.field_values() == e.value.field_values()


def test_preprocess_errors_name_the_file_and_column(files, tmp_path):
  paths, _ = files
  t = make_table(40, 0, 9)
  p = str(tmp_path / "typo.parquet")
  pq.write_table(t.rename_columns(["a", "bb", "c", "c_w", "row", "label"]), p)
  stage = stage_of(ns_specs())
  with pytest.raises(scp.InvalidInputError) as e:
    stage.map(sg.ParquetBatches([p], B)[0])
  assert e.value.feature == "b" and "no column `b`" in str(e.value) and p in str(e.value)
  p2 = str(tmp_path / "strings.parquet")
  pq.write_table(t.set_column(1, "b", pa.array([["x"]] * 40)), p2)
  with pytest.raises(scp.InputTypeError) as e:
    stage.map(sg.ParquetBatches([p2], B)[0])
  assert (e.value.feature, e.value.column) == ("b", "b") and p2 in str(e.value)
  # An id outside the vocabulary: the native error, with the file and rows in front.
  p3 = str(tmp_path / "oov.parquet")
  pq.write_table(t.set_column(0, "a", pa.array([[600]] * 40, pa.list_(pa.int64()))), p3)
  with pytest.raises(scp.InvalidInputError) as e:
    stage.map(sg.ParquetBatches([p3], B)[0])
  assert e.value.feature == "a" and e.value.id == 600 and f"{p3} rows 0..32" in str(e.value)


def test_errors_cross_worker_processes(files, tmp_path):
  t = make_table(64, 0, 5)
  p = str(tmp_path / "typo.parquet")
  pq.write_table(t.rename_columns(["a", "bb", "c", "c_w", "row", "label"]), p)
  ds = (grain.MapDataset.source(sg.ParquetBatches([p], B)).map(stage_of(ns_specs())).to_iter_dataset()
        .mp_prefetch(grain.MultiprocessingOptions(num_workers=2)))
  with pytest.raises(scp.InvalidInputError) as e:
    next(iter(ds))
  assert e.value.feature == "b" and p in str(e.value)


def test_multi_host_minibatching_in_a_worker_is_a_clear_error(files):
  paths, _ = files

  class Alone:
    def all_reduce_or(self, sync_key, value):
      return value

  stage = stage_of(ns_specs(), enable_minibatching=True, all_reduce_interface=Alone())
  t = sg.ParquetBatches(paths, B)[0]
  stage.map(t)  # here: the interface is at hand
  # Two steps at once on one host would wait for each other's peers: a clear error instead.
  import threading

  inside, go = threading.Event(), threading.Event()

  class Slow:
    def all_reduce_or(self, sync_key, value):
      inside.set()
      go.wait(30)
      return value

  slow = stage_of(ns_specs(), enable_minibatching=True, all_reduce_interface=Slow())
  first = threading.Thread(target=slow.map, args=(t,))
  first.start()
  inside.wait(30)
  with pytest.raises(scp.ConfigError) as e:
    slow.map(t)
  assert "num_threads=1" in str(e.value)
  go.set()
  first.join()
  moved = pickle.loads(pickle.dumps(stage))
  with pytest.raises(scp.ConfigError) as e:
    moved.map(t)
  assert e.value.field == "all_reduce_interface" and "num_workers=0" in str(e.value)


def test_import_error_without_grain():
  code = "import sys; sys.modules['grain'] = None\ntry:\n import sparsecore_prep.grain\nexcept ImportError as e:\n print(e)"
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
  assert "pip install grain" in out


# ---------------------------------------------------------------------------------------------
# Two hosts, minibatching, each host its own Grain pipeline in its main process
# ---------------------------------------------------------------------------------------------

HOST = textwrap.dedent("""
    import json, pickle, sys
    import grain, numpy as np
    import sparsecore_prep as scp
    from sparsecore_prep import grain as sg
    sys.path.insert(0, {here!r})
    import test_grain as tg

    host, ports, paths, out = int(sys.argv[1]), json.loads(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]
    ari = scp.get_all_reduce_interface([f"127.0.0.1:{{p}}" for h, p in enumerate(ports) if h != host], ports[host],
                                       host_id=host, host_count=2, token="test-grain", timeout=60)
    specs = tg.ns_specs(limit=8)  # small limits: batches split into minibatches
    stage = sg.Preprocess(specs, weights={{"c": "c_w"}}, local_device_count=1, global_device_count=2,
                          num_sc_per_device=2, enable_minibatching=True, allow_id_dropping=True,
                          all_reduce_interface=ari)
    src = sg.ParquetBatches(paths, tg.B, shard=(host, 2))
    # No worker processes; one read thread: the hosts exchange step after step.
    ds = grain.MapDataset.source(src).map(stage).to_iter_dataset(grain.ReadOptions(num_threads=1))
    got = [(pre, st) for pre, st, _ in ds]
    # The same rows through the drop-in call, step by step, under other batch numbers.
    want = []
    for i in range(len(src)):
        t = src[i]
        want.append(scp.preprocess_sparse_dense_matmul_input(
            tg.ragged(t), tg.ragged_weights(t), specs, 1, 2, num_sc_per_device=2, batch_number=1000 + i,
            enable_minibatching=True, allow_id_dropping=True, all_reduce_interface=ari))
    for g, w in zip(got, want):
        tg.assert_same(g, w)
    with open(out, "w") as fh:
        json.dump([int(pre.num_minibatches[0]) for pre, _ in got], fh)
""")


def test_two_hosts_minibatching_under_grain(files, tmp_path):
  paths, _ = files
  script = tmp_path / "host.py"
  script.write_text(HOST.format(here=HERE))
  socks = []
  for _ in range(2):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    socks.append(s)
  ports = [s.getsockname()[1] for s in socks]
  for s in socks:
    s.close()
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  procs = [subprocess.Popen([sys.executable, str(script), str(h), json.dumps(ports), json.dumps(paths),
                             str(tmp_path / f"host{h}.json")], env=env, stderr=subprocess.PIPE, text=True)
           for h in range(2)]
  errs = [p.communicate(timeout=240)[1] for p in procs]
  assert [p.returncode for p in procs] == [0, 0], "\n".join(errs)
  splits = [json.loads((tmp_path / f"host{h}.json").read_text()) for h in range(2)]
  assert splits[0] == splits[1] and len(splits[0]) == 4
  assert max(splits[0]) > 1, splits  # the hosts did split, and agreed


# ---------------------------------------------------------------------------------------------
# tune
# ---------------------------------------------------------------------------------------------


def merged_stats(results):
  out = {f: {} for f in ("max_ids_per_partition", "max_unique_ids_per_partition", "required_buffer_size_per_sc")}
  for _, st in results:
    for f in out:
      for k, v in getattr(st, f).items():
        out[f][k] = np.maximum(out[f].get(k, v), v)
  return out


def test_tune_as_update_preprocessing_parameters(files):
  paths, _ = files
  src = sg.ParquetBatches(paths, B)
  if ref.reference_available():
    from jax_tpu_embedding.sparsecore.lib.nn import embedding

    theirs = reference_specs(limit=256)
    results = [embedding.preprocess_sparse_dense_matmul_input(ragged(src[i]), ragged_weights(src[i]), theirs, L, G,
                                                              num_sc_per_device=S) for i in range(len(src))]
    m = merged_stats(results)
    stats = embedding.SparseDenseMatmulInputStats(
        max_ids_per_partition=m["max_ids_per_partition"],
        max_unique_ids_per_partition=m["max_unique_ids_per_partition"],
        required_buffer_size_per_sc=m["required_buffer_size_per_sc"])
    embedding.update_preprocessing_parameters(theirs, stats, S)
    ours = reference_specs(limit=256)
  else:
    ours = ns_specs(limit=256)
    results = [scp.preprocess_sparse_dense_matmul_input(ragged(src[i]), ragged_weights(src[i]), ours, L, G, S)
               for i in range(len(src))]
    m = merged_stats(results)
    theirs = None
  got = sg.tune(paths, ours, headroom=1.0, weights={"c": "c_w"}, **OPTIONS)
  for f, per_stack in m.items():
    for k, v in per_stack.items():
      np.testing.assert_array_equal(getattr(got, f)[k], v, err_msg=f"{f}[{k}]")
  fields = ("max_ids_per_partition", "max_unique_ids_per_partition", "suggested_coo_buffer_size_per_device")
  for f in ("a", "b", "c"):
    st = ours[f].table_spec.stacked_table_spec
    if theirs is not None:
      want = theirs[f].table_spec.stacked_table_spec
      assert [getattr(st, x) for x in fields] == [getattr(want, x) for x in fields], f
    stack = ours[f].table_spec.setting_in_stack.stack_name
    assert st.max_ids_per_partition == int(m["max_ids_per_partition"][stack].max())
    assert st.suggested_coo_buffer_size_per_device == int(m["required_buffer_size_per_sc"][stack].max()) * S
  # With headroom, the limits grow, and the tuned specs preprocess every batch without dropping.
  roomy = ns_specs(limit=256)
  sg.tune(paths, roomy, headroom=1.5, sample=3, weights={"c": "c_w"}, **OPTIONS)
  for stack, st in (("t0", roomy["a"].table_spec.stacked_table_spec), ("t1", roomy["c"].table_spec.stacked_table_spec)):
    assert st.max_ids_per_partition >= m["max_ids_per_partition"][stack].max()
  stage = stage_of(roomy)
  for i in range(len(src)):
    _, stats, _ = stage.map(src[i])
    assert all(int(v) == 0 for v in stats.id_drop_counters.values())


# ---------------------------------------------------------------------------------------------
# examples/grain_train.py
# ---------------------------------------------------------------------------------------------


@pytest.mark.skipif(not ref.reference_available(), reason="the example uses the reference's specs")
def test_grain_train_example_learns():
  root = os.path.abspath(os.path.join(HERE, "..", ".."))
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(
      p for p in (os.path.join(root, "python"), os.environ.get("PYTHONPATH")) if p))
  proc = subprocess.run([sys.executable, os.path.join(root, "examples", "grain_train.py")], env=env,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  last = proc.stdout.strip().splitlines()[-1]
  assert last.startswith("held-out AUC: ") and float(last.split()[-1]) >= 0.70, last
