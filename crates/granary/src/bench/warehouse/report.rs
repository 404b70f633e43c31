//! What every part of the warehouse benchmark shares for reporting: the
//! host description for the header, aligned text tables, goal verdicts
//! (PASS/MISS with the figures) and progress bars.

use std::fmt::Write as _;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

/// The machine the run happened on, as printed in the header.
#[derive(Debug, Clone, Serialize)]
pub struct Host {
    pub cores: usize,
    pub memory_bytes: u64,
    pub cpu: String,
    pub kernel: String,
}

impl Host {
    pub fn probe() -> Host {
        let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let memory_bytes = meminfo
            .lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
            .map_or(0, |kib| kib * 1024);
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu = cpuinfo
            .lines()
            .find(|l| l.starts_with("model name"))
            .and_then(|l| l.split_once(':'))
            .map_or_else(|| "unknown CPU".to_string(), |(_, v)| v.trim().to_string());
        let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .map_or_else(|_| std::env::consts::OS.to_string(), |k| format!("Linux {}", k.trim()));
        Host { cores, memory_bytes, cpu, kernel }
    }

    pub fn describe(&self) -> String {
        format!(
            "{} cores ({}), {:.1} GiB memory, {}",
            self.cores,
            self.cpu,
            self.memory_bytes as f64 / (1u64 << 30) as f64,
            self.kernel
        )
    }
}

/// `YYYY-MM-DD HH:MM:SS UTC` for `t`, without a calendar dependency.
pub fn utc_timestamp(t: SystemTime) -> String {
    let secs = t.duration_since(UNIX_EPOCH).unwrap_or(Duration::ZERO).as_secs();
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    // Civil-from-days over 400-year eras of 146,097 days, with years starting in March.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02} UTC", rem / 3600, rem / 60 % 60, rem % 60)
}

/// The command line as typed, quoted where a shell would need it.
pub fn command_line() -> String {
    let mut args = std::env::args();
    let prog = args
        .next()
        .and_then(|p| std::path::Path::new(&p).file_name().map(|f| f.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "granary".into());
    std::iter::once(prog).chain(args.map(|a| shell_quote(&a))).collect::<Vec<_>>().join(" ")
}

fn shell_quote(a: &str) -> String {
    let plain = !a.is_empty() && a.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_./=,:@%+".contains(&b));
    if plain {
        a.to_string()
    } else {
        format!("'{}'", a.replace('\'', r"'\''"))
    }
}

/// A text table with right-aligned numeric columns.
pub struct Table {
    title: String,
    headers: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(title: impl Into<String>, headers: &[&str]) -> Table {
        Table { title: title.into(), headers: headers.iter().map(|h| h.to_string()).collect(), rows: Vec::new() }
    }

    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    pub fn render(&self) -> String {
        let cols = self.headers.len();
        let mut width: Vec<usize> = self.headers.iter().map(|h| h.chars().count()).collect();
        for r in &self.rows {
            for (i, c) in r.iter().enumerate().take(cols) {
                width[i] = width[i].max(c.chars().count());
            }
        }
        let line = |cells: &[String]| {
            let mut s = String::new();
            for (i, w) in width.iter().enumerate() {
                let c = cells.get(i).map_or("", String::as_str);
                let pad = w - c.chars().count();
                // First column reads as a label: left-aligned; figures right-aligned.
                if i == 0 {
                    let _ = write!(s, "{c}{}", " ".repeat(pad));
                } else {
                    let _ = write!(s, "  {}{c}", " ".repeat(pad));
                }
            }
            s.trim_end().to_string()
        };
        let mut out = format!("{}\n", self.title);
        out.push_str(&line(&self.headers));
        out.push('\n');
        let rule: Vec<String> = width.iter().map(|w| "-".repeat(*w)).collect();
        out.push_str(&line(&rule));
        out.push('\n');
        for r in &self.rows {
            out.push_str(&line(r));
            out.push('\n');
        }
        out
    }
}

/// A goal and whether this run met it, with the figures that decided.
#[derive(Debug, Clone, Serialize)]
pub struct Goal {
    pub part: &'static str,
    pub goal: String,
    pub pass: bool,
    pub figures: String,
}

impl Goal {
    pub fn new(part: &'static str, goal: impl Into<String>, pass: bool, figures: impl Into<String>) -> Goal {
        Goal { part, goal: goal.into(), pass, figures: figures.into() }
    }

    /// A goal the run could not measure counts as missed, with the reason.
    pub fn unmeasured(part: &'static str, goal: impl Into<String>, why: &str) -> Goal {
        Goal::new(part, goal, false, format!("not measured: {why}"))
    }

    pub fn render(&self) -> String {
        format!("{} {:<8} {} — {}", if self.pass { "PASS" } else { "MISS" }, self.part, self.goal, self.figures)
    }
}

/// A bar over `len` steps on stderr (hidden when stderr is not a terminal).
pub fn bar(len: u64, what: &str) -> ProgressBar {
    let pb = ProgressBar::new(len);
    pb.set_style(
        ProgressStyle::with_template("{prefix:>10} [{bar:30}] {pos}/{len} {msg} ({elapsed})")
            .expect("static template")
            .progress_chars("=> "),
    );
    pb.set_prefix(what.to_string());
    pb
}

/// A bar counting bytes.
pub fn byte_bar(len: u64, what: &str) -> ProgressBar {
    let pb = ProgressBar::new(len);
    pb.set_style(
        ProgressStyle::with_template("{prefix:>10} [{bar:30}] {bytes}/{total_bytes} {binary_bytes_per_sec} {msg}")
            .expect("static template")
            .progress_chars("=> "),
    );
    pb.set_prefix(what.to_string());
    pb
}

/// `1 MiB`, `64 KiB`: block and value sizes in the tables.
pub fn size_label(bytes: u64) -> String {
    if bytes >= 1 << 20 && bytes.is_multiple_of(1 << 20) {
        format!("{} MiB", bytes >> 20)
    } else if bytes >= 1 << 10 && bytes.is_multiple_of(1 << 10) {
        format!("{} KiB", bytes >> 10)
    } else {
        format!("{bytes} B")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_are_civil_dates() {
        assert_eq!(utc_timestamp(UNIX_EPOCH), "1970-01-01 00:00:00 UTC");
        // 2026-11-22 05:45:24 UTC.
        assert_eq!(utc_timestamp(UNIX_EPOCH + Duration::from_secs(1_795_326_324)), "2026-11-22 05:45:24 UTC");
        // 2024-02-29 12:00:00 UTC (a leap day).
        assert_eq!(utc_timestamp(UNIX_EPOCH + Duration::from_secs(1_709_208_000)), "2024-02-29 12:00:00 UTC");
    }

    #[test]
    fn tables_align() {
        let mut t = Table::new("T", &["size", "req/s"]);
        t.row(vec!["1 MiB".into(), "12".into()]);
        t.row(vec!["64 KiB".into(), "12345".into()]);
        let r = t.render();
        assert!(r.contains("1 MiB      12\n"), "{r}");
        assert!(r.contains("64 KiB  12345\n"), "{r}");
    }

    #[test]
    fn quoting() {
        assert_eq!(shell_quote("--only"), "--only");
        assert_eq!(shell_quote("a b"), "'a b'");
        assert_eq!(size_label(64 << 10), "64 KiB");
        assert_eq!(size_label(4 << 20), "4 MiB");
    }
}
