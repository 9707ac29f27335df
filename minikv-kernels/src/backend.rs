//! The CUDA attention backend: prefill (with `A_cumul`) and fused decode
//! through minikv.cu's kernels on any [`Device`], with device-resident
//! stores created by its storage factory.

use crate::decode::{DecodeKernel, combine_threads, decode_plan};
use crate::device::{Arg, Batched, Calls, Device, Launch, Scratch, err, int};
pub use crate::prefill::PrefillKernelTimes;
pub use crate::prefill::PrefillPath;
use crate::prefill::{Rows, Staged, f16_rows};
use crate::resident::Histories;
use crate::store::{DeviceFpStore, DeviceQuantStore, Staging};
use minikv_core::attention::{
    AttentionBackend, DecodeArgs, PrefillArgs, check_decode, check_prefill,
};
use minikv_core::storage::{FpStore, StorageFactory};
use minikv_core::{Axis, Error, KvHistory, MinMaxSpec, QuantStore, Quantizer, Result};
use std::sync::{Arc, Mutex};

/// Threads per block of the attention kernels (`MK_THREADS`).
pub(crate) const THREADS: u32 = 128;
/// Largest head dimension the kernels take (`MK_MAX_D`).
pub const MAX_HEAD_DIM: usize = 256;
/// Tokens per split of the fused decode (flash-decoding; `MK_CHUNK` of
/// the fast kernel).
pub const DECODE_CHUNK: usize = 256;
/// `MkQuant` of minikv.cu with device addresses (same C layout; the padding
/// is explicit so that the struct is plain bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct MkQuant {
    /// Packed words.
    pub words: u64,
    /// Scales (fp16 bits or f32).
    pub scale: u64,
    /// Minimums.
    pub minv: u64,
    /// Tokens held.
    pub n: i32,
    /// Group size.
    pub group: i32,
    /// Bits per code.
    pub bits: i32,
    /// 0: per channel, 1: per token.
    pub axis: i32,
    /// 1: fp16 scales, 0: f32.
    pub f16: i32,
    /// 1: integer key products in the fast decode kernels (`arithmetic =
    /// "int8"` on per-channel 2- or 4-bit keys), else 0.
    pub i8: i32,
}

/// `MkHead` of minikv.cu with device addresses.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct MkHead {
    /// Quantized keys.
    pub k: MkQuant,
    /// Quantized values.
    pub v: MkQuant,
    /// fp16 residual keys: `len - k.n` rows of a ring.
    pub fk: u64,
    /// fp16 residual values: `len - v.n` rows of a ring.
    pub fv: u64,
    /// Tokens held.
    pub len: i32,
    /// Slot of residual key 0.
    pub fk0: i32,
    /// Slots of the key ring.
    pub fkcap: i32,
    /// Slot of residual value 0.
    pub fv0: i32,
    /// Slots of the value ring.
    pub fvcap: i32,
    /// Padding.
    pub pad0: i32,
    /// Extra entries' keys `[n_extra][d]`, fp16.
    pub ek: u64,
    /// Extra entries' values.
    pub ev: u64,
    /// Extra entries' logit bias (f32).
    pub ebias: u64,
    /// Extra entries.
    pub n_extra: i32,
    /// Padding.
    pub pad1: i32,
}

const _: () = assert!(std::mem::size_of::<MkQuant>() == 48);
const _: () = assert!(std::mem::size_of::<MkHead>() == 168);

/// Creates device-resident stores.
#[derive(Debug)]
pub struct DeviceStorage {
    dev: Arc<dyn Device>,
    staging: Arc<Staging>,
}

impl StorageFactory for DeviceStorage {
    fn fp_store(&self, head_dim: usize, page_tokens: usize) -> Box<dyn FpStore> {
        Box::new(DeviceFpStore::new(self.dev.clone(), head_dim, page_tokens))
    }
    fn quant_store(
        &self,
        q: &dyn Quantizer,
        head_dim: usize,
        page_tokens: usize,
    ) -> Result<Box<dyn QuantStore>> {
        q.validate(head_dim)?;
        let spec = q.min_max().ok_or_else(|| {
            err(format!(
                "the quantizer {q:?} is not the min-max quantizer the CUDA kernels implement"
            ))
        })?;
        Ok(Box::new(DeviceQuantStore::new(
            self.dev.clone(),
            self.staging.clone(),
            spec,
            head_dim,
            page_tokens,
        )?))
    }
}

/// True when a store's keys get integer products in the fast decode
/// kernels: `arithmetic = "int8"` on per-channel 2- or 4-bit codes whose
/// scale groups hold whole words (where the CPU's integer kernels apply;
/// other stores multiply in f32 on both backends).
pub(crate) fn int8_keys(sp: &MinMaxSpec) -> bool {
    sp.int8_products
        && (sp.bits == 2 || sp.bits == 4)
        && sp.axis == Axis::Channel
        && sp.group.is_multiple_of(32 / sp.bits as usize)
}

/// SnapKV's pooling of window scores (`same` padding).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowPooling {
    /// Kernel size (odd in SnapKV's configs).
    pub kernel: usize,
    /// Max pooling (else average, zero padding counted).
    pub max: bool,
}

/// The CUDA backend over a [`Device`]: the real GPU ([`crate::cuda_backend`])
/// or, with the `emulate` feature, the CPU emulation of the same kernels.
#[derive(Debug)]
pub struct CudaBackend {
    batched: Arc<Batched>,
    dev: Arc<dyn Device>,
    storage: DeviceStorage,
    scratch: Mutex<Scratch>,
    histories: Mutex<Histories>,
    prefill_path: PrefillPath,
    decode_kernel: DecodeKernel,
    last_plan: Mutex<Option<DecodePlan>>,
}

/// How the last fused decode ran (for reports and tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct DecodePlan {
    /// The kernel launched.
    pub kernel: &'static str,
    /// Tokens per split.
    pub chunk: usize,
    /// Splits per head.
    pub splits: usize,
}

impl CudaBackend {
    /// A backend on `dev`, its small uploads queued and sent together
    /// ([`Batched`]).
    pub fn new(dev: Arc<dyn Device>) -> Self {
        let batched = Arc::new(Batched::new(dev));
        let dev: Arc<dyn Device> = batched.clone();
        Self {
            batched,
            storage: DeviceStorage {
                dev: dev.clone(),
                staging: Arc::default(),
            },
            dev,
            scratch: Mutex::default(),
            histories: Mutex::default(),
            prefill_path: PrefillPath::default(),
            decode_kernel: DecodeKernel::default(),
            last_plan: Mutex::default(),
        }
    }
    /// The backend with prefill and `A_cumul` on `path` (the default:
    /// [`PrefillPath::TensorCores`]).
    pub fn with_prefill_path(mut self, path: PrefillPath) -> Self {
        self.prefill_path = path;
        self
    }
    /// The backend with fused decode on `kernel` where the layout allows
    /// (the default: [`DecodeKernel::Fast`]).
    pub fn with_decode_kernel(mut self, kernel: DecodeKernel) -> Self {
        self.decode_kernel = kernel;
        self
    }
    /// Which fused decode kernel the common layouts take.
    pub fn decode_kernel(&self) -> DecodeKernel {
        self.decode_kernel
    }
    /// The kernel and splits of the last decode call (`None` before one).
    pub fn last_decode_plan(&self) -> Option<DecodePlan> {
        *self.last_plan.lock().unwrap_or_else(|p| p.into_inner())
    }
    /// Which kernels compute prefill attention and `A_cumul`.
    pub fn prefill_path(&self) -> PrefillPath {
        self.prefill_path
    }
    /// True when prefill with head dim `d` runs on the tensor-core kernels
    /// (fp16 operands), false when on the scalar f32 ones.
    pub fn prefill_on_tensor_cores(&self, d: usize) -> bool {
        Rows::use_mma(self.prefill_path, d)
    }
    /// The device (behind the upload queue).
    pub fn device(&self) -> &Arc<dyn Device> {
        &self.dev
    }
    /// The host-device calls made so far (what reached the device).
    pub fn calls(&self) -> Calls {
        self.batched.calls()
    }
    fn scratch(&self) -> std::sync::MutexGuard<'_, Scratch> {
        self.scratch.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn histories(&self) -> std::sync::MutexGuard<'_, Histories> {
        self.histories.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Prefill histories kept on the device (see
    /// [`PrefillArgs::history`](minikv_core::PrefillArgs::history)).
    pub fn kept_histories(&self) -> usize {
        self.histories().len()
    }

    /// Times the prefill kernels of this backend's path alone on `a` (no
    /// history): its operands uploaded once, then the forward kernel and,
    /// when `a` asks for `A_cumul`, the column sums, each launched `runs`
    /// times after an untimed launch and waited for; the best of each.
    /// Fills `a.out` and `a.cumulative` as [`AttentionBackend::prefill`]
    /// does (the same kernels on the same operands).
    pub fn time_prefill_kernels(
        &self,
        a: PrefillArgs<'_>,
        runs: usize,
    ) -> Result<PrefillKernelTimes> {
        crate::prefill::time_kernels(&mut self.scratch(), &self.dev, self.prefill_path, a, runs)
    }

    /// SnapKV's window scores on the device: the column sums of the softmax
    /// of the last `w` queries (`q_window [Hq][w][d]`, positions `t - w ..
    /// t`) over the first `t - w` keys, pooled with `kernel` (`max`: max
    /// pooling, else average; `same` padding). Returns `[Hq][t - w]`.
    pub fn window_scores(
        &self,
        q_window: &[f32],
        keys: &[&[f32]],
        d: usize,
        t: usize,
        w: usize,
        pool: WindowPooling,
    ) -> Result<Vec<f32>> {
        let WindowPooling { kernel, max } = pool;
        let hkv = keys.len();
        let hq = q_window.len() / (w * d).max(1);
        if hkv == 0 || w == 0 || w >= t || hq * w * d != q_window.len() || !hq.is_multiple_of(hkv) {
            return Err(Error::shape(
                "window scores (q_window, keys, w, t)",
                "q [Hq][w][d], Hkv | Hq, 0 < w < t",
                format!("{} floats, {hkv} heads, w {w}, t {t}", q_window.len()),
            ));
        }
        if d > MAX_HEAD_DIM || kernel == 0 {
            return Err(Error::shape(
                "window scores (head dim, pooling kernel)",
                "d <= 256, kernel > 0",
                format!("({d}, {kernel})"),
            ));
        }
        for k in keys {
            minikv_core::check_len("window keys", t * d, k.len())?;
        }
        let dev = &self.dev;
        let mut s = self.scratch();
        let (qp, mma, pipe, scale) =
            Rows::put_queries(&mut s, dev, self.prefill_path, q_window, d)?;
        let kp = if mma {
            s.put(dev, 1, &f16_rows(keys))?
        } else {
            let kall: Vec<f32> = keys.iter().flat_map(|k| k.iter().copied()).collect();
            s.put(dev, 1, &kall)?
        };
        // The values are not needed for the scores; pass the keys (same shape).
        let outp = s.get(dev, 2, hq * w * d * 4)?.ptr();
        let lsep = s.get(dev, 3, hq * w * 4)?.ptr();
        let zeros = vec![0.0f32; hq * t];
        let sp = s.put(dev, 4, &zeros)?;
        let pp = s.put(dev, 5, &zeros)?;
        let rows = Rows {
            q: qp,
            k: kp,
            hq,
            n: int(w)?,
            t: int(t)?,
            d: int(d)?,
            group: int(hq / hkv)?,
            scale,
            window: 0,
            mma,
            pipe,
        };
        rows.forward(dev, kp, outp, lsep)?;
        rows.column_sums(dev, lsep, sp, 0, rows.n)?;
        let p = t - w;
        dev.launch(
            "mk_pool1d",
            Launch {
                grid: (p.div_ceil(32) as u32, hq as u32, 1),
                block: (32, 1, 1),
            },
            &[
                Arg::Ptr(sp),
                Arg::Ptr(pp),
                Arg::I32(int(hq)?),
                Arg::I32(int(p)?),
                Arg::I32(rows.t),
                Arg::I32(int(kernel)?),
                Arg::I32(if max { 0 } else { 1 }),
            ],
        )?;
        let pooled: Vec<f32> = s.get(dev, 5, 0)?.to_vec(0, hq * t)?;
        Ok((0..hq)
            .flat_map(|h| pooled[h * t..h * t + p].iter().copied())
            .collect())
    }

    fn quant_view(z: Option<&dyn QuantStore>, what: &str, s: usize) -> Result<MkQuant> {
        let Some(z) = z else {
            return Ok(MkQuant {
                bits: 2,
                group: 1,
                ..Default::default()
            });
        };
        let dq = z.as_any().downcast_ref::<DeviceQuantStore>().ok_or_else(|| {
            err(format!(
                "decode head {s}: the quantized {what} are not a device store (created outside the cuda backend's storage factory)"
            ))
        })?;
        let sp = dq.spec();
        let (w, sc, mn) = dq.ptrs();
        Ok(MkQuant {
            words: w,
            scale: sc,
            minv: mn,
            n: int(dq.len())?,
            group: int(sp.group)?,
            bits: sp.bits as i32,
            axis: match sp.axis {
                Axis::Channel => 0,
                Axis::Token => 1,
            },
            f16: i32::from(sp.f16_scales),
            i8: i32::from(int8_keys(&sp)),
        })
    }

    /// The decode kernel's head table: device addresses and sizes of each
    /// storage head's stores, its extra entries' biases uploaded to slot 10.
    fn head_table(&self, a: &DecodeArgs<'_>, s: &mut Scratch) -> Result<Vec<MkHead>> {
        let dev = &self.dev;
        let mut heads = Vec::with_capacity(a.heads.len());
        let mut biases: Vec<f32> = Vec::new();
        let mut bias_at = Vec::with_capacity(a.heads.len());
        for (i, h) in a.heads.iter().enumerate() {
            let (fk, fk0, fkcap) = Self::fp_ring(h.fp_keys, "keys", i)?;
            let (fv, fv0, fvcap) = Self::fp_ring(h.fp_values, "values", i)?;
            let mut mk = MkHead {
                k: Self::quant_view(h.quant_keys, "keys", i)?,
                v: Self::quant_view(h.quant_values, "values", i)?,
                fk,
                fv,
                fk0,
                fkcap,
                fv0,
                fvcap,
                len: int(h.len())?,
                ..Default::default()
            };
            bias_at.push(biases.len());
            if let Some(x) = h.extra {
                if x.gate.is_some() {
                    return Err(err(format!(
                        "decode head {i}: gated extra entries (a logit gate) are not implemented by the cuda kernels"
                    )));
                }
                mk.ek = Self::fp_ptr(x.keys, "extra keys", i)?;
                mk.ev = Self::fp_ptr(x.values, "extra values", i)?;
                mk.n_extra = int(x.bias.len())?;
                biases.extend_from_slice(x.bias);
            }
            heads.push(mk);
        }
        if !biases.is_empty() {
            let bp = s.put(dev, 10, &biases)?;
            for (mk, &at) in heads.iter_mut().zip(&bias_at) {
                if mk.n_extra > 0 {
                    mk.ebias = bp + (at * 4) as u64;
                }
            }
        }
        Ok(heads)
    }

    /// A device fp store's (address, first slot, slots).
    fn fp_ring(f: &dyn FpStore, what: &str, s: usize) -> Result<(u64, i32, i32)> {
        f.as_any()
            .downcast_ref::<DeviceFpStore>()
            .map(|x| Ok((x.ptr(), int(x.start())?, int(x.capacity())?)))
            .ok_or_else(|| {
                let dbg = format!("{f:?}");
                let ty = dbg.split([' ', '{', '(']).next().unwrap_or("");
                err(format!(
                    "decode head {s}: the {what} are a {ty}, not a device store (the cuda backend does not run key-channel pruning or other store wrappers)"
                ))
            })?
    }

    /// A device fp store's address, its rows contiguous from slot 0.
    fn fp_ptr(f: &dyn FpStore, what: &str, s: usize) -> Result<u64> {
        let (p, start, _) = Self::fp_ring(f, what, s)?;
        if start != 0 {
            return Err(err(format!(
                "decode head {s}: the {what} start at ring slot {start}, not 0"
            )));
        }
        Ok(p)
    }
}

impl AttentionBackend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn prefill(&self, a: PrefillArgs<'_>) -> Result<()> {
        let (_, group) = check_prefill(&a)?;
        if a.head_dim > MAX_HEAD_DIM {
            return Err(Error::shape("cuda prefill head dim", "<= 256", a.head_dim));
        }
        if a.n == 0 {
            return Ok(());
        }
        let dev = &self.dev;
        let mut s = self.scratch();
        // Held to the end of the call: the kept rows' buffers stay alive.
        let mut hist = self.histories();
        let st = Staged::upload(&mut s, dev, self.prefill_path, &a, group, |mma| {
            a.history
                .map(|h| hist.rows(dev, h, a.keys, a.values, a.t, a.head_dim, mma))
                .transpose()
        })?;
        st.rows.forward(dev, st.v, st.out, st.lse)?;
        if let Some(c) = a.cumulative {
            let cp = s.put(dev, 5, c)?;
            st.rows.column_sums(dev, st.lse, cp, 0, st.rows.n)?;
            s.get(dev, 5, 0)?.read(0, c)?;
        }
        s.get(dev, 3, 0)?.read(0, a.out)?;
        Ok(())
    }

    fn release_history(&self, history: KvHistory) {
        self.histories().release(history);
    }

    fn decode(&self, a: DecodeArgs<'_>) -> Result<()> {
        let group = check_decode(&a)?;
        let d = a.head_dim;
        if d > MAX_HEAD_DIM {
            return Err(Error::shape("cuda decode head dim", "<= 256", d));
        }
        let hq = a.q.len() / d;
        let dev = &self.dev;
        let mut s = self.scratch();
        let heads = self.head_table(&a, &mut s)?;
        let longest = a
            .heads
            .iter()
            .map(|h| h.len() + h.n_extra())
            .max()
            .unwrap_or(0);
        let (kernel, rows, chunk) = decode_plan(self.decode_kernel, &heads, d, group, hq, longest);
        let splits = longest.div_ceil(chunk).max(1);
        *self.last_plan.lock().unwrap_or_else(|p| p.into_inner()) = Some(DecodePlan {
            kernel,
            chunk,
            splits,
        });
        let hp = s.put(dev, 11, &heads)?;
        let qp = s.put(dev, 12, a.q)?;
        let pm = s.get(dev, 13, hq * splits * 4)?.ptr();
        let pl = s.get(dev, 14, hq * splits * 4)?.ptr();
        let pacc = s.get(dev, 15, hq * splits * d * 4)?.ptr();
        // One result buffer, read back in one copy: the outputs, then (with
        // probabilities) each head's log-sum-exp and its logits.
        let nmax = a.heads.iter().map(|h| h.len()).max().unwrap_or(0);
        let (n_out, n_res) = match a.probs {
            Some(_) => (hq * d, hq * d + hq + hq * nmax),
            None => (hq * d, hq * d),
        };
        let op = s.get(dev, 16, n_res * 4)?.ptr();
        let (lse, lg) = if a.probs.is_some() {
            (op + (n_out * 4) as u64, op + ((n_out + hq) * 4) as u64)
        } else {
            (0, 0)
        };
        let scale = 1.0 / (d as f32).sqrt();
        dev.launch(
            kernel,
            Launch {
                grid: (splits as u32, rows as u32, 1),
                block: (THREADS, 1, 1),
            },
            &[
                Arg::Ptr(qp),
                Arg::Ptr(hp),
                Arg::I32(int(d)?),
                Arg::I32(int(group)?),
                Arg::F32(scale),
                Arg::I32(int(chunk)?),
                Arg::Ptr(pm),
                Arg::Ptr(pl),
                Arg::Ptr(pacc),
                Arg::Ptr(lg),
                Arg::I32(int(nmax)?),
            ],
        )?;
        dev.launch(
            "mk_decode_combine",
            Launch {
                // A block per query head and slice of 32 channels.
                grid: (hq as u32, d.div_ceil(32) as u32, 1),
                block: (combine_threads(splits)?, 1, 1),
            },
            &[
                Arg::Ptr(pm),
                Arg::Ptr(pl),
                Arg::Ptr(pacc),
                Arg::I32(int(splits)?),
                Arg::I32(int(d)?),
                Arg::Ptr(op),
                Arg::Ptr(lse),
            ],
        )?;
        let Some(probs) = a.probs else {
            return s.get(dev, 16, 0)?.read(0, a.out);
        };
        let res: Vec<f32> = s.get(dev, 16, 0)?.to_vec(0, n_res)?;
        a.out.copy_from_slice(&res[..n_out]);
        let (lses, logits) = res[n_out..].split_at(hq);
        for (h, p) in probs.iter_mut().enumerate() {
            let n = a.heads[h / group].len();
            p.clear();
            p.extend(
                logits[h * nmax..h * nmax + n]
                    .iter()
                    .map(|&x| (x - lses[h]).exp()),
            );
        }
        Ok(())
    }

    fn storage(&self) -> &dyn StorageFactory {
        &self.storage
    }
}
