//! [`Journal`]: an opt-in record of changes that one component makes and another drains between engine steps
//! (idle prefix groups for the tiers, prefix-index and tier changes for the block-event reporter).
//!
//! Recording is off until a consumer starts it, so a worker without that consumer pays one branch per change and
//! never builds the item (`record_with` takes a closure).

/// Changes of type `T` in the order they happened, recorded only once [`Journal::start`] was called.
#[derive(Debug)]
pub struct Journal<T>(Option<Vec<T>>);

impl<T> Default for Journal<T> {
    fn default() -> Self {
        Journal(None)
    }
}

impl<T> Journal<T> {
    /// Turns recording on (idempotent).
    pub fn start(&mut self) {
        self.0.get_or_insert_with(Vec::new);
    }

    /// Records the change `make` builds, if recording is on.
    #[inline]
    pub fn record_with(&mut self, make: impl FnOnce() -> T) {
        if let Some(v) = &mut self.0 {
            v.push(make());
        }
    }

    /// Moves the changes recorded since the last call into `out`, in order.
    pub fn drain_into(&mut self, out: &mut Vec<T>) {
        if let Some(v) = &mut self.0 {
            out.append(v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_only_once_started_and_drains_in_order() {
        let mut j = Journal::default();
        j.record_with(|| 1);
        let mut out = Vec::new();
        j.drain_into(&mut out);
        assert!(out.is_empty());
        j.start();
        j.record_with(|| 2);
        j.record_with(|| 3);
        j.drain_into(&mut out);
        assert_eq!(out, [2, 3]);
        j.drain_into(&mut out);
        assert_eq!(out, [2, 3], "each change is handed out once");
    }
}
