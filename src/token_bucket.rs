//! A token bucket: `rate` tokens per second, at most `burst` held. Used for the admission of new
//! downstream streams (a reconnect storm is admitted at a bounded rate and cannot starve connected
//! clients) and for each stream's request rate (a NACK loop cannot burn relay CPU). Time is passed
//! in.

use std::time::Instant;

#[derive(Debug)]
pub struct TokenBucket {
    rate: f64,
    burst: f64,
    tokens: f64,
    last: Instant,
}

impl TokenBucket {
    /// `rate` tokens per second with bursts of `burst`; `None` if `rate` is 0 (no limit).
    pub fn new(rate: f64, burst: u32, now: Instant) -> Option<Self> {
        (rate > 0.0).then(|| TokenBucket {
            rate,
            burst: f64::from(burst.max(1)),
            tokens: f64::from(burst.max(1)),
            last: now,
        })
    }

    /// Takes one token if there is one.
    pub fn take(&mut self, now: Instant) -> bool {
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
        let mut a = TokenBucket::new(10.0, 5, t0).unwrap();
        assert_eq!((0..8).filter(|_| a.take(t0)).count(), 5);
        // 10/s: one more token every 100 ms.
        assert!(a.take(t0 + Duration::from_millis(100)));
        assert!(!a.take(t0 + Duration::from_millis(150)));
        // Never more than the burst, however long the pause.
        let later = t0 + Duration::from_secs(60);
        assert_eq!((0..8).filter(|_| a.take(later)).count(), 5);
        assert!(TokenBucket::new(0.0, 5, t0).is_none());
    }
}
