//! A bare hyper gateway: hyper's HTTP/1.1 server on each accepted
//! connection, one hyper HTTP/1.1 client connection to the upstream per
//! client connection, and `send_request` in between. No pool, no headers
//! added or removed, no limits, no timers, no logs: what proxying costs with
//! the same codecs floodgate uses, to measure floodgate's own layers
//! against.
//!
//!   bare-gateway LISTEN UPSTREAM      e.g. 127.0.0.1:8080 127.0.0.1:9000

use std::net::SocketAddr;
use std::sync::Arc;

use hyper::body::Incoming;
use hyper::client::conn::http1 as client;
use hyper::server::conn::http1 as server;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Mutex;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let usage = "usage: bare-gateway LISTEN UPSTREAM";
    let listen: SocketAddr = args.next().ok_or(usage)?.parse()?;
    let upstream: SocketAddr = args.next().ok_or(usage)?.parse()?;
    let listener = TcpListener::bind(listen).await?;
    loop {
        let (stream, _) = listener.accept().await?;
        tokio::spawn(async move {
            let Ok(up) = TcpStream::connect(upstream).await else {
                return;
            };
            let Ok((sender, connection)) = client::handshake(TokioIo::new(up)).await else {
                return;
            };
            tokio::spawn(connection);
            // HTTP/1.1 serves one request at a time per connection: the lock
            // is never contended.
            let sender = Arc::new(Mutex::new(sender));
            let service = service_fn(move |request: Request<Incoming>| {
                let sender = Arc::clone(&sender);
                async move {
                    let response: Response<Incoming> =
                        sender.lock().await.send_request(request).await?;
                    Ok::<_, hyper::Error>(response)
                }
            });
            let _ = server::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}
