"""Type stubs of sparsecore_prep (the documentation is in the docstrings of __init__.py and of the
private modules that define each name)."""

import contextlib
import dataclasses
import os
from typing import Any, Iterable, Mapping, NamedTuple, Protocol, Sequence, runtime_checkable

import numpy as np

from ._errors import ConfigError as ConfigError
from ._errors import FeatureSpecError as FeatureSpecError
from ._errors import InputTypeError as InputTypeError
from ._errors import InvalidInputError as InvalidInputError
from ._errors import LimitExceededError as LimitExceededError
from ._errors import SparseCorePrepError as SparseCorePrepError
from ._install import ReferenceNotInstalledError as ReferenceNotInstalledError
from ._native import TcpAllReduce as TcpAllReduce

__version__: str

class SparseDenseMatmulInput(NamedTuple):
  """Per-stack CSR-wrapped COO buffers, keyed by stack name."""

  lhs_row_pointers: Mapping[str, np.ndarray]
  lhs_embedding_ids: Mapping[str, np.ndarray]
  lhs_sample_ids: Mapping[str, np.ndarray]
  lhs_gains: Mapping[str, np.ndarray]

@dataclasses.dataclass
class SparseDenseMatmulInputStats:
  """FDO statistics of one call, per stack."""

  max_ids_per_partition: dict[str, np.ndarray]
  max_unique_ids_per_partition: dict[str, np.ndarray]
  required_buffer_size_per_sc: dict[str, np.ndarray] = ...
  id_drop_counters: dict[str, int] = ...
  def get_required_buffer_size_per_device(self, table_name: str, num_sc_per_device: int | None = None) -> int | None:
    """The buffer a device needs for `table_name`."""

@dataclasses.dataclass
class PreprocessedInput:
  """The buffers and the number of minibatches per local device."""

  sparse_dense_matmul_input: SparseDenseMatmulInput
  num_minibatches: np.ndarray
  @property
  def lhs_row_pointers(self) -> Mapping[str, np.ndarray]: ...
  @property
  def lhs_embedding_ids(self) -> Mapping[str, np.ndarray]: ...
  @property
  def lhs_sample_ids(self) -> Mapping[str, np.ndarray]: ...
  @property
  def lhs_gains(self) -> Mapping[str, np.ndarray]: ...

Nested = Any  # dicts, lists and tuples of leaves

class AllReduceError(SparseCorePrepError, RuntimeError):
  """The hosts could not agree on a minibatching split; `sync_key` names the exchange."""

  sync_key: int | None

@runtime_checkable
class AllReduceInterface(Protocol):
  """What an all_reduce_interface provides: the OR of `value` over all hosts under `sync_key`."""

  def all_reduce_or(self, sync_key: int, value: int) -> int: ...

def get_all_reduce_interface(
    peer_addresses: Sequence[str],
    minibatching_port: int,
    host_id: int | None = None,
    host_count: int | None = None,
    *,
    token: str | bytes | None = None,
    timeout: float = 60.0,
    bind_address: str | None = None,
) -> TcpAllReduce:
  """This host's authenticated TCP all-reduce (the reference's signature)."""

def install() -> None:
  """Routes jax_tpu_embedding's embedding.preprocess_sparse_dense_matmul_input (and _from_sparse_tensor) to ours."""

def uninstall() -> None:
  """Undoes one install(); the last one puts the reference's functions back."""

def is_installed() -> bool:
  """Whether the reference's calls are routed to ours."""

def installed() -> contextlib.AbstractContextManager[None]:
  """install() for the duration of a with block."""

class JaxDistributedAllReduce:
  """An all-reduce over the jax.distributed coordination service's key-value store."""

  def __init__(self, name: str = "sparsecore_prep/all_reduce", *, timeout: float = 60.0) -> None: ...
  @property
  def host_id(self) -> int: ...
  @property
  def host_count(self) -> int: ...
  def all_reduce_or(self, sync_key: int, value: int) -> int:
    """The OR of `value` over all processes under `sync_key`."""

def preprocess_sparse_dense_matmul_input(
    features: Nested,
    features_weights: Nested | None,
    feature_specs: Nested,
    local_device_count: int,
    global_device_count: int,
    num_sc_per_device: int | None = None,
    sharding_strategy: str = "MOD",
    has_leading_dimension: bool = False,
    allow_id_dropping: bool = False,
    batch_number: int = 0,
    enable_minibatching: bool = False,
    *,
    all_reduce_interface: AllReduceInterface | TcpAllReduce | None = None,
    validate_ids: bool = True,
) -> tuple[PreprocessedInput, SparseDenseMatmulInputStats]:
  """Drop-in replacement for the reference's preprocess_sparse_dense_matmul_input."""

def preprocess_sparse_dense_matmul_input_from_sparse_tensor(
    indices: Nested,
    values: Nested | None,
    dense_shapes: Nested | None,
    feature_specs: Nested,
    local_device_count: int,
    global_device_count: int,
    num_sc_per_device: int | None = None,
    sharding_strategy: str = "MOD",
    has_leading_dimension: bool = False,
    allow_id_dropping: bool = False,
    batch_number: int = 0,
    enable_minibatching: bool = False,
    *,
    all_reduce_interface: AllReduceInterface | TcpAllReduce | None = None,
    validate_ids: bool = True,
) -> tuple[PreprocessedInput, SparseDenseMatmulInputStats]:
  """Drop-in replacement for the reference's preprocess_sparse_dense_matmul_input_from_sparse_tensor:
  trees of [nnz, 2] indices, [nnz] ids and [batch, width] dense shapes (or, with values and
  dense_shapes None, a tree of tf.SparseTensor-like objects). Unit weights."""

ConfigLike = Mapping[str, Any] | str | os.PathLike[str]

class Preprocessor:
  """A reusable, picklable preprocessor for one config, over Arrow record batches."""

  def __init__(
      self,
      config: ConfigLike,
      *,
      threads: int | None = None,
      has_leading_dimension: bool = False,
      all_reduce_interface: AllReduceInterface | TcpAllReduce | None = None,
  ) -> None: ...
  @property
  def config(self) -> dict[str, Any]:
    """The config, with defaults filled in."""
  def __call__(self, batch: Any) -> tuple[PreprocessedInput, SparseDenseMatmulInputStats]:
    """Preprocesses one record batch (any __arrow_c_array__ / __arrow_c_stream__ object)."""
  def set_batch_number(self, batch_number: int) -> None:
    """Sets the step number that keys minibatching's cross-host agreement."""
  def set_all_reduce_interface(self, all_reduce_interface: AllReduceInterface | TcpAllReduce | None) -> None:
    """Agrees on minibatching splits with the other hosts through `all_reduce_interface`."""
  def fdo_stats(self, batch: Any) -> FdoStats:
    """The FDO statistics of one record batch, without writing buffers."""
  def balance(self, batches: Iterable[Any], *, window: int = 1, refine: str = "worst-cell", with_report: bool = False) -> Any:
    """Balanced record batches and the permutation (and per-window reports)."""

class FdoStats:
  """FDO statistics merged over batches, workers and hosts."""

  @classmethod
  def from_json(cls, text: str) -> FdoStats:
    """Parses stats JSON (ours or the CLI's)."""
  @classmethod
  def read(cls, path: str | os.PathLike[str]) -> FdoStats:
    """Reads a stats JSON file."""
  @classmethod
  def merge_all(cls, stats: Iterable[FdoStats]) -> FdoStats:
    """Merges any number of stats (at least one) into new stats."""
  def merge(self, other: FdoStats) -> FdoStats:
    """Merges `other` in place and returns self."""
  @property
  def batches(self) -> int:
    """Batches merged in."""
  def to_json(self) -> str:
    """The stats as JSON."""
  def to_dict(self) -> dict[str, Any]:
    """The stats as a dict."""
  def write(self, path: str | os.PathLike[str]) -> None:
    """Writes the JSON atomically."""
  def tune(self, config: ConfigLike, headroom: float = 1.0) -> dict[str, Any]:
    """A copy of `config` with limits and buffer sizes from these stats."""

class FdoStatsMapper(Preprocessor):
  """A Preprocessor shaped for ray.data.Dataset.map_batches: one stats row per batch."""

  def __call__(self, batch: Any) -> dict[str, np.ndarray]:  # type: ignore[override]
    """`{"fdo_stats": np.array([stats JSON], dtype=object)}` for one batch."""
