//! Which of the engine's CPU kernel paths runs: the best this CPU has, or
//! a lower one named by `GRANARY_KERNELS`, so that tests and benchmarks can
//! run every path on one host.
//!
//! - `avx512vnni`: weights in int8 and 4-bit tiles multiplied by int8
//!   activations (`qmatmul`; AVX-512 F, BW and VNNI), AVX2 vector code for
//!   the rest;
//! - `avx2`: dense f32 weights (gemm) and the AVX2/FMA/F16C vector code;
//! - `generic`: dense f32 weights and the portable vector code.

use std::sync::OnceLock;

/// The environment variable naming a kernel path.
pub const KERNELS_ENV: &str = "GRANARY_KERNELS";

/// A CPU kernel path, lowest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum KernelPath {
    Generic,
    Avx2,
    Avx512Vnni,
}

impl KernelPath {
    pub const ALL: [KernelPath; 3] = [KernelPath::Avx512Vnni, KernelPath::Avx2, KernelPath::Generic];

    pub fn name(self) -> &'static str {
        match self {
            KernelPath::Generic => "generic",
            KernelPath::Avx2 => "avx2",
            KernelPath::Avx512Vnni => "avx512vnni",
        }
    }

    fn parse(s: &str) -> Option<KernelPath> {
        KernelPath::ALL.into_iter().find(|p| p.name() == s)
    }

    /// The best path this CPU runs.
    pub fn detected() -> KernelPath {
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 =
                is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c");
            let vnni = is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vnni");
            if avx2 && vnni {
                return KernelPath::Avx512Vnni;
            }
            if avx2 {
                return KernelPath::Avx2;
            }
        }
        KernelPath::Generic
    }
}

/// `GRANARY_KERNELS` as asked: `Ok(None)` when unset; an error naming the
/// paths for a value that is none of them, or for a path this CPU lacks.
pub fn requested() -> Result<Option<KernelPath>, String> {
    let Some(v) = std::env::var_os(KERNELS_ENV) else { return Ok(None) };
    let names: Vec<&str> = KernelPath::ALL.iter().map(|p| p.name()).collect();
    let v = v.to_string_lossy();
    let Some(p) = KernelPath::parse(v.trim()) else {
        return Err(format!("{KERNELS_ENV}={v:?} names no kernel path (one of: {})", names.join(", ")));
    };
    let best = KernelPath::detected();
    if p > best {
        return Err(format!("{KERNELS_ENV}={} is beyond this CPU, whose best path is {}", p.name(), best.name()));
    }
    Ok(Some(p))
}

/// The path in use, read once: the one `GRANARY_KERNELS` names, else the
/// best this CPU has (a value [`requested`] refuses counts as unset; the
/// `granary` commands refuse it before anything runs).
pub fn kernel_path() -> KernelPath {
    static PATH: OnceLock<KernelPath> = OnceLock::new();
    *PATH.get_or_init(|| requested().ok().flatten().unwrap_or_else(KernelPath::detected))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_named_and_ordered() {
        for p in KernelPath::ALL {
            assert_eq!(KernelPath::parse(p.name()), Some(p));
        }
        assert_eq!(KernelPath::parse("avx512"), None);
        assert!(KernelPath::Generic < KernelPath::Avx2 && KernelPath::Avx2 < KernelPath::Avx512Vnni);
        assert!(kernel_path() <= KernelPath::detected());
    }
}
