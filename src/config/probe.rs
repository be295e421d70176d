//! What `floodgate --probe` reads of a file: only where floodgate
//! listens, so that a running floodgate is found even when the file has
//! since been edited into an invalid state.

use std::net::SocketAddr;
use std::path::Path;

use serde::Deserialize;

/// Where a configuration file says floodgate listens, as `--probe` reads
/// it: the proxy listener's address, the admin listener's if any, and
/// whether the proxy listener speaks TLS. Addresses only; the bound
/// sockets are `server::Listeners`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ListenAddresses {
    /// `[server] listen`: the proxy listener.
    pub listen: SocketAddr,
    /// `[server] admin_listen`: the admin listener, if any.
    pub admin_listen: Option<SocketAddr>,
    /// Whether `[server] tls` is set: the proxy listener speaks TLS.
    pub tls: bool,
}

/// Reads only `[server]`'s `listen`, `admin_listen` and whether `tls` is
/// set, ignoring the rest of the file: what `floodgate --probe` needs to
/// find a running floodgate. A file edited into an invalid state is still
/// probed by the addresses the running process took at its start (a listener
/// change needs a restart), so the health check follows the process, not
/// the next reload.
pub fn listen_addresses(path: &Path) -> Result<ListenAddresses, String> {
    #[derive(Deserialize)]
    struct File {
        server: Server,
    }
    #[derive(Deserialize)]
    struct Server {
        listen: String,
        admin_listen: Option<String>,
        tls: Option<toml::Value>,
    }
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let file: File = toml::from_str(&text).map_err(|e| {
        let place = e
            .span()
            .map(|span| {
                let (line, column) = super::problems::line_column(&text, span.start);
                format!(":{line}:{column}")
            })
            .unwrap_or_default();
        format!("{}{place}: {}", path.display(), e.message())
    })?;
    let address = |text: &str, key: &str| {
        text.parse::<SocketAddr>().map_err(|_| {
            format!(
                "{}: [server] {key} {text:?} is not an address and port",
                path.display()
            )
        })
    };
    Ok(ListenAddresses {
        listen: address(&file.server.listen, "listen")?,
        admin_listen: match &file.server.admin_listen {
            Some(a) => Some(address(a, "admin_listen")?),
            None => None,
        },
        tls: file.server.tls.is_some(),
    })
}
