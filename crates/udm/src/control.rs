//! The control protocol between `udm` verbs and the daemon: one JSON object per line on a
//! Unix socket, answered by one JSON object per line. Described in docs/control-protocol.md.

use serde::{Deserialize, Serialize};

pub const PROTOCOL_VERSION: u32 = 1;

/// Every request names a device by its name or its UUID. Fields added since version 1 first
/// spoke are optional, so older clients' requests mean what they meant.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "command", rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    Create {
        name: String,
        table: String,
        #[serde(default)]
        read_only: bool,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        uuid: Option<String>,
    },
    Load {
        name: String,
        table: String,
        #[serde(default)]
        force: bool,
        /// The device is read-only once this table is live.
        #[serde(default)]
        read_only: bool,
    },
    Clear {
        name: String,
    },
    Suspend {
        name: String,
        #[serde(default)]
        noflush: bool,
    },
    Resume {
        name: String,
        #[serde(default)]
        noflush: bool,
    },
    Message {
        name: String,
        sector: u64,
        words: Vec<String>,
    },
    /// Without a name: every device.
    Status {
        #[serde(default)]
        name: Option<String>,
        /// Only segments of this target type.
        #[serde(default)]
        target: Option<String>,
    },
    /// Without a name: every device.
    Table {
        #[serde(default)]
        name: Option<String>,
        #[serde(default)]
        target: Option<String>,
        /// The inactive table instead of the live one.
        #[serde(default)]
        inactive: bool,
    },
    /// Without a name: every device (`data` is then a list).
    Info {
        #[serde(default)]
        name: Option<String>,
    },
    Ls {
        #[serde(default)]
        tree: bool,
        /// Only devices with a target of this type.
        #[serde(default)]
        target: Option<String>,
    },
    /// Without a name: every device.
    Deps {
        #[serde(default)]
        name: Option<String>,
    },
    Wait {
        name: String,
        event_nr: Option<u64>,
    },
    /// A new name, or (`uuid`) a UUID for a device that has none.
    Rename {
        name: String,
        #[serde(default)]
        new_name: Option<String>,
        #[serde(default)]
        uuid: Option<String>,
    },
    Remove {
        name: String,
        #[serde(default)]
        force: bool,
        /// Wait longer for clients to let go (dmsetup's `--retry`).
        #[serde(default)]
        retry: bool,
        /// Remove once nothing uses the device any more.
        #[serde(default)]
        deferred: bool,
    },
    RemoveAll {
        #[serde(default)]
        force: bool,
    },
    Finalize {
        name: String,
    },
    Targets,
    Version,
    /// What differs between two thin devices of a pool (`from` None: everything `to` maps).
    ThinDelta {
        pool: String,
        #[serde(default)]
        from: Option<u32>,
        to: u32,
    },
    /// Streams thin device `id` of `pool` (what changed since `from`): the answer (`data`:
    /// what the stream holds) is followed by the stream's bytes, from record `start_at` on,
    /// and the connection ends with them.
    Send {
        pool: String,
        id: u32,
        #[serde(default)]
        from: Option<u32>,
        #[serde(default)]
        start_at: u64,
    },
    /// Receives a stream into new thin device `id` of `pool`: the first answer (`data`: a
    /// receive kept for resuming, or null) is followed by the stream from the client, then
    /// a second answer says how it went, and the connection ends.
    Receive {
        pool: String,
        id: u32,
        /// The local device that holds the stream's base (found by default).
        #[serde(default)]
        base: Option<u32>,
        /// Keep a failed receive for resuming, and continue one kept before.
        #[serde(default)]
        resume: bool,
    },
    /// Stop the daemon as SIGTERM does; the answer (`data`: pid, state_dir) comes first.
    Stop,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct Envelope {
    pub version: u32,
    #[serde(flatten)]
    pub request: Request,
}

#[derive(Debug, Default, Serialize, Deserialize)]
pub struct Response {
    pub ok: bool,
    /// What the client prints on success.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub output: String,
    /// The same answer as structured data, for `--json`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<serde_json::Value>,
    /// One line saying what went wrong.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl Response {
    pub fn text(output: impl Into<String>) -> Self {
        Response {
            ok: true,
            output: output.into(),
            ..Default::default()
        }
    }

    pub fn error(message: impl std::fmt::Display) -> Self {
        // One line, whatever the cause chain looked like.
        let message = message.to_string().replace('\n', "; ");
        Response {
            ok: false,
            error: Some(message),
            ..Default::default()
        }
    }
}
