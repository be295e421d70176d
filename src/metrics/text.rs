//! The Prometheus text format 0.0.4, for scrapers that ask for it.

/// The Prometheus text format 0.0.4 of an OpenMetrics exposition: a
/// counter's `HELP` and `TYPE` name its samples (`…_total`), and there is
/// no `UNIT` or `EOF` line.
pub(super) fn text_format(openmetrics: &str) -> String {
    let mut out = String::with_capacity(openmetrics.len());
    let mut help: Option<&str> = None;
    for line in openmetrics.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            if let Some(pending) = help.replace(rest) {
                out.push_str("# HELP ");
                out.push_str(pending);
                out.push('\n');
            }
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or((rest, "untyped"));
            let (name, kind) = match kind {
                "counter" => (format!("{name}_total"), "counter"),
                "gauge" | "histogram" | "summary" => (name.to_owned(), kind),
                _ => (name.to_owned(), "untyped"),
            };
            if let Some(text) = help.take() {
                let text = text.split_once(' ').map_or("", |(_, t)| t);
                out.push_str(&format!("# HELP {name} {text}\n"));
            }
            out.push_str(&format!("# TYPE {name} {kind}\n"));
            continue;
        }
        if let Some(pending) = help.take() {
            out.push_str("# HELP ");
            out.push_str(pending);
            out.push('\n');
        }
        if line.starts_with("# UNIT ") || line == "# EOF" {
            continue;
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}
