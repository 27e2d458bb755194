//! The recent-latency timeline behind the dashboard's charts. It owns a fixed ring of 5-second windows covering
//! the last 10 minutes; each window counts the `/v1` requests answered (and how many failed) and holds log-bucketed
//! histograms of time to first token and inter-token latency, from which the window's p50/p90/p99 are read.
//!
//! Memory is fixed (120 windows × 2 × 96 counters) whatever the traffic, and recording is one short critical
//! section on a std mutex, never held across an await. Percentiles come from bucket midpoints: buckets are a
//! quarter octave wide, so a reported percentile is within about 9% of the exact one.

use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::Serialize;

/// Width of one window.
pub const WINDOW: Duration = Duration::from_secs(5);
/// Windows kept: 10 minutes.
pub const WINDOWS: usize = 120;
const BUCKETS: usize = 96;
/// Buckets per doubling of the latency.
const BUCKETS_PER_OCTAVE: f64 = 4.0;
/// Lower edge of bucket 1; bucket 0 takes everything below it. The top bucket starts at ~700 s.
const SMALLEST_S: f64 = 50e-6;

/// A log-bucketed latency histogram.
#[derive(Clone)]
struct Histogram {
    counts: [u32; BUCKETS],
    total: u32,
}

impl Histogram {
    const EMPTY: Histogram = Histogram { counts: [0; BUCKETS], total: 0 };

    fn bucket(seconds: f64) -> usize {
        if seconds.is_nan() || seconds <= SMALLEST_S {
            return 0;
        }
        let i = ((seconds / SMALLEST_S).log2() * BUCKETS_PER_OCTAVE).floor() + 1.0;
        // Infinity and huge values land in the top bucket (`as` saturates, the `min` caps).
        (i.min((BUCKETS - 1) as f64)) as usize
    }

    /// The geometric middle of bucket `i`, the value reported for samples in it.
    fn midpoint(i: usize) -> f64 {
        if i == 0 {
            return SMALLEST_S / 2.0;
        }
        SMALLEST_S * ((i as f64 - 0.5) / BUCKETS_PER_OCTAVE).exp2()
    }

    fn record(&mut self, seconds: f64) {
        self.counts[Self::bucket(seconds)] += 1;
        self.total += 1;
    }

    /// The `q` quantile (0 < q <= 1), or `None` without samples.
    fn quantile(&self, q: f64) -> Option<f64> {
        if self.total == 0 {
            return None;
        }
        let rank = ((q * f64::from(self.total)).ceil() as u32).clamp(1, self.total);
        let mut seen = 0;
        for (i, &c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return Some(Self::midpoint(i));
            }
        }
        Some(Self::midpoint(BUCKETS - 1))
    }

    fn summary(&self) -> Option<Percentiles> {
        Some(Percentiles {
            count: self.total,
            p50_s: self.quantile(0.50)?,
            p90_s: self.quantile(0.90)?,
            p99_s: self.quantile(0.99)?,
        })
    }
}

#[derive(Clone)]
struct Window {
    /// Which window of the timeline this slot holds now (windows since the timeline started).
    number: u64,
    requests: u32,
    errors: u32,
    ttft: Histogram,
    inter_token: Histogram,
}

impl Window {
    const EMPTY: Window =
        Window { number: u64::MAX, requests: 0, errors: 0, ttft: Histogram::EMPTY, inter_token: Histogram::EMPTY };
}

/// Latency percentiles of one window.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Percentiles {
    pub count: u32,
    pub p50_s: f64,
    pub p90_s: f64,
    pub p99_s: f64,
}

/// One window as the dashboard sees it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WindowSummary {
    /// When the window ends (for the newest window, which is still filling, a moment in the future).
    pub end_unix_ms: u64,
    pub requests: u32,
    pub errors: u32,
    pub ttft: Option<Percentiles>,
    pub inter_token: Option<Percentiles>,
}

/// The timeline as the dashboard sees it: windows oldest first, the last one still filling.
#[derive(Debug, Clone, Serialize)]
pub struct TimelineSnapshot {
    pub window_s: u64,
    /// `/v1` requests answered since the router started.
    pub requests_total: u64,
    /// `/v1` requests answered per second over the last minute (or since start, when younger).
    pub request_rate_1m: f64,
    pub windows: Vec<WindowSummary>,
}

struct Ring {
    windows: Box<[Window]>,
    requests_total: u64,
}

/// See the module docs.
pub struct Timeline {
    started: Instant,
    started_unix_ms: u64,
    ring: Mutex<Ring>,
}

impl Default for Timeline {
    fn default() -> Self {
        Timeline::new()
    }
}

impl Timeline {
    pub fn new() -> Timeline {
        let started_unix_ms =
            SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or_default();
        Timeline {
            started: Instant::now(),
            started_unix_ms,
            ring: Mutex::new(Ring { windows: vec![Window::EMPTY; WINDOWS].into_boxed_slice(), requests_total: 0 }),
        }
    }

    fn number_at(&self, at: Instant) -> u64 {
        (at.saturating_duration_since(self.started).as_millis() / WINDOW.as_millis()) as u64
    }

    /// Runs `f` on the window that holds `at`, clearing the slot first when it still holds an older window.
    fn with_window(&self, at: Instant, f: impl FnOnce(&mut Window)) {
        let number = self.number_at(at);
        let Ok(mut ring) = self.ring.lock() else { return };
        let slot = &mut ring.windows[(number % WINDOWS as u64) as usize];
        if slot.number != number {
            *slot = Window { number, ..Window::EMPTY };
        }
        f(slot);
    }

    /// A `/v1` request was answered with `status`.
    pub fn record_request(&self, status: u16, at: Instant) {
        self.with_window(at, |w| {
            w.requests += 1;
            if status >= 400 {
                w.errors += 1;
            }
        });
        if let Ok(mut ring) = self.ring.lock() {
            ring.requests_total += 1;
        }
    }

    pub fn record_ttft(&self, seconds: f64, at: Instant) {
        self.with_window(at, |w| w.ttft.record(seconds));
    }

    pub fn record_inter_token(&self, seconds: f64, at: Instant) {
        self.with_window(at, |w| w.inter_token.record(seconds));
    }

    /// The windows of the last 10 minutes (fewer when the router is younger), oldest first, up to `now`.
    pub fn snapshot(&self, now: Instant) -> TimelineSnapshot {
        let newest = self.number_at(now);
        let oldest = newest.saturating_sub(WINDOWS as u64 - 1);
        let (copies, requests_total): (Vec<Window>, u64) = match self.ring.lock() {
            Ok(ring) => (ring.windows.to_vec(), ring.requests_total),
            Err(_) => (Vec::new(), 0),
        };
        let window_ms = WINDOW.as_millis() as u64;
        let mut windows = Vec::with_capacity((newest - oldest + 1) as usize);
        for number in oldest..=newest {
            let end_unix_ms = self.started_unix_ms + (number + 1) * window_ms;
            let summary = match copies.get((number % WINDOWS as u64) as usize).filter(|w| w.number == number) {
                Some(w) => WindowSummary {
                    end_unix_ms,
                    requests: w.requests,
                    errors: w.errors,
                    ttft: w.ttft.summary(),
                    inter_token: w.inter_token.summary(),
                },
                None => WindowSummary { end_unix_ms, requests: 0, errors: 0, ttft: None, inter_token: None },
            };
            windows.push(summary);
        }
        // The rate counts whole windows, so it divides by the time those windows cover: from the start of the
        // oldest window younger than a minute (or the router's start) to now.
        let since = now.checked_sub(Duration::from_secs(60)).map_or(0, |t| self.number_at(t));
        let covered_ms =
            (now.saturating_duration_since(self.started).as_millis() as u64).saturating_sub(since * window_ms);
        let recent: u64 =
            windows.iter().zip(oldest..=newest).filter(|(_, n)| *n >= since).map(|(w, _)| u64::from(w.requests)).sum();
        let secs = (covered_ms as f64 / 1000.0).max(1.0);
        TimelineSnapshot { window_s: WINDOW.as_secs(), requests_total, request_rate_1m: recent as f64 / secs, windows }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_within_a_bucket_of_the_truth() {
        let mut h = Histogram::EMPTY;
        assert_eq!(h.quantile(0.5), None);
        // 1 ms .. 1000 ms, one sample each.
        for ms in 1..=1000 {
            h.record(f64::from(ms) / 1000.0);
        }
        for (q, exact) in [(0.5, 0.500), (0.9, 0.900), (0.99, 0.990)] {
            let got = h.quantile(q).unwrap();
            assert!((got / exact - 1.0).abs() < 0.1, "q{q}: {got} vs {exact}");
        }
        // Out-of-range and odd inputs land in the end buckets instead of panicking.
        for v in [0.0, -1.0, f64::NAN, 1e-9, 1e9, f64::INFINITY] {
            h.record(v);
        }
        assert_eq!(h.total, 1006);
        assert_eq!(Histogram::bucket(f64::NAN), 0);
        assert_eq!(Histogram::bucket(f64::INFINITY), BUCKETS - 1);
    }

    #[test]
    fn windows_roll_over_and_stay_bounded() {
        let t = Timeline::new();
        let t0 = t.started;
        t.record_request(200, t0);
        t.record_request(500, t0 + Duration::from_millis(4900));
        t.record_ttft(0.2, t0 + Duration::from_millis(100));
        t.record_inter_token(0.01, t0 + Duration::from_secs(6));
        let s = t.snapshot(t0 + Duration::from_secs(7));
        assert_eq!(s.windows.len(), 2);
        assert_eq!((s.windows[0].requests, s.windows[0].errors), (2, 1));
        let ttft = s.windows[0].ttft.unwrap();
        assert_eq!(ttft.count, 1);
        assert!((ttft.p50_s / 0.2 - 1.0).abs() < 0.1, "{ttft:?}");
        assert!(s.windows[0].inter_token.is_none());
        assert_eq!(s.windows[1].inter_token.unwrap().count, 1);
        assert_eq!(s.windows[1].end_unix_ms - s.windows[0].end_unix_ms, 5000);
        assert_eq!(s.requests_total, 2);
        assert!((s.request_rate_1m - 2.0 / 7.0).abs() < 1e-9, "{}", s.request_rate_1m);

        // 20 minutes later: the old windows are gone, the ring still holds 120 windows, and a slot reused for a
        // new window starts from zero.
        let later = t0 + Duration::from_secs(1200);
        t.record_request(200, later);
        let s = t.snapshot(later);
        assert_eq!(s.windows.len(), WINDOWS);
        assert_eq!(s.windows.iter().map(|w| w.requests).sum::<u32>(), 1);
        assert_eq!(s.windows.last().unwrap().requests, 1);
        assert_eq!(s.requests_total, 3);
        assert!((s.request_rate_1m - 1.0 / 60.0).abs() < 1e-9, "{}", s.request_rate_1m);
    }
}
