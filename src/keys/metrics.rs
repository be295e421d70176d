//! The registry's series, read at each scrape: its size, lookups by
//! outcome, and how it follows the store.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

use super::{Keys, Outcome};

/// The registry, shown.
#[derive(Debug)]
pub struct Shown(pub Arc<Keys>);

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabel {
    outcome: &'static str,
}

impl Collector for Shown {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let keys = &self.0;
        let gauges: [(&str, &str, i64); 3] = [
            (
                "floodgate_keys",
                "Keys in the registry, as this instance holds it.",
                i64::try_from(keys.len()).unwrap_or(i64::MAX),
            ),
            (
                "floodgate_keys_synced_timestamp_seconds",
                "When this instance last followed the store's registry (0: never, or the memory store).",
                i64::try_from(keys.synced_ms.load(Ordering::Relaxed) / 1000).unwrap_or(0),
            ),
            (
                "floodgate_keys_file_reconciled_timestamp_seconds",
                "When the keys file was last reconciled into the registry (0: never).",
                keys.reconciled
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .as_ref()
                    .map_or(0, |r| i64::try_from(r.at_ms / 1000).unwrap_or(0)),
            ),
        ];
        for (name, help, value) in gauges {
            let family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            ConstGauge::new(value).encode(family)?;
        }
        let counters: [(&str, &str, u64); 2] = [
            (
                "floodgate_key_store_asks",
                "Keys this instance did not know asked of the store (a key made elsewhere a moment ago; at most 50 a second).",
                keys.asked[0].load(Ordering::Relaxed),
            ),
            (
                "floodgate_key_store_asks_found",
                "Of those, the keys the store knew (kept from then on).",
                keys.asked[1].load(Ordering::Relaxed),
            ),
        ];
        for (name, help, value) in counters {
            let family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            ConstCounter::new(value).encode(family)?;
        }
        let mut family = encoder.encode_descriptor(
            "floodgate_key_lookups",
            "Keys verified, by outcome (every lookup is of this instance's copy of the registry: none asks the store).",
            None,
            MetricType::Counter,
        )?;
        for (outcome, count) in Outcome::ALL.iter().zip(&keys.replica.lookups) {
            let label = OutcomeLabel {
                outcome: outcome.name(),
            };
            ConstCounter::new(count.load(Ordering::Relaxed))
                .encode(family.encode_family(&label)?)?;
        }
        Ok(())
    }
}
