//! The parallel loader gives the naive path's tensors bit for bit, and the
//! same fingerprint (so KV block names do not change); a cut-short file is
//! an error naming the file and the tensor, never a panic or a partial set.

use super::*;
use crate::model::{Chunk, LoadOptions, Model};
use candle_core::DType;
use safetensors::View;

fn small_reads(threads: usize) -> ReadOptions {
    // 1 MiB pieces: every large tensor is split across the threads.
    ReadOptions { threads, chunk_bytes: 1 << 20, fingerprint: true }
}

/// The message of an expected error (`{:#}`: with its context).
fn err_of<T>(r: Result<T>) -> String {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => format!("{e:#}"),
    }
}

fn qbytes(q: &QTensor) -> Vec<u8> {
    q.data().unwrap().into_owned()
}

#[test]
fn gguf_tensors_are_bit_identical_to_the_naive_path() {
    let Some(path) = granary_tokenizer::testing::model_or_skip("gguf_tensors_are_bit_identical_to_the_naive_path")
    else {
        return;
    };
    let naive = naive_gguf(&path, &Device::Cpu, true).unwrap();
    let whole = blake3::hash(&std::fs::read(&path).unwrap()).to_hex().to_string();
    assert_eq!(naive.stats.fingerprint.as_deref(), Some(whole.as_str()));
    for threads in [1, 3, 8] {
        let fast = read_gguf(&path, &Device::Cpu, &small_reads(threads)).unwrap();
        assert_eq!(fast.stats.fingerprint.as_deref(), Some(whole.as_str()), "{threads} threads");
        assert_eq!(fast.stats.file_bytes, std::fs::metadata(&path).unwrap().len());
        assert_eq!(fast.tensors.len(), naive.tensors.len());
        assert!(fast.tensors.len() > 100, "the default model has hundreds of tensors");
        let mut dtypes = std::collections::BTreeSet::new();
        for (name, n) in &naive.tensors {
            let f = fast.tensors.get(name).unwrap_or_else(|| panic!("{name} missing"));
            assert_eq!(f.dtype(), n.dtype(), "{name}");
            assert_eq!(f.shape(), n.shape(), "{name}");
            assert!(qbytes(f) == qbytes(n), "{name}: bytes differ ({threads} threads)");
            dtypes.insert(format!("{:?}", f.dtype()));
        }
        // Quantized blocks and plain floats both went through the fast path.
        assert!(dtypes.contains("Q4_1") && dtypes.contains("F32"), "{dtypes:?}");
    }
    let fast = read_gguf(&path, &Device::Cpu, &ReadOptions { fingerprint: false, ..small_reads(4) }).unwrap();
    assert!(fast.stats.fingerprint.is_none());
    assert_eq!(fast.stats.file_bytes, fast.stats.tensor_bytes);
}

#[test]
fn a_model_loads_the_same_either_way_with_the_same_fingerprint() {
    let Some(path) = granary_tokenizer::testing::model_or_skip("a_model_loads_the_same_either_way") else { return };
    let opts = |loader| LoadOptions { loader, max_context: Some(64), ..LoadOptions::default() };
    let (fast, stats) = Model::load_timed(&path, &opts(Loader::Parallel(small_reads(4)))).unwrap();
    let (naive, naive_stats) = Model::load_timed(&path, &opts(Loader::Naive)).unwrap();
    let whole = blake3::hash(&std::fs::read(&path).unwrap()).to_hex().to_string();
    assert_eq!(fast.fingerprint(), whole);
    assert_eq!(naive.fingerprint(), whole);
    assert_eq!((stats.read.loader, naive_stats.read.loader), ("parallel", "naive"));
    assert!(stats.read.read > Duration::ZERO && stats.convert > Duration::ZERO, "{stats:?}");
    let ids = [1u32, 504, 3458, 282, 4649, 314];
    let logits = |m: &Model| {
        let mut kv = m.new_kv(16);
        m.forward(&mut [Chunk { tokens: &ids, kv: &mut kv, logits: true }]).unwrap().unwrap().to_vec2::<f32>().unwrap()
    };
    assert!(logits(&fast) == logits(&naive), "the two loads compute different logits");
}

/// Writes `tensors` as a safetensors file.
fn write_st(path: &Path, tensors: &[(&str, Tensor)]) {
    let map: HashMap<String, Tensor> = tensors.iter().map(|(n, t)| (n.to_string(), t.clone())).collect();
    candle_core::safetensors::save(&map, path).unwrap();
}

/// Deterministic tensors of several dtypes, one above the 1 MiB piece size.
type Named = Vec<(&'static str, Tensor)>;

fn sample_tensors() -> (Named, Named) {
    let dev = Device::Cpu;
    let ramp =
        |n: usize, scale: f32| -> Vec<f32> { (0..n).map(|i| ((i * 7919) % 1000) as f32 * scale - 3.0).collect() };
    let big = Tensor::from_vec(ramp(600 * 1000, 0.01), (600, 1000), &dev).unwrap();
    let a = vec![
        ("model.embed_tokens.weight", big),
        (
            "model.layers.0.self_attn.q_proj.weight",
            Tensor::from_vec(ramp(64 * 48, 0.5), (64, 48), &dev).unwrap().to_dtype(DType::BF16).unwrap(),
        ),
        (
            "model.layers.0.input_layernorm.weight",
            Tensor::from_vec(ramp(48, 0.25), 48, &dev).unwrap().to_dtype(DType::F16).unwrap(),
        ),
        ("odd.u8", Tensor::from_vec((0..37u8).collect::<Vec<_>>(), 37, &dev).unwrap()),
    ];
    let b = vec![
        (
            "model.layers.1.mlp.down_proj.weight",
            Tensor::from_vec(ramp(33 * 17, 1.5), (33, 17), &dev).unwrap().to_dtype(DType::F16).unwrap(),
        ),
        ("ids.i64", Tensor::from_vec((0..11i64).map(|i| i * -3).collect::<Vec<_>>(), 11, &dev).unwrap()),
        ("ids.u32", Tensor::from_vec((0..13u32).collect::<Vec<_>>(), 13, &dev).unwrap()),
        ("model.norm.weight", Tensor::from_vec(ramp(48, 0.125), 48, &dev).unwrap().to_dtype(DType::F64).unwrap()),
    ];
    (a, b)
}

#[test]
fn safetensors_are_bit_identical_to_the_naive_path() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = sample_tensors();
    let files =
        vec![dir.path().join("model-00001-of-00002.safetensors"), dir.path().join("model-00002-of-00002.safetensors")];
    write_st(&files[0], &a);
    write_st(&files[1], &b);
    let prefix = br#"{"model_type":"llama"}"#;
    let mut all = prefix.to_vec();
    for f in &files {
        all.extend(std::fs::read(f).unwrap());
    }
    let whole = blake3::hash(&all).to_hex().to_string();

    let naive = naive_safetensors(&files, prefix, &Device::Cpu, true).unwrap();
    assert_eq!(naive.stats.fingerprint.as_deref(), Some(whole.as_str()));
    for threads in [1, 2, 5] {
        let fast = read_safetensors(&files, prefix, &Device::Cpu, &small_reads(threads)).unwrap();
        assert_eq!(fast.stats.fingerprint.as_deref(), Some(whole.as_str()), "{threads} threads");
        assert_eq!(fast.tensors.len(), a.len() + b.len());
        assert_eq!(fast.stats.file_bytes, all.len() as u64 - prefix.len() as u64);
        for (name, original) in a.iter().chain(&b) {
            let f = &fast.tensors[*name];
            let n = &naive.tensors[*name];
            assert_eq!((f.dtype(), f.dims()), (original.dtype(), original.dims()), "{name}");
            assert_eq!((n.dtype(), n.dims()), (original.dtype(), original.dims()), "{name}");
            assert!(f.data() == n.data(), "{name}: bytes differ from the naive path");
            assert!(f.data() == original.data(), "{name}: bytes differ from what was written");
        }
    }
}

#[test]
fn a_cut_short_gguf_is_an_error_naming_the_file_and_tensor() {
    let Some(path) = granary_tokenizer::testing::model_or_skip("a_cut_short_gguf_is_an_error") else { return };
    let full = std::fs::read(&path).unwrap();
    let ct = gguf_file::Content::read(&mut Cursor::new(&full)).unwrap();
    // The last tensor in the file loses its last 1000 bytes.
    let (last, _) = ct.tensor_infos.iter().max_by_key(|(_, i)| i.offset).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cut = dir.path().join("cut.gguf");
    std::fs::write(&cut, &full[..full.len() - 1000]).unwrap();

    let err = err_of(read_gguf(&cut, &Device::Cpu, &ReadOptions::default()));
    assert!(err.contains("cut.gguf") && err.contains(&format!("tensor `{last}`")), "{err}");
    assert!(err.contains("truncated"), "{err}");
    let err = err_of(Model::load(&cut, &LoadOptions::default()));
    assert!(err.contains("cut.gguf") && err.contains(last.as_str()), "{err}");
    assert!(Model::load(&cut, &LoadOptions { loader: Loader::Naive, ..Default::default() }).is_err());

    // Cut inside the header: the header parser's own error, with the file's name.
    let head = dir.path().join("head.gguf");
    std::fs::write(&head, &full[..4096]).unwrap();
    let err = err_of(read_gguf(&head, &Device::Cpu, &ReadOptions::default()));
    assert!(err.contains("head.gguf"), "{err}");
}

#[test]
fn a_cut_short_safetensors_file_is_an_error_naming_the_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let (a, _) = sample_tensors();
    let path = dir.path().join("model.safetensors");
    write_st(&path, &a);
    let full = std::fs::read(&path).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&full).unwrap();
    let last = meta.offset_keys().pop().unwrap();
    std::fs::write(&path, &full[..full.len() - 3]).unwrap();
    let err = err_of(read_safetensors(std::slice::from_ref(&path), b"", &Device::Cpu, &ReadOptions::default()));
    assert!(err.contains("model.safetensors") && err.contains(&format!("tensor `{last}`")), "{err}");
    assert!(naive_safetensors(std::slice::from_ref(&path), b"", &Device::Cpu, false).is_err());

    // Bytes after the last tensor are refused too, as the library refuses them.
    let mut long = full.clone();
    long.extend_from_slice(&[0; 5]);
    std::fs::write(&path, &long).unwrap();
    let err = err_of(read_safetensors(std::slice::from_ref(&path), b"", &Device::Cpu, &ReadOptions::default()));
    assert!(err.contains("5 bytes after the last tensor"), "{err}");

    // A header that is not JSON.
    let mut bad = 16u64.to_le_bytes().to_vec();
    bad.extend_from_slice(b"not json at all!");
    std::fs::write(&path, &bad).unwrap();
    let err = err_of(read_safetensors(std::slice::from_ref(&path), b"", &Device::Cpu, &ReadOptions::default()));
    assert!(err.contains("model.safetensors") && err.contains("invalid safetensors header"), "{err}");
}

/// A file that shrinks after its header was checked: the reader thread
/// that meets the end reports the tensor, and the others stop.
#[test]
fn a_file_ending_mid_read_is_reported_by_the_reader() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("w.bin");
    std::fs::write(&path, vec![7u8; 3 << 20]).unwrap();
    let files = [File::open(&path).unwrap()];
    let paths = [path.clone()];
    let names = ["blk.0.ffn_up.weight".to_string()];
    let mut buf = vec![0u8; 4 << 20];
    let pieces = vec![Piece { file: 0, offset: 0, len: buf.len(), dst: Dst(buf.as_mut_ptr()), tensor: Some(0) }];
    let plan = Plan { files: &files, paths: &paths, names: &names, pieces };
    let err = err_of(run(plan, &small_reads(3), b""));
    assert!(err.contains("w.bin") && err.contains("tensor `blk.0.ffn_up.weight`"), "{err}");
    assert!(err.contains("cut short") && err.contains("3145728"), "{err}");
}

/// Small neighbouring tensors share one vectored read; the one the file
/// ends in is the one named, and the bytes before it are where they belong.
#[test]
fn small_tensors_share_a_read_and_a_short_one_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("small.bin");
    let data: Vec<u8> = (0..4500u32).map(|i| (i * 31 % 251) as u8).collect();
    std::fs::write(&path, &data).unwrap();
    let files = [File::open(&path).unwrap()];
    let paths = [path.clone()];
    let names: Vec<String> = (0..5).map(|i| format!("blk.{i}.attn_norm.weight")).collect();
    let mut bufs: Vec<Vec<u8>> = (0..5).map(|_| vec![0u8; 1000]).collect();
    let pieces: Vec<Piece> = bufs
        .iter_mut()
        .enumerate()
        .map(|(i, b)| Piece { file: 0, offset: i as u64 * 1000, len: 1000, dst: Dst(b.as_mut_ptr()), tensor: Some(i) })
        .collect();
    let plan = Plan { files: &files, paths: &paths, names: &names, pieces };
    let err = err_of(run(plan, &small_reads(2), b""));
    assert!(err.contains("tensor `blk.4.attn_norm.weight`") && err.contains("4500"), "{err}");
    for (i, b) in bufs.iter().take(4).enumerate() {
        assert!(b[..] == data[i * 1000..(i + 1) * 1000], "tensor {i} was not read in place");
    }
}
