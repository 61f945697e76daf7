//! Fields in network byte order: [`Reader`] takes them apart, reporting truncation instead of
//! panicking; [`Writer`] puts them into a buffer of the message's size.

use super::ProtocolError;

/// A cursor over a message that reports truncation instead of panicking.
pub struct Reader<'a> {
    data: &'a [u8],
    what: &'static str,
}

impl<'a> Reader<'a> {
    pub fn new(data: &'a [u8], what: &'static str) -> Self {
        Reader { data, what }
    }
    pub fn bytes(&mut self, n: usize) -> Result<&'a [u8], ProtocolError> {
        if self.data.len() < n {
            return Err(ProtocolError::Truncated(self.what));
        }
        let (head, tail) = self.data.split_at(n);
        self.data = tail;
        Ok(head)
    }
    pub fn u16(&mut self) -> Result<u16, ProtocolError> {
        Ok(u16::from_be_bytes(self.bytes(2)?.try_into().unwrap()))
    }
    pub fn u32(&mut self) -> Result<u32, ProtocolError> {
        Ok(u32::from_be_bytes(self.bytes(4)?.try_into().unwrap()))
    }
    pub fn u64(&mut self) -> Result<u64, ProtocolError> {
        Ok(u64::from_be_bytes(self.bytes(8)?.try_into().unwrap()))
    }
    /// Whatever is left.
    pub fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.data)
    }
    /// A u32 length followed by that many bytes of UTF-8.
    pub fn string(&mut self) -> Result<String, ProtocolError> {
        let len = self.u32()? as usize;
        let bytes = self.bytes(len)?;
        String::from_utf8(bytes.to_vec())
            .map_err(|_| ProtocolError::Invalid(format!("{} contains invalid UTF-8", self.what)))
    }
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }
}

/// A cursor writing fields into a buffer sized for the message (a field past its end is a bug
/// in the caller, and panics).
pub struct Writer<'a> {
    out: &'a mut [u8],
    at: usize,
}

impl<'a> Writer<'a> {
    pub fn new(out: &'a mut [u8]) -> Self {
        Writer { out, at: 0 }
    }
    pub fn bytes(&mut self, data: &[u8]) -> &mut Self {
        self.out[self.at..self.at + data.len()].copy_from_slice(data);
        self.at += data.len();
        self
    }
    pub fn u16(&mut self, v: u16) -> &mut Self {
        self.bytes(&v.to_be_bytes())
    }
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.bytes(&v.to_be_bytes())
    }
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.bytes(&v.to_be_bytes())
    }
    /// A u32 length followed by the bytes: the inverse of [`Reader::string`].
    pub fn string(&mut self, s: &str) -> &mut Self {
        self.u32(s.len() as u32).bytes(s.as_bytes())
    }
    /// The bytes [`Writer::string`] takes for `s`.
    pub fn string_len(s: &str) -> usize {
        4 + s.len()
    }
}

/// A message of `len` bytes, written by `fill`.
pub fn message(len: usize, fill: impl FnOnce(&mut Writer)) -> Vec<u8> {
    let mut out = vec![0u8; len];
    fill(&mut Writer::new(&mut out));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_the_writer_writes_the_reader_reads() {
        let data = message(2 + 4 + 8 + Writer::string_len("vol"), |w| {
            w.u16(1).u32(2).u64(3).string("vol");
        });
        let mut r = Reader::new(&data, "test");
        assert_eq!((r.u16(), r.u32(), r.u64()), (Ok(1), Ok(2), Ok(3)));
        assert_eq!(r.string().unwrap(), "vol");
        assert!(r.is_empty());
        assert_eq!(r.u16(), Err(ProtocolError::Truncated("test")));
    }
}
