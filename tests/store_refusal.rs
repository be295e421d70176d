//! A store that answers and refuses floodgate's settings (a wrong password
//! or user, a database Redis lacks, something that is not Redis) is a
//! configuration error, never an outage: floodgate refuses to start naming
//! the setting, a reload with it keeps the old rules, and one appearing at
//! run time makes `/readyz` fail and is logged at error level, whatever
//! `on_error` says. `--check --connect` says what answers.

mod support;

use std::path::Path;
use std::time::{Duration, Instant};

use support::config::{Config, Route};
use support::redis::{TestRedis, unique_prefix};
use support::{Floodgate, FloodgateProcess, TestClient, Upstream, free_port, temp_dir};

/// A Redis of the test's own that wants the password `secret`.
async fn redis_with_password() -> (TestRedis, u16) {
    let redis = TestRedis::start_process().await;
    let port = redis.addr().await.port();
    require_password(&mut redis.connection().await, "secret").await;
    (redis, port)
}

/// Makes the Redis on `conn` want `password` from new connections.
async fn require_password(conn: &mut redis::aio::MultiplexedConnection, password: &str) {
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("requirepass")
        .arg(password)
        .query_async(conn)
        .await
        .expect("set the password");
}

/// A connection to that Redis, with its password.
async fn with_password(port: u16) -> redis::aio::MultiplexedConnection {
    redis::Client::open(format!("redis://:secret@127.0.0.1:{port}"))
        .expect("url")
        .get_multiplexed_async_connection()
        .await
        .expect("connect with the password")
}

/// One limited route counted in the Redis at `url`, floodgate on `listen`
/// and its admin listener on `admin` (0: any free port).
fn config(url: &str, prefix: &str, listen: u16, admin: u16) -> String {
    Config::new()
        .listen_on(listen)
        .admin_on(admin)
        .redis(url, prefix)
        .store(r#"timeout = "500ms""#)
        .route(
            Route::new("api")
                .respond(r#"status = 200, body = "ok""#)
                .limit("fixed_window", 1_000, "1h"),
        )
        .toml()
}

/// Runs the binary with `args` on `config` and returns its exit code and
/// what it wrote to standard output and standard error; it must end by
/// itself.
fn run(config: &Path, args: &[&str]) -> (Option<i32>, String) {
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_floodgate"))
        .args(args)
        .arg("--config")
        .arg(config)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start floodgate");
    let deadline = Instant::now() + Duration::from_secs(60);
    while child.try_wait().expect("wait").is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("floodgate {args:?} did not end by itself");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().expect("output");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code(), text)
}

/// Starting with `url` is refused, and the message says `says`.
fn start_is_refused(test: &str, url: &str, says: &[&str]) {
    let dir = temp_dir(test);
    let path = dir.join("floodgate.toml");
    std::fs::write(&path, config(url, &unique_prefix(test), 0, 0)).expect("write config");
    let (code, text) = run(&path, &[]);
    assert_eq!(code, Some(1), "floodgate started with {url}:\n{text}");
    assert!(
        text.contains("refuses floodgate's settings") && text.contains("[store]"),
        "the refusal does not name the setting:\n{text}"
    );
    for word in says {
        assert!(text.contains(word), "no {word:?} in:\n{text}");
    }
    first_word_about_the_store_is_the_refusal(&text);
    assert!(
        !text.contains("secret"),
        "the password is in the message:\n{text}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// The refusal is the first thing floodgate says about the store at warning
/// level or above (other warnings, such as a loopback address inside a
/// container, may come before): no warning before it sends a newcomer elsewhere (to the
/// channel's permission, say, when the password is wrong).
fn first_word_about_the_store_is_the_refusal(text: &str) {
    let logged = |l: &&str| l.contains(" WARN ") || l.contains(" ERROR ");
    let about_the_store = |l: &&str| {
        ["store", "Redis", "redis", "given"]
            .iter()
            .any(|w| l.contains(w))
    };
    let first = text
        .lines()
        .find(|l| (logged(l) && about_the_store(l)) || l.contains("refuses floodgate's settings"))
        .unwrap_or_else(|| panic!("nothing about the store in:\n{text}"));
    assert!(
        first.contains("refuses floodgate's settings")
            && !first.contains("cannot listen for units given back"),
        "the first word about the store is not the refusal: {first}\nin:\n{text}"
    );
}

#[tokio::test]
async fn a_wrong_password_or_user_or_none_refuses_to_start() {
    let (_redis, port) = redis_with_password().await;
    start_is_refused(
        "wrong-password",
        &format!("redis://:wrong@127.0.0.1:{port}"),
        &["password"],
    );
    start_is_refused(
        "wrong-user",
        &format!("redis://nobody:secret@127.0.0.1:{port}"),
        &["user name"],
    );
    start_is_refused(
        "no-password",
        &format!("redis://127.0.0.1:{port}"),
        &["requires a password"],
    );
}

/// Started again and again with a wrong password, floodgate never warns
/// about the store before it names the password: the listener for units
/// given back, which fails as the start's check does, keeps its advice
/// (a permission on the channel) to itself until the store has accepted
/// floodgate.
#[tokio::test]
async fn a_wrong_password_is_named_before_any_other_word_about_the_store() {
    let (_redis, port) = redis_with_password().await;
    for i in 0..10 {
        start_is_refused(
            &format!("wrong-password-{i}"),
            &format!("redis://:wrong@127.0.0.1:{port}"),
            &["password"],
        );
    }
}

#[tokio::test]
async fn an_unknown_database_refuses_to_start() {
    let redis = TestRedis::start_process().await;
    let port = redis.addr().await.port();
    start_is_refused(
        "unknown-database",
        &format!("redis://127.0.0.1:{port}/99"),
        &["database"],
    );
}

#[test]
fn a_server_that_is_not_redis_refuses_to_start() {
    // An HTTP server on the port Redis was meant to be on answers what
    // nginx answers bytes that are not HTTP.
    let http = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = http.local_addr().expect("addr");
    std::thread::spawn(move || {
        use std::io::{Read, Write};
        for stream in http.incoming() {
            let Ok(mut stream) = stream else { return };
            let mut request = [0u8; 1024];
            let _ = stream.read(&mut request);
            let _ = stream.write_all(
                b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/html\r\nContent-Length: 11\r\nConnection: close\r\n\r\nBad Request",
            );
        }
    });
    start_is_refused(
        "not-redis",
        &format!("redis://{addr}"),
        &["does not speak the Redis protocol"],
    );
}

#[tokio::test]
async fn check_connect_says_what_answers() {
    let (_redis, port) = redis_with_password().await;
    let upstream = Upstream::start().await;
    let dead = free_port();
    let dir = temp_dir("check-connect");
    let path = dir.join("floodgate.toml");
    let write = |password: &str| {
        let toml = Config::new()
            .redis(
                &format!("redis://:{password}@127.0.0.1:{port}"),
                &unique_prefix("check-connect"),
            )
            .route(
                Route::new("live")
                    .matching(r#"path_prefix = "/live""#)
                    .upstream(&upstream.url()),
            )
            .route(Route::new("dead").upstream(&format!("http://127.0.0.1:{dead}")))
            .toml();
        std::fs::write(&path, toml).expect("write config");
    };

    write("wrong");
    let (code, text) = run(&path, &["--check"]);
    assert_eq!(code, Some(0), "--check alone connects to nothing:\n{text}");
    let (code, text) = run(&path, &["--check", "--connect"]);
    assert_eq!(code, Some(1), "{text}");
    assert!(text.contains("refuses floodgate's settings"), "{text}");
    assert!(
        text.contains(&format!("{} accepts connections", upstream.addr)),
        "{text}"
    );
    assert!(
        text.contains(&format!("127.0.0.1:{dead}")) && text.contains("cannot connect"),
        "{text}"
    );

    write("secret");
    let (_, text) = run(&path, &["--check", "--connect"]);
    assert!(
        text.contains("answers and accepts floodgate's settings"),
        "{text}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn a_reload_to_a_store_that_refuses_keeps_the_old_rules() {
    let (_redis, port) = redis_with_password().await;
    let prefix = unique_prefix("reload-refused");
    let dir = temp_dir("reload-refused");
    let path = dir.join("floodgate.toml");
    let good = config(&format!("redis://:secret@127.0.0.1:{port}"), &prefix, 0, 0);
    std::fs::write(&path, &good).expect("write config");
    let gate = Floodgate::start_file(&path).await;
    let client = TestClient::http1();
    let before = client.get(&gate.url("/"), &[]).await;
    assert_eq!(before.status, 200);
    assert!(
        before
            .header("ratelimit-policy")
            .unwrap_or("")
            .contains("q=1000")
    );

    let bad = config(&format!("redis://:wrong@127.0.0.1:{port}"), &prefix, 0, 0)
        .replace("limit = 1000", "limit = 7");
    assert_ne!(bad, good, "the new file changes the limit");
    std::fs::write(&path, &bad).expect("write config");
    gate.reload.notify_one();
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        let status = client
            .get(&gate.admin_url("/status.json"), &[])
            .await
            .json();
        if !status["reload"].is_null() {
            break status;
        }
        assert!(Instant::now() < deadline, "the reload was not tried");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let problem = status["reload"]["problem"].as_str().unwrap_or_default();
    assert!(
        problem.contains("[store]") && problem.contains("password"),
        "{status}"
    );
    let after = client.get(&gate.url("/"), &[]).await;
    assert!(
        after
            .header("ratelimit-policy")
            .unwrap_or("")
            .contains("q=1000"),
        "the old rules are not in force: {:?}",
        after.headers
    );
    gate.stop().await.expect("stop");
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn a_password_changed_at_run_time_fails_readiness_and_is_logged_again_and_again() {
    let (redis, port) = redis_with_password().await;
    let (listen, admin) = (free_port(), free_port());
    let dir = temp_dir("password-changed");
    let path = dir.join("floodgate.toml");
    let toml = config(
        &format!("redis://:secret@127.0.0.1:{port}"),
        &unique_prefix("password-changed"),
        listen,
        admin,
    );
    std::fs::write(&path, toml).expect("write config");
    let log = dir.join("floodgate.log");
    let started = Instant::now();
    let process = FloodgateProcess::spawn_logging(&path, listen, &[], &[], &log).await;
    let client = TestClient::http1();
    let readyz = format!("http://127.0.0.1:{admin}/readyz");
    assert_eq!(client.get(&readyz, &[]).await.status, 200);
    assert_eq!(client.get(&process.url("/"), &[]).await.status, 200);

    // The password changes on the server and its connections are cut, as
    // a restart with a new password would.
    let mut conn = with_password(port).await;
    require_password(&mut conn, "changed").await;
    let _: redis::Value = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("TYPE")
        .arg("normal")
        .arg("SKIPME")
        .arg("yes")
        .query_async(&mut conn)
        .await
        .expect("cut the connections");

    let deadline = Instant::now() + Duration::from_secs(30);
    let answer = loop {
        // Requests still pass (on_error = "allow"); they also find the
        // refusal sooner than the breaker's probes would.
        let _ = client.get(&process.url("/"), &[]).await;
        let answer = client.get(&readyz, &[]).await;
        if answer.status == 503 {
            break answer;
        }
        assert!(Instant::now() < deadline, "/readyz still answers 200");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(answer.text().contains("password"), "{}", answer.text());

    // Each retry the store refuses is logged at error level, at most once
    // a second.
    let refusals = |text: &str| {
        text.lines()
            .filter(|l| l.contains("ERROR") && l.contains("refuses floodgate's settings"))
            .count()
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while refusals(&std::fs::read_to_string(&log).unwrap_or_default()) < 3 {
        assert!(
            Instant::now() < deadline,
            "the refusal is not logged again:\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        let _ = client.get(&process.url("/"), &[]).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let seconds = started.elapsed().as_secs();
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        refusals(&text) as u64 <= seconds + 2,
        "more than one line a second:\n{text}"
    );

    // The password is put back: ready again.
    require_password(&mut conn, "secret").await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while client.get(&readyz, &[]).await.status != 200 {
        assert!(Instant::now() < deadline, "/readyz did not recover");
        let _ = client.get(&process.url("/"), &[]).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(process);
    drop(redis);
    let _ = std::fs::remove_dir_all(dir);
}

/// The password need not be in the file: `password_file` (as a Kubernetes
/// Secret mounts it) or `${ENV}` in the URL; either counts in Redis.
#[tokio::test]
async fn the_password_comes_from_a_file_or_the_environment() {
    let (redis, port) = redis_with_password().await;
    let dir = temp_dir("password-sources");
    std::fs::write(dir.join("redis-password"), "secret\n").expect("write the secret");
    for (how, store, env) in [
        (
            "file",
            format!("url = \"redis://127.0.0.1:{port}\"\npassword_file = \"redis-password\""),
            ("FLOODGATE_TEST_UNUSED", ""),
        ),
        (
            "environment",
            format!("url = \"redis://:${{REDIS_PASSWORD}}@127.0.0.1:{port}\""),
            ("REDIS_PASSWORD", "secret"),
        ),
    ] {
        let listen = free_port();
        let prefix = unique_prefix(&format!("password-{how}"));
        let path = dir.join(format!("{how}.toml"));
        std::fs::write(
            &path,
            format!(
                "[server]\nlisten = \"127.0.0.1:{listen}\"\n\n[store]\nbackend = \"redis\"\n{store}\nkey_prefix = \"{prefix}\"\n\n[[routes]]\nname = \"api\"\nrespond = {{ status = 200 }}\nlimits = [{{ algorithm = \"fixed_window\", limit = 2, window = \"1h\" }}]\n"
            ),
        )
        .expect("write config");
        let log = dir.join(format!("{how}.log"));
        let process = FloodgateProcess::spawn_logging(&path, listen, &[env], &[], &log).await;
        let client = TestClient::http1();
        let mut seen = [0u16; 3];
        for status in &mut seen {
            *status = client.get(&process.url("/"), &[]).await.status.as_u16();
        }
        assert_eq!(seen, [200, 200, 429], "password from the {how}");
        let mut conn = with_password(port).await;
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{prefix}*"))
            .query_async(&mut conn)
            .await
            .expect("keys");
        assert!(!keys.is_empty(), "nothing counted in Redis ({how})");
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        assert!(
            !text.contains("secret"),
            "the password is in the log:\n{text}"
        );
        drop(process);
    }
    // An unset variable is named at load.
    let path = dir.join("unset.toml");
    std::fs::write(
        &path,
        format!(
            "[server]\nlisten = \"127.0.0.1:0\"\n\n[store]\nbackend = \"redis\"\nurl = \"redis://:${{FLOODGATE_TEST_NOT_SET}}@127.0.0.1:{port}\"\n\n[[routes]]\nname = \"api\"\nrespond = {{ status = 200 }}\n"
        ),
    )
    .expect("write config");
    let (code, text) = run(&path, &["--check"]);
    assert_eq!(code, Some(1), "{text}");
    assert!(
        text.contains("FLOODGATE_TEST_NOT_SET") && text.contains("unset.toml:"),
        "{text}"
    );
    drop(redis);
    let _ = std::fs::remove_dir_all(dir);
}

/// A Redis user that may not run floodgate's code (an ACL without
/// `FUNCTION`, `FCALL`, `SCRIPT` and `EVALSHA`) is a configuration error too.
#[tokio::test]
async fn a_user_without_the_permissions_floodgate_needs_refuses_to_start() {
    let redis = TestRedis::start_process().await;
    let port = redis.addr().await.port();
    let mut conn = redis.connection().await;
    let _: () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg("reader")
        .arg("on")
        .arg(">readerpass")
        .arg("~*")
        .arg("+@read")
        .arg("+ping")
        .arg("+hello")
        .arg("+client")
        .query_async(&mut conn)
        .await
        .expect("make a read-only user");
    start_is_refused(
        "no-permission",
        &format!("redis://reader:readerpass@127.0.0.1:{port}"),
        &["permission", "ACL SETUSER"],
    );
}
