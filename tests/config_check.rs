//! `floodgate --check`: every shipped config passes, every invalid fixture is
//! refused with its file, line and column.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

fn floodgate() -> Command {
    Command::new(env!("CARGO_BIN_EXE_floodgate"))
}

/// `floodgate --check --config file`, run to the end.
fn check(file: &Path) -> std::process::Output {
    floodgate()
        .arg("--check")
        .arg("--config")
        .arg(file)
        .output()
        .expect("run")
}

fn files_in(dir: &str) -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join(dir);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("read {}: {e}", dir.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        .collect();
    files.sort();
    files
}

#[test]
fn every_shipped_config_passes_check() {
    let files = files_in("config");
    assert!(
        files.len() >= 2,
        "expected quickstart.toml and example.toml"
    );
    for file in files {
        let out = check(&file);
        assert!(
            out.status.success(),
            "{} failed --check:\n{}",
            file.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// Each fixture names what it must produce in `# expect: LINE:COL message`
/// lines at its top.
#[test]
fn every_invalid_fixture_is_refused_naming_line_and_column() {
    let files = files_in("config/invalid");
    assert!(files.len() >= 10, "too few fixtures");
    for file in files {
        let text = std::fs::read_to_string(&file).expect("read fixture");
        let expects: Vec<(&str, &str)> = text
            .lines()
            .filter_map(|l| l.strip_prefix("# expect: "))
            .filter_map(|l| l.split_once(' '))
            .collect();
        assert!(
            !expects.is_empty(),
            "{} has no `# expect:` line",
            file.display()
        );
        let out = check(&file);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{}: {stderr}", file.display());
        for (at, message) in &expects {
            let located = format!("{}:{at}: ", file.display());
            let found = stderr
                .lines()
                .any(|l| l.starts_with(&located) && l[located.len()..].contains(message.trim()));
            assert!(
                found,
                "{} should report `{at}: {message}`; it said:\n{stderr}",
                file.display()
            );
        }
        assert_eq!(
            stderr.lines().count(),
            expects.len(),
            "{} reported other problems too:\n{stderr}",
            file.display()
        );
    }
}

#[test]
fn a_missing_file_is_reported_by_name() {
    let out = floodgate()
        .args(["--check", "--config", "/nonexistent/floodgate.toml"])
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("cannot read config file /nonexistent/floodgate.toml"),
        "{stderr}"
    );
}

/// One run names every mistake of a file, of every kind (unknown keys,
/// values of the wrong type, invalid values), and nothing that only
/// follows from one of them.
#[test]
fn one_check_run_lists_every_mistake_once() {
    let file =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("config/invalid/every_kind_of_mistake.toml");
    let out = check(&file);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let text = std::fs::read_to_string(&file).expect("read fixture");
    let expected = text.lines().filter(|l| l.starts_with("# expect: ")).count();
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), expected, "{stderr}");
    assert!(expected >= 5);
    // In the order of the file.
    let positions: Vec<(usize, usize)> = lines
        .iter()
        .filter_map(|l| {
            let mut fields = l.split(':').skip(1);
            Some((fields.next()?.parse().ok()?, fields.next()?.parse().ok()?))
        })
        .collect();
    let mut sorted = positions.clone();
    sorted.sort_unstable();
    assert_eq!(positions, sorted);
    assert_eq!(positions.len(), expected);
}

// === The reference, held to the model ===

/// The configuration model: every `#[serde(deny_unknown_fields)]` struct
/// of `src/config.rs` and `src/config/`, by name, with the keys it
/// accepts (a field's name, or its `#[serde(rename = "…")]`).
/// `envoy_ratelimit.rs` is left out: it models envoyproxy/ratelimit's
/// YAML, which `--from-envoy-ratelimit` reads, not floodgate's file.
fn model() -> BTreeMap<String, Vec<String>> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = vec![root.join("src/config.rs")];
    let mut dirs = vec![root.join("src/config")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("read src/config") {
            let path = entry.expect("entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs")
                && !path.ends_with("envoy_ratelimit.rs")
            {
                files.push(path);
            }
        }
    }
    let mut models = BTreeMap::new();
    for file in files {
        let text = std::fs::read_to_string(&file).expect("read source");
        models.extend(models_in(&text));
    }
    models
}

/// The `deny_unknown_fields` structs of one source file and their keys.
fn models_in(text: &str) -> Vec<(String, Vec<String>)> {
    let structure = regex::Regex::new(r"^\s*(pub(\([^)]*\))?\s+)?struct\s+(\w+)").expect("regex");
    let field = regex::Regex::new(r"^\s*(pub(\([^)]*\))?\s+)?(\w+)\s*:").expect("regex");
    let rename = regex::Regex::new(r#"rename\s*=\s*"([^"]+)""#).expect("regex");
    let mut models = Vec::new();
    let mut lines = text.lines();
    while let Some(line) = lines.next() {
        if !line.contains("deny_unknown_fields") {
            continue;
        }
        let Some(name) = lines.by_ref().find_map(|l| structure.captures(l)) else {
            break;
        };
        let mut keys = Vec::new();
        let mut renamed = None;
        for line in lines.by_ref() {
            if line.starts_with('}') {
                break;
            }
            let trimmed = line.trim_start();
            if trimmed.starts_with("#[") {
                if let Some(r) = rename.captures(trimmed) {
                    renamed = Some(r[1].to_owned());
                }
            } else if !trimmed.starts_with("//")
                && let Some(f) = field.captures(line)
            {
                keys.push(renamed.take().unwrap_or_else(|| f[3].to_owned()));
            }
        }
        models.push((name[3].to_owned(), keys));
    }
    models
}

/// One table of `docs/reference.md`: the model it documents (its
/// `<!-- model: NAME -->` line) and each row's key and reload column.
struct ReferenceTable {
    model: String,
    rows: Vec<(String, String)>,
}

fn reference() -> Vec<ReferenceTable> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(root.join("docs/reference.md")).expect("reference");
    let mut tables: Vec<ReferenceTable> = Vec::new();
    for line in text.lines() {
        if let Some(model) = line
            .strip_prefix("<!-- model: ")
            .and_then(|l| l.strip_suffix(" -->"))
        {
            tables.push(ReferenceTable {
                model: model.to_owned(),
                rows: Vec::new(),
            });
        } else if line.starts_with("| `")
            && let Some(table) = tables.last_mut()
        {
            let cells: Vec<&str> = line.split('|').map(str::trim).collect();
            let key = cells[1].trim_matches('`').to_owned();
            table.rows.push((key, cells[4].to_owned()));
        }
    }
    tables
}

#[test]
fn the_reference_documents_every_key_the_model_accepts_and_no_other() {
    let model = model();
    assert!(model.len() > 20, "the model's structs: {model:?}");
    let reference = reference();
    let mut problems = Vec::new();
    for (name, keys) in &model {
        let Some(table) = reference.iter().find(|t| &t.model == name) else {
            problems.push(format!("{name} (keys {keys:?}) has no table"));
            continue;
        };
        for key in keys {
            if !table.rows.iter().any(|(k, _)| k == key) {
                problems.push(format!("{name}'s key `{key}` is not documented"));
            }
        }
        for (key, _) in &table.rows {
            if !keys.contains(key) {
                problems.push(format!(
                    "{name}'s table documents `{key}`, which the model lacks"
                ));
            }
        }
    }
    for table in &reference {
        if !model.contains_key(&table.model) {
            problems.push(format!("a table for {}, which is no model", table.model));
        }
    }
    assert!(
        problems.is_empty(),
        "docs/reference.md and the model in src/config differ:\n{}",
        problems.join("\n")
    );
}

/// Where each model's keys go in a file: `{kv}` stands for one key.
fn placement(model: &str) -> &'static str {
    match model {
        "FileModel" => "{kv}\n",
        "ServerModel" => "[server]\n{kv}\n",
        "ListenerTlsModel" => "[server.tls]\n{kv}\n",
        "StoreModel" => "[store]\n{kv}\n",
        "AccessLogModel" => "[access_log]\n{kv}\n",
        "UpstreamModel" => "[upstreams.u]\n{kv}\n",
        "HealthCheckModel" => "[upstreams.u.health_check]\n{kv}\n",
        "RouteModel" => "[[routes]]\n{kv}\n",
        "MatchModel" => "[[routes]]\n[routes.match]\n{kv}\n",
        "RespondModel" => "[[routes]]\n[routes.respond]\n{kv}\n",
        "ClientModel" => "[[routes]]\n[routes.client]\n{kv}\n",
        "LimitModel" => "[[routes]]\n[[routes.limits]]\n{kv}\n",
        "ClaimLimitModel" => "[[routes]]\n[[routes.limits]]\n[routes.limits.limit_from]\n{kv}\n",
        "LeaseModel" => "[[routes]]\n[[routes.limits]]\n[routes.limits.lease]\n{kv}\n",
        "CountWhenModel" => "[[routes]]\n[[routes.limits]]\n[routes.limits.count_when]\n{kv}\n",
        "PenaltyModel" => "[[routes]]\n[[routes.limits]]\n[routes.limits.penalty]\n{kv}\n",
        "OverrideModel" => "[[routes]]\n[[routes.overrides]]\n{kv}\n",
        "DenyModel" => "[[routes]]\n[routes.deny]\n{kv}\n",
        "ConcurrencyModel" => "[[routes]]\n[routes.concurrency]\n{kv}\n",
        "AdaptiveModel" => "[[routes]]\n[routes.concurrency.adaptive]\n{kv}\n",
        "UsageModel" => "[[routes]]\n[routes.usage]\n{kv}\n",
        "FailedModel" => "[[routes]]\n[routes.usage.failed]\n{kv}\n",
        "DescriptorModel" => "[[routes]]\n[routes.descriptor]\n{kv}\n",
        "BudgetModel" => "[budgets.b]\n{kv}\n",
        "PlanModel" => "[plans.p]\n{kv}\n",
        "PlanSelectionModel" => "[plan_selection]\n{kv}\n",
        "KeysModel" => "[keys]\n{kv}\n",
        "ApiKeyModel" => "[[routes]]\n[routes.api_key]\n{kv}\n",
        "KeysFileModel" => "# the keys file\n{kv}\n",
        "ListedKeyModel" => "# the keys file\n[[key]]\n{kv}\n",
        other => panic!("no placement for {other}: add one beside its table"),
    }
}

/// `--check` of a file holding `key = 0` where `model` reads its keys:
/// whether it names the key unknown (any other problem is beside the
/// point: the value is not the key's type, required keys are missing).
fn refused_as_unknown(dir: &Path, model: &str, key: &str) -> bool {
    let file = dir.join(format!("{model}-{key}.toml"));
    let key_text = if key.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
        key.to_owned()
    } else {
        format!("\"{key}\"")
    };
    let text = placement(model).replace("{kv}", &format!("{key_text} = 0"));
    let text = match text.strip_prefix("# the keys file\n") {
        // A model of the keys file (`[keys] file`): the key in that file,
        // read by a configuration that names it.
        Some(keys_file) => {
            let listed = dir.join(format!("{model}-{key}-keys.toml"));
            std::fs::write(&listed, keys_file).expect("write");
            format!(
                "[server]\nlisten = \"127.0.0.1:8080\"\n[keys]\nstate_file = {:?}\nfile = {:?}\n[[routes]]\nname = \"r\"\nrespond = {{ status = 200 }}\n",
                dir.join("state.json").display().to_string(),
                listed.display().to_string()
            )
        }
        None => text,
    };
    std::fs::write(&file, text).expect("write");
    let out = check(&file);
    String::from_utf8_lossy(&out.stderr).contains(&format!("unknown key `{key}`"))
        || String::from_utf8_lossy(&out.stdout).contains(&format!("unknown key `{key}`"))
}

#[test]
fn every_key_the_reference_documents_is_one_the_model_accepts() {
    let dir = std::env::temp_dir().join(format!("floodgate-reference-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let mut refused = Vec::new();
    for table in reference() {
        // The placement reaches the model's table: a made-up key is refused there.
        assert!(
            refused_as_unknown(&dir, &table.model, "not_a_documented_key"),
            "the placement of {} does not reach its table",
            table.model
        );
        for (key, _) in &table.rows {
            if refused_as_unknown(&dir, &table.model, key) {
                refused.push(format!("{}: `{key}`", table.model));
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        refused.is_empty(),
        "docs/reference.md documents keys floodgate --check refuses: {refused:?}"
    );
}

/// The reload column says `restart` exactly for what a reload cannot
/// apply (`Config::differences_needing_restart`: some `[server]` keys,
/// all of `[store]`, `[access_log]` and `[keys]`).
#[test]
fn the_reference_says_which_keys_need_a_restart() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let source = std::fs::read_to_string(root.join("src/config.rs")).expect("config.rs");
    let body = source
        .split("fn differences_needing_restart")
        .nth(1)
        .and_then(|rest| rest.split("\n    }\n").next())
        .expect("differences_needing_restart");
    let pushed = regex::Regex::new(r#"out\.push\("(\w+)"\)"#).expect("regex");
    let restart: Vec<&str> = pushed
        .captures_iter(body)
        .map(|c| c.get(1).expect("name").as_str())
        .collect();
    for table in reference() {
        for (key, reload) in &table.rows {
            let needs_restart = match table.model.as_str() {
                "ServerModel" => restart.contains(&key.as_str()),
                "StoreModel" | "AccessLogModel" | "KeysModel" => true,
                "FileModel" => ["store", "access_log", "keys"].contains(&key.as_str()),
                _ => false,
            };
            assert_eq!(
                reload == "restart",
                needs_restart,
                "docs/reference.md: {}'s `{key}` says reload {reload:?}",
                table.model
            );
        }
    }
}

// === config/example.toml, held to the reference table by table ===

/// The sections of `config/example.toml` (a `[…]` or `[[…]]` header, set
/// or commented, starts one) as (header, the keys shown in it: `key =`,
/// set or commented, at the start of a line or inside an inline table,
/// and `[….key]` headers).
fn example_sections() -> Vec<(String, Vec<String>)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let example = std::fs::read_to_string(root.join("config/example.toml")).expect("example");
    let header = regex::Regex::new(r"^\[\[?([^\]]+)\]\]?").expect("regex");
    let key = regex::Regex::new(r#"(?:^|[{,\s])"?([A-Za-z0-9_.-]+)"?\s*="#).expect("regex");
    let mut sections: Vec<(String, Vec<String>)> = Vec::new();
    for line in example.lines() {
        let line = line.trim_start_matches(['#', ' ']);
        if let Some(h) = header.captures(line) {
            let name = h[1].to_owned();
            // A header's names after the first are keys: `budgets` of
            // `[plans.pro.budgets.tokens]`, `usage` of `[routes.usage]`.
            let named: Vec<String> = name.split('.').skip(1).map(str::to_owned).collect();
            // A sub-table of a route (`[routes.usage]`) belongs to the route.
            if name.starts_with("routes.") {
                if let Some(section) = sections.last_mut() {
                    section.1.extend(named);
                }
            } else {
                sections.push((name, named));
            }
            continue;
        }
        if let Some(section) = sections.last_mut() {
            section
                .1
                .extend(key.captures_iter(line).map(|c| c[1].to_owned()));
        }
    }
    sections
}

/// Which sections of the example a model's keys are shown in.
fn example_section_of(model: &str, section: &str) -> bool {
    let top = section.split('.').next().unwrap_or(section);
    match model {
        "FileModel" => false,
        "ServerModel" | "ListenerTlsModel" => section == "server",
        "StoreModel" => section == "store",
        "AccessLogModel" => section == "access_log",
        "UpstreamModel" | "HealthCheckModel" => top == "upstreams",
        "BudgetModel" => top == "budgets" || section.contains(".budgets."),
        "PlanModel" => top == "plans",
        "PlanSelectionModel" => section == "plan_selection",
        "KeysModel" => section == "keys",
        _ => section == "routes",
    }
}

#[test]
fn the_example_file_shows_every_key_in_its_table() {
    let sections = example_sections();
    let tops: Vec<&str> = sections
        .iter()
        .map(|(name, _)| name.split('.').next().unwrap_or(name))
        .collect();
    let mut missing = Vec::new();
    for table in reference() {
        // The keys file is a file of its own (`[keys] file`), shown in
        // docs/keys.md, not in the configuration's example.
        if matches!(table.model.as_str(), "KeysFileModel" | "ListedKeyModel") {
            continue;
        }
        for (key, _) in &table.rows {
            let shown = if table.model == "FileModel" {
                tops.contains(&key.as_str())
            } else {
                sections
                    .iter()
                    .filter(|(name, _)| example_section_of(&table.model, name))
                    .any(|(_, keys)| keys.contains(key))
            };
            if !shown {
                missing.push(format!("{}: `{key}`", table.model));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "config/example.toml does not show these keys in their tables: {missing:?}"
    );
}

// === What --check prints ===

/// `--check` of `text` (written to a file of its own): its standard output.
fn check_says(name: &str, text: &str) -> String {
    let dir = std::env::temp_dir().join(format!("floodgate-summary-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let file = dir.join("floodgate.toml");
    std::fs::write(&file, text).expect("write");
    let out = check(&file);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A route that verifies keys says where it reads them, and the registry
/// says where its records live: the shared store, followed every
/// `sync_every`, or the memory store's state file.
#[test]
fn the_summary_shows_the_key_registry_and_the_routes_that_verify_keys() {
    let routes = r#"
[[routes]]
name = "chat"
match = { path_prefix = "/v1" }
respond = { status = 200 }
api_key = { from = "bearer" }
client = { from = "key" }
limits = [{ algorithm = "sliding_window", limit = 60, window = "1m" }]

[[routes]]
name = "legacy"
match = { path_prefix = "/legacy" }
respond = { status = 200 }
api_key = { from = "header", name = "X-Api-Key" }
limits = [{ algorithm = "sliding_window", limit = 60, window = "1m", key = { from = "key", name = "org" } }]

[[routes]]
name = "health"
match = { path = "/healthz" }
respond = { status = 200 }
"#;
    let shared = check_says(
        "redis",
        &format!(
            "[server]\nlisten = \"127.0.0.1:0\"\n[store]\nbackend = \"redis\"\nurl = \"redis://127.0.0.1:6379\"\n[keys]\nprefix = \"sk-live-\"\n{routes}"
        ),
    );
    assert!(
        shared.contains("route chat (api key: bearer): 60 per 1m sliding_window per client (key)"),
        "{shared}"
    );
    assert!(
        shared.contains(
            "route legacy (api key: header x-api-key): 60 per 1m sliding_window per key org"
        ),
        "{shared}"
    );
    assert!(shared.contains("route health: not limited"), "{shared}");
    assert!(
        shared.contains(
            "key registry: in the store, prefix sk-live-, synced every 200ms, at most 20 unknown keys a minute per address"
        ),
        "{shared}"
    );
    let own = check_says(
        "memory",
        &format!(
            "[server]\nlisten = \"127.0.0.1:0\"\n[keys]\nstate_file = \"/var/lib/floodgate/keys.json\"\nfailures_per_minute = 0\n{routes}"
        ),
    );
    assert!(
        own.contains(
            "key registry: in /var/lib/floodgate/keys.json, prefix sk-, unknown keys not limited per address"
        ),
        "{own}"
    );
    let none = check_says(
        "none",
        "[server]\nlisten = \"127.0.0.1:0\"\n[[routes]]\nname = \"r\"\nrespond = { status = 200 }\n",
    );
    assert!(!none.contains("key registry"), "{none}");
    assert!(!none.contains("api key"), "{none}");
}
