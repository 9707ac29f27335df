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
    data: Runs,
    /// How decode matvecs treat the input ([`Activations::F32`] unless set).
    act: Activations,
}

thread_local! {
    /// The block sums of an f32 matvec's input (reused: no allocation per call).
    static SUMS: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// The 8-bit input of a [`Activations::Q8`] matvec (reused: no allocation per call).
    static Q8_INPUT: RefCell<Q8Vec> = RefCell::new(Q8Vec::default());
    /// The 8-bit inputs of a batched [`Activations::Q8`] product, laid out
    /// for the AVX-512 VNNI kernels (reused).
    #[cfg(x86_kernels)]
    static PAIRS: RefCell<crate::q8_x86_512::Pairs> = RefCell::new(Default::default());
}

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
            data: Runs::one(dtype.row_bytes(cols), rows, data),
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
    /// instead of several in decode) without copying them: the stack reads
    /// each part where it lies (one run of rows where the parts lie back to
    /// back in one file, as `ffn_gate` and `ffn_up` often do).
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
        let parts: Vec<&Runs> = ms.iter().map(|m| &m.data).collect();
        Ok(Self {
            dtype: first.dtype,
            rows: ms.iter().map(|m| m.rows).sum(),
            cols: first.cols,
            data: Runs::concat(first.dtype.row_bytes(first.cols), &parts),
            act: first.act,
        })
    }

    /// Heap bytes holding the weights of `ms` beyond the memory-mapped
    /// file: each distinct buffer once (matrices, their stacks and views of
    /// one buffer count once; a model read into memory counts whole).
    pub fn heap_bytes<'a>(ms: impl IntoIterator<Item = &'a QMatrix>) -> usize {
        let mut seen = std::collections::BTreeMap::new();
        for (at, n) in ms.into_iter().flat_map(|m| m.data.heap_buffers()) {
            seen.insert(at, n);
        }
        seen.values().sum()
    }

    /// Storage types of `ms` with their counts, for reports (e.g. `Q4_1
    /// x210, Q8_0 x1`).
    pub fn type_counts<'a>(ms: impl IntoIterator<Item = &'a QMatrix>) -> String {
        let mut t = std::collections::BTreeMap::<String, usize>::new();
        for m in ms {
            *t.entry(format!("{:?}", m.dtype)).or_default() += 1;
        }
        let counts: Vec<String> = t.iter().map(|(k, v)| format!("{k} x{v}")).collect();
        counts.join(", ")
    }

    /// Rows `r0 .. r0 + n` as a matrix sharing these bytes (no copy), such
    /// as a part of a [`Self::concat_rows`] stack. Panics past the last row.
    pub fn row_view(&self, r0: usize, n: usize) -> Self {
        assert!(
            r0 + n <= self.rows,
            "row_view: rows {r0} + {n} past {}",
            self.rows
        );
        Self {
            dtype: self.dtype,
            rows: n,
            cols: self.cols,
            data: self.data.slice(r0, n),
            act: self.act,
        }
    }

    /// An f32 matrix from values.
    pub fn from_f32(rows: usize, cols: usize, v: &[f32]) -> Self {
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        Self {
            dtype: GgmlType::F32,
            rows,
            cols,
            data: Runs::one(4 * cols, rows, Blob::owned(bytes)),
            act: Activations::F32,
        }
    }

    /// Sets how decode matvecs treat the input. [`Activations::Q8`] applies
    /// to `Q4_1`, `Q8_0`, `Q5_0`, `Q4_K` and `Q6_K` weights (other types
    /// keep the exact f32 dot).
    pub fn set_activations(&mut self, act: Activations) {
        self.act = act;
    }

    /// How decode matvecs treat the input.
    pub fn activations(&self) -> Activations {
        self.act
    }

    /// Bytes of the weights, in their storage format.
    pub fn byte_len(&self) -> usize {
        self.data.byte_len()
    }

    /// The weights' bytes as held, in row order: one slice per run of
    /// rows (a stack of parts that lie apart in the file has several).
    pub fn byte_runs(&self) -> impl Iterator<Item = &[u8]> {
        self.data.slices()
    }

    fn row(&self, r: usize) -> &[u8] {
        self.data.row(r)
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
        if self.act == Activations::Q8 && crate::q8::applies(self.dtype) {
            // A nested call on this thread (rayon work-stealing) gets its own buffer.
            return Q8_INPUT.with(|cell| match cell.try_borrow_mut() {
                Ok(mut a) => self.matvec_q8(x, &mut a, y),
                Err(_) => self.matvec_q8(x, &mut Q8Vec::default(), y),
            });
        }
        // The input's block sums in a reused buffer (none allocated per
        // call); a nested call on this thread gets its own.
        SUMS.with(|cell| match cell.try_borrow_mut() {
            Ok(mut s) => self.matvec_f32(x, &mut s, y),
            Err(_) => self.matvec_f32(x, &mut Vec::new(), y),
        })
    }

    /// [`Self::matvec`] with f32 activations, `xs` a buffer for the
    /// input's block sums.
    fn matvec_f32(&self, x: &[f32], xs: &mut Vec<f32>, y: &mut [f32]) {
        xs.clear();
        if crate::blocks::needs_block_sums(self.dtype) {
            block_sums(x, xs);
        }
        let xs: &[f32] = xs;
        let (ty, rb) = (self.dtype, self.dtype.row_bytes(self.cols));
        #[cfg(x86_kernels)]
        if (matches!(ty, GgmlType::Q4_1 | GgmlType::Q8_0) || crate::kquant_x86::handles(ty))
            && x.len() == self.cols
        {
            // `Q4_1` / `Q8_0` or a k-quant, on 512-bit registers where the
            // CPU has AVX-512F (and the cap allows it), else on 256-bit ones.
            let blocks = matches!(ty, GgmlType::Q4_1 | GgmlType::Q8_0);
            let wide = match blocks {
                true => crate::blocks_x86_512::available(ty),
                false => crate::kquant_x86_512::available(ty),
            };
            // SAFETY: AVX-512F where `wide` (checked), AVX2/FMA/F16C (cfg);
            // a task's rows are whole, `xs` holds the block sums.
            let f = |w: &[u8], o: &mut [f32]| unsafe {
                match (blocks, wide) {
                    (true, true) => crate::blocks_x86_512::matvec(ty, w, x, xs, o),
                    (true, false) => crate::blocks_x86::matvec(ty, w, x, xs, o),
                    (false, true) => crate::kquant_x86_512::matvec(ty, w, x, xs, o),
                    (false, false) => crate::kquant_x86::matvec(ty, w, x, xs, o),
                }
            };
            return self.tasks_into(y, f);
        }
        self.tasks_into(y, |w, o| {
            let rows = w.chunks_exact(rb).zip(o);
            rows.for_each(|(row, o)| *o = dot_row(ty, row, x, xs));
        });
    }

    /// [`Self::matvec`] with the input rounded to 8 bits per block of 32.
    fn matvec_q8(&self, x: &[f32], a: &mut Q8Vec, y: &mut [f32]) {
        a.quantize(x);
        let (a, ty) = (&*a, self.dtype);
        #[cfg(x86_kernels)]
        if crate::q8_x86_512::available() && 32 * a.d.len() == self.cols {
            // SAFETY: AVX-512 VNNI and the rest are available (checked); a
            // task's rows are whole rows of the input's block count.
            let f = |w: &[u8], o: &mut [f32]| unsafe { crate::q8_x86_512::matvec(ty, w, a, o) };
            return self.tasks_into(y, f);
        }
        self.tasks_into(y, |w, o| crate::q8_avx2::dot_rows(ty, w, a, o));
    }

    /// Runs `f(rows' bytes, their outputs)` over consecutive rows, split
    /// between rayon tasks of [`Self::chunk_rows`] rows (`y` has one output
    /// per row), a task's rows cut where runs of rows meet.
    fn tasks_into(&self, y: &mut [f32], f: impl Fn(&[u8], &mut [f32]) + Sync) {
        let c = self.chunk_rows();
        y.par_chunks_mut(c).enumerate().for_each(|(i, o)| {
            let r0 = i * c;
            self.data.pieces(r0, r0 + o.len(), |a, b, w| {
                f(w, &mut o[a - r0..b - r0]);
            });
        });
    }

    /// `y[i] = W x[i]` for the rows `sel` of `x` (`[.][cols]`) into the same
    /// rows of `y` (`[.][rows]`): several decode inputs (one per sequence of a
    /// batch) against one read of the weights. Each output is bitwise equal
    /// to [`Self::matvec`] of that input alone: the arithmetic per input is
    /// the same, only the weight blocks are unpacked once for a group of
    /// inputs (`Q4_1`, `Q8_0` with AVX2) or re-read from L1 (other types).
    pub fn matvec_rows(&self, x: &[f32], y: &mut [f32], sel: &[usize]) {
        let (rows, cols) = (self.rows, self.cols);
        // The products below write through raw pointers: every input and
        // output row must be whole.
        assert!(
            sel.iter()
                .all(|&i| (i + 1) * cols <= x.len() && (i + 1) * rows <= y.len()),
            "matvec_rows: a selected row is past the end of x or y"
        );
        match sel {
            [] => return,
            &[i] => {
                return self.matvec(
                    &x[i * cols..(i + 1) * cols],
                    &mut y[i * rows..(i + 1) * rows],
                );
            }
            _ => {}
        }
        if self.act == Activations::Q8 && crate::q8::applies(self.dtype) {
            return self.matvec_rows_q8(x, y, sel);
        }
        #[cfg(x86_kernels)]
        if crate::blocks_x86_512::available(self.dtype) {
            return self.matvec_rows_512(x, y, sel);
        }
        self.matvec_rows_dots(x, y, sel);
    }

    /// [`Self::matvec_rows`] a weight row at a time against the inputs
    /// ([`dots`]): `Q4_1` and `Q8_0` on AVX2 (as on a CPU without AVX-512;
    /// a test runs it on any x86 CPU), the k-quants on their own kernels,
    /// other types by the portable dots.
    fn matvec_rows_dots(&self, x: &[f32], y: &mut [f32], sel: &[usize]) {
        let cols = self.cols;
        let nb = cols / 32;
        let mut sums = Vec::new();
        if crate::blocks::needs_block_sums(self.dtype) {
            let mut s = Vec::new();
            for &i in sel {
                block_sums(&x[i * cols..(i + 1) * cols], &mut s);
                sums.extend_from_slice(&s);
            }
        }
        let per = sums.len() / sel.len();
        self.rows_into(y, sel, |w, out| {
            dots(self.dtype, w, nb, cols, x, sel, &sums, per, out)
        });
    }

    /// Runs `f(row r's bytes, out)` for every weight row `r`, rows split
    /// between rayon tasks, where `out(j, v)` stores `v` as output `r` of
    /// input `sel[j]` (`y[sel[j] * rows + r]`). The caller has checked that
    /// every `sel[j]` indexes a whole row of `y`.
    fn rows_into(
        &self,
        y: &mut [f32],
        sel: &[usize],
        f: impl Fn(&[u8], &mut dyn FnMut(usize, f32)) + Sync,
    ) {
        self.row_groups_into(y, sel, 1, |w, _, out| {
            f(w, &mut |j, v| out(0, j, std::slice::from_ref(&v)))
        });
    }

    /// [`Self::rows_into`] for groups of up to `g` consecutive rows:
    /// `f(rows' bytes, k rows, out)` for each group of `k <= g` rows starting
    /// at row `r`, where `out(i, j, v)` stores `v[t]` as output `r + i` of
    /// input `sel[j + t]` (a row's results for a run of inputs in one call).
    /// A group never spans two rayon tasks, nor two runs of rows.
    pub(super) fn row_groups_into(
        &self,
        y: &mut [f32],
        sel: &[usize],
        g: usize,
        f: impl Fn(&[u8], usize, &mut dyn FnMut(usize, usize, &[f32])) + Sync,
    ) {
        let (rows, rb) = (self.rows, self.dtype.row_bytes(self.cols));
        let c = self.chunk_rows();
        let yp = SendPtr(y.as_mut_ptr());
        let yp = &yp;
        (0..rows.div_ceil(c)).into_par_iter().for_each(|t| {
            let end = ((t + 1) * c).min(rows);
            self.data.pieces(t * c, end, |a, b, w| {
                for r in (a..b).step_by(g.max(1)) {
                    let k = g.max(1).min(b - r);
                    let mut out = |i: usize, j: usize, v: &[f32]| {
                        // A row outside the group could be another task's.
                        assert!(i < k, "row {i} of a group of {k}");
                        for (&s, &v) in sel[j..j + v.len()].iter().zip(v) {
                            // SAFETY: output (s, r + i) is written by this
                            // task only (rows are split between tasks, and
                            // `i < k` keeps it in this group); in bounds (the
                            // caller checked every selected row).
                            unsafe { *yp.0.add(s * rows + r + i) = v }
                        }
                    };
                    f(&w[(r - a) * rb..(r - a + k) * rb], k, &mut out);
                }
            });
        });
    }

    /// [`Self::matvec_rows`] with each input rounded to 8 bits per block of 32
    /// (as [`Self::matvec`] does under [`Activations::Q8`]).
    fn matvec_rows_q8(&self, x: &[f32], y: &mut [f32], sel: &[usize]) {
        let cols = self.cols;
        #[cfg(x86_kernels)]
        if crate::q8_x86_512::available() {
            // A nested call on this thread (rayon work-stealing) gets its own buffer.
            return PAIRS.with(|cell| match cell.try_borrow_mut() {
                Ok(mut p) => self.matvec_rows_pairs(x, y, sel, &mut p),
                Err(_) => self.matvec_rows_pairs(x, y, sel, &mut Default::default()),
            });
        }
        let qs: Vec<Q8Vec> = sel
            .iter()
            .map(|&i| {
                let mut a = Q8Vec::default();
                a.quantize(&x[i * cols..(i + 1) * cols]);
                a
            })
            .collect();
        let refs: Vec<&Q8Vec> = qs.iter().collect();
        self.rows_into(y, sel, |w, out| {
            // Each input's result is that of its dot alone: groups of 32
            // inputs give the same values without a buffer per row.
            for (g, part) in refs.chunks(32).enumerate() {
                let mut o = [0.0f32; 32];
                crate::q8::dot_many(w, self.dtype, part, &mut o[..part.len()]);
                o[..part.len()]
                    .iter()
                    .enumerate()
                    .for_each(|(j, &v)| out(32 * g + j, v));
            }
        });
    }

    /// `Y = X W^T` for consecutive segments of rows of `X` (one per sequence
    /// of a batch, lengths `segs`): each segment is computed the way
    /// [`Self::matmul`] computes it alone (bitwise equal), segments of at most
    /// two rows together through [`Self::matvec_rows`].
    pub fn matmul_segments(&self, x: &[f32], segs: &Segments, y: &mut [f32]) {
        self.matvec_rows(x, y, &segs.small);
        if !segs.big.is_empty() {
            self.matmul_parts(x, &segs.big, y);
        }
    }
}

#[path = "matrix_prefill.rs"]
mod prefill;
#[path = "matrix_runs.rs"]
mod runs;
pub use prefill::Segments;
use runs::Runs;

/// One `Q4_1` weight row against inputs `j .. j + N` (each block unpacked
/// once for the group), handed to `out` as [`dots`] does.
///
/// # Safety
/// AVX2/FMA/F16C (cfg); `w` holds `nb` blocks, each input `32 nb` values
/// and `nb` sums.
#[cfg(x86_kernels)]
unsafe fn q4_1_group<const N: usize>(
    j: usize,
    w: &[u8],
    nb: usize,
    xrow: impl Fn(usize) -> *const f32,
    srow: impl Fn(usize) -> *const f32,
    out: &mut impl FnMut(usize, f32),
) {
    let mut o = [0.0; N];
    let xs = std::array::from_fn(|k| xrow(j + k));
    let ss = std::array::from_fn(|k| srow(j + k));
    // SAFETY: as the caller guarantees.
    unsafe { crate::blocks_x86::dot_q4_1_n::<N>(w, nb, xs, ss, &mut o) };
    o.iter().enumerate().for_each(|(k, &v)| out(j + k, v));
}

/// Dot products of one weight row `w` with the inputs `sel` of `x`, each
/// result handed to `out(j, value)`; bitwise equal to [`dot_row`] per input.
#[allow(clippy::too_many_arguments)]
#[inline]
fn dots(
    ty: GgmlType,
    w: &[u8],
    nb: usize,
    cols: usize,
    x: &[f32],
    sel: &[usize],
    sums: &[f32],
    per: usize,
    mut out: impl FnMut(usize, f32),
) {
    let xrow = |j: usize| &x[sel[j] * cols..(sel[j] + 1) * cols];
    let srow = |j: usize| &sums[j * per..(j + 1) * per];
    #[cfg(x86_kernels)]
    {
        use crate::blocks_x86::dot_q8_0_n;
        match ty {
            GgmlType::Q4_1 if w.len() >= nb * 20 && per >= nb && cols == 32 * nb => {
                // Groups of four inputs, the last one of what is left.
                let (xp, sp) = (|j| xrow(j).as_ptr(), |j| srow(j).as_ptr());
                for j in (0..sel.len()).step_by(4) {
                    // SAFETY: `w` holds nb blocks, each input `32 nb` values
                    // and `nb` sums (checked above).
                    unsafe {
                        match sel.len() - j {
                            1 => q4_1_group::<1>(j, w, nb, xp, sp, &mut out),
                            2 => q4_1_group::<2>(j, w, nb, xp, sp, &mut out),
                            3 => q4_1_group::<3>(j, w, nb, xp, sp, &mut out),
                            _ => q4_1_group::<4>(j, w, nb, xp, sp, &mut out),
                        }
                    }
                }
                return;
            }
            GgmlType::Q8_0 if w.len() >= nb * 34 && cols == 32 * nb => {
                let mut j = 0;
                while j < sel.len() {
                    // SAFETY: as above, blocks of 34 bytes.
                    unsafe {
                        if sel.len() - j >= 2 {
                            let mut o = [0.0; 2];
                            let xs = [xrow(j).as_ptr(), xrow(j + 1).as_ptr()];
                            dot_q8_0_n::<2>(w, nb, xs, &mut o);
                            out(j, o[0]);
                            out(j + 1, o[1]);
                            j += 2;
                        } else {
                            let mut o = [0.0; 1];
                            dot_q8_0_n::<1>(w, nb, [xrow(j).as_ptr()], &mut o);
                            out(j, o[0]);
                            j += 1;
                        }
                    }
                }
                return;
            }
            _ if crate::kquant_x86::handles(ty) => {
                let wide = crate::kquant_x86_512::available(ty);
                let kb = cols / ty.block_size();
                let whole = kb > 0
                    && cols == kb * ty.block_size()
                    && w.len() >= kb * ty.block_bytes()
                    && (ty != GgmlType::Q4_K || per >= 8 * kb);
                if whole {
                    // Tiles of up to eight inputs, their pointers on the stack.
                    for j0 in (0..sel.len()).step_by(8) {
                        let n = (sel.len() - j0).min(8);
                        let null = std::ptr::null();
                        let xs: [*const f32; 8] = std::array::from_fn(|t| match t < n {
                            true => xrow(j0 + t).as_ptr(),
                            false => null,
                        });
                        let ss: [*const f32; 8] = std::array::from_fn(|t| match t < n && per > 0 {
                            true => srow(j0 + t).as_ptr(),
                            false => null,
                        });
                        let mut o = [0.0f32; 8];
                        let ns = if per == 0 { 0 } else { n };
                        let (xs, ss, o) = (&xs[..n], &ss[..ns], &mut o[..n]);
                        // SAFETY: a kernel for `ty` (AVX-512F where detected,
                        // else AVX2, enabled by cfg); `w` holds `kb` blocks,
                        // each input `cols` values and (for `Q4_K`) `per >= 8
                        // kb` sums (checked above).
                        unsafe {
                            match wide {
                                true => crate::kquant_x86_512::row_dots(ty, w, kb, xs, ss, o),
                                false => crate::kquant_x86::row_dots(ty, w, kb, xs, ss, o),
                            }
                        };
                        o[..n].iter().enumerate().for_each(|(t, &v)| out(j0 + t, v));
                    }
                    return;
                }
            }
            _ => {}
        }
    }
    let _ = nb;
    for j in 0..sel.len() {
        let s: &[f32] = if per == 0 { &[] } else { srow(j) };
        out(j, dot_row(ty, w, xrow(j), s));
    }
}

#[cfg(x86_kernels)]
#[path = "matrix_x86.rs"]
mod x86;

#[cfg(test)]
#[path = "matrix_tests.rs"]
mod batch_tests;
