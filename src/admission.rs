//! Admission control for new downstream streams: a token bucket, so a reconnect storm of thousands
//! of clients is admitted at a bounded rate and cannot starve the clients already connected. Time
//! is passed in.

use std::time::Instant;

#[derive(Debug)]
pub struct Admission {
    rate: f64,
    burst: f64,
    tokens: f64,
    last: Instant,
}

impl Admission {
    /// `rate` streams per second with bursts of `burst`; `None` if `rate` is 0 (no limit).
    pub fn new(rate: f64, burst: u32, now: Instant) -> Option<Self> {
        (rate > 0.0).then(|| Admission {
            rate,
            burst: f64::from(burst.max(1)),
            tokens: f64::from(burst.max(1)),
            last: now,
        })
    }

    /// Takes one token if there is one.
    pub fn admit(&mut self, now: Instant) -> bool {
        let elapsed = now.saturating_duration_since(self.last).as_secs_f64();
        self.last = now;
        self.tokens = (self.tokens + elapsed * self.rate).min(self.burst);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn burst_then_rate() {
        let t0 = Instant::now();
        let mut a = Admission::new(10.0, 5, t0).unwrap();
        assert_eq!((0..8).filter(|_| a.admit(t0)).count(), 5);
        // 10/s: one more token every 100 ms.
        assert!(a.admit(t0 + Duration::from_millis(100)));
        assert!(!a.admit(t0 + Duration::from_millis(150)));
        // Never more than the burst, however long the pause.
        let later = t0 + Duration::from_secs(60);
        assert_eq!((0..8).filter(|_| a.admit(later)).count(), 5);
        assert!(Admission::new(0.0, 5, t0).is_none());
    }
}
