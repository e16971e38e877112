"""Every public object is safe to call from many threads at once: N threads sharing one
Preprocessor, the drop-in call, one FdoStats and one all-reduce get what serial calls get."""

from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import pyarrow as pa

import sparsecore_prep as scp

THREADS = 4
CALLS = 32

CONFIG = {
    "config": {"local_device_count": 1, "global_device_count": 1, "num_sc_per_device": 4},
    "tables": [
        {"name": "a", "vocabulary_size": 50_000, "embedding_dim": 8, "combiner": "sum",
         "max_ids_per_partition": 65536, "max_unique_ids_per_partition": 65536},
        {"name": "b", "vocabulary_size": 1_000, "embedding_dim": 8, "combiner": "mean",
         "max_ids_per_partition": 65536, "max_unique_ids_per_partition": 65536},
    ],
    "features": [
        {"name": "fa", "table": "a", "weights_column": "wa"},
        {"name": "fb", "table": "b"},
    ],
}


def batch(seed, rows=2048):
  """A batch big enough (about 20,000 ids) to run on the pool, with the GIL released."""
  rng = np.random.default_rng(seed)
  la = rng.integers(0, 12, rows)
  lb = rng.integers(1, 6, rows)
  fa = [rng.integers(0, 50_000, n).tolist() for n in la]
  wa = [(rng.integers(1, 64, n) / 16).astype(np.float32).tolist() for n in la]
  fb = [rng.integers(0, 1_000, n).tolist() for n in lb]
  return pa.record_batch({"fa": pa.array(fa, pa.list_(pa.int64())), "wa": pa.array(wa, pa.list_(pa.float32())),
                          "fb": pa.array(fb, pa.list_(pa.int32()))})


def flat(result):
  """A result's arrays and stats as plain numpy values, copied (the buffers are reused)."""
  out, stats = result
  m = out.sparse_dense_matmul_input
  arrays = {f"{field}/{k}": np.array(v) for field in m._fields for k, v in getattr(m, field).items()}
  arrays["num_minibatches"] = np.array(out.num_minibatches)
  for field in ("max_ids_per_partition", "max_unique_ids_per_partition", "required_buffer_size_per_sc"):
    for k, v in getattr(stats, field).items():
      arrays[f"{field}/{k}"] = np.array(v)
  arrays["dropped"] = np.array(sorted(stats.id_drop_counters.items()), dtype=object)
  return arrays


def assert_same(a, b):
  assert a.keys() == b.keys()
  for k in a:
    np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def in_threads(fn, items):
  with ThreadPoolExecutor(THREADS) as pool:
    return list(pool.map(fn, items))


def test_one_preprocessor_shared_by_threads():
  batches = [batch(s) for s in range(CALLS)]
  serial = [flat(scp.Preprocessor(CONFIG)(b)) for b in batches]
  for threads in (None, 1, 2):
    prep = scp.Preprocessor(CONFIG, threads=threads)
    got = in_threads(lambda b: flat(prep(b)), batches)
    for want, have in zip(serial, got):
      assert_same(want, have)
    stats = in_threads(prep.fdo_stats, batches)
    merged = scp.FdoStats.merge_all(stats)
    assert merged == scp.FdoStats.merge_all(scp.Preprocessor(CONFIG).fdo_stats(b) for b in batches)
    assert merged.batches == CALLS


class Recorder:
  """An all_reduce_interface for one host of two whose peer contributes 0, recording sync keys."""

  def __init__(self):
    self.keys = []

  def all_reduce_or(self, sync_key, value):
    self.keys.append(int(sync_key))
    return value


def test_settings_reach_every_native_preprocessor():
  multi = {**CONFIG, "config": {**CONFIG["config"], "global_device_count": 2, "enable_minibatching": True}}
  first, second = Recorder(), Recorder()
  prep = scp.Preprocessor(multi, all_reduce_interface=first)
  batches = [batch(s) for s in range(8)]
  in_threads(prep, batches)  # several native preprocessors exist now
  assert first.keys and set(first.keys) == {0}
  prep.set_batch_number(7)
  prep.set_all_reduce_interface(second)
  in_threads(prep, batches)
  # Every call, on whichever native preprocessor, used the new interface under step 7's keys.
  assert len(first.keys) == len(batches) and len(second.keys) == len(batches)
  assert set(second.keys) == {14}


def test_drop_in_from_threads():
  stacked = {n: SimpleNamespace(combiner=c, max_ids_per_partition=65536, max_unique_ids_per_partition=65536,
                                suggested_coo_buffer_size_per_device=None) for n, c in (("a", "sum"), ("b", "mean"))}
  specs = {}
  for f, t, vocab in (("fa", "a", 50_000), ("fb", "b", 1_000)):
    table = SimpleNamespace(name=t, vocabulary_size=vocab, embedding_dim=8, stacked_table_spec=stacked[t],
                            setting_in_stack=SimpleNamespace(stack_name=t))
    specs[f] = SimpleNamespace(name=f, table_spec=table, output_shape=[2048, 8], _id_transformation=None)

  def inputs(seed):
    b = batch(seed)
    feats, weights = {}, {}
    for name in ("fa", "fb"):
      col = b.column(name).to_pylist()
      feats[name] = np.empty(len(col), dtype=object)
      weights[name] = np.empty(len(col), dtype=object)
      wcol = b.column("wa").to_pylist() if name == "fa" else [[1.0] * len(r) for r in col]
      for i, (r, w) in enumerate(zip(col, wcol)):
        feats[name][i] = np.array(r, np.int32)
        weights[name][i] = np.array(w, np.float32)
    return feats, weights

  args = [inputs(s) for s in range(12)]
  call = lambda fw: flat(scp.preprocess_sparse_dense_matmul_input(fw[0], fw[1], specs, 1, 1, 4))
  serial = [call(a) for a in args]
  for want, have in zip(serial, in_threads(call, args)):
    assert_same(want, have)


def test_sparse_coo_drop_in_from_threads():
  # Concurrent calls run on their own threads while one call alone would take the pool: both
  # must give what serial calls give, through the COO entry point's own path too.
  stacked = SimpleNamespace(combiner="sum", max_ids_per_partition=65536, max_unique_ids_per_partition=65536,
                            suggested_coo_buffer_size_per_device=None)
  table = SimpleNamespace(name="a", vocabulary_size=50_000, embedding_dim=8, stacked_table_spec=stacked,
                          setting_in_stack=SimpleNamespace(stack_name="a"))
  specs = {"fa": SimpleNamespace(name="fa", table_spec=table, output_shape=[2048, 8], _id_transformation=None)}

  def inputs(seed, rows=2048):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 20, rows)
    row = np.repeat(np.arange(rows), lengths)
    pos = np.concatenate([np.arange(n) for n in lengths])
    indices = np.stack([row, pos], axis=1).astype(np.int64)
    values = rng.integers(0, 50_000, len(row)).astype(np.int32)
    return {"fa": indices}, {"fa": values}, {"fa": np.array([rows, 20])}

  args = [inputs(s) for s in range(12)]
  call = lambda a: flat(scp.preprocess_sparse_dense_matmul_input_from_sparse_tensor(*a, specs, 1, 1, 4))
  serial = [call(a) for a in args]
  assert sum(len(a[1]["fa"]) for a in args[:1]) >= scp._native.SMALL_BATCH_IDS
  for want, have in zip(serial, in_threads(call, args)):
    assert_same(want, have)


def test_fdo_stats_merged_from_threads():
  prep = scp.Preprocessor(CONFIG)
  parts = [prep.fdo_stats(batch(s)) for s in range(16)]
  total = scp.FdoStats.from_json(parts[0].to_json())
  in_threads(total.merge, parts[1:])
  assert total == scp.FdoStats.merge_all(parts)
  # Merging a stats object into itself doubles its batch count, as with a copy.
  one = scp.FdoStats.from_json(parts[0].to_json())
  one.merge(one)
  assert one.batches == 2


def test_all_reduce_object_from_threads():
  got = in_threads(lambda i: scp.get_all_reduce_interface(peer_addresses=[], minibatching_port=0,
                                                          host_id=0, host_count=1).all_reduce_or(i, 1 << (i % 60)),
                   range(8))
  assert got == [1 << (i % 60) for i in range(8)]
