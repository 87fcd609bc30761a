//! Which way a call longer than the rings takes: the staging area, the
//! target's kernel copy, or (with grants) the initiator's own copy.
//!
//! The staging area is fastest when both processes run at once: each copies
//! its side of a 256 KiB pipeline. When they compete with other work for
//! the CPUs, one of them waits for the other's turn and the pipeline moves
//! at the speed of their turns. The kernel copy needs one thread, the
//! target's, and a granted copy ([`crate::same_host::grant`]) only the
//! initiator's: each keeps its speed there. Calls whose frames fit in the
//! rings together always stay staged (they never wait for room).
//!
//! **Where the kernel reports CPU pressure** (PSI: this process's cgroup
//! v2 `cpu.pressure`, else `/proc/pressure/cpu`; [`pressure`]) that alone
//! decides: while some runnable task waited for a CPU at least
//! [`pressure::CONTENDED`] per mille of the last window (until it falls
//! below [`pressure::CALM`]), long calls copy granted (else take the
//! kernel copy); otherwise they stage (the thresholds' measurements:
//! crates/ferry-tcp/BENCHMARKS.md). Rates measured per call were not a
//! usable signal: the area's speed is bimodal even on a quiet machine
//! (whether the two copying threads share a CPU), so a moving average
//! kept leaving it for granted copies at half its speed.
//!
//! **Without PSI** the choice falls back on what the streams see. An
//! initiator whose staged stream had to wait a scheduler's time slice
//! for the other side (2 ms: that side lost its CPU, not just a passing
//! preemption) sends its next long calls the other way for a while, then
//! tries the area again: the while doubles (up to [`MAX_BACKOFF`]) each
//! time a wait sleeps again, and starts over once none has for
//! [`FORGET`]. The target tells its own sleeps (it waits when the
//! initiator lost its CPU) through a counter in the area. With grants,
//! long calls otherwise go the way whose measured speed is higher
//! ([`PathChoice::grant`]): each way's rate is a moving average over its
//! long calls, and the way not taken gets one call every [`EXPLORE`].
//!
//! Only the initiator chooses, and only between ways the target already
//! serves: a target cannot tell, and a peer that makes the initiator
//! sleep only makes it use another way.

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
    /// Whether the CPUs are contended (`None`: not known);
    /// [`pressure::contended`] but in tests.
    contended: fn() -> Option<bool>,
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
            contended: pressure::contended,
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
        if total <= RING_BYTES as u64 {
            return true;
        }
        match (self.contended)() {
            Some(contended) => !contended,
            None => self.now() >= self.avoid_until.load(Ordering::Relaxed),
        }
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
        if (self.contended)().is_some() {
            // Calm CPUs (`stage` said so): the area.
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

/// Whether the CPUs are contended, from the kernel's pressure stall
/// information (`/proc/pressure/cpu`, Linux ≥ 4.20 with PSI on): the
/// share of the last while in which some runnable task waited for a CPU.
pub(crate) mod pressure {
    use std::os::unix::fs::FileExt;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::OnceLock;
    use std::time::Instant;

    /// A share at or above this (per mille) starts calling the CPUs
    /// contended; below [`CALM`] ends it.
    pub(crate) const CONTENDED: u64 = 450;
    /// See [`CONTENDED`].
    pub(crate) const CALM: u64 = 350;
    /// Samples are this far apart at least (nanoseconds).
    const WINDOW: u64 = 50_000_000;

    struct Sampler {
        file: std::fs::File,
        epoch: Instant,
        /// Nanoseconds after `epoch` of the last sample (`u64::MAX` while
        /// one is being taken).
        at: AtomicU64,
        /// The stall total (µs) at the last sample.
        total: AtomicU64,
        contended: AtomicBool,
    }

    fn sampler() -> Option<&'static Sampler> {
        static SAMPLER: OnceLock<Option<Sampler>> = OnceLock::new();
        SAMPLER
            .get_or_init(|| {
                let file = open()?;
                let total = read_total(&file)?;
                Some(Sampler {
                    file,
                    epoch: Instant::now(),
                    at: AtomicU64::new(0),
                    total: AtomicU64::new(total),
                    contended: AtomicBool::new(false),
                })
            })
            .as_ref()
    }

    /// This process's cgroup's `cpu.pressure` (cgroup v2: its own tasks'
    /// waits, CPU quota throttling included), else the machine's.
    fn open() -> Option<std::fs::File> {
        let own = std::fs::read_to_string("/proc/self/cgroup")
            .ok()
            .and_then(|c| {
                c.lines()
                    .find_map(|l| l.strip_prefix("0::"))
                    .map(|p| format!("/sys/fs/cgroup{}/cpu.pressure", p.trim_end_matches('/')))
            });
        own.and_then(|p| std::fs::File::open(p).ok())
            .or_else(|| std::fs::File::open("/proc/pressure/cpu").ok())
    }

    /// The `some` line's `total=` (µs), if the file reads as expected.
    fn read_total(file: &std::fs::File) -> Option<u64> {
        let mut buf = [0u8; 256];
        let n = file.read_at(&mut buf, 0).ok()?;
        parse_some_total(std::str::from_utf8(&buf[..n]).ok()?)
    }

    /// `total=` of the `some` line of a pressure file.
    pub(crate) fn parse_some_total(text: &str) -> Option<u64> {
        let line = text.lines().find(|l| l.starts_with("some "))?;
        line.split_whitespace()
            .find_map(|f| f.strip_prefix("total="))?
            .parse()
            .ok()
    }

    /// Whether the CPUs are contended after a window in which tasks
    /// waited `share` per mille of the time, if they `was` before.
    pub(crate) fn next(was: bool, share: u64) -> bool {
        share >= if was { CALM } else { CONTENDED }
    }

    /// The answer as of the last sample (taken now if the last is older
    /// than the window); `None` where the kernel has no such file.
    pub(crate) fn contended() -> Option<bool> {
        let s = sampler()?;
        let now = s.epoch.elapsed().as_nanos() as u64;
        let at = s.at.load(Ordering::Relaxed);
        if at != u64::MAX
            && now.saturating_sub(at) >= WINDOW
            && s.at
                .compare_exchange(at, u64::MAX, Ordering::Acquire, Ordering::Relaxed)
                .is_ok()
        {
            if let Some(total) = read_total(&s.file) {
                let stalled = total.saturating_sub(s.total.swap(total, Ordering::Relaxed));
                // Per mille of the elapsed time (µs against ns).
                let share = stalled * 1_000_000 / now.saturating_sub(at).max(1);
                let was = s.contended.load(Ordering::Relaxed);
                let is = next(was, share);
                if is != was {
                    tracing::debug!(
                        share_per_mille = share,
                        "same-host: CPUs {}",
                        if is {
                            "contended: long calls copy granted"
                        } else {
                            "calm: long calls stage"
                        }
                    );
                }
                s.contended.store(is, Ordering::Relaxed);
            }
            s.at.store(now, Ordering::Release);
        }
        Some(s.contended.load(Ordering::Relaxed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LONG: u64 = RING_BYTES as u64 + 1;

    /// A choice that does not know the CPUs' pressure (the fallback).
    fn unknown() -> PathChoice {
        PathChoice {
            contended: || None,
            ..Default::default()
        }
    }

    fn backoff(c: &PathChoice) -> Duration {
        Duration::from_nanos(c.backoff.load(Ordering::Relaxed))
    }

    #[test]
    fn a_sleeping_stream_sends_long_calls_to_the_kernel_copy_for_a_while() {
        let c = unknown();
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
        let c = unknown();
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
        let c = unknown();
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
            ..unknown()
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

    #[test]
    fn known_pressure_decides_long_calls_alone() {
        let calm = PathChoice {
            contended: || Some(false),
            ..Default::default()
        };
        calm.staged(5);
        assert!(calm.stage(LONG, 9), "sleeps do not count on calm CPUs");
        calm.moved(true, 4 * LONG, Duration::from_micros(10));
        calm.moved(false, 4 * LONG, Duration::from_millis(10));
        assert!(
            !calm.grant(4 * LONG, true),
            "calm: the area, whatever the rates said"
        );
        assert!(!calm.grant(RING_BYTES as u64, true));
        let busy = PathChoice {
            contended: || Some(true),
            ..Default::default()
        };
        assert!(!busy.stage(LONG, 0), "contended: long calls avoid the area");
        assert!(busy.grant(LONG, busy.stage(LONG, 0)), "and copy granted");
        assert!(
            busy.stage(RING_BYTES as u64, 0),
            "calls that fit stay staged"
        );
        assert!(!busy.grant(RING_BYTES as u64, true));
    }

    #[test]
    fn pressure_files_parse() {
        let text = "some avg10=1.13 avg60=3.49 avg300=8.03 total=10011335679\n\
                    full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n";
        assert_eq!(pressure::parse_some_total(text), Some(10011335679));
        assert_eq!(
            pressure::parse_some_total("some avg10=0.00 avg60=0.00 avg300=0.00 total=42"),
            Some(42)
        );
        assert_eq!(
            pressure::parse_some_total("full avg10=0.00 total=5\n"),
            None
        );
        assert_eq!(pressure::parse_some_total("some total=x"), None);
        assert_eq!(pressure::parse_some_total(""), None);
    }

    #[test]
    fn pressure_turns_with_hysteresis() {
        use pressure::{next, CALM, CONTENDED};
        assert!(!next(false, 0));
        assert!(!next(false, CONTENDED - 1));
        assert!(next(false, CONTENDED));
        assert!(next(true, CONTENDED - 1), "stays contended above CALM");
        assert!(next(true, CALM));
        assert!(!next(true, CALM - 1));
    }

    /// With more spinning threads than CPUs, the kernel's pressure
    /// figures say contended within a few windows (skipped where the
    /// kernel has no PSI).
    #[test]
    fn spinning_threads_read_as_contended() {
        if pressure::contended().is_none() {
            eprintln!("skipped: no /proc/pressure/cpu (kernel without PSI)");
            return;
        }
        let cpus = std::thread::available_parallelism().map_or(1, usize::from);
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let spinners: Vec<_> = (0..3 * cpus)
            .map(|_| {
                let stop = std::sync::Arc::clone(&stop);
                std::thread::spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        std::hint::spin_loop();
                    }
                })
            })
            .collect();
        let mut seen = false;
        for _ in 0..40 {
            std::thread::sleep(Duration::from_millis(60));
            if pressure::contended() == Some(true) {
                seen = true;
                break;
            }
        }
        stop.store(true, Ordering::Relaxed);
        for s in spinners {
            s.join().unwrap();
        }
        assert!(
            seen,
            "{} spinning threads on {cpus} CPUs never read as contended",
            3 * cpus
        );
    }
}
