//! Quest (Tang et al. 2024, docs/algorithms.md "Quest"): query-aware page
//! selection at decode. Every token stays stored; each head's rows are cut
//! into pages of `page_size` rows (storage order = position order), and each
//! page keeps the per-channel min and max of its keys. For a decode query `q`
//! a page's attention logit is bounded by `Σ_c max(q_c·min_c, q_c·max_c)`
//! (the max over the query heads reading the head); the pages with the
//! highest bounds, up to `token_budget` rows, are read, the page holding the
//! newest token always. Attention runs over exactly those rows; bytes read per
//! decoded token (rows read + page bounds) are reported beside bytes stored.

use super::store::HeadStore;
use crate::storage::FpStore;
use crate::{Error, Result};
use serde::{Deserialize, Serialize};

/// `[cache.quest]`: Quest's page size and token budget.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct QuestConfig {
    /// Rows per page (Quest's default 16).
    pub page_size: usize,
    /// Rows read per decode step and head (whole pages; Quest's budgets are
    /// 256-4096 tokens).
    pub token_budget: usize,
}

impl Default for QuestConfig {
    fn default() -> Self {
        Self {
            page_size: 16,
            token_budget: 512,
        }
    }
}

impl QuestConfig {
    /// Checks the numbers.
    pub fn validate(&self) -> Result<()> {
        if !(1..=4096).contains(&self.page_size) {
            return Err(Error::config(
                "cache.quest.page_size",
                format!("must be in 1..=4096, got {}", self.page_size),
            ));
        }
        if self.token_budget < self.page_size || self.token_budget > 1 << 24 {
            return Err(Error::config(
                "cache.quest.token_budget",
                format!(
                    "must be at least one page ({}) and at most 16777216, got {}",
                    self.page_size, self.token_budget
                ),
            ));
        }
        Ok(())
    }
}

/// Quest's running byte counts.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct QuestStats {
    pub steps: u64,
    pub bytes_read: u64,
    pub bytes_all: u64,
}

/// One storage head's page bounds and the rows selected for this step.
#[derive(Debug)]
pub(crate) struct QuestHead {
    d: usize,
    page: usize,
    /// Rows covered by the bounds.
    rows: usize,
    mins: Vec<f32>,
    maxs: Vec<f32>,
    bounds: Vec<f32>,
    order: Vec<u32>,
    idx: Vec<u32>,
    buf: Vec<f32>,
    /// The selected rows as stores a backend reads.
    pub sel_k: Box<dyn FpStore>,
    pub sel_v: Box<dyn FpStore>,
    /// Whether this step reads the selection (else the whole head).
    pub selected: bool,
}

impl QuestHead {
    pub fn new(
        cfg: &QuestConfig,
        d: usize,
        sel_k: Box<dyn FpStore>,
        sel_v: Box<dyn FpStore>,
    ) -> Self {
        Self {
            d,
            page: cfg.page_size,
            rows: 0,
            mins: Vec::new(),
            maxs: Vec::new(),
            bounds: Vec::new(),
            order: Vec::new(),
            idx: Vec::new(),
            buf: Vec::new(),
            sel_k,
            sel_v,
            selected: false,
        }
    }

    /// Extends the bounds with rows `[n][d]` appended after the covered ones.
    pub fn add_rows(&mut self, rows: &[f32]) {
        let d = self.d;
        for r in rows.chunks_exact(d) {
            if self.rows.is_multiple_of(self.page) {
                self.mins.extend_from_slice(r);
                self.maxs.extend_from_slice(r);
            } else {
                let p = self.rows / self.page;
                let (lo, hi) = (
                    &mut self.mins[p * d..(p + 1) * d],
                    &mut self.maxs[p * d..(p + 1) * d],
                );
                for c in 0..d {
                    lo[c] = lo[c].min(r[c]);
                    hi[c] = hi[c].max(r[c]);
                }
            }
            self.rows += 1;
        }
    }

    /// Chooses the pages for queries `q` (`[g][d]`) and copies their rows out
    /// of `head`; returns the bytes this step reads: the fp16 keys and values
    /// of the rows read and, when pages were chosen, every page's bounds (a
    /// head within the budget is read whole and nothing is copied).
    pub fn select(&mut self, head: &HeadStore, q: &[f32], budget: usize) -> usize {
        let (d, page) = (self.d, self.page);
        let n = self.rows;
        if n <= budget {
            self.selected = false;
            return 4 * d * n;
        }
        let pages = n.div_ceil(page);
        let g = q.len() / d;
        self.bounds.clear();
        for p in 0..pages {
            let (lo, hi) = (
                &self.mins[p * d..(p + 1) * d],
                &self.maxs[p * d..(p + 1) * d],
            );
            let mut best = f32::NEG_INFINITY;
            for j in 0..g {
                let qj = &q[j * d..(j + 1) * d];
                let b: f32 = (0..d).map(|c| (qj[c] * lo[c]).max(qj[c] * hi[c])).sum();
                best = best.max(b);
            }
            self.bounds.push(best);
        }
        // The newest page always; then the highest bounds, lower pages on ties.
        let last = pages - 1;
        self.order.clear();
        self.order.extend(0..last as u32);
        let bounds = &self.bounds;
        let mut room = budget.saturating_sub(n - last * page) / page;
        room = room.min(self.order.len());
        if room > 0 && room < self.order.len() {
            self.order.select_nth_unstable_by(room - 1, |&a, &b| {
                bounds[b as usize]
                    .total_cmp(&bounds[a as usize])
                    .then(a.cmp(&b))
            });
        }
        self.order.truncate(room);
        self.order.push(last as u32);
        self.order.sort_unstable();
        self.idx.clear();
        for &p in &self.order {
            let p = p as usize;
            self.idx
                .extend((p * page) as u32..((p + 1) * page).min(n) as u32);
        }
        let (fk, fv) = head.fp();
        self.sel_k.clear();
        self.sel_v.clear();
        fk.gather(&self.idx, &mut self.buf);
        self.sel_k.push(&self.buf);
        fv.gather(&self.idx, &mut self.buf);
        self.sel_v.push(&self.buf);
        self.selected = true;
        4 * d * self.idx.len() + self.bound_bytes_used()
    }

    /// Bytes of this head's rows (fp16 keys and values) and page bounds, in
    /// the unit of [`select`](QuestHead::select).
    pub fn held_bytes(&self) -> usize {
        4 * self.d * self.rows + self.bound_bytes_used()
    }

    /// Bytes of the page bounds (read every step) and of this head's work buffers.
    pub fn bytes(&self) -> (usize, usize) {
        let bounds = 4 * (self.mins.capacity() + self.maxs.capacity());
        let work = 4
            * (self.bounds.capacity()
                + self.order.capacity()
                + self.idx.capacity()
                + self.buf.capacity())
            + self.sel_k.bytes()
            + self.sel_v.bytes();
        (bounds, work)
    }

    /// Bytes of bounds read per step: every page's min and max.
    pub fn bound_bytes_used(&self) -> usize {
        4 * (self.mins.len() + self.maxs.len())
    }
}
