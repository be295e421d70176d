//! The manual in `docs/`: every page listed in `SUMMARY.md` and every
//! listed page there, the code map naming every module of `lib.rs`, and
//! the README a front door into it.

use std::path::Path;

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
