//! A real `redis-server` beside the warehouse, and its replies as the
//! reference: the same command sequence goes to both over raw sockets and
//! the replies are compared byte for byte.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A throwaway `redis-server` on a free loopback port, nothing persisted;
/// killed when dropped.
pub struct Redis {
    pub port: u16,
    child: Child,
}

impl Redis {
    /// `None` when redis-server is not installed (a failure under
    /// `GRANARY_REQUIRE_EXTERNAL=1`).
    pub fn start() -> Option<Redis> {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let spawned = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn();
        let child = match spawned {
            Ok(c) => c,
            Err(e) => {
                if std::env::var("GRANARY_REQUIRE_EXTERNAL").as_deref() == Ok("1") {
                    panic!("redis-server is required (GRANARY_REQUIRE_EXTERNAL=1): {e}");
                }
                eprintln!("skipped: redis-server not available ({e})");
                return None;
            }
        };
        let r = Redis { port, child };
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "redis-server did not listen on {port}");
            std::thread::sleep(Duration::from_millis(20));
        }
        Some(r)
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One RESP connection that sends a command and reads its whole reply.
pub struct Conn(BufReader<TcpStream>);

impl Conn {
    pub fn open(port: u16) -> Conn {
        let s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        Conn(BufReader::new(s))
    }

    /// A connection authenticated with `token` (the warehouse's admin, say).
    pub fn open_as(port: u16, token: &[u8]) -> Conn {
        let mut c = Conn::open(port);
        let ok = c.call(&[b"AUTH", token]);
        assert_eq!(ok, b"+OK\r\n", "AUTH answered {:?}", String::from_utf8_lossy(&ok));
        c
    }

    /// The reply to `args`, as the bytes on the wire.
    pub fn call(&mut self, args: &[&[u8]]) -> Vec<u8> {
        let mut frame = format!("*{}\r\n", args.len()).into_bytes();
        for a in args {
            frame.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
            frame.extend_from_slice(a);
            frame.extend_from_slice(b"\r\n");
        }
        self.0.get_mut().write_all(&frame).unwrap();
        let mut out = Vec::new();
        self.reply(&mut out);
        out
    }

    fn reply(&mut self, out: &mut Vec<u8>) {
        let start = out.len();
        let n = self.0.read_until(b'\n', out).unwrap();
        assert!(n >= 3 && out.ends_with(b"\r\n"), "a broken reply: {:?}", String::from_utf8_lossy(&out[start..]));
        let line = String::from_utf8_lossy(&out[start + 1..out.len() - 2]).into_owned();
        match out[start] {
            b'$' => {
                let len: i64 = line.parse().unwrap();
                if len >= 0 {
                    let mut body = vec![0; len as usize + 2];
                    self.0.read_exact(&mut body).unwrap();
                    out.extend_from_slice(&body);
                }
            }
            b'*' => {
                let len: i64 = line.parse().unwrap();
                for _ in 0..len.max(0) {
                    self.reply(out);
                }
            }
            _ => {}
        }
    }
}

/// Sends every command of `script` in order to the warehouse on `ours` and
/// to Redis on `reference`, one connection each, and returns each command
/// whose replies differ, with both replies.
pub fn differences(ours: u16, reference: u16, script: &[Vec<Vec<u8>>]) -> Vec<String> {
    let (mut a, mut b) = (Conn::open(ours), Conn::open(reference));
    let mut out = Vec::new();
    for cmd in script {
        let args: Vec<&[u8]> = cmd.iter().map(Vec::as_slice).collect();
        let (got, want) = (a.call(&args), b.call(&args));
        if got != want {
            let show = |b: &[u8]| String::from_utf8_lossy(b).replace("\r\n", "\\r\\n");
            let words: Vec<String> = args.iter().map(|a| String::from_utf8_lossy(a).into_owned()).collect();
            out.push(format!("{}: warehouse {:?}, redis {:?}", words.join(" "), show(&got), show(&want)));
        }
    }
    out
}

/// A script from lines of space-separated words.
pub fn script(lines: &[&str]) -> Vec<Vec<Vec<u8>>> {
    lines.iter().map(|l| l.split(' ').map(|w| w.as_bytes().to_vec()).collect()).collect()
}
