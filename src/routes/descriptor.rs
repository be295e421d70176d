//! Routes that Envoy's rate limit service protocol reaches: a domain and
//! the descriptor entries it matches, as envoyproxy/ratelimit's
//! configuration names them (`key`, or `key` and `value`, in order). A
//! request's descriptor is on the first such route, in file order, whose
//! domain and entries it has exactly; the values of the entries the route
//! does not fix are whose count it is.

use crate::client::ClientId;

/// One entry a route matches: its key, and its value when the route
/// fixes it.
pub type Entry = (Box<str>, Option<Box<str>>);

/// What one route matches of a descriptor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Descriptor {
    /// `RateLimitRequest.domain`.
    pub domain: Box<str>,
    /// Each entry's key, and its value when the route fixes it.
    pub entries: Vec<Entry>,
    /// The key of the entry whose value names the route's plan (one of
    /// `entries`, not fixed), if plans are chosen by one.
    pub plan: Option<Box<str>>,
}

impl Descriptor {
    /// Whether `entries` (key, value), in `domain`, are this one's.
    pub fn matches<'e>(
        &self,
        domain: &str,
        entries: impl ExactSizeIterator<Item = (&'e str, &'e str)>,
    ) -> bool {
        if *self.domain != *domain || entries.len() != self.entries.len() {
            return false;
        }
        self.entries
            .iter()
            .zip(entries)
            .all(|((key, fixed), (k, v))| **key == *k && fixed.as_deref().is_none_or(|f| f == v))
    }

    /// The plan a descriptor it matches names, by its `plan` entry's value.
    pub fn plan<'e>(
        &self,
        mut entries: impl Iterator<Item = (&'e str, &'e str)>,
    ) -> Option<&'e str> {
        let plan = self.plan.as_deref()?;
        entries
            .find(|(key, _)| *key == plan)
            .map(|(_, value)| value)
    }

    /// Whose count a descriptor it matches is: the values of the entries
    /// not fixed here (nor naming the plan), in order (one value is the id
    /// itself); the whole route when every value is fixed. A value longer than `max_len` is
    /// counted by its SHA-256.
    pub fn client<'e>(
        &self,
        entries: impl Iterator<Item = (&'e str, &'e str)>,
        max_len: usize,
    ) -> ClientId {
        let mut parts: Vec<ClientId> = self
            .entries
            .iter()
            .zip(entries)
            .filter(|((key, fixed), _)| fixed.is_none() && Some(key) != self.plan.as_ref())
            .map(|(_, (_, value))| {
                if value.len() > max_len {
                    ClientId::digest_of(value)
                } else {
                    ClientId::header(value)
                }
            })
            .collect();
        match parts.len() {
            0 => ClientId::Global,
            1 => parts.pop().unwrap_or(ClientId::Global),
            _ => ClientId::Composite(parts.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn descriptor(entries: &[(&str, Option<&str>)]) -> Descriptor {
        Descriptor {
            domain: "edge".into(),
            entries: entries
                .iter()
                .map(|(k, v)| ((*k).into(), v.map(Into::into)))
                .collect(),
            plan: None,
        }
    }

    #[test]
    fn a_descriptor_matches_its_keys_in_order_and_its_fixed_values() {
        let d = descriptor(&[("generic_key", Some("api")), ("user", None)]);
        let sent = [("generic_key", "api"), ("user", "ann")];
        assert!(d.matches("edge", sent.iter().copied()));
        assert!(!d.matches("other", sent.iter().copied()));
        assert!(!d.matches(
            "edge",
            [("generic_key", "web"), ("user", "ann")].into_iter()
        ));
        assert!(!d.matches(
            "edge",
            [("user", "ann"), ("generic_key", "api")].into_iter()
        ));
        assert!(!d.matches("edge", [("generic_key", "api")].into_iter()));
        assert_eq!(d.client(sent.iter().copied(), 256), ClientId::header("ann"));
    }

    #[test]
    fn whose_count_it_is_comes_from_the_values_not_fixed() {
        let all_fixed = descriptor(&[("generic_key", Some("api"))]);
        assert_eq!(
            all_fixed.client([("generic_key", "api")].into_iter(), 256),
            ClientId::Global
        );
        let two = descriptor(&[("org", None), ("user", None)]);
        assert_eq!(
            two.client([("org", "acme"), ("user", "ann")].into_iter(), 256),
            ClientId::Composite(vec![ClientId::header("acme"), ClientId::header("ann")].into())
        );
        let planned = Descriptor {
            plan: Some("tier".into()),
            ..descriptor(&[("user", None), ("tier", None)])
        };
        let sent = [("user", "ann"), ("tier", "pro")];
        assert_eq!(
            planned.client(sent.iter().copied(), 256),
            ClientId::header("ann")
        );
        assert_eq!(planned.plan(sent.iter().copied()), Some("pro"));
        let long = "x".repeat(300);
        assert_eq!(
            two.client([("org", long.as_str()), ("user", "ann")].into_iter(), 256),
            ClientId::Composite(vec![ClientId::digest_of(&long), ClientId::header("ann")].into())
        );
    }
}
