//! The request head as it goes upstream, in the form each protocol wants,
//! and the copy kept of it while its request is in flight so that it may
//! be sent again.

use std::cell::Cell;

use http::header::{HeaderName, HeaderValue};
use http::uri::PathAndQuery;
use http::{HeaderMap, Method, Request, Uri};

use super::request_body::RequestBody;
use super::settings::Endpoint;

/// A request head as it goes upstream: the target in origin form; the
/// headers already rewritten, `Host` included.
#[derive(Debug)]
pub struct Head {
    /// The method.
    pub method: Method,
    /// Path and query.
    pub target: PathAndQuery,
    /// The header fields.
    pub headers: HeaderMap,
}

impl Head {
    /// The request to send over `wire`: origin form for HTTP/1.1; for
    /// HTTP/2 the scheme and authority in the target, and no `Host`.
    pub(super) fn request(
        self,
        wire: Wire,
        upstream: &Endpoint,
        body: RequestBody,
    ) -> Request<RequestBody> {
        let Head {
            method,
            target,
            mut headers,
        } = self;
        let uri = match wire {
            Wire::Http1 => Uri::from(target),
            Wire::Http2 => {
                // `:authority` carries what `Host` says: the upstream's own
                // address, or the client's host with `preserve_host`.
                let authority = headers
                    .remove(http::header::HOST)
                    .and_then(|h| http::uri::Authority::try_from(h.as_bytes()).ok())
                    .unwrap_or_else(|| upstream.authority.clone());
                Uri::builder()
                    .scheme(upstream.scheme.clone())
                    .authority(authority)
                    .path_and_query(target)
                    .build()
                    .unwrap_or_default()
            }
        };
        let mut request = Request::new(body);
        *request.method_mut() = method;
        *request.uri_mut() = uri;
        *request.headers_mut() = headers;
        request
    }

    /// The head of `request`, to send it again.
    pub(super) fn of(request: Request<RequestBody>) -> (Self, RequestBody) {
        let (parts, body) = request.into_parts();
        let target = parts
            .uri
            .into_parts()
            .path_and_query
            .unwrap_or_else(|| PathAndQuery::from_static("/"));
        let head = Head {
            method: parts.method,
            target,
            headers: parts.headers,
        };
        (head, body)
    }
}

/// Most fields a kept copy of a head holds without growing its list.
const KEPT_FIELDS: usize = 128;

thread_local! {
    /// A list a copy of a head has used, kept to be used again.
    static SPARE_FIELDS: Cell<Vec<(HeaderName, HeaderValue)>> =
        const { Cell::new(Vec::new()) };
}

/// A copy of a head kept while its request is in flight, so that it may go
/// again once the connection that carried it breaks before any answer.
/// Most requests are answered and the copy dropped, so it is made as cheap
/// as it can be: its fields in a list rather than a map (no index to
/// build), in a list this thread has used before (nothing allocated once
/// warm), each field a reference count more (no bytes copied).
pub(super) struct KeptHead {
    method: Method,
    target: PathAndQuery,
    fields: Vec<(HeaderName, HeaderValue)>,
}

impl KeptHead {
    /// The copy of `head`.
    pub(super) fn of(head: &Head) -> Self {
        let mut fields = SPARE_FIELDS.take();
        fields.extend(
            head.headers
                .iter()
                .map(|(name, value)| (name.clone(), value.clone())),
        );
        Self {
            method: head.method.clone(),
            target: head.target.clone(),
            fields,
        }
    }

    /// The head again, its fields in their order.
    pub(super) fn head(mut self) -> Head {
        let mut headers = HeaderMap::with_capacity(self.fields.len());
        for (name, value) in self.fields.drain(..) {
            headers.append(name, value);
        }
        Head {
            method: std::mem::take(&mut self.method),
            target: std::mem::replace(&mut self.target, PathAndQuery::from_static("/")),
            headers,
        }
    }
}

impl Drop for KeptHead {
    fn drop(&mut self) {
        let mut fields = std::mem::take(&mut self.fields);
        fields.clear();
        if fields.capacity() <= KEPT_FIELDS {
            SPARE_FIELDS.set(fields);
        }
    }
}

/// The protocol a request goes over.
#[derive(Debug, Clone, Copy)]
pub(super) enum Wire {
    /// Origin form, with `Host`.
    Http1,
    /// Scheme and authority in the target, no `Host`.
    Http2,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kept_copy_gives_back_the_same_head() {
        let mut headers = HeaderMap::new();
        headers.append("host", HeaderValue::from_static("api.internal"));
        headers.append("accept", HeaderValue::from_static("text/plain"));
        headers.append("x-tag", HeaderValue::from_static("one"));
        headers.append("accept", HeaderValue::from_static("application/json"));
        headers.append("x-tag", HeaderValue::from_static("two"));
        let head = Head {
            method: Method::DELETE,
            target: PathAndQuery::from_static("/items/7?force=1"),
            headers,
        };
        let fields = |head: &Head| {
            head.headers
                .iter()
                .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
                .collect::<Vec<_>>()
        };
        let copy = KeptHead::of(&head);
        let again = copy.head();
        assert_eq!(again.method, Method::DELETE);
        assert_eq!(again.target.as_str(), "/items/7?force=1");
        assert_eq!(fields(&again), fields(&head));
        assert_eq!(again.headers.get_all("accept").iter().count(), 2);

        // The list is used again by the next copy, which holds only its own
        // head's fields.
        let mut small = HeaderMap::new();
        small.insert("host", HeaderValue::from_static("other"));
        let other = Head {
            method: Method::GET,
            target: PathAndQuery::from_static("/"),
            headers: small,
        };
        drop(KeptHead::of(&head));
        assert_eq!(fields(&KeptHead::of(&other).head()), fields(&other));
    }
}
