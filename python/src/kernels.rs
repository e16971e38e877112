//! `NativeKernels`: the CPU backend (crate `sparsecore-kernel`) for `sparsecore_prep.kernels`.
//!
//! The Python side (`sparsecore_prep/kernels.py`) has the reference's signatures, reads the
//! feature and optimizer specs, checks shapes while `jax.jit` traces, and calls in here from a
//! `jax.pure_callback`. This module owns the plan of one set of resolved specs (the drop-in
//! preprocessing call's, so the buffers it reads are exactly the ones that call wrote) and runs
//! the crate's passes over the numpy arrays in place, with the GIL released, on a rayon pool:
//! `sparse_dense_matmul_into` and `feature_activations` forward, `stack_feature_gradients` and
//! `apply_gradients_into` backward, `StackedTable` for the table layout helpers.
//!
//! Arrays come in as numpy views (read-only, or read-write for the in-place update the
//! benchmark uses) and leave as new numpy arrays that own the `ndarray` they were computed in,
//! so nothing is copied on the way out.

use std::sync::{Arc, Mutex};

use ndarray::{s, Array2, ArrayView2, ArrayViewMut2, Axis};
use numpy::{
    IntoPyArray, PyArray2, PyReadonlyArray1, PyReadonlyArray2, PyReadwriteArray2,
    PyUntypedArrayMethods,
};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use rayon::prelude::*;
use rayon::ThreadPool;
use sparsecore_kernel::{
    apply_gradients_into, feature_activations, sparse_dense_matmul_into, stack_feature_gradients,
    KernelError, Optimizer, StackBuffers, StackedTable,
};
use sparsecore_prep::{Config, Plan};

use crate::errors::{self, field, kernel_to_py, to_py, Class};
use crate::prep::{resolved_plan, SpecTuple};
use crate::threads;

/// One stack's four buffers as numpy arrays (any shape; read flat, C order).
type Buffers<'py> = (
    PyReadonlyArray1<'py, i32>,
    PyReadonlyArray1<'py, i32>,
    PyReadonlyArray1<'py, i32>,
    PyReadonlyArray1<'py, f32>,
);

/// An optimizer as the Python side reads it from a spec: its short name (the reference's
/// `short_name()`), its hyper-parameters in the reference's order, the step (Adam, LaProp) and
/// the flag (Adagrad-momentum's `use_nesterov`, FTRL's `multiply_linear_by_learning_rate`).
type OptimizerTuple = (String, Vec<f32>, Option<i64>, bool);

/// Plans and runs the passes for one set of specs and one device layout.
#[pyclass(module = "sparsecore_prep._native")]
pub struct NativeKernels {
    plan: Plan,
    /// A dedicated pool of this many threads, or the package's shared one.
    threads: Option<usize>,
    /// The dedicated pool and the process it was started in. Behind a lock, not `&mut self`:
    /// JAX runs callbacks on its own threads while the caller goes on (dispatch is
    /// asynchronous), so calls on one instance may overlap.
    pool: Mutex<Option<(u32, Arc<ThreadPool>)>>,
}

fn config_error(py: Python<'_>, stack: &str, field_name: &str, message: String) -> PyErr {
    errors::raise(
        py,
        Class::Config,
        message,
        &[
            ("field", field(py, field_name)),
            ("location", field(py, format!("stack `{stack}`"))),
        ],
    )
}

/// The crate's optimizer for a stack, or a `ConfigError` naming the stack and the
/// hyper-parameter (an unknown optimizer, a wrong number of hyper-parameters, a NaN or infinite
/// one).
fn optimizer(
    py: Python<'_>,
    stack: &str,
    (kind, h, step, flag): &OptimizerTuple,
) -> PyResult<Optimizer> {
    let want = match kind.as_str() {
        "sgd" | "adagrad" => 1,
        "adagrad_momentum" | "ftrl" => 5,
        "adam" | "laprop" => 4,
        _ => {
            return Err(config_error(
                py,
                stack,
                "optimizer",
                format!("stack `{stack}`: optimizer `{kind}` is not one of sgd, adagrad, adagrad_momentum, adam, ftrl, laprop"),
            ))
        }
    };
    if h.len() != want {
        return Err(config_error(
            py,
            stack,
            "optimizer",
            format!(
                "stack `{stack}`: {kind} takes {want} hyper-parameters, got {}",
                h.len()
            ),
        ));
    }
    let step_u32 = |s: i64| {
        u32::try_from(s).map_err(|_| {
            config_error(
                py,
                stack,
                "step",
                format!("stack `{stack}`: step {s} must be in [0, 2^32)"),
            )
        })
    };
    let opt = match kind.as_str() {
        "sgd" => Optimizer::Sgd { lr: h[0] },
        "adagrad" => Optimizer::Adagrad { lr: h[0] },
        "adagrad_momentum" => Optimizer::AdagradMomentum {
            lr: h[0],
            momentum: h[1],
            beta2: h[2],
            epsilon: h[3],
            exponent: h[4],
            use_nesterov: *flag,
        },
        "adam" => Optimizer::Adam {
            lr: h[0],
            beta1: h[1],
            beta2: h[2],
            epsilon: h[3],
            step: step_u32(step.unwrap_or(0))?,
        },
        "ftrl" => Optimizer::Ftrl {
            lr: h[0],
            lr_power: h[1],
            l1: h[2],
            l2: h[3],
            beta: h[4],
            multiply_linear_by_lr: *flag,
        },
        _ => Optimizer::Laprop {
            lr: h[0],
            b1: h[1],
            b2: h[2],
            eps: h[3],
            step: step.map(step_u32).transpose()?,
        },
    };
    opt.validate().map_err(|e| {
        let hyper = match e.root() {
            KernelError::Parameter { value, .. } => {
                value.split(' ').next().unwrap_or("optimizer").to_string()
            }
            _ => "optimizer".to_string(),
        };
        config_error(py, stack, &hyper, format!("stack `{stack}`, {kind}: {e}"))
    })?;
    Ok(opt)
}

/// A C-contiguous numpy array's data, or a `ValueError` naming what it is.
fn flat<'a, T: numpy::Element>(
    a: &'a PyReadonlyArray1<'_, T>,
    what: &str,
    stack: &str,
) -> PyResult<&'a [T]> {
    a.as_slice().map_err(|_| {
        errors::raise(
            a.py(),
            Class::InvalidInput,
            format!("stack `{stack}`: {what} must be C-contiguous"),
            &[],
        )
    })
}

impl NativeKernels {
    fn with_plan(plan: Plan, threads: Option<usize>) -> Self {
        NativeKernels {
            plan,
            threads,
            pool: Mutex::new(None),
        }
    }

    /// The pool to run on: a dedicated one (rebuilt in a forked child, whose threads it does
    /// not have), or the package's shared one.
    fn pool(&self) -> PyResult<Arc<ThreadPool>> {
        let Some(n) = self.threads else {
            return threads::pool();
        };
        let pid = std::process::id();
        let mut slot = self.pool.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((owner, pool)) = &*slot {
            if *owner == pid {
                return Ok(pool.clone());
            }
        }
        if let Some(inherited) = slot.take() {
            std::mem::forget(inherited);
        }
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .thread_name(|i| format!("sparsecore-kernels-{i}"))
            .build()
            .map_err(|e| PyRuntimeError::new_err(format!("cannot start the thread pool: {e}")))?;
        let pool = Arc::new(pool);
        *slot = Some((pid, pool.clone()));
        Ok(pool)
    }

    /// Borrowed buffers of every stack, in plan order.
    fn buffers<'a>(
        &'a self,
        py: Python<'_>,
        buffers: &'a [Buffers<'_>],
    ) -> PyResult<Vec<StackBuffers<'a>>> {
        if buffers.len() != self.plan.stacks.len() {
            return Err(errors::raise(
                py,
                Class::InvalidInput,
                format!(
                    "{} stacks of buffers for the {} stacks of the specs",
                    buffers.len(),
                    self.plan.stacks.len()
                ),
                &[],
            ));
        }
        self.plan
            .stacks
            .iter()
            .zip(buffers)
            .map(|(sp, (rp, e, smp, g))| {
                Ok(StackBuffers {
                    stack: &sp.name,
                    row_pointers: flat(rp, "lhs_row_pointers", &sp.name)?,
                    embedding_ids: flat(e, "lhs_embedding_ids", &sp.name)?,
                    sample_ids: flat(smp, "lhs_sample_ids", &sp.name)?,
                    gains: flat(g, "lhs_gains", &sp.name)?,
                })
            })
            .collect()
    }

    fn bsd(&self, stack: usize) -> usize {
        (self.plan.stacks[stack].total_sample_count / self.plan.layout.global_devices as u64)
            as usize
    }

    /// Per-feature gradients (`[L · S · rows, dim]`, the per-feature activations' shape) of
    /// every stack stacked into its `[L · bsd, D]` activation layout.
    fn stack_gradients(
        &self,
        grads: &[ArrayView2<'_, f32>],
    ) -> sparsecore_kernel::Result<Vec<Array2<f32>>> {
        let l = self.plan.layout.local_devices;
        self.plan
            .stacks
            .par_iter()
            .enumerate()
            .map(|(i, sp)| {
                let bsd = self.bsd(i);
                let mut out = Array2::<f32>::zeros((l * bsd, sp.stack_embedding_dim as usize));
                for d in 0..l {
                    let per_device: Vec<(usize, ArrayView2<'_, f32>)> = sp
                        .features
                        .iter()
                        .map(|&f| {
                            let g = &grads[f];
                            let rows = g.nrows() / l;
                            (f, g.slice(s![d * rows..(d + 1) * rows, ..]))
                        })
                        .collect();
                    let stacked = stack_feature_gradients(&self.plan, &sp.name, &per_device)?;
                    out.slice_mut(s![d * bsd..(d + 1) * bsd, ..])
                        .assign(&stacked);
                }
                Ok(out)
            })
            .collect()
    }

    fn check_grads(&self, py: Python<'_>, grads: &[ArrayView2<'_, f32>]) -> PyResult<()> {
        let (l, s, n) = (
            self.plan.layout.local_devices,
            self.plan.layout.sc_per_device,
            self.plan.layout.num_partitions(),
        );
        if grads.len() != self.plan.features.len() {
            return Err(errors::raise(
                py,
                Class::InvalidInput,
                format!(
                    "{} activation gradients for {} features",
                    grads.len(),
                    self.plan.features.len()
                ),
                &[],
            ));
        }
        for (f, g) in self.plan.features.iter().zip(grads) {
            let want = (l * s * (f.global_batch_size / n), f.embedding_dim as usize);
            if g.dim() != want {
                return Err(errors::invalid_input(
                    py,
                    &f.name,
                    None,
                    None::<i64>,
                    format!("feature `{}`: activation gradient of shape {:?}, expected [{}, {}] (the feature's activations)", f.name, g.dim(), want.0, want.1),
                ));
            }
        }
        Ok(())
    }
}

#[pymethods]
impl NativeKernels {
    /// Plans resolved specs (the drop-in preprocessing call's `SpecTuple`s) for `L` local and
    /// `G` global devices of `S` SparseCores.
    #[new]
    #[pyo3(signature = (specs, local_device_count, global_device_count, num_sc_per_device, enable_minibatching, threads=None))]
    fn new(
        py: Python<'_>,
        specs: Vec<SpecTuple>,
        local_device_count: usize,
        global_device_count: usize,
        num_sc_per_device: usize,
        enable_minibatching: bool,
        threads: Option<usize>,
    ) -> PyResult<Self> {
        let (_, plan) = resolved_plan(
            &specs,
            local_device_count,
            global_device_count,
            num_sc_per_device,
            "MOD".to_string(),
            false,
            enable_minibatching,
            true,
        )
        .map_err(|e| to_py(py, e))?;
        Ok(Self::with_plan(plan, threads))
    }

    /// Plans our JSON config for the given global batch size of every feature (what
    /// `sparsecore_prep.Preprocessor` runs), so that its buffers can be fed to the passes.
    #[staticmethod]
    #[pyo3(signature = (config_json, global_batch_sizes, threads=None))]
    fn from_config(
        py: Python<'_>,
        config_json: &str,
        global_batch_sizes: Vec<usize>,
        threads: Option<usize>,
    ) -> PyResult<Self> {
        let config = Config::from_json(config_json).map_err(|e| to_py(py, e))?;
        let plan = Plan::new(&config, &global_batch_sizes).map_err(|e| to_py(py, e))?;
        Ok(Self::with_plan(plan, threads))
    }

    /// The shapes the Python side needs: `{"local_devices", "stacks": [{name, vocab, dim,
    /// shards, rows_per_shard, batch_per_device, features, tables: [(name, vocab, dim)]}],
    /// "features": [(name, stack, rows, dim)]}` (`rows`: the feature's activation rows over
    /// the local devices).
    fn layout<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let out = PyDict::new(py);
        let layout = self.plan.layout;
        let (l, s, n) = (
            layout.local_devices,
            layout.sc_per_device,
            layout.num_partitions(),
        );
        out.set_item("local_devices", l)?;
        let mut stacks = Vec::new();
        for (i, sp) in self.plan.stacks.iter().enumerate() {
            let d = PyDict::new(py);
            d.set_item("name", &sp.name)?;
            d.set_item("vocab", sp.stack_vocab_size)?;
            d.set_item("dim", sp.stack_embedding_dim)?;
            d.set_item("shards", n)?;
            d.set_item("rows_per_shard", sp.stack_vocab_size as usize / n)?;
            d.set_item("batch_per_device", self.bsd(i))?;
            d.set_item("features", sp.features.clone())?;
            let tables: Vec<(String, u64, u64)> = sp
                .tables
                .iter()
                .filter_map(|&t| self.plan.features.iter().find(|f| f.table_index == t))
                .map(|f| (f.table.clone(), f.vocabulary_size, f.embedding_dim))
                .collect();
            d.set_item("tables", tables)?;
            stacks.push(d);
        }
        out.set_item("stacks", stacks)?;
        let features: Vec<(String, usize, usize, u64)> = self
            .plan
            .features
            .iter()
            .map(|f| {
                (
                    f.name.clone(),
                    f.stack,
                    l * s * (f.global_batch_size / n),
                    f.embedding_dim,
                )
            })
            .collect();
        out.set_item("features", features)?;
        Ok(out)
    }

    /// The forward pass: per-feature activations in spec order (`unstack`), or per-stack
    /// stacked activations `[L · bsd, D]` in plan order.
    #[pyo3(signature = (buffers, num_minibatches, tables, unstack=true))]
    fn forward<'py>(
        &self,
        py: Python<'py>,
        buffers: Vec<Buffers<'py>>,
        num_minibatches: usize,
        tables: Vec<PyReadonlyArray2<'py, f32>>,
        unstack: bool,
    ) -> PyResult<Vec<Bound<'py, PyArray2<f32>>>> {
        let pool = self.pool()?;
        let b = self.buffers(py, &buffers)?;
        if tables.len() != b.len() {
            return Err(errors::raise(
                py,
                Class::InvalidInput,
                format!("{} tables for {} stacks", tables.len(), b.len()),
                &[],
            ));
        }
        let views: Vec<ArrayView2<'_, f32>> = tables.iter().map(|t| t.as_array()).collect();
        let plan = &self.plan;
        let l = plan.layout.local_devices;
        let this = self;
        let result = py.detach(|| {
            pool.install(|| -> sparsecore_kernel::Result<Vec<Array2<f32>>> {
                let stacked: Vec<Array2<f32>> = b
                    .par_iter()
                    .zip(&views)
                    .enumerate()
                    .map(|(i, (buf, table))| {
                        let mut act = Array2::<f32>::zeros((
                            l * this.bsd(i),
                            plan.stacks[i].stack_embedding_dim as usize,
                        ));
                        sparse_dense_matmul_into(
                            plan,
                            buf,
                            num_minibatches,
                            table.view(),
                            act.view_mut(),
                        )?;
                        Ok(act)
                    })
                    .collect::<sparsecore_kernel::Result<_>>()?;
                if !unstack {
                    return Ok(stacked);
                }
                (0..plan.features.len())
                    .into_par_iter()
                    .map(|f| {
                        let st = &stacked[plan.features[f].stack];
                        let bsd = st.nrows() / l;
                        let per_device: Vec<Array2<f32>> = (0..l)
                            .map(|d| {
                                feature_activations(
                                    plan,
                                    f,
                                    st.slice(s![d * bsd..(d + 1) * bsd, ..]),
                                )
                            })
                            .collect::<sparsecore_kernel::Result<_>>()?;
                        let views: Vec<_> = per_device.iter().map(|a| a.view()).collect();
                        Ok(ndarray::concatenate(Axis(0), &views).expect("equal widths"))
                    })
                    .collect()
            })
        });
        Ok(result
            .map_err(|e| kernel_to_py(py, e))?
            .into_iter()
            .map(|a| a.into_pyarray(py))
            .collect())
    }

    /// The backward pass with each stack's optimizer, on copies: returns every stack's updated
    /// `[table, *slots]`. `grads` are per-feature (spec order) or, with `stacked`, per-stack
    /// `[L · bsd, D]`; `limits` per stack are `(min, max)` (±inf for none).
    #[pyo3(signature = (buffers, num_minibatches, grads, variables, optimizers, limits, stacked=false))]
    #[allow(clippy::too_many_arguments)]
    fn backward<'py>(
        &self,
        py: Python<'py>,
        buffers: Vec<Buffers<'py>>,
        num_minibatches: usize,
        grads: Vec<PyReadonlyArray2<'py, f32>>,
        variables: Vec<Vec<PyReadonlyArray2<'py, f32>>>,
        optimizers: Vec<OptimizerTuple>,
        limits: Vec<(f32, f32)>,
        stacked: bool,
    ) -> PyResult<Vec<Vec<Bound<'py, PyArray2<f32>>>>> {
        let mut owned: Vec<Vec<Array2<f32>>> = variables
            .iter()
            .map(|v| v.iter().map(|a| a.as_array().to_owned()).collect())
            .collect();
        let mut views: Vec<Vec<ArrayViewMut2<'_, f32>>> = owned
            .iter_mut()
            .map(|v| v.iter_mut().map(|a| a.view_mut()).collect())
            .collect();
        self.update(
            py,
            &buffers,
            num_minibatches,
            &grads,
            &mut views,
            &optimizers,
            &limits,
            stacked,
        )?;
        drop(views);
        Ok(owned
            .into_iter()
            .map(|v| v.into_iter().map(|a| a.into_pyarray(py)).collect())
            .collect())
    }

    /// [`NativeKernels::backward`] in place on writable numpy arrays (the benchmark's path; the
    /// `jax.pure_callback` path must not write into its inputs).
    #[pyo3(signature = (buffers, num_minibatches, grads, variables, optimizers, limits, stacked=true))]
    #[allow(clippy::too_many_arguments)]
    fn backward_in_place<'py>(
        &self,
        py: Python<'py>,
        buffers: Vec<Buffers<'py>>,
        num_minibatches: usize,
        grads: Vec<PyReadonlyArray2<'py, f32>>,
        mut variables: Vec<Vec<PyReadwriteArray2<'py, f32>>>,
        optimizers: Vec<OptimizerTuple>,
        limits: Vec<(f32, f32)>,
        stacked: bool,
    ) -> PyResult<()> {
        let mut views: Vec<Vec<ArrayViewMut2<'_, f32>>> = variables
            .iter_mut()
            .map(|v| v.iter_mut().map(|a| a.as_array_mut()).collect())
            .collect();
        self.update(
            py,
            &buffers,
            num_minibatches,
            &grads,
            &mut views,
            &optimizers,
            &limits,
            stacked,
        )
    }

    /// Member table arrays (`[vocabulary_size, embedding_dim]`, the stack's table order) of stack
    /// `stack` (plan index) in the stacked, sharded layout `[N · R, D]`.
    fn stack_table<'py>(
        &self,
        py: Python<'py>,
        stack: usize,
        tables: Vec<PyReadonlyArray2<'py, f32>>,
    ) -> PyResult<Bound<'py, PyArray2<f32>>> {
        let sp = self.stack_plan(py, stack)?;
        let views: Vec<ArrayView2<'_, f32>> = tables.iter().map(|t| t.as_array()).collect();
        let t = StackedTable::from_tables(&self.plan, &sp.name, &views)
            .map_err(|e| kernel_to_py(py, e))?;
        Ok(t.data.into_pyarray(py))
    }

    /// The inverse of [`NativeKernels::stack_table`]: the member tables of stack `stack`.
    fn unstack_table<'py>(
        &self,
        py: Python<'py>,
        stack: usize,
        table: PyReadonlyArray2<'py, f32>,
    ) -> PyResult<Vec<Bound<'py, PyArray2<f32>>>> {
        let sp = self.stack_plan(py, stack)?;
        let n = self.plan.layout.num_partitions();
        let (v, d) = (
            sp.stack_vocab_size as usize,
            sp.stack_embedding_dim as usize,
        );
        if table.shape() != [v, d] {
            return Err(config_error(
                py,
                &sp.name,
                "embedding_variables",
                format!(
                    "stack `{}`: table of shape {:?}, expected [{v}, {d}]",
                    sp.name,
                    table.shape()
                ),
            ));
        }
        let st = StackedTable {
            stack: sp.name.clone(),
            num_shards: n,
            rows_per_shard: v / n,
            dim: d,
            data: table.as_array().to_owned(),
        };
        sp.tables
            .iter()
            .map(|&t| {
                Ok(st
                    .table(&self.plan, t)
                    .map_err(|e| kernel_to_py(py, e))?
                    .into_pyarray(py))
            })
            .collect()
    }
}

impl NativeKernels {
    fn stack_plan(
        &self,
        py: Python<'_>,
        stack: usize,
    ) -> PyResult<&sparsecore_prep::spec::StackPlan> {
        self.plan.stacks.get(stack).ok_or_else(|| {
            errors::raise(
                py,
                Class::InvalidInput,
                format!("no stack {stack} ({} stacks)", self.plan.stacks.len()),
                &[],
            )
        })
    }

    /// Checks everything that does not need the data (optimizers, counts, shapes), then runs
    /// every stack's update in parallel with the GIL released.
    #[allow(clippy::too_many_arguments)]
    fn update(
        &self,
        py: Python<'_>,
        buffers: &[Buffers<'_>],
        num_minibatches: usize,
        grads: &[PyReadonlyArray2<'_, f32>],
        variables: &mut [Vec<ArrayViewMut2<'_, f32>>],
        optimizers: &[OptimizerTuple],
        limits: &[(f32, f32)],
        stacked: bool,
    ) -> PyResult<()> {
        let pool = self.pool()?;
        let b = self.buffers(py, buffers)?;
        let k = self.plan.stacks.len();
        if variables.len() != k || optimizers.len() != k || limits.len() != k {
            return Err(errors::raise(
                py,
                Class::InvalidInput,
                format!(
                    "{} variables, {} optimizers and {} limits for {k} stacks",
                    variables.len(),
                    optimizers.len(),
                    limits.len()
                ),
                &[],
            ));
        }
        let mut opts = Vec::with_capacity(k);
        for ((sp, o), vars) in self
            .plan
            .stacks
            .iter()
            .zip(optimizers)
            .zip(variables.iter())
        {
            let opt = optimizer(py, &sp.name, o)?;
            let want = (
                sp.stack_vocab_size as usize,
                sp.stack_embedding_dim as usize,
            );
            if vars.len() != 1 + opt.slot_names().len() {
                return Err(config_error(
                    py,
                    &sp.name,
                    "embedding_variables",
                    format!(
                        "stack `{}`: {} needs the table and {} slot variables ({}), got {} arrays",
                        sp.name,
                        o.0,
                        opt.slot_names().len(),
                        opt.slot_names().join(", "),
                        vars.len()
                    ),
                ));
            }
            if let Some(v) = vars.iter().find(|v| v.dim() != want) {
                return Err(config_error(
                    py,
                    &sp.name,
                    "embedding_variables",
                    format!(
                        "stack `{}`: variable of shape {:?}, expected the stacked table's [{}, {}]",
                        sp.name,
                        v.dim(),
                        want.0,
                        want.1
                    ),
                ));
            }
            opts.push(opt);
        }
        let grad_views: Vec<ArrayView2<'_, f32>> = grads.iter().map(|g| g.as_array()).collect();
        if stacked {
            if grad_views.len() != k {
                return Err(errors::raise(
                    py,
                    Class::InvalidInput,
                    format!("{} stacked gradients for {k} stacks", grad_views.len()),
                    &[],
                ));
            }
        } else {
            self.check_grads(py, &grad_views)?;
        }
        let this = self;
        let result = py.detach(|| {
            pool.install(|| -> sparsecore_kernel::Result<()> {
                let stacked_owned;
                let stacked_grads: Vec<ArrayView2<'_, f32>> = if stacked {
                    grad_views.clone()
                } else {
                    stacked_owned = this.stack_gradients(&grad_views)?;
                    stacked_owned.iter().map(|a| a.view()).collect()
                };
                variables
                    .par_iter_mut()
                    .zip(b.par_iter())
                    .zip(stacked_grads.par_iter())
                    .zip(opts.par_iter().zip(limits.par_iter()))
                    .try_for_each(|(((vars, buf), g), (opt, lim))| {
                        let (table, slots) = vars
                            .split_first_mut()
                            .expect("the table is there (checked)");
                        apply_gradients_into(
                            &this.plan,
                            buf,
                            num_minibatches,
                            g.view(),
                            opt,
                            *lim,
                            table.view_mut(),
                            slots,
                        )
                    })
            })
        });
        result.map_err(|e| kernel_to_py(py, e))
    }
}
