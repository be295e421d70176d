//! floodgate: a reverse proxy that enforces rate limits in front of HTTP APIs.
//!
//! A request travels one way through modules that each own one question:
//!
//! | module | question |
//! |---|---|
//! | [`config`] | what did the operator ask for? (TOML → validated [`config::Config`]: the rule table, the upstreams routes refer to by index, and each module's settings; no live state) |
//! | [`head`] | does the request head have one meaning? (method spelling, one `Host`, no CONNECT) |
//! | [`routes`] | which route is this request on, and what are its rules? (matching by path, template, method, host and headers; its limits and the overrides for some clients; how its answers carry them; its upstream, by index) |
//! | [`client`] | who is asking? (an address, a header, a path parameter, the whole route; how many failed credentials an address may send before its new tokens go unchecked) |
//! | [`jwt`] | which verified token claim is asking? (signature, algorithm, lifetime, issuer, audience) |
//! | [`keys`] | whose API key is this? (the registry of customers' keys: identity, plan, attributes, enabled, expiry; kept as keyed digests in the store, every instance holding a copy that follows the store's changes; made, imported, changed, revoked and rotated through the admin listener or listed in the keys file it reconciles, every change audited) |
//! | [`concurrency`] | is there room in flight? (per-route and per-client caps, fixed or following the upstream's latency, with a bounded queue; its settings in [`concurrency::settings`], its series in [`concurrency::metrics`]) |
//! | [`limit`] | is it allowed? (algorithms, the memory and Redis stores, and the limiter that adds the circuit breakers (one per Redis node: a cluster's primaries each have their own, as the store routes decisions to them itself), denial cache and `on_error`; the Redis store decides with `FCALL` of a function library, `EVALSHA` where Redis has no functions) |
//! | [`metrics`] | what happened, counted per route and outcome: the families and the registry; modules with live state to show at scrape time (endpoints, caps) hand it their own collectors; the dashboard's 15 minutes of history per route ([`metrics::history`]) |
//! | [`proxy`] | forward it upstream and stream the answer back over hyper's HTTP/1.1 and HTTP/2 client connections ([`proxy::pool`]), its head in each protocol's form and the copy kept to send it again ([`proxy::outgoing`]), TLS to `https://` upstreams ([`proxy::connect`]), upgrades spliced ([`proxy::upgrade`]), every phase timed ([`proxy::request_body`], [`proxy::response_body`]), forwarding headers ([`proxy::headers`] through [`proxy::Peer`]); an upstream as configured ([`proxy::settings`]), its endpoints balanced and ejected ([`proxy::balance`]), its DNS names followed and health checked ([`proxy::discovery`]), their series ([`proxy::metrics`]) |
//! | [`usage`] | how many units did the request use, on a route whose cost is what its upstream reports? (the reservation a request names; the report in the answer's header fields, its trailers, its JSON body or its event stream's last event, read as the body streams past; its settings in [`usage::settings`]) |
//! | [`refusal`] | every answer floodgate makes itself, and whose fault it is (client, upstream, store) |
//! | [`response`] | problem documents, the rate-limit headers, and the body type every answer goes out as (`response::body`: the upstream's streamed or floodgate's whole, with what watches its end) |
//! | [`reload`] | has the configuration changed? (SIGHUP, file contents; the plan table and the keys file read anew on their own) |
//! | [`admin`] | `/healthz`, `/readyz`, `/metrics` on their own listener, the dashboard with its JSON (`/status.json`, `/history.json`, `/clients/top`), operators on one client's counts (`/clients/standing`, `/credit`, `/debit`, `/reset`, behind a bearer token) and usage per window (`/usage/closed`, `/usage/top`) |
//! | [`access_log`] | one line per request, written off the data path, with sampling and caps (its `Line`, one of an answer's end hooks that gate holds beside the concurrency slot and a usage meter) |
//! | [`top`] | who is limited: each route's heaviest clients of the last minute, in fixed memory |
//! | [`tls`] | rustls configuration: the proxy listener's certificate, key and client CA; the trust, name and client certificate of `https://` upstreams |
//! | [`gate`] | one request's phases in order ([`gate::phases`]: head, route, admit body, identify, reserve, decide, forward, annotate, log), the rules a reload swaps with the live tables built beside them ([`gate::rules`]: upstream endpoints, caps, top clients, metric handles, by route or upstream index), the state requests share ([`gate::shared`]: the limiter and store, the forwarder, metrics, the access log) |
//! | [`envoy`] | what does Envoy's rate limit service protocol say? (its messages, with Envoy's field numbers, and gRPC's framing of one message; the decision listener answers it through [`gate`]) |
//! | [`server`] | listeners, accepting connections under a cap, serving them with hyper, shutting down gracefully; each request handed to [`gate`] |
//! | [`clock`] | the wall clock limits, ejections and the admin pages share |
//! | [`in_flight`] | how much is still in flight for a stop to wait for (open connections, usage settlements) |
//!
//! [`run`] serves a configuration on its [`Listeners`] (proxy, and admin
//! and decisions if configured) until a shutdown future completes, reloading when notified;
//! `main` parses flags, sets up logging, binds the listeners and turns
//! SIGHUP and SIGTERM into those two signals.

#![forbid(unsafe_code)]

pub mod access_log;
pub mod admin;
pub mod client;
pub mod clock;
pub mod concurrency;
pub mod config;
pub mod envoy;
pub mod gate;
pub mod head;
pub mod in_flight;
pub mod jwt;
pub mod keys;
pub mod limit;
pub mod metrics;
pub mod proxy;
pub mod refusal;
pub mod reload;
pub mod response;
pub mod routes;
pub mod server;
pub mod tls;
pub mod top;
pub mod usage;

pub use server::{Listeners, ServeError, run};
