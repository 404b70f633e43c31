//! State shared by the RESP and HTTP servers: the store, who may use it,
//! and per-protocol counters that `/metrics` and INFO report.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use serde::Serialize;

use crate::auth::Auth;
use crate::config::{LmConfig, ServeLimits};
use crate::store::Store;

/// Counters of one protocol's front end.
#[derive(Debug, Default)]
pub struct ProtocolStats {
    pub connections_open: AtomicU64,
    pub connections_total: AtomicU64,
    pub requests_ok: AtomicU64,
    /// Requests answered with an error (bad input, auth, limits).
    pub requests_error: AtomicU64,
    pub bytes_read: AtomicU64,
    pub bytes_written: AtomicU64,
    /// Connections closed for a protocol violation (malformed frame, oversized value).
    pub protocol_errors: AtomicU64,
}

#[derive(Debug, Default, Serialize, Clone, Copy)]
pub struct ProtocolSnapshot {
    pub connections_open: u64,
    pub connections_total: u64,
    pub requests_ok: u64,
    pub requests_error: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
    pub protocol_errors: u64,
}

impl ProtocolStats {
    pub fn snapshot(&self) -> ProtocolSnapshot {
        ProtocolSnapshot {
            connections_open: self.connections_open.load(Relaxed),
            connections_total: self.connections_total.load(Relaxed),
            requests_ok: self.requests_ok.load(Relaxed),
            requests_error: self.requests_error.load(Relaxed),
            bytes_read: self.bytes_read.load(Relaxed),
            bytes_written: self.bytes_written.load(Relaxed),
            protocol_errors: self.protocol_errors.load(Relaxed),
        }
    }
}

/// Everything a connection handler needs.
pub struct ServerCtx {
    pub store: Store,
    pub auth: Auth,
    pub resp: ProtocolStats,
    pub http: ProtocolStats,
    /// LMCache's `lm://` protocol ([`crate::lm`]).
    pub lm: ProtocolStats,
    /// Set once the store is open and the listeners are bound (`/ready`).
    pub ready: std::sync::atomic::AtomicBool,
    /// Connection limits of the front ends.
    pub limits: ServeLimits,
    /// The `lm://` listener's settings.
    pub lm_config: LmConfig,
}

impl ServerCtx {
    pub fn new(store: Store, auth: Auth) -> Self {
        ServerCtx {
            store,
            auth,
            resp: ProtocolStats::default(),
            http: ProtocolStats::default(),
            lm: ProtocolStats::default(),
            ready: std::sync::atomic::AtomicBool::new(true),
            limits: ServeLimits::default(),
            lm_config: LmConfig::default(),
        }
    }

    /// Replaces the default connection limits.
    pub fn with_limits(mut self, limits: ServeLimits) -> Self {
        self.limits = limits;
        self
    }

    /// Sets where and for which namespace `lm://` is served.
    pub fn with_lm(mut self, lm: LmConfig) -> Self {
        self.lm_config = lm;
        self
    }
}
