//! MULTI, EXEC and DISCARD: queueing and running a transaction.

use super::*;

impl Session<'_> {
    /// A command received between MULTI and EXEC/DISCARD: transaction
    /// control runs at once; anything else is checked and queued (a failed
    /// check answers its error and dooms the transaction, as in Redis).
    pub(super) async fn in_multi(&mut self, args: Vec<Bytes>, out: &mut Out) -> CmdResult {
        let spec = match self.check(&args) {
            Ok(spec) => spec,
            Err(e) => {
                self.tx_dirty = true;
                return Err(e);
            }
        };
        match spec.name {
            "multi" => return Err(CmdError::NestedMulti),
            "discard" => {
                self.end_multi();
                out.ok();
                return Ok(Flow::Continue);
            }
            "exec" => return self.exec(out).await,
            "quit" | "reset" => {
                self.end_multi();
                return self.dispatch(&args, out).await;
            }
            _ => {}
        }
        if spec.has(table::NO_MULTI) {
            self.tx_dirty = true;
            return Err(CmdError::NotInMulti);
        }
        let bytes: usize = args.iter().map(Bytes::len).sum();
        let queue = self.queued.as_mut().expect("inside MULTI");
        if queue.len() >= MAX_QUEUED || self.queued_bytes + bytes > MAX_QUEUED_BYTES {
            self.tx_dirty = true;
            return Err(CmdError::TxTooLarge);
        }
        self.queued_bytes += bytes;
        // Small arguments are copied so the queue does not pin read buffers.
        queue.push(args.into_iter().map(own).collect());
        out.simple("QUEUED");
        Ok(Flow::Continue)
    }

    pub(super) fn end_multi(&mut self) -> Vec<Vec<Bytes>> {
        self.queued_bytes = 0;
        self.tx_dirty = false;
        self.queued.take().unwrap_or_default()
    }

    /// Runs the queued commands in order and answers one array of their
    /// replies; a command that fails at run time answers its error in its
    /// slot and the rest still run (Redis's semantics). Other connections'
    /// commands may interleave: there is no isolation, hence no WATCH.
    pub(super) async fn exec(&mut self, out: &mut Out) -> CmdResult {
        let dirty = self.tx_dirty;
        let queued = self.end_multi();
        if dirty {
            return Err(CmdError::ExecAbort);
        }
        out.array(queued.len());
        for args in queued {
            match self.dispatch(&args, out).await {
                Ok(_) => self.ctx.resp.requests_ok.fetch_add(1, Relaxed),
                Err(e) => {
                    out.error(&e.to_string());
                    self.ctx.resp.requests_error.fetch_add(1, Relaxed)
                }
            };
        }
        Ok(Flow::Continue)
    }
}
