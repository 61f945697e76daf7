//! A connection's life on the loop: attached, receiving, sending its replies, aborted,
//! detached once nothing of it is in flight.

use super::*;

impl EventLoop {
    pub(super) fn attach(&mut self, attach: Attach) {
        let Attach {
            stream,
            negotiated,
            slot,
        } = attach;
        // Timeouts are the loop's now; the socket's own would only confuse io_uring.
        let _ = stream.set_read_timeout(None);
        let _ = stream.set_write_timeout(None);
        let (session, open_guard) = Session::start(negotiated);
        let session = Arc::new(session);
        let conn = Conn {
            session,
            stream,
            _export: open_guard,
            _slot: slot,
            buf: vec![0u8; RECEIVE_BUFFER].into_boxed_slice(),
            start: 0,
            end: 0,
            receiving: false,
            receiving_payload: 0,
            // SAFETY: msghdr and iovec are plain data; zeroed means no address, no control
            // data and empty iovecs.
            receive: Box::new(unsafe { std::mem::zeroed() }),
            writing: None,
            large_writes: false,
            mapped: Vec::new(),
            mapped_free: Vec::new(),
            in_flight: 0,
            replies: VecDeque::new(),
            sending: None,
            closing: false,
            dead: false,
            waiting_for_budget: false,
            held: VecDeque::new(),
            last_active: Instant::now(),
        };
        let index = match self.free.pop() {
            Some(i) => {
                self.conns[i] = Some(conn);
                i
            }
            None => {
                self.conns.push(Some(conn));
                self.conns.len() - 1
            }
        };
        self.dirty.push(index);
    }

    pub(super) fn received(&mut self, index: usize, result: i32) {
        let Some(conn) = self.conns.get_mut(index).and_then(Option::as_mut) else {
            return;
        };
        conn.receiving = false;
        let into_payload = std::mem::take(&mut conn.receiving_payload);
        if into_payload > 0 && conn.dead {
            // Aborted while the kernel could still write into the payload: free it now.
            conn.writing = None;
        }
        match result {
            n if n > 0 => {
                let n = n as usize;
                let to_payload = n.min(into_payload);
                // While a write's data arrives, every byte received is its.
                if let Some(writing) = conn.writing.as_mut() {
                    writing.got += to_payload;
                    writing.progress.moved(n);
                }
                conn.end += n - to_payload;
                conn.last_active = Instant::now();
            }
            0 => conn.closing = true,
            n if matches!(-n, libc::EINTR | libc::EAGAIN) => {}
            n => {
                let err = io::Error::from_raw_os_error(-n);
                self.abort(index, &format!("reading a request: {err}"));
            }
        }
        self.dirty.push(index);
    }

    pub(super) fn sent(&mut self, index: usize, result: i32) {
        let Some(conn) = self.conns.get_mut(index).and_then(Option::as_mut) else {
            return;
        };
        let Some(sending) = conn.sending.as_mut() else {
            return;
        };
        if result < 0 {
            if matches!(-result, libc::EINTR | libc::EAGAIN) {
                let entry = send_entry(index, &conn.stream, sending);
                self.queued.push(entry);
                return;
            }
            let err = io::Error::from_raw_os_error(-result);
            self.abort(index, &format!("sending a reply: {err}"));
            if let Some(conn) = self.conns.get_mut(index).and_then(Option::as_mut) {
                conn.sending = None;
            }
            self.dirty.push(index);
            return;
        }
        let mut left = result as usize;
        while left > 0 && sending.first < sending.iovecs.len() {
            let iov = &mut sending.iovecs[sending.first];
            let n = left.min(iov.iov_len);
            // SAFETY: advances within the iovec's own buffer.
            iov.iov_base = unsafe { iov.iov_base.cast::<u8>().add(n) }.cast();
            iov.iov_len -= n;
            left -= n;
            if iov.iov_len == 0 {
                sending.first += 1;
            }
        }
        sending.progress.moved(result as usize);
        if sending.first < sending.iovecs.len() {
            let entry = send_entry(index, &conn.stream, sending);
            self.queued.push(entry);
            return;
        }
        conn.sending = None;
        conn.last_active = Instant::now();
        self.dirty.push(index);
    }

    /// Ends a connection whose socket failed or whose client broke the protocol: what is in
    /// flight finishes, and its replies are dropped.
    pub(super) fn abort(&mut self, index: usize, why: &str) {
        let Some(conn) = self.conns.get_mut(index).and_then(Option::as_mut) else {
            return;
        };
        if !conn.dead {
            if conn.closing {
                debug!(
                    "nbd export '{}': connection ended: {why}",
                    conn.session.name
                );
            } else {
                warn!(
                    "nbd export '{}': closing connection: {why}",
                    conn.session.name
                );
            }
        }
        conn.dead = true;
        conn.closing = true;
        if conn.receiving_payload == 0 {
            conn.writing = None;
        }
        conn.in_flight -= conn.held.len();
        conn.held.clear();
        conn.replies.clear();
        conn.stream.shutdown();
        self.dirty.push(index);
    }

    /// Parses what has arrived, starts the next receive and send, and ends the connection
    /// when it is done.
    pub(super) fn pump(&mut self, index: usize) {
        self.release_held(index);
        let open = self.conns.get(index).and_then(Option::as_ref);
        if open.is_none_or(|c| c.closing) {
            return self.finish_if_done(index);
        }
        self.parse(index);
        let Some(conn) = self.conns.get_mut(index).and_then(Option::as_mut) else {
            return;
        };
        if conn.buf.len() - conn.end < REQUEST_HEADER_LEN || conn.start == conn.end {
            // Keep the unparsed bytes at the front so the next receive has room.
            conn.buf.copy_within(conn.start..conn.end, 0);
            conn.end -= conn.start;
            conn.start = 0;
        }
        let busy = conn.in_flight + conn.replies.len() >= self.queue_depth;
        if !conn.receiving && !conn.closing && !conn.dead && !conn.waiting_for_budget && !busy {
            let entry = conn.receive_entry(index);
            self.queued.push(entry);
        }
        self.finish_if_done(index);
    }

    pub(super) fn finish_if_done(&mut self, index: usize) {
        let Some(conn) = self.conns.get_mut(index).and_then(Option::as_mut) else {
            return;
        };
        if conn.sending.is_none() && !conn.replies.is_empty() && !conn.dead {
            let count = replies_per_send(conn.replies.iter().map(Reply::len));
            let replies: Vec<Reply> = conn.replies.drain(..count).collect();
            let iovecs: Vec<libc::iovec> = replies
                .iter()
                .flat_map(|r| r.slices())
                .map(|s| libc::iovec {
                    iov_base: s.as_ptr() as *mut _,
                    iov_len: s.len(),
                })
                .collect();
            // SAFETY: msghdr is plain data; zeroed means no address and no control data.
            let header: Box<libc::msghdr> = Box::new(unsafe { std::mem::zeroed() });
            let mut sending = Sending {
                _replies: replies,
                iovecs,
                header,
                first: 0,
                progress: Progress::new(),
            };
            let entry = send_entry(index, &conn.stream, &mut sending);
            conn.sending = Some(sending);
            self.queued.push(entry);
        }
        if conn.finished() {
            debug!("nbd: client detached from '{}'", conn.session.name);
            self.conns[index] = None;
            self.free.push(index);
            self.mailbox.connections.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

/// How many of the queued replies (their lengths, in order) the next sendmsg takes: up to
/// [`SEND_BATCH`], and none more once they carry [`SEND_BYTES`] (always at least one).
fn replies_per_send(lengths: impl Iterator<Item = usize>) -> usize {
    let mut bytes = 0;
    let within = lengths.take(SEND_BATCH).take_while(|len| {
        let before = bytes;
        bytes += len;
        before < SEND_BYTES
    });
    within.count()
}

/// The sendmsg entry for what is left of `sending`.
fn send_entry(index: usize, stream: &Stream, sending: &mut Sending) -> squeue::Entry {
    let rest = &mut sending.iovecs[sending.first..];
    sending.header.msg_iov = rest.as_mut_ptr();
    sending.header.msg_iovlen = rest.len() as _;
    opcode::SendMsg::new(fd(stream), &*sending.header)
        .flags(libc::MSG_NOSIGNAL as u32)
        .build()
        .user_data(user_data(index, SEND))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_send_takes_replies_up_to_its_bytes_or_its_count() {
        let read_4k = 16 + 4096;
        assert_eq!(replies_per_send(std::iter::repeat_n(read_4k, 32)), 8);
        // Headers only (writes): the count bounds them.
        assert_eq!(replies_per_send(std::iter::repeat_n(16, 100)), SEND_BATCH);
        // A big read goes alone, and a small one behind it waits for the next send.
        assert_eq!(replies_per_send([16 + (256 << 10), 16].into_iter()), 1);
        // What is left goes whatever its size.
        assert_eq!(replies_per_send(std::iter::once(16)), 1);
        assert_eq!(replies_per_send(std::iter::empty()), 0);
    }
}
