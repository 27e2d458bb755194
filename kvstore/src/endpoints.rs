//! The kvstore nodes a process talks to: a fixed list (`--kvstore`), or one the etcd registry keeps current as
//! nodes join, move and leave. Every consumer (a [`crate::Client`], the router's directory feed, the dashboard)
//! holds its own [`Endpoints`] and picks up a new list the next time it looks for a node, so a replaced kvstore
//! node never strands a worker or a router on addresses that no longer answer.

use tokio::sync::watch;

/// Most kvstore addresses one list may hold (a raft cluster has a handful of voters).
pub const MAX_ENDPOINTS: usize = 16;

/// A view of the current kvstore node list; clones share the source but track their own "seen" state.
#[derive(Clone, Debug)]
pub struct Endpoints {
    rx: watch::Receiver<Vec<String>>,
}

/// The writing side of an updating list (held by the registry watch).
#[derive(Debug)]
pub struct EndpointsSource {
    tx: watch::Sender<Vec<String>>,
}

fn bounded(mut list: Vec<String>) -> Vec<String> {
    list.retain(|a| !a.is_empty());
    list.dedup();
    list.truncate(MAX_ENDPOINTS);
    list
}

impl Endpoints {
    /// A list that never changes.
    pub fn fixed(list: Vec<String>) -> Endpoints {
        // The sender is dropped at once: `has_changed` then reports no change, and `borrow` the list, forever.
        let (_, rx) = watch::channel(bounded(list));
        Endpoints { rx }
    }

    /// A list that `source` replaces whenever membership changes.
    pub fn updating(initial: Vec<String>) -> (EndpointsSource, Endpoints) {
        let (tx, rx) = watch::channel(bounded(initial));
        (EndpointsSource { tx }, Endpoints { rx })
    }

    /// The current list.
    pub fn current(&self) -> Vec<String> {
        self.rx.borrow().clone()
    }

    /// The current list, marked as seen: [`Endpoints::changed`] reports only later lists.
    pub fn latest(&mut self) -> Vec<String> {
        self.rx.borrow_and_update().clone()
    }

    pub fn is_empty(&self) -> bool {
        self.rx.borrow().is_empty()
    }

    pub fn len(&self) -> usize {
        self.rx.borrow().len()
    }

    /// Whether `addr` is listed now.
    pub fn contains(&self, addr: &str) -> bool {
        self.rx.borrow().iter().any(|a| a == addr)
    }

    /// The new list, when it changed since this view last looked (or was created).
    pub fn changed(&mut self) -> Option<Vec<String>> {
        match self.rx.has_changed() {
            Ok(true) => Some(self.rx.borrow_and_update().clone()),
            _ => None,
        }
    }
}

impl EndpointsSource {
    /// Publishes `list` (sorted, deduplicated, bounded) when it differs from the current one. An empty list is
    /// ignored: with every node gone from the registry the last known addresses are still the best guess.
    pub fn publish(&self, mut list: Vec<String>) -> bool {
        list.sort();
        let list = bounded(list);
        if list.is_empty() {
            return false;
        }
        self.tx.send_if_modified(|cur| {
            if *cur == list {
                return false;
            }
            *cur = list;
            true
        })
    }

    /// Whether every [`Endpoints`] view is gone (nothing left to update).
    pub fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fixed_list_never_changes() {
        let mut e = Endpoints::fixed(vec!["a:1".into(), "b:2".into(), "a:1".into()]);
        assert_eq!(e.current(), ["a:1", "b:2", "a:1"]);
        assert_eq!(e.changed(), None);
    }

    #[test]
    fn each_view_sees_each_new_list_once() {
        let (src, mut a) = Endpoints::updating(vec!["x:1".into()]);
        let mut b = a.clone();
        assert_eq!(a.changed(), None);
        assert!(src.publish(vec!["z:3".into(), "y:2".into(), "y:2".into()]));
        assert_eq!(a.changed().unwrap(), ["y:2", "z:3"]);
        assert_eq!(a.changed(), None);
        assert_eq!(b.changed().unwrap(), ["y:2", "z:3"]);
        // The same list again, or an empty one, is no change.
        assert!(!src.publish(vec!["z:3".into(), "y:2".into()]));
        assert!(!src.publish(vec![]));
        assert_eq!(a.changed(), None);
        assert_eq!(a.current(), ["y:2", "z:3"]);
        assert!(a.contains("z:3") && !a.contains("x:1"));
        assert_eq!(a.len(), 2);
        src.publish(vec!["w:4".into()]);
        assert_eq!(b.latest(), ["w:4"]);
        assert_eq!(b.changed(), None, "latest marks the list seen");
    }

    #[test]
    fn lists_are_bounded() {
        let many: Vec<String> = (0..100).map(|i| format!("h:{i:03}")).collect();
        let (src, e) = Endpoints::updating(many.clone());
        assert_eq!(e.current().len(), MAX_ENDPOINTS);
        src.publish(many);
        assert_eq!(e.current().len(), MAX_ENDPOINTS);
        drop(e);
        assert!(src.is_closed());
    }
}
