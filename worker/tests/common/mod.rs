//! Helpers shared by the engine tests that run the real model (`mod common;` in each).

use std::time::{Duration, Instant};

use pagoda_worker::engine::{EngineHandle, EngineStats};

/// The engine's stats once `done` holds, polled for at most a minute.
pub fn wait_stats(h: &EngineHandle, what: &str, done: impl Fn(&EngineStats) -> bool) -> EngineStats {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let s = h.stats();
        if done(&s) {
            return s;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}: {s:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
}
