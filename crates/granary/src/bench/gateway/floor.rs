//! The floor of the gateway's HTTP stack: a reverse proxy made of what the
//! gateway's generation path is made of (hyper's HTTP/1.1 server, the
//! gateway's own upstream pool, [`PlainWire`], each body read whole) and
//! nothing the gateway adds (no key, limits, metrics, audit, routing). Run
//! as a process of its own like the gateway, with the same runtime
//! threads, it shows how much of the distance to nginx is the stack's and
//! how much the gateway's features'.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use bytes::Bytes;
use granary_gateway::upstream::PlainWire;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;

const PATH: &str = "/v1/chat/completions";
/// Largest answer read (the bench's is about 300 bytes).
const MAX_ANSWER: usize = 1 << 20;

/// Serves until the process is killed, forwarding `POST PATH` to `up`.
pub(super) async fn serve(up: SocketAddr) -> Result<()> {
    let wire = PlainWire::new(&format!("http://{up}"), &[PATH], Duration::from_secs(5))
        .context("the upstream pool takes plain http:// upstreams with no proxy set in the environment")?;
    let wire = Arc::new(wire);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    println!("granary: proxy on http://{}", listener.local_addr()?);
    println!("granary: ready");
    loop {
        let (tcp, _) = listener.accept().await?;
        let _ = tcp.set_nodelay(true);
        let wire = wire.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| forward(wire.clone(), req));
            let _ = hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(tcp), service).await;
        });
    }
}

async fn forward(wire: Arc<PlainWire>, req: Request<Incoming>) -> Result<Response<Full<Bytes>>, Infallible> {
    let failed = |what: String| {
        let mut r = Response::new(Full::new(Bytes::from(what)));
        *r.status_mut() = StatusCode::BAD_GATEWAY;
        r
    };
    let (parts, body) = req.into_parts();
    let body = match body.collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => return Ok(failed(format!("reading the request: {e}"))),
    };
    let Some(uri) = wire.uri(PATH) else { return Ok(failed(format!("no target for {PATH}"))) };
    let mut answer = match wire.post(uri, parts.headers, body).await {
        Ok(a) => a,
        Err(e) => return Ok(failed(format!("the upstream: {e}"))),
    };
    let bytes = match answer.read_all(MAX_ANSWER).await {
        Ok(b) => b,
        Err(e) => return Ok(failed(format!("reading the answer: {e}"))),
    };
    let mut resp = Response::new(Full::new(Bytes::from(bytes)));
    *resp.status_mut() = answer.status;
    *resp.headers_mut() = answer.headers;
    Ok(resp)
}
