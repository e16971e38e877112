"""Type stubs of the Rust extension module (used through sparsecore_prep).

Its errors are the classes of sparsecore_prep._errors, which it looks up in the package."""

from typing import Any

import numpy as np

__version__: str
# A call on fewer ids runs on the calling thread (the crate's SMALL_BATCH_IDS).
SMALL_BATCH_IDS: int
# Fewer ragged rows than this are gathered on the calling thread.
GATHER_ON_CALLER_MAX_ROWS: int

_Dicts = tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, np.ndarray], dict[str, np.ndarray]]
_Results = tuple[
    dict[str, np.ndarray], dict[str, np.ndarray], dict[str, np.ndarray], dict[str, np.ndarray], int,
    tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, np.ndarray], dict[str, int]],
]
_SpecTuple = tuple[tuple[str, str, int, int, int], tuple[str, int, int, int], tuple[str, int, int, int | None]]

class NativePreprocessor:
  """A config-driven preprocessor over Arrow record batches."""

  def __init__(
      self, config_json: str, threads: int | None = None, all_reduce_interface: Any = None, multi_host: bool = False
  ) -> None: ...
  @property
  def config_json(self) -> str:
    """The config as normalised JSON."""
  @property
  def multi_host(self) -> bool:
    """Whether it agrees across hosts through an all-reduce interface (set now or to be set)."""
  def set_batch_number(self, batch_number: int) -> None:
    """Sets the minibatching batch number."""
  def set_all_reduce_interface(self, all_reduce_interface: Any) -> None:
    """The multi-host all-reduce (TcpAllReduce or an object with all_reduce_or), or None."""
  def run(self, batch: Any, has_leading_dimension: bool = False) -> _Results:
    """Preprocesses one record batch: the reference's 6-tuple."""
  def fdo_stats(self, batch: Any) -> NativeFdoStats:
    """Statistics of one record batch."""

class NativeFdoStats:
  """Mergeable FDO statistics."""

  @staticmethod
  def from_json(text: str) -> NativeFdoStats:
    """Parses stats JSON."""
  def to_json(self) -> str:
    """The stats as JSON."""
  def merge(self, other: NativeFdoStats) -> None:
    """Merges `other` in place."""
  @property
  def batches(self) -> int:
    """Batches merged in."""
  def tune(self, config_json: str, headroom: float) -> str:
    """A tuned config, as JSON."""

def preprocess_resolved(
    features: list[Any],
    weights: list[Any] | None,
    specs: list[_SpecTuple],
    local_device_count: int,
    global_device_count: int,
    num_sc_per_device: int,
    sharding_strategy: str,
    has_leading_dimension: bool,
    allow_id_dropping: bool,
    batch_number: int,
    enable_minibatching: bool,
    validate_ids: bool,
) -> _Results:
  """The drop-in call on flattened leaves and resolved specs."""

def spec_tuples(leaves: list[Any]) -> tuple[_SpecTuple, ...] | None:
  """The spec tuples of FeatureSpec leaves, or None when one needs `_specs._spec_tuples`."""


class NativeDropIn:
  """The drop-in call's state for one set of resolved specs and options (plan, scratch, gather buffers)."""

  def __init__(
      self,
      specs: list[_SpecTuple],
      local_device_count: int,
      global_device_count: int,
      num_sc_per_device: int,
      sharding_strategy: str,
      allow_id_dropping: bool,
      enable_minibatching: bool,
      validate_ids: bool,
      multi_host: bool = False,
  ) -> None: ...
  def run(
      self,
      features: list[Any],
      weights: list[Any] | None,
      has_leading_dimension: bool,
      batch_number: int,
      all_reduce_interface: Any = None,
  ) -> _Results:
    """One batch of flattened leaves, in spec order; one call at a time. `all_reduce_interface`:
    this call's (an instance made with multi_host takes one)."""
  def run_coo(
      self,
      indices: list[np.ndarray],
      values: list[np.ndarray],
      batch_sizes: list[int],
      has_leading_dimension: bool,
      batch_number: int,
      all_reduce_interface: Any = None,
  ) -> _Results:
    """One batch of sparse COO features, in spec order: C-contiguous int64 [nnz, 2] indices,
    C-contiguous int32/int64 [nnz] ids, local batch sizes. Unit weights."""

class PooledBuffer:
    """The base object of every output array: owns its memory, which goes back to the call
    state that made it when numpy frees the last view, so that the next call reuses the pages
    instead of faulting in fresh ones. Not constructible from Python."""

class TcpAllReduce:
  """This host's authenticated TCP all-reduce (made by sparsecore_prep.get_all_reduce_interface)."""

  def __init__(
      self,
      host_id: int,
      host_count: int,
      peer_addresses: list[str],
      minibatching_port: int,
      token: str | bytes | None = None,
      timeout: float = 60.0,
      bind_address: str | None = None,
  ) -> None: ...
  def all_reduce_or(self, sync_key: int, value: int) -> int:
    """The OR of `value` over all hosts under `sync_key`."""
  @property
  def host_id(self) -> int:
    """This host's index."""
  @property
  def host_count(self) -> int:
    """The number of hosts."""
  @property
  def port(self) -> int:
    """The port this host listens on."""
  @property
  def peers(self) -> list[str]:
    """The other hosts' resolved addresses, as given."""
  def counters(self) -> dict[str, int]:
    """Messages dropped so far, by reason (none ever changed a result)."""
  def close(self) -> None:
    """Stops listening."""
  def __enter__(self) -> TcpAllReduce: ...
  def __exit__(self, *exc: object) -> bool: ...

_Buffers = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
_OptimizerTuple = tuple[str, list[float], int | None, bool]

class NativeKernels:
  """The CPU backend behind `sparsecore_prep.kernels`: the plan of one set of resolved specs and
  the forward / backward passes over numpy buffers and tables (see python/src/kernels.rs)."""

  def __init__(
      self,
      specs: list[_SpecTuple],
      local_device_count: int,
      global_device_count: int,
      num_sc_per_device: int,
      enable_minibatching: bool,
      threads: int | None = None,
  ) -> None: ...
  @staticmethod
  def from_config(config_json: str, global_batch_sizes: list[int], threads: int | None = None) -> NativeKernels:
    """Plans our JSON config for the given global batch size of every feature."""
  def layout(self) -> dict[str, Any]:
    """Stacks (name, vocab, dim, shards, rows_per_shard, batch_per_device, features, tables) and
    features (name, stack, rows, dim) of the plan, and the local device count."""
  def forward(self, buffers: list[_Buffers], num_minibatches: int, tables: list[np.ndarray],
              unstack: bool = True) -> list[np.ndarray]:
    """Per-feature activations (spec order), or per-stack stacked activations."""
  def backward(self, buffers: list[_Buffers], num_minibatches: int, grads: list[np.ndarray],
               variables: list[list[np.ndarray]], optimizers: list[_OptimizerTuple],
               limits: list[tuple[float, float]], stacked: bool = False) -> list[list[np.ndarray]]:
    """Every stack's updated [table, *slots], as new arrays."""
  def backward_in_place(self, buffers: list[_Buffers], num_minibatches: int, grads: list[np.ndarray],
                        variables: list[list[np.ndarray]], optimizers: list[_OptimizerTuple],
                        limits: list[tuple[float, float]], stacked: bool = True) -> None:
    """The same update, in place on writable arrays."""
  def stack_table(self, stack: int, tables: list[np.ndarray]) -> np.ndarray:
    """Member tables of stack `stack` (plan index) in the stacked [N * R, D] layout."""
  def unstack_table(self, stack: int, table: np.ndarray) -> list[np.ndarray]:
    """The member tables of stack `stack` read back."""
