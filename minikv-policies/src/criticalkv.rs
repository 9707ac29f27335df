//! CriticalKV (Feng et al. 2025; kvpress's `CriticalKVPress`,
//! docs/algorithms.md "CriticalKV"): a two-stage refinement of any scorer by
//! how much each value actually moves the layer's output.
//!
//! Per KV head, the inner scorer's scores (mean over the query heads of the
//! group) are computed. Stage 1 reserves the `first_stage_ratio` share of the
//! head's budget for the inner scorer's top tokens. Stage 2 rescales every
//! score by the L1 norm of the value's contribution to the output,
//! `‖W_o^h v_j‖₁` (mean over the group's query heads `h`, `W_o^h` the output
//! projection's columns of head `h`): `(s_j + ε)·‖W_o^h v_j‖₁`; the stage-1
//! tokens then score above all others. The model supplies `W_o` through the
//! cache's observation channel.

use minikv_core::{
    Error, Needs, Result, ScoreInputs, TokenScorer, check_range, register, top_k_indices,
};
use serde::{Deserialize, Serialize};

/// CriticalKV wrapper (kvpress defaults: ε = 1e-4, first stage 0.5).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CriticalKv {
    /// Share of the budget chosen by the inner scorer alone (0.5).
    pub first_stage_ratio: f64,
    /// Added to the inner score before the projection-norm product (1e-4).
    pub epsilon: f32,
    /// The scorer refined.
    pub scorer: Box<dyn TokenScorer>,
}

impl Default for CriticalKv {
    fn default() -> Self {
        Self {
            first_stage_ratio: 0.5,
            epsilon: 1e-4,
            scorer: Box::new(crate::SnapKv::default()),
        }
    }
}

/// `‖W_o^h v_j‖₁` for the rows `v` (`[n][d]`) and query head `h`, into `out[n]`.
/// `w` is `[hidden][hq * d]`; `tmp` is scratch.
#[allow(clippy::too_many_arguments)]
fn projected_l1(
    w: &[f32],
    hidden: usize,
    hq: usize,
    h: usize,
    v: &[f32],
    d: usize,
    out: &mut [f32],
    tmp: &mut Vec<f32>,
) {
    const ROWS: usize = 512;
    let cols = hq * d;
    for (vb, ob) in v.chunks(ROWS * d).zip(out.chunks_mut(ROWS)) {
        let n = ob.len();
        tmp.resize(n * hidden, 0.0);
        // tmp[n][hidden] = vb[n][d] · (W_o^h)ᵀ[d][hidden].
        // SAFETY: vb is n x d, W_o^h^T is read at (c, r) -> r * cols + h * d + c,
        // inside w for c < d, r < hidden; tmp is n x hidden; no overlap.
        unsafe {
            matrixmultiply::sgemm(
                n,
                d,
                hidden,
                1.0,
                vb.as_ptr(),
                d as isize,
                1,
                w[h * d..].as_ptr(),
                1,
                cols as isize,
                0.0,
                tmp.as_mut_ptr(),
                hidden as isize,
                1,
            );
        }
        for (o, row) in ob.iter_mut().zip(tmp.chunks_exact(hidden)) {
            *o = row.iter().map(|x| x.abs()).sum();
        }
    }
}

/// The inner scorer's scores (`out`, `[Hq][T]`) and `‖W_o^h v_j‖₁`, each
/// averaged over the query heads of every KV head: `([Hkv][T], [Hkv][T])`.
/// `who` names the component in the error when the model supplied no `W_o`.
pub(crate) fn kv_scores_and_norms(
    inp: &ScoreInputs<'_>,
    out: &[f32],
    who: &str,
) -> Result<(Vec<f32>, Vec<f32>)> {
    let (t, d) = (inp.t, inp.spec.head_dim);
    let (hq, hkv, g) = (inp.spec.n_q_heads, inp.spec.n_kv_heads, inp.spec.group());
    let w = inp.output_projection.ok_or_else(|| {
        Error::Unsupported(format!(
            "{who} needs the layer's output projection, which the model supplies during \
             prefill (decode-time re-scoring does not have it)"
        ))
    })?;
    if w.is_empty() || !w.len().is_multiple_of(hq * d) {
        return Err(Error::shape(
            "output projection",
            format!("[hidden][{}]", hq * d),
            w.len(),
        ));
    }
    let hidden = w.len() / (hq * d);
    let (mut s, mut norm) = (vec![0.0f32; hkv * t], vec![0.0f32; hkv * t]);
    let (mut p, mut tmp) = (vec![0.0f32; t], Vec::new());
    for kv in 0..hkv {
        for h in kv * g..(kv + 1) * g {
            s[kv * t..(kv + 1) * t]
                .iter_mut()
                .zip(&out[h * t..(h + 1) * t])
                .for_each(|(a, b)| *a += b / g as f32);
            projected_l1(w, hidden, hq, h, inp.values[kv], d, &mut p, &mut tmp);
            norm[kv * t..(kv + 1) * t]
                .iter_mut()
                .zip(&p)
                .for_each(|(a, b)| *a += b / g as f32);
        }
    }
    Ok((s, norm))
}

#[typetag::serde(name = "criticalkv")]
impl TokenScorer for CriticalKv {
    fn needs(&self) -> Needs {
        self.scorer.needs().union(Needs {
            output_projection: true,
            ..Default::default()
        })
    }
    fn validate(&self) -> Result<()> {
        check_range(
            "cache.scorer.first_stage_ratio",
            self.first_stage_ratio,
            0.0,
            1.0,
        )?;
        check_range("cache.scorer.epsilon", self.epsilon, 0.0, 1e6)?;
        self.scorer.validate()
    }
    fn score(&self, inp: &ScoreInputs<'_>, out: &mut [f32]) -> Result<()> {
        self.scorer.score(inp, out)?;
        let t = inp.t;
        let g = inp.spec.group();
        let (s_all, norm_all) = kv_scores_and_norms(inp, out, "criticalkv")?;
        let stage1 = inp
            .budget
            .map_or(0, |b| (b.min(t) as f64 * self.first_stage_ratio) as usize);
        let all: Vec<u32> = (0..t as u32).collect();
        for kv in 0..inp.spec.n_kv_heads {
            let mut s = s_all[kv * t..(kv + 1) * t].to_vec();
            let norm = &norm_all[kv * t..(kv + 1) * t];
            let first = top_k_indices(&s, &all, stage1);
            s.iter_mut()
                .zip(norm)
                .for_each(|(a, n)| *a = (*a + self.epsilon) * n);
            let top = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            for &i in &first {
                s[i as usize] = top + 1.0;
            }
            for h in kv * g..(kv + 1) * g {
                out[h * t..(h + 1) * t].copy_from_slice(&s);
            }
        }
        Ok(())
    }
}
register!(
    Scorer,
    "criticalkv",
    CriticalKv,
    "CriticalKV: any scorer refined in two stages, the second weighting by the L1 norm of each value's output projection"
);
