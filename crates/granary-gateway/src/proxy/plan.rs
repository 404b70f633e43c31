//! The routing plan: which upstreams to try, in which order, with the
//! prompt's blocks as each names them.

use super::*;

/// The body to send `up` for `model`: the client's, with the model named as
/// the upstream knows it. Serialized once per distinct name.
pub(super) fn payload_for(
    cache: &mut Vec<(String, Bytes)>,
    body: &serde_json::Map<String, Value>,
    wire_model: &str,
) -> Result<Bytes, ApiError> {
    if let Some((_, b)) = cache.iter().find(|(m, _)| m == wire_model) {
        return Ok(b.clone());
    }
    let mut body = body.clone();
    body.insert("model".into(), Value::String(wire_model.to_string()));
    let bytes = Bytes::from(serde_json::to_vec(&body).map_err(|e| ApiError::internal(&e))?);
    cache.push((wire_model.to_string(), bytes.clone()));
    Ok(bytes)
}

/// One routing choice: the upstream to try, and for disaggregated pools the
/// prefill engines to run first.
pub(super) struct Choice {
    pub(super) upstream: Arc<Upstream>,
    /// The model it serves the request as (the requested one, or a fallback).
    pub(super) model: String,
    pub(super) prefill: Option<Vec<Arc<Upstream>>>,
}

/// The upstreams of `list` in the order of `ids` (a policy's ranking).
pub(super) fn in_order(ids: &[usize], list: &[&Arc<Upstream>]) -> Vec<Arc<Upstream>> {
    ids.iter().filter_map(|id| list.iter().find(|u| u.id == *id).map(|u| (*u).clone())).collect()
}

pub(super) fn route(
    gw: &Arc<Gateway>,
    topo: &Topology,
    blocks: &PromptBlocks,
    model: &str,
    p: &Principal,
    headers: &HeaderMap,
) -> Vec<Choice> {
    let mut plan: Vec<Choice> = Vec::new();
    for pi in topo.pool_order(model) {
        let Some(view) = topo.pools.get(pi) else { continue };
        let pool = &view.pool;
        let serving: Vec<&Arc<Upstream>> = view.members.iter().filter(|u| u.serves(model) && u.is_routable()).collect();
        let decoders: Vec<&Arc<Upstream>> = serving.iter().copied().filter(|u| u.role() != Role::Prefill).collect();
        let prefillers: Vec<&Arc<Upstream>> = serving.iter().copied().filter(|u| u.role() == Role::Prefill).collect();
        if decoders.is_empty() {
            continue;
        }
        let (granary, by_upstream): (&[_], &[_]) =
            if pool.kv_aware { (&blocks.granary, &blocks.by_upstream) } else { (&[], &[]) };
        let session = pool.session_header.as_ref().and_then(|h| headers.get(h)).and_then(|v| v.to_str().ok());
        let req = RouteRequest { namespace: &p.namespace, session, blocks: granary, by_upstream };
        let cands = |list: &[&Arc<Upstream>]| -> Vec<Candidate> {
            list.iter()
                .map(|u| Candidate {
                    index: u.id,
                    active: u.active.load(std::sync::atomic::Ordering::Relaxed),
                    max_active: u.cfg.max_active,
                    publishes_events: u.publishes_events(),
                })
                .collect()
        };
        let ranked = pool.policy.rank(&req, &cands(&decoders));
        let prefill = if prefillers.is_empty() {
            None
        } else {
            Some(in_order(&pool.policy.rank(&req, &cands(&prefillers)), &prefillers))
        };
        if let Some(&first) = ranked.first() {
            pool.policy.routed(&req, first);
            let policy = pool.policy.name().to_string();
            let blocks = req.blocks_for(first);
            if !blocks.is_empty() {
                let hit = gw.upstreams.index.prefix_match(first, blocks);
                gw.metrics.routed_blocks.get_or_create(&vec![("policy", policy.clone())]).inc_by(blocks.len() as u64);
                gw.metrics.routed_hit_blocks.get_or_create(&vec![("policy", policy)]).inc_by(hit as u64);
            }
        }
        for u in in_order(&ranked, &decoders) {
            if !plan.iter().any(|c| c.upstream.id == u.id) {
                plan.push(Choice { upstream: u, model: model.to_string(), prefill: prefill.clone() });
            }
        }
    }
    plan
}

/// The prompt's blocks as the routable members of the kv-aware pools
/// serving `model` name them, tokenized off the async workers (empty where
/// no tokenizer or layout is known: the policy then decides by load).
pub(super) async fn prompt_blocks(
    gw: &Arc<Gateway>,
    topo: &Topology,
    prompt: Option<&PromptText>,
    model: &str,
    p: &Principal,
) -> PromptBlocks {
    let Some(prompt) = prompt else { return PromptBlocks::default() };
    let candidates: Vec<Arc<Upstream>> = topo
        .pool_members(model)
        .filter(|(pool, _)| pool.kv_aware)
        .flat_map(|(_, members)| members.iter())
        .filter(|u| u.serves(model) && u.is_routable() && u.role() != Role::Prefill)
        .cloned()
        .collect();
    let jobs = jobs_for(&gw.tokenizers, model, &p.namespace, &candidates);
    PromptBlocks::compute(prompt.clone(), jobs).await
}
