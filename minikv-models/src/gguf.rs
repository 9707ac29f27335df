//! GGUF v2/v3 reader. The file is memory-mapped; every count, length, offset and
//! size is validated against the file before anything is allocated or read, so a
//! truncated or malicious file gives an error that names the key or tensor.

use crate::blocks::GgmlType;
use minikv_core::{Error, Result};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// Unsigned integer (u8..u64).
    U64(u64),
    /// Signed integer (i8..i64).
    I64(i64),
    /// Float (f32, f64).
    F64(f64),
    /// Boolean.
    Bool(bool),
    /// UTF-8 string.
    Str(String),
    /// Array.
    Array(Vec<Value>),
}

impl Value {
    /// As an unsigned integer.
    pub fn as_u64(&self) -> Option<u64> {
        match self {
            Value::U64(v) => Some(*v),
            Value::I64(v) if *v >= 0 => Some(*v as u64),
            _ => None,
        }
    }
    /// As a float.
    pub fn as_f64(&self) -> Option<f64> {
        match self {
            Value::F64(v) => Some(*v),
            Value::U64(v) => Some(*v as f64),
            Value::I64(v) => Some(*v as f64),
            _ => None,
        }
    }
    /// As a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }
}

/// One tensor's description.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    /// Name.
    pub name: String,
    /// Dimensions, fastest first (ggml order: `dims[0]` is the row length).
    pub dims: Vec<usize>,
    /// Element type.
    pub dtype: GgmlType,
    /// Absolute byte offset of the data in the file.
    pub offset: usize,
    /// Size in bytes.
    pub size: usize,
}

impl TensorInfo {
    /// Number of elements.
    pub fn n_elements(&self) -> usize {
        self.dims.iter().product()
    }
}

/// A parsed GGUF file (memory-mapped).
#[derive(Debug)]
pub struct Gguf {
    /// Format version.
    pub version: u32,
    /// Metadata by key.
    pub metadata: BTreeMap<String, Value>,
    /// Tensors by name.
    pub tensors: BTreeMap<String, TensorInfo>,
    data: Arc<Bytes>,
}

/// The bytes of a model file: a memory map or an owned buffer (for tests/fuzzing).
#[derive(Debug)]
pub enum Bytes {
    /// Memory-mapped file.
    Mmap(memmap2::Mmap),
    /// Owned bytes.
    Owned(Vec<u8>),
}

impl std::ops::Deref for Bytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Bytes::Mmap(m) => m,
            Bytes::Owned(v) => v,
        }
    }
}

/// A byte range of shared model bytes.
#[derive(Debug, Clone)]
pub struct Blob {
    data: Arc<Bytes>,
    start: usize,
    len: usize,
}

impl Blob {
    /// Wraps owned bytes.
    pub fn owned(v: Vec<u8>) -> Self {
        let len = v.len();
        Self {
            data: Arc::new(Bytes::Owned(v)),
            start: 0,
            len,
        }
    }
    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.data[self.start..self.start + self.len]
    }

    /// The heap buffer under this blob, as (address, bytes of the whole
    /// buffer): `None` when it is the memory-mapped file. Blobs of one buffer
    /// give one address, so a sum over distinct addresses counts each
    /// allocation once.
    pub fn heap_buffer(&self) -> Option<(usize, usize)> {
        match &*self.data {
            Bytes::Mmap(_) => None,
            Bytes::Owned(v) => Some((v.as_ptr() as usize, v.capacity())),
        }
    }

    /// Bytes `start .. start + len` of this blob, sharing them (no copy).
    /// Panics past the end.
    pub fn slice(&self, start: usize, len: usize) -> Self {
        assert!(
            start.checked_add(len).is_some_and(|e| e <= self.len),
            "Blob::slice: {start} + {len} is past {} bytes",
            self.len
        );
        Self {
            data: self.data.clone(),
            start: self.start + start,
            len,
        }
    }

    /// The blobs one after another as one blob without a copy, when each
    /// starts where the one before ends in the same bytes (tensors stored
    /// back to back in one file); `None` otherwise.
    pub fn adjacent(parts: &[&Blob]) -> Option<Self> {
        let first = parts.first()?;
        let mut end = first.start + first.len;
        for b in &parts[1..] {
            if !Arc::ptr_eq(&b.data, &first.data) || b.start != end {
                return None;
            }
            end += b.len;
        }
        Some(Self {
            data: first.data.clone(),
            start: first.start,
            len: end - first.start,
        })
    }
}

const MAX_DIMS: u32 = 4;
/// Upper bound on array nesting (arrays of arrays).
const MAX_DEPTH: u32 = 2;

struct Cursor<'a> {
    b: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, what: &dyn Fn() -> String) -> Result<&'a [u8]> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.b.len())
            .ok_or_else(|| {
                Error::Format(format!(
                    "truncated file: {} needs {n} bytes at offset {}, file has {}",
                    what(),
                    self.pos,
                    self.b.len()
                ))
            })?;
        let s = &self.b[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32> {
        Ok(u32::from_le_bytes(
            self.take(4, what)?.try_into().expect("4 bytes"),
        ))
    }
    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64> {
        Ok(u64::from_le_bytes(
            self.take(8, what)?.try_into().expect("8 bytes"),
        ))
    }
    fn remaining(&self) -> usize {
        self.b.len() - self.pos
    }
    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String> {
        let n = self.u64(what)?;
        if n > self.remaining() as u64 {
            return Err(Error::Format(format!(
                "{}: string length {n} exceeds the {} bytes left",
                what(),
                self.remaining()
            )));
        }
        let s = self.take(n as usize, what)?;
        String::from_utf8(s.to_vec())
            .map_err(|_| Error::Format(format!("{}: string is not UTF-8", what())))
    }
    fn value(&mut self, ty: u32, key: &str, depth: u32) -> Result<Value> {
        let w = || format!("metadata `{key}`");
        Ok(match ty {
            0 => Value::U64(self.take(1, &w)?[0] as u64),
            1 => Value::I64(self.take(1, &w)?[0] as i8 as i64),
            2 => Value::U64(u16::from_le_bytes(self.take(2, &w)?.try_into().expect("2")) as u64),
            3 => Value::I64(i16::from_le_bytes(self.take(2, &w)?.try_into().expect("2")) as i64),
            4 => Value::U64(self.u32(&w)? as u64),
            5 => Value::I64(self.u32(&w)? as i32 as i64),
            6 => Value::F64(f32::from_bits(self.u32(&w)?) as f64),
            7 => Value::Bool(self.take(1, &w)?[0] != 0),
            8 => Value::Str(self.string(&w)?),
            9 => {
                if depth >= MAX_DEPTH {
                    return Err(Error::Format(format!(
                        "metadata `{key}`: arrays nested too deeply"
                    )));
                }
                let ety = self.u32(&w)?;
                let n = self.u64(&w)?;
                // Every element takes at least one byte: bound n before allocating.
                let min = match ety {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    8 | 10..=12 => 8,
                    9 => 12,
                    t => {
                        return Err(Error::Format(format!(
                            "metadata `{key}`: unknown array element type {t}"
                        )));
                    }
                };
                if n.saturating_mul(min) > self.remaining() as u64 {
                    return Err(Error::Format(format!(
                        "metadata `{key}`: array of {n} elements exceeds the {} bytes left",
                        self.remaining()
                    )));
                }
                let mut v = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    v.push(self.value(ety, key, depth + 1)?);
                }
                Value::Array(v)
            }
            10 => Value::U64(self.u64(&w)?),
            11 => Value::I64(self.u64(&w)? as i64),
            12 => Value::F64(f64::from_bits(self.u64(&w)?)),
            t => {
                return Err(Error::Format(format!(
                    "metadata `{key}`: unknown value type {t}"
                )));
            }
        })
    }
}

impl Gguf {
    /// Memory-maps and parses `path`.
    pub fn open(path: &Path) -> Result<Self> {
        let f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        // SAFETY: the file is opened read-only; minikv never writes model files
        // while they are mapped (a concurrent external writer is the user's problem,
        // as with every mmap-based model loader).
        let map = unsafe { memmap2::Mmap::map(&f) }.map_err(|e| Error::io(path, e))?;
        Self::parse(Bytes::Mmap(map)).map_err(|e| match e {
            Error::Format(m) => Error::Format(format!("{}: {m}", path.display())),
            e => e,
        })
    }

    /// Parses GGUF bytes.
    pub fn parse(bytes: Bytes) -> Result<Self> {
        let data = Arc::new(bytes);
        let b: &[u8] = &data;
        let mut c = Cursor { b, pos: 0 };
        let hdr = || "header".to_string();
        let magic = c.take(4, &hdr)?;
        if magic != b"GGUF" {
            return Err(Error::Format(format!(
                "not a GGUF file (magic {magic:02x?})"
            )));
        }
        let version = c.u32(&hdr)?;
        if !(2..=3).contains(&version) {
            return Err(Error::Format(format!(
                "unsupported GGUF version {version} (2 and 3 are supported)"
            )));
        }
        let n_tensors = c.u64(&hdr)?;
        let n_kv = c.u64(&hdr)?;
        if n_kv == 0 {
            return Err(Error::Format(
                "the header declares no metadata entries; a GGUF model needs them (general.architecture, shapes, tokenizer)".into(),
            ));
        }
        // A KV pair takes >= 12 bytes, a tensor info >= 28: bound the counts by the file.
        if n_kv.saturating_mul(12) > c.remaining() as u64 {
            return Err(Error::Format(format!(
                "header claims {n_kv} metadata entries, more than the file can hold"
            )));
        }
        if n_tensors.saturating_mul(28) > c.remaining() as u64 {
            return Err(Error::Format(format!(
                "header claims {n_tensors} tensors, more than the file can hold"
            )));
        }
        let mut metadata = BTreeMap::new();
        for i in 0..n_kv {
            let key = c.string(&|| format!("metadata key #{i}"))?;
            let ty = c.u32(&|| format!("metadata `{key}` type"))?;
            let v = c.value(ty, &key, 0)?;
            if metadata.contains_key(&key) {
                return Err(Error::Format(format!(
                    "metadata key `{key}` appears twice (entry #{i}); a GGUF holds each key once"
                )));
            }
            metadata.insert(key, v);
        }
        let align = alignment(&metadata)?;
        let mut infos = Vec::with_capacity(n_tensors as usize);
        for i in 0..n_tensors {
            let name = c.string(&|| format!("tensor #{i} name"))?;
            let w = || format!("tensor `{name}`");
            let nd = c.u32(&w)?;
            if nd == 0 || nd > MAX_DIMS {
                return Err(Error::Format(format!(
                    "tensor `{name}`: {nd} dimensions (1..=4 supported)"
                )));
            }
            let mut dims = Vec::with_capacity(nd as usize);
            for _ in 0..nd {
                let d = c.u64(&w)?;
                if d == 0 || d > u32::MAX as u64 {
                    return Err(Error::Format(format!(
                        "tensor `{name}`: dimension {d} out of range"
                    )));
                }
                dims.push(d as usize);
            }
            let ty = c.u32(&w)?;
            let dtype = GgmlType::from_id(ty).ok_or_else(|| Error::Format(format!("tensor `{name}`: unsupported tensor type id {ty} (supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q6_K)")))?;
            let off = c.u64(&w)?;
            infos.push((name, dims, dtype, off));
        }
        let data_start = c.pos.div_ceil(align) * align;
        let tensors = place_tensors(infos, data_start, align, b.len())?;
        Ok(Self {
            version,
            metadata,
            tensors,
            data,
        })
    }

    /// A 1-D tensor of `n` elements as f32 (norm weights); a non-finite
    /// element is an error naming the tensor.
    pub fn vector(&self, name: &str, n: usize) -> Result<Vec<f32>> {
        let t = self.tensor(name)?;
        if t.n_elements() != n {
            return Err(Error::Format(format!(
                "tensor `{name}` has {} elements, expected {n}",
                t.n_elements()
            )));
        }
        let mut v = vec![0.0; n];
        crate::blocks::dequantize_row(t.dtype, self.blob(t).bytes(), &mut v);
        if let Some(i) = v.iter().position(|x| !x.is_finite()) {
            return Err(Error::Format(format!(
                "tensor `{name}`: element {i} is not finite"
            )));
        }
        Ok(v)
    }

    /// Checks that every `blk.N.*` tensor belongs to a layer below
    /// `{arch}.block_count` (`n_layers`).
    pub fn check_block_count(&self, arch: &str, n_layers: usize) -> Result<()> {
        let extra = self
            .tensors
            .keys()
            .filter_map(|n| {
                n.strip_prefix("blk.")?
                    .split('.')
                    .next()?
                    .parse::<usize>()
                    .ok()
            })
            .filter(|&i| i >= n_layers)
            .max();
        match extra {
            Some(extra) => Err(Error::Format(format!(
                "metadata {arch}.block_count = {n_layers} but the file has tensors of layer {extra} (blk.{extra}.*)"
            ))),
            None => Ok(()),
        }
    }

    /// A metadata value, or an error naming the key.
    pub fn get(&self, key: &str) -> Result<&Value> {
        self.metadata
            .get(key)
            .ok_or_else(|| Error::Format(format!("missing metadata key `{key}`")))
    }

    /// An unsigned integer metadata value.
    pub fn get_usize(&self, key: &str) -> Result<usize> {
        self.get(key)?
            .as_u64()
            .map(|v| v as usize)
            .ok_or_else(|| Error::Format(format!("metadata `{key}` is not an unsigned integer")))
    }

    /// A float metadata value.
    pub fn get_f64(&self, key: &str) -> Result<f64> {
        self.get(key)?
            .as_f64()
            .ok_or_else(|| Error::Format(format!("metadata `{key}` is not a number")))
    }

    /// A string metadata value.
    pub fn get_str(&self, key: &str) -> Result<&str> {
        self.get(key)?
            .as_str()
            .ok_or_else(|| Error::Format(format!("metadata `{key}` is not a string")))
    }

    /// A tensor's info, or an error naming it.
    pub fn tensor(&self, name: &str) -> Result<&TensorInfo> {
        self.tensors
            .get(name)
            .ok_or_else(|| Error::Format(format!("missing tensor `{name}`")))
    }

    /// A tensor's bytes (shared, zero-copy).
    pub fn blob(&self, t: &TensorInfo) -> Blob {
        Blob {
            data: self.data.clone(),
            start: t.offset,
            len: t.size,
        }
    }
}

/// The data section's alignment (`general.alignment`, default 32).
fn alignment(metadata: &BTreeMap<String, Value>) -> Result<usize> {
    Ok(match metadata.get("general.alignment") {
        None => 32,
        Some(v) => {
            let a = v
                .as_u64()
                .ok_or_else(|| Error::Format("general.alignment is not an integer".into()))?;
            if a == 0 || !a.is_power_of_two() || a > 1 << 20 {
                return Err(Error::Format(format!(
                    "general.alignment = {a} is not a power of two <= 1 MiB"
                )));
            }
            a as usize
        }
    })
}

/// Places each tensor in the data section: checked sizes, alignment, bounds
/// and unique names.
fn place_tensors(
    infos: Vec<(String, Vec<usize>, GgmlType, u64)>,
    data_start: usize,
    align: usize,
    file_len: usize,
) -> Result<BTreeMap<String, TensorInfo>> {
    let mut tensors = BTreeMap::new();
    for (name, dims, dtype, off) in infos {
        let n = dims
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .ok_or_else(|| Error::Format(format!("tensor `{name}`: element count overflows")))?;
        if dims[0] % dtype.block_size() != 0 {
            return Err(Error::Format(format!(
                "tensor `{name}`: row length {} is not a multiple of the {dtype:?} block size {}",
                dims[0],
                dtype.block_size()
            )));
        }
        let size = (n / dtype.block_size())
            .checked_mul(dtype.block_bytes())
            .ok_or_else(|| Error::Format(format!("tensor `{name}`: byte size overflows")))?;
        if off % align as u64 != 0 {
            return Err(Error::Format(format!(
                "tensor `{name}`: offset {off} is not aligned to {align}"
            )));
        }
        let offset = (data_start as u64)
            .checked_add(off)
            .filter(|&s| s <= file_len as u64)
            .ok_or_else(|| {
                Error::Format(format!(
                    "tensor `{name}`: offset {off} is past the end of the file"
                ))
            })? as usize;
        if offset.checked_add(size).is_none_or(|e| e > file_len) {
            return Err(Error::Format(format!(
                "tensor `{name}`: {size} bytes at offset {offset} run past the end of the file ({} bytes): truncated?",
                file_len
            )));
        }
        if tensors
            .insert(
                name.clone(),
                TensorInfo {
                    name: name.clone(),
                    dims,
                    dtype,
                    offset,
                    size,
                },
            )
            .is_some()
        {
            return Err(Error::Format(format!("tensor `{name}` appears twice")));
        }
    }
    Ok(tensors)
}
