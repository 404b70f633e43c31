//! Who a client is, for both servers.
//!
//! Each namespace may have a bearer token; one admin token covers every
//! namespace and the admin endpoints; an optional metrics token opens
//! `/metrics` and nothing else (for a scraper that must not be able to
//! flush the store). Tokens are kept only as SHA-256
//! digests and compared in constant time. With no token configured at all
//! the servers run open (for loopback development): every client is the
//! `default` namespace and admin actions are refused unless an admin token
//! exists.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// The namespace of unauthenticated clients on an open server.
pub const DEFAULT_NAMESPACE: &str = "default";

/// What an authenticated client may do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Principal {
    /// Every namespace and the admin commands.
    Admin,
    /// One namespace.
    Namespace(String),
    /// `/metrics` only: no namespace, no admin command.
    Metrics,
}

impl Principal {
    pub fn is_admin(&self) -> bool {
        matches!(self, Principal::Admin)
    }

    /// Whether this principal may touch `ns`.
    pub fn may_access(&self, ns: &str) -> bool {
        match self {
            Principal::Admin => true,
            Principal::Namespace(n) => n == ns,
            Principal::Metrics => false,
        }
    }
}

/// A token as written in config: plain, or already hashed.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenConfig {
    /// The token itself.
    pub token: Option<String>,
    /// Its SHA-256 as 64 hex chars (keeps the secret out of the file).
    pub token_sha256: Option<String>,
}

impl TokenConfig {
    fn digest(&self) -> Result<[u8; 32], String> {
        match (&self.token, &self.token_sha256) {
            (Some(t), None) => Ok(sha256(t.as_bytes())),
            (None, Some(h)) => {
                let mut out = [0u8; 32];
                hex::decode_to_slice(h, &mut out).map_err(|_| "token_sha256 must be 64 hex chars".to_string())?;
                Ok(out)
            }
            _ => Err("give exactly one of token and token_sha256".into()),
        }
    }
}

pub fn sha256(data: &[u8]) -> [u8; 32] {
    Sha256::digest(data).into()
}

/// Token digests of the admin and of each namespace.
#[derive(Debug, Clone, Default)]
pub struct Auth {
    admin: Option<[u8; 32]>,
    namespaces: Vec<(String, [u8; 32])>,
    metrics: Option<[u8; 32]>,
}

impl Auth {
    /// Builds from config; errors name the offending entry.
    pub fn new(admin: Option<&TokenConfig>, namespaces: &HashMap<String, TokenConfig>) -> Result<Auth, String> {
        let admin = admin.map(|t| t.digest().map_err(|e| format!("admin token: {e}"))).transpose()?;
        let mut ns = Vec::new();
        for (name, t) in namespaces {
            ns.push((name.clone(), t.digest().map_err(|e| format!("token of namespace {name:?}: {e}"))?));
        }
        ns.sort();
        Ok(Auth { admin, namespaces: ns, metrics: None })
    }

    /// Adds a token that opens `/metrics` and nothing else.
    pub fn with_metrics_token(mut self, t: &TokenConfig) -> Result<Auth, String> {
        self.metrics = Some(t.digest().map_err(|e| format!("metrics token: {e}"))?);
        Ok(self)
    }

    /// [`Auth::with_metrics_token`] with a plain token (tests, flags).
    pub fn with_metrics_plain(mut self, token: &str) -> Auth {
        self.metrics = Some(sha256(token.as_bytes()));
        self
    }

    /// Whether a metrics-only token is configured.
    pub fn has_metrics(&self) -> bool {
        self.metrics.is_some()
    }

    /// Convenience for tests and flags: plain tokens.
    pub fn from_plain(admin: Option<&str>, namespaces: &[(&str, &str)]) -> Auth {
        Auth {
            admin: admin.map(|t| sha256(t.as_bytes())),
            namespaces: namespaces.iter().map(|(n, t)| (n.to_string(), sha256(t.as_bytes()))).collect(),
            metrics: None,
        }
    }

    /// No token configured: the server is open.
    pub fn is_open(&self) -> bool {
        self.admin.is_none() && self.namespaces.is_empty()
    }

    /// Whether an admin token is configured (admin endpoints answer only then).
    pub fn has_admin(&self) -> bool {
        self.admin.is_some()
    }

    /// The principal of an unauthenticated client: `Some` only on an open server.
    pub fn anonymous(&self) -> Option<Principal> {
        self.is_open().then(|| Principal::Namespace(DEFAULT_NAMESPACE.to_string()))
    }

    /// Checks a token (and, when given, the namespace it must belong to).
    /// Every configured digest is compared, so timing says nothing about which matched.
    pub fn authenticate(&self, namespace: Option<&str>, token: &[u8]) -> Option<Principal> {
        let d = sha256(token);
        let mut found = None;
        if let Some(a) = &self.admin {
            if bool::from(a.ct_eq(&d)) && namespace.is_none_or(|n| n == "admin" || n == "default") {
                found = Some(Principal::Admin);
            }
        }
        for (name, t) in &self.namespaces {
            let ok = bool::from(t.ct_eq(&d));
            if ok && found.is_none() && namespace.is_none_or(|n| n == name) {
                found = Some(Principal::Namespace(name.clone()));
            }
        }
        if let Some(m) = &self.metrics {
            if bool::from(m.ct_eq(&d)) && found.is_none() && namespace.is_none() {
                found = Some(Principal::Metrics);
            }
        }
        found
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_map_to_principals() {
        let a = Auth::from_plain(Some("root"), &[("t1", "s1"), ("t2", "s2")]);
        assert!(!a.is_open());
        assert_eq!(a.anonymous(), None);
        assert_eq!(a.authenticate(None, b"s1"), Some(Principal::Namespace("t1".into())));
        assert_eq!(a.authenticate(Some("t2"), b"s2"), Some(Principal::Namespace("t2".into())));
        assert_eq!(a.authenticate(Some("t2"), b"s1"), None, "token of t1 must not open t2");
        assert_eq!(a.authenticate(None, b"root"), Some(Principal::Admin));
        assert_eq!(a.authenticate(None, b"nope"), None);
        assert!(Principal::Namespace("t1".into()).may_access("t1"));
        assert!(!Principal::Namespace("t1".into()).may_access("t2"));
    }

    #[test]
    fn open_server_and_hashed_config() {
        assert_eq!(Auth::default().anonymous(), Some(Principal::Namespace("default".into())));
        let mut ns = HashMap::new();
        ns.insert("t".to_string(), TokenConfig { token: None, token_sha256: Some(hex::encode(sha256(b"secret"))) });
        let a = Auth::new(None, &ns).unwrap();
        assert_eq!(a.authenticate(None, b"secret"), Some(Principal::Namespace("t".into())));
        ns.insert("bad".to_string(), TokenConfig { token: None, token_sha256: Some("zz".into()) });
        assert!(Auth::new(None, &ns).unwrap_err().contains("\"bad\""));
    }
}
