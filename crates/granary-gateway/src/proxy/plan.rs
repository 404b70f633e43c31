//! The routing plan: which upstreams to try, in which order, with the
//! prompt's blocks as each names them.

use super::*;

/// The body to send `up` for `model`: the client's, with the model named as
/// the upstream knows it. Serialized once per distinct name.
pub(super) fn payload_for(
    cache: &mut Vec<(String, Bytes)>,
    parsed: &Parsed,
    wire_model: &str,
) -> Result<Bytes, ApiError> {
    if let Some((_, b)) = cache.iter().find(|(m, _)| m == wire_model) {
        return Ok(b.clone());
    }
    let bytes = parsed.payload(wire_model)?;
    cache.push((wire_model.to_string(), bytes.clone()));
    Ok(bytes)
}

/// One routing choice: the upstream to try, and for disaggregated pools the
/// prefill engines to pair it with.
pub(super) struct Choice {
    pub(super) upstream: Arc<Upstream>,
    /// The model it serves the request as (the requested one, or a fallback).
    pub(super) model: String,
    /// The prefill engines of its pool, best partner first
    /// ([`by_prefix_hit`]); `None` outside disaggregated pools.
    pub(super) prefill: Option<Vec<Arc<Upstream>>>,
}

/// Orders prefill engines for a decode engine: the one already holding the
/// longest prefix of the prompt first (`hit`: its blocks in the KV index),
/// then the least loaded; ties keep `ranked`'s (the policy's) order.
pub(super) fn by_prefix_hit(mut ranked: Vec<Arc<Upstream>>, hit: impl Fn(&Upstream) -> usize) -> Vec<Arc<Upstream>> {
    let load = |u: &Upstream| {
        let active = u.active.load(std::sync::atomic::Ordering::Relaxed);
        // Per mille of its slots, or bare requests when it has no bound.
        match u.cfg.max_active {
            0 => active,
            max => active.saturating_mul(1000) / max,
        }
    };
    let mut keyed: Vec<(usize, usize, Arc<Upstream>)> = ranked.drain(..).map(|u| (hit(&u), load(&u), u)).collect();
    keyed.sort_by_key(|(h, l, _)| (std::cmp::Reverse(*h), *l));
    keyed.into_iter().map(|(_, _, u)| u).collect()
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
        // The pair: the decode engine by the policy (KV held, load), its
        // prefill partner by the prompt prefix it already holds, then load.
        let prefill = if prefillers.is_empty() {
            None
        } else {
            let ranked = in_order(&pool.policy.rank(&req, &cands(&prefillers)), &prefillers);
            Some(by_prefix_hit(ranked, |u| {
                let blocks = req.blocks_for(u.id);
                if blocks.is_empty() {
                    0
                } else {
                    gw.upstreams.index.prefix_match(u.id, blocks)
                }
            }))
        };
        if let Some(&first) = ranked.first() {
            pool.policy.routed(&req, first);
            let policy = pool.policy.name().to_string();
            let blocks = req.blocks_for(first);
            // The `routing` span tells of the first pool's choice.
            let span = plan.is_empty().then(tracing::Span::current);
            if let Some(span) = &span {
                span.record("granary.routing.policy", policy.as_str());
            }
            if !blocks.is_empty() {
                let hit = gw.upstreams.index.prefix_match(first, blocks);
                let block_tokens = decoders.iter().find(|u| u.id == first).map(|u| match u.kv_info() {
                    Some(info) => info.layout.block_tokens as usize,
                    None => u.cfg.kv_block_tokens,
                });
                if let (Some(span), Some(bt)) = (&span, block_tokens) {
                    span.record("granary.routing.predicted_cached_tokens", hit * bt);
                }
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
pub(super) async fn prompt_blocks<'p>(
    gw: &Arc<Gateway>,
    topo: &Topology,
    prompt: impl FnOnce() -> Option<&'p PromptText>,
    model: &str,
    p: &Principal,
) -> PromptBlocks {
    let candidates: Vec<Arc<Upstream>> = topo
        .pool_members(model)
        .filter(|(pool, _)| pool.kv_aware)
        .flat_map(|(_, members)| members.iter())
        .filter(|u| u.serves(model) && u.is_routable())
        .cloned()
        .collect();
    let jobs = jobs_for(&gw.tokenizers, model, &p.namespace, &candidates);
    if jobs.is_empty() {
        return PromptBlocks::default();
    }
    let Some(prompt) = prompt() else { return PromptBlocks::default() };
    PromptBlocks::compute(prompt.clone(), jobs).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::UpstreamConfig;

    /// Issue 14, point 4: a decode engine's prefill partner is the prefill
    /// engine holding the longest prefix of the prompt, then the least
    /// loaded; equal ones keep the policy's order.
    #[test]
    fn prefill_partners_go_by_prefix_hit_then_load() {
        let section = crate::config::GatewaySection::default();
        let cfgs: Vec<UpstreamConfig> = ["p0", "p1", "p2", "p3"]
            .iter()
            .map(|n| {
                let mut c = UpstreamConfig::new(n.to_string(), format!("http://127.0.0.1:9/{n}"));
                c.max_active = 4;
                c
            })
            .collect();
        let set = Upstreams::new(&section, &cfgs, GatewayMetrics::new(8)).unwrap();
        let list = set.list();
        let by_name = |n: &str| list.iter().find(|u| u.name() == n).unwrap().clone();
        let (p0, p1, p2, p3) = (by_name("p0"), by_name("p1"), by_name("p2"), by_name("p3"));
        // p1 and p3 hold 3 blocks of the prompt, p3 is busier; p0 and p2 none.
        p3.active.store(2, std::sync::atomic::Ordering::Relaxed);
        p0.active.store(3, std::sync::atomic::Ordering::Relaxed);
        let hits: HashMap<usize, usize> = [(p1.id, 3), (p3.id, 3)].into_iter().collect();
        let policy_order = vec![p0.clone(), p3.clone(), p2.clone(), p1.clone()];
        let names = |v: Vec<Arc<Upstream>>| v.iter().map(|u| u.name().to_string()).collect::<Vec<_>>();
        let ordered = by_prefix_hit(policy_order.clone(), |u| hits.get(&u.id).copied().unwrap_or(0));
        assert_eq!(names(ordered), ["p1", "p3", "p2", "p0"]);
        // Nothing held anywhere: by load, then the policy's order.
        p3.active.store(0, std::sync::atomic::Ordering::Relaxed);
        assert_eq!(names(by_prefix_hit(policy_order, |_| 0)), ["p3", "p2", "p1", "p0"]);
    }
}
