//! How a table line names a device, one rule for the daemon that opens it, the client that
//! sends it and the targets that share what it names.

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
}
