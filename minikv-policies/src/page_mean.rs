//! Page selection by mean logit (`[cache.pages.score] type = "page_mean"`):
//! a page keeps the mean of its keys, `[mean; d][rows]`, and scores
//! `max_j q_j · mean`, which by linearity is the page's mean logit for the
//! query head `j` that likes it best. Quest's score is an upper bound on the
//! page's largest logit; this one estimates its average, so it favours pages
//! that are relevant throughout over pages with one strong row: an ablation
//! of the page score, at half Quest's summary bytes.
//!
//! ```
//! use minikv_core::PageScore;
//! use minikv_policies::PageMean;
//!
//! let p = PageMean::default();
//! let mut s = vec![0.0; p.summary_len(2)];
//! p.add_row(&mut s, &[1.0, 0.0], true);
//! p.add_row(&mut s, &[0.0, 2.0], false);
//! // mean key (0.5, 1.0); query heads (1, 1) and (2, 0): max(1.5, 1.0)
//! assert_eq!(p.score(&s, &[1.0, 1.0, 2.0, 0.0], 2), 1.5);
//! ```

use minikv_core::PageScore;
use serde::{Deserialize, Serialize};

/// Page score: the mean key's dot product with the query (see the module docs).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PageMean {}

#[typetag::serde(name = "page_mean")]
impl PageScore for PageMean {
    fn summary_len(&self, d: usize) -> usize {
        d + 1
    }

    fn add_row(&self, summary: &mut [f32], row: &[f32], first: bool) {
        let d = row.len();
        let (mean, n) = summary.split_at_mut(d);
        if first {
            mean.copy_from_slice(row);
            n[0] = 1.0;
            return;
        }
        // Running mean: exact for the page sizes allowed (at most 4096 rows).
        n[0] += 1.0;
        let w = 1.0 / n[0];
        for (m, &x) in mean.iter_mut().zip(row) {
            *m += (x - *m) * w;
        }
    }

    fn score(&self, summary: &[f32], q: &[f32], d: usize) -> f32 {
        let mean = &summary[..d];
        q.chunks_exact(d)
            .map(|qj| qj.iter().zip(mean).map(|(a, b)| a * b).sum::<f32>())
            .fold(f32::NEG_INFINITY, f32::max)
    }
}

minikv_core::register!(
    PageScore,
    "page_mean",
    PageMean,
    "page score by mean key (the page's mean logit): an ablation of Quest's upper bound"
);
