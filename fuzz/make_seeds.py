#!/usr/bin/env python3
"""Writes the hand-made seed corpora of the fuzz targets under fuzz/corpus/<target>/.

    PY=$(bash ../shared/peer/setup.sh)   # any python with numpy and pyarrow
    $PY fuzz/make_seeds.py [--golden ../shared/golden --golden-mb ../shared/golden_mb]

- config_json: the configs of the golden cases (inline data and the reference's results
  stripped), the configs of testdata/arrow_cases, and a few hand-written ones for the options
  the goldens do not use.
- arrow_ipc: tiny Arrow IPC files and streams (and one Parquet file) with the columns the
  target's fixed configs read (a, b, wb, c), in every accepted type, plus broken variants
  (nulls, a missing column, a wrong type, mismatched weights).
- stats_import: our FDO stats JSON, the reference's .npz (stored and deflated) and .csv dumps,
  and bare .npy arrays.

The ragged target's input is decoded by `arbitrary`, so its seeds are the minimised corpus of
a fuzzing run (`cargo fuzz cmin ragged`), not files written here.
"""

import argparse
import io
import json
import os
import zipfile

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def out_dir(target):
    d = os.path.join(HERE, "corpus", target)
    os.makedirs(d, exist_ok=True)
    return d


def write(target, name, data):
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(out_dir(target), name), "wb") as f:
        f.write(data)


# ---------------------------------------------------------------- config_json

CONFIG_KEYS = ("local_device_count", "global_device_count", "num_sc_per_device", "allow_id_dropping",
               "stacking", "stack_limits", "enable_minibatching")
TABLE_KEYS = ("name", "vocabulary_size", "embedding_dim", "combiner", "max_ids_per_partition",
              "max_unique_ids_per_partition", "suggested_coo_buffer_size_per_device")


def golden_config(path):
    d = json.load(open(path))
    cfg = {k: d["config"][k] for k in CONFIG_KEYS if d["config"].get(k) is not None}
    tables = [{k: t[k] for k in TABLE_KEYS if k in t} for t in d["tables"]]
    feats = [{"name": f["name"], "table": f["table"]} for f in d["features"]]
    return json.dumps({"config": cfg, "tables": tables, "features": feats}, separators=(",", ":"))


HANDMADE_CONFIGS = {
    "options_all": {
        "config": {"local_device_count": 2, "global_device_count": 4, "num_sc_per_device": 2,
                   "allow_id_dropping": True, "stacking": "auto", "validate_ids": False,
                   "sharding_strategy": "MOD", "enable_minibatching": False,
                   "stack_limits": {"max_ids_per_partition": 32, "max_unique_ids_per_partition": 16},
                   "stack_suggested_coo_buffer_size_per_device": {"t0_t1": 256}},
        "tables": [
            {"name": "t0", "vocabulary_size": 100, "embedding_dim": 8, "combiner": "sqrtn"},
            {"name": "t1", "vocabulary_size": 37, "embedding_dim": 5, "combiner": "sqrtn"}],
        "features": [{"name": "f0", "table": "t0", "column": "x", "weights_column": "w"},
                     {"name": "f1", "table": "t1"}]},
    "minibatching_l1g1": {
        "config": {"local_device_count": 1, "global_device_count": 1, "num_sc_per_device": 4,
                   "enable_minibatching": True},
        "tables": [{"name": "t0", "vocabulary_size": 1000, "embedding_dim": 16, "combiner": "mean",
                    "max_ids_per_partition": 4, "max_unique_ids_per_partition": 4}],
        "features": [{"name": "f0", "table": "t0"}, {"name": "f1", "table": "t0"}]},
    "suggested_small": {
        "config": {"local_device_count": 1, "global_device_count": 2, "num_sc_per_device": 4},
        "tables": [{"name": "t0", "vocabulary_size": 2147483647, "embedding_dim": 2147483647,
                    "max_ids_per_partition": 2147483647, "max_unique_ids_per_partition": 1,
                    "suggested_coo_buffer_size_per_device": 32}],
        "features": [{"name": "f0", "table": "t0"}]},
    "many_tables_auto": {
        "config": {"local_device_count": 1, "global_device_count": 1, "num_sc_per_device": 1,
                   "stacking": "auto"},
        "tables": [{"name": "t%d" % i, "vocabulary_size": 10 + i, "embedding_dim": 8 * (1 + i % 3),
                    "combiner": ["sum", "mean", "sqrtn"][i % 3]} for i in range(8)],
        "features": [{"name": "f%d" % i, "table": "t%d" % (i % 8)} for i in range(12)]},
}


def config_seeds(golden, golden_mb):
    for root in (golden, golden_mb):
        for case in sorted(os.listdir(root)):
            p = os.path.join(root, case, "input.json")
            if os.path.isfile(p):
                write("config_json", case + ".json", golden_config(p))
    cases = os.path.join(ROOT, "testdata", "arrow_cases")
    for case in sorted(os.listdir(cases)):
        p = os.path.join(cases, case, "config.json")
        if os.path.isfile(p):
            write("config_json", "arrow_" + case + ".json", json.dumps(json.load(open(p)), separators=(",", ":")))
    for name, cfg in HANDMADE_CONFIGS.items():
        write("config_json", "hand_" + name + ".json", json.dumps(cfg))


# ---------------------------------------------------------------- arrow_ipc

def ragged(rng, rows, vocab, max_len):
    return [list(rng.integers(0, vocab, rng.integers(0, max_len + 1))) for _ in range(rows)]


def table(rng, rows, id_type=pa.int32(), large=False, weights=True, vocab_a=64, vocab_c=1000):
    lt = pa.large_list if large else pa.list_
    a = ragged(rng, rows, vocab_a, 4)
    b = ragged(rng, rows, vocab_a, 3)
    c = ragged(rng, rows, vocab_c, 5)
    cols = {"a": pa.array(a, lt(id_type)), "b": pa.array(b, lt(id_type)), "c": pa.array(c, lt(id_type))}
    if weights:
        wb = [[float(rng.integers(-16, 48)) / 16 for _ in r] for r in b]
        cols["wb"] = pa.array(wb, lt(pa.float32()))
    return pa.table(cols)


def ipc_bytes(tables, stream):
    sink = io.BytesIO()
    schema = tables[0].schema
    w = ipc.new_stream(sink, schema) if stream else ipc.new_file(sink, schema)
    for t in tables:
        w.write_table(t)
    w.close()
    return sink.getvalue()


def arrow_seeds():
    rng = np.random.default_rng(7)
    variants = {
        "i32_list": dict(),
        "i64_list": dict(id_type=pa.int64()),
        "i32_large": dict(large=True),
        "i64_large": dict(id_type=pa.int64(), large=True),
        "no_weights": dict(weights=False),
        "hot_ids": dict(vocab_a=3, vocab_c=5),
        "out_of_range": dict(vocab_a=200, vocab_c=5000),
    }
    for name, kw in variants.items():
        for rows in (4, 8):
            t = table(rng, rows, **kw)
            write("arrow_ipc", f"file_{name}_{rows}.arrow", ipc_bytes([t], stream=False))
            write("arrow_ipc", f"stream_{name}_{rows}.arrows", ipc_bytes([t], stream=True))
    # Several batches of different sizes in one file and one stream.
    ts = [table(rng, r) for r in (2, 8, 6)]
    write("arrow_ipc", "file_three_batches.arrow", ipc_bytes(ts, stream=False))
    write("arrow_ipc", "stream_three_batches.arrows", ipc_bytes(ts, stream=True))
    # Odd row counts (batch not divisible by the SparseCores).
    write("arrow_ipc", "file_rows_3.arrow", ipc_bytes([table(rng, 3)], stream=False))
    # Broken variants the readers must refuse with a typed error.
    t = table(rng, 4)
    nulls = t.set_column(0, "a", pa.array([[1], None, [2, 3], []], pa.list_(pa.int32())))
    write("arrow_ipc", "file_null_list.arrow", ipc_bytes([nulls], stream=False))
    inner = t.set_column(0, "a", pa.array([[1, None], [], [2], [3]], pa.list_(pa.int32())))
    write("arrow_ipc", "stream_null_value.arrows", ipc_bytes([inner], stream=True))
    write("arrow_ipc", "file_missing_c.arrow", ipc_bytes([t.drop(["c"])], stream=False))
    wrong = t.set_column(2, "c", pa.array([[1.5], [], [2.0], []], pa.list_(pa.float64())))
    write("arrow_ipc", "file_wrong_type.arrow", ipc_bytes([wrong], stream=False))
    flat = t.set_column(0, "a", pa.array([1, 2, 3, 4], pa.int32()))
    write("arrow_ipc", "stream_not_a_list.arrows", ipc_bytes([flat], stream=True))
    wb = t.column("wb").to_pylist()
    wb[1] = wb[1] + [0.5]
    bad_w = t.set_column(t.schema.get_field_index("wb"), "wb", pa.array(wb, pa.list_(pa.float32())))
    write("arrow_ipc", "file_weights_shape.arrow", ipc_bytes([bad_w], stream=False))
    nan_w = [[float("nan")] * len(r) for r in t.column("b").to_pylist()]
    nan_t = t.set_column(t.schema.get_field_index("wb"), "wb", pa.array(nan_w, pa.list_(pa.float32())))
    write("arrow_ipc", "stream_nan_weights.arrows", ipc_bytes([nan_t], stream=True))
    empty = table(rng, 0)
    write("arrow_ipc", "stream_empty_batch.arrows", ipc_bytes([empty], stream=True))
    # Parquet: one row group per batch.
    sink = io.BytesIO()
    pq.write_table(table(rng, 8), sink, row_group_size=4, compression="none")
    write("arrow_ipc", "parquet_two_groups.parquet", sink.getvalue())


# ---------------------------------------------------------------- stats_import

def npy_bytes(a):
    b = io.BytesIO()
    np.save(b, a)
    return b.getvalue()


def npz_bytes(arrays, compressed):
    b = io.BytesIO()
    (np.savez_compressed if compressed else np.savez)(b, **arrays)
    return b.getvalue()


def stats_seeds():
    rng = np.random.default_rng(11)
    n, l, s = 4, 1, 2
    one = {
        "t0_max_ids": rng.integers(0, 20, l * n).astype(np.int64),
        "t0_max_unique_ids": rng.integers(0, 10, l * n).astype(np.int64),
        "t0_required_buffer_size": rng.integers(0, 200, l * s).astype(np.int64),
        "t0_id_drop_counters": np.array(3, dtype=np.int64),
        "t1_max_ids": rng.integers(0, 20, l * n).astype(np.int64),
        "t1_max_unique_ids": rng.integers(0, 10, l * n).astype(np.int64),
        "t1_required_buffer_size": rng.integers(0, 200, l * s).astype(np.int64),
        "t1_id_drop_counters": np.array(0, dtype=np.int64),
    }
    steps = {k: np.stack([v, v + 1]) if v.ndim else np.array([v, v + 2]) for k, v in one.items()}
    write("stats_import", "one_step.npz", npz_bytes(one, compressed=False))
    write("stats_import", "two_steps.npz", npz_bytes(steps, compressed=False))
    write("stats_import", "two_steps_deflated.npz", npz_bytes(steps, compressed=True))
    write("stats_import", "int32.npz", npz_bytes({k: v.astype(np.int32) for k, v in one.items()}, compressed=False))
    write("stats_import", "unknown_key.npz", npz_bytes({"t0_bogus": np.arange(4)}, compressed=False))
    write("stats_import", "max_ids.npy", npy_bytes(one["t0_max_ids"]))
    write("stats_import", "matrix.npy", npy_bytes(steps["t0_max_ids"]))
    write("stats_import", "scalar.npy", npy_bytes(np.array(5, dtype=np.int64)))
    write("stats_import", "float.npy", npy_bytes(np.zeros(3, dtype=np.float32)))
    z = io.BytesIO()
    with zipfile.ZipFile(z, "w") as zf:
        zf.writestr("t0_max_ids.npy", b"not an array")
    write("stats_import", "bad_member.npz", z.getvalue())

    def csv(arrays):
        lines = ["key,values"]
        for k, v in arrays.items():
            for row in (v.reshape(1, -1) if v.ndim < 2 else v):
                lines.append(k + "," + " ".join(str(int(x)) for x in row))
        return "\n".join(lines) + "\n"

    write("stats_import", "one_step.csv", csv(one))
    write("stats_import", "two_steps.csv", csv(steps))
    write("stats_import", "ragged_rows.csv", "key,values\nt0_max_ids,1 2 3\nt0_max_ids,4 5\n")
    write("stats_import", "no_header.csv", "t0_max_ids,1 2 3 4\n")

    def ours(stacks, batches=2, version=1):
        return json.dumps({"version": version, "layout": {"local_device_count": l, "global_device_count": 2,
                                                           "num_sc_per_device": s},
                           "batches": batches, "stacks": stacks}, indent=1)

    st = lambda k: {"max_ids_per_partition": one[k + "_max_ids"].tolist(),
                    "max_unique_ids_per_partition": one[k + "_max_unique_ids"].tolist(),
                    "required_buffer_size_per_sc": one[k + "_required_buffer_size"].tolist(),
                    "dropped_id_count": int(one[k + "_id_drop_counters"])}
    write("stats_import", "stats.json", ours({"t0": st("t0"), "t1": st("t1")}))
    write("stats_import", "stats_one_stack.json", ours({"t0": st("t0")}, batches=1))
    write("stats_import", "stats_unknown_stack.json", ours({"zz": st("t0")}))
    write("stats_import", "stats_v2.json", ours({"t0": st("t0")}, version=2))
    write("stats_import", "stats_empty.json", ours({}, batches=0))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    shared = os.path.join(os.path.dirname(ROOT), "shared")
    ap.add_argument("--golden", default=os.path.join(shared, "golden"))
    ap.add_argument("--golden-mb", default=os.path.join(shared, "golden_mb"))
    args = ap.parse_args()
    config_seeds(args.golden, args.golden_mb)
    arrow_seeds()
    stats_seeds()


if __name__ == "__main__":
    main()
