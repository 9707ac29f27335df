//! Prefill histories kept on the device ([`PrefillArgs::history`]): a
//! chunked prefill hands the backend every earlier row of the layer again
//! with each chunk; with a history the backend keeps the rows it has and
//! uploads only the new ones (linear host-to-device traffic instead of
//! quadratic), until the cache releases the history.
//!
//! [`PrefillArgs::history`]: minikv_core::PrefillArgs::history

use crate::device::{DevBuf, DevPtr, Device};
use crate::prefill::f16_rows;
use minikv_core::{KvHistory, Result};
use std::collections::HashMap;
use std::sync::Arc;

/// Most bytes the kept histories hold together: beyond it the least
/// recently used ones are dropped (the one in use always stays; a dropped
/// history is uploaded whole at its next call, so this bounds memory, not
/// correctness).
pub(crate) const HISTORY_BYTES_MAX: usize = 8 << 30;

/// One history's rows on the device: keys and values `[hkv][t][d]`, f32 or
/// (for the tensor-core kernels) fp16, exactly `t` rows per head (the
/// kernels' layout).
#[derive(Debug)]
struct Resident {
    hkv: usize,
    d: usize,
    t: usize,
    half: bool,
    k: DevBuf,
    v: DevBuf,
    used: u64,
}

impl Resident {
    fn bytes(&self) -> usize {
        self.k.len() + self.v.len()
    }
}

/// The histories a backend keeps.
#[derive(Debug, Default)]
pub(crate) struct Histories {
    map: HashMap<KvHistory, Resident>,
    clock: u64,
}

impl Histories {
    /// The keys and values of a call of history `h` on the device (`t` rows
    /// of `d` per KV head; fp16 when `half`, else f32): the rows it kept,
    /// moved on the device into a buffer of the new length, and the new rows
    /// uploaded. A history whose shape or element type changed, or that
    /// holds more rows than the call (against the append-only promise), is
    /// uploaded whole.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn rows(
        &mut self,
        dev: &Arc<dyn Device>,
        h: KvHistory,
        keys: &[&[f32]],
        values: &[&[f32]],
        t: usize,
        d: usize,
        half: bool,
    ) -> Result<(DevPtr, DevPtr)> {
        let hkv = keys.len();
        let es = if half { 2 } else { 4 };
        self.clock += 1;
        let old = self.map.remove(&h);
        let kept = match &old {
            Some(r) if r.hkv == hkv && r.d == d && r.t <= t && r.half == half => r.t,
            _ => 0,
        };
        let r = match old {
            Some(mut r) if kept == t => {
                r.used = self.clock;
                r
            }
            old => {
                let bytes = hkv * t * d * es;
                let (k, v) = (DevBuf::zeroed(dev, bytes)?, DevBuf::zeroed(dev, bytes)?);
                for (buf, src, prev) in [
                    (&k, keys, old.as_ref().map(|r| &r.k)),
                    (&v, values, old.as_ref().map(|r| &r.v)),
                ] {
                    for (head, rows) in src.iter().enumerate() {
                        if let Some(p) = prev {
                            // Nothing moves when `kept` is 0.
                            buf.copy_from(
                                head * t * d * es,
                                p,
                                head * kept * d * es,
                                kept * d * es,
                            )?;
                        }
                        let new = &rows[kept * d..t * d];
                        let at = (head * t + kept) * d * es;
                        if half {
                            buf.write(at, &f16_rows(&[new]))?;
                        } else {
                            buf.write(at, new)?;
                        }
                    }
                }
                Resident {
                    hkv,
                    d,
                    t,
                    half,
                    k,
                    v,
                    used: self.clock,
                }
            }
        };
        let ptrs = (r.k.ptr(), r.v.ptr());
        self.map.insert(h, r);
        self.evict(h);
        Ok(ptrs)
    }

    /// Drops history `h` (nothing if it is not kept).
    pub(crate) fn release(&mut self, h: KvHistory) {
        self.map.remove(&h);
    }

    /// Histories kept (for tests and reports).
    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    /// Drops the least recently used histories other than `keep` while the
    /// kept bytes pass [`HISTORY_BYTES_MAX`].
    fn evict(&mut self, keep: KvHistory) {
        let mut total: usize = self.map.values().map(Resident::bytes).sum();
        while total > HISTORY_BYTES_MAX {
            let Some((&h, r)) = self
                .map
                .iter()
                .filter(|(h, _)| **h != keep)
                .min_by_key(|(_, r)| r.used)
            else {
                return;
            };
            total -= r.bytes();
            self.map.remove(&h);
        }
    }
}
