//! A request's way through the loop: parsed out of the receive buffer, held while the device
//! is suspended, remapped onto the engine or run on the pool, and answered.

use super::*;

impl EventLoop {
    pub(super) fn parse(&mut self, index: usize) {
        loop {
            let Some(conn) = self.conns.get_mut(index).and_then(Option::as_mut) else {
                return;
            };
            conn.waiting_for_budget = false;
            if conn.closing || conn.in_flight + conn.replies.len() >= self.queue_depth {
                return;
            }
            if let Some(w) = conn.writing.as_mut() {
                let n = (w.payload.len() - w.got).min(conn.end - conn.start);
                w.payload[w.got..w.got + n].copy_from_slice(&conn.buf[conn.start..conn.start + n]);
                w.got += n;
                conn.start += n;
                if w.got < w.payload.len() {
                    return;
                }
                let Writing {
                    request, payload, ..
                } = conn.writing.take().expect("checked above");
                self.dispatch(index, request, Some(payload));
                continue;
            }
            if conn.end - conn.start < REQUEST_HEADER_LEN {
                return;
            }
            let header: &[u8; REQUEST_HEADER_LEN] = conn.buf
                [conn.start..conn.start + REQUEST_HEADER_LEN]
                .try_into()
                .expect("sliced to length");
            let request = match parse_request(header) {
                Ok(r) => r,
                Err(e) => return self.abort(index, &format!("reading a request: {e}")),
            };
            let wants_buffer = match request.command {
                CMD_DISC => {
                    conn.start += REQUEST_HEADER_LEN;
                    conn.closing = true;
                    return;
                }
                CMD_WRITE if request.length > MAX_PAYLOAD => {
                    let why = format!(
                        "write of {} bytes exceeds the {MAX_PAYLOAD}-byte limit",
                        request.length
                    );
                    return self.abort(index, &why);
                }
                CMD_WRITE => true,
                CMD_READ => conn.session.validate(&request).is_ok(),
                _ => false,
            };
            let payload = if wants_buffer {
                match self.budget.try_take(request.length as usize) {
                    Some(payload) => Some(payload),
                    None => {
                        // Leave the header where it is and look again soon.
                        conn.waiting_for_budget = true;
                        return;
                    }
                }
            } else {
                None
            };
            conn.start += REQUEST_HEADER_LEN;
            conn.last_active = Instant::now();
            conn.large_writes =
                request.command == CMD_WRITE && request.length as usize >= DIRECT_RECEIVE;
            if request.command == CMD_WRITE {
                conn.writing = Some(Writing {
                    request,
                    payload: payload.expect("taken above"),
                    got: 0,
                    progress: Progress::new(),
                });
                continue;
            }
            self.dispatch(index, request, payload);
        }
    }

    /// Counts a request in and starts it, holds it while the device is suspended, or
    /// answers it at once if it is invalid.
    pub(super) fn dispatch(&mut self, index: usize, request: Request, payload: Option<Payload>) {
        let Some(conn) = self.conns.get_mut(index).and_then(Option::as_mut) else {
            return;
        };
        conn.in_flight += 1;
        if let Err(e) = conn.session.validate(&request) {
            return self.answer(index, &request, Err(e), payload);
        }
        // Held only if it fits now: one that does not fails at once, as it would have.
        let fits = request
            .offset
            .checked_add(u64::from(request.length))
            .is_some_and(|end| end <= conn.session.device.size());
        if fits && (!conn.held.is_empty() || conn.session.device.suspended()) {
            return conn.held.push_back((request, payload));
        }
        self.start(index, request, payload);
    }

    /// Starts the requests held for a device that has resumed.
    pub(super) fn release_held(&mut self, index: usize) {
        loop {
            let Some(conn) = self.conns.get_mut(index).and_then(Option::as_mut) else {
                return;
            };
            if conn.held.is_empty() || conn.session.device.suspended() {
                return;
            }
            let (request, payload) = conn.held.pop_front().expect("not empty");
            let end = request.offset + u64::from(request.length);
            if end > conn.session.device.size() {
                // The table that resumed is smaller: the request fails whole, as one queued
                // at the suspend gate does.
                let e = BlockError::Io(format!(
                    "offset {} length {} is beyond the end of the device, which shrank while the request waited",
                    request.offset, request.length
                ));
                self.answer(index, &request, Err(e), payload);
                continue;
            }
            self.start(index, request, payload);
        }
    }

    /// Starts a counted, valid request: remapped onto the engine when the device can say
    /// where it lives, on the pool otherwise.
    pub(super) fn start(&mut self, index: usize, request: Request, payload: Option<Payload>) {
        let Some(conn) = self.conns.get_mut(index).and_then(Option::as_mut) else {
            return;
        };
        let session = conn.session.clone();
        if let Some(op) = map_op(&request) {
            let device = &session.device;
            let (offset, len) = (request.offset, u64::from(request.length));
            // A panic in a target's map() fails its request like one in its I/O would.
            let mapping = catch_unwind(AssertUnwindSafe(|| device.map(op, offset, len)));
            match mapping {
                Err(panic) => {
                    let why = crate::commands::panic_message(&*panic).to_string();
                    warn!(
                        "nbd export '{}': mapping a request panicked: {why}",
                        session.name
                    );
                    let e = BlockError::Io(format!("the request failed: {why}"));
                    return self.answer(index, &request, Err(e), payload);
                }
                Ok(Some(mapping)) => {
                    let conn = self.conns[index].as_mut().expect("present");
                    let slot = conn.mapped_free.pop().unwrap_or_else(|| {
                        conn.mapped.push(None);
                        conn.mapped.len() - 1
                    });
                    let mapped = conn.mapped[slot].insert(Mapped { request, payload });
                    let buf = mapped
                        .payload
                        .as_deref_mut()
                        .map_or(std::ptr::null_mut(), |p| p.as_mut_ptr());
                    let owner = (index as u64) << 32 | slot as u64;
                    if mapping.is_ready() {
                        return self.submit_mapped(owner, op, mapping);
                    }
                    // It waits for steps (a timer, a snapshot copy-out) or transfers (a remote
                    // export's client) that finish on other threads: it comes back through
                    // the mailbox, holding no thread meanwhile.
                    let mailbox = self.mailbox.clone();
                    // SAFETY: the buffer is the payload held in `conn.mapped[slot]`, which
                    // stays there (and the connection stays, counting the request in flight)
                    // until the Ready message has been handled.
                    unsafe {
                        mapping.when_ready_with(buf, move |ready| {
                            mailbox.post(Message::Ready { owner, op, ready })
                        })
                    };
                    return;
                }
                Ok(None) => {}
            }
        }
        self.run_on_pool(index, session, request, payload);
    }

    /// Serves a request through the device's synchronous methods, on a pool thread.
    pub(super) fn run_on_pool(
        &self,
        index: usize,
        session: Arc<Session>,
        request: Request,
        mut payload: Option<Payload>,
    ) {
        let mailbox = self.mailbox.clone();
        self.pool.submit(Box::new(move || {
            let result = session.execute(&request, payload.as_deref_mut());
            mailbox.post(Message::Done {
                conn: index,
                request,
                result,
                payload,
            });
        }));
    }

    /// Hands a parked request's ready mapping to the engine.
    pub(super) fn submit_mapped(&mut self, owner: u64, op: MapOp, mapping: Mapping) {
        let index = (owner >> 32) as usize;
        let slot = (owner & 0xffff_ffff) as usize;
        let Some(conn) = self.conns.get_mut(index).and_then(Option::as_mut) else {
            return;
        };
        let Some(Mapped { payload, .. }) = conn.mapped[slot].as_mut() else {
            return;
        };
        let buf = payload
            .as_deref_mut()
            .map_or(std::ptr::null_mut(), |p| p.as_mut_ptr());
        let queued = &mut self.queued;
        // SAFETY: the buffer is the payload held in `conn.mapped[slot]`, which stays there
        // (and the connection stays, counting the request in flight) until the engine says
        // the request is complete.
        let done = unsafe {
            self.engine
                .start(op, mapping, buf, owner, &mut |e| queued.push(e))
        };
        match done {
            Some(outcome) => self.mapped_done(owner, MappedOutcome::Done(outcome)),
            None if self.queued.len() >= SUBMIT_CHUNK => self.submit_now(),
            None => {}
        }
    }

    pub(super) fn mapped_done(&mut self, owner: u64, outcome: MappedOutcome) {
        let index = (owner >> 32) as usize;
        let slot = (owner & 0xffff_ffff) as usize;
        let Some(conn) = self.conns.get_mut(index).and_then(Option::as_mut) else {
            return;
        };
        let Some(Mapped { request, payload }) = conn.mapped[slot].take() else {
            return;
        };
        conn.mapped_free.push(slot);
        let outcome = match outcome {
            MappedOutcome::Done(outcome) => outcome,
            MappedOutcome::Retry => {
                let session = conn.session.clone();
                return self.run_on_pool(index, session, request, payload);
            }
        };
        let result = outcome.map(|()| {
            if request.command == CMD_READ {
                Outcome::Read
            } else {
                Outcome::Done
            }
        });
        self.answer(index, &request, result, payload);
    }

    /// Queues the reply to a request that has finished.
    pub(super) fn answer(
        &mut self,
        index: usize,
        request: &Request,
        result: Result<Outcome, BlockError>,
        payload: Option<Payload>,
    ) {
        let Some(conn) = self.conns.get_mut(index).and_then(Option::as_mut) else {
            return;
        };
        conn.in_flight -= 1;
        conn.last_active = Instant::now();
        if !conn.dead {
            let reply = conn.session.reply(request, result, payload);
            conn.replies.push_back(reply);
        }
        self.dirty.push(index);
    }
}
