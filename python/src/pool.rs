//! Output arrays whose memory comes back to the drop-in call once numpy is done with it.
//!
//! Every call returns fresh numpy arrays (the caller may keep them), so without this each call
//! allocates its COO buffers anew: tens of megabytes on large batches, every page of which the
//! kernel then faults in and zeroes before the pipeline writes it. In a training loop the
//! previous batch's arrays are usually dead by the next call. Each array handed out here is a
//! view of a [`PooledBuffer`], and when numpy frees the last view, the buffer's `Vec` goes back
//! to its slot (stack, array) in the [`BufferPool`], where the next call picks it up: its pages
//! are mapped already, and the pipeline overwrites every slot (data or padding), so no memset
//! is needed either. (Numpy's arrays are writable, so a returned buffer's tails are padded in
//! full: [`sparsecore_prep::StackOutput::mark_written`].) An array still alive simply leaves its slot empty, and that call
//! allocates, as before.
//!
//! The pool holds at most one buffer per slot, so it never keeps more than one call's output.

use std::sync::{Arc, Mutex, Weak};

use numpy::ndarray::ArrayView1;
use numpy::{Element, PyArray1};
use pyo3::prelude::*;
use sparsecore_prep::Output;

/// The four arrays of a stack, in the order of the reference's result.
const ROLES: usize = 4;

/// One array's memory (the two element types the four output arrays use).
pub enum Buf {
    I32(Vec<i32>),
    F32(Vec<f32>),
}

/// Returned buffers by `[stack][role]`.
type Slots = Vec<[Option<Buf>; ROLES]>;

/// The buffers of one drop-in state (see the module docs).
#[derive(Default)]
pub struct BufferPool {
    slots: Arc<Mutex<Slots>>,
}

impl BufferPool {
    /// Puts every returned buffer back into the stack array it came from, where `out` has an
    /// empty one (the arrays of the last call were moved out), so that the next run reuses it.
    pub fn refill(&self, out: &mut Output) {
        let Ok(mut slots) = self.slots.lock() else {
            return;
        };
        for (so, slot) in out.stacks.iter_mut().zip(slots.iter_mut()) {
            let [rp, eid, sid, gains] = slot;
            put(&mut so.row_pointers, rp);
            put(&mut so.embedding_ids, eid);
            put(&mut so.sample_ids, sid);
            put(&mut so.gains, gains);
            // numpy's arrays are writable, so a returned buffer may have been changed anywhere:
            // the next batch pads its tails in full.
            so.mark_written();
        }
    }

    /// A numpy array over `v`, whose memory returns to slot (`stack`, `role`) when numpy frees it.
    pub fn array<'py, T: Pooled>(
        &self,
        py: Python<'py>,
        v: Vec<T>,
        stack: usize,
        role: usize,
    ) -> PyResult<Bound<'py, PyAny>> {
        if let Ok(mut slots) = self.slots.lock() {
            if slots.len() <= stack {
                slots.resize_with(stack + 1, Default::default);
            }
        }
        let owner = Bound::new(
            py,
            PooledBuffer {
                buf: Some(T::wrap(v)),
                home: Arc::downgrade(&self.slots),
                stack,
                role,
            },
        )?;
        let view = ArrayView1::from(owner.get().slice::<T>());
        // SAFETY: the array points into the `Vec` held by `owner`, which becomes its base object
        // and so outlives it; the `Vec` is never touched again until `owner` is dropped (the
        // class is frozen, and nothing else can reach the field).
        Ok(unsafe { PyArray1::borrow_from_array(&view, owner.clone().into_any()) }.into_any())
    }
}

/// Moves a returned buffer of the right type into `dst`, if `dst` is empty.
fn put<T: Pooled>(dst: &mut Vec<T>, slot: &mut Option<Buf>) {
    if dst.capacity() == 0 {
        if let Some(v) = slot.take().and_then(T::unwrap) {
            *dst = v;
        }
    }
}

/// Element types of the output arrays, so that one pool serves `i32` and `f32` arrays.
pub trait Pooled: Element + Copy {
    /// Tags a buffer with its type for the pool.
    fn wrap(v: Vec<Self>) -> Buf;
    /// The buffer back, if it holds this type (a slot only ever holds its own array's type).
    fn unwrap(b: Buf) -> Option<Vec<Self>>;
    /// The buffer's elements, if it holds this type.
    fn view(b: &Buf) -> &[Self];
}

/// `Pooled` for an element type: `$this` is its `Buf` variant, `$other` the other one.
macro_rules! pooled {
    ($t:ty, $this:ident, $other:ident) => {
        impl Pooled for $t {
            fn wrap(v: Vec<Self>) -> Buf {
                Buf::$this(v)
            }
            fn unwrap(b: Buf) -> Option<Vec<Self>> {
                match b {
                    Buf::$this(v) => Some(v),
                    Buf::$other(_) => None,
                }
            }
            fn view(b: &Buf) -> &[Self] {
                match b {
                    Buf::$this(v) => v,
                    Buf::$other(_) => &[],
                }
            }
        }
    };
}

pooled!(i32, I32, F32);
pooled!(f32, F32, I32);

/// The base object of a pooled numpy array: owns the memory, and hands it back to its pool
/// (if the pool still exists and the slot is free) when numpy drops it.
#[pyclass(module = "sparsecore_prep._native", frozen)]
pub struct PooledBuffer {
    buf: Option<Buf>,
    home: Weak<Mutex<Slots>>,
    stack: usize,
    role: usize,
}

impl PooledBuffer {
    fn slice<T: Pooled>(&self) -> &[T] {
        self.buf.as_ref().map_or(&[], T::view)
    }
}

impl Drop for PooledBuffer {
    fn drop(&mut self) {
        let (Some(buf), Some(home)) = (self.buf.take(), self.home.upgrade()) else {
            return;
        };
        let Ok(mut slots) = home.lock() else { return };
        if let Some(slot) = slots.get_mut(self.stack).and_then(|s| s.get_mut(self.role)) {
            if slot.is_none() {
                *slot = Some(buf);
            }
        }
    }
}
