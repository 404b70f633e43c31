//! `disk`: how close the disk tier comes to the disk it sits on.
//!
//! Writes blocks of 1, 4 and 16 MiB through the `Tier` API of a freshly
//! opened disk tier, counting until `flush()` returns (data fsynced), drops
//! the written files from the page cache, then reads every block back. The
//! anchor is the raw sequential bandwidth of the same filesystem measured
//! in the same run by `fio` with the same block size and total bytes, at
//! the tier's depth: `--ioengine=libaio --iodepth=4` (the tier keeps 4
//! blocks in flight, [`IN_FLIGHT`]) with `--direct=1`, since libaio only
//! queues I/O that bypasses the page cache (`--end_fsync=1` for writes); when
//! `fio` is missing, a plain `std::fs` sequential write + fsync and read of
//! one file stands in, and the report says so. Each block size runs three
//! rounds (one with `--quick`), alternating whether the tier or the anchor
//! goes first; the report gives each figure's median and the range of the
//! ratios, since a virtual disk's bandwidth varies from run to run.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, ensure, Context, Result};
use bytes::Bytes;
use futures::StreamExt;
use granary_core::ByteSize;
use granary_warehouse::config::DiskConfig;
use granary_warehouse::tier::at_rest::AtRest;
use granary_warehouse::tier::disk::open_disk;
use granary_warehouse::{EntryMeta, PolicyKind, Tier};
use rand::rngs::StdRng;
use rand::{RngCore, SeedableRng};
use serde::Serialize;

use super::report::{byte_bar, size_label, Goal, Table};
use super::Ctx;

const NS: &str = "bench";
const SIZES: [u64; 3] = [1 << 20, 4 << 20, 16 << 20];
/// Distinct random values cycled through, so that no two neighbours are equal.
const POOL: usize = 8;

#[derive(Debug, Serialize)]
pub struct DiskRow {
    pub block_bytes: u64,
    pub total_bytes: u64,
    pub granary_write_gbps: f64,
    pub raw_write_gbps: f64,
    pub write_ratio: f64,
    pub granary_read_gbps: f64,
    pub raw_read_gbps: f64,
    pub read_ratio: f64,
    /// Share of the tier's file pages still cached when the read pass began.
    pub resident_before_read: f64,
    /// Rounds behind the medians, and the lowest and highest round's ratios.
    pub rounds: usize,
    pub write_ratio_range: (f64, f64),
    pub read_ratio_range: (f64, f64),
}

#[derive(Debug, Serialize)]
pub struct DiskReport {
    pub dir: PathBuf,
    /// `fio 3.x` or the `std::fs` fallback.
    pub anchor: String,
    pub rows: Vec<DiskRow>,
}

pub async fn run(ctx: &Ctx) -> Result<DiskReport> {
    let base = match &ctx.dir {
        Some(d) => {
            std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
            tempfile::Builder::new().prefix("granary-bench-").tempdir_in(d)?
        }
        None => tempfile::Builder::new().prefix(".granary-bench-").tempdir_in(".")?,
    };
    let total = if ctx.quick { 32u64 << 20 } else { 1u64 << 30 };
    let fio = fio_version();
    let anchor = match &fio {
        Some(v) => format!("{v} libaio iodepth={IN_FLIGHT} direct"),
        None => {
            eprintln!(
                "disk: fio not found on PATH; the raw anchor falls back to a std::fs sequential write+fsync/read"
            );
            "std::fs sequential file (fio missing)".to_string()
        }
    };
    let mut rng = StdRng::seed_from_u64(ctx.seed ^ 0xd15c);
    let mut rows = Vec::new();
    for bs in SIZES {
        let n = (total / bs).max(1);
        let total = n * bs;
        let pool: Vec<Bytes> = (0..POOL)
            .map(|_| {
                let mut v = vec![0u8; bs as usize];
                rng.fill_bytes(&mut v);
                Bytes::from(v)
            })
            .collect();
        let rounds = if ctx.quick { 1 } else { ROUNDS };
        // Per round: (tier write, tier read, resident, raw write, raw read), bytes/s.
        let mut runs: Vec<[f64; 5]> = Vec::new();
        for round in 0..rounds {
            let mut tier = None;
            let mut raw = None;
            // Alternating who goes first, so neither always meets the disk fresh.
            for tier_now in [round % 2 == 0, round % 2 != 0] {
                if tier_now {
                    let dir = base.path().join(format!("tier-{}", bs >> 20));
                    tier = Some(tier_pass(&dir, bs, n, &pool).await?);
                    std::fs::remove_dir_all(&dir).ok();
                } else {
                    let file = base.path().join("raw.dat");
                    raw = Some(match fio {
                        Some(_) => (fio_pass(&file, "write", bs, total)?, fio_pass(&file, "read", bs, total)?),
                        None => fs_pass(&file, bs, n, &pool)?,
                    });
                    std::fs::remove_file(&file).ok();
                }
            }
            let ((gw, gr, resident), (rw, rr)) = (tier.expect("tier pass ran"), raw.expect("raw pass ran"));
            runs.push([gw, gr, resident, rw, rr]);
        }
        let med = |i: usize| median(runs.iter().map(|r| r[i]).collect());
        let range = |f: &dyn Fn(&[f64; 5]) -> f64| {
            runs.iter().map(f).fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), x| (lo.min(x), hi.max(x)))
        };
        let (gw, gr, resident, rw, rr) = (med(0), med(1), med(2), med(3), med(4));
        let gb = |bytes_per_s: f64| bytes_per_s / 1e9;
        rows.push(DiskRow {
            block_bytes: bs,
            total_bytes: total,
            granary_write_gbps: gb(gw),
            raw_write_gbps: gb(rw),
            write_ratio: gw / rw,
            granary_read_gbps: gb(gr),
            raw_read_gbps: gb(rr),
            read_ratio: gr / rr,
            resident_before_read: resident,
            rounds,
            write_ratio_range: range(&|r| r[0] / r[3]),
            read_ratio_range: range(&|r| r[1] / r[4]),
        });
    }
    Ok(DiskReport { dir: base.path().to_path_buf(), anchor, rows })
}

/// Rounds per block size (one with `--quick`).
const ROUNDS: usize = 3;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// Blocks in flight at once, as an engine saving or loading a prompt's
/// prefix has them; fio's anchor runs at the same depth.
const IN_FLIGHT: usize = 4;

/// Writes `n` blocks through a fresh disk tier and reads them back;
/// (write bytes/s, read bytes/s, resident share before the read).
async fn tier_pass(dir: &Path, bs: u64, n: u64, pool: &[Bytes]) -> Result<(f64, f64, f64)> {
    let cfg =
        DiskConfig { dir: dir.to_path_buf(), capacity: ByteSize(2 * n * bs + (64 << 20)), policy: PolicyKind::Lru };
    let tier = open_disk(&cfg, AtRest::from_config(None, None)?).await.context("opening the disk tier")?;
    let key = |i: u64| Bytes::from(format!("{:064x}", u128::from(i) * 0x9e37_79b9_7f4a_7c15 + u128::from(bs)));
    let total = n * bs;

    let pb = byte_bar(total, &format!("{} write", size_label(bs)));
    let t = Instant::now();
    let mut puts = futures::stream::iter(0..n)
        .map(|i| tier.put(NS, key(i), pool[i as usize % pool.len()].clone(), EntryMeta::default()))
        .buffer_unordered(IN_FLIGHT);
    while let Some(evicted) = puts.next().await {
        ensure!(evicted?.is_empty(), "the disk tier evicted blocks under a budget twice the data");
        pb.inc(bs);
    }
    drop(puts);
    tier.flush().await.context("flushing the disk tier")?;
    let write = total as f64 / t.elapsed().as_secs_f64();
    pb.finish_and_clear();

    let files = files_under(dir);
    for f in &files {
        drop_from_page_cache(f)?;
    }
    let resident = resident_share(&files);

    let pb = byte_bar(total, &format!("{} read", size_label(bs)));
    let t = Instant::now();
    let keys: Vec<Bytes> = (0..n).map(key).collect();
    let tier = &tier;
    let mut gets = futures::stream::iter(keys.iter().enumerate())
        .map(|(i, k)| async move { (i, tier.get(NS, k).await) })
        .buffered(IN_FLIGHT);
    while let Some((i, got)) = gets.next().await {
        let s = got?.with_context(|| format!("block {i} missing from the disk tier"))?;
        ensure!(s.value.len() as u64 == bs, "block {i} came back with {} bytes", s.value.len());
        pb.inc(bs);
    }
    let read = total as f64 / t.elapsed().as_secs_f64();
    pb.finish_and_clear();
    Ok((write, read, resident))
}

pub(in crate::bench) fn fio_version() -> Option<String> {
    let out = Command::new("fio").arg("--version").output().ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// One fio job over `file`; bytes/s as fio reports it (`bw_bytes`).
fn fio_pass(file: &Path, rw: &str, bs: u64, total: u64) -> Result<f64> {
    let mut cmd = Command::new("fio");
    cmd.arg("--name=raw")
        .arg(format!("--filename={}", file.display()))
        .arg(format!("--rw={rw}"))
        .arg(format!("--bs={bs}"))
        .arg(format!("--size={total}"))
        .arg("--ioengine=libaio")
        .arg(format!("--iodepth={IN_FLIGHT}"))
        .arg("--direct=1")
        .arg("--output-format=json");
    cmd.arg(if rw == "write" { "--end_fsync=1" } else { "--invalidate=1" });
    let out = cmd.output().context("running fio")?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!("fio --rw={rw} failed: {}{}", stdout.trim(), String::from_utf8_lossy(&out.stderr).trim());
    }
    parse_fio(&stdout, rw)
}

pub(in crate::bench) fn parse_fio(stdout: &str, rw: &str) -> Result<f64> {
    let json = stdout.find('{').map(|i| &stdout[i..]).context("fio printed no JSON")?;
    let v: serde_json::Value = serde_json::from_str(json).context("parsing fio's JSON")?;
    let bw = v["jobs"][0][rw]["bw_bytes"].as_f64().context("fio JSON lacks jobs[0].<rw>.bw_bytes")?;
    ensure!(bw > 0.0, "fio reported no {rw} bandwidth");
    Ok(bw)
}

/// The fallback anchor: one file written in `bs` chunks then fsynced, and
/// read back after leaving the page cache; (write bytes/s, read bytes/s).
fn fs_pass(file: &Path, bs: u64, n: u64, pool: &[Bytes]) -> Result<(f64, f64)> {
    let t = Instant::now();
    let mut f = File::create(file)?;
    for i in 0..n {
        f.write_all(&pool[i as usize % pool.len()])?;
    }
    f.sync_all()?;
    let write = (n * bs) as f64 / t.elapsed().as_secs_f64();
    drop(f);
    drop_from_page_cache(file)?;
    let mut buf = vec![0u8; bs as usize];
    let t = Instant::now();
    let mut f = File::open(file)?;
    for _ in 0..n {
        f.read_exact(&mut buf)?;
    }
    let read = (n * bs) as f64 / t.elapsed().as_secs_f64();
    Ok((write, read))
}

pub(in crate::bench) fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else { continue };
        for e in rd.flatten() {
            match e.file_type() {
                Ok(t) if t.is_dir() => stack.push(e.path()),
                Ok(t) if t.is_file() => out.push(e.path()),
                _ => {}
            }
        }
    }
    out
}

/// Makes the file's data durable, then asks the kernel to drop its pages,
/// so the read pass measures the disk rather than memory. Per file rather
/// than `/proc/sys/vm/drop_caches`, which would also empty the cache of
/// everything else running on the host.
pub(in crate::bench) fn drop_from_page_cache(path: &Path) -> Result<()> {
    let f = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    f.sync_data().ok();
    // SAFETY: a valid open descriptor; the call only advises the kernel.
    let rc = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    ensure!(rc == 0, "posix_fadvise(DONTNEED) on {} failed: {}", path.display(), std::io::Error::from_raw_os_error(rc));
    Ok(())
}

/// Share of the files' pages in the page cache (mincore); 0 when unknown.
pub(in crate::bench) fn resident_share(files: &[PathBuf]) -> f64 {
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as usize;
    let (mut resident, mut pages) = (0usize, 0usize);
    for path in files {
        let Ok(f) = File::open(path) else { continue };
        let len = f.metadata().map_or(0, |m| m.len() as usize);
        if len == 0 {
            continue;
        }
        // SAFETY: a read-only shared mapping of a file we keep open; it is
        // only passed to mincore and unmapped before `f` is dropped.
        unsafe {
            let p = libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ, libc::MAP_SHARED, f.as_raw_fd(), 0);
            if p == libc::MAP_FAILED {
                continue;
            }
            let n = len.div_ceil(page);
            let mut vec = vec![0u8; n];
            if libc::mincore(p, len, vec.as_mut_ptr()) == 0 {
                resident += vec.iter().filter(|b| **b & 1 == 1).count();
                pages += n;
            }
            libc::munmap(p, len);
        }
    }
    if pages == 0 {
        0.0
    } else {
        resident as f64 / pages as f64
    }
}

pub fn tables(r: &DiskReport) -> Vec<Table> {
    let mut t = Table::new(
        format!("disk: disk-tier write (until flush() fsynced) and cold read vs raw sequential I/O ({})", r.anchor),
        &["block", "total", "op", "rounds", "granary GB/s", "raw GB/s", "ratio", "ratio range", "cached at read"],
    );
    for row in &r.rows {
        let total = format!("{} MiB", row.total_bytes >> 20);
        t.row(vec![
            size_label(row.block_bytes),
            total.clone(),
            "write".into(),
            row.rounds.to_string(),
            format!("{:.3}", row.granary_write_gbps),
            format!("{:.3}", row.raw_write_gbps),
            format!("{:.0}%", row.write_ratio * 100.0),
            format!("{:.0}-{:.0}%", row.write_ratio_range.0 * 100.0, row.write_ratio_range.1 * 100.0),
            String::new(),
        ]);
        t.row(vec![
            size_label(row.block_bytes),
            total,
            "read".into(),
            row.rounds.to_string(),
            format!("{:.3}", row.granary_read_gbps),
            format!("{:.3}", row.raw_read_gbps),
            format!("{:.0}%", row.read_ratio * 100.0),
            format!("{:.0}-{:.0}%", row.read_ratio_range.0 * 100.0, row.read_ratio_range.1 * 100.0),
            format!("{:.1}%", row.resident_before_read * 100.0),
        ]);
    }
    vec![t]
}

pub fn goals(r: &DiskReport) -> Vec<Goal> {
    let figures = |f: &dyn Fn(&DiskRow) -> f64| {
        r.rows.iter().map(|row| format!("{} {:.0}%", size_label(row.block_bytes), f(row) * 100.0)).collect::<Vec<_>>()
    };
    let read_ok = !r.rows.is_empty() && r.rows.iter().all(|row| row.read_ratio >= 0.90);
    let write_ok = !r.rows.is_empty() && r.rows.iter().all(|row| row.write_ratio >= 0.85);
    vec![
        Goal::new("disk", "read >= 90% of raw, every block size", read_ok, figures(&|row| row.read_ratio).join(", ")),
        Goal::new(
            "disk",
            "write >= 85% of raw, every block size",
            write_ok,
            figures(&|row| row.write_ratio).join(", "),
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_fio_json() {
        let out = "note: both iodepth >= 1 and synchronous I/O engine are selected\n{\"jobs\":[{\"write\":{\"bw_bytes\":1130254551}}]}";
        assert_eq!(parse_fio(out, "write").unwrap(), 1_130_254_551.0);
        assert!(parse_fio(out, "read").is_err());
    }

    #[test]
    fn medians() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 3.0, 2.0]), 2.5);
        assert!(median(Vec::new()).is_nan());
    }
}
