//! API key secrets: their format, generation and hashing.
//!
//! A key reads `gk_` + 8 public characters + `_` + 32 secret characters, all
//! base62 from the operating system's CSPRNG (through `rand`'s thread RNG,
//! which is seeded from it). `gk_` and the 8 public characters form the
//! prefix, kept in clear to name the key in listings and logs; the database
//! keeps only the blake3 hash of the whole key.

use rand::distr::{Alphanumeric, SampleString};
use subtle::ConstantTimeEq;

/// What every key starts with.
pub const KEY_SCHEME: &str = "gk_";
/// Length of the public part after [`KEY_SCHEME`].
pub const PUBLIC_LEN: usize = 8;
/// Length of the secret part.
pub const SECRET_LEN: usize = 32;
/// Length of a whole key.
pub const KEY_LEN: usize = KEY_SCHEME.len() + PUBLIC_LEN + 1 + SECRET_LEN;

/// A fresh key: `(whole key, public prefix)`.
pub fn generate() -> (String, String) {
    let mut rng = rand::rng();
    let public = Alphanumeric.sample_string(&mut rng, PUBLIC_LEN);
    let secret = Alphanumeric.sample_string(&mut rng, SECRET_LEN);
    let prefix = format!("{KEY_SCHEME}{public}");
    (format!("{prefix}_{secret}"), prefix)
}

/// Whether `key` has the shape of a key this gateway issues.
pub fn well_formed(key: &str) -> bool {
    let b = key.as_bytes();
    b.len() == KEY_LEN
        && key.starts_with(KEY_SCHEME)
        && b[KEY_SCHEME.len() + PUBLIC_LEN] == b'_'
        && b[KEY_SCHEME.len()..KEY_SCHEME.len() + PUBLIC_LEN].iter().all(u8::is_ascii_alphanumeric)
        && b[KEY_LEN - SECRET_LEN..].iter().all(u8::is_ascii_alphanumeric)
}

/// The public prefix of a well-formed key.
pub fn prefix_of(key: &str) -> &str {
    &key[..KEY_SCHEME.len() + PUBLIC_LEN]
}

/// The stored form of a key: blake3 of the whole key, in lowercase hex.
pub fn hash(key: &str) -> String {
    blake3::hash(key.as_bytes()).to_hex().to_string()
}

/// Constant-time equality of two stored hashes.
pub fn hashes_equal(a: &str, b: &str) -> bool {
    a.len() == b.len() && bool::from(a.as_bytes().ct_eq(b.as_bytes()))
}

/// The token a request's `Authorization` header carries ([`strip_bearer`]);
/// empty when it has none.
pub fn bearer(headers: &axum::http::HeaderMap) -> &str {
    headers.get(axum::http::header::AUTHORIZATION).and_then(|v| v.to_str().ok()).map(strip_bearer).unwrap_or("")
}

/// The token in an `Authorization` value: `Bearer <token>` (scheme in any
/// case) or the bare token; surrounding blanks are ignored, and a lone
/// `Bearer` is no token at all.
pub fn strip_bearer(value: &str) -> &str {
    let v = value.trim();
    if v.eq_ignore_ascii_case("bearer") {
        return "";
    }
    match v.split_once(char::is_whitespace) {
        Some((scheme, rest)) if scheme.eq_ignore_ascii_case("bearer") => rest.trim(),
        _ => v,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_keys_are_well_formed_and_distinct() {
        let (a, pa) = generate();
        let (b, _) = generate();
        assert_ne!(a, b);
        assert!(well_formed(&a), "{a}");
        assert_eq!(a.len(), KEY_LEN);
        assert!(a.starts_with(&pa));
        assert_eq!(prefix_of(&a), pa);
        assert_eq!(pa.len(), 11);
        assert_eq!(hash(&a).len(), 64);
        assert!(hashes_equal(&hash(&a), &hash(&a)));
        assert!(!hashes_equal(&hash(&a), &hash(&b)));
    }

    #[test]
    fn malformed_keys_are_refused() {
        let (k, _) = generate();
        assert!(!well_formed(""));
        assert!(!well_formed(&k[1..]));
        assert!(!well_formed(&format!("{k}x")));
        assert!(!well_formed(&k.replace("gk_", "sk_")));
        let mut bad = k.clone().into_bytes();
        bad[11] = b'-';
        assert!(!well_formed(&String::from_utf8(bad).unwrap()));
        let mut bad = k.into_bytes();
        bad[20] = b'!';
        assert!(!well_formed(&String::from_utf8(bad).unwrap()));
        // A multi-byte character of the right byte length must not panic.
        assert!(!well_formed(&format!("gk_é{}", "a".repeat(KEY_LEN - 5))));
    }

    #[test]
    fn the_authorization_headers_token_is_read_once_for_all_routes() {
        let mut h = axum::http::HeaderMap::new();
        assert_eq!(bearer(&h), "");
        h.insert(axum::http::header::AUTHORIZATION, "Bearer gk_abc".parse().unwrap());
        assert_eq!(bearer(&h), "gk_abc");
        h.insert(axum::http::header::AUTHORIZATION, "BEARER  gk_abc ".parse().unwrap());
        assert_eq!(bearer(&h), "gk_abc");
    }

    #[test]
    fn bearer_scheme_is_stripped() {
        assert_eq!(strip_bearer("Bearer abc"), "abc");
        assert_eq!(strip_bearer("bearer   abc "), "abc");
        assert_eq!(strip_bearer("abc"), "abc");
        assert_eq!(strip_bearer("  "), "");
        assert_eq!(strip_bearer("Bearer"), "");
    }
}
