//! Worker membership from the etcd registry (DESIGN §6): the task that turns the registry's worker keys into the
//! pool's worker list.
//!
//! It owns the map registry id → address of the registered workers. Every full list ([`MembershipEvent::Listed`])
//! adds the workers the pool lacks and removes the registered ones that are gone; a `Joined` adds one (and drops
//! the old address of an id that moved); a `Left` (the worker's lease expired or was revoked) removes it, and with
//! it everything the residency index held for it, so it leaves placement at once. A worker that registers again
//! rejoins, probed at once, and the directory feed re-reads its blocks. Workers given with `--worker` are pinned:
//! the registry never removes them. Addresses are compared as the pool compares them (with or without
//! `http://`), and an address stays while any registered id still names it.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use pagoda_registry::{MembershipEvent, RegistryConfig, Role};

use crate::workers::{RegistryStatus, WorkerPool, strip_scheme};

struct Membership {
    pool: Arc<WorkerPool>,
    pinned: BTreeSet<String>,
    registered: BTreeMap<String, String>,
    status: RegistryStatus,
}

/// Starts following the registry's workers for `pool`; `pinned` are the static `--worker` addresses.
pub fn spawn(pool: Arc<WorkerPool>, cfg: RegistryConfig, pinned: Vec<String>) -> tokio::task::JoinHandle<()> {
    let (mut rx, watcher) = pagoda_registry::watch(cfg, Role::Worker);
    tokio::spawn(async move {
        let mut m = Membership {
            pool,
            pinned: pinned.into_iter().collect(),
            registered: BTreeMap::new(),
            status: RegistryStatus { enabled: true, ..RegistryStatus::default() },
        };
        m.publish();
        while let Some(ev) = rx.recv().await {
            m.apply(ev).await;
            m.publish();
        }
        watcher.abort();
    })
}

impl Membership {
    async fn apply(&mut self, ev: MembershipEvent) {
        match ev {
            MembershipEvent::Listed(members) => {
                let now: BTreeMap<String, String> = members.into_iter().map(|m| (m.id, m.address)).collect();
                let gone: Vec<String> =
                    self.registered.iter().filter(|(id, _)| !now.contains_key(*id)).map(|(id, _)| id.clone()).collect();
                for id in gone {
                    self.leave(&id);
                }
                for (id, address) in now {
                    self.join(id, address).await;
                }
            }
            MembershipEvent::Joined(m) => self.join(m.id, m.address).await,
            MembershipEvent::Left(id) => self.leave(&id),
        }
    }

    async fn join(&mut self, id: String, address: String) {
        if let Some(old) = self.registered.get(&id)
            && *old != address
        {
            // The same worker id registered at a new address: the old one is gone.
            self.leave(&id);
        }
        self.registered.insert(id.clone(), address.clone());
        match self.pool.add(&address) {
            Ok(Some(worker)) => {
                self.status.joined_total += 1;
                tracing::info!(worker = %id, address, "worker registered; it joins placement");
                // Ready for placement as soon as it answers, not at the next health round.
                worker.probe().await;
            }
            Ok(None) => {}
            Err(e) => tracing::warn!(worker = %id, address, error = %e, "cannot add a registered worker"),
        }
    }

    fn leave(&mut self, id: &str) {
        let Some(address) = self.registered.remove(id) else { return };
        // The pool holds one worker per address however it is spelt, so a pinned or still-registered spelling of
        // this address is the same worker, and it stays.
        let same = |a: &String| strip_scheme(a) == strip_scheme(&address);
        if self.pinned.iter().any(same) || self.registered.values().any(same) {
            return;
        }
        if self.pool.remove(&address) {
            self.status.left_total += 1;
            tracing::warn!(worker = %id, address, "worker's registry lease is gone; it and its residency leave placement");
        }
    }

    fn publish(&mut self) {
        self.status.workers = self.registered.iter().map(|(id, a)| (id.clone(), a.clone())).collect();
        self.pool.set_registry_status(self.status.clone());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placer::PlacerConfig;
    use pagoda_registry::Member;

    fn membership(pinned: &[&str]) -> Membership {
        let pinned: Vec<String> = pinned.iter().map(|a| a.to_string()).collect();
        Membership {
            pool: Arc::new(WorkerPool::dynamic(&pinned, PlacerConfig::default()).unwrap()),
            pinned: pinned.into_iter().collect(),
            registered: BTreeMap::new(),
            status: RegistryStatus::default(),
        }
    }

    fn member(id: &str, address: &str) -> MembershipEvent {
        MembershipEvent::Joined(Member { id: id.into(), address: address.into(), epoch: 1, node_id: None })
    }

    fn addresses(m: &Membership) -> Vec<String> {
        m.pool.workers().iter().map(|w| w.addr.clone()).collect()
    }

    // Port 1 on loopback refuses at once, so the join's probe does not wait.
    #[tokio::test]
    async fn a_pinned_worker_stays_when_it_registered_under_another_spelling() {
        let mut m = membership(&["127.0.0.1:1"]);
        m.apply(member("w1", "http://127.0.0.1:1")).await;
        assert_eq!(addresses(&m), ["127.0.0.1:1"], "one worker, however it is spelt");
        m.apply(MembershipEvent::Left("w1".into())).await;
        assert_eq!(addresses(&m), ["127.0.0.1:1"], "pinned with --worker");
    }

    #[tokio::test]
    async fn an_address_stays_while_another_registered_id_names_it() {
        let mut m = membership(&[]);
        m.apply(member("old", "127.0.0.1:1")).await;
        m.apply(member("new", "http://127.0.0.1:1")).await;
        m.apply(MembershipEvent::Left("old".into())).await;
        assert_eq!(addresses(&m), ["127.0.0.1:1"], "`new` still registers it");
        m.apply(MembershipEvent::Left("new".into())).await;
        assert!(addresses(&m).is_empty());
    }

    #[tokio::test]
    async fn a_lease_blip_keeps_the_load_of_the_requests_still_running() {
        let mut m = membership(&[]);
        m.apply(member("w1", "127.0.0.1:1")).await;
        let load = m.pool.find("127.0.0.1:1").unwrap().load().clone();
        let mut running = crate::workers::InFlight::new(load, 10);
        running.first_token();
        m.apply(MembershipEvent::Left("w1".into())).await;
        m.apply(member("w1", "127.0.0.1:1")).await;
        let back = m.pool.find("127.0.0.1:1").unwrap();
        assert_eq!(back.load().decoding(), 1);
        drop(running);
        assert_eq!(back.load().decoding(), 0);
    }
}
