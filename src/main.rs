//! The `floodgate` binary: flags, logging, exit codes.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::Parser;
use tracing_subscriber::EnvFilter;

/// A rate-limiting reverse proxy.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Flags {
    /// The configuration file.
    #[arg(long, env = "FLOODGATE_CONFIG", default_value = "floodgate.toml")]
    config: PathBuf,
    /// Validate the configuration, print every problem, and exit.
    #[arg(long)]
    check: bool,
}

fn main() -> ExitCode {
    let flags = Flags::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_env("FLOODGATE_LOG").unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();

    let config = match floodgate::config::load(&flags.config) {
        Ok(config) => config,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    if flags.check {
        println!(
            "{}: ok ({} routes)",
            flags.config.display(),
            config.routes.len()
        );
        return ExitCode::SUCCESS;
    }
    match serve(config) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("floodgate: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn serve(config: floodgate::config::Config) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(async {
        let listen = config.server.listen;
        let listener = tokio::net::TcpListener::bind(listen)
            .await
            .with_context(|| format!("cannot listen on {listen}"))?;
        tracing::info!(%listen, routes = config.routes.len(), "floodgate listening");
        floodgate::run(config, listener, shutdown_signal())
            .await
            .context("server failed")
    })
}

/// Completes on SIGTERM or SIGINT.
async fn shutdown_signal() {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = interrupt => {}
                    _ = term.recv() => {}
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot watch SIGTERM; only SIGINT stops floodgate");
                let _ = interrupt.await;
            }
        }
    }
    #[cfg(not(unix))]
    let _ = interrupt.await;
    tracing::info!("stop signal received");
}
