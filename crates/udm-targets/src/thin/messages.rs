//! The pool's messages, parsed as dm-thin's pool_message does: command names in any case,
//! exact argument counts, device ids of 24 bits, transaction ids of 64.

use super::args::parse_dev_id;
use crate::target::TargetError;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolMessage {
    CreateThin(u32),
    CreateSnap { id: u32, origin: u32 },
    Delete(u32),
    SetTransactionId { old: u64, new: u64 },
    ReserveMetadataSnap,
    ReleaseMetadataSnap,
}

const USAGE: &str = "create_thin <dev id>, create_snap <dev id> <origin id>, delete <dev id>, \
                     set_transaction_id <current id> <new id>, reserve_metadata_snap, \
                     release_metadata_snap";

impl PoolMessage {
    pub fn parse(words: &[&str]) -> Result<PoolMessage, TargetError> {
        let error = |what: String| TargetError::new(format!("thin-pool: {what}"));
        let Some((command, rest)) = words.split_first() else {
            return Err(error(format!("empty message (messages: {USAGE})")));
        };
        let command = command.to_ascii_lowercase();
        let expect = |names: &[&str]| {
            if rest.len() == names.len() {
                return Ok(());
            }
            let usage: String = names.iter().map(|n| format!(" <{n}>")).collect();
            Err(error(format!(
                "{command}{usage}: expected {} argument(s), got {}",
                names.len(),
                rest.len()
            )))
        };
        let dev_id = |word: &str| parse_dev_id(word).map_err(|e| error(format!("{command}: {e}")));
        let transaction_id = |word: &str| {
            word.parse::<u64>().map_err(|_| {
                error(format!(
                    "{command}: invalid transaction id '{word}' (a number, 0 to 2^64 - 1)"
                ))
            })
        };
        Ok(match command.as_str() {
            "create_thin" => {
                expect(&["dev id"])?;
                PoolMessage::CreateThin(dev_id(rest[0])?)
            }
            "create_snap" => {
                expect(&["dev id", "origin id"])?;
                PoolMessage::CreateSnap {
                    id: dev_id(rest[0])?,
                    origin: dev_id(rest[1])?,
                }
            }
            "delete" => {
                expect(&["dev id"])?;
                PoolMessage::Delete(dev_id(rest[0])?)
            }
            "set_transaction_id" => {
                expect(&["current id", "new id"])?;
                PoolMessage::SetTransactionId {
                    old: transaction_id(rest[0])?,
                    new: transaction_id(rest[1])?,
                }
            }
            "reserve_metadata_snap" => {
                expect(&[])?;
                PoolMessage::ReserveMetadataSnap
            }
            "release_metadata_snap" => {
                expect(&[])?;
                PoolMessage::ReleaseMetadataSnap
            }
            _ => {
                return Err(error(format!(
                    "unrecognised message '{}' (messages: {USAGE})",
                    words[0]
                )))
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<PoolMessage, String> {
        let words: Vec<&str> = text.split_whitespace().collect();
        PoolMessage::parse(&words).map_err(|e| e.to_string())
    }

    #[test]
    fn every_message_parses() {
        assert_eq!(parse("create_thin 0"), Ok(PoolMessage::CreateThin(0)));
        assert_eq!(
            parse("CREATE_THIN 16777215"),
            Ok(PoolMessage::CreateThin((1 << 24) - 1))
        );
        assert_eq!(
            parse("create_snap 2 1"),
            Ok(PoolMessage::CreateSnap { id: 2, origin: 1 })
        );
        assert_eq!(parse("delete 9"), Ok(PoolMessage::Delete(9)));
        assert_eq!(
            parse("set_transaction_id 0 18446744073709551615"),
            Ok(PoolMessage::SetTransactionId {
                old: 0,
                new: u64::MAX
            })
        );
        assert_eq!(
            parse("reserve_metadata_snap"),
            Ok(PoolMessage::ReserveMetadataSnap)
        );
        assert_eq!(
            parse("release_metadata_snap"),
            Ok(PoolMessage::ReleaseMetadataSnap)
        );
    }

    #[test]
    fn hostile_messages_are_refused_naming_the_token() {
        let cases = [
            ("", "empty message"),
            (
                "create_thin",
                "create_thin <dev id>: expected 1 argument(s), got 0",
            ),
            ("create_thin 1 2", "expected 1 argument(s), got 2"),
            ("create_thin 16777216", "invalid device id '16777216'"),
            ("create_thin -1", "invalid device id '-1'"),
            ("create_thin 0x10", "invalid device id '0x10'"),
            (
                "create_snap 1",
                "create_snap <dev id> <origin id>: expected 2",
            ),
            ("create_snap 1 x", "invalid device id 'x'"),
            ("delete", "expected 1 argument(s), got 0"),
            ("set_transaction_id 1", "expected 2 argument(s), got 1"),
            (
                "set_transaction_id 1 18446744073709551616",
                "invalid transaction id",
            ),
            ("reserve_metadata_snap now", "expected 0 argument(s), got 1"),
            ("frobnicate 1", "unrecognised message 'frobnicate'"),
            ("\u{0}\u{1}", "unrecognised message"),
        ];
        for (text, expected) in cases {
            let err = parse(text).unwrap_err();
            assert!(err.starts_with("thin-pool: "), "{text:?}: {err}");
            assert!(err.contains(expected), "{text:?}: {err}");
        }
    }
}
