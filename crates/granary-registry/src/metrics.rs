//! The registry's Prometheus metrics, named in
//! [`granary_core::metrics::registry`]. Label values come from bounded sets
//! (route templates, methods, status classes, outcomes), never from
//! client input.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use granary_core::metrics::registry as names;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry as PromRegistry;

use crate::catalog::CatalogCounts;

/// Content type of [`Metrics::render`]'s output.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

type Labels = Vec<(&'static str, &'static str)>;

/// Import outcomes (the `outcome` label).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ImportOutcome {
    Ok,
    Conflict,
    Invalid,
    Failed,
}

/// Counters the registry keeps; gauges are read from the catalog per scrape.
#[derive(Default)]
pub struct Metrics {
    http: Family<Labels, Counter>,
    pub blob_sent_bytes: AtomicU64,
    pub integrity_failures: AtomicU64,
    imports: [AtomicU64; 4],
    pub uploaded_bytes: AtomicU64,
    pub deduplicated_bytes: AtomicU64,
    pub blobs_deleted: AtomicU64,
    pub presigned_urls: AtomicU64,
}

fn counter_base(name: &str) -> &str {
    name.strip_suffix("_total").unwrap_or(name)
}

/// The status class label of an HTTP status.
fn status_class(status: u16) -> &'static str {
    match status {
        100..=199 => "1xx",
        200..=299 => "2xx",
        300..=399 => "3xx",
        400..=499 => "4xx",
        _ => "5xx",
    }
}

impl Metrics {
    /// Records one HTTP answer. `route` is a route template or `unmatched`.
    pub fn http(&self, method: &'static str, route: &'static str, status: u16) {
        self.http.get_or_create(&vec![("method", method), ("route", route), ("status", status_class(status))]).inc();
    }

    pub fn import(&self, outcome: ImportOutcome) {
        self.imports[outcome as usize].fetch_add(1, Relaxed);
    }

    /// Imports so far with `outcome`.
    pub fn imports(&self, outcome: ImportOutcome) -> u64 {
        self.imports[outcome as usize].load(Relaxed)
    }

    /// The Prometheus text exposition (0.0.4), with the catalog's counts.
    pub fn render(&self, counts: Option<CatalogCounts>) -> String {
        let mut reg = PromRegistry::default();
        reg.register(counter_base(names::HTTP_REQUESTS), "HTTP requests answered", self.http.clone());
        let simple = |reg: &mut PromRegistry, name: &str, help: &str, v: &AtomicU64| {
            let c: Counter = Counter::default();
            c.inc_by(v.load(Relaxed));
            reg.register(counter_base(name), help, c);
        };
        simple(&mut reg, names::BLOB_SENT_BYTES, "Blob bytes sent to clients", &self.blob_sent_bytes);
        simple(
            &mut reg,
            names::INTEGRITY_FAILURES,
            "Stored blobs that failed their size or sha256 check when fetched",
            &self.integrity_failures,
        );
        simple(&mut reg, names::BLOBS_DELETED, "Unreferenced blobs deleted", &self.blobs_deleted);
        simple(&mut reg, names::PRESIGNED_URLS, "Presigned URLs handed out", &self.presigned_urls);
        let imports = Family::<Labels, Counter>::default();
        for (i, outcome) in ["ok", "conflict", "invalid", "failed"].into_iter().enumerate() {
            imports.get_or_create(&vec![("outcome", outcome)]).inc_by(self.imports[i].load(Relaxed));
        }
        reg.register(counter_base(names::IMPORTS), "Imports by outcome", imports);
        let bytes = Family::<Labels, Counter>::default();
        bytes.get_or_create(&vec![("stored", "uploaded")]).inc_by(self.uploaded_bytes.load(Relaxed));
        bytes.get_or_create(&vec![("stored", "deduplicated")]).inc_by(self.deduplicated_bytes.load(Relaxed));
        reg.register(counter_base(names::IMPORTED_BYTES), "Bytes of imported files", bytes);
        if let Some(c) = counts {
            let entries = Family::<Labels, Gauge>::default();
            for (kind, v) in [("models", c.models), ("revisions", c.revisions), ("files", c.files)] {
                entries.get_or_create(&vec![("kind", kind)]).set(v as i64);
            }
            reg.register(names::CATALOG_ENTRIES, "Catalog rows", entries);
            let g: Gauge = Gauge::default();
            g.set(c.bytes as i64);
            reg.register(names::CATALOG_BYTES, "Sum of the revisions' sizes", g);
        }
        let mut text = String::new();
        encode(&mut text, &reg).expect("encoding to a String cannot fail");
        granary_core::metrics::to_prometheus_text(&text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_every_catalog_name() {
        let m = Metrics::default();
        m.http("GET", "/v1/models", 200);
        m.import(ImportOutcome::Conflict);
        m.integrity_failures.fetch_add(2, Relaxed);
        let text = m.render(Some(CatalogCounts { models: 1, revisions: 2, files: 3, bytes: 4 }));
        for name in names::ALL {
            assert!(text.contains(name), "{name} missing from:\n{text}");
        }
        assert!(text.contains("granary_registry_imports_total{outcome=\"conflict\"} 1"), "{text}");
        assert!(text.contains("granary_registry_integrity_failures_total 2"), "{text}");
        assert!(text.contains("granary_registry_catalog_entries{kind=\"revisions\"} 2"), "{text}");
        assert!(!text.contains("# EOF"));
    }
}
