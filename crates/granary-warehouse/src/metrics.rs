//! Prometheus exposition of the warehouse.
//!
//! Store and protocol numbers already live in atomics ([`crate::Store::stats`],
//! [`crate::server::ProtocolStats`]), so they are not mirrored into a second
//! set of counters: every scrape builds a fresh [`Registry`], fills it from a
//! snapshot and encodes it. Only what exists nowhere else — the HTTP
//! request-duration histogram — is kept here, in [`HttpMetrics`], and added
//! to each scrape's registry.
//!
//! Names come from [`granary_core::metrics::warehouse`]; every label value is
//! drawn from a bounded set (tiers, protocols, outcomes, route templates,
//! method names, status classes), never from client input.

use std::sync::atomic::AtomicU64;
use std::time::Duration;

use granary_core::metrics::warehouse as names;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use crate::server::{ProtocolSnapshot, ServerCtx};
use crate::store::StoreStats;
use crate::tier::TierKind;

/// Content type of [`render`]'s output.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
/// Content type of [`to_prometheus_text`]'s output.
pub const PROMETHEUS_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

type Labels = Vec<(&'static str, &'static str)>;
type U64Gauge = Gauge<u64, AtomicU64>;
type HistogramFamily = Family<Labels, Histogram, fn() -> Histogram>;

/// Request-latency buckets: 100 µs to about 13 s.
fn latency_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.0001, 2.0, 18))
}

/// Metrics the HTTP front end records itself.
#[derive(Clone)]
pub struct HttpMetrics {
    durations: HistogramFamily,
}

impl Default for HttpMetrics {
    fn default() -> Self {
        HttpMetrics { durations: Family::new_with_constructor(latency_histogram as fn() -> Histogram) }
    }
}

impl HttpMetrics {
    /// Records one request. `route` must be a route template or another
    /// fixed string, never a raw path.
    pub fn observe(&self, method: &'static str, route: &'static str, status: u16, elapsed: Duration) {
        let labels = vec![("method", method), ("route", route), ("status", status_class(status))];
        self.durations.get_or_create(&labels).observe(elapsed.as_secs_f64());
    }
}

/// The status class label of an HTTP status (`2xx` … `5xx`).
pub fn status_class(status: u16) -> &'static str {
    match status {
        100..=199 => "1xx",
        200..=299 => "2xx",
        300..=399 => "3xx",
        400..=499 => "4xx",
        _ => "5xx",
    }
}

/// A per-tier (or per-protocol) family of counters filled from a snapshot.
fn counter_family(reg: &mut Registry, name: &str, help: &str, values: &[(Labels, u64)]) {
    let fam = Family::<Labels, Counter>::default();
    for (labels, v) in values {
        fam.get_or_create(labels).inc_by(*v);
    }
    reg.register(names::counter_base(name), help, fam);
}

fn gauge_family(reg: &mut Registry, name: &str, help: &str, values: &[(Labels, u64)]) {
    let fam = Family::<Labels, U64Gauge>::default();
    for (labels, v) in values {
        fam.get_or_create(labels).set(*v);
    }
    reg.register(name, help, fam);
}

fn per_tier(stats: &StoreStats, f: impl Fn(&crate::types::TierStats) -> u64) -> Vec<(Labels, u64)> {
    stats.tiers.iter().filter_map(|t| t.tier.map(|k| (vec![("tier", k.as_str())], f(t)))).collect()
}

fn per_offload(stats: &StoreStats, f: impl Fn(&crate::store::OffloadStats) -> u64) -> Vec<(Labels, u64)> {
    stats.offload.iter().filter_map(|o| o.tier.map(|k| (vec![("tier", k.as_str())], f(o)))).collect()
}

fn per_protocol(
    protocols: &[(&'static str, ProtocolSnapshot)],
    f: impl Fn(&ProtocolSnapshot) -> u64,
) -> Vec<(Labels, u64)> {
    protocols.iter().map(|(p, s)| (vec![("protocol", *p)], f(s))).collect()
}

/// Fills a registry with the store's and the servers' numbers as they are now.
fn collect(reg: &mut Registry, ctx: &ServerCtx, uptime: Duration) {
    let s = ctx.store.stats();
    gauge_family(reg, names::TIER_BYTES, "Bytes held per tier.", &per_tier(&s, |t| t.bytes));
    gauge_family(reg, names::TIER_ENTRIES, "Entries held per tier.", &per_tier(&s, |t| t.entries));
    gauge_family(
        reg,
        names::TIER_CAPACITY_BYTES,
        "Byte budget per tier (0 = unbounded).",
        &per_tier(&s, |t| t.capacity),
    );
    counter_family(reg, names::HITS, "Read hits per tier.", &per_tier(&s, |t| t.hits));
    counter_family(reg, names::MISSES, "Read misses per tier.", &per_tier(&s, |t| t.misses));
    counter_family(reg, names::EVICTIONS, "Entries evicted per tier.", &per_tier(&s, |t| t.evictions));
    counter_family(reg, names::EXPIRATIONS, "Entries that expired per tier.", &per_tier(&s, |t| t.expirations));
    counter_family(
        reg,
        names::CORRUPT_DROPPED,
        "Corrupt or torn entries found and dropped per tier.",
        &per_tier(&s, |t| t.corrupt_dropped),
    );
    counter_family(reg, names::TIER_ERRORS, "Tier I/O errors.", &per_tier(&s, |t| t.errors));
    if let Some(remote) = s.tiers.iter().find(|t| t.tier == Some(TierKind::Remote)) {
        let c = Counter::<u64>::default();
        c.inc_by(remote.verify_failed);
        reg.register(
            names::counter_base(names::REMOTE_VERIFY_FAILED),
            "Remote-tier reads that failed verification; skipped, the shared object left in place.",
            c,
        );
    }
    counter_family(
        reg,
        names::RECOVERED,
        "Entries recovered from persistent storage at start.",
        &per_tier(&s, |t| t.recovered),
    );
    counter_family(
        reg,
        names::OFFLOADS_QUEUED,
        "Offloads accepted into a slower tier's queue.",
        &per_offload(&s, |o| o.queued),
    );
    counter_family(reg, names::OFFLOADS, "Offloads written to a slower tier.", &per_offload(&s, |o| o.written));
    counter_family(
        reg,
        names::OFFLOADS_DROPPED,
        "Offloads dropped because the tier's queue was full.",
        &per_offload(&s, |o| o.dropped),
    );
    counter_family(
        reg,
        names::OFFLOAD_ERRORS,
        "Offloads that failed to write to a slower tier.",
        &per_offload(&s, |o| o.errors),
    );
    counter_family(
        reg,
        names::PROMOTIONS,
        "Hits promoted into memory, by the tier they were found in.",
        &[(vec![("tier", "disk")], s.promotions_from_disk), (vec![("tier", "remote")], s.promotions_from_remote)],
    );

    let protocols = [("http", ctx.http.snapshot()), ("resp", ctx.resp.snapshot()), ("lm", ctx.lm.snapshot())];
    let mut requests = Vec::new();
    for (p, snap) in &protocols {
        requests.push((vec![("protocol", *p), ("outcome", "ok")], snap.requests_ok));
        requests.push((vec![("protocol", *p), ("outcome", "error")], snap.requests_error));
    }
    counter_family(reg, names::REQUESTS, "Requests served per protocol and outcome.", &requests);
    gauge_family(
        reg,
        names::CONNECTIONS,
        "Open client connections per protocol.",
        &per_protocol(&protocols, |p| p.connections_open),
    );
    counter_family(
        reg,
        names::CONNECTIONS_ACCEPTED,
        "Client connections accepted per protocol.",
        &per_protocol(&protocols, |p| p.connections_total),
    );
    counter_family(
        reg,
        names::READ_BYTES,
        "Bytes the server read from clients.",
        &per_protocol(&protocols, |p| p.bytes_read),
    );
    counter_family(
        reg,
        names::WRITTEN_BYTES,
        "Bytes the server wrote to clients.",
        &per_protocol(&protocols, |p| p.bytes_written),
    );
    counter_family(
        reg,
        names::PROTOCOL_ERRORS,
        "Requests or connections refused for a protocol violation.",
        &per_protocol(&protocols, |p| p.protocol_errors),
    );

    let up = Gauge::<f64, AtomicU64>::default();
    up.set(uptime.as_secs_f64());
    reg.register(names::UPTIME_SECONDS, "Seconds since the server started.", up);
}

/// The exposition text (OpenMetrics, which Prometheus scrapes natively):
/// store and protocol numbers as of now, plus the HTTP histogram when given.
pub fn render(ctx: &ServerCtx, http: Option<&HttpMetrics>, uptime: Duration) -> String {
    let mut reg = Registry::default();
    collect(&mut reg, ctx, uptime);
    if let Some(h) = http {
        reg.register(names::HTTP_REQUEST_SECONDS, "HTTP request latency in seconds.", h.durations.clone());
    }
    let mut out = String::new();
    // Writing into a String cannot fail; an encoder error would be a bug in
    // a metric's encoding, and an incomplete page is still better than none.
    if let Err(e) = encode(&mut out, &reg) {
        tracing::error!(error = %e, "metrics encoding failed");
    }
    out
}

pub use granary_core::metrics::to_prometheus_text;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::Auth;
    use crate::store::Store;
    use std::sync::atomic::Ordering::Relaxed;

    #[test]
    fn every_catalog_family_is_exported() {
        let ctx = ServerCtx::new(Store::memory_only(1 << 20), Auth::default());
        ctx.http.requests_ok.fetch_add(3, Relaxed);
        let m = HttpMetrics::default();
        m.observe("GET", "/health", 200, Duration::from_millis(2));
        let text = render(&ctx, Some(&m), Duration::from_secs(5));
        for name in [
            names::TIER_BYTES,
            names::HITS,
            names::REQUESTS,
            names::CONNECTIONS,
            names::HTTP_REQUEST_SECONDS,
            names::UPTIME_SECONDS,
        ] {
            assert!(text.contains(&format!("# TYPE {} ", names::counter_base(name))), "{name} missing:\n{text}");
        }
        assert!(text.contains(r#"granary_warehouse_requests_total{protocol="http",outcome="ok"} 3"#), "{text}");
        assert!(text.contains(r#"granary_warehouse_tier_capacity_bytes{tier="memory"} 1048576"#), "{text}");
        assert!(text.trim_end().ends_with("# EOF"));
    }

    #[test]
    fn prometheus_text_names_counters_by_their_series() {
        let om = "# HELP a_hits Hits.\n# TYPE a_hits counter\na_hits_total{tier=\"memory\"} 3\n\
                  # HELP a_bytes Bytes.\n# TYPE a_bytes gauge\na_bytes 7\n# EOF\n";
        let text = to_prometheus_text(om);
        assert_eq!(
            text,
            "# HELP a_hits_total Hits.\n# TYPE a_hits_total counter\na_hits_total{tier=\"memory\"} 3\n\
             # HELP a_bytes Bytes.\n# TYPE a_bytes gauge\na_bytes 7\n"
        );
    }

    #[test]
    fn status_classes() {
        assert_eq!(status_class(204), "2xx");
        assert_eq!(status_class(413), "4xx");
        assert_eq!(status_class(503), "5xx");
    }
}
