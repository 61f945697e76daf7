//! What each NBD command means and how its reply looks, shared by the event loop and the
//! threaded fallback so a request means the same whichever serves it.

use std::any::Any;
use std::io::IoSlice;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use log::warn;
use smallvec::SmallVec;
use udm_block::{
    merge_extents, BlockDevice, BlockError, Checked, Extent, MapOp, WriteFlags, ZeroFlags,
};

use crate::budget::Payload;
use crate::handshake::{Contexts, Negotiated, MAX_PAYLOAD};
use crate::protocol::*;

pub(crate) type Device = Checked<Arc<dyn BlockDevice>>;

/// What a connection negotiated: the device and the reply style.
pub(crate) struct Session {
    pub name: String,
    pub device: Arc<Device>,
    pub structured: bool,
    pub base_allocation: bool,
    /// Other meta contexts selected, with their ids.
    pub contexts: Contexts,
}

/// A successful command's result.
pub(crate) enum Outcome {
    Done,
    /// The data is in the request's buffer.
    Read,
    /// Per meta context selected: its id and extents.
    Extents(Vec<(u32, Vec<Extent>)>),
}

/// A reply's header and any small payload. Inline up to 32 bytes, which holds a simple reply
/// and a structured read's data or hole chunk header: most replies allocate nothing.
type Head = SmallVec<[u8; 32]>;

/// A reply ready to send: its header (and any small payload), then the read data.
pub(crate) struct Reply {
    head: Head,
    data: Option<Payload>,
}

impl Reply {
    /// Bytes on the wire.
    pub fn len(&self) -> usize {
        self.head.len() + self.data.as_ref().map_or(0, |d| d.len())
    }

    /// The header, then the read data if any.
    pub fn slices(&self) -> impl Iterator<Item = IoSlice<'_>> {
        let data = self.data.as_deref().map(IoSlice::new);
        std::iter::once(IoSlice::new(&self.head)).chain(data)
    }
}

impl Session {
    /// The session a negotiated connection serves, and the export's open guard, which the
    /// caller keeps until the connection's last request is done (it holds the open count).
    pub fn start(negotiated: Negotiated) -> (Session, Box<dyn Any + Send + Sync>) {
        let Negotiated {
            name,
            export,
            structured,
            base_allocation,
            contexts,
        } = negotiated;
        let session = Session {
            name,
            device: Arc::new(Checked::new(export.device, export.read_only)),
            structured,
            base_allocation,
            contexts,
        };
        (session, export.open_guard)
    }

    /// The checks that need no device: flags, arguments, sizes. A request that fails them
    /// gets an error reply and the connection goes on.
    pub fn validate(&self, r: &Request) -> Result<(), BlockError> {
        self.check_flags(r)?;
        let (offset, len) = (r.offset, u64::from(r.length));
        match r.command {
            CMD_READ if r.length > MAX_PAYLOAD => Err(BlockError::InvalidArgument(format!(
                "read of {len} bytes exceeds the {MAX_PAYLOAD}-byte limit"
            ))),
            CMD_FLUSH if offset != 0 || len != 0 => Err(BlockError::InvalidArgument(format!(
                "flush with offset {offset} and length {len} (both must be 0)"
            ))),
            CMD_BLOCK_STATUS if !self.base_allocation && self.contexts.is_empty() => {
                Err(BlockError::InvalidArgument(
                    "block status without a negotiated meta context".into(),
                ))
            }
            CMD_READ | CMD_WRITE | CMD_FLUSH | CMD_TRIM | CMD_CACHE | CMD_WRITE_ZEROES
            | CMD_BLOCK_STATUS => Ok(()),
            other => Err(BlockError::InvalidArgument(format!(
                "unknown command {other}"
            ))),
        }
    }

    /// Refuses flags a command does not take, as nbdkit does. FUA is valid on every command
    /// (the protocol says so); DF only on reads with structured replies.
    fn check_flags(&self, r: &Request) -> Result<(), BlockError> {
        let allowed = CMD_FLAG_FUA
            | match r.command {
                CMD_READ if self.structured => CMD_FLAG_DF,
                CMD_WRITE_ZEROES => CMD_FLAG_NO_HOLE | CMD_FLAG_FAST_ZERO,
                CMD_BLOCK_STATUS => CMD_FLAG_REQ_ONE,
                _ => 0,
            };
        let bad = r.flags & !allowed;
        if bad == 0 {
            return Ok(());
        }
        let why = if bad == CMD_FLAG_DF && r.command == CMD_READ {
            " without structured replies".to_string()
        } else {
            format!(" on command {}", r.command)
        };
        Err(BlockError::InvalidArgument(format!(
            "flags {bad:#x} are not valid{why}"
        )))
    }

    /// Runs a validated request against the device, synchronously. A read fills `buf`, a
    /// write takes its data from it. A bug in a target fails its request, not the
    /// connection (nor the daemon).
    pub fn execute(&self, r: &Request, buf: Option<&mut [u8]>) -> Result<Outcome, BlockError> {
        catch_unwind(AssertUnwindSafe(|| self.execute_unguarded(r, buf))).unwrap_or_else(|panic| {
            let why = panic_message(&*panic);
            warn!(
                "nbd export '{}': command {} panicked: {why}",
                self.name, r.command
            );
            Err(BlockError::Io(format!("the request failed: {why}")))
        })
    }

    fn execute_unguarded(
        &self,
        r: &Request,
        buf: Option<&mut [u8]>,
    ) -> Result<Outcome, BlockError> {
        let device = &self.device;
        let fua = r.flags & CMD_FLAG_FUA != 0;
        let (offset, len) = (r.offset, u64::from(r.length));
        match r.command {
            CMD_READ => {
                device.read(offset, buf.expect("a read has its buffer"))?;
                return Ok(Outcome::Read);
            }
            CMD_WRITE => device.write(
                offset,
                buf.expect("a write's payload was read"),
                WriteFlags { fua },
            )?,
            CMD_FLUSH => device.flush()?,
            CMD_TRIM => {
                device.discard(offset, len)?;
                if fua {
                    device.flush()?;
                }
            }
            CMD_CACHE => device.cache(offset, len)?,
            CMD_WRITE_ZEROES => device.write_zeroes(
                offset,
                len,
                ZeroFlags {
                    fua,
                    may_unmap: r.flags & CMD_FLAG_NO_HOLE == 0,
                    fast_only: r.flags & CMD_FLAG_FAST_ZERO != 0,
                },
            )?,
            CMD_BLOCK_STATUS => {
                // Checked keeps the total within the request, whose length is a u32, so every
                // merged extent fits the wire format.
                let mut all = Vec::with_capacity(1 + self.contexts.len());
                if self.base_allocation {
                    all.push((BASE_ALLOCATION_ID, device.block_status(offset, len)?));
                }
                for (id, context) in &self.contexts {
                    let mut extents = context.extents(offset, len)?;
                    // Within the request, whatever the context answered.
                    udm_block::clip_extents(&mut extents, len);
                    if extents.is_empty() {
                        return Err(BlockError::Io(format!(
                            "meta context {id} answered nothing"
                        )));
                    }
                    all.push((*id, extents));
                }
                for (_, extents) in &mut all {
                    *extents = merge_extents(std::mem::take(extents));
                    if r.flags & CMD_FLAG_REQ_ONE != 0 {
                        extents.truncate(1);
                    }
                }
                return Ok(Outcome::Extents(all));
            }
            other => unreachable!("command {other} passed validation"),
        }
        Ok(Outcome::Done)
    }

    /// The reply to `r`. `payload` is the request's buffer: a read's data goes out in it.
    pub fn reply(
        &self,
        r: &Request,
        result: Result<Outcome, BlockError>,
        payload: Option<Payload>,
    ) -> Reply {
        match result {
            Ok(Outcome::Read) => self.reply_read(r, payload.expect("a read has its buffer")),
            Ok(Outcome::Extents(extents)) => self.reply_block_status(r, &extents),
            Ok(Outcome::Done) => Reply {
                head: Head::from_slice(&simple_reply(r.cookie, 0)),
                data: None,
            },
            Err(e) => {
                log::debug!(
                    "nbd export '{}': command {} failed: {e}",
                    self.name,
                    r.command
                );
                self.reply_error(r, &e)
            }
        }
    }

    fn reply_read(&self, r: &Request, data: Payload) -> Reply {
        if !self.structured {
            return Reply {
                head: Head::from_slice(&simple_reply(r.cookie, 0)),
                data: Some(data),
            };
        }
        let mut head = Head::new();
        if is_zero(&data) {
            // A hole chunk tells the client the range is zero without sending the zeroes.
            head.extend_from_slice(&chunk_header(
                CHUNK_FLAG_DONE,
                CHUNK_OFFSET_HOLE,
                r.cookie,
                12,
            ));
            head.extend_from_slice(&r.offset.to_be_bytes());
            head.extend_from_slice(&(data.len() as u32).to_be_bytes());
            return Reply { head, data: None };
        }
        let length = 8 + data.len() as u32;
        head.extend_from_slice(&chunk_header(
            CHUNK_FLAG_DONE,
            CHUNK_OFFSET_DATA,
            r.cookie,
            length,
        ));
        head.extend_from_slice(&r.offset.to_be_bytes());
        Reply {
            head,
            data: Some(data),
        }
    }

    /// One chunk per meta context, the last one marked done.
    fn reply_block_status(&self, r: &Request, contexts: &[(u32, Vec<Extent>)]) -> Reply {
        let mut head = Head::new();
        for (i, (id, extents)) in contexts.iter().enumerate() {
            let mut payload = id.to_be_bytes().to_vec();
            for e in extents {
                payload.extend_from_slice(&(e.len as u32).to_be_bytes());
                payload.extend_from_slice(&e.flags.to_be_bytes());
            }
            let done = if i + 1 == contexts.len() {
                CHUNK_FLAG_DONE
            } else {
                0
            };
            head.extend_from_slice(&chunk_header(
                done,
                CHUNK_BLOCK_STATUS,
                r.cookie,
                payload.len() as u32,
            ));
            head.extend_from_slice(&payload);
        }
        Reply { head, data: None }
    }

    fn reply_error(&self, r: &Request, e: &BlockError) -> Reply {
        let error = nbd_error(e.errno());
        if !(self.structured && matches!(r.command, CMD_READ | CMD_BLOCK_STATUS)) {
            return Reply {
                head: Head::from_slice(&simple_reply(r.cookie, error)),
                data: None,
            };
        }
        let mut message = e.to_string();
        if message.len() > MAX_ERROR_MESSAGE {
            // Cut on a character boundary: the protocol wants valid UTF-8.
            let cut = (0..=MAX_ERROR_MESSAGE)
                .rev()
                .find(|&i| message.is_char_boundary(i))
                .unwrap_or(0);
            message.truncate(cut);
        }
        let message = message.as_bytes();
        let mut payload = error.to_be_bytes().to_vec();
        payload.extend_from_slice(&(message.len() as u16).to_be_bytes());
        payload.extend_from_slice(message);
        let mut head = Head::from_slice(&chunk_header(
            CHUNK_FLAG_DONE,
            CHUNK_ERROR,
            r.cookie,
            payload.len() as u32,
        ));
        head.extend_from_slice(&payload);
        Reply { head, data: None }
    }
}

/// The most of an error's words an error chunk carries: its payload (the error, the length
/// and the words) then stays within the 1,000 bytes qemu's client takes. A longer one it
/// refused, and the request failed with EINVAL instead of the error sent.
const MAX_ERROR_MESSAGE: usize = 1000 - 4 - 2;

/// How a command can be remapped (see [`udm_block::map`]); `None` for the commands that
/// always go the synchronous way.
/// The operation to map a request as; `None` for those that always go the synchronous way
/// (block status, cache).
pub(crate) fn map_op(r: &Request) -> Option<MapOp> {
    let fua = r.flags & CMD_FLAG_FUA != 0;
    match r.command {
        CMD_READ => Some(MapOp::Read),
        CMD_WRITE => Some(MapOp::Write { fua }),
        CMD_FLUSH => Some(MapOp::Flush),
        CMD_TRIM => Some(MapOp::Discard { fua }),
        CMD_WRITE_ZEROES => Some(MapOp::WriteZeroes {
            may_unmap: r.flags & CMD_FLAG_NO_HOLE == 0,
            fast_only: r.flags & CMD_FLAG_FAST_ZERO != 0,
            fua,
        }),
        _ => None,
    }
}

pub(crate) fn panic_message(panic: &(dyn Any + Send)) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("a panic")
}

fn is_zero(data: &[u8]) -> bool {
    // SAFETY: any bytes are valid u128s.
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
