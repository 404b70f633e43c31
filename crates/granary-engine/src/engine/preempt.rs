//! Preemption: running sequences whose KV outgrows the memory budget are
//! set aside and later resumed where they stopped.
//!
//! Before each step the step loop counts the blocks every running sequence
//! holds once the step has run (a prefilling sequence its whole prompt, a
//! decoding one one token more). Past the budget, sequences are set aside,
//! the lowest priority first (the highest `priority` value) and within a
//! priority the newest first. Setting aside writes the sequence's KV blocks
//! to the warehouse (full blocks under their chain names, the last, partly
//! filled block under a one-off name) and frees them. Set-aside sequences
//! come back before any new request is admitted, the most important and
//! oldest first, once their blocks fit: the blocks are read back (full ones
//! from the engine's block cache while it still holds them) and the
//! sequence goes on with the same KV, no token computed again.
//!
//! Without a warehouse (or when a block cannot be read back: a failed write
//! or read, an evicted block) the sequence keeps the leading blocks it gets
//! back from the engine's block cache and computes the rest again from its
//! tokens (prompt and output so far) before it decodes on.

use std::sync::mpsc as std_mpsc;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use granary_core::hash::{BlockHash, HashChain};

use super::step::{Seq, StepLoop};
use super::{EngineMetrics, Shared};

/// Blocks `s` holds once the next step has run, with `kv_len` tokens of KV
/// now: its whole prompt while prefilling, one token more when decoding.
fn need(bt: usize, s: &Seq, kv_len: usize) -> usize {
    let len = if s.prompt_done < s.prompt_target { s.prompt_target } else { kv_len + 1 };
    len.div_ceil(bt)
}

/// A sequence set aside: its state without its KV.
struct SetAside {
    id: u64,
    seq: Seq,
    /// Tokens of KV it held.
    kv_len: usize,
    /// Its blocks' names, in order: the full blocks' chain names, then the
    /// partial last block's one-off name when that was written.
    names: Vec<BlockHash>,
    /// Resolves to whether the blocks reached the warehouse; `None` when
    /// nothing was written.
    written: Option<tokio::task::JoinHandle<bool>>,
    /// Blocks it needs back.
    need: usize,
}

/// Blocks read back for the set-aside sequence `id`, in order.
struct ReadBack {
    id: u64,
    blocks: Vec<Bytes>,
}

/// Sequences set aside and those being read back.
pub(super) struct Parked {
    aside: Vec<SetAside>,
    loading: Vec<SetAside>,
    next_id: u64,
    tx: std_mpsc::Sender<ReadBack>,
    rx: std_mpsc::Receiver<ReadBack>,
    arrived: Vec<ReadBack>,
}

impl Parked {
    pub(super) fn new() -> Self {
        let (tx, rx) = std_mpsc::channel();
        Parked { aside: Vec::new(), loading: Vec::new(), next_id: 0, tx, rx, arrived: Vec::new() }
    }

    /// No sequence set aside or being read back.
    pub(super) fn is_empty(&self) -> bool {
        self.aside.is_empty() && self.loading.is_empty()
    }

    /// Sequences being read back.
    pub(super) fn loading(&self) -> usize {
        self.loading.len()
    }

    /// Waits up to `timeout` for a read-back (when one is under way).
    pub(super) fn wait_for_resumed(&mut self, timeout: Duration) {
        if self.loading.is_empty() {
            return;
        }
        if let Ok(r) = self.rx.recv_timeout(timeout) {
            self.arrived.push(r);
        }
    }

    pub(super) fn drop_cancelled(&mut self, m: &EngineMetrics) {
        self.aside.retain(|p| {
            let keep = !p.seq.tx.is_closed();
            if !keep {
                m.outcome("cancelled");
            }
            keep
        });
    }

    pub(super) fn update_gauges(&self, m: &EngineMetrics) {
        m.preempted.set((self.aside.len() + self.loading.len()) as i64);
    }
}

impl StepLoop {
    /// Blocks the running sequences hold once the next step has run, and
    /// those reserved for sequences being read back.
    pub(super) fn blocks_in_use(&self) -> usize {
        let bt = self.sh.cfg.block_tokens;
        let running: usize = self.running.iter().map(|s| need(bt, s, s.kv.len())).sum();
        running + self.parked.loading.iter().map(|p| p.need).sum::<usize>()
    }

    /// Sets running sequences aside until the rest fit in the budget. A
    /// sequence alone always fits: admission refuses any request whose
    /// prompt and `max_tokens` exceed the budget.
    pub(super) fn make_room(&mut self) {
        let bt = self.sh.cfg.block_tokens;
        let mut used = self.blocks_in_use();
        while used > self.sh.kv_budget_blocks && !self.running.is_empty() {
            if self.running.len() == 1 && self.parked.loading.is_empty() {
                break;
            }
            // Lowest priority (highest value), then newest.
            let Some(i) =
                (0..self.running.len()).max_by_key(|&i| (self.running[i].req.priority, self.running[i].arrived))
            else {
                break;
            };
            let s = self.running.remove(i);
            used -= need(bt, &s, s.kv.len());
            self.set_aside(s);
        }
    }

    /// Starts reading back set-aside sequences, most important and oldest
    /// first, while they fit beside `used` blocks (counted in). True when
    /// none is left waiting for room: new requests may then be admitted.
    pub(super) fn resume_parked(&mut self, used: &mut usize) -> bool {
        loop {
            let Some(i) = (0..self.parked.aside.len())
                .min_by_key(|&i| (self.parked.aside[i].seq.req.priority, self.parked.aside[i].seq.arrived))
            else {
                return true;
            };
            let need = self.parked.aside[i].need;
            let idle = self.running.is_empty() && self.parked.loading.is_empty();
            let busy = self.running.len() + self.parked.loading.len() >= self.sh.cfg.max_running;
            if (*used + need > self.sh.kv_budget_blocks && !idle) || busy {
                return false;
            }
            *used += need;
            let p = self.parked.aside.remove(i);
            self.read_back(p);
        }
    }

    /// Takes read-back sequences into the running batch: their blocks are
    /// imported and whatever did not come back is computed again.
    pub(super) fn take_back_resumed(&mut self) {
        while let Ok(r) = self.parked.rx.try_recv() {
            self.parked.arrived.push(r);
        }
        for r in std::mem::take(&mut self.parked.arrived) {
            let Some(pos) = self.parked.loading.iter().position(|p| p.id == r.id) else { continue };
            let p = self.parked.loading.remove(pos);
            let seq = self.take_back(p, r.blocks);
            self.running.push(seq);
        }
    }

    fn take_back(&self, p: SetAside, blocks: Vec<Bytes>) -> Seq {
        let bt = self.sh.cfg.block_tokens;
        let layers = self.sh.model.config().layers;
        let mut s = p.seq;
        for (i, b) in blocks.into_iter().enumerate() {
            if let Err(e) = s.kv.import_block(layers, i, bt, b) {
                tracing::warn!(error = %e, block = i, "a set-aside KV block is unusable; computing from here");
                break;
            }
        }
        s.kv.truncate(p.kv_len);
        let have = s.kv.len();
        let m = &self.sh.metrics;
        m.resumed_tokens.get_or_create(&vec![("how", "loaded")]).inc_by(have as u64);
        m.resumed_tokens.get_or_create(&vec![("how", "recomputed")]).inc_by((p.kv_len - have) as u64);
        if have < p.kv_len {
            if s.prompt_done >= s.prompt_target {
                // Decoding: the prompt and the output up to the next input
                // (whose KV the next decode step computes).
                let kept = s.output.len().saturating_sub(1);
                let mut replay = s.req.prompt.clone();
                replay.extend_from_slice(&s.output[..kept]);
                s.prompt_target = replay.len();
                s.replay = replay;
            }
            s.prompt_done = have;
        }
        s
    }

    /// Writes `s`'s KV to the warehouse (when there is one), frees it and
    /// parks the sequence.
    fn set_aside(&mut self, mut s: Seq) {
        let sh = self.sh.clone();
        let bt = sh.cfg.block_tokens;
        let kv_len = s.kv.len();
        let full = kv_len / bt;
        name_full_blocks(&sh, &mut s, full);
        let full = full.min(s.hashes.len());
        let mut names: Vec<BlockHash> = s.hashes[..full].to_vec();
        let mut blocks = Vec::new();
        if sh.store.is_some() {
            for b in 0..kv_len.div_ceil(bt) {
                let (name, payload) = if b < full {
                    (s.hashes[b], s.kv.export_block(b, bt))
                } else {
                    (BlockHash(rand::random()), s.kv.export_last_block(b, bt))
                };
                match payload {
                    Ok(p) => blocks.push((name, p)),
                    Err(e) => {
                        tracing::warn!(error = %e, block = b, "exporting a KV block to set aside failed");
                        break;
                    }
                }
            }
            names = blocks.iter().map(|(h, _)| *h).collect();
        }
        s.kv = sh.model.new_kv(bt);
        let written = match (&sh.store, blocks.is_empty()) {
            (Some(store), false) => {
                let (store, m) = (store.clone(), sh.clone());
                let span = super::step::save_span(&s.request_span, blocks.len());
                Some(sh.runtime.spawn(async move {
                    let n = blocks.len();
                    match tracing::Instrument::instrument(store.put_many(blocks), span).await {
                        Ok(()) => true,
                        Err(e) => {
                            tracing::warn!(error = %e, blocks = n, "writing a set-aside sequence's KV failed");
                            m.metrics.warehouse_errors.inc();
                            false
                        }
                    }
                }))
            }
            _ => None,
        };
        // Nothing to compute again when every block was written (or none held).
        let whole = sh.store.is_some() && names.len() == kv_len.div_ceil(bt);
        let kind = if whole { "warehouse" } else { "recompute" };
        sh.metrics.preemptions.get_or_create(&vec![("kv", kind)]).inc();
        let need = need(bt, &s, kv_len);
        let id = self.parked.next_id;
        self.parked.next_id += 1;
        self.parked.aside.push(SetAside { id, seq: s, kv_len, names, written, need });
    }

    /// Reads `p`'s blocks back off the step thread; the step loop takes
    /// them in when they arrive ([`StepLoop::take_back_resumed`]).
    fn read_back(&mut self, mut p: SetAside) {
        let sh = self.sh.clone();
        let tx = self.parked.tx.clone();
        let (id, names, written) = (p.id, p.names.clone(), p.written.take());
        let full = (p.kv_len / sh.cfg.block_tokens).min(names.len());
        self.parked.loading.push(p);
        self.sh.runtime.spawn(async move {
            let written = match written {
                Some(h) => h.await.unwrap_or(false),
                None => false,
            };
            let mut blocks = sh.cache.prefix(&names[..full]);
            if let (true, Some(store)) = (written && blocks.len() < names.len(), &sh.store) {
                let rest = &names[blocks.len()..];
                match tokio::time::timeout(sh.cfg.fetch_timeout, store.get_many(rest)).await {
                    Ok(Ok(got)) => blocks.extend(got.into_iter().map_while(|b| b.map(|b| b.payload))),
                    Ok(Err(e)) => {
                        tracing::warn!(error = %e, "reading a set-aside sequence's KV failed; computing it again");
                        sh.metrics.warehouse_errors.inc();
                    }
                    Err(_) => {
                        tracing::warn!("reading a set-aside sequence's KV timed out; computing it again");
                        sh.metrics.warehouse_errors.inc();
                    }
                }
            }
            let _ = tx.send(ReadBack { id, blocks });
        });
    }
}

/// Extends `s.hashes` to name its first `full` blocks (prompt and output
/// tokens, as the saved blocks of a chat's answer are named).
fn name_full_blocks(sh: &Arc<Shared>, s: &mut Seq, full: usize) {
    if s.hashes.len() >= full {
        return;
    }
    let bt = sh.cfg.block_tokens;
    let tokens: Vec<u32> = s.req.prompt.iter().chain(&s.output).copied().take(full * bt).collect();
    let chain = HashChain::for_layout(&s.req.namespace, sh.model.fingerprint().as_bytes(), &sh.layout);
    s.hashes = chain.hashes(&tokens);
}
