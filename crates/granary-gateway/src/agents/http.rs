//! The agents' admin routes:
//!
//! | route | token | does |
//! | --- | --- | --- |
//! | `POST /admin/v1/agents/heartbeat` | agent or admin | an agent reports its engines and loadable models ([`Heartbeat`]) → `{"ok": true, "ttl_ms", "draining": {model: requests in flight here}, "keep": [models], "prefetch": [{model}]}` |
//! | `GET /admin/v1/agents` | admin | the agents heard from within `ttl_ms`, their engines as upstreams |

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{RawQuery, State};
use axum::middleware::from_fn_with_state;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::json;

use super::Heartbeat;
use crate::error::ApiError;
use crate::identity::{parse_json_body, query_params, require_admin, AdminToken};
use crate::proxy::Gateway;

/// The routes: heartbeats behind the agent token or the admin token, the
/// listing behind the admin token. A route neither token opens is absent.
pub fn admin_routes(gw: Arc<Gateway>, admin: Option<AdminToken>, agent: Option<AdminToken>) -> Router {
    let mut r = Router::new();
    if let Some(admin) = &admin {
        r = r.merge(
            Router::new()
                .route("/admin/v1/agents", get(list))
                .route_layer(from_fn_with_state(admin.clone(), require_admin))
                .with_state(gw.clone()),
        );
    }
    let beat = match (&admin, &agent) {
        (Some(a), Some(b)) => Some(a.or(b)),
        (a, b) => a.clone().or_else(|| b.clone()),
    };
    if let Some(token) = beat {
        r = r.merge(
            Router::new()
                .route("/admin/v1/agents/heartbeat", post(heartbeat))
                .route_layer(from_fn_with_state(token, require_admin))
                .with_state(gw),
        );
    }
    r
}

fn disabled() -> ApiError {
    ApiError::forbidden("agents_disabled", "Agents are disabled in this gateway's configuration ([gateway.agents]).")
}

async fn heartbeat(State(gw): State<Arc<Gateway>>, body: Bytes) -> Result<Response, ApiError> {
    if !gw.agents.enabled() {
        return Err(disabled());
    }
    let hb: Heartbeat = parse_json_body(&body)?;
    hb.validate()?;
    let agent_id = hb.agent_id.clone();
    gw.heartbeat(hb)?;
    gw.start_reaper();
    Ok(Json(json!({
        "ok": true,
        "ttl_ms": gw.agents.cfg.ttl_ms,
        "draining": gw.draining_active(&agent_id),
        "keep": gw.keep_warm(&agent_id),
        "prefetch": gw.prefetch_for(&agent_id),
    }))
    .into_response())
}

async fn list(State(gw): State<Arc<Gateway>>, RawQuery(q): RawQuery) -> Result<Response, ApiError> {
    if !gw.agents.enabled() {
        return Err(disabled());
    }
    query_params(q, &[])?;
    Ok(Json(json!({"object": "list", "ttl_ms": gw.agents.cfg.ttl_ms, "data": gw.agents_view()})).into_response())
}
