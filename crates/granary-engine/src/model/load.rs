//! Reading weight files into the engine's tensors.
//!
//! The parallel path (what [`super::Model::load`] uses) parses the header
//! (GGUF through candle's `gguf_file::Content::read`, safetensors through the
//! `safetensors` crate's `Metadata`), allocates every tensor's final host
//! buffer (the `Vec` of quantized blocks or elements candle will own), and
//! then has several threads fill those buffers with large positioned reads
//! (`preadv`, up to [`ReadOptions::chunk_bytes`] each: a large tensor is
//! split, small neighbours share one vectored read), taken in file order
//! so the disk sees a few sequential streams; each read's pages are mapped
//! in bulk first (`MADV_POPULATE_WRITE`). Nothing is read into a
//! staging buffer and copied: each buffer becomes a `QTensor` or `Tensor`
//! as it is. The file's blake3 (the model fingerprint that names KV blocks)
//! is computed while the reads run, from the same memory, chunk by chunk in
//! file order, each chunk hashed on every core (blake3's tree); header and
//! padding bytes are read into small scratch buffers for it.
//!
//! The naive path reads each whole file into one `Vec<u8>` and parses it
//! with the library calls the engine used before (`Content::read` and
//! `Content::tensor` over a cursor; `candle_core::safetensors::load_buffer`),
//! which copies every tensor out of that buffer. It is kept to measure the
//! parallel path against (`granary bench load`) and as a fallback
//! ([`Loader::Naive`]).
//!
//! Both paths stop at the tensors as stored. What the engine does next
//! (dequantizing, fusing projections, re-quantizing to int8 tiles) is
//! conversion, timed apart in [`super::LoadStats`].

use std::collections::HashMap;
use std::fs::File;
use std::io::Cursor;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use candle_core::quantized::k_quants::{
    BlockQ2K, BlockQ3K, BlockQ4K, BlockQ4_0, BlockQ4_1, BlockQ5K, BlockQ5_0, BlockQ5_1, BlockQ6K, BlockQ8K, BlockQ8_0,
    BlockQ8_1,
};
use candle_core::quantized::{gguf_file, GgmlDType, QStorage, QTensor};
use candle_core::{Device, Tensor};
use half::{bf16, f16};
use serde::Serialize;

/// Which path [`super::Model::load`] reads weights with.
#[derive(Debug, Clone)]
pub enum Loader {
    /// Parallel positioned reads straight into the tensors' buffers.
    Parallel(ReadOptions),
    /// The whole file into memory, then parsed (the comparison baseline).
    Naive,
}

impl Default for Loader {
    fn default() -> Self {
        Loader::Parallel(ReadOptions::default())
    }
}

impl Loader {
    pub fn name(&self) -> &'static str {
        match self {
            Loader::Parallel(_) => "parallel",
            Loader::Naive => "naive",
        }
    }
}

/// How the parallel path reads.
#[derive(Debug, Clone)]
pub struct ReadOptions {
    /// Reader threads (`GRANARY_LOAD_THREADS` overrides the default of 8).
    pub threads: usize,
    /// Largest single read; tensors above it are split.
    pub chunk_bytes: usize,
    /// Compute the blake3 of the files (in order) while reading.
    pub fingerprint: bool,
}

/// Default number of reader threads.
pub const DEFAULT_THREADS: usize = 8;
/// Default largest read.
pub const DEFAULT_CHUNK: usize = 16 << 20;
/// Smallest piece a large tensor is split into when spreading a small file
/// over the threads.
const MIN_CHUNK: usize = 1 << 20;

impl Default for ReadOptions {
    fn default() -> Self {
        let threads = std::env::var("GRANARY_LOAD_THREADS")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .filter(|&n| n > 0)
            .unwrap_or(DEFAULT_THREADS);
        ReadOptions { threads, chunk_bytes: DEFAULT_CHUNK, fingerprint: true }
    }
}

/// What a read did.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ReadStats {
    /// `parallel` or `naive`.
    pub loader: &'static str,
    pub files: usize,
    pub tensors: usize,
    /// Bytes of tensor data.
    pub tensor_bytes: u64,
    /// Bytes read in all (whole files).
    pub file_bytes: u64,
    /// Opening the files and parsing their headers.
    #[serde(serialize_with = "as_ms")]
    pub header: Duration,
    /// Reading the tensor data into tensors (and the fingerprint, when asked).
    #[serde(serialize_with = "as_ms")]
    pub read: Duration,
    pub threads: usize,
    /// blake3 of the files, in order, when asked for.
    pub fingerprint: Option<String>,
}

fn as_ms<S: serde::Serializer>(d: &Duration, s: S) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_f64((d.as_secs_f64() * 1e6).round() / 1e3)
}

impl ReadStats {
    /// Header plus data.
    pub fn total(&self) -> Duration {
        self.header + self.read
    }

    /// File bytes over the whole time, in GB/s (10^9 bytes).
    pub fn gbps(&self) -> f64 {
        self.file_bytes as f64 / self.total().as_secs_f64().max(1e-9) / 1e9
    }
}

/// A GGUF file's header and tensors as stored.
pub struct GgufWeights {
    pub content: gguf_file::Content,
    pub tensors: HashMap<String, QTensor>,
    pub stats: ReadStats,
}

/// The tensors of one or more safetensors files, as stored.
pub struct SafetensorsWeights {
    pub tensors: HashMap<String, Tensor>,
    pub stats: ReadStats,
}

/// A pointer into a buffer that outlives the reader threads.
#[derive(Clone, Copy)]
pub(super) struct Dst(pub(super) *mut u8);
// SAFETY: each piece's range is written by exactly one thread, and read
// (hashed, or turned into a tensor) only after that thread has published
// its completion with release ordering.
unsafe impl Send for Dst {}
unsafe impl Sync for Dst {}

/// One read: `len` bytes of file `file` at `offset` into `dst`.
pub(super) struct Piece {
    pub(super) file: usize,
    pub(super) offset: u64,
    pub(super) len: usize,
    pub(super) dst: Dst,
    /// The tensor the bytes belong to (`None`: header or padding).
    pub(super) tensor: Option<usize>,
}

/// Everything one parallel read needs.
pub(super) struct Plan<'a> {
    pub(super) files: &'a [File],
    pub(super) paths: &'a [PathBuf],
    pub(super) names: &'a [String],
    /// Ordered by file, then offset.
    pub(super) pieces: Vec<Piece>,
}

/// Bytes that are not tensor data (header, alignment padding), read only
/// so that the fingerprint covers the whole file.
pub(super) struct Scratch(pub(super) Vec<Vec<u8>>);

impl Scratch {
    pub(super) fn piece(&mut self, file: usize, offset: u64, len: usize) -> Piece {
        let mut v = vec![0u8; len];
        let dst = Dst(v.as_mut_ptr());
        self.0.push(v);
        Piece { file, offset, len, dst, tensor: None }
    }
}

/// A tensor's final host buffer, allocated before its bytes are read: a
/// `Vec` of the element or block type candle stores it as.
macro_rules! host_buffers {
    ($name:ident { $($variant:ident($t:ty)),* $(,)? }) => {
        pub(super) enum $name {
            $($variant(Vec<$t>, usize)),*
        }

        impl $name {
            /// The buffer's memory (capacity, not yet initialised) and its length in bytes.
            pub(super) fn raw(&mut self) -> (*mut u8, usize) {
                match self {
                    $($name::$variant(v, n) => (v.as_mut_ptr().cast::<u8>(), *n * std::mem::size_of::<$t>())),*
                }
            }

            /// Marks the buffer as filled.
            ///
            /// # Safety
            /// Every byte of [`Self::raw`]'s range must have been written; any
            /// bit pattern is a valid value of the element type.
            pub(super) unsafe fn assume_filled(&mut self) {
                match self {
                    $($name::$variant(v, n) => unsafe { v.set_len(*n) }),*
                }
            }

            /// The filled bytes.
            #[allow(dead_code)]
            pub(super) fn bytes(&self) -> &[u8] {
                match self {
                    $($name::$variant(v, _) => {
                        // SAFETY: plain-old-data elements, viewed as bytes.
                        unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v.as_slice())) }
                    }),*
                }
            }
        }
    };
}

host_buffers!(QBuf {
    F32(f32),
    F16(f16),
    BF16(bf16),
    Q4_0(BlockQ4_0),
    Q4_1(BlockQ4_1),
    Q5_0(BlockQ5_0),
    Q5_1(BlockQ5_1),
    Q8_0(BlockQ8_0),
    Q8_1(BlockQ8_1),
    Q2K(BlockQ2K),
    Q3K(BlockQ3K),
    Q4K(BlockQ4K),
    Q5K(BlockQ5K),
    Q6K(BlockQ6K),
    Q8K(BlockQ8K),
});

/// A `Vec` with room for `n` elements, not yet initialised. (Asking for
/// transparent huge pages here was measured: fewer faults when free huge
/// pages exist, but multi-second stalls in direct compaction when memory is
/// fragmented, as on any long-running host. Pages are populated in bulk
/// before each read instead, see [`populate`].)
fn alloc<T>(n: usize) -> Vec<T> {
    Vec::with_capacity(n)
}

impl QBuf {
    pub(super) fn new(dtype: GgmlDType, blocks: usize) -> QBuf {
        match dtype {
            GgmlDType::F32 => QBuf::F32(alloc(blocks), blocks),
            GgmlDType::F16 => QBuf::F16(alloc(blocks), blocks),
            GgmlDType::BF16 => QBuf::BF16(alloc(blocks), blocks),
            GgmlDType::Q4_0 => QBuf::Q4_0(alloc(blocks), blocks),
            GgmlDType::Q4_1 => QBuf::Q4_1(alloc(blocks), blocks),
            GgmlDType::Q5_0 => QBuf::Q5_0(alloc(blocks), blocks),
            GgmlDType::Q5_1 => QBuf::Q5_1(alloc(blocks), blocks),
            GgmlDType::Q8_0 => QBuf::Q8_0(alloc(blocks), blocks),
            GgmlDType::Q8_1 => QBuf::Q8_1(alloc(blocks), blocks),
            GgmlDType::Q2K => QBuf::Q2K(alloc(blocks), blocks),
            GgmlDType::Q3K => QBuf::Q3K(alloc(blocks), blocks),
            GgmlDType::Q4K => QBuf::Q4K(alloc(blocks), blocks),
            GgmlDType::Q5K => QBuf::Q5K(alloc(blocks), blocks),
            GgmlDType::Q6K => QBuf::Q6K(alloc(blocks), blocks),
            GgmlDType::Q8K => QBuf::Q8K(alloc(blocks), blocks),
        }
    }

    /// The candle storage owning this very buffer (host), or a device copy.
    pub(super) fn into_qtensor(
        self,
        dtype: GgmlDType,
        dims: Vec<usize>,
        device: &Device,
    ) -> candle_core::Result<QTensor> {
        if !device.is_cpu() {
            return candle_core::quantized::ggml_file::qtensor_from_ggml(dtype, self.bytes(), dims, device);
        }
        let storage = match self {
            QBuf::F32(v, _) => QStorage::Cpu(Box::new(v)),
            QBuf::F16(v, _) => QStorage::Cpu(Box::new(v)),
            QBuf::BF16(v, _) => QStorage::Cpu(Box::new(v)),
            QBuf::Q4_0(v, _) => QStorage::Cpu(Box::new(v)),
            QBuf::Q4_1(v, _) => QStorage::Cpu(Box::new(v)),
            QBuf::Q5_0(v, _) => QStorage::Cpu(Box::new(v)),
            QBuf::Q5_1(v, _) => QStorage::Cpu(Box::new(v)),
            QBuf::Q8_0(v, _) => QStorage::Cpu(Box::new(v)),
            QBuf::Q8_1(v, _) => QStorage::Cpu(Box::new(v)),
            QBuf::Q2K(v, _) => QStorage::Cpu(Box::new(v)),
            QBuf::Q3K(v, _) => QStorage::Cpu(Box::new(v)),
            QBuf::Q4K(v, _) => QStorage::Cpu(Box::new(v)),
            QBuf::Q5K(v, _) => QStorage::Cpu(Box::new(v)),
            QBuf::Q6K(v, _) => QStorage::Cpu(Box::new(v)),
            QBuf::Q8K(v, _) => QStorage::Cpu(Box::new(v)),
        };
        QTensor::new(storage, dims)
    }
}

host_buffers!(TBuf {
    U8(u8),
    U32(u32),
    I16(i16),
    I32(i32),
    I64(i64),
    BF16(bf16),
    F16(f16),
    F32(f32),
    F64(f64),
    // Any other dtype: the bytes, converted by candle afterwards.
    Raw(u8),
});

impl TBuf {
    pub(super) fn new(dtype: safetensors::Dtype, elems: usize, bytes: usize) -> TBuf {
        use safetensors::Dtype as D;
        match dtype {
            D::U8 => TBuf::U8(alloc(elems), elems),
            D::U32 => TBuf::U32(alloc(elems), elems),
            D::I16 => TBuf::I16(alloc(elems), elems),
            D::I32 => TBuf::I32(alloc(elems), elems),
            D::I64 => TBuf::I64(alloc(elems), elems),
            D::BF16 => TBuf::BF16(alloc(elems), elems),
            D::F16 => TBuf::F16(alloc(elems), elems),
            D::F32 => TBuf::F32(alloc(elems), elems),
            D::F64 => TBuf::F64(alloc(elems), elems),
            _ => TBuf::Raw(alloc(bytes), bytes),
        }
    }

    /// A tensor owning this very buffer (host), or a device copy.
    pub(super) fn into_tensor(
        self,
        dtype: safetensors::Dtype,
        shape: &[usize],
        device: &Device,
    ) -> candle_core::Result<Tensor> {
        let host = Device::Cpu;
        let t = match self {
            TBuf::U8(v, _) => Tensor::from_vec(v, shape, &host)?,
            TBuf::U32(v, _) => Tensor::from_vec(v, shape, &host)?,
            TBuf::I16(v, _) => Tensor::from_vec(v, shape, &host)?,
            TBuf::I32(v, _) => Tensor::from_vec(v, shape, &host)?,
            TBuf::I64(v, _) => Tensor::from_vec(v, shape, &host)?,
            TBuf::BF16(v, _) => Tensor::from_vec(v, shape, &host)?,
            TBuf::F16(v, _) => Tensor::from_vec(v, shape, &host)?,
            TBuf::F32(v, _) => Tensor::from_vec(v, shape, &host)?,
            TBuf::F64(v, _) => Tensor::from_vec(v, shape, &host)?,
            TBuf::Raw(v, _) => {
                let view = safetensors::tensor::TensorView::new(dtype, shape.to_vec(), &v)
                    .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
                return candle_core::safetensors::Load::load(&view, device);
            }
        };
        if device.is_cpu() {
            Ok(t)
        } else {
            t.to_device(device)
        }
    }
}

pub(super) fn open(path: &Path) -> Result<File> {
    File::open(path).with_context(|| format!("open {}", path.display()))
}

pub(super) fn file_len(f: &File, path: &Path) -> Result<u64> {
    Ok(f.metadata().with_context(|| format!("stat {}", path.display()))?.len())
}

/// Parses a GGUF header. From memory when it fits in the first few MiB
/// (candle asks for the stream position before every string, and a file's
/// is a system call: tens of thousands for a tokenizer's vocabulary);
/// otherwise, or to report what is wrong, from the file.
pub(super) fn gguf_header(file: &File, path: &Path, len: u64) -> Result<gguf_file::Content> {
    use std::io::{Seek, SeekFrom};
    use std::os::unix::fs::FileExt;
    for prefix in [4u64 << 20, 32 << 20] {
        let n = prefix.min(len);
        let mut head = vec![0u8; n as usize];
        file.read_exact_at(&mut head, 0).with_context(|| format!("read {}", path.display()))?;
        // A header longer than `head` fails with an early end: try more.
        if let Ok(ct) = gguf_file::Content::read(&mut Cursor::new(&head)) {
            return Ok(ct);
        }
        if n == len {
            break;
        }
    }
    let mut r = std::io::BufReader::with_capacity(1 << 20, file);
    r.seek(SeekFrom::Start(0))?;
    gguf_file::Content::read(&mut r).with_context(|| format!("read GGUF header of {}", path.display()))
}

/// Reads a GGUF file's tensors with parallel positioned reads.
pub fn read_gguf(path: &Path, device: &Device, opts: &ReadOptions) -> Result<GgufWeights> {
    let t0 = Instant::now();
    let file = open(path)?;
    let len = file_len(&file, path)?;
    let content = gguf_header(&file, path, len)?;
    let header = t0.elapsed();

    let mut names: Vec<String> = content.tensor_infos.keys().cloned().collect();
    names.sort_by_key(|n| content.tensor_infos[n].offset);
    let base = content.tensor_data_offset;
    let mut bufs = Vec::with_capacity(names.len());
    let mut scratch = Scratch(Vec::new());
    let mut pieces = Vec::new();
    let mut cursor = 0u64;
    let mut tensor_bytes = 0u64;
    let mut prev: Option<&str> = None;
    for (i, name) in names.iter().enumerate() {
        let info = &content.tensor_infos[name];
        let (elems, bs) = (info.shape.elem_count(), info.ggml_dtype.block_size());
        ensure!(
            elems % bs == 0,
            "{}: tensor `{name}` has {elems} elements, not a multiple of the {:?} block size {bs}",
            path.display(),
            info.ggml_dtype
        );
        let bytes = elems / bs * info.ggml_dtype.type_size();
        let start = base.checked_add(info.offset).context("tensor offset overflows")?;
        let end = start + bytes as u64;
        if end > len {
            bail!(
                "{}: tensor `{name}` needs bytes {start}..{end} but the file has {len} bytes (truncated?)",
                path.display()
            );
        }
        if start < cursor {
            bail!("{}: tensor `{name}` overlaps `{}`", path.display(), prev.unwrap_or("the header"));
        }
        if opts.fingerprint && start > cursor {
            pieces.push(scratch.piece(0, cursor, (start - cursor) as usize));
        }
        let mut buf = QBuf::new(info.ggml_dtype, elems / bs);
        let (ptr, n) = buf.raw();
        debug_assert_eq!(n, bytes);
        pieces.push(Piece { file: 0, offset: start, len: bytes, dst: Dst(ptr), tensor: Some(i) });
        bufs.push(buf);
        cursor = end;
        tensor_bytes += bytes as u64;
        prev = Some(name);
    }
    if opts.fingerprint && cursor < len {
        pieces.push(scratch.piece(0, cursor, (len - cursor) as usize));
    }
    let t1 = Instant::now();
    let files = [file];
    let paths = [path.to_path_buf()];
    let plan = Plan { files: &files, paths: &paths, names: &names, pieces };
    let fingerprint = run(plan, opts, &[])?;
    drop(scratch);
    let mut tensors = HashMap::with_capacity(names.len());
    for (name, mut buf) in names.iter().zip(bufs) {
        // SAFETY: `run` returned Ok, so every piece of this buffer was read in full.
        unsafe { buf.assume_filled() };
        let info = &content.tensor_infos[name];
        let q = buf
            .into_qtensor(info.ggml_dtype, info.shape.dims().to_vec(), device)
            .with_context(|| format!("{}: tensor `{name}`", path.display()))?;
        tensors.insert(name.clone(), q);
    }
    let stats = ReadStats {
        loader: "parallel",
        files: 1,
        tensors: tensors.len(),
        tensor_bytes,
        file_bytes: if opts.fingerprint { len } else { tensor_bytes },
        header,
        read: t1.elapsed(),
        threads: opts.threads.max(1),
        fingerprint,
    };
    Ok(GgufWeights { content, tensors, stats })
}

/// One safetensors file's header: where its data starts and its tensors.
fn safetensors_header(f: &File, path: &Path, len: u64) -> Result<(u64, safetensors::tensor::Metadata)> {
    use std::os::unix::fs::FileExt;
    let mut n = [0u8; 8];
    f.read_exact_at(&mut n, 0)
        .with_context(|| format!("{}: no safetensors header (file too short)", path.display()))?;
    let n = u64::from_le_bytes(n);
    ensure!(
        n <= 100_000_000 && n + 8 <= len,
        "{}: safetensors header of {n} bytes does not fit a file of {len} bytes",
        path.display()
    );
    let mut header = vec![0u8; n as usize];
    f.read_exact_at(&mut header, 8).with_context(|| format!("read {}", path.display()))?;
    let meta: safetensors::tensor::Metadata =
        serde_json::from_slice(&header).with_context(|| format!("{}: invalid safetensors header", path.display()))?;
    Ok((8 + n, meta))
}

/// Reads safetensors files with parallel positioned reads. With
/// [`ReadOptions::fingerprint`], the fingerprint covers `prefix` (e.g.
/// `config.json`'s bytes) and then every file, in order.
pub fn read_safetensors(
    paths: &[PathBuf],
    prefix: &[u8],
    device: &Device,
    opts: &ReadOptions,
) -> Result<SafetensorsWeights> {
    let t0 = Instant::now();
    let mut files = Vec::with_capacity(paths.len());
    let mut names = Vec::new();
    /// (tensor index, buffer, dtype, shape)
    type Pending = (usize, TBuf, safetensors::Dtype, Vec<usize>);
    let mut pending: Vec<Pending> = Vec::new();
    let mut scratch = Scratch(Vec::new());
    let mut pieces = Vec::new();
    let (mut tensor_bytes, mut file_bytes) = (0u64, 0u64);
    for (fi, path) in paths.iter().enumerate() {
        let f = open(path)?;
        let len = file_len(&f, path)?;
        let (data_start, meta) = safetensors_header(&f, path, len)?;
        if opts.fingerprint {
            pieces.push(scratch.piece(fi, 0, data_start as usize));
        }
        for name in meta.offset_keys() {
            let info = meta.info(&name).expect("a name from the same metadata");
            let (s, e) = info.data_offsets;
            let (start, end) = (data_start + s as u64, data_start + e as u64);
            if end > len {
                bail!(
                    "{}: tensor `{name}` needs bytes {start}..{end} but the file has {len} bytes (truncated?)",
                    path.display()
                );
            }
            let elems: usize = info.shape.iter().product();
            let mut buf = TBuf::new(info.dtype, elems, e - s);
            let (ptr, n) = buf.raw();
            ensure!(n == e - s, "{}: tensor `{name}`: {} bytes for {elems} elements", path.display(), e - s);
            pieces.push(Piece { file: fi, offset: start, len: n, dst: Dst(ptr), tensor: Some(names.len()) });
            pending.push((names.len(), buf, info.dtype, info.shape.clone()));
            names.push(name);
            tensor_bytes += n as u64;
        }
        let end = data_start + meta.data_len() as u64;
        ensure!(
            end == len,
            "{}: {} bytes after the last tensor (the header says the data ends at byte {end})",
            path.display(),
            len.saturating_sub(end)
        );
        file_bytes += len;
        files.push(f);
    }
    let header = t0.elapsed();
    let t1 = Instant::now();
    let plan = Plan { files: &files, paths, names: &names, pieces };
    let fingerprint = run(plan, opts, prefix)?;
    drop(scratch);
    let mut tensors = HashMap::with_capacity(names.len());
    for (i, mut buf, dtype, shape) in pending {
        // SAFETY: `run` returned Ok, so every piece of this buffer was read in full.
        unsafe { buf.assume_filled() };
        let t = buf.into_tensor(dtype, &shape, device).with_context(|| format!("tensor `{}`", names[i]))?;
        if tensors.insert(names[i].clone(), t).is_some() {
            bail!("tensor `{}` is in more than one file", names[i]);
        }
    }
    let stats = ReadStats {
        loader: "parallel",
        files: paths.len(),
        tensors: tensors.len(),
        tensor_bytes,
        file_bytes: if opts.fingerprint { file_bytes } else { tensor_bytes },
        header,
        read: t1.elapsed(),
        threads: opts.threads.max(1),
        fingerprint,
    };
    Ok(SafetensorsWeights { tensors, stats })
}

/// Maps the pages of `dst..dst+len` in one call rather than one fault per
/// 4 KiB page as the read first touches them (a fresh allocation is
/// unmapped; faulting it page by page costs about as much as the copy).
/// Advice only: kernels before 5.14 refuse it and the read faults as usual.
fn populate(dst: *mut u8, len: usize) {
    const PAGE: usize = 4096;
    let start = (dst as usize).next_multiple_of(PAGE);
    let end = (dst as usize + len) / PAGE * PAGE;
    if end > start {
        // SAFETY: pages inside a live allocation this thread is about to
        // write; populating them changes no contents.
        unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_POPULATE_WRITE) };
    }
}

/// Most buffers one `preadv` takes (Linux's `IOV_MAX`).
const MAX_IOVECS: usize = 1024;

/// Reads consecutive pieces (one contiguous range of one file) with
/// vectored positioned reads, each piece's bytes straight into its buffer,
/// until all are in. On failure: the index in `batch` of the piece being
/// read, and the error.
fn read_batch(file: &File, batch: &[Piece]) -> Result<(), (usize, std::io::Error)> {
    let mut iov: Vec<libc::iovec> =
        batch.iter().map(|p| libc::iovec { iov_base: p.dst.0.cast(), iov_len: p.len }).collect();
    let mut first = 0;
    let mut offset = batch.first().map_or(0, |p| p.offset);
    while first < iov.len() {
        if iov[first].iov_len == 0 {
            first += 1;
            continue;
        }
        let count = (iov.len() - first).min(MAX_IOVECS) as libc::c_int;
        // SAFETY: every iovec points into a live allocation that only this
        // thread writes while the read runs, with its length within it.
        let n = unsafe { libc::preadv(file.as_raw_fd(), iov[first..].as_ptr(), count, offset as libc::off_t) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err((first, e));
        }
        if n == 0 {
            return Err((first, std::io::ErrorKind::UnexpectedEof.into()));
        }
        let mut n = n as usize;
        offset += n as u64;
        while n > 0 {
            let v = &mut iov[first];
            if n >= v.iov_len {
                n -= v.iov_len;
                first += 1;
            } else {
                // SAFETY: `n < iov_len`: still inside the same buffer.
                v.iov_base = unsafe { v.iov_base.cast::<u8>().add(n) }.cast();
                v.iov_len -= n;
                n = 0;
            }
        }
    }
    Ok(())
}

/// Splits large pieces so that the threads share even a small file, joins
/// small neighbours into one vectored read, then runs the reads; returns
/// the fingerprint of `prefix` and the files, if asked.
pub(super) fn run(mut plan: Plan<'_>, opts: &ReadOptions, prefix: &[u8]) -> Result<Option<String>> {
    let threads = opts.threads.max(1);
    let total: usize = plan.pieces.iter().map(|p| p.len).sum();
    let chunk = (total / (threads * 4)).clamp(MIN_CHUNK, opts.chunk_bytes.max(MIN_CHUNK));
    let mut pieces = Vec::with_capacity(plan.pieces.len() + total / chunk + 1);
    for p in plan.pieces.drain(..) {
        let mut at = 0;
        while at < p.len {
            let n = (p.len - at).min(chunk);
            // SAFETY: `at + n <= p.len`, inside the piece's buffer.
            let dst = Dst(unsafe { p.dst.0.add(at) });
            pieces.push(Piece { file: p.file, offset: p.offset + at as u64, len: n, dst, tensor: p.tensor });
            at += n;
        }
    }
    // Neighbouring small pieces (norm vectors, small projections, padding)
    // share one vectored read of up to `chunk` bytes.
    let mut batches: Vec<std::ops::Range<usize>> = Vec::new();
    let mut bytes = 0;
    for (i, p) in pieces.iter().enumerate() {
        let joins = batches.last().is_some_and(|b| {
            let prev = &pieces[b.end - 1];
            prev.file == p.file
                && prev.offset + prev.len as u64 == p.offset
                && bytes + p.len <= chunk
                && b.len() < MAX_IOVECS
        });
        if joins {
            batches.last_mut().expect("checked above").end = i + 1;
            bytes += p.len;
        } else {
            batches.push(i..i + 1);
            bytes = p.len;
        }
    }
    for f in plan.files {
        // SAFETY: advice on an open descriptor; no memory is involved.
        unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_SEQUENTIAL) };
    }
    let next = AtomicUsize::new(0);
    let done: Vec<AtomicBool> = pieces.iter().map(|_| AtomicBool::new(false)).collect();
    let failed = AtomicBool::new(false);
    let error: Mutex<Option<anyhow::Error>> = Mutex::new(None);
    let signal = (Mutex::new(()), Condvar::new());
    let describe = |p: &Piece, e: std::io::Error| -> anyhow::Error {
        let path = plan.paths[p.file].display();
        let what = match p.tensor {
            Some(t) => format!("tensor `{}`", plan.names[t]),
            None => "header or padding".to_string(),
        };
        let range = format!("bytes {}..{}", p.offset, p.offset + p.len as u64);
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            let len = plan.files[p.file].metadata().map(|m| m.len()).unwrap_or(0);
            anyhow::anyhow!("{path}: {what} ({range}) is cut short: the file ends at byte {len} (truncated?)")
        } else {
            anyhow::Error::new(e).context(format!("{path}: reading {what} ({range})"))
        }
    };
    let mut hasher = opts.fingerprint.then(blake3::Hasher::new);
    std::thread::scope(|s| {
        for _ in 0..threads.min(batches.len()) {
            s.spawn(|| loop {
                if failed.load(Ordering::Relaxed) {
                    return;
                }
                let b = next.fetch_add(1, Ordering::Relaxed);
                let Some(range) = batches.get(b) else { return };
                let batch = &pieces[range.clone()];
                for p in batch {
                    populate(p.dst.0, p.len);
                }
                match read_batch(&plan.files[batch[0].file], batch) {
                    Ok(()) => {
                        for d in &done[range.clone()] {
                            d.store(true, Ordering::Release);
                        }
                    }
                    Err((at, e)) => {
                        let mut slot = error.lock().unwrap_or_else(|e| e.into_inner());
                        slot.get_or_insert(describe(&batch[at], e));
                        failed.store(true, Ordering::Relaxed);
                    }
                }
                let _g = signal.0.lock().unwrap_or_else(|e| e.into_inner());
                signal.1.notify_all();
            });
        }
        if let Some(h) = hasher.as_mut() {
            h.update(prefix);
            'pieces: for (i, p) in pieces.iter().enumerate() {
                let mut g = signal.0.lock().unwrap_or_else(|e| e.into_inner());
                while !done[i].load(Ordering::Acquire) {
                    if failed.load(Ordering::Relaxed) {
                        break 'pieces;
                    }
                    g = signal.1.wait_timeout(g, Duration::from_millis(50)).unwrap_or_else(|e| e.into_inner()).0;
                }
                drop(g);
                // SAFETY: the piece is read in full (its `done` flag was
                // published with release ordering after the write) and no
                // thread writes it again.
                let bytes = unsafe { std::slice::from_raw_parts(p.dst.0, p.len) };
                // blake3's tree hashes large inputs on every core (same digest).
                if bytes.len() >= 1 << 20 {
                    h.update_rayon(bytes);
                } else {
                    h.update(bytes);
                }
            }
        }
    });
    if let Some(e) = error.into_inner().unwrap_or_else(|e| e.into_inner()) {
        return Err(e);
    }
    Ok(hasher.map(|h| h.finalize().to_hex().to_string()))
}

/// The naive path for GGUF: the whole file into memory, then
/// `Content::read` and `Content::tensor` over it.
pub fn naive_gguf(path: &Path, device: &Device, fingerprint: bool) -> Result<GgufWeights> {
    let t0 = Instant::now();
    let bytes = std::fs::read(path).with_context(|| format!("read {}", path.display()))?;
    let read_whole = t0.elapsed();
    let t1 = Instant::now();
    let len = bytes.len() as u64;
    let fp = fingerprint.then(|| blake3::hash(&bytes).to_hex().to_string());
    let mut cur = Cursor::new(bytes);
    let content =
        gguf_file::Content::read(&mut cur).with_context(|| format!("read GGUF header of {}", path.display()))?;
    let mut tensors = HashMap::with_capacity(content.tensor_infos.len());
    let mut tensor_bytes = 0u64;
    for name in content.tensor_infos.keys() {
        let q =
            content.tensor(&mut cur, name, device).with_context(|| format!("{}: tensor `{name}`", path.display()))?;
        tensor_bytes += q.storage_size_in_bytes() as u64;
        tensors.insert(name.clone(), q);
    }
    let stats = ReadStats {
        loader: "naive",
        files: 1,
        tensors: tensors.len(),
        tensor_bytes,
        file_bytes: len,
        header: Duration::ZERO,
        read: read_whole + t1.elapsed(),
        threads: 1,
        fingerprint: fp,
    };
    Ok(GgufWeights { content, tensors, stats })
}

/// The naive path for safetensors: each whole file into memory, then
/// `candle_core::safetensors::load_buffer`.
pub fn naive_safetensors(
    paths: &[PathBuf],
    prefix: &[u8],
    device: &Device,
    fingerprint: bool,
) -> Result<SafetensorsWeights> {
    let t0 = Instant::now();
    let mut hasher = fingerprint.then(|| {
        let mut h = blake3::Hasher::new();
        h.update(prefix);
        h
    });
    let mut tensors = HashMap::new();
    let (mut tensor_bytes, mut file_bytes) = (0u64, 0u64);
    for path in paths {
        let bytes = std::fs::read(path).with_context(|| format!("read {}", path.display()))?;
        file_bytes += bytes.len() as u64;
        if let Some(h) = hasher.as_mut() {
            h.update(&bytes);
        }
        let loaded = candle_core::safetensors::load_buffer(&bytes, device)
            .with_context(|| format!("{}: invalid safetensors", path.display()))?;
        for (name, t) in loaded {
            tensor_bytes += (t.elem_count() * t.dtype().size_in_bytes()) as u64;
            if tensors.insert(name.clone(), t).is_some() {
                bail!("tensor `{name}` is in more than one file");
            }
        }
    }
    let stats = ReadStats {
        loader: "naive",
        files: paths.len(),
        tensors: tensors.len(),
        tensor_bytes,
        file_bytes,
        header: Duration::ZERO,
        read: t0.elapsed(),
        threads: 1,
        fingerprint: hasher.map(|h| h.finalize().to_hex().to_string()),
    };
    Ok(SafetensorsWeights { tensors, stats })
}

#[cfg(test)]
mod tests;
