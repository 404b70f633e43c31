//! `granary warehouse`: opens the store and serves it over RESP and HTTP
//! until SIGINT/SIGTERM, then drains offloads and syncs the disk tier.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use granary_warehouse::auth::Auth;
use granary_warehouse::{ServerCtx, Store};
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::config::WarehouseConfig;

pub async fn run(cfg: WarehouseConfig) -> Result<()> {
    let mut auth =
        Auth::new(cfg.admin_token.as_ref(), &cfg.tokens).map_err(|e| anyhow::anyhow!("warehouse tokens: {e}"))?;
    if let Some(t) = &cfg.metrics_token {
        auth = auth.with_metrics_token(t).map_err(|e| anyhow::anyhow!("warehouse tokens: {e}"))?;
    }
    if auth.is_open() {
        tracing::warn!("no tokens configured: every client shares namespace `default`; admin endpoints are disabled");
    }
    let started = std::time::Instant::now();
    let store = Store::open(cfg.store.clone()).await.context("opening the store")?;
    let ctx = Arc::new(ServerCtx::new(store.clone(), auth).with_limits(cfg.limits.clone()).with_lm(cfg.lm.clone()));
    let recovered: u64 = store.stats().tiers.iter().map(|t| t.recovered).sum();
    tracing::info!(tiers = ?store.tiers(), recovered, took_ms = started.elapsed().as_millis() as u64, "store open");

    let (stop_tx, stop_rx) = watch::channel(false);
    let stopped = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let mut tasks = Vec::new();
    if let Some(addr) = WarehouseConfig::listen("resp", &cfg.resp)? {
        let l = TcpListener::bind(addr).await.with_context(|| format!("binding RESP on {addr}"))?;
        println!("granary warehouse: resp listening on {}", l.local_addr()?);
        tasks.push(tokio::spawn(granary_warehouse::resp::serve(l, ctx.clone(), stopped(stop_rx.clone()))));
    }
    if let Some(addr) = WarehouseConfig::listen("http", &cfg.http)? {
        let l = TcpListener::bind(addr).await.with_context(|| format!("binding HTTP on {addr}"))?;
        println!("granary warehouse: http listening on {}", l.local_addr()?);
        tasks.push(tokio::spawn(granary_warehouse::http::serve(l, ctx.clone(), stopped(stop_rx.clone()))));
    }
    tasks.extend(granary_warehouse::lm::spawn(ctx.clone(), stopped(stop_rx.clone())).await?);
    println!("granary warehouse: ready");
    shutdown_signal().await;
    tracing::info!("shutting down: draining offloads");
    let _ = stop_tx.send(true);
    for t in tasks {
        let _ = tokio::time::timeout(Duration::from_secs(5), t).await;
    }
    store.flush(Duration::from_secs(10)).await.context("flushing the store")?;
    Ok(())
}

pub async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("SIGTERM handler");
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}
