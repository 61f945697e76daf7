//! How a table line names a device, one rule for the daemon that opens it, the client that
//! sends it and the targets that share what it names.

use std::path::{Component, Path, PathBuf};

/// A device reference from a table line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reference<'a> {
    /// A file or block device: `/…`, or relative to the writer's directory, `./…` or `../…`.
    Path(&'a str),
    /// A remote NBD export: `nbd://…` or `nbd+unix://…`.
    Remote(&'a str),
    /// Any other word: another udm device.
    Device(&'a str),
}

impl<'a> Reference<'a> {
    pub fn parse(reference: &'a str) -> Self {
        if reference.starts_with('/') || Self::is_relative_path(reference) {
            Reference::Path(reference)
        } else if reference.starts_with("nbd://") || reference.starts_with("nbd+unix://") {
            Reference::Remote(reference)
        } else {
            Reference::Device(reference)
        }
    }

    /// A path relative to the directory of whoever wrote the table: the client makes it
    /// absolute before sending, since the daemon's directory is not the caller's.
    pub fn is_relative_path(reference: &str) -> bool {
        reference.starts_with("./") || reference.starts_with("../")
    }

    /// `table` with every relative path (`./x`, `../x`) made absolute against `base`, its
    /// words joined by one space and its lines by a newline.
    pub fn absolute_paths(table: &str, base: &Path) -> String {
        let lines: Vec<String> = table
            .lines()
            .map(|line| {
                line.split_whitespace()
                    .map(|word| match Self::is_relative_path(word) {
                        true => normalize(&base.join(word)).display().to_string(),
                        false => word.to_string(),
                    })
                    .collect::<Vec<_>>()
                    .join(" ")
            })
            .collect();
        lines.join("\n")
    }
}

/// `path` without `.` and `..` components (textually: symlinks are not followed).
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for component in path.components() {
        match component {
            Component::CurDir => {}
            Component::ParentDir => {
                out.pop();
            }
            other => out.push(other),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_remotes_and_devices() {
        for path in ["/dev/sdb", "./a.img", "../b.img"] {
            assert_eq!(Reference::parse(path), Reference::Path(path));
        }
        for uri in ["nbd://host/x", "nbd+unix:///x?socket=/s"] {
            assert_eq!(Reference::parse(uri), Reference::Remote(uri));
        }
        for name in ["vol", "a.img", ".hidden", "nbd:x"] {
            assert_eq!(Reference::parse(name), Reference::Device(name));
        }
        assert!(Reference::is_relative_path("./a") && !Reference::is_relative_path("/a"));
    }

    #[test]
    fn relative_paths_become_absolute_and_names_stay() {
        let base = Path::new("/srv/disks");
        let table = "0 8 linear ./a.img 0\n8 8 linear vol 0\n16 8 linear ../x/./b.img 0";
        assert_eq!(
            Reference::absolute_paths(table, base),
            "0 8 linear /srv/disks/a.img 0\n8 8 linear vol 0\n16 8 linear /srv/x/b.img 0"
        );
        assert_eq!(
            Reference::absolute_paths("0 8  linear /a.img 0\n", base),
            "0 8 linear /a.img 0"
        );
    }
}
