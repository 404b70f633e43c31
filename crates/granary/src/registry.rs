//! `granary registry`: run the model registry (`serve`) or drive one over
//! its HTTP API (`list`, `show`, `import`, `push`, `delete`, `gc`).

use std::io::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use granary_registry::{ImportRequest, RegistryClient, RegistryConfig};

#[derive(Args)]
pub struct RegistryArgs {
    #[command(subcommand)]
    pub cmd: RegistryCmd,
}

#[derive(Subcommand)]
pub enum RegistryCmd {
    /// Run the registry's HTTP API.
    Serve(Box<ServeArgs>),
    /// List models and their revisions.
    List {
        #[command(flatten)]
        client: ClientArgs,
        /// Print the JSON answer.
        #[arg(long)]
        json: bool,
    },
    /// Show a model's revisions, or one revision's files (NAME@REV, REV may be `latest`).
    Show {
        /// NAME or NAME@REV.
        target: String,
        #[command(flatten)]
        client: ClientArgs,
        /// Print the JSON answer.
        #[arg(long)]
        json: bool,
    },
    /// Import a revision from dir:/abs/path, pypi:SPEC or hf:owner/name[@rev]
    /// (a plain path means dir:). The registry reads the source, not this command.
    Import {
        /// dir:/abs/path, pypi:SPEC, hf:owner/name[@rev], or a local path.
        source: String,
        /// The model's name.
        #[arg(long)]
        name: String,
        /// The revision's name [default: the source's version or commit, or a content hash].
        #[arg(long)]
        revision: Option<String>,
        /// License id (e.g. apache-2.0) [default: what the source declares].
        #[arg(long)]
        license: Option<String>,
        #[command(flatten)]
        client: ClientArgs,
        /// Print the JSON answer.
        #[arg(long)]
        json: bool,
    },
    /// Upload the files of a local directory over HTTP (resumable, sha256
    /// checked by the registry) and record them as a revision.
    Push {
        /// The directory (hidden files are skipped, as in a dir: import).
        dir: PathBuf,
        /// The model's name.
        #[arg(long)]
        name: String,
        /// The revision's name [default: a hash of the files].
        #[arg(long)]
        revision: Option<String>,
        /// License id (e.g. apache-2.0).
        #[arg(long)]
        license: Option<String>,
        #[command(flatten)]
        client: ClientArgs,
        /// Print the JSON answer.
        #[arg(long)]
        json: bool,
    },
    /// Delete a model (NAME) or one revision (NAME@REV), and the blobs nothing else references.
    Delete {
        /// NAME or NAME@REV.
        target: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Delete blobs no revision references (left by interrupted imports).
    Gc {
        /// Keep unreferenced blobs younger than this many seconds.
        #[arg(long, default_value_t = 3600)]
        grace_s: u64,
        #[command(flatten)]
        client: ClientArgs,
    },
}

#[derive(Args)]
pub struct ClientArgs {
    /// The registry's URL.
    #[arg(long, env = "GRANARY_REGISTRY_URL", default_value = "http://127.0.0.1:8400")]
    pub url: String,
    /// Bearer token (the admin token for import, delete and gc).
    #[arg(long, env = "GRANARY_REGISTRY_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
}

impl ClientArgs {
    fn client(&self) -> Result<RegistryClient> {
        Ok(RegistryClient::new(&self.url, self.token.clone())?)
    }
}

#[derive(Args)]
pub struct ServeArgs {
    /// Listen address.
    #[arg(long, default_value = "127.0.0.1:8400")]
    pub listen: SocketAddr,
    /// Data directory [default: $XDG_DATA_HOME/granary or ~/.local/share/granary].
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// Catalog: sqlite:///path/registry.db or postgres://… [default: sqlite://DATA/registry/registry.db].
    #[arg(long, env = "GRANARY_REGISTRY_DATABASE")]
    pub database: Option<String>,
    /// Object store: file:///dir, s3://bucket/prefix, gs://…, az://… [default: file://DATA/registry/blobs].
    #[arg(long, env = "GRANARY_REGISTRY_STORE")]
    pub store: Option<String>,
    /// An object-store option KEY=VALUE (repeatable), e.g. aws_endpoint=http://127.0.0.1:9000.
    #[arg(long = "store-option", value_parser = parse_kv)]
    pub store_options: Vec<(String, String)>,
    /// Admin token for import, delete and gc; without one they are refused.
    #[arg(long, env = "GRANARY_REGISTRY_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
    /// A file holding the admin token.
    #[arg(long, conflicts_with = "admin_token")]
    pub admin_token_file: Option<PathBuf>,
    /// A token that may read (repeatable; visible in `ps`: prefer --read-token-file).
    #[arg(long = "read-token")]
    pub read_tokens: Vec<String>,
    /// A file of read tokens, one per line (blank lines and `#` comments skipped).
    #[arg(long)]
    pub read_token_file: Option<PathBuf>,
    /// Where uploads are kept until complete [default: DATA/registry/uploads].
    #[arg(long)]
    pub upload_dir: Option<PathBuf>,
    /// Reads need no token.
    #[arg(long)]
    pub anonymous_read: bool,
    /// The URL clients reach this registry at (for blob URLs of file:// stores) [default: the request's Host].
    #[arg(long)]
    pub public_url: Option<String>,
    /// Seconds presigned URLs stay valid.
    #[arg(long, default_value_t = 3600)]
    pub url_ttl_s: u64,
    /// Seconds a client has to send a request's headers (a silent or
    /// trickling client is closed after it); 0: no limit.
    #[arg(long, default_value_t = 30)]
    pub header_timeout_s: u64,
    /// Most connections open at once; one more is answered 503 `too_many_connections`.
    #[arg(long, default_value_t = 10_000)]
    pub max_connections: usize,
    /// A directory dir: imports may read (repeatable) [default: any].
    #[arg(long = "import-root")]
    pub import_roots: Vec<PathBuf>,
    /// An extra argument for `pip download` (repeatable), e.g. --pip-arg=--index-url=URL.
    #[arg(long = "pip-arg", allow_hyphen_values = true)]
    pub pip_args: Vec<String>,
    /// The Hugging Face cache hf: imports read [default: HF_HUB_CACHE, HF_HOME/hub or ~/.cache/huggingface/hub].
    #[arg(long)]
    pub hf_cache: Option<PathBuf>,
}

fn parse_kv(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err(format!("expected KEY=VALUE, got {s:?}")),
    }
}

/// `NAME` or `NAME@REV`.
fn split_target(t: &str) -> (&str, Option<&str>) {
    match t.split_once('@') {
        Some((n, r)) => (n, Some(r)),
        None => (t, None),
    }
}

pub async fn run(args: RegistryArgs) -> Result<()> {
    match args.cmd {
        RegistryCmd::Serve(a) => serve(*a).await,
        RegistryCmd::List { client, json } => {
            let models = client.client()?.list().await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&serde_json::json!({ "models": models }))?);
            } else if models.is_empty() {
                println!("no models");
            } else {
                println!("{:<32} {:<20} REVISIONS", "NAME", "LATEST");
                for m in models {
                    println!("{:<32} {:<20} {}", m.name, m.latest, m.revisions.join(", "));
                }
            }
            Ok(())
        }
        RegistryCmd::Show { target, client, json } => {
            let c = client.client()?;
            let (name, rev) = split_target(&target);
            let revisions = match rev {
                Some(r) => vec![c.revision(name, r).await?],
                None => c.model(name).await?.revisions,
            };
            if json {
                let v = if rev.is_some() {
                    serde_json::to_value(&revisions[0])?
                } else {
                    serde_json::to_value(&revisions)?
                };
                println!("{}", serde_json::to_string_pretty(&v)?);
                return Ok(());
            }
            for r in revisions {
                print_revision(&r);
            }
            Ok(())
        }
        RegistryCmd::Import { source, name, revision, license, client, json } => {
            let source = if source.contains(':') {
                source
            } else {
                let p = std::fs::canonicalize(&source).with_context(|| format!("{source}: no such path"))?;
                format!("dir:{}", p.display())
            };
            let req = ImportRequest { name, revision, source, license };
            let spinner = indicatif::ProgressBar::new_spinner();
            spinner
                .set_style(indicatif::ProgressStyle::with_template("{spinner} {msg} [{elapsed}]").expect("template"));
            spinner.set_message(format!("importing {} into {}", req.source, req.name));
            spinner.enable_steady_tick(Duration::from_millis(200));
            let res = client.client()?.import(&req).await;
            spinner.finish_and_clear();
            let rev = res?;
            if json {
                println!("{}", serde_json::to_string_pretty(&rev)?);
            } else {
                println!("imported {}@{}", rev.name, rev.revision);
                print_revision(&rev);
            }
            Ok(())
        }
        RegistryCmd::Push { dir, name, revision, license, client, json } => {
            anyhow::ensure!(dir.is_dir(), "{}: not a directory", dir.display());
            let bar = indicatif::ProgressBar::new(0);
            bar.set_style(
                indicatif::ProgressStyle::with_template("{msg} {bytes}/{total_bytes} [{elapsed}]").expect("template"),
            );
            let show = |label: &str, done: u64, total: u64| {
                bar.set_message(label.to_string());
                bar.set_length(total);
                bar.set_position(done);
            };
            let res = client.client()?.push_dir(&dir, &name, revision, license, &show).await;
            bar.finish_and_clear();
            let (rev, report) = res?;
            if json {
                println!("{}", serde_json::to_string_pretty(&rev)?);
            } else {
                println!(
                    "pushed {}@{}: {} files sent ({} bytes, {} resumed from an earlier push), {} already stored",
                    rev.name,
                    rev.revision,
                    report.uploaded,
                    report.sent_bytes,
                    report.resumed_bytes,
                    report.already_stored
                );
                print_revision(&rev);
            }
            Ok(())
        }
        RegistryCmd::Delete { target, client } => {
            let (name, rev) = split_target(&target);
            client.client()?.delete(name, rev).await?;
            println!("deleted {target}");
            Ok(())
        }
        RegistryCmd::Gc { grace_s, client } => {
            let r = client.client()?.gc(Duration::from_secs(grace_s)).await?;
            println!(
                "deleted {} blobs ({} bytes); {} unreferenced kept (younger than {grace_s}s); {} referenced",
                r.deleted, r.deleted_bytes, r.kept_young, r.referenced
            );
            Ok(())
        }
    }
}

fn print_revision(r: &granary_registry::Revision) {
    println!(
        "{}@{}  format {}  license {}  {} bytes  created {}",
        r.name,
        r.revision,
        r.format,
        r.license.as_deref().unwrap_or("-"),
        r.size,
        r.created
    );
    if let Some(s) = &r.source {
        println!("  source {s}");
    }
    for f in &r.files {
        println!("  {:>12}  {}  {}", f.size, f.sha256, f.path);
    }
}

async fn serve(a: ServeArgs) -> Result<()> {
    let data = a.data_dir.clone().unwrap_or_else(crate::engine::default_data_dir).join("registry");
    let database = match a.database {
        Some(d) => d,
        None => {
            std::fs::create_dir_all(&data).with_context(|| format!("creating {}", data.display()))?;
            format!("sqlite://{}", data.join("registry.db").display())
        }
    };
    let store = match a.store {
        Some(s) => s,
        None => {
            let dir = data.join("blobs");
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            url::Url::from_directory_path(std::fs::canonicalize(&dir)?)
                .map_err(|_| anyhow::anyhow!("{} is not an absolute path", dir.display()))?
                .to_string()
        }
    };
    let mut cfg = RegistryConfig::new(database, store);
    cfg.store_options = a.store_options;
    cfg.admin_token = a.admin_token.filter(|t| !t.is_empty());
    if let Some(p) = &a.admin_token_file {
        let t = std::fs::read_to_string(p).with_context(|| format!("--admin-token-file: reading {}", p.display()))?;
        anyhow::ensure!(!t.trim().is_empty(), "--admin-token-file: {} is empty", p.display());
        cfg.admin_token = Some(t.trim().to_string());
    }
    cfg.read_tokens = a.read_tokens;
    if let Some(p) = &a.read_token_file {
        let text = std::fs::read_to_string(p).with_context(|| format!("--read-token-file: reading {}", p.display()))?;
        cfg.read_tokens
            .extend(text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')).map(str::to_string));
    }
    if let Some(u) = &a.public_url {
        let ok = url::Url::parse(u).is_ok_and(|p| matches!(p.scheme(), "http" | "https") && p.host().is_some());
        anyhow::ensure!(ok, "--public-url: {u:?} is not an http:// or https:// URL");
    }
    cfg.upload_dir = Some(a.upload_dir.clone().unwrap_or_else(|| data.join("uploads")));
    cfg.anonymous_read = a.anonymous_read;
    cfg.public_url = a.public_url;
    cfg.url_ttl = Duration::from_secs(a.url_ttl_s);
    anyhow::ensure!(a.max_connections > 0, "--max-connections: must be at least 1");
    cfg.http = granary_core::serve::HttpLimits::new(a.header_timeout_s, a.max_connections);
    cfg.import.dir_roots = a.import_roots;
    cfg.import.pip_args = a.pip_args;
    cfg.import.hf_cache = a.hf_cache;
    if let Some(py) = std::env::var_os("GRANARY_PYTHON") {
        cfg.import.python = py.to_string_lossy().into_owned();
    }
    if cfg.admin_token.as_ref().is_some_and(|t| t.len() < 16) {
        eprintln!("granary registry: warning: the admin token is shorter than 16 characters");
    }
    if cfg.admin_token.is_none() {
        eprintln!("granary registry: no --admin-token: import, delete and gc are disabled");
    }
    if cfg.admin_token.is_none() && cfg.read_tokens.is_empty() && !cfg.anonymous_read {
        eprintln!("granary registry: no tokens and no --anonymous-read: every read will be refused");
    }
    let reg = std::sync::Arc::new(granary_registry::Registry::open(&cfg).await?);
    let listener = tokio::net::TcpListener::bind(a.listen).await.with_context(|| format!("binding {}", a.listen))?;
    let addr = listener.local_addr()?;
    println!(
        "granary registry: listening on http://{addr} (catalog {}, store {})",
        reg.catalog().backend(),
        reg.blobs().url()
    );
    println!("granary registry: ready");
    let _ = std::io::stdout().flush();
    granary_registry::server::serve_registry(reg, &cfg, listener, crate::warehouse::shutdown_signal()).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_and_options() {
        assert_eq!(split_target("m"), ("m", None));
        assert_eq!(split_target("m@latest"), ("m", Some("latest")));
        assert_eq!(parse_kv("aws_endpoint=http://x=y").unwrap(), ("aws_endpoint".into(), "http://x=y".into()));
        assert!(parse_kv("=x").is_err());
        assert!(parse_kv("novalue").is_err());
    }
}
