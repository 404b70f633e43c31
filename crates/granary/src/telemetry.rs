//! Logging to stderr, and traces over OTLP when asked for.
//!
//! Traces are off unless `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or
//! `OTEL_EXPORTER_OTLP_ENDPOINT` is set (the exporter reads them, with
//! `OTEL_EXPORTER_OTLP_HEADERS` and `..._TIMEOUT`); the sampler follows
//! `OTEL_TRACES_SAMPLER`/`OTEL_TRACES_SAMPLER_ARG` (default: parent-based,
//! always on), the batch `OTEL_BSP_*`. Only Granary's own spans are
//! exported, never log events (they are for stderr). See
//! docs/observability.md.

use anyhow::{bail, Context, Result};
use bytes::Bytes;
use opentelemetry_otlp::{WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::Layer;

/// The exporter, kept to flush it at exit.
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// Sends the spans still queued (bounded by the exporter's timeout).
    pub fn shutdown(self) {
        if let Some(p) = self.provider {
            if let Err(e) = p.shutdown() {
                eprintln!("granary: traces: flushing at exit failed: {e}");
            }
        }
    }
}

/// Whether the environment asks for traces (an OTLP endpoint is set).
pub fn enabled(env: &dyn Fn(&str) -> Option<String>) -> bool {
    ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"]
        .iter()
        .any(|k| env(k).is_some_and(|v| !v.trim().is_empty()))
}

/// Checks `OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL`: only `http/protobuf` is built in.
pub fn check_protocol(env: &dyn Fn(&str) -> Option<String>) -> Result<()> {
    for var in ["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"] {
        match env(var).as_deref().map(str::trim) {
            None | Some("") => continue,
            Some("http/protobuf") => return Ok(()),
            Some(p @ ("grpc" | "http/json")) => bail!(
                "{var}={p}: this build exports traces over OTLP http/protobuf only; \
                 set {var}=http/protobuf and point the endpoint at the collector's HTTP port (4318)"
            ),
            Some(p) => bail!("{var}={p}: unknown OTLP protocol (expected http/protobuf)"),
        }
    }
    Ok(())
}

/// The service name: `OTEL_SERVICE_NAME`, or `default` (per command).
pub fn service_name(env: &dyn Fn(&str) -> Option<String>, default: &str) -> String {
    env("OTEL_SERVICE_NAME").filter(|s| !s.trim().is_empty()).unwrap_or_else(|| default.to_string())
}

/// `OTEL_EXPORTER_OTLP_(TRACES_)TIMEOUT` in milliseconds (default 10 s).
fn export_timeout(env: &dyn Fn(&str) -> Option<String>) -> std::time::Duration {
    let ms = ["OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT"]
        .iter()
        .find_map(|k| env(k)?.trim().parse::<u64>().ok())
        .unwrap_or(10_000);
    std::time::Duration::from_millis(ms.max(1))
}

/// Installs the stderr log (filtered by `log`) and, when the environment
/// asks for it, the OTLP span exporter (on `rt`, which must outlive the
/// returned [`Telemetry`]).
pub fn init(log: &str, service: &str, rt: &tokio::runtime::Runtime) -> Result<Telemetry> {
    let env = |k: &str| std::env::var(k).ok();
    let filter = tracing_subscriber::EnvFilter::try_new(log).unwrap_or_else(|_| "info".into());
    // Log events only: formatting every span's fields for the log (several
    // spans a request) cost the gateway about a tenth of its CPU under load
    // (`granary bench gateway`), for a prefix on the few lines logged inside
    // them; lines about a request name it (`request_id`). Spans go to OTLP.
    let events = tracing_subscriber::filter::filter_fn(|m| m.is_event());
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_filter(tracing_subscriber::filter::FilterExt::and(filter, events));
    if !enabled(&env) {
        tracing_subscriber::registry().with(fmt).init();
        return Ok(Telemetry { provider: None });
    }
    check_protocol(&env)?;
    // The exporter bounds its retries; each request is bounded here.
    let client = reqwest::Client::builder().no_proxy().timeout(export_timeout(&env)).build()?;
    let client = ExportClient { client, rt: rt.handle().clone() };
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
        .with_http_client(client)
        .build()
        .context("traces: the OTLP exporter")?;
    let resource = opentelemetry_sdk::Resource::builder().with_service_name(service_name(&env, service)).build();
    let provider = SdkTracerProvider::builder().with_batch_exporter(exporter).with_resource(resource).build();
    let tracer = opentelemetry::trace::TracerProvider::tracer(&provider, "granary");
    opentelemetry::global::set_text_map_propagator(opentelemetry_sdk::propagation::TraceContextPropagator::new());
    // Granary's spans only: no log events (they could quote anything), no
    // spans of libraries.
    let ours = tracing_subscriber::filter::filter_fn(|m| m.is_span() && m.target().starts_with("granary"));
    let otel = tracing_opentelemetry::layer().with_tracer(tracer).with_location(false).with_filter(ours);
    tracing_subscriber::registry().with(fmt).with(otel).init();
    Ok(Telemetry { provider: Some(provider) })
}

/// The exporter's HTTP client: the workspace's reqwest on the command's
/// runtime (the batch processor calls it from its own thread).
#[derive(Debug)]
struct ExportClient {
    client: reqwest::Client,
    rt: tokio::runtime::Handle,
}

#[async_trait::async_trait]
impl opentelemetry_http::HttpClient for ExportClient {
    async fn send_bytes(
        &self,
        request: http::Request<Bytes>,
    ) -> Result<http::Response<Bytes>, opentelemetry_http::HttpError> {
        let request = reqwest::Request::try_from(request)?;
        let client = self.client.clone();
        let answer = self.rt.spawn(async move {
            let r = client.execute(request).await?;
            let mut b = http::Response::builder().status(r.status().as_u16());
            for (k, v) in r.headers() {
                b = b.header(k, v);
            }
            let body = r.bytes().await?;
            Ok::<_, opentelemetry_http::HttpError>(b.body(body)?)
        });
        answer.await?
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env_of<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
    }

    #[test]
    fn traces_are_off_without_an_endpoint() {
        assert!(!enabled(&env_of(&[])));
        assert!(!enabled(&env_of(&[("OTEL_EXPORTER_OTLP_ENDPOINT", " ")])));
        assert!(enabled(&env_of(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")])));
        assert!(enabled(&env_of(&[("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://c:4318/v1/traces")])));
    }

    #[test]
    fn only_http_protobuf_is_accepted_and_the_error_names_the_variable() {
        assert!(check_protocol(&env_of(&[])).is_ok());
        assert!(check_protocol(&env_of(&[("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")])).is_ok());
        let e = check_protocol(&env_of(&[("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")])).unwrap_err().to_string();
        assert!(e.starts_with("OTEL_EXPORTER_OTLP_PROTOCOL=grpc:") && e.contains("http/protobuf"), "{e}");
        assert!(!e.contains('\n'));
        // The signal's own variable wins over the general one.
        let both = [("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf"), ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")];
        assert!(check_protocol(&env_of(&both)).is_ok());
        let e = check_protocol(&env_of(&[("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "udp")])).unwrap_err().to_string();
        assert!(e.contains("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=udp"), "{e}");
    }

    #[test]
    fn the_export_timeout_is_read_in_milliseconds() {
        assert_eq!(export_timeout(&env_of(&[])), std::time::Duration::from_secs(10));
        let t = export_timeout(&env_of(&[("OTEL_EXPORTER_OTLP_TIMEOUT", "2500")]));
        assert_eq!(t, std::time::Duration::from_millis(2500));
    }

    #[test]
    fn the_service_name_defaults_per_command() {
        assert_eq!(service_name(&env_of(&[]), "granary-gateway"), "granary-gateway");
        assert_eq!(service_name(&env_of(&[("OTEL_SERVICE_NAME", "gw-eu")]), "granary-gateway"), "gw-eu");
    }
}
