//! The standard `process_*` metrics of the running process.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

/// The standard `process_*` metrics, read from `/proc` at each scrape.
#[derive(Debug)]
pub(super) struct Process {
    /// When it started, in seconds since the Unix epoch.
    started: f64,
}

impl Process {
    pub(super) fn new() -> Self {
        let started = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        Self { started }
    }
}

/// Clock ticks per second in `/proc/self/stat` (`USER_HZ`, 100 on Linux).
const TICKS_PER_SECOND: f64 = 100.0;

impl Collector for Process {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        // utime and stime are the 14th and 15th fields; the 2nd, the
        // command, is in parentheses and may hold spaces.
        let cpu = std::fs::read_to_string("/proc/self/stat")
            .ok()
            .and_then(|stat| {
                let after = stat.rsplit_once(')')?.1;
                let fields: Vec<&str> = after.split_whitespace().collect();
                let ticks = |i: usize| fields.get(i)?.parse::<u64>().ok();
                Some((ticks(11)? + ticks(12)?) as f64 / TICKS_PER_SECOND)
            });
        if let Some(cpu) = cpu {
            let family = encoder.encode_descriptor(
                "process_cpu_seconds",
                "User and system CPU time spent by the process, in seconds.",
                None,
                MetricType::Counter,
            )?;
            ConstCounter::new(cpu).encode(family)?;
        }
        let resident = std::fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|status| {
                let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
                let kib = line.split_whitespace().nth(1)?.parse::<i64>().ok()?;
                Some(kib * 1024)
            });
        if let Some(bytes) = resident {
            let family = encoder.encode_descriptor(
                "process_resident_memory_bytes",
                "Resident memory of the process, in bytes.",
                None,
                MetricType::Gauge,
            )?;
            ConstGauge::new(bytes).encode(family)?;
        }
        if let Ok(fds) = std::fs::read_dir("/proc/self/fd") {
            let family = encoder.encode_descriptor(
                "process_open_fds",
                "File descriptors the process holds open.",
                None,
                MetricType::Gauge,
            )?;
            ConstGauge::new(i64::try_from(fds.count()).unwrap_or(i64::MAX)).encode(family)?;
        }
        if let Some(max) = rustix::process::getrlimit(rustix::process::Resource::Nofile).current {
            let family = encoder.encode_descriptor(
                "process_max_fds",
                "Most file descriptors the process may open.",
                None,
                MetricType::Gauge,
            )?;
            ConstGauge::new(i64::try_from(max).unwrap_or(i64::MAX)).encode(family)?;
        }
        let family = encoder.encode_descriptor(
            "process_start_time_seconds",
            "When the process started, in seconds since the Unix epoch.",
            None,
            MetricType::Gauge,
        )?;
        ConstGauge::new(self.started).encode(family)?;
        Ok(())
    }
}
