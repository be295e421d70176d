//! Series that a module with live state shows through its own collector.

use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;

/// A place in the exposition for series that a module with live state
/// (the upstream endpoints, the concurrency caps) reads from that state at
/// each scrape: the owner writes the collector beside its state and puts
/// it here; a reload swaps it. Empty, it shows nothing.
#[derive(Debug, Default)]
pub(super) struct Shown {
    collector: arc_swap::ArcSwapOption<Box<dyn Collector>>,
}

impl Shown {
    pub(super) fn show(&self, collector: impl Collector) {
        self.collector.store(Some(Arc::new(Box::new(collector))));
    }
}

impl Collector for Shown {
    fn encode(&self, encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        match &*self.collector.load() {
            Some(collector) => collector.encode(encoder),
            None => Ok(()),
        }
    }
}
