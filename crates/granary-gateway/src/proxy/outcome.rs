//! What happened to one request, recorded once when it ends: the audit
//! record, the metrics, and the settling of its token reservation.

use super::*;

/// The most streamed text kept for counting a stream's tokens, in bytes.
pub(super) const TEXT_KEPT: usize = 4 << 20;

/// What happened to one request; recorded (audit, metrics, token charge)
/// exactly once, when it is dropped — also when a client goes away
/// mid-stream.
pub(super) struct Outcome {
    pub(super) gw: Arc<Gateway>,
    /// The request's span (a streamed answer holds it open to its end).
    pub(super) span: tracing::Span,
    pub(super) start: Instant,
    pub(super) rec: AuditRecord,
    pub(super) principal: Option<Principal>,
    pub(super) ttft: Option<Duration>,
    pub(super) armed: bool,
    /// The answer was handed over whole (or the stream ran to its end);
    /// dropped before that, the client went away: status 499.
    pub(super) done: bool,
    /// The upstream's usage object arrived (then it is the truth).
    pub(super) usage_seen: bool,
    /// Completion tokens counted from streamed chunks so far.
    pub(super) streamed: u64,
    /// A third-party upstream's tokenizer (its configured file): a stream
    /// without a usage chunk is then also counted by tokenizing the text
    /// it relayed, since an upstream may send several tokens in a chunk.
    pub(super) tokenizer: Option<Arc<granary_tokenizer::Tokenizer>>,
    /// The text relayed so far, per choice, while `tokenizer` is set (at
    /// most [`TEXT_KEPT`] bytes in all; chunks past that count one each).
    pub(super) streamed_text: Vec<String>,
    /// Content chunks that came after the text kept was full.
    pub(super) streamed_untexted: u64,
    /// The prompt's size in tokens (estimated from its bytes unless it was
    /// tokenized for routing), for a stream without a usage chunk.
    pub(super) prompt_estimate: u64,
    /// What the limits left, for the response's `x-ratelimit-*` headers.
    pub(super) quota: Quota,
    /// The tokens reserved at admission; settled with the real usage on drop.
    pub(super) reservation: Option<Reservation>,
    /// Where a deterministic request's answer is kept, once it comes.
    pub(super) cache_key: Option<CacheKey>,
    /// `hit` or `miss`, for the `x-granary-cache` header.
    pub(super) cache_state: Option<&'static str>,
    /// On a hit, `exact` or `semantic`, for `x-granary-cache-match`.
    pub(super) cache_match: Option<&'static str>,
    /// Where the semantic cache keeps the answer, once it comes.
    pub(super) semantic: Option<crate::semantic::Probe>,
    /// Where a load this request waited on went, for `x-granary-placement`.
    pub(super) placement: Option<String>,
    /// How a disaggregated pair's prefill went, for `x-granary-prefill`.
    pub(super) prefill: Option<&'static str>,
}

impl Outcome {
    pub(super) fn new(gw: Arc<Gateway>, endpoint: Endpoint, request_id: String, span: tracing::Span) -> Outcome {
        gw.metrics.active.inc();
        let rec = AuditRecord {
            time_ms: now_ms(),
            request_id,
            endpoint: endpoint.path().to_string(),
            status: 200,
            ..Default::default()
        };
        Outcome {
            gw,
            span,
            start: Instant::now(),
            rec,
            principal: None,
            ttft: None,
            armed: true,
            done: false,
            usage_seen: false,
            streamed: 0,
            tokenizer: None,
            streamed_text: Vec::new(),
            streamed_untexted: 0,
            prompt_estimate: 0,
            quota: Quota::default(),
            reservation: None,
            cache_key: None,
            cache_state: None,
            cache_match: None,
            semantic: None,
            placement: None,
            prefill: None,
        }
    }

    /// Moves the record into a new owner (a response stream).
    pub(super) fn take(&mut self) -> Outcome {
        self.armed = false;
        Outcome {
            gw: self.gw.clone(),
            span: self.span.clone(),
            start: self.start,
            rec: self.rec.clone(),
            principal: self.principal.clone(),
            ttft: self.ttft,
            armed: true,
            done: false,
            usage_seen: self.usage_seen,
            streamed: self.streamed,
            tokenizer: self.tokenizer.clone(),
            streamed_text: std::mem::take(&mut self.streamed_text),
            streamed_untexted: self.streamed_untexted,
            prompt_estimate: self.prompt_estimate,
            quota: self.quota,
            reservation: self.reservation.take(),
            cache_key: None,
            cache_state: self.cache_state,
            cache_match: self.cache_match,
            semantic: None,
            placement: self.placement.clone(),
            prefill: self.prefill,
        }
    }

    pub(super) fn fail(&mut self, e: &ApiError) {
        self.rec.status = e.status.as_u16();
        self.rec.error_code = e.code.map(str::to_string);
    }

    /// A stream that had started broke: the client saw a 200, the record
    /// says what happened.
    pub(super) fn broke(&mut self, status: u16, code: &str) {
        self.rec.status = status;
        self.rec.error_code = Some(code.to_string());
    }

    /// The answer is complete (or ended by the upstream): not the client's
    /// hang-up.
    pub(super) fn finished(&mut self) {
        self.done = true;
    }

    pub(super) fn first_byte(&mut self) {
        if self.ttft.is_none() {
            self.ttft = Some(self.start.elapsed());
        }
    }

    /// Counts a streamed chunk's new output: a token per choice that has
    /// some, and its text kept for tokenizing when a tokenizer is known.
    pub(super) fn streamed_chunk(&mut self, v: &Value) {
        self.streamed += super::relay::content_choices(v);
        if self.tokenizer.is_none() {
            return;
        }
        let Some(choices) = v.get("choices").and_then(Value::as_array) else { return };
        for c in choices {
            let d = &c["delta"];
            let parts = [&d["content"], &d["reasoning_content"], &c["text"]];
            let text: String = parts.iter().filter_map(|x| x.as_str()).collect();
            if text.is_empty() {
                continue;
            }
            let kept: usize = self.streamed_text.iter().map(String::len).sum();
            if kept + text.len() > TEXT_KEPT {
                self.streamed_untexted += 1;
                continue;
            }
            let i = c["index"].as_u64().unwrap_or(0).min(64) as usize;
            if self.streamed_text.len() <= i {
                self.streamed_text.resize(i + 1, String::new());
            }
            self.streamed_text[i].push_str(&text);
        }
    }

    /// The completion tokens of a stream that sent no usage: one per
    /// content chunk and choice (a lower bound: every such chunk holds a
    /// token at least), or, with the upstream's tokenizer, the relayed
    /// text's tokens where that is more (an upstream that packs several
    /// tokens into a chunk).
    pub(super) fn streamed_tokens(&self) -> u64 {
        let Some(tok) = &self.tokenizer else { return self.streamed };
        let texted: u64 =
            self.streamed_text.iter().map(|t| tok.encode(t, false).map_or(0, |ids| ids.len() as u64)).sum();
        self.streamed.max(texted + self.streamed_untexted)
    }

    /// Reads the `usage` member of an answer or chunk `v`, if it has one.
    pub(super) fn usage(&mut self, v: &Value) {
        if let Some(u) = v.get("usage") {
            self.usage_object(u);
        }
    }

    /// Reads a `usage` object (anything else is no usage).
    pub(super) fn usage_object(&mut self, u: &Value) {
        let n = |x: &Value| x.as_u64().unwrap_or(0);
        if u.is_object() {
            self.usage_counts((
                n(&u["prompt_tokens"]),
                n(&u["completion_tokens"]),
                n(&u["prompt_tokens_details"]["cached_tokens"]),
            ));
        }
    }

    /// The upstream's (prompt, completion, cached) token counts.
    pub(super) fn usage_counts(&mut self, (prompt, completion, cached): (u64, u64, u64)) {
        self.usage_seen = true;
        self.rec.prompt_tokens = prompt;
        self.rec.completion_tokens = completion;
        self.rec.cached_tokens = cached;
    }
}

impl Drop for Outcome {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        if !self.done {
            // The client went away before the answer was complete: the
            // upstream request is already dropped with the future or stream
            // that owned it.
            self.rec.status = 499;
            self.rec.error_code = Some("client_closed_request".into());
        }
        if !self.usage_seen && self.streamed > 0 {
            // A stream without a usage chunk (cut before it, or an upstream
            // that sends none): charge what was relayed.
            self.rec.completion_tokens = self.streamed_tokens();
            self.rec.prompt_tokens = self.prompt_estimate;
        } else if !self.usage_seen && !self.done && self.rec.upstream.as_deref().is_some_and(|u| u != CACHE_UPSTREAM) {
            // The client went away after its request reached an engine but
            // before a token reached the client (during prefill, or while
            // a whole answer was being generated): the engine computed the
            // prompt for it, so the prompt is charged.
            self.rec.prompt_tokens = self.prompt_estimate;
        }
        let m = &self.gw.metrics;
        m.active.dec();
        let elapsed = self.start.elapsed();
        self.rec.latency_ms = elapsed.as_secs_f64() * 1e3;
        self.rec.ttft_ms = self.ttft.map(|t| t.as_secs_f64() * 1e3);
        let series = m.request_series(self.rec.tenant.as_deref(), self.rec.model.as_deref());
        series.requests(m, self.rec.status).inc();
        series.latency(m).observe(elapsed.as_secs_f64());
        if let Some(t) = self.ttft {
            series.ttft(m).observe(t.as_secs_f64());
        }
        for (kind, n) in
            [self.rec.prompt_tokens, self.rec.completion_tokens, self.rec.cached_tokens].into_iter().enumerate()
        {
            if n > 0 {
                series.tokens(m, kind).inc_by(n);
            }
        }
        let spent = self.rec.prompt_tokens + self.rec.completion_tokens;
        if let Some(p) = self.principal.take() {
            let limiter = self.gw.limiter.clone();
            let reservation = self.reservation.take().unwrap_or_default();
            // At the price of the model that served it (a fallback's own).
            let cost = match self.rec.model.as_deref() {
                Some(model) if spent > 0 => self.gw.cfg.prices.spend(
                    model,
                    self.rec.prompt_tokens,
                    self.rec.cached_tokens,
                    self.rec.completion_tokens,
                ),
                _ => crate::pricing::Money(0),
            };
            if cost.0 > 0 {
                m.cost
                    .get_or_create(&vec![
                        ("tenant", m.tenant_label(self.rec.tenant.as_deref())),
                        ("model", m.model_label(self.rec.model.as_deref())),
                        ("currency", self.gw.cfg.prices.currency.clone()),
                    ])
                    .inc_by(cost.units());
            }
            // Settling releases what was reserved and not used, so it runs
            // also when nothing was spent.
            if (spent != reservation.tokens || cost != reservation.spend)
                && !limiter.settle_spend_now(&p, &reservation, spent, cost)
            {
                if let Ok(rt) = tokio::runtime::Handle::try_current() {
                    rt.spawn(async move { limiter.settle_spend(&p, &reservation, spent, cost).await });
                }
            }
        }
        self.gw.observe_request(self.rec.tenant.as_deref(), self.rec.model.as_deref(), self.rec.upstream.as_deref());
        // A request no key authenticated is counted in the metrics above
        // (status 401), not audited: the audit log is the billing record,
        // and a flood of bad keys must not take its queue's places.
        if self.rec.status == 401 && self.rec.tenant.is_none() {
            return;
        }
        self.gw.identity.record(std::mem::take(&mut self.rec));
    }
}
