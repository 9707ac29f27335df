//! Prefill products (many rows of inputs against a weight matrix): tiles
//! of weight rows dequantized to f32, then multiplied by the inputs.
//!
//! Two routes with the same bits (every output is `matrixmultiply`'s sum,
//! whatever the shape of the product it is computed in:
//! [`minikv_core::gemm`]). Short chunks go through
//! [`minikv_core::gemm::gemm`] with the tile as its left operand, read in
//! place, against the inputs transposed once per call: `matrixmultiply`
//! would copy the whole tile into its panels for a few multiply-adds per
//! weight. Long ones go through `sgemm` (the `matrixmultiply` crate) per
//! part of the inputs, whose copies are then a small share. [`Segments`]
//! says which rows of a batch go which way.

use super::{QMatrix, SendPtr};
use rayon::prelude::*;
use std::cell::RefCell;

thread_local! {
    /// A task's dequantized tile of weight rows (reused).
    static TILE: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// A task's products of its tile, `[tile row][input]` (reused).
    static OUT: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Most input rows (all parts together) that go through
/// [`minikv_core::gemm::gemm`] instead of `sgemm`. Measured with `cargo
/// bench -p minikv-models --bench matvec -- matmul/` and `minikv bench
/// prefill` (docs/performance.md): up to 64 rows that route was faster for
/// the 576- and 1536-row matrices, at 128 the two could not be told apart,
/// at 512 it took 1.4-2.5 times as long as `sgemm` (whose blocking keeps a
/// tile's rows in cache across the inputs; the direct product reads the
/// whole tile again for every 64 inputs).
const DIRECT_MOST: usize = 64;

/// Most rows of a part (a sequence's prefill chunk) that take 8-bit
/// activations under [`crate::q8::Activations::Q8`]: those rows go through
/// [`QMatrix::matvec_rows`]'s 8-bit route (two inputs per register, each
/// row's result bitwise its single-input dot), longer parts keep the
/// exact f32 routes. The choice is per part, so a sequence's results never
/// depend on what else its batch holds. Measured with `minikv bench prefill --activations q8`
/// (docs/performance.md): 8 tokens 1.7-1.8x the f32 route's tokens/s, 32
/// tokens 1.04x (Gemma 3) and 1.17x (SmolLM2), 48 tokens 0.95x on Gemma 3,
/// 512 tokens 0.83x (the integer products take as many instructions per
/// multiply-add as `sgemm`'s, without its blocking).
pub(super) const Q8_MOST: usize = 32;

/// Most output rows dequantized per prefill tile.
const TILE_ROWS: usize = 512;

/// Output rows per prefill tile for a matrix of `rows` rows, `threads`
/// threads and parts of up to `n` input rows: as few tiles as keep every
/// thread busy (a multiple of the thread count), each at most `n` rows
/// (64 to [`TILE_ROWS`]). Each tile is one `sgemm` call per part, which
/// packs the part's inputs again: for chunks of 512 tokens, 64-row tiles
/// spent about a quarter of the multiply-adds' time on that packing. For
/// short chunks the tile's dequantization weighs more than that packing,
/// and a tile that stays in the core's cache until `sgemm` reads it back
/// pays: 64-row tiles there measured faster than 384.
fn tile_rows(rows: usize, threads: usize, n: usize) -> usize {
    let (threads, most) = (threads.max(1), n.clamp(64, TILE_ROWS));
    let tiles = (threads * rows.div_ceil(threads * most)).max(1);
    rows.div_ceil(tiles).max(1)
}

impl QMatrix {
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
        self.matmul_parts(x, &[(0, n)], y);
    }

    /// `Y = X W^T` for each part `(first row, rows)` of `X` (`rows >= 3`):
    /// every tile of `W` is dequantized once for all the parts (several
    /// sequences' prefill chunks in one batch unpack the weights once, not
    /// once each), then multiplied by them. Each output's sum runs over the
    /// same products in the same order whatever the tile's width, the other
    /// parts and the route, so each part's rows are bitwise what
    /// [`Self::matmul`] gives for that part alone (tested with parts whose
    /// tiles alone would be narrower, and each route against the other).
    pub(super) fn matmul_parts(&self, x: &[f32], parts: &[(usize, usize)], y: &mut [f32]) {
        let total: usize = parts.iter().map(|p| p.1).sum();
        if total == 0 {
            return;
        }
        if self.act == crate::q8::Activations::Q8
            && crate::q8::applies(self.dtype)
            && parts.iter().any(|p| p.1 <= Q8_MOST)
        {
            // Each part by its own length, whatever else the batch holds:
            // a sequence's results do not depend on its neighbours.
            let short = |p: &&(usize, usize)| p.1 <= Q8_MOST;
            let sel: Vec<usize> = (parts.iter().filter(short))
                .flat_map(|&(a, n)| a..a + n)
                .collect();
            self.check_parts(x, parts, y);
            self.matvec_rows_q8(x, y, &sel);
            let long: Vec<(usize, usize)> =
                parts.iter().filter(|p| p.1 > Q8_MOST).copied().collect();
            return self.matmul_parts(x, &long, y);
        }
        if total <= DIRECT_MOST {
            self.matmul_direct(x, parts, y);
        } else {
            self.matmul_packed(x, parts, y);
        }
    }

    /// Every part has at least 3 rows and lies inside `x` and `y` (what
    /// the routes' raw writes rely on).
    fn check_parts(&self, x: &[f32], parts: &[(usize, usize)], y: &[f32]) {
        for &(a, n) in parts {
            assert!(n >= 3 && (a + n) * self.cols <= x.len() && (a + n) * self.rows <= y.len());
        }
    }

    /// [`Self::matmul_parts`] through `sgemm` per part and tile.
    pub(super) fn matmul_packed(&self, x: &[f32], parts: &[(usize, usize)], y: &mut [f32]) {
        let (rows, cols) = (self.rows, self.cols);
        self.check_parts(x, parts, y);
        let yp = SendPtr(y.as_mut_ptr());
        let yp = &yp;
        let most = parts.iter().map(|p| p.1).max().unwrap_or(0);
        let tr = tile_rows(rows, rayon::current_num_threads(), most);
        (0..rows.div_ceil(tr)).into_par_iter().for_each(|tile| {
            let r0 = tile * tr;
            let nr = tr.min(rows - r0);
            TILE.with(|t| {
                let mut t = t.borrow_mut();
                if t.len() < nr * cols {
                    t.resize(nr * cols, 0.0);
                }
                for r in 0..nr {
                    self.dequantize_row(r0 + r, &mut t[r * cols..(r + 1) * cols]);
                }
                for &(a, n) in parts {
                    // SAFETY: C = y[a.., r0..r0+nr] (row stride `rows`) is written by
                    // this task only; A = x[a..a+n] (n x cols) and B = tile^T
                    // (cols x nr) are in bounds (checked above).
                    unsafe {
                        matrixmultiply::sgemm(
                            n,
                            cols,
                            nr,
                            1.0,
                            x.as_ptr().add(a * cols),
                            cols as isize,
                            1,
                            t.as_ptr(),
                            1,
                            cols as isize,
                            0.0,
                            yp.0.add(a * rows + r0),
                            rows as isize,
                            1,
                        );
                    }
                }
            });
        });
    }

    /// [`Self::matmul_parts`] through [`minikv_core::gemm::gemm`]: the
    /// parts' input rows transposed once (`[column][input]`), then each
    /// tile of weight rows, dequantized, times all of them in one product
    /// (`[tile row][input]`), written out to each input's row of `y`.
    pub(super) fn matmul_direct(&self, x: &[f32], parts: &[(usize, usize)], y: &mut [f32]) {
        let (rows, cols) = (self.rows, self.cols);
        self.check_parts(x, parts, y);
        // The parts' input rows in order (input `i` of the product is row
        // `r` of `x` and `y`).
        let inputs = || parts.iter().flat_map(|&(a, n)| a..a + n);
        let total = inputs().count();
        // Transposed in slices of 16 columns, in parallel: a slice's
        // `16 x total` floats stay in the core's L1 while every input's 16
        // values (one cache line) are written into it. Every element is
        // written, so the buffer is not zeroed first.
        let mut xt: Vec<f32> = Vec::with_capacity(cols * total);
        let spare = &mut xt.spare_capacity_mut()[..cols * total];
        spare
            .par_chunks_mut(16 * total)
            .enumerate()
            .for_each(|(s, xt)| {
                let c0 = 16 * s;
                for (i, r) in inputs().enumerate() {
                    let src = &x[r * cols + c0..r * cols + c0 + xt.len() / total];
                    for (c, &v) in src.iter().enumerate() {
                        xt[c * total + i].write(v);
                    }
                }
            });
        // SAFETY: the slices of 16 columns (the last one shorter) cover all
        // `cols x total` elements, and every input's column of each was
        // written.
        unsafe { xt.set_len(cols * total) };
        let yp = SendPtr(y.as_mut_ptr());
        let (yp, xt) = (&yp, &xt);
        let tr = tile_rows(rows, rayon::current_num_threads(), total);
        (0..rows.div_ceil(tr)).into_par_iter().for_each(|tile| {
            let r0 = tile * tr;
            let nr = tr.min(rows - r0);
            TILE.with_borrow_mut(|t| {
                OUT.with_borrow_mut(|o| {
                    t.resize(t.len().max(nr * cols), 0.0);
                    o.resize(o.len().max(nr * total), 0.0);
                    for r in 0..nr {
                        self.dequantize_row(r0 + r, &mut t[r * cols..(r + 1) * cols]);
                    }
                    let o = &mut o[..nr * total];
                    minikv_core::gemm::gemm(
                        nr,
                        cols,
                        total,
                        t,
                        (cols, 1),
                        xt,
                        (total, 1),
                        0.0,
                        o,
                        total,
                    );
                    for (i, r) in inputs().enumerate() {
                        // SAFETY: y[r][r0 .. r0 + nr] is written by this
                        // task only, and lies inside y (`check_parts`).
                        let yr =
                            unsafe { std::slice::from_raw_parts_mut(yp.0.add(r * rows + r0), nr) };
                        for (j, v) in yr.iter_mut().enumerate() {
                            *v = o[j * total + i];
                        }
                    }
                });
            });
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Tiles hold at most `n` rows (64 to `TILE_ROWS`) and split a matrix
    /// into at least as many tiles as threads once it has `threads^2` rows
    /// (no thread left idle), and into exactly one tile per thread when
    /// that keeps them within that bound (none with twice the work).
    #[test]
    fn prefill_tiles_split_rows_evenly() {
        for n in [3, 64, 100, 512, 4096] {
            let most = n.clamp(64, TILE_ROWS);
            for threads in 1..=8 {
                for rows in (1..3000).chain([49152, 65536]) {
                    let tr = tile_rows(rows, threads, n);
                    assert!((1..=most).contains(&tr), "{rows}/{threads}/{n}: {tr}");
                    let tiles = rows.div_ceil(tr);
                    if rows >= threads * threads {
                        assert!(tiles >= threads, "{rows}/{threads}/{n}: {tiles} tiles");
                    }
                    if rows >= threads * threads && rows <= threads * most {
                        assert_eq!(tiles, threads, "{rows}/{threads}/{n}: {tr} a tile");
                    }
                }
            }
        }
    }
}

/// How a batch's rows split into sequences, for [`QMatrix::matmul_segments`]:
/// the rows of short segments (at most two rows: decode steps) are computed
/// together, longer ones (prefill chunks) each by its own matrix product
/// against weights dequantized once for all of them.
#[derive(Debug, Default, Clone)]
pub struct Segments {
    /// Rows of the segments of at most two rows.
    pub(super) small: Vec<usize>,
    /// `(first row, rows)` of the longer segments.
    pub(super) big: Vec<(usize, usize)>,
    /// Total rows.
    rows: usize,
}

impl Segments {
    /// Segments of the given lengths, consecutive from row 0 (reuses the buffers).
    pub fn set(&mut self, lens: impl IntoIterator<Item = usize>) {
        self.small.clear();
        self.big.clear();
        let mut a = 0;
        for n in lens {
            match n {
                0 => {}
                1 | 2 => self.small.extend(a..a + n),
                _ => self.big.push((a, n)),
            }
            a += n;
        }
        self.rows = a;
    }

    /// Total rows.
    pub fn rows(&self) -> usize {
        self.rows
    }
}
