//! `udm info -c`: dmsetup's column report (`-o FIELDS`, `--noheadings`, `--separator`), drawn
//! from the daemon's `info` data. Fields that only mean something for kernel devices (major,
//! minor, devno, blkdevname) are refused by name.

use anyhow::bail;
use serde_json::Value;

/// dmsetup's default without major and minor: udm devices have no device numbers.
const DEFAULT_FIELDS: &str = "name,attr,open,segments,events,uuid";

struct Field {
    id: &'static str,
    heading: &'static str,
    /// dmsetup's minimum column width.
    width: usize,
    numeric: bool,
    value: fn(&Value) -> String,
}

const FIELDS: &[Field] = &[
    Field {
        id: "name",
        heading: "Name",
        width: 16,
        numeric: false,
        value: |d| text(&d["name"]),
    },
    Field {
        id: "uuid",
        heading: "UUID",
        width: 32,
        numeric: false,
        value: |d| text(&d["uuid"]),
    },
    Field {
        id: "attr",
        heading: "Stat",
        width: 4,
        numeric: false,
        value: attr,
    },
    Field {
        id: "tables_loaded",
        heading: "Tables",
        width: 6,
        numeric: false,
        value: |d| {
            match d["inactive_table"].as_bool() == Some(true) {
                true => "Both",
                false => "Live",
            }
            .into()
        },
    },
    Field {
        id: "suspended",
        heading: "Suspended",
        width: 9,
        numeric: false,
        value: |d| {
            match d["state"] == "SUSPENDED" {
                true => "Suspended",
                false => "Active",
            }
            .into()
        },
    },
    Field {
        id: "readonly",
        heading: "Read-only",
        width: 9,
        numeric: false,
        value: |d| {
            match d["read_only"].as_bool() == Some(true) {
                true => "Read-only",
                false => "Writeable",
            }
            .into()
        },
    },
    Field {
        id: "open",
        heading: "Open",
        width: 4,
        numeric: true,
        value: |d| text(&d["open_count"]),
    },
    Field {
        id: "segments",
        heading: "Targ",
        width: 4,
        numeric: true,
        value: |d| text(&d["segments"]),
    },
    Field {
        id: "events",
        heading: "Event",
        width: 6,
        numeric: true,
        value: |d| text(&d["event_nr"]),
    },
    Field {
        id: "sectors",
        heading: "Sectors",
        width: 7,
        numeric: true,
        value: |d| text(&d["sectors"]),
    },
];

/// Kernel-only fields, refused with a reason rather than as unknown.
const KERNEL_FIELDS: &[&str] = &["major", "minor", "devno", "blkdevname", "read_ahead"];

fn text(value: &Value) -> String {
    match value {
        Value::Null => String::new(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// dmsetup's Stat: (L)ive, (I)nactive, (s)uspended, (r)ead-only or read-(w)rite.
fn attr(d: &Value) -> String {
    let flag = |on: bool, c: char| if on { c } else { '-' };
    [
        'L',
        flag(d["inactive_table"].as_bool() == Some(true), 'I'),
        flag(d["state"] == "SUSPENDED", 's'),
        if d["read_only"].as_bool() == Some(true) {
            'r'
        } else {
            'w'
        },
    ]
    .iter()
    .collect()
}

/// How the report is laid out.
pub struct Layout<'a> {
    /// `-o`: a list, or `+LIST` to add to the default.
    pub fields: Option<&'a str>,
    pub headings: bool,
    /// Fields joined with this instead of aligned.
    pub separator: Option<&'a str>,
}

impl Layout<'_> {
    fn fields(&self) -> anyhow::Result<Vec<&'static Field>> {
        let list = match self.fields {
            None => DEFAULT_FIELDS.to_string(),
            Some(extra) if extra.starts_with('+') => format!("{DEFAULT_FIELDS},{}", &extra[1..]),
            Some(list) => list.to_string(),
        };
        list.split(',')
            .map(str::trim)
            .filter(|id| !id.is_empty())
            .map(|id| {
                if KERNEL_FIELDS.contains(&id) {
                    bail!("field '{id}': udm devices are not kernel block devices and have none");
                }
                FIELDS.iter().find(|f| f.id == id).ok_or_else(|| {
                    let known: Vec<_> = FIELDS.iter().map(|f| f.id).collect();
                    anyhow::anyhow!("unknown field '{id}' (fields: {})", known.join(", "))
                })
            })
            .collect()
    }

    /// The report for `devices` (the daemon's `info` data for each).
    pub fn render(&self, devices: &[Value]) -> anyhow::Result<String> {
        let fields = self.fields()?;
        let rows: Vec<Vec<String>> = devices
            .iter()
            .map(|d| fields.iter().map(|f| (f.value)(d)).collect())
            .collect();
        let mut lines = Vec::new();
        if let Some(separator) = self.separator {
            if self.headings {
                lines.push(
                    fields
                        .iter()
                        .map(|f| f.heading)
                        .collect::<Vec<_>>()
                        .join(separator),
                );
            }
            lines.extend(rows.iter().map(|row| row.join(separator)));
            return Ok(lines.join("\n"));
        }
        let widths: Vec<usize> = fields
            .iter()
            .enumerate()
            .map(|(i, f)| {
                rows.iter()
                    .map(|r| r[i].chars().count())
                    .chain([f.width, f.heading.len()])
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        let line = |cells: Vec<(&str, bool)>| {
            let padded: Vec<String> = cells
                .iter()
                .zip(&widths)
                .map(|((cell, numeric), width)| match numeric {
                    true => format!("{cell:>width$}"),
                    false => format!("{cell:<width$}"),
                })
                .collect();
            padded.join(" ").trim_end().to_string()
        };
        if self.headings {
            lines.push(line(fields.iter().map(|f| (f.heading, false)).collect()));
        }
        for row in &rows {
            let cells = row
                .iter()
                .zip(&fields)
                .map(|(c, f)| (c.as_str(), f.numeric))
                .collect();
            lines.push(line(cells));
        }
        Ok(lines.join("\n"))
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn devices() -> Vec<Value> {
        vec![
            json!({"name": "fast", "uuid": null, "state": "ACTIVE", "read_only": false,
                   "inactive_table": false, "open_count": 1, "segments": 1, "event_nr": 0,
                   "sectors": 2097152}),
            json!({"name": "vol", "uuid": "U-1", "state": "SUSPENDED", "read_only": true,
                   "inactive_table": true, "open_count": 0, "segments": 2, "event_nr": 12,
                   "sectors": 8}),
        ]
    }

    #[test]
    fn the_default_report_is_dmsetups_without_device_numbers() {
        let layout = Layout {
            fields: None,
            headings: true,
            separator: None,
        };
        assert_eq!(
            layout.render(&devices()).unwrap(),
            "Name             Stat Open Targ Event  UUID\n\
             fast             L--w    1    1      0\n\
             vol              LIsr    0    2     12 U-1"
        );
    }

    #[test]
    fn noheadings_is_colon_separated_as_in_dmsetup() {
        let layout = Layout {
            fields: Some("name,open,attr"),
            headings: false,
            separator: Some(":"),
        };
        assert_eq!(
            layout.render(&devices()).unwrap(),
            "fast:1:L--w\nvol:0:LIsr"
        );
        let layout = Layout {
            fields: Some("+sectors"),
            headings: true,
            separator: Some(";"),
        };
        let out = layout.render(&devices()).unwrap();
        assert_eq!(
            out.lines().next().unwrap(),
            "Name;Stat;Open;Targ;Event;UUID;Sectors"
        );
    }

    #[test]
    fn unknown_and_kernel_only_fields_are_refused_by_name() {
        let layout = |fields| Layout {
            fields: Some(fields),
            headings: true,
            separator: None,
        };
        let e = layout("name,frob")
            .render(&devices())
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown field 'frob'"), "{e}");
        let e = layout("major").render(&devices()).unwrap_err().to_string();
        assert!(e.contains("not kernel block devices"), "{e}");
    }
}
