//! A checkpoint of the default model gives the converted model's logits bit
//! for bit and its fingerprint, and one that is damaged, cut short, made
//! for other files or other options is never used: the load falls back to
//! converting and says why.

use std::path::{Path, PathBuf};

use super::*;
use crate::model::{Chunk, Model};

/// The default model copied into `dir` (its stamps are then this test's own).
fn model_copy(test: &str, dir: &Path) -> Option<PathBuf> {
    let src = granary_tokenizer::testing::model_or_skip(test)?;
    let dst = dir.join("model.gguf");
    std::fs::copy(&src, &dst).unwrap();
    Some(dst)
}

fn opts(ck: &Path) -> LoadOptions {
    LoadOptions { checkpoint: Some(ck.to_path_buf()), ..Default::default() }
}

/// Logits of a 40-token prefill, then of 6 greedy steps.
fn logits(m: &Model) -> Vec<Vec<f32>> {
    let prompt: Vec<u32> = (0..40u32).map(|i| 100 + i * 37).collect();
    let mut kv = m.new_kv(16);
    let mut out = Vec::new();
    let mut next = prompt.clone();
    for _ in 0..7 {
        let l = m.forward(&mut [Chunk { tokens: &next, kv: &mut kv, logits: true }]).unwrap().unwrap();
        let row = l.to_vec2::<f32>().unwrap().remove(0);
        let best = row.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0 as u32;
        out.push(row);
        next = vec![best];
    }
    out
}

fn used(path: &Path, ck: &Path) -> (Model, CheckpointUse) {
    let (m, stats) = Model::load_timed(path, &opts(ck)).unwrap();
    (m, stats.checkpoint)
}

#[test]
fn the_default_model_round_trips_and_bad_checkpoints_fall_back() {
    let dir = tempfile::tempdir().unwrap();
    let Some(path) = model_copy("the_default_model_round_trips_and_bad_checkpoints_fall_back", dir.path()) else {
        return;
    };
    let ck = default_path(&path);
    assert_eq!(ck.parent(), path.parent(), "the default checkpoint sits beside the model");

    // A write cut short long ago left its temporary file; a recent one
    // may be another engine's write in progress.
    let old_tmp = dir.path().join(".granary-ckpt-old");
    std::fs::write(&old_tmp, b"partial").unwrap();
    let f = std::fs::File::options().write(true).open(&old_tmp).unwrap();
    f.set_modified(std::time::SystemTime::now() - std::time::Duration::from_secs(3600)).unwrap();
    drop(f);
    let new_tmp = dir.path().join(".granary-ckpt-new");
    std::fs::write(&new_tmp, b"partial").unwrap();

    let (converted, u) = used(&path, &ck);
    assert_eq!(u, CheckpointUse::Missing);
    let want = logits(&converted);
    let bytes = converted.save_checkpoint(&ck).unwrap();
    // No temporary file of its own is left beside it; the old one is gone.
    assert!(!old_tmp.exists(), "a stale temporary file was left");
    std::fs::remove_file(&new_tmp).unwrap();
    let names: Vec<String> =
        std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert_eq!(names.len(), 2, "{names:?}");

    let (loaded, stats) = Model::load_timed(&path, &opts(&ck)).unwrap();
    assert_eq!(stats.checkpoint, CheckpointUse::Loaded);
    assert_eq!(stats.read.file_bytes, bytes);
    assert_eq!(loaded.fingerprint(), converted.fingerprint());
    assert!(logits(&loaded) == want, "logits differ after the checkpoint");
    // A model loaded from a checkpoint writes the same checkpoint again.
    let again = dir.path().join("again.ckpt");
    loaded.save_checkpoint(&again).unwrap();
    assert!(std::fs::read(&again).unwrap() == std::fs::read(&ck).unwrap(), "a rewritten checkpoint differs");
    drop(loaded);

    let good = std::fs::read(&ck).unwrap();
    let check_falls_back = |what: &str, want_use: &dyn Fn(&CheckpointUse) -> bool| {
        let (m, u) = used(&path, &ck);
        assert!(want_use(&u), "{what}: {u}");
        assert!(logits(&m) == want, "{what}: the fallback conversion gives other logits");
    };

    // One flipped bit in the data, in the header, and a cut-short file.
    let mut bad = good.clone();
    let at = bad.len() - 1000;
    bad[at] ^= 0x10;
    std::fs::write(&ck, &bad).unwrap();
    check_falls_back("flipped data bit", &|u| *u == CheckpointUse::Unusable("data checksum mismatch".into()));
    let mut bad = good.clone();
    bad[PREFIX + 20] ^= 0x01;
    std::fs::write(&ck, &bad).unwrap();
    check_falls_back("flipped header bit", &|u| *u == CheckpointUse::Unusable("header checksum mismatch".into()));
    std::fs::write(&ck, &good[..good.len() / 2]).unwrap();
    check_falls_back("cut short", &|u| matches!(u, CheckpointUse::Unusable(w) if w.contains("truncated")));
    std::fs::write(&ck, b"not a checkpoint at all, just some text that is long enough").unwrap();
    check_falls_back("not a checkpoint", &|u| matches!(u, CheckpointUse::Unusable(w) if w.contains("magic")));

    // Made for other options (dense weights for tensor operations).
    std::fs::write(&ck, &good).unwrap();
    let other = LoadOptions { tensor_ops: true, ..opts(&ck) };
    let (_, stats) = Model::load_timed(&path, &other).unwrap();
    assert!(
        matches!(&stats.checkpoint, CheckpointUse::Stale(w) if w.contains("tensor_ops=true")),
        "{}",
        stats.checkpoint
    );

    // The model file changed (a new modification time) after it was written.
    let (_, u) = used(&path, &ck);
    assert_eq!(u, CheckpointUse::Loaded);
    let f = std::fs::File::options().write(true).open(&path).unwrap();
    f.set_modified(std::time::SystemTime::now() + std::time::Duration::from_secs(5)).unwrap();
    drop(f);
    check_falls_back("model touched", &|u| matches!(u, CheckpointUse::Stale(w) if w.contains("changed")));
    // ... and a model whose file changed since its load writes none.
    let err = converted.save_checkpoint(&ck).unwrap_err();
    assert!(format!("{err:#}").contains("changed since it was loaded"), "{err:#}");
}

#[test]
fn no_checkpoint_is_read_or_written_when_none_is_asked_for() {
    let dir = tempfile::tempdir().unwrap();
    let Some(path) = model_copy("no_checkpoint_is_read_or_written_when_none_is_asked_for", dir.path()) else {
        return;
    };
    let (_, stats) = Model::load_timed(&path, &LoadOptions::default()).unwrap();
    assert_eq!(stats.checkpoint, CheckpointUse::Off);
    assert!(!stats.checkpoint.wants_write());
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
}

#[test]
fn a_link_into_a_content_addressed_store_is_stamped_by_its_hash_not_its_time() {
    let dir = tempfile::tempdir().unwrap();
    let blobs = dir.path().join("blobs");
    std::fs::create_dir(&blobs).unwrap();
    let sha = "ab".repeat(32);
    let blob = blobs.join(&sha);
    std::fs::write(&blob, b"weights").unwrap();
    let link = dir.path().join("model.gguf");
    std::os::unix::fs::symlink(&blob, &link).unwrap();
    let before = stamps(&link).unwrap();
    // Touched (recency) and copied to another tier under the same name.
    let f = std::fs::File::options().write(true).open(&blob).unwrap();
    f.set_modified(std::time::SystemTime::now() + std::time::Duration::from_secs(60)).unwrap();
    drop(f);
    assert_eq!(stamps(&link).unwrap(), before);
    let ram = dir.path().join("ram");
    std::fs::create_dir(&ram).unwrap();
    std::fs::copy(&blob, ram.join(&sha)).unwrap();
    std::fs::remove_file(&link).unwrap();
    std::os::unix::fs::symlink(ram.join(&sha), &link).unwrap();
    assert_eq!(stamps(&link).unwrap(), before);
    // Other content is another name: a different stamp.
    let other = blobs.join("cd".repeat(32));
    std::fs::write(&other, b"weights").unwrap();
    std::fs::remove_file(&link).unwrap();
    std::os::unix::fs::symlink(&other, &link).unwrap();
    assert_ne!(stamps(&link).unwrap(), before);
    // A plain file is stamped by its time.
    let plain = dir.path().join("plain.gguf");
    std::fs::write(&plain, b"weights").unwrap();
    let s = stamps(&plain).unwrap();
    assert!(s[0].mtime_ns > 0 && s[0].name == "plain.gguf", "{s:?}");
}

#[test]
fn a_file_replaced_with_its_size_and_time_kept_gets_a_new_stamp() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.gguf");
    std::fs::write(&path, b"weights-1").unwrap();
    let before = stamps(&path).unwrap();
    assert_eq!(stamps(&path).unwrap(), before, "an unchanged file keeps its stamp");
    let mtime = std::fs::metadata(&path).unwrap().modified().unwrap();
    let set_back = |p: &Path| {
        let f = std::fs::File::options().write(true).open(p).unwrap();
        f.set_modified(mtime).unwrap();
    };
    // Another file of the same size, its modification time set back to the
    // original's, renamed over it (as a copy that keeps times would be).
    let tmp = dir.path().join("model.gguf.part");
    std::fs::write(&tmp, b"weights-2").unwrap();
    set_back(&tmp);
    std::fs::rename(&tmp, &path).unwrap();
    let replaced = stamps(&path).unwrap();
    assert_eq!((replaced[0].len, replaced[0].mtime_ns), (before[0].len, before[0].mtime_ns));
    assert_ne!(replaced, before, "a file replaced with its size and time kept looked unchanged");
    // Rewritten in place, then its time set back (file times tick
    // coarsely: a pause, so the status change is seen as one).
    std::thread::sleep(std::time::Duration::from_millis(30));
    std::fs::write(&path, b"weights-3").unwrap();
    set_back(&path);
    let rewritten = stamps(&path).unwrap();
    assert_eq!((rewritten[0].len, rewritten[0].mtime_ns), (before[0].len, before[0].mtime_ns));
    assert_ne!(rewritten, replaced, "a file rewritten in place with its time set back looked unchanged");
}
