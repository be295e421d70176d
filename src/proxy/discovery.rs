//! Keeping an upstream's endpoints current: DNS names resolved again every
//! `resolve_every`, so that a changed record or the pods behind a Kubernetes
//! headless service are followed; and the optional active health check,
//! a `GET` of a path on every endpoint every interval, expecting 2xx.
//!
//! Each group with a DNS name or a health check has one task, which holds
//! the group weakly: when a reload drops the group, the task ends. Names
//! are resolved by the system's resolver (`/etc/hosts`, `/etc/resolv.conf`
//! and its search domains). A lookup that fails or finds nothing keeps the
//! addresses last found, so a resolver outage never empties an upstream.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use http::header::{HOST, USER_AGENT};
use http::{HeaderMap, HeaderValue, Method};
use tokio::time::Instant;

use super::balance::{Group, Member};
use super::connect::{self, Sender};
use super::outgoing::{Head, Wire};
use super::request_body::RequestBody;
use super::settings::{Check, Endpoint};

/// How long a DNS lookup may take before the addresses last found are kept.
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(5);

static CHECKER: HeaderValue = HeaderValue::from_static("floodgate-health-check");

// === impl Group ===

impl Group {
    /// Looks its DNS names up once (so that requests go to addresses from
    /// the first one on), then starts the task that resolves them again and
    /// checks its endpoints, if it has either to do. Needs a Tokio runtime.
    pub async fn start(self: &Arc<Self>) {
        let resolves = self.sources.iter().any(|s| s.name.is_some());
        if resolves {
            self.resolve().await;
        }
        if resolves || self.check.is_some() {
            tokio::spawn(upkeep(Arc::downgrade(self), resolves));
        }
    }

    /// Looks every DNS name up again and puts the addresses found in force;
    /// an address still there keeps its member (and its health record).
    async fn resolve(&self) {
        let current = self.members();
        let mut next: Vec<Arc<Member>> = Vec::with_capacity(current.len());
        let mut changed = false;
        for (index, source) in self.sources.iter().enumerate() {
            let kept = current.iter().filter(|m| m.source == index);
            let Some((host, port)) = &source.name else {
                next.extend(kept.cloned());
                continue;
            };
            let found =
                tokio::time::timeout(RESOLVE_TIMEOUT, tokio::net::lookup_host((&**host, *port)))
                    .await;
            let mut addresses: Vec<SocketAddr> = match found {
                Ok(Ok(found)) => found.collect(),
                Ok(Err(e)) => {
                    source.lookup_failed(&self.name, &e.to_string());
                    Vec::new()
                }
                Err(_) => {
                    source.lookup_failed(&self.name, "no answer in time");
                    Vec::new()
                }
            };
            if addresses.is_empty() {
                next.extend(kept.cloned());
                continue;
            }
            if source.failing.swap(false, Ordering::Relaxed) {
                tracing::info!(upstream = %self.name, host = %host, "DNS name resolves again");
            }
            addresses.sort_unstable();
            addresses.dedup();
            for address in addresses {
                let label = address.to_string();
                match current
                    .iter()
                    .find(|m| m.source == index && *m.address == *label)
                {
                    Some(member) => next.push(Arc::clone(member)),
                    None => {
                        if let Some(member) = source.at(index, address) {
                            changed = true;
                            next.push(Arc::new(member));
                        }
                    }
                }
            }
        }
        changed |= next.len() != current.len();
        if changed {
            let addresses: Vec<&str> = next.iter().map(|m| m.address()).collect();
            tracing::info!(upstream = %self.name, ?addresses, "upstream endpoints changed");
            self.replace(next);
        }
    }

    /// Checks every endpoint in force at once, each within the timeout.
    async fn check_all(self: &Arc<Self>, check: &Check) {
        let mut checks = tokio::task::JoinSet::new();
        for member in self.members().iter() {
            let (group, member, check) = (Arc::clone(self), Arc::clone(member), check.clone());
            checks.spawn(async move {
                let passed = tokio::time::timeout(check.timeout, probe(&member.endpoint, &check))
                    .await
                    .unwrap_or_else(|_| Err("no answer in time".to_owned()));
                if let Err(why) = &passed {
                    tracing::debug!(
                        upstream = %group.name,
                        endpoint = %member.endpoint.target,
                        why,
                        "health check failed"
                    );
                }
                group.checked(&member, &check, passed.is_ok());
            });
        }
        while checks.join_next().await.is_some() {}
    }
}

/// Resolves and checks the group until it is dropped.
async fn upkeep(group: Weak<Group>, resolves: bool) {
    let Some(every) = group.upgrade().map(|g| g.resolve_every) else {
        return;
    };
    // [`Group::start`] has just resolved.
    let mut resolve_at = Instant::now() + every;
    let mut check_at = Instant::now();
    loop {
        let Some(g) = group.upgrade() else {
            return;
        };
        if resolves && Instant::now() >= resolve_at {
            g.resolve().await;
            resolve_at = Instant::now() + g.resolve_every;
        }
        let mut wake = resolves.then_some(resolve_at);
        if let Some(check) = &g.check {
            if Instant::now() >= check_at {
                g.check_all(check).await;
                check_at = Instant::now() + check.every;
            }
            wake = Some(wake.map_or(check_at, |w| w.min(check_at)));
        }
        drop(g);
        let Some(wake) = wake else {
            return;
        };
        tokio::time::sleep_until(wake).await;
    }
}

/// One health check of `endpoint` on a connection of its own: `Ok` for a
/// 2xx answer, else why not.
async fn probe(endpoint: &Endpoint, check: &Check) -> Result<(), String> {
    let sender = connect::connect(endpoint, false)
        .await
        .map_err(|e| e.to_string())?;
    let mut headers = HeaderMap::with_capacity(2);
    headers.insert(HOST, endpoint.host_header.clone());
    headers.insert(USER_AGENT, CHECKER.clone());
    let head = Head {
        method: Method::GET,
        target: check.path.clone(),
        headers,
    };
    let response = match sender {
        Sender::Http1(mut send) => {
            send.ready().await.map_err(|e| e.to_string())?;
            let request = head.request(Wire::Http1, endpoint, RequestBody::empty());
            send.send_request(request).await
        }
        Sender::Http2(mut send) => {
            send.ready().await.map_err(|e| e.to_string())?;
            let request = head.request(Wire::Http2, endpoint, RequestBody::empty());
            send.send_request(request).await
        }
    }
    .map_err(|e| e.to_string())?;
    if response.status().is_success() {
        Ok(())
    } else {
        Err(format!("answered {}", response.status()))
    }
}
