//! TLS on the front (with and without client certificates) and mTLS from
//! the gateway to an upstream, with certificates made by the test.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use axum::routing::{get, post};
use axum::{Json, Router};
use granary_gateway::config::{GatewayConfig, ServerTls, UpstreamConfig, UpstreamTls};
use granary_gateway::identity::{AdminToken, Identity, IdentityOptions};
use granary_gateway::limits::Limiter;
use granary_gateway::tls::{serve, server_config};
use granary_gateway::Gateway;
use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};
use serde_json::{json, Value};

const ADMIN: &str = "admin-token-0123456789";

struct Ca {
    cert: rcgen::Certificate,
    key: KeyPair,
}

impl Ca {
    fn new() -> Ca {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let cert = params.self_signed(&key).unwrap();
        Ca { cert, key }
    }

    /// A certificate for `names` signed by this CA: (cert PEM, key PEM).
    fn issue(&self, names: &[&str]) -> (String, String) {
        let key = KeyPair::generate().unwrap();
        let params = CertificateParams::new(names.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap();
        let cert = params.signed_by(&key, &self.cert, &self.key).unwrap();
        (cert.pem(), key.serialize_pem())
    }

    fn write(&self, dir: &Path, name: &str) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, self.cert.pem()).unwrap();
        p
    }
}

fn write_pair(dir: &Path, name: &str, pair: &(String, String)) -> (PathBuf, PathBuf) {
    let (c, k) = (dir.join(format!("{name}.pem")), dir.join(format!("{name}.key")));
    std::fs::write(&c, &pair.0).unwrap();
    std::fs::write(&k, &pair.1).unwrap();
    (c, k)
}

async fn tls_server(app: Router, tls: &ServerTls) -> SocketAddr {
    let cfg = server_config(tls).unwrap();
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        serve(l, app, cfg, granary_core::serve::HttpLimits::default(), std::future::pending()).await
    });
    addr
}

fn client(ca: &Path, identity: Option<&(String, String)>) -> reqwest::Client {
    let mut b = reqwest::Client::builder()
        .add_root_certificate(reqwest::Certificate::from_pem(&std::fs::read(ca).unwrap()).unwrap());
    if let Some((c, k)) = identity {
        b = b.identity(reqwest::Identity::from_pem(format!("{c}{k}").as_bytes()).unwrap());
    }
    b.build().unwrap()
}

/// An engine-like upstream answering one fixed completion.
fn upstream_app() -> Router {
    Router::new()
        .route("/health", get(|| async { "ok" }))
        .route("/v1/models", get(|| async { Json(json!({"data": [{"id": "m"}]})) }))
        .route(
            "/v1/chat/completions",
            post(|| async {
                Json(json!({"choices": [{"message": {"content": "over tls"}}], "usage": {"prompt_tokens": 1, "completion_tokens": 1}}))
            }),
        )
}

async fn gateway(cfg: GatewayConfig) -> (std::sync::Arc<Gateway>, Router) {
    let identity = Identity::open("sqlite::memory:", IdentityOptions::default()).await.unwrap();
    let gw = Gateway::new(&cfg, identity, Limiter::in_process()).unwrap();
    gw.upstreams.probe_all(&cfg.gateway).await;
    let app = granary_gateway::server::router(gw.clone(), Some(AdminToken::new(ADMIN)));
    (gw, app)
}

#[tokio::test]
async fn the_front_speaks_tls_and_can_require_client_certificates() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new();
    let ca_path = ca.write(dir.path(), "ca.pem");
    let (cert, key) = write_pair(dir.path(), "server", &ca.issue(&["localhost"]));
    let up = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let up_addr = up.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(up, upstream_app()).await });
    let mut cfg = GatewayConfig::default();
    let mut u = UpstreamConfig::new("plain", format!("http://{up_addr}"));
    u.kv_events = false;
    cfg.upstreams.push(u);
    let (_gw, app) = gateway(cfg).await;

    let addr = tls_server(app.clone(), &ServerTls { cert: cert.clone(), key: key.clone(), client_ca: None }).await;
    let url = format!("https://localhost:{}/health", addr.port());
    let c = client(&ca_path, None);
    let r = c.get(&url).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.headers().contains_key("x-request-id"));
    // Plain HTTP to the TLS port gets no answer.
    assert!(reqwest::get(format!("http://{addr}/health")).await.is_err());
    // A client that does not trust the CA refuses the server.
    let other = Ca::new();
    let other_path = other.write(dir.path(), "other.pem");
    assert!(client(&other_path, None).get(&url).send().await.is_err());

    // With client_ca: no certificate, no connection; a certificate from the CA works.
    let clients = Ca::new();
    let clients_path = clients.write(dir.path(), "clients.pem");
    let addr = tls_server(app, &ServerTls { cert, key, client_ca: Some(clients_path) }).await;
    let url = format!("https://localhost:{}/health", addr.port());
    assert!(client(&ca_path, None).get(&url).send().await.is_err());
    let id = clients.issue(&["client-1"]);
    let r = client(&ca_path, Some(&id)).get(&url).send().await.unwrap();
    assert_eq!(r.status(), 200);
}

#[tokio::test]
async fn the_gateway_presents_its_certificate_to_an_mtls_upstream() {
    let dir = tempfile::tempdir().unwrap();
    let server_ca = Ca::new();
    let server_ca_path = server_ca.write(dir.path(), "server-ca.pem");
    let (cert, key) = write_pair(dir.path(), "upstream", &server_ca.issue(&["127.0.0.1", "localhost"]));
    let client_ca = Ca::new();
    let client_ca_path = client_ca.write(dir.path(), "client-ca.pem");
    let up = tls_server(upstream_app(), &ServerTls { cert, key, client_ca: Some(client_ca_path) }).await;
    let (gw_cert, gw_key) = write_pair(dir.path(), "gateway", &client_ca.issue(&["gateway"]));

    for with_cert in [true, false] {
        let mut cfg = GatewayConfig::default();
        let mut u = UpstreamConfig::new("secure", format!("https://localhost:{}", up.port()));
        u.kv_events = false;
        u.models = vec!["m".into()];
        u.tls = Some(UpstreamTls {
            ca: server_ca_path.clone(),
            cert: with_cert.then(|| gw_cert.clone()),
            key: with_cert.then(|| gw_key.clone()),
        });
        cfg.upstreams.push(u);
        cfg.gateway.max_attempts = 1;
        let (gw, app) = gateway(cfg).await;
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", l.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(l, app).await });
        let http = reqwest::Client::new();
        let _ = http
            .post(format!("{base}/admin/v1/tenants"))
            .bearer_auth(ADMIN)
            .json(&json!({"name": "acme"}))
            .send()
            .await
            .unwrap();
        let k: Value = http
            .post(format!("{base}/admin/v1/keys"))
            .bearer_auth(ADMIN)
            .json(&json!({"tenant": "acme"}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let r = http
            .post(format!("{base}/v1/chat/completions"))
            .bearer_auth(k["key"].as_str().unwrap())
            .json(&json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}))
            .send()
            .await
            .unwrap();
        if with_cert {
            assert_eq!(r.status(), 200);
            let v: Value = r.json().await.unwrap();
            assert_eq!(v["choices"][0]["message"]["content"], "over tls");
        } else {
            // The upstream refuses the handshake: health checks fail and requests get a server error.
            assert!(matches!(r.status().as_u16(), 502 | 503), "{}", r.status());
        }
        drop(gw);
    }
}
