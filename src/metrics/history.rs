//! The dashboard's history: per route, how many requests ended each way in
//! each 5-second bucket of the last 15 minutes, in a ring of fixed size in
//! the process, so a page opened now draws the last 15 minutes at once.
//!
//! Nothing is counted twice: once a second the owner hands in each route's
//! counters as they stand (the same ones `/metrics` exposes), and when a
//! bucket's end has passed the difference since the last bucket becomes
//! that bucket. The request path does no work for it.
//!
//! Memory is fixed by the route count: [`BUCKETS`] × [`SERIES`] counts of
//! 4 bytes per route (about 4.3 KB), whatever the traffic.

use std::fmt::Write as _;
use std::sync::Mutex;

/// One bucket's length.
pub const BUCKET_MS: u64 = 5_000;
/// Buckets kept: 15 minutes.
pub const BUCKETS: usize = 180;
/// The series, in the order each bucket holds them: the decisions
/// (`allowed`, `denied`, `shadow_denied`), the store's failures answered by
/// `on_error` (`store_error`), requests refused by a concurrency cap
/// (`capacity`), and answers of 500 and above from the upstream
/// (`upstream_5xx`).
pub const SERIES: [&str; 6] = [
    "allowed",
    "denied",
    "shadow_denied",
    "store_error",
    "capacity",
    "upstream_5xx",
];

/// One route's counters as they stand, in [`SERIES`] order.
pub type Counts = [u64; SERIES.len()];

/// The ring of every route.
#[derive(Debug, Default)]
pub struct History {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    /// End of the newest bucket (ms since the epoch); 0 before the first.
    end_ms: u64,
    tracks: Vec<Track>,
}

/// One route's buckets.
#[derive(Debug)]
struct Track {
    route: String,
    /// The counters when the newest bucket closed.
    last: Counts,
    /// The buckets, oldest first once full; `head` is the next to write.
    ring: Box<[[u32; SERIES.len()]; BUCKETS]>,
    head: usize,
    filled: usize,
}

impl Track {
    fn new(route: &str, now: Counts) -> Self {
        Self {
            route: route.to_owned(),
            last: now,
            ring: Box::new([[0; SERIES.len()]; BUCKETS]),
            head: 0,
            filled: 0,
        }
    }

    fn push(&mut self, bucket: [u32; SERIES.len()]) {
        self.ring[self.head] = bucket;
        self.head = (self.head + 1) % BUCKETS;
        self.filled = (self.filled + 1).min(BUCKETS);
    }

    /// The buckets, oldest first.
    fn buckets(&self) -> impl Iterator<Item = &[u32; SERIES.len()]> {
        let start = (self.head + BUCKETS - self.filled) % BUCKETS;
        (0..self.filled).map(move |i| &self.ring[(start + i) % BUCKETS])
    }
}

/// What a counter rose by, as a bucket holds it (a counter that went back,
/// as a concurrency cap's does when a reload replaces it, rose by 0).
fn rise(now: &Counts, before: &Counts) -> [u32; SERIES.len()] {
    std::array::from_fn(|i| u32::try_from(now[i].saturating_sub(before[i])).unwrap_or(u32::MAX))
}

impl History {
    /// Takes the routes' counters at `now_ms`, in the order of the rules in
    /// force: closes the buckets whose end has passed. A route new to the
    /// rules starts with no history; a route no longer in them is dropped.
    pub fn record(&self, now_ms: u64, routes: &[(&str, Counts)]) {
        let mut inner = self
            .inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let end = now_ms - now_ms % BUCKET_MS;
        let Inner { end_ms, tracks } = &mut *inner;
        let closed = if *end_ms == 0 {
            0
        } else {
            end.saturating_sub(*end_ms) / BUCKET_MS
        };
        let mut kept: Vec<Track> = Vec::with_capacity(routes.len());
        for (route, now) in routes {
            let found = tracks
                .iter()
                .position(|t| t.route == *route)
                .map(|i| tracks.swap_remove(i));
            let mut track = match found {
                Some(track) => track,
                None => {
                    kept.push(Track::new(route, *now));
                    continue;
                }
            };
            if closed > 0 {
                // Buckets the sampler missed (a stalled machine) stay empty;
                // what was counted meanwhile goes to the newest.
                for _ in 1..closed.min(BUCKETS as u64) {
                    track.push([0; SERIES.len()]);
                }
                track.push(rise(now, &track.last));
                track.last = *now;
            }
            kept.push(track);
        }
        *tracks = kept;
        if *end_ms == 0 || closed > 0 {
            *end_ms = end;
        }
    }

    /// The history as JSON, with the bucket still open (`current`, from
    /// `end` to `now`) taken from `routes`' counters as they stand now:
    ///
    /// `{"bucket_seconds":5,"buckets":180,"series":[...],"end":ms,"now":ms,
    /// "routes":[{"route":"api","buckets":[[allowed,denied,...],...],
    /// "current":[...]}]}`, buckets oldest first, the newest ending at `end`.
    pub fn json(
        &self,
        now_ms: u64,
        routes: &[(&str, Counts)],
        quote: fn(&mut String, &str),
    ) -> String {
        let inner = self
            .inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut out = format!(
            "{{\"bucket_seconds\":{},\"buckets\":{BUCKETS},\"series\":[",
            BUCKET_MS / 1000
        );
        for (i, name) in SERIES.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            let _ = write!(out, "\"{name}\"");
        }
        let _ = write!(
            out,
            "],\"end\":{},\"now\":{now_ms},\"routes\":[",
            inner.end_ms
        );
        let mut first = true;
        for (route, now) in routes {
            let Some(track) = inner.tracks.iter().find(|t| t.route == *route) else {
                continue;
            };
            if !first {
                out.push(',');
            }
            first = false;
            out.push_str("{\"route\":");
            quote(&mut out, route);
            out.push_str(",\"buckets\":[");
            for (i, bucket) in track.buckets().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                counts(&mut out, bucket);
            }
            out.push_str("],\"current\":");
            counts(&mut out, &rise(now, &track.last));
            out.push('}');
        }
        out.push_str("]}");
        out
    }
}

fn counts(out: &mut String, bucket: &[u32; SERIES.len()]) {
    out.push('[');
    for (i, n) in bucket.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        let _ = write!(out, "{n}");
    }
    out.push(']');
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quote(out: &mut String, s: &str) {
        let _ = write!(out, "\"{s}\"");
    }

    #[test]
    fn buckets_hold_what_each_interval_added_and_the_ring_stays_fixed() {
        let history = History::default();
        let t0 = 1_000_000_000_000;
        history.record(t0 + 100, &[("api", [0; 6])]);
        // Within the first bucket: nothing closes.
        history.record(t0 + 4_000, &[("api", [3, 1, 0, 0, 0, 0])]);
        history.record(t0 + 5_000, &[("api", [7, 2, 0, 1, 0, 0])]);
        let json = history.json(t0 + 6_000, &[("api", [9, 2, 0, 1, 0, 4])], quote);
        assert!(
            json.contains(r#""buckets":[[7,2,0,1,0,0]],"current":[2,0,0,0,0,4]"#),
            "{json}"
        );
        assert!(json.contains(&format!("\"end\":{}", t0 + 5_000)), "{json}");
        // Three buckets pass with nothing sampled: two empty, then the rise.
        history.record(t0 + 20_000, &[("api", [10, 2, 0, 1, 0, 4])]);
        let json = history.json(t0 + 20_000, &[("api", [10, 2, 0, 1, 0, 4])], quote);
        assert!(
            json.contains(r#""buckets":[[7,2,0,1,0,0],[0,0,0,0,0,0],[0,0,0,0,0,0],[3,0,0,0,0,4]]"#),
            "{json}"
        );
        // Far more than the ring holds: it keeps BUCKETS, the newest last.
        for i in 0..400u64 {
            history.record(
                t0 + 25_000 + i * BUCKET_MS,
                &[("api", [11 + i, 2, 0, 1, 0, 4])],
            );
        }
        let inner = history.inner.lock().expect("lock");
        assert_eq!(inner.tracks[0].filled, BUCKETS);
        assert_eq!(inner.tracks[0].buckets().count(), BUCKETS);
        assert!(inner.tracks[0].buckets().all(|b| b[0] == 1));
    }

    #[test]
    fn routes_follow_the_rules_in_force() {
        let history = History::default();
        let t0 = 1_000_000_000_000;
        history.record(t0, &[("a", [0; 6]), ("b", [0; 6])]);
        history.record(t0 + 5_000, &[("a", [1; 6]), ("b", [2; 6])]);
        // A reload removes b and adds c.
        history.record(t0 + 10_000, &[("c", [5; 6]), ("a", [1; 6])]);
        let json = history.json(t0 + 10_000, &[("c", [6; 6]), ("a", [1; 6])], quote);
        assert!(
            json.contains(r#""routes":[{"route":"c","buckets":[],"current":[1,1,1,1,1,1]},{"route":"a","buckets":[[1,1,1,1,1,1],[0,0,0,0,0,0]]"#),
            "{json}"
        );
        assert!(!json.contains("\"b\""), "{json}");
    }
}
