//! The router's cached snapshot of every worker's `Stats`, shared by `/metrics` and the dashboard.
//!
//! This module owns that snapshot and how it is refreshed: at most once per [`STATS_MAX_AGE`], by one fan-out at a
//! time (single flight), so that any number of Prometheus scrapes and open dashboards cost each worker about one
//! `Stats` call per [`STATS_MAX_AGE`]. The fan-out runs as its own task: a caller that goes away (a scrape whose
//! client disconnects) does not cancel it, so a refresh once started always lands, and callers never wait on a
//! refresh that nobody drives.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use futures::FutureExt;
use futures::future::{BoxFuture, Shared};
use pagoda_proto::worker::StatsResponse;

use crate::workers::WorkerPool;

/// How old the snapshot may get before a caller refreshes it.
pub const STATS_MAX_AGE: Duration = Duration::from_secs(1);

/// What the workers' `Stats` said at one moment.
#[derive(Debug)]
pub struct StatsSnapshot {
    /// When the fan-out finished.
    pub fetched: Instant,
    /// Per worker of the pool then, by address (the pool may have changed since): its `Stats`, or `None` when it
    /// did not answer.
    pub stats: BTreeMap<String, Option<StatsResponse>>,
}

impl StatsSnapshot {
    /// The worker at `addr`'s `Stats`, if it was in the pool then and answered.
    pub fn get(&self, addr: &str) -> Option<&StatsResponse> {
        self.stats.get(addr)?.as_ref()
    }
}

/// A refresh under way; `None` when its task failed.
type Refresh = Shared<BoxFuture<'static, Option<Arc<StatsSnapshot>>>>;

#[derive(Default)]
struct CacheState {
    latest: Option<Arc<StatsSnapshot>>,
    refreshing: Option<Refresh>,
}

/// The shared snapshot (see the module docs). The lock is held only to read or swap the state, never across an
/// await: waiters await a clone of the refresh's shared future.
pub struct StatsCache {
    max_age: Duration,
    state: Arc<Mutex<CacheState>>,
}

impl Default for StatsCache {
    fn default() -> StatsCache {
        StatsCache::new(STATS_MAX_AGE)
    }
}

impl StatsCache {
    pub fn new(max_age: Duration) -> StatsCache {
        StatsCache { max_age, state: Arc::default() }
    }

    fn lock(state: &Mutex<CacheState>) -> std::sync::MutexGuard<'_, CacheState> {
        // Every update is a single assignment, so a poisoned lock still holds a consistent state.
        state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The snapshot, refreshed first when it is older than the max age. The caller that finds it old starts the
    /// refresh and waits for it; callers arriving while it runs get the previous snapshot at once (they would
    /// otherwise queue behind a slow worker), or wait for the same refresh when there is none yet. `None` only
    /// when the first refresh failed.
    pub async fn snapshot(&self, pool: &Arc<WorkerPool>) -> Option<Arc<StatsSnapshot>> {
        let refresh = {
            let mut s = Self::lock(&self.state);
            let latest = s.latest.clone();
            if latest.as_ref().is_some_and(|l| l.fetched.elapsed() < self.max_age) {
                return latest;
            }
            match (&s.refreshing, latest) {
                (Some(_), Some(previous)) => return Some(previous),
                (Some(running), None) => running.clone(),
                (None, _) => {
                    let started = self.start_refresh(pool.clone());
                    s.refreshing = Some(started.clone());
                    started
                }
            }
        };
        match refresh.await {
            Some(fresh) => Some(fresh),
            None => Self::lock(&self.state).latest.clone(),
        }
    }

    /// Spawns the fan-out; it publishes its snapshot itself, so it lands even when every caller has gone.
    fn start_refresh(&self, pool: Arc<WorkerPool>) -> Refresh {
        let state = self.state.clone();
        let task = tokio::spawn(async move {
            let workers = pool.workers();
            let stats = futures::future::join_all(workers.iter().map(|w| w.stats())).await;
            let stats = workers.iter().map(|w| w.addr.clone()).zip(stats).collect();
            let fresh = Arc::new(StatsSnapshot { fetched: Instant::now(), stats });
            let mut s = Self::lock(&state);
            s.latest = Some(fresh.clone());
            s.refreshing = None;
            fresh
        });
        let state = self.state.clone();
        async move {
            let fresh = task.await.ok();
            if fresh.is_none() {
                // The task died before publishing: the next caller starts another.
                Self::lock(&state).refreshing = None;
            }
            fresh
        }
        .boxed()
        .shared()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pool of one address nothing listens on: each fan-out is one failed `Stats` call, and a snapshot names it.
    fn pool() -> Arc<WorkerPool> {
        Arc::new(WorkerPool::new(&["127.0.0.1:1".into()]).unwrap())
    }

    #[tokio::test]
    async fn concurrent_callers_share_one_refresh_and_an_aged_snapshot_is_refreshed() {
        let (cache, pool) = (StatsCache::new(Duration::from_millis(200)), pool());
        let all = futures::future::join_all((0..8).map(|_| cache.snapshot(&pool))).await;
        let first = all[0].clone().unwrap();
        assert!(all.iter().all(|s| s.as_ref().is_some_and(|s| Arc::ptr_eq(s, &first))), "one fan-out for all");
        assert_eq!(first.stats.keys().collect::<Vec<_>>(), ["127.0.0.1:1"]);
        assert!(first.get("127.0.0.1:1").is_none(), "nothing answers there");
        let again = cache.snapshot(&pool).await.unwrap();
        assert!(Arc::ptr_eq(&again, &first), "within the max age");
        tokio::time::sleep(Duration::from_millis(250)).await;
        let aged = cache.snapshot(&pool).await.unwrap();
        assert!(!Arc::ptr_eq(&aged, &first) && aged.fetched > first.fetched, "refreshed once aged");
    }

    #[tokio::test]
    async fn a_refresh_whose_caller_left_still_lands() {
        let (cache, pool) = (StatsCache::new(Duration::from_secs(60)), pool());
        // Polled once, then dropped: the spawned fan-out goes on without it.
        let mut first = Box::pin(cache.snapshot(&pool));
        assert!(futures::poll!(first.as_mut()).is_pending());
        drop(first);
        let snap = cache.snapshot(&pool).await.unwrap();
        assert_eq!(snap.stats.len(), 1);
        assert!(StatsCache::lock(&cache.state).refreshing.is_none());
    }
}
