//! The prefill launches of the CUDA backend: attention with each row's
//! log-sum-exp, and the column sums of the causal softmax (`A_cumul`, SnapKV's
//! window scores), on the scalar f32 kernels or on tensor cores.

use crate::backend::THREADS;
use crate::device::{Arg, DevPtr, Device, Launch, Scratch, int};
use minikv_core::{PrefillArgs, Result};
use std::sync::Arc;

/// One prefill-shaped attention on the device: `hq` query heads of `n`
/// rows `q [Hq][n][d]` at the last `n` of `t` positions, keys `[Hkv][t][d]`
/// (f32 for the scalar kernels, fp16 bits for the tensor-core ones).
pub(crate) struct Rows {
    pub(crate) q: DevPtr,
    pub(crate) k: DevPtr,
    pub(crate) hq: usize,
    pub(crate) n: i32,
    pub(crate) t: i32,
    pub(crate) d: i32,
    pub(crate) group: i32,
    pub(crate) scale: f32,
    pub(crate) window: i32,
    /// Run the tensor-core kernels (`mk_prefill_mma{64,128}`).
    pub(crate) mma: bool,
    /// With `mma`, run their pipelined forms
    /// (`mk_prefill_mma_pipe{64,128}`, `mk_column_sums_mma_pipe{64,128}`),
    /// whose queries `q` are fp16 bits of the queries times `scale`
    /// ([`f16_scaled`]).
    pub(crate) pipe: bool,
}

/// Which kernels compute prefill attention and `A_cumul`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PrefillPath {
    /// Tensor-core tiles (`mma.sync.m16n8k16`, fp16 operands, f32
    /// accumulation; FlashAttention-2's precision) for head dims 64 and 128,
    /// the scalar f32 kernels for other head dims.
    #[default]
    TensorCores,
    /// The scalar f32 kernels for every head dim (one block per query row).
    Scalar,
    /// [`PrefillPath::TensorCores`] with the forward pass on
    /// `mk_prefill_mma_pipe{64,128}` and `A_cumul` on
    /// `mk_column_sums_mma_pipe{64,128}`: the same products in the same
    /// order (the same bits), with key, value and query tiles staged by
    /// asynchronous copies ahead of their use, the B fragments loaded by
    /// `ldmatrix`, and the queries uploaded as fp16 (rounded on the host as
    /// the plain kernels round them on the device: half the bytes). Checked
    /// under the emulation and by ptxas; not yet timed on a GPU.
    Pipelined,
}

impl PrefillPath {
    /// The path named by `MINIKV_CUDA_PREFILL` (unset:
    /// [`PrefillPath::TensorCores`]; a value as [`PrefillPath::parse`]
    /// takes it).
    pub fn from_env() -> Result<Self> {
        match std::env::var("MINIKV_CUDA_PREFILL") {
            Err(_) => Ok(Self::TensorCores),
            Ok(v) => Self::parse(&v),
        }
    }
    /// `tensor-cores`, `pipelined` or `scalar` (empty: `tensor-cores`); any
    /// other name is an error that names it and the three.
    pub fn parse(name: &str) -> Result<Self> {
        match name.trim() {
            "" | "tensor-cores" => Ok(Self::TensorCores),
            "pipelined" => Ok(Self::Pipelined),
            "scalar" => Ok(Self::Scalar),
            other => Err(crate::device::err(format!(
                "MINIKV_CUDA_PREFILL={other:?}: expected \"tensor-cores\", \"pipelined\" or \"scalar\""
            ))),
        }
    }
    /// The name `MINIKV_CUDA_PREFILL` takes.
    pub fn name(self) -> &'static str {
        match self {
            Self::TensorCores => "tensor-cores",
            Self::Pipelined => "pipelined",
            Self::Scalar => "scalar",
        }
    }
}

/// Rows of f32 as fp16, one after another (keys or values `[Hkv][t][d]`
/// for the tensor-core kernels, which take them as fp16): rounded to
/// nearest even, as the kernels' own conversion, so the staged operands are
/// the bits an on-device rounding of the f32 gives; in parallel chunks.
pub(crate) fn f16_rows(rows: &[&[f32]]) -> Vec<half::f16> {
    use half::slice::HalfFloatSliceExt;
    use rayon::prelude::*;
    const CHUNK: usize = 1 << 16;
    let total: usize = rows.iter().map(|r| r.len()).sum();
    let mut out = vec![half::f16::ZERO; total];
    let mut rest = &mut out[..];
    let mut parts = Vec::with_capacity(rows.len());
    for r in rows {
        let (head, tail) = rest.split_at_mut(r.len());
        parts.push((head, *r));
        rest = tail;
    }
    parts.into_par_iter().for_each(|(dst, src)| {
        dst.par_chunks_mut(CHUNK)
            .zip(src.par_chunks(CHUNK))
            .for_each(|(d, s)| d.convert_from_f32_slice(s));
    });
    out
}

/// The queries times `scale` as fp16 bits, for the pipelined tensor-core
/// kernels: the f32 product rounded to nearest even, the operands the plain
/// kernels make of f32 queries on the device (the same bits), in half the
/// bytes.
pub(crate) fn f16_scaled(q: &[f32], scale: f32) -> Vec<half::f16> {
    use rayon::prelude::*;
    q.par_iter()
        .map(|&x| half::f16::from_f32(x * scale))
        .collect()
}

/// Query rows (fwd) or keys (column sums) per block of the tensor-core kernels.
const MMA_TILE: u32 = 64;

impl Rows {
    /// The pipelined kernels copy 16-byte units of their queries, keys and
    /// values: device buffers are allocated so, and a misaligned one (which
    /// no other kernel could read either: its queries are fp16) is an error.
    fn check_aligned(&self, ptrs: &[DevPtr]) -> Result<()> {
        match ptrs.iter().find(|p| !p.is_multiple_of(16)) {
            None => Ok(()),
            Some(p) => Err(crate::device::err(format!(
                "pipelined prefill: device address {p:#x} is not 16-byte aligned"
            ))),
        }
    }

    /// Uploads the queries to scratch slot 0 as `path`'s kernels take them
    /// (f32, or on the pipelined path fp16 times the scale); returns their
    /// address, whether the tensor-core kernels run, whether their pipelined
    /// forms do, and the scale 1 / sqrt(d).
    pub(crate) fn put_queries(
        s: &mut Scratch,
        dev: &Arc<dyn Device>,
        path: PrefillPath,
        q: &[f32],
        d: usize,
    ) -> Result<(DevPtr, bool, bool, f32)> {
        let mma = Self::use_mma(path, d);
        let pipe = mma && path == PrefillPath::Pipelined;
        let scale = 1.0 / (d as f32).sqrt();
        let qp = if pipe {
            s.put(dev, 0, &f16_scaled(q, scale))?
        } else {
            s.put(dev, 0, q)?
        };
        Ok((qp, mma, pipe, scale))
    }

    /// Whether `path` runs the tensor-core kernels for head dim `d`.
    pub(crate) fn use_mma(path: PrefillPath, d: usize) -> bool {
        path != PrefillPath::Scalar && (d == 64 || d == 128)
    }

    /// The forward kernel this shape runs and its grid's x size (scalar:
    /// one block per query row).
    pub(crate) fn forward_kernel(&self) -> (&'static str, u32) {
        let names = if self.pipe {
            [
                "mk_prefill_fwd",
                "mk_prefill_mma_pipe64",
                "mk_prefill_mma_pipe128",
            ]
        } else {
            ["mk_prefill_fwd", "mk_prefill_mma64", "mk_prefill_mma128"]
        };
        self.kernel(names, self.n, 1)
    }

    /// The column-sums kernel this shape runs and its grid's x size
    /// (scalar: one thread per key).
    pub(crate) fn column_sums_kernel(&self) -> (&'static str, u32) {
        let names = if self.pipe {
            [
                "mk_column_sums",
                "mk_column_sums_mma_pipe64",
                "mk_column_sums_mma_pipe128",
            ]
        } else {
            [
                "mk_column_sums",
                "mk_column_sums_mma64",
                "mk_column_sums_mma128",
            ]
        };
        self.kernel(names, self.t, THREADS)
    }

    /// Of `names` (scalar, tensor-core d = 64, d = 128), the kernel to run
    /// and the grid's x size for `rows` rows: 64 per block on tensor cores,
    /// `scalar_per_block` on the scalar kernel.
    fn kernel(
        &self,
        names: [&'static str; 3],
        rows: i32,
        scalar_per_block: u32,
    ) -> (&'static str, u32) {
        match (self.mma, self.d) {
            (true, 64) => (names[1], (rows as u32).div_ceil(MMA_TILE)),
            (true, _) => (names[2], (rows as u32).div_ceil(MMA_TILE)),
            _ => (names[0], (rows as u32).div_ceil(scalar_per_block)),
        }
    }

    /// `mk_prefill_fwd` (or its tensor-core form): outputs and each row's
    /// log-sum-exp.
    pub(crate) fn forward(
        &self,
        dev: &Arc<dyn Device>,
        v: DevPtr,
        out: DevPtr,
        lse: DevPtr,
    ) -> Result<()> {
        if self.pipe {
            self.check_aligned(&[self.q, self.k, v])?;
        }
        let (name, gx) = self.forward_kernel();
        dev.launch(
            name,
            Launch {
                grid: (gx, self.hq as u32, 1),
                block: (THREADS, 1, 1),
            },
            &[
                Arg::Ptr(self.q),
                Arg::Ptr(self.k),
                Arg::Ptr(v),
                Arg::Ptr(out),
                Arg::Ptr(lse),
                Arg::I32(self.n),
                Arg::I32(self.t),
                Arg::I32(self.d),
                Arg::I32(self.group),
                Arg::F32(self.scale),
                Arg::I32(self.window),
            ],
        )
    }
    /// `mk_column_sums` (or its tensor-core form) of rows `i_begin..i_end`,
    /// added into `cumul [Hq][t]`.
    pub(crate) fn column_sums(
        &self,
        dev: &Arc<dyn Device>,
        lse: DevPtr,
        cumul: DevPtr,
        i_begin: i32,
        i_end: i32,
    ) -> Result<()> {
        if self.pipe {
            self.check_aligned(&[self.q, self.k])?;
        }
        let (name, gx) = self.column_sums_kernel();
        dev.launch(
            name,
            Launch {
                grid: (gx, self.hq as u32, 1),
                block: (THREADS, 1, 1),
            },
            &[
                Arg::Ptr(self.q),
                Arg::Ptr(self.k),
                Arg::Ptr(lse),
                Arg::Ptr(cumul),
                Arg::I32(self.n),
                Arg::I32(self.t),
                Arg::I32(self.d),
                Arg::I32(self.group),
                Arg::F32(self.scale),
                Arg::I32(self.window),
                Arg::I32(i_begin),
                Arg::I32(i_end),
            ],
        )
    }
}

/// A prefill's operands on the device: its launch shape, the values, the
/// outputs `[Hq][n][d]` (scratch slot 3) and each row's log-sum-exp (slot 4).
pub(crate) struct Staged {
    pub(crate) rows: Rows,
    pub(crate) v: DevPtr,
    pub(crate) out: DevPtr,
    pub(crate) lse: DevPtr,
}

impl Staged {
    /// Uploads `a`'s queries (scratch slot 0) and, unless `kept` gives the
    /// device rows of its keys and values (it is told whether the
    /// tensor-core kernels run: they take fp16 rows, the scalar ones f32),
    /// its keys and values (slots 1 and 2); `group` query heads per KV
    /// head (`check_prefill`'s).
    pub(crate) fn upload(
        s: &mut Scratch,
        dev: &Arc<dyn Device>,
        path: PrefillPath,
        a: &PrefillArgs<'_>,
        group: usize,
        kept: impl FnOnce(bool) -> Result<Option<(DevPtr, DevPtr)>>,
    ) -> Result<Self> {
        let (hq, d, n, t) = (a.n_q_heads, a.head_dim, a.n, a.t);
        let (q, mma, pipe, scale) = Rows::put_queries(s, dev, path, a.q, d)?;
        let (k, v) = match kept(mma)? {
            Some(kv) => kv,
            // The tensor-core kernels take keys and values as fp16.
            None if mma => {
                let k = s.put(dev, 1, &f16_rows(a.keys))?;
                (k, s.put(dev, 2, &f16_rows(a.values))?)
            }
            None => {
                let mut kv = Vec::with_capacity(a.keys.len() * t * d);
                for k in a.keys {
                    kv.extend_from_slice(k);
                }
                let k = s.put(dev, 1, &kv)?;
                kv.clear();
                for v in a.values {
                    kv.extend_from_slice(v);
                }
                (k, s.put(dev, 2, &kv)?)
            }
        };
        let out = s.get(dev, 3, hq * n * d * 4)?.ptr();
        let lse = s.get(dev, 4, hq * n * 4)?.ptr();
        let rows = Rows {
            q,
            k,
            hq,
            n: int(n)?,
            t: int(t)?,
            d: int(d)?,
            group: int(group)?,
            scale,
            window: int(a.window.unwrap_or(0))?,
            mma,
            pipe,
        };
        Ok(Self { rows, v, out, lse })
    }
}

/// Device time of the prefill kernels alone, their operands already on the
/// device ([`crate::CudaBackend::time_prefill_kernels`]): what
/// FlashAttention-style figures measure, without the uploads, the host's
/// fp16 conversions and the download that a prefill call also pays.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct PrefillKernelTimes {
    /// The forward kernel (outputs and each row's log-sum-exp).
    pub forward_kernel: &'static str,
    /// Its best time over the timed runs, in seconds.
    pub forward_seconds: f64,
    /// The `A_cumul` kernel (its second pass over the tiles), when the call
    /// asked for `A_cumul`.
    pub column_sums_kernel: Option<&'static str>,
    /// Its best time, in seconds.
    pub column_sums_seconds: Option<f64>,
    /// Timed runs of each kernel (after one untimed run).
    pub runs: usize,
}

/// Waits until the device has run everything queued: a download of one
/// float from scratch slot 4, the log-sum-exp [`Staged::upload`] allocated
/// (downloads wait for the stream).
fn wait(s: &mut Scratch, dev: &Arc<dyn Device>) -> Result<()> {
    let mut one = [0.0f32; 1];
    s.get(dev, 4, 0)?.read(0, &mut one)
}

/// [`crate::CudaBackend::time_prefill_kernels`] on the backend's scratch.
pub(crate) fn time_kernels(
    s: &mut Scratch,
    dev: &Arc<dyn Device>,
    path: PrefillPath,
    a: PrefillArgs<'_>,
    runs: usize,
) -> Result<PrefillKernelTimes> {
    let (_, group) = minikv_core::attention::check_prefill(&a)?;
    if a.head_dim > crate::backend::MAX_HEAD_DIM || a.n == 0 || runs == 0 {
        return Err(crate::device::err(format!(
            "timing the prefill kernels needs a head dim of at most 256, queries and runs (d = {}, n = {}, runs = {runs})",
            a.head_dim, a.n
        )));
    }
    let st = Staged::upload(s, dev, path, &a, group, |_| Ok(None))?;
    // The best of `runs` after an untimed one; `prepare` runs before each
    // clock starts.
    let timed = |s: &mut Scratch,
                 prepare: &dyn Fn(&mut Scratch) -> Result<()>,
                 launch: &dyn Fn() -> Result<()>|
     -> Result<f64> {
        let mut best = f64::INFINITY;
        for run in 0..=runs {
            prepare(s)?;
            wait(s, dev)?;
            let t0 = std::time::Instant::now();
            launch()?;
            wait(s, dev)?;
            if run > 0 {
                best = best.min(t0.elapsed().as_secs_f64());
            }
        }
        Ok(best)
    };
    let forward_seconds = timed(s, &|_| Ok(()), &|| {
        st.rows.forward(dev, st.v, st.out, st.lse)
    })?;
    let mut times = PrefillKernelTimes {
        forward_kernel: st.rows.forward_kernel().0,
        forward_seconds,
        column_sums_kernel: None,
        column_sums_seconds: None,
        runs,
    };
    if let Some(c) = a.cumulative {
        let cp = s.get(dev, 5, c.len() * 4)?.ptr();
        // Each run adds into a fresh copy of the caller's sums, so they end
        // as one pass leaves them.
        let fresh: &[f32] = c;
        let secs = timed(s, &|s| s.get(dev, 5, 0)?.write(0, fresh), &|| {
            st.rows.column_sums(dev, st.lse, cp, 0, st.rows.n)
        })?;
        s.get(dev, 5, 0)?.read(0, c)?;
        times.column_sums_kernel = Some(st.rows.column_sums_kernel().0);
        times.column_sums_seconds = Some(secs);
    }
    s.get(dev, 3, 0)?.read(0, a.out)?;
    Ok(times)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prefill_path_is_chosen_by_name() {
        for p in [
            PrefillPath::TensorCores,
            PrefillPath::Pipelined,
            PrefillPath::Scalar,
        ] {
            assert_eq!(PrefillPath::parse(p.name()).unwrap(), p);
        }
        assert_eq!(PrefillPath::parse(" ").unwrap(), PrefillPath::TensorCores);
        let e = PrefillPath::parse("pipelnied").unwrap_err().to_string();
        assert!(
            e.contains("pipelnied") && e.contains("\"pipelined\""),
            "{e}"
        );
        // The queries as the pipelined kernels take them: each the fp16 of
        // its f32 product with the scale, in order (a long vector: rayon
        // splits it).
        let q: Vec<f32> = (0..200_000)
            .map(|i| (i as f32 * 0.37).sin() * 9.0)
            .collect();
        let want: Vec<u16> = q
            .iter()
            .map(|&x| half::f16::from_f32(x * 0.125).to_bits())
            .collect();
        let got: Vec<u16> = f16_scaled(&q, 0.125).iter().map(|h| h.to_bits()).collect();
        assert_eq!(got, want);
        // Both tensor-core paths take head dims 64 and 128 only.
        for (p, d, mma) in [
            (PrefillPath::Pipelined, 64, true),
            (PrefillPath::Pipelined, 128, true),
            (PrefillPath::Pipelined, 32, false),
            (PrefillPath::TensorCores, 128, true),
            (PrefillPath::Scalar, 128, false),
        ] {
            assert_eq!(Rows::use_mma(p, d), mma, "{p:?} d = {d}");
        }
    }
}
