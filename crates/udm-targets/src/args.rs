//! Reading arguments one token at a time, with errors that name the token: a table line's
//! arguments, a target's messages, and the line itself. Every number udm reads from a table or
//! a message is parsed here.

use std::fmt::Display;
use std::str::FromStr;
use std::sync::Arc;

use udm_block::{BlockDevice, OpenMode, SECTOR_SIZE};

use crate::target::{TargetContext, TargetError};

pub struct Args<'a> {
    /// Named at the start of every error ("linear: …"); empty for none.
    target: &'a str,
    tokens: Vec<&'a str>,
    next: usize,
}

impl<'a> Args<'a> {
    pub fn new<S: AsRef<str>>(target: &'a str, tokens: &'a [S]) -> Self {
        Args {
            target,
            tokens: tokens.iter().map(AsRef::as_ref).collect(),
            next: 0,
        }
    }

    /// An error about these arguments.
    pub fn error(&self, message: impl Display) -> TargetError {
        if self.target.is_empty() {
            return TargetError::new(message.to_string());
        }
        TargetError::new(format!("{}: {message}", self.target))
    }

    /// Every token, as given.
    pub fn tokens(&self) -> &[&'a str] {
        &self.tokens
    }

    pub fn remaining(&self) -> usize {
        self.tokens.len() - self.next
    }

    pub fn word(&mut self, what: &str) -> Result<&'a str, TargetError> {
        let token = *self
            .tokens
            .get(self.next)
            .ok_or_else(|| self.error(format!("missing argument <{what}>")))?;
        self.next += 1;
        Ok(token)
    }

    /// The tokens not read yet, which are then read.
    pub fn rest(&mut self) -> &[&'a str] {
        let rest = &self.tokens[self.next..];
        self.next = self.tokens.len();
        rest
    }

    pub fn number<T: FromStr>(&mut self, what: &str) -> Result<T, TargetError> {
        let token = self.word(what)?;
        token
            .parse()
            .map_err(|_| self.error(format!("invalid <{what}> '{token}': expected a number")))
    }

    /// A number of at least `min`.
    pub fn number_at_least<T: FromStr + PartialOrd + Display>(
        &mut self,
        what: &str,
        min: T,
    ) -> Result<T, TargetError> {
        let n: T = self.number(what)?;
        if n < min {
            return Err(self.error(format!("invalid <{what}> {n}: must be at least {min}")));
        }
        Ok(n)
    }

    /// A number within `range`.
    pub fn number_in<T: FromStr + PartialOrd + Display>(
        &mut self,
        what: &str,
        range: std::ops::RangeInclusive<T>,
    ) -> Result<T, TargetError> {
        let n: T = self.number(what)?;
        if !range.contains(&n) {
            return Err(self.error(format!(
                "invalid <{what}> {n}: must be between {} and {}",
                range.start(),
                range.end()
            )));
        }
        Ok(n)
    }

    /// The next `n` tokens, which a count before them announced as `what`.
    pub fn take(&mut self, n: usize, what: &str) -> Result<Vec<&'a str>, TargetError> {
        if n > self.remaining() {
            return Err(self.error(format!(
                "{what}: {n} announced but only {} argument(s) follow",
                self.remaining()
            )));
        }
        let taken = self.tokens[self.next..self.next + n].to_vec();
        self.next += n;
        Ok(taken)
    }

    /// A number if there is a token left, `None` otherwise.
    pub fn optional_number<T: FromStr>(&mut self, what: &str) -> Result<Option<T>, TargetError> {
        if self.remaining() == 0 {
            return Ok(None);
        }
        self.number(what).map(Some)
    }

    /// A sector count, returned in bytes.
    pub fn sectors(&mut self, what: &str) -> Result<u64, TargetError> {
        let sectors: u64 = self.number(what)?;
        sectors
            .checked_mul(SECTOR_SIZE)
            .ok_or_else(|| self.error(format!("<{what}> {sectors} is too large")))
    }

    /// A device reference and its handle.
    pub fn device(
        &mut self,
        ctx: &TargetContext,
        what: &str,
        mode: OpenMode,
    ) -> Result<(String, Arc<dyn BlockDevice>), TargetError> {
        self.device_by(what, |reference| ctx.resolver.open(reference, mode))
    }

    /// A device reference and the handle `open` gives for it.
    pub fn device_by(
        &mut self,
        what: &str,
        open: impl FnOnce(&str) -> Result<Arc<dyn BlockDevice>, TargetError>,
    ) -> Result<(String, Arc<dyn BlockDevice>), TargetError> {
        let reference = self.word(what)?;
        let dev = open(reference)
            .map_err(|e| self.error(format!("cannot open <{what}> '{reference}': {e}")))?;
        Ok((reference.to_string(), dev))
    }

    /// Opens a device reference read earlier (targets that check every token before opening
    /// anything, as the kernel's thin-pool does).
    pub fn open(
        &self,
        ctx: &TargetContext,
        what: &str,
        reference: &str,
        mode: OpenMode,
    ) -> Result<Arc<dyn BlockDevice>, TargetError> {
        ctx.resolver
            .open(reference, mode)
            .map_err(|e| self.error(format!("cannot open <{what}> '{reference}': {e}")))
    }

    /// Fails if tokens are left over.
    pub fn finish(&self) -> Result<(), TargetError> {
        match self.tokens.get(self.next) {
            None => Ok(()),
            Some(extra) => Err(self.error(format!("unexpected argument '{extra}'"))),
        }
    }
}
