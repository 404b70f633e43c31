//! What the soak samples outside its own requests: RSS and open files of
//! processes (from `/proc`), and the warehouse's bytes per tier from a
//! Prometheus `/metrics` page.

use std::collections::BTreeMap;

use granary_core::metrics::warehouse::TIER_BYTES;

use super::ProcSample;

/// `pid` and its descendants, in pid order (children found through each
/// process's `/proc/PID/stat` parent field).
pub fn with_descendants(roots: &[u32]) -> Vec<u32> {
    let mut parent = BTreeMap::new();
    if let Ok(rd) = std::fs::read_dir("/proc") {
        for e in rd.flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
            if let Some(pp) = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok().and_then(|s| ppid_of(&s)) {
                parent.insert(pid, pp);
            }
        }
    }
    let mut out: Vec<u32> = roots.to_vec();
    let mut i = 0;
    while i < out.len() {
        let p = out[i];
        out.extend(parent.iter().filter(|(c, pp)| **pp == p && !out.contains(c)).map(|(c, _)| *c).collect::<Vec<_>>());
        i += 1;
    }
    out.sort_unstable();
    out.dedup();
    out
}

/// The parent pid from a `/proc/PID/stat` line (the field after the
/// parenthesised command, which may itself hold spaces and parentheses).
fn ppid_of(stat: &str) -> Option<u32> {
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(1)?.parse().ok()
}

/// RSS (`VmRSS`) and open file descriptors of `pid`; `None` once it is gone.
pub fn sample(pid: u32) -> Option<ProcSample> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let rss_bytes = vm_rss(&status)?;
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count() as u64;
    let name =
        std::fs::read_to_string(format!("/proc/{pid}/comm")).map_or_else(|_| "?".into(), |s| s.trim().to_string());
    Some(ProcSample { pid, name, rss_bytes, fds })
}

fn vm_rss(status: &str) -> Option<u64> {
    let kib: u64 = status.lines().find_map(|l| l.strip_prefix("VmRSS:"))?.split_whitespace().next()?.parse().ok()?;
    Some(kib * 1024)
}

/// `granary_warehouse_tier_bytes{tier="..."}` values of a Prometheus text
/// page, per tier.
pub fn tier_bytes(page: &str) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for line in page.lines() {
        let Some(rest) = line.strip_prefix(TIER_BYTES).and_then(|r| r.strip_prefix('{')) else { continue };
        let Some((labels, value)) = rest.split_once('}') else { continue };
        let Some(tier) = labels.split(',').find_map(|l| l.trim().strip_prefix("tier=")).map(|t| t.trim_matches('"'))
        else {
            continue;
        };
        let Some(v) = value.split_whitespace().next().and_then(|v| v.parse::<f64>().ok()) else { continue };
        *out.entry(tier.to_string()).or_insert(0) += v as u64;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_this_process() {
        let me = std::process::id();
        let s = sample(me).expect("this process is alive");
        assert!(s.rss_bytes > 1 << 20 && s.fds >= 3, "{s:?}");
        let child = std::process::Command::new("sleep").arg("5").spawn().unwrap();
        let all = with_descendants(&[me]);
        assert!(all.contains(&me) && all.contains(&child.id()), "{all:?}");
        let mut child = child;
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(sample(u32::MAX).is_none());
    }

    #[test]
    fn parses_stat_and_status() {
        assert_eq!(ppid_of("123 (a b) c) S 77 123 123 0"), Some(77));
        assert_eq!(vm_rss("Name:\tx\nVmRSS:\t  2048 kB\n"), Some(2 << 20));
    }

    #[test]
    fn parses_tier_bytes() {
        let page = "# TYPE granary_warehouse_tier_bytes gauge\n\
            granary_warehouse_tier_bytes{tier=\"memory\"} 1024\n\
            granary_warehouse_tier_bytes{tier=\"disk\"} 5e3\n\
            granary_warehouse_tier_bytes_other{tier=\"disk\"} 9\n\
            granary_warehouse_tier_entries{tier=\"memory\"} 3\n";
        let t = tier_bytes(page);
        assert_eq!(t.len(), 2, "{t:?}");
        assert_eq!((t["memory"], t["disk"]), (1024, 5000));
    }
}
