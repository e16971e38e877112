"""sparsecore_prep: SparseCore input preprocessing in Rust, for Python.

Three entry points:

* :func:`preprocess_sparse_dense_matmul_input` is a drop-in replacement for
  ``jax_tpu_embedding.sparsecore.lib.nn.embedding.preprocess_sparse_dense_matmul_input``:
  the same arguments (numpy dense or ragged features, the reference's own
  ``FeatureSpec`` objects after ``prepare_feature_specs_for_training`` or
  ``auto_stack_tables``), the same result structure and values, and Python
  exceptions where the reference aborts the process;
  :func:`preprocess_sparse_dense_matmul_input_from_sparse_tensor` is the same
  for the reference's sparse COO entry point (``tf.SparseTensor``-like input).
* :class:`Preprocessor` takes our JSON config and Arrow record batches (any
  producer of ``__arrow_c_array__`` / ``__arrow_c_stream__``, read without
  copies). It pickles through its config, so it ships to Ray Data and Spark
  workers.
* :class:`FdoStats` merges per-batch FDO statistics from any number of
  workers and tunes a config from them; :class:`FdoStatsMapper` is the
  :class:`Preprocessor` shaped for ``ray.data.Dataset.map_batches``.
* :func:`install` (or ``with`` :func:`installed`) routes the reference's
  own ``embedding.preprocess_sparse_dense_matmul_input`` and
  ``..._from_sparse_tensor`` to the two drop-in calls, so training code that
  calls them through the reference (keras-rs, the Flax layers) runs ours
  unchanged.
* Multi-host minibatching: both take an ``all_reduce_interface`` from
  :func:`get_all_reduce_interface` (the reference's signature; our
  authenticated TCP all-reduce), :class:`JaxDistributedAllReduce` (over the
  ``jax.distributed`` coordination service), or any object with
  ``all_reduce_or(sync_key, value) -> int`` (:class:`AllReduceInterface`).

The heavy lifting runs in the Rust crate ``sparsecore-prep`` with the GIL
released. Errors are the picklable exceptions of :mod:`sparsecore_prep._errors`
(:class:`ConfigError`, :class:`InvalidInputError`, :class:`LimitExceededError`,
:class:`InputTypeError`, :class:`FeatureSpecError`, all
:class:`SparseCorePrepError`).
"""

from . import _native
from ._allreduce import (
    AllReduceError,
    AllReduceInterface,
    JaxDistributedAllReduce,
    TcpAllReduce,
    get_all_reduce_interface,
)
from ._dropin import (
    preprocess_sparse_dense_matmul_input,
    preprocess_sparse_dense_matmul_input_from_sparse_tensor,
)
from ._errors import (
    ConfigError,
    FeatureSpecError,
    InputTypeError,
    InvalidInputError,
    LimitExceededError,
    SparseCorePrepError,
)
from ._fdo import FdoStats
from ._install import ReferenceNotInstalledError, install, installed, is_installed, uninstall
from ._preprocessor import FdoStatsMapper, Preprocessor
from ._results import PreprocessedInput, SparseDenseMatmulInput, SparseDenseMatmulInputStats

# Pickles of a Preprocessor call sparsecore_prep._rebuild_preprocessor (its __reduce__) to rebuild it.
from ._preprocessor import _rebuild_preprocessor  # noqa: F401

__all__ = [
    "AllReduceError",
    "AllReduceInterface",
    "ConfigError",
    "FdoStats",
    "FdoStatsMapper",
    "FeatureSpecError",
    "InputTypeError",
    "InvalidInputError",
    "JaxDistributedAllReduce",
    "LimitExceededError",
    "PreprocessedInput",
    "Preprocessor",
    "SparseCorePrepError",
    "SparseDenseMatmulInput",
    "SparseDenseMatmulInputStats",
    "TcpAllReduce",
    "get_all_reduce_interface",
    "install",
    "installed",
    "is_installed",
    "preprocess_sparse_dense_matmul_input",
    "preprocess_sparse_dense_matmul_input_from_sparse_tensor",
    "uninstall",
]

__version__ = _native.__version__
