//! One storage head after compression: a quantized part, a full-precision
//! (fp16) residual streamed into it by the residual rule, and optional extra
//! attention entries from a compensator.

use crate::Result;
use crate::attention::{ExtraView, HeadView};
use crate::cache::HeadMemory;
use crate::compensate::{ExtraEntries, LogitGate};
use crate::config::CacheConfig;
use crate::quant::QuantStore;
use crate::residual::{ResidualRule, ResidualShape};
use crate::storage::{FpStore, StorageFactory};

/// How the fp16 residual streams into the quantized part (docs/algorithms.md
/// §2): the config's [`ResidualRule`] with the residual's shape.
#[derive(Debug, Clone)]
pub(crate) struct Residual {
    /// `R` and the quantizers' append unit (`r = usize::MAX` without
    /// quantization).
    pub shape: ResidualShape,
    /// The rule (`None` without quantization: nothing ever streams).
    pub rule: Option<Box<dyn ResidualRule>>,
}

impl Residual {
    pub fn new(cfg: &CacheConfig) -> Self {
        match &cfg.quant {
            None => Self {
                shape: ResidualShape {
                    r: usize::MAX,
                    granularity: 1,
                },
                rule: None,
            },
            Some(q) => {
                let a = q.keys.as_ref().map_or(1, |z| z.token_granularity());
                let b = q.values.as_ref().map_or(1, |z| z.token_granularity());
                Self {
                    shape: ResidualShape {
                        r: q.residual,
                        granularity: a.max(b),
                    },
                    rule: Some(q.residual_mode.clone()),
                }
            }
        }
    }

    /// How many of `n` prompt rows go to the quantized keys and values.
    fn prompt_split(&self, n: usize) -> (usize, usize) {
        self.rule
            .as_ref()
            .map_or((0, 0), |r| clamp(r.prompt_split(n, &self.shape), n, n))
    }
}

/// A rule's counts, at most the rows there are.
fn clamp((k, v): (usize, usize), keys: usize, values: usize) -> (usize, usize) {
    (k.min(keys), v.min(values))
}

/// Extra entries as stored: fp16 keys and values, f32 biases.
#[derive(Debug)]
struct Extra {
    keys: Box<dyn FpStore>,
    values: Box<dyn FpStore>,
    bias: Vec<f32>,
}

/// One storage head.
#[derive(Debug)]
pub(crate) struct HeadStore {
    qk: Option<Box<dyn QuantStore>>,
    qv: Option<Box<dyn QuantStore>>,
    fk: Box<dyn FpStore>,
    fv: Box<dyn FpStore>,
    extra: Option<Extra>,
}

fn flush(
    quant: &mut Option<Box<dyn QuantStore>>,
    fp: &mut dyn FpStore,
    n: usize,
    scratch: &mut Vec<f32>,
) -> Result<()> {
    let Some(qs) = quant.as_mut() else {
        return Ok(());
    };
    if n == 0 {
        return Ok(());
    }
    if qs.append_front_of(fp, n)? {
        fp.discard_front(n);
        return Ok(());
    }
    scratch.clear();
    fp.drain_front(n, scratch);
    qs.append(scratch)
}

impl HeadStore {
    /// Empty stores created through the backend's factory.
    pub fn new(cfg: &CacheConfig, st: &dyn StorageFactory, d: usize) -> Result<Self> {
        let page = cfg.page_tokens;
        let (qk, qv) = match &cfg.quant {
            Some(q) => (
                q.keys
                    .as_deref()
                    .map(|z| st.quant_store(z, d, page))
                    .transpose()?,
                q.values
                    .as_deref()
                    .map(|z| st.quant_store(z, d, page))
                    .transpose()?,
            ),
            None => (None, None),
        };
        // A quantized cache's fp16 residual never holds more than R + 1 rows.
        let fp_page = cfg
            .quant
            .as_ref()
            .map_or(page, |q| page.min(q.residual + 1));
        Ok(Self {
            qk,
            qv,
            fk: st.fp_store(d, fp_page),
            fv: st.fp_store(d, fp_page),
            extra: None,
        })
    }

    /// Replaces the (still empty) key stores by stores of only `channels`
    /// of each row (key-channel pruning; memory drops with the channels).
    pub fn restrict_keys(
        &mut self,
        cfg: &CacheConfig,
        st: &dyn StorageFactory,
        channels: Vec<u16>,
        d: usize,
    ) -> Result<()> {
        use crate::channels::{ChannelSubsetFp, ChannelSubsetQuant, SplitKeys};
        let dk = channels.len();
        if dk == d {
            return Ok(());
        }
        let page = cfg.page_tokens;
        if let Some(z) = cfg.quant.as_ref().and_then(|q| q.keys.as_deref()) {
            let inner = st.quant_store(z, dk, page)?;
            self.qk = Some(Box::new(ChannelSubsetQuant::new(
                inner,
                channels.clone(),
                d,
            )));
        }
        let fp_page = cfg
            .quant
            .as_ref()
            .map_or(page, |q| page.min(q.residual + 1));
        let pruned = ChannelSubsetFp::new(st.fp_store(dk, fp_page), channels, d);
        self.fk = match cfg.channels.as_ref().is_some_and(|c| c.prune_appended()) {
            true => Box::new(pruned),
            // Decoded keys keep every channel, beside the pruned prompt rows.
            false => Box::new(SplitKeys::new(pruned, st.fp_store(d, fp_page))),
        };
        Ok(())
    }

    /// Loads the kept prompt rows (`[n][d]`, in position order), split by the
    /// residual rule, and the extra entries; every store is trimmed to fit.
    pub fn load(
        &mut self,
        st: &dyn StorageFactory,
        keys: &[f32],
        values: &[f32],
        d: usize,
        rule: &Residual,
        extra: ExtraEntries,
    ) -> Result<()> {
        let n = keys.len() / d;
        let (nqk, nqv) = rule.prompt_split(n);
        let nqk = if self.qk.is_some() { nqk } else { 0 };
        let nqv = if self.qv.is_some() { nqv } else { 0 };
        if let Some(q) = self.qk.as_mut() {
            q.append(&keys[..nqk * d])?;
        }
        if let Some(q) = self.qv.as_mut() {
            q.append(&values[..nqv * d])?;
        }
        self.fk.push(&keys[nqk * d..]);
        self.fv.push(&values[nqv * d..]);
        if !extra.is_empty() {
            let (mut k, mut v) = (st.fp_store(d, 1), st.fp_store(d, 1));
            k.push(&extra.keys);
            v.push(&extra.values);
            k.shrink();
            v.shrink();
            let mut bias = extra.bias;
            bias.shrink_to_fit();
            self.extra = Some(Extra {
                keys: k,
                values: v,
                bias,
            });
        }
        for s in [self.qk.as_mut(), self.qv.as_mut()].into_iter().flatten() {
            s.shrink();
        }
        self.fk.shrink();
        self.fv.shrink();
        Ok(())
    }

    /// Makes room for `rows` more fp16 rows at once (a cache whose length is
    /// bounded, e.g. decode-time eviction, then never grows again).
    pub fn reserve_fp(&mut self, rows: usize) {
        self.fk.reserve_exact(rows);
        self.fv.reserve_exact(rows);
    }

    /// Appends one decoded token, then quantizes what the rule says before
    /// attention (MiniKV: the whole residual once it holds `R`).
    pub fn push(
        &mut self,
        k: &[f32],
        v: &[f32],
        rule: &Residual,
        scratch: &mut Vec<f32>,
    ) -> Result<()> {
        self.fk.push(k);
        self.fv.push(v);
        if let Some(r) = &rule.rule {
            let (nk, nv) = (self.fk.len(), self.fv.len());
            let (fk, fv) = clamp(r.before_attend(nk, nv, &rule.shape), nk, nv);
            self.flush(fk, fv, scratch)?;
        }
        Ok(())
    }

    /// After attention, what the rule quantizes then (KIVI: keys all `R`
    /// once the residual reaches it; values slide a window of `R`).
    pub fn after_attend(&mut self, rule: &Residual, scratch: &mut Vec<f32>) -> Result<()> {
        if let Some(r) = &rule.rule {
            let (nk, nv) = (self.fk.len(), self.fv.len());
            let (fk, fv) = clamp(r.after_attend(nk, nv, &rule.shape), nk, nv);
            self.flush(fk, fv, scratch)?;
        }
        Ok(())
    }

    /// Moves the oldest `nk` keys and `nv` values into the quantized parts
    /// (a part without a quantizer keeps its rows).
    fn flush(&mut self, nk: usize, nv: usize, scratch: &mut Vec<f32>) -> Result<()> {
        flush(&mut self.qk, self.fk.as_mut(), nk, scratch)?;
        flush(&mut self.qv, self.fv.as_mut(), nv, scratch)
    }

    /// Removes full-precision row `i` (the last row takes its place).
    pub fn swap_remove(&mut self, i: usize) {
        self.fk.swap_remove(i);
        self.fv.swap_remove(i);
    }

    /// Tokens held (quantized + full precision).
    pub fn len(&self) -> usize {
        self.fk.len() + self.qk.as_ref().map_or(0, |q| q.len())
    }

    /// Full-precision keys and values (an unquantized head: all of it).
    pub fn fp(&self) -> (&dyn FpStore, &dyn FpStore) {
        (self.fk.as_ref(), self.fv.as_ref())
    }

    /// The head as decode attention sees it.
    pub fn view<'a>(&'a self, gate: Option<&'a dyn LogitGate>) -> HeadView<'a> {
        HeadView {
            quant_keys: self.qk.as_deref(),
            quant_values: self.qv.as_deref(),
            fp_keys: self.fk.as_ref(),
            fp_values: self.fv.as_ref(),
            extra: self.extra.as_ref().map(|e| ExtraView {
                keys: e.keys.as_ref(),
                values: e.values.as_ref(),
                bias: &e.bias,
                gate,
            }),
        }
    }

    /// Bytes of this head's own stores (`indices` is filled by the evictor).
    pub fn memory(&self) -> HeadMemory {
        let (mut codes, mut scales, mut used) = (0, 0, 0);
        for q in [&self.qk, &self.qv].into_iter().flatten() {
            let b = q.bytes();
            codes += b.codes;
            scales += b.scales;
            used += q.used_bytes();
        }
        let clusters = self.extra.as_ref().map_or(0, |e| {
            e.keys.bytes() + e.values.bytes() + 4 * e.bias.capacity()
        });
        used += self.extra.as_ref().map_or(0, |e| {
            e.keys.used_bytes() + e.values.used_bytes() + 4 * e.bias.len()
        });
        HeadMemory {
            tokens: self.len(),
            quant_keys: self.qk.as_ref().map_or(0, |q| q.len()),
            quant_values: self.qv.as_ref().map_or(0, |q| q.len()),
            quant_codes: codes,
            quant_scales: scales,
            fp: self.fk.bytes() + self.fv.bytes(),
            indices: 0,
            clusters,
            used: used + self.fk.used_bytes() + self.fv.used_bytes(),
        }
    }
}
