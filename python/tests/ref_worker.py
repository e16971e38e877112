"""Child process of the differential tests: runs the reference on cases read from stdin.

Frames are an 8-byte little-endian length and a pickle, both ways. The answer is ("ok", plain
result dict) or ("raised", "ExceptionType: message"). A reference abort kills this process;
the parent sees the closed pipe and the exit status.
"""

import os
import pickle
import struct
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import reference  # noqa: E402


def main():
  inp, out = sys.stdin.buffer, sys.stdout.buffer
  while True:
    head = inp.read(8)
    if len(head) < 8:
      return
    (n,) = struct.unpack("<Q", head)
    case = pickle.loads(inp.read(n))
    try:
      answer = ("ok", reference.run_reference_inline(case))
    except Exception as e:  # the reference's catchable errors
      answer = ("raised", f"{type(e).__name__}: {e}")
    blob = pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL)
    out.write(struct.pack("<Q", len(blob)) + blob)
    out.flush()


if __name__ == "__main__":
  main()
