//! Audit records, usage rollups and reports, and the spool that keeps
//! records through a database outage.

use super::http::call;
use super::*;

#[tokio::test]
async fn audit_records_are_written_on_flush_and_aggregated_into_usage() {
    let id = mem().await;
    let t0 = 1_700_000_000_000;
    let recs = [
        rec("acme", "llama", 200, 10, 5, 2, t0),
        rec("acme", "llama", 200, 20, 7, 0, t0 + 1),
        rec("acme", "llama", 429, 0, 0, 0, t0 + 2),
        rec("acme", "qwen", 200, 3, 4, 1, t0 + 3),
        rec("beta", "llama", 500, 8, 0, 0, t0 + 4),
        rec("beta", "llama", 200, 1, 1, 1, t0 + 5),
        // Outside [t0, t0 + 10).
        rec("acme", "llama", 200, 1000, 1000, 0, t0 + 10),
        rec("acme", "llama", 200, 1000, 1000, 0, t0 - 1),
    ];
    for r in &recs {
        id.record(r.clone());
    }
    id.flush().await;
    assert_eq!(id.audit_dropped(), 0);

    let rows = id.usage(&UsageQuery { from_ms: t0, to_ms: t0 + 10, tenant: None }).await.unwrap();
    let row = |tenant: &str, model: &str, requests, errors, prompt, completion, cached| UsageRow {
        tenant: tenant.into(),
        model: model.into(),
        requests,
        errors,
        prompt_tokens: prompt,
        completion_tokens: completion,
        cached_tokens: cached,
    };
    assert_eq!(
        rows,
        vec![
            row("acme", "llama", 3, 1, 30, 12, 2),
            row("acme", "qwen", 1, 0, 3, 4, 1),
            row("beta", "llama", 2, 1, 9, 1, 1)
        ]
    );
    let beta = id.usage(&UsageQuery { from_ms: t0, to_ms: t0 + 10, tenant: Some("beta".into()) }).await.unwrap();
    assert_eq!(beta, vec![row("beta", "llama", 2, 1, 9, 1, 1)]);
    assert!(id.usage(&UsageQuery { from_ms: t0, to_ms: t0, tenant: None }).await.is_err());

    // The records read back whole, newest first.
    let listed = id.audit(&AuditQuery { limit: 3, ..Default::default() }).await.unwrap();
    assert_eq!(listed.len(), 3);
    assert_eq!(listed[0], recs[6]);
    assert_eq!(listed[1], recs[5]);
    let since = id.audit(&AuditQuery { tenant: Some("beta".into()), limit: 10, since_ms: Some(t0 + 5) }).await.unwrap();
    assert_eq!(since, vec![recs[5].clone()]);
    assert!(id.audit(&AuditQuery { limit: 0, ..Default::default() }).await.is_err());
}

#[tokio::test]
async fn a_full_audit_queue_drops_and_counts_instead_of_waiting() {
    let id = Identity::open(
        "sqlite::memory:",
        IdentityOptions { key_cache: Duration::from_secs(2), audit_queue: 4, ..IdentityOptions::default() },
    )
    .await
    .unwrap();
    // Hold the only connection so the writer cannot drain the queue.
    let conn = id.pool().acquire().await.unwrap();
    let started = std::time::Instant::now();
    for i in 0..20 {
        id.record(rec("acme", "llama", 200, 1, 1, 0, i));
    }
    assert!(started.elapsed() < Duration::from_millis(500), "record() must not wait");
    let dropped = id.audit_dropped();
    // The queue holds 4, the writer at most one batch in hand.
    assert!(dropped >= 20 - 4 - 4 - 1, "dropped {dropped}");
    drop(conn);
    id.flush().await;
    let n: i64 = sqlx::query("SELECT COUNT(*) FROM audit_log").fetch_one(id.pool()).await.unwrap().try_get(0).unwrap();
    assert_eq!(n as u64 + dropped, 20);
}

#[test]
fn usage_csv_has_a_header_and_quotes_when_needed() {
    let rows = vec![
        UsageRow { tenant: "acme".into(), model: "llama".into(), requests: 3, errors: 1, ..Default::default() },
        UsageRow { tenant: "b".into(), model: "odd,\"name\"".into(), prompt_tokens: 7, ..Default::default() },
    ];
    assert_eq!(
        usage_csv(&rows),
        "tenant,model,requests,errors,prompt_tokens,completion_tokens,cached_tokens\n\
         acme,llama,3,1,0,0,0\n\
         b,\"odd,\"\"name\"\"\",0,0,7,0,0\n"
    );
}

/// Issue 14, point 2: usage reports with cost, and cells that start like a
/// formula (model names come from clients) made inert.
#[test]
fn usage_csv_prices_rows_and_neutralises_formulas() {
    let mut prices = crate::pricing::Prices::default();
    prices.models.insert(
        "llama".into(),
        crate::pricing::ModelPrice { input_per_million: 1.0, cached_input_per_million: None, output_per_million: 2.0 },
    );
    let rows = vec![
        UsageRow {
            tenant: "acme".into(),
            model: "llama".into(),
            prompt_tokens: 1_000,
            completion_tokens: 500,
            ..Default::default()
        },
        UsageRow { tenant: "acme".into(), model: "=HYPERLINK(\"http://x\")".into(), requests: 1, ..Default::default() },
        UsageRow { tenant: "acme".into(), model: "+1".into(), ..Default::default() },
        UsageRow { tenant: "acme".into(), model: "@sum".into(), ..Default::default() },
        UsageRow { tenant: "acme".into(), model: "-2".into(), ..Default::default() },
    ];
    let csv = usage_csv_priced(&rows, Some(&prices));
    let lines: Vec<&str> = csv.lines().collect();
    assert_eq!(lines[0], "tenant,model,requests,errors,prompt_tokens,completion_tokens,cached_tokens,cost,currency");
    assert_eq!(lines[1], "acme,llama,0,0,1000,500,0,0.002000,USD");
    assert_eq!(lines[2], "acme,\"'=HYPERLINK(\"\"http://x\"\")\",1,0,0,0,0,,USD", "no price: an empty cost");
    assert_eq!(&lines[3..], ["acme,'+1,0,0,0,0,0,,USD", "acme,'@sum,0,0,0,0,0,,USD", "acme,'-2,0,0,0,0,0,,USD"]);
}

/// Issue 40, point 4: a batch written again (its commit reached the
/// database, the answer did not, the writer retried; or a spool replayed
/// after a crash) adds no audit row and no usage twice. Before, it added
/// both again: `request_id` had no unique constraint.
#[tokio::test]
async fn an_audit_batch_written_twice_is_counted_once() {
    let id = mem().await;
    let t0 = 1_700_000_000_000;
    let batch = vec![rec("acme", "llama", 200, 10, 5, 2, t0), rec("acme", "llama", 200, 20, 7, 0, t0 + 1)];
    super::super::audit::write_batch(id.pool(), &batch).await.unwrap();
    // A retry of the whole batch, and one with a new record beside the old.
    super::super::audit::write_batch(id.pool(), &batch).await.unwrap();
    let mut more = batch.clone();
    more.push(rec("acme", "llama", 200, 1, 1, 0, t0 + 2));
    super::super::audit::write_batch(id.pool(), &more).await.unwrap();
    assert_eq!(audit_count(&id).await, 3);
    let rows = id.usage(&UsageQuery { from_ms: t0, to_ms: t0 + 10, tenant: None }).await.unwrap();
    assert_eq!(rows.len(), 1, "{rows:?}");
    let r = &rows[0];
    assert_eq!((r.requests, r.prompt_tokens, r.completion_tokens, r.cached_tokens), (3, 31, 13, 2), "{r:?}");
    // The rollup that budgets are restored from counts each request once.
    let rollup = sqlx::query(
        "SELECT CAST(SUM(requests) AS BIGINT), CAST(SUM(prompt_tokens) AS BIGINT), \
         CAST(SUM(completion_tokens) AS BIGINT) FROM usage_daily",
    )
    .fetch_one(id.pool())
    .await
    .unwrap();
    let sums: Vec<i64> = (0..3).map(|i| rollup.get::<i64, _>(i)).collect();
    assert_eq!(sums, [3, 31, 13]);
}

async fn audit_count(id: &Identity) -> i64 {
    sqlx::query("SELECT COUNT(*) FROM audit_log").fetch_one(id.pool()).await.map(|r| r.get::<i64, _>(0)).unwrap_or(-1)
}

async fn spooling(dir: &std::path::Path) -> Identity {
    let opts = IdentityOptions {
        audit_spool_dir: Some(dir.join("spool")),
        audit_write_timeout: Duration::from_millis(500),
        ..IdentityOptions::default()
    };
    Identity::open(&format!("sqlite://{}", dir.join("g.db").display()), opts).await.unwrap()
}

/// Issue 14, point 2: while the database refuses audit writes (here its
/// `audit_log` table is renamed away) under load, batches are retried and
/// spooled to disk; when it takes writes again every record arrives, once,
/// and the daily rollup counts them all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue_14_audit_records_survive_a_database_outage_under_load() {
    let dir = tempfile::tempdir().unwrap();
    let id = spooling(dir.path()).await;
    const TOTAL: i64 = 3_000;
    let loader = {
        let id = id.clone();
        tokio::spawn(async move {
            for i in 0..TOTAL {
                id.record(rec("acme", "llama", 200, 3, 4, 0, 1_741_964_966_500 + i));
                if i % 20 == 0 {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    sqlx::query("ALTER TABLE audit_log RENAME TO audit_log_away").execute(id.pool()).await.unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while id.audit_spooled() == 0 {
        assert!(std::time::Instant::now() < deadline, "nothing was spooled");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(800)).await;
    sqlx::query("ALTER TABLE audit_log_away RENAME TO audit_log").execute(id.pool()).await.unwrap();
    loader.await.unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        id.flush().await;
        if audit_count(&id).await == TOTAL && id.audit_spooled() == 0 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{} of {TOTAL} records arrived, {} spooled, {} dropped",
            audit_count(&id).await,
            id.audit_spooled(),
            id.audit_dropped()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(id.audit_dropped(), 0);
    assert!(id.audit_write_errors() > 0);
    let distinct: i64 =
        sqlx::query("SELECT COUNT(DISTINCT request_id) FROM audit_log").fetch_one(id.pool()).await.unwrap().get(0);
    assert_eq!(distinct, TOTAL);
    let (requests, tokens): (i64, i64) = sqlx::query(
        "SELECT CAST(SUM(requests) AS BIGINT), CAST(SUM(prompt_tokens + completion_tokens) AS BIGINT) FROM usage_daily",
    )
    .fetch_one(id.pool())
    .await
    .map(|r| (r.get(0), r.get(1)))
    .unwrap();
    assert_eq!((requests, tokens), (TOTAL, TOTAL * 7));
    let files = std::fs::read_dir(dir.path().join("spool")).unwrap().count();
    assert_eq!(files, 0, "replayed spool files are removed");
}

/// Batches spooled before a restart are written by the next process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue_14_spooled_audit_batches_are_replayed_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let id = spooling(dir.path()).await;
    sqlx::query("ALTER TABLE audit_log RENAME TO audit_log_away").execute(id.pool()).await.unwrap();
    for i in 0..10 {
        id.record(rec("acme", "llama", 200, 1, 1, 0, i));
    }
    id.flush().await;
    assert_eq!((id.audit_spooled(), id.audit_dropped()), (10, 0));
    drop(id);
    // The writer ends with its last sender; the database comes back.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let url = format!("sqlite://{}", dir.path().join("g.db").display());
    let raw = sqlx::AnyPool::connect(&url).await.unwrap();
    sqlx::query("ALTER TABLE audit_log_away RENAME TO audit_log").execute(&raw).await.unwrap();
    raw.close().await;
    let again = spooling(dir.path()).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    // Committed first, then the file is removed and the count updated.
    while audit_count(&again).await != 10 || again.audit_spooled() != 0 {
        assert!(std::time::Instant::now() < deadline, "the spool was not replayed at start");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(audit_count(&again).await, 10, "replayed once");
    // Without a spool, a batch the database refuses is dropped and counted.
    sqlx::query("ALTER TABLE audit_log RENAME TO audit_log_away").execute(again.pool()).await.unwrap();
    let plain = Identity::open(
        &format!("sqlite://{}", dir.path().join("g.db").display()),
        IdentityOptions { audit_write_timeout: Duration::from_millis(500), ..IdentityOptions::default() },
    )
    .await
    .unwrap();
    plain.record(rec("acme", "llama", 200, 1, 1, 0, 99));
    plain.flush().await;
    assert_eq!(plain.audit_dropped(), 1);
}

/// Issue 14, point 2: with prices configured, the usage report gives each
/// row's cost and the currency; a model without a price has none.
#[tokio::test]
async fn usage_reports_cost_when_prices_are_configured() {
    let id = mem().await;
    tenant(&id, "acme").await;
    id.record(rec("acme", "llama", 200, 2_000_000, 1_000_000, 1_000_000, 1_700_000_000_000));
    id.record(rec("acme", "free", 200, 10, 10, 0, 1_700_000_000_001));
    id.flush().await;
    let mut prices = crate::pricing::Prices { currency: "EUR".into(), ..Default::default() };
    prices.models.insert(
        "llama".into(),
        crate::pricing::ModelPrice {
            input_per_million: 1.0,
            cached_input_per_million: Some(0.5),
            output_per_million: 3.0,
        },
    );
    let r = admin_router_with(id, AdminToken::new(ADMIN), AdminOptions { prices, ..Default::default() });
    let uri = "/admin/v1/usage?from=2023-11-14T00:00:00Z&to=2023-11-15T00:00:00Z";
    let (status, _, json, _) = call(&r, Method::GET, uri, Some(ADMIN), None).await;
    assert_eq!(status, StatusCode::OK, "{json}");
    assert_eq!(json["currency"], "EUR");
    let cost =
        |model: &str| json["data"].as_array().unwrap().iter().find(|r| r["model"] == model).unwrap()["cost"].clone();
    // 1M fresh × 1 + 1M cached × 0.5 + 1M out × 3.
    assert_eq!(cost("llama"), serde_json::json!(4.5));
    assert_eq!(cost("free"), serde_json::Value::Null);
    let (_, _, _, text) = call(&r, Method::GET, &format!("{uri}&format=csv"), Some(ADMIN), None).await;
    assert!(text.contains("acme,llama,1,0,2000000,1000000,1000000,4.500000,EUR\n"), "{text}");
}
