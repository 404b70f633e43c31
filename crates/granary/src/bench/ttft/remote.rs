//! The remote tier of `bench ttft`: a `file://` directory, or an `s3s-fs`
//! process serving one over S3.

use super::*;

/// Bucket the s3s-fs remote tier writes to.
const BUCKET: &str = "granary-bench";

/// Where the remote tier's objects go: a directory behind `file://`, or an
/// `s3s-fs` process serving that directory over S3 (killed on drop). Each
/// run writes under its own prefix.
pub(super) struct Remote {
    pub(super) kind: RemoteKind,
    root: tempfile::TempDir,
    server: Option<(std::process::Child, u16)>,
}

impl Drop for Remote {
    fn drop(&mut self) {
        if let Some((child, _)) = &mut self.server {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn on_path(bin: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|d| d.join(bin)).find(|p| p.is_file())
}

impl Remote {
    pub(super) fn open(want: RemoteKind, base: &Path) -> Result<Remote> {
        let root = tempfile::Builder::new().prefix("granary-bench-ttft-remote-").tempdir_in(base)?;
        let bin = match want {
            RemoteKind::File => None,
            RemoteKind::Auto => on_path("s3s-fs"),
            RemoteKind::S3sFs => {
                Some(on_path("s3s-fs").context("--remote s3s-fs: s3s-fs is not on PATH (cargo install s3s-fs)")?)
            }
        };
        let Some(bin) = bin else { return Ok(Remote { kind: RemoteKind::File, root, server: None }) };
        std::fs::create_dir(root.path().join(BUCKET))?;
        // s3s-fs takes a port number, not a listener: ask the OS for a free one.
        let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let child = std::process::Command::new(&bin)
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["--access-key", "granary-bench", "--secret-key", "granary-bench-secret"])
            .arg(root.path())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let mut remote = Remote { kind: RemoteKind::S3sFs, root, server: Some((child, port)) };
        let deadline = Instant::now() + Duration::from_secs(15);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            if let Some((child, _)) = &mut remote.server {
                if let Some(status) = child.try_wait()? {
                    bail!("s3s-fs exited at start: {status}");
                }
            }
            if Instant::now() > deadline {
                bail!("s3s-fs did not listen on port {port} within 15 s");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(remote)
    }

    pub(super) fn describe(&self) -> String {
        match &self.server {
            Some((_, port)) => format!(
                "s3s-fs on 127.0.0.1:{port} (S3 over HTTP, objects under {})",
                self.root.path().join(BUCKET).display()
            ),
            None => format!("file:// directory under {}", self.root.path().display()),
        }
    }

    pub(super) fn config(&self, prefix: &str) -> RemoteConfig {
        match &self.server {
            None => RemoteConfig {
                url: format!("file://{}", self.root.path().join(prefix).display()),
                options: Default::default(),
            },
            Some((_, port)) => RemoteConfig {
                url: format!("s3://{BUCKET}/{prefix}"),
                options: [
                    ("aws_endpoint", format!("http://127.0.0.1:{port}")),
                    ("aws_allow_http", "true".into()),
                    ("aws_access_key_id", "granary-bench".into()),
                    ("aws_secret_access_key", "granary-bench-secret".into()),
                    ("aws_region", "us-east-1".into()),
                    ("aws_virtual_hosted_style_request", "false".into()),
                ]
                .into_iter()
                .map(|(k, v)| (k.to_string(), v))
                .collect(),
            },
        }
    }

    /// The directory holding the objects written under `prefix`.
    pub(super) fn files(&self, prefix: &str) -> PathBuf {
        match &self.server {
            None => self.root.path().join(prefix),
            Some(_) => self.root.path().join(BUCKET).join(prefix),
        }
    }
}
