//! Trace context across processes: W3C `traceparent` in HTTP headers.
//!
//! Components open `tracing` spans under the names below; the `granary`
//! binary exports them over OTLP when `OTEL_EXPORTER_OTLP_ENDPOINT` is set
//! (see docs/observability.md) and installs the W3C propagator. A server
//! continues the caller's trace with [`continue_from`]; a client passes its
//! current span on with [`headers_for`]. With tracing off (no exporter, no
//! propagator installed) both do nothing: no header is read or written.
//!
//! Span attributes never carry prompt text, generated text or credentials.

use opentelemetry::propagation::{Extractor, Injector};
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// The W3C trace context header.
pub const TRACEPARENT: &str = "traceparent";

/// Span names, stable across releases (dashboards and queries use them).
pub mod span {
    /// Gateway and engine: one generation request, server side.
    pub const REQUEST: &str = "request";
    /// Gateway: key check, body, model access and limits.
    pub const ADMISSION: &str = "admission";
    /// Gateway: tokenizing for routing and choosing the upstream.
    pub const ROUTING: &str = "routing";
    /// Gateway: one attempt on an upstream, until its answer's headers.
    pub const UPSTREAM: &str = "upstream";
    /// Engine: the longest prefix held in engine memory, then the warehouse.
    pub const PREFIX_LOOKUP: &str = "prefix_lookup";
    /// Engine: reading the found blocks (one span per source: `engine`
    /// memory, or the `warehouse` with blocks counted per tier).
    pub const KV_LOAD: &str = "kv_load";
    /// Engine: computing the prompt tokens not found.
    pub const PREFILL: &str = "prefill";
    /// Engine: writing a request's new blocks to the warehouse, from queued
    /// to acknowledged (may end after the request).
    pub const KV_SAVE: &str = "kv_save";
    /// Engine: from the request's arrival to its first generated token.
    pub const FIRST_TOKEN: &str = "first_token";
    /// Warehouse (HTTP): one block-API request.
    pub const WAREHOUSE_OP: &str = "warehouse_op";
}

struct Get<'a>(&'a http::HeaderMap);

impl Extractor for Get<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(http::HeaderName::as_str).collect()
    }
}

struct Set<'a>(&'a mut http::HeaderMap);

impl Injector for Set<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(k), Ok(v)) = (http::HeaderName::try_from(key), http::HeaderValue::try_from(value)) {
            self.0.insert(k, v);
        }
    }
}

/// Makes `span` a child of the trace context in `headers` (a caller's
/// `traceparent`); without one, or with tracing off, `span` stays a root.
pub fn continue_from(span: &tracing::Span, headers: &http::HeaderMap) {
    let cx = opentelemetry::global::get_text_map_propagator(|p| p.extract(&Get(headers)));
    if opentelemetry::trace::TraceContextExt::has_active_span(&cx) {
        // Fails only when no OpenTelemetry layer is installed: nothing to continue then.
        let _ = span.set_parent(cx);
    }
}

/// The headers that pass `span`'s trace context on to a server (empty with
/// tracing off).
pub fn headers_for(span: &tracing::Span) -> http::HeaderMap {
    let mut headers = http::HeaderMap::new();
    let cx = span.context();
    opentelemetry::global::get_text_map_propagator(|p| p.inject_context(&cx, &mut Set(&mut headers)));
    headers
}

/// [`headers_for`] the current span.
pub fn current_headers() -> http::HeaderMap {
    headers_for(&tracing::Span::current())
}

/// Ends spans when it is dropped instead of when their work was last
/// entered: held by a streamed answer, it makes the spans of the request
/// last as long as the stream (an exported span ends when it was last
/// exited; this enters and leaves each span, in the order given, on drop).
pub struct EndOnDrop(Vec<tracing::Span>);

impl EndOnDrop {
    /// Children before their parents.
    pub fn new(spans: impl IntoIterator<Item = tracing::Span>) -> EndOnDrop {
        EndOnDrop(spans.into_iter().collect())
    }
}

impl Drop for EndOnDrop {
    fn drop(&mut self) {
        for span in &self.0 {
            span.in_scope(|| {});
        }
    }
}
