"""Multi-host minibatching from Python, checked against the reference's own multi-host runs.

`../shared/golden_mh` holds cases of 2 and 4 hosts dumped from the reference's multi-host runs
(README there): a host's output depends on the other hosts' batches, because the hosts OR their
split decisions. Every case runs all its hosts together, and every host's arrays are compared
with its own expected.json (as test_golden.py compares a golden_mb case):

- as separate Python processes on 127.0.0.1 (multihost_worker.py), through the drop-in call with
  `get_all_reduce_interface` (our authenticated TCP all-reduce);
- as separate Python processes that call `jax.distributed.initialize` on CPU, through the
  drop-in call with `JaxDistributedAllReduce` (the coordination service's key-value store);
- as threads of this process, through a Python object with `all_reduce_or` (the path a user's
  own collective takes), and through `Preprocessor` over Arrow.

One group of processes runs every case with its number of hosts in turn, so each mode starts
2 + 4 processes. Processes have deadlines (a hung exchange fails, it never blocks), ports are
picked free and a group that loses a port race is retried with others.
"""

from __future__ import annotations

import glob
import json
import os
import pickle
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import sparsecore_prep as scp
from test_golden import PAD, SHARED, array, specs_from_resolved

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "multihost_worker.py")
MH = os.path.join(SHARED, "golden_mh")
CASES = sorted(glob.glob(os.path.join(MH, "case_mh_*")))
# A group of processes runs all its cases within this (each exchange itself times out in 60 s).
GROUP_DEADLINE = 420.0
PORT_IN_USE = 75


def load_case(path):
  with open(os.path.join(path, "case.json")) as fh:
    meta = json.load(fh)
  hosts = []
  for h in range(meta["hosts"]):
    with open(os.path.join(path, f"host_{h}", "input.json")) as fh:
      case = json.load(fh)
    with open(os.path.join(path, f"host_{h}", "expected.json")) as fh:
      expected = json.load(fh)
    hosts.append((case, expected))
  return meta, hosts


def check_host(expected, got, label):
  """`got`: {"num_minibatches", "<array>/<stack>", "<stat>/<stack>"} of one host, compared with
  its expected.json inside the ranges the reference writes (gains by bit pattern)."""
  assert "error" not in expected, f"{label}: the golden_mh cases all have outputs"
  np.testing.assert_array_equal(np.ravel(got["num_minibatches"]), expected["num_minibatches"],
                                err_msg=f"{label} num_minibatches")
  stacks = sorted(k.split("/", 1)[1] for k in got if k.startswith("row_pointers/"))
  assert stacks == sorted(expected["stacks"]), label
  for name, want in expected["stacks"].items():
    rp = np.asarray(got[f"row_pointers/{name}"])
    want_rp = np.array([PAD if v is None else v for v in want["row_pointers"]])
    mask = np.array([v is not None for v in want["row_pointers"]])
    assert rp.shape == want_rp.shape, f"{label} {name} row pointers shape"
    np.testing.assert_array_equal(rp[mask], want_rp[mask], err_msg=f"{label} {name} row pointers")
    valid = np.zeros(len(want["embedding_ids"]), dtype=bool)
    for lo, hi in want["valid_ranges"]:
      valid[lo:hi] = True
    assert valid.any() or not any(want["row_pointers"]), f"{label} {name}: nothing to compare"
    for key, arr in (("embedding_ids", got[f"embedding_ids/{name}"]), ("sample_ids", got[f"sample_ids/{name}"]),
                     ("gains_bits", np.asarray(got[f"gains/{name}"]).view(np.uint32))):
      want_v = np.array([0 if v is None else v for v in want[key]], dtype=np.int64)
      arr = np.asarray(arr)
      assert arr.shape == want_v.shape, f"{label} {name} {key} shape"
      bad = np.flatnonzero(valid & (arr.astype(np.int64) != want_v))
      assert bad.size == 0, f"{label} {name} {key} differ at {bad[:10]}"
    st = want["stats"]
    for key in ("max_ids_per_partition", "max_unique_ids_per_partition", "required_buffer_size_per_sc"):
      np.testing.assert_array_equal(got[f"{key}/{name}"], st[key], err_msg=f"{label} {name} {key}")
    assert int(np.asarray(got[f"dropped_id_count/{name}"])) == st["dropped_id_count"], f"{label} {name} drops"


def as_dict(out, stats):
  d = {"num_minibatches": out.num_minibatches}
  for key, m in (("row_pointers", out.lhs_row_pointers), ("embedding_ids", out.lhs_embedding_ids),
                 ("sample_ids", out.lhs_sample_ids), ("gains", out.lhs_gains),
                 ("max_ids_per_partition", stats.max_ids_per_partition),
                 ("max_unique_ids_per_partition", stats.max_unique_ids_per_partition),
                 ("required_buffer_size_per_sc", stats.required_buffer_size_per_sc),
                 ("dropped_id_count", stats.id_drop_counters)):
    for stack, v in m.items():
      d[f"{key}/{stack}"] = v
  return d


def drop_in_args(case):
  cfg = case["config"]
  feats = [array(f["ids"], np.int32, f.get("layout") == "dense") for f in case["features"]]
  weights = None
  if cfg.get("weights"):
    weights = [array(f["weights"] if f["weights"] is not None else [[1.0] * len(r) for r in f["ids"]], np.float32,
                     f.get("layout") == "dense") for f in case["features"]]
  return (feats, weights, specs_from_resolved(case), cfg["local_device_count"], cfg["global_device_count"],
          cfg["num_sc_per_device"])


def test_every_case_is_found():
  # No skip when the cases are missing: CI must run them.
  assert len(CASES) >= 9, f"golden_mh cases under {MH}: {CASES}"
  sizes = sorted(load_case(p)[0]["hosts"] for p in CASES)
  assert 2 in sizes and 4 in sizes


# -----------------------------------------------------------------------------
# Separate processes: TCP and jax.distributed
# -----------------------------------------------------------------------------


def free_ports(n):
  """`n` distinct ports free right now (held together while picked, so they differ)."""
  socks = []
  try:
    for _ in range(n):
      s = socket.socket()
      s.bind(("127.0.0.1", 0))
      socks.append(s)
    return [s.getsockname()[1] for s in socks]
  finally:
    for s in socks:
      s.close()


def run_group(mode, hosts, case_dirs, out_dir, extra=lambda h: []):
  """Runs `hosts` worker processes over `case_dirs`; returns {host: (returncode, stderr)}."""
  for attempt in range(4):
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(out_dir)
    if mode == "tcp":
      where = ["--ports", ",".join(map(str, free_ports(hosts)))]
    else:
      where = ["--coordinator", f"127.0.0.1:{free_ports(1)[0]}"]
    env = dict(os.environ, JAX_PLATFORMS="cpu", MH_TEST_TOKEN=secrets.token_hex(16))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH")) if p)
    procs = [subprocess.Popen([sys.executable, WORKER, "--mode", mode, "--host", str(h), "--hosts", str(hosts),
                               "--out", out_dir, *where, *extra(h), *case_dirs], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for h in range(hosts)]
    deadline = time.monotonic() + GROUP_DEADLINE
    results = {}
    for h, p in enumerate(procs):
      try:
        _, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        results[h] = (p.returncode, err)
      except subprocess.TimeoutExpired:
        for q in procs:
          q.kill()
        _, err = p.communicate()
        results[h] = ("timeout", err)
    if not any(rc == PORT_IN_USE for rc, _ in results.values()):
      return results
    for p in procs:  # a host that lost the port race: the others wait for it in vain
      if p.poll() is None:
        p.kill()
        p.communicate()
  return results


def group_results(mode, tmp_path_factory):
  by_hosts = {}
  for p in CASES:
    by_hosts.setdefault(load_case(p)[0]["hosts"], []).append(p)
  out = tmp_path_factory.mktemp(f"mh_{mode}")
  status = {}
  for hosts, dirs in sorted(by_hosts.items()):
    res = run_group(mode, hosts, dirs, str(out / f"h{hosts}"))
    for d in dirs:
      status[os.path.basename(d)] = (str(out / f"h{hosts}" / os.path.basename(d)), res)
  return status


def check_processes(path, status):
  meta, hosts = load_case(path)
  name = os.path.basename(path)
  out_dir, res = status[name]
  problems = [f"host {h}: exit {rc}\n{err[-3000:]}" for h, (rc, err) in res.items() if rc != 0]
  got = []
  for h in range(meta["hosts"]):
    err_file = os.path.join(out_dir, f"host_{h}.error")
    if os.path.exists(err_file):
      with open(err_file) as fh:
        problems.append(f"host {h} raised:\n{fh.read()}")
    npz = os.path.join(out_dir, f"host_{h}.npz")
    if os.path.exists(npz):
      with np.load(npz) as z:
        got.append({k: z[k] for k in z.files})
  assert not problems and len(got) == meta["hosts"], "\n".join(problems) or f"{name}: outputs missing"
  for h, ((case, expected), g) in enumerate(zip(hosts, got)):
    check_host(expected, g, f"{name} host {h}")
  assert len({int(np.ravel(g["num_minibatches"])[0]) for g in got}) == 1


def test_a_host_that_dies_mid_run_is_an_error_naming_it_on_the_other(tmp_path):
  dirs = [os.path.join(MH, "case_mh_00_criteo_h2_l1"), os.path.join(MH, "case_mh_07_criteo_h2_thin_host1")]
  res = run_group("tcp", 2, dirs, str(tmp_path / "out"),
                  extra=lambda h: ["--timeout", "3"] + (["--die-after", "1"] if h == 1 else []))
  assert [rc for rc, _ in res.values()] == [0, 0], res
  first = os.path.join(tmp_path, "out", os.path.basename(dirs[0]))
  assert sorted(os.listdir(first)) == ["host_0.npz", "host_1.npz"]
  second = os.path.join(tmp_path, "out", os.path.basename(dirs[1]))
  assert os.listdir(second) == ["host_0.error"]
  with open(os.path.join(second, "host_0.error")) as fh:
    text = fh.read()
  # Batch 4 of case 07: host 0 waits under sync key 8 for peer 1, which is gone.
  assert "AllReduceError: all-reduce under sync key 8" in text and "peer 1 at 127.0.0.1:" in text, text


@pytest.fixture(scope="module")
def tcp_runs(tmp_path_factory):
  return group_results("tcp", tmp_path_factory)


@pytest.fixture(scope="module")
def jax_runs(tmp_path_factory):
  return group_results("jax", tmp_path_factory)


@pytest.mark.parametrize("path", CASES, ids=os.path.basename)
def test_processes_over_tcp(path, tcp_runs):
  check_processes(path, tcp_runs)


@pytest.mark.parametrize("path", CASES, ids=os.path.basename)
def test_processes_over_jax_distributed(path, jax_runs):
  check_processes(path, jax_runs)


# -----------------------------------------------------------------------------
# Threads of this process: a user's Python collective, and Preprocessor
# -----------------------------------------------------------------------------


class ThreadOr:
  """A user's collective: the OR over `n` threads of this process (what a job would build on its
  own collective library). Records the calls it served."""

  def __init__(self, n, timeout=60.0):
    self.n, self.timeout = n, timeout
    self.cv = threading.Condition()
    self.values = {}
    self.calls = []

  def member(self, rank):
    group = self

    class Member:
      def all_reduce_or(self, sync_key, value):
        with group.cv:
          group.calls.append((rank, sync_key, value))
          slot = group.values.setdefault(sync_key, {})
          slot[rank] = value
          group.cv.notify_all()
          if not group.cv.wait_for(lambda: len(slot) == group.n, group.timeout):
            raise TimeoutError(f"sync key {sync_key}: heard from {sorted(slot)} of {group.n}")
          out = 0
          for v in slot.values():
            out |= v
          return out

    return Member()


def run_threads(n, work):
  """`work(rank)` on `n` threads; their results, or the first exception re-raised."""
  results, errors = [None] * n, []

  def go(rank):
    try:
      results[rank] = work(rank)
    except BaseException as e:  # noqa: BLE001 - re-raised below
      errors.append(e)

  threads = [threading.Thread(target=go, args=(r,)) for r in range(n)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(120)
  assert not any(t.is_alive() for t in threads), "a host thread hung"
  if errors:
    raise errors[0]
  return results


@pytest.mark.parametrize("path", CASES, ids=os.path.basename)
def test_threads_through_preprocessor_with_a_python_all_reduce_object(path):
  # Each host runs on its own thread (threads=1, no pool): hosts that shared one pool would wait
  # for each other inside it on a batch large enough to run there, as would any hosts of one job
  # that share too few threads.
  from test_api import arrow_config, record_batch
  meta, hosts = load_case(path)
  group = ThreadOr(meta["hosts"])
  b = meta["batch_number"]

  def work(h):
    case = hosts[h][0]
    prep = scp.Preprocessor(arrow_config(case), threads=1, all_reduce_interface=group.member(h))
    prep.set_batch_number(b)
    return as_dict(*prep(record_batch(case)))

  got = run_threads(meta["hosts"], work)
  for h, ((case, expected), g) in enumerate(zip(hosts, got)):
    check_host(expected, g, f"host {h}")
  # The object was asked under the reference's keys: 2b (split at all?), then 2b + 1 (where?)
  # when a split is needed.
  keys = sorted({k for _, k, _ in group.calls})
  assert keys == ([2 * b, 2 * b + 1] if hosts[0][1]["num_minibatches"] > 1 else [2 * b])
  assert len(group.calls) == meta["hosts"] * len(keys)


def test_preprocessor_takes_the_interface_later_and_refuses_none():
  from test_api import arrow_config, record_batch
  meta, hosts = load_case(os.path.join(MH, "case_mh_07_criteo_h2_thin_host1"))
  with pytest.raises(scp.ConfigError, match="all_reduce_interface must be provided"):
    scp.Preprocessor(arrow_config(hosts[0][0]))

  class Broken:
    def all_reduce_or(self, sync_key, value):
      raise AssertionError("replaced before use")

  group = ThreadOr(meta["hosts"])

  def work(h):
    prep = scp.Preprocessor(arrow_config(hosts[h][0]), threads=1, all_reduce_interface=Broken())
    if h == 1:  # shipped to a worker: the interface stays behind, and the worker sets its own
      prep = pickle.loads(pickle.dumps(prep))
      with pytest.raises(scp.AllReduceError, match="no all_reduce_interface was given") as e:
        prep(record_batch(hosts[h][0]))
      assert e.value.sync_key == 0
    prep.set_all_reduce_interface(group.member(h))
    prep.set_batch_number(meta["batch_number"])
    return as_dict(*prep(record_batch(hosts[h][0])))

  for h, ((case, expected), g) in enumerate(zip(hosts, run_threads(meta["hosts"], work))):
    check_host(expected, g, f"host {h}")
  # A one-host config built without an interface takes one later (and then asks it).
  cfg = arrow_config(hosts[0][0])
  cfg["config"]["global_device_count"] = cfg["config"]["local_device_count"]
  prep = scp.Preprocessor(cfg, threads=1)
  with pytest.raises(scp.ConfigError, match="no method all_reduce_or"):
    prep.set_all_reduce_interface(42)
  alone = ThreadOr(1)
  prep.set_all_reduce_interface(alone.member(0))
  prep.set_batch_number(4)
  prep(record_batch(hosts[0][0]))
  assert [k for _, k, _ in alone.calls][:1] == [8]


# -----------------------------------------------------------------------------
# The TCP all-reduce in one process, and errors
# -----------------------------------------------------------------------------


def tcp_pair(token_of=lambda h: "s3cret", timeout=20.0):
  ports = free_ports(2)
  return [scp.get_all_reduce_interface([f"127.0.0.1:{ports[1 - h]}"], ports[h], host_id=h, host_count=2,
                                       token=token_of(h), timeout=timeout) for h in range(2)]


def test_tcp_all_reduce_ors_and_reports_itself():
  a, b = tcp_pair()
  with a, b:
    assert (a.host_id, a.host_count, b.host_id) == (0, 2, 1)
    assert a.peers == [f"127.0.0.1:{b.port}"]
    got = run_threads(2, lambda h: [(a, b)[h].all_reduce_or(6, 1 << (3 * h)), (a, b)[h].all_reduce_or(7, 2**63 * h)])
    assert got == [[0b1001, 2**63], [0b1001, 2**63]]
    assert set(a.counters().values()) == {0}
    assert "host 0 of 2" in repr(a)
    with pytest.raises(TypeError, match="cannot be pickled"):
      pickle.dumps(a)
  with pytest.raises(scp.ConfigError, match="closed"):
    a.all_reduce_or(8, 1)


def test_tcp_peer_lists_in_any_order_or_all_in_host_order():
  ports = free_ports(3)
  addrs = [f"127.0.0.1:{p}" for p in ports]
  # The reference's form: the other hosts, here out of host order.
  hosts = [scp.get_all_reduce_interface([a for i, a in enumerate(addrs) if i != h][::-1], ports[h], host_id=h,
                                        host_count=3, token="x", timeout=20) for h in range(3)]
  assert run_threads(3, lambda h: hosts[h].all_reduce_or(1, 1 << h)) == [7, 7, 7]
  for ari in hosts:
    ari.close()
  # All hosts in host order, this host's entry unused.
  ports = free_ports(3)
  addrs = [f"127.0.0.1:{p}" for p in ports]
  hosts = [scp.get_all_reduce_interface(addrs, ports[h], host_id=h, host_count=3, token="x", timeout=20)
           for h in range(3)]
  assert run_threads(3, lambda h: hosts[h].all_reduce_or(2, 8 << h)) == [56, 56, 56]
  for ari in hosts:
    ari.close()


def test_tcp_all_reduce_with_a_wrong_token_fails_naming_the_key():
  a, b = tcp_pair(token_of=lambda h: f"token-{h}", timeout=1.5)
  with a, b:
    errs = run_threads(2, lambda h: pytest.raises(scp.AllReduceError, (a, b)[h].all_reduce_or, 12, 1))
    for e in errs:
      assert e.value.sync_key == 12 and "sync key 12" in str(e.value)
      assert "same token" in str(e.value)
    assert a.counters()["bad_mac"] >= 1 and b.counters()["bad_mac"] >= 1


def test_a_missing_host_is_an_all_reduce_error_within_the_timeout():
  path = os.path.join(MH, "case_mh_00_criteo_h2_l1")
  meta, hosts = load_case(path)
  case = hosts[0][0]
  dead = free_ports(1)[0]  # nobody listens there
  with scp.get_all_reduce_interface([f"127.0.0.1:{dead}"], 0, host_id=0, host_count=2, token="t",
                                    timeout=0.5) as ari:
    t = time.monotonic()
    with pytest.raises(scp.AllReduceError) as e:
      scp.preprocess_sparse_dense_matmul_input(*drop_in_args(case), allow_id_dropping=True, batch_number=7,
                                               enable_minibatching=True, all_reduce_interface=ari)
    assert time.monotonic() - t < 30
  assert e.value.sync_key == 14
  assert f"127.0.0.1:{dead}" in str(e.value) and isinstance(e.value, RuntimeError)


def test_errors_of_a_users_object_name_the_sync_key():
  case = load_case(os.path.join(MH, "case_mh_00_criteo_h2_l1"))[1][0][0]

  class Raises:
    def all_reduce_or(self, sync_key, value):
      raise ConnectionError("the collective is down")

  class Drops:  # returns an OR without this host's bits
    def all_reduce_or(self, sync_key, value):
      return 0

  class NotAnInt:
    def all_reduce_or(self, sync_key, value):
      return "yes"

  def call(ari, b=3):
    return scp.preprocess_sparse_dense_matmul_input(*drop_in_args(case), allow_id_dropping=True, batch_number=b,
                                                    enable_minibatching=True, all_reduce_interface=ari)

  with pytest.raises(scp.AllReduceError, match="sync key 6.*raised ConnectionError") as e:
    call(Raises())
  assert e.value.sync_key == 6 and isinstance(e.value.__cause__, ConnectionError)
  # Host 0 of this case needs a split alone, so its first value is 1 and 0 lacks it.
  with pytest.raises(scp.AllReduceError, match="lacks bits of this host's own value") as e:
    call(Drops(), b=5)
  assert e.value.sync_key == 10
  with pytest.raises(scp.AllReduceError, match="not an integer") as e:
    call(NotAnInt())
  with pytest.raises(scp.ConfigError, match="no method all_reduce_or") as e:
    call(object())
  assert e.value.field == "all_reduce_interface"
  # Multi-host minibatching without an interface is refused, as by the reference.
  with pytest.raises(scp.ConfigError, match="all_reduce_interface must be provided"):
    call(None)
  # The errors pickle, fields and all.
  err = pickle.loads(pickle.dumps(scp.AllReduceError("m", sync_key=4)))
  assert type(err) is scp.AllReduceError and err.sync_key == 4


def test_get_all_reduce_interface_arguments(monkeypatch):
  with pytest.raises(scp.ConfigError, match="3 peer addresses for host_count 2") as e:
    scp.get_all_reduce_interface(["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"], 0, host_id=0, host_count=2)
  assert e.value.field == "peer_addresses"
  with pytest.raises(scp.ConfigError, match="host_id 2 must be in"):
    scp.get_all_reduce_interface(["127.0.0.1:1"], 0, host_id=2, host_count=2)
  # A mistyped host_count is refused by the address count before anything is sized by it (it
  # used to abort the interpreter allocating one entry per claimed host).
  with pytest.raises(scp.ConfigError, match="0 peer addresses for host_count 1099511627776") as e:
    scp.get_all_reduce_interface([], 0, host_id=0, host_count=2**40)
  assert e.value.field == "peer_addresses"
  with pytest.raises(scp.ConfigError, match="2 peer addresses for host_count 1099511627776"):
    scp.get_all_reduce_interface(["127.0.0.1:1", "127.0.0.1:2"], 0, host_id=5, host_count=2**40)
  with pytest.raises(scp.ConfigError, match="not-a-host"):
    scp.get_all_reduce_interface(["not-a-host"], 0, host_id=0, host_count=2)
  with pytest.raises(scp.ConfigError, match="timeout"):
    scp.get_all_reduce_interface(["127.0.0.1:1"], 0, host_id=0, host_count=2, timeout=0)
  # Without jax to ask, host_id and host_count must be given.
  monkeypatch.setitem(sys.modules, "jax", None)
  with pytest.raises(scp.ConfigError, match="jax is not importable") as e:
    scp.get_all_reduce_interface([], 0)
  assert e.value.field == "host_id"
  # A port in use is an OSError naming it.
  with socket.socket() as s:
    s.bind(("0.0.0.0", 0))
    s.listen()
    with pytest.raises(OSError, match=str(s.getsockname()[1])):
      scp.get_all_reduce_interface([], s.getsockname()[1], host_id=0, host_count=1)


def test_jax_distributed_all_reduce_needs_initialize():
  code = ("import sparsecore_prep as scp\n"
          "try:\n  scp.JaxDistributedAllReduce()\nexcept scp.ConfigError as e:\n  print('ConfigError', e.field, e)\n")
  run = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True,
                       text=True, timeout=120)
  assert run.stdout.startswith("ConfigError all_reduce_interface") and "jax.distributed.initialize" in run.stdout, (
      run.stdout + run.stderr)


def test_the_sparse_coo_call_takes_the_interface():
  (path,) = glob.glob(os.path.join(SHARED, "golden_mb", "case_206*"))
  with open(os.path.join(path, "input.json")) as fh:
    case = json.load(fh)
  with open(os.path.join(path, "expected.json")) as fh:
    expected = json.load(fh)
  cfg = case["config"]
  assert cfg["enable_minibatching"] and expected["num_minibatches"] > 1
  alone = ThreadOr(1)
  out = scp.preprocess_sparse_dense_matmul_input_from_sparse_tensor(
      [np.asarray(f["indices"], dtype=np.int64).reshape(-1, 2) for f in case["features"]],
      [np.asarray(f["values"], dtype=np.int32) for f in case["features"]],
      [np.asarray(f["dense_shape"], dtype=np.int64) for f in case["features"]], specs_from_resolved(case),
      cfg["local_device_count"], cfg["global_device_count"], num_sc_per_device=cfg["num_sc_per_device"],
      allow_id_dropping=cfg["allow_id_dropping"], batch_number=21, enable_minibatching=True,
      all_reduce_interface=alone.member(0))
  check_host(expected, as_dict(*out), os.path.basename(path))
  assert [k for _, k, _ in alone.calls] == [42, 43]


JAX_PROBE = r"""
import sys, time
import jax
import sparsecore_prep as scp
host, coordinator = int(sys.argv[1]), sys.argv[2]
jax.distributed.initialize(coordinator_address=coordinator, num_processes=2, process_id=host,
                           initialization_timeout=60)
ari = scp.JaxDistributedAllReduce(timeout=20.0)
# get_all_reduce_interface's host_id and host_count default to jax's process index and count.
with scp.get_all_reduce_interface(["127.0.0.1:1"], 0, token="t") as tcp:
  print("defaults", tcp.host_id, tcp.host_count, flush=True)
# Repeated sync keys (a loop that leaves batch_number at 0) still pair up exchange by exchange.
got = [ari.all_reduce_or(0, 1 << host), ari.all_reduce_or(0, 4 << host), ari.all_reduce_or(5, 2**63 * host)]
print("ors", got, flush=True)
if host == 0:
  ari_short = scp.JaxDistributedAllReduce("probe/short", timeout=1.0)
  try:
    ari_short.all_reduce_or(9, 1)  # host 1 never contributes under this name
  except scp.AllReduceError as e:
    print("error", e.sync_key, type(e.__cause__).__name__, e, flush=True)
jax.distributed.shutdown()
"""


def test_jax_distributed_all_reduce_ors_and_times_out_naming_the_key():
  for attempt in range(3):
    coordinator = f"127.0.0.1:{free_ports(1)[0]}"
    procs = [subprocess.Popen([sys.executable, "-c", JAX_PROBE, str(h), coordinator], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
             for h in range(2)]
    outs = []
    for p in procs:
      try:
        outs.append(p.communicate(timeout=180))
      except subprocess.TimeoutExpired:
        for q in procs:
          q.kill()
        outs.append(p.communicate())
    if all(p.returncode == 0 for p in procs) or attempt == 2:
      break
  assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
  for h, (out, _) in enumerate(outs):
    assert "ors [3, 12, 9223372036854775808]" in out, out
    assert f"defaults {h} 2" in out, out
  error = [line for line in outs[0][0].splitlines() if line.startswith("error")]
  assert error and error[0].startswith("error 9 ") and "no value from process 1 of 2" in error[0], outs[0][0]
