//! Real front proxies asking floodgate's decision listener: nginx with
//! `auth_request` and Caddy with `forward_auth`, each started as its own
//! process from the configuration docs/decision-listener.md documents, in
//! front of a real upstream. The proxies are Debian's packages (`test.sh` installs
//! them); a raw HTTP/1.1 client that picks its own loopback source address
//! plays clients at different addresses.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A front proxy process, killed when dropped.
pub struct FrontProxy {
    pub port: u16,
    child: Child,
    dir: PathBuf,
    name: &'static str,
}

impl FrontProxy {
    /// nginx on a free port: `auth_request` asks `decisions` (one upstream
    /// block, several servers when several floodgates decide) about every
    /// request, which then goes to `upstream`.
    pub async fn nginx(decisions: &[SocketAddr], upstream: SocketAddr) -> Self {
        Self::nginx_with(decisions, upstream, "", "").await
    }

    /// nginx as [`Self::nginx`], and after each answer its reservation
    /// named back to floodgate with the units the upstream reported in
    /// `X-Units-Used` (`post_action`), as docs/decision-listener.md shows.
    pub async fn nginx_settling(decisions: &[SocketAddr], upstream: SocketAddr) -> Self {
        Self::nginx_with(decisions, upstream, NGINX_SETTLE, NGINX_SETTLE_LOCATION).await
    }

    async fn nginx_with(
        decisions: &[SocketAddr],
        upstream: SocketAddr,
        settle: &str,
        settle_location: &str,
    ) -> Self {
        let dir = super::temp_dir("nginx");
        let port = super::free_port();
        let servers: String = decisions
            .iter()
            .map(|d| format!("        server {d};\n"))
            .collect();
        let conf = NGINX
            .replace("{settle}", settle)
            .replace("{settle_location}", settle_location)
            .replace("{ask}", NGINX_ASK)
            .replace("{dir}", &dir.display().to_string())
            .replace("{port}", &port.to_string())
            .replace("{decisions}", &servers)
            .replace("{upstream}", &upstream.to_string());
        let path = dir.join("nginx.conf");
        std::fs::write(&path, conf).expect("write nginx.conf");
        let child = Command::new(which("nginx"))
            .arg("-p")
            .arg(&dir)
            .arg("-c")
            .arg(&path)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start nginx");
        Self::started(child, port, dir, "nginx").await
    }

    /// nginx on a free port limiting every request by its address itself
    /// with `limit_req` (`arguments`, such as `burst=20 delay=8`) at
    /// `rate`, refusing with 429, and proxying the rest to `upstream`
    /// (`/warm` too, unlimited): what floodgate's `delay` is compared
    /// with.
    pub async fn nginx_limit_req(upstream: SocketAddr, rate: &str, arguments: &str) -> Self {
        let dir = super::temp_dir("nginx-limit-req");
        let port = super::free_port();
        let conf = NGINX_LIMIT_REQ
            .replace("{dir}", &dir.display().to_string())
            .replace("{port}", &port.to_string())
            .replace("{rate}", rate)
            .replace("{arguments}", arguments)
            .replace("{upstream}", &upstream.to_string());
        let path = dir.join("nginx.conf");
        std::fs::write(&path, conf).expect("write nginx.conf");
        let child = Command::new(which("nginx"))
            .arg("-p")
            .arg(&dir)
            .arg("-c")
            .arg(&path)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start nginx");
        Self::started(child, port, dir, "nginx").await
    }

    /// Caddy on a free port: `forward_auth`'s expanded form asks
    /// `decision` about every request, which then goes to `upstream`.
    pub async fn caddy(decision: SocketAddr, upstream: SocketAddr) -> Self {
        let dir = super::temp_dir("caddy");
        let port = super::free_port();
        let conf = CADDY
            .replace("{port}", &port.to_string())
            .replace("{decision}", &decision.to_string())
            .replace("{upstream}", &upstream.to_string());
        let path = dir.join("Caddyfile");
        std::fs::write(&path, conf).expect("write Caddyfile");
        let child = Command::new(which("caddy"))
            .args(["run", "--adapter", "caddyfile", "--config"])
            .arg(&path)
            .env("HOME", &dir)
            .env("XDG_DATA_HOME", dir.join("data"))
            .env("XDG_CONFIG_HOME", dir.join("config"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start caddy");
        Self::started(child, port, dir, "caddy").await
    }

    async fn started(mut child: Child, port: u16, dir: PathBuf, name: &'static str) -> Self {
        for _ in 0..300 {
            if tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_ok()
            {
                return Self {
                    port,
                    child,
                    dir,
                    name,
                };
            }
            if let Ok(Some(status)) = child.try_wait() {
                let log = std::fs::read_to_string(dir.join("error.log")).unwrap_or_default();
                panic!("{name} exited at start ({status}):\n{log}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("{name} did not listen on {port} within 15 s");
    }

    /// The front proxy's access log (nginx limiting requests: when each
    /// began, see `NGINX_LIMIT_REQ`).
    pub fn access_log(&self) -> String {
        std::fs::read_to_string(self.dir.join("access.log")).unwrap_or_default()
    }

    /// The front proxy's error log (nginx), for a failing assertion.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("error.log"))
            .unwrap_or_else(|_| format!("({} keeps no log here)", self.name))
    }
}

impl Drop for FrontProxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn which(program: &str) -> PathBuf {
    for dir in ["/usr/sbin", "/usr/bin", "/usr/local/bin", "/usr/local/sbin"] {
        let path = PathBuf::from(dir).join(program);
        if path.exists() {
            return path;
        }
    }
    panic!("{program} is not installed: run ./test.sh, which installs it");
}

/// An answer as a client read it off the wire.
#[derive(Debug)]
pub struct Raw {
    pub status: u16,
    /// Header fields, names in lower case, in order.
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Raw {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// `GET target` to `port` on 127.0.0.1 from the source address `from`
/// (any of 127.0.0.0/8), with `headers`, on a connection of its own.
pub async fn get_from(from: IpAddr, port: u16, target: &str, headers: &[(&str, &str)]) -> Raw {
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket.bind(SocketAddr::new(from, 0)).expect("bind source");
    let mut stream = socket
        .connect(SocketAddr::from(([127, 0, 0, 1], port)))
        .await
        .expect("connect");
    let mut request = format!("GET {target} HTTP/1.1\r\nHost: api.test\r\nConnection: close\r\n");
    for (name, value) in headers {
        request.push_str(&format!("{name}: {value}\r\n"));
    }
    request.push_str("\r\n");
    stream.write_all(request.as_bytes()).await.expect("write");
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), stream.read_to_end(&mut answer))
        .await
        .expect("an answer within 30 s")
        .expect("read");
    let text = String::from_utf8_lossy(&answer).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {text:?}"));
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    Raw {
        status,
        headers,
        body: body.to_owned(),
    }
}

/// nginx in front of an API, asking floodgate about every request (the
/// configuration of docs/decision-listener.md, with test paths): the
/// decision's `RateLimit` fields go to the client with every answer, and a
/// refusal is the 429 floodgate decided, with its `Retry-After`. nginx's
/// `auth_request` passes on only 2xx, 401 and 403 and makes anything else a
/// 500; the named location tells floodgate's 429 from a failure by the
/// status the decision had.
const NGINX: &str = r#"
daemon off;
master_process off;
worker_processes 1;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events { worker_connections 256; }
http {
    access_log off;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;

    upstream floodgate_decisions {
{decisions}        keepalive 16;
    }

    server {
        listen 127.0.0.1:{port};

        location / {
            auth_request /_floodgate;
            auth_request_set $floodgate_status $upstream_status;
            auth_request_set $floodgate_ratelimit $upstream_http_ratelimit;
            auth_request_set $floodgate_policy $upstream_http_ratelimit_policy;
            auth_request_set $floodgate_retry_after $upstream_http_retry_after;
            add_header RateLimit $floodgate_ratelimit always;
            add_header RateLimit-Policy $floodgate_policy always;
            error_page 500 = @floodgate_refused;
            proxy_pass http://{upstream};
{settle}        }

        location = /_floodgate {
            internal;
{ask}        }

        location @floodgate_refused {
            add_header RateLimit $floodgate_ratelimit always;
            add_header RateLimit-Policy $floodgate_policy always;
            add_header Retry-After $floodgate_retry_after always;
            if ($floodgate_status = 429) {
                return 429 "Too Many Requests\n";
            }
            return 503 "the rate limiter cannot decide\n";
        }
{settle_location}    }
}
"#;

/// nginx limiting requests itself, per client address, in front of an
/// upstream.
const NGINX_LIMIT_REQ: &str = r#"
daemon off;
master_process off;
worker_processes 1;
pid {dir}/nginx.pid;
error_log {dir}/error.log info;
events { worker_connections 1024; }
http {
    # When each request began (nginx's cached clock, in ms: the log's
    # time less the request's), for comparing what it decided.
    log_format began '$msec $request_time $request_uri';
    access_log {dir}/access.log began;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    limit_req_zone $binary_remote_addr zone=clients:1m rate={rate};
    limit_req_status 429;
    limit_req_log_level info;

    server {
        listen 127.0.0.1:{port};
        keepalive_requests 100000;

        location / {
            limit_req zone=clients {arguments};
            proxy_pass http://{upstream};
        }

        location /warm {
            proxy_pass http://{upstream};
        }
    }
}
"#;

/// How nginx asks floodgate, for a decision and for a settlement alike:
/// on a kept-alive connection, without the body, the original request
/// described by the forwarded fields.
const NGINX_ASK: &str = r#"            proxy_pass http://floodgate_decisions;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_pass_request_body off;
            proxy_set_header Content-Length "";
            proxy_set_header X-Original-URI $request_uri;
            proxy_set_header X-Original-Method $request_method;
            proxy_set_header X-Forwarded-Uri "";
            proxy_set_header X-Forwarded-Method "";
            proxy_set_header X-Forwarded-Host $host;
            proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
"#;

/// In the API's location: keep the decision's reservation, and name it
/// back once the answer has gone out.
const NGINX_SETTLE: &str = r#"            auth_request_set $floodgate_reservation $upstream_http_floodgate_reservation;
            post_action @floodgate_settle;
"#;

/// The settlement: the request described again, the reservation, and the
/// units the upstream reported (`$sent_http_…`: the answer's own field,
/// which `$upstream_http_…` no longer is once this location proxies).
const NGINX_SETTLE_LOCATION: &str = r#"
        location @floodgate_settle {
{ask}            proxy_set_header Floodgate-Settle $floodgate_reservation;
            proxy_set_header X-Units-Used $sent_http_x_units_used;
        }
"#;

/// Caddy in front of an API: `forward_auth`'s expanded form, so that a
/// 2xx decision's `RateLimit` fields also reach the client (the short
/// form copies fields to the upstream's request only); any other answer,
/// floodgate's 429 included, goes to the client as floodgate made it.
/// `X-Forwarded-For` is Caddy's own: it ignores a client's (no
/// `trusted_proxies` here).
const CADDY: &str = r#"
{
    admin off
    auto_https off
}

http://:{port} {
    bind 127.0.0.1
    reverse_proxy {decision} {
        method GET
        rewrite /_floodgate
        header_up X-Forwarded-Method {method}
        header_up X-Forwarded-Uri {uri}
        header_up -X-Original-URI
        header_up -X-Original-Method
        # Caddy names the decision's fields as Go writes them
        # (Ratelimit); a 2xx without them (a route without limits) must
        # not match, or the placeholders would be sent as written.
        @limited {
            status 2xx
            header Ratelimit-Policy *
        }
        handle_response @limited {
            header RateLimit {rp.header.Ratelimit}
            header RateLimit-Policy {rp.header.Ratelimit-Policy}
        }
        @allowed status 2xx
        handle_response @allowed {
            header -X-Floodgate-Nothing
        }
    }
    reverse_proxy {upstream}
}
"#;

/// What a listed front proxy (on loopback) sends the decision listener on
/// `port` about the client 203.0.113.5's request to `/chat`, with `more`
/// fields.
pub async fn about_chat(port: u16, more: &[(&str, &str)]) -> Raw {
    let mut fields = vec![
        ("X-Original-URI", "/chat"),
        ("X-Forwarded-For", "203.0.113.5"),
    ];
    fields.extend_from_slice(more);
    get_from(IpAddr::from([127, 0, 0, 1]), port, "/_floodgate", &fields).await
}
