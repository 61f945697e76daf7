//! Reading table arguments one token at a time, with errors that name the token.

use std::sync::Arc;

use udm_block::{BlockDevice, OpenMode, SECTOR_SIZE};

use crate::target::{TargetContext, TargetError};

pub struct Args<'a> {
    target: &'a str,
    tokens: &'a [String],
    next: usize,
}

impl<'a> Args<'a> {
    pub fn new(target: &'a str, tokens: &'a [String]) -> Self {
        Args {
            target,
            tokens,
            next: 0,
        }
    }

    /// An error about this target's arguments.
    pub fn error(&self, message: impl std::fmt::Display) -> TargetError {
        TargetError::new(format!("{}: {message}", self.target))
    }

    /// Every token of the line's arguments, as given.
    pub fn tokens(&self) -> &'a [String] {
        self.tokens
    }

    pub fn remaining(&self) -> usize {
        self.tokens.len() - self.next
    }

    pub fn word(&mut self, what: &str) -> Result<&'a str, TargetError> {
        let token = self
            .tokens
            .get(self.next)
            .ok_or_else(|| self.error(format!("missing argument <{what}>")))?;
        self.next += 1;
        Ok(token)
    }

    pub fn number<T: std::str::FromStr>(&mut self, what: &str) -> Result<T, TargetError> {
        let token = self.word(what)?;
        token
            .parse()
            .map_err(|_| self.error(format!("invalid <{what}> '{token}': expected a number")))
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
        let reference = self.word(what)?;
        let dev = self.open(ctx, what, reference, mode)?;
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
