"""Builds the small hostile-but-accepted workloads of this folder (Arrow IPC + config).

  PY=$(bash ../../../shared/peer/setup.sh); $PY make_hostile.py
  $PY ../../../shared/peer/run_peer.py --config weights.json --input weights.arrow --dump DIR

(weights -> finite_hostile_weights_l1g1s4, ragged9 -> batch9_l2g2s2_row8_unread,
subnormal -> subnormal_gains_l1g1s2; each DIR then holds input.json and expected.json, and
the .arrow / .json pair is kept as batch.arrow / config.json.)
"""
import json, sys
import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

def f32(x): return float(np.float32(x))

F32_MAX = float(np.finfo(np.float32).max)
SUB1 = float(np.float32(1e-45)); SUB2 = float(np.float32(3e-45))

def write(path, cols):
    tbl = pa.table(cols)
    with ipc.new_file(path, tbl.schema) as w:
        w.write_table(tbl)

def table(name, comb):
    return {"name": name, "vocabulary_size": 1000, "embedding_dim": 16, "combiner": comb,
            "max_ids_per_partition": 64, "max_unique_ids_per_partition": 64,
            "suggested_coo_buffer_size_per_device": None}

# 1. Finite hostile weights, every combiner: negative, zero-sum, all-zero, -0.0, f32::MAX (sums
#    overflow to inf), subnormals (squares underflow to 0), opposite duplicates, empty rows.
rows = [
    ([1, 2, 3], [-1.5, 2.0, -0.25]),
    ([4, 5], [1.0, -1.0]),
    ([6, 7], [0.0, 0.0]),
    ([8], [-0.0]),
    ([9, 10], [F32_MAX, F32_MAX]),
    ([11, 12], [SUB1, SUB2]),
    ([13, 13], [1.0, -1.0]),
    ([], []),
    ([14, 15], [-F32_MAX, F32_MAX]),
    ([16], [-2.0]),
    ([17, 17, 18], [0.5, 0.5, -1.0]),
    ([19, 20, 21, 22], [-0.0, 0.0, -0.0, 0.0]),
    ([23], [SUB1]),
    ([24, 25], [F32_MAX, -1.0]),
    ([26, 27], [-3.0, -4.0]),
    ([28], [1.0]),
]
ids = pa.array([r[0] for r in rows], pa.list_(pa.int32()))
w = pa.array([r[1] for r in rows], pa.list_(pa.float32()))
cols = {}
feats = []
tables = []
for comb in ["sum", "mean", "sqrtn"]:
    cols[f"f_{comb}"] = ids
    cols[f"w_{comb}"] = w
    tables.append(table(f"t_{comb}", comb))
    feats.append({"name": f"f_{comb}", "table": f"t_{comb}", "column": f"f_{comb}", "weights_column": f"w_{comb}"})
write("weights.arrow", cols)
json.dump({"config": {"local_device_count": 1, "global_device_count": 1, "num_sc_per_device": 4,
                      "allow_id_dropping": False, "stacking": "feature"},
           "tables": tables, "features": feats}, open("weights.json", "w"), indent=1)

# 2. A local batch of 9 samples on L = 2 devices of S = 2 SparseCores: per-device batch
#    floor(9 / 2) = 4 divides by S, so the reference accepts it and never reads row 8.
rows2 = [[r, r + 100] for r in range(8)] + [[999, 998, 997]]
write("ragged9.arrow", {"f0": pa.array(rows2, pa.list_(pa.int32()))})
json.dump({"config": {"local_device_count": 2, "global_device_count": 2, "num_sc_per_device": 2,
                      "allow_id_dropping": False, "stacking": "feature"},
           "tables": [table("t0", "sum")],
           "features": [{"name": "f0", "table": "t0", "column": "f0", "weights_column": None}]},
          open("ragged9.json", "w"), indent=1)

# 3. Normal weights whose gains, divisors or merged sums are subnormal (and weights that are).
rows3 = [
    ([1, 2], [f32(1e-30), f32(1e10)]),      # mean: 1e-30 / 1e10 = 1e-40 is subnormal
    ([3], [f32(1e-20)]),                     # sqrtn: Q = 1e-40 is subnormal in f32
    ([5, 5], [f32(1e-38), f32(-9e-39)]),     # subnormal weights (< 1.18e-38): +0 and -0, merged
    ([6, 7], [f32(1e-38), f32(-9e-39)]),     # the same, mean: divisor 0, gains 0 / 0
    ([8, 9], [f32(2e-38), f32(3e-38)]),      # all normal, small
    ([10], [f32(-1e-20)]),
    ([11, 11, 12], [f32(1e-38), f32(1e-38), f32(-1.5e-38)]),  # two subnormal, one normal
    ([13], [1.0]),
]
ids = pa.array([r[0] for r in rows3], pa.list_(pa.int32()))
w = pa.array([r[1] for r in rows3], pa.list_(pa.float32()))
cols, feats, tables = {}, [], []
for comb in ["sum", "mean", "sqrtn"]:
    cols[f"f_{comb}"] = ids
    cols[f"w_{comb}"] = w
    tables.append({"name": f"t_{comb}", "vocabulary_size": 1000, "embedding_dim": 16, "combiner": comb,
                   "max_ids_per_partition": 64, "max_unique_ids_per_partition": 64,
                   "suggested_coo_buffer_size_per_device": None})
    feats.append({"name": f"f_{comb}", "table": f"t_{comb}", "column": f"f_{comb}", "weights_column": f"w_{comb}"})
write("subnormal.arrow", cols)
json.dump({"config": {"local_device_count": 1, "global_device_count": 1, "num_sc_per_device": 2,
                      "allow_id_dropping": False, "stacking": "feature"},
           "tables": tables, "features": feats}, open("subnormal.json", "w"), indent=1)
