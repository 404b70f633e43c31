//! The semantic cache's part of the request path: the prompt's embedding
//! from an engine serving the embedding model, then the lookup; the answer
//! is kept by the attempt that gets it.

use super::attempt::headers_to;
use super::*;
use crate::semantic::{normalized, prompt_text, rest_hash, Probe, SemanticCache};

/// The request's place in the semantic cache: its prompt embedded. `None`
/// when it cannot have one: a prompt with no single text, a tenant whose
/// threshold is above 1, or an embedding that failed or came too late
/// (counted as `error`; the request goes on as a miss).
pub(super) async fn probe(
    gw: &Arc<Gateway>,
    sem: &SemanticCache,
    p: &Principal,
    endpoint: Endpoint,
    body: &serde_json::Map<String, Value>,
    store: bool,
    request_id: &str,
) -> Option<Probe> {
    let threshold = sem.threshold(&p.tenant);
    if threshold > 1.0 {
        return None;
    }
    let text = prompt_text(endpoint == Endpoint::Chat, body)?;
    let limit = Duration::from_millis(sem.cfg.timeout_ms);
    let vector = match tokio::time::timeout(limit, embed(gw, &sem.cfg.embedding_model, p, &text, request_id)).await {
        Ok(Ok(v)) => v,
        Ok(Err(why)) => {
            sem.count("error");
            tracing::warn!(request_id, error = %why, "semantic cache: no embedding; the request goes on as a miss");
            return None;
        }
        Err(_) => {
            sem.count("error");
            tracing::warn!(request_id, "semantic cache: the embedding took too long; the request goes on as a miss");
            return None;
        }
    };
    Some(Probe { tenant: p.tenant_id, rest: rest_hash(endpoint.path(), body), vector, threshold, store })
}

/// The prompt's embedding (length 1) from the least busy routable
/// upstream serving `model`.
async fn embed(
    gw: &Arc<Gateway>,
    model: &str,
    p: &Principal,
    text: &str,
    request_id: &str,
) -> Result<Vec<f32>, String> {
    let topo = gw.topology();
    let up = topo
        .pool_members(model)
        .flat_map(|(_, members)| members.iter())
        .filter(|u| u.serves(model) && u.is_routable() && u.breaker.is_available())
        .min_by_key(|u| u.active.load(std::sync::atomic::Ordering::Relaxed))
        .cloned()
        .ok_or_else(|| format!("no upstream serves the embedding model `{model}`"))?;
    let body = serde_json::json!({"model": up.wire_model(model), "input": text});
    let payload = Bytes::from(serde_json::to_vec(&body).map_err(|e| e.to_string())?);
    // The whole answer within the first-byte timeout.
    let answer = async {
        let mut a =
            up.post("/v1/embeddings", headers_to(&up, p, request_id), payload).await.map_err(|e| e.to_string())?;
        let bytes = a.read_all(64 << 20).await.map_err(|e| e.to_string())?;
        Ok::<_, String>((a.status, bytes))
    };
    let (status, bytes) = tokio::time::timeout(gw.cfg.first_byte_timeout(), answer)
        .await
        .map_err(|_| format!("{}: no whole answer in time", up.name()))?
        .map_err(|e| format!("{}: {e}", up.name()))?;
    if !status.is_success() {
        return Err(format!("{}: status {status}", up.name()));
    }
    let v: Value = serde_json::from_slice(&bytes).map_err(|e| format!("{}: not JSON: {e}", up.name()))?;
    let vector = v["data"][0]["embedding"]
        .as_array()
        .and_then(|a| a.iter().map(|x| x.as_f64().map(|f| f as f32)).collect::<Option<Vec<f32>>>())
        .ok_or_else(|| format!("{}: no data[0].embedding of numbers", up.name()))?;
    normalized(vector).ok_or_else(|| format!("{}: an empty or zero embedding", up.name()))
}
