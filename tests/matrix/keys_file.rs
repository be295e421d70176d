//! The keys file: keys listed by SHA-256 in a file kept in git are
//! reconciled into the registry on every instance; the file owns them (the
//! admin API refuses to change them), leaves the API's keys alone, and a
//! changed file reaches every instance within a second of its reload, each
//! change audited as the file's.

use std::path::Path;
use std::time::{Duration, Instant};

use sha2::Digest as _;

use super::registry::{admin, chat, make_key, registry_config_with};
use super::{Bed, Gates};
use crate::support::temp_dir;

/// The keys the file lists, as their customers send them.
const GINA: &str = "sk-file-gina-0123456789abcdef";
const HAL: &str = "sk-file-hal-0123456789abcdef";

fn sha256(key: &str) -> String {
    sha2::Sha256::digest(key.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The file: Gina on `gina_plan`, Hal when `with_hal`, both of acme.
fn keys_file(gina_plan: &str, with_hal: bool) -> String {
    let mut text = format!(
        "# customers' keys, by SHA-256\n[[key]]\nsha256 = \"{}\"\nidentity = \"gina\"\nplan = \"{gina_plan}\"\nattributes = {{ org = \"acme\" }}\nname = \"Gina's CI\"\n",
        sha256(GINA)
    );
    if with_hal {
        text.push_str(&format!(
            "\n[[key]]\nsha256 = \"{}\"\nidentity = \"hal\"\nattributes = {{ org = \"acme\" }}\nexpires = \"2099-01-01T00:00:00Z\"\n",
            sha256(HAL)
        ));
    }
    text
}

/// Replaces the file whole, as a deployment does.
fn replace(path: &Path, text: &str) {
    let aside = path.with_extension("toml.new");
    std::fs::write(&aside, text).expect("write the keys file");
    std::fs::rename(&aside, path).expect("replace the keys file");
}

/// The record of the key `id` on instance `i` (`None`: unknown there).
async fn record(gates: &Gates, i: usize, id: &str) -> Option<serde_json::Value> {
    let answer = admin(gates, i, "GET", &format!("/keys/{id}"), "").await;
    (answer.status == 200).then(|| answer.json())
}

/// The id of `identity`'s only key, as instance 0 lists it.
async fn only_key(gates: &Gates, identity: &str) -> serde_json::Value {
    let listed = admin(gates, 0, "GET", &format!("/identities/{identity}/keys"), "").await;
    assert_eq!(listed.status, 200, "{}", listed.text());
    let keys = listed.json()["keys"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(keys.len(), 1, "{identity}: {keys:?}");
    keys[0].clone()
}

/// Keys listed in the file work on every instance (each reconciled the
/// file at start; the second found the records as the file says and
/// wrote nothing); an API key beside them is untouched by reconciles; the
/// API refuses to change or import a file's key; a changed file (a key
/// removed, a plan changed) is applied on every instance within a second
/// of its reload; every change is audited as the keys file's.
pub async fn the_keys_file_is_reconciled_on_every_instance(bed: &Bed) {
    let path = temp_dir("matrix-keys-file").join("keys.toml");
    std::fs::write(&path, keys_file("pro", true)).expect("write the keys file");
    let toml = registry_config_with(
        bed,
        "matrix-keys-file",
        &format!("file = {:?}\n", path.display().to_string()),
    )
    .toml();
    let gates = bed.instances(&toml).await;
    let (ian, ian_id) = make_key(
        &gates,
        1,
        r#"{"identity": "ian", "attributes": {"org": "zeta"}, "reason": "signed up"}"#,
    )
    .await;
    for i in 0..2 {
        for key in [GINA, HAL, &ian] {
            let answer = chat(&gates, i, &[("authorization", &format!("Bearer {key}"))]).await;
            assert_eq!(answer.status, 200, "instance {i}: {}", answer.text());
        }
    }
    let gina = only_key(&gates, "gina").await;
    let hal = only_key(&gates, "hal").await;
    assert_eq!(
        (gina["source"].as_str(), gina["plan"].as_str()),
        (Some("file"), Some("pro"))
    );
    assert_eq!(hal["expires_ms"], 4_070_908_800_000u64);
    let (gina_id, hal_id) = (
        gina["id"].as_str().unwrap_or(""),
        hal["id"].as_str().unwrap_or(""),
    );
    the_api_refuses_the_files_keys(&gates, gina_id, &path).await;
    let ian_before = record(&gates, 0, &ian_id).await;

    replace(&path, &keys_file("free", false));
    let took = applied_everywhere(&gates, gina_id, hal_id).await;
    assert!(
        took < Duration::from_secs(1),
        "the last instance applied the file {took:?} after the first"
    );
    let hal_refused = chat(&gates, 1, &[("authorization", &format!("Bearer {HAL}"))]).await;
    assert_eq!(hal_refused.status, 401, "{}", hal_refused.text());
    assert_eq!(
        record(&gates, 0, &ian_id).await,
        ian_before,
        "a reconcile never touches the API's keys"
    );
    audited_as_the_files(&gates, &path).await;
}

/// Updating, rotating or revoking a file's key, and importing a key the
/// file lists, are refused (409) naming the file.
async fn the_api_refuses_the_files_keys(gates: &Gates, gina_id: &str, path: &Path) {
    let file = path.display().to_string();
    let refused = [
        admin(
            gates,
            0,
            "PATCH",
            &format!("/keys/{gina_id}"),
            r#"{"plan": "free", "reason": "downgrade"}"#,
        )
        .await,
        admin(
            gates,
            1,
            "POST",
            &format!("/keys/{gina_id}/rotate"),
            r#"{"grace": "1h", "reason": "leaked"}"#,
        )
        .await,
        admin(
            gates,
            0,
            "DELETE",
            &format!("/keys/{gina_id}"),
            r#"{"reason": "left"}"#,
        )
        .await,
        admin(
            gates,
            1,
            "POST",
            "/keys/import",
            &format!(r#"{{"key": "{HAL}", "identity": "hal", "reason": "moved"}}"#),
        )
        .await,
    ];
    for answer in refused {
        assert_eq!(answer.status, 409, "{}", answer.text());
        let text = answer.text();
        assert!(
            text.contains(&file) && text.contains("edit the keys file and reload"),
            "{text}"
        );
    }
    let still = record(gates, 1, gina_id).await.expect("gina's key stays");
    assert_eq!(still["plan"], "pro");
}

/// Waits (10 s at most) until every instance has Gina on free and Hal
/// gone: how long the last took after the first.
async fn applied_everywhere(gates: &Gates, gina_id: &str, hal_id: &str) -> Duration {
    let start = Instant::now();
    let mut applied: Vec<Option<Duration>> = vec![None; gates.count()];
    while applied.iter().any(Option::is_none) {
        for (i, when) in applied.iter_mut().enumerate() {
            if when.is_some() {
                continue;
            }
            let gina = record(gates, i, gina_id).await;
            let hal = record(gates, i, hal_id).await;
            if gina.as_ref().is_some_and(|g| g["plan"] == "free") && hal.is_none() {
                *when = Some(start.elapsed());
            }
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the changed file is not applied everywhere: {applied:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let times: Vec<Duration> = applied.into_iter().flatten().collect();
    let first = times.iter().min().copied().unwrap_or_default();
    let last = times.iter().max().copied().unwrap_or_default();
    last - first
}

/// The audit, read on the other instance, has each of the file's changes
/// once (instances reading the same file converge on one change each),
/// by the operator `keys file` with the file named.
async fn audited_as_the_files(gates: &Gates, path: &Path) {
    let file = path.display().to_string();
    let entries = |identity: &'static str| async move {
        let audit = admin(gates, 1, "GET", &format!("/audit?identity={identity}"), "").await;
        assert_eq!(audit.status, 200, "{}", audit.text());
        audit.json()["entries"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    };
    let shown = |entries: &[serde_json::Value]| -> Vec<(String, String)> {
        entries
            .iter()
            .map(|e| {
                (
                    e["action"].as_str().unwrap_or("").to_owned(),
                    e["operator"].as_str().unwrap_or("").to_owned(),
                )
            })
            .collect()
    };
    let gina = entries("gina").await;
    let hal = entries("hal").await;
    let owner = "keys file".to_owned();
    assert_eq!(
        shown(&gina),
        [
            ("update".to_owned(), owner.clone()),
            ("import".to_owned(), owner.clone())
        ],
        "newest first"
    );
    assert_eq!(
        shown(&hal),
        [
            ("revoke".to_owned(), owner.clone()),
            ("import".to_owned(), owner)
        ]
    );
    for entry in gina.iter().chain(&hal) {
        let reason = entry["reason"].as_str().unwrap_or("");
        assert!(reason.contains(&file), "{reason}");
    }
    assert!(
        gina[0]["after"]
            .as_str()
            .unwrap_or("")
            .contains("\"plan\":\"free\"")
    );
}

/// How many keys the large file lists.
const BULK: usize = 10_000;

/// The key `i` of the large file, as its customer sends it.
fn bulk_key(i: usize) -> String {
    format!("sk-bulk-{i:08}-0123456789abcdef")
}

/// A file of the keys `0..count`, the first `free` of them on plan free,
/// the others on pro.
fn bulk_file(count: usize, free: usize) -> String {
    let mut text = String::with_capacity(count * 160);
    for i in 0..count {
        let plan = if i < free { "free" } else { "pro" };
        text.push_str(&format!(
            "[[key]]\nsha256 = \"{}\"\nidentity = \"bulk-{i}\"\nplan = \"{plan}\"\nattributes = {{ org = \"bulk\" }}\n",
            sha256(&bulk_key(i))
        ));
    }
    text
}

/// `floodgate_keys` on instance `i`: the records it holds.
async fn keys_held(gates: &Gates, i: usize) -> u64 {
    let metrics = admin(gates, i, "GET", "/metrics", "").await.text();
    metrics
        .lines()
        .find_map(|l| l.strip_prefix("floodgate_keys "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// Waits (two minutes at most, for a loaded machine) until every instance
/// holds `count` records, `identity`'s key among them when `listed`: how
/// long it took. Asked of the admin API, so nothing is counted.
async fn until_everywhere(gates: &Gates, count: u64, identity: &str, listed: bool) -> Duration {
    let start = Instant::now();
    let path = format!("/identities/{identity}/keys");
    for i in 0..gates.count() {
        loop {
            let held = keys_held(gates, i).await;
            let keys = admin(gates, i, "GET", &path, "").await.json()["keys"]
                .as_array()
                .map_or(0, Vec::len);
            if held == count && (keys == 1) == listed {
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(120),
                "instance {i} holds {held} keys, not {count}, and lists {keys} for {identity}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    start.elapsed()
}

/// Every instance answers `key` with `status`.
async fn answered_everywhere(gates: &Gates, key: &str, status: u16) {
    let bearer = format!("Bearer {key}");
    for i in 0..gates.count() {
        let answer = chat(gates, i, &[("authorization", &bearer)]).await;
        assert_eq!(answer.status, status, "instance {i}: {}", answer.text());
    }
}

/// Waits (two minutes at most) until the memory store's state file at
/// `path` holds `count` records: it is written once the reconcile is done.
async fn until_written(path: &str, count: usize) {
    let start = Instant::now();
    loop {
        let written: serde_json::Value = std::fs::read(path)
            .ok()
            .and_then(|bytes| serde_json::from_slice(&bytes).ok())
            .unwrap_or_default();
        let records = written["records"]
            .as_object()
            .map_or(0, serde_json::Map::len);
        if records == count {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "the state file holds {records} records, not {count}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A keys file of 10 000 keys is reconciled whole on every instance: each
/// key admitted with its record's plan, and a change of a fifth of them
/// (1 000 moved to free, 1 000 removed) applied everywhere; with the
/// memory store the state file holds every record once the reconcile is
/// done. The times are printed, not asserted; the two-minute patience is
/// what a state file written once a key would miss (10 000 keys took
/// 148 s that way in a release build).
pub async fn a_large_keys_file_is_reconciled_whole(bed: &Bed) {
    let path = temp_dir("matrix-keys-bulk").join("keys.toml");
    std::fs::write(&path, bulk_file(BULK, 0)).expect("write the keys file");
    let config = registry_config_with(
        bed,
        "matrix-keys-bulk",
        &format!("file = {:?}\n", path.display().to_string()),
    );
    let toml = config.toml();
    let state: Option<String> = toml
        .lines()
        .find_map(|l| l.trim().strip_prefix("state_file = "))
        .map(|quoted| serde_json::from_str(quoted).expect("the state file's path"));
    let gates = bed.instances(&toml).await;
    let last = format!("bulk-{}", BULK - 1);
    let started = until_everywhere(&gates, BULK as u64, &last, true).await;
    answered_everywhere(&gates, &bulk_key(BULK - 1), 200).await;
    assert_eq!(only_key(&gates, "bulk-0").await["plan"], "pro");
    if let Some(state) = &state {
        until_written(state, BULK).await;
    }

    replace(&path, &bulk_file(BULK - 1_000, 1_000));
    let changed = until_everywhere(&gates, (BULK - 1_000) as u64, &last, false).await;
    answered_everywhere(&gates, &bulk_key(BULK - 1), 401).await;
    for identity in ["bulk-0", "bulk-999"] {
        assert_eq!(
            only_key(&gates, identity).await["plan"],
            "free",
            "{identity}"
        );
    }
    assert_eq!(only_key(&gates, "bulk-1000").await["plan"], "pro");
    if let Some(state) = &state {
        until_written(state, BULK - 1_000).await;
    }
    println!(
        "{:?}: {BULK} keys reconciled on {} instance(s) within {started:?} of their start; 2 000 changes applied everywhere within {changed:?} of the file's replacement",
        bed.store,
        gates.count()
    );
}
