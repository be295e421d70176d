//! What became of an answer whose client left before its usage report.

/// What became of an answer whose client left before its report (see
/// [`super::settings::Abandoned`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Abandonment {
    /// Read on to the end of the answer (or to its final report): settled
    /// to what it reported.
    Drained,
    /// `drain_time` or `drain_bytes` was reached first: closed then, the
    /// reservation standing as the charge.
    Bound,
    /// `max_draining` answers of the route were being read on already:
    /// closed at once, the reservation standing.
    Full,
    /// The upstream's answer broke off while it was read on.
    Broke,
    /// Closed at once (`abandoned = "close"`), the reservation standing.
    Closed,
}

impl Abandonment {
    /// Every outcome, in declaration order.
    pub const ALL: [Abandonment; 5] = [
        Self::Drained,
        Self::Bound,
        Self::Full,
        Self::Broke,
        Self::Closed,
    ];

    /// The outcome as metrics and logs name it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Drained => "drained",
            Self::Bound => "bound",
            Self::Full => "full",
            Self::Broke => "broke",
            Self::Closed => "closed",
        }
    }
}
