"""Swapping the drop-in calls into the reference: ``install()``, ``uninstall()``, ``installed()``.

Training code calls ``embedding.preprocess_sparse_dense_matmul_input`` through the module
``jax_tpu_embedding.sparsecore.lib.nn.embedding`` (keras-rs's ``stack_and_shard_samples``, Flax's
``SparseCoreEmbed.preprocess_inputs``, the reference's own tests), so replacing the two module
attributes reroutes every such call to ours; nothing else in the reference changes.

Installs nest: each ``install()`` is matched by one ``uninstall()``, and the originals come back
when the last one is undone (an ``installed()`` block inside another leaves ours in place on
exit). One lock serialises the swaps, so threads may install and uninstall concurrently.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from typing import Iterator

from ._errors import SparseCorePrepError

_REFERENCE_MODULE = "jax_tpu_embedding.sparsecore.lib.nn.embedding"
_NAMES = (
    "preprocess_sparse_dense_matmul_input",
    "preprocess_sparse_dense_matmul_input_from_sparse_tensor",
)


class ReferenceNotInstalledError(SparseCorePrepError, ImportError):
  """``install()`` needs jax-tpu-embedding (the module it patches) and could not import it.

  Field ``module``: the module that did not import.
  """

  fields = ("module",)


_lock = threading.RLock()
# The reference's own functions while ours are installed, and how many installs are open.
_originals: dict[str, object] = {}
_depth = 0


def _reference_module():
  try:
    return importlib.import_module(_REFERENCE_MODULE)
  except ImportError as e:
    raise ReferenceNotInstalledError(
        f"sparsecore_prep.install() replaces functions of {_REFERENCE_MODULE}, which does not import "
        f"({type(e).__name__}: {e}); install jax-tpu-embedding (pip install jax-tpu-embedding) or call "
        "sparsecore_prep.preprocess_sparse_dense_matmul_input directly", module=_REFERENCE_MODULE) from e


def _ours() -> dict[str, object]:
  from . import _dropin
  return {name: getattr(_dropin, name) for name in _NAMES}


def install() -> None:
  """Routes the reference's two preprocessing calls to sparsecore_prep's.

  Replaces ``preprocess_sparse_dense_matmul_input`` and
  ``preprocess_sparse_dense_matmul_input_from_sparse_tensor`` in
  ``jax_tpu_embedding.sparsecore.lib.nn.embedding``; code that calls them
  through that module (``embedding.preprocess_sparse_dense_matmul_input(...)``)
  runs ours from then on. Code that bound the function itself earlier
  (``from ...embedding import preprocess_sparse_dense_matmul_input``) keeps
  the reference's.

  Calls nest: each one is undone by one :func:`uninstall`.

  Raises:
    ReferenceNotInstalledError: jax-tpu-embedding does not import (an
      ``ImportError``).
  """
  global _depth
  module = _reference_module()
  with _lock:
    if _depth == 0:
      ours = _ours()
      _originals.clear()
      for name in _NAMES:
        _originals[name] = getattr(module, name)
      for name in _NAMES:
        setattr(module, name, ours[name])
    _depth += 1


def uninstall() -> None:
  """Undoes one :func:`install`; the last one puts the reference's functions back.

  Without an open install it does nothing.
  """
  global _depth
  with _lock:
    if _depth == 0:
      return
    _depth -= 1
    if _depth == 0:
      module = _reference_module()
      for name in _NAMES:
        setattr(module, name, _originals[name])
      _originals.clear()


def is_installed() -> bool:
  """Whether the reference's calls are routed to ours (an install is open)."""
  with _lock:
    return _depth > 0


@contextlib.contextmanager
def installed() -> Iterator[None]:
  """``with sparsecore_prep.installed():`` runs the block with ours installed (see :func:`install`),
  and undoes that install on the way out, also on an exception."""
  install()
  try:
    yield
  finally:
    uninstall()


ReferenceNotInstalledError.__module__ = "sparsecore_prep"
