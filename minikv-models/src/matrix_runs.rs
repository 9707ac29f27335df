//! A weight matrix's bytes as runs of whole rows: one run for a tensor as
//! the file stores it, several for a stack of tensors whose bytes lie apart
//! in the file (`[q; k; v]`, `[gate; up]`), each run read where it lies.
//! A stack is then never a copy, and the products split their rayon tasks
//! at run boundaries, so every kernel still sees consecutive rows in one
//! slice.

use crate::gguf::Blob;

/// Runs of whole rows of one matrix, in row order.
#[derive(Debug, Clone)]
pub(super) struct Runs {
    /// Bytes per row.
    rb: usize,
    /// Rows in all.
    rows: usize,
    /// Each run's first row (increasing from 0) and bytes (whole rows).
    runs: Vec<(usize, Blob)>,
}

impl Runs {
    /// One run of `rows` rows of `rb` bytes (the caller checked the size).
    pub(super) fn one(rb: usize, rows: usize, data: Blob) -> Self {
        Self {
            rb,
            rows,
            runs: vec![(0, data)],
        }
    }

    /// The rows of `parts` one after another (all with rows of `rb`
    /// bytes); a run that starts where the one before it ends, in the same
    /// bytes, joins it.
    pub(super) fn concat(rb: usize, parts: &[&Runs]) -> Self {
        let mut runs: Vec<(usize, Blob)> = Vec::new();
        let mut rows = 0;
        for p in parts {
            for (r0, b) in &p.runs {
                let joined = runs.last().and_then(|(_, last)| Blob::adjacent(&[last, b]));
                match joined {
                    Some(j) => runs.last_mut().expect("a last run").1 = j,
                    None => runs.push((rows + r0, b.clone())),
                }
            }
            rows += p.rows;
        }
        Self { rb, rows, runs }
    }

    /// Rows `r0 .. r0 + n` (in bounds: the caller checked), sharing the
    /// bytes.
    pub(super) fn slice(&self, r0: usize, n: usize) -> Self {
        let mut runs = Vec::new();
        self.pieces(r0, r0 + n, |a, b, _| {
            let (s, blob) = self.run_at(a);
            let start = (a - s) * self.rb;
            runs.push((a - r0, blob.slice(start, (b - a) * self.rb)));
        });
        if runs.is_empty() {
            runs.push((0, self.runs[0].1.slice(0, 0)));
        }
        Self {
            rb: self.rb,
            rows: n,
            runs,
        }
    }

    /// The run holding row `r` (`r < rows`, or the last run), with its
    /// first row.
    fn run_at(&self, r: usize) -> (usize, &Blob) {
        let i = self.runs.partition_point(|(s, _)| *s <= r).max(1) - 1;
        (self.runs[i].0, &self.runs[i].1)
    }

    /// Bytes of row `r` (panics past the last row).
    #[inline]
    pub(super) fn row(&self, r: usize) -> &[u8] {
        let (s, blob) = self.run_at(r);
        &blob.bytes()[(r - s) * self.rb..(r - s + 1) * self.rb]
    }

    /// Rows `a .. b` cut where runs meet: `f(first, end, their bytes)` for
    /// each piece in order (none when `a == b`).
    #[inline]
    pub(super) fn pieces(&self, a: usize, b: usize, mut f: impl FnMut(usize, usize, &[u8])) {
        let first = self.runs.partition_point(|(s, _)| *s <= a).max(1) - 1;
        for (i, (s, blob)) in self.runs.iter().enumerate().skip(first) {
            let end = self.runs.get(i + 1).map_or(self.rows, |n| n.0);
            let (p0, p1) = (a.max(*s), b.min(end));
            if p0 < p1 {
                f(
                    p0,
                    p1,
                    &blob.bytes()[(p0 - s) * self.rb..(p1 - s) * self.rb],
                );
            }
            if end >= b {
                break;
            }
        }
    }

    /// Bytes in all.
    pub(super) fn byte_len(&self) -> usize {
        self.runs.iter().map(|(_, b)| b.bytes().len()).sum()
    }

    /// Each run's bytes, in row order.
    pub(super) fn slices(&self) -> impl Iterator<Item = &[u8]> {
        self.runs.iter().map(|(_, b)| b.bytes())
    }

    /// The heap buffers under the runs (see [`Blob::heap_buffer`]).
    pub(super) fn heap_buffers(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.runs.iter().filter_map(|(_, b)| b.heap_buffer())
    }
}
