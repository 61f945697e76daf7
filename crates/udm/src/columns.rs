//! `udm info -c`: dmsetup's column report (`-o FIELDS`, `--noheadings`, `--separator`), drawn
//! from the daemon's `info` data. Fields that only mean something for kernel devices (major,
//! minor, devno, blkdevname) are refused by name.

use anyhow::bail;
use serde_json::Value;

/// dmsetup's default without major and minor: udm devices have no device numbers.
pub const DEFAULT_FIELDS: &str = "name,attr,open,segments,events,uuid";

/// `splitname`'s default: the parts of an LVM name.
pub const SPLITNAME_FIELDS: &str = "vg_name,lv_name,lv_layer";

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
    Field {
        id: "vg_name",
        heading: "VG",
        width: 2,
        numeric: false,
        value: |d| lvm_part(d, 0),
    },
    Field {
        id: "lv_name",
        heading: "LV",
        width: 2,
        numeric: false,
        value: |d| lvm_part(d, 1),
    },
    Field {
        id: "lv_layer",
        heading: "LVLayer",
        width: 7,
        numeric: false,
        value: |d| lvm_part(d, 2),
    },
];

/// LVM's split of a device-mapper name into volume group, volume and layer, as libdevmapper's
/// dm_split_lvm_name: a single `-` ends a part (one after the layer ends the split), a doubled
/// one stands for `-`, and one at the very end is kept.
pub fn lvm_parts(name: &str) -> [String; 3] {
    let mut parts: [String; 3] = Default::default();
    let mut part = 0;
    let mut chars = name.chars().peekable();
    while let Some(c) = chars.next() {
        match (c, chars.peek()) {
            ('-', Some('-')) => {
                chars.next();
            }
            ('-', Some(_)) if part == 2 => break,
            ('-', Some(_)) => {
                part += 1;
                continue;
            }
            _ => {}
        }
        parts[part].push(c);
    }
    parts
}

/// One part of the device's name split as LVM's.
fn lvm_part(d: &Value, part: usize) -> String {
    let mut parts = lvm_parts(&text(&d["name"]));
    std::mem::take(&mut parts[part])
}

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
    /// The fields without `-o`.
    pub default: &'static str,
    pub headings: bool,
    /// Fields joined with this instead of aligned.
    pub separator: Option<&'a str>,
    /// Each field as `DM_FIELD='value'`, for a shell to eval (dmsetup's --nameprefixes).
    pub name_prefixes: bool,
}

impl Layout<'_> {
    fn fields(&self) -> anyhow::Result<Vec<&'static Field>> {
        let list = match self.fields {
            None => self.default.to_string(),
            Some(extra) if extra.starts_with('+') => format!("{},{}", self.default, &extra[1..]),
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

    /// One field of one device, as `--nameprefixes` says.
    fn cell(&self, field: &Field, device: &Value) -> String {
        let value = (field.value)(device);
        if !self.name_prefixes {
            return value;
        }
        // Quoted for the shell: a `'` in a UUID closes, escapes and reopens the quote.
        let quoted = value.replace('\'', r"'\''");
        format!("DM_{}='{quoted}'", field.id.to_uppercase())
    }

    /// The report for `devices` (the daemon's `info` data for each).
    pub fn render(&self, devices: &[Value]) -> anyhow::Result<String> {
        let fields = self.fields()?;
        let rows: Vec<Vec<String>> = devices
            .iter()
            .map(|d| fields.iter().map(|f| self.cell(f, d)).collect())
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

    #[test]
    fn nameprefixes_quote_each_value_for_the_shell() {
        let layout = Layout {
            fields: Some("name,uuid"),
            default: DEFAULT_FIELDS,
            headings: false,
            separator: Some(":"),
            name_prefixes: true,
        };
        let device = json!({"name": "v", "uuid": "it's"});
        assert_eq!(
            layout.render(&[device]).unwrap(),
            r"DM_NAME='v':DM_UUID='it'\''s'"
        );
    }

    #[test]
    fn lvm_names_split_as_libdevmapper_splits_them() {
        let parts = lvm_parts;
        assert_eq!(parts("vg-lv"), ["vg", "lv", ""]);
        assert_eq!(parts("my--vg-lv--1-tpool"), ["my-vg", "lv-1", "tpool"]);
        // A `-` at the very end is kept; one after the layer ends the split.
        assert_eq!(parts("vg-"), ["vg-", "", ""]);
        assert_eq!(parts("a-b-c-d"), ["a", "b", "c"]);
        assert_eq!(parts("plain"), ["plain", "", ""]);
    }

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
            default: DEFAULT_FIELDS,
            name_prefixes: false,
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
            default: DEFAULT_FIELDS,
            name_prefixes: false,
            fields: Some("name,open,attr"),
            headings: false,
            separator: Some(":"),
        };
        assert_eq!(
            layout.render(&devices()).unwrap(),
            "fast:1:L--w\nvol:0:LIsr"
        );
        let layout = Layout {
            default: DEFAULT_FIELDS,
            name_prefixes: false,
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
            default: DEFAULT_FIELDS,
            name_prefixes: false,
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
