//! Time as the core sees it: points on the driver's clock, passed in.
//!
//! The core never reads a clock. A driver names "now" as a [`Time`] (the
//! nanoseconds since an origin of its choosing: the tokio driver takes the
//! first time it looked, a simulator its virtual clock) and turns the
//! deadlines the core computes back into its own instants. Arithmetic
//! saturates: a deadline beyond the end of the clock is "never", not a
//! panic or a wrap.

use core::time::Duration;

/// A point on the driver's clock: nanoseconds since its origin.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Time(u64);

impl Time {
    /// The origin.
    pub const ZERO: Time = Time(0);
    /// The last point of the clock: "never" as a deadline.
    pub const NEVER: Time = Time(u64::MAX);

    /// The point `ns` nanoseconds after the origin.
    #[inline]
    pub const fn from_nanos(ns: u64) -> Time {
        Time(ns)
    }

    /// Nanoseconds since the origin.
    #[inline]
    pub const fn as_nanos(self) -> u64 {
        self.0
    }

    /// `d` later (saturating at [`Time::NEVER`]).
    #[inline]
    pub fn after(self, d: Duration) -> Time {
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        Time(self.0.saturating_add(ns))
    }

    /// How long from `self` until `later` (zero if `later` is not later).
    #[inline]
    pub fn until(self, later: Time) -> Duration {
        Duration::from_nanos(later.0.saturating_sub(self.0))
    }
}

/// How fast a peer must move bytes inside a frame: some progress every
/// `stall`, and `n` bytes within `stall + n / min_rate`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pace {
    /// Longest wait for any progress.
    pub stall: Duration,
    /// Minimum bytes per second over a whole payload.
    pub min_rate: u64,
}

impl Pace {
    /// A pace with only a stall deadline (handshake messages, which are
    /// small).
    #[inline]
    pub const fn stall_only(stall: Duration) -> Pace {
        Pace {
            stall,
            min_rate: u64::MAX,
        }
    }

    /// The time allowed for moving `bytes`: the stall plus the bytes at
    /// the minimum rate (saturating).
    #[inline]
    pub fn allowance(&self, bytes: u64) -> Duration {
        let per = Duration::try_from_secs_f64(bytes as f64 / self.min_rate.max(1) as f64)
            .unwrap_or(Duration::MAX);
        self.stall.saturating_add(per)
    }

    /// When moving `bytes`, starting at `now`, must have finished.
    #[inline]
    pub fn deadline(&self, now: Time, bytes: u64) -> Time {
        now.after(self.allowance(bytes))
    }

    /// The wait allowed at `now` for the next progress: the stall, cut to
    /// what is left until `deadline`; `None` once the deadline has come
    /// (the peer is too slow).
    #[inline]
    pub fn wait(&self, now: Time, deadline: Time) -> Option<Duration> {
        let left = now.until(deadline);
        (!left.is_zero()).then(|| self.stall.min(left))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_saturate_instead_of_wrapping() {
        let t = Time::from_nanos(10);
        assert_eq!(t.after(Duration::from_nanos(5)).as_nanos(), 15);
        assert_eq!(t.after(Duration::MAX), Time::NEVER);
        assert_eq!(Time::NEVER.after(Duration::from_secs(1)), Time::NEVER);
        assert_eq!(t.until(Time::ZERO), Duration::ZERO);
        assert_eq!(Time::ZERO.until(t), Duration::from_nanos(10));
    }

    #[test]
    fn a_deadline_is_the_stall_plus_the_bytes_at_the_minimum_rate() {
        let pace = Pace {
            stall: Duration::from_secs(2),
            min_rate: 1_000_000,
        };
        let now = Time::from_nanos(1_000);
        let d = pace.deadline(now, 3_000_000);
        assert_eq!(now.until(d), Duration::from_secs(5));
        // Waits are the stall, cut to what is left, then none.
        assert_eq!(pace.wait(now, d), Some(Duration::from_secs(2)));
        let late = d.after(Duration::ZERO);
        let near = Time::from_nanos(late.as_nanos() - 1_000_000);
        assert_eq!(pace.wait(near, d), Some(Duration::from_millis(1)));
        assert_eq!(pace.wait(late, d), None);
        assert_eq!(pace.wait(late.after(Duration::from_secs(1)), d), None);
        // No minimum rate (handshakes): the stall alone; a zero rate does
        // not divide by zero, and absurd sizes mean "never".
        let hs = Pace::stall_only(Duration::from_secs(1));
        assert_eq!(now.until(hs.deadline(now, 1 << 20)), Duration::from_secs(1));
        let zero = Pace {
            stall: Duration::from_secs(1),
            min_rate: 0,
        };
        assert_eq!(zero.deadline(now, u64::MAX), Time::NEVER);
    }
}
