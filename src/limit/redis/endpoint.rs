//! Reaching `[store]`'s endpoint: each URL's connection settings (with
//! its TLS), and from them what the store sends on (the pool for one Redis
//! or the primary a Sentinel group names, a cluster's seeds) and where it
//! listens for units given back.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicUsize};
use std::time::Duration;

use arc_swap::ArcSwapOption;
use deadpool::managed;
use prometheus_client::metrics::counter::Counter;
use redis::sentinel::{SentinelClient, SentinelNodeConnectionInfo, SentinelServerType};
use redis::{
    AsyncConnectionConfig, ClientTlsConfig, ConnectionInfo, IntoConnectionInfo, RedisError, Script,
    TlsCertificates,
};

use super::cluster::{Cluster, Node};
use super::code::{FUNCTIONS_UNKNOWN, Library, SCRIPT};
use super::connections::Lanes;
use super::given_back::{self, Source};
use super::keys::IdKey;
use super::{CONNECTIONS, Link, RedisStore};
use crate::limit::StoreError;
use crate::limit::deny_cache::GivenBack;
use crate::limit::settings::{Endpoint, Tls};

impl RedisStore {
    /// A store for `endpoint`: one Redis or a Redis Cluster, over TLS with
    /// `tls` for `rediss://`, counting the calls it sends in `calls` and
    /// noting in `given_back` the units the store tells were given back.
    /// Connects lazily; listens for units given back from the start, when
    /// made on a Tokio runtime.
    pub fn connect(
        endpoint: &Endpoint,
        tls: &Tls,
        key_prefix: &str,
        timeout: Duration,
        calls: Counter,
        given_back: GivenBack,
    ) -> Result<Self, StoreError> {
        let reach = Reach::new(tls, timeout);
        let (lanes, cluster, source) = reach.endpoint(endpoint)?;
        let pool = lanes.map(pool_of).transpose()?;
        let given_back = Arc::new(given_back);
        let listener = given_back::listen(
            source,
            format!("{key_prefix}:given-back"),
            Arc::clone(&given_back),
            reach.connect_timeout.max(Duration::from_secs(1)),
        );
        Ok(Self {
            link: Arc::new(Link {
                pool,
                lanes: (0..CONNECTIONS).map(|_| ArcSwapOption::empty()).collect(),
                next_lane: AtomicUsize::new(0),
                script: Script::new(SCRIPT),
                library: Library::new(),
                functions: AtomicU8::new(FUNCTIONS_UNKNOWN),
                cluster,
                timeout,
                calls,
            }),
            queue: ArcSwapOption::empty(),
            key_prefix: key_prefix.to_owned(),
            id_key: IdKey::new(None),
            single: Arc::new(Node::single(endpoint.to_string())),
            given_back,
            listener,
        })
    }
}

/// How the store reaches each URL of its endpoint: TLS settings and
/// connection timeouts shared by all of them.
struct Reach<'a> {
    tls: &'a Tls,
    /// Whether `tls` names a CA or a client certificate of its own.
    custom_tls: bool,
    connect_timeout: Duration,
}

/// What a store sends on: the pool's connections (one Redis, or the
/// primary the Sentinels name), or a cluster; and where it hears of units
/// given back.
type Reached = (Option<Lanes>, Option<Arc<Cluster>>, Source);

impl<'a> Reach<'a> {
    fn new(tls: &'a Tls, timeout: Duration) -> Self {
        let connect_timeout = timeout.max(Duration::from_millis(500));
        Self {
            tls,
            custom_tls: tls.ca.is_some() || tls.client.is_some(),
            connect_timeout,
        }
    }

    /// How each connection is made: within the connect timeout, with no
    /// response timeout of redis-rs's (each decision has its own deadline).
    fn config(&self) -> AsyncConnectionConfig {
        AsyncConnectionConfig::new()
            .set_connection_timeout(Some(self.connect_timeout))
            .set_response_timeout(None)
    }

    /// What the store sends on for `endpoint`.
    fn endpoint(&self, endpoint: &Endpoint) -> Result<Reached, StoreError> {
        let config = self.config();
        Ok(match endpoint {
            Endpoint::Single(url) => (
                Some(Lanes::Single(
                    deadpool_redis::Manager::new_with_config(self.info(url)?, config)
                        .map_err(invalid)?,
                )),
                None,
                Source::Single(self.info(url)?),
            ),
            Endpoint::Cluster(urls) => {
                let seeds = urls
                    .iter()
                    .map(|url| self.info(url))
                    .collect::<Result<Vec<_>, _>>()?;
                let cluster = Arc::new(Cluster::new(seeds, config, self.connect_timeout));
                let source = Source::Cluster(Arc::clone(&cluster));
                (None, Some(cluster), source)
            }
            Endpoint::Sentinel { urls, master } => (
                Some(Lanes::Sentinel(
                    tokio::sync::Mutex::new(sentinels(urls, master)?),
                    config,
                )),
                None,
                Source::Sentinel(sentinels(urls, master)?),
            ),
        })
    }

    /// How to connect to `url`, with the configured certificates.
    fn info(&self, url: &str) -> Result<ConnectionInfo, StoreError> {
        if !self.custom_tls {
            return url.into_connection_info().map_err(invalid);
        }
        Ok(redis::Client::build_with_tls(url, self.certificates())
            .map_err(invalid)?
            .get_connection_info()
            .clone())
    }

    /// The configured CA and client certificate, as redis-rs takes them.
    fn certificates(&self) -> TlsCertificates {
        TlsCertificates {
            client_tls: self.tls.client.as_ref().map(|(cert, key)| ClientTlsConfig {
                client_cert: cert.clone(),
                client_key: key.clone(),
            }),
            root_cert: self.tls.ca.clone(),
        }
    }
}

/// A client of the Sentinels at `urls` for the primary named `master`.
fn sentinels(urls: &[String], master: &str) -> Result<SentinelClient, StoreError> {
    SentinelClient::build(
        urls.iter().map(String::as_str).collect(),
        master,
        Some(SentinelNodeConnectionInfo::default()),
        SentinelServerType::Master,
    )
    .map_err(invalid)
}

/// The pool of connections `lanes` makes.
fn pool_of(lanes: Lanes) -> Result<managed::Pool<Lanes>, StoreError> {
    managed::Pool::builder(lanes)
        .max_size(CONNECTIONS)
        .runtime(deadpool::Runtime::Tokio1)
        .build()
        .map_err(|e| StoreError::Backend(format!("cannot build the Redis pool: {e}")))
}

/// Settings redis-rs cannot make sense of.
fn invalid(e: RedisError) -> StoreError {
    StoreError::Backend(format!("invalid Redis settings: {e}"))
}
