//! A TCP relay between floodgate and Redis that can go silent the way a lost
//! host does: connections stay open, bytes sent are never answered, and
//! nothing tells the sender. Then the address works again for new
//! connections only, as when a managed Redis comes back on a new host under
//! the same name, while the old connections stay silent (TCP would give up
//! on them only after many minutes).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;

pub struct Relay {
    pub addr: SocketAddr,
    state: Arc<State>,
    /// The accept loop; every connection's tasks are in its set, so
    /// dropping the relay ends them all.
    task: tokio::task::JoinHandle<()>,
}

struct State {
    /// Connections accepted before this generation are silent.
    silent_before: AtomicU64,
    /// The generation of the next connection.
    next: AtomicU64,
    /// New connections are accepted and then never answered.
    refuse_service: AtomicBool,
}

impl Relay {
    /// A relay on a free loopback port to `target`.
    pub async fn start(target: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind relay");
        let addr = listener.local_addr().expect("relay addr");
        let state = Arc::new(State {
            silent_before: AtomicU64::new(0),
            next: AtomicU64::new(0),
            refuse_service: AtomicBool::new(false),
        });
        let shared = Arc::clone(&state);
        let task = tokio::spawn(async move {
            let mut connections = JoinSet::new();
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    continue;
                };
                let generation = shared.next.fetch_add(1, Ordering::SeqCst);
                if shared.refuse_service.load(Ordering::SeqCst) {
                    // Held open, never read: a host that is not there.
                    connections.spawn(async move {
                        let _held = client;
                        std::future::pending::<()>().await;
                    });
                    continue;
                }
                let Ok(server) = TcpStream::connect(target).await else {
                    continue;
                };
                let (client_read, client_write) = client.into_split();
                let (server_read, server_write) = server.into_split();
                let up = Arc::clone(&shared);
                let down = Arc::clone(&shared);
                connections.spawn(pipe(client_read, server_write, generation, up));
                connections.spawn(pipe(server_read, client_write, generation, down));
            }
        });
        Self { addr, state, task }
    }

    /// Every connection goes silent, and so does every new one.
    pub fn go_silent(&self) {
        self.state.refuse_service.store(true, Ordering::SeqCst);
        let next = self.state.next.load(Ordering::SeqCst);
        self.state.silent_before.store(next, Ordering::SeqCst);
    }

    /// New connections are served again; the silent ones stay silent.
    pub fn serve_new_connections(&self) {
        let next = self.state.next.load(Ordering::SeqCst);
        self.state.silent_before.store(next, Ordering::SeqCst);
        self.state.refuse_service.store(false, Ordering::SeqCst);
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Copies `from` to `to` until either closes; once the connection of
/// `generation` is silenced, keeps both open and copies nothing more.
async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    generation: u64,
    state: Arc<State>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if generation < state.silent_before.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
