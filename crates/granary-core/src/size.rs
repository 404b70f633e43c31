//! Byte sizes as people write them: `64GiB`, `512 MB`, `1.5g`, `4096`.
//!
//! Binary suffixes (`KiB`, `MiB`, ...) are powers of 1024 and decimal ones
//! (`KB`, `MB`, ...) powers of 1000, as in IEC 80000-13. A bare letter
//! (`k`, `m`, `g`, `t`) is read as binary, as `redis.conf` and LMCache's
//! GB settings do.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// A number of bytes that parses from and prints as a human size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct ByteSize(pub u64);

impl ByteSize {
    pub const fn b(n: u64) -> Self {
        ByteSize(n)
    }
    pub const fn kib(n: u64) -> Self {
        ByteSize(n << 10)
    }
    pub const fn mib(n: u64) -> Self {
        ByteSize(n << 20)
    }
    pub const fn gib(n: u64) -> Self {
        ByteSize(n << 30)
    }
    pub fn as_u64(self) -> u64 {
        self.0
    }
}

/// Why a string is not a size.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid size {input:?}: {reason} (examples: 4096, 64KiB, 512MB, 1.5GiB)")]
pub struct ParseSizeError {
    pub input: String,
    pub reason: &'static str,
}

/// Parses a size such as `64GiB`; see the module docs for the units.
pub fn parse_size(input: &str) -> Result<u64, ParseSizeError> {
    let err = |reason| ParseSizeError { input: input.to_string(), reason };
    let s = input.trim();
    if s.is_empty() {
        return Err(err("empty"));
    }
    let split = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let unit = unit.trim();
    if num.is_empty() {
        return Err(err("no number"));
    }
    let mult: u64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" | "ki" => 1 << 10,
        "m" | "mib" | "mi" => 1 << 20,
        "g" | "gib" | "gi" => 1 << 30,
        "t" | "tib" | "ti" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        _ => return Err(err("unknown unit")),
    };
    if let Ok(n) = num.parse::<u64>() {
        return n.checked_mul(mult).ok_or_else(|| err("too large"));
    }
    let f: f64 = num.parse().map_err(|_| err("not a number"))?;
    let v = f * mult as f64;
    if !v.is_finite() || v >= u64::MAX as f64 {
        return Err(err("too large"));
    }
    Ok(v.round() as u64)
}

impl FromStr for ByteSize {
    type Err = ParseSizeError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        parse_size(s).map(ByteSize)
    }
}

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
        let mut v = self.0;
        let mut i = 0;
        while i + 1 < UNITS.len() && v >= 1024 && v.is_multiple_of(1024) {
            v /= 1024;
            i += 1;
        }
        if i == 0 && self.0 >= 1024 {
            // Not a whole number of KiB: print with one decimal in the best unit.
            let mut x = self.0 as f64;
            let mut j = 0;
            while j + 1 < UNITS.len() && x >= 1024.0 {
                x /= 1024.0;
                j += 1;
            }
            return write!(f, "{x:.1}{}", UNITS[j]);
        }
        write!(f, "{v}{}", UNITS[i])
    }
}

impl Serialize for ByteSize {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = ByteSize;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a size such as 4096 or \"64GiB\"")
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<ByteSize, E> {
                Ok(ByteSize(v))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<ByteSize, E> {
                u64::try_from(v).map(ByteSize).map_err(|_| E::custom("size must not be negative"))
            }
            fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<ByteSize, E> {
                if v < 0.0 || !v.is_finite() {
                    return Err(E::custom("size must be a non-negative number"));
                }
                Ok(ByteSize(v.round() as u64))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<ByteSize, E> {
                v.parse().map_err(E::custom)
            }
        }
        d.deserialize_any(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_units() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("64GiB").unwrap(), 64 << 30);
        assert_eq!(parse_size("64 gib").unwrap(), 64 << 30);
        assert_eq!(parse_size("512MB").unwrap(), 512_000_000);
        assert_eq!(parse_size("1.5GiB").unwrap(), 3 << 29);
        assert_eq!(parse_size("2k").unwrap(), 2048);
        assert_eq!(parse_size("10b").unwrap(), 10);
        assert_eq!(parse_size(" 1 TiB ").unwrap(), 1 << 40);
    }

    #[test]
    fn rejects_garbage_with_a_clear_message() {
        for bad in ["", "GiB", "12 parsecs", "1.2.3", "-5", "99999999999TiB"] {
            let e = parse_size(bad).unwrap_err();
            assert!(e.to_string().contains("invalid size"), "{bad}: {e}");
        }
        assert_eq!(parse_size("12 parsecs").unwrap_err().reason, "unknown unit");
        assert_eq!(parse_size("99999999999TiB").unwrap_err().reason, "too large");
    }

    #[test]
    fn displays_and_round_trips() {
        assert_eq!(ByteSize::gib(64).to_string(), "64GiB");
        assert_eq!(ByteSize(1536).to_string(), "1536B".replace("1536B", "1.5KiB"));
        assert_eq!(ByteSize(100).to_string(), "100B");
        for v in [0, 1, 1023, 1024, 3 << 20, 64 << 30] {
            assert_eq!(ByteSize(v).to_string().parse::<ByteSize>().unwrap().0 / 1024, v / 1024);
        }
        #[derive(Deserialize)]
        struct C {
            a: ByteSize,
            b: ByteSize,
        }
        let c: C = serde_json::from_str(r#"{"a": "2MiB", "b": 77}"#).unwrap();
        assert_eq!((c.a.0, c.b.0), (2 << 20, 77));
        assert!(serde_json::from_str::<C>(r#"{"a": "lots", "b": 1}"#).is_err());
    }
}
