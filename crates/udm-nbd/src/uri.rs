//! NBD URIs (the `nbd://` and `nbd+unix://` forms of the NBD URI specification, the ones
//! qemu and libnbd accept): where a remote export lives and what it is called.

use std::fmt;
use std::net::Ipv6Addr;
use std::os::unix::ffi::OsStringExt;
use std::path::PathBuf;
use std::str::FromStr;

use thiserror::Error;

/// The IANA port for NBD, used when a `nbd://` URI names none.
pub const DEFAULT_PORT: u16 = 10809;

/// Export names longer than this are refused by every server (the protocol's string limit).
const MAX_EXPORT_NAME: usize = 4096;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NbdAddress {
    /// `host` is a name, an IPv4 address or an IPv6 address (without brackets).
    Tcp {
        host: String,
        port: u16,
    },
    Unix {
        path: PathBuf,
    },
}

impl fmt::Display for NbdAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NbdAddress::Tcp { host, port } if host.contains(':') => write!(f, "[{host}]:{port}"),
            NbdAddress::Tcp { host, port } => write!(f, "{host}:{port}"),
            NbdAddress::Unix { path } => write!(f, "unix:{}", path.display()),
        }
    }
}

/// A parsed NBD URI.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NbdUri {
    pub address: NbdAddress,
    /// The export name; empty selects the server's default export.
    pub export: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum UriError {
    #[error("'{uri}': unsupported scheme '{scheme}' (expected nbd:// or nbd+unix://)")]
    UnsupportedScheme { uri: String, scheme: String },
    #[error("'{uri}': TLS (nbds://) is not supported; use nbd:// over a trusted network")]
    Tls { uri: String },
    #[error("'{uri}': {what}")]
    Malformed { uri: String, what: String },
}

impl FromStr for NbdUri {
    type Err = UriError;

    /// Accepts `nbd://HOST[:PORT]/EXPORT` (HOST may be `[IPv6]`) and
    /// `nbd+unix:///EXPORT?socket=PATH`. Percent-escapes in the export and the socket path are
    /// decoded.
    fn from_str(uri: &str) -> Result<Self, UriError> {
        let malformed = |what: String| UriError::Malformed {
            uri: uri.to_string(),
            what,
        };
        let Some((scheme, rest)) = uri.split_once("://") else {
            return Err(malformed(
                "not a URI: expected nbd://HOST[:PORT]/EXPORT or nbd+unix:///EXPORT?socket=PATH"
                    .into(),
            ));
        };
        let unix = match scheme.to_ascii_lowercase().as_str() {
            "nbd" => false,
            "nbd+unix" => true,
            "nbds" | "nbds+unix" => return Err(UriError::Tls { uri: uri.into() }),
            _ => {
                return Err(UriError::UnsupportedScheme {
                    uri: uri.into(),
                    scheme: scheme.into(),
                })
            }
        };
        if rest.contains('#') {
            return Err(malformed(
                "fragments ('#…') have no meaning in an NBD URI".into(),
            ));
        }
        let (before_query, query) = match rest.split_once('?') {
            Some((before, query)) => (before, Some(query)),
            None => (rest, None),
        };
        let (authority, path) = match before_query.find('/') {
            Some(i) => before_query.split_at(i),
            None => (before_query, ""),
        };
        let export = parse_export(path.strip_prefix('/').unwrap_or(path)).map_err(malformed)?;
        let socket = parse_query(query, unix).map_err(malformed)?;
        let address = if unix {
            if !authority.is_empty() {
                return Err(malformed(format!(
                    "nbd+unix:// URIs take no host ('{authority}'); write nbd+unix:///EXPORT?socket=PATH"
                )));
            }
            let path = socket.ok_or_else(|| {
                malformed("nbd+unix:// needs the socket path: ?socket=PATH".into())
            })?;
            NbdAddress::Unix { path }
        } else {
            let (host, port) = parse_authority(authority).map_err(malformed)?;
            NbdAddress::Tcp { host, port }
        };
        Ok(NbdUri { address, export })
    }
}

/// The export name from the URI's path (without its leading '/'): decoded, UTF-8, within the
/// protocol's limits.
fn parse_export(path: &str) -> Result<String, String> {
    let export = decode(path).map_err(|e| format!("export name: {e}"))?;
    let export = String::from_utf8(export).map_err(|_| "export name is not valid UTF-8")?;
    if export.contains('\0') {
        return Err("export name contains a NUL byte".into());
    }
    if export.len() > MAX_EXPORT_NAME {
        return Err(format!(
            "export name of {} bytes exceeds the protocol's {MAX_EXPORT_NAME}",
            export.len()
        ));
    }
    Ok(export)
}

/// The query's one parameter, `socket=PATH`, which only `nbd+unix://` URIs take.
fn parse_query(query: Option<&str>, unix: bool) -> Result<Option<PathBuf>, String> {
    let mut socket = None;
    for param in query.into_iter().flat_map(|q| q.split('&')) {
        match param.split_once('=') {
            Some(("socket", value)) if unix => {
                if socket.is_some() {
                    return Err("'socket' given twice".into());
                }
                let path = decode(value).map_err(|e| format!("socket: {e}"))?;
                if path.is_empty() {
                    return Err("empty socket path".into());
                }
                socket = Some(PathBuf::from(std::ffi::OsString::from_vec(path)));
            }
            Some(("socket", _)) => {
                return Err("'socket' belongs to nbd+unix:// URIs, not nbd://".into())
            }
            _ => return Err(format!("query parameter '{param}' is not supported")),
        }
    }
    Ok(socket)
}

/// `HOST[:PORT]` or `[IPV6][:PORT]`.
fn parse_authority(authority: &str) -> Result<(String, u16), String> {
    if authority.is_empty() {
        return Err("missing host: write nbd://HOST[:PORT]/EXPORT".into());
    }
    if authority.contains('@') {
        return Err("user names ('…@') are not supported".into());
    }
    let (host, port) = if let Some(rest) = authority.strip_prefix('[') {
        let (inside, after) = rest
            .split_once(']')
            .ok_or_else(|| format!("unclosed '[' in '{authority}'"))?;
        inside
            .parse::<Ipv6Addr>()
            .map_err(|_| format!("'{inside}' is not an IPv6 address"))?;
        let port = match after {
            "" => None,
            _ => Some(
                after
                    .strip_prefix(':')
                    .ok_or_else(|| format!("unexpected '{after}' after the IPv6 address"))?,
            ),
        };
        (inside, port)
    } else if authority.matches(':').count() > 1 {
        return Err(format!(
            "IPv6 addresses need brackets: nbd://[{authority}]/EXPORT"
        ));
    } else {
        match authority.split_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (authority, None),
        }
    };
    if host.is_empty() {
        return Err("missing host: write nbd://HOST[:PORT]/EXPORT".into());
    }
    if let Some(bad) = host
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_' | ':')))
    {
        return Err(format!("host '{host}' contains '{bad}'"));
    }
    let port = match port {
        None => DEFAULT_PORT,
        Some(p) => match p.parse::<u16>() {
            Ok(port) if port != 0 && p.bytes().all(|b| b.is_ascii_digit()) => port,
            _ => return Err(format!("port '{p}' is not a number from 1 to 65535")),
        },
    };
    Ok((host.to_string(), port))
}

/// Decodes `%XX` escapes.
fn decode(s: &str) -> Result<Vec<u8>, String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| format!("bad percent-escape at '{}'", &s[i..]))?;
            out.push(hex);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<NbdUri, UriError> {
        s.parse()
    }

    fn tcp(host: &str, port: u16, export: &str) -> NbdUri {
        NbdUri {
            address: NbdAddress::Tcp {
                host: host.into(),
                port,
            },
            export: export.into(),
        }
    }

    fn what(s: &str) -> String {
        parse(s).unwrap_err().to_string()
    }

    #[test]
    fn tcp_forms_parse() {
        for (text, host, port, export) in [
            ("nbd://backup-host/vol", "backup-host", DEFAULT_PORT, "vol"),
            ("nbd://10.0.0.2:10900/a/b", "10.0.0.2", 10900, "a/b"),
            ("nbd://[::1]/vol", "::1", DEFAULT_PORT, "vol"),
            ("nbd://[fe80::2]:7000/", "fe80::2", 7000, ""),
            ("NBD://host", "host", DEFAULT_PORT, ""),
            ("nbd://host/my%20disk", "host", DEFAULT_PORT, "my disk"),
        ] {
            assert_eq!(parse(text).unwrap(), tcp(host, port, export), "{text}");
        }
    }

    #[test]
    fn unix_forms_parse() {
        assert_eq!(
            parse("nbd+unix:///vol?socket=/run/nbd.sock").unwrap(),
            NbdUri {
                address: NbdAddress::Unix {
                    path: "/run/nbd.sock".into()
                },
                export: "vol".into()
            }
        );
        assert_eq!(
            parse("nbd+unix://?socket=rel/dir%20x/s.sock").unwrap(),
            NbdUri {
                address: NbdAddress::Unix {
                    path: "rel/dir x/s.sock".into()
                },
                export: String::new()
            }
        );
    }

    #[test]
    fn errors_name_what_is_wrong() {
        assert!(what("backup-host/vol").contains("not a URI"));
        assert!(what("http://host/vol").contains("unsupported scheme 'http'"));
        assert!(what("nbds://host/vol").contains("TLS"));
        assert!(what("nbd:///vol").contains("missing host"));
        assert!(what("nbd://host:/vol").contains("port ''"));
        assert!(what("nbd://host:0/vol").contains("port '0'"));
        assert!(what("nbd://host:70000/vol").contains("port '70000'"));
        assert!(what("nbd://host:+80/vol").contains("port '+80'"));
        assert!(what("nbd://::1/vol").contains("need brackets"));
        assert!(what("nbd://[::1/vol").contains("unclosed"));
        assert!(what("nbd://[nope]/vol").contains("not an IPv6 address"));
        assert!(what("nbd://[::1]x/vol").contains("unexpected 'x'"));
        assert!(what("nbd://user@host/vol").contains("user names"));
        assert!(what("nbd://ho st/vol").contains("contains ' '"));
        assert!(what("nbd://host/vol?socket=/s").contains("belongs to nbd+unix"));
        assert!(what("nbd://host/vol?tls=on").contains("'tls=on' is not supported"));
        assert!(what("nbd://host/vol#x").contains("fragments"));
        assert!(what("nbd://host/v%zz").contains("percent-escape"));
        assert!(what("nbd://host/v%ff").contains("not valid UTF-8"));
        assert!(what("nbd://host/v%00").contains("NUL"));
        assert!(what("nbd+unix:///vol").contains("needs the socket path"));
        assert!(what("nbd+unix://host/vol?socket=/s").contains("take no host"));
        assert!(what("nbd+unix:///vol?socket=").contains("empty socket path"));
        assert!(what("nbd+unix:///vol?socket=/a&socket=/b").contains("twice"));
        let long = format!("nbd://host/{}", "x".repeat(5000));
        assert!(what(&long).contains("exceeds"));
    }

    #[test]
    fn addresses_display_as_they_are_dialled() {
        assert_eq!(tcp("::1", 10809, "").address.to_string(), "[::1]:10809");
        assert_eq!(tcp("h", 1, "").address.to_string(), "h:1");
        let unix = NbdAddress::Unix {
            path: "/s.sock".into(),
        };
        assert_eq!(unix.to_string(), "unix:/s.sock");
    }
}
