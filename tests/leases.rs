//! Leases for hot keys: eight floodgate processes share one global budget
//! in a real Redis, each spending slices of it taken ahead. Counted from
//! the upstream's own log of when each request arrived, a window never
//! admits more than its limit, and at most the stated bound less; the store
//! is called about once per slice instead of once per request.

mod support;

use std::time::Duration;

use support::load::{Arrival, Got, Instance, Ledger, instances, now_ms, offer};
use support::redis::{TestRedis, command_stats, decision_calls, reset_command_stats};

/// The windows of these tests: 10 000 per 10 s.
const LIMIT: u64 = 10_000;
const WINDOW_MS: u64 = 10_000;

/// Most of the load tests run at once: each runs eight instances and
/// offers 3 000 requests a second, which two at once leave room for on a
/// small machine.
static AT_ONCE: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(2);

/// Waits, if need be, for a window's first half, and says when that is:
/// the load's first window is then long enough to be spent early. (A
/// window the load reaches only near its end is not spent, and what it
/// admits in its last milliseconds reaches the upstream in the next one:
/// in the upstream's log, not in the store's.)
async fn start_in_a_windows_first_half() -> u64 {
    let into = now_ms() % WINDOW_MS;
    if into >= WINDOW_MS / 2 {
        tokio::time::sleep(Duration::from_millis(WINDOW_MS - into + 20)).await;
    }
    now_ms()
}

/// What one fixed window of the load saw. floodgate decided each request
/// between when the load sent it and when it reached the upstream (or was
/// answered, when refused): `certain` counts the admissions decided in the
/// window for sure, `possible` those that may have been (decided across
/// one of its edges, a busy machine making that span long).
#[derive(Debug, Clone, Copy)]
struct Window {
    start: u64,
    certain: u64,
    possible: u64,
    /// Requests refused in the window for sure: the window ran out, so it
    /// is held to its floor.
    refused: u64,
}

/// The windows wholly inside `[from, to)`, from the upstream's arrivals
/// and the load's refusals.
fn per_window(arrivals: &[Arrival], got: &[Got], from: u64, to: u64) -> Vec<Window> {
    let first = from.div_ceil(WINDOW_MS);
    let last = to / WINDOW_MS;
    (first..last)
        .map(|w| {
            let (start, end) = (w * WINDOW_MS, (w + 1) * WINDOW_MS);
            let inside = |a: &&Arrival| a.sent >= start && a.at < end;
            let touches = |a: &&Arrival| a.at >= start && a.sent < end;
            Window {
                start,
                certain: arrivals.iter().filter(inside).count() as u64,
                possible: arrivals.iter().filter(touches).count() as u64,
                refused: got
                    .iter()
                    .flat_map(|g| &g.refusals)
                    .filter(|&&(sent, answered)| sent >= start && answered < end)
                    .count() as u64,
            }
        })
        .collect()
}

/// The lower bound on what a window admits, as docs/leases.md states it: the
/// limit less what the instances' last slices of the window left unspent
/// (each at most `share` of what remained, an eighth by default, sized to
/// a quarter second of its traffic: far less here).
const WINDOW_FLOOR: u64 = LIMIT * 95 / 100;

/// A load run: the instances, the upstream's ledger, what each instance's
/// share of the load got, and the store calls meanwhile.
struct Run {
    gates: Vec<Instance>,
    ledger: Ledger,
    _redis: TestRedis,
    /// When the instances' first requests were sent (a bucket starts full
    /// at the first).
    first_ms: u64,
    from: u64,
    until: u64,
    got: Vec<Got>,
    calls: u64,
    killed: bool,
}

/// What a run does besides offering load: kill instance `i` by SIGKILL
/// `ms` after the start of the load's first whole window.
#[derive(Clone, Copy)]
struct Kill {
    instance: usize,
    ms: u64,
}

/// Starts `rates.len()` instances on one route limited by `limit`, and
/// offers `rates[i]` requests a second to instance `i` over `windows`
/// whole windows (and the part of one before them).
async fn run(test: &str, limit: &str, rates: &[u64], windows: u64, kill: Option<Kill>) -> Run {
    let redis = TestRedis::start_private().await;
    let ledger = Ledger::start().await;
    let mut first_ms = 0;
    let gates = instances(
        test,
        rates.len(),
        &redis,
        &ledger,
        limit,
        &[],
        &mut first_ms,
    )
    .await;
    let ports: Vec<u16> = gates.iter().map(|g| g.process.port).collect();
    let mut conn = redis.connection().await;
    reset_command_stats(&mut conn).await;
    let from = start_in_a_windows_first_half().await;
    let until = (from / WINDOW_MS + 1 + windows) * WINDOW_MS + 200;
    let load = tokio::spawn({
        let rates = rates.to_vec();
        async move { offer(&ports, &rates, until).await }
    });
    if let Some(kill) = kill {
        let at = (from / WINDOW_MS + 1) * WINDOW_MS + kill.ms;
        tokio::time::sleep(Duration::from_millis(at.saturating_sub(now_ms()))).await;
        gates[kill.instance].process.signal("-KILL");
    }
    let got = load.await.expect("the load");
    let calls = decision_calls(&command_stats(&mut conn).await);
    Run {
        gates,
        ledger,
        _redis: redis,
        first_ms,
        from,
        until,
        got,
        calls,
        killed: kill.is_some(),
    }
}

impl Run {
    fn admitted(&self) -> u64 {
        self.got.iter().map(|g| g.ok).sum()
    }

    /// A metric summed over the instances that still answer.
    async fn sum(&self, name: &str) -> f64 {
        let mut sum = 0.0;
        for g in &self.gates {
            sum += g.metric(name).await;
        }
        sum
    }

    /// Prints what the run did, for the test's output, and checks what
    /// holds in every run: only 200s and 429s, and the upstream saw each
    /// request admitted (and the instances' first requests).
    async fn report(&self) {
        for name in [
            "floodgate_lease_slices_total",
            "floodgate_lease_short_total",
            "floodgate_lease_returns_total",
            "floodgate_lease_admitted_total",
            "floodgate_lease_taken_units_total",
            "floodgate_lease_returned_units_total",
            "floodgate_lease_lost_units_total",
        ] {
            println!("{name}: {}", self.sum(name).await);
        }
        let admitted = self.admitted();
        println!(
            "admitted {admitted}, refused {}, store calls {} ({:.4} a request admitted)",
            self.got.iter().map(|g| g.refused).sum::<u64>(),
            self.calls,
            self.calls as f64 / admitted.max(1) as f64
        );
        assert_eq!(
            self.got.iter().map(|g| g.other).sum::<u64>(),
            0,
            "only 200 and 429: {:?}",
            self.got
        );
        // A killed instance's requests in flight may have reached the
        // upstream, their answers lost: at most one a connection.
        let seen = self.ledger.arrivals().len() as u64 - self.gates.len() as u64;
        let lost = if self.killed { 4 } else { 0 };
        assert!(
            (admitted..=admitted + lost).contains(&seen),
            "the upstream saw {seen} requests besides each instance's first, {admitted} admitted"
        );
    }

    /// The whole windows of the load.
    fn windows(&self) -> Vec<Window> {
        per_window(&self.ledger.arrivals(), &self.got, self.from, self.until)
    }

    /// Requests a second the load reached on each instance (a busy
    /// machine reaches less than it was asked).
    fn rates(&self) -> Vec<f64> {
        let seconds = (self.until - self.from) as f64 / 1000.0;
        self.got
            .iter()
            .map(|g| g.offered() as f64 / seconds)
            .collect()
    }

    /// The store calls leases may take for the traffic the load reached,
    /// slices lasting `interval_ms`. A slice holds an interval of its
    /// instance's traffic: what an instance admitted takes that many
    /// slices, half again for slices that grow from their last size and
    /// rates that move. Each window's end adds its tail: slices of an
    /// eighth of what remains, from eight slices' worth down to one unit
    /// (about ln(slice) / ln(8/7) calls), and two calls an instance that
    /// learns the window is spent.
    fn calls_allowed(&self, interval_ms: u64) -> u64 {
        let mut slices = 0.0;
        let mut largest: f64 = 1.0;
        for (g, rate) in self.got.iter().zip(self.rates()) {
            let slice = (rate * interval_ms as f64 / 1000.0).max(1.0);
            slices += g.ok as f64 / slice;
            largest = largest.max(slice);
        }
        let windows = (self.until - self.from).div_ceil(WINDOW_MS) as f64;
        let tail = largest.ln() / (8.0_f64 / 7.0).ln() + 2.0 * self.gates.len() as f64;
        (1.5 * slices + windows * tail).ceil() as u64
    }

    /// The store was called about once a slice: at most
    /// [`Run::calls_allowed`], and `asked_again` calls besides.
    fn assert_few_calls(&self, interval_ms: u64, asked_again: u64) {
        let allowed = self.calls_allowed(interval_ms) + asked_again;
        let rates: Vec<u64> = self.rates().iter().map(|r| *r as u64).collect();
        println!(
            "store calls {} for rates reached {rates:?} a second: {allowed} allowed",
            self.calls
        );
        assert!(
            self.calls <= allowed,
            "{} store calls for {} admitted at the rates reached {rates:?}: over the {allowed} slices of a {interval_ms} ms interval need",
            self.calls,
            self.admitted()
        );
    }
}

/// Every whole window admitted at most the limit, and each that ran out
/// (refused a request) at least the floor. (A window the load did not run
/// out, on a machine too busy to offer the limit, admitted all it was
/// offered: it refused nothing.)
fn assert_windows(windows: &[Window], floor: u64) {
    println!("windows: {windows:?}");
    for w in windows {
        let (start, n) = (w.start, w.certain);
        assert!(n <= LIMIT, "window at {start} admitted {n}, over {LIMIT}");
        if w.refused > 0 {
            let n = w.possible;
            assert!(
                n >= floor,
                "window at {start} refused {} while it admitted {n}, under {floor}",
                w.refused
            );
        }
    }
    let ran_out = windows.iter().filter(|w| w.refused > 0).count();
    println!("{ran_out} of {} windows ran out", windows.len());
}

const FIXED: &str = r#"{ algorithm = "fixed_window", limit = 10000, window = "10s", key = { from = "global" }, lease = {} }"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_instances_share_one_global_fixed_window_exactly_with_few_store_calls() {
    let _slot = AT_ONCE.acquire().await.expect("a slot");
    // About 3× the limit, over five whole windows.
    let run = run("lease-fixed", FIXED, &[375; 8], 5, None).await;
    run.report().await;
    let windows = run.windows();
    assert!(windows.len() >= 5, "five whole windows: {windows:?}");
    assert_windows(&windows, WINDOW_FLOOR);
    run.assert_few_calls(250, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_instances_share_one_global_token_bucket_exactly_with_few_store_calls() {
    let _slot = AT_ONCE.acquire().await.expect("a slot");
    // 10 000 tokens a 10 s (1 a ms), holding 10 000; about 3× offered.
    // A bucket emptied by its traffic hands out slices as fast as it
    // refills, and instances waiting for one ask again now and then: a
    // longer interval than the default (larger slices) keeps the calls
    // near one a slice (see docs/leases.md).
    let run = run(
        "lease-bucket",
        r#"{ algorithm = "token_bucket", limit = 10000, window = "10s", key = { from = "global" }, lease = { interval = "500ms" } }"#,
        &[375; 8],
        5,
        None,
    )
    .await;
    run.report().await;
    // However the tokens were leased, by any moment since the bucket
    // started full, it handed out at most its burst and a token a ms.
    // (An arrival comes after its decision: its time bounds it loosely.)
    let arrivals = run.ledger.arrivals();
    for (k, &Arrival { at: t, .. }) in arrivals.iter().enumerate() {
        let most = LIMIT + t.saturating_sub(run.first_ms);
        assert!(
            (k as u64) < most,
            "{} admitted by {t}, {} ms after the bucket started: more than {most}",
            k + 1,
            t - run.first_ms
        );
    }
    // It admitted nearly all it allowed, or all the load offered where a
    // busy machine offered less.
    let end = arrivals.last().map_or(0, |a| a.at);
    let offered = run.got.iter().map(Got::offered).sum::<u64>() + run.gates.len() as u64;
    let most = (LIMIT + end - run.first_ms).min(offered);
    let admitted = arrivals.len() as u64;
    println!(
        "admitted {admitted} of the {most} the bucket allowed by the last arrival and the load offered"
    );
    assert!(
        admitted >= most * 95 / 100,
        "{admitted} admitted, under 95 % of the {most} the bucket allowed and the load offered"
    );
    // A bucket its traffic keeps empty has a slice only once it has
    // refilled: an instance that spent its slice is told when the next
    // will fit (a short) and asks again then, so besides the slices the
    // store is asked about once more a slice taken, and once an instance
    // at the end (measured: 488 shorts for 488 slices and 502 for 503 in
    // the whole suite; 569 for 410 with this test alone, where the
    // instances reach the whole rate offered). The slice model alone
    // left this test failing by 1-8 % whenever it ran alone.
    let taken = run.sum("floodgate_lease_slices_total").await as u64;
    run.assert_few_calls(500, taken + run.gates.len() as u64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_instance_taking_most_of_the_traffic_starves_none_of_the_others() {
    let _slot = AT_ONCE.acquire().await.expect("a slot");
    // One instance takes 80 % of about 3× the limit, seven share the rest.
    let mut rates = [86; 8];
    rates[0] = 2_400;
    let run = run("lease-uneven", FIXED, &rates, 3, None).await;
    run.report().await;
    let windows = run.windows();
    assert!(windows.len() >= 3, "three whole windows: {windows:?}");
    assert_windows(&windows, WINDOW_FLOOR);
    // Each instance admits about its share of the traffic the load
    // reached in each window that ran out (first come, first served), at
    // least half of it. (A window that did not run out admitted all.)
    let arrivals = run.ledger.arrivals();
    let reached = run.rates();
    let total: f64 = reached.iter().sum();
    for w in windows.iter().filter(|w| w.refused > 0) {
        let (start, end) = (w.start, w.start + WINDOW_MS);
        for (i, rate) in reached.iter().enumerate() {
            let n = arrivals
                .iter()
                .filter(|a| a.at >= start && a.sent < end && usize::from(a.from) == i)
                .count() as u64;
            let share = (LIMIT as f64 * rate / total) as u64;
            println!("window {start}, instance {i}: {n} admitted (share {share})");
            assert!(
                n >= share / 2,
                "instance {i} admitted {n} in the window at {start}, under half its share {share}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_killed_mid_window_never_lets_the_total_past_the_limit() {
    let _slot = AT_ONCE.acquire().await.expect("a slot");
    // Killed 1.5 s into the first whole window, while the budget is being
    // spent: what its slice held is lost for that window, no more.
    let kill = Kill {
        instance: 7,
        ms: 1_500,
    };
    let run = run("lease-killed", FIXED, &[375; 8], 3, Some(kill)).await;
    run.report().await;
    let windows = run.windows();
    assert!(windows.len() >= 3, "three whole windows: {windows:?}");
    // The bound docs/leases.md states: at most the killed instance's slice,
    // itself at most `share` (an eighth) of what remained when it was
    // taken.
    let bound = LIMIT / 8;
    assert_windows(&windows[..1], LIMIT - bound);
    assert_windows(&windows[1..], WINDOW_FLOOR);
}

/// Requests admitted (the upstream's count, the instances' first requests
/// included) once `rates` were offered for `ms`.
async fn flood(run_ports: &[u16], rates: &[u64], ms: u64) -> Vec<Got> {
    offer(run_ports, rates, now_ms() + ms).await
}

/// Waits until the instances gave back a slice, at most 20 s.
async fn until_returned(gates: &[Instance]) {
    for _ in 0..200 {
        let mut returned = 0.0;
        for g in gates {
            returned += g.metric("floodgate_lease_returns_total").await;
        }
        if returned >= 1.0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("a reload gives back the slices each instance holds");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leased_sliding_window_is_exact_and_a_reload_gives_its_slices_back() {
    let _slot = AT_ONCE.acquire().await.expect("a slot");
    let redis = TestRedis::start_private().await;
    let ledger = Ledger::start().await;
    let mut first_ms = 0;
    // A day's window: the test stays in one, whose count is the
    // weighted count (the previous window counted nothing). Slices that
    // go unspent for a minute only: what goes back here is the reload's.
    let gates = instances(
        "lease-sliding",
        2,
        &redis,
        &ledger,
        r#"{ algorithm = "sliding_window", limit = 2000, window = "1d", key = { from = "global" }, lease = { interval = "60s" } }"#,
        &[],
        &mut first_ms,
    )
    .await;
    let ports: Vec<u16> = gates.iter().map(|g| g.process.port).collect();
    // Half the limit first: the instances then hold slices not spent.
    let first = flood(&ports, &[250, 250], 2_000).await;
    let held: f64 = {
        let mut sum = 0.0;
        for g in &gates {
            sum += g.metric("floodgate_lease_admitted_total").await;
        }
        sum
    };
    assert!(held > 0.0, "requests were decided from slices");
    // A reload gives back what the slices hold; the next requests spend
    // it, up to the limit exactly.
    for g in &gates {
        g.process.signal("-HUP");
    }
    until_returned(&gates).await;
    let second = flood(&ports, &[1_500, 1_500], 2_000).await;
    let admitted: u64 = first.iter().chain(&second).map(|g| g.ok).sum::<u64>() + 2;
    println!(
        "admitted {admitted}: {} before the reload, {} after",
        first.iter().map(|g| g.ok).sum::<u64>() + 2,
        second.iter().map(|g| g.ok).sum::<u64>()
    );
    assert_eq!(ledger.arrivals().len() as u64, admitted);
    assert_eq!(admitted, 2_000, "the sliding window's limit, exactly");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gcra_slice_in_hand_decides_while_the_store_is_down() {
    let _slot = AT_ONCE.acquire().await.expect("a slot");
    let redis = TestRedis::start_process().await;
    let ledger = Ledger::start().await;
    let mut first_ms = 0;
    let gates = instances(
        "lease-gcra-outage",
        1,
        &redis,
        &ledger,
        r#"{ algorithm = "gcra", limit = 2000, window = "1d", burst = 2000, key = { from = "global" }, lease = { interval = "60s" } }"#,
        &[r#"on_error = "deny""#],
        &mut first_ms,
    )
    .await;
    let port = gates[0].process.port;
    // A first slice, then a larger one as the traffic shows (as long as
    // it takes a busy machine to send it).
    let mut held = 0.0;
    for _ in 0..50 {
        let warm = flood(&[port], &[400], 300).await;
        assert!(warm[0].ok > 0 && warm[0].other == 0, "{warm:?}");
        held = gates[0].metric("floodgate_lease_held_units").await;
        if held > 0.0 {
            break;
        }
    }
    // (The gauge is as of the last second: it says a slice was held.)
    assert!(held > 0.0, "the instance holds a slice");
    redis.pause();
    // Redis answers nothing now: what the slice holds is still admitted,
    // then `on_error = "deny"` refuses (503).
    let mut admitted_while_down = 0;
    let mut refused_while_down = 0;
    for _ in 0..2_000 {
        match support::load::get_status(port).await {
            Some(200) => admitted_while_down += 1,
            Some(503) => {
                refused_while_down += 1;
                break;
            }
            other => panic!("{other:?} while the store is down"),
        }
    }
    redis.resume();
    println!("while Redis was paused: {admitted_while_down} admitted from the slice, then 503");
    assert!(admitted_while_down > 0, "the slice in hand decides");
    assert_eq!(refused_while_down, 1, "then on_error applies");
    let total = ledger.arrivals().len() as u64;
    assert!(
        total <= 2_001,
        "{total} admitted, past the burst and a day's refill"
    );
}
