//! The batched products of `matrix.rs` on 512-bit registers (AVX-512F,
//! and VNNI for 8-bit activations), chosen at run time by
//! [`QMatrix::matvec_rows`].

use super::QMatrix;
use crate::blocks::{GgmlType, block_sums};

impl QMatrix {
    /// [`Self::matvec_rows`] on 512-bit registers (`Q4_1`, `Q8_0`; the CPU
    /// has AVX-512F): groups of up to 16 inputs per unpacked weight block,
    /// each result bitwise that of [`Self::matvec`] alone.
    pub(super) fn matvec_rows_512(&self, x: &[f32], y: &mut [f32], sel: &[usize]) {
        use crate::blocks_x86_512::{Inputs, dots};
        let (cols, n) = (self.cols, sel.len());
        let nb = cols / 32;
        // The block sums, block-major: `block_sums` per input (the single
        // matvec's own sums), then block `b` of input `j` at `b * n + j`.
        let mut sums = Vec::new();
        if self.dtype == GgmlType::Q4_1 {
            sums.resize(nb * n, 0.0);
            let mut s = Vec::new();
            for (j, &i) in sel.iter().enumerate() {
                block_sums(&x[i * cols..(i + 1) * cols], &mut s);
                for (b, &v) in s.iter().enumerate() {
                    sums[b * n + j] = v;
                }
            }
        }
        let inp = Inputs {
            x,
            sel,
            sums: &sums,
            nb,
        };
        // A task's rows in groups of 64: tiles of rows for small batches
        // (`dots`) without a call per row.
        // SAFETY: AVX-512F was detected for this type; the `k` rows hold `nb`
        // blocks each, each selected input `cols = 32 nb` values (the type's
        // block is 32 and `new` checked the columns) and the sums `nb` per
        // input.
        self.row_groups_into(y, sel, 64, |w, k, out| unsafe {
            dots(self.dtype, w, k, &inp, out)
        });
    }

    /// [`Self::matvec_rows_q8`] with AVX-512 VNNI: the inputs quantized and
    /// laid out in pairs once (into `pairs`, reused), then every row against
    /// them two at a time; bitwise equal to [`Self::matvec`] per input.
    pub(super) fn matvec_rows_pairs(
        &self,
        x: &[f32],
        y: &mut [f32],
        sel: &[usize],
        pairs: &mut crate::q8_x86_512::Pairs,
    ) {
        pairs.set(x, self.cols, sel);
        let pairs = &*pairs;
        // A task's rows in groups of 64 (tiles of rows for small batches).
        // SAFETY: the features were detected; every row holds `cols / 32`
        // blocks, as many as each input (`new` checked the columns).
        self.row_groups_into(y, sel, 64, |w, k, out| unsafe {
            crate::q8_x86_512::dots(w, k, self.dtype, pairs, out)
        });
    }
}
