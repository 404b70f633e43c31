//! vLLM's own KV events, read into the gateway's [`KvIndex`] so that
//! KV-aware routing is precise for vLLM engines too.
//!
//! vLLM (`--kv-events-config`) publishes on a ZeroMQ PUB socket. Each
//! message has three frames: the topic, a sequence number (8 bytes, big
//! endian, counting from 0 per publisher) and a MessagePack payload, a
//! `KVEventBatch` encoded by msgspec as an array `[ts, events,
//! data_parallel_rank?]`. Each event is a tagged array whose first element
//! names its kind:
//!
//! - `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, ...]`
//! - `["BlockRemoved", block_hashes, medium, ...]`
//! - `["AllBlocksCleared"]`
//!
//! Trailing fields left at their defaults may be omitted, and newer vLLM
//! versions append fields: both are accepted. Block hashes are integers or
//! bytes, depending on the version and `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`.
//!
//! vLLM's hashes cannot be recomputed here (its hash function and seed are
//! its own), but `BlockStored` carries each block's tokens and its parent.
//! So each stored block gets the gateway's own name — the third-party hash
//! chain ([`third_party_chain`]) over the same tokens — and [`VllmBlocks`]
//! remembers vLLM's name → ours, to undo it on `BlockRemoved`. The proxy
//! names a prompt's blocks with the same chain, after tokenizing it with the
//! model's tokenizer, and the two meet in the index.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use granary_core::hash::{BlockHash, HashChain};
use rmpv::Value;
use tokio_util::sync::CancellationToken;
use zeromq::{Socket, SocketRecv, SubSocket};

use super::KvIndex;
use crate::metrics::GatewayMetrics;

/// The KV layout bytes of the third-party chain: engines whose KV layout
/// the gateway does not know are named by tokens alone.
const THIRD_PARTY_LAYOUT: &[u8] = b"granary/third-party-engine";

/// The hash chain the gateway names third-party engines' blocks with: no
/// tenant namespace (such engines share their prefix cache between
/// requests whoever sends them), no model fingerprint (each upstream has
/// its own index entries), `block_tokens` tokens a block (vLLM's
/// `--block-size`, 16 by default).
pub fn third_party_chain(block_tokens: usize) -> HashChain {
    HashChain::new("", b"", THIRD_PARTY_LAYOUT, block_tokens.max(1))
}

/// A block hash as vLLM publishes it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum ExternalHash {
    Int(i128),
    Bytes(Box<[u8]>),
}

/// One decoded event.
#[derive(Clone, Debug, PartialEq)]
pub enum VllmEvent {
    Stored {
        hashes: Vec<ExternalHash>,
        parent: Option<ExternalHash>,
        tokens: Vec<u32>,
        block_size: usize,
        lora_id: Option<i64>,
        medium: Option<String>,
    },
    Removed {
        hashes: Vec<ExternalHash>,
        medium: Option<String>,
    },
    AllCleared,
}

/// A decoded `KVEventBatch`.
#[derive(Clone, Debug, PartialEq)]
pub struct VllmBatch {
    pub ts: f64,
    pub events: Vec<VllmEvent>,
    pub data_parallel_rank: Option<i64>,
}

/// Why a message or event could not be read.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum DecodeError {
    #[error("not MessagePack: {0}")]
    Msgpack(String),
    #[error("{0}")]
    Shape(String),
    #[error("a ZeroMQ message of {0} frames (expected topic, sequence, payload)")]
    Frames(usize),
}

fn shape(what: impl Into<String>) -> DecodeError {
    DecodeError::Shape(what.into())
}

/// Splits a message's frames: `(topic, sequence, payload)`.
pub fn split_frames<B: AsRef<[u8]>>(frames: &[B]) -> Result<(&[u8], u64, &[u8]), DecodeError> {
    let [topic, seq, payload] = frames else { return Err(DecodeError::Frames(frames.len())) };
    let seq: [u8; 8] =
        seq.as_ref().try_into().map_err(|_| shape(format!("a sequence frame of {} bytes", seq.as_ref().len())))?;
    Ok((topic.as_ref(), u64::from_be_bytes(seq), payload.as_ref()))
}

/// Decodes a `KVEventBatch` payload.
pub fn decode_batch(payload: &[u8]) -> Result<VllmBatch, DecodeError> {
    let v = rmpv::decode::read_value(&mut &payload[..]).map_err(|e| DecodeError::Msgpack(e.to_string()))?;
    let Value::Array(items) = v else { return Err(shape("a batch that is not an array")) };
    let ts = items.first().and_then(Value::as_f64).ok_or_else(|| shape("a batch without its timestamp"))?;
    let Some(Value::Array(events)) = items.get(1) else { return Err(shape("a batch without its event list")) };
    let data_parallel_rank = match items.get(2) {
        None | Some(Value::Nil) => None,
        Some(v) => Some(v.as_i64().ok_or_else(|| shape("data_parallel_rank is not an integer"))?),
    };
    let events = events.iter().map(decode_event).collect::<Result<_, _>>()?;
    Ok(VllmBatch { ts, events, data_parallel_rank })
}

fn decode_event(v: &Value) -> Result<VllmEvent, DecodeError> {
    let Value::Array(f) = v else { return Err(shape("an event that is not an array")) };
    let tag = f.first().and_then(Value::as_str).ok_or_else(|| shape("an event without its tag"))?;
    let opt_str = |i: usize, name: &str| match f.get(i) {
        None | Some(Value::Nil) => Ok(None),
        Some(Value::String(s)) => Ok(s.as_str().map(str::to_string)),
        Some(_) => Err(shape(format!("{tag}.{name} is not a string"))),
    };
    match tag {
        "BlockStored" => {
            let hashes = hash_list(f.get(1), "BlockStored.block_hashes")?;
            let parent = match f.get(2) {
                None | Some(Value::Nil) => None,
                Some(v) => Some(hash(v).ok_or_else(|| shape("BlockStored.parent_block_hash is not a hash"))?),
            };
            let Some(Value::Array(toks)) = f.get(3) else { return Err(shape("BlockStored.token_ids is missing")) };
            let tokens = toks
                .iter()
                .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
                .collect::<Option<Vec<u32>>>()
                .ok_or_else(|| shape("BlockStored.token_ids holds a value that is not a token id"))?;
            let block_size = f
                .get(4)
                .and_then(Value::as_u64)
                .filter(|&b| b > 0)
                .ok_or_else(|| shape("BlockStored.block_size is missing or not a positive integer"))?
                as usize;
            let lora_id = match f.get(5) {
                None | Some(Value::Nil) => None,
                Some(v) => Some(v.as_i64().ok_or_else(|| shape("BlockStored.lora_id is not an integer"))?),
            };
            Ok(VllmEvent::Stored { hashes, parent, tokens, block_size, lora_id, medium: opt_str(6, "medium")? })
        }
        "BlockRemoved" => Ok(VllmEvent::Removed {
            hashes: hash_list(f.get(1), "BlockRemoved.block_hashes")?,
            medium: opt_str(2, "medium")?,
        }),
        "AllBlocksCleared" => Ok(VllmEvent::AllCleared),
        other => Err(shape(format!("an event of unknown kind {other:?}"))),
    }
}

fn hash(v: &Value) -> Option<ExternalHash> {
    match v {
        Value::Integer(i) => i.as_i64().map(i128::from).or_else(|| i.as_u64().map(i128::from)).map(ExternalHash::Int),
        Value::Binary(b) => Some(ExternalHash::Bytes(b.clone().into_boxed_slice())),
        _ => None,
    }
}

fn hash_list(v: Option<&Value>, what: &str) -> Result<Vec<ExternalHash>, DecodeError> {
    let Some(Value::Array(a)) = v else { return Err(shape(format!("{what} is missing"))) };
    a.iter().map(|h| hash(h).ok_or_else(|| shape(format!("{what} holds a value that is not a hash")))).collect()
}

/// What applying events did, for the metrics.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Applied {
    pub stored: u64,
    pub removed: u64,
    pub cleared: u64,
    /// Blocks whose parent is unknown (events were missed): their names
    /// cannot be computed.
    pub unknown_parent: u64,
    /// Blocks of a LoRA adapter: prompts are named for the base model.
    pub lora: u64,
    /// Blocks of another size than configured (`kv_block_tokens`).
    pub wrong_block_size: u64,
}

/// One vLLM engine's blocks: vLLM's name → the gateway's, and the media
/// (GPU, CPU...) holding each; a block leaves the index when no medium
/// holds it any more.
#[derive(Default)]
pub struct VllmBlocks {
    names: HashMap<ExternalHash, (BlockHash, Vec<Option<String>>)>,
    /// Our names may repeat (vLLM adds salts and multimodal inputs to its
    /// hashes, which tokens alone do not show): how many of vLLM's blocks
    /// each stands for.
    refs: HashMap<BlockHash, u32>,
}

impl VllmBlocks {
    pub fn new() -> Self {
        Self::default()
    }

    /// vLLM blocks known.
    pub fn len(&self) -> usize {
        self.names.len()
    }

    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }

    /// Forgets everything (the engine restarted or cleared its cache).
    pub fn clear(&mut self, index: &KvIndex, upstream: usize) {
        self.names.clear();
        self.refs.clear();
        index.forget(upstream);
    }

    /// Applies a batch's events to `index` for `upstream`, naming blocks
    /// with `chain`.
    pub fn apply(&mut self, batch: &VllmBatch, chain: &HashChain, index: &KvIndex, upstream: usize) -> Applied {
        let mut out = Applied::default();
        for ev in &batch.events {
            match ev {
                VllmEvent::Stored { hashes, parent, tokens, block_size, lora_id, medium } => {
                    if lora_id.is_some() {
                        out.lora += hashes.len() as u64;
                        continue;
                    }
                    if *block_size != chain.block_tokens() || tokens.len() != hashes.len() * block_size {
                        out.wrong_block_size += hashes.len() as u64;
                        continue;
                    }
                    let mut prev = match parent {
                        None => chain.root(),
                        Some(p) => match self.names.get(p) {
                            Some((ours, _)) => *ours,
                            None => {
                                out.unknown_parent += hashes.len() as u64;
                                continue;
                            }
                        },
                    };
                    let mut added = Vec::with_capacity(hashes.len());
                    for (ext, block) in hashes.iter().zip(tokens.chunks_exact(*block_size)) {
                        let ours = HashChain::next(&prev, block);
                        prev = ours;
                        match self.names.get_mut(ext) {
                            Some((_, media)) => {
                                if !media.contains(medium) {
                                    media.push(medium.clone());
                                }
                            }
                            None => {
                                self.names.insert(ext.clone(), (ours, vec![medium.clone()]));
                                *self.refs.entry(ours).or_default() += 1;
                                added.push(ours);
                            }
                        }
                        out.stored += 1;
                    }
                    index.insert(upstream, &added);
                }
                VllmEvent::Removed { hashes, medium } => {
                    let mut gone = Vec::new();
                    for ext in hashes {
                        let Some((ours, media)) = self.names.get_mut(ext) else { continue };
                        media.retain(|m| m != medium);
                        if !media.is_empty() {
                            continue;
                        }
                        let ours = *ours;
                        self.names.remove(ext);
                        out.removed += 1;
                        if let Some(n) = self.refs.get_mut(&ours) {
                            *n -= 1;
                            if *n == 0 {
                                self.refs.remove(&ours);
                                gone.push(ours);
                            }
                        }
                    }
                    index.remove(upstream, &gone);
                }
                VllmEvent::AllCleared => {
                    self.clear(index, upstream);
                    out.cleared += 1;
                }
            }
        }
        out
    }
}

/// Where a follower reads from, and what it writes into.
pub struct Follow {
    /// The upstream's name, for logs.
    pub name: String,
    /// Its id: the key of its index entries.
    pub upstream: usize,
    /// `tcp://host:port` of vLLM's PUB socket.
    pub endpoint: String,
    /// The topic to subscribe to (empty: every topic).
    pub topic: String,
    pub chain: HashChain,
    pub index: Arc<KvIndex>,
    pub metrics: Arc<GatewayMetrics>,
    pub stop: CancellationToken,
}

/// Subscribes to a vLLM engine's KV events until `stop`, applying them to
/// the index. The socket reconnects by itself when the engine goes away.
/// A sequence number lower than expected means the engine restarted with an
/// empty cache: what was known of it is forgotten first. A gap (batches the
/// subscriber missed; PUB drops them under pressure) is counted, and the
/// index keeps what it knows: a missed removal only costs a wrong guess,
/// which is what routing without events does anyway.
pub async fn follow(f: Follow) {
    let count = |outcome: &str, n: u64| {
        if n > 0 {
            f.metrics.vllm_kv_events.get_or_create(&vec![("outcome", outcome.to_string())]).inc_by(n);
        }
    };
    let mut blocks = VllmBlocks::new();
    let mut backoff = Duration::from_millis(200);
    let mut expected: Option<u64> = None;
    loop {
        let mut socket = SubSocket::new();
        let connected = async {
            socket.connect(&f.endpoint).await?;
            socket.subscribe(&f.topic).await?;
            Ok::<_, zeromq::ZmqError>(())
        };
        let res = tokio::select! {
            _ = f.stop.cancelled() => break,
            r = connected => r,
        };
        if let Err(e) = res {
            tracing::debug!(upstream = %f.name, endpoint = %f.endpoint, error = %e, "vLLM KV events: cannot subscribe yet");
            tokio::select! {
                _ = f.stop.cancelled() => break,
                _ = tokio::time::sleep(backoff) => {}
            }
            backoff = (backoff * 2).min(Duration::from_secs(5));
            continue;
        }
        backoff = Duration::from_millis(200);
        tracing::info!(upstream = %f.name, endpoint = %f.endpoint, "following vLLM KV events");
        loop {
            let msg = tokio::select! {
                _ = f.stop.cancelled() => {
                    f.index.forget(f.upstream);
                    return;
                }
                m = socket.recv() => m,
            };
            let msg = match msg {
                Ok(m) => m.into_vec(),
                Err(e) => {
                    tracing::debug!(upstream = %f.name, error = %e, "vLLM KV event stream broke; resubscribing");
                    break;
                }
            };
            let decoded = split_frames(&msg).and_then(|(_, seq, payload)| Ok((seq, decode_batch(payload)?)));
            let (seq, batch) = match decoded {
                Ok(x) => x,
                Err(e) => {
                    count("undecodable", 1);
                    tracing::warn!(upstream = %f.name, error = %e, "unreadable vLLM KV event batch");
                    continue;
                }
            };
            match expected {
                Some(want) if seq < want => {
                    tracing::info!(upstream = %f.name, seq, "vLLM KV events restarted: the engine's cache is new");
                    blocks.clear(&f.index, f.upstream);
                }
                Some(want) if seq > want => count("missed_batches", seq - want),
                _ => {}
            }
            expected = Some(seq + 1);
            let a = blocks.apply(&batch, &f.chain, &f.index, f.upstream);
            count("stored", a.stored);
            count("removed", a.removed);
            count("cleared", a.cleared);
            count("unknown_parent", a.unknown_parent);
            count("lora", a.lora);
            count("wrong_block_size", a.wrong_block_size);
            if a.wrong_block_size > 0 {
                tracing::warn!(
                    upstream = %f.name,
                    expected = f.chain.block_tokens(),
                    "vLLM KV events carry blocks of another size than kv_block_tokens; they are not indexed"
                );
            }
            f.metrics.kv_index_blocks.set(f.index.total_blocks() as i64);
        }
    }
    f.index.forget(f.upstream);
}

#[cfg(test)]
mod tests {
    use super::*;
    use rmpv::Value as V;

    fn enc(v: &V) -> Vec<u8> {
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, v).unwrap();
        out
    }

    fn ints(xs: &[i64]) -> V {
        V::Array(xs.iter().map(|&x| V::from(x)).collect())
    }

    fn stored(hashes: &[i64], parent: Option<i64>, tokens: &[i64], size: i64) -> V {
        V::Array(vec![
            V::from("BlockStored"),
            ints(hashes),
            parent.map_or(V::Nil, V::from),
            ints(tokens),
            V::from(size),
            V::Nil,
            V::from("GPU"),
        ])
    }

    #[test]
    fn batches_decode_with_omitted_and_extra_trailing_fields() {
        let batch = V::Array(vec![
            V::from(1.5),
            V::Array(vec![
                // Trailing defaults omitted (an older vLLM without `medium`).
                V::Array(vec![V::from("BlockStored"), ints(&[-7]), V::Nil, ints(&[1, 2]), V::from(2)]),
                // A field appended by a newer version.
                V::Array(vec![
                    V::from("BlockRemoved"),
                    V::Array(vec![V::Binary(vec![9; 32])]),
                    V::from("CPU"),
                    V::from("extra"),
                ]),
                V::Array(vec![V::from("AllBlocksCleared")]),
            ]),
        ]);
        let b = decode_batch(&enc(&batch)).unwrap();
        assert_eq!(b.ts, 1.5);
        assert_eq!(b.data_parallel_rank, None);
        assert_eq!(
            b.events[0],
            VllmEvent::Stored {
                hashes: vec![ExternalHash::Int(-7)],
                parent: None,
                tokens: vec![1, 2],
                block_size: 2,
                lora_id: None,
                medium: None
            }
        );
        assert_eq!(
            b.events[1],
            VllmEvent::Removed {
                hashes: vec![ExternalHash::Bytes(vec![9; 32].into_boxed_slice())],
                medium: Some("CPU".into())
            }
        );
        assert_eq!(b.events[2], VllmEvent::AllCleared);
    }

    #[test]
    fn malformed_messages_are_refused_by_name() {
        assert!(matches!(decode_batch(b"\x92\x01"), Err(DecodeError::Msgpack(_))), "a truncated array");
        let bad = V::Array(vec![V::from(0.0), V::Array(vec![V::Array(vec![V::from("BlockMoved")])])]);
        assert_eq!(decode_batch(&enc(&bad)), Err(shape("an event of unknown kind \"BlockMoved\"")));
        let bad = V::Array(vec![V::from(0.0), V::Array(vec![stored(&[1], None, &[-1, 2], 2)])]);
        assert!(decode_batch(&enc(&bad)).unwrap_err().to_string().contains("token_ids"));
        assert_eq!(split_frames(&[b"t".as_slice(), b"x"]).unwrap_err(), DecodeError::Frames(2));
        let seq = 5u64.to_be_bytes();
        assert_eq!(split_frames(&[b"t".as_slice(), &seq, b"p"]).unwrap(), (&b"t"[..], 5, &b"p"[..]));
    }

    fn batch(events: Vec<V>) -> VllmBatch {
        decode_batch(&enc(&V::Array(vec![V::from(0.0), V::Array(events)]))).unwrap()
    }

    #[test]
    fn stored_blocks_get_the_chains_names_and_removed_ones_leave() {
        let chain = third_party_chain(2);
        let index = KvIndex::new();
        let mut m = VllmBlocks::new();
        let prompt: [i64; 6] = [10, 11, 12, 13, 14, 15];
        let ours = chain.hashes(&prompt.map(|t| t as u32));
        // Two blocks, then a third whose parent is the second.
        let a = m.apply(&batch(vec![stored(&[100, 101], None, &prompt[..4], 2)]), &chain, &index, 7);
        assert_eq!(a.stored, 2);
        let a = m.apply(&batch(vec![stored(&[102], Some(101), &prompt[4..], 2)]), &chain, &index, 7);
        assert_eq!(a.stored, 1);
        assert_eq!(index.prefix_match(7, &ours), 3, "the gateway's names of the prompt's blocks");
        // A parent never seen: the block's name cannot be known.
        let a = m.apply(&batch(vec![stored(&[200], Some(999), &[1, 2], 2)]), &chain, &index, 7);
        assert_eq!((a.stored, a.unknown_parent), (0, 1));
        // Another block size, a LoRA block: refused and counted.
        assert_eq!(m.apply(&batch(vec![stored(&[300], None, &[1, 2, 3], 3)]), &chain, &index, 7).wrong_block_size, 1);
        let lora = V::Array(vec![V::from("BlockStored"), ints(&[400]), V::Nil, ints(&[1, 2]), V::from(2), V::from(1)]);
        assert_eq!(m.apply(&batch(vec![lora]), &chain, &index, 7).lora, 1);
        // Removing the middle block ends the matched prefix at one block.
        let rm = V::Array(vec![V::from("BlockRemoved"), ints(&[101]), V::from("GPU")]);
        assert_eq!(m.apply(&batch(vec![rm]), &chain, &index, 7).removed, 1);
        assert_eq!(index.prefix_match(7, &ours), 1);
        assert_eq!(m.len(), 2);
        let clear = V::Array(vec![V::from("AllBlocksCleared")]);
        assert_eq!(m.apply(&batch(vec![clear]), &chain, &index, 7).cleared, 1);
        assert_eq!((index.blocks(7), m.len()), (0, 0));
    }

    #[test]
    fn a_block_stays_while_some_medium_holds_it() {
        let chain = third_party_chain(2);
        let index = KvIndex::new();
        let mut m = VllmBlocks::new();
        let cpu = V::Array(vec![
            V::from("BlockStored"),
            ints(&[1]),
            V::Nil,
            ints(&[5, 6]),
            V::from(2),
            V::Nil,
            V::from("CPU"),
        ]);
        m.apply(&batch(vec![stored(&[1], None, &[5, 6], 2), cpu]), &chain, &index, 0);
        let rm_gpu = V::Array(vec![V::from("BlockRemoved"), ints(&[1]), V::from("GPU")]);
        m.apply(&batch(vec![rm_gpu]), &chain, &index, 0);
        assert_eq!(index.blocks(0), 1, "still on the CPU tier");
        let rm_cpu = V::Array(vec![V::from("BlockRemoved"), ints(&[1]), V::from("CPU")]);
        m.apply(&batch(vec![rm_cpu]), &chain, &index, 0);
        assert_eq!(index.blocks(0), 0);
    }
}
