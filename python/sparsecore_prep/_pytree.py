"""Pytrees (dicts by sorted key, lists and tuples in order, None empty), flattened as
``jax.tree.leaves`` flattens them; jax itself is used when it is already loaded."""

from __future__ import annotations

import sys
from typing import Mapping

from ._errors import InvalidInputError


def _flatten(tree, path=(), out=None):
  if out is None:
    out = []
  if tree is None:
    return out
  if isinstance(tree, Mapping):
    for k in sorted(tree):
      _flatten(tree[k], path + (k,), out)
  elif isinstance(tree, (list, tuple)):
    for i, v in enumerate(tree):
      _flatten(v, path + (i,), out)
  else:
    out.append((path, tree))
  return out


def _leaves_with_paths(tree):
  jax = sys.modules.get("jax")
  if jax is not None:
    pairs = jax.tree_util.tree_leaves_with_path(tree)
    return [p for p, _ in pairs], [v for _, v in pairs]
  pairs = _flatten(tree)
  return [p for p, _ in pairs], [v for _, v in pairs]


def _leaves_and_structure(tree):
  """The leaves, and a structure to compare: jax's treedef when jax is loaded (flattening
  without key paths is several times faster), else the paths."""
  jax = sys.modules.get("jax")
  if jax is not None:
    return jax.tree_util.tree_flatten(tree)
  pairs = _flatten(tree)
  return [v for _, v in pairs], [p for p, _ in pairs]


def _check_structure(a, a_struct, b, b_struct, a_name: str, b_name: str) -> None:
  """Raises unless trees `a` and `b` have leaves at the same paths. Equal structures pass at
  once; otherwise the paths decide (a list and a tuple with the same indices still match)."""
  if a_struct != b_struct:
    _same_structure(_leaves_with_paths(a)[0], _leaves_with_paths(b)[0], a_name, b_name)


def _same_structure(a_paths, b_paths, a_name: str, b_name: str) -> None:
  if a_paths != b_paths:
    raise InvalidInputError(
        f"Pytree structures of {a_name} and {b_name} do not match.\n"
        f"{a_name}: {len(a_paths)} leaves at {a_paths[:8]}{'...' if len(a_paths) > 8 else ''}\n"
        f"{b_name}: {len(b_paths)} leaves at {b_paths[:8]}{'...' if len(b_paths) > 8 else ''}")
