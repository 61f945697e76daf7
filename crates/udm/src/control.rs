//! The control protocol between `udm` verbs and the daemon: one JSON object per line on a
//! Unix socket, answered by one JSON object per line. Described in docs/control-protocol.md.

use serde::{Deserialize, Serialize};

pub const PROTOCOL_VERSION: u32 = 1;

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "command", rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    Create {
        name: String,
        table: String,
        #[serde(default)]
        read_only: bool,
    },
    Load {
        name: String,
        table: String,
        #[serde(default)]
        force: bool,
    },
    Clear {
        name: String,
    },
    Suspend {
        name: String,
    },
    Resume {
        name: String,
    },
    Message {
        name: String,
        sector: u64,
        words: Vec<String>,
    },
    Status {
        name: String,
    },
    Table {
        name: String,
    },
    Info {
        name: String,
    },
    Ls {
        #[serde(default)]
        tree: bool,
    },
    Wait {
        name: String,
        event_nr: Option<u64>,
    },
    Remove {
        name: String,
        #[serde(default)]
        force: bool,
    },
    Finalize {
        name: String,
    },
    Targets,
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
