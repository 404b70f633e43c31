//! Generation requests to an upstream, on the path every request takes.
//!
//! A plain `http://` upstream gets a connection pool of hyper's own: its
//! generation URIs are parsed once when it joins, and a request costs its
//! headers, a pool checkout and the I/O. The general-purpose client runs a
//! redirect policy (which prints and parses the URL again), a retry layer
//! and more boxed futures for every request; on a fast upstream those were
//! a sizeable part of the gateway's CPU per request. `https://` upstreams
//! (TLS, client certificates), and every upstream when the environment
//! names an HTTP proxy, keep going through the upstream's reqwest client.

use std::pin::Pin;
use std::time::Duration;

use axum::http::{HeaderMap, Method, Request, StatusCode, Uri};
use bytes::Bytes;
use futures::{Stream, TryStreamExt};
use http_body_util::{BodyDataStream, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};

/// An error while reading an answer's body.
pub type BodyError = Box<dyn std::error::Error + Send + Sync>;
/// An answer's body as it arrives.
pub type BodyStream = Pin<Box<dyn Stream<Item = Result<Bytes, BodyError>> + Send>>;

/// An upstream's answer: its status and headers, and the body to read.
pub struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: BodyStream,
}

/// Why no answer came.
#[derive(Debug)]
pub enum SendError {
    /// No connection (refused, unreachable, past the connect timeout).
    Connect(String),
    /// Anything after connecting (the connection closed, a malformed answer).
    Other(String),
}

impl std::fmt::Display for SendError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SendError::Connect(e) => write!(f, "cannot connect: {e}"),
            SendError::Other(e) => f.write_str(e),
        }
    }
}

/// The variables through which the environment names an HTTP proxy (the
/// general-purpose client honours them; the plain pool does not).
const PROXY_VARS: [&str; 4] = ["HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"];

/// The plain HTTP/1.1 pool of one upstream and its parsed generation URIs.
pub(super) struct PlainWire {
    client: Client<HttpConnector, Full<Bytes>>,
    uris: Vec<(&'static str, Uri)>,
}

impl PlainWire {
    /// For an `http://` base URL when no proxy is configured; None otherwise.
    pub(super) fn new(base: &str, paths: &[&'static str], connect_timeout: Duration) -> Option<PlainWire> {
        if !base.starts_with("http://") || PROXY_VARS.iter().any(|v| std::env::var_os(v).is_some_and(|x| !x.is_empty()))
        {
            return None;
        }
        let uris: Vec<(&'static str, Uri)> =
            paths.iter().filter_map(|p| Some((*p, format!("{base}{p}").parse::<Uri>().ok()?))).collect();
        if uris.len() != paths.len() {
            return None;
        }
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(connect_timeout));
        let client = Client::builder(TokioExecutor::new())
            .pool_timer(TokioTimer::new())
            .pool_idle_timeout(Duration::from_secs(90))
            .build(connector);
        Some(PlainWire { client, uris })
    }

    /// The parsed URI of a generation path.
    pub(super) fn uri(&self, path: &str) -> Option<&Uri> {
        self.uris.iter().find(|(p, _)| *p == path).map(|(_, u)| u)
    }

    pub(super) async fn post(&self, uri: &Uri, headers: HeaderMap, payload: Bytes) -> Result<Answer, SendError> {
        let mut req = Request::new(Full::new(payload));
        *req.method_mut() = Method::POST;
        *req.uri_mut() = uri.clone();
        *req.headers_mut() = headers;
        let resp = self.client.request(req).await.map_err(|e| send_error(&e, e.is_connect()))?;
        let (head, body) = resp.into_parts();
        let body = BodyDataStream::new(body).map_err(|e| Box::new(e) as BodyError);
        Ok(Answer { status: head.status, headers: head.headers, body: Box::pin(body) })
    }
}

/// Through the general-purpose client (TLS upstreams, proxies).
pub(super) async fn post_reqwest(
    client: &reqwest::Client,
    url: reqwest::Url,
    headers: HeaderMap,
    payload: Bytes,
) -> Result<Answer, SendError> {
    let resp =
        client.post(url).headers(headers).body(payload).send().await.map_err(|e| send_error(&e, e.is_connect()))?;
    let (status, headers) = (resp.status(), resp.headers().clone());
    let body = resp.bytes_stream().map_err(|e| Box::new(e) as BodyError);
    Ok(Answer { status, headers, body: Box::pin(body) })
}

impl Answer {
    /// The whole body, refused past `max` bytes.
    pub async fn read_all(&mut self, max: usize) -> Result<Vec<u8>, SendError> {
        use futures::StreamExt;
        let mut bytes = Vec::new();
        while let Some(chunk) = self.body.next().await {
            bytes.extend_from_slice(&chunk.map_err(|e| SendError::Other(e.to_string()))?);
            if bytes.len() > max {
                return Err(SendError::Other(format!("answer over {max} bytes")));
            }
        }
        Ok(bytes)
    }
}

/// A client's error as a [`SendError`], with its causes.
fn send_error(e: &(dyn std::error::Error + 'static), connect: bool) -> SendError {
    let why = error_chain(e);
    if connect {
        SendError::Connect(why)
    } else {
        SendError::Other(why)
    }
}

/// An error with its causes, `outer: inner: root`.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let c_text = c.to_string();
        if !s.contains(&c_text) {
            s.push_str(": ");
            s.push_str(&c_text);
        }
        cause = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;

    const PATHS: [&str; 2] = ["/v1/chat/completions", "/v1/completions"];

    #[test]
    fn only_plain_http_upstreams_get_the_plain_pool() {
        let t = Duration::from_secs(1);
        assert!(PlainWire::new("https://127.0.0.1:8443", &PATHS, t).is_none(), "TLS goes through reqwest");
        let w = PlainWire::new("http://127.0.0.1:8000/base", &PATHS, t).expect("plain HTTP");
        assert_eq!(
            w.uri("/v1/completions").map(|u| u.to_string()).as_deref(),
            Some("http://127.0.0.1:8000/base/v1/completions")
        );
        assert!(w.uri("/v1/embeddings").is_none(), "only the generation paths are parsed ahead");
    }

    #[tokio::test]
    async fn a_request_reaches_the_upstream_and_a_closed_port_is_a_connect_error() {
        use axum::routing::post;
        let app = axum::Router::new().route(
            "/v1/completions",
            post(|h: HeaderMap, body: Bytes| async move {
                let key = h.get("authorization").and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
                format!("{key}|{}", String::from_utf8_lossy(&body))
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        let w = PlainWire::new(&format!("http://{addr}"), &PATHS, Duration::from_secs(2)).unwrap();
        let mut h = HeaderMap::new();
        h.insert("authorization", "Bearer k".parse().unwrap());
        // Twice: the second request takes the pooled connection.
        for n in 0..2 {
            let uri = w.uri("/v1/completions").unwrap();
            let mut a = w.post(uri, h.clone(), Bytes::from(format!("{{\"n\":{n}}}"))).await.unwrap();
            assert_eq!(a.status, StatusCode::OK);
            let mut got = Vec::new();
            while let Some(c) = a.body.next().await {
                got.extend_from_slice(&c.unwrap());
            }
            assert_eq!(String::from_utf8(got).unwrap(), format!("Bearer k|{{\"n\":{n}}}"));
        }
        // A port nothing listens on.
        let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
        let w = PlainWire::new(&format!("http://{free}"), &PATHS, Duration::from_secs(2)).unwrap();
        let uri = w.uri("/v1/completions").unwrap();
        match w.post(uri, HeaderMap::new(), Bytes::new()).await {
            Err(SendError::Connect(_)) => {}
            Err(e) => panic!("expected a connect error, got {e}"),
            Ok(a) => panic!("expected a connect error, got status {}", a.status),
        }
    }
}
