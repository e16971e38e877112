"""Times our CPU kernels against a jitted JAX-on-CPU implementation of the same math.

    python python/bench_kernels.py [--workloads criteo long] [--dims 16 64] [--threads 1 2]
                                   [--repeat 7] [--vocab-cap 262144] [--json]

Inputs: the test kit's `criteo` and `long` workloads (`sparsecore-prep generate`, layout
1/1/4, one batch of the profile's default size), preprocessed once by `sparsecore_prep.Preprocessor`
into the four buffers per stack. Both sides run on exactly these buffers; only the table dim
changes between points (16 and 64; the buffers do not depend on it). Vocabularies larger than
`--vocab-cap` (a multiple of the 4 partitions, so every id keeps its partition and the config's
limits still hold) are folded to it (id mod cap), so that the tables of both sides fit in memory.

Two passes per point:
* forward: every stack's activations `[L * bsd, D]` from the buffers.
  Ours: `NativeKernels.forward` (sparse_dense_matmul_into). JAX: `segment_sum(table[rows] *
  gains, act_rows)` under `jax.jit`.
* train: forward, then the row gradients of the given activation gradients and one Adagrad
  step on the touched rows, in place. Ours: `forward` + `backward_in_place`
  (apply_gradients_into). JAX: the same forward, `segment_sum(dact[act_rows] * gains,
  inverse)` over the unique rows, `acc.at[uniq].add(g^2)`, `table.at[uniq].add(-lr g /
  sqrt(acc))`, jitted with the table and accumulator donated (updated in place).
The slot -> (table row, activation row) decoding of the buffers and the unique rows are
computed once on the host for JAX and not timed (JAX's best case); ours decodes and sorts on
every call.

Threads: our pool gets `t` threads; the whole process (JAX's XLA threads included) is pinned to
`t` CPUs with sched_setaffinity. The two sides alternate, `--repeat` times each after a warm-up;
reported are medians of wall time, as M rows/s (rows = valid slots, ids looked up), and the
ratio ours / JAX. The outputs of both sides are checked to agree (1e-5) before timing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

os.environ.setdefault("JAX_PLATFORMS", "cpu")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
LR = 0.05


def cli() -> str:
  if os.environ.get("SPARSECORE_PREP_CLI"):
    return os.environ["SPARSECORE_PREP_CLI"]
  for profile in ("release", "debug"):
    p = os.path.join(ROOT, "target", profile, "sparsecore-prep")
    if os.path.exists(p):
      return p
  raise SystemExit("build the CLI first: cargo build --release -p sparsecore-cli")


def workload(name: str):
  out = os.path.join(ROOT, "target", "bench-kernels")
  os.makedirs(out, exist_ok=True)
  arrow, cfg = os.path.join(out, f"{name}.arrow"), os.path.join(out, f"{name}.json")
  if not (os.path.exists(arrow) and os.path.exists(cfg)):
    subprocess.run([cli(), "generate", "--profile", name, "--out", arrow, "--config-out", cfg], check=True,
                   stdout=subprocess.DEVNULL)
  return arrow, cfg


def folded(arrow: str, cfg_path: str, cap: int):
  """The first batch and the config, with vocabularies above `cap` folded to it."""
  import pyarrow as pa
  import pyarrow.compute as pc

  with open(cfg_path) as fh:
    config = json.load(fh)
  with pa.memory_map(arrow) as src:
    batch = pa.ipc.open_file(src).get_batch(0)
  vocab = {}
  for t in config["tables"]:
    if t["vocabulary_size"] > cap:
      t["vocabulary_size"] = cap
    vocab[t["name"]] = t["vocabulary_size"]
  cols = {}
  for f in config["features"]:
    col_name = f.get("column") or f["name"]
    col = batch.column(col_name)
    values = pc.bit_wise_and(col.values, pa.scalar(cap - 1, col.values.type)) if vocab[f["table"]] == cap else col.values
    cols[col_name] = type(col).from_arrays(col.offsets, values)
  for name in batch.schema.names:
    cols.setdefault(name, batch.column(name))
  return pa.RecordBatch.from_pydict(cols), config


def decode(rp, eid, sid, gains, layout, stack, local):
  """Valid slots of one stack: (table row, activation row, gain), in buffer order (no minibatching)."""
  s_count, n = layout["sc"], stack["shards"]
  rpb = max(n, 8)
  c = eid.size // local
  rp_len = rp.size // local
  cs = c // s_count
  bsd = stack["batch_per_device"]
  bsps = bsd // s_count
  rows, acts, gs = [], [], []
  for d in range(local):
    for sc in range(s_count):
      start = sc * cs
      for p in range(n):
        if p > 0:
          start = (start + 7) // 8 * 8
        end = min(sc * cs + max(int(rp[d * rp_len + sc * rpb + p]), 0), c)
        if start < end:
          sl = slice(d * c + start, d * c + end)
          rows.append(p * stack["rows_per_shard"] + eid[sl].astype(np.int64))
          acts.append(d * bsd + sc * bsps + sid[sl].astype(np.int64))
          gs.append(gains[sl])
        start = max(start, end)
  return np.concatenate(rows).astype(np.int32), np.concatenate(acts).astype(np.int32), np.concatenate(gs)


def pin(cpus: int) -> None:
  """Every thread of the process (JAX's included) on the first `cpus` CPUs."""
  mask = set(range(cpus))
  for tid in os.listdir("/proc/self/task"):
    try:
      os.sched_setaffinity(int(tid), mask)
    except OSError:
      pass


def median_time(fn, repeat: int) -> float:
  ts = []
  for _ in range(repeat):
    t0 = time.perf_counter()
    fn()
    ts.append(time.perf_counter() - t0)
  return float(np.median(ts))


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--workloads", nargs="+", default=["criteo", "long"])
  p.add_argument("--dims", nargs="+", type=int, default=[16, 64])
  p.add_argument("--threads", nargs="+", type=int, default=[1, 2])
  p.add_argument("--repeat", type=int, default=7)
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--vocab-cap", type=int, default=1 << 18)
  p.add_argument("--json", action="store_true")
  args = p.parse_args()

  import jax
  import jax.numpy as jnp

  sys.path.insert(0, HERE)
  import sparsecore_prep
  from sparsecore_prep import _native

  results = []
  if not args.json:
    print(f"{'workload':<8} {'dim':>4} {'thr':>4} {'rows':>9} | {'fwd ours':>9} {'fwd jax':>8} {'ratio':>6} | "
          f"{'train ours':>10} {'train jax':>9} {'ratio':>6}   (M rows/s)")
  for name in args.workloads:
    arrow, cfg_path = workload(name)
    batch, base_config = folded(arrow, cfg_path, args.vocab_cap)
    for dim in args.dims:
      config = json.loads(json.dumps(base_config))
      for t in config["tables"]:
        t["embedding_dim"] = dim
      pre, _ = sparsecore_prep.Preprocessor(config)(batch)
      m = int(np.ravel(pre.num_minibatches)[0])
      local = config["config"]["local_device_count"]
      batches = [batch.num_rows * config["config"]["global_device_count"] // local] * len(config["features"])
      natives = {t: _native.NativeKernels.from_config(json.dumps(config), batches, t) for t in args.threads}
      layout = natives[args.threads[0]].layout()
      stacks = layout["stacks"]
      names = [s["name"] for s in stacks]
      bufs = [(np.ascontiguousarray(pre.lhs_row_pointers[k]).ravel(), np.ascontiguousarray(pre.lhs_embedding_ids[k]).ravel(),
               np.ascontiguousarray(pre.lhs_sample_ids[k]).ravel(), np.ascontiguousarray(pre.lhs_gains[k]).ravel())
              for k in names]
      lay = {"sc": config["config"]["num_sc_per_device"]}
      decoded = [decode(*b, lay, s, local) for b, s in zip(bufs, stacks)]
      n_rows = sum(d[0].size for d in decoded)
      rng = np.random.default_rng(dim)
      tables = [rng.uniform(-1, 1, (s["vocab"], s["dim"])).astype(np.float32) for s in stacks]
      dacts = [rng.uniform(-1, 1, (local * s["batch_per_device"], s["dim"])).astype(np.float32) for s in stacks]
      seg = [local * s["batch_per_device"] for s in stacks]
      uniq = [np.unique(d[0], return_inverse=True) for d in decoded]

      # JAX: the same math, jitted.
      j_idx = [(jnp.asarray(r), jnp.asarray(a), jnp.asarray(g)) for r, a, g in decoded]
      j_uniq = [(jnp.asarray(u.astype(np.int32)), jnp.asarray(inv.astype(np.int32))) for u, inv in uniq]
      j_dact = [jnp.asarray(d) for d in dacts]

      def jax_forward(tabs, idx):
        return [jax.ops.segment_sum(t[r] * g[:, None], a, num_segments=n) for t, (r, a, g), n in zip(tabs, idx, seg)]

      def jax_train(tabs, accs, idx, uq, dact):
        acts = jax_forward(tabs, idx)
        new_t, new_a = [], []
        for t, acc, (r, a, g), (u, inv), da in zip(tabs, accs, idx, uq, dact):
          grad = jax.ops.segment_sum(da[a] * g[:, None], inv, num_segments=u.shape[0])
          acc = acc.at[u].add(grad * grad)
          t = t.at[u].add(-LR * grad / jnp.sqrt(acc[u]))
          new_t.append(t)
          new_a.append(acc)
        return acts, new_t, new_a

      fwd = jax.jit(jax_forward)
      train = jax.jit(jax_train, donate_argnums=(0, 1))
      j_state = {"t": [jnp.asarray(t) for t in tables], "a": [jnp.full(t.shape, 0.1, jnp.float32) for t in tables]}
      o_tables = [t.copy() for t in tables]
      o_accs = [np.full(t.shape, 0.1, np.float32) for t in tables]
      opts = [("adagrad", [LR], None, False)] * len(stacks)
      limits = [(-np.inf, np.inf)] * len(stacks)

      def ours_forward(native):
        return native.forward(bufs, m, o_tables, False)

      def ours_train(native):
        acts = native.forward(bufs, m, o_tables, False)
        native.backward_in_place(bufs, m, dacts, [[t, a] for t, a in zip(o_tables, o_accs)], opts, limits, True)
        return acts

      def jax_fwd_call():
        return jax.block_until_ready(fwd(j_state["t"], j_idx))

      def jax_train_call():
        acts, j_state["t"], j_state["a"] = train(j_state["t"], j_state["a"], j_idx, j_uniq, j_dact)
        jax.block_until_ready((acts, j_state["t"], j_state["a"]))

      # Agreement before timing: forward, and one training step from the same state.
      native = natives[args.threads[0]]
      for ours, theirs in zip(ours_forward(native), jax_fwd_call()):
        np.testing.assert_allclose(ours, np.asarray(theirs), rtol=1e-5, atol=1e-5)
      ours_train(native)
      jax_train_call()
      for ot, jt in zip(o_tables, j_state["t"]):
        np.testing.assert_allclose(ot, np.asarray(jt), rtol=1e-5, atol=1e-5)

      for threads in args.threads:
        pin(threads)
        native = natives[threads]
        for _ in range(args.warmup):
          ours_forward(native), jax_fwd_call(), ours_train(native), jax_train_call()
        fo = ft = 0.0
        fo_l, fj_l, to_l, tj_l = [], [], [], []
        for _ in range(args.repeat):  # interleaved, so that load from other processes hits both
          fo_l.append(median_time(lambda: ours_forward(native), 1))
          fj_l.append(median_time(jax_fwd_call, 1))
          to_l.append(median_time(lambda: ours_train(native), 1))
          tj_l.append(median_time(jax_train_call, 1))
        fo, fj, to, tj = (float(np.median(x)) for x in (fo_l, fj_l, to_l, tj_l))
        row = {"workload": name, "dim": dim, "threads": threads, "rows": n_rows, "stacks": len(stacks),
               "forward_ours_s": fo, "forward_jax_s": fj, "train_ours_s": to, "train_jax_s": tj,
               "forward_ratio": fj / fo, "train_ratio": tj / to}
        results.append(row)
        if args.json:
          print(json.dumps(row), flush=True)
        else:
          mr = lambda s: n_rows / s / 1e6  # noqa: E731
          print(f"{name:<8} {dim:>4} {threads:>4} {n_rows:>9} | {mr(fo):>9.1f} {mr(fj):>8.1f} {fj / fo:>5.2f}x | "
                f"{mr(to):>10.1f} {mr(tj):>9.1f} {tj / to:>5.2f}x", flush=True)
      pin(os.cpu_count() or 1)
      del j_state, o_tables, o_accs, tables
  return 0


if __name__ == "__main__":
  sys.exit(main())
