//! A real nginx serving files with HTTP range support, and its access log
//! read back to count what clients fetched.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Whether tests must fail rather than skip when a program is missing.
pub fn required() -> bool {
    std::env::var("GRANARY_REQUIRE_EXTERNAL").is_ok_and(|v| v == "1")
}

fn nginx_bin() -> Option<PathBuf> {
    ["nginx", "/usr/sbin/nginx"].iter().map(PathBuf::from).find(|p| {
        Command::new(p).arg("-v").stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok_and(|s| s.success())
    })
}

/// One request in nginx's access log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hit {
    pub uri: String,
    pub status: u16,
    pub bytes: u64,
    pub range: String,
}

/// nginx serving `root` at `/fast/` and, at 256 KiB/s per connection, at `/slow/`.
pub struct Nginx {
    child: Child,
    dir: tempfile::TempDir,
    pub port: u16,
}

impl Nginx {
    /// Starts nginx, or returns `None` (after saying why) when it is not installed.
    pub fn start(root: &Path) -> Option<Nginx> {
        let Some(bin) = nginx_bin() else {
            assert!(!required(), "nginx is not installed and GRANARY_REQUIRE_EXTERNAL=1");
            eprintln!("skipping: nginx is not installed (scripts/test.sh installs it)");
            return None;
        };
        let dir = tempfile::tempdir().unwrap();
        // nginx cannot take a bound socket: find a free port, then let it bind.
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let d = dir.path().display();
        let r = root.display();
        let conf = format!(
            "worker_processes 1;\ndaemon off;\nmaster_process off;\npid {d}/nginx.pid;\nerror_log {d}/error.log warn;\n\
             events {{ worker_connections 256; }}\n\
             http {{\n  log_format counts '$request_uri $status $body_bytes_sent \"$http_range\"';\n\
             access_log {d}/access.log counts;\n  client_body_temp_path {d}/body;\n  proxy_temp_path {d}/proxy;\n\
             fastcgi_temp_path {d}/fcgi;\n  uwsgi_temp_path {d}/uwsgi;\n  scgi_temp_path {d}/scgi;\n\
             server {{\n    listen 127.0.0.1:{port};\n    location /fast/ {{ alias {r}/; }}\n\
             location /slow/ {{ alias {r}/; limit_rate 256k; }}\n  }}\n}}\n"
        );
        let path = dir.path().join("nginx.conf");
        std::fs::write(&path, conf).unwrap();
        let child = Command::new(bin)
            .args(["-p", &d.to_string(), "-c", &path.display().to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start nginx");
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "nginx did not start listening");
            std::thread::sleep(Duration::from_millis(20));
        }
        Some(Nginx { child, dir, port })
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    /// Every request logged so far.
    pub fn hits(&self) -> Vec<Hit> {
        let text = std::fs::read_to_string(self.dir.path().join("access.log")).unwrap_or_default();
        text.lines()
            .filter_map(|l| {
                let mut it = l.splitn(4, ' ');
                Some(Hit {
                    uri: it.next()?.to_string(),
                    status: it.next()?.parse().ok()?,
                    bytes: it.next()?.parse().ok()?,
                    range: it.next()?.trim_matches('"').to_string(),
                })
            })
            .collect()
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Deterministic bytes that differ at every offset of interest.
pub fn data(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

pub fn sha256_hex(b: &[u8]) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(b))
}

/// Every file under `dir`, recursively.
pub fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else { continue };
        for e in rd.flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push(p);
            }
        }
    }
    out
}
