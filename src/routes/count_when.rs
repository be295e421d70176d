//! Which answers a limit counts (`count_when`): a limit that counts only
//! failed logins counts the answers with those statuses, or carrying a
//! header the upstream sets, and gives the rest back.

use http::HeaderMap;
use http::header::HeaderName;

/// The answers a limit counts: any whose status is in one of `statuses`
/// or that carries `header`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CountWhen {
    /// Status ranges, both ends included (`401` is `401..=401`, `4xx` is
    /// `400..=499`).
    pub statuses: Vec<(u16, u16)>,
    /// A response header whose presence counts the answer.
    pub header: Option<HeaderName>,
}

impl CountWhen {
    /// Whether an answer with `status` and `headers` counts.
    pub fn counts(&self, status: u16, headers: &HeaderMap) -> bool {
        self.statuses
            .iter()
            .any(|&(low, high)| (low..=high).contains(&status))
            || self
                .header
                .as_ref()
                .is_some_and(|h| headers.contains_key(h))
    }

    /// As operators read it: `status 401, 403, 500-599 or header
    /// x-login-failed`.
    pub fn describe(&self) -> String {
        let statuses: Vec<String> = self
            .statuses
            .iter()
            .map(|&(low, high)| {
                if low == high {
                    low.to_string()
                } else if low % 100 == 0 && high == low + 99 {
                    format!("{}xx", low / 100)
                } else {
                    format!("{low}-{high}")
                }
            })
            .collect();
        let mut out = String::new();
        if !statuses.is_empty() {
            out.push_str("status ");
            out.push_str(&statuses.join(", "));
        }
        if let Some(header) = &self.header {
            if !out.is_empty() {
                out.push_str(" or ");
            }
            out.push_str("header ");
            out.push_str(header.as_str());
        }
        out
    }

    /// A status or range as a configuration writes it (`401`, `"4xx"`,
    /// `"500-504"`), or `None` when it is none of those or outside 100 to
    /// 599.
    pub fn parse_status(text: &str) -> Option<(u16, u16)> {
        let range = match text.split_once('-') {
            Some((low, high)) => (low.trim().parse().ok()?, high.trim().parse().ok()?),
            None => match text.strip_suffix("xx") {
                Some(class) if class.len() == 1 => {
                    let class: u16 = class.parse().ok()?;
                    (class * 100, class * 100 + 99)
                }
                _ => {
                    let one = text.trim().parse().ok()?;
                    (one, one)
                }
            },
        };
        ((100..=599).contains(&range.0) && (range.0..=599).contains(&range.1)).then_some(range)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_classes_and_ranges_are_read_and_described_as_written() {
        assert_eq!(CountWhen::parse_status("401"), Some((401, 401)));
        assert_eq!(CountWhen::parse_status("4xx"), Some((400, 499)));
        assert_eq!(CountWhen::parse_status("500-504"), Some((500, 504)));
        for bad in ["600", "99", "504-500", "xx", "12xx", "4xy", "", "401-"] {
            assert_eq!(CountWhen::parse_status(bad), None, "{bad}");
        }
        let when = CountWhen {
            statuses: vec![(401, 401), (500, 599), (502, 504)],
            header: Some(HeaderName::from_static("x-login-failed")),
        };
        assert_eq!(
            when.describe(),
            "status 401, 5xx, 502-504 or header x-login-failed"
        );
    }

    #[test]
    fn an_answer_counts_by_its_status_or_the_header() {
        let when = CountWhen {
            statuses: vec![(401, 401), (403, 403)],
            header: Some(HeaderName::from_static("x-login-failed")),
        };
        let none = HeaderMap::new();
        assert!(when.counts(401, &none));
        assert!(when.counts(403, &none));
        assert!(!when.counts(200, &none));
        assert!(!when.counts(404, &none));
        let mut flagged = HeaderMap::new();
        flagged.insert("x-login-failed", http::HeaderValue::from_static("1"));
        assert!(when.counts(200, &flagged));
    }
}
