//! The `floodgate` binary: flags, logging, exit codes.

use std::path::PathBuf;
use std::process::ExitCode;

use std::sync::Arc;

use anyhow::Context as _;
use clap::Parser;
use tokio::sync::Notify;
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
    /// With --check: also connect to the store (and give it the decision
    /// code, as a start does) and to each upstream endpoint's address,
    /// and say what answers; exit 1 if anything does not.
    #[arg(long, requires = "check")]
    connect: bool,
    /// The proxy's listener, in place of the file's `[server] listen`: so
    /// that instances on one host can share one configuration file.
    #[arg(long, env = "FLOODGATE_LISTEN", value_name = "ADDRESS:PORT")]
    listen: Option<std::net::SocketAddr>,
    /// The admin listener, in place of (or in addition to) the file's
    /// `[server] admin_listen`.
    #[arg(long, env = "FLOODGATE_ADMIN_LISTEN", value_name = "ADDRESS:PORT")]
    admin_listen: Option<std::net::SocketAddr>,
    /// Log format: "text" for people, "json" for log pipelines.
    #[arg(long, env = "FLOODGATE_LOG_FORMAT", default_value = "text")]
    log_format: LogFormat,
    /// A container health check without curl: exit 0 when floodgate is
    /// healthy, 1 otherwise. With a URL, GET it and want a 2xx answer.
    /// Without one, read the configuration file (`--config`,
    /// `FLOODGATE_CONFIG`) and GET `/healthz` on its admin listener, or,
    /// when it has none, connect to its proxy listener.
    #[arg(long, value_name = "URL", num_args = 0..=1)]
    probe: Option<Option<String>>,
    /// Translate envoyproxy/ratelimit's YAML configuration (one or more
    /// files, each with one or more domains) into floodgate's descriptor
    /// routes, printed as TOML; what cannot be expressed the same way is
    /// refused by name, and nothing is printed.
    #[arg(long, value_name = "FILE", num_args = 1..)]
    from_envoy_ratelimit: Vec<PathBuf>,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

/// Prints the descriptor routes `files` (envoyproxy/ratelimit's YAML)
/// translate into, or every problem and exit 1.
fn from_envoy_ratelimit(files: &[PathBuf]) -> ExitCode {
    let mut texts = Vec::new();
    for file in files {
        match std::fs::read_to_string(file) {
            Ok(text) => texts.push((file.display().to_string(), text)),
            Err(e) => {
                eprintln!("cannot read {}: {e}", file.display());
                return ExitCode::FAILURE;
            }
        }
    }
    match floodgate::config::envoy_ratelimit::translate(&texts) {
        Ok(toml) => {
            let _ = std::io::Write::write_all(&mut std::io::stdout(), toml.as_bytes());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{e}");
            ExitCode::FAILURE
        }
    }
}

fn main() -> ExitCode {
    let flags = Flags::parse();
    let overrides = floodgate::config::Overrides {
        listen: flags.listen,
        admin_listen: flags.admin_listen,
    };
    if !flags.from_envoy_ratelimit.is_empty() {
        return from_envoy_ratelimit(&flags.from_envoy_ratelimit);
    }
    if let Some(url) = &flags.probe {
        return match url {
            Some(url) => probe(url),
            None => probe_configured(&flags.config, overrides),
        };
    }
    let (filter, bad_filter) = match log_filter() {
        Ok(filter) => (filter, None),
        Err(problem) => (EnvFilter::new("info"), Some(problem)),
    };
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    match flags.log_format {
        LogFormat::Text => logs.init(),
        LogFormat::Json => logs.json().flatten_event(true).init(),
    }
    if let Some(problem) = bad_filter {
        fatal(flags.log_format, &problem);
        return ExitCode::FAILURE;
    }

    let config = match floodgate::config::load(&flags.config) {
        Ok(config) => overrides.apply(config),
        Err(e) if flags.check => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
        Err(e) => {
            fatal(flags.log_format, &e.to_string());
            return ExitCode::FAILURE;
        }
    };
    if flags.check {
        // A reader that stops early (`| head`) is not an error of the file.
        let said = format!(
            "{}: ok ({} routes)\n{}",
            flags.config.display(),
            config.routes.len(),
            config.summary()
        );
        let _ = std::io::Write::write_all(&mut std::io::stdout(), said.as_bytes());
        if flags.connect && !check_connections(&config) {
            return ExitCode::FAILURE;
        }
        return ExitCode::SUCCESS;
    }
    match serve(config) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            fatal(flags.log_format, &format!("floodgate: {e:#}"));
            ExitCode::FAILURE
        }
    }
}

/// `--check --connect`: connects to the store and to every upstream
/// endpoint's address, printing one line for each; true when all answer.
fn check_connections(config: &floodgate::config::Config) -> bool {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("cannot start the async runtime: {e}");
            return false;
        }
    };
    runtime.block_on(async {
        let mut all = true;
        let store = match &config.store {
            floodgate::limit::settings::Store::Memory => "memory".to_owned(),
            floodgate::limit::settings::Store::Redis(settings) => settings.endpoint.to_string(),
        };
        match floodgate::limit::Limiter::check(&config.store).await {
            Ok(()) => println!("store {store}: answers and accepts floodgate's settings"),
            Err(e) => {
                all = false;
                println!("store {store}: {e}");
            }
        }
        for upstream in &config.upstreams {
            for endpoint in &upstream.endpoints {
                let address = endpoint.authority.as_str();
                let connected = tokio::time::timeout(
                    endpoint
                        .connect_timeout
                        .max(std::time::Duration::from_secs(1)),
                    tokio::net::TcpStream::connect(address),
                )
                .await;
                let said = match connected {
                    Ok(Ok(stream)) => match stream.peer_addr() {
                        Ok(peer) => format!("{peer} accepts connections"),
                        Err(_) => "accepts connections".to_owned(),
                    },
                    Ok(Err(e)) => {
                        all = false;
                        format!("cannot connect: {e}")
                    }
                    Err(_) => {
                        all = false;
                        "no answer in time".to_owned()
                    }
                };
                println!("upstream {} ({}): {said}", upstream.name, endpoint.target);
            }
        }
        all
    })
}

/// Reports why floodgate cannot start: as written for people, or one JSON
/// log line per line of it for log pipelines.
fn fatal(format: LogFormat, message: &str) {
    match format {
        LogFormat::Text => eprintln!("{message}"),
        LogFormat::Json => {
            for line in message.lines() {
                tracing::error!("{line}");
            }
        }
    }
}

/// The log filter `FLOODGATE_LOG` asks for (`info` when unset). Every
/// directive must end in a level: a bare word such as `verbose` would be
/// read as a target and turn every other log off.
fn log_filter() -> Result<EnvFilter, String> {
    let text = match std::env::var("FLOODGATE_LOG") {
        Ok(text) if !text.trim().is_empty() => text,
        _ => return Ok(EnvFilter::new("info")),
    };
    for directive in text.split(',').map(str::trim).filter(|d| !d.is_empty()) {
        let level = directive.rsplit_once('=').map_or(directive, |(_, l)| l);
        if !matches!(
            level.to_ascii_lowercase().as_str(),
            "trace" | "debug" | "info" | "warn" | "error" | "off"
        ) {
            return Err(format!(
                "FLOODGATE_LOG={text:?}: {directive:?} is not a level; use trace, debug, info, warn, error or off, or TARGET=LEVEL directives such as \"info,floodgate::proxy=debug\""
            ));
        }
    }
    EnvFilter::try_new(&text).map_err(|e| format!("FLOODGATE_LOG={text:?}: {e}"))
}

/// `--probe URL`: exit 0 when URL answers 2xx within three seconds.
fn probe(url: &str) -> ExitCode {
    let answer = (|| -> anyhow::Result<http::StatusCode> {
        let uri: http::Uri = url.parse().context("not a URL")?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("cannot start the async runtime")?;
        runtime.block_on(async {
            let client =
                hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                    .build_http::<http_body_util::Empty<bytes::Bytes>>();
            let response = tokio::time::timeout(PROBE_TIMEOUT, client.get(uri))
                .await
                .context("no answer within 3 s")?
                .context("request failed")?;
            Ok(response.status())
        })
    })();
    match answer {
        Ok(status) if status.is_success() => ExitCode::SUCCESS,
        Ok(status) => {
            eprintln!("{url}: {status}");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("{url}: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// `--probe` without a URL: the admin listener's `/healthz` as the file at
/// `path` names it, or a connection to the proxy listener when there is no
/// admin listener. An unspecified address (`0.0.0.0`, `[::]`) is probed on
/// loopback.
fn probe_configured(path: &std::path::Path, overrides: floodgate::config::Overrides) -> ExitCode {
    let addresses = match floodgate::config::listen_addresses(path) {
        Ok(addresses) => overrides.apply_to(addresses),
        Err(problem) => {
            eprintln!("cannot tell where to probe: {problem}");
            return ExitCode::FAILURE;
        }
    };
    if let Some(admin) = addresses.admin_listen {
        return probe(&format!("http://{}/healthz", reachable(admin)));
    }
    let address = reachable(addresses.listen);
    let connected = std::net::TcpStream::connect_timeout(&address, PROBE_TIMEOUT);
    match connected {
        Ok(_) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{address} (listen; no admin_listen to ask /healthz): {e}");
            ExitCode::FAILURE
        }
    }
}

/// How long a probe waits for its answer.
const PROBE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(3);

/// Where a local client reaches a listener bound to `address`.
fn reachable(address: std::net::SocketAddr) -> std::net::SocketAddr {
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
    let ip = match address.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(ip) if ip.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
        ip => ip,
    };
    std::net::SocketAddr::new(ip, address.port())
}

/// Whether floodgate runs in a container: Docker's and Podman's marker
/// files, the `container` variable systemd-nspawn and Podman set, or a
/// Kubernetes pod's service variables.
fn in_container() -> bool {
    std::path::Path::new("/.dockerenv").exists()
        || std::path::Path::new("/run/.containerenv").exists()
        || std::env::var_os("container").is_some()
        || std::env::var_os("KUBERNETES_SERVICE_HOST").is_some()
}

fn serve(config: floodgate::config::Config) -> anyhow::Result<()> {
    // Every client connection holds a descriptor, and most a second one to
    // its upstream: the default soft limit (often 1 024) would cap floodgate
    // far below what the machine allows.
    match floodgate::server::raise_open_file_limit() {
        Ok(limit) => tracing::info!(open_files = limit, "open file limit"),
        Err(e) => tracing::warn!(error = %e, "cannot raise the open file limit"),
    }
    // One worker per CPU floodgate may use. (A single-threaded runtime was
    // measured on one CPU: 7% faster with the memory store but slower with
    // Redis, where the multi-threaded scheduler runs a just-woken task next.)
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let served = runtime.block_on(async {
        // Signal handlers first: a signal that arrives once the port answers
        // must find them installed.
        let reload = watch_reload_signal()?;
        watch_reopen_signal()?;
        let (shutdown, hurry) = shutdown_signal()?;
        let listeners = floodgate::Listeners::bind(&config.server).await?;
        tracing::info!(
            listen = %config.server.listen,
            admin = %config
                .server
                .admin_listen
                .map_or_else(|| "none".to_owned(), |a| a.to_string()),
            decisions = %config
                .server
                .decision_listen
                .map_or_else(|| "none".to_owned(), |a| a.to_string()),
            routes = config.routes.len(),
            digest = %config.digest,
            "floodgate listening"
        );
        if config.server.listen.ip().is_loopback() && in_container() {
            tracing::warn!(
                listen = %config.server.listen,
                "listen is a loopback address inside a container: nothing outside this container (a published port, another pod) can reach it; listen on 0.0.0.0:{}",
                config.server.listen.port()
            );
        }
        // A second signal drops the server where it stands: its listeners
        // close at once, and the runtime ends its connections' tasks.
        tokio::select! {
            served = floodgate::run(config, listeners, shutdown, reload) => {
                served.context("server failed")
            }
            () = hurry => Ok(()),
        }
    });
    // Tasks still running (connections cut by a second signal) are
    // dropped, not waited for.
    runtime.shutdown_timeout(std::time::Duration::from_millis(200));
    served
}

/// SIGUSR1 reopens the access log file (after logrotate moved it).
fn watch_reopen_signal() -> anyhow::Result<()> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut usr1 = signal(SignalKind::user_defined1()).context("cannot watch SIGUSR1")?;
        tokio::spawn(async move {
            while usr1.recv().await.is_some() {
                floodgate::access_log::reopen();
            }
        });
    }
    Ok(())
}

/// SIGHUP notifies the returned handle, which reloads the configuration.
fn watch_reload_signal() -> anyhow::Result<Arc<Notify>> {
    let reload = Arc::new(Notify::new());
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut hangup = signal(SignalKind::hangup()).context("cannot watch SIGHUP")?;
        let notify = Arc::clone(&reload);
        tokio::spawn(async move {
            while hangup.recv().await.is_some() {
                notify.notify_one();
            }
        });
    }
    Ok(reload)
}

/// Two futures: the first completes on the first SIGTERM or SIGINT, the
/// second on the one after it, which stops floodgate at once instead of
/// after its drain and grace (as nginx and Envoy do on a second signal).
fn shutdown_signal() -> anyhow::Result<(
    impl std::future::Future<Output = ()>,
    impl std::future::Future<Output = ()>,
)> {
    let (count, seen) = tokio::sync::watch::channel(0u32);
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate()).context("cannot watch SIGTERM")?;
        let mut interrupt = signal(SignalKind::interrupt()).context("cannot watch SIGINT")?;
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    Some(()) = term.recv() => {}
                    Some(()) = interrupt.recv() => {}
                    else => return,
                }
                count.send_modify(|n| *n += 1);
            }
        });
    }
    #[cfg(not(unix))]
    tokio::spawn(async move {
        while tokio::signal::ctrl_c().await.is_ok() {
            count.send_modify(|n| *n += 1);
        }
    });
    let nth = |n: u32| {
        let mut seen = seen.clone();
        async move {
            let _ = seen.wait_for(|count| *count >= n).await;
        }
    };
    let first = nth(1);
    let second = nth(2);
    Ok((
        async move {
            first.await;
            tracing::info!("stop signal received (another one stops at once)");
        },
        async move {
            second.await;
            tracing::warn!(
                "second stop signal: stopping now, without waiting for requests in flight"
            );
        },
    ))
}
