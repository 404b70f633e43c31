//! The step loop: one OS thread that admits sequences, runs one forward
//! pass per step over every running sequence (a token for each decoding
//! one, prefill chunks up to the token budget), samples, and saves the
//! blocks that steps complete.

use std::collections::VecDeque;
use std::sync::mpsc as std_mpsc;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;
use bytes::Bytes;
use granary_core::hash::{BlockHash, HashChain};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::sync::mpsc;

use tracing::Instrument;

use super::device_pick::{self, Outcome, Want};
use super::{preempt, sampler, Admitted, Fault, KvEvent, Role, SaveJob, Shared, Source};
use crate::model::{Chunk, KvCache};
use crate::{Event, FinishReason, GenerateRequest, Usage};

/// Blocks of `s` from `s.blocks_known` up to its computed prompt, exported.
fn export_new_blocks(bt: usize, s: &mut Seq) -> Vec<(BlockHash, Bytes)> {
    let full = (s.prompt_done / bt).min(s.hashes.len());
    let mut out = Vec::new();
    for i in s.blocks_known..full {
        match s.kv.export_block(i, bt) {
            Ok(b) => out.push((s.hashes[i], b)),
            Err(e) => {
                tracing::warn!(error = %e, block = i, "exporting a KV block failed");
                break;
            }
        }
    }
    s.blocks_known = full;
    out
}

pub(super) struct Seq {
    pub(super) req: GenerateRequest,
    pub(super) tx: mpsc::UnboundedSender<Event>,
    pub(super) hashes: Vec<BlockHash>,
    pub(super) kv: KvCache,
    /// Prompt tokens whose KV is in `kv` (tokens of `replay` while it is
    /// replayed).
    pub(super) prompt_done: usize,
    /// Prompt tokens to compute before the sequence is done with its prompt.
    pub(super) prompt_target: usize,
    /// Tokens to compute again before decoding goes on: prompt and output
    /// of a sequence resumed without its KV (see `preempt`); empty otherwise.
    pub(super) replay: Vec<u32>,
    /// Blocks already held by the engine cache or the warehouse.
    pub(super) blocks_known: usize,
    cached_tokens: usize,
    generated: usize,
    input: [u32; 1],
    /// Generated tokens, in order (their KV follows the prompt's).
    pub(super) output: Vec<u32>,
    rng: StdRng,
    /// Tokens seen, for the penalties.
    history: sampler::History,
    pub(super) arrived: Instant,
    last_token: Option<Instant>,
    /// Open while the prompt is computed (`prefill`), and until the first
    /// token (`first_token`); closing ends the span.
    prefill_span: Option<tracing::Span>,
    first_token_span: Option<tracing::Span>,
    /// The request's span: saves of its blocks are traced under it.
    pub(super) request_span: tracing::Span,
    /// While fewer than `min_tokens` are generated: the length of
    /// `logit_bias` before the stop tokens' masks were appended to it.
    stops_masked: Option<usize>,
}

/// Keeps the stop tokens from being sampled until `min_tokens` are
/// generated, by appending a bias of minus infinity for each to the
/// request's `logit_bias` (applied the same on the host and the device).
/// Returns the length to cut `logit_bias` back to once they may end the
/// answer; None when nothing was masked.
fn mask_stop_tokens(req: &mut GenerateRequest) -> Option<usize> {
    if req.min_tokens == 0 || req.stop_token_ids.is_empty() {
        return None;
    }
    let len = req.sampling.logit_bias.len();
    req.sampling.logit_bias.extend(req.stop_token_ids.iter().map(|&id| (id, f32::NEG_INFINITY)));
    Some(len)
}

pub(super) struct StepLoop {
    pub(super) sh: Arc<Shared>,
    rx: std_mpsc::Receiver<Admitted>,
    saver: mpsc::Sender<SaveJob>,
    waiting: VecDeque<Admitted>,
    pub(super) running: Vec<Seq>,
    /// Sequences set aside for memory, and those being loaded back.
    pub(super) parked: preempt::Parked,
}

impl StepLoop {
    pub(super) fn new(sh: Arc<Shared>, rx: std_mpsc::Receiver<Admitted>, saver: mpsc::Sender<SaveJob>) -> Self {
        StepLoop { sh, rx, saver, waiting: VecDeque::new(), running: Vec::new(), parked: preempt::Parked::new() }
    }

    pub(super) fn run(mut self) {
        // Marks the thread dead however it ends (a panic included): health
        // checks and new requests see it.
        let _alive = AliveGuard(self.sh.clone());
        loop {
            self.sh.health.beat();
            if self.running.is_empty() {
                if self.parked.loading() > 0 {
                    // Nothing to step until a sequence is read back.
                    self.parked.wait_for_resumed(std::time::Duration::from_millis(20));
                } else if self.waiting.is_empty() && self.parked.is_empty() {
                    match self.rx.recv() {
                        Ok(a) => self.waiting.push_back(a),
                        Err(_) => return,
                    }
                }
            }
            while let Ok(a) = self.rx.try_recv() {
                self.waiting.push_back(a);
            }
            self.take_back_resumed();
            self.drop_cancelled();
            // Running sequences outgrowing the budget are set aside; those
            // set aside come back before any new request is admitted.
            self.make_room();
            let mut used = self.blocks_in_use();
            let all_back = self.resume_parked(&mut used);
            // Admission in arrival order: the next request runs once its
            // prompt (and the first generated token) fit in the KV budget
            // beside the running ones' blocks (no later request overtakes it).
            while all_back && self.running.len() + self.parked.loading() < self.sh.cfg.max_running {
                let Some(next) = self.waiting.front() else { break };
                let need = self.admission_need(&next.req);
                if used + need > self.sh.kv_budget_blocks && !(self.running.is_empty() && self.parked.is_empty()) {
                    break;
                }
                used += need;
                let Some(a) = self.waiting.pop_front() else { break };
                self.sh.metrics.waiting.dec();
                if let Some(Fault::KillThread(t)) = self.sh.cfg.fault {
                    if a.req.prompt.contains(&t) {
                        panic!("injected fault: the step thread stops");
                    }
                }
                if let Some(seq) = self.start(a) {
                    self.running.push(seq);
                }
            }
            self.sh.metrics.running.set(self.running.len() as i64);
            self.contained_step();
            self.update_gauges();
        }
    }

    /// One step; a failure (an error or a panic) fails only the sequences
    /// it comes from. After a failed batch every sequence's KV is cut back
    /// to where it was and each is stepped alone: those that fail again end
    /// with an error, the others go on.
    fn contained_step(&mut self) {
        let lens: Vec<usize> = self.running.iter().map(|s| s.kv.len()).collect();
        let Err(e) = self.guarded_step() else { return };
        for (s, &n) in self.running.iter_mut().zip(&lens) {
            s.kv.truncate(n);
        }
        if self.running.len() > 1 {
            tracing::warn!(error = %e, sequences = self.running.len(), "a step failed; stepping its sequences one by one");
        }
        let all = std::mem::take(&mut self.running);
        let alone = all.len() == 1;
        let mut kept = Vec::with_capacity(all.len());
        for seq in all {
            let n = seq.kv.len();
            self.running = vec![seq];
            let result = if alone { Err(e.clone()) } else { self.guarded_step() };
            match result {
                Ok(()) => kept.append(&mut self.running),
                Err(e) => {
                    for mut s in self.running.drain(..) {
                        s.kv.truncate(n);
                        tracing::error!(error = %e, "a step failed; failing its request");
                        let _ = s.tx.send(Event::Failed(format!("engine step failed: {e}")));
                        self.sh.metrics.outcome("failed");
                    }
                }
            }
        }
        self.running = kept;
    }

    /// [`StepLoop::step`] with a panic turned into an error.
    fn guarded_step(&mut self) -> Result<(), String> {
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.step())) {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(format!("{e:#}")),
            Err(p) => {
                let msg = p
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| p.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "unknown panic".into());
                Err(format!("panicked: {msg}"))
            }
        }
    }

    /// Blocks a waiting request needs to join: its prompt and the first
    /// generated token.
    fn admission_need(&self, req: &GenerateRequest) -> usize {
        let generates = usize::from(self.sh.cfg.role != Role::Prefill);
        (req.prompt.len() + generates).div_ceil(self.sh.cfg.block_tokens)
    }

    fn update_gauges(&self) {
        self.sh.metrics.kv_reserved_blocks.set(self.blocks_in_use() as i64);
        self.parked.update_gauges(&self.sh.metrics);
        self.sh.metrics.kv_budget_blocks.set(self.sh.kv_budget_blocks as i64);
        let bt = self.sh.cfg.block_tokens;
        let in_seqs: usize = self.running.iter().map(|s| s.kv.len().div_ceil(bt)).sum();
        self.sh.metrics.resident.get_or_create(&vec![("holder", "sequences")]).set(in_seqs as i64);
        self.sh.metrics.resident.get_or_create(&vec![("holder", "cache")]).set(self.sh.cache.len() as i64);
        self.sh.metrics.running.set(self.running.len() as i64);
    }

    fn drop_cancelled(&mut self) {
        let m = &self.sh.metrics;
        self.running.retain(|s| {
            let keep = !s.tx.is_closed();
            if !keep {
                m.outcome("cancelled");
            }
            keep
        });
        self.waiting.retain(|a| {
            let keep = !a.tx.is_closed();
            if !keep {
                m.waiting.dec();
                m.outcome("cancelled");
            }
            keep
        });
        self.parked.drop_cancelled(m);
    }

    /// Imports the fetched prefix and decides what is left to compute.
    fn start(&mut self, a: Admitted) -> Option<Seq> {
        let sh = self.sh.clone();
        let bt = sh.cfg.block_tokens;
        let layers = sh.model.config().layers;
        let mut kv = sh.model.new_kv(bt);
        let prompt_len = a.req.prompt.len();
        let mut sources = Vec::new();
        for (i, (bytes, source)) in a.loaded.iter().enumerate() {
            if let Err(e) = kv.import_block(layers, i, bt, bytes.clone()) {
                tracing::warn!(error = %e, block = i, "unusable KV block; computing from here");
                break;
            }
            sources.push(*source);
        }
        if let Some((bytes, n)) = a.tail.as_ref().filter(|_| sources.len() == a.hashes.len()) {
            // Positions past `n` hold other tokens' KV: cut off, and written
            // over (on a copy) as this sequence computes its own.
            let at = sources.len();
            let block = super::cache::expand_tail(&sh.layout, bytes)
                .ok_or_else(|| anyhow::anyhow!("a partial block of {} bytes does not fit this layout", bytes.len()));
            match block.and_then(|b| kv.import_block(layers, at, bt, b)) {
                Ok(()) => kv.truncate(at * bt + n),
                Err(e) => tracing::warn!(error = %e, block = at, "unusable partial KV block; computing from here"),
            }
        }
        let role = sh.cfg.role;
        // Logits need at least one computed token: a fully cached prompt
        // recomputes its last token only.
        if role != Role::Prefill && kv.len() >= prompt_len {
            kv.truncate(prompt_len - 1);
        }
        let cached = kv.len();
        for (i, src) in sources.iter().enumerate() {
            let n = bt.min(cached.saturating_sub(i * bt));
            sh.metrics.add_prompt_tokens(*src, n);
        }
        sh.metrics.add_prompt_tokens(Source::Engine, cached.saturating_sub(sources.len() * bt));
        // Blocks taken from the warehouse are kept in engine memory too.
        let from_store: Vec<(BlockHash, Bytes)> = a
            .loaded
            .iter()
            .zip(&a.hashes)
            .take(sources.len())
            .filter(|((_, s), _)| *s != Source::Engine)
            .map(|((b, _), h)| (*h, b.clone()))
            .collect();
        sh.cache.insert(&a.req.namespace, from_store);
        let prompt_target = if role == Role::Prefill { prompt_len / bt * bt } else { prompt_len };
        sh.metrics.add_prompt_tokens(Source::Computed, prompt_target.saturating_sub(cached));
        let _ = a.tx.send(Event::Started { cached_tokens: cached });
        let computed = prompt_target.saturating_sub(cached);
        let prefill_span = (computed > 0).then(|| {
            tracing::info_span!(
                parent: &a.spans.request,
                "prefill",
                "granary.prefill.tokens" = computed,
                "granary.cached_tokens" = cached,
                "gen_ai.usage.input_tokens" = prompt_len,
            )
        });
        let seed = a.req.sampling.seed.unwrap_or_else(rand::random);
        let mut req = a.req;
        let stops_masked = mask_stop_tokens(&mut req);
        let seq = Seq {
            hashes: a.hashes,
            kv,
            prompt_done: cached,
            prompt_target,
            replay: Vec::new(),
            blocks_known: sources.len(),
            cached_tokens: cached,
            generated: 0,
            input: [0],
            output: Vec::new(),
            rng: StdRng::seed_from_u64(seed),
            history: sampler::History::new(&req.sampling, &req.prompt),
            arrived: a.arrived,
            last_token: None,
            prefill_span,
            first_token_span: Some(a.spans.first_token),
            request_span: a.spans.request,
            tx: a.tx,
            stops_masked,
            req,
        };
        if role == Role::Prefill && seq.prompt_done >= seq.prompt_target {
            self.finish_prefill_role(seq);
            return None;
        }
        Some(seq)
    }

    fn usage(s: &Seq) -> Usage {
        Usage { prompt_tokens: s.req.prompt.len(), completion_tokens: s.generated, cached_tokens: s.cached_tokens }
    }

    /// Queues a save; a full queue drops it (saving never delays a step).
    fn queue_save(&mut self, job: SaveJob) {
        let n = job.blocks.len() as u64;
        if self.saver.try_send(job).is_err() {
            self.sh.metrics.save("dropped", n);
        }
    }

    /// A prefill-role request is answered once its blocks are written.
    fn finish_prefill_role(&mut self, mut s: Seq) {
        let blocks = export_new_blocks(self.sh.cfg.block_tokens, &mut s);
        self.cache_blocks(&s.req.namespace, &blocks);
        let usage = Self::usage(&s);
        self.sh.metrics.outcome("finished");
        self.sh.metrics.request_seconds.observe(s.arrived.elapsed().as_secs_f64());
        if self.sh.store.is_none() || blocks.is_empty() {
            let _ = s.tx.send(Event::Finished { reason: FinishReason::Length, usage });
            return;
        }
        // Awaited, not queued: the caller relies on the blocks being there.
        let sh = self.sh.clone();
        let ns = s.req.namespace.clone();
        let tx = s.tx.clone();
        let span = save_span(&s.request_span, blocks.len());
        self.sh.runtime.spawn(async move {
            let n = blocks.len() as u64;
            let hashes: Vec<String> = blocks.iter().map(|(h, _)| h.to_hex()).collect();
            let store = sh.store.as_ref().expect("checked above");
            match store.put_many(blocks).instrument(span).await {
                Ok(()) => {
                    sh.metrics.save("saved", n);
                    sh.cache.publish(KvEvent { kind: "stored", namespace: ns, tier: "warehouse", hashes });
                    let _ = tx.send(Event::Finished { reason: FinishReason::Length, usage });
                }
                Err(e) => {
                    sh.metrics.save("failed", n);
                    sh.metrics.warehouse_errors.inc();
                    let _ = tx.send(Event::Failed(format!("writing KV blocks to the warehouse failed: {e}")));
                }
            }
        });
    }

    /// Names, keeps and saves the full blocks of sequence `i` past its
    /// prompt: prompt and generated tokens whose KV is computed (the last
    /// sampled token's is not yet).
    fn save_generated_blocks(&mut self, i: usize) {
        let bt = self.sh.cfg.block_tokens;
        let s = &mut self.running[i];
        if s.prompt_done < s.prompt_target || s.kv.len() / bt <= s.blocks_known {
            return;
        }
        let full = s.kv.len() / bt;
        if s.hashes.len() < full {
            let tokens: Vec<u32> = s.req.prompt.iter().chain(&s.output).copied().take(full * bt).collect();
            let chain =
                HashChain::for_layout(&s.req.namespace, self.sh.model.fingerprint().as_bytes(), &self.sh.layout);
            s.hashes = chain.hashes(&tokens);
        }
        let mut blocks = Vec::new();
        for b in s.blocks_known..full {
            match s.kv.export_block(b, bt) {
                Ok(payload) => blocks.push((s.hashes[b], payload)),
                Err(e) => {
                    tracing::warn!(error = %e, block = b, "exporting a KV block failed");
                    break;
                }
            }
        }
        s.blocks_known = full;
        if blocks.is_empty() {
            return;
        }
        let ns = s.req.namespace.clone();
        let span = save_span(&s.request_span, blocks.len());
        self.cache_blocks(&ns, &blocks);
        if self.sh.store.is_some() {
            self.queue_save(SaveJob { namespace: ns, blocks, span });
        }
    }

    /// Keeps the partial blocks of a finished sequence in engine memory, so
    /// that a request repeating its prompt, or continuing its answer (a
    /// chat's next turn), computes only what follows: the block holding the
    /// end of its prompt when generated tokens filled it, and its last,
    /// unfilled block.
    fn keep_tails(&mut self, i: usize) {
        let bt = self.sh.cfg.block_tokens;
        let s = &mut self.running[i];
        let len = s.kv.len();
        let prompt_len = s.req.prompt.len();
        if len > prompt_len + s.output.len() {
            return;
        }
        let root =
            || HashChain::for_layout(&s.req.namespace, self.sh.model.fingerprint().as_bytes(), &self.sh.layout).root();
        let parent = |b: usize| if b == 0 { Some(root()) } else { s.hashes.get(b - 1).copied() };
        let (pb, last) = (prompt_len / bt, len / bt);
        let (prompt_parent, last_parent) = (parent(pb), parent(last));
        let mut keep = Vec::new();
        // The prompt's part of the block holding its end, when generated
        // tokens filled that block (the whole block is a named one).
        if !prompt_len.is_multiple_of(bt) && (pb + 1) * bt <= len {
            if let (Some(p), Ok(bytes)) = (prompt_parent, s.kv.export_block(pb, bt)) {
                keep.push((p, pb * bt..prompt_len, bytes));
            }
        }
        if !len.is_multiple_of(bt) {
            if let (Some(p), Ok(bytes)) = (last_parent, s.kv.export_last_block(last, bt)) {
                keep.push((p, last * bt..len, bytes));
            }
        }
        for (p, range, bytes) in keep {
            // The tail's tokens alone (not the whole sequence's).
            let tokens: Vec<u32> =
                s.req.prompt.iter().chain(&s.output).skip(range.start).take(range.len()).copied().collect();
            let tail = super::cache::compact_tail(&self.sh.layout, &bytes, range.len());
            self.sh.cache.insert_tail(p, &tokens, tail);
        }
    }

    fn cache_blocks(&self, namespace: &str, blocks: &[(BlockHash, Bytes)]) {
        self.sh.cache.insert(namespace, blocks.to_vec());
    }

    fn step(&mut self) -> Result<()> {
        if self.running.is_empty() {
            return Ok(());
        }
        let started = Instant::now();
        let mut budget = self.sh.cfg.max_batch_tokens;
        // (index, start, len, wants logits)
        let mut plan: Vec<(usize, usize, usize, bool)> = Vec::new();
        for (i, s) in self.running.iter().enumerate() {
            if s.prompt_done >= s.prompt_target {
                plan.push((i, 0, 1, true));
                budget = budget.saturating_sub(1);
            }
        }
        for (i, s) in self.running.iter().enumerate() {
            if budget == 0 {
                break;
            }
            if s.prompt_done < s.prompt_target {
                let take = (s.prompt_target - s.prompt_done).min(budget);
                let completes = s.prompt_done + take == s.prompt_target;
                // A replay ends where the sequence's next input is known.
                let logits = completes && self.sh.cfg.role != Role::Prefill && s.output.is_empty();
                plan.push((i, s.prompt_done, take, logits));
                budget -= take;
            }
        }
        plan.sort_by_key(|p| p.0);
        let (mut prefill_tokens, mut decode_tokens) = (0usize, 0usize);
        let logits = {
            let mut chunks = Vec::with_capacity(plan.len());
            let mut pi = 0;
            for (i, s) in self.running.iter_mut().enumerate() {
                if pi < plan.len() && plan[pi].0 == i {
                    let (_, start, len, want) = plan[pi];
                    let tokens: &[u32] = if s.prompt_done < s.prompt_target {
                        prefill_tokens += len;
                        let from = if s.replay.is_empty() { &s.req.prompt } else { &s.replay };
                        &from[start..start + len]
                    } else {
                        decode_tokens += 1;
                        &s.input
                    };
                    inject(self.sh.cfg.fault, tokens)?;
                    chunks.push(Chunk { tokens, kv: &mut s.kv, logits: want });
                    pi += 1;
                }
            }
            self.sh.model.forward(&mut chunks)?
        };
        let outcomes: Vec<Outcome> = match logits {
            // The tensor path: the choice is made where the logits are.
            Some(t) if !self.sh.model.host_kernels() => {
                let vocab = t.dim(1)?;
                // Grammar masks and draws change the sequences; the choice
                // then reads them.
                let mut prep = Vec::new();
                for &(i, ..) in plan.iter().filter(|p| p.3) {
                    let s = &mut self.running[i];
                    let allowed = s.req.constraint.as_mut().map(|c| c.allowed(vocab)).transpose();
                    let uniform = if s.req.sampling.temperature > 0.0 { s.rng.random::<f32>() } else { 0.0 };
                    prep.push((i, allowed, uniform));
                }
                let mut out: Vec<Option<Outcome>> = prep.iter().map(|_| None).collect();
                let mut wants = Vec::new();
                for (row, (i, allowed, uniform)) in prep.into_iter().enumerate() {
                    match allowed {
                        Err(e) => out[row] = Some(Outcome::Failed(e.to_string())),
                        Ok(allowed) => {
                            let s = &self.running[i];
                            wants.push(Want { row, sampling: &s.req.sampling, history: &s.history, allowed, uniform });
                        }
                    }
                }
                let (chosen, moved) = device_pick::choose(&t, &wants)?;
                self.sh.metrics.logits_to_host.inc_by(moved as u64);
                for (w, o) in wants.iter().zip(chosen) {
                    out[w.row] = Some(o);
                }
                out.into_iter().map(|o| o.expect("an outcome per row")).collect()
            }
            Some(t) => {
                let rows = t.to_vec2::<f32>()?;
                let seqs = plan.iter().filter(|p| p.3).map(|p| p.0);
                seqs.zip(rows).map(|(i, row)| choose_on_host(&mut self.running[i], row)).collect()
            }
            None => Vec::new(),
        };
        let elapsed = started.elapsed().as_secs_f64().max(1e-9);
        if prefill_tokens > 0 {
            self.sh
                .metrics
                .tokens_per_second
                .get_or_create(&vec![("phase", "prefill")])
                .set(prefill_tokens as f64 / elapsed);
        }
        if decode_tokens > 0 {
            self.sh
                .metrics
                .tokens_per_second
                .get_or_create(&vec![("phase", "decode")])
                .set(decode_tokens as f64 / elapsed);
        }
        // Apply results; remember which sequences end.
        let mut outcomes = outcomes.into_iter();
        let mut finished: Vec<usize> = Vec::new();
        // Sent once the finished sequences' blocks are kept, so that a
        // request sent on their answer finds them.
        let mut endings: Vec<Event> = Vec::new();
        // Sequences whose grammar failed (their error is sent already).
        let mut failed: Vec<usize> = Vec::new();
        let mut prefill_done: Vec<usize> = Vec::new();
        for &(i, _, len, want) in &plan {
            let s = &mut self.running[i];
            let was_prefill = s.prompt_done < s.prompt_target;
            if was_prefill {
                s.prompt_done += len;
                if s.prompt_done >= s.prompt_target {
                    prefill_done.push(i);
                    s.prefill_span = None;
                }
            }
            if !want {
                continue;
            }
            let picked = outcomes.next().expect("an outcome per chunk that asked");
            let now = Instant::now();
            let (tok, logprobs) = match picked {
                Outcome::Token { token, logprobs } => (token, logprobs),
                Outcome::Failed(e) => {
                    let _ = s.tx.send(Event::Failed(format!("the output grammar failed: {e}")));
                    failed.push(i);
                    continue;
                }
            };
            if s.last_token.is_none() {
                self.sh.metrics.ttft.observe(now.duration_since(s.arrived).as_secs_f64());
                s.first_token_span = None;
            } else if let Some(prev) = s.last_token {
                self.sh.metrics.tpot.observe(now.duration_since(prev).as_secs_f64());
            }
            s.last_token = Some(now);
            if s.req.stop_token_ids.contains(&tok) {
                endings.push(Event::Finished { reason: FinishReason::Stop, usage: Self::usage(s) });
                finished.push(i);
                continue;
            }
            if s.generated >= s.req.max_tokens {
                endings.push(Event::Finished { reason: FinishReason::Length, usage: Self::usage(s) });
                finished.push(i);
                continue;
            }
            if let Some(c) = s.req.constraint.as_mut() {
                if let Err(e) = c.accept(tok) {
                    let _ = s.tx.send(Event::Failed(format!("the output grammar failed: {e}")));
                    failed.push(i);
                    continue;
                }
            }
            s.generated += 1;
            if let Some(len) = s.stops_masked.filter(|_| s.generated >= s.req.min_tokens) {
                // `min_tokens` reached: the stop tokens may end the answer.
                s.req.sampling.logit_bias.truncate(len);
                s.stops_masked = None;
            }
            s.output.push(tok);
            s.history.push(tok);
            self.sh.metrics.generated.inc();
            if let Some(l) = logprobs {
                let _ = s.tx.send(Event::Logprobs(Box::new(l)));
            }
            let _ = s.tx.send(Event::Token(tok));
            s.input = [tok];
            let out_of_room = s.kv.len() + 1 > self.sh.model.context_len();
            if s.req.constraint.as_ref().is_some_and(|c| c.is_finished()) {
                // The grammar is complete: nothing but an end may follow.
                endings.push(Event::Finished { reason: FinishReason::Stop, usage: Self::usage(s) });
                finished.push(i);
            } else if s.generated >= s.req.max_tokens || out_of_room {
                endings.push(Event::Finished { reason: FinishReason::Length, usage: Self::usage(s) });
                finished.push(i);
            }
        }
        // Save the blocks of prompts that completed this step.
        for &i in &prefill_done {
            if self.sh.cfg.role == Role::Prefill {
                continue;
            }
            let blocks = export_new_blocks(self.sh.cfg.block_tokens, &mut self.running[i]);
            if blocks.is_empty() {
                continue;
            }
            let ns = self.running[i].req.namespace.clone();
            let span = save_span(&self.running[i].request_span, blocks.len());
            self.cache_blocks(&ns, &blocks);
            if self.sh.store.is_some() {
                self.queue_save(SaveJob { namespace: ns, blocks, span });
            }
        }
        // Save blocks that generated tokens completed, so that a chat's
        // next turn reuses the answer's KV too.
        if self.sh.cfg.role != Role::Prefill {
            for &(i, _, _, _) in &plan {
                self.save_generated_blocks(i);
            }
        }
        // Keep the finished sequences' partial blocks, then tell their clients.
        for (&i, end) in finished.iter().zip(endings) {
            if self.sh.cfg.role != Role::Prefill {
                self.keep_tails(i);
            }
            let _ = self.running[i].tx.send(end);
        }
        // Remove ended sequences (highest index first keeps indices valid).
        let mut ended: Vec<usize> = finished;
        ended.extend(failed.iter().copied());
        if self.sh.cfg.role == Role::Prefill {
            ended.extend(prefill_done.iter().copied());
        }
        ended.sort_unstable();
        ended.dedup();
        for &i in ended.iter().rev() {
            let s = self.running.swap_remove(i);
            if self.sh.cfg.role == Role::Prefill {
                self.finish_prefill_role(s);
            } else if failed.contains(&i) {
                self.sh.metrics.outcome("failed");
            } else {
                self.sh.metrics.outcome("finished");
                self.sh.metrics.request_seconds.observe(s.arrived.elapsed().as_secs_f64());
            }
        }
        Ok(())
    }
}

/// The next token of `s` from its whole row of logits, on the host: the
/// grammar masks the row, `logprobs` read it, then the sampler chooses.
fn choose_on_host(s: &mut Seq, mut row: Vec<f32>) -> Outcome {
    if let Some(c) = s.req.constraint.as_mut() {
        if let Err(e) = c.mask(&mut row) {
            return Outcome::Failed(e.to_string());
        }
    }
    let token = sampler::sample(&row, &s.req.sampling, &s.history, &mut s.rng);
    let logprobs = s.req.sampling.logprobs.map(|top| sampler::logprobs(&row, token, top));
    Outcome::Token { token, logprobs }
}

/// Fails (or panics) a step whose chunk holds a test's fault token.
/// The `kv_save` span of `blocks` new blocks of a request: from queued to
/// acknowledged by the warehouse.
pub(super) fn save_span(request: &tracing::Span, blocks: usize) -> tracing::Span {
    tracing::info_span!(parent: request, "kv_save", "granary.kv.blocks" = blocks)
}

fn inject(fault: Option<Fault>, tokens: &[u32]) -> Result<()> {
    match fault {
        Some(Fault::StepError(t)) if tokens.contains(&t) => anyhow::bail!("injected fault: step error"),
        Some(Fault::StepPanic(t)) if tokens.contains(&t) => panic!("injected fault: step panic"),
        _ => Ok(()),
    }
}

/// Marks the step thread dead when dropped.
struct AliveGuard(Arc<Shared>);

impl Drop for AliveGuard {
    fn drop(&mut self) {
        let why = if std::thread::panicking() { "the step thread panicked" } else { "the step thread stopped" };
        self.0.health.dead(why);
    }
}
