use super::*;

const FULL: &str = r#"
[gateway]
listen = "127.0.0.1:9000"
database = "sqlite::memory:"
redis = "redis://127.0.0.1:6379"
max_attempts = 2

[gateway.breaker]
failures = 5
open_ms = 500

[[upstream]]
name = "a"
url = "http://127.0.0.1:8001"
max_active = 4

[[upstream]]
name = "b"
url = "http://127.0.0.1:8002"
role = "decode"
kv_events = false

[[pool]]
name = "main"
upstreams = ["a"]
weight = 80
routing = { policy = "kv_aware", load_penalty = 2.0 }

[[pool]]
name = "spill"
upstreams = ["b"]
weight = 20
routing = { policy = "session", header = "x-user" }
"#;

#[test]
fn parses_a_full_file() {
    let c = GatewayConfig::from_toml(FULL).unwrap();
    assert_eq!(c.gateway.listen.port(), 9000);
    assert_eq!(c.gateway.max_attempts, 2);
    assert_eq!(c.gateway.breaker, BreakerConfig { failures: 5, open_ms: 500 });
    assert_eq!(c.gateway.first_byte_timeout_s, 300, "defaults fill what is absent");
    assert_eq!(c.upstreams.len(), 2);
    assert!(c.upstreams[0].kv_events && !c.upstreams[1].kv_events);
    assert_eq!(c.upstreams[1].role, Role::Decode);
    assert_eq!(c.pools[0].weight, 80);
    assert!(matches!(c.pools[0].routing, PolicyConfig::KvAware { .. }));
    assert_eq!(c.pools[1].routing.session_header(), Some("x-user"));
}

#[test]
fn defaults_listen_on_loopback_and_pool_everything() {
    let c = GatewayConfig::from_toml("[[upstream]]\nname = \"a\"\nurl = \"http://h:1\"\n").unwrap();
    assert!(c.gateway.listen.ip().is_loopback());
    let pools = c.effective_pools();
    assert_eq!(pools.len(), 1);
    assert_eq!(pools[0].upstreams, vec!["a".to_string()]);
}

#[test]
fn errors_name_the_field() {
    let err = |s: &str| GatewayConfig::from_toml(s).unwrap_err();
    assert_eq!(err("[gateway]\nmax_attempts = \"x\"\n").field, "gateway.max_attempts");
    assert_eq!(err("[gateway]\nlisten = 5\nbogus = 1\n").field, "gateway.listen");
    assert_eq!(err("[gateway]\nbogus = 1\n").field, "gateway.bogus");
    assert_eq!(err("[[upstream]]\nname = \"a\"\nurl = \"ftp://x\"\n").field, "upstream[0].url");
    assert_eq!(
        err("[[upstream]]\nname = \"a\"\nurl = \"http://x\"\n[[upstream]]\nname = \"a\"\nurl = \"http://y\"\n").field,
        "upstream[1].name"
    );
    let e = err("[[upstream]]\nname = \"a\"\nurl = \"http://x\"\n[[pool]]\nname = \"p\"\nupstreams = [\"zz\"]\n");
    assert_eq!(e.field, "pool[0].upstreams[0]");
    assert!(e.message.contains("zz"));
    assert_eq!(err("[gateway]\nmax_attempts = 0\n").field, "gateway.max_attempts");
}

/// Issue 14, point 3: third-party upstreams' fields, and their checks.
#[test]
fn third_party_upstream_fields_parse_and_are_checked() {
    let c = GatewayConfig::from_toml(
        r#"
[gateway]
key_rotation_grace_s = 60
agent_token_env = "AGENT"
[gateway.model_fallbacks]
big = ["small", "tiny"]
[[upstream]]
name = "vllm"
url = "http://h:1"
granary = false
health_path = ""
api_key_env = "VLLM_KEY"
model_map = { big = "org/big-v2" }
[[upstream]]
name = "eng"
url = "http://h:2"
"#,
    )
    .unwrap();
    let (v, e) = (&c.upstreams[0], &c.upstreams[1]);
    assert_eq!((v.granary, v.health_path.as_str()), (Some(false), ""));
    assert_eq!(v.model_map["big"], "org/big-v2");
    assert_eq!((e.granary, e.health_path.as_str()), (None, "/health"), "defaults: detected, /health");
    assert_eq!(c.gateway.model_fallbacks["big"], vec!["small".to_string(), "tiny".into()]);
    assert_eq!((c.gateway.key_rotation_grace_s, c.gateway.agent_token_env.as_str()), (60, "AGENT"));
    assert_eq!(c.gateway.metrics_token_env, "GRANARY_METRICS_TOKEN");

    let err = |s: &str| GatewayConfig::from_toml(s).unwrap_err();
    let up = "[[upstream]]\nname = \"a\"\nurl = \"http://x\"\n";
    assert_eq!(err(&format!("{up}health_path = \"health\"\n")).field, "upstream[0].health_path");
    assert_eq!(err(&format!("{up}model_map = {{ a = \"\" }}\n")).field, "upstream[0].model_map");
    assert_eq!(err(&format!("{up}granary = \"yes\"\n")).field, "upstream[0].granary");
    assert_eq!(err("[gateway.model_fallbacks]\nbig = [\"big\"]\n").field, "gateway.model_fallbacks.big[0]");
}

/// Issue 14, point 3: a vLLM engine's KV events and tokenizer.
#[test]
fn vllm_kv_event_fields_parse_and_are_checked() {
    let up = "[[upstream]]\nname = \"v\"\nurl = \"http://x\"\n";
    let c = GatewayConfig::from_toml(&format!(
        "{up}tokenizer = \"/m/model.gguf\"\nkv_events_zmq = \"tcp://127.0.0.1:5557\"\nkv_block_tokens = 32\nkv_events_topic = \"kv\"\n"
    ))
    .unwrap();
    let v = &c.upstreams[0];
    assert_eq!(v.tokenizer.as_deref(), Some(std::path::Path::new("/m/model.gguf")));
    assert_eq!((v.kv_block_tokens, v.kv_events_topic.as_str()), (32, "kv"));
    assert_eq!(GatewayConfig::from_toml(up).unwrap().upstreams[0].kv_block_tokens, 16, "vLLM's default");

    let err = |s: &str| GatewayConfig::from_toml(&format!("{up}{s}")).unwrap_err();
    let e = err("kv_events_zmq = \"tcp://h:1\"\n");
    assert_eq!(e.field, "upstream[0].kv_events_zmq");
    assert!(e.message.contains("tokenizer"), "{}", e.message);
    assert_eq!(err("tokenizer = \"t.json\"\nkv_events_zmq = \"ipc:///x\"\n").field, "upstream[0].kv_events_zmq");
    assert_eq!(
        err("tokenizer = \"t.json\"\nkv_events_zmq = \"tcp://h:1\"\ngranary = true\n").field,
        "upstream[0].kv_events_zmq"
    );
    assert_eq!(err("kv_block_tokens = 0\n").field, "upstream[0].kv_block_tokens");
}

#[test]
fn the_agents_section_has_defaults_and_names_its_fields() {
    let c = GatewayConfig::from_toml("").unwrap();
    assert!(c.gateway.agents.enabled);
    assert_eq!(c.gateway.agents.ttl_ms, 10_000);
    assert_eq!(c.gateway.agents.load_timeout_ms, 120_000);
    assert!(matches!(c.gateway.agents.pool_policy.config(), PolicyConfig::KvAware { .. }));
    let c = GatewayConfig::from_toml(
        "[gateway.agents]\nttl_ms = 500\nload_timeout_ms = 1000\nenabled = false\npool_policy = \"least_load\"\n",
    )
    .unwrap();
    assert_eq!(c.gateway.agents.ttl(), Duration::from_millis(500));
    assert!(!c.gateway.agents.enabled);
    assert_eq!(c.gateway.agents.pool_policy.config(), PolicyConfig::LeastLoad);
    let c = GatewayConfig::from_toml("[gateway.agents]\npool_policy = { policy = \"session\", header = \"x-user\" }\n")
        .unwrap();
    assert_eq!(c.gateway.agents.pool_policy.config().session_header(), Some("x-user"));

    let err = |s: &str| GatewayConfig::from_toml(s).unwrap_err();
    assert_eq!(err("[gateway.agents]\nttl_ms = 5\n").field, "gateway.agents.ttl_ms");
    assert_eq!(err("[gateway.agents]\nttl_ms = \"x\"\n").field, "gateway.agents.ttl_ms");
    assert_eq!(err("[gateway.agents]\nload_timeout_ms = 0\n").field, "gateway.agents.load_timeout_ms");
    assert_eq!(err("[gateway.agents]\nbogus = 1\n").field, "gateway.agents.bogus");
    let e = err("[gateway.agents]\npool_policy = \"fastest\"\n");
    assert_eq!(e.field, "gateway.agents.pool_policy");
    assert!(e.message.contains("kv_aware"), "{}", e.message);
    assert_eq!(
        err("[gateway.agents]\npool_policy = { policy = \"kv_aware\", load_penalty = -1.0 }\n").field,
        "gateway.agents.pool_policy.load_penalty"
    );
    // Placement and prefetch.
    let d = GatewayConfig::from_toml("").unwrap().gateway.agents;
    assert_eq!((d.placement, d.prefetch, d.prefetch_max), (Placement::Locality, false, 2));
    let c = GatewayConfig::from_toml(
        "[gateway.agents]\nplacement = \"fewest_engines\"\nprefetch = true\nprefetch_max = 5\n",
    )
    .unwrap()
    .gateway
    .agents;
    assert_eq!((c.placement, c.prefetch, c.prefetch_max), (Placement::FewestEngines, true, 5));
    let e = err("[gateway.agents]\nplacement = \"nearest\"\n");
    assert_eq!(e.field, "gateway.agents.placement");
    assert!(e.message.contains("fewest_engines"), "{}", e.message);
    assert_eq!(err("[gateway.agents]\nprefetch = \"yes\"\n").field, "gateway.agents.prefetch");
}

/// Issue 40, point 4: the audit spool was off unless a directory was
/// named, so a database outage dropped billing records by default. It is on
/// by default, beside a SQLite file or in the working directory.
#[test]
fn the_audit_spool_is_on_by_default_beside_the_database() {
    let spool = |toml: &str| GatewayConfig::from_toml(toml).map(|c| c.gateway.spool_dir());
    let with = |db: &str| spool(&format!("[gateway]\ndatabase = {db:?}\n")).unwrap();
    assert_eq!(spool("").unwrap(), Some(PathBuf::from("gateway.db.audit-spool")));
    assert_eq!(with("sqlite:///var/lib/g/ids.db?mode=rwc"), Some(PathBuf::from("/var/lib/g/ids.db.audit-spool")));
    assert_eq!(with("sqlite:rel/ids.db"), Some(PathBuf::from("rel/ids.db.audit-spool")));
    assert_eq!(with("postgres://u:p@db/granary"), Some(PathBuf::from("audit-spool")));
    assert_eq!(with("sqlite::memory:"), None, "a database in memory keeps nothing to replay");
    assert_eq!(with("sqlite://x?mode=memory&cache=shared"), None);
    let named = "[gateway]\ndatabase = \"sqlite::memory:\"\naudit_spool_dir = \"/s\"\n";
    assert_eq!(spool(named).unwrap(), Some(PathBuf::from("/s")));
    assert_eq!(spool("[gateway]\naudit_spool = false\n").unwrap(), None);
    let both = spool("[gateway]\naudit_spool = false\naudit_spool_dir = \"/s\"\n").unwrap_err().to_string();
    assert!(both.contains("gateway.audit_spool_dir"), "{both}");
    // The identity store gets it.
    let c = GatewayConfig::from_toml("").unwrap();
    assert_eq!(c.gateway.identity_options().audit_spool_dir, Some(PathBuf::from("gateway.db.audit-spool")));
}
