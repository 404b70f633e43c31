//! TLS on the front (rustls), with optional client-certificate checks.
//! (TLS to upstreams, mTLS included, is the HTTP client's: see
//! [`crate::config::UpstreamTls`].)

use std::future::Future;
use std::sync::Arc;

use anyhow::{Context, Result};
use hyper_util::rt::TokioIo;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::RootCertStore;
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;

use crate::config::ServerTls;

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn certs(path: &std::path::Path) -> Result<Vec<CertificateDer<'static>>> {
    let pem = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let certs: Vec<_> = rustls_pemfile::certs(&mut pem.as_slice())
        .collect::<Result<_, _>>()
        .with_context(|| format!("parsing certificates in {}", path.display()))?;
    anyhow::ensure!(!certs.is_empty(), "no certificate in {}", path.display());
    Ok(certs)
}

fn key(path: &std::path::Path) -> Result<PrivateKeyDer<'static>> {
    let pem = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    rustls_pemfile::private_key(&mut pem.as_slice())
        .with_context(|| format!("parsing the key in {}", path.display()))?
        .with_context(|| format!("no private key in {}", path.display()))
}

/// The server's rustls configuration (HTTP/1.1; client certificates
/// required when `client_ca` is set).
pub fn server_config(tls: &ServerTls) -> Result<Arc<rustls::ServerConfig>> {
    let builder = rustls::ServerConfig::builder_with_provider(provider()).with_safe_default_protocol_versions()?;
    let builder = match &tls.client_ca {
        Some(ca) => {
            let mut roots = RootCertStore::empty();
            for c in certs(ca)? {
                roots.add(c).context("adding the client CA")?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
                .build()
                .context("building the client certificate verifier")?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let mut cfg = builder.with_single_cert(certs(&tls.cert)?, key(&tls.key)?).context("loading the certificate")?;
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(cfg))
}

/// Serves `app` over TLS until `shutdown` resolves. A failed handshake
/// closes that connection only.
pub async fn serve(
    listener: TcpListener,
    app: impl Into<crate::front::App>,
    config: Arc<rustls::ServerConfig>,
    limits: granary_core::serve::HttpLimits,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<()> {
    let app: crate::front::App = app.into();
    let header_timeout = limits.header_timeout;
    let cap = granary_core::serve::ConnectionCap::new(limits.max_connections);
    let acceptor = TlsAcceptor::from(config);
    tokio::pin!(shutdown);
    loop {
        let (tcp, peer) = tokio::select! {
            _ = &mut shutdown => return Ok(()),
            x = granary_core::serve::accept(&listener) => x,
        };
        // Past `max_connections`: closed before the handshake.
        let Some(slot) = cap.admit(&tcp, false) else { continue };
        let _ = tcp.set_nodelay(true);
        let acceptor = acceptor.clone();
        let app = app.clone();
        tokio::spawn(async move {
            let _slot = slot;
            // The handshake gets the header timeout too: a client that
            // connects and sends nothing is closed as on plain HTTP.
            let handshake = acceptor.accept(tcp);
            let stream = match header_timeout {
                Some(t) => match tokio::time::timeout(t, handshake).await {
                    Ok(r) => r,
                    Err(_) => {
                        tracing::debug!(%peer, "TLS handshake timed out");
                        return;
                    }
                },
                None => handshake.await,
            };
            let stream = match stream {
                Ok(s) => s,
                Err(e) => {
                    tracing::debug!(%peer, error = %e, "TLS handshake failed");
                    return;
                }
            };
            let service = hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| app.call(req));
            if let Err(e) = crate::front::builder(header_timeout).serve_connection(TokioIo::new(stream), service).await
            {
                tracing::debug!(%peer, error = %e, "connection ended with an error");
            }
        });
    }
}
