//! The upstream endpoints' series, read from the endpoints in force at
//! each scrape: the addresses of a DNS name come and go, and so do their
//! series, so their number stays that of the endpoints in force.

use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

use super::balance::{Failure, Group, Stats};

/// The series of the upstreams in force (each group once).
#[derive(Debug)]
pub struct Endpoints {
    groups: Vec<Arc<Group>>,
}

impl Endpoints {
    /// The series of `groups`' endpoints.
    pub fn new(groups: Vec<Arc<Group>>) -> Self {
        Self { groups }
    }
}

/// A metric's name, help and value, read from an endpoint's stats.
type Series<T> = (&'static str, &'static str, fn(&Stats) -> T);

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EndpointLabel {
    upstream: String,
    endpoint: String,
    address: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabel {
    kind: String,
}

impl Collector for Endpoints {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let mut rows = Vec::new();
        for group in &self.groups {
            for member in group.members().iter() {
                let label = EndpointLabel {
                    upstream: group.name.to_string(),
                    endpoint: group.configured(member).to_owned(),
                    address: member.address().to_owned(),
                };
                rows.push((label, member.stats()));
            }
        }
        let counters: [Series<u64>; 2] = [
            (
                "floodgate_upstream_endpoint_requests",
                "Requests sent to each upstream endpoint (a retry counts where it went).",
                |s| s.requests,
            ),
            (
                "floodgate_upstream_endpoint_ejections",
                "Times each upstream endpoint was ejected after failing in a row.",
                |s| s.ejections,
            ),
        ];
        for (name, help, value) in counters {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            for (label, stats) in &rows {
                ConstCounter::new(value(stats)).encode(family.encode_family(label)?)?;
            }
        }
        {
            let mut family = encoder.encode_descriptor(
                "floodgate_upstream_endpoint_errors",
                "Failures of each upstream endpoint by kind (connect, timeout, protocol).",
                None,
                MetricType::Counter,
            )?;
            for (label, stats) in &rows {
                for kind in Failure::ALL {
                    let labels = (
                        label.clone(),
                        KindLabel {
                            kind: kind.name().into(),
                        },
                    );
                    ConstCounter::new(stats.errors[kind as usize])
                        .encode(family.encode_family(&labels)?)?;
                }
            }
        }
        let gauges: [Series<i64>; 2] = [
            (
                "floodgate_upstream_endpoint_in_flight",
                "Requests in flight on each upstream endpoint.",
                |s| i64::try_from(s.in_flight).unwrap_or(i64::MAX),
            ),
            (
                "floodgate_upstream_endpoint_healthy",
                "1 while an upstream endpoint takes requests (not ejected, not failing its health check).",
                |s| i64::from(s.healthy),
            ),
        ];
        for (name, help, value) in gauges {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for (label, stats) in &rows {
                ConstGauge::new(value(stats)).encode(family.encode_family(label)?)?;
            }
        }
        Ok(())
    }
}
