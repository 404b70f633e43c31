//! The agents' admin routes (admin token):
//!
//! | route | does |
//! | --- | --- |
//! | `POST /admin/v1/agents/heartbeat` | an agent reports its engines and loadable models ([`Heartbeat`]) → `{"ok": true, "ttl_ms"}` |
//! | `GET /admin/v1/agents` | the agents heard from within `ttl_ms`, their engines as upstreams |

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

/// The routes, behind the admin token.
pub fn admin_routes(gw: Arc<Gateway>, token: AdminToken) -> Router {
    Router::new()
        .route("/admin/v1/agents", get(list))
        .route("/admin/v1/agents/heartbeat", post(heartbeat))
        .route_layer(from_fn_with_state(token, require_admin))
        .with_state(gw)
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
    gw.heartbeat(hb)?;
    gw.start_reaper();
    Ok(Json(json!({"ok": true, "ttl_ms": gw.agents.cfg.ttl_ms})).into_response())
}

async fn list(State(gw): State<Arc<Gateway>>, RawQuery(q): RawQuery) -> Result<Response, ApiError> {
    if !gw.agents.enabled() {
        return Err(disabled());
    }
    query_params(q, &[])?;
    Ok(Json(json!({"object": "list", "ttl_ms": gw.agents.cfg.ttl_ms, "data": gw.agents_view()})).into_response())
}
