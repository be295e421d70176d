//! One way for tests to write floodgate's TOML: `[server]`, an optional
//! `[store]`, and routes, each with only the keys a test cares about.
//!
//! ```text
//! let toml = Config::new()
//!     .redis(&redis.url, &prefix)
//!     .route(Route::new("api").upstream(&up.url()).limit("fixed_window", 3, "60s"))
//!     .toml();
//! ```

/// A whole configuration file.
#[derive(Debug, Clone)]
pub struct Config {
    server: Vec<String>,
    store: Vec<String>,
    upstreams: Vec<(String, Vec<String>)>,
    routes: Vec<Route>,
    access_log: Vec<String>,
    tables: Vec<String>,
}

/// One `[[routes]]` entry.
#[derive(Debug, Clone)]
pub struct Route {
    lines: Vec<String>,
    limits: Vec<String>,
}

impl Config {
    /// `[server]` on a loopback port (in-process tests replace it), the
    /// memory store, no routes.
    pub fn new() -> Self {
        Self {
            server: vec![r#"listen = "127.0.0.1:0""#.to_owned()],
            store: Vec::new(),
            upstreams: Vec::new(),
            routes: Vec::new(),
            access_log: Vec::new(),
            tables: Vec::new(),
        }
    }

    /// Adds tables written out after the routes, such as `[budgets.tokens]`
    /// or `[plans.free]` with their keys.
    pub fn tables(mut self, text: &str) -> Self {
        self.tables.push(text.to_owned());
        self
    }

    /// Turns the access log on, with these `[access_log]` lines.
    pub fn access_log(mut self, lines: &[&str]) -> Self {
        self.access_log = lines.iter().map(|l| (*l).to_owned()).collect();
        self
    }

    /// Listens on `port` (for floodgate started as a process).
    pub fn listen_on(mut self, port: u16) -> Self {
        self.server[0] = format!(r#"listen = "127.0.0.1:{port}""#);
        self
    }

    /// Adds an admin listener.
    pub fn admin(self) -> Self {
        self.server(r#"admin_listen = "127.0.0.1:0""#)
    }

    /// Adds an admin listener on `port`.
    pub fn admin_on(self, port: u16) -> Self {
        self.server(&format!(r#"admin_listen = "127.0.0.1:{port}""#))
    }

    /// Adds a line to `[server]`, such as `escaped_slashes = "decode"`.
    pub fn server(mut self, line: &str) -> Self {
        self.server.push(line.to_owned());
        self
    }

    /// Counts in one Redis at `url`, under `prefix`, with a 1 s timeout.
    ///
    /// The timeouts here are sized for a loaded machine: a decision that a
    /// starved scheduler delays must stay a decision, not turn into an
    /// `on_error` answer. Tests of the outage path set their own.
    pub fn redis(mut self, url: &str, prefix: &str) -> Self {
        self.store = vec![
            r#"backend = "redis""#.to_owned(),
            format!(r#"url = "{url}""#),
            format!(r#"key_prefix = "{prefix}""#),
            r#"timeout = "1s""#.to_owned(),
        ];
        self
    }

    /// Counts in the Redis Cluster found through `urls`, under `prefix`,
    /// with a 1 s timeout.
    pub fn redis_cluster(mut self, urls: &[String], prefix: &str) -> Self {
        self.store = vec![
            r#"backend = "redis_cluster""#.to_owned(),
            format!("urls = [{}]", quoted(urls)),
            format!(r#"key_prefix = "{prefix}""#),
            r#"timeout = "1s""#.to_owned(),
        ];
        self
    }

    /// Counts in the primary of the Sentinel group `master` that the
    /// Sentinels at `urls` watch, under `prefix`, with a 1 s timeout.
    pub fn redis_sentinel(mut self, urls: &[String], master: &str, prefix: &str) -> Self {
        self.store = vec![
            r#"backend = "redis_sentinel""#.to_owned(),
            format!("urls = [{}]", quoted(urls)),
            format!(r#"master_name = "{master}""#),
            format!(r#"key_prefix = "{prefix}""#),
            r#"timeout = "1s""#.to_owned(),
        ];
        self
    }

    /// Adds a line to `[store]`, or replaces the line that sets the same
    /// key, such as `on_error = "deny"`.
    pub fn store(mut self, line: &str) -> Self {
        let key = line.split('=').next().unwrap_or_default().trim();
        self.store
            .retain(|l| l.split('=').next().unwrap_or_default().trim() != key);
        self.store.push(line.to_owned());
        self
    }

    /// Adds `[upstreams.NAME]` with `lines`, such as `url = "https://..."`.
    pub fn upstream(mut self, name: &str, lines: &[&str]) -> Self {
        self.upstreams.push((
            name.to_owned(),
            lines.iter().map(|l| (*l).to_owned()).collect(),
        ));
        self
    }

    /// Adds a route after the others.
    pub fn route(mut self, route: Route) -> Self {
        self.routes.push(route);
        self
    }

    /// The TOML text.
    pub fn toml(&self) -> String {
        let mut out = String::from("[server]\n");
        for line in &self.server {
            out.push_str(line);
            out.push('\n');
        }
        if !self.store.is_empty() {
            out.push_str("\n[store]\n");
            for line in &self.store {
                out.push_str(line);
                out.push('\n');
            }
        }
        for (name, lines) in &self.upstreams {
            out.push_str(&format!("\n[upstreams.{name}]\n"));
            for line in lines {
                out.push_str(line);
                out.push('\n');
            }
        }
        if !self.access_log.is_empty() {
            out.push_str("\n[access_log]\n");
            for line in &self.access_log {
                out.push_str(line);
                out.push('\n');
            }
        }
        for route in &self.routes {
            out.push_str("\n[[routes]]\n");
            for line in &route.lines {
                out.push_str(line);
                out.push('\n');
            }
            if !route.limits.is_empty() {
                out.push_str(&format!("limits = [{}]\n", route.limits.join(", ")));
            }
        }
        for table in &self.tables {
            out.push('\n');
            out.push_str(table);
            out.push('\n');
        }
        out
    }

    /// Writes the TOML to `config.toml` in a fresh directory for `test`.
    pub fn write(&self, test: &str) -> std::path::PathBuf {
        let path = super::temp_dir(test).join("config.toml");
        std::fs::write(&path, self.toml()).expect("write config");
        path
    }
}

/// `"a", "b"`
fn quoted(items: &[String]) -> String {
    items
        .iter()
        .map(|u| format!("\"{u}\""))
        .collect::<Vec<_>>()
        .join(", ")
}

impl Route {
    /// A route named `name` that answers 200 itself until told otherwise.
    pub fn new(name: &str) -> Self {
        Self {
            lines: vec![
                format!(r#"name = "{name}""#),
                r#"respond = { status = 200, body = "ok" }"#.to_owned(),
            ],
            limits: Vec::new(),
        }
    }

    /// Forwards to `url` instead of answering.
    pub fn upstream(mut self, url: &str) -> Self {
        self.lines.retain(|l| !l.starts_with("respond"));
        self.lines.push(format!(r#"upstream = "{url}""#));
        self
    }

    /// Neither forwards nor answers: only decided for front proxies, on
    /// the decision listener.
    pub fn decided_only(mut self) -> Self {
        self.lines
            .retain(|l| !l.starts_with("respond") && !l.starts_with("upstream"));
        self
    }

    /// Answers itself with `respond = { … }`, given the inside of the braces.
    pub fn respond(mut self, inside: &str) -> Self {
        self.lines
            .retain(|l| !l.starts_with("respond") && !l.starts_with("upstream"));
        self.lines.push(format!("respond = {{ {inside} }}"));
        self
    }

    /// Answers the caller's standing on `routes` (`standing = [...]`)
    /// instead.
    pub fn standing(mut self, routes: &[&str]) -> Self {
        self.lines
            .retain(|l| !l.starts_with("respond") && !l.starts_with("upstream"));
        let list: Vec<String> = routes.iter().map(|r| format!("\"{r}\"")).collect();
        self.lines.push(format!("standing = [{}]", list.join(", ")));
        self
    }

    /// `match = { … }`, given the inside of the braces.
    pub fn matching(self, inside: &str) -> Self {
        self.line(&format!("match = {{ {inside} }}"))
    }

    /// `client = { … }`, given the inside of the braces.
    pub fn client(self, inside: &str) -> Self {
        self.line(&format!("client = {{ {inside} }}"))
    }

    /// Adds limits written out, such as
    /// `{ algorithm = "gcra", limit = 5, window = "1s", burst = 2 }`.
    pub fn limits(mut self, written: &str) -> Self {
        self.limits.push(written.to_owned());
        self
    }

    /// Adds a limit.
    pub fn limit(mut self, algorithm: &str, limit: u64, window: &str) -> Self {
        self.limits.push(format!(
            r#"{{ algorithm = "{algorithm}", limit = {limit}, window = "{window}" }}"#
        ));
        self
    }

    /// Adds any other line, such as `shadow = true`.
    pub fn line(mut self, line: &str) -> Self {
        self.lines.push(line.to_owned());
        self
    }
}
