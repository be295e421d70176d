//! The routes' concurrency series, read from the caps in force at each
//! scrape.

use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

use super::{Capacity, Refused};

/// The caps of the rules in force, by route name.
#[derive(Debug)]
pub struct Capacities {
    caps: Vec<(Arc<str>, Arc<Capacity>)>,
}

impl Capacities {
    /// The series of `caps`, each labelled with its route's name.
    pub fn new(caps: Vec<(Arc<str>, Arc<Capacity>)>) -> Self {
        Self { caps }
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteLabel {
    route: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    route: String,
    reason: &'static str,
}

impl Collector for Capacities {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        type Read = fn(&Capacity) -> usize;
        let gauges: [(&str, &str, Read); 3] = [
            (
                "floodgate_concurrency_in_flight",
                "Requests in flight on each route with a concurrency cap (all its clients together for per-client caps).",
                Capacity::in_flight,
            ),
            (
                "floodgate_concurrency_waiting",
                "Requests waiting in each route's concurrency queue.",
                Capacity::waiting,
            ),
            (
                "floodgate_concurrency_limit",
                "Each route's concurrency cap now (an adaptive cap moves; per-client caps are per client).",
                Capacity::limit,
            ),
        ];
        for (name, help, read) in gauges {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for (route, cap) in &self.caps {
                let label = RouteLabel {
                    route: route.to_string(),
                };
                ConstGauge::new(i64::try_from(read(cap)).unwrap_or(i64::MAX))
                    .encode(family.encode_family(&label)?)?;
            }
        }
        let mut family = encoder.encode_descriptor(
            "floodgate_concurrency_refusals",
            "Requests refused by each route's concurrency cap, by reason (full: no slot and no room in the queue; queue_timeout: waited the whole queue_timeout).",
            None,
            MetricType::Counter,
        )?;
        for (route, cap) in &self.caps {
            for reason in Refused::ALL {
                let label = ReasonLabel {
                    route: route.to_string(),
                    reason: reason.name(),
                };
                ConstCounter::new(cap.refusals(reason) as u64)
                    .encode(family.encode_family(&label)?)?;
            }
        }
        Ok(())
    }
}
