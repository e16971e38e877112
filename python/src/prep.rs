//! The native classes and the drop-in call.
//!
//! Results leave Rust as plain tuples and dicts in the layout of the reference's pybind module
//! (`row_pointers`, `embedding_ids`, `sample_ids`, `gains` dicts keyed by stack, the number of
//! minibatches and a stats tuple); `sparsecore_prep/_results.py` wraps them in the reference's
//! result classes.

use numpy::{PyArray1, PyReadonlyArray1, PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString, PyTuple};
use rayon::ThreadPool;
use sparsecore_prep::fdo::{tune, FdoStats};
use sparsecore_prep::input::{CooInput, Ids, Offsets, RaggedInput, SampleSource};
use sparsecore_prep::spec::{
    FeatureConfig, Options, Placement, ResolvedStack, Stacking, TableConfig,
};
use sparsecore_prep::{
    Config, ConfigItem, Output, Plan, Preprocessor, PreprocessorBuilder, TailFill,
};

use std::sync::Arc;

use crate::allreduce::{to_py_error, AllReduceSlot};
use crate::errors::{self, to_py};
use crate::pool::BufferPool;
use crate::threads::Turn;
use crate::{arrow_input, numpy_input, threads};

/// The four arrays of every stack, the number of minibatches, and the stats.
type Results = (
    Py<PyDict>,
    Py<PyDict>,
    Py<PyDict>,
    Py<PyDict>,
    usize,
    Py<PyTuple>,
);

/// Hands the output buffers to numpy (moved, not copied; their memory comes back to `pool`
/// when numpy frees them) and the stats as arrays.
///
/// `names`: the stacks' names as Python strings, made on the first call and reused, so that the
/// dicts' keys are neither built nor hashed again on every call (the stacks of a plan never
/// change; a mismatch rebuilds them).
fn results(
    py: Python<'_>,
    out: &mut Output,
    pool: &BufferPool,
    leading: bool,
    names: &mut Vec<Py<PyString>>,
) -> PyResult<Results> {
    if names.len() != out.stacks.len()
        || names
            .iter()
            .zip(&out.stacks)
            .any(|(n, so)| n.bind(py).to_str().map_or(true, |n| n != so.name))
    {
        *names = out
            .stacks
            .iter()
            .map(|so| PyString::intern(py, &so.name).unbind())
            .collect();
    }
    let (rp, eid, sid, gains) = (
        PyDict::new(py),
        PyDict::new(py),
        PyDict::new(py),
        PyDict::new(py),
    );
    let (max_ids, max_unique, required, dropped) = (
        PyDict::new(py),
        PyDict::new(py),
        PyDict::new(py),
        PyDict::new(py),
    );
    for (i, so) in out.stacks.iter_mut().enumerate() {
        let l = so.local_devices();
        let (rp_per, c) = (
            so.row_pointers_per_device(),
            so.coo_buffer_size_per_device(),
        );
        let extents: Arc<[u32]> = Arc::from(so.tail_extents());
        let name = names[i].bind(py);
        rp.set_item(
            name,
            shaped(
                leading,
                l,
                pool.array(py, std::mem::take(&mut so.row_pointers), i, 0, None)?,
                rp_per,
            )?,
        )?;
        eid.set_item(
            name,
            shaped(
                leading,
                l,
                pool.array(
                    py,
                    std::mem::take(&mut so.embedding_ids),
                    i,
                    1,
                    Some(extents.clone()),
                )?,
                c,
            )?,
        )?;
        sid.set_item(
            name,
            shaped(
                leading,
                l,
                pool.array(
                    py,
                    std::mem::take(&mut so.sample_ids),
                    i,
                    2,
                    Some(extents.clone()),
                )?,
                c,
            )?,
        )?;
        gains.set_item(
            name,
            shaped(
                leading,
                l,
                pool.array(
                    py,
                    std::mem::take(&mut so.gains),
                    i,
                    3,
                    Some(extents.clone()),
                )?,
                c,
            )?,
        )?;
        stats_into(py, so, name, &max_ids, &max_unique, &required, &dropped)?;
    }
    let stats = PyTuple::new(py, [max_ids, max_unique, required, dropped])?;
    Ok((
        rp.unbind(),
        eid.unbind(),
        sid.unbind(),
        gains.unbind(),
        out.num_minibatches,
        stats.unbind(),
    ))
}

/// The output every Python call writes: zeros past each segment's final cursor, where the
/// reference leaves memory uninitialised. New buffers then come as fresh zeroed pages, and the
/// caller's resident memory grows with what the batches wrote, not with the buffer sizes (a
/// loader that keeps a dozen untuned results in flight would otherwise hold gigabytes).
fn zero_tailed() -> Output {
    Output::new().with_tail_fill(TailFill::Zeros)
}

/// A flat array, or `[l, cols]` with a leading dimension.
fn shaped<'py>(
    leading: bool,
    l: usize,
    a: Bound<'py, PyAny>,
    cols: usize,
) -> PyResult<Bound<'py, PyAny>> {
    if leading {
        a.call_method1("reshape", ((l, cols),))
    } else {
        Ok(a)
    }
}

fn stats_into(
    py: Python<'_>,
    so: &sparsecore_prep::StackOutput,
    name: &Bound<'_, PyString>,
    max_ids: &Bound<'_, PyDict>,
    max_unique: &Bound<'_, PyDict>,
    required: &Bound<'_, PyDict>,
    dropped: &Bound<'_, PyDict>,
) -> PyResult<()> {
    let st = &so.stats;
    max_ids.set_item(name, PyArray1::from_slice(py, &st.max_ids_per_partition))?;
    max_unique.set_item(
        name,
        PyArray1::from_slice(py, &st.max_unique_ids_per_partition),
    )?;
    required.set_item(
        name,
        PyArray1::from_slice(py, &st.required_buffer_size_per_sc),
    )?;
    dropped.set_item(name, st.dropped_id_count)?;
    Ok(())
}

/// Runs `prep` on `sources` with the GIL released: on this thread, with the pool's threads
/// helping if `turn` has it (`Preprocessor::run_helped`: this thread starts at once, where
/// handing the batch to the pool would first wait for its threads to wake after the caller's
/// idle time), else alone; `slot` is the all-reduce it was built with (its failures become
/// `AllReduceError`s).
fn run_detached(
    py: Python<'_>,
    turn: &Turn,
    prep: &mut Preprocessor,
    sources: &[Box<dyn SampleSource + '_>],
    out: &mut Output,
    slot: Option<&AllReduceSlot>,
) -> PyResult<()> {
    let inputs: Vec<&dyn SampleSource> = sources.iter().map(|s| s.as_ref()).collect();
    py.detach(|| match turn.pool() {
        Some(pool) => prep.run_helped(pool, &inputs, out),
        None => prep.run_on_caller_thread(&inputs, out),
    })
    .map_err(|e| to_py_error(py, e, slot))
}

/// Runs `run` on `inputs`: on `pool` (the package's, when the preprocessor has none of its own)
/// only if the preprocessor would run them in parallel, since a small batch runs on the calling
/// thread anyway and the hand-over would cost more than the batch (`SMALL_BATCH_IDS`).
fn on_pool_if_parallel<T: Send>(
    pool: Option<&ThreadPool>,
    prep: &mut Preprocessor,
    inputs: &[&dyn SampleSource],
    run: impl FnOnce(&mut Preprocessor, &[&dyn SampleSource]) -> sparsecore_prep::Result<T> + Send,
) -> sparsecore_prep::Result<T> {
    match pool {
        Some(pool) if !prep.runs_on_caller_thread(inputs) => pool.install(|| run(prep, inputs)),
        _ => run(prep, inputs),
    }
}

/// [`on_pool_if_parallel`] on the features of a record batch (read there, without the GIL: reading
/// them hashes raw keys).
fn batch_on_pool_if_parallel<T: Send>(
    pool: Option<&ThreadPool>,
    prep: &mut Preprocessor,
    batch: &arrow_array::RecordBatch,
    run: impl FnOnce(&mut Preprocessor, &[&dyn SampleSource]) -> sparsecore_prep::Result<T> + Send,
) -> sparsecore_prep::Result<T> {
    let features = sparsecore_prep::input::features_from_record_batch(prep.config(), batch)?;
    let inputs: Vec<&dyn SampleSource> = features.iter().map(|f| f as &dyn SampleSource).collect();
    on_pool_if_parallel(pool, prep, &inputs, run)
}

/// `builder` agreeing across hosts through `slot`, if any.
fn with_slot(
    builder: PreprocessorBuilder,
    slot: &Option<Arc<AllReduceSlot>>,
) -> PreprocessorBuilder {
    match slot {
        Some(s) => builder.all_reduce(s.clone()),
        None => builder,
    }
}

/// Builds a preprocessor on the package's pool (see `threads`), unless it has a pool of its own:
/// its per-thread scratch is sized by the pool it is built on.
fn build(py: Python<'_>, builder: PreprocessorBuilder, dedicated: bool) -> PyResult<Preprocessor> {
    // Without the GIL: the pool's threads may be busy with another call whose all-reduce
    // interface is Python code that needs it, and `install` waits for them.
    let built = if dedicated {
        py.detach(|| builder.build())
    } else {
        let pool = threads::pool()?;
        py.detach(|| pool.install(|| builder.build()))
    };
    built.map_err(|e| to_py(py, e))
}

/// A config-driven preprocessor over Arrow record batches (wrapped by `sparsecore_prep.Preprocessor`).
///
/// With `threads`, it has a pool of its own, whose threads a forked child does not inherit: the
/// first call in another process than the one it was built in rebuilds it (see `threads`).
#[pyclass(module = "sparsecore_prep._native")]
pub struct NativePreprocessor {
    prep: Preprocessor,
    out: Output,
    pool: BufferPool,
    config_json: String,
    threads: Option<usize>,
    batch_number: u64,
    pid: u32,
    /// The multi-host all-reduce, once one was given (`set_all_reduce_interface`).
    slot: Option<Arc<AllReduceSlot>>,
    /// The stacks' names as the result dicts' keys (see [`results`]).
    stack_names: Vec<Py<PyString>>,
}

impl NativePreprocessor {
    fn build(
        py: Python<'_>,
        config: Config,
        threads: Option<usize>,
        slot: &Option<Arc<AllReduceSlot>>,
    ) -> PyResult<Preprocessor> {
        let mut builder = with_slot(Preprocessor::builder(config), slot);
        if let Some(n) = threads {
            builder = builder.threads(n);
        }
        build(py, builder, threads.is_some())
    }

    /// Rebuilds the preprocessor if this is a forked child of the process that built it; the
    /// pool to run it on (None: its own).
    fn live(&mut self, py: Python<'_>) -> PyResult<Option<std::sync::Arc<ThreadPool>>> {
        let pid = std::process::id();
        // `threads=1` has no pool (it runs on the calling thread), so a child can keep it.
        if self.pid != pid && self.threads.is_some_and(|n| n > 1) {
            let config = Config::from_json(&self.config_json).map_err(|e| to_py(py, e))?;
            let mut fresh = Self::build(py, config, self.threads, &self.slot)?;
            fresh.set_batch_number(self.batch_number);
            // The old one's pool has no threads here: nothing to join, so nothing is dropped.
            std::mem::forget(std::mem::replace(&mut self.prep, fresh));
        }
        self.pid = pid;
        Ok(if self.threads.is_some() {
            None
        } else {
            Some(threads::pool()?)
        })
    }
}

#[pymethods]
impl NativePreprocessor {
    /// `config_json`: the config file's text. `threads`: a dedicated pool of that many threads
    /// (default: the process-wide pool, one thread per CPU).
    /// `all_reduce_interface`: see `set_all_reduce_interface`. `multi_host`: agree across
    /// hosts through an interface set later (an unpickled preprocessor, whose interface stayed
    /// behind), failing at a split until then.
    #[new]
    #[pyo3(signature = (config_json, threads=None, all_reduce_interface=None, multi_host=false))]
    fn new(
        py: Python<'_>,
        config_json: &str,
        threads: Option<usize>,
        all_reduce_interface: Option<&Bound<'_, PyAny>>,
        multi_host: bool,
    ) -> PyResult<Self> {
        let config = Config::from_json(config_json).map_err(|e| to_py(py, e))?;
        let config_json = config.to_json();
        let given = all_reduce_interface.filter(|a| !a.is_none());
        let slot = (given.is_some() || multi_host).then(|| Arc::new(AllReduceSlot::default()));
        if let Some(slot) = &slot {
            slot.set(given)?;
        }
        let prep = Self::build(py, config, threads, &slot)?;
        Ok(NativePreprocessor {
            prep,
            out: zero_tailed(),
            pool: BufferPool::default(),
            config_json,
            threads,
            batch_number: 0,
            pid: std::process::id(),
            slot,
            stack_names: Vec::new(),
        })
    }

    /// Agrees on minibatching splits with the other hosts through `all_reduce_interface` (our
    /// TCP all-reduce or any object with `all_reduce_or(sync_key, value) -> int`; None: no more
    /// cross-host agreement, which a multi-host config then reports at its next split).
    fn set_all_reduce_interface(
        &mut self,
        py: Python<'_>,
        all_reduce_interface: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        match (&self.slot, all_reduce_interface.filter(|a| !a.is_none())) {
            (Some(slot), a) => slot.set(a)?,
            (None, None) => {}
            (None, Some(a)) => {
                let slot = Arc::new(AllReduceSlot::default());
                slot.set(Some(a))?;
                let config = Config::from_json(&self.config_json).map_err(|e| to_py(py, e))?;
                let mut fresh = Self::build(py, config, self.threads, &Some(slot.clone()))?;
                fresh.set_batch_number(self.batch_number);
                self.prep = fresh;
                self.pid = std::process::id();
                self.slot = Some(slot);
            }
        }
        Ok(())
    }

    /// The config as normalised JSON (defaults filled in).
    #[getter]
    fn config_json(&self) -> &str {
        &self.config_json
    }

    /// Whether it agrees across hosts through an all-reduce interface (set now or to be set).
    #[getter]
    fn multi_host(&self) -> bool {
        self.slot.is_some()
    }

    /// Sets the batch number that keys minibatching's cross-host agreement.
    fn set_batch_number(&mut self, batch_number: u64) {
        self.batch_number = batch_number;
        self.prep.set_batch_number(batch_number);
    }

    /// Preprocesses one record batch: the reference's 6-tuple.
    #[pyo3(signature = (batch, has_leading_dimension=false))]
    fn run(
        &mut self,
        py: Python<'_>,
        batch: &Bound<'_, PyAny>,
        has_leading_dimension: bool,
    ) -> PyResult<Results> {
        let rb = arrow_input::record_batch(batch)?;
        let on = self.live(py)?;
        // On the shared pool, calls take turns as the drop-in's do (see `Turn`): a loader's
        // threads (Grain's 16) calling at once each run on their own, and a call that gets the
        // pool starts on this thread with the pool's threads helping, as the drop-in's do.
        let turn = on.as_ref().map(|_| Turn::take()).transpose()?;
        let (prep, out) = (&mut self.prep, &mut self.out);
        self.pool.refill(out);
        py.detach(|| match turn.as_ref().map(Turn::pool) {
            Some(None) => batch_on_pool_if_parallel(None, prep, &rb, |prep, inputs| {
                prep.run_on_caller_thread(inputs, out)
            }),
            Some(Some(pool)) => batch_on_pool_if_parallel(None, prep, &rb, |prep, inputs| {
                prep.run_helped(pool, inputs, out)
            }),
            None => batch_on_pool_if_parallel(on.as_deref(), prep, &rb, |prep, inputs| {
                prep.run(inputs, out)
            }),
        })
        .map_err(|e| {
            out.clear();
            to_py_error(py, e, self.slot.as_deref())
        })?;
        results(
            py,
            &mut self.out,
            &self.pool,
            has_leading_dimension,
            &mut self.stack_names,
        )
    }

    /// The FDO statistics of one record batch (no buffers written), as mergeable stats.
    fn fdo_stats(&mut self, py: Python<'_>, batch: &Bound<'_, PyAny>) -> PyResult<NativeFdoStats> {
        let rb = arrow_input::record_batch(batch)?;
        let on = self.live(py)?;
        let (prep, out) = (&mut self.prep, &mut self.out);
        py.detach(|| {
            batch_on_pool_if_parallel(on.as_deref(), prep, &rb, |prep, inputs| {
                prep.run_stats(inputs, out)?;
                let plan = prep.plan().expect("a successful run has a plan");
                let mut stats = FdoStats::new(plan.layout);
                stats.record(plan, out)?;
                Ok(stats)
            })
        })
        .map(|inner| NativeFdoStats { inner })
        .map_err(|e| to_py(py, e))
    }
}

/// Mergeable FDO statistics (the crate's `fdo::FdoStats`).
#[pyclass(module = "sparsecore_prep._native")]
#[derive(Clone)]
pub struct NativeFdoStats {
    inner: FdoStats,
}

#[pymethods]
impl NativeFdoStats {
    /// Parses the JSON of `to_json` (or of the CLI's `stats.json`).
    #[staticmethod]
    fn from_json(py: Python<'_>, text: &str) -> PyResult<Self> {
        FdoStats::from_json(text)
            .map(|inner| NativeFdoStats { inner })
            .map_err(|e| to_py(py, e))
    }

    fn to_json(&self) -> String {
        self.inner.to_json()
    }

    /// Element-wise max of the arrays, sum of drops and batches, in place.
    fn merge(&mut self, py: Python<'_>, other: &NativeFdoStats) -> PyResult<()> {
        self.inner.merge(&other.inner).map_err(|e| to_py(py, e))
    }

    #[getter]
    fn batches(&self) -> u64 {
        self.inner.batches
    }

    /// New limits and buffer sizes for `config_json` (JSON in, JSON out), with `headroom`.
    fn tune(&self, py: Python<'_>, config_json: &str, headroom: f64) -> PyResult<String> {
        let config = Config::from_json(config_json).map_err(|e| to_py(py, e))?;
        let (tuned, _) = tune(&config, &self.inner, headroom).map_err(|e| to_py(py, e))?;
        // The tuned config must itself be usable.
        build(py, Preprocessor::builder(tuned.clone()), false)?;
        Ok(tuned.to_json())
    }

    fn __eq__(&self, other: &NativeFdoStats) -> bool {
        self.inner == other.inner
    }
}

/// Per feature, what the reference reads from its `FeatureSpec` (SPEC Part 2, section 2.6):
/// `(name, table, vocabulary_size, embedding_dim, global_batch)`,
/// `(stack, row_offset, col_offset, col_shift)`,
/// `(combiner, max_ids_per_partition, max_unique_ids_per_partition, suggested_coo_buffer_size_per_device)`.
pub(crate) type SpecTuple = (
    (String, String, u64, u64, usize),
    (String, u64, u64, u64),
    (String, u64, u64, Option<u64>),
);

/// Config and plan for features whose stacking was already resolved by the reference's specs.
#[allow(clippy::too_many_arguments)]
pub(crate) fn resolved_plan(
    specs: &[SpecTuple],
    l: usize,
    g: usize,
    s: usize,
    sharding_strategy: String,
    allow_id_dropping: bool,
    enable_minibatching: bool,
    validate_ids: bool,
) -> sparsecore_prep::Result<(Config, Plan)> {
    let mut tables: Vec<TableConfig> = Vec::new();
    let mut stacks: Vec<ResolvedStack> = Vec::new();
    let mut features = Vec::with_capacity(specs.len());
    let mut placements = Vec::with_capacity(specs.len());
    for spec in specs {
        let (
            (name, table, vocab, dim, global_batch),
            (stack, row_offset, col_offset, col_shift),
            (combiner, max_ids, max_unique, _),
        ) = spec;
        match tables.iter().find(|t| &t.name == table) {
            Some(t) if t.vocabulary_size != *vocab || t.embedding_dim != *dim => {
                return Err(sparsecore_prep::Error::config(
                    ConfigItem::Table,
                    table,
                    format!(
                        "two table specs share this name with different shapes ({}x{} and {vocab}x{dim})",
                        t.vocabulary_size, t.embedding_dim
                    ),
                ));
            }
            Some(_) => {}
            None => tables.push(TableConfig {
                name: table.clone(),
                vocabulary_size: *vocab,
                embedding_dim: *dim,
                combiner: combiner.clone(),
                max_ids_per_partition: *max_ids,
                max_unique_ids_per_partition: *max_unique,
                suggested_coo_buffer_size_per_device: None,
            }),
        }
        // Per stack, the settings of its first feature in row-offset order, as the reference
        // takes them (all members share one StackedTableSpec in practice).
        let first = specs
            .iter()
            .filter(|sp| sp.1 .0 == *stack)
            .min_by_key(|sp| sp.1 .1)
            .unwrap_or(spec);
        if !stacks.iter().any(|x| &x.name == stack) {
            let (combiner, max_ids, max_unique, suggested) = &first.2;
            stacks.push(ResolvedStack {
                name: stack.clone(),
                combiner: combiner.clone(),
                max_ids_per_partition: *max_ids,
                max_unique_ids_per_partition: *max_unique,
                suggested_coo_buffer_size_per_device: *suggested,
            });
        }
        features.push(FeatureConfig {
            name: name.clone(),
            table: table.clone(),
            column: None,
            weights_column: None,
            hash: None,
        });
        placements.push(Placement {
            stack: stack.clone(),
            row_offset: *row_offset,
            col_offset: *col_offset,
            col_shift: *col_shift,
            global_batch_size: *global_batch,
        });
    }
    let config = Config {
        config: Options {
            local_device_count: l,
            global_device_count: g,
            num_sc_per_device: s,
            allow_id_dropping,
            stacking: Stacking::Feature,
            stack_limits: None,
            enable_minibatching,
            stack_suggested_coo_buffer_size_per_device: None,
            validate_ids,
            sharding_strategy: Some(sharding_strategy),
        },
        tables,
        features,
    };
    let plan = Plan::from_resolved(&config, &placements, &stacks)?;
    Ok((config, plan))
}

/// The drop-in call's state for one set of resolved specs and options: the preprocessor (its
/// plan, and its per-thread scratch, which keeps its memory from call to call) and the buffers
/// ragged features are gathered into. `sparsecore_prep.preprocess_sparse_dense_matmul_input`
/// keeps a few of these, keyed by the specs' contents and the options, so that repeated calls
/// (a training loop) allocate and fault in only the output arrays they return.
///
/// One call at a time: the Python side takes an instance out of its cache for the duration of
/// a call, so concurrent calls from several threads each get their own.
#[pyclass(module = "sparsecore_prep._native")]
pub struct NativeDropIn {
    prep: Preprocessor,
    names: Vec<String>,
    scratch: Vec<numpy_input::Gathered>,
    /// The output of the last call, whose arrays were moved into numpy, and the pool their
    /// memory returns to (see `pool`).
    out: Output,
    pool: BufferPool,
    /// With `multi_host`: the all-reduce each call's `all_reduce_interface` is put into.
    slot: Option<Arc<AllReduceSlot>>,
    /// The stacks' names as the result dicts' keys (see [`results`]).
    stack_names: Vec<Py<PyString>>,
    /// The row splits of the COO features read as ragged rows (see `coo_row_splits`), kept
    /// from call to call.
    coo_splits: Vec<Vec<i32>>,
}

#[pymethods]
impl NativeDropIn {
    /// Plans the specs (resolved `(feature, placement, stack)` tuples, see `SpecTuple`) under
    /// the options; errors are the ones a call with these specs would raise. `multi_host`: the
    /// calls will pass an `all_reduce_interface`.
    #[new]
    #[pyo3(signature = (specs, local_device_count, global_device_count, num_sc_per_device,
                        sharding_strategy, allow_id_dropping, enable_minibatching, validate_ids, multi_host=false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        specs: Vec<SpecTuple>,
        local_device_count: usize,
        global_device_count: usize,
        num_sc_per_device: usize,
        sharding_strategy: String,
        allow_id_dropping: bool,
        enable_minibatching: bool,
        validate_ids: bool,
        multi_host: bool,
    ) -> PyResult<Self> {
        let (config, plan) = resolved_plan(
            &specs,
            local_device_count,
            global_device_count,
            num_sc_per_device,
            sharding_strategy,
            allow_id_dropping,
            enable_minibatching,
            validate_ids,
        )
        .map_err(|e| to_py(py, e))?;
        let slot = multi_host.then(|| Arc::new(AllReduceSlot::default()));
        let prep = build(
            py,
            with_slot(Preprocessor::builder(config).plan(plan), &slot),
            false,
        )?;
        let names = specs.into_iter().map(|s| s.0 .0).collect();
        Ok(NativeDropIn {
            prep,
            names,
            scratch: Vec::new(),
            out: zero_tailed(),
            pool: BufferPool::default(),
            slot,
            stack_names: Vec::new(),
            coo_splits: Vec::new(),
        })
    }

    /// Preprocesses one batch: numpy leaves (already flattened, in spec order), the
    /// reference's 6-tuple out. `all_reduce_interface`: this call's (built `multi_host`).
    #[pyo3(signature = (features, weights, has_leading_dimension, batch_number, all_reduce_interface=None))]
    fn run(
        &mut self,
        py: Python<'_>,
        features: Vec<Bound<'_, PyAny>>,
        weights: Option<Vec<Bound<'_, PyAny>>>,
        has_leading_dimension: bool,
        batch_number: u64,
        all_reduce_interface: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Results> {
        self.set_all_reduce(all_reduce_interface)?;
        let ran = self.run_inner(py, features, weights, has_leading_dimension, batch_number);
        if let Some(slot) = &self.slot {
            slot.clear();
        }
        ran
    }

    /// Preprocesses one batch of sparse COO features (the reference's
    /// `preprocess_sparse_dense_matmul_sparse_coo_input`), in spec order: per feature, `[nnz, 2]`
    /// C-contiguous int64 indices (column 0 the sample row, column 1 ignored), `[nnz]`
    /// C-contiguous int32 or int64 ids, and the local batch size (`dense_shape[0]`). Unit
    /// weights. The reference's 6-tuple out.
    #[pyo3(signature = (indices, values, batch_sizes, has_leading_dimension, batch_number, all_reduce_interface=None))]
    #[allow(clippy::too_many_arguments)]
    fn run_coo(
        &mut self,
        py: Python<'_>,
        indices: Vec<PyReadonlyArray2<'_, i64>>,
        values: Vec<Bound<'_, PyAny>>,
        batch_sizes: Vec<usize>,
        has_leading_dimension: bool,
        batch_number: u64,
        all_reduce_interface: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Results> {
        self.set_all_reduce(all_reduce_interface)?;
        let ran = self.run_coo_inner(
            py,
            indices,
            values,
            batch_sizes,
            has_leading_dimension,
            batch_number,
        );
        if let Some(slot) = &self.slot {
            slot.clear();
        }
        ran
    }
}

impl NativeDropIn {
    /// [`NativeDropIn::run`] once the call's all-reduce is set.
    fn run_inner(
        &mut self,
        py: Python<'_>,
        features: Vec<Bound<'_, PyAny>>,
        weights: Option<Vec<Bound<'_, PyAny>>>,
        has_leading_dimension: bool,
        batch_number: u64,
    ) -> PyResult<Results> {
        self.check_count(py, features.len(), "features")?;
        if let Some(w) = &weights {
            self.check_count(py, w.len(), "weights")?;
        }
        let turn = Turn::take()?;
        // Ragged features are gathered in parallel off the Python API; anything unusual (and
        // every error) goes through the checked path below, one feature at a time.
        let raw: Vec<_> = features
            .iter()
            .enumerate()
            .map(|(i, f)| {
                let w = weights.as_ref().map(|w| numpy_input::RawObjects::of(&w[i]));
                match (numpy_input::RawObjects::of(f), w) {
                    (Some(ids), None) => (Some(ids), None),
                    (Some(ids), Some(Some(w))) => (Some(ids), Some(w)),
                    _ => (None, None),
                }
            })
            .collect();
        // With an all-reduce, the pool's threads may wait for the GIL (a Python interface, in
        // another thread's call), which the gather holds: it then stays on this thread.
        let gather_pool = if self.slot.is_some() {
            None
        } else {
            turn.pool()
        };
        let fast = numpy_input::gather_all(py, gather_pool, &raw, &mut self.scratch);
        let data = fast
            .into_iter()
            .zip(features.iter().zip(&self.names))
            .enumerate()
            .map(|(i, (done, (f, name)))| match done {
                Some(d) => Ok(d),
                None => numpy_input::feature(name, f, weights.as_ref().map(|w| &w[i])),
            })
            .collect::<PyResult<Vec<_>>>()?;
        let out = &mut self.out;
        self.pool.refill(out);
        let ran = {
            let sources = data
                .iter()
                .zip(&self.names)
                .map(|(d, name)| d.source(name))
                .collect::<sparsecore_prep::Result<Vec<_>>>()
                .map_err(|e| to_py(py, e));
            sources.and_then(|sources| {
                self.prep.set_batch_number(batch_number);
                run_detached(
                    py,
                    &turn,
                    &mut self.prep,
                    &sources,
                    out,
                    self.slot.as_deref(),
                )
            })
        };
        numpy_input::recycle(data, &mut self.scratch);
        ran?;
        results(
            py,
            out,
            &self.pool,
            has_leading_dimension,
            &mut self.stack_names,
        )
    }

    /// [`NativeDropIn::run_coo`] once the call's all-reduce is set.
    fn run_coo_inner(
        &mut self,
        py: Python<'_>,
        indices: Vec<PyReadonlyArray2<'_, i64>>,
        values: Vec<Bound<'_, PyAny>>,
        batch_sizes: Vec<usize>,
        has_leading_dimension: bool,
        batch_number: u64,
    ) -> PyResult<Results> {
        self.check_count(py, indices.len(), "indices")?;
        self.check_count(py, values.len(), "values")?;
        self.check_count(py, batch_sizes.len(), "dense shapes")?;
        let turn = Turn::take()?;
        let values = values
            .iter()
            .zip(&self.names)
            .map(|(v, name)| coo_values(name, v))
            .collect::<PyResult<Vec<_>>>()?;
        // Each feature's view, or the error that it raises in its turn below.
        let views: Vec<PyResult<CooView<'_>>> = indices
            .iter()
            .zip(&values)
            .zip(&batch_sizes)
            .zip(&self.names)
            .map(|(((idx, ids), &batch), name)| {
                let contiguous = |what: &str| {
                    errors::invalid_input(
                        py,
                        name,
                        None,
                        None::<i64>,
                        format!("feature `{name}`: the {what} must be C-contiguous"),
                    )
                };
                if idx.shape()[1] != 2 {
                    return Err(errors::invalid_input(
                        py,
                        name,
                        None,
                        None::<i64>,
                        format!(
                            "feature `{name}`: indices must have shape [nnz, 2], got {:?}",
                            idx.shape()
                        ),
                    ));
                }
                let flat = idx.as_slice().map_err(|_| contiguous("indices"))?;
                let ids = match ids {
                    CooValues::I32(v) => Ids::I32(v.as_slice().map_err(|_| contiguous("values"))?),
                    CooValues::I64(v) => Ids::I64(v.as_slice().map_err(|_| contiguous("values"))?),
                };
                Ok((flat, ids, batch))
            })
            .collect();
        // Single-host calls read valid COO features as ragged rows (see `coo_row_splits`);
        // multi-host ones keep the COO view, so that a call never runs twice (its all-reduce
        // would be asked twice).
        let convert = self.slot.is_none();
        let mut splits = std::mem::take(&mut self.coo_splits);
        splits.resize_with(views.len(), Vec::new);
        let converted: Vec<bool> = if convert {
            let entries: usize = views
                .iter()
                .map(|v| v.as_ref().map_or(0, |v| v.1.len()))
                .sum();
            let split = |(splits, view): (&mut Vec<i32>, &PyResult<CooView<'_>>)| {
                view.as_ref()
                    .is_ok_and(|(flat, ids, batch)| coo_row_splits(flat, ids.len(), *batch, splits))
            };
            match turn.pool() {
                Some(pool) if entries >= COO_SPLITS_ON_CALLER_MAX_ENTRIES => {
                    use rayon::prelude::*;
                    // The views are slices of numpy arrays that this call holds (read-only borrows).
                    let views: Vec<Option<(&[i64], usize, usize)>> = views
                        .iter()
                        .map(|v| v.as_ref().ok().map(|(f, ids, b)| (*f, ids.len(), *b)))
                        .collect();
                    py.detach(|| {
                        pool.install(|| {
                            splits
                                .par_iter_mut()
                                .zip(views.par_iter())
                                .map(|(splits, view)| {
                                    view.is_some_and(|(flat, nnz, batch)| {
                                        coo_row_splits(flat, nnz, batch, splits)
                                    })
                                })
                                .collect()
                        })
                    })
                }
                _ => splits.iter_mut().zip(&views).map(split).collect(),
            }
        } else {
            vec![false; views.len()]
        };
        let sources = |as_coo: bool| -> PyResult<Vec<Box<dyn SampleSource + '_>>> {
            let mut sources: Vec<Box<dyn SampleSource + '_>> = Vec::with_capacity(views.len());
            for (((view, name), splits), &ragged) in
                views.iter().zip(&self.names).zip(&splits).zip(&converted)
            {
                let (flat, ids, batch) = match view {
                    Ok(v) => *v,
                    Err(e) => return Err(e.clone_ref(py)),
                };
                if ragged && !as_coo {
                    sources.push(Box::new(
                        RaggedInput::new(name, ids, Offsets::I32(splits))
                            .map_err(|e| to_py(py, e))?,
                    ));
                } else {
                    sources.push(Box::new(
                        CooInput::new(name, flat, ids, batch).map_err(|e| to_py(py, e))?,
                    ));
                }
            }
            Ok(sources)
        };
        self.pool.refill(&mut self.out);
        self.prep.set_batch_number(batch_number);
        let (prep, out, slot) = (&mut self.prep, &mut self.out, self.slot.as_deref());
        let mut run = |sources: PyResult<Vec<Box<dyn SampleSource + '_>>>| {
            sources.and_then(|sources| run_detached(py, &turn, prep, &sources, out, slot))
        };
        let mut ran = run(sources(false));
        if ran.is_err() && converted.contains(&true) {
            // A failing call runs again on the COO view, so that its error is the one the COO
            // path reports (which entry, which id first).
            ran = run(sources(true));
        }
        drop(views);
        self.coo_splits = splits;
        ran?;
        results(
            py,
            &mut self.out,
            &self.pool,
            has_leading_dimension,
            &mut self.stack_names,
        )
    }
}

impl NativeDropIn {
    /// Puts this call's `all_reduce_interface` into the slot (a multi-host instance needs one;
    /// others take none).
    fn set_all_reduce(&self, all_reduce_interface: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        match &self.slot {
            Some(slot) => slot.set(all_reduce_interface),
            None => Ok(()),
        }
    }

    /// One `what` per feature spec, or an error.
    fn check_count(&self, py: Python<'_>, got: usize, what: &str) -> PyResult<()> {
        if got == self.names.len() {
            return Ok(());
        }
        let message = format!(
            "{got} {what} for {} feature specs (the lists must match one to one)",
            self.names.len()
        );
        Err(errors::raise(py, errors::Class::InvalidInput, message, &[]))
    }
}

/// A COO feature's flat `[nnz, 2]` indices, its ids, and its batch (`dense_shape[0]`).
type CooView<'a> = (&'a [i64], Ids<'a>, usize);

/// Fewer COO entries than this (over all features) get their row splits on the calling thread.
const COO_SPLITS_ON_CALLER_MAX_ENTRIES: usize = 65_536;

/// The row splits of `nnz` COO entries (`indices`: `[nnz, 2]`, row first) into `splits`, so that
/// the pipeline reads them as ragged rows (`ids[splits[r]..splits[r + 1]]`, the ids in place):
/// one pass over the rows, where the COO view costs the pipeline a check in `CooInput::new`,
/// another in each task, and a row-by-row extraction. `false` (the COO view then reports the
/// problem) unless the indices hold `2 * nnz` values, every row lies in `0..batch` and rows do
/// not decrease, and `nnz` and `batch` fit the int32 splits.
fn coo_row_splits(indices: &[i64], nnz: usize, batch: usize, splits: &mut Vec<i32>) -> bool {
    if indices.len() != 2 * nnz || nnz > i32::MAX as usize || batch >= i32::MAX as usize {
        return false;
    }
    splits.clear();
    splits.reserve(batch + 1);
    splits.push(0);
    let mut prev = 0i64;
    for (k, pair) in indices.chunks_exact(2).enumerate() {
        let row = pair[0];
        if row < prev || row as u64 >= batch as u64 {
            return false;
        }
        if row != prev {
            // Rows prev + 1 ..= row start at entry k (the ones between are empty).
            splits.resize(row as usize + 1, k as i32);
            prev = row;
        }
    }
    splits.resize(batch + 1, nnz as i32);
    true
}

/// A COO feature's ids: a 1-D int32 or int64 array.
enum CooValues<'py> {
    I32(PyReadonlyArray1<'py, i32>),
    I64(PyReadonlyArray1<'py, i64>),
}

fn coo_values<'py>(name: &str, values: &Bound<'py, PyAny>) -> PyResult<CooValues<'py>> {
    if let Ok(v) = values.extract::<PyReadonlyArray1<'py, i32>>() {
        return Ok(CooValues::I32(v));
    }
    if let Ok(v) = values.extract::<PyReadonlyArray1<'py, i64>>() {
        return Ok(CooValues::I64(v));
    }
    Err(errors::input_type(
        values.py(),
        name,
        format!("feature `{name}`: COO values must be a 1-D int32 or int64 array"),
    ))
}

/// The drop-in call without the cache: numpy leaves (already flattened) and resolved specs in,
/// the reference's 6-tuple out.
#[pyfunction]
#[pyo3(signature = (features, weights, specs, local_device_count, global_device_count, num_sc_per_device,
                    sharding_strategy, has_leading_dimension, allow_id_dropping, batch_number,
                    enable_minibatching, validate_ids))]
#[allow(clippy::too_many_arguments)]
pub fn preprocess_resolved(
    py: Python<'_>,
    features: Vec<Bound<'_, PyAny>>,
    weights: Option<Vec<Bound<'_, PyAny>>>,
    specs: Vec<SpecTuple>,
    local_device_count: usize,
    global_device_count: usize,
    num_sc_per_device: usize,
    sharding_strategy: String,
    has_leading_dimension: bool,
    allow_id_dropping: bool,
    batch_number: u64,
    enable_minibatching: bool,
    validate_ids: bool,
) -> PyResult<Results> {
    let mut call = NativeDropIn::new(
        py,
        specs,
        local_device_count,
        global_device_count,
        num_sc_per_device,
        sharding_strategy,
        allow_id_dropping,
        enable_minibatching,
        validate_ids,
        false,
    )?;
    call.run(
        py,
        features,
        weights,
        has_leading_dimension,
        batch_number,
        None,
    )
}
