//! # minikv-quant
//!
//! KIVI-exact asymmetric min-max quantization (docs/algorithms.md §1) of KV caches,
//! bit packing LSB-first into `u32` words, and the per-head [`MinMaxStore`] with
//! fused dequantize-and-attend kernels: decode attention reads the packed codes
//! and per-group scale/min directly, never a dequantized tensor.
//!
//! The quantizer is registered as `type = "minmax"` for configs:
//!
//! ```
//! use minikv_core::{Quantizer, QuantStore, Axis};
//! use minikv_quant::{MinMax, quantize_group};
//!
//! // The golden row of docs/algorithms.md §1 (b = 2, G = 16).
//! let row = [0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 0.25, 0.75, 1.25, 1.75, 2.25, 2.75, 3.0, 0.0, 1.0];
//! let g = quantize_group(&row, 2).unwrap();
//! assert_eq!(g.codes, [0, 0, 1, 2, 2, 2, 3, 0, 1, 1, 2, 2, 3, 3, 0, 1]);
//! assert_eq!(minikv_quant::pack(&g.codes, 2), [0x4fa53a90]);
//!
//! // A per-channel key store for head dim 4, fed 16 tokens at a time.
//! let q = MinMax { bits: 2, group: 16, axis: Axis::Channel, ..Default::default() };
//! let mut store = q.new_store(4, 256).unwrap();
//! let keys: Vec<f32> = (0..64).map(|i| (i as f32 * 0.3).sin()).collect();
//! store.append(&keys).unwrap();
//! let mut scores = vec![0.0; 16];
//! store.scores(&[1.0, 0.0, 0.0, 0.0], 1, &mut scores, 16); // q . k_hat, fused
//! assert!((scores[3] - keys[12]).abs() < 0.35);
//! ```

#![warn(missing_docs)]

mod exact;
mod int8;
#[cfg(target_arch = "x86_64")]
mod prefetch;
pub mod residual;
#[cfg(target_arch = "x86_64")]
mod simd512;
mod store;
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
))]
mod x86;
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx512f",
    target_feature = "f16c",
    target_feature = "fma"
))]
mod x86_512;
#[cfg(target_arch = "x86_64")]
mod x86_int8;
#[cfg(target_arch = "x86_64")]
mod x86_int8_512;

pub use residual::KiviResidual;
pub use store::MinMaxStore;

use minikv_core::{Axis, Error, QuantStore, Quantizer, Result};
use serde::{Deserialize, Serialize};

/// Precision of the stored scale and minimum.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ScaleDtype {
    /// IEEE half (as the KIVI and MiniKV references).
    #[default]
    F16,
    /// f32.
    F32,
}

impl ScaleDtype {
    /// Bytes per stored scale or minimum.
    pub fn bytes(self) -> usize {
        match self {
            ScaleDtype::F16 => 2,
            ScaleDtype::F32 => 4,
        }
    }
    /// Rounds `x` to what is stored.
    pub fn round(self, x: f32) -> f32 {
        match self {
            ScaleDtype::F16 => half::f16::from_f32(x).to_f32(),
            ScaleDtype::F32 => x,
        }
    }
}

/// Asymmetric min-max quantization with `bits` bits in groups of `group` along `axis`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MinMax {
    /// Bits per element: 2, 4 or 8.
    pub bits: u32,
    /// Group size `G`.
    pub group: usize,
    /// Per channel (groups of tokens; keys) or per token (groups of channels; values).
    pub axis: Axis,
    /// Precision of stored scale and minimum.
    #[serde(default)]
    pub scale_dtype: ScaleDtype,
    /// Arithmetic of the fused decode products (`exact` f32 or `int8`
    /// integer products, docs/algorithms.md §1 "Integer products").
    #[serde(default)]
    pub arithmetic: Arithmetic,
}

impl Default for MinMax {
    fn default() -> Self {
        Self {
            bits: 2,
            group: 16,
            axis: Axis::Channel,
            scale_dtype: ScaleDtype::F16,
            arithmetic: Arithmetic::Exact,
        }
    }
}

/// Arithmetic of the fused dequantize-and-attend products.
///
/// `exact` multiplies the codes in f32 (the scores and outputs of
/// dequantize-then-attend up to f32 rounding). `int8` rounds the query
/// (scales folded in per key group, one step per head and segment of 4096
/// tokens) and the attention weights (times the value scales, one step per
/// head, channel group and block of 32 tokens) to 8 bits and multiplies
/// codes in integers (512-bit `vpdpbusd` and `vpermb` where the CPU has
/// AVX-512 VNNI and VBMI, 256-bit `vpdpbusd` with VNNI, `vpmaddubsw`
/// otherwise, a portable loop elsewhere: all give bitwise the same result);
/// decode then splits long heads into those segments flash-decoding style
/// (docs/algorithms.md §1). Only 2- and 4-bit
/// codes with `group` a multiple of the codes per word have integer
/// kernels; other stores run `exact`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Arithmetic {
    /// f32 products (the default).
    #[default]
    Exact,
    /// 8-bit query / weights times codes, integer sums.
    Int8,
}

#[typetag::serde(name = "minmax")]
impl Quantizer for MinMax {
    fn bits(&self) -> u32 {
        self.bits
    }
    fn group(&self) -> usize {
        self.group
    }
    fn axis(&self) -> Axis {
        self.axis
    }
    fn validate(&self, head_dim: usize) -> Result<()> {
        check_bits(self.bits)?;
        if self.group == 0 {
            return Err(Error::config("group", "must be positive"));
        }
        let per_word = 32 / self.bits as usize;
        match self.axis {
            Axis::Token => {
                if !head_dim.is_multiple_of(self.group) {
                    return Err(Error::config(
                        "group",
                        format!(
                            "per-token groups of {} do not divide the head dim {head_dim}",
                            self.group
                        ),
                    ));
                }
                if !head_dim.is_multiple_of(per_word) {
                    return Err(Error::config(
                        "bits",
                        format!(
                            "head dim {head_dim} is not a multiple of {per_word} codes per 32-bit word"
                        ),
                    ));
                }
            }
            Axis::Channel => {}
        }
        Ok(())
    }
    fn new_store(&self, head_dim: usize, page_tokens: usize) -> Result<Box<dyn QuantStore>> {
        self.validate(head_dim)?;
        Ok(Box::new(MinMaxStore::new(*self, head_dim, page_tokens)))
    }
    fn min_max(&self) -> Option<minikv_core::MinMaxSpec> {
        Some(minikv_core::MinMaxSpec {
            bits: self.bits,
            group: self.group,
            axis: self.axis,
            f16_scales: self.scale_dtype == ScaleDtype::F16,
            int8_products: self.arithmetic == Arithmetic::Int8,
        })
    }
}

minikv_core::register!(
    Quantizer,
    "minmax",
    MinMax,
    "asymmetric min-max (KIVI): bits 2/4/8, group G, axis channel|token, fp16 or f32 scale/min, arithmetic exact|int8"
);

/// One quantized group: codes, scale and minimum (f32, before storage rounding).
#[derive(Debug, Clone, PartialEq)]
pub struct Group {
    /// Codes in `0 ..= 2^b - 1`.
    pub codes: Vec<u8>,
    /// `(max - min) / (2^b - 1)`; 0 for a constant group.
    pub scale: f32,
    /// The group minimum.
    pub min: f32,
}

/// Quantizes one group exactly as docs/algorithms.md §1: clamp, then round half to even.
/// A constant group gives code 0 and scale 0. NaN or infinite inputs are an error.
pub fn quantize_group(x: &[f32], bits: u32) -> Result<Group> {
    minikv_core::check_finite("quantize", x)?;
    if x.is_empty() {
        return Err(Error::Input("quantize: empty group".into()));
    }
    let mn = x.iter().copied().fold(f32::INFINITY, f32::min);
    let mx = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let qmax = ((1u32 << bits) - 1) as f32;
    let scale = (mx - mn) / qmax;
    if !scale.is_finite() {
        return Err(Error::Input(format!(
            "quantize: range {mn}..{mx} overflows f32"
        )));
    }
    let codes = if scale == 0.0 {
        vec![0u8; x.len()]
    } else {
        x.iter().map(|&v| code_of(v, mn, scale, qmax)).collect()
    };
    Ok(Group {
        codes,
        scale,
        min: mn,
    })
}

#[inline]
fn code_of(v: f32, mn: f32, scale: f32, qmax: f32) -> u8 {
    ((v - mn) / scale).clamp(0.0, qmax).round_ties_even() as u8
}

/// Packs codes LSB-first, `32 / bits` per word; a partial last word is zero-padded.
pub fn pack(codes: &[u8], bits: u32) -> Vec<u32> {
    let per = 32 / bits as usize;
    codes
        .chunks(per)
        .map(|c| {
            c.iter()
                .enumerate()
                .fold(0u32, |w, (j, &x)| w | ((x as u32) << (bits as usize * j)))
        })
        .collect()
}

/// Unpacks `n` codes packed by [`pack`].
pub fn unpack(words: &[u32], bits: u32, n: usize) -> Vec<u8> {
    let per = 32 / bits as usize;
    let mask = (1u32 << bits) - 1;
    (0..n)
        .map(|i| ((words[i / per] >> (bits as usize * (i % per))) & mask) as u8)
        .collect()
}

/// A row quantized for inspection (`minikv quantize`).
#[derive(Debug, Clone, Serialize)]
pub struct QuantizedRow {
    /// Codes per element.
    pub codes: Vec<u8>,
    /// Packed words as `0x...` strings.
    pub packed: Vec<String>,
    /// Stored scale per group (as f32).
    pub scale: Vec<f32>,
    /// Stored minimum per group (as f32).
    pub min: Vec<f32>,
    /// Reconstruction from the stored values.
    pub dequant: Vec<f32>,
    /// `max |x - dequant|`.
    pub max_abs_error: f32,
}

/// Quantizes a row along its length in groups of `group`, storing scale/min as `dtype`.
pub fn quantize_row(x: &[f32], bits: u32, group: usize, dtype: ScaleDtype) -> Result<QuantizedRow> {
    check_bits(bits)?;
    if group == 0 || !x.len().is_multiple_of(group) {
        return Err(Error::config(
            "group",
            format!(
                "group size {group} does not divide the row length {}",
                x.len()
            ),
        ));
    }
    let mut codes = Vec::with_capacity(x.len());
    let (mut scale, mut min, mut dequant) = (Vec::new(), Vec::new(), Vec::new());
    for chunk in x.chunks(group) {
        let g = quantize_group(chunk, bits)?;
        let (s, m) = store_pair(dtype, g.scale, g.min)?;
        dequant.extend(g.codes.iter().map(|&c| c as f32 * s + m));
        codes.extend_from_slice(&g.codes);
        scale.push(s);
        min.push(m);
    }
    let max_abs_error = x
        .iter()
        .zip(&dequant)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    Ok(QuantizedRow {
        packed: pack(&codes, bits)
            .iter()
            .map(|w| format!("{w:#010x}"))
            .collect(),
        codes,
        scale,
        min,
        dequant,
        max_abs_error,
    })
}

/// Bits must be 2, 4 or 8.
fn check_bits(bits: u32) -> Result<()> {
    if ![2, 4, 8].contains(&bits) {
        return Err(Error::config(
            "bits",
            format!("must be 2, 4 or 8, got {bits}"),
        ));
    }
    Ok(())
}

/// Rounds scale and min to the storage dtype; f16 overflow is an error, never inf.
pub(crate) fn store_pair(dtype: ScaleDtype, scale: f32, min: f32) -> Result<(f32, f32)> {
    let (s, m) = (dtype.round(scale), dtype.round(min));
    if !s.is_finite() || !m.is_finite() {
        return Err(Error::Input(format!(
            "quantize: scale {scale} or min {min} overflows fp16 storage; use scale_dtype = \"f32\""
        )));
    }
    Ok((s, m))
}
