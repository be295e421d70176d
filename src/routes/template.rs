//! Path templates: `/users/{id}/orders`, where `{id}` stands for any one
//! non-empty segment, and a route can count clients by it.

/// One segment of a template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Segment {
    /// Must be this text.
    Literal(String),
    /// Any one non-empty segment, named.
    Param(String),
}

/// A compiled path template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Template {
    /// The segments after the leading `/`.
    pub segments: Vec<Segment>,
    /// The text as written.
    pub text: String,
}

impl Template {
    /// Parses `text`; `Ok(None)` when it has no `{param}`, and an error
    /// naming the fault when a brace is misplaced or a name repeats.
    pub fn parse(text: &str) -> Result<Option<Self>, String> {
        if !text.contains(['{', '}']) {
            return Ok(None);
        }
        let mut segments = Vec::new();
        for part in text.trim_start_matches('/').split('/') {
            match part.strip_prefix('{').and_then(|p| p.strip_suffix('}')) {
                Some(name) => {
                    let valid = !name.is_empty()
                        && name.len() <= 64
                        && name
                            .bytes()
                            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
                    if !valid {
                        return Err(format!(
                            "path parameter {{{name}}} must be named with letters, digits, '_' or '-'"
                        ));
                    }
                    if segments.contains(&Segment::Param(name.to_owned())) {
                        return Err(format!("path parameter {{{name}}} is named twice"));
                    }
                    segments.push(Segment::Param(name.to_owned()));
                }
                None if part.contains(['{', '}']) => {
                    return Err(format!(
                        "segment {part:?}: a parameter must be a whole segment, as in /users/{{id}}/orders"
                    ));
                }
                None => segments.push(Segment::Literal(part.to_owned())),
            }
        }
        Ok(Some(Self {
            segments,
            text: text.to_owned(),
        }))
    }

    /// The position of the segment parameter `name` stands for.
    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.segments
            .iter()
            .position(|s| matches!(s, Segment::Param(p) if p == name))
    }

    /// The literal text before the first parameter (`/users/` for
    /// `/users/{id}/orders`): every path the template matches starts with
    /// it.
    pub fn literal_head(&self) -> String {
        let mut head = String::from("/");
        for segment in &self.segments {
            match segment {
                Segment::Literal(text) => {
                    head.push_str(text);
                    head.push('/');
                }
                Segment::Param(_) => break,
            }
        }
        head
    }

    /// Whether `path` matches: all of it (`prefix` false, a trailing slash
    /// allowed), or its first segments (`prefix` true).
    pub fn matches(&self, path: &str, prefix: bool, ignore_case: bool) -> bool {
        let Some(rest) = path.strip_prefix('/') else {
            return false;
        };
        let rest = match rest.strip_suffix('/') {
            Some(trimmed) if !prefix => trimmed,
            _ => rest,
        };
        let mut parts = rest.split('/');
        for segment in &self.segments {
            let Some(part) = parts.next() else {
                return false;
            };
            let ok = match segment {
                Segment::Param(_) => !part.is_empty(),
                Segment::Literal(text) if ignore_case => text.eq_ignore_ascii_case(part),
                Segment::Literal(text) => text == part,
            };
            if !ok {
                return false;
            }
        }
        prefix || parts.next().is_none()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(text: &str) -> Template {
        match Template::parse(text) {
            Ok(Some(t)) => t,
            other => panic!("{text}: {other:?}"),
        }
    }

    #[test]
    fn parameters_match_one_non_empty_segment() {
        let orders = t("/users/{id}/orders");
        assert!(orders.matches("/users/42/orders", false, false));
        assert!(orders.matches("/users/42/orders/", false, false));
        assert!(!orders.matches("/users//orders", false, false));
        assert!(!orders.matches("/users/42/orders/7", false, false));
        assert!(!orders.matches("/users/42", false, false));
        assert!(!orders.matches("/USERS/42/orders", false, false));
        assert!(orders.matches("/USERS/42/orders", false, true));
        assert!(orders.matches("/users/42/orders/7", true, false));
        assert_eq!(orders.index_of("id"), Some(1));
        assert_eq!(orders.literal_head(), "/users/");
    }

    #[test]
    fn misplaced_braces_are_refused() {
        assert_eq!(Template::parse("/plain"), Ok(None));
        for bad in [
            "/users/x{id}",
            "/users/{}",
            "/a/{id}/b/{id}",
            "/users/{i d}",
        ] {
            assert!(Template::parse(bad).is_err(), "{bad}");
        }
    }
}
