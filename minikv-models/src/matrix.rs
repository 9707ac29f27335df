//! Weight matrices kept in their file format (quantized blocks stay compact:
//! decode reads ~4.5 bits per weight instead of 32).

use crate::blocks::{GgmlType, block_sums, dequantize_row, dot_row};
use crate::gguf::Blob;
use crate::q8::{Activations, Q8Vec};
use minikv_core::{Error, Result};
use rayon::prelude::*;
use std::cell::RefCell;

/// A `rows x cols` weight matrix (`y = W x`), row-major in blocks.
#[derive(Debug, Clone)]
pub struct QMatrix {
    /// Element type.
    pub dtype: GgmlType,
    /// Output features.
    pub rows: usize,
    /// Input features.
    pub cols: usize,
    data: Blob,
    /// How decode matvecs treat the input ([`Activations::F32`] unless set).
    act: Activations,
}

thread_local! {
    static TILE: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// The 8-bit input of a [`Activations::Q8`] matvec (reused: no allocation per call).
    static Q8_INPUT: RefCell<Q8Vec> = RefCell::new(Q8Vec::default());
}

/// Output rows dequantized per prefill tile.
const TILE_ROWS: usize = 64;

struct SendPtr(*mut f32);
// SAFETY: used only to write disjoint column blocks of one output matrix from
// rayon tasks (see `matmul`).
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

impl QMatrix {
    /// Wraps bytes; checks their size.
    pub fn new(name: &str, dtype: GgmlType, rows: usize, cols: usize, data: Blob) -> Result<Self> {
        if !cols.is_multiple_of(dtype.block_size()) {
            return Err(Error::Format(format!(
                "{name}: {cols} columns are not a multiple of the {dtype:?} block"
            )));
        }
        let want = rows * dtype.row_bytes(cols);
        if data.bytes().len() != want {
            return Err(Error::Format(format!(
                "{name}: expected {want} bytes for {rows}x{cols} {dtype:?}, got {}",
                data.bytes().len()
            )));
        }
        if let Some(i) = dtype.first_non_finite(data.bytes()) {
            let per = if dtype.block_size() == 1 {
                "element"
            } else {
                "block"
            };
            return Err(Error::Format(format!(
                "{name}: {dtype:?} {per} {i} is NaN or infinite"
            )));
        }
        Ok(Self {
            dtype,
            rows,
            cols,
            data,
            act: Activations::F32,
        })
    }

    /// The GGUF tensor `name` as a `rows x cols` matrix (GGUF dims `[cols, rows]`).
    pub fn from_gguf(g: &crate::gguf::Gguf, name: &str, rows: usize, cols: usize) -> Result<Self> {
        let t = g.tensor(name)?;
        if t.dims.len() != 2 || t.dims[0] != cols || t.dims[1] != rows {
            return Err(Error::Format(format!(
                "tensor `{name}` has shape {:?}, expected [{cols}, {rows}]",
                t.dims
            )));
        }
        Self::new(name, t.dtype, rows, cols, g.blob(t))
    }

    /// Stacks matrices with the same type and columns (one parallel region
    /// instead of several in decode).
    pub fn concat_rows(ms: &[&QMatrix]) -> Result<Self> {
        let first = ms
            .first()
            .ok_or_else(|| Error::Format("concat of no matrices".into()))?;
        if ms
            .iter()
            .any(|m| m.dtype != first.dtype || m.cols != first.cols)
        {
            return Err(Error::Format(
                "concat of matrices with different types or widths".into(),
            ));
        }
        let mut bytes = Vec::with_capacity(ms.iter().map(|m| m.bytes().len()).sum());
        for m in ms {
            bytes.extend_from_slice(m.bytes());
        }
        Ok(Self {
            dtype: first.dtype,
            rows: ms.iter().map(|m| m.rows).sum(),
            cols: first.cols,
            data: Blob::owned(bytes),
            act: first.act,
        })
    }

    /// An f32 matrix from values.
    pub fn from_f32(rows: usize, cols: usize, v: &[f32]) -> Self {
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        Self {
            dtype: GgmlType::F32,
            rows,
            cols,
            data: Blob::owned(bytes),
            act: Activations::F32,
        }
    }

    /// Sets how decode matvecs treat the input. [`Activations::Q8`] applies
    /// to `Q4_1` and `Q8_0` weights (other types keep the exact f32 dot).
    pub fn set_activations(&mut self, act: Activations) {
        self.act = act;
    }

    /// How decode matvecs treat the input.
    pub fn activations(&self) -> Activations {
        self.act
    }

    /// Bytes of the weights.
    pub fn bytes(&self) -> &[u8] {
        self.data.bytes()
    }

    fn row(&self, r: usize) -> &[u8] {
        let rb = self.dtype.row_bytes(self.cols);
        &self.bytes()[r * rb..(r + 1) * rb]
    }

    /// Rows per decode task: two tasks per thread (few, large tasks: decode
    /// matvecs are microseconds long, so scheduling must stay cheap).
    fn chunk_rows(&self) -> usize {
        self.rows.div_ceil(2 * rayon::current_num_threads()).max(16)
    }

    /// Dequantizes row `r` into `out`.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        dequantize_row(self.dtype, self.row(r), out);
    }

    /// `y = W x` (decode), parallel over rows, f32 activations against the
    /// weights' own blocks (exact up to f32 rounding).
    pub fn matvec(&self, x: &[f32], y: &mut [f32]) {
        if self.act == Activations::Q8 && matches!(self.dtype, GgmlType::Q4_1 | GgmlType::Q8_0) {
            // A nested call on this thread (rayon work-stealing) gets its own buffer.
            return Q8_INPUT.with(|cell| match cell.try_borrow_mut() {
                Ok(mut a) => self.matvec_q8(x, &mut a, y),
                Err(_) => self.matvec_q8(x, &mut Q8Vec::default(), y),
            });
        }
        let mut xs = Vec::new();
        if crate::blocks::needs_block_sums(self.dtype) {
            block_sums(x, &mut xs);
        }
        let c = self.chunk_rows();
        y.par_chunks_mut(c).enumerate().for_each(|(i, yc)| {
            for (j, o) in yc.iter_mut().enumerate() {
                *o = dot_row(self.dtype, self.row(i * c + j), x, &xs);
            }
        });
    }

    /// [`Self::matvec`] with the input rounded to 8 bits per block of 32.
    fn matvec_q8(&self, x: &[f32], a: &mut Q8Vec, y: &mut [f32]) {
        a.quantize(x);
        let a = &*a;
        let c = self.chunk_rows();
        let dot = match self.dtype {
            GgmlType::Q4_1 => crate::q8::dot_q4_1,
            _ => crate::q8::dot_q8_0,
        };
        y.par_chunks_mut(c).enumerate().for_each(|(i, yc)| {
            for (j, o) in yc.iter_mut().enumerate() {
                *o = dot(self.row(i * c + j), a);
            }
        });
    }

    /// `Y = X W^T` for `n` rows of `X` (`[n][cols]` -> `[n][rows]`).
    pub fn matmul(&self, x: &[f32], n: usize, y: &mut [f32]) {
        debug_assert_eq!(x.len(), n * self.cols);
        debug_assert_eq!(y.len(), n * self.rows);
        if n <= 2 {
            for (xi, yi) in x.chunks_exact(self.cols).zip(y.chunks_exact_mut(self.rows)) {
                self.matvec(xi, yi);
            }
            return;
        }
        let (rows, cols) = (self.rows, self.cols);
        let yp = SendPtr(y.as_mut_ptr());
        let yp = &yp;
        (0..rows.div_ceil(TILE_ROWS))
            .into_par_iter()
            .for_each(|tile| {
                let r0 = tile * TILE_ROWS;
                let nr = TILE_ROWS.min(rows - r0);
                TILE.with(|t| {
                    let mut t = t.borrow_mut();
                    if t.len() < nr * cols {
                        t.resize(nr * cols, 0.0);
                    }
                    for r in 0..nr {
                        self.dequantize_row(r0 + r, &mut t[r * cols..(r + 1) * cols]);
                    }
                    // SAFETY: C = y[:, r0..r0+nr] (row stride `rows`) is written by this
                    // task only; A = x (n x cols), B = tile^T (cols x nr) are in bounds.
                    unsafe {
                        matrixmultiply::sgemm(
                            n,
                            cols,
                            nr,
                            1.0,
                            x.as_ptr(),
                            cols as isize,
                            1,
                            t.as_ptr(),
                            1,
                            cols as isize,
                            0.0,
                            yp.0.add(r0),
                            rows as isize,
                            1,
                        );
                    }
                });
            });
    }
}
