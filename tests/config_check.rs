//! `floodgate --check`: every shipped config passes, every invalid fixture is
//! refused with its file, line and column.

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

/// Every key the manual's tables document (the first column of each
/// `| key | default | meaning |` table in `docs/`) appears in
/// `config/example.toml`, set or in a comment, as `key =` or as a
/// `[….key]` table: the example shows every key, as the manual says.
#[test]
fn the_example_file_shows_every_documented_key() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let manual = docs_text(&root.join("docs"));
    let example = std::fs::read_to_string(root.join("config/example.toml")).expect("example");
    let mut documented = Vec::new();
    let mut in_table = false;
    for line in manual.lines() {
        if line.starts_with("| key | default | meaning |") {
            in_table = true;
            continue;
        }
        if !line.starts_with('|') {
            in_table = false;
        }
        if !in_table || line.starts_with("|---") {
            continue;
        }
        let first = line.split('|').nth(1).unwrap_or("");
        for key in first.split('`').skip(1).step_by(2) {
            if key
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
            {
                documented.push(key.to_owned());
            }
        }
    }
    assert!(
        documented.len() > 80,
        "the manual's key tables: {documented:?}"
    );
    let shown = |key: &str| {
        example.lines().any(|line| {
            let line = line.trim_start_matches(['#', ' ']);
            line.ends_with(&format!(".{key}]"))
                || line.match_indices(key).any(|(at, _)| {
                    let before = line[..at].chars().next_back();
                    let after = line[at + key.len()..].trim_start();
                    matches!(before, None | Some(' ' | '{' | ',')) && after.starts_with('=')
                })
        })
    };
    let missing: Vec<&String> = documented.iter().filter(|k| !shown(k)).collect();
    assert!(
        missing.is_empty(),
        "config/example.toml does not show {missing:?}"
    );
}

/// Every Markdown page under `dir`, in path order, as one text.
fn docs_text(dir: &Path) -> String {
    let mut pages = Vec::new();
    let mut dirs = vec![dir.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("read docs") {
            let path = entry.expect("docs entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "md") {
                pages.push(path);
            }
        }
    }
    pages.sort();
    pages
        .iter()
        .map(|p| std::fs::read_to_string(p).expect("read page"))
        .collect::<Vec<_>>()
        .join("\n")
}
