//! The import rules of floodgate's layering, checked on every run.
//!
//! Each rule names the modules it holds, what they never import, and why.
//! The test reads every `src/**/*.rs`, finds each path that names another
//! part of floodgate (`crate::…`, `super::…`, `use` groups included) or an
//! HTTP crate, and fails naming the file, the line and the rule for every
//! import a rule forbids. A file's unit tests (its trailing
//! `#[cfg(test)] mod tests`) are not read: they may assemble what they test
//! from anywhere.
//!
//! The rules are those of the architecture notes' table ("never
//! imports"). Change one here, with its reason, only when the design
//! changes.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// Every module of floodgate at the top of `src/`.
const TOP: [&str; 23] = [
    "access_log",
    "admin",
    "client",
    "clock",
    "concurrency",
    "config",
    "envoy",
    "gate",
    "head",
    "in_flight",
    "jwt",
    "keys",
    "limit",
    "metrics",
    "proxy",
    "refusal",
    "reload",
    "response",
    "routes",
    "server",
    "tls",
    "top",
    "usage",
];

/// The HTTP crates: names that only the request's path speaks.
const HTTP: [&str; 5] = ["http", "hyper", "hyper_util", "http_body_util", "h2"];

/// One contract: modules under `from` never import a path under one of
/// `never`, unless it is under one of `except`.
struct Rule {
    name: &'static str,
    from: &'static [&'static str],
    never: &'static [&'static str],
    except: &'static [&'static str],
    why: &'static str,
}

/// The settings modules: plain data that other modules compile into.
const SETTINGS: [&str; 6] = [
    "keys::settings",
    "limit::settings",
    "proxy::settings",
    "concurrency::settings",
    "access_log::settings",
    "usage::settings",
];

/// The limit module's stores and the limiter around them (`limit`'s root
/// re-exports the limiter, so its names are listed too).
const STORES: [&str; 9] = [
    "limit::memory",
    "limit::redis",
    "limit::limiter",
    "limit::shards",
    "limit::breaker",
    "limit::deny_cache",
    "limit::Limiter",
    "limit::Answer",
    "limit::StoreError",
];

const RULES: &[Rule] = &[
    Rule {
        name: "server accepts connections; it does not know the limiter or the store",
        from: &["server"],
        never: &["limit"],
        except: &[],
        why: "building and asking the limiter is gate's work; server hands requests to gate",
    },
    Rule {
        name: "server does not route",
        from: &["server"],
        never: &["routes"],
        except: &[],
        why: "finding a request's route is one of gate's phases",
    },
    Rule {
        name: "admin and reload read the data path through gate's narrow handle",
        from: &["admin", "reload"],
        never: &[
            "proxy",
            "limit",
            "concurrency",
            "client",
            "jwt",
            "routes",
            "head",
            "server",
        ],
        except: &[],
        why: "the data path's internals change with it; admin and reload see what gate shows",
    },
    Rule {
        name: "config compiles rules and settings; it builds no live state",
        from: &["config"],
        never: &["proxy", "gate", "server", "response", "admin"],
        except: &["proxy::settings"],
        why: "compiled rules are data a reload swaps; live state is built beside them by gate",
    },
    Rule {
        name: "envoy's protocol is data: it imports nothing of floodgate's",
        from: &["envoy"],
        never: &TOP,
        except: &[],
        why: "what Envoy's messages say is read before anything is decided, by the gate, which maps them to limits",
    },
    Rule {
        name: "head imports nothing of floodgate's",
        from: &["head"],
        never: &TOP,
        except: &[],
        why: "whether a head has one meaning is asked before anything else, of nothing else",
    },
    Rule {
        name: "routes are data: no live proxy, no gate, no stores",
        from: &["routes"],
        never: &["proxy", "gate", "server", "tls"],
        except: &["proxy::settings"],
        why: "the rule table is swapped whole on reload and must not carry connections or health",
    },
    Rule {
        name: "routes know limits, not the stores that count them",
        from: &["routes"],
        never: &STORES,
        except: &[],
        why: "a route names its limits; where they are counted is the limiter's question",
    },
    Rule {
        name: "client and jwt identify; they do not route or limit",
        from: &["client", "jwt"],
        never: &["routes", "limit"],
        except: &[],
        why: "a client id is made from the request alone, and routes and limits build on it",
    },
    Rule {
        name: "keys answers whose key it is; it neither routes, forwards nor serves",
        from: &["keys"],
        never: &[
            "routes",
            "proxy",
            "gate",
            "server",
            "config",
            "admin",
            "concurrency",
        ],
        except: &[],
        why: "the registry is live state every reload shares; it reads and writes records through the store's handle, and gate asks it",
    },
    Rule {
        name: "concurrency caps know neither routes nor the proxy",
        from: &["concurrency"],
        never: &["routes", "proxy"],
        except: &[],
        why: "a cap counts what is in flight; gate keys caps by route and holds them while forwarding",
    },
    Rule {
        name: "limit decides from counts alone",
        from: &["limit"],
        never: &["config", "routes", "proxy", "gate", "server"],
        except: &[],
        why: "the limiter is shared by every reload of the rules and knows only limits and clients",
    },
    Rule {
        name: "limit speaks no HTTP",
        from: &["limit"],
        never: &HTTP,
        except: &[],
        why: "algorithms and stores are tested and benched without requests",
    },
    Rule {
        name: "proxy forwards; it neither limits nor routes",
        from: &["proxy"],
        never: &["limit", "routes", "gate", "server", "config"],
        except: &[],
        why: "the proxy is handed an upstream and a request; what is allowed was decided before",
    },
    Rule {
        name: "usage reads what a request reserves and an answer reports; it neither limits, routes nor forwards",
        from: &["usage"],
        never: &["limit", "routes", "proxy", "gate", "server", "config"],
        except: &[],
        why: "gate charges and settles with the limiter; usage only reads requests and answers",
    },
    Rule {
        name: "floodgate's own answers do not depend on the proxy",
        from: &["refusal", "response"],
        never: &["proxy", "gate", "server"],
        except: &[],
        why: "the proxy uses them to answer; they do not reach back into it",
    },
    Rule {
        name: "metrics, the access log and top clients observe; they do not reach into the data path",
        from: &["metrics", "access_log", "top"],
        never: &["routes", "proxy", "gate", "server", "config"],
        except: &[],
        why: "observers are fed by their owners; owners with scrape-time state register their own collectors",
    },
    Rule {
        name: "metrics define families; caps show themselves",
        from: &["metrics"],
        never: &["concurrency"],
        except: &[],
        why: "a module with state to show at scrape time writes its collector beside that state",
    },
    Rule {
        name: "settings modules import nothing else of floodgate's",
        from: &SETTINGS,
        never: &TOP,
        except: &SETTINGS,
        why: "settings are plain data: config fills them in, their module reads them",
    },
];

/// One import found in a file.
#[derive(Debug)]
struct Import {
    line: usize,
    /// The path as `a::b::c`, without `crate::`; for an external crate, its
    /// name first.
    path: String,
}

#[test]
fn every_module_imports_only_what_its_rules_allow() {
    let files = rust_files(&Path::new(ROOT).join("src"));
    assert!(files.len() > 40, "expected floodgate's sources under src/");
    let mut broken = Vec::new();
    for file in &files {
        let module = module_of(file);
        if module.is_empty() || module == "main" {
            continue;
        }
        let text = std::fs::read_to_string(file).unwrap_or_else(|e| panic!("{file:?}: {e}"));
        for import in imports(&text, &module) {
            for rule in RULES {
                if !rule.from.iter().any(|m| under(&module, m)) {
                    continue;
                }
                // A module's own descendants are not imports of another part.
                if under(&import.path, &module) {
                    continue;
                }
                let forbidden = rule.never.iter().any(|n| under(&import.path, n))
                    && !rule.except.iter().any(|e| under(&import.path, e));
                if forbidden {
                    broken.push(format!(
                        "{}:{}: {} imports {} — rule \"{}\": {}",
                        file.strip_prefix(ROOT).unwrap_or(file).display(),
                        import.line,
                        module,
                        import.path,
                        rule.name,
                        rule.why
                    ));
                }
            }
        }
    }
    assert!(
        broken.is_empty(),
        "{} import(s) break the layering:\n{}",
        broken.len(),
        broken.join("\n")
    );
}

#[test]
fn the_import_reader_finds_every_form_of_import() {
    let text = "use crate::routes::Table;\n\
                use crate::{limit::{self, Limiter}, proxy::Peer};\n\
                // use crate::gate::Shared; (a comment)\n\
                use super::pool::Pool;\n\
                fn f() { let _ = crate::metrics::Outcome::Allowed; }\n\
                use http::HeaderMap;\n\
                let s = \"crate::server::run\";\n\
                #[cfg(test)]\nmod tests { use crate::config::parse; }\n";
    let found: BTreeSet<String> = imports(text, "proxy::balance")
        .into_iter()
        .map(|i| i.path)
        .collect();
    let want: BTreeSet<String> = [
        "routes::Table",
        "limit",
        "limit::Limiter",
        "proxy::Peer",
        "proxy::pool::Pool",
        "metrics::Outcome::Allowed",
        "http::HeaderMap",
    ]
    .into_iter()
    .map(String::from)
    .collect();
    assert_eq!(found, want);
}

#[test]
fn a_forbidden_import_is_reported_with_its_rule() {
    let import = imports("use crate::limit::Limiter;\n", "server::connection");
    assert_eq!(import.len(), 1);
    let rule = RULES
        .iter()
        .find(|r| {
            r.from.iter().any(|m| under("server::connection", m))
                && r.never.iter().any(|n| under(&import[0].path, n))
        })
        .map(|r| r.name);
    assert_eq!(
        rule,
        Some("server accepts connections; it does not know the limiter or the store")
    );
}

#[test]
fn the_module_map_in_lib_rs_names_every_module() {
    let lib = std::fs::read_to_string(Path::new(ROOT).join("src/lib.rs")).unwrap_or_default();
    let declared: Vec<&str> = lib
        .lines()
        .filter_map(|l| l.strip_prefix("pub mod "))
        .map(|l| l.trim_end_matches(';'))
        .collect();
    assert!(declared.len() > 15, "lib.rs declares floodgate's modules");
    for module in declared {
        assert!(
            lib.contains(&format!("[`{module}`]")),
            "lib.rs's module map does not describe `{module}`"
        );
        assert!(
            TOP.contains(&module),
            "`{module}` is not in tests/architecture.rs's list of modules: add it, and a rule if it has one"
        );
    }
}

/// The house's limit on a source file: past it, a file is split by
/// question (ARCHITECTURE.md). A check, not a hope: a limit nothing checks
/// erodes one reasonable exception at a time.
const MAX_FILE_LINES: usize = 600;

#[test]
fn no_source_file_is_longer_than_the_house_allows() {
    let sources: Vec<(String, String)> = rust_files(&Path::new(ROOT).join("src"))
        .iter()
        .map(|f| (relative(f), read(f)))
        .collect();
    let long = too_long(&sources);
    assert!(
        long.is_empty(),
        "{} file(s) in src/ are past {MAX_FILE_LINES} lines; split each by question:\n{}",
        long.len(),
        long.join("\n")
    );
}

#[test]
fn a_file_one_line_past_the_limit_is_reported() {
    let at_limit = "fn f() {}\n".repeat(MAX_FILE_LINES);
    let past = format!("{at_limit}// one more\n");
    let sources = vec![
        ("src/at_limit.rs".to_owned(), at_limit),
        ("src/past.rs".to_owned(), past),
    ];
    assert_eq!(
        too_long(&sources),
        vec![format!("src/past.rs: {} lines", MAX_FILE_LINES + 1)]
    );
}

/// The files of `sources` (path, text) past the limit, each with its length.
fn too_long(sources: &[(String, String)]) -> Vec<String> {
    sources
        .iter()
        .filter_map(|(path, text)| {
            let lines = text.lines().count();
            (lines > MAX_FILE_LINES).then(|| format!("{path}: {lines} lines"))
        })
        .collect()
}

#[test]
fn no_modules_import_each_other_in_a_circle() {
    let sources: Vec<(String, String)> = rust_files(&Path::new(ROOT).join("src"))
        .iter()
        .filter(|f| !matches!(module_of(f).as_str(), "" | "main"))
        .map(|f| (module_of(f), read(f)))
        .collect();
    let circles = circles(&sources);
    assert!(
        circles.is_empty(),
        "{} import circle(s) among sibling modules; one side of each must stop importing the other \
         (move what both need below them, or pass it in):\n{}",
        circles.len(),
        circles.join("\n")
    );
}

#[test]
fn a_planted_circle_is_reported_with_the_imports_that_close_it() {
    let sources: Vec<(String, String)> = [
        ("limit", "pub mod leases;\n"),
        (
            "limit::leases",
            "use super::Limit;\nuse crate::metrics::Leases;\n",
        ),
        (
            "metrics",
            "pub fn refused(r: &crate::refusal::Refusal) {}\n",
        ),
        ("refusal", "use crate::response::Body;\n"),
        ("response", "use crate::limit::Decision;\n"),
        ("config::limits", "use super::calendars::Calendar;\n"),
        ("config::calendars", "use super::limits::LimitModel;\n"),
        ("config::plans", "use super::limits::LimitModel;\n"),
        ("config", "use crate::limit::Limit;\n"),
        ("gate", "use crate::limit::Limiter;\n"),
    ]
    .into_iter()
    .map(|(m, t)| (m.to_owned(), t.to_owned()))
    .collect();
    let found = circles(&sources);
    assert_eq!(found.len(), 2, "{found:#?}");
    assert!(
        found[0].starts_with("config::calendars → config::limits → config::calendars"),
        "{}",
        found[0]
    );
    assert!(
        found[1].starts_with("limit → metrics → refusal → response → limit"),
        "{}",
        found[1]
    );
    assert!(
        found[1].contains("limit::leases:2 imports metrics::Leases"),
        "{}",
        found[1]
    );
    // Without the one import that closes it, the circle is gone.
    let broken: Vec<(String, String)> = sources
        .into_iter()
        .filter(|(m, _)| m != "response" && m != "config::limits")
        .collect();
    assert_eq!(circles(&broken), Vec::<String>::new());
}

/// Every circle of imports among sibling modules (children of one parent,
/// or the top-level modules), each as `a → b → … → a` followed by one import
/// that makes each step. An import from a module into its own parent or
/// child is no step: a parent declares and re-exports its children.
fn circles(sources: &[(String, String)]) -> Vec<String> {
    use std::collections::BTreeMap;
    let modules: BTreeSet<&str> = sources.iter().map(|(m, _)| m.as_str()).collect();
    // (from, to) between siblings → the first import that makes the step.
    let mut steps: BTreeMap<(String, String), String> = BTreeMap::new();
    for (module, text) in sources {
        for import in imports(text, module) {
            let Some(target) = owning_module(&import.path, &modules) else {
                continue;
            };
            if under(target, module) || under(module, target) {
                continue;
            }
            let (from, to) = siblings_below_common_parent(module, target);
            steps
                .entry((from, to))
                .or_insert_with(|| format!("{module}:{} imports {}", import.line, import.path));
        }
    }
    let mut next: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (from, to) in steps.keys() {
        next.entry(from.as_str()).or_default().push(to.as_str());
    }
    let mut found = Vec::new();
    let mut seen: BTreeSet<BTreeSet<&str>> = BTreeSet::new();
    for &start in next.keys() {
        // The shortest way back to `start`, found breadth first.
        let mut came_from: BTreeMap<&str, &str> = BTreeMap::new();
        let mut queue = std::collections::VecDeque::from([start]);
        let mut closed = None;
        while let Some(at) = queue.pop_front() {
            for &to in next.get(at).map(Vec::as_slice).unwrap_or_default() {
                if to == start {
                    closed = Some(at);
                    break;
                }
                if !came_from.contains_key(to) {
                    came_from.insert(to, at);
                    queue.push_back(to);
                }
            }
            if closed.is_some() {
                break;
            }
        }
        let Some(last) = closed else {
            continue;
        };
        let mut path = vec![last];
        while let Some(&before) = came_from.get(path[path.len() - 1]) {
            path.push(before);
        }
        path.reverse();
        if path[0] != start {
            path.insert(0, start);
        }
        if !seen.insert(path.iter().copied().collect()) {
            continue;
        }
        let mut circle: Vec<&str> = path.clone();
        circle.push(start);
        let evidence: Vec<&str> = circle
            .windows(2)
            .map(|w| steps[&(w[0].to_owned(), w[1].to_owned())].as_str())
            .collect();
        found.push(format!(
            "{}\n    {}",
            circle.join(" → "),
            evidence.join("\n    ")
        ));
    }
    found.sort();
    found
}

/// The deepest module of `modules` that `path` names or is inside.
fn owning_module<'m>(path: &str, modules: &BTreeSet<&'m str>) -> Option<&'m str> {
    modules
        .iter()
        .filter(|m| under(path, m))
        .max_by_key(|m| m.len())
        .copied()
}

/// For `a::b::c` and `a::d::e`, the children of their common parent that
/// hold each: `a::b` and `a::d`.
fn siblings_below_common_parent(a: &str, b: &str) -> (String, String) {
    let a: Vec<&str> = a.split("::").collect();
    let b: Vec<&str> = b.split("::").collect();
    let common = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
    (a[..=common].join("::"), b[..=common].join("::"))
}

fn relative(file: &Path) -> String {
    file.strip_prefix(ROOT)
        .unwrap_or(file)
        .display()
        .to_string()
}

fn read(file: &Path) -> String {
    std::fs::read_to_string(file).unwrap_or_else(|e| panic!("{file:?}: {e}"))
}

// === reading the sources ===

fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }
    out.sort();
    out
}

/// `src/proxy/balance.rs` → `proxy::balance`; `src/limit/mod.rs` and
/// `src/limit.rs` → `limit`; `src/lib.rs` → "".
fn module_of(file: &Path) -> String {
    let relative = file
        .strip_prefix(Path::new(ROOT).join("src"))
        .unwrap_or(file);
    let mut parts: Vec<String> = relative
        .iter()
        .map(|p| p.to_string_lossy().trim_end_matches(".rs").to_owned())
        .collect();
    if parts.last().is_some_and(|p| p == "mod" || p == "lib") {
        parts.pop();
    }
    parts.join("::")
}

/// Whether `path` is `module` or inside it (`proxy::pool::Pool` is under
/// `proxy` and `proxy::pool`, not under `pro`).
fn under(path: &str, module: &str) -> bool {
    path == module
        || path
            .strip_prefix(module)
            .is_some_and(|rest| rest.starts_with("::"))
}

/// The imports in `text`, the source of `module`: every `crate::` and
/// `super::` path (groups expanded) and every path of an HTTP crate, outside
/// comments, strings and the trailing unit tests.
fn imports(text: &str, module: &str) -> Vec<Import> {
    let code = code_only(text);
    let bytes = code.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let at_word = i == 0 || !is_ident(bytes[i - 1]) && bytes[i - 1] != b':';
        if !at_word || !is_ident(bytes[i]) {
            i += 1;
            continue;
        }
        let start = i;
        while i < bytes.len() && is_ident(bytes[i]) {
            i += 1;
        }
        let word = &code[start..i];
        if !code[i..].starts_with("::") {
            continue;
        }
        let base = match word {
            "crate" => Some(String::new()),
            "super" => {
                let mut parent: Vec<&str> = module.split("::").collect();
                parent.pop();
                let mut j = i;
                // super::super::…
                while code[j..].starts_with("::super") {
                    parent.pop();
                    j += "::super".len();
                }
                i = j;
                Some(parent.join("::"))
            }
            w if HTTP.contains(&w) && preceded_by_use_or_path(&code, start) => Some(w.to_owned()),
            _ => None,
        };
        let Some(base) = base else {
            continue;
        };
        let line = code[..start].matches('\n').count() + 1;
        let (paths, end) = path_tree(&code, i + 2);
        for p in paths {
            let path = join(&base, &p);
            if !path.is_empty() {
                out.push(Import { line, path });
            }
        }
        i = end;
    }
    out
}

/// An HTTP crate's name counts where it starts a path in code, not as a
/// field or variable (`self.http`, `let http = …` are not followed by `::`).
fn preceded_by_use_or_path(code: &str, start: usize) -> bool {
    let before = code[..start].trim_end();
    !before.ends_with('.')
}

fn join(base: &str, path: &str) -> String {
    let path = path.trim_end_matches("::self");
    match (base.is_empty(), path.is_empty()) {
        (true, _) => path.to_owned(),
        (false, true) => base.to_owned(),
        (false, false) => format!("{base}::{path}"),
    }
}

/// The paths written at `start` (after a `::`): `a::b::C`, or a group
/// `{a::{self, B}, c}` expanded; and where they end.
fn path_tree(code: &str, start: usize) -> (Vec<String>, usize) {
    let bytes = code.as_bytes();
    let mut i = start;
    let mut prefix = String::new();
    loop {
        while i < bytes.len() && bytes[i].is_ascii_whitespace() {
            i += 1;
        }
        if i < bytes.len() && bytes[i] == b'{' {
            let mut out = Vec::new();
            i += 1;
            loop {
                while i < bytes.len() && (bytes[i].is_ascii_whitespace() || bytes[i] == b',') {
                    i += 1;
                }
                if i >= bytes.len() {
                    return (out, i);
                }
                if bytes[i] == b'}' {
                    i += 1;
                    break;
                }
                let (inner, end) = path_tree(code, i);
                for p in inner {
                    out.push(join(prefix.trim_end_matches("::"), &p));
                }
                if end == i {
                    i += 1;
                } else {
                    i = end;
                }
            }
            return (out, i);
        }
        let s = i;
        while i < bytes.len() && (is_ident(bytes[i]) || bytes[i] == b'*') {
            i += 1;
        }
        if s == i {
            return (vec![prefix.trim_end_matches("::").to_owned()], i);
        }
        prefix.push_str(&code[s..i]);
        if code[i..].starts_with("::") {
            prefix.push_str("::");
            i += 2;
            continue;
        }
        // `as name` renames; the path is what counts.
        return (vec![prefix], i);
    }
}

fn is_ident(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

/// `text` with comments and string literals blanked (lines kept), and
/// without a trailing `#[cfg(test)] mod …` block.
fn code_only(text: &str) -> String {
    let cut = text
        .find("#[cfg(test)]\nmod ")
        .or_else(|| text.find("#[cfg(test)]\npub mod "))
        .unwrap_or(text.len());
    let text = &text[..cut];
    let bytes = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < bytes.len() {
        if text[i..].starts_with("//") {
            while i < bytes.len() && bytes[i] != b'\n' {
                i += 1;
            }
        } else if text[i..].starts_with("/*") {
            let end = text[i + 2..]
                .find("*/")
                .map_or(bytes.len(), |e| i + 2 + e + 2);
            out.extend(text[i..end].chars().filter(|&c| c == '\n'));
            i = end;
        } else if bytes[i] == b'"' && !text[..i].ends_with('\'') {
            // A string literal (raw strings in floodgate hold no quotes).
            i += 1;
            while i < bytes.len() && bytes[i] != b'"' {
                if bytes[i] == b'\\' {
                    i += 1;
                }
                if bytes.get(i) == Some(&b'\n') {
                    out.push('\n');
                }
                i += 1;
            }
            i += 1;
            out.push_str("\"\"");
        } else {
            let c = text[i..].chars().next().unwrap_or(' ');
            out.push(c);
            i += c.len_utf8();
        }
    }
    out
}
