//! What a `kill -9` of the gateway loses from the audit log: at most the
//! records of the last flush interval (the writer commits a batch every
//! 100 ms or 512 records).
//!
//! The gateway must die for real, so it runs in a child process: this test
//! binary started again on the ignored test `child_gateway`, which serves a
//! gateway on an SQLite file until it is killed.

use super::*;

const CHILD_DIR: &str = "GRANARY_TEST_AUDIT_CHILD_DIR";

/// Not a test of its own: the gateway process of
/// `issue_14_kill_9_loses_at_most_the_last_flush_interval_of_audit_records`.
#[tokio::test]
#[ignore = "run by the kill -9 test as its child process"]
async fn child_gateway() {
    let Some(dir) = std::env::var_os(CHILD_DIR).map(std::path::PathBuf::from) else { return };
    let up = start_upstream("a", Mode::Ok, &["m"]).await;
    let db = format!("sqlite://{}", dir.join("gateway.db").display());
    let g = Gw::start(&named(&[("a", up.addr)]), |c| c.gateway.database = db).await;
    let key = g.key("acme", json!({})).await;
    std::fs::write(dir.join("ready.tmp"), format!("{}\n{key}\n", g.base)).unwrap();
    std::fs::rename(dir.join("ready.tmp"), dir.join("ready")).unwrap();
    tokio::time::sleep(Duration::from_secs(600)).await;
}

/// Issue 14, point 2: requests answered more than a flush interval (plus
/// the time a batch takes to commit on a busy machine) before the kill are
/// all in the audit log afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue_14_kill_9_loses_at_most_the_last_flush_interval_of_audit_records() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["durability::child_gateway", "--exact", "--ignored", "--nocapture"])
        .env(CHILD_DIR, dir.path())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let ready = dir.path().join("ready");
    let t0 = Instant::now();
    while !ready.exists() {
        assert!(t0.elapsed() < Duration::from_secs(30), "the child gateway did not start");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let text = std::fs::read_to_string(&ready).unwrap();
    let (base, key) = text.trim().split_once('\n').unwrap();
    let (base, key) = (base.to_string(), key.to_string());

    // Four clients send requests for a second and a half, noting when each
    // answer came; then the gateway is killed mid-traffic.
    let answered: Arc<Mutex<Vec<(String, Instant)>>> = Arc::default();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut clients = Vec::new();
    for _ in 0..4 {
        let (base, key, answered, stop) = (base.clone(), key.clone(), answered.clone(), stop.clone());
        clients.push(tokio::spawn(async move {
            let http = reqwest::Client::new();
            while !stop.load(Ordering::Relaxed) {
                let r = http.post(format!("{base}/v1/chat/completions")).bearer_auth(&key).json(&chat_body(false));
                let Ok(resp) = r.send().await else { break };
                if resp.status() == 200 {
                    let id = resp.headers()["x-request-id"].to_str().unwrap().to_string();
                    answered.lock().push((id, Instant::now()));
                }
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    child.kill().unwrap(); // SIGKILL
    let killed = Instant::now();
    child.wait().unwrap();
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        c.await.unwrap();
    }

    let db = format!("sqlite://{}", dir.path().join("gateway.db").display());
    let pool = sqlx::sqlite::SqlitePool::connect(&db).await.unwrap();
    let ids: Vec<(String,)> = sqlx::query_as("SELECT request_id FROM audit_log").fetch_all(&pool).await.unwrap();
    let kept: std::collections::HashSet<&str> = ids.iter().map(|(id,)| id.as_str()).collect();
    let answered = answered.lock();
    assert!(answered.len() > 50, "too little traffic to tell: {}", answered.len());
    // The flush interval, and up to 400 ms for a batch to commit on a
    // machine whose two cores also run the clients and the upstream.
    let window = Duration::from_millis(100 + 400);
    let lost: Vec<Duration> =
        answered.iter().filter(|(id, _)| !kept.contains(id.as_str())).map(|(_, at)| killed - *at).collect();
    assert!(
        lost.iter().all(|before_kill| *before_kill <= window),
        "records answered long before the kill were lost: {lost:?} of {}",
        answered.len()
    );
    let oldest = lost.iter().max().copied().unwrap_or_default();
    eprintln!(
        "answered {}, audited {}, lost {}, the oldest answered {oldest:?} before the kill",
        answered.len(),
        kept.len(),
        lost.len()
    );
}
