//! In front of an LLM API, with the official `openai` Python SDK as the
//! client (`tests/peers/openai_peer.py`) and an upstream that reports
//! `usage` the way the OpenAI API does: a JSON `usage` object, or, when
//! streaming with `stream_options.include_usage`, a last chunk with
//! `choices: []` and the usage before `data: [DONE]`. Its streams stay
//! open a moment after `[DONE]`, as streams do, so the SDK closes every
//! answer before its end.

mod support;

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt as _;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use support::config::{Config, Route};
use support::peers::client;
use support::redis::{TestRedis, unique_prefix};
use support::{Chunks, Floodgate, TestClient};

/// Prompt tokens of every call.
const PROMPT: u64 = 100;
/// Completion tokens of every call (at most its `max_tokens`).
const COMPLETION: u64 = 55;

/// An OpenAI-compatible chat completions API: its URL (`…/v1`).
async fn fake_openai() -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}/v1", listener.local_addr().expect("addr"));
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let service = service_fn(answer);
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    url
}

async fn answer(req: Request<Incoming>) -> Result<Response<Chunks>, Infallible> {
    let body = req
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let asked: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    let max = asked["max_completion_tokens"]
        .as_u64()
        .or(asked["max_tokens"].as_u64())
        .unwrap_or(u64::MAX);
    let completion = COMPLETION.min(max);
    let usage = serde_json::json!({
        "prompt_tokens": PROMPT,
        "completion_tokens": completion,
        "total_tokens": PROMPT + completion,
    });
    let (tx, rx) = tokio::sync::mpsc::channel(8);
    let streaming = asked["stream"].as_bool() == Some(true);
    // As the OpenAI API: a stream reports its usage only when asked to.
    let report = asked["stream_options"]["include_usage"].as_bool() == Some(true);
    let content_type = if streaming {
        "text/event-stream"
    } else {
        "application/json"
    };
    tokio::spawn(async move {
        if !streaming {
            let whole = serde_json::json!({
                "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "fake-model",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello!"}, "finish_reason": "stop"}],
                "usage": usage,
            });
            let _ = tx.send(Bytes::from(whole.to_string())).await;
            return;
        }
        // A stream of its own framing: the request's `seed`, else the
        // next of a count.
        let seed = asked["seed"]
            .as_u64()
            .unwrap_or_else(|| STREAMS.fetch_add(1, Ordering::Relaxed));
        let stream = event_stream(seed, report.then_some(&usage));
        // Model `fake-model-slow` generates slowly: one event at a time,
        // 150 ms apart.
        if asked["model"] == "fake-model-slow" {
            for event in stream.split_inclusive(&format!("{0}{0}", eol(seed))) {
                let _ = tx.send(Bytes::from(event.to_owned())).await;
                tokio::time::sleep(Duration::from_millis(150)).await;
            }
        } else {
            for piece in pieces(seed, stream.as_bytes()) {
                let _ = tx.send(piece).await;
            }
        }
        // The stream's own end comes a moment later; the SDK has closed
        // the answer by then.
        tokio::time::sleep(Duration::from_millis(300)).await;
    });
    Ok(Response::builder()
        .header("content-type", content_type)
        .body(Chunks(rx))
        .expect("response"))
}

/// Streams answered without a `seed`: each is framed by the next count.
static STREAMS: AtomicU64 = AtomicU64::new(0);

/// The line end of stream `seed`: a line feed, or on every other stream
/// a carriage return and a line feed.
fn eol(seed: u64) -> &'static str {
    if seed.is_multiple_of(2) { "\n" } else { "\r\n" }
}

/// One event of stream `seed`: a chat completion chunk of `choices`, and
/// of `usage` when there is one.
fn chunk_event(seed: u64, choices: serde_json::Value, usage: Option<&serde_json::Value>) -> String {
    let mut event = serde_json::json!({
        "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1,
        "model": "fake-model", "choices": choices,
    });
    if let Some(usage) = usage {
        event["usage"] = usage.clone();
    }
    let eol = eol(seed);
    format!("data: {event}{eol}{eol}")
}

/// The usage event of stream `seed` reporting `usage`: `choices` empty.
fn usage_event(seed: u64, usage: &serde_json::Value) -> String {
    chunk_event(seed, serde_json::json!([]), Some(usage))
}

/// Stream `seed`, as the OpenAI API sends it: a comment now and then,
/// "Hel" and "lo!", then (when reported) the `usage` event, then
/// `[DONE]`; with `include_usage`, every other chunk carries `"usage":
/// null`.
fn event_stream(seed: u64, usage: Option<&serde_json::Value>) -> String {
    let eol = eol(seed);
    let mut text = String::new();
    if seed.is_multiple_of(3) {
        text.push_str(&format!(": keep-alive{eol}{eol}"));
    }
    for piece in ["Hel", "lo!"] {
        let choices =
            serde_json::json!([{"index": 0, "delta": {"content": piece}, "finish_reason": null}]);
        let null = serde_json::Value::Null;
        text.push_str(&chunk_event(seed, choices, usage.map(|_| &null)));
    }
    if let Some(usage) = usage {
        text.push_str(&usage_event(seed, usage));
    }
    text.push_str(&format!("data: [DONE]{eol}{eol}"));
    text
}

/// `bytes` in the frames stream `seed` is sent in: pieces of 1 to 97
/// bytes, so that events (the usage event too) are split across frames
/// and frames hold several events, at places that differ per stream.
fn pieces(seed: u64, bytes: &[u8]) -> Vec<Bytes> {
    let mut out = Vec::new();
    let mut at = 0;
    let mut n = seed;
    while at < bytes.len() {
        n = n
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        let len = (((n >> 33) % 97) as usize + 1).min(bytes.len() - at);
        out.push(Bytes::copy_from_slice(&bytes[at..at + len]));
        at += len;
    }
    out
}

/// A route for the chat completions API at `api`, keyed by the
/// `Authorization` header, `tokens` an hour in a sliding log (so Redis
/// holds one member per token: its size is the charge), reserving
/// `max_completion_tokens` or `max_tokens` plus 100 for the prompt, and
/// settling to the usage the answer reports, JSON or event stream.
fn chat(api: &str, tokens: u64) -> Route {
    chat_named("chat", api, tokens, "")
}

/// [`chat`] named `name` on `/{name}/v1/chat/completions` (the name taken
/// off before forwarding) unless it is `chat`, with more `usage` keys
/// (`extra`, starting with a comma).
fn chat_named(name: &str, api: &str, tokens: u64, extra: &str) -> Route {
    let prefix = if name == "chat" {
        String::new()
    } else {
        format!("/{name}")
    };
    let route = Route::new(name)
        .upstream(api.trim_end_matches("/v1"))
        .matching(&format!(r#"path_prefix = "{prefix}/v1/chat/completions""#))
        .client(r#"from = "header", name = "Authorization""#)
        .limit("sliding_log", tokens, "1h")
        .line(&format!(r#"usage = {{ reserve = 1000, reserve_json = ["max_completion_tokens", "max_tokens"], reserve_add = 100, report = "json_or_sse", units = {{ "usage.prompt_tokens" = 1, "usage.completion_tokens" = 1 }}{extra} }}"#));
    if prefix.is_empty() {
        route
    } else {
        route.line(&format!(r#"strip_prefix = "{prefix}""#))
    }
}

/// Units logged in the sliding-log keys of route `chat`.
async fn charged(redis: &TestRedis, prefix: &str) -> u64 {
    charged_on(redis, prefix, "chat").await
}

/// Units logged in the sliding-log keys of route `route`.
async fn charged_on(redis: &TestRedis, prefix: &str, route: &str) -> u64 {
    redis.logged(&format!("{prefix}:{{{route}:*")).await
}

/// The charge once it reaches `want` (settlements of event streams
/// follow the answers), or what it is after 30 s.
async fn settled(redis: &TestRedis, prefix: &str, want: u64) -> u64 {
    let mut found = 0;
    for _ in 0..600 {
        found = charged(redis, prefix).await;
        if found == want {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    found
}

/// `floodgate_usage_unreported_total{route="chat",reason=…}` of `gate`.
async fn unreported(gate: &Floodgate, reason: &str) -> u64 {
    let scrape = TestClient::http1()
        .get(&gate.admin_url("/metrics"), &[])
        .await
        .text();
    let labels = format!(r#"route="chat",reason="{reason}""#);
    scrape
        .lines()
        .filter(|l| l.starts_with("floodgate_usage_unreported_total{") && l.contains(&labels))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

/// Runs the SDK: `rounds` rounds of `per_round` calls 0.15 s apart, a new
/// client each round, alternating between `gates`.
async fn sdk(
    gates: &[Floodgate],
    rounds: u32,
    per_round: u32,
    mode: &str,
) -> Vec<serde_json::Value> {
    let urls: Vec<String> = gates.iter().map(|g| g.url("/v1")).collect();
    client(
        "openai_peer.py",
        &[
            "calls".to_owned(),
            urls.join(","),
            "sk-test-key".to_owned(),
            rounds.to_string(),
            per_round.to_string(),
            "0.15".to_owned(),
            mode.to_owned(),
        ],
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_sdk_streams_closed_at_done_settle_to_the_usage_the_sdk_read() {
    let redis = TestRedis::start().await;
    let prefix = unique_prefix("sdk-streams");
    let api = fake_openai().await;
    let toml = Config::new()
        .admin()
        .redis(&redis.url, &prefix)
        .route(chat(&api, 1_000_000))
        .toml();
    let gates = [Floodgate::start(&toml).await, Floodgate::start(&toml).await];
    let calls = sdk(&gates, 10, 5, "stream").await;
    assert_eq!(calls.len(), 50);
    let mut read = 0;
    for call in &calls {
        assert_eq!(call["text"], "Hello!", "{call}");
        read += call["read"]
            .as_u64()
            .unwrap_or_else(|| panic!("no usage read: {call}"));
    }
    assert_eq!(read, 50 * (PROMPT + COMPLETION));
    assert_eq!(settled(&redis, &prefix, read).await, read);
    for gate in &gates {
        assert_eq!(unreported(gate, "client_left").await, 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_route_one_budget_for_streamed_and_whole_answers_through_the_sdk() {
    let redis = TestRedis::start().await;
    let prefix = unique_prefix("sdk-both");
    let api = fake_openai().await;
    // 2 000 tokens an hour: with reservations of 400, calls are admitted
    // while they fit, settled to 155 each, streamed or not.
    let toml = Config::new()
        .admin()
        .redis(&redis.url, &prefix)
        .route(chat(&api, 2_000))
        .toml();
    let gates = [Floodgate::start(&toml).await, Floodgate::start(&toml).await];
    let calls = sdk(&gates, 4, 4, "both").await;
    let ok: Vec<_> = calls.iter().filter(|c| c.get("read").is_some()).collect();
    let refused = calls
        .iter()
        .filter(|c| c["error"] == "RateLimitError")
        .count();
    assert_eq!(ok.len() + refused, 16, "{calls:?}");
    assert!(ok.iter().any(|c| c["stream"] == true) && ok.iter().any(|c| c["stream"] == false));
    let read: u64 = ok.iter().filter_map(|c| c["read"].as_u64()).sum();
    // Admitted while a reservation of 400 fits what the settled calls
    // left: 155 × n + 400 ≤ 2 000 admits n + 1 = 11, then every call is
    // refused (the SDK raises RateLimitError on the 429).
    assert_eq!(ok.len(), 11, "{calls:?}");
    assert_eq!(read, 11 * (PROMPT + COMPLETION));
    assert_eq!(settled(&redis, &prefix, read).await, read);
    for gate in &gates {
        assert_eq!(unreported(gate, "client_left").await, 0);
        assert_eq!(unreported(gate, "missing").await, 0);
    }
}

/// The usage every call reports.
fn usage() -> serde_json::Value {
    serde_json::json!({
        "prompt_tokens": PROMPT,
        "completion_tokens": COMPLETION,
        "total_tokens": PROMPT + COMPLETION,
    })
}

/// Fifty streams that do not ask for their usage, read by the plain loop
/// that indexes `chunk.choices[0]`, on two instances of a route that asks
/// for it: no chunk without a choice reaches the SDK, the client never
/// sees the usage, and every stream is settled to what the upstream
/// reported.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_streams_asked_for_their_usage_by_floodgate_read_as_the_client_asked_them() {
    let redis = TestRedis::start().await;
    let prefix = unique_prefix("sdk-unasked");
    let api = fake_openai().await;
    let toml = Config::new()
        .admin()
        .redis(&redis.url, &prefix)
        .route(chat_named(
            "chat",
            &api,
            1_000_000,
            ", stream_include_usage = true",
        ))
        .toml();
    let gates = [Floodgate::start(&toml).await, Floodgate::start(&toml).await];
    let calls = sdk(&gates, 10, 5, "indexing").await;
    assert_eq!(calls.len(), 50);
    for call in &calls {
        assert_eq!(call["text"], "Hello!", "{call}");
        assert_eq!(call["chunks"], 2, "{call}");
        assert!(call["read"].is_null(), "the client did not ask: {call}");
    }
    let want = 50 * (PROMPT + COMPLETION);
    assert_eq!(settled(&redis, &prefix, want).await, want);
    for gate in &gates {
        for reason in ["missing", "client_left", "upstream_failed", "store_failed"] {
            assert_eq!(unreported(gate, reason).await, 0, "{reason}");
        }
    }
}

/// A streaming request with `seed`, asking for its usage or not.
fn stream_request(url: &str, seed: u64, ask: bool) -> Request<support::ClientBody> {
    let mut body = serde_json::json!({
        "model": "fake-model", "stream": true, "max_tokens": 300, "seed": seed,
        "messages": [{"role": "user", "content": "Say hello."}],
    });
    if ask {
        body["stream_options"] = serde_json::json!({"include_usage": true});
    }
    Request::post(url)
        .header("authorization", "Bearer sk-raw")
        .header("content-type", "application/json")
        .body(support::text_body(&body.to_string()))
        .expect("request")
}

/// Byte for byte, over streams framed every way the upstream frames them
/// (events split across frames, several in one, `\n` and `\r\n` line
/// ends, comments): a client that did not ask for usage receives the
/// upstream's stream without its usage event, one that asked the whole
/// stream; each settled to the usage reported.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_receives_the_upstreams_bytes_less_only_the_usage_event_it_did_not_ask_for() {
    let redis = TestRedis::start().await;
    let prefix = unique_prefix("raw-unasked");
    let api = fake_openai().await;
    let toml = Config::new()
        .admin()
        .redis(&redis.url, &prefix)
        .route(chat_named(
            "chat",
            &api,
            1_000_000,
            ", stream_include_usage = true",
        ))
        .toml();
    let gate = Floodgate::start(&toml).await;
    let http = TestClient::http1();
    let url = gate.url("/v1/chat/completions");
    let usage = usage();
    let mut streams = 0;
    for seed in 1_000..1_024 {
        let upstream = event_stream(seed, Some(&usage));
        let unasked = http.send(stream_request(&url, seed, false)).await;
        assert_eq!(unasked.status, 200);
        let less = upstream.replacen(&usage_event(seed, &usage), "", 1);
        assert_ne!(less, upstream);
        assert_eq!(unasked.text(), less, "seed {seed}");
        let asked = http.send(stream_request(&url, seed, true)).await;
        assert_eq!(asked.text(), upstream, "seed {seed}");
        streams += 2;
    }
    let want = streams * (PROMPT + COMPLETION);
    assert_eq!(settled(&redis, &prefix, want).await, want);
    assert_eq!(unreported(&gate, "client_left").await, 0);
    assert_eq!(unreported(&gate, "missing").await, 0);
}

/// On a route that does not ask for a stream's usage, a stream that does
/// not ask either reports nothing: it stands at its reservation of
/// 300 + 100, counted as missing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_that_do_not_ask_for_usage_stand_at_their_reservation_where_nobody_asks() {
    let redis = TestRedis::start().await;
    let prefix = unique_prefix("sdk-ask");
    let api = fake_openai().await;
    let toml = Config::new()
        .admin()
        .redis(&redis.url, &prefix)
        .route(chat_named("plain", &api, 1_000_000, ""))
        .toml();
    let gate = Floodgate::start(&toml).await;
    let args = [
        "calls".to_owned(),
        gate.url("/plain/v1"),
        "sk-test-key".to_owned(),
        "1".to_owned(),
        "4".to_owned(),
        "0.05".to_owned(),
        "bare".to_owned(),
    ];
    let bare = client("openai_peer.py", &args).await;
    assert!(bare.iter().all(|c| c["read"].is_null()), "{bare:?}");
    let mut found = 0;
    for _ in 0..600 {
        found = charged_on(&redis, &prefix, "plain").await;
        if found == 4 * 400 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(found, 4 * 400);
    let scrape = TestClient::http1()
        .get(&gate.admin_url("/metrics"), &[])
        .await
        .text();
    assert!(
        scrape.contains(r#"floodgate_usage_unreported_total{route="plain",reason="missing"} 4"#),
        "{scrape}"
    );
}

/// The rate-limit field `name` of one call's answer.
fn field(call: &serde_json::Value, name: &str) -> String {
    call["headers"][name]
        .as_str()
        .unwrap_or_else(|| panic!("no {name}: {call}"))
        .to_owned()
}

/// The ten admitted calls: each reports both limits, the requests' counting
/// down by one and the tokens' by what the calls before it used.
fn each_admitted_call_reports_both_limits(calls: &[serde_json::Value]) {
    for (n, call) in calls.iter().enumerate() {
        let n = n as u64;
        assert_eq!(call["read"], PROMPT + COMPLETION, "{call}");
        assert_eq!(field(call, "x-ratelimit-limit-requests"), "10");
        assert_eq!(
            field(call, "x-ratelimit-remaining-requests"),
            (9 - n).to_string(),
            "{call}"
        );
        assert_eq!(field(call, "x-ratelimit-limit-tokens"), "2000");
        // Each call reserves 300 + 100 before it is answered; the calls
        // before it were settled to what they used.
        let tokens = 2_000 - n * (PROMPT + COMPLETION) - 400;
        assert_eq!(
            field(call, "x-ratelimit-remaining-tokens"),
            tokens.to_string(),
            "{call}"
        );
        for reset in ["x-ratelimit-reset-requests", "x-ratelimit-reset-tokens"] {
            let text = field(call, reset);
            assert!(
                text.ends_with('s') && text.len() > 1 && !text.contains(' '),
                "{reset}: {text}"
            );
        }
        assert!(call["headers"].get("retry-after").is_none(), "{call}");
    }
}

/// The 11th: the requests' limit refuses; the tokens would have fit.
fn the_eleventh_is_refused_by_the_requests_limit(refused: &serde_json::Value) {
    assert_eq!(refused["error"], "RateLimitError", "{refused}");
    assert_eq!(field(refused, "x-ratelimit-remaining-requests"), "0");
    assert_eq!(field(refused, "x-ratelimit-limit-requests"), "10");
    let wait: u64 = field(refused, "retry-after")
        .parse()
        .expect("Retry-After seconds");
    assert!(
        wait > 3_000,
        "an hour's log frees its first request in about an hour: {wait}"
    );
    let message = refused["body"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains(&format!("try again in {wait}s")),
        "{refused}"
    );
    // Its reset is the same wait, as a duration: about an hour.
    let reset = field(refused, "x-ratelimit-reset-requests");
    assert!(
        reset.starts_with("59m") || reset.starts_with("1h0m"),
        "{reset}"
    );
}

/// `rate_limit_headers = "openai"` through the SDK's raw responses: 10
/// requests and 2 000 tokens an hour on one route, each reported on its
/// own after every call, matching a model of both limits; the call past
/// the requests' limit is refused by it (the tokens still fit), with its
/// wait in the fields, in `Retry-After` and in the OpenAI-shaped body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_rate_limit_fields_report_each_limit_after_every_call() {
    let redis = TestRedis::start().await;
    let prefix = unique_prefix("sdk-fields");
    let api = fake_openai().await;
    let route = chat(&api, 2_000)
        .limits(r#"{ algorithm = "sliding_log", limit = 10, window = "1h", counts = "requests" }"#)
        .line(r#"rate_limit_headers = "openai""#)
        .line(r#"deny = { status = 429, content_type = "application/json", body = '{"error":{"message":"Rate limit reached; try again in {retry_after}s.","type":"requests","code":"rate_limit_exceeded"}}' }"#);
    let toml = Config::new()
        .admin()
        .redis(&redis.url, &prefix)
        .route(route)
        .toml();
    let gate = Floodgate::start(&toml).await;
    // Each call comes once the one before it is settled (its 400 reserved
    // settled to what it used), however long a busy machine takes.
    let mut calls = Vec::new();
    for n in 1..=11u64 {
        calls.push(one_call(&gate, 300).await);
        let refunded = n.min(10) * (400 - (PROMPT + COMPLETION));
        for _ in 0..600 {
            if counted(&gate, "floodgate_usage_units_total", r#"kind="refunded""#).await == refunded
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    each_admitted_call_reports_both_limits(&calls[..10]);
    the_eleventh_is_refused_by_the_requests_limit(&calls[10]);
    // The route's logs: the tokens' holds what the ten calls used, the
    // requests' one member per call; the refused call took nothing.
    let logged = 10 * (PROMPT + COMPLETION) + 10;
    assert_eq!(settled(&redis, &prefix, logged).await, logged);
}

/// The sum of the samples of counter `family` on route `chat` of `gate`
/// whose labels hold `label`.
async fn counted(gate: &Floodgate, family: &str, label: &str) -> u64 {
    let scrape = TestClient::http1()
        .get(&gate.admin_url("/metrics"), &[])
        .await
        .text();
    scrape
        .lines()
        .filter(|l| l.starts_with(&format!("{family}{{")) && l.contains(r#"route="chat""#))
        .filter(|l| l.contains(label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

/// One SDK call through `gate` with `max_tokens`: its answer's fields.
async fn one_call(gate: &Floodgate, max_tokens: u64) -> serde_json::Value {
    let args = [
        "calls".to_owned(),
        gate.url("/v1"),
        "sk-test-key".to_owned(),
        "1".to_owned(),
        "1".to_owned(),
        "0".to_owned(),
        format!("headers:{max_tokens}"),
    ];
    let mut calls = client("openai_peer.py", &args).await;
    assert_eq!(calls.len(), 1, "{calls:?}");
    calls.remove(0)
}

/// Twelve calls against the model of 10 requests and 2 000 tokens (each
/// call reserving its `max_tokens` + 100, settled to 155): seven of 900
/// admitted, the eighth refused by the tokens' limit (915 left, 1 000
/// asked), three of 300 admitted, the twelfth refused by the requests'
/// limit. After every call each `x-ratelimit-*` field is the model's: a
/// refused call reports every limit as it stands, nothing taken.
async fn every_field_follows_the_model(gate: &Floodgate, redis: Option<(&TestRedis, &str)>) {
    let (mut requests, mut tokens, mut refunded, mut logged) = (10u64, 2_000u64, 0u64, 0u64);
    let mut refusals = Vec::new();
    let first = std::time::Instant::now();
    for max_tokens in [900; 8].into_iter().chain([300; 4]) {
        let reserve = max_tokens + 100;
        let call = one_call(gate, max_tokens).await;
        assert_eq!(field(&call, "x-ratelimit-limit-requests"), "10", "{call}");
        assert_eq!(field(&call, "x-ratelimit-limit-tokens"), "2000", "{call}");
        // Both logs' oldest entry is the first call's: each reset is the
        // hour from it, so no more than an hour and no less than an hour
        // less the time since the first call was sent.
        let since_first = u64::try_from(first.elapsed().as_millis()).unwrap_or(u64::MAX);
        for reset in ["x-ratelimit-reset-requests", "x-ratelimit-reset-tokens"] {
            let ms = go_duration_ms(&field(&call, reset));
            assert!(
                ms <= 3_600_000 && ms + since_first + 50 >= 3_600_000,
                "{reset} {ms} ms, {since_first} ms after the first call: {call}"
            );
        }
        let refused_by = if requests == 0 {
            Some("requests")
        } else if tokens < reserve {
            Some("tokens")
        } else {
            None
        };
        let (shown_requests, shown_tokens) = match refused_by {
            Some(which) => {
                assert_eq!(call["error"], "RateLimitError", "{call}");
                assert!(call["headers"].get("retry-after").is_some(), "{call}");
                refusals.push(which);
                (requests, tokens)
            }
            None => {
                assert_eq!(call["read"], PROMPT + COMPLETION, "{call}");
                assert!(call["headers"].get("retry-after").is_none(), "{call}");
                requests -= 1;
                let shown = (requests, tokens - reserve);
                tokens -= PROMPT + COMPLETION;
                refunded += reserve - (PROMPT + COMPLETION);
                logged += PROMPT + COMPLETION + 1;
                shown
            }
        };
        assert_eq!(
            field(&call, "x-ratelimit-remaining-requests"),
            shown_requests.to_string(),
            "{call}"
        );
        assert_eq!(
            field(&call, "x-ratelimit-remaining-tokens"),
            shown_tokens.to_string(),
            "{call}"
        );
        // The next call comes once this one is settled.
        for _ in 0..600 {
            let store_done = match redis {
                Some((redis, prefix)) => charged(redis, prefix).await == logged,
                None => true,
            };
            if store_done
                && counted(gate, "floodgate_usage_units_total", r#"kind="refunded""#).await
                    == refunded
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    assert_eq!(refusals, ["tokens", "requests"]);
}

/// A duration as OpenAI writes its resets (`59m58.5s`, `6ms`), in
/// milliseconds.
fn go_duration_ms(text: &str) -> u64 {
    if let Some(ms) = text.strip_suffix("ms") {
        return ms.parse().unwrap_or_else(|_| panic!("a duration: {text}"));
    }
    let (mut total, mut number) = (0.0f64, String::new());
    for c in text.chars() {
        let unit = match c {
            'h' => 3_600_000.0,
            'm' => 60_000.0,
            's' => 1_000.0,
            _ => {
                number.push(c);
                continue;
            }
        };
        let n: f64 = number
            .parse()
            .unwrap_or_else(|_| panic!("a duration: {text}"));
        total += n * unit;
        number.clear();
    }
    assert!(number.is_empty(), "a duration: {text}");
    total.round() as u64
}

/// [`every_field_follows_the_model`] on a route of 10 requests and 2 000
/// tokens an hour (the model needs no window to pass), `store` its
/// store's TOML lines.
fn model_route(api: &str) -> Route {
    chat(api, 2_000)
        .limits(r#"{ algorithm = "sliding_log", limit = 10, window = "1h", counts = "requests" }"#)
        .line(r#"rate_limit_headers = "openai""#)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_calls_report_every_limit_as_the_memory_store_holds_it() {
    let api = fake_openai().await;
    let toml = Config::new().admin().route(model_route(&api)).toml();
    let gate = Floodgate::start(&toml).await;
    every_field_follows_the_model(&gate, None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_calls_report_every_limit_as_redis_holds_it() {
    let redis = TestRedis::start().await;
    let prefix = unique_prefix("sdk-model");
    let api = fake_openai().await;
    let toml = Config::new()
        .admin()
        .redis(&redis.url, &prefix)
        .route(model_route(&api))
        .toml();
    let gate = Floodgate::start(&toml).await;
    every_field_follows_the_model(&gate, Some((&redis, &prefix))).await;
}

/// `n` calls through the SDK to the API at `base` (`…/v1`), 0.05 s apart,
/// each with `max_tokens` 10: what each read, or raised.
async fn calls_to(base: &str, n: u32) -> Vec<serde_json::Value> {
    let args = [
        "calls".to_owned(),
        base.to_owned(),
        "sk-test-key".to_owned(),
        "1".to_owned(),
        n.to_string(),
        "0.05".to_owned(),
        "headers:10".to_owned(),
    ];
    client("openai_peer.py", &args).await
}

/// The SDK's error of `call`: a 429 `RateLimitError` with `code`, and
/// OpenAI's whole error body as it was sent.
fn rate_limit_error<'c>(call: &'c serde_json::Value, code: &str) -> &'c serde_json::Value {
    assert_eq!(call["error"], "RateLimitError", "{call}");
    assert_eq!(call["status"], 429, "{call}");
    assert_eq!(call["code"], code, "{call}");
    let error = &call["whole"]["error"];
    assert_eq!(
        call["whole"].as_object().map(|o| o.len()),
        Some(1),
        "{call}"
    );
    let mut keys: Vec<&String> = error
        .as_object()
        .map(|o| o.keys().collect())
        .unwrap_or_default();
    keys.sort();
    assert_eq!(keys, ["code", "message", "param", "type"], "{call}");
    assert!(error["param"].is_null(), "{call}");
    assert!(field(call, "retry-after").parse::<u64>().is_ok(), "{call}");
    error
}

/// On routes with `answers = "openai"`: a spent month (a calendar window,
/// no `deny_code`) raises `insufficient_quota`, a spent minute
/// `rate_limit_exceeded` typed `requests`, and a rolling window that
/// names `deny_code = "insufficient_quota"` that; each a
/// `RateLimitError` the SDK reads, with `Retry-After` and the
/// `x-ratelimit-*` fields as on any refusal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spent_month_and_a_spent_minute_raise_the_codes_openai_clients_act_on() {
    let redis = TestRedis::start().await;
    let prefix = unique_prefix("sdk-codes");
    let api = fake_openai().await;
    let two_requests = |name: &str, window: &str, extra: &str| {
        chat_named(name, &api, 1_000_000, "")
            .limits(&format!(
                r#"{{ algorithm = "fixed_window", limit = 2, window = "{window}", counts = "requests"{extra} }}"#
            ))
            .line(r#"answers = "openai""#)
            .line(r#"rate_limit_headers = "openai""#)
    };
    let toml = Config::new()
        .admin()
        .redis(&redis.url, &prefix)
        .route(two_requests("monthly", "month", ""))
        .route(two_requests("minute", "1m", ""))
        .route(two_requests(
            "named",
            "1h",
            r#", deny_code = "insufficient_quota""#,
        ))
        .toml();
    let gate = Floodgate::start(&toml).await;
    for (name, code) in [
        ("monthly", "insufficient_quota"),
        ("minute", "rate_limit_exceeded"),
        ("named", "insufficient_quota"),
    ] {
        let calls = calls_to(&gate.url(&format!("/{name}/v1")), 3).await;
        assert_eq!(calls.len(), 3, "{calls:?}");
        for admitted in &calls[..2] {
            assert_eq!(admitted["read"], PROMPT + 10, "{admitted}");
        }
        let refused = &calls[2];
        let error = rate_limit_error(refused, code);
        assert_eq!(error["code"], code, "{refused}");
        assert_eq!(field(refused, "x-ratelimit-remaining-requests"), "0");
        assert_eq!(field(refused, "x-ratelimit-limit-requests"), "2");
        if code == "insufficient_quota" {
            assert_eq!(refused["type"], "insufficient_quota", "{refused}");
            assert_eq!(
                error["message"],
                "You exceeded your current quota, please check your plan and billing details."
            );
        } else {
            assert_eq!(refused["type"], "requests", "{refused}");
            let wait = field(refused, "retry-after");
            let message = error["message"].as_str().unwrap_or_default();
            assert!(
                message.starts_with("Rate limit reached for requests")
                    && message.ends_with(&format!("Please try again in {wait}s.")),
                "{refused}"
            );
        }
    }
}

/// With `on_error = "deny"` and the store gone, a route with `answers =
/// "openai"` answers 503 in OpenAI's shape, which the SDK raises as an
/// `APIStatusError` (its `InternalServerError`) with the body read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_outage_is_an_api_status_error_with_openais_error_body() {
    let mut redis = TestRedis::start_process().await;
    let prefix = unique_prefix("sdk-outage");
    let api = fake_openai().await;
    let toml = Config::new()
        .admin()
        .redis(&redis.url, &prefix)
        .store(r#"on_error = "deny""#)
        .route(chat(&api, 1_000_000).line(r#"answers = "openai""#))
        .toml();
    let gate = Floodgate::start(&toml).await;
    let before = calls_to(&gate.url("/v1"), 1).await;
    assert_eq!(before.len(), 1);
    assert_eq!(before[0]["read"], PROMPT + 10, "{before:?}");
    redis.kill();
    let during = calls_to(&gate.url("/v1"), 3).await;
    assert_eq!(during.len(), 3, "{during:?}");
    for call in &during {
        assert_eq!(call["error"], "InternalServerError", "{call}");
        assert_eq!(call["status"], 503, "{call}");
        assert_eq!(
            call["whole"],
            serde_json::json!({"error": {
                "message": "the rate limit store is unavailable; retry later",
                "type": "server_error", "param": null, "code": null,
            }}),
            "{call}"
        );
        assert_eq!(call["type"], "server_error", "{call}");
        assert!(field(call, "retry-after").parse::<u64>().is_ok(), "{call}");
    }
}

/// Units charged on route `chat` once they reach `want`, or what they are
/// after 60 s (an answer read on settles when the upstream has finished
/// it).
async fn settled_within_a_minute(redis: &TestRedis, prefix: &str, want: u64) -> u64 {
    let found = settled(redis, prefix, want).await;
    if found == want {
        return found;
    }
    settled(redis, prefix, want).await
}

/// The access log lines at `path` of requests on route `chat` once there
/// are `count` of them, or those there are after 60 s.
async fn chat_lines(path: &std::path::Path, count: usize) -> Vec<serde_json::Value> {
    let mut found = Vec::new();
    for _ in 0..1_200 {
        found = std::fs::read_to_string(path)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|l| l["route"] == "chat")
            .collect();
        if found.len() >= count {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    found
}

/// Twenty SDK streams of a slow model, each closed by its caller after the
/// first chunk, on two instances on one Redis of a route whose `usage`
/// says `abandoned` (and more `usage` keys, `extra`): the calls, each
/// instance's access log lines of route `chat`, and the instances.
async fn twenty_abandoned_streams(
    redis: &TestRedis,
    prefix: &str,
    extra: &str,
) -> (
    Vec<serde_json::Value>,
    Vec<serde_json::Value>,
    [Floodgate; 2],
) {
    let api = fake_openai().await;
    let dir = support::temp_dir("abandoned");
    let logs = [dir.join("a.log"), dir.join("b.log")];
    let toml = |log: &std::path::Path| {
        Config::new()
            .admin()
            .redis(&redis.url, prefix)
            .access_log(&[&format!("path = {:?}", log.display().to_string())])
            .route(chat_named("chat", &api, 1_000_000, extra))
            .toml()
    };
    let gates = [
        Floodgate::start(&toml(&logs[0])).await,
        Floodgate::start(&toml(&logs[1])).await,
    ];
    let calls = sdk(&gates, 4, 5, "abandon").await;
    let mut lines = Vec::new();
    for log in &logs {
        // Each instance served two rounds of five calls.
        lines.extend(chat_lines(log, 10).await);
    }
    assert_eq!(lines.len(), 20, "{lines:#?}");
    (calls, lines, gates)
}

/// The sum over `gates` of `floodgate_usage_abandoned_total` on route
/// `chat` for `outcome`.
async fn abandoned(gates: &[Floodgate], outcome: &str) -> u64 {
    let mut sum = 0;
    for gate in gates {
        sum += counted(
            gate,
            "floodgate_usage_abandoned_total",
            &format!(r#"outcome="{outcome}""#),
        )
        .await;
    }
    sum
}

/// With `abandoned = "drain"`, twenty streams closed by the SDK after
/// their first chunk are read on by floodgate until the upstream has
/// finished them and reported their usage: each is settled to the 155
/// tokens it reported, not its reservation of 400, and its log line says
/// `drained`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_streams_abandoned_after_their_first_chunk_are_drained_and_settled_to_their_report()
{
    let redis = TestRedis::start().await;
    let prefix = unique_prefix("sdk-drain");
    let (calls, lines, gates) =
        twenty_abandoned_streams(&redis, &prefix, r#", abandoned = "drain""#).await;
    assert_eq!(calls.len(), 20);
    for call in &calls {
        assert_eq!(call["first"], "Hel", "{call}");
    }
    let want = 20 * (PROMPT + COMPLETION);
    assert_eq!(settled_within_a_minute(&redis, &prefix, want).await, want);
    for line in &lines {
        assert_eq!(line["abandoned"], "drained", "{line}");
        assert_eq!(line["units_reserved"], 400, "{line}");
        assert_eq!(line["units_reported"], PROMPT + COMPLETION, "{line}");
    }
    assert_eq!(abandoned(&gates, "drained").await, 20);
    for outcome in ["bound", "full", "broke", "closed"] {
        assert_eq!(abandoned(&gates, outcome).await, 0, "{outcome}");
    }
    for gate in &gates {
        assert_eq!(unreported(gate, "client_left").await, 0);
    }
}

/// With `abandoned = "close"` (the default, here written out), the same
/// twenty streams are closed when their client leaves: each is charged its
/// reservation of 400, counted as `client_left`, and its log line says
/// `closed`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_streams_abandoned_after_their_first_chunk_are_closed_and_charged_their_reservation()
{
    let redis = TestRedis::start().await;
    let prefix = unique_prefix("sdk-close");
    let (calls, lines, gates) =
        twenty_abandoned_streams(&redis, &prefix, r#", abandoned = "close""#).await;
    assert_eq!(calls.len(), 20);
    for call in &calls {
        assert_eq!(call["first"], "Hel", "{call}");
    }
    let want = 20 * 400;
    assert_eq!(settled_within_a_minute(&redis, &prefix, want).await, want);
    for line in &lines {
        assert_eq!(line["abandoned"], "closed", "{line}");
        assert_eq!(line["units_reserved"], 400, "{line}");
        assert!(line.get("units_reported").is_none(), "{line}");
    }
    assert_eq!(abandoned(&gates, "closed").await, 20);
    for outcome in ["drained", "bound", "full", "broke"] {
        assert_eq!(abandoned(&gates, outcome).await, 0, "{outcome}");
    }
    let left =
        unreported(&gates[0], "client_left").await + unreported(&gates[1], "client_left").await;
    assert_eq!(left, 20);
}

/// A chat route on Redis whose client is the registry's key, read as the
/// SDK sends it; 3 calls an hour each.
fn keyed_chat(redis: &str, prefix: &str, api: &str, token: &std::path::Path) -> String {
    Config::new()
        .admin()
        .redis(redis, prefix)
        .server(&format!(r#"admin_token_file = "{}""#, token.display()))
        .tables("[keys]\nprefix = \"sk-proj-\"\n")
        .route(
            Route::new("chat")
                .upstream(api.trim_end_matches("/v1"))
                .matching(r#"path_prefix = "/v1/chat/completions""#)
                .line(r#"api_key = { from = "bearer" }"#)
                .line(r#"answers = "openai""#)
                .client(r#"from = "key""#)
                .limits(r#"{ algorithm = "sliding_log", limit = 3, window = "1h" }"#),
        )
        .toml()
}

/// A key made through one instance's admin API, sent by the SDK as its
/// `api_key` (`Authorization: Bearer …`) through the other instance at
/// once: admitted by the key's own limit (3 an hour), then a
/// `RateLimitError`; a made-up key raises `AuthenticationError` (401,
/// `invalid_api_key`, OpenAI's whole error body) and the key once
/// disabled `PermissionDeniedError` (403), neither counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sdks_key_is_verified_by_the_registry_and_refused_as_openai_would() {
    let redis = TestRedis::start().await;
    let prefix = unique_prefix("sdk-keys");
    let api = fake_openai().await;
    let dir = support::temp_dir("sdk-keys");
    let token = "0123456789abcdef0123456789abcdef";
    std::fs::write(dir.join("token"), format!("{token}\n")).expect("write the token");
    let toml = keyed_chat(&redis.url, &prefix, &api, &dir.join("token"));
    let (a, b) = (Floodgate::start(&toml).await, Floodgate::start(&toml).await);
    let admin = |method: &str, path: &str, body: &str| {
        http::Request::builder()
            .method(method)
            .uri(a.admin_url(path))
            .header("authorization", format!("Bearer {token}"))
            .body(support::text_body(body))
            .expect("a request")
    };
    let made = TestClient::http1()
        .send(admin(
            "POST",
            "/keys",
            r#"{"identity": "dora", "reason": "signed up"}"#,
        ))
        .await;
    assert_eq!(made.status, 201, "{}", made.text());
    let key = made.json()["key"].as_str().expect("a key").to_owned();
    let id = made.json()["record"]["id"]
        .as_str()
        .expect("an id")
        .to_owned();
    let through_b = |key: &str, n: u32| {
        let args = [
            "calls".to_owned(),
            b.url("/v1"),
            key.to_owned(),
            "1".to_owned(),
            n.to_string(),
            "0.05".to_owned(),
            "headers:10".to_owned(),
        ];
        async move { client("openai_peer.py", &args).await }
    };
    let made_up = through_b("sk-proj-made-up", 2).await;
    for call in &made_up {
        assert_eq!(call["error"], "AuthenticationError", "{call}");
        assert_eq!(call["status"], 401, "{call}");
        assert_eq!(call["code"], "invalid_api_key", "{call}");
        assert_eq!(
            call["whole"]["error"]["type"], "invalid_request_error",
            "{call}"
        );
    }
    let calls = through_b(&key, 4).await;
    let admitted = calls.iter().filter(|c| c["read"].is_u64()).count();
    assert_eq!(admitted, 3, "{calls:?}");
    assert_eq!(calls[3]["error"], "RateLimitError", "{}", calls[3]);
    let disabled = TestClient::http1()
        .send(admin(
            "PATCH",
            &format!("/keys/{id}"),
            r#"{"enabled": false, "reason": "chargeback"}"#,
        ))
        .await;
    assert_eq!(disabled.status, 200, "{}", disabled.text());
    let start = std::time::Instant::now();
    let refused = loop {
        let call = through_b(&key, 1).await.remove(0);
        if call["error"] != "RateLimitError" || start.elapsed() > Duration::from_secs(5) {
            break call;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(refused["error"], "PermissionDeniedError", "{refused}");
    assert_eq!(refused["status"], 403, "{refused}");
    assert_eq!(refused["code"], "invalid_api_key", "{refused}");
}
