//! Virtual token counters: the tenant ledger of `--scheduling-policy vtc`, the Virtual Token Counter of Sheng et
//! al., "Fairness in Serving Large Language Models" (OSDI 2024).
//!
//! Each tenant has a counter of the service it has received, in weighted tokens: `W_PROMPT` per prompt token when
//! one of its requests is admitted and `W_OUTPUT` per generated token, both divided by the tenant's weight. The
//! scheduler admits next from the backlogged tenant with the smallest counter. A tenant that arrives with nothing
//! waiting has its counter lifted to the smallest counter of the tenants that are waiting (or, when none is, to the
//! counter of the last tenant that left the queue), so a tenant cannot bank service by being idle and then starve
//! the others.
//!
//! Slot fairness ([`crate::scheduler::SchedulingPolicy::Fair`]) gives each tenant the same number of running
//! sequences; this gives each the same weighted tokens, so a tenant of long prompts does not take several times the
//! compute of a tenant of short ones through the same slots.
//!
//! The ledger is a plain struct owned by the scheduler. It remembers at most [`MAX_TENANTS`] tenants; beyond that
//! it forgets an inactive tenant with the smallest counter, which the lift on its next arrival makes harmless.

/// The paper's cost of a prompt token (`w_p`) and of a generated token (`w_q`).
pub const W_PROMPT: u64 = 1;
pub const W_OUTPUT: u64 = 2;

/// Fixed-point scale of the counters: a weighted token is `1 << FRACTION_BITS`, so dividing by a weight of up to
/// 1000 keeps 10 bits of the fraction and comparisons are exact.
const FRACTION_BITS: u32 = 20;

/// Most tenants the ledger remembers.
pub const MAX_TENANTS: usize = 1024;

/// The counters, in fixed point (see [`VirtualTokenCounters::counter_tokens`]).
#[derive(Debug, Default)]
pub struct VirtualTokenCounters {
    /// (tenant, counter): a handful of tenants, so a vector beats a map.
    counters: Vec<(u64, u64)>,
    /// The counter of the last tenant whose last waiting request was admitted (the paper's `l`).
    last_left: u64,
}

impl VirtualTokenCounters {
    /// The tenant's counter (0 for one never seen), in fixed point.
    pub fn counter(&self, tenant: u64) -> u64 {
        self.counters.iter().find(|(t, _)| *t == tenant).map_or(0, |(_, c)| *c)
    }

    /// The tenant's counter in weighted tokens.
    pub fn counter_tokens(&self, tenant: u64) -> f64 {
        self.counter(tenant) as f64 / f64::from(1u32 << FRACTION_BITS)
    }

    /// A request of `tenant`, which has nothing waiting, arrives; `waiting_min` is the smallest counter of the
    /// tenants that do have requests waiting (None when nothing waits). Lifts its counter so that idle time earns
    /// no credit. `is_active` says whether a tenant has requests waiting or running (the ones never forgotten).
    pub fn arrive(&mut self, tenant: u64, waiting_min: Option<u64>, is_active: impl Fn(u64) -> bool) {
        let floor = waiting_min.unwrap_or(self.last_left);
        let at = self.slot(tenant, is_active);
        let c = &mut self.counters[at].1;
        *c = (*c).max(floor);
    }

    /// Charges `tenant` for `tokens` tokens of cost `cost` each (`W_PROMPT` or `W_OUTPUT`) at weight `weight`.
    pub fn charge(&mut self, tenant: u64, tokens: usize, cost: u64, weight: u32, is_active: impl Fn(u64) -> bool) {
        if tokens == 0 {
            return;
        }
        let add = (tokens as u64).saturating_mul(cost) << FRACTION_BITS;
        let add = add / u64::from(weight.max(1));
        let at = self.slot(tenant, is_active);
        let c = &mut self.counters[at].1;
        *c = c.saturating_add(add);
    }

    /// `tenant`'s last waiting request was admitted: a tenant arriving to an empty queue starts from its counter.
    pub fn left_queue(&mut self, tenant: u64) {
        self.last_left = self.counter(tenant);
    }

    /// The index of `tenant`'s counter, making room for it when it is new.
    fn slot(&mut self, tenant: u64, is_active: impl Fn(u64) -> bool) -> usize {
        if let Some(at) = self.counters.iter().position(|(t, _)| *t == tenant) {
            return at;
        }
        if self.counters.len() >= MAX_TENANTS {
            let forget = (0..self.counters.len())
                .filter(|&i| !is_active(self.counters[i].0))
                .min_by_key(|&i| self.counters[i].1)
                .or_else(|| (0..self.counters.len()).min_by_key(|&i| self.counters[i].1));
            if let Some(i) = forget {
                self.counters.swap_remove(i);
            }
        }
        self.counters.push((tenant, 0));
        self.counters.len() - 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ONE: u64 = 1 << FRACTION_BITS;

    #[test]
    fn charges_prompt_and_output_tokens_by_their_weights_over_the_tenant_weight() {
        let mut v = VirtualTokenCounters::default();
        v.charge(1, 100, W_PROMPT, 1, |_| true);
        v.charge(1, 10, W_OUTPUT, 1, |_| true);
        assert_eq!(v.counter(1), 120 * ONE);
        v.charge(2, 90, W_PROMPT, 3, |_| true);
        assert_eq!(v.counter(2), 30 * ONE);
        assert_eq!(v.counter_tokens(2), 30.0);
        v.charge(3, 0, W_OUTPUT, 1, |_| true);
        assert_eq!(v.counter(3), 0);
    }

    #[test]
    fn an_arriving_tenant_is_lifted_to_the_waiting_minimum_or_the_last_to_leave() {
        let mut v = VirtualTokenCounters::default();
        v.charge(1, 500, W_PROMPT, 1, |_| true);
        // Idle tenant 2 arrives while tenant 1 (counter 500) waits: it starts at 500, not 0.
        v.arrive(2, Some(v.counter(1)), |_| true);
        assert_eq!(v.counter(2), 500 * ONE);
        // A tenant ahead of the waiting minimum keeps its counter.
        v.charge(3, 700, W_PROMPT, 1, |_| true);
        v.arrive(3, Some(500 * ONE), |_| true);
        assert_eq!(v.counter(3), 700 * ONE);
        // Nothing waiting: the floor is the counter of the last tenant that left the queue.
        v.left_queue(1);
        v.arrive(4, None, |_| true);
        assert_eq!(v.counter(4), 500 * ONE);
    }

    #[test]
    fn remembers_a_bounded_number_of_tenants_and_forgets_an_inactive_one_first() {
        let mut v = VirtualTokenCounters::default();
        for t in 0..MAX_TENANTS as u64 {
            v.charge(t, 1 + t as usize, W_PROMPT, 1, |_| true);
        }
        // Tenant 0 has the smallest counter but is active; tenant 1 is the smallest inactive one.
        v.charge(9_999, 1, W_PROMPT, 1, |t| t == 0);
        assert_eq!(v.counters.len(), MAX_TENANTS);
        assert_eq!(v.counter(0), ONE);
        assert_eq!(v.counter(1), 0);
        assert_eq!(v.counter(9_999), ONE);
        // Every tenant active: the smallest goes.
        v.charge(10_000, 1, W_PROMPT, 1, |_| true);
        assert_eq!(v.counters.len(), MAX_TENANTS);
        assert!(v.counter(0) == 0 || v.counter(9_999) == 0);
    }
}
