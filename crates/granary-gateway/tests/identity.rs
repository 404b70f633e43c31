//! The identity store against a real PostgreSQL server: the one started by
//! `scripts/pg-test-server.sh`, or the one `GRANARY_TEST_POSTGRES_URL` names.
//! Without PostgreSQL the test is skipped with a notice, unless
//! `GRANARY_REQUIRE_EXTERNAL=1`, which makes it fail.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use axum::body::Body;
use axum::http::{header, Method, Request, StatusCode};
use granary_gateway::identity::{
    admin_router, usage_csv, AdminError, AdminToken, AuditQuery, AuditRecord, AuthError, Identity, IdentityOptions,
    KeyUpdate, NewKey, NewTenant, TenantUpdate, UsageQuery, UsageRow,
};
use granary_gateway::{Limits, Priority};
use tower::ServiceExt as _;

fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/pg-test-server.sh")
}

fn postgres_installed() -> bool {
    if std::env::var_os("PG_BIN").is_some() {
        return true;
    }
    std::fs::read_dir("/usr/lib/postgresql")
        .map(|dirs| dirs.flatten().any(|d| d.path().join("bin/initdb").exists()))
        .unwrap_or(false)
}

/// A server started for this test; stopped (and its files removed) on drop.
struct Server {
    url: String,
    dir: Option<String>,
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(dir) = &self.dir {
            let _ = Command::new("bash").arg(script()).arg("stop").arg(dir).status();
        }
    }
}

/// The server to test against, or `None` (after a notice) to skip.
fn server() -> Option<Server> {
    if let Ok(url) = std::env::var("GRANARY_TEST_POSTGRES_URL") {
        return Some(Server { url, dir: None });
    }
    let required = std::env::var("GRANARY_REQUIRE_EXTERNAL").is_ok_and(|v| v == "1");
    if !postgres_installed() {
        assert!(!required, "GRANARY_REQUIRE_EXTERNAL=1 but PostgreSQL is not installed");
        eprintln!(
            "SKIPPED: PostgreSQL is not installed (no /usr/lib/postgresql/*/bin/initdb); set GRANARY_TEST_POSTGRES_URL"
        );
        return None;
    }
    let out = Command::new("bash").arg(script()).arg("start").output().expect("running pg-test-server.sh");
    assert!(out.status.success(), "pg-test-server.sh start failed: {}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8(out.stdout).expect("utf-8 output");
    let mut lines = stdout.lines();
    let url = lines.next().expect("a URL line").to_string();
    let dir = lines.next().expect("a directory line").to_string();
    Some(Server { url, dir: Some(dir) })
}

fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as i64
}

fn rec(tenant: &str, model: &str, status: u16, prompt: u64, completion: u64, time_ms: i64) -> AuditRecord {
    AuditRecord {
        time_ms,
        request_id: format!("{tenant}-{time_ms}"),
        tenant: Some(tenant.to_string()),
        tenant_id: Some(1),
        key_id: None,
        endpoint: "/v1/completions".into(),
        model: Some(model.to_string()),
        upstream: None,
        status,
        error_code: None,
        stream: false,
        prompt_tokens: prompt,
        completion_tokens: completion,
        cached_tokens: prompt / 2,
        latency_ms: 7.5,
        ttft_ms: None,
        prompt: Some("hello".into()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn identity_on_postgresql() {
    let Some(server) = server() else { return };
    let opts =
        IdentityOptions { key_cache: Duration::from_millis(1000), audit_queue: 1024, ..IdentityOptions::default() };
    let id = Identity::open(&server.url, opts.clone()).await.expect("open on PostgreSQL");
    assert_eq!(id.backend(), "postgres");
    // A second process on the same database: migrations are already applied.
    let other = Identity::open(&server.url, opts).await.expect("open again");

    // Names unique per run, so a shared server given by URL can be reused.
    let run = format!("{:x}", now_ms());
    let acme = format!("acme-{run}");
    let beta = format!("beta-{run}");

    // Tenants.
    let t = id
        .create_tenant(NewTenant {
            name: acme.clone(),
            priority: Some(Priority::Premium),
            limits: Some(Limits { tokens_per_minute: Some(1000), ..Default::default() }),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(t.namespace, acme);
    assert!(matches!(
        id.create_tenant(NewTenant { name: acme.clone(), ..Default::default() }).await,
        Err(AdminError::Conflict(_))
    ));
    id.create_tenant(NewTenant { name: beta.clone(), ..Default::default() }).await.unwrap();
    let listed = id.list_tenants().await.unwrap();
    assert!(listed.iter().any(|t| t.name == beta));
    let updated = id
        .update_tenant(
            &beta,
            TenantUpdate { log_prompts: Some(true), priority: Some(Priority::Batch), ..Default::default() },
        )
        .await
        .unwrap();
    assert!(updated.log_prompts);
    assert_eq!(updated.priority, Priority::Batch);

    // Keys and authentication.
    let k = id
        .create_key(NewKey {
            tenant: acme.clone(),
            name: Some("ci".into()),
            models: Some(vec!["llama".into()]),
            ..Default::default()
        })
        .await
        .unwrap();
    let p = id.authenticate(&format!("Bearer {}", k.secret)).await.unwrap();
    assert_eq!(p.tenant, acme);
    assert_eq!(p.priority, Priority::Premium);
    assert_eq!(p.tenant_limits.tokens_per_minute, Some(1000));
    assert_eq!(p.models, Some(vec!["llama".to_string()]));
    let keys = id.list_keys(Some(&acme)).await.unwrap();
    assert_eq!(keys.len(), 1);
    assert_eq!(keys[0].prefix, k.info.prefix);

    let (unknown, _) = granary_gateway::identity::keys::generate();
    assert_eq!(id.authenticate(&unknown).await.unwrap_err(), AuthError::Unknown);

    // Revocation by another process: cached here until the cache time ends.
    other.authenticate(&k.secret).await.unwrap();
    id.revoke_key(k.info.id).await.unwrap();
    assert!(matches!(id.authenticate(&k.secret).await, Err(AuthError::Revoked { .. })));
    other.authenticate(&k.secret).await.expect("still cached in the other process");
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let e = other.authenticate(&k.secret).await.unwrap_err().to_api_error();
    assert_eq!((e.status, e.code), (StatusCode::UNAUTHORIZED, Some("invalid_api_key")));

    let expiring = id
        .create_key(NewKey { tenant: beta.clone(), expires_ms: Some(now_ms() + 1000), ..Default::default() })
        .await
        .unwrap();
    id.authenticate(&expiring.secret).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert_eq!(id.authenticate(&expiring.secret).await.unwrap_err().to_api_error().code, Some("expired_api_key"));

    // Rotation (the old secret works for its grace period) and update, on
    // PostgreSQL (issue 14, point 5).
    let r = id.create_key(NewKey { tenant: beta.clone(), ..Default::default() }).await.unwrap();
    let rotated = id.rotate_key(r.info.id, Duration::from_millis(800)).await.unwrap();
    assert_ne!(rotated.secret, r.secret);
    id.authenticate(&rotated.secret).await.unwrap();
    id.authenticate(&r.secret).await.expect("the old secret, within the grace period");
    tokio::time::sleep(Duration::from_millis(900)).await;
    assert_eq!(id.authenticate(&r.secret).await.unwrap_err().to_api_error().code, Some("expired_api_key"));
    let u = KeyUpdate {
        models: Some(Some(vec!["m".into()])),
        expires_ms: Some(Some(now_ms() + 60_000)),
        ..Default::default()
    };
    let info = id.update_key(r.info.id, u).await.unwrap();
    assert_eq!(info.models, Some(vec!["m".to_string()]));
    assert_eq!(id.authenticate(&rotated.secret).await.unwrap().models, Some(vec!["m".to_string()]));

    let b = id.create_key(NewKey { tenant: beta.clone(), ..Default::default() }).await.unwrap();
    id.update_tenant(&beta, TenantUpdate { disabled: Some(true), ..Default::default() }).await.unwrap();
    let e = id.authenticate(&b.secret).await.unwrap_err().to_api_error();
    assert_eq!((e.status, e.code), (StatusCode::FORBIDDEN, Some("tenant_disabled")));
    id.update_tenant(&beta, TenantUpdate { disabled: Some(false), ..Default::default() }).await.unwrap();
    id.authenticate(&b.secret).await.unwrap();

    // Audit and usage.
    let t0 = now_ms() - 60_000;
    let recs = [
        rec(&acme, "llama", 200, 10, 4, t0),
        rec(&acme, "llama", 429, 0, 0, t0 + 1),
        rec(&acme, "qwen", 200, 6, 6, t0 + 2),
        rec(&beta, "llama", 200, 2, 1, t0 + 3),
        rec(&beta, "llama", 500, 2, 0, t0 + 4),
    ];
    for r in &recs {
        id.record(r.clone());
    }
    id.flush().await;
    assert_eq!(id.audit_dropped(), 0);
    let row = |tenant: &str, model: &str, requests, errors, prompt, completion, cached| UsageRow {
        tenant: tenant.into(),
        model: model.into(),
        requests,
        errors,
        prompt_tokens: prompt,
        completion_tokens: completion,
        cached_tokens: cached,
    };
    let usage = id.usage(&UsageQuery { from_ms: t0, to_ms: t0 + 5, tenant: None }).await.unwrap();
    let ours: Vec<UsageRow> = usage.into_iter().filter(|r| r.tenant == acme || r.tenant == beta).collect();
    assert_eq!(
        ours,
        vec![
            row(&acme, "llama", 2, 1, 10, 4, 5),
            row(&acme, "qwen", 1, 0, 6, 6, 3),
            row(&beta, "llama", 2, 1, 4, 1, 2)
        ]
    );
    let only_beta = id.usage(&UsageQuery { from_ms: t0, to_ms: t0 + 4, tenant: Some(beta.clone()) }).await.unwrap();
    assert_eq!(only_beta, vec![row(&beta, "llama", 1, 0, 2, 1, 1)]);
    assert_eq!(usage_csv(&only_beta).lines().nth(1), Some(format!("{beta},llama,1,0,2,1,1").as_str()));

    let newest = id.audit(&AuditQuery { tenant: Some(acme.clone()), limit: 2, since_ms: Some(t0) }).await.unwrap();
    assert_eq!(newest, vec![recs[2].clone(), recs[1].clone()]);

    // The admin API on PostgreSQL.
    let router = admin_router(id.clone(), AdminToken::new("pg-admin"));
    let call = |method: Method, uri: String, body: Option<String>| {
        let router = router.clone();
        async move {
            let mut req = Request::builder().method(method).uri(uri).header(header::AUTHORIZATION, "Bearer pg-admin");
            if body.is_some() {
                req = req.header(header::CONTENT_TYPE, "application/json");
            }
            let resp =
                router.oneshot(req.body(body.map(Body::from).unwrap_or_else(Body::empty)).unwrap()).await.unwrap();
            let status = resp.status();
            let bytes = axum::body::to_bytes(resp.into_body(), 1 << 20).await.unwrap();
            (status, serde_json::from_slice::<serde_json::Value>(&bytes).unwrap_or_default())
        }
    };
    let gamma = format!("gamma-{run}");
    let (status, _) = call(Method::POST, "/admin/v1/tenants".into(), Some(format!(r#"{{"name":"{gamma}"}}"#))).await;
    assert_eq!(status, StatusCode::CREATED);
    let (status, _) = call(Method::POST, "/admin/v1/tenants".into(), Some(format!(r#"{{"name":"{gamma}"}}"#))).await;
    assert_eq!(status, StatusCode::CONFLICT);
    let (status, created) =
        call(Method::POST, "/admin/v1/keys".into(), Some(format!(r#"{{"tenant":"{gamma}","expires_in_s":60}}"#))).await;
    assert_eq!(status, StatusCode::CREATED, "{created}");
    let secret = created["key"].as_str().expect("the secret").to_string();
    assert_eq!(id.authenticate(&secret).await.unwrap().tenant, gamma);
    let (status, disabled) = call(Method::DELETE, format!("/admin/v1/tenants/{gamma}"), None).await;
    assert_eq!((status, disabled["disabled"].as_bool()), (StatusCode::OK, Some(true)));
    assert!(matches!(id.authenticate(&secret).await, Err(AuthError::Revoked { .. })));
    let (status, usage) =
        call(Method::GET, format!("/admin/v1/usage?tenant={acme}&from={}&to={}", t0 / 1000, t0 / 1000 + 60), None)
            .await;
    assert_eq!(status, StatusCode::OK, "{usage}");
    assert_eq!(usage["data"].as_array().map(Vec::len), Some(2), "{usage}");

    drop(server);
}

/// `pg_ctl` on the test server in `dir` (as the user that owns it).
fn pg_ctl(dir: &str, args: &[&str]) -> bool {
    let bin = match std::env::var("PG_BIN") {
        Ok(b) => PathBuf::from(b),
        Err(_) => {
            let mut dirs: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
                .unwrap()
                .flatten()
                .map(|d| d.path().join("bin"))
                .filter(|b| b.join("pg_ctl").exists())
                .collect();
            dirs.sort();
            dirs.pop().expect("a PostgreSQL bin directory")
        }
    };
    let pg_ctl = bin.join("pg_ctl");
    let root = Command::new("id").arg("-u").output().map(|o| o.stdout.starts_with(b"0")).unwrap_or(false);
    let mut cmd = if root {
        let owner = std::fs::read_to_string(format!("{dir}/owner")).unwrap();
        let mut c = Command::new("runuser");
        c.args(["-u", owner.trim(), "--"]).arg(&pg_ctl);
        c
    } else {
        Command::new(&pg_ctl)
    };
    cmd.arg("-D").arg(format!("{dir}/data")).args(args);
    cmd.stdout(std::process::Stdio::null()).stderr(std::process::Stdio::null()).status().unwrap().success()
}

/// Issue 14, point 2: PostgreSQL stopped for a few seconds under load and
/// started again: audit batches are retried, spooled to disk meanwhile and
/// replayed, so every record arrives and none is dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue_14_postgresql_stopped_under_load_loses_no_audit_record() {
    let Some(server) = server() else { return };
    let Some(dir) = server.dir.clone() else {
        eprintln!("SKIPPED: a server given by GRANARY_TEST_POSTGRES_URL cannot be stopped by the test");
        return;
    };
    let port = std::fs::read_to_string(format!("{dir}/port")).unwrap().trim().to_string();
    let spool = tempfile::tempdir().unwrap();
    let opts = IdentityOptions {
        audit_spool_dir: Some(spool.path().to_path_buf()),
        audit_write_timeout: Duration::from_millis(500),
        ..IdentityOptions::default()
    };
    let id = Identity::open(&server.url, opts).await.expect("open on PostgreSQL");
    let tenant = format!("outage-{:x}", now_ms());
    let t0 = now_ms();
    const TOTAL: i64 = 3_000;
    let loader = {
        let (id, tenant) = (id.clone(), tenant.clone());
        tokio::spawn(async move {
            for i in 0..TOTAL {
                id.record(rec(&tenant, "llama", 200, 3, 4, t0 + i));
                if i % 20 == 0 {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(pg_ctl(&dir, &["-m", "fast", "-w", "stop"]), "pg_ctl stop");
    let stopped = std::time::Instant::now();
    while id.audit_spooled() == 0 {
        assert!(stopped.elapsed() < Duration::from_secs(30), "nothing was spooled while PostgreSQL was down");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let options = format!(
        "-c listen_addresses=127.0.0.1 -p {port} -k {dir} -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
    );
    assert!(
        pg_ctl(&dir, &["-l", &format!("{dir}/server.log"), "-w", "-t", "30", "-o", &options, "start"]),
        "pg_ctl start"
    );
    let down_for = stopped.elapsed();
    loader.await.unwrap();
    let q = UsageQuery { from_ms: t0, to_ms: t0 + TOTAL, tenant: Some(tenant.clone()) };
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        id.flush().await;
        let requests = id.usage(&q).await.ok().and_then(|rows| rows.first().map(|r| r.requests)).unwrap_or(0);
        if requests == TOTAL as u64 && id.audit_spooled() == 0 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{requests} of {TOTAL} records arrived; {} spooled, {} dropped",
            id.audit_spooled(),
            id.audit_dropped()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(id.audit_dropped(), 0);
    assert!(id.audit_write_errors() > 0, "the outage was seen");
    let rows = id.usage(&q).await.unwrap();
    assert_eq!((rows[0].prompt_tokens, rows[0].completion_tokens), (3 * TOTAL as u64, 4 * TOTAL as u64));
    // The daily rollup, written with the batches, agrees.
    let usage = id.budget_usage(t0, &granary_gateway::pricing::Prices::default()).await.unwrap();
    let tokens: u64 = usage.iter().filter(|u| u.tenant_id == 1).map(|u| u.tokens).sum();
    assert!(tokens >= 7 * TOTAL as u64, "{tokens}");
    eprintln!("PostgreSQL was down for {:.1} s; {TOTAL} of {TOTAL} audit records arrived", down_for.as_secs_f64());
}

/// Issue 40, point 4: a commit that reaches PostgreSQL after the writer's
/// timeout has fired (the writer retries a batch the database has in fact
/// taken) adds no audit row and no usage twice. Each transaction that
/// inserts audit rows is held at COMMIT for 1.5 s by a deferred trigger,
/// three times the writer's 500 ms timeout; the retries' inserts find the
/// rows there (or wait for the first transaction and then find them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_delayed_past_the_write_timeout_adds_no_duplicate_rows() {
    let Some(server) = server() else { return };
    let spool = tempfile::tempdir().unwrap();
    let opts = IdentityOptions {
        audit_spool_dir: Some(spool.path().to_path_buf()),
        audit_write_timeout: Duration::from_millis(500),
        ..IdentityOptions::default()
    };
    let id = Identity::open(&server.url, opts).await.expect("open on PostgreSQL");
    let pg = sqlx::postgres::PgPool::connect(&server.url).await.unwrap();
    // Once per transaction, at its commit: the sleep runs after the rows
    // are in, before the commit completes.
    for sql in [
        "CREATE OR REPLACE FUNCTION granary_test_slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$ \
         BEGIN \
           IF current_setting('granary_test.slept', true) IS DISTINCT FROM txid_current()::text THEN \
             PERFORM set_config('granary_test.slept', txid_current()::text, true); \
             PERFORM pg_sleep(1.5); \
           END IF; \
           RETURN NULL; \
         END $$",
        "DROP TRIGGER IF EXISTS granary_test_slow_commit ON audit_log",
        "CREATE CONSTRAINT TRIGGER granary_test_slow_commit AFTER INSERT ON audit_log \
         DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION granary_test_slow_commit()",
    ] {
        sqlx::query(sql).execute(&pg).await.unwrap();
    }
    let tenant = format!("slowcommit-{:x}", now_ms());
    let t0 = now_ms();
    const TOTAL: i64 = 300;
    for i in 0..TOTAL {
        // The model is named after the test too, for the usage_daily rows.
        id.record(rec(&tenant, &tenant, 200, 3, 4, t0 + i));
        if i % 100 == 99 {
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    }
    let q = UsageQuery { from_ms: t0, to_ms: t0 + TOTAL, tenant: Some(tenant.clone()) };
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let rows = loop {
        id.flush().await;
        let rows: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM audit_log WHERE tenant = $1")
            .bind(&tenant)
            .fetch_one(&pg)
            .await
            .unwrap();
        if rows >= TOTAL && id.audit_spooled() == 0 {
            break rows;
        }
        assert!(std::time::Instant::now() < deadline, "{rows} of {TOTAL} rows arrived; {} spooled", id.audit_spooled());
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    sqlx::query("DROP TRIGGER granary_test_slow_commit ON audit_log").execute(&pg).await.unwrap();
    assert!(id.audit_write_errors() > 0, "no write outlived the timeout: the test did not test anything");
    assert_eq!(rows, TOTAL, "audit rows for {TOTAL} requests");
    let usage = id.usage(&q).await.unwrap();
    assert_eq!(
        (usage[0].requests, usage[0].prompt_tokens, usage[0].completion_tokens),
        (TOTAL as u64, 3 * TOTAL as u64, 4 * TOTAL as u64),
        "usage counted once"
    );
    let daily: i64 =
        sqlx::query_scalar("SELECT CAST(COALESCE(SUM(requests), 0) AS BIGINT) FROM usage_daily WHERE model = $1")
            .bind(&tenant)
            .fetch_one(&pg)
            .await
            .unwrap();
    assert_eq!(daily, TOTAL, "the daily rollup budgets are restored from counts each request once");
    eprintln!(
        "{TOTAL} records, {} writes timed out and were retried: {rows} audit rows, {daily} requests in usage_daily",
        id.audit_write_errors()
    );
}

const CHILD: &str = "GRANARY_TEST_AUDIT_WRITER_CHILD";

/// Not a test of its own: the process that `kill -9` hits in
/// `a_kill_9_during_slow_commits_loses_at_most_the_last_flush_intervals`.
/// It records an audit record every 2 ms (its id carries the time it was
/// handed over) and appends each id to a file once `record` returned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "run by the kill -9 test as its child process"]
async fn child_audit_writer() {
    use std::io::Write;
    let Some(spec) = std::env::var(CHILD).ok() else { return };
    let v: serde_json::Value = serde_json::from_str(&spec).unwrap();
    let opts = IdentityOptions {
        audit_spool_dir: Some(PathBuf::from(v["spool"].as_str().unwrap())),
        ..IdentityOptions::default()
    };
    let id = Identity::open(v["url"].as_str().unwrap(), opts).await.unwrap();
    let mut progress =
        std::fs::File::options().append(true).create(true).open(v["progress"].as_str().unwrap()).unwrap();
    let tenant = v["tenant"].as_str().unwrap().to_string();
    for i in 0.. {
        let t = now_ms();
        let mut r = rec(&tenant, "llama", 200, 3, 4, t);
        r.request_id = format!("{tenant}-{i}-{t}");
        id.record(r.clone());
        progress.write_all(format!("{}\n", r.request_id).as_bytes()).unwrap();
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Issue 40, point 4: with every write taking 3 s, the writer used to sit
/// in the write while records queued behind it in memory, so a `kill -9`
/// lost the batch being written and everything handed over since (seconds
/// of traffic). Now what arrives during a write is spilled to the spool
/// every 100 ms, and a write still running after 100 ms has its batch
/// spilled too: after the kill, a restart replays the spool, and every
/// record handed over more than a few flush intervals before the kill is
/// in the database.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_9_during_slow_commits_loses_at_most_the_last_flush_intervals() {
    let Some(server) = server() else { return };
    let dir = tempfile::tempdir().unwrap();
    let spool = dir.path().join("spool");
    let progress = dir.path().join("progress");
    // Migrated first, so that the trigger has its table.
    drop(Identity::open(&server.url, IdentityOptions::default()).await.unwrap());
    let pg = sqlx::postgres::PgPool::connect(&server.url).await.unwrap();
    // Each transaction's first INSERT into audit_log sleeps 3 s: a client
    // killed meanwhile never sends COMMIT, so what it was writing is lost
    // unless it is somewhere else too.
    for sql in [
        "CREATE OR REPLACE FUNCTION granary_test_slow_insert() RETURNS trigger LANGUAGE plpgsql AS $$ \
         BEGIN \
           IF current_setting('granary_test.slept', true) IS DISTINCT FROM txid_current()::text THEN \
             PERFORM set_config('granary_test.slept', txid_current()::text, true); \
             PERFORM pg_sleep(3); \
           END IF; \
           RETURN NULL; \
         END $$",
        "DROP TRIGGER IF EXISTS granary_test_slow_insert ON audit_log",
        "CREATE TRIGGER granary_test_slow_insert BEFORE INSERT ON audit_log \
         FOR EACH STATEMENT EXECUTE FUNCTION granary_test_slow_insert()",
    ] {
        sqlx::query(sql).execute(&pg).await.unwrap();
    }
    let tenant = format!("k9-{:x}", now_ms());
    let spec = serde_json::json!({"url": server.url, "spool": spool, "progress": progress, "tenant": tenant});
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["child_audit_writer", "--exact", "--ignored", "--nocapture"])
        .env(CHILD, spec.to_string())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let t0 = std::time::Instant::now();
    while std::fs::metadata(&progress).map_or(0, |m| m.len()) == 0 {
        assert!(t0.elapsed() < Duration::from_secs(30), "the child never recorded");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Killed once a write has been sleeping for more than a second (and
    // at least two seconds of records were handed over): by then the batch
    // being written, and a second of records behind it, are at stake.
    let t1 = std::time::Instant::now();
    loop {
        let sleeping: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM pg_stat_activity WHERE wait_event = 'PgSleep' \
             AND now() - query_start > interval '1 second'",
        )
        .fetch_one(&pg)
        .await
        .unwrap();
        if sleeping > 0 && t1.elapsed() > Duration::from_secs(2) {
            break;
        }
        assert!(t1.elapsed() < Duration::from_secs(30), "no write ever slept");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    child.kill().unwrap(); // SIGKILL
    let killed = now_ms();
    child.wait().unwrap();
    sqlx::query("DROP TRIGGER granary_test_slow_insert ON audit_log").execute(&pg).await.unwrap();
    let files = std::fs::read_dir(&spool).map_or(0, |d| d.count());
    eprintln!("spool files at the kill: {files}");

    // A restart on the same spool replays it.
    let opts = IdentityOptions { audit_spool_dir: Some(spool.clone()), ..IdentityOptions::default() };
    let id = Identity::open(&server.url, opts).await.unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        // The first flush is answered after the writer's start-up replay.
        id.flush().await;
        if id.audit_spooled() == 0 {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the spool was not replayed: {} left", id.audit_spooled());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let kept: std::collections::HashSet<String> =
        sqlx::query_scalar("SELECT request_id FROM audit_log WHERE tenant = $1")
            .bind(&tenant)
            .fetch_all(&pg)
            .await
            .unwrap()
            .into_iter()
            .collect();
    let handed: Vec<String> = std::fs::read_to_string(&progress).unwrap().lines().map(str::to_string).collect();
    assert!(handed.len() > 500, "too little traffic to tell: {}", handed.len());
    let age = |id: &str| killed - id.rsplit('-').next().unwrap().parse::<i64>().unwrap();
    let lost: Vec<i64> = handed.iter().filter(|id| !kept.contains(*id)).map(|id| age(id)).collect();
    // Two flush intervals (the batch being written for less than one, and
    // what arrived since the last spill), and 400 ms for a fsync and the
    // scheduling of a loaded two-core machine.
    let window = 2 * 100 + 400;
    assert!(
        lost.iter().all(|&ms| ms <= window),
        "records handed over long before the kill were lost: {} of {}, the oldest {} ms before it",
        lost.len(),
        handed.len(),
        lost.iter().max().unwrap()
    );
    eprintln!(
        "handed over {}, in the database after the restart {}, lost {} (the oldest {} ms before the kill)",
        handed.len(),
        kept.len(),
        lost.len(),
        lost.iter().max().copied().unwrap_or(0)
    );
}
