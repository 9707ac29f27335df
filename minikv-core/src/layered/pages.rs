//! Page selection at decode (`[cache.pages]`, [`crate::pages`]): per storage
//! head, the page summaries of its keys, and each step's selected rows copied
//! out for the backend. Every token stays stored; attention runs over exactly
//! the selected rows; bytes read per decoded token (rows read + summaries)
//! are reported beside bytes stored.

use super::store::HeadStore;
use crate::pages::{PageScore, PagesConfig};
use crate::storage::FpStore;

/// Page selection's running byte counts.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct PageStats {
    pub steps: u64,
    pub bytes_read: u64,
    pub bytes_all: u64,
}

/// One storage head's page summaries and the rows selected for this step.
#[derive(Debug)]
pub(crate) struct PageHead {
    score: Box<dyn PageScore>,
    /// Floats per page summary.
    sl: usize,
    d: usize,
    page: usize,
    /// Rows covered by the summaries.
    rows: usize,
    summaries: Vec<f32>,
    /// This step's page scores.
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

impl PageHead {
    pub fn new(
        cfg: &PagesConfig,
        d: usize,
        sel_k: Box<dyn FpStore>,
        sel_v: Box<dyn FpStore>,
    ) -> Self {
        Self {
            sl: cfg.score.summary_len(d),
            score: cfg.score.clone(),
            d,
            page: cfg.page_size,
            rows: 0,
            summaries: Vec::new(),
            bounds: Vec::new(),
            order: Vec::new(),
            idx: Vec::new(),
            buf: Vec::new(),
            sel_k,
            sel_v,
            selected: false,
        }
    }

    /// Extends the summaries with rows `[n][d]` appended after the covered ones.
    pub fn add_rows(&mut self, rows: &[f32]) {
        let (d, sl) = (self.d, self.sl);
        for r in rows.chunks_exact(d) {
            let first = self.rows.is_multiple_of(self.page);
            let p = self.rows / self.page;
            if first {
                self.summaries.resize((p + 1) * sl, 0.0);
            }
            self.score
                .add_row(&mut self.summaries[p * sl..(p + 1) * sl], r, first);
            self.rows += 1;
        }
    }

    /// Chooses the pages for queries `q` (`[g][d]`) and copies their rows out
    /// of `head`; returns the bytes this step reads: the fp16 keys and values
    /// of the rows read and, when pages were chosen, every page's summary (a
    /// head within the budget is read whole and nothing is copied).
    pub fn select(&mut self, head: &HeadStore, q: &[f32], budget: usize) -> usize {
        let (d, page) = (self.d, self.page);
        let n = self.rows;
        if n <= budget {
            self.selected = false;
            return 4 * d * n;
        }
        let pages = n.div_ceil(page);
        self.bounds.clear();
        let sl = self.sl;
        for p in 0..pages {
            let b = self
                .score
                .score(&self.summaries[p * sl..(p + 1) * sl], q, d);
            self.bounds.push(b);
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
        4 * d * self.idx.len() + self.summary_bytes_used()
    }

    /// Bytes of this head's rows (fp16 keys and values) and page summaries, in
    /// the unit of [`select`](PageHead::select).
    pub fn held_bytes(&self) -> usize {
        4 * self.d * self.rows + self.summary_bytes_used()
    }

    /// Bytes of the page summaries (read every step) and of this head's work buffers.
    pub fn bytes(&self) -> (usize, usize) {
        let bounds = 4 * self.summaries.capacity();
        let work = 4
            * (self.bounds.capacity()
                + self.order.capacity()
                + self.idx.capacity()
                + self.buf.capacity())
            + self.sel_k.bytes()
            + self.sel_v.bytes();
        (bounds, work)
    }

    /// Bytes of summaries read per step: every page's.
    pub fn summary_bytes_used(&self) -> usize {
        4 * self.summaries.len()
    }
}
