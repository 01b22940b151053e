//! Jittered exponential backoff for upstream reconnects (C12).

use std::time::Duration;

use rand::Rng;

#[derive(Debug, Clone)]
pub struct Backoff {
    initial: Duration,
    max: Duration,
    current: Duration,
}

impl Backoff {
    pub fn new(initial: Duration, max: Duration) -> Self {
        Backoff {
            initial,
            max,
            current: initial,
        }
    }

    /// The next delay: the current ceiling scaled by a random factor in [0.5, 1.0], so a fleet of
    /// relays that lost the same control plane does not reconnect in lockstep. The ceiling doubles
    /// up to `max`.
    pub fn next_delay(&mut self) -> Duration {
        let factor = rand::rng().random_range(0.5..=1.0);
        let delay = self.current.mul_f64(factor);
        self.current = (self.current * 2).min(self.max);
        delay
    }

    /// Called once a stream has delivered a response.
    pub fn reset(&mut self) {
        self.current = self.initial;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_to_max_with_jitter_and_resets() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_millis(800));
        let delays: Vec<Duration> = (0..6).map(|_| b.next_delay()).collect();
        let ceilings = [100, 200, 400, 800, 800, 800];
        for (d, c) in delays.iter().zip(ceilings) {
            assert!(
                *d <= Duration::from_millis(c) && *d >= Duration::from_millis(c / 2),
                "{d:?} vs {c}"
            );
        }
        b.reset();
        assert!(b.next_delay() <= Duration::from_millis(100));
    }
}
