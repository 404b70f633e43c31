//! `resp`'s multi-key row: one `MSET` of many large values, then one `MGET`
//! of them all, against granary and Redis in alternating rounds. A frame
//! of many large arguments is where a reader that grows its buffer
//! argument by argument goes quadratic (an MSET of 100 values of 1 MiB
//! once took 12.8 s here against Redis's 0.18 s).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use serde::Serialize;

use super::report::{size_label, Goal, Table};

/// Values per command, and their size.
const VALUES: usize = 200;
const QUICK_VALUES: usize = 20;
const VALUE_BYTES: usize = 1 << 20;
/// granary's time within this multiple of Redis's.
const GOAL: f64 = 2.0;

#[derive(Debug, Clone, Serialize)]
pub struct MultiRow {
    pub op: &'static str,
    pub server: &'static str,
    pub values: usize,
    pub value_bytes: usize,
    pub rounds: usize,
    /// Median, lowest and highest round, seconds for the one command.
    pub seconds: f64,
    pub seconds_min: f64,
    pub seconds_max: f64,
    /// granary / redis (time), on the granary row.
    pub ratio: Option<f64>,
}

/// One connection's `MSET` then `MGET` of `values` keys; seconds for each.
fn one_round(port: u16, values: usize, tag: usize) -> Result<[f64; 2]> {
    let s = TcpStream::connect(("127.0.0.1", port)).with_context(|| format!("connecting to 127.0.0.1:{port}"))?;
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(Duration::from_secs(120)))?;
    let mut r = BufReader::with_capacity(1 << 20, s.try_clone()?);
    let mut w = s;
    let keys: Vec<String> = (0..values).map(|i| format!("multi:{tag}:{i}")).collect();
    let value = vec![b'v'; VALUE_BYTES];
    let mut mset = format!("*{}\r\n$4\r\nMSET\r\n", 1 + 2 * values).into_bytes();
    for k in &keys {
        mset.extend_from_slice(format!("${}\r\n{k}\r\n${VALUE_BYTES}\r\n", k.len()).as_bytes());
        mset.extend_from_slice(&value);
        mset.extend_from_slice(b"\r\n");
    }
    let mut mget = format!("*{}\r\n$4\r\nMGET\r\n", 1 + values).into_bytes();
    for k in &keys {
        mget.extend_from_slice(format!("${}\r\n{k}\r\n", k.len()).as_bytes());
    }
    let t = Instant::now();
    w.write_all(&mset)?;
    let mut line = String::new();
    r.read_line(&mut line)?;
    ensure!(line == "+OK\r\n", "MSET answered {line:?}");
    let set_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    w.write_all(&mget)?;
    line.clear();
    r.read_line(&mut line)?;
    ensure!(line == format!("*{values}\r\n"), "MGET answered {line:?}");
    let mut body = vec![0u8; VALUE_BYTES + 2];
    for k in &keys {
        line.clear();
        r.read_line(&mut line)?;
        if line != format!("${VALUE_BYTES}\r\n") {
            bail!("MGET's value for {k}: {line:?}");
        }
        r.read_exact(&mut body)?;
        ensure!(body[..VALUE_BYTES] == value[..], "MGET's value for {k} differs from what MSET stored");
    }
    let get_s = t.elapsed().as_secs_f64();
    // Leave the servers as they were.
    let mut del = format!("*{}\r\n$3\r\nDEL\r\n", 1 + values).into_bytes();
    for k in &keys {
        del.extend_from_slice(format!("${}\r\n{k}\r\n", k.len()).as_bytes());
    }
    w.write_all(&del)?;
    line.clear();
    r.read_line(&mut line)?;
    ensure!(line == format!(":{values}\r\n"), "DEL answered {line:?}");
    Ok([set_s, get_s])
}

/// Rounds over `servers` (name, port; the anchor first), each round
/// starting with the next server.
pub fn measure(servers: &[(&'static str, u16)], quick: bool, rounds: usize) -> Result<Vec<MultiRow>> {
    let values = if quick { QUICK_VALUES } else { VALUES };
    let mut runs: Vec<Vec<[f64; 2]>> = vec![Vec::new(); servers.len()];
    for round in 0..rounds {
        for k in 0..servers.len() {
            let at = (k + round) % servers.len();
            let (name, port) = servers[at];
            runs[at].push(one_round(port, values, round).with_context(|| format!("{name}: MSET/MGET"))?);
        }
    }
    let mut rows = Vec::new();
    for (op_i, op) in ["MSET", "MGET"].into_iter().enumerate() {
        let mut anchor = None;
        for ((name, _), r) in servers.iter().zip(&runs) {
            let mut t: Vec<f64> = r.iter().map(|x| x[op_i]).collect();
            t.sort_by(f64::total_cmp);
            let median = t[t.len() / 2];
            let ratio = anchor.map(|a: f64| median / a);
            anchor.get_or_insert(median);
            rows.push(MultiRow {
                op,
                server: name,
                values,
                value_bytes: VALUE_BYTES,
                rounds: t.len(),
                seconds: median,
                seconds_min: t[0],
                seconds_max: t[t.len() - 1],
                ratio,
            });
        }
    }
    Ok(rows)
}

pub fn table(rows: &[MultiRow]) -> Table {
    let mut t = Table::new(
        "resp: one MSET of N large values, then one MGET of them, one connection; medians of rotating rounds",
        &["op", "server", "values", "size", "rounds", "seconds", "range", "time ratio"],
    );
    for r in rows {
        t.row(vec![
            r.op.to_string(),
            r.server.to_string(),
            r.values.to_string(),
            size_label(r.value_bytes as u64),
            r.rounds.to_string(),
            format!("{:.3}", r.seconds),
            format!("{:.3}-{:.3}", r.seconds_min, r.seconds_max),
            r.ratio.map_or_else(|| "anchor".into(), |x| format!("{x:.2}x")),
        ]);
    }
    t
}

pub fn goals(rows: &[MultiRow], why_not: Option<&str>) -> Vec<Goal> {
    ["MSET", "MGET"]
        .into_iter()
        .map(|op| {
            let n = rows.first().map_or(VALUES, |r| r.values);
            let goal = format!("{op} of {n} x 1 MiB: granary within {GOAL:.0}x Redis's time");
            let find = |s: &str| rows.iter().find(|r| r.op == op && r.server == s);
            match (find("granary"), find("redis")) {
                (Some(g), Some(a)) => {
                    let ratio = g.seconds / a.seconds;
                    let figures = format!(
                        "{:.3} vs {:.3} s ({ratio:.2}x) for {} values of {}",
                        g.seconds,
                        a.seconds,
                        g.values,
                        size_label(g.value_bytes as u64)
                    );
                    Goal::new("resp", goal, ratio <= GOAL, figures)
                }
                _ => Goal::unmeasured("resp", goal, why_not.unwrap_or("not measured")),
            }
        })
        .collect()
}
