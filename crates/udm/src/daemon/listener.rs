//! `--nbd` listeners: where the NBD server listens, and what each listener lets clients reach.

use std::path::PathBuf;
use std::sync::Arc;

use udm_block::{Export, ExportCatalog, MetaContext};

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Address {
    Unix(PathBuf),
    Tcp(String),
}

/// One `--nbd` value: `ADDRESS[,export=NAME]…[,read-only]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listener {
    pub address: Address,
    /// Only these devices are listed and opened here; `None`: every device.
    pub exports: Option<Vec<String>>,
    /// Every device is read-only through this listener.
    pub read_only: bool,
}

impl std::str::FromStr for Listener {
    type Err = String;
    /// `unix:PATH`, `tcp:PORT` (loopback), `tcp:HOST:PORT` or `tcp:[IPv6]:PORT`, then options
    /// after commas. (Device names cannot hold a comma, so a comma always starts an option.)
    fn from_str(s: &str) -> Result<Self, String> {
        let mut parts = s.split(',');
        let address = parse_address(parts.next().unwrap_or_default())?;
        let mut listener = Listener {
            address,
            exports: None,
            read_only: false,
        };
        for option in parts {
            match option.split_once('=') {
                Some(("export", name)) if !name.is_empty() => listener
                    .exports
                    .get_or_insert_with(Vec::new)
                    .push(name.to_string()),
                None if option == "read-only" => listener.read_only = true,
                _ => {
                    return Err(format!(
                    "'{s}': unknown listener option '{option}' (expected export=NAME or read-only)"
                ))
                }
            }
        }
        Ok(listener)
    }
}

fn parse_address(s: &str) -> Result<Address, String> {
    if let Some(path) = s.strip_prefix("unix:") {
        if path.is_empty() {
            return Err("unix: needs a socket path".into());
        }
        return Ok(Address::Unix(path.into()));
    }
    if let Some(addr) = s.strip_prefix("tcp:") {
        if addr.parse::<u16>().is_ok() {
            return Ok(Address::Tcp(format!("127.0.0.1:{addr}")));
        }
        return match addr.rsplit_once(':') {
            Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => {
                Ok(Address::Tcp(addr.to_string()))
            }
            _ => Err(format!("'{s}': expected tcp:PORT or tcp:HOST:PORT")),
        };
    }
    Err(format!("'{s}': expected unix:PATH or tcp:[HOST:]PORT"))
}

impl Listener {
    /// The exports as this listener's clients see them.
    pub fn catalog(&self, all: Arc<dyn ExportCatalog>) -> Arc<dyn ExportCatalog> {
        if self.exports.is_none() && !self.read_only {
            return all;
        }
        Arc::new(Restricted {
            all,
            exports: self.exports.clone(),
            read_only: self.read_only,
        })
    }
}

/// A listener's view: devices outside its allow list do not exist for its clients (they are
/// neither listed nor opened), and a read-only listener opens every device read-only.
struct Restricted {
    all: Arc<dyn ExportCatalog>,
    exports: Option<Vec<String>>,
    read_only: bool,
}

impl Restricted {
    fn allows(&self, name: &str) -> bool {
        self.exports
            .as_ref()
            .is_none_or(|allowed| allowed.iter().any(|a| a == name))
    }
}

impl ExportCatalog for Restricted {
    fn open(&self, name: &str) -> Option<Export> {
        if !self.allows(name) {
            return None;
        }
        let mut export = self.all.open(name)?;
        export.read_only |= self.read_only;
        Some(export)
    }

    fn list(&self) -> Vec<(String, String)> {
        let mut list = self.all.list();
        list.retain(|(name, _)| self.allows(name));
        list
    }

    fn meta_context(&self, name: &str, context: &str) -> Option<Arc<dyn MetaContext>> {
        self.allows(name)
            .then(|| self.all.meta_context(name, context))
            .flatten()
    }

    fn meta_contexts(&self, name: &str, prefix: &str) -> Vec<String> {
        match self.allows(name) {
            true => self.all.meta_contexts(name, prefix),
            false => Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_and_options_parse() {
        let l: Listener = "tcp:10809,export=vol1,export=a+b,read-only"
            .parse()
            .unwrap();
        assert_eq!(l.address, Address::Tcp("127.0.0.1:10809".into()));
        assert_eq!(l.exports, Some(vec!["vol1".into(), "a+b".into()]));
        assert!(l.read_only);
        let l: Listener = "tcp:[::1]:10809".parse().unwrap();
        assert_eq!(l.address, Address::Tcp("[::1]:10809".into()));
        assert_eq!((l.exports, l.read_only), (None, false));
        let l: Listener = "unix:/run/udm/nbd.sock,read-only".parse().unwrap();
        assert_eq!(l.address, Address::Unix("/run/udm/nbd.sock".into()));
        assert!(l.read_only);
    }

    #[test]
    fn bad_options_are_named() {
        for (bad, named) in [
            ("tcp:10809,exports=vol1", "exports=vol1"),
            ("tcp:10809,export=", "export="),
            ("tcp:10809,readonly", "readonly"),
        ] {
            let err = bad.parse::<Listener>().unwrap_err();
            assert!(err.contains(&format!("'{named}'")), "{err}");
        }
        assert!("tcp:".parse::<Listener>().is_err());
        assert!("unix:,read-only".parse::<Listener>().is_err());
    }
}
