//! Attempts: a slot on an upstream, the request, retries before the first
//! byte, and prefill before decode in disaggregated pools.

use super::*;
use crate::upstream::SendError;

/// Takes a slot on the first upstream of `order` with room; waits (by
/// priority) when all are full. None: every one of them left routing (an
/// engine drained for an idle unload) since the request was routed.
pub(super) async fn acquire(
    gw: &Arc<Gateway>,
    order: &[Arc<Upstream>],
    p: &Principal,
) -> Result<Option<Slot>, ApiError> {
    let try_take = || order.iter().find_map(|u| u.try_acquire());
    let slot = match try_take() {
        Some(s) => s,
        None if order.iter().all(|u| u.is_removed()) => return Ok(None),
        None => {
            let prio = vec![("priority", p.priority.as_str().to_string())];
            gw.metrics.queue_waiting.get_or_create(&prio).inc();
            let t0 = Instant::now();
            let wants: Vec<usize> = order.iter().map(|u| u.id).collect();
            let got = gw.admission.acquire(p.priority, &wants, gw.cfg.queue_timeout(), try_take).await;
            gw.metrics.queue_waiting.get_or_create(&prio).dec();
            gw.metrics.queue_seconds.get_or_create(&prio).observe(t0.elapsed().as_secs_f64());
            got.ok_or_else(|| {
                ApiError::unavailable("Every upstream for this model is at capacity; try again later.")
                    .retry_after(Duration::from_secs(1))
            })?
        }
    };
    // Released, the slot's capacity goes straight to the best request
    // waiting for this upstream.
    let admission = gw.admission.clone();
    let up = slot.upstream.clone();
    Ok(Some(slot.on_release(move || admission.offer(up.id, || up.try_acquire()))))
}

/// How [`attempt_all`] ended, short of an error for the client.
pub(super) enum Attempted {
    /// The answer to pass on.
    Done(Response),
    /// Every upstream the plan named left routing before the request was
    /// sent anywhere: route it again (a load takes a draining engine back).
    Replan,
}

pub(super) enum AttemptError {
    /// Worth trying elsewhere: nothing reached the client.
    Retryable(&'static str, String),
    /// A final answer to pass on.
    Final(Response),
}

/// The headers of a generation request to `up` (its API key is added by
/// [`Upstream::post`]).
pub(super) fn headers_to(up: &Upstream, p: &Principal, request_id: &str) -> HeaderMap {
    // The trace goes on at the upstream (`traceparent`; nothing with tracing off).
    let mut h = granary_core::trace::current_headers();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    // Granary headers go to Granary engines only: a tenant's namespace is
    // its name by default, and must not reach a third party; and servers
    // may read `x-request-id` their own way (llama-cpp-python's answers a
    // bare 400 to any id that is not a UUID).
    if up.is_granary() {
        if let Ok(v) = HeaderValue::from_str(request_id) {
            h.insert(REQUEST_ID_HEADER, v);
        }
        if up.cfg.send_namespace {
            if let Ok(v) = HeaderValue::from_str(&p.namespace) {
                h.insert(NAMESPACE_HEADER, v);
            }
        }
    }
    h
}

/// The prefill half of a disaggregated pair, run once the decode engine's
/// slot is held (so a prefill is never wasted on a decode engine that has
/// no room): the first of `order` (the best partner) with a free slot
/// computes the prompt's KV into the shared warehouse. Never waits for a
/// slot. Says `ok`; `failed` (an error, a non-2xx answer, no answer within
/// the first-byte timeout); or `busy` (every prefill engine full). On
/// anything but `ok` the decode engine serves the whole request alone,
/// computing the prompt itself.
pub(super) async fn prefill_first(
    gw: &Arc<Gateway>,
    endpoint: Endpoint,
    parsed: &Parsed,
    model: &str,
    p: &Principal,
    out: &Outcome,
    order: &[Arc<Upstream>],
) -> &'static str {
    let outcome = prefill_on(gw, endpoint, parsed, model, p, out, order).await;
    gw.metrics.prefill.get_or_create(&vec![("outcome", outcome.to_string())]).inc();
    outcome
}

async fn prefill_on(
    gw: &Arc<Gateway>,
    endpoint: Endpoint,
    parsed: &Parsed,
    model: &str,
    p: &Principal,
    out: &Outcome,
    order: &[Arc<Upstream>],
) -> &'static str {
    let free = order.iter().filter(|u| u.breaker.is_available() && !u.is_removed()).find_map(|u| u.try_acquire());
    let Some(slot) = free else { return "busy" };
    let up = slot.upstream.clone();
    if !up.breaker.allow() {
        return "busy";
    }
    let mut body = parsed.body().clone();
    body.insert("stream".into(), Value::Bool(false));
    body.insert("model".into(), Value::String(up.wire_model(model).to_string()));
    body.remove("stream_options");
    let Ok(payload) = serde_json::to_vec(&body) else { return "failed" };
    // The whole prefill (its answer read to the end) within the first-byte timeout.
    let timeout = gw.cfg.first_byte_timeout();
    let headers = headers_to(&up, p, &out.rec.request_id);
    let send = async {
        let mut a = up.post(endpoint.path(), headers, payload.into()).await?;
        if a.status.is_success() {
            a.read_all(64 << 20).await?;
        }
        Ok::<_, SendError>(a.status)
    };
    let failed = |what: &'static str, why: &dyn std::fmt::Display| {
        up.attempt(what);
        up.breaker.failure();
        tracing::warn!(upstream = %up.name(), request_id = %out.rec.request_id, error = %why,
            "prefill failed; the decode engine serves the whole request");
        "failed"
    };
    match tokio::time::timeout(timeout, send).await {
        Ok(Ok(status)) if status.is_success() => {
            up.attempt("ok");
            up.breaker.success();
            "ok"
        }
        Ok(Ok(status)) if status.is_server_error() => failed("status_5xx", &status),
        Ok(Ok(status)) => {
            // The engine is up; the request is what it refused.
            up.attempt("status_4xx");
            tracing::warn!(upstream = %up.name(), status = %status, "prefill refused; the decode engine serves the whole request");
            "failed"
        }
        Err(_) => failed("timeout", &"no whole answer in time"),
        Ok(Err(e @ SendError::Connect(_))) => failed("connect_error", &e),
        Ok(Err(e)) => failed("bad_response", &e),
    }
}

pub(super) async fn attempt_all(
    gw: &Arc<Gateway>,
    out: &mut Outcome,
    endpoint: Endpoint,
    parsed: &Parsed,
    p: &Principal,
    plan: Vec<Choice>,
) -> Result<Attempted, ApiError> {
    let mut payloads: Vec<(String, Bytes)> = Vec::new();
    // The model each upstream serves the request as (the first choice
    // naming it: the requested model before fallbacks).
    let mut order: Vec<Arc<Upstream>> = Vec::new();
    let mut models: HashMap<usize, String> = HashMap::new();
    // Decode engines' prefill partners (disaggregated pools).
    let mut partners: HashMap<usize, Vec<Arc<Upstream>>> = HashMap::new();
    for c in plan {
        if let std::collections::hash_map::Entry::Vacant(e) = models.entry(c.upstream.id) {
            e.insert(c.model);
            if let Some(prefill) = c.prefill {
                partners.insert(c.upstream.id, prefill);
            }
            order.push(c.upstream);
        }
    }
    let mut tried: Vec<usize> = Vec::new();
    let mut backoff = Duration::from_millis(gw.cfg.retry_backoff_ms);
    let mut last = String::new();
    for attempt in 0..gw.cfg.max_attempts {
        // Prefer upstreams not tried yet; come back to tried ones only when
        // nothing else is left.
        let fresh: Vec<Arc<Upstream>> = order.iter().filter(|u| !tried.contains(&u.id)).cloned().collect();
        let candidates: Vec<Arc<Upstream>> = if fresh.is_empty() { order.clone() } else { fresh };
        let candidates: Vec<Arc<Upstream>> =
            candidates.into_iter().filter(|u| u.breaker.is_available() && !u.is_removed()).collect();
        if candidates.is_empty() {
            if tried.is_empty() && order.iter().all(|u| u.is_removed()) {
                return Ok(Attempted::Replan);
            }
            break;
        }
        if attempt > 0 {
            gw.metrics.retries.inc();
            tokio::time::sleep(backoff).await;
            backoff *= 2;
        }
        let Some(slot) = acquire(gw, &candidates, p).await? else {
            if tried.is_empty() {
                return Ok(Attempted::Replan);
            }
            break;
        };
        let up = slot.upstream.clone();
        if !up.breaker.allow() {
            continue;
        }
        tried.push(up.id);
        out.rec.upstream = Some(up.name().to_string());
        let model = models.get(&up.id).cloned().unwrap_or_else(|| parsed.model.clone());
        let payload = payload_for(&mut payloads, parsed, up.wire_model(&model))?;
        // A pair: the decode slot is held; its partner prefills first (once:
        // the warehouse keeps the KV for a retry on another decode engine).
        if let (None, Some(prefill)) = (out.prefill, partners.get(&up.id)) {
            out.prefill = Some(prefill_first(gw, endpoint, parsed, &model, p, out, prefill).await);
        }
        out.rec.model = Some(model);
        let span = tracing::info_span!(
            "upstream",
            "otel.kind" = "client",
            "granary.upstream" = up.name(),
            "granary.attempt" = attempt,
            "gen_ai.request.model" = out.rec.model.as_deref().unwrap_or_default(),
            "http.response.status_code" = tracing::field::Empty,
            "error.type" = tracing::field::Empty,
        );
        let tried_one = attempt_one(gw, out, endpoint, parsed, p, slot, payload).instrument(span.clone()).await;
        if let Err(AttemptError::Retryable(outcome, _)) = &tried_one {
            span.record("error.type", *outcome);
        }
        match tried_one {
            Ok(resp) => return Ok(Attempted::Done(resp)),
            Err(AttemptError::Final(resp)) => return Ok(Attempted::Done(resp)),
            Err(AttemptError::Retryable(outcome, why)) => {
                up.attempt(outcome);
                up.breaker.failure();
                tracing::warn!(upstream = %up.name(), request_id = %out.rec.request_id, attempt, error = %why, "upstream attempt failed");
                last = why;
            }
        }
    }
    let _ = last;
    Err(ApiError::bad_gateway("The upstream engines failed to answer this request; try again."))
}

pub(super) async fn attempt_one(
    gw: &Arc<Gateway>,
    out: &mut Outcome,
    endpoint: Endpoint,
    parsed: &Parsed,
    p: &Principal,
    slot: Slot,
    payload: Bytes,
) -> Result<Response, AttemptError> {
    let up = slot.upstream.clone();
    let first_byte = gw.cfg.first_byte_timeout();
    // No total timeout on the request: streams may run long; silence is
    // bounded per chunk instead.
    let send = up.post(endpoint.path(), headers_to(&up, p, &out.rec.request_id), payload);
    let resp = match tokio::time::timeout(first_byte, send).await {
        Err(_) => return Err(AttemptError::Retryable("timeout", "no response headers in time".into())),
        Ok(Err(e)) => return Err(AttemptError::Retryable("connect_error", e.to_string())),
        Ok(Ok(r)) => r,
    };
    let status = resp.status;
    tracing::Span::current().record("http.response.status_code", status.as_u16());
    if status.is_server_error() {
        return Err(AttemptError::Retryable("status_5xx", format!("status {status}")));
    }
    let content_type = resp.headers.get(header::CONTENT_TYPE).cloned();
    let is_sse =
        content_type.as_ref().and_then(|v| v.to_str().ok()).is_some_and(|v| v.starts_with("text/event-stream"));
    let mut body = resp.body;
    // The first body byte: until it arrives, a failure is retried elsewhere.
    let first = match tokio::time::timeout(first_byte, body.next()).await {
        Err(_) => return Err(AttemptError::Retryable("timeout", "no first byte in time".into())),
        Ok(Some(Err(e))) => return Err(AttemptError::Retryable("bad_response", e.to_string())),
        Ok(None) => Bytes::new(),
        Ok(Some(Ok(b))) => b,
    };
    out.first_byte();
    let code = StatusCode::from_u16(status.as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    out.rec.status = code.as_u16();
    if parsed.stream && is_sse && code.is_success() {
        up.attempt("ok");
        up.breaker.success();
        if !up.is_granary() {
            // Third-party engines may send no usage (llama.cpp's Python
            // server ignores `stream_options`) and several tokens a chunk.
            out.tokenizer = up.cfg.tokenizer.as_deref().and_then(|p| gw.tokenizers.file(p));
        }
        let owned = out.take();
        // The upstream and request spans end with the stream, not here.
        let ends = granary_core::trace::EndOnDrop::new([tracing::Span::current(), owned.span.clone()]);
        let stream = relay_sse(first, body, owned, (slot, ends), parsed.include_usage, gw.cfg.idle_timeout());
        return Ok(Response::builder()
            .status(code)
            .header(header::CONTENT_TYPE, "text/event-stream")
            .header(header::CACHE_CONTROL, "no-cache")
            .body(Body::from_stream(stream))
            .unwrap_or_else(|_| ApiError::bad_gateway("bad upstream response").into_response()));
    }
    // Whole answers: read to the end (a failure here is still retryable:
    // the client has received nothing).
    // One chunk (the usual small answer) is relayed as it came, uncopied.
    let mut more: Option<Vec<u8>> = None;
    loop {
        match tokio::time::timeout(gw.cfg.idle_timeout(), body.next()).await {
            Err(_) => return Err(AttemptError::Retryable("timeout", "upstream went silent".into())),
            Ok(Some(Err(e))) => return Err(AttemptError::Retryable("bad_response", e.to_string())),
            Ok(Some(Ok(b))) => {
                let buf = more.get_or_insert_with(|| first.to_vec());
                if buf.len() + b.len() > 64 << 20 {
                    return Err(AttemptError::Retryable("bad_response", "answer over 64 MiB".into()));
                }
                buf.extend_from_slice(&b);
            }
            Ok(None) => break,
        }
    }
    let buf: Bytes = more.map_or(first, Bytes::from);
    // Only what metering and the audit need is read (usage from the tail
    // when it is there); the answer is relayed as it came.
    let json = super::answer::read_answer(&buf, code.is_success());
    if code.is_success() && json.is_none() {
        return Err(AttemptError::Retryable("bad_response", "the upstream's answer is not a JSON object".into()));
    }
    up.attempt(if code.is_success() { "ok" } else { "status_4xx" });
    up.breaker.success();
    drop(slot);
    if let Some(key) = out.cache_key.take().filter(|k| code == StatusCode::OK && k.store) {
        if let Some(cache) = &gw.cache {
            cache.put(&key, buf.clone());
        }
    }
    if let Some(probe) = out.semantic.take().filter(|_| code == StatusCode::OK) {
        if let Some(sem) = &gw.semantic {
            sem.put(probe, buf.clone());
        }
    }
    if let Some(v) = &json {
        if let Some(u) = v.usage.and_then(|l| l.0) {
            out.usage_counts(u.counts());
        }
        if !code.is_success() {
            out.rec.error_code = v.error.as_ref().and_then(|e| e["code"].as_str()).map(str::to_string);
        }
    }
    let mut r = Response::builder().status(code);
    r = r.header(header::CONTENT_TYPE, content_type.unwrap_or(HeaderValue::from_static("application/json")));
    Err(AttemptError::Final(
        r.body(Body::from(buf)).unwrap_or_else(|_| ApiError::bad_gateway("bad upstream response").into_response()),
    ))
}
