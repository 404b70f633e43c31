//! Where the warehouse is: `embedded`, `resp://HOST:PORT` or `http://HOST:PORT`.

use std::fmt;
use std::str::FromStr;

/// Which warehouse the connector talks to, and over what.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum WarehouseSpec {
    /// A [`granary_warehouse::Store`] in this process, handed in by the caller.
    Embedded,
    /// The warehouse's RESP server; `addr` is `HOST:PORT` (IPv6 hosts in brackets).
    Resp { addr: String },
    /// The warehouse's HTTP server; `addr` is `HOST:PORT` (IPv6 hosts in brackets).
    Http { addr: String },
}

/// Why a string is not a warehouse spec; the message quotes it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid warehouse spec {spec:?}: {reason} (expected embedded, resp://HOST:PORT or http://HOST:PORT)")]
pub struct SpecError {
    pub spec: String,
    pub reason: String,
}

impl WarehouseSpec {
    /// Parses `embedded`, `resp://HOST:PORT` or `http://HOST:PORT` (a single
    /// trailing `/` is allowed on the HTTP form). Surrounding whitespace is ignored.
    pub fn parse(spec: &str) -> Result<Self, SpecError> {
        let fail = |reason: String| SpecError { spec: spec.to_string(), reason };
        let s = spec.trim();
        if s.is_empty() {
            return Err(fail("it is empty".into()));
        }
        if s == "embedded" {
            return Ok(WarehouseSpec::Embedded);
        }
        let Some((scheme, rest)) = s.split_once("://") else {
            return Err(fail(format!("{s:?} is neither `embedded` nor a resp:// or http:// address")));
        };
        match scheme {
            "resp" => Ok(WarehouseSpec::Resp { addr: host_port(rest).map_err(fail)? }),
            "http" => {
                let rest = rest.strip_suffix('/').unwrap_or(rest);
                Ok(WarehouseSpec::Http { addr: host_port(rest).map_err(fail)? })
            }
            "redis" => Err(fail("scheme redis:// is spelled resp:// here".into())),
            "https" => Err(fail("https is not supported; the warehouse serves plain HTTP".into())),
            other => Err(fail(format!("unknown scheme {other:?}"))),
        }
    }

    /// `HOST:PORT` of a remote warehouse; `None` for the embedded one.
    pub fn addr(&self) -> Option<&str> {
        match self {
            WarehouseSpec::Embedded => None,
            WarehouseSpec::Resp { addr } | WarehouseSpec::Http { addr } => Some(addr),
        }
    }
}

/// Checks `HOST:PORT` (host a name, an IPv4 address or a bracketed IPv6
/// address; port 1 to 65535) and returns it as given.
fn host_port(s: &str) -> Result<String, String> {
    if s.is_empty() {
        return Err("missing HOST:PORT after the scheme".into());
    }
    if let Some(c) = s.chars().find(|c| matches!(c, '/' | '?' | '#')) {
        return Err(format!("unexpected {c:?} in {s:?}: only HOST:PORT may follow the scheme"));
    }
    if s.contains('@') {
        return Err(format!("credentials in {s:?} are not accepted here; give the token in the connector settings"));
    }
    let (host, port) = if let Some(inner) = s.strip_prefix('[') {
        let Some((v6, after)) = inner.split_once(']') else {
            return Err(format!("unclosed '[' in {s:?}"));
        };
        if v6.parse::<std::net::Ipv6Addr>().is_err() {
            return Err(format!("{v6:?} is not an IPv6 address"));
        }
        let Some(port) = after.strip_prefix(':') else {
            return Err(format!("missing port in {s:?}"));
        };
        (&s[..v6.len() + 2], port)
    } else {
        let Some((host, port)) = s.rsplit_once(':') else {
            return Err(format!("missing port in {s:?}"));
        };
        if host.contains(':') {
            return Err(format!("IPv6 host in {s:?} must be written in brackets, like [::1]:6380"));
        }
        if host.is_empty() {
            return Err(format!("missing host in {s:?}"));
        }
        if let Some(c) = host.chars().find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_'))) {
            return Err(format!("host {host:?} contains {c:?}"));
        }
        (host, port)
    };
    match port.parse::<u16>() {
        Ok(p) if p > 0 => Ok(format!("{host}:{p}")),
        _ => Err(format!("port {port:?} is not a number from 1 to 65535")),
    }
}

impl FromStr for WarehouseSpec {
    type Err = SpecError;
    fn from_str(s: &str) -> Result<Self, SpecError> {
        Self::parse(s)
    }
}

impl fmt::Display for WarehouseSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WarehouseSpec::Embedded => f.write_str("embedded"),
            WarehouseSpec::Resp { addr } => write!(f, "resp://{addr}"),
            WarehouseSpec::Http { addr } => write!(f, "http://{addr}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepted_forms() {
        assert_eq!(WarehouseSpec::parse("embedded").unwrap(), WarehouseSpec::Embedded);
        assert_eq!(
            WarehouseSpec::parse(" resp://127.0.0.1:6380 ").unwrap(),
            WarehouseSpec::Resp { addr: "127.0.0.1:6380".into() }
        );
        assert_eq!(
            WarehouseSpec::parse("http://warehouse.svc:8300/").unwrap(),
            WarehouseSpec::Http { addr: "warehouse.svc:8300".into() }
        );
        assert_eq!(
            WarehouseSpec::parse("resp://[::1]:6380").unwrap(),
            WarehouseSpec::Resp { addr: "[::1]:6380".into() }
        );
        for s in ["embedded", "resp://h:1", "http://[::1]:8300"] {
            assert_eq!(WarehouseSpec::parse(s).unwrap().to_string(), s);
        }
    }

    #[test]
    fn errors_name_the_bad_value() {
        let cases = [
            ("", "empty"),
            ("embeded", "\"embeded\""),
            ("redis://h:6380", "resp://"),
            ("https://h:8300", "https"),
            ("ftp://h:1", "\"ftp\""),
            ("resp://", "missing HOST:PORT"),
            ("resp://host", "missing port in \"host\""),
            ("resp://:6380", "missing host"),
            ("resp://h:0", "port \"0\""),
            ("resp://h:65536", "port \"65536\""),
            ("http://h:x", "port \"x\""),
            ("http://h:8300/v1", "'/'"),
            ("resp://::1:6380", "brackets"),
            ("resp://[::1:6380", "unclosed"),
            ("resp://[zz]:6380", "\"zz\""),
            ("http://user:pw@h:1", "credentials"),
            ("resp://h st:1", "' '"),
        ];
        for (spec, want) in cases {
            let e = WarehouseSpec::parse(spec).unwrap_err();
            let msg = e.to_string();
            assert!(msg.contains(want), "{spec:?}: {msg}");
            assert!(msg.contains(&format!("{spec:?}")), "error must quote the spec: {msg}");
        }
    }
}
