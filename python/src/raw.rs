//! Slices over the memory of Python arrays: the package's only unsafe code.
//!
//! # Invariants
//!
//! An [`Array`] is made only by [`Array::of`] from a `numpy.ndarray` (that type exactly: a
//! subclass, or any other object, may describe memory it does not own in its
//! `__array_interface__`), and only used while the caller holds a reference to that object
//! (every function of the module takes the array objects as arguments and keeps them for the
//! call):
//!
//! - **A1**: the interface's `data` address points to the array's elements, `len` of them of
//!   `dtype` (the product of `shape`), contiguous (`strides` is `None`), as numpy computes it
//!   for its own live array; a reference held keeps the memory from being freed or resized
//!   (numpy refuses to resize an array that others reference).
//! - **A2**: outputs are arrays whose interface says writable (`data[1]` false); no other
//!   thread writes the arrays during a call (the same contract numpy's own GIL-releasing
//!   functions have). Overlap between one call's outputs is checked ([`disjoint`]).
//!
//! Alignment to the element size and `len * size <= isize::MAX` are checked in [`Array::of`].

use codec_core::{Dtype, TensorMut, TensorRef};
use half::{bf16, f16};
use kvc_bind::Error;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;

/// An array's memory as described by its `__array_interface__`, checked (A1).
#[derive(Clone, Copy, Debug)]
pub struct Array {
    addr: usize,
    /// Elements.
    pub len: usize,
    /// Element type (`uint16` arrays are bf16).
    pub dtype: ElemType,
    /// Whether the array may be written.
    pub writable: bool,
}

/// The element types an array may hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ElemType {
    /// A KV dtype (numpy `float16`, `float32`, or `uint16` holding bf16 bits).
    Kv(Dtype),
    /// `uint16` as integers (PQ codes).
    U16,
}

impl Array {
    /// Reads `obj.__array_interface__`: a `numpy.ndarray` (not a subclass: `numpy.asarray`
    /// views one as an ndarray without copying), contiguous, aligned, little-endian, of f16,
    /// f32 or u16 (`u16` means bf16 when `u16_is_bf16`).
    pub fn of(obj: &Bound<'_, PyAny>, what: &str, u16_is_bf16: bool) -> Result<Array, Error> {
        let bad = |why: &str| Error::argument(format!("{what}: {why}"));
        static NDARRAY: PyOnceLock<Py<PyType>> = PyOnceLock::new();
        let ndarray = NDARRAY
            .import(obj.py(), "numpy", "ndarray")
            .map_err(|_| bad("numpy cannot be imported"))?;
        if !obj.is_exact_instance(ndarray) {
            let ty = obj
                .get_type()
                .name()
                .map_or_else(|_| "?".into(), |n| n.to_string());
            return Err(bad(&format!(
                "a {ty}, not a numpy.ndarray (numpy.asarray makes one)"
            )));
        }
        let ai = obj
            .getattr("__array_interface__")
            .map_err(|_| bad("not an array (no __array_interface__)"))?;
        let get = |k: &str| {
            ai.get_item(k)
                .map_err(|_| bad("malformed __array_interface__"))
        };
        let (addr, readonly): (usize, bool) = get("data")?
            .extract()
            .map_err(|_| bad("malformed __array_interface__ data"))?;
        let typestr: String = get("typestr")?
            .extract()
            .map_err(|_| bad("malformed __array_interface__ typestr"))?;
        let shape: Vec<usize> = get("shape")?
            .extract()
            .map_err(|_| bad("malformed __array_interface__ shape"))?;
        let strides = ai.get_item("strides").ok().filter(|s| !s.is_none());
        if strides.is_some() {
            return Err(bad("not C-contiguous (use numpy.ascontiguousarray)"));
        }
        let dtype = match (typestr.as_str(), u16_is_bf16) {
            ("<f2", _) => ElemType::Kv(Dtype::F16),
            ("<f4", _) => ElemType::Kv(Dtype::F32),
            ("<u2", true) => ElemType::Kv(Dtype::Bf16),
            ("<u2", false) => ElemType::U16,
            (t, _) => {
                return Err(bad(&format!(
                    "dtype {t} is not float16, float32 or uint16 (bf16 bits)"
                )))
            }
        };
        let size = match dtype {
            ElemType::Kv(d) => d.size_bytes(),
            ElemType::U16 => 2,
        };
        let len = shape
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .filter(|n| {
                n.checked_mul(size)
                    .is_some_and(|b| b <= isize::MAX as usize)
            })
            .ok_or_else(|| bad("size overflows"))?;
        if len > 0 && (addr == 0 || !addr.is_multiple_of(size)) {
            return Err(bad("data is null or not aligned to its element size"));
        }
        Ok(Array {
            addr,
            len,
            dtype,
            writable: !readonly,
        })
    }

    /// The array as `n` equal consecutive parts (a stacked `[L, ...]` array's layers), or `None`
    /// if its elements do not split evenly into `n` (or `n` is 0). Each part lies inside the
    /// array's memory, so A1 and A2 hold for it as for the array.
    pub fn split(&self, n: usize) -> Option<Vec<Array>> {
        if n == 0 || !self.len.is_multiple_of(n) {
            return None;
        }
        let per = self.len / n;
        let bytes = per * self.size();
        let part = |i: usize| Array {
            addr: self.addr + i * bytes,
            len: per,
            ..*self
        };
        Some((0..n).map(part).collect())
    }

    fn size(&self) -> usize {
        match self.dtype {
            ElemType::Kv(d) => d.size_bytes(),
            ElemType::U16 => 2,
        }
    }

    /// The elements, read-only. The caller holds the array object for as long as the slice
    /// lives (A1).
    pub fn tensor<'a>(&self) -> TensorRef<'a> {
        let p = self.addr as *const u8;
        let n = self.len;
        if n == 0 {
            return match self.dtype {
                ElemType::Kv(Dtype::F16) => TensorRef::F16(&[]),
                ElemType::Kv(Dtype::Bf16) | ElemType::U16 => TensorRef::Bf16(&[]),
                ElemType::Kv(Dtype::F32) => TensorRef::F32(&[]),
            };
        }
        // SAFETY: A1: `addr` holds `len` contiguous elements of the dtype, aligned (checked in
        // `of`), alive while the caller holds the object; f16/bf16 accept every bit pattern.
        unsafe {
            match self.dtype {
                ElemType::Kv(Dtype::F16) => {
                    TensorRef::F16(core::slice::from_raw_parts(p.cast::<f16>(), n))
                }
                ElemType::Kv(Dtype::Bf16) | ElemType::U16 => {
                    TensorRef::Bf16(core::slice::from_raw_parts(p.cast::<bf16>(), n))
                }
                ElemType::Kv(Dtype::F32) => {
                    TensorRef::F32(core::slice::from_raw_parts(p.cast::<f32>(), n))
                }
            }
        }
    }

    /// The elements as f32 (the array must hold float32).
    pub fn f32s<'a>(&self, what: &str) -> Result<&'a [f32], Error> {
        match self.tensor() {
            TensorRef::F32(s) => Ok(s),
            _ => Err(Error::argument(format!("{what}: must be float32"))),
        }
    }

    /// The elements as u16 integers (PQ codes).
    pub fn u16s<'a>(&self, what: &str) -> Result<&'a [u16], Error> {
        if self.dtype != ElemType::U16 {
            return Err(Error::argument(format!("{what}: must be uint16")));
        }
        if self.len == 0 {
            return Ok(&[]);
        }
        // SAFETY: A1, as in `tensor`; u16 accepts every bit pattern.
        Ok(unsafe { core::slice::from_raw_parts(self.addr as *const u16, self.len) })
    }
}

/// Checks that no two arrays' memory overlaps.
pub fn disjoint(arrays: &[Array]) -> Result<(), Error> {
    let mut r: Vec<(usize, usize)> = arrays
        .iter()
        .filter(|a| a.len > 0)
        .map(|a| (a.addr, a.len * a.size()))
        .collect();
    r.sort_unstable();
    if r.windows(2).any(|w| w[0].0 + w[0].1 > w[1].0) {
        return Err(Error::argument("output arrays overlap"));
    }
    Ok(())
}

/// Mutable tensors over output arrays: writable (A2), pairwise disjoint (checked here), so each
/// slice is the only reference to its memory for the call.
pub fn tensors_mut<'a>(arrays: &[Array]) -> Result<Vec<TensorMut<'a>>, Error> {
    if let Some(i) = arrays.iter().position(|a| !a.writable) {
        return Err(Error::argument(format!("output array {i} is read-only")));
    }
    disjoint(arrays)?;
    arrays
        .iter()
        .map(|a| {
            let p = a.addr as *mut u8;
            let n = a.len;
            if n == 0 {
                return Ok(match a.dtype {
                    ElemType::Kv(Dtype::F16) => TensorMut::F16(&mut []),
                    ElemType::Kv(Dtype::F32) => TensorMut::F32(&mut []),
                    _ => TensorMut::Bf16(&mut []),
                });
            }
            // SAFETY: A1 (live, contiguous, aligned, `len` elements) and A2 (writable, no other
            // writer during the call); disjoint from the call's other outputs (checked above).
            Ok(unsafe {
                match a.dtype {
                    ElemType::Kv(Dtype::F16) => {
                        TensorMut::F16(core::slice::from_raw_parts_mut(p.cast(), n))
                    }
                    ElemType::Kv(Dtype::Bf16) => {
                        TensorMut::Bf16(core::slice::from_raw_parts_mut(p.cast(), n))
                    }
                    ElemType::Kv(Dtype::F32) => {
                        TensorMut::F32(core::slice::from_raw_parts_mut(p.cast(), n))
                    }
                    ElemType::U16 => {
                        return Err(Error::argument("uint16 codes are not a KV output"))
                    }
                }
            })
        })
        .collect()
}
