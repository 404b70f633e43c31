//! Idle unload without failed requests: leave the gateways' routing, let
//! what is in flight finish, then stop.
//!
//! An engine idle for `idle_unload` is first marked draining, and the agent
//! heartbeats that at once to every gateway. A gateway takes a draining
//! engine out of routing before it answers: a request for the model that
//! comes later makes the gateway ask for a load, and a load of a draining
//! engine takes it back (it stays, no start). The answer also says how many
//! requests that gateway still has in flight on the engine. The agent stops
//! the engine once every gateway says none and the engine itself has none
//! (its front's count, or the running and waiting gauges of its metrics),
//! twice in a row [`DRAIN_POLL`] apart, or after `drain_timeout` whatever
//! they say. A gateway that lists the model in its answer's `keep` (its
//! `min_replicas`) ends the drain and the engine stays loaded.
//!
//! An unload someone asks for (`POST /models/{model}/unload`) drains the
//! same way first, but a gateway's `keep` does not stop it.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::agent::Agent;

/// Time between two looks at a draining engine's requests.
pub const DRAIN_POLL: Duration = Duration::from_millis(50);

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// How a drain ended.
enum Drained {
    /// No request left, at the gateways or the engine.
    Quiet,
    /// `drain_timeout` passed with requests still in flight.
    TimedOut,
    /// A load took the engine back.
    TakenBack,
    /// A gateway needs it kept (`min_replicas`).
    Kept,
    /// The agent is stopping.
    Stopping,
}

/// What the gateways said of a draining engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct GatewaysSay {
    /// Requests in flight through them; None: some gateway did not answer.
    in_flight: Option<u64>,
    /// Some gateway needs the engine kept.
    keep: bool,
}

impl Agent {
    /// Marks `model`'s engine draining and drains it in the background,
    /// then unloads it unless a load took it back or a gateway keeps it;
    /// the task says whether it was unloaded. None: no such engine, or it
    /// drains already.
    pub fn start_drain(self: &Arc<Self>, model: &str) -> Option<tokio::task::JoinHandle<bool>> {
        if !self.supervisor().set_draining(model, true) {
            return None;
        }
        tracing::info!(model, "draining an idle engine before unloading it");
        Some(tokio::spawn(self.clone().drain_then_unload(model.to_string())))
    }

    async fn drain_then_unload(self: Arc<Self>, model: String) -> bool {
        match self.wait_drained(&model, true).await {
            Drained::Quiet | Drained::TimedOut => {}
            Drained::TakenBack | Drained::Kept | Drained::Stopping => return false,
        }
        match self.unload_drained(&model).await {
            Ok(unloaded) => unloaded,
            Err(e) => {
                tracing::warn!(model = %model, error = %e, "idle unload failed");
                false
            }
        }
    }

    /// Before an unload someone asked for: the engine leaves the gateways'
    /// routing and its requests finish (up to `drain_timeout`), whatever
    /// their `keep` says. Nothing to do without gateways or for an engine
    /// not serving yet. The caller holds the model's load lock, so no load
    /// takes the engine back meanwhile.
    pub(crate) async fn drain_before_unload(&self, model: &str) {
        let serving = self.supervisor().status(model).is_some_and(|st| st.ever_ready);
        if self.config().gateways.is_empty() || !serving {
            return;
        }
        self.supervisor().set_draining(model, true);
        tracing::info!(model, "draining the engine before unloading it");
        self.wait_drained(model, false).await;
    }

    /// Waits until the gateways and the engine have no request in flight
    /// (twice in a row), the drain times out, a load takes the engine back,
    /// or (with `honour_keep`) a gateway keeps it.
    async fn wait_drained(&self, model: &str, honour_keep: bool) -> Drained {
        let http = crate::heartbeat::client();
        let started = Instant::now();
        let mut quiet = 0;
        loop {
            if !self.supervisor().is_draining(model) {
                tracing::info!(model = %model, "a load took the draining engine back");
                return Drained::TakenBack;
            }
            let say = self.tell_gateways(&http, model).await;
            if say.keep && honour_keep {
                tracing::info!(model = %model, "a gateway keeps the engine loaded (min_replicas)");
                self.supervisor().mark_active(model, now_ms());
                self.supervisor().set_draining(model, false);
                return Drained::Kept;
            }
            let here = self.engine_in_flight(&http, model).await;
            quiet = if say.in_flight == Some(0) && here == 0 { quiet + 1 } else { 0 };
            if quiet >= 2 {
                return Drained::Quiet;
            }
            if started.elapsed() >= self.config().drain_timeout {
                tracing::warn!(model = %model, gateways = ?say.in_flight, engine = here, "drain timeout: unloading with requests in flight");
                return Drained::TimedOut;
            }
            tokio::select! {
                _ = self.stopping().cancelled() => return Drained::Stopping,
                _ = tokio::time::sleep(DRAIN_POLL) => {}
            }
        }
    }

    /// A heartbeat to every gateway (saying the engine drains); the sum of
    /// their in-flight counts for `model` and whether any keeps it.
    async fn tell_gateways(&self, http: &reqwest::Client, model: &str) -> GatewaysSay {
        let mut say = GatewaysSay { in_flight: Some(0), keep: false };
        for g in &self.config().gateways {
            match crate::heartbeat::send(self, http, g).await {
                Ok(a) => {
                    say.in_flight = say.in_flight.map(|n| n + a.draining.get(model).copied().unwrap_or(0));
                    say.keep |= a.keep.iter().any(|m| m == model);
                }
                Err(e) => {
                    tracing::debug!(gateway = %g, error = %e, "heartbeat during a drain failed");
                    say.in_flight = None;
                }
            }
        }
        say
    }

    /// Requests the engine itself is answering: its front's count, else the
    /// running and waiting gauges of its metrics (0 when they cannot be read).
    async fn engine_in_flight(&self, http: &reqwest::Client, model: &str) -> u64 {
        if let Some(front) = self.supervisor().front_stats(model) {
            return front.in_flight();
        }
        let Some(st) = self.supervisor().status(model) else { return 0 };
        let text = match http.get(format!("{}/metrics", st.engine_url)).timeout(Duration::from_secs(2)).send().await {
            Ok(r) if r.status().is_success() => r.text().await.unwrap_or_default(),
            _ => return 0,
        };
        crate::activity::parse(&text).map_or(0, |a| a.in_flight.max(0.0) as u64)
    }
}
