//! Usage settled from the upstream's report, and leases.

use super::{Bed, Store, fields, reporting_upstream};
use crate::support::TestClient;
use crate::support::config::Route;

/// 200 units an hour per key, each request reserving 100 and settled to
/// the units its answer reports in a header (before the answer's head
/// goes out): each answer's remaining is the limit less everything
/// reported so far, through either instance, one report past its
/// reservation included; a request whose reservation no longer fits is
/// refused and charged nothing.
pub async fn reported_units_are_settled_across_instances(bed: &Bed) {
    let upstream = reporting_upstream().await;
    let toml = bed
        .config("matrix-usage")
        .route(
            Route::new("metered")
                .upstream(&upstream)
                .client(r#"from = "header", name = "X-Key""#)
                .limit("sliding_log", 200, "1h")
                .line(r#"usage = { reserve = 100, report = "header", units = { "x-units" = 1 } }"#),
        )
        .toml();
    let gates = bed.instances(&toml).await;
    let http = TestClient::http1();
    let key = [("x-key", "team-a")];
    let mut spent = 0;
    for (i, units) in [12, 5, 150].into_iter().enumerate() {
        let answer = http
            .get(&gates.url(i, &format!("/?units={units}")), &key)
            .await;
        spent += units;
        assert_eq!(answer.status, 200, "request {i}");
        assert_eq!(fields(&answer).1, 200 - spent, "request {i}");
    }
    let refused = http.get(&gates.url(1, "/?units=1"), &key).await;
    assert_eq!(refused.status, 429, "100 reserved no longer fit in 33");
    // Another key is whole; the refusal took nothing from team-a.
    let other = http
        .get(&gates.url(0, "/?units=7"), &[("x-key", "team-b")])
        .await;
    assert_eq!(fields(&other).1, 193);
    let again = http.get(&gates.url(0, "/?units=0"), &key).await;
    assert_eq!(again.status, 429, "{spent} spent: still too little left");
}

/// A global limit of 50 an hour leased by each instance in slices: of 80
/// requests through both instances, exactly 50 are admitted, and the
/// 51st and later are refused on both. On a shared store requests were
/// decided from slices (the memory store decides in process, unleased).
pub async fn a_leased_global_limit_admits_exactly_its_limit(bed: &Bed) {
    let toml = bed
        .config("matrix-leases")
        .admin()
        .route(
            Route::new("api")
                .respond("status = 200")
                .limits(r#"{ algorithm = "fixed_window", limit = 50, window = "1h", key = { from = "global" }, lease = {} }"#),
        )
        .toml();
    let gates = bed.instances(&toml).await;
    let http = TestClient::http1();
    let mut statuses = Vec::new();
    for i in 0..80 {
        statuses.push(http.get(&gates.url(i, "/"), &[]).await.status.as_u16());
    }
    let admitted = statuses.iter().filter(|s| **s == 200).count();
    let refused = statuses.iter().filter(|s| **s == 429).count();
    assert_eq!((admitted, refused), (50, 30), "{statuses:?}");
    // Both instances refuse once the hour is spent, whatever they hold.
    for i in 0..4 {
        assert_eq!(http.get(&gates.url(i, "/"), &[]).await.status, 429);
    }
    let mut from_slices = 0.0;
    for i in 0..2 {
        let scrape = http.get(&gates.admin_url(i, "/metrics"), &[]).await.text();
        from_slices += scrape
            .lines()
            .filter(|l| l.starts_with("floodgate_lease_admitted_total{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>();
    }
    if bed.store != Store::Memory {
        assert!(from_slices > 0.0, "no request was decided from a slice");
    }
}
