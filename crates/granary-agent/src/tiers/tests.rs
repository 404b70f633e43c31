//! The tiers' budgets, eviction, promotion, layout and checkpoints.

use super::*;

fn sha(n: u8) -> String {
    hex::encode([n; 32])
}

/// Writes a "downloaded" file of `size` bytes through begin/end_download.
fn put(t: &Tiers, n: u8, size: usize) -> Result<(), AgentError> {
    let dest = t.begin_download(&sha(n), size as u64, &format!("file{n}"))?;
    std::fs::write(&dest, vec![n; size]).unwrap();
    t.end_download(&sha(n), true);
    Ok(())
}

fn tiers(dir: &Path, ram: bool, disk_budget: u64, ram_budget: u64) -> Tiers {
    let cfg = TierConfig {
        ram_dir: ram.then(|| dir.join("ram")),
        ram_budget: ByteSize(ram_budget),
        disk_budget: ByteSize(disk_budget),
        promote_after: 2,
        promote_window: Duration::from_secs(60),
        demote_after: None,
    };
    Tiers::open(cfg, &dir.join("cache")).unwrap()
}

#[test]
fn disk_evicts_least_recently_used_unpinned_files() {
    let d = tempfile::tempdir().unwrap();
    let t = tiers(d.path(), false, 300, 0);
    put(&t, 1, 100).unwrap();
    std::thread::sleep(Duration::from_millis(5));
    put(&t, 2, 100).unwrap();
    std::thread::sleep(Duration::from_millis(5));
    put(&t, 3, 100).unwrap();
    // 1 is the oldest, but a load holds it; 2 is touched: 3 goes.
    t.pin(&[sha(1)]);
    std::thread::sleep(Duration::from_millis(5));
    t.touch(&[sha(2)]);
    put(&t, 4, 100).unwrap();
    assert_eq!(t.locate(&sha(1)), Some(Tier::Disk));
    assert_eq!(t.locate(&sha(2)), Some(Tier::Disk));
    assert_eq!(t.locate(&sha(3)), None);
    assert!(!t.disk_path(&sha(3)).exists(), "an evicted file is deleted");
    assert_eq!(t.status().disk, TierStatus { budget: 300, used: 300, files: 3 });

    // Everything else held: a file that cannot fit is refused, naming the budget.
    t.pin(&[sha(2), sha(4)]);
    match put(&t, 5, 10) {
        Err(AgentError::OverBudget { tier: "disk", budget: 300, pinned: 300, .. }) => {}
        other => panic!("expected OverBudget, got {other:?}"),
    }
    // Larger than the whole budget: refused without evicting anything.
    t.unpin(&[sha(2), sha(4)]);
    assert!(matches!(put(&t, 6, 301), Err(AgentError::OverBudget { .. })));
    assert_eq!(t.status().disk.files, 3);
}

#[test]
fn the_index_survives_a_restart_with_recency() {
    let d = tempfile::tempdir().unwrap();
    {
        let t = tiers(d.path(), false, 200, 0);
        put(&t, 1, 100).unwrap();
        std::thread::sleep(Duration::from_millis(20));
        put(&t, 2, 100).unwrap();
        // An interrupted download's part file is counted and evictable.
        std::fs::write(crate::download::part_path(&t.disk_path(&sha(9))), vec![0u8; 50]).unwrap();
    }
    let t = tiers(d.path(), false, 200, 0);
    assert_eq!(t.status().disk, TierStatus { budget: 200, used: 250, files: 2 });
    // Over budget: the part file (oldest? no: written last) and file 1 are the candidates by age.
    put(&t, 3, 100).unwrap();
    assert_eq!(t.locate(&sha(1)), None, "the least recently used file went first");
    assert_eq!(t.locate(&sha(3)), Some(Tier::Disk));
    assert!(t.status().disk.used <= 200);
}

#[tokio::test]
async fn promotion_after_n_loads_and_demotion_under_pressure() {
    let d = tempfile::tempdir().unwrap();
    let t = tiers(d.path(), true, 1000, 250);
    for n in 1..=3 {
        put(&t, n, 100).unwrap();
    }
    // Model a = file 1; b = file 2; c = file 3.
    assert!(!t.record_load("a"), "one load does not promote");
    assert!(t.record_load("a"), "the second within the window does");
    assert!(t.promote(&[sha(1)]).await.unwrap());
    assert_eq!(t.locate(&sha(1)), Some(Tier::Ram));
    assert_eq!(std::fs::read(t.ram_path(&sha(1)).unwrap()).unwrap(), vec![1u8; 100]);
    std::thread::sleep(Duration::from_millis(5));
    assert!(t.promote(&[sha(2)]).await.unwrap());
    // RAM holds 200 of 250: promoting c demotes the least recently used, a.
    std::thread::sleep(Duration::from_millis(5));
    assert!(t.promote(&[sha(3)]).await.unwrap());
    assert_eq!(t.locate(&sha(1)), Some(Tier::Disk), "demoted to disk, not lost");
    assert!(!t.ram_path(&sha(1)).unwrap().exists());
    assert_eq!(t.locate(&sha(3)), Some(Tier::Ram));
    assert_eq!(t.status().ram, Some(TierStatus { budget: 250, used: 200, files: 2 }));

    // Held copies are not demoted: a model that only fits by demoting them stays on disk.
    t.pin(&[sha(2), sha(3)]);
    assert!(!t.promote(&[sha(1)]).await.unwrap());
    assert_eq!(t.locate(&sha(1)), Some(Tier::Disk));

    // Materialised: links into the fastest tier of each file.
    let root = d.path().join("models/m/r");
    let slowest = t.materialise(&root, &[("w/a.bin".into(), sha(1)), ("b.bin".into(), sha(3))]).unwrap();
    assert_eq!(slowest, Tier::Disk);
    assert_eq!(std::fs::read_link(root.join("b.bin")).unwrap(), t.ram_path(&sha(3)).unwrap());
    assert_eq!(std::fs::read(root.join("w/a.bin")).unwrap(), vec![1u8; 100]);
    assert!(t.materialise(&root, &[("../x".into(), sha(1))]).is_err(), "no escaping the model directory");

    // A copy deleted behind the agent's back is forgotten, not linked.
    std::fs::remove_file(t.ram_path(&sha(3)).unwrap()).unwrap();
    assert_eq!(t.locate(&sha(3)), Some(Tier::Disk));
    std::fs::remove_file(t.disk_path(&sha(2))).unwrap();
    std::fs::remove_file(t.ram_path(&sha(2)).unwrap()).unwrap();
    assert_eq!(t.locate(&sha(2)), None);
}

#[test]
fn idle_ram_copies_are_demoted_when_configured() {
    let d = tempfile::tempdir().unwrap();
    let mut t = tiers(d.path(), true, 1000, 1000);
    t.cfg.demote_after = Some(Duration::from_millis(30));
    put(&t, 1, 10).unwrap();
    put(&t, 2, 10).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    assert!(rt.block_on(t.promote(&[sha(1), sha(2)])).unwrap());
    t.pin(&[sha(2)]);
    assert_eq!(t.demote_idle(), 0, "nothing is idle yet");
    std::thread::sleep(Duration::from_millis(60));
    assert_eq!(t.demote_idle(), 1, "the held copy stays");
    assert_eq!(t.locate(&sha(1)), Some(Tier::Disk));
    assert_eq!(t.locate(&sha(2)), Some(Tier::Ram));
}

#[test]
fn a_checkpoint_an_engine_wrote_is_kept_in_the_tiers_and_linked_again() {
    let d = tempfile::tempdir().unwrap();
    let t = tiers(d.path(), true, 1000, 1000);
    put(&t, 1, 100).unwrap();
    let root = d.path().join("models/m/r1");
    let files = [("m.gguf".to_string(), sha(1))];
    t.materialise(&root, &files).unwrap();
    assert!(t.checkpoint_shas(&root).is_empty());

    // The engine writes its checkpoint beside the weights (and a temporary
    // file it had not renamed yet, which is left alone).
    let ck = root.join("m.gguf.granary-avx512vnni.ckpt");
    std::fs::write(&ck, vec![7u8; 200]).unwrap();
    std::fs::write(root.join(".granary-ckpt-partial"), b"x").unwrap();
    let want = hex::encode(<sha2::Sha256 as sha2::Digest>::digest(vec![7u8; 200]));
    let adopted = t.adopt_checkpoints(&root);
    assert_eq!(adopted, vec![("m.gguf.granary-avx512vnni.ckpt".to_string(), want.clone())]);
    assert_eq!(std::fs::read_link(&ck).unwrap(), t.disk_path(&want), "the file became a link into the disk tier");
    assert_eq!(std::fs::read(&ck).unwrap(), vec![7u8; 200]);
    assert_eq!(t.status().disk, TierStatus { budget: 1000, used: 300, files: 2 }, "counted in the disk budget");
    assert_eq!(t.checkpoint_shas(&root), vec![want.clone()]);
    // Adopting again changes nothing.
    assert_eq!(t.adopt_checkpoints(&root).len(), 1);
    assert_eq!(t.status().disk.files, 2);

    // The next layout keeps it, linked to the fastest tier once promoted.
    let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    assert!(rt.block_on(t.promote(&[sha(1), want.clone()])).unwrap());
    t.materialise(&root, &files).unwrap();
    assert_eq!(std::fs::read_link(&ck).unwrap(), t.ram_path(&want).unwrap());
    assert!(!root.join(".granary-ckpt-partial").exists(), "a layout starts from a clean directory");

    // Evicted like any unpinned file; the next layout then leaves it out.
    t.pin(&[sha(1)]);
    put(&t, 2, 800).unwrap();
    assert_eq!(t.locate(&want), None, "the checkpoint was the file to evict");
    t.materialise(&root, &files).unwrap();
    assert!(std::fs::symlink_metadata(&ck).is_err(), "no link to an evicted checkpoint");

    // One that cannot fit the disk budget is deleted, not kept outside it.
    std::fs::write(&ck, vec![9u8; 150]).unwrap();
    t.pin(&[sha(2)]);
    assert!(t.adopt_checkpoints(&root).is_empty());
    assert!(std::fs::symlink_metadata(&ck).is_err());
    assert_eq!(t.status().disk.used, 900);
}
