//! A front for one engine: an HTTP proxy on the agent, between the gateway
//! (or any client) and an engine, so that the agent sees the engine's
//! requests itself.
//!
//! Engines that publish no request metrics (llama-cpp-python's
//! `llama_cpp.server`, or llama.cpp's `llama-server` without `--metrics`)
//! would otherwise never be unloaded for idleness. With
//! `engines.proxy = true` each engine is reported at its front's URL; the
//! front forwards every request unchanged (bodies streamed both ways) and
//! counts the ones that are work: anything but `GET`, `HEAD` and `OPTIONS`
//! (health checks and model lists do not keep an engine loaded). A request
//! is in flight from its arrival until the last byte of its answer (an SSE
//! stream included), so a long generation is never mistaken for idleness.
//!
//! Headers named in `engines.proxy_drop_headers` are not passed on: an
//! engine may refuse what a client sends as a matter of course (e.g.
//! `llama_cpp.server` answers an `X-Request-ID` that is not a UUID with an
//! empty 400, and gateways send their own request ids).
//!
//! `GET /health` is answered from the engine's `health_path` (e.g.
//! `/openapi.json` for `llama_cpp.server`, which has no `/health`), so the
//! gateway's health checks of the front reach the engine's real one.
//!
//! The front lives in the agent: while the agent restarts, a fronted engine
//! is unreachable (the next agent binds the same port again when it can).
//! Engines with metrics need no front and keep serving through a restart.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderName, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Router;
use futures::StreamExt as _;
use tokio_util::sync::CancellationToken;

use crate::error::AgentError;

/// What a front has seen.
#[derive(Debug, Default)]
pub struct FrontStats {
    in_flight: AtomicU64,
    requests: AtomicU64,
    /// Unix milliseconds of the last request's start or end; 0: none yet.
    last_ms: AtomicU64,
}

impl FrontStats {
    /// Requests (work, not health checks) being answered now.
    pub fn in_flight(&self) -> u64 {
        self.in_flight.load(Relaxed)
    }

    /// Requests (work) forwarded so far.
    pub fn requests(&self) -> u64 {
        self.requests.load(Relaxed)
    }

    /// When a request last started or ended, unix milliseconds (0: never).
    pub fn last_activity_ms(&self) -> u64 {
        self.last_ms.load(Relaxed)
    }
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// One request in flight; ends when dropped (with the answer's body).
struct InFlight(Arc<FrontStats>);

impl InFlight {
    fn new(stats: Arc<FrontStats>) -> Self {
        stats.in_flight.fetch_add(1, Relaxed);
        stats.requests.fetch_add(1, Relaxed);
        stats.last_ms.store(now_ms(), Relaxed);
        InFlight(stats)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.last_ms.store(now_ms(), Relaxed);
        self.0.in_flight.fetch_sub(1, Relaxed);
    }
}

struct FrontState {
    /// The engine's own base URL.
    engine: String,
    health_path: String,
    /// Request headers not passed on (lowercase).
    drop: Vec<String>,
    stats: Arc<FrontStats>,
    http: reqwest::Client,
}

/// A running front; it stops when dropped.
pub struct Front {
    port: u16,
    stats: Arc<FrontStats>,
    stop: CancellationToken,
}

impl Drop for Front {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl Front {
    /// Starts a front on `host`, on `port` when it is free (an engine
    /// adopted after an agent restart keeps its URL), else on any port.
    pub async fn start(
        host: &str,
        port: Option<u16>,
        engine: String,
        health_path: String,
        drop_headers: &[String],
    ) -> Result<Front, AgentError> {
        let wanted = match port {
            Some(p) => tokio::net::TcpListener::bind((host, p)).await.ok(),
            None => None,
        };
        let listener = match wanted {
            Some(l) => l,
            None => tokio::net::TcpListener::bind((host, 0))
                .await
                .map_err(|e| AgentError::io(format!("binding an engine's front on {host}"), e))?,
        };
        let port = listener.local_addr().map_err(|e| AgentError::io("the front's address", e))?.port();
        let stats = Arc::new(FrontStats::default());
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(5))
            .tcp_nodelay(true)
            .build()
            .map_err(|e| AgentError::io("HTTP client", std::io::Error::other(e.to_string())))?;
        let drop = drop_headers.iter().map(|h| h.to_ascii_lowercase()).collect();
        let state = Arc::new(FrontState { engine, health_path, drop, stats: stats.clone(), http });
        let app = Router::new().fallback(forward).with_state(state);
        let stop = CancellationToken::new();
        let done = stop.clone();
        tokio::spawn(async move {
            let limits = granary_core::serve::HttpLimits::default();
            let served = granary_core::serve::serve_http(listener, app, limits, done.cancelled_owned()).await;
            if let Err(e) = served {
                tracing::warn!(port, error = %e, "an engine's front stopped");
            }
        });
        Ok(Front { port, stats, stop })
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn stats(&self) -> &Arc<FrontStats> {
        &self.stats
    }
}

/// Headers that belong to one connection, not to the message (RFC 9110 §7.6.1).
fn hop_by_hop(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "proxy-authenticate"
            | "proxy-authorization"
            | "proxy-connection"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
            | "host"
    )
}

fn end_to_end(h: &HeaderMap) -> HeaderMap {
    h.iter().filter(|(k, _)| !hop_by_hop(k)).map(|(k, v)| (k.clone(), v.clone())).collect()
}

fn unreachable_engine(why: String) -> Response {
    let body = serde_json::json!({"error": {
        "message": format!("The engine did not answer: {why}"),
        "type": "server_error",
        "param": null,
        "code": "engine_unreachable",
    }});
    (StatusCode::BAD_GATEWAY, axum::Json(body)).into_response()
}

async fn forward(State(st): State<Arc<FrontState>>, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let work = !matches!(parts.method, Method::GET | Method::HEAD | Method::OPTIONS);
    let target = if parts.method == Method::GET && parts.uri.path() == "/health" {
        st.health_path.clone()
    } else {
        parts.uri.path_and_query().map_or_else(|| "/".to_string(), |p| p.as_str().to_string())
    };
    let guard = work.then(|| InFlight::new(st.stats.clone()));
    let sent = st
        .http
        .request(parts.method, format!("{}{target}", st.engine))
        .headers({
            let mut h = end_to_end(&parts.headers);
            for name in &st.drop {
                h.remove(name.as_str());
            }
            h
        })
        .body(reqwest::Body::wrap_stream(body.into_data_stream()))
        .send()
        .await;
    let answer = match sent {
        Ok(r) => r,
        Err(e) => return unreachable_engine(e.to_string()),
    };
    let status = answer.status();
    let headers = end_to_end(answer.headers());
    // The request stays in flight until its answer's last byte is sent (or
    // the client goes away and the body is dropped).
    let stream = answer.bytes_stream().map(move |chunk| {
        let _held = &guard;
        chunk
    });
    let mut resp = Response::new(Body::from_stream(stream));
    *resp.status_mut() = status;
    *resp.headers_mut() = headers;
    resp.headers_mut().remove(header::CONTENT_LENGTH);
    resp
}

#[cfg(test)]
mod tests {
    use axum::routing::{get, post};

    use super::*;

    /// A real HTTP server as the engine: `/v1/models` for health, a slow
    /// streaming POST. The front answers `/health` from `/v1/models`,
    /// counts the POST as in flight until its body ends, and does not
    /// count health checks.
    #[tokio::test]
    async fn counts_work_until_the_answer_ends_and_maps_health() {
        let engine = Router::new()
            .route("/v1/models", get(|| async { "{\"data\":[]}" }))
            .route(
                "/v1/headers",
                post(|h: HeaderMap| async move {
                    format!("drop={} keep={}", h.contains_key("x-drop-me"), h.contains_key("x-keep-me"))
                }),
            )
            .route(
                "/v1/slow",
                post(|body: String| async move {
                    let chunks = futures::stream::iter(0..3).then(move |i| {
                        let body = body.clone();
                        async move {
                            tokio::time::sleep(Duration::from_millis(150)).await;
                            Ok::<_, std::io::Error>(format!("{i}:{body};"))
                        }
                    });
                    Body::from_stream(chunks)
                }),
            );
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let engine_url = format!("http://{}", l.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(l, engine).await.unwrap() });
        let front =
            Front::start("127.0.0.1", None, engine_url, "/v1/models".into(), &["X-Drop-Me".into()]).await.unwrap();
        let base = format!("http://127.0.0.1:{}", front.port());
        let http = reqwest::Client::new();

        let r = http.get(format!("{base}/health")).send().await.unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(r.text().await.unwrap(), "{\"data\":[]}");
        assert_eq!(http.get(format!("{base}/nope")).send().await.unwrap().status(), 404);
        assert_eq!((front.stats().requests(), front.stats().last_activity_ms()), (0, 0), "GETs are not work");

        let mut r = http.post(format!("{base}/v1/slow")).body("hi").send().await.unwrap();
        assert_eq!(r.status(), 200);
        let first = r.chunk().await.unwrap().unwrap();
        assert_eq!(&first[..], b"0:hi;");
        assert_eq!(front.stats().in_flight(), 1, "still streaming");
        let mut rest = Vec::new();
        while let Some(c) = r.chunk().await.unwrap() {
            rest.extend_from_slice(&c);
        }
        assert_eq!(rest, b"1:hi;2:hi;");
        // The guard drops with the body stream on the server side.
        for _ in 0..100 {
            if front.stats().in_flight() == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!((front.stats().in_flight(), front.stats().requests()), (0, 1));
        let r = http.post(format!("{base}/v1/headers")).header("X-Drop-Me", "1").header("X-Keep-Me", "1").send();
        assert_eq!(r.await.unwrap().text().await.unwrap(), "drop=false keep=true");
        assert!(front.stats().last_activity_ms() > 0);

        // The engine gone: a 502 naming why, OpenAI-shaped.
        let dead = Front::start("127.0.0.1", None, "http://127.0.0.1:9".into(), "/health".into(), &[]).await.unwrap();
        let r = http.post(format!("http://127.0.0.1:{}/v1/x", dead.port())).send().await.unwrap();
        assert_eq!(r.status(), 502);
        let v: serde_json::Value = r.json().await.unwrap();
        assert_eq!(v["error"]["code"], "engine_unreachable");
    }
}
