//! Which way a frame longer than the rings takes: the staging area or the
//! target's kernel copy.
//!
//! The staging area is fastest when both processes run at once: each copies
//! its side of a 256 KiB pipeline. When they compete with other work for
//! the CPUs, one of them is descheduled for a whole time slice (ms) and the
//! other waits: the pipeline moves at the speed of their turns. The kernel
//! copy needs one thread, the target's, and keeps its speed there (it is
//! also what frames of 8 MiB and more use). So an initiator whose staged
//! stream had to sleep for the target (its wait outlasted the spin and
//! yield phases: the target lost its CPU) sends its next long frames as
//! kernel copies for a while, then tries the area again: the while doubles
//! (up to [`MAX_BACKOFF`]) each time the trial sleeps too, and is forgotten
//! once one does not. Frames that fit in the rings stay staged: they never
//! wait for the target to make room.
//!
//! Only the initiator chooses, and only between two ways the target
//! already serves: a target cannot tell, and a peer that makes the
//! initiator sleep only makes it use the kernel copy.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::stage::RING_BYTES;

/// The first while long frames avoid the area after a staged stream slept.
pub(crate) const MIN_BACKOFF: Duration = Duration::from_millis(5);
/// The longest while.
pub(crate) const MAX_BACKOFF: Duration = Duration::from_millis(200);

/// One connection's choice (see the module's comment).
#[derive(Debug)]
pub(crate) struct PathChoice {
    epoch: Instant,
    /// Nanoseconds after `epoch` until which long frames avoid the area.
    avoid_until: AtomicU64,
    /// The current while, in nanoseconds (0: the last trial did not sleep).
    backoff: AtomicU64,
}

impl Default for PathChoice {
    fn default() -> Self {
        PathChoice {
            epoch: Instant::now(),
            avoid_until: AtomicU64::new(0),
            backoff: AtomicU64::new(0),
        }
    }
}

impl PathChoice {
    fn now(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }

    /// Whether a frame of `total` bytes goes through the area (else: a
    /// kernel copy by the target).
    pub(crate) fn stage(&self, total: u64) -> bool {
        total <= RING_BYTES as u64 || self.now() >= self.avoid_until.load(Ordering::Relaxed)
    }

    /// After a staged stream of `bytes`: `slept` of its waits had to
    /// sleep. A short stream that did not sleep says nothing about long
    /// ones (it never waited for room).
    pub(crate) fn staged(&self, bytes: usize, slept: u32) {
        if slept == 0 {
            if bytes > RING_BYTES {
                self.backoff.store(0, Ordering::Relaxed);
            }
            return;
        }
        let min = MIN_BACKOFF.as_nanos() as u64;
        let max = MAX_BACKOFF.as_nanos() as u64;
        let last = self.backoff.load(Ordering::Relaxed);
        let next = if last == 0 {
            tracing::debug!(
                "same-host: a staged stream waited for the target's CPU; long frames take the \
                 kernel copy for a while"
            );
            min
        } else {
            (last * 2).min(max)
        };
        self.backoff.store(next, Ordering::Relaxed);
        self.avoid_until.store(self.now() + next, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LONG: usize = RING_BYTES + 1;

    #[test]
    fn a_sleeping_stream_sends_long_frames_to_the_kernel_copy_for_a_while() {
        let c = PathChoice::default();
        let long = RING_BYTES as u64 + 1;
        assert!(c.stage(long) && c.stage(4096));
        c.staged(LONG, 0);
        assert!(c.stage(long), "a stream that never slept changes nothing");
        c.staged(LONG, 3);
        assert!(!c.stage(long), "long frames avoid the area after a sleep");
        assert!(
            c.stage(RING_BYTES as u64),
            "frames that fit in the rings stay staged"
        );
        std::thread::sleep(MIN_BACKOFF + Duration::from_millis(2));
        assert!(c.stage(long), "the area is tried again after the while");
    }

    #[test]
    fn the_while_doubles_while_trials_sleep_and_resets_when_one_does_not() {
        let c = PathChoice::default();
        let ns = |d: Duration| d.as_nanos() as u64;
        c.staged(LONG, 1);
        assert_eq!(c.backoff.load(Ordering::Relaxed), ns(MIN_BACKOFF));
        c.staged(LONG, 1);
        assert_eq!(c.backoff.load(Ordering::Relaxed), 2 * ns(MIN_BACKOFF));
        for _ in 0..20 {
            c.staged(LONG, 1);
        }
        assert_eq!(c.backoff.load(Ordering::Relaxed), ns(MAX_BACKOFF));
        c.staged(4096, 0);
        assert_eq!(
            c.backoff.load(Ordering::Relaxed),
            ns(MAX_BACKOFF),
            "a short stream that did not sleep resets nothing"
        );
        c.staged(4096, 2);
        assert_eq!(c.backoff.load(Ordering::Relaxed), ns(MAX_BACKOFF));
        c.staged(LONG, 0);
        assert_eq!(c.backoff.load(Ordering::Relaxed), 0);
        c.staged(LONG, 1);
        assert_eq!(c.backoff.load(Ordering::Relaxed), ns(MIN_BACKOFF));
    }
}
