"""Our JSON config (SPEC Part 1, section 1.1), as :class:`~sparsecore_prep.Preprocessor` and
:meth:`~sparsecore_prep.FdoStats.tune` take it."""

from __future__ import annotations

import json
import os
from typing import Mapping


def _config_json(config) -> str:
  """Config text from a dict, a JSON string, or a path to a JSON file."""
  if isinstance(config, Mapping):
    return json.dumps(config)
  if isinstance(config, (str, os.PathLike)):
    text = os.fspath(config)
    if isinstance(text, str) and text.lstrip().startswith("{"):
      return text
    with open(text) as fh:
      return fh.read()
  raise TypeError(f"config must be a dict, a JSON string or a path, got {type(config).__name__}")
