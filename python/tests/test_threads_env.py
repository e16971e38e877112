"""SPARSECORE_INPUT_PREPROCESSING_THREADS sizes the package's pool as it sizes the reference's:
a whole number n with 0 < n < the CPUs this process may use, read when the pool starts; any
other value leaves one thread per CPU."""

import os
import subprocess
import sys

import pytest

# A batch well above SMALL_BATCH_IDS, so that it runs on the pool, then the pool's threads
# counted by name (Linux truncates "sparsecore-prep-N" to its first 15 characters).
CHILD = r"""
import os
import numpy as np
import pyarrow as pa
import sparsecore_prep as scp
cfg = {
    "config": {"local_device_count": 1, "global_device_count": 1, "num_sc_per_device": 4,
               "allow_id_dropping": False},
    "tables": [{"name": "t", "vocabulary_size": 1000, "embedding_dim": 8, "combiner": "sum",
                "max_ids_per_partition": 65536, "max_unique_ids_per_partition": 65536}],
    "features": [{"name": "f", "table": "t"}],
}
rows = 4096
ids = pa.array([[i % 1000, (7 * i) % 1000, (13 * i) % 1000, (31 * i) % 1000] for i in range(rows)],
               pa.list_(pa.int64()))
scp.Preprocessor(cfg)(pa.record_batch({"f": ids}))
import time


def count():
  names = []
  for t in os.listdir("/proc/self/task"):
    try:
      names.append(open(f"/proc/self/task/{t}/comm").read().strip())
    except OSError:
      pass
  return sum(n == "sparsecore-prep" for n in names)


# A new thread names itself once it runs: count until the number holds for a second.
last, steady, deadline = -1, 0, time.monotonic() + 10
while time.monotonic() < deadline and steady < 10:
  n = count()
  steady = steady + 1 if n == last else 0
  last = n
  time.sleep(0.1)
print(last)
"""


def pool_threads(value):
  env = {k: v for k, v in os.environ.items() if k not in ("SPARSECORE_INPUT_PREPROCESSING_THREADS", "RAYON_NUM_THREADS")}
  if value is not None:
    env["SPARSECORE_INPUT_PREPROCESSING_THREADS"] = value
  out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True)
  return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads through /proc")
def test_threads_variable_sizes_the_pool_like_the_reference():
  cpus = len(os.sched_getaffinity(0))
  if cpus < 2:
    pytest.skip("needs 2 CPUs: the variable only ever lowers the count")
  assert pool_threads(None) == cpus
  assert pool_threads("1") == 1
  assert pool_threads(" 1 ") == 1
  # Not below the CPUs, not a positive whole number: ignored, as by the reference.
  assert pool_threads(str(cpus)) == cpus
  assert pool_threads("0") == cpus
  assert pool_threads("-1") == cpus
  assert pool_threads("one") == cpus
