"""One instance of every picklable class that ``sparsecore_prep`` itself exports, built the same
way each time, and the script that pickles them.

``python python/tests/pickle_cases.py DIR`` writes ``DIR/NAME.pPROTOCOL.pickle`` for each object of
:func:`cases` and each protocol of :data:`PROTOCOLS`. The files in data/pickles_pre_split/ were
written so by the package as it was when every class lived in ``sparsecore_prep/__init__.py``
(module ``sparsecore_prep`` in each pickle); test_pickle_compat.py checks that they still load
into objects equal to fresh ones. Writing over them with the present package would keep that test
passing whatever the package does, so the directory is an argument, not a default.
"""

from __future__ import annotations

import os
import pickle
import sys

import numpy as np
import pyarrow as pa

import sparsecore_prep as scp

# 2: classes as GLOBAL "module\nname" opcodes; 5 (the highest, what Ray's cloudpickle uses):
# STACK_GLOBAL with the module and name as strings.
PROTOCOLS = (2, 5)

# Two tables on one device with 2 SparseCores; f0 weighted.
CONFIG = {
    "config": {"local_device_count": 1, "global_device_count": 1, "num_sc_per_device": 2},
    "tables": [
        {"name": "t0", "vocabulary_size": 64, "embedding_dim": 8, "combiner": "sum",
         "max_ids_per_partition": 64, "max_unique_ids_per_partition": 64},
        {"name": "t1", "vocabulary_size": 16, "embedding_dim": 4, "combiner": "mean",
         "max_ids_per_partition": 64, "max_unique_ids_per_partition": 64},
    ],
    "features": [
        {"name": "f0", "table": "t0", "column": "f0", "weights_column": "w0"},
        {"name": "f1", "table": "t1", "column": "f1"},
    ],
}

# The same tables as one of two hosts of a job (1 device each), minibatching on: the hosts agree
# on splits through an all_reduce_interface.
MULTI_HOST_CONFIG = {**CONFIG, "config": {"local_device_count": 1, "global_device_count": 2, "num_sc_per_device": 2,
                                          "enable_minibatching": True}}

F0 = [[1, 2, 3], [5], [63, 0, 0, 7], [], [8, 9], [10], [11, 12, 13], [40]]
W0 = [[1.0, 0.5, 2.0], [1.0], [0.25, 1.0, 1.0, 3.0], [], [1.0, 1.0], [2.0], [1.0, 1.0, 1.0], [0.5]]
F1 = [[0], [1, 2], [3], [15, 15], [4], [5, 6, 7], [8], [9]]


def record_batch(rows=slice(None)):
  """A local batch of 8 samples for CONFIG (rows: a slice of them)."""
  return pa.record_batch({
      "f0": pa.array(F0[rows], pa.list_(pa.int64())),
      "w0": pa.array(W0[rows], pa.list_(pa.float32())),
      "f1": pa.array(F1[rows], pa.list_(pa.int32())),
  })


class OneHostOr:
  """An all_reduce_interface for a host whose peers all contribute 0."""

  def all_reduce_or(self, sync_key, value):
    return value


def _drop_in_result():
  """The drop-in call on F0 with duck-typed specs, as the package's own result classes (the call
  returns the reference's classes when the reference is imported)."""
  from types import SimpleNamespace

  stacked = SimpleNamespace(combiner="sum", max_ids_per_partition=64, max_unique_ids_per_partition=64,
                            suggested_coo_buffer_size_per_device=None)
  table = SimpleNamespace(name="t0", vocabulary_size=64, embedding_dim=8, stacked_table_spec=stacked,
                          setting_in_stack=SimpleNamespace(stack_name="t0"))
  spec = SimpleNamespace(name="f0", table_spec=table, output_shape=[8, 8], _id_transformation=None)
  ids = np.empty(len(F0), dtype=object)
  weights = np.empty(len(W0), dtype=object)
  for i, (row, w) in enumerate(zip(F0, W0)):
    ids[i] = np.array(row, dtype=np.int64)
    weights[i] = np.array(w, dtype=np.float32)
  out, stats = scp.preprocess_sparse_dense_matmul_input({"f0": ids}, {"f0": weights}, {"f0": spec}, 1, 1, 2)
  m = out.sparse_dense_matmul_input
  matmul = scp.SparseDenseMatmulInput(dict(m.lhs_row_pointers), dict(m.lhs_embedding_ids), dict(m.lhs_sample_ids),
                                      dict(m.lhs_gains))
  return (scp.PreprocessedInput(matmul, out.num_minibatches),
          scp.SparseDenseMatmulInputStats(dict(stats.max_ids_per_partition), dict(stats.max_unique_ids_per_partition),
                                          dict(stats.required_buffer_size_per_sc), dict(stats.id_drop_counters)))


def cases() -> dict:
  """Name -> object: the result classes, the preprocessors, FDO stats and every exception."""
  out, stats = _drop_in_result()
  prep = scp.Preprocessor(CONFIG, threads=1)
  fdo = scp.FdoStats.merge_all([prep.fdo_stats(record_batch(slice(0, 4))), prep.fdo_stats(record_batch(slice(4, 8)))])
  return {
      "sparse_dense_matmul_input": out.sparse_dense_matmul_input,
      "preprocessed_input": out,
      "sparse_dense_matmul_input_stats": stats,
      "preprocessor": scp.Preprocessor(CONFIG),
      "preprocessor_threads_leading": scp.Preprocessor(CONFIG, threads=2, has_leading_dimension=True),
      "preprocessor_multi_host": scp.Preprocessor(MULTI_HOST_CONFIG, threads=1, all_reduce_interface=OneHostOr()),
      "fdo_stats_mapper": scp.FdoStatsMapper(CONFIG, threads=1),
      "fdo_stats": fdo,
      "sparse_core_prep_error": scp.SparseCorePrepError("base"),
      "config_error": scp.ConfigError("unknown field", field="max_ids_per_partitions", location="table `t0`",
                                      suggestion="max_ids_per_partition"),
      "invalid_input_error": scp.InvalidInputError("id out of range", feature="f0", row=3, id=99),
      "limit_exceeded_error": scp.LimitExceededError("over", stack="t0", limit_name="max_ids_per_partition",
                                                     observed=9, limit=8, device=0, sparsecore=1, partition=1),
      "input_type_error": scp.InputTypeError("float ids", feature="f1", column="f1"),
      "feature_spec_error": scp.FeatureSpecError("missing", feature="f0", attribute="table_spec.vocabulary_size"),
      "all_reduce_error": scp.AllReduceError("peer gone", sync_key=6),
  }


def main(argv) -> int:
  if len(argv) != 2:
    print(__doc__, file=sys.stderr)
    return 2
  os.makedirs(argv[1], exist_ok=True)
  for name, obj in cases().items():
    for protocol in PROTOCOLS:
      with open(os.path.join(argv[1], f"{name}.p{protocol}.pickle"), "wb") as fh:
        fh.write(pickle.dumps(obj, protocol=protocol))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
