//! Engine logs: one file per model, appended to by the engine itself,
//! rotated by size, read back from the end.

use std::path::Path;

use crate::error::AgentError;

/// `model`'s log file in `logs_dir`, opened for appending.
pub(super) fn open_log(logs_dir: &Path, model: &str) -> Result<std::fs::File, AgentError> {
    let path = logs_dir.join(format!("{model}.log"));
    std::fs::File::options()
        .create(true)
        .append(true)
        .open(&path)
        .map_err(|e| AgentError::io(format!("opening {}", path.display()), e))
}

/// Copies `model`'s log aside and truncates it once past `max_bytes` (one
/// old file is kept; the engine writes with `O_APPEND`, so it goes on at
/// the start).
pub(super) fn rotate_log(logs_dir: &Path, model: &str, max_bytes: u64) {
    let path = logs_dir.join(format!("{model}.log"));
    let Ok(m) = std::fs::metadata(&path) else { return };
    if m.len() <= max_bytes {
        return;
    }
    let old = logs_dir.join(format!("{model}.log.1"));
    if std::fs::copy(&path, &old).is_ok() {
        if let Ok(f) = std::fs::File::options().write(true).open(&path) {
            let _ = f.set_len(0);
        }
    }
}

/// The last `n` lines of a file (reading at most its last 4 MiB).
pub fn tail_lines(path: &Path, n: usize) -> std::io::Result<String> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = std::fs::File::open(path)?;
    let len = f.metadata()?.len();
    let from = len.saturating_sub(4 << 20);
    f.seek(SeekFrom::Start(from))?;
    let mut buf = Vec::new();
    f.read_to_end(&mut buf)?;
    let text = String::from_utf8_lossy(&buf);
    let lines: Vec<&str> = text.lines().collect();
    let start = lines.len().saturating_sub(n);
    let mut out = lines[start..].join("\n");
    out.push('\n');
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tail_returns_the_last_lines() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("x.log");
        std::fs::write(&p, "a\nb\nc\nd\n").unwrap();
        assert_eq!(tail_lines(&p, 2).unwrap(), "c\nd\n");
        assert_eq!(tail_lines(&p, 10).unwrap(), "a\nb\nc\nd\n");
    }
}
