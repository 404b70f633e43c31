//! The registry's wire types, shared by the server and [`crate::client`],
//! and the rules every name, revision and file path obeys.
//!
//! All JSON is `snake_case`. These shapes are a contract with the node agent
//! and the gateway: fields may be added, never renamed or dropped.

use serde::{Deserialize, Serialize};

/// `format` of a revision holding a GGUF file.
pub const FORMAT_GGUF: &str = "gguf";
/// `format` of a revision holding `config.json`, `*.safetensors` and a tokenizer.
pub const FORMAT_SAFETENSORS: &str = "safetensors";
/// The revision name that stands for the newest revision of a model.
pub const LATEST: &str = "latest";

/// Longest model name or revision, in bytes.
pub const MAX_NAME_LEN: usize = 128;
/// Longest file path inside a revision, in bytes.
pub const MAX_PATH_LEN: usize = 1024;

/// One file of a revision.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    /// Relative, `/`-separated, checked by [`check_file_path`].
    pub path: String,
    /// Bytes.
    pub size: u64,
    /// 64 lowercase hex characters; also the blob's name in the store.
    pub sha256: String,
}

/// A model revision: an immutable set of files.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Revision {
    /// The model's name.
    pub name: String,
    /// The revision's name, unique within the model.
    pub revision: String,
    /// [`FORMAT_GGUF`] or [`FORMAT_SAFETENSORS`].
    pub format: String,
    /// An SPDX-style license id, when known.
    #[serde(default)]
    pub license: Option<String>,
    /// When it was imported, unix seconds.
    pub created: i64,
    /// Sum of the files' sizes, bytes.
    pub size: u64,
    /// Sorted by path.
    pub files: Vec<FileEntry>,
    /// The import source it came from (`dir:…`, `pypi:…`, `hf:…`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
}

impl Revision {
    /// The file at `path`, if the revision has one.
    pub fn file(&self, path: &str) -> Option<&FileEntry> {
        self.files.iter().find(|f| f.path == path)
    }
}

/// A model in `GET /v1/models`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelSummary {
    pub name: String,
    /// The newest revision's name.
    pub latest: String,
    /// Every revision's name, oldest first.
    pub revisions: Vec<String>,
}

/// The body of `GET /v1/models`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelList {
    pub models: Vec<ModelSummary>,
}

/// A model with all its revisions: `GET /v1/models/{name}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Model {
    pub name: String,
    /// The newest revision's name.
    pub latest: String,
    /// Oldest first.
    pub revisions: Vec<Revision>,
}

/// Where to download one file: `GET …/files/{path}/url`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileUrl {
    /// A presigned object-store URL (S3, GCS, Azure) that needs no
    /// credentials, or the registry's own `/v1/blobs/{sha256}` (which needs
    /// the registry token unless it allows anonymous reads).
    pub url: String,
    /// When a presigned URL stops working, unix seconds.
    pub expires_at: i64,
    /// The file's size, bytes.
    #[serde(default)]
    pub size: u64,
    /// The file's sha256, to verify the download against.
    #[serde(default)]
    pub sha256: String,
    /// Whether `url` is presigned (no `Authorization` header needed or wanted).
    #[serde(default)]
    pub presigned: bool,
}

/// The body of `POST /v1/models/import`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ImportRequest {
    /// The model's name ([`check_name`]).
    pub name: String,
    /// The revision's name; by default the source's own (a PyPI version,
    /// a hub commit) or, for a directory, a short hash of its contents.
    #[serde(default)]
    pub revision: Option<String>,
    /// `dir:/abs/path`, `pypi:SPEC` or `hf:owner/name[@rev]`.
    pub source: String,
    /// An SPDX-style license id; by default what the source declares.
    #[serde(default)]
    pub license: Option<String>,
}

/// Where an upload stands: `GET /v1/uploads/{sha256}` and the answer of
/// each `PATCH` to it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct UploadStatus {
    pub sha256: String,
    /// Bytes the registry holds of it; the next `PATCH` starts here.
    pub offset: u64,
    /// Whether the blob is stored (verified): nothing more to send.
    pub complete: bool,
}

/// The body of `POST /v1/models/{name}/revisions`: a revision made of
/// blobs already uploaded.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RevisionRequest {
    /// The revision's name; by default a short hash of its files.
    #[serde(default)]
    pub revision: Option<String>,
    /// An SPDX-style license id.
    #[serde(default)]
    pub license: Option<String>,
    /// Every file: its path, size and sha256 (each stored already).
    pub files: Vec<FileEntry>,
}

/// What a garbage-collection pass did: the body of `POST /v1/gc`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GcReport {
    /// Blobs deleted.
    pub deleted: u64,
    /// Their bytes.
    pub deleted_bytes: u64,
    /// Unreferenced blobs kept because they are younger than the grace period.
    pub kept_young: u64,
    /// Blobs some revision references.
    pub referenced: u64,
}

/// Why a name, revision or path was refused.
pub type RuleError = String;

fn check_token(what: &str, s: &str) -> Result<(), RuleError> {
    if s.is_empty() {
        return Err(format!("the {what} is empty"));
    }
    if s.len() > MAX_NAME_LEN {
        return Err(format!("the {what} is longer than {MAX_NAME_LEN} bytes"));
    }
    let first_ok = s.as_bytes()[0].is_ascii_alphanumeric();
    let rest_ok = s.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if !first_ok || !rest_ok {
        return Err(format!(
            "the {what} {s:?} must start with a letter or digit and hold only letters, digits, `.`, `_` and `-`"
        ));
    }
    Ok(())
}

/// A model name: `[A-Za-z0-9][A-Za-z0-9._-]*`, at most 128 bytes.
pub fn check_name(name: &str) -> Result<(), RuleError> {
    check_token("model name", name)
}

/// A revision name: as a model name, and not `latest`.
pub fn check_revision(rev: &str) -> Result<(), RuleError> {
    check_token("revision", rev)?;
    if rev == LATEST {
        return Err(format!("`{LATEST}` is reserved for the newest revision"));
    }
    Ok(())
}

/// A file path inside a revision: relative, `/`-separated, no empty, `.` or
/// `..` component, no backslash, no control character, at most 1024 bytes.
/// A revision materialised as a directory of its paths therefore never
/// writes outside that directory.
pub fn check_file_path(path: &str) -> Result<(), RuleError> {
    if path.is_empty() {
        return Err("the file path is empty".into());
    }
    if path.len() > MAX_PATH_LEN {
        return Err(format!("the file path is longer than {MAX_PATH_LEN} bytes"));
    }
    if path.starts_with('/') {
        return Err(format!("the file path {path:?} is absolute"));
    }
    if path.contains('\\') || path.chars().any(char::is_control) {
        return Err(format!("the file path {path:?} holds a backslash or a control character"));
    }
    for part in path.split('/') {
        match part {
            "" => return Err(format!("the file path {path:?} has an empty component")),
            "." | ".." => return Err(format!("the file path {path:?} has a `{part}` component")),
            _ => {}
        }
    }
    Ok(())
}

/// Whether `s` is a sha256 in the registry's text form (64 lowercase hex).
pub fn is_sha256(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_revisions() {
        for ok in ["smollm2", "SmolLM2-135M", "a", "v1.2_3", &"x".repeat(128)] {
            check_name(ok).unwrap();
            check_revision(ok).unwrap();
        }
        for bad in ["", "-a", ".a", "a/b", "a b", "a..b/c", "ü", &"x".repeat(129)] {
            assert!(check_name(bad).is_err(), "{bad:?} accepted");
        }
        assert!(check_name("latest").is_ok());
        let e = check_revision("latest").unwrap_err();
        assert!(e.contains("reserved"), "{e}");
    }

    #[test]
    fn file_paths() {
        for ok in ["model.gguf", "sub/dir/x.safetensors", "a..b", ".hidden", "with space"] {
            check_file_path(ok).unwrap();
        }
        for bad in ["", "/etc/passwd", "../x", "a/../../x", "a/./b", "a//b", "a/", "a\\b", "a\nb", &"x".repeat(1025)] {
            assert!(check_file_path(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn sha256_text_form() {
        assert!(is_sha256(&"ab".repeat(32)));
        assert!(!is_sha256(&"AB".repeat(32)));
        assert!(!is_sha256(&"ab".repeat(31)));
        assert!(!is_sha256(&"zz".repeat(32)));
    }

    #[test]
    fn revision_json_is_the_contract_shape() {
        let r = Revision {
            name: "smollm2".into(),
            revision: "0.1.2".into(),
            format: FORMAT_GGUF.into(),
            license: Some("apache-2.0".into()),
            created: 1_764_000_000,
            size: 3,
            files: vec![FileEntry { path: "m.gguf".into(), size: 3, sha256: "ab".repeat(32) }],
            source: None,
        };
        let v = serde_json::to_value(&r).unwrap();
        assert_eq!(v["files"][0]["sha256"], "ab".repeat(32));
        assert_eq!(v["created"], 1_764_000_000);
        assert!(v.get("source").is_none());
        let back: Revision = serde_json::from_value(v).unwrap();
        assert_eq!(back, r);
        let e = serde_json::from_str::<ImportRequest>(r#"{"name":"a","source":"dir:/x","bogus":1}"#).unwrap_err();
        assert!(e.to_string().contains("bogus"), "{e}");
    }
}
