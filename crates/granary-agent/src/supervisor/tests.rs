use super::*;

/// A temporary directory with `www/health` in it, for python's HTTP server
/// to serve as an engine; None (after saying so) without python3.
fn www() -> Option<(tempfile::TempDir, std::path::PathBuf)> {
    if std::process::Command::new("python3").arg("--version").output().is_err() {
        eprintln!("skipping: python3 is not installed");
        return None;
    }
    let d = tempfile::tempdir().unwrap();
    let www = d.path().join("www");
    std::fs::create_dir_all(&www).unwrap();
    std::fs::write(www.join("health"), "ok").unwrap();
    Some((d, www))
}

fn spec(www: &std::path::Path) -> LaunchSpec {
    LaunchSpec {
        model: "m".into(),
        revision: "1".into(),
        model_path: www.to_path_buf(),
        files: vec![],
        tier: Tier::Disk,
        gpus: None,
        memory: 0,
    }
}

/// A real HTTP server as the engine (python's, serving a directory with
/// a `health` file): killed, it is restarted after the backoff; an agent
/// that goes away during the backoff leaves it in the state file with
/// pid 0, so the next one starts it again instead of forgetting it.
#[tokio::test]
async fn a_killed_engine_restarts_and_one_between_processes_is_not_forgotten() {
    let Some((d, www)) = www() else { return };
    let cfg = SupervisorConfig {
        command: Some(format!("cd {} && exec python3 -m http.server {{port}} --bind {{host}}", www.display())),
        health_interval: Duration::from_millis(50),
        backoff_initial: Duration::from_millis(300),
        start_timeout: Duration::from_secs(20),
        ..Default::default()
    };
    let sup = Supervisor::new(cfg.clone(), d.path()).unwrap();
    let spec = spec(&www);
    let st = sup.start(spec.clone()).await.unwrap();
    assert_eq!(st.state, EngineState::Ready);
    let pid = st.pid.unwrap();
    assert_eq!(sup.persisted()[0].pid, pid);

    signal_group(pid, libc::SIGKILL);
    let mut rx = sup.changed_signal();
    while sup.status("m").unwrap().state != EngineState::Restarting {
        rx.changed().await.unwrap();
    }
    assert_eq!(sup.persisted()[0].pid, 0, "between processes");
    let st = sup.ready("m", Duration::from_secs(20)).await.unwrap();
    assert_eq!(st.restarts, 1);
    assert_ne!(st.pid, Some(pid));
    assert!(st.last_error.unwrap().contains("signal 9"));

    // Gone during a backoff: the next supervisor does not adopt pid 0.
    signal_group(st.pid.unwrap(), libc::SIGKILL);
    while sup.status("m").unwrap().state != EngineState::Restarting {
        rx.changed().await.unwrap();
    }
    sup.detach();
    let next = Supervisor::new(cfg, d.path()).unwrap();
    let p = next.persisted();
    assert_eq!((p.len(), p[0].pid), (1, 0), "{p:?}");
    assert!(!next.adopt(&p[0]).await);
    assert!(next.list().is_empty());
}

/// The idle window starts when the engine can serve, not when it was
/// started: a slow start is not idleness (an idle unload right after a
/// load would take the engine away from the requests that asked for it).
#[tokio::test]
async fn the_idle_window_starts_when_the_engine_is_ready() {
    let Some((d, www)) = www() else { return };
    let cfg = SupervisorConfig {
        command: Some(format!(
            "sleep 0.8; cd {} && exec python3 -m http.server {{port}} --bind {{host}}",
            www.display()
        )),
        health_interval: Duration::from_millis(50),
        start_timeout: Duration::from_secs(20),
        ..Default::default()
    };
    let sup = Supervisor::new(cfg, d.path()).unwrap();
    let spec = spec(&www);
    let asked = now_ms();
    let st = sup.start(spec).await.unwrap();
    assert_eq!(st.state, EngineState::Ready);
    let last = sup.last_active_ms("m").unwrap();
    assert!(
        last >= asked + 800,
        "idle since {} ms after the start was asked; it could serve only after 800",
        last - asked
    );
    sup.stop("m").await.unwrap();
}
