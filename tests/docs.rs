//! The manual in `docs/`: every page listed in `SUMMARY.md` and every
//! listed page there, the code map naming every module of `lib.rs`, the
//! operations pages naming every metric and every alert, the README a
//! front door into it, and every TOML example accepted by
//! `floodgate --check` under the convention `docs/README.md` states.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

/// Every Markdown page of the manual, as paths relative to `docs/`.
fn pages() -> Vec<String> {
    let docs = root().join("docs");
    let mut pages = Vec::new();
    let mut dirs = vec![docs.clone()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("read docs") {
            let path = entry.expect("docs entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "md") {
                let relative = path.strip_prefix(&docs).expect("under docs");
                pages.push(relative.to_string_lossy().replace('\\', "/"));
            }
        }
    }
    pages.sort();
    pages
}

#[test]
fn the_summary_lists_every_page_and_no_missing_one() {
    let summary = read(&root().join("docs/SUMMARY.md"));
    let link = regex::Regex::new(r"\]\(([^)#]+)\)").expect("regex");
    let listed: Vec<String> = link
        .captures_iter(&summary)
        .map(|c| c[1].to_owned())
        .collect();
    let missing: Vec<&String> = listed
        .iter()
        .filter(|p| !root().join("docs").join(p).is_file())
        .collect();
    assert!(
        missing.is_empty(),
        "SUMMARY.md lists pages that do not exist: {missing:?}"
    );
    let unlisted: Vec<String> = pages()
        .into_iter()
        .filter(|p| p != "SUMMARY.md" && !listed.contains(p))
        .collect();
    assert!(
        unlisted.is_empty(),
        "pages of docs/ that SUMMARY.md does not list: {unlisted:?}"
    );
}

#[test]
fn every_link_between_pages_reaches_a_page() {
    let link = regex::Regex::new(r"\]\(([^)#:]+\.md)(#[^)]*)?\)").expect("regex");
    for page in pages() {
        let path = root().join("docs").join(&page);
        let text = read(&path);
        let dir = path.parent().expect("a page's directory");
        for target in link.captures_iter(&text) {
            assert!(
                dir.join(&target[1]).is_file(),
                "docs/{page} links to {}, which does not exist",
                &target[1]
            );
        }
    }
}

#[test]
fn the_architecture_page_names_every_module_of_lib_rs() {
    let lib = read(&root().join("src/lib.rs"));
    let architecture = read(&root().join("docs/architecture.md"));
    let modules: Vec<&str> = lib
        .lines()
        .filter_map(|l| l.trim().strip_prefix("pub mod "))
        .filter_map(|l| l.strip_suffix(';'))
        .collect();
    assert!(modules.len() > 10, "the modules of lib.rs: {modules:?}");
    let unnamed: Vec<&&str> = modules
        .iter()
        .filter(|m| !architecture.contains(&format!("| `{m}` |")))
        .collect();
    assert!(
        unnamed.is_empty(),
        "docs/architecture.md's code map does not name {unnamed:?}"
    );
    for invariant in [
        "One meaning per path",
        "All-or-nothing decisions",
        "One clock",
        "Nothing fails open on a configuration error",
    ] {
        assert!(
            architecture.contains(invariant),
            "docs/architecture.md does not state {invariant:?}"
        );
    }
}

#[test]
fn the_readme_is_a_front_door_into_the_manual() {
    let readme = read(&root().join("README.md"));
    let lines = readme.lines().count();
    assert!(lines <= 300, "README.md has {lines} lines; at most 300");
    for needed in [
        "](docs/SUMMARY.md)",
        "](docs/first-setup.md)",
        "](docs/reference.md)",
        "](docs/architecture.md)",
        "cargo run --release -- --config config/quickstart.toml",
        "./test.sh",
        "cargo build --release --locked",
    ] {
        assert!(readme.contains(needed), "README.md lacks {needed:?}");
    }
    let link = regex::Regex::new(r"\]\((docs/[^)#]+)").expect("regex");
    for target in link.captures_iter(&readme) {
        assert!(
            root().join(&target[1]).is_file(),
            "README.md links to {}, which does not exist",
            &target[1]
        );
    }
}

#[test]
fn the_first_setup_page_shows_its_file_whole() {
    let page = read(&root().join("docs/first-setup.md"));
    let file = read(&root().join("config/first-setup.toml"));
    assert!(
        page.contains(&format!("```toml\n{file}```\n")),
        "docs/first-setup.md must show config/first-setup.toml as it is"
    );
}

#[test]
fn the_alerts_page_says_what_to_do_for_every_alert() {
    let rules = read(&root().join("deploy/prometheus/alerts.yml"));
    let page = read(&root().join("docs/operations/alerts.md"));
    let alerts: Vec<&str> = rules
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- alert: "))
        .collect();
    assert!(alerts.len() > 5, "the alerts: {alerts:?}");
    for alert in alerts {
        let section = page
            .split_once(&format!("## {alert}"))
            .map(|(_, rest)| rest.split("\n## ").next().unwrap_or(rest))
            .unwrap_or_else(|| panic!("docs/operations/alerts.md has no section for {alert}"));
        assert!(
            section.contains("**Do**"),
            "docs/operations/alerts.md does not say what to do when {alert} fires"
        );
    }
}

/// Every `floodgate_…` name in `src/` (a metric family, as registered):
/// the metrics page names it.
#[test]
fn the_metrics_page_names_every_metric_floodgate_registers() {
    let page = read(&root().join("docs/operations/metrics.md"));
    let name = regex::Regex::new(r#""(floodgate_[a-z0-9_]+)""#).expect("regex");
    let mut unnamed = Vec::new();
    let mut dirs = vec![root().join("src")];
    let mut seen = 0;
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("read src") {
            let path = entry.expect("src entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                for metric in name.captures_iter(&read(&path)) {
                    seen += 1;
                    if !page.contains(&metric[1]) {
                        unnamed.push(format!("{} ({})", &metric[1], path.display()));
                    }
                }
            }
        }
    }
    assert!(seen > 20, "metric names found in src/: {seen}");
    assert!(
        unnamed.is_empty(),
        "docs/operations/metrics.md does not name {unnamed:?}"
    );
}

// === Every TOML example, through `floodgate --check` ===

/// A public RSA key as a JWK Set: the stand-in for a block's `jwks_file`.
const JWKS: &str = r#"{"keys":[{"kty":"RSA","alg":"RS256","use":"sig","kid":"docs","n":"1AJvmgEhtz1mZjBXns9yHygdPghsEBjHfY8Bh9jvycKbCGz0fHxTLDyZlpGM4wqCxWe3HBNmubSIGQz1RB9tcSy_VfEPhqqbH89qq6_yO5ma9NFmtu4Ur6y97kIcztBf4fVJE8xbQv3k_I7aIWxg7HwBcVC3vwkJQB2NkTyFI9FgRYbJSta5sgtee-A-Awr1AHOtpKSgmP7_YxVeTWxS8YYBuJMmXY7W1g4_BYuOE-bQT8eLmYJsmL0JCTZIko5l9CK2Ys9Cv9CzwF1dqz0RqoLi6U3H-XKdt_-0o_cA8gZ3W1vCIWTNd3_medevrUDOBP3ImVA7va3eiKmBXAIKxQ","e":"AQAB"}]}"#;

/// The stand-in for a file a block names, by the key that names it; a key
/// without one keeps its path, and only "cannot read" is forgiven it.
fn stand_in(key: &str) -> Option<&'static str> {
    match key {
        "jwks_file" => Some(JWKS),
        "secret_file" => Some("a shared secret of at least thirty-two bytes\n"),
        "admin_token_file" => Some("a-token-of-sixteen-characters\n"),
        "password_file" => Some("secret\n"),
        "id_secret_file" => Some("an id secret of at least sixteen bytes\n"),
        _ => None,
    }
}

/// One ```toml block of a page: where it starts, its marks, its text.
struct Block {
    page: String,
    line: usize,
    marks: Vec<String>,
    text: String,
}

/// Every ```toml block of the manual (indented ones in lists too), with a
/// page's `part` blocks joined into one, in order.
fn toml_blocks() -> Vec<Block> {
    let mut blocks = Vec::new();
    for page in pages() {
        let text = read(&root().join("docs").join(&page));
        let mut parts: Option<Block> = None;
        let mut lines = text.lines().enumerate();
        while let Some((number, line)) = lines.next() {
            let trimmed = line.trim_start();
            let Some(info) = trimmed.strip_prefix("```toml") else {
                continue;
            };
            let indent = line.len() - trimmed.len();
            let marks: Vec<String> = info.split_whitespace().map(str::to_owned).collect();
            let mut body = String::new();
            for (_, line) in lines.by_ref() {
                if line.trim_start().starts_with("```") {
                    break;
                }
                body.push_str(line.get(indent..).unwrap_or(line.trim_start()));
                body.push('\n');
            }
            if marks.iter().any(|m| m == "part") {
                let joined = parts.get_or_insert_with(|| Block {
                    page: page.clone(),
                    line: number + 1,
                    marks: marks.clone(),
                    text: String::new(),
                });
                joined.text.push_str(&body);
            } else {
                blocks.push(Block {
                    page: page.clone(),
                    line: number + 1,
                    marks,
                    text: body,
                });
            }
        }
        blocks.extend(parts);
    }
    blocks
}

/// A block completed into a file, as `docs/README.md` states the rules.
fn completed(block: &Block) -> String {
    let starts = |text: &str, key: &str| {
        text.lines()
            .any(|l| l.starts_with(key) && l[key.len()..].trim_start().starts_with('='))
    };
    let mut text = block.text.clone();
    if block.marks.iter().any(|m| m == "route") {
        let mut head = String::from("[[routes]]\n");
        if !starts(&text, "name") {
            head.push_str("name = \"example\"\n");
        }
        if !["upstream", "respond", "standing", "descriptor"]
            .iter()
            .any(|k| starts(&text, k))
        {
            head.push_str("upstream = \"http://127.0.0.1:9000\"\n");
        }
        text = head + &text;
    }
    if !text.lines().any(|l| l.trim_end() == "[server]") {
        text = format!("[server]\nlisten = \"127.0.0.1:0\"\n{text}");
    }
    let defined: Vec<String> = text
        .lines()
        .filter_map(|l| l.strip_prefix("name = \""))
        .filter_map(|l| l.split('"').next())
        .map(str::to_owned)
        .collect();
    let standing = regex::Regex::new(r"standing\s*=\s*\[([^\]]*)\]").expect("regex");
    let named: Vec<String> = standing
        .captures_iter(&text)
        .flat_map(|c| {
            c[1].split(',')
                .map(|n| n.trim().trim_matches('"').to_owned())
                .collect::<Vec<_>>()
        })
        .filter(|n| !n.is_empty() && !defined.contains(n))
        .collect();
    for name in named {
        text.push_str(&format!(
            "\n[[routes]]\nname = \"{name}\"\nmatch = {{ path_prefix = \"/{name}\" }}\nrespond = {{ status = 200 }}\n"
        ));
    }
    if !text.lines().any(|l| l.trim_end() == "[[routes]]") {
        let tables = |prefix: &str| -> Vec<String> {
            text.lines()
                .filter_map(|l| l.strip_prefix(prefix))
                .filter_map(|l| l.split(']').next())
                .filter(|name| !name.contains('.'))
                .map(|name| format!("\"{name}\""))
                .collect()
        };
        let (budgets, plans) = (tables("[budgets."), tables("[plans."));
        text.push_str("\n[[routes]]\nname = \"example\"\nrespond = { status = 200 }\n");
        if !budgets.is_empty() {
            text.push_str(&format!("budgets = [{}]\n", budgets.join(", ")));
        }
        if !plans.is_empty() {
            text.push_str(&format!("plans = [{}]\n", plans.join(", ")));
        }
    }
    text
}

/// The block's text with each file that has a stand-in written to `dir`
/// and named there instead.
fn with_stand_ins(text: &str, dir: &Path) -> String {
    let file = regex::Regex::new(r#"\b(\w+_file)\s*=\s*"[^"]*""#).expect("regex");
    file.replace_all(text, |c: &regex::Captures| match stand_in(&c[1]) {
        Some(contents) => {
            let path = dir.join(format!("{}.txt", &c[1]));
            std::fs::write(&path, contents).expect("write a stand-in");
            format!("{} = \"{}\"", &c[1], path.display())
        }
        None => c[0].to_owned(),
    })
    .into_owned()
}

fn scratch_dir() -> PathBuf {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "floodgate-docs-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

#[test]
fn every_toml_example_passes_check() {
    let blocks = toml_blocks();
    assert!(
        blocks.len() > 15,
        "the manual's TOML blocks: {}",
        blocks.len()
    );
    let mut failures = Vec::new();
    for block in &blocks {
        let dir = scratch_dir();
        let file = dir.join("floodgate.toml");
        std::fs::write(&file, with_stand_ins(&completed(block), &dir)).expect("write");
        let out = Command::new(env!("CARGO_BIN_EXE_floodgate"))
            .arg("--check")
            .arg("--config")
            .arg(&file)
            .output()
            .expect("run --check");
        let said = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let problems: Vec<&str> = said.lines().filter(|l| l.contains(".toml:")).collect();
        let unforgiven: Vec<&&str> = problems
            .iter()
            .filter(|p| !(p.contains("cannot read") && p.contains("No such file")))
            .collect();
        let passed = out.status.success() || (!problems.is_empty() && unforgiven.is_empty());
        let invalid = block.marks.iter().any(|m| m == "invalid");
        if passed == invalid {
            failures.push(format!(
                "docs/{}:{} ({}):\n{said}",
                block.page,
                block.line,
                if invalid {
                    "marked invalid, yet accepted"
                } else {
                    "refused"
                }
            ));
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
    assert!(
        failures.is_empty(),
        "TOML examples of the manual that --check does not take as docs/README.md says:\n{}",
        failures.join("\n")
    );
}
