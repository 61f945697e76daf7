//! The transmission phase: requests in, replies out, many in flight.

use std::io::{self, BufReader, IoSlice, Read};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use log::{debug, warn};
use udm_block::{
    merge_extents, AlignedBuf, BlockDevice, BlockError, Checked, Extent, WriteFlags, ZeroFlags,
};

use crate::handshake::{Negotiated, MAX_PAYLOAD};
use crate::protocol::*;
use crate::stream::Stream;

const READ_BUFFER: usize = 256 << 10;

const KNOWN_FLAGS: u16 =
    CMD_FLAG_FUA | CMD_FLAG_NO_HOLE | CMD_FLAG_DF | CMD_FLAG_REQ_ONE | CMD_FLAG_FAST_ZERO;

struct Connection {
    name: String,
    /// Buffered: at queue depth 32 one read() brings in many requests (and small write
    /// payloads), instead of two system calls per request.
    reader: Mutex<BufReader<Stream>>,
    writer: Mutex<Stream>,
    device: Checked<Arc<dyn BlockDevice>>,
    structured: bool,
    base_allocation: bool,
    closing: AtomicBool,
}

/// Serves one negotiated connection with `workers` threads until the client disconnects.
pub fn serve(stream: Stream, negotiated: Negotiated, workers: usize) -> io::Result<()> {
    let Negotiated {
        name,
        export,
        structured,
        base_allocation,
    } = negotiated;
    let conn = Connection {
        name,
        writer: Mutex::new(stream.try_clone()?),
        reader: Mutex::new(BufReader::with_capacity(READ_BUFFER, stream)),
        device: Checked::new(export.device.clone(), export.read_only),
        structured,
        base_allocation,
        closing: AtomicBool::new(false),
    };
    std::thread::scope(|scope| {
        for i in 0..workers.max(1) {
            let conn = &conn;
            std::thread::Builder::new()
                .name(format!("nbd-{}-{i}", conn.name))
                .spawn_scoped(scope, move || conn.worker())
                .expect("spawn NBD worker");
        }
    });
    // The export (and its open count) is released when the last worker is done.
    drop(export);
    Ok(())
}

enum Next {
    Request(Request),
    /// NBD_CMD_DISC or end of stream: finish what is in flight and close.
    Disconnect,
}

impl Connection {
    fn worker(&self) {
        let mut buf = AlignedBuf::new();
        loop {
            let next = {
                let mut reader = self.reader.lock().unwrap();
                if self.closing.load(Ordering::Acquire) {
                    return;
                }
                Self::read_request(&mut reader, &mut buf)
            };
            let request = match next {
                Ok(Next::Request(r)) => r,
                Ok(Next::Disconnect) => {
                    self.closing.store(true, Ordering::Release);
                    return;
                }
                Err(e) => return self.abort(&format!("reading a request: {e}")),
            };
            if let Err(e) = self.handle(request, &mut buf) {
                return self.abort(&format!("sending a reply: {e}"));
            }
        }
    }

    /// Ends the connection after a protocol violation or a dead socket.
    fn abort(&self, why: &str) {
        if !self.closing.swap(true, Ordering::AcqRel) {
            warn!("nbd export '{}': closing connection: {why}", self.name);
        }
        self.writer.lock().unwrap().shutdown();
    }

    fn read_request(reader: &mut BufReader<Stream>, buf: &mut AlignedBuf) -> io::Result<Next> {
        let mut header = [0u8; REQUEST_HEADER_LEN];
        match reader.read_exact(&mut header) {
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(Next::Disconnect),
            other => other?,
        }
        let request = parse_request(&header)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
        if request.command == CMD_WRITE {
            // The payload must be consumed to stay in sync; one we won't buffer ends things.
            if request.length > MAX_PAYLOAD {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!(
                        "write of {} bytes exceeds the {MAX_PAYLOAD}-byte limit",
                        request.length
                    ),
                ));
            }
            buf.resize(request.length as usize);
            reader.read_exact(buf)?;
        }
        if request.command == CMD_DISC {
            return Ok(Next::Disconnect);
        }
        Ok(Next::Request(request))
    }

    fn handle(&self, r: Request, buf: &mut AlignedBuf) -> io::Result<()> {
        let result = self.execute(&r, buf);
        match (result, r.command) {
            (Ok(Some(extents)), _) => self.reply_block_status(&r, &extents),
            (Ok(None), CMD_READ) => self.reply_read(&r, &buf[..r.length as usize]),
            (Ok(None), _) => self
                .writer
                .lock()
                .unwrap()
                .write_all_vectored(&mut [IoSlice::new(&simple_reply(r.cookie, 0))]),
            (Err(e), _) => {
                debug!(
                    "nbd export '{}': command {} failed: {e}",
                    self.name, r.command
                );
                self.reply_error(&r, &e)
            }
        }
    }

    /// Runs a request against the device; block status returns its extents.
    fn execute(
        &self,
        r: &Request,
        buf: &mut AlignedBuf,
    ) -> Result<Option<Vec<Extent>>, BlockError> {
        if r.flags & !KNOWN_FLAGS != 0 {
            return Err(BlockError::InvalidArgument(format!(
                "unknown flags {:#x}",
                r.flags
            )));
        }
        let fua = r.flags & CMD_FLAG_FUA != 0;
        let (offset, len) = (r.offset, u64::from(r.length));
        match r.command {
            CMD_READ => {
                if r.length > MAX_PAYLOAD {
                    return Err(BlockError::InvalidArgument(format!(
                        "read of {len} bytes exceeds the {MAX_PAYLOAD}-byte limit"
                    )));
                }
                buf.resize(r.length as usize);
                self.device.read(offset, buf)?;
            }
            CMD_WRITE => {
                self.device
                    .write(offset, &buf[..r.length as usize], WriteFlags { fua })?
            }
            CMD_FLUSH => self.device.flush()?,
            CMD_TRIM => {
                self.device.discard(offset, len)?;
                if fua {
                    self.device.flush()?;
                }
            }
            CMD_CACHE => self.device.cache(offset, len)?,
            CMD_WRITE_ZEROES => self.device.write_zeroes(
                offset,
                len,
                ZeroFlags {
                    fua,
                    may_unmap: r.flags & CMD_FLAG_NO_HOLE == 0,
                    fast_only: r.flags & CMD_FLAG_FAST_ZERO != 0,
                },
            )?,
            CMD_BLOCK_STATUS => {
                if !self.base_allocation {
                    return Err(BlockError::InvalidArgument(
                        "block status without a negotiated meta context".into(),
                    ));
                }
                // Checked keeps the total within the request, whose length is a u32, so every
                // merged extent fits the wire format.
                let mut extents = merge_extents(self.device.block_status(offset, len)?);
                if r.flags & CMD_FLAG_REQ_ONE != 0 {
                    extents.truncate(1);
                }
                return Ok(Some(extents));
            }
            other => {
                return Err(BlockError::InvalidArgument(format!(
                    "unknown command {other}"
                )));
            }
        }
        Ok(None)
    }

    fn reply_read(&self, r: &Request, data: &[u8]) -> io::Result<()> {
        let mut writer = self.writer.lock().unwrap();
        if !self.structured {
            let header = simple_reply(r.cookie, 0);
            return writer.write_all_vectored(&mut [IoSlice::new(&header), IoSlice::new(data)]);
        }
        let offset = r.offset.to_be_bytes();
        if is_zero(data) {
            // A hole chunk tells the client the range is zero without sending the zeroes.
            let header = chunk_header(CHUNK_FLAG_DONE, CHUNK_OFFSET_HOLE, r.cookie, 12);
            let size = (data.len() as u32).to_be_bytes();
            return writer.write_all_vectored(&mut [
                IoSlice::new(&header),
                IoSlice::new(&offset),
                IoSlice::new(&size),
            ]);
        }
        let header = chunk_header(
            CHUNK_FLAG_DONE,
            CHUNK_OFFSET_DATA,
            r.cookie,
            8 + data.len() as u32,
        );
        writer.write_all_vectored(&mut [
            IoSlice::new(&header),
            IoSlice::new(&offset),
            IoSlice::new(data),
        ])
    }

    fn reply_block_status(&self, r: &Request, extents: &[Extent]) -> io::Result<()> {
        let mut payload = BASE_ALLOCATION_ID.to_be_bytes().to_vec();
        for e in extents {
            payload.extend_from_slice(&(e.len as u32).to_be_bytes());
            payload.extend_from_slice(&e.flags.to_be_bytes());
        }
        let header = chunk_header(
            CHUNK_FLAG_DONE,
            CHUNK_BLOCK_STATUS,
            r.cookie,
            payload.len() as u32,
        );
        self.writer
            .lock()
            .unwrap()
            .write_all_vectored(&mut [IoSlice::new(&header), IoSlice::new(&payload)])
    }

    fn reply_error(&self, r: &Request, e: &BlockError) -> io::Result<()> {
        let error = nbd_error(e.errno());
        let mut writer = self.writer.lock().unwrap();
        if self.structured && matches!(r.command, CMD_READ | CMD_BLOCK_STATUS) {
            let mut message = e.to_string();
            if message.len() > 1024 {
                // Cut on a character boundary: the protocol wants valid UTF-8.
                let cut = (0..=1024)
                    .rev()
                    .find(|&i| message.is_char_boundary(i))
                    .unwrap_or(0);
                message.truncate(cut);
            }
            let message = message.as_bytes();
            let mut payload = error.to_be_bytes().to_vec();
            payload.extend_from_slice(&(message.len() as u16).to_be_bytes());
            payload.extend_from_slice(message);
            let header = chunk_header(CHUNK_FLAG_DONE, CHUNK_ERROR, r.cookie, payload.len() as u32);
            return writer.write_all_vectored(&mut [IoSlice::new(&header), IoSlice::new(&payload)]);
        }
        writer.write_all_vectored(&mut [IoSlice::new(&simple_reply(r.cookie, error))])
    }
}

fn is_zero(data: &[u8]) -> bool {
    let (head, words, tail) = unsafe { data.align_to::<u128>() };
    head.iter().all(|&b| b == 0) && words.iter().all(|&w| w == 0) && tail.iter().all(|&b| b == 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_detection_sees_a_single_set_byte_anywhere() {
        let mut data = vec![0u8; 4099];
        assert!(is_zero(&data));
        for at in [0, 1, 15, 16, 2048, 4098] {
            data[at] = 1;
            assert!(!is_zero(&data), "byte {at}");
            data[at] = 0;
        }
    }
}
