"""Type stubs of sparsecore_prep.grain (see grain.py for the documentation)."""

import os
from typing import Any, Mapping, Sequence

import grain
import pyarrow as pa

from ._errors import SparseCorePrepError
from ._fdo import FdoStats
from ._results import PreprocessedInput, SparseDenseMatmulInputStats

_Path = str | os.PathLike[str]

class DataSourceError(SparseCorePrepError, ValueError):
  path: str | None
  column: str | None
  row_group: int | None

class ParquetBatches:
  def __init__(
      self,
      paths: _Path | Sequence[_Path],
      batch_size: int,
      *,
      columns: Sequence[str] | None = None,
      drop_remainder: bool = True,
      shard: tuple[int, int] | Any | None = None,
  ) -> None: ...
  @property
  def num_rows(self) -> int: ...
  @property
  def columns(self) -> tuple[str, ...]: ...
  @property
  def paths(self) -> tuple[str, ...]: ...
  def __len__(self) -> int: ...
  def __getitem__(self, index: int) -> pa.Table: ...

def ragged_batch(rows: Sequence[Mapping[str, Any]]) -> pa.Table: ...

class Preprocess(grain.transforms.Map):
  def __init__(
      self,
      feature_specs_or_config: Any,
      *,
      weights: Mapping[str, str] | None = None,
      threads: int | None = None,
      local_device_count: int = ...,
      global_device_count: int = ...,
      num_sc_per_device: int = ...,
      sharding_strategy: str = "MOD",
      has_leading_dimension: bool = False,
      allow_id_dropping: bool = False,
      enable_minibatching: bool = False,
      all_reduce_interface: Any = None,
      validate_ids: bool = True,
  ) -> None: ...
  def arrow_native(self, batch_size: int) -> bool: ...
  def map(self, rows: Any) -> tuple[PreprocessedInput, SparseDenseMatmulInputStats, dict[str, Any]]: ...
  def fdo_stats(self, rows: Any) -> FdoStats: ...

def tune(
    paths: _Path | Sequence[_Path],
    feature_specs: Any,
    *,
    headroom: float = 1.1,
    sample: int | None = None,
    batch_size: int | None = None,
    weights: Mapping[str, str] | None = None,
    workers: int | None = None,
    local_device_count: int = ...,
    global_device_count: int = ...,
    num_sc_per_device: int = ...,
    sharding_strategy: str = "MOD",
    validate_ids: bool = True,
) -> SparseDenseMatmulInputStats: ...
