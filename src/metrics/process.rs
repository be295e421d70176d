//! The standard `process_*` metrics of the running process.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

/// The standard `process_*` metrics, read from `/proc` at each scrape.
#[derive(Debug)]
pub(super) struct Process {
    /// When the process started, in seconds since the Unix epoch.
    started: f64,
    /// Clock ticks per second, as `/proc/self/stat` counts them
    /// (`sysconf(_SC_CLK_TCK)`).
    ticks_per_second: f64,
}

impl Process {
    pub(super) fn new() -> Self {
        let ticks_per_second = rustix::param::clock_ticks_per_second().max(1) as f64;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        Self {
            started: start_time(ticks_per_second).unwrap_or(now),
            ticks_per_second,
        }
    }
}

/// The fields of `/proc/self/stat` after the command (which is in
/// parentheses and may hold spaces): the 3rd field of the file is the
/// first of these.
fn stat_fields(stat: &str) -> Option<Vec<&str>> {
    Some(stat.rsplit_once(')')?.1.split_whitespace().collect())
}

/// When this process started, in seconds since the Unix epoch: the boot
/// time (`btime` of `/proc/stat`) plus the process's start in clock ticks
/// since boot (the 22nd field of `/proc/self/stat`).
fn start_time(ticks_per_second: f64) -> Option<f64> {
    let boot = std::fs::read_to_string("/proc/stat").ok()?;
    let boot: f64 = boot
        .lines()
        .find_map(|l| l.strip_prefix("btime "))?
        .trim()
        .parse()
        .ok()?;
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let since_boot: f64 = stat_fields(&stat)?.get(19)?.parse().ok()?;
    Some(boot + since_boot / ticks_per_second)
}

impl Collector for Process {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        // utime and stime are the 14th and 15th fields; the 2nd, the
        // command, is in parentheses and may hold spaces.
        let cpu = std::fs::read_to_string("/proc/self/stat")
            .ok()
            .and_then(|stat| {
                let fields = stat_fields(&stat)?;
                let ticks = |i: usize| fields.get(i)?.parse::<u64>().ok();
                Some((ticks(11)? + ticks(12)?) as f64 / self.ticks_per_second)
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
