//! What the server says about itself: CONFIG and INFO (a tenant sees its
//! own namespace only).

use super::*;

/// INFO's replication section: a lone primary. Clients that look for the
/// primary of a standalone deployment (valkey-glide, so LMCache's
/// `valkey://` connector) read `role:master` here.
const REPLICATION_INFO: &str = "# Replication\r\nrole:master\r\nconnected_slaves:0\r\n\r\n";

impl Session<'_> {
    pub(super) fn config(&self, a: &[Bytes], out: &mut Out) -> Result<(), CmdError> {
        let sub = String::from_utf8_lossy(&a[0]).to_ascii_uppercase();
        match sub.as_str() {
            "GET" => {
                if a.len() < 2 {
                    return Err(CmdError::Arity("config|get".into()));
                }
                let cfg = self.ctx.store.config();
                let params: [(&str, String); 6] = [
                    ("maxmemory", cfg.memory.as_u64().to_string()),
                    ("maxmemory-policy", cfg.memory_policy.to_string()),
                    ("save", String::new()),
                    ("appendonly", "no".into()),
                    ("databases", "1".into()),
                    ("proto-max-bulk-len", cfg.max_value.as_u64().to_string()),
                ];
                let hits: Vec<&(&str, String)> =
                    params.iter().filter(|(k, _)| a[1..].iter().any(|p| glob_match(p, k.as_bytes(), true))).collect();
                out.map(hits.len());
                for (k, v) in hits {
                    out.bulk(k.as_bytes());
                    out.bulk(v.as_bytes());
                }
            }
            "SET" => {
                if a.len() < 3 || a.len().is_multiple_of(2) {
                    return Err(CmdError::Arity("config|set".into()));
                }
                out.ok();
            }
            "RESETSTAT" | "REWRITE" => out.ok(),
            _ => return Err(CmdError::UnknownSubcommand { cmd: "CONFIG", sub: String::from_utf8_lossy(&a[0]).into() }),
        }
        Ok(())
    }

    /// INFO as a tenant sees it: its own namespace's figures only (no
    /// process id, no server-wide counters, no other tenant's bytes).
    pub(super) async fn tenant_info_text(&self, want: &(dyn Fn(&str) -> bool + Sync)) -> Result<String, CmdError> {
        let cfg = self.ctx.store.config();
        let usage = self.ctx.store.namespace_usage(&self.ns);
        let mut t = String::new();
        if want("server") {
            let _ = write!(
                t,
                "# Server\r\nredis_version:{REDIS_VERSION}\r\ngranary_version:{}\r\nredis_mode:standalone\r\n\
                 tcp_port:{}\r\n\r\n",
                env!("CARGO_PKG_VERSION"),
                self.info.port,
            );
        }
        if want("clients") {
            let mine = self.info.clients.lock().values().filter(|c| c.namespace == self.ns).count();
            let _ = write!(t, "# Clients\r\nconnected_clients:{mine}\r\n\r\n");
        }
        if want("replication") {
            t.push_str(REPLICATION_INFO);
        }
        let mem = usage.iter().find(|u| u.tier == crate::TierKind::Memory);
        if want("memory") {
            let _ = write!(
                t,
                "# Memory\r\nused_memory:{}\r\nmaxmemory:{}\r\nmaxmemory_policy:{}\r\n\r\n",
                mem.and_then(|m| m.bytes).unwrap_or(0),
                mem.and_then(|m| m.quota).unwrap_or(cfg.memory.as_u64()),
                cfg.memory_policy,
            );
        }
        if want("tiers") || want("granary") {
            let _ = write!(t, "# Tiers\r\nnamespace:{}\r\n", self.ns);
            let num = |v: Option<u64>| v.map_or_else(|| "-".to_string(), |v| v.to_string());
            for u in &usage {
                let _ = write!(
                    t,
                    "tier_{}:bytes={},entries={},quota={}\r\n",
                    u.tier.as_str(),
                    num(u.bytes),
                    num(u.entries),
                    num(u.quota),
                );
            }
            t.push_str("\r\n");
        }
        if want("keyspace") {
            let keys = self.ctx.store.count(&self.ns).await?;
            let _ = write!(t, "# Keyspace\r\ndb0:keys={keys},expires=0,avg_ttl=0\r\n");
        }
        Ok(t)
    }

    pub(super) async fn info_text(&self, a: &[Bytes]) -> Result<String, CmdError> {
        let wanted: Vec<String> = a.iter().map(|s| lower(s)).collect();
        let all = wanted.is_empty() || wanted.iter().any(|w| w == "all" || w == "everything" || w == "default");
        let want = |s: &str| all || wanted.iter().any(|w| w == s);
        // An open server has one trust level; with tokens, only the admin
        // sees the server's own figures.
        if !self.ctx.auth.is_open() && !self.principal.as_ref().is_some_and(Principal::is_admin) {
            return self.tenant_info_text(&want).await;
        }
        let stats = self.ctx.store.stats();
        let p = self.ctx.resp.snapshot();
        let cfg = self.ctx.store.config();
        let mut t = String::new();
        // Writing to a String cannot fail; results are ignored.
        if want("server") {
            let _ = write!(
                t,
                "# Server\r\nredis_version:{REDIS_VERSION}\r\ngranary_version:{}\r\nredis_mode:standalone\r\n\
                 os:{} {}\r\narch_bits:{}\r\nprocess_id:{}\r\ntcp_port:{}\r\nuptime_in_seconds:{}\r\n\r\n",
                env!("CARGO_PKG_VERSION"),
                std::env::consts::OS,
                std::env::consts::ARCH,
                usize::BITS,
                std::process::id(),
                self.info.port,
                self.info.started.elapsed().as_secs(),
            );
        }
        if want("clients") {
            let _ = write!(t, "# Clients\r\nconnected_clients:{}\r\n\r\n", p.connections_open);
        }
        if want("replication") {
            t.push_str(REPLICATION_INFO);
        }
        let mem = stats.tiers.first().cloned().unwrap_or_default();
        if want("memory") {
            let _ = write!(
                t,
                "# Memory\r\nused_memory:{}\r\nmaxmemory:{}\r\nmaxmemory_policy:{}\r\n\r\n",
                mem.bytes,
                cfg.memory.as_u64(),
                cfg.memory_policy,
            );
        }
        if want("stats") {
            let _ = write!(
                t,
                "# Stats\r\ntotal_connections_received:{}\r\ntotal_commands_processed:{}\r\n\
                 total_net_input_bytes:{}\r\ntotal_net_output_bytes:{}\r\nkeyspace_hits:{}\r\n\
                 keyspace_misses:{}\r\nevicted_keys:{}\r\nexpired_keys:{}\r\ngranary_requests_ok:{}\r\n\
                 granary_requests_error:{}\r\ngranary_protocol_errors:{}\r\n\r\n",
                p.connections_total,
                p.requests_ok + p.requests_error,
                p.bytes_read,
                p.bytes_written,
                mem.hits,
                mem.misses,
                mem.evictions,
                mem.expirations,
                p.requests_ok,
                p.requests_error,
                p.protocol_errors,
            );
        }
        if want("tiers") || want("granary") {
            let _ = write!(t, "# Tiers\r\nnamespace:{}\r\n", self.ns);
            for s in &stats.tiers {
                let _ = write!(
                    t,
                    "tier_{}:bytes={},entries={},capacity={},hits={},misses={},evictions={},expirations={},\
                     corrupt_dropped={},verify_failed={},errors={},policy={}\r\n",
                    s.tier.map_or("unknown", |k| k.as_str()),
                    s.bytes,
                    s.entries,
                    s.capacity,
                    s.hits,
                    s.misses,
                    s.evictions,
                    s.expirations,
                    s.corrupt_dropped,
                    s.verify_failed,
                    s.errors,
                    s.policy.as_deref().unwrap_or("-"),
                );
            }
            for o in &stats.offload {
                let _ = write!(
                    t,
                    "offload_{}:queued={},written={},dropped={},errors={}\r\n",
                    o.tier.map_or("unknown", |k| k.as_str()),
                    o.queued,
                    o.written,
                    o.dropped,
                    o.errors,
                );
            }
            let _ = write!(
                t,
                "promotions_from_disk:{}\r\npromotions_from_remote:{}\r\n\r\n",
                stats.promotions_from_disk, stats.promotions_from_remote
            );
        }
        if want("keyspace") {
            let keys = self.ctx.store.count(&self.ns).await?;
            let _ = write!(t, "# Keyspace\r\ndb0:keys={keys},expires=0,avg_ttl=0\r\n");
        }
        Ok(t)
    }
}
