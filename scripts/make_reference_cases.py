#!/usr/bin/env python3
"""Makes the repository's reference cases (testdata/reference/) by running the reference.

Run through scripts/make_reference_cases.sh, which installs the reference into a venv with
../shared/peer/setup.sh and runs this file with the venv's python. Every case here is a small
input defined below (seeded numpy draws, written as an Arrow IPC file and a config in a
temporary directory) that the peer tools run:

- single-host cases: `run_peer.py --dump` (the golden input.json/expected.json pair);
- dense and sparse-COO cases: a ragged dump whose input.json is rewritten to the other layout
  (every row of a dense case has the same length; a COO case has no weights), keeping the
  ragged run's expected.json; `check_case.py`, run at the end over every single-host case,
  shows that the reference gives that expected.json from the rewritten input;
- multi-host cases: `run_peer_multihost.py` (case.json and host_h/).

Limits and buffer sizes are set from the reference's own stats: a first run with loose limits
(`LOOSE`) gives each stack's observed maxima, and a case's limits are those scaled by its
factors (1.0: exactly the observed maxima, so nothing drops and nothing aborts). Buffer sizes
that depend on the output (minibatching: what the reference writes plus one 8·S block, as in
../shared/golden_mb; an overflow: half of what it needs) come from one more run.

The tools' code is not copied here: they run as commands, and their outputs are read back.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

SEED = 20250211
# Limits of the calibrating run: above any count of these small batches.
LOOSE = 64
ALIGN = 8


@dataclass
class Feature:
    name: str
    table: str
    # Ids per sample: uniform in [lo, hi] (lo == hi: a fixed valency, as a dense case needs).
    lo: int = 0
    hi: int = 6
    # A share `hot` of the ids is drawn from the first `hot_ids` ids (duplicates inside a sample
    # and hot partitions), the rest uniformly from the vocabulary.
    hot: float = 0.3
    hot_ids: int = 4


@dataclass
class Table:
    name: str
    vocab: int
    dim: int = 8
    combiner: str = "sum"


@dataclass
class Spec:
    name: str
    what: str
    layout: tuple[int, int, int]  # L/G/S
    rows: int  # local batch
    tables: list[Table]
    features: list[Feature]
    weights: str | None = None  # None, "positive" (k/16, k in 1..64) or "signed" (-32..32)
    stacking: str = "feature"
    drop: bool = False
    minibatching: bool = False
    # Limits: the observed maxima scaled by (ids, unique) factors, at least 1.
    limits: tuple[float, float] = (1.0, 1.0)
    # "overflow": a suggested buffer of half the need; "large": halfway between the need and
    # the theoretical size; "fit": what the reference writes plus 8·S (minibatching).
    buffer: str | None = None
    rewrite: str | None = None  # "dense" or "coo"
    expect_error: bool = False
    hosts: int = 1  # > 1: a multi-host case (record batch h is host h's batch)
    thin_host: int | None = None  # this host's rows hold one id each, none of them hot
    batch_number: int = 0


def tbl(name, vocab, **kw):
    return Table(name, vocab, **kw)


def one(vocab=1000, combiner="sum", **feat):
    return [Table("t0", vocab, combiner=combiner)], [Feature("f0", "t0", **feat)]


SINGLE = [
    Spec("ragged_sum_dups_empty_g1s4",
         "sum, no weights; duplicates inside samples and empty samples",
         (1, 1, 4), 16, *one(hi=7, hot=0.5)),
    Spec("ragged_mean_signed_weights_g2l2s4",
         "mean over signed weights (zero included), odd vocabulary",
         (2, 2, 4), 32, *one(vocab=777, combiner="mean"), weights="signed"),
    Spec("ragged_sqrtn_weights_g4l1s2",
         "sqrtn with weights on one host of a 4-device job (L = 1, G = 4)",
         (1, 4, 2), 16, *one(vocab=500, combiner="sqrtn", lo=1), weights="positive"),
    Spec("feature_stacking_mixed_combiners_g2l2s4",
         "two features stacked on one table (sum) beside a mean table, with weights",
         (2, 2, 4), 16,
         [tbl("t0", 600), tbl("t1", 90, combiner="mean")],
         [Feature("f0", "t0"), Feature("f1", "t0", hi=3), Feature("f2", "t1", lo=1, hi=4)],
         weights="positive"),
    Spec("auto_stack_3tables_odd_vocab_g2l2s4",
         "auto stacking of three tables with odd vocabularies into one stack",
         (2, 2, 4), 16,
         [tbl("ta", 101), tbl("tb", 57), tbl("tc", 1999)],
         [Feature("fa", "ta"), Feature("fb", "tb", hi=3), Feature("fc", "tc", lo=1)],
         stacking="auto"),
    Spec("auto_stack_2groups_weights_g4l4s4",
         "auto stacking into two stacks (two embedding dims), weights",
         (4, 4, 4), 16,
         [tbl("ta", 300), tbl("tb", 200), tbl("tc", 800, dim=16), tbl("td", 64, dim=16)],
         [Feature("fa", "ta"), Feature("fb", "tb"), Feature("fc", "tc", hi=4),
          Feature("fd", "td", lo=1, hi=2)],
         weights="positive", stacking="auto"),
    Spec("drop_max_ids_g1s4",
         "dropping on, max_ids_per_partition at half the observed count, weights",
         (1, 1, 4), 32, *one(vocab=400, hi=8), weights="positive", drop=True,
         limits=(0.5, 1.0)),
    Spec("drop_max_unique_g2l1s4",
         "dropping on, max_unique_ids_per_partition at half the observed count",
         (1, 2, 4), 16, *one(vocab=2000, lo=2, hi=8, hot=0.1), drop=True, limits=(1.0, 0.5)),
    Spec("overflow_small_suggested_g1s4",
         "a suggested buffer of half the need, dropping off: the overflow drops",
         (1, 1, 4), 32, *one(vocab=300), weights="positive", buffer="overflow"),
    Spec("large_suggested_g2l2s4",
         "a suggested buffer between the need and the theoretical size",
         (2, 2, 4), 16, *one(vocab=5000, combiner="mean"), buffer="large"),
    Spec("error_limit_without_dropping_g1s4",
         "limits below the observed counts with dropping off: the reference aborts",
         (1, 1, 4), 16, *one(hi=8), limits=(0.5, 0.5), expect_error=True),
    Spec("dense_weights_g2l2s4",
         "dense input (three ids per sample) with weights, sum",
         (2, 2, 4), 16, *one(vocab=256, lo=3, hi=3), weights="positive", rewrite="dense"),
    Spec("coo_mean_g2l2s4",
         "sparse COO input, mean, positions with gaps",
         (2, 2, 4), 16,
         [tbl("t0", 700, combiner="mean"), tbl("t1", 50, combiner="sqrtn")],
         [Feature("f0", "t0"), Feature("f1", "t1", hi=3)], rewrite="coo"),
    Spec("coo_auto_stack_g4l4s2",
         "sparse COO input with auto stacking, two SparseCores per device",
         (4, 4, 2), 16,
         [tbl("ta", 333), tbl("tb", 1000)],
         [Feature("fa", "ta"), Feature("fb", "tb", hi=4)], stacking="auto", rewrite="coo"),
    Spec("vocab_1e7_two_tables_g4l4s4",
         "a 10^7-row table beside a small one",
         (4, 4, 4), 16,
         [tbl("big", 10_000_000), tbl("small", 40, combiner="sqrtn")],
         [Feature("fbig", "big", hot=0.05), Feature("fsmall", "small", hi=3)],
         weights="positive"),
]

MINIBATCH = [
    Spec("mb_sum_split_g1s4",
         "minibatching, sum: limits at 0.4 of the observed counts split the batch",
         (1, 1, 4), 32, *one(vocab=500, hi=8, hot=0.0), minibatching=True, limits=(0.4, 0.4),
         buffer="fit"),
    Spec("mb_mean_weights_g2l2s2",
         "minibatching, mean with weights, two SparseCores per device",
         (2, 2, 2), 32, *one(vocab=300, combiner="mean", hi=7, hot=0.0), weights="positive",
         minibatching=True, limits=(0.4, 0.4), buffer="fit"),
    Spec("mb_auto_stack_g2l2s4",
         "minibatching with auto stacking (the buffer set on the stack)",
         (2, 2, 4), 16,
         [tbl("ta", 120), tbl("tb", 77), tbl("tc", 900)],
         [Feature("fa", "ta", hot=0.0), Feature("fb", "tb", hi=4, hot=0.0),
          Feature("fc", "tc", lo=1, hot=0.0)],
         stacking="auto", minibatching=True, limits=(0.4, 0.4), buffer="fit"),
    Spec("mb_drop_hot_id_g1s4",
         "minibatching with dropping: one hot id fills a bucket past the limit",
         (1, 1, 4), 32, *one(vocab=400, lo=1, hi=6, hot=0.6, hot_ids=1), drop=True,
         minibatching=True, limits=(0.3, 0.3), buffer="fit"),
    Spec("mb_overflow_suggested_g1s4",
         "minibatching with a suggested buffer of half the need: the overflow drops",
         (1, 1, 4), 32, *one(vocab=600, hi=8, hot=0.0), minibatching=True, limits=(0.4, 0.4),
         buffer="overflow"),
    Spec("mb_error_hot_id_without_dropping_g1s4",
         "minibatching without dropping: a bucket over the limit aborts",
         (1, 1, 4), 32, *one(vocab=400, lo=1, hi=6, hot=0.6, hot_ids=1),
         minibatching=True, limits=(0.3, 0.3), expect_error=True),
]

MULTIHOST = [
    Spec("mh_h2_l1_thin_host1",
         "2 hosts; host 1 keeps one id per row, so alone it would not split",
         (1, 2, 4), 32, *one(vocab=800, hi=8), minibatching=True, drop=True,
         limits=(0.5, 0.5), buffer="fit", hosts=2, thin_host=1, batch_number=2),
    Spec("mh_h4_l1_weights_thin_host2",
         "4 hosts with weights; host 2 keeps one id per row, so alone it would not split",
         (1, 4, 4), 32,
         [tbl("t0", 1500), tbl("t1", 200, combiner="mean")],
         [Feature("f0", "t0", hi=12), Feature("f1", "t1", lo=2, hi=8)],
         weights="positive", minibatching=True, drop=True, limits=(0.6, 0.6), buffer="fit",
         hosts=4, thin_host=2, batch_number=6),
]


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------


def draw_batch(spec: Spec, rng, thin: bool):
    """Arrow columns of one record batch: ids (and weights) per feature."""
    vocab = {t.name: t.vocab for t in spec.tables}
    columns = {}
    for f in spec.features:
        if thin:
            lengths = np.ones(spec.rows, np.int64)
        else:
            lengths = rng.integers(f.lo, f.hi + 1, size=spec.rows)
        n = int(lengths.sum())
        hot = rng.random(n) < (0.0 if thin else f.hot)
        ids = np.where(hot, rng.integers(0, min(f.hot_ids, vocab[f.table]), size=n),
                       rng.integers(0, vocab[f.table], size=n)).astype(np.int32)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        columns[f.name] = pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids))
        if spec.weights:
            k = (rng.integers(-32, 33, size=n) if spec.weights == "signed"
                 else rng.integers(1, 65, size=n))
            w = (k / 16).astype(np.float32)
            columns[f.name + "__w"] = pa.ListArray.from_arrays(pa.array(offsets), pa.array(w))
    return pa.record_batch(list(columns.values()), names=list(columns))


def write_arrow(spec: Spec, seed: int, path: str) -> None:
    rng = np.random.default_rng([SEED, seed])
    batches = [draw_batch(spec, rng, h == spec.thin_host) for h in range(spec.hosts)]
    with pa.OSFile(path, "wb") as sink, ipc.new_file(sink, batches[0].schema) as writer:
        for b in batches:
            writer.write_batch(b)


def config(spec: Spec, limits: dict | None, suggested: dict | None) -> dict:
    """The peer tools' config. `limits`: {table: (ids, unique)} (None: LOOSE);
    `suggested`: {stack: size}, set on the tables under feature stacking (stack = table) and
    on the stacks under auto stacking."""
    ldc, gdc, nsc = spec.layout
    cfg = {"local_device_count": ldc, "global_device_count": gdc, "num_sc_per_device": nsc,
           "allow_id_dropping": spec.drop, "stacking": spec.stacking}
    if spec.minibatching:
        cfg["enable_minibatching"] = True
    tables = []
    for t in spec.tables:
        ids, unique = (limits or {}).get(t.name, (LOOSE, LOOSE))
        tables.append({"name": t.name, "vocabulary_size": t.vocab, "embedding_dim": t.dim,
                       "combiner": t.combiner, "max_ids_per_partition": ids,
                       "max_unique_ids_per_partition": unique,
                       "suggested_coo_buffer_size_per_device": None})
    if spec.stacking == "auto":
        stack_ids = max((v[0] for v in (limits or {}).values()), default=LOOSE)
        stack_unique = max((v[1] for v in (limits or {}).values()), default=LOOSE)
        cfg["stack_limits"] = {"max_ids_per_partition": stack_ids,
                               "max_unique_ids_per_partition": stack_unique}
        if suggested:
            cfg["stack_suggested_coo_buffer_size_per_device"] = suggested
    elif suggested:
        for t in tables:
            if t["name"] in suggested:
                t["suggested_coo_buffer_size_per_device"] = suggested[t["name"]]
    features = [{"name": f.name, "table": f.table, "column": f.name,
                 "weights_column": f.name + "__w" if spec.weights else None}
                for f in spec.features]
    return {"config": cfg, "tables": tables, "features": features}


# ---------------------------------------------------------------------------------------------
# Running the peer tools
# ---------------------------------------------------------------------------------------------


class Peer:
    def __init__(self, peer_dir: str, work: str):
        self.dir = peer_dir
        self.work = work

    def tool(self, name: str) -> str:
        return os.path.join(self.dir, name)

    def run(self, spec: Spec, arrow: str, cfg: dict, out: str, may_fail: bool = False):
        """Dumps `spec` under `cfg` into `out`; returns the host directories' (input, expected)
        pairs (one for a single-host case)."""
        cfg_path = os.path.join(self.work, spec.name + ".json")
        with open(cfg_path, "w") as fh:
            json.dump(cfg, fh, indent=1)
        if os.path.exists(out):
            shutil.rmtree(out)
        if spec.hosts > 1:
            cmd = [sys.executable, self.tool("run_peer_multihost.py"), "--config", cfg_path,
                   "--input", arrow, "--hosts", str(spec.hosts), "--dump", out,
                   "--batch-number", str(spec.batch_number)]
            dirs = [os.path.join(out, f"host_{h}") for h in range(spec.hosts)]
        else:
            cmd = [sys.executable, self.tool("run_peer.py"), "--config", cfg_path, "--input",
                   arrow, "--dump", out, "--repeat", "0", "--warmup", "0"]
            dirs = [out]
        r = subprocess.run(cmd, capture_output=True, text=True)
        results = []
        for d in dirs:
            exp_path = os.path.join(d, "expected.json")
            if not os.path.exists(exp_path):
                sys.exit(f"{spec.name}: no expected.json from {' '.join(cmd)}\n{r.stderr[-3000:]}")
            with open(os.path.join(d, "input.json")) as fh:
                inp = json.load(fh)
            with open(exp_path) as fh:
                exp = json.load(fh)
            npz = os.path.join(d, "raw.npz")
            if os.path.exists(npz):
                os.remove(npz)
            results.append((inp, exp))
        errors = [exp["error"] for _, exp in results if "error" in exp]
        if errors and not may_fail:
            sys.exit(f"{spec.name}: the reference failed: {errors[0]}")
        if r.returncode != 0 and not errors:
            sys.exit(f"{spec.name}: {' '.join(cmd)} exited {r.returncode}\n{r.stderr[-3000:]}")
        return results


def stack_of_table(inp: dict) -> dict:
    return {f["table"]: f["stack_name"] for f in inp["resolved"]["features"]}


def observed(results) -> dict:
    """{stack: (max ids, max unique ids)} over every SparseCore and host."""
    seen = {}
    for _, exp in results:
        for name, st in exp["stacks"].items():
            ids = max(st["stats"]["max_ids_per_partition"])
            unique = max(st["stats"]["max_unique_ids_per_partition"])
            old = seen.get(name, (0, 0))
            seen[name] = (max(old[0], ids), max(old[1], unique))
    return seen


def written(results) -> dict:
    """{stack: the largest share of its device buffer any device's written ranges reach}."""
    out = {}
    for _, exp in results:
        for name, st in exp["stacks"].items():
            c = st["coo_buffer_size_per_device"]
            top = max((end - (start // c) * c for start, end in st["valid_ranges"]
                       if end > start), default=0)
            out[name] = max(out.get(name, 0), top)
    return out


def needed(results, nsc: int) -> dict:
    """{stack: S times the largest required_buffer_size_per_sc}, the buffer of no overflow."""
    out = {}
    for _, exp in results:
        for name, st in exp["stacks"].items():
            out[name] = max(out.get(name, 0), nsc * max(st["stats"]["required_buffer_size_per_sc"]))
    return out


def rewrite(inp: dict, kind: str) -> dict:
    """The ragged input.json as a dense or a sparse-COO case of the same ids."""
    inp = json.loads(json.dumps(inp))
    for f in inp["features"]:
        rows = f["ids"]
        if kind == "dense":
            if len({len(r) for r in rows}) != 1:
                sys.exit(f"{inp['case']}: a dense case needs one length for every row")
            f["layout"] = "dense"
            continue
        if inp["config"]["weights"]:
            sys.exit(f"{inp['case']}: the COO entry point takes no weights")
        # Positions skip every other column from row 1 on: the reference ignores them.
        indices, values = [], []
        for r, row in enumerate(rows):
            for j, v in enumerate(row):
                indices.append([r, j * (1 + r % 2)])
                values.append(v)
        width = max((p for _, p in indices), default=0) + 1
        del f["ids"]
        f.update({"layout": "coo", "indices": indices, "values": values,
                  "dense_shape": [len(rows), width], "weights": None})
    inp["entry_point"] = ("preprocess_sparse_dense_matmul_input_from_sparse_tensor"
                          if kind == "coo" else "preprocess_sparse_dense_matmul_input")
    inp["description"] += (f"; rewritten as {kind} input by make_reference_cases.py, and"
                           " check_case.py gives expected.json from it")
    return inp


def make(spec: Spec, index: int, peer: Peer, out_root: str, folder: str) -> str:
    arrow = os.path.join(peer.work, spec.name + ".arrow")
    write_arrow(spec, index, arrow)
    out = os.path.join(out_root, folder, spec.name)
    tmp = os.path.join(peer.work, "calibrate")
    nsc = spec.layout[2]

    base = peer.run(spec, arrow, config(spec, None, None), tmp)
    seen = observed(base)
    stacks = stack_of_table(base[0][0])
    limits = {}
    for t in spec.tables:
        ids, unique = seen[stacks[t.name]]
        limits[t.name] = (max(1, math.floor(ids * spec.limits[0])),
                          max(1, math.floor(unique * spec.limits[1])))

    suggested = None
    if spec.buffer:
        sized = peer.run(spec, arrow, config(spec, limits, None), tmp)
        if spec.buffer == "fit":
            suggested = {s: w + ALIGN * nsc for s, w in written(sized).items()}
        elif spec.buffer == "overflow":
            suggested = {s: max(ALIGN * nsc, n // 2) for s, n in needed(sized, nsc).items()}
        elif spec.buffer == "large":
            theoretical = {s: exp["stacks"][s]["coo_buffer_size_per_device"]
                           for _, exp in sized[:1] for s in exp["stacks"]}
            suggested = {s: (n + theoretical[s]) // 2 for s, n in needed(sized, nsc).items()}
    final = peer.run(spec, arrow, config(spec, limits, suggested), out,
                     may_fail=spec.expect_error)
    failed = ["error" in exp for _, exp in final]
    if spec.expect_error != any(failed):
        sys.exit(f"{spec.name}: expected {'an error' if spec.expect_error else 'output'}, "
                 f"got {[exp.get('error') for _, exp in final]}")

    if spec.rewrite:
        inp = rewrite(final[0][0], spec.rewrite)
        with open(os.path.join(out, "input.json"), "w") as fh:
            json.dump(inp, fh, separators=(",", ":"))
            fh.write("\n")

    summary = describe(spec, folder, final)
    if spec.thin_host is not None:
        thin_inp, thin_exp = final[spec.thin_host]
        if final[0][1]["num_minibatches"] <= 1:
            sys.exit(f"{spec.name}: the hosts did not split")
        for name, st in thin_exp["stacks"].items():
            lim = thin_inp["resolved"]["stacks"][name]
            if (max(st["stats"]["max_ids_per_partition"]) > lim["max_ids_per_partition"]
                    or max(st["stats"]["max_unique_ids_per_partition"])
                    > lim["max_unique_ids_per_partition"]):
                sys.exit(f"{spec.name}: the thin host {spec.thin_host} exceeds its limits")
    return summary


def describe(spec: Spec, folder: str, results) -> str:
    """The case's row of testdata/reference/README.md's table."""
    ldc, gdc, nsc = spec.layout
    exp = results[0][1]
    if "error" in exp:
        outcome = f"error ({exp['error']['kind']})"
    else:
        drops = sum(st["stats"]["dropped_id_count"] for _, e in results
                    for st in e["stacks"].values())
        outcome = f"M = {exp['num_minibatches']}, {drops} dropped"
    hosts = f" ({spec.hosts} hosts)" if spec.hosts > 1 else ""
    return f"| `{folder}/{spec.name}` | {ldc}/{gdc}/{nsc}{hosts} | {spec.what} | {outcome} |"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peer", required=True, help="../shared/peer")
    ap.add_argument("--out", required=True, help="testdata/reference")
    ap.add_argument("--only", help="remake this case only (into a scratch directory)")
    args = ap.parse_args()
    sets = [("golden", SINGLE), ("golden_mb", MINIBATCH), ("golden_mh", MULTIHOST)]
    with tempfile.TemporaryDirectory(prefix="reference-cases-") as work:
        peer = Peer(os.path.abspath(args.peer), work)
        stage = os.path.join(work, "out")
        lines = []
        index = 0
        for folder, specs in sets:
            for spec in specs:
                index += 1
                if args.only and spec.name != args.only:
                    continue
                print(f"make_reference_cases: {folder}/{spec.name}", file=sys.stderr, flush=True)
                lines.append(make(spec, index, peer, stage, folder))
        single = [os.path.join(stage, f, d) for f in ("golden", "golden_mb")
                  if os.path.isdir(os.path.join(stage, f))
                  for d in sorted(os.listdir(os.path.join(stage, f)))]
        if single:
            check = subprocess.run([sys.executable, peer.tool("check_case.py"), *single])
            if check.returncode != 0:
                sys.exit("check_case.py: the reference does not reproduce every case")
        # The rows of README.md's table.
        print("\n".join(lines))
        if args.only:
            dest = os.path.join(tempfile.gettempdir(), "reference-case-" + args.only)
            shutil.rmtree(dest, ignore_errors=True)
            shutil.copytree(stage, dest)
            print(f"written to {dest}", file=sys.stderr)
            return 0
        for folder, _ in sets:
            shutil.rmtree(os.path.join(args.out, folder), ignore_errors=True)
            shutil.copytree(os.path.join(stage, folder), os.path.join(args.out, folder))
    return 0


if __name__ == "__main__":
    sys.exit(main())
