//! Per-key request limits: a token bucket (requests per second and burst) and a cap on requests in flight.
//!
//! [`Limiter`] owns the state of every key of the [`KeyTable`] it was built from, one fixed slot per key, so its
//! memory is bounded by the keys file. The state sits behind one short-lived `std::sync::Mutex` that is never held
//! across an `.await`. An admitted request holds a [`Permit`]; dropping it (the response body ended, or the client
//! went away and the server dropped the body) frees the key's concurrency slot.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::auth::{KeyTable, Limits};

/// Why a request was refused.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Denied {
    /// Over the request rate; a token is back after `retry_after`.
    Rate { retry_after: Duration },
    /// `limit` requests of this key are already in flight.
    Concurrency { limit: u32 },
}

impl Denied {
    /// The `Retry-After` value in whole seconds (at least 1). For the concurrency cap there is no way to know
    /// when a slot frees, so it says 1.
    pub fn retry_after_secs(&self) -> u64 {
        match self {
            Denied::Rate { retry_after } => retry_after.as_secs_f64().ceil().max(1.0) as u64,
            Denied::Concurrency { .. } => 1,
        }
    }
}

struct Slot {
    limits: Limits,
    tokens: f64,
    refilled: Instant,
    in_flight: u32,
    admitted: u64,
    rejected_rate: u64,
    rejected_concurrency: u64,
}

impl Slot {
    fn refill(&mut self, now: Instant) {
        if let Some(rate) = self.limits.rate {
            let elapsed = now.saturating_duration_since(self.refilled).as_secs_f64();
            self.tokens = (self.tokens + elapsed * rate.per_second).min(f64::from(rate.burst));
        }
        self.refilled = now;
    }
}

/// One key's limits and current usage, for the admin view.
#[derive(Debug, Clone, Serialize)]
pub struct KeyUsage {
    pub key_index: usize,
    pub rps: Option<f64>,
    pub burst: Option<u32>,
    pub concurrency: Option<u32>,
    pub in_flight: u32,
    /// Requests the bucket would admit right now.
    pub tokens_available: Option<f64>,
    pub admitted_total: u64,
    pub rejected_rate_total: u64,
    pub rejected_concurrency_total: u64,
}

/// The limit state of every key.
pub struct Limiter {
    slots: Mutex<Vec<Slot>>,
}

/// An admitted request's hold on its key's concurrency slot; released on drop.
pub struct Permit {
    limiter: Arc<Limiter>,
    index: usize,
}

impl Drop for Permit {
    fn drop(&mut self) {
        if let Some(s) = self.limiter.lock().get_mut(self.index) {
            s.in_flight = s.in_flight.saturating_sub(1);
        }
    }
}

impl std::fmt::Debug for Permit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Permit(key {})", self.index)
    }
}

impl Limiter {
    /// A full bucket and no request in flight for every key of `table`.
    pub fn new(table: &KeyTable) -> Arc<Limiter> {
        Limiter::with_limits(table.entries().iter().map(|e| e.limits), Instant::now())
    }

    fn with_limits(limits: impl Iterator<Item = Limits>, now: Instant) -> Arc<Limiter> {
        let slots = limits
            .map(|limits| Slot {
                limits,
                tokens: limits.rate.map_or(0.0, |r| f64::from(r.burst)),
                refilled: now,
                in_flight: 0,
                admitted: 0,
                rejected_rate: 0,
                rejected_concurrency: 0,
            })
            .collect();
        Arc::new(Limiter { slots: Mutex::new(slots) })
    }

    /// The state stays consistent even if a holder panicked (no code under the lock can leave it half-updated),
    /// so a poisoned lock is used as is.
    fn lock(&self) -> MutexGuard<'_, Vec<Slot>> {
        self.slots.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Admits one request of key `index` now, or says why not.
    pub fn acquire(self: &Arc<Self>, index: usize) -> Result<Permit, Denied> {
        self.acquire_at(index, Instant::now())
    }

    fn acquire_at(self: &Arc<Self>, index: usize, now: Instant) -> Result<Permit, Denied> {
        let mut slots = self.lock();
        // An index outside the table cannot come from a KeyTable lookup; refusing it keeps this total.
        let Some(s) = slots.get_mut(index) else {
            return Err(Denied::Concurrency { limit: 0 });
        };
        // The concurrency cap is checked first so a refused request does not also spend a rate token.
        if let Some(limit) = s.limits.concurrency
            && s.in_flight >= limit
        {
            s.rejected_concurrency += 1;
            return Err(Denied::Concurrency { limit });
        }
        if let Some(rate) = s.limits.rate {
            s.refill(now);
            if s.tokens < 1.0 {
                s.rejected_rate += 1;
                let wait = (1.0 - s.tokens) / rate.per_second;
                return Err(Denied::Rate { retry_after: Duration::from_secs_f64(wait.min(86_400.0)) });
            }
            s.tokens -= 1.0;
        }
        s.in_flight += 1;
        s.admitted += 1;
        drop(slots);
        Ok(Permit { limiter: self.clone(), index })
    }

    /// Every key's limits and usage, in key-table order.
    pub fn usage(&self) -> Vec<KeyUsage> {
        let now = Instant::now();
        let mut slots = self.lock();
        slots
            .iter_mut()
            .enumerate()
            .map(|(key_index, s)| {
                s.refill(now);
                KeyUsage {
                    key_index,
                    rps: s.limits.rate.map(|r| r.per_second),
                    burst: s.limits.rate.map(|r| r.burst),
                    concurrency: s.limits.concurrency,
                    in_flight: s.in_flight,
                    tokens_available: s.limits.rate.map(|_| s.tokens),
                    admitted_total: s.admitted,
                    rejected_rate_total: s.rejected_rate,
                    rejected_concurrency_total: s.rejected_concurrency,
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::Rate;

    fn limiter(limits: &[Limits], t0: Instant) -> Arc<Limiter> {
        Limiter::with_limits(limits.iter().copied(), t0)
    }

    #[test]
    fn token_bucket_allows_burst_then_refills_at_rate() {
        let t0 = Instant::now();
        let l = limiter(&[Limits { rate: Some(Rate { per_second: 2.0, burst: 3 }), concurrency: None }], t0);
        let held: Vec<Permit> = (0..3).map(|_| l.acquire_at(0, t0).unwrap()).collect();
        drop(held);
        let d = l.acquire_at(0, t0).unwrap_err();
        assert_eq!(d, Denied::Rate { retry_after: Duration::from_millis(500) });
        assert_eq!(d.retry_after_secs(), 1);
        // 0.25 s later half a token is back: still refused, 0.25 s to go.
        let Denied::Rate { retry_after } = l.acquire_at(0, t0 + Duration::from_millis(250)).unwrap_err() else {
            panic!("expected a rate denial");
        };
        assert!((retry_after.as_secs_f64() - 0.25).abs() < 1e-9, "{retry_after:?}");
        assert!(l.acquire_at(0, t0 + Duration::from_millis(500)).is_ok());
        // A long idle time refills only up to the burst.
        let t1 = t0 + Duration::from_secs(100);
        for _ in 0..3 {
            assert!(l.acquire_at(0, t1).is_ok());
        }
        assert!(l.acquire_at(0, t1).is_err());
        let u = &l.usage()[0];
        assert_eq!((u.admitted_total, u.rejected_rate_total, u.in_flight), (7, 3, 0));
    }

    #[test]
    fn slow_rate_gives_long_retry_after() {
        let t0 = Instant::now();
        let l = limiter(&[Limits { rate: Some(Rate { per_second: 0.1, burst: 1 }), concurrency: None }], t0);
        let _p = l.acquire_at(0, t0).unwrap();
        assert_eq!(l.acquire_at(0, t0).unwrap_err().retry_after_secs(), 10);
    }

    #[test]
    fn concurrency_cap_is_released_by_dropping_the_permit() {
        let t0 = Instant::now();
        let l =
            limiter(&[Limits { rate: None, concurrency: Some(2) }, Limits { rate: None, concurrency: Some(1) }], t0);
        let a = l.acquire_at(0, t0).unwrap();
        let b = l.acquire_at(0, t0).unwrap();
        assert_eq!(l.acquire_at(0, t0).unwrap_err(), Denied::Concurrency { limit: 2 });
        // Keys are independent.
        let c = l.acquire_at(1, t0).unwrap();
        assert_eq!(l.usage()[0].in_flight, 2);
        drop(a);
        let a2 = l.acquire_at(0, t0).unwrap();
        drop((a2, b, c));
        let u = l.usage();
        assert_eq!((u[0].in_flight, u[1].in_flight), (0, 0));
        assert_eq!(u[0].rejected_concurrency_total, 1);
        assert!(l.acquire_at(2, t0).is_err(), "an index outside the table is refused");
    }

    #[test]
    fn concurrency_refusal_spends_no_rate_token() {
        let t0 = Instant::now();
        let l = limiter(&[Limits { rate: Some(Rate { per_second: 1.0, burst: 2 }), concurrency: Some(1) }], t0);
        let p = l.acquire_at(0, t0).unwrap();
        for _ in 0..5 {
            assert!(matches!(l.acquire_at(0, t0), Err(Denied::Concurrency { .. })));
        }
        drop(p);
        assert!(l.acquire_at(0, t0).is_ok(), "the second burst token is still there");
    }
}
