//! Serving the gateway's router on its listener: plain HTTP here, TLS in
//! [`crate::tls`]. Connections are HTTP/1.1 through hyper with a timer, so that a client which does not finish a request's headers
//! within `header_timeout_s` (a slowloris, or a kept-alive connection left
//! idle) is closed instead of holding its socket and task for good.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::Method;
use axum::response::Response;
use axum::Router;
use futures::future::Either;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tower::ServiceExt;

use crate::proxy::{handle, Endpoint, Gateway};

/// What a connection serves: the router, and the gateway whose two
/// generation routes (`POST /v1/chat/completions`, `POST /v1/completions`,
/// the path nearly every request takes) are handed to the proxy directly,
/// without the router's matching, layers and extractors in between.
#[derive(Clone)]
pub struct App {
    router: Router,
    generation: Option<Arc<Gateway>>,
}

impl App {
    /// `router` for every request, but the generation routes go to `gw`
    /// (the same handler `router` has for them, see [`crate::server::app`]).
    pub fn new(router: Router, gw: Option<Arc<Gateway>>) -> App {
        App { router, generation: gw }
    }

    /// Serves one request.
    pub(crate) fn call(
        &self,
        req: hyper::Request<Incoming>,
    ) -> impl Future<Output = Result<Response, Infallible>> + Send + 'static {
        match (&self.generation, generation_route(&req)) {
            (Some(gw), Some(endpoint)) => Either::Left(generation(gw.clone(), endpoint, req)),
            _ => Either::Right(self.router.clone().oneshot(req.map(Body::new))),
        }
    }
}

impl From<Router> for App {
    fn from(router: Router) -> App {
        App { router, generation: None }
    }
}

fn generation_route(req: &hyper::Request<Incoming>) -> Option<Endpoint> {
    if req.method() != Method::POST {
        return None;
    }
    match req.uri().path() {
        "/v1/chat/completions" => Some(Endpoint::Chat),
        "/v1/completions" => Some(Endpoint::Completions),
        _ => None,
    }
}

/// A generation request, as the router's handler and request-id layer
/// would serve it.
async fn generation(
    gw: Arc<Gateway>,
    endpoint: Endpoint,
    req: hyper::Request<Incoming>,
) -> Result<Response, Infallible> {
    let id = crate::server::new_request_id();
    let (parts, body) = req.into_parts();
    let mut resp = handle(gw, endpoint, id.clone(), parts.headers, Body::new(body)).await;
    crate::server::set_request_id(&mut resp, &id);
    Ok(resp)
}

/// The connection builder (HTTP/1.1), with the header timeout. (hyper's
/// protocol-detecting builder waits for a first byte with no timer, so a
/// client that sends nothing would never be closed.)
pub(crate) fn builder(header_timeout: Option<Duration>) -> hyper::server::conn::http1::Builder {
    let mut b = hyper::server::conn::http1::Builder::new();
    b.timer(TokioTimer::new()).header_read_timeout(header_timeout);
    b
}

/// Serves `app` over plain HTTP until `shutdown` resolves, then lets the
/// requests in flight finish.
pub async fn serve_plain(
    listener: TcpListener,
    app: impl Into<App>,
    limits: granary_core::serve::HttpLimits,
    shutdown: impl Future<Output = ()> + Send,
) -> std::io::Result<()> {
    let app: App = app.into();
    let header_timeout = limits.header_timeout;
    let cap = granary_core::serve::ConnectionCap::new(limits.max_connections);
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let (tcp, peer) = tokio::select! {
            _ = &mut shutdown => break,
            x = granary_core::serve::accept(&listener) => x,
        };
        // Past `max_connections`: a 503 `too_many_connections`, closed.
        let Some(slot) = cap.admit(&tcp, true) else { continue };
        let _ = tcp.set_nodelay(true);
        let (app, watcher) = (app.clone(), graceful.watcher());
        tokio::spawn(async move {
            let _slot = slot;
            let service = hyper::service::service_fn(move |req: hyper::Request<Incoming>| app.call(req));
            let b = builder(header_timeout);
            if let Err(e) = watcher.watch(b.serve_connection(TokioIo::new(tcp), service)).await {
                tracing::debug!(%peer, error = %e, "connection ended with an error");
            }
        });
    }
    graceful.shutdown().await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use axum::routing::get;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// A server of `/health` within `limits` on a free port.
    async fn health_server(header_timeout_s: u64, max_connections: usize) -> std::net::SocketAddr {
        let app = Router::new().route("/health", get(|| async { "ok" }));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let limits = granary_core::serve::HttpLimits::new(header_timeout_s, max_connections);
        tokio::spawn(serve_plain(listener, app, limits, std::future::pending()));
        addr
    }

    /// A client trickling its headers (slowloris) and one that sends
    /// nothing are closed once the header timeout passes, without an
    /// answer; a client beside them is served meanwhile, over a kept-alive
    /// connection too. Without the timeout both would stay open.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn slow_or_silent_clients_are_closed_after_the_header_timeout() {
        let addr = health_server(2, 100).await;

        let started = Instant::now();
        let (mut slow_rx, mut slow_tx) = tokio::net::TcpStream::connect(addr).await.unwrap().into_split();
        slow_tx.write_all(b"GET /health HTTP/1.1\r\n").await.unwrap();
        let trickling = tokio::spawn(async move {
            let mut sent = 0;
            for i in 0..100 {
                tokio::time::sleep(Duration::from_millis(200)).await;
                if slow_tx.write_all(format!("x-{i}: y\r\n").as_bytes()).await.is_err() {
                    break;
                }
                sent += 1;
            }
            sent
        });
        let mut silent = tokio::net::TcpStream::connect(addr).await.unwrap();

        let http = reqwest::Client::new();
        for _ in 0..3 {
            let r = http.get(format!("http://{addr}/health")).send().await.unwrap();
            assert_eq!(r.text().await.unwrap(), "ok");
        }

        for (what, rx) in
            [("silent", &mut silent as &mut (dyn tokio::io::AsyncRead + Unpin + Send)), ("slow", &mut slow_rx)]
        {
            let mut got = Vec::new();
            tokio::time::timeout(Duration::from_secs(10), rx.read_to_end(&mut got))
                .await
                .unwrap_or_else(|_| panic!("the {what} client was never closed"))
                .ok();
            assert!(!String::from_utf8_lossy(&got).contains(" 200 "), "{what}: {}", String::from_utf8_lossy(&got));
        }
        let closed_after = started.elapsed();
        assert!(closed_after >= Duration::from_millis(1900), "closed before the timeout: {closed_after:?}");
        let sent = trickling.await.unwrap();
        assert!((5..100).contains(&sent), "the trickle ran {sent} lines");
        let r = http.get(format!("http://{addr}/health")).send().await.unwrap();
        assert_eq!(r.text().await.unwrap(), "ok");
    }

    /// Issue 40: past `max_connections` a connection is answered 503
    /// `too_many_connections` in the OpenAI error shape and closed; once a
    /// place frees, clients are served again. Before, the gateway took
    /// every connection it was offered.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_connection_past_the_cap_is_refused_in_the_openai_shape() {
        let addr = health_server(30, 2).await;
        let held: Vec<_> = futures::future::join_all((0..2).map(|_| tokio::net::TcpStream::connect(addr))).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        let mut third = tokio::net::TcpStream::connect(addr).await.unwrap();
        let mut got = Vec::new();
        tokio::time::timeout(Duration::from_secs(5), third.read_to_end(&mut got)).await.unwrap().unwrap();
        let text = String::from_utf8_lossy(&got);
        assert!(text.starts_with("HTTP/1.1 503"), "{text}");
        assert!(text.contains("\"code\": \"too_many_connections\""), "{text}");
        drop(held);
        let started = Instant::now();
        loop {
            match reqwest::get(format!("http://{addr}/health")).await {
                Ok(r) if r.status() == 200 => break,
                _ => assert!(started.elapsed() < Duration::from_secs(5), "not served once places freed"),
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}
