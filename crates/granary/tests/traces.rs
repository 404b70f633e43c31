//! Traces across processes (issue 17, point 4): the real `granary gateway`
//! in front of a real `granary engine` (the default model) whose KV
//! warehouse is a real `granary warehouse` over HTTP, all three exporting
//! spans over OTLP/HTTP to a receiver this test runs on loopback. A client's
//! `traceparent` is continued through gateway → engine → warehouse, the
//! named spans carry their attributes, nothing exported holds the prompt or
//! a key, and without an OTLP endpoint nothing is exported at all.
//!
//! No OpenTelemetry collector installs here (none from apt, PyPI or
//! crates.io), so the receiver is a small axum server that decodes each
//! `ExportTraceServiceRequest` protobuf with the `opentelemetry-proto`
//! crate, as a collector would.

mod common;
use common::Proc;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::common::v1::KeyValue;
use parking_lot::Mutex;
use prost::Message;
use serde_json::{json, Value};

const ADMIN: &str = "gateway-admin-token-for-traces";
const MODEL: &str = "SmolLM2-135M-Instruct";
/// A phrase of the prompt, to look for in what was exported.
const SECRET_PHRASE: &str = "quartz-lantern-marmalade";

/// What the receiver got: every export body, raw and decoded.
#[derive(Default)]
struct Got {
    raw: Vec<Vec<u8>>,
    decoded: Vec<ExportTraceServiceRequest>,
}

/// An OTLP/HTTP trace receiver on loopback (`POST /v1/traces`).
struct Receiver {
    addr: std::net::SocketAddr,
    got: Arc<Mutex<Got>>,
    _rt: tokio::runtime::Runtime,
}

impl Receiver {
    fn start(addr: &str) -> std::io::Result<Receiver> {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
        let listener = rt.block_on(tokio::net::TcpListener::bind(addr))?;
        let addr = listener.local_addr()?;
        let got = Arc::new(Mutex::new(Got::default()));
        let sink = got.clone();
        let app = axum::Router::new().route(
            "/v1/traces",
            axum::routing::post(move |body: bytes::Bytes| async move {
                let decoded =
                    ExportTraceServiceRequest::decode(body.clone()).expect("a valid ExportTraceServiceRequest");
                let mut g = sink.lock();
                g.raw.push(body.to_vec());
                g.decoded.push(decoded);
                ([("content-type", "application/x-protobuf")], Vec::<u8>::new())
            }),
        );
        rt.spawn(async move { axum::serve(listener, app).await });
        Ok(Receiver { addr, got, _rt: rt })
    }

    fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }
}

/// One exported span, flattened.
#[derive(Debug, Clone)]
struct Span {
    service: String,
    name: String,
    trace: String,
    id: String,
    parent: String,
    attrs: HashMap<String, String>,
    /// Start and end, ns since the epoch.
    start: u64,
    end: u64,
}

fn text_of(v: &Option<opentelemetry_proto::tonic::common::v1::AnyValue>) -> String {
    match v.as_ref().and_then(|a| a.value.as_ref()) {
        Some(AnyValue::StringValue(s)) => s.clone(),
        Some(AnyValue::IntValue(i)) => i.to_string(),
        Some(AnyValue::BoolValue(b)) => b.to_string(),
        Some(AnyValue::DoubleValue(d)) => d.to_string(),
        other => format!("{other:?}"),
    }
}

fn attrs_of(kvs: &[KeyValue]) -> HashMap<String, String> {
    kvs.iter().map(|kv| (kv.key.clone(), text_of(&kv.value))).collect()
}

fn spans(got: &Got) -> Vec<Span> {
    let mut out = Vec::new();
    for req in &got.decoded {
        for rs in &req.resource_spans {
            let resource = rs.resource.as_ref().map(|r| attrs_of(&r.attributes)).unwrap_or_default();
            let service = resource.get("service.name").cloned().unwrap_or_default();
            for ss in &rs.scope_spans {
                for s in &ss.spans {
                    out.push(Span {
                        service: service.clone(),
                        name: s.name.clone(),
                        trace: hex::encode(&s.trace_id),
                        id: hex::encode(&s.span_id),
                        parent: hex::encode(&s.parent_span_id),
                        attrs: attrs_of(&s.attributes),
                        start: s.start_time_unix_nano,
                        end: s.end_time_unix_nano,
                    });
                }
            }
        }
    }
    out
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn traceparent(trace: &str, parent: &str) -> String {
    format!("00-{trace}-{parent}-01")
}

fn by_name<'a>(spans: &'a [Span], service: &str, name: &str) -> Vec<&'a Span> {
    spans.iter().filter(|s| s.service == service && s.name == name).collect()
}

fn one<'a>(spans: &'a [Span], service: &str, name: &str) -> &'a Span {
    let found = by_name(spans, service, name);
    assert_eq!(found.len(), 1, "one {service} `{name}` span expected: {spans:#?}");
    found[0]
}

fn num(s: &Span, key: &str) -> i64 {
    s.attrs.get(key).unwrap_or_else(|| panic!("`{}` has no {key}: {s:#?}", s.name)).parse().unwrap()
}

#[test]
fn a_request_is_traced_from_the_gateway_through_the_engine_to_the_warehouse() {
    if granary_tokenizer::testing::model_or_skip("traces test").is_none() {
        return;
    }
    let receiver = Receiver::start("127.0.0.1:0").unwrap();
    let endpoint = receiver.endpoint();
    let otel = [("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str())];
    let mut warehouse = common::Warehouse::start(&[], &otel);
    let wh = format!("http://{}", warehouse.http.clone().unwrap());
    let engine_port = free_port();
    let listen = format!("127.0.0.1:{engine_port}");
    // No engine-memory cache: a repeated prompt's blocks come from the warehouse.
    let mut engine = Proc::start(
        &[
            "engine",
            "--listen",
            &listen,
            "--block-tokens",
            "16",
            "--kv-cache",
            "0",
            "--warehouse",
            &wh,
            "--trust-namespace-header",
        ],
        &otel,
    );
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let cfg = format!(
        "[gateway]\nlisten = \"127.0.0.1:{port}\"\ndatabase = \"sqlite://{}\"\n[[upstream]]\nname = \"e0\"\nurl = \"http://{listen}\"\n",
        dir.path().join("gateway.db").display()
    );
    let cfg_path = dir.path().join("gateway.toml");
    std::fs::write(&cfg_path, cfg).unwrap();
    let mut gateway =
        Proc::start(&["gateway", "--config", cfg_path.to_str().unwrap()], &[("GRANARY_ADMIN_TOKEN", ADMIN), otel[0]]);
    let base = format!("http://127.0.0.1:{port}");
    let http = reqwest::blocking::Client::builder().timeout(Duration::from_secs(300)).build().unwrap();
    let _ = http.post(format!("{base}/admin/v1/tenants")).bearer_auth(ADMIN).json(&json!({"name": "acme"})).send();
    let made: Value = http
        .post(format!("{base}/admin/v1/keys"))
        .bearer_auth(ADMIN)
        .json(&json!({"tenant": "acme"}))
        .send()
        .unwrap()
        .json()
        .unwrap();
    let key = made["key"].as_str().unwrap().to_string();

    let prompt = format!("Tell me about {SECRET_PHRASE} and the lighthouse keepers of the northern coast. ").repeat(4);
    let chat = |trace: &str, parent: &str| -> Value {
        let r = http
            .post(format!("{base}/v1/chat/completions"))
            .bearer_auth(&key)
            .header("traceparent", traceparent(trace, parent))
            .json(&json!({"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 2, "temperature": 0}))
            .send()
            .unwrap();
        assert_eq!(r.status(), 200);
        r.json().unwrap()
    };
    // The first request computes the prompt and saves its blocks; a later
    // one (once they are saved) loads them from the warehouse.
    let (t1, p1) = ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7");
    let first = chat(t1, p1);
    assert!(first["usage"]["prompt_tokens"].as_u64().unwrap() >= 48, "{first}");
    let mut traces = vec![t1.to_string()];
    let mut hit = None;
    for i in 0..40u32 {
        std::thread::sleep(Duration::from_millis(250));
        let t = format!("5a{i:030x}");
        traces.push(t.clone());
        let again = chat(&t, "00f067aa0ba902b8");
        if again["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0) > 0 {
            hit = Some(t);
            break;
        }
    }
    let t2 = hit.expect("the repeated prompt's KV came from the warehouse");
    // A streamed answer: its spans last as long as the stream.
    let t3 = "6c0000000000000000000000000000a1";
    traces.push(t3.to_string());
    let streamed = http
        .post(format!("{base}/v1/chat/completions"))
        .bearer_auth(&key)
        .header("traceparent", traceparent(t3, "00f067aa0ba902b9"))
        .json(&json!({"model": MODEL, "messages": [{"role": "user", "content": "Name a colour."}],
                      "max_tokens": 8, "temperature": 0, "stream": true}))
        .send()
        .unwrap();
    assert_eq!(streamed.status(), 200);
    let events = streamed.text().unwrap();
    assert!(events.trim_end().ends_with("data: [DONE]"), "{events}");
    // Spans go out at exit (the batch is flushed on SIGTERM).
    gateway.terminate();
    engine.terminate();
    assert!(warehouse.terminate().success());

    let got = receiver.got.lock();
    let all = spans(&got);
    let mut summary: HashMap<(String, String), usize> = HashMap::new();
    for s in &all {
        *summary.entry((s.service.clone(), s.name.clone())).or_default() += 1;
    }
    let mut summary: Vec<_> = summary.into_iter().collect();
    summary.sort();
    println!("traces: {} export requests, {} spans: {summary:?}", got.decoded.len(), all.len());
    // Nothing exported holds the prompt or a credential.
    for raw in &got.raw {
        let text = String::from_utf8_lossy(raw);
        for secret in [SECRET_PHRASE, key.as_str(), ADMIN] {
            assert!(!text.contains(secret), "an export holds {secret:?}");
        }
    }
    // Every span belongs to one of the requests' traces: health checks,
    // scrapes and event streams start none.
    for s in &all {
        assert!(traces.contains(&s.trace), "a span outside the requests' traces: {s:#?}");
    }

    // The first request: gateway → engine → warehouse under the client's trace.
    let first: Vec<Span> = all.iter().filter(|s| s.trace == t1).cloned().collect();
    let (gw, en, wh) = ("granary-gateway", "granary-engine", "granary-warehouse");
    let g_req = one(&first, gw, "request");
    assert_eq!(g_req.parent, p1, "the gateway continues the client's traceparent");
    assert_eq!(g_req.attrs["http.response.status_code"], "200");
    let admission = one(&first, gw, "admission");
    assert_eq!(admission.parent, g_req.id);
    assert_eq!(admission.attrs["gen_ai.request.model"], MODEL);
    let routing = one(&first, gw, "routing");
    assert_eq!(routing.parent, g_req.id);
    assert_eq!(routing.attrs["granary.routing.policy"], "kv_aware");
    assert_eq!(routing.attrs["granary.routing.upstream"], "e0");
    let upstream = one(&first, gw, "upstream");
    assert_eq!(upstream.parent, g_req.id);
    assert_eq!(upstream.attrs["granary.upstream"], "e0");
    assert_eq!(upstream.attrs["http.response.status_code"], "200");
    let e_req = one(&first, en, "request");
    assert_eq!(e_req.parent, upstream.id, "the engine continues the gateway's upstream span");
    assert_eq!(e_req.attrs["gen_ai.request.model"], MODEL);
    assert_eq!(e_req.attrs["gen_ai.operation.name"], "chat");
    let input_tokens = num(e_req, "gen_ai.usage.input_tokens");
    assert!(input_tokens >= 48, "{e_req:#?}");
    assert_eq!(num(e_req, "gen_ai.usage.output_tokens"), 2);
    let lookup = one(&first, en, "prefix_lookup");
    assert_eq!(lookup.parent, e_req.id);
    assert_eq!(num(lookup, "granary.prefix.blocks"), input_tokens / 16);
    assert_eq!(num(lookup, "granary.prefix.tokens_found"), 0);
    let prefill = one(&first, en, "prefill");
    assert_eq!(prefill.parent, e_req.id);
    assert_eq!(num(prefill, "granary.prefill.tokens"), input_tokens);
    assert_eq!(one(&first, en, "first_token").parent, e_req.id);
    let saves = by_name(&first, en, "kv_save");
    assert!(!saves.is_empty() && saves.iter().all(|s| s.parent == e_req.id), "{first:#?}");
    let w_ops = by_name(&first, wh, "warehouse_op");
    let w_lookup: Vec<_> = w_ops.iter().filter(|s| s.attrs["granary.warehouse.op"] == "lookup").collect();
    assert_eq!(w_lookup.len(), 1, "{w_ops:#?}");
    assert_eq!(w_lookup[0].parent, lookup.id, "the warehouse continues the engine's prefix lookup");
    assert_eq!(num(w_lookup[0], "granary.warehouse.keys"), input_tokens / 16);
    assert_eq!(num(w_lookup[0], "granary.warehouse.matched"), 0);
    let puts: Vec<_> = w_ops.iter().filter(|s| s.attrs["granary.warehouse.op"] == "put").collect();
    assert!(!puts.is_empty(), "{w_ops:#?}");
    for p in &puts {
        assert!(saves.iter().any(|s| s.id == p.parent), "a put outside the engine's kv_save: {p:#?}");
        assert_eq!(num(p, "granary.warehouse.keys"), 1);
    }

    // The hit: the blocks load from the warehouse's memory tier.
    let second: Vec<Span> = all.iter().filter(|s| s.trace == t2).cloned().collect();
    let routing = one(&second, gw, "routing");
    assert!(routing.attrs.contains_key("granary.routing.predicted_cached_tokens"), "{routing:#?}");
    let e_req = one(&second, en, "request");
    assert!(num(e_req, "granary.cached_tokens") > 0, "{e_req:#?}");
    let lookup = one(&second, en, "prefix_lookup");
    assert!(num(lookup, "granary.prefix.warehouse_blocks") > 0, "{lookup:#?}");
    let load = by_name(&second, en, "kv_load");
    let load = load.iter().find(|s| s.attrs["granary.kv.source"] == "warehouse").expect("a kv_load from the warehouse");
    assert_eq!(load.parent, e_req.id);
    let from_memory = num(load, "granary.kv.blocks.memory");
    assert!(from_memory > 0 && from_memory == num(load, "granary.kv.blocks_loaded"), "{load:#?}");
    let gets: Vec<_> =
        by_name(&second, wh, "warehouse_op").into_iter().filter(|s| s.attrs["granary.warehouse.op"] == "get").collect();
    assert_eq!(gets.len() as i64, from_memory, "one warehouse get per block loaded");
    for g in &gets {
        assert_eq!(g.parent, load.id);
        assert_eq!(g.attrs["granary.warehouse.tier"], "memory");
    }

    // The streamed request: every span of it lasts as long as the stream.
    // The engine's request span ends after its first token (with its last
    // event), the gateway's upstream span after that (with the relay), and
    // the gateway's request span last; not when the headers went out.
    let third: Vec<Span> = all.iter().filter(|s| s.trace == t3).cloned().collect();
    let (g_req, upstream, e_req) =
        (one(&third, gw, "request"), one(&third, gw, "upstream"), one(&third, en, "request"));
    let first_token = one(&third, en, "first_token");
    assert_eq!(upstream.parent, g_req.id);
    assert_eq!(e_req.parent, upstream.id);
    let ms = |a: u64, b: u64| (a as f64 - b as f64) / 1e6;
    println!(
        "streamed: gateway request {:.1} ms, upstream {:.1} ms, engine request {:.1} ms, engine first token at {:.1} ms",
        ms(g_req.end, g_req.start),
        ms(upstream.end, upstream.start),
        ms(e_req.end, e_req.start),
        ms(first_token.end, e_req.start)
    );
    assert!(
        e_req.end >= first_token.end && upstream.end >= e_req.end && g_req.end >= upstream.end,
        "spans end before the stream they belong to: the engine's request {:.1} ms after its first token, \
         the gateway's upstream {:.1} ms after the engine's request, its request {:.1} ms after its upstream",
        ms(e_req.end, first_token.end),
        ms(upstream.end, e_req.end),
        ms(g_req.end, upstream.end)
    );
}

/// With no `OTEL_EXPORTER_OTLP_*ENDPOINT`, nothing is exported: a receiver
/// on the OTLP/HTTP default address (127.0.0.1:4318) hears nothing while
/// the warehouse serves requests that carry a `traceparent`.
#[test]
fn without_an_endpoint_nothing_is_exported() {
    let receiver = match Receiver::start("127.0.0.1:4318") {
        Ok(r) => r,
        Err(e) => {
            eprintln!("skipping: 127.0.0.1:4318 is taken ({e})");
            return;
        }
    };
    let mut warehouse = common::Warehouse::start(&[], &[("OTEL_SERVICE_NAME", "should-not-export")]);
    let http = reqwest::blocking::Client::new();
    let tp = traceparent("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7");
    let key = common::key(7);
    let put = http
        .put(warehouse.url(&format!("/v1/blocks/default/{key}")))
        .header("traceparent", &tp)
        .body(common::block(7, 16))
        .send()
        .unwrap();
    assert!(put.status().is_success(), "{}", put.status());
    let r = http
        .post(warehouse.url("/v1/lookup"))
        .header("traceparent", &tp)
        .json(&json!({"namespace": "default", "keys": [key]}))
        .send()
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(warehouse.terminate().success());
    let got = receiver.got.lock();
    assert_eq!(got.raw.len(), 0, "the receiver got {} export requests", got.raw.len());
}
