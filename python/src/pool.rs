//! Output arrays whose memory comes back to the drop-in call once numpy is done with it.
//!
//! Every call returns fresh numpy arrays (the caller may keep them), so without this each call
//! allocates its COO buffers anew: tens of megabytes on large batches, every page of which the
//! kernel then faults in and zeroes before the pipeline writes it. In a training loop the
//! previous batch's arrays are usually dead by the next call. Each array handed out here is a
//! view of a [`PooledBuffer`], and when numpy frees the last view, the buffer's `Vec` goes back
//! to its slot (stack, array) in the [`BufferPool`], where the next call picks it up: its pages
//! are mapped already, and the pipeline overwrites every slot (data or padding), so no memset
//! is needed either. A COO array carries its stack's tail extents (how far that call wrote
//! each segment; past them the tail holds zeros), and when a call's three COO arrays of a stack
//! come back together the next call fills their tails only up to there
//! ([`sparsecore_prep::StackOutput::restore_tail_extents`]), so that its cost and the pages it
//! touches follow the ids, not the buffer size; other mixes are filled in full. (A caller that
//! writes into a result's tail and then frees it would leave that write in a later result's
//! tail: python/README.md says to write into copies.) An array still alive simply leaves its
//! slot empty, and that call allocates, as before.
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

/// What the stack's tail extents were when a COO array left it (shared by its three arrays):
/// the slots at or past them hold the tail fill, unless the caller wrote there.
type Extents = Arc<[u32]>;

/// A returned buffer and, for a COO array, its extents.
type Returned = (Buf, Option<Extents>);

/// Returned buffers by `[stack][role]`.
type Slots = Vec<[Option<Returned>; ROLES]>;

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
            let coo = [
                put(&mut so.embedding_ids, eid),
                put(&mut so.sample_ids, sid),
                put(&mut so.gains, gains),
            ];
            match coo {
                // Nothing came back: the arrays in place are the stack's own.
                [None, None, None] => {}
                // The three arrays of one call, together again: the next batch fills their
                // tails only up to where that call wrote.
                [Some(Some(a)), Some(Some(b)), Some(Some(c))]
                    if Arc::ptr_eq(&a, &b) && Arc::ptr_eq(&a, &c) =>
                {
                    so.restore_tail_extents(&a)
                }
                _ => so.mark_written(),
            }
        }
    }

    /// A numpy array over `v`, whose memory returns to slot (`stack`, `role`) when numpy frees it.
    /// `extents`: a COO array's tail extents at hand-out (see [`Extents`]).
    pub fn array<'py, T: Pooled>(
        &self,
        py: Python<'py>,
        v: Vec<T>,
        stack: usize,
        role: usize,
        extents: Option<Extents>,
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
                extents,
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

/// Moves a returned buffer of the right type into `dst`, if `dst` is empty; returns the
/// buffer's extents if it moved one.
fn put<T: Pooled>(dst: &mut Vec<T>, slot: &mut Option<Returned>) -> Option<Option<Extents>> {
    if dst.capacity() != 0 {
        return None;
    }
    let (buf, extents) = slot.take()?;
    *dst = T::unwrap(buf)?;
    Some(extents)
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
    extents: Option<Extents>,
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
                *slot = Some((buf, self.extents.take()));
            }
        }
    }
}
