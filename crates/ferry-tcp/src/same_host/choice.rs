//! Which way a frame longer than the rings takes: the staging area or the
//! target's kernel copy.
//!
//! The staging area is fastest when both processes run at once: each copies
//! its side of a 256 KiB pipeline. When they compete with other work for
//! the CPUs, one of them is descheduled for a whole time slice (ms) and the
//! other waits: the pipeline moves at the speed of their turns. The kernel
//! copy needs one thread, the target's, and keeps its speed there (it is
//! also what frames of 8 MiB and more use). So an initiator whose staged
//! stream had to wait a scheduler's time slice for the other side (2 ms:
//! that side lost its CPU, not just a passing preemption) sends the frames of its next long
//! calls as kernel copies for a while, then tries the area again: the while doubles
//! (up to [`MAX_BACKOFF`]) each time a wait sleeps again, and starts over
//! once none has for [`FORGET`]. The target tells its own sleeps
//! (it waits when the initiator lost its CPU) through a counter in the
//! area. Calls whose frames fit in the rings together stay staged: they
//! never wait for room.
//!
//! Only the initiator chooses, and only between two ways the target
//! already serves: a target cannot tell, and a peer that makes the
//! initiator sleep only makes it use the kernel copy.
//!
//! With granted copies ([`crate::same_host::grant`]) the other way is the
//! initiator's own copy into the target's memory, which needs no target
//! on a CPU at all. Quiet, the area's two copies are about twice as fast
//! as one `process_vm_writev`; when the processes compete for the CPUs
//! the area slows down long before any wait lasts a time slice. So long
//! calls (longer than the rings) go the way whose measured speed is
//! higher ([`PathChoice::grant`]): each way's rate is a moving average
//! over its long calls, and the way not taken gets one call every
//! [`EXPLORE`] so that its rate stays current. A sleep still sends long
//! calls away from the area at once, as above.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::stage::RING_BYTES;

/// The first while long frames avoid the area after a staged stream slept.
pub(crate) const MIN_BACKOFF: Duration = Duration::from_millis(5);
/// The longest while.
pub(crate) const MAX_BACKOFF: Duration = Duration::from_secs(1);
/// A sleep this long after the last one starts again from [`MIN_BACKOFF`].
pub(crate) const FORGET: Duration = Duration::from_secs(3);

/// The way not taken by long calls gets one of them this often.
pub(crate) const EXPLORE: Duration = Duration::from_millis(100);

/// One connection's choice (see the module's comment).
#[derive(Debug)]
pub(crate) struct PathChoice {
    /// Moving averages of long calls' rates, bytes per µs × 16 (0: none
    /// measured yet): through the area, and granted.
    staged_rate: AtomicU64,
    granted_rate: AtomicU64,
    /// Nanoseconds after `epoch` of the last long call each way.
    staged_last: AtomicU64,
    granted_last: AtomicU64,
    epoch: Instant,
    /// Nanoseconds after `epoch` until which long frames avoid the area.
    avoid_until: AtomicU64,
    /// The current while, in nanoseconds (0: no recent sleep).
    backoff: AtomicU64,
    /// The target's count of sleeps last seen.
    peer_seen: AtomicU64,
    /// Nanoseconds after `epoch` of the last sleep (0: none yet).
    last_sleep: AtomicU64,
}

impl Default for PathChoice {
    fn default() -> Self {
        PathChoice {
            staged_rate: AtomicU64::new(0),
            granted_rate: AtomicU64::new(0),
            staged_last: AtomicU64::new(0),
            granted_last: AtomicU64::new(0),
            epoch: Instant::now(),
            avoid_until: AtomicU64::new(0),
            backoff: AtomicU64::new(0),
            peer_seen: AtomicU64::new(0),
            last_sleep: AtomicU64::new(0),
        }
    }
}

impl PathChoice {
    fn now(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }

    /// Whether a call that moves `total` bytes in frames that could be
    /// staged stages them (else: kernel copies by the target).
    /// `peer_slept` is the target's count of its sleeps
    /// ([`super::stage::Area::target_slept`]): one it made since the last
    /// look counts as a sleep of ours.
    pub(crate) fn stage(&self, total: u64, peer_slept: u64) -> bool {
        // A load first: the line stays shared (no write) on the common
        // path, where the target has not slept since the last look.
        if self.peer_seen.load(Ordering::Relaxed) != peer_slept
            && self.peer_seen.swap(peer_slept, Ordering::Relaxed) != peer_slept
        {
            self.slept();
        }
        total <= RING_BYTES as u64 || self.now() >= self.avoid_until.load(Ordering::Relaxed)
    }

    /// Whether a call of `total` bytes, with granted copies available,
    /// goes granted rather than through the area; `stage_now` is
    /// [`PathChoice::stage`]'s answer for it (false: the area is avoided).
    /// Calls that fit in the rings stay staged (they never wait for the
    /// target); longer ones take the faster way (see the module's comment).
    pub(crate) fn grant(&self, total: u64, stage_now: bool) -> bool {
        if !stage_now {
            return true;
        }
        if total <= RING_BYTES as u64 {
            return false;
        }
        let now = self.now();
        let explore = EXPLORE.as_nanos() as u64;
        let (s, g) = (
            self.staged_rate.load(Ordering::Relaxed),
            self.granted_rate.load(Ordering::Relaxed),
        );
        let due = |last: &AtomicU64| {
            let l = last.load(Ordering::Relaxed);
            now.saturating_sub(l) >= explore
                && last
                    .compare_exchange(l, now, Ordering::Relaxed, Ordering::Relaxed)
                    .is_ok()
        };
        if g == 0 || s == 0 {
            // The unmeasured way first.
            return g == 0;
        }
        if g > s {
            !due(&self.staged_last)
        } else {
            due(&self.granted_last)
        }
    }

    /// A long call (longer than the rings) moved `bytes` in `took`,
    /// `granted` or through the area.
    pub(crate) fn moved(&self, granted: bool, bytes: u64, took: Duration) {
        if bytes <= RING_BYTES as u64 {
            return;
        }
        let rate = (bytes * 16 / (took.as_micros() as u64).max(1)).max(1);
        let (avg, last) = if granted {
            (&self.granted_rate, &self.granted_last)
        } else {
            (&self.staged_rate, &self.staged_last)
        };
        let old = avg.load(Ordering::Relaxed);
        let new = if old == 0 { rate } else { (old * 3 + rate) / 4 };
        avg.store(new.max(1), Ordering::Relaxed);
        last.store(self.now(), Ordering::Relaxed);
    }

    /// After a staged stream: `slept` of its waits had to sleep.
    pub(crate) fn staged(&self, slept: u64) {
        if slept > 0 {
            self.slept();
        }
    }

    /// A wait of either side slept: long calls avoid the area for the next
    /// while, twice the last one (from [`MIN_BACKOFF`] up to
    /// [`MAX_BACKOFF`]; back to the first after [`FORGET`] without a
    /// sleep). Staged streams that do not sleep do not shorten it: under
    /// CPU pressure most streams run clean and the few that do not cost
    /// tens of milliseconds each.
    fn slept(&self) {
        let now = self.now();
        let min = MIN_BACKOFF.as_nanos() as u64;
        let max = MAX_BACKOFF.as_nanos() as u64;
        let last_sleep = self.last_sleep.swap(now, Ordering::Relaxed);
        let mut last = self.backoff.load(Ordering::Relaxed);
        if last_sleep == 0 || now.saturating_sub(last_sleep) > FORGET.as_nanos() as u64 {
            last = 0;
        }
        let next = if last == 0 {
            tracing::debug!(
                "same-host: a staged stream waited for a descheduled side; long frames take \
                 the kernel copy for a while"
            );
            min
        } else {
            (last * 2).min(max)
        };
        self.backoff.store(next, Ordering::Relaxed);
        self.avoid_until.store(now + next, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LONG: u64 = RING_BYTES as u64 + 1;

    fn backoff(c: &PathChoice) -> Duration {
        Duration::from_nanos(c.backoff.load(Ordering::Relaxed))
    }

    #[test]
    fn a_sleeping_stream_sends_long_calls_to_the_kernel_copy_for_a_while() {
        let c = PathChoice::default();
        assert!(c.stage(LONG, 0) && c.stage(4096, 0));
        c.staged(0);
        assert!(
            c.stage(LONG, 0),
            "a stream that never slept changes nothing"
        );
        c.staged(3);
        assert!(!c.stage(LONG, 0), "long calls avoid the area after a sleep");
        assert!(
            c.stage(RING_BYTES as u64, 0),
            "calls that fit in the rings stay staged"
        );
        std::thread::sleep(MIN_BACKOFF + Duration::from_millis(2));
        assert!(c.stage(LONG, 0), "the area is tried again after the while");
    }

    #[test]
    fn long_calls_take_the_faster_way_and_try_the_other_now_and_then() {
        let c = PathChoice::default();
        let long = 4 * LONG;
        assert!(
            !c.grant(RING_BYTES as u64, true),
            "calls that fit stay staged"
        );
        assert!(c.grant(long, false), "an avoided area means granted");
        assert!(c.grant(long, true), "unmeasured: granted first");
        c.moved(true, long, Duration::from_micros(400));
        assert!(!c.grant(long, true), "then the area, unmeasured");
        c.moved(false, long, Duration::from_micros(200));
        // The area is twice as fast: staged, but for one granted call
        // once the exploration interval has passed.
        assert!(!c.grant(long, true));
        std::thread::sleep(EXPLORE + Duration::from_millis(5));
        assert!(c.grant(long, true), "granted explored");
        assert!(!c.grant(long, true), "once");
        // The area slows down (the target loses its CPU): granted.
        for _ in 0..8 {
            c.moved(false, long, Duration::from_micros(2000));
        }
        assert!(c.grant(long, true));
        assert!(c.grant(long, true));
        c.moved(true, 1, Duration::from_secs(1));
        assert!(c.grant(long, true), "short calls are not measured");
    }

    #[test]
    fn a_sleep_of_the_target_counts_too() {
        let c = PathChoice::default();
        assert!(c.stage(LONG, 0));
        assert!(!c.stage(LONG, 1), "the target's count moved: it slept");
        assert_eq!(backoff(&c), MIN_BACKOFF);
        assert!(!c.stage(LONG, 1));
        assert_eq!(backoff(&c), MIN_BACKOFF, "the same count is no new sleep");
        assert!(!c.stage(LONG, 7));
        assert_eq!(backoff(&c), 2 * MIN_BACKOFF);
    }

    #[test]
    fn the_while_doubles_while_streams_sleep_and_clean_ones_do_not_shorten_it() {
        // An epoch in the past, so that "long ago" has a time.
        let c = PathChoice {
            epoch: Instant::now() - 2 * FORGET,
            ..Default::default()
        };
        c.staged(1);
        assert_eq!(backoff(&c), MIN_BACKOFF);
        c.staged(1);
        assert_eq!(backoff(&c), 2 * MIN_BACKOFF);
        for _ in 0..20 {
            c.staged(1);
        }
        assert_eq!(backoff(&c), MAX_BACKOFF);
        c.staged(0);
        assert_eq!(
            backoff(&c),
            MAX_BACKOFF,
            "a stream that did not sleep changes nothing"
        );
        // Long after the last sleep, the next one starts over.
        c.last_sleep
            .store(c.now() - FORGET.as_nanos() as u64 - 1, Ordering::Relaxed);
        c.staged(2);
        assert_eq!(backoff(&c), MIN_BACKOFF);
    }
}
