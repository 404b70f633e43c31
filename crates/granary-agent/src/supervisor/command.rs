//! Engine command lines: the embedded engine's flags, or an external
//! engine's template with its placeholders substituted (shell-quoted).

use super::{LaunchSpec, SupervisorConfig};
use crate::error::AgentError;

/// `engines.threads`, else the cores this process may use.
pub fn threads(cfg: &SupervisorConfig) -> usize {
    cfg.threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// Quotes `s` for `sh`.
pub fn shell_quote(s: &str) -> String {
    if !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_./:=@%+,".contains(&b)) {
        return s.to_string();
    }
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// Replaces each `{name}` of `values` in one pass (a value is never read
/// again, so a model path holding `{port}` stays as it is); other braces
/// (`${VAR}`, `{a,b}`) are left to the shell.
fn substitute(template: &str, values: &[(&str, String)]) -> String {
    let mut out = String::with_capacity(template.len());
    let mut rest = template;
    while let Some(i) = rest.find('{') {
        out.push_str(&rest[..i]);
        let tail = &rest[i + 1..];
        let hit = values.iter().find(|(k, _)| tail.strip_prefix(k).is_some_and(|t| t.starts_with('}')));
        match hit {
            Some((k, v)) => {
                out.push_str(v);
                rest = &tail[k.len() + 1..];
            }
            None => {
                out.push('{');
                rest = tail;
            }
        }
    }
    out.push_str(rest);
    out
}

/// The engine flag that makes it run each request in the namespace the
/// gateway names.
const TRUST_NAMESPACE: &str = "--trust-namespace-header";

/// The command line for `spec` on `port`.
pub fn build_command(cfg: &SupervisorConfig, spec: &LaunchSpec, port: u16) -> Result<Vec<String>, AgentError> {
    let path = spec.model_path.to_string_lossy().into_owned();
    let gpus: Vec<String> = spec.gpus.iter().flatten().map(u32::to_string).collect();
    match &cfg.command {
        Some(t) => {
            let values = [
                ("model_path", shell_quote(&path)),
                ("model_id", shell_quote(&spec.model)),
                ("port", port.to_string()),
                ("host", shell_quote(&cfg.host)),
                ("threads", threads(cfg).to_string()),
                ("gpus", shell_quote(&gpus.join(","))),
                ("gpu_count", gpus.len().to_string()),
            ];
            let line = substitute(t, &values);
            Ok(vec!["sh".into(), "-c".into(), line])
        }
        None => {
            let exe = match &cfg.granary_exe {
                Some(p) => p.clone(),
                None => std::env::current_exe().map_err(|e| AgentError::io("finding the granary executable", e))?,
            };
            let mut v = vec![
                exe.to_string_lossy().into_owned(),
                "engine".into(),
                "--model".into(),
                path,
                "--model-id".into(),
                spec.model.clone(),
                "--listen".into(),
                format!("{}:{port}", cfg.host),
            ];
            // The gateway names each request's KV namespace from the
            // tenant of its key (`x-granary-namespace`); an engine that
            // ignored the header would run every tenant in one namespace,
            // and a tenant's prompt would reuse another's blocks. The
            // engines an agent starts answer the gateway only (its
            // deployment keeps them off clients' networks).
            if !cfg.engine_args.iter().any(|a| a == TRUST_NAMESPACE) {
                v.push(TRUST_NAMESPACE.into());
            }
            v.extend(cfg.engine_args.iter().cloned());
            Ok(v)
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::tiers::Tier;

    fn spec() -> LaunchSpec {
        LaunchSpec {
            model: "smol lm".into(),
            revision: "1".into(),
            model_path: PathBuf::from("/m/it's here.gguf"),
            files: vec![],
            tier: Tier::Disk,
            gpus: None,
            memory: 0,
        }
    }

    #[test]
    fn templates_substitute_shell_quoted_values() {
        let cfg = SupervisorConfig {
            command: Some("vllm serve {model_path} --served-model-name {model_id} --host {host} --port {port}".into()),
            ..Default::default()
        };
        let c = build_command(&cfg, &spec(), 4242).unwrap();
        assert_eq!(c[..2], ["sh", "-c"]);
        assert_eq!(
            c[2],
            r"vllm serve '/m/it'\''s here.gguf' --served-model-name 'smol lm' --host 127.0.0.1 --port 4242"
        );
        // What sh makes of it: the path comes back whole.
        let out = std::process::Command::new("sh")
            .args(["-c", &format!("printf %s {}", shell_quote("/m/it's here.gguf"))])
            .output()
            .unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout), "/m/it's here.gguf");
    }

    #[test]
    fn the_embedded_engine_gets_its_flags() {
        let cfg = SupervisorConfig {
            granary_exe: Some("/bin/granary".into()),
            engine_args: vec!["--block-tokens".into(), "16".into()],
            ..Default::default()
        };
        let c = build_command(&cfg, &spec(), 7).unwrap();
        assert_eq!(
            c,
            [
                "/bin/granary",
                "engine",
                "--model",
                "/m/it's here.gguf",
                "--model-id",
                "smol lm",
                "--listen",
                "127.0.0.1:7",
                "--trust-namespace-header",
                "--block-tokens",
                "16"
            ]
        );
        // Given among the engine's own flags, it is not given twice.
        let cfg = SupervisorConfig { engine_args: vec!["--trust-namespace-header".into()], ..cfg };
        let c = build_command(&cfg, &spec(), 7).unwrap();
        assert_eq!(c.iter().filter(|a| *a == "--trust-namespace-header").count(), 1, "{c:?}");
    }

    #[test]
    fn threads_gpus_and_braces_the_shell_owns() {
        let cfg = SupervisorConfig {
            command: Some(
                "CUDA={gpus} ${HOME} {a,b} run {model_path} -t {threads} --tp {gpu_count} --port {port}".into(),
            ),
            threads: Some(3),
            ..Default::default()
        };
        let mut s = spec();
        s.model_path = PathBuf::from("/m/{port}.gguf");
        s.gpus = Some(vec![2, 5]);
        let c = build_command(&cfg, &s, 77).unwrap();
        assert_eq!(c[2], "CUDA=2,5 ${HOME} {a,b} run '/m/{port}.gguf' -t 3 --tp 2 --port 77");
        s.gpus = None;
        let c = build_command(&cfg, &s, 77).unwrap();
        assert!(c[2].starts_with("CUDA='' ") && c[2].contains("--tp 0"), "{}", c[2]);
    }
}
