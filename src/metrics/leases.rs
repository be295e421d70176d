//! The leases' series: per leased limit (its scope, a route or a budget,
//! and its place), slices taken, short and given back, units taken, given
//! back, lost and held, and requests decided from a slice. Operators read
//! calls to the store per admitted request from them: slices taken, short
//! and given back over requests decided from a slice.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LeaseLabel {
    scope: String,
    limit: String,
}

/// One leased limit's handles.
#[derive(Debug, Clone, Default)]
pub struct LeaseMetrics {
    /// Slices taken from the store.
    pub taken: Counter,
    /// Units those slices took.
    pub units_taken: Counter,
    /// Slices the store had no room for.
    pub short: Counter,
    /// Slices whose unspent units were given back.
    pub returned: Counter,
    /// Units given back.
    pub units_returned: Counter,
    /// Units unspent when their window ended: what leasing kept from
    /// being admitted.
    pub units_lost: Counter,
    /// Requests decided from a slice, without asking the store.
    pub admitted: Counter,
    /// Units held unspent, as of the last sweep.
    pub held: Gauge,
}

/// The lease families, registered once.
#[derive(Debug, Clone, Default)]
pub struct LeaseFamilies {
    taken: Family<LeaseLabel, Counter>,
    units_taken: Family<LeaseLabel, Counter>,
    short: Family<LeaseLabel, Counter>,
    returned: Family<LeaseLabel, Counter>,
    units_returned: Family<LeaseLabel, Counter>,
    units_lost: Family<LeaseLabel, Counter>,
    admitted: Family<LeaseLabel, Counter>,
    held: Family<LeaseLabel, Gauge>,
}

impl LeaseFamilies {
    /// Registers the families in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let families = Self::default();
        let f = &families;
        let counters = [
            (
                "floodgate_lease_slices",
                "Slices of a leased limit's budget taken from the shared store, by scope (route or budget) and limit",
                &f.taken,
            ),
            (
                "floodgate_lease_taken_units",
                "Units the slices of a leased limit took from the shared store",
                &f.units_taken,
            ),
            (
                "floodgate_lease_short",
                "Slices the shared store had no room for (the limit near its end: decided per request, or a bucket's requests refused until a slice fits)",
                &f.short,
            ),
            (
                "floodgate_lease_returns",
                "Slices whose unspent units were given back to the shared store",
                &f.returned,
            ),
            (
                "floodgate_lease_returned_units",
                "Units given back to the shared store unspent",
                &f.units_returned,
            ),
            (
                "floodgate_lease_lost_units",
                "Units of slices still unspent when their window ended: admitted by no instance (the under-admission leasing costs)",
                &f.units_lost,
            ),
            (
                "floodgate_lease_admitted",
                "Requests decided from a slice in this instance, without a call to the shared store",
                &f.admitted,
            ),
        ];
        for (name, help, family) in counters {
            registry.register(name, help, family.clone());
        }
        registry.register(
            "floodgate_lease_held_units",
            "Units this instance holds in slices, unspent (as of the last second)",
            f.held.clone(),
        );
        families
    }

    /// The handles of limit `index` of `scope`.
    pub fn of(&self, scope: &str, index: usize) -> LeaseMetrics {
        let label = LeaseLabel {
            scope: scope.to_owned(),
            limit: index.to_string(),
        };
        LeaseMetrics {
            taken: self.taken.get_or_create(&label).clone(),
            units_taken: self.units_taken.get_or_create(&label).clone(),
            short: self.short.get_or_create(&label).clone(),
            returned: self.returned.get_or_create(&label).clone(),
            units_returned: self.units_returned.get_or_create(&label).clone(),
            units_lost: self.units_lost.get_or_create(&label).clone(),
            admitted: self.admitted.get_or_create(&label).clone(),
            held: self.held.get_or_create(&label).clone(),
        }
    }
}
