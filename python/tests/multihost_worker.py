"""One host of a multi-host run, for test_multihost.py: runs its batch of every given golden_mh
case through the drop-in call, agreeing with the other hosts through an all-reduce, and saves
its outputs for the parent to compare.

  python multihost_worker.py --mode tcp --host H --hosts N --out DIR --ports P0,P1,... CASE...
  python multihost_worker.py --mode jax --host H --hosts N --out DIR --coordinator 127.0.0.1:P CASE...

`tcp`: `sparsecore_prep.get_all_reduce_interface` on 127.0.0.1 (this host listens on port P_H);
`jax`: `jax.distributed.initialize` on CPU and `sparsecore_prep.JaxDistributedAllReduce`.
`--die-after K`: exits abruptly before its K-th case. Host H of case C writes DIR/C/host_H.npz (arrays, stats, num_minibatches), or
DIR/C/host_H.error (the exception) and goes on with the next case. Exit status 75: the port
could not be listened on (the parent retries with other ports).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

import numpy as np

PORT_IN_USE = 75


def main() -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--mode", choices=("tcp", "jax"), required=True)
  ap.add_argument("--host", type=int, required=True)
  ap.add_argument("--hosts", type=int, required=True)
  ap.add_argument("--out", required=True)
  ap.add_argument("--ports")
  ap.add_argument("--coordinator")
  ap.add_argument("--timeout", type=float, default=60.0)
  ap.add_argument("--die-after", type=int, help="exit abruptly after this many cases (a host that dies)")
  ap.add_argument("cases", nargs="+")
  args = ap.parse_args()

  import sparsecore_prep as scp
  from test_golden import array, specs_from_resolved

  if args.mode == "tcp":
    ports = [int(p) for p in args.ports.split(",")]
    peers = [f"127.0.0.1:{p}" for h, p in enumerate(ports) if h != args.host]
    # The reference's peer list carries no ranks: out of host order, it still works.
    peers = peers[args.host % len(peers):] + peers[:args.host % len(peers)]
    try:
      ari = scp.get_all_reduce_interface(peers, ports[args.host], host_id=args.host, host_count=args.hosts,
                                         token=os.environ.get("MH_TEST_TOKEN"), timeout=args.timeout)
    except OSError as e:
      print(f"PORT_IN_USE {e}", file=sys.stderr)
      return PORT_IN_USE
  else:
    import jax
    try:
      jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=args.hosts,
                                 process_id=args.host, initialization_timeout=int(args.timeout))
    except Exception as e:  # the coordinator's port was taken, most likely
      print(f"PORT_IN_USE {type(e).__name__}: {e}", file=sys.stderr)
      return PORT_IN_USE
    ari = scp.JaxDistributedAllReduce(timeout=args.timeout)
    assert (ari.host_id, ari.host_count) == (args.host, args.hosts)

  for n, case_dir in enumerate(args.cases):
    if args.die_after is not None and n == args.die_after:
      os._exit(0)  # no goodbye: the listener just vanishes
    name = os.path.basename(case_dir.rstrip("/"))
    out_dir = os.path.join(args.out, name)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(case_dir, "case.json")) as fh:
      meta = json.load(fh)
    with open(os.path.join(case_dir, f"host_{args.host}", "input.json")) as fh:
      case = json.load(fh)
    cfg = case["config"]
    assert (cfg["host_id"], cfg["host_count"], cfg["batch_number"]) == (args.host, args.hosts, meta["batch_number"])
    try:
      feats = [array(f["ids"], np.int32, f.get("layout") == "dense") for f in case["features"]]
      weights = None
      if cfg.get("weights"):
        weights = [array(f["weights"] if f["weights"] is not None else [[1.0] * len(r) for r in f["ids"]], np.float32,
                         f.get("layout") == "dense") for f in case["features"]]
      out, stats = scp.preprocess_sparse_dense_matmul_input(
          feats, weights, specs_from_resolved(case), cfg["local_device_count"], cfg["global_device_count"],
          cfg["num_sc_per_device"], allow_id_dropping=cfg["allow_id_dropping"], batch_number=meta["batch_number"],
          enable_minibatching=True, all_reduce_interface=ari)
    except Exception:
      with open(os.path.join(out_dir, f"host_{args.host}.error"), "w") as fh:
        fh.write(traceback.format_exc())
      continue
    arrays = {"num_minibatches": np.asarray(out.num_minibatches)}
    for key, d in (("row_pointers", out.lhs_row_pointers), ("embedding_ids", out.lhs_embedding_ids),
                   ("sample_ids", out.lhs_sample_ids), ("gains", out.lhs_gains),
                   ("max_ids_per_partition", stats.max_ids_per_partition),
                   ("max_unique_ids_per_partition", stats.max_unique_ids_per_partition),
                   ("required_buffer_size_per_sc", stats.required_buffer_size_per_sc),
                   ("dropped_id_count", stats.id_drop_counters)):
      for stack, v in d.items():
        arrays[f"{key}/{stack}"] = np.asarray(v)
    np.savez(os.path.join(out_dir, f"host_{args.host}.npz"), **arrays)

  if args.mode == "tcp":
    print("counters", json.dumps(ari.counters()), flush=True)
    ari.close()
  else:
    import jax
    jax.distributed.shutdown()
  return 0


if __name__ == "__main__":
  sys.exit(main())
