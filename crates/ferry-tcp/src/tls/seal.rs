//! Sealing a batch of planned records on two threads while the connection
//! writes the sealed ones.
//!
//! A TLS sender's thread did three things in turn: copy the plaintext out
//! of the caller's memory, seal it, and `sendmsg` the records, the first
//! two costing about as much CPU as the third (`perf`, 1 MiB x 16 writes:
//! `memmove` 31 %, AES-GCM 11 %, the kernel's send path the rest). Here the
//! records of a send ([`ferry_tcp_proto::record::Writer::plan`], cut into
//! runs by [`ferry_tcp_proto::record::runs`]) go to a [`Batch`]: a
//! process-wide helper thread claims runs and seals them while the
//! connection's thread writes each run as soon as it is sealed, and seals
//! runs itself whenever nothing is ready to write (so a busy or absent
//! helper slows nothing down: the connection's thread then seals all).
//!
//! Helpers: `FERRY_SEAL_HELPERS=N` (at most 8), by default one when the
//! process may run on two or more CPUs, none otherwise. They are started
//! on first use, live as long as the process (no thread per connection:
//! every connection shares them) and sleep on a condition variable while
//! no batch waits (after a 50 µs look for the next one when batches come
//! as a stream).
//!
//! Memory: a batch names the caller's plaintext and the connection's send
//! buffer by address. Its submitter keeps both valid, and touches no part
//! of the buffer a helper may be sealing, until every run claimed has been
//! sealed: [`Batch`]'s `Drop` stops the claims and waits for that, on
//! every path out (returns, errors, unwinding).

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

// The claim protocol's atomics and parking: plain ones, or loom's when the
// model checker runs it (`--cfg ferry_loom`, see the `loom_model` tests).
#[cfg(ferry_loom)]
use loom::sync::atomic::{AtomicU8, AtomicUsize as ClaimCounter};
#[cfg(ferry_loom)]
use loom::thread::{current, park, Thread};
#[cfg(not(ferry_loom))]
use std::sync::atomic::{AtomicU8, AtomicUsize as ClaimCounter};
#[cfg(not(ferry_loom))]
use std::thread::{current, park, Thread};

use ferry_tcp_proto::record::{self, Planned, RecordError, HEADER_LEN};

use super::conn::RingAead;

/// A run's state.
const PENDING: u8 = 0;
const SEALED: u8 = 1;
const FAILED: u8 = 2;

/// Which runs of a batch are claimed and which are sealed: the protocol
/// between a batch's submitter and the helpers (model-checked with loom,
/// see `loom_model`).
///
/// - A run is sealed by the one thread whose [`Claims::claim`] returned it.
/// - Its state goes from `PENDING` to `SEALED` or `FAILED` once, with
///   release ordering after its bytes are written; the submitter reads
///   the bytes of a run only after an acquire load saw it sealed.
/// - [`Claims::close`] stops the claims and returns only once every run
///   claimed before has left `PENDING`: after it, no thread touches the
///   batch's memory.
/// - A helper unparks the submitter after each run it finishes, so a
///   submitter parked on a run claimed by a helper always wakes.
struct Claims {
    /// The next run to claim (≥ the number of runs: none left).
    next: ClaimCounter,
    state: Vec<AtomicU8>,
    /// The submitter, unparked after each run a helper seals.
    waiter: Thread,
}

impl Claims {
    /// `runs` runs, all pending; the calling thread is the submitter.
    fn new(runs: usize) -> Claims {
        Claims {
            next: ClaimCounter::new(0),
            state: (0..runs).map(|_| AtomicU8::new(PENDING)).collect(),
            waiter: current(),
        }
    }

    fn len(&self) -> usize {
        self.state.len()
    }

    /// Whether runs are left to claim.
    fn open(&self) -> bool {
        self.next.load(Ordering::Acquire) < self.len()
    }

    fn claim(&self) -> Option<usize> {
        let r = self.next.fetch_add(1, Ordering::AcqRel);
        (r < self.len()).then_some(r)
    }

    /// Says that claimed run `r` is sealed (`ok`) or failed.
    fn finish(&self, r: usize, ok: bool) {
        self.state[r].store(if ok { SEALED } else { FAILED }, Ordering::Release);
    }

    /// A helper's part: seals (`seal`) the runs it claims until none is
    /// left, unparking the submitter after each; returns how many.
    fn work(&self, seal: impl Fn(usize) -> bool) -> u64 {
        let mut n = 0;
        while let Some(r) = self.claim() {
            self.finish(r, seal(r));
            n += 1;
            self.waiter.unpark();
        }
        n
    }

    /// The submitter's part while runs are pending: seals the next
    /// unclaimed run itself, or, if none is left, parks until a helper
    /// finishes one (a bounded wait: a claimed run is being sealed).
    fn help_or_wait(&self, seal: impl FnOnce(usize) -> bool) {
        match self.claim() {
            Some(r) => self.finish(r, seal(r)),
            None => park(),
        }
    }

    /// Moves `ready` (the runs found sealed, in order) over those sealed
    /// since; `Err` at a failed run.
    fn advance(&self, ready: &mut usize) -> Result<(), ()> {
        while *ready < self.len() {
            match self.state[*ready].load(Ordering::Acquire) {
                SEALED => *ready += 1,
                FAILED => return Err(()),
                _ => break,
            }
        }
        Ok(())
    }

    /// No claims from now on; waits for those made (their sealing may be
    /// writing the buffer and reading the caller's memory).
    fn close(&self) {
        let claimed = self
            .next
            .swap(usize::MAX / 2, Ordering::AcqRel)
            .min(self.len());
        for s in &self.state[..claimed] {
            while s.load(Ordering::Acquire) == PENDING {
                park();
            }
        }
    }
}

/// What a batch shares with the helpers (behind an `Arc`: a helper may
/// look at its claims after the submitter has returned, never at the
/// memory).
struct Job {
    recs: Vec<Planned>,
    runs: Vec<Range<usize>>,
    /// The caller's plaintext: (address, length) of each range, and where
    /// each starts in their concatenation.
    src: Vec<(usize, usize)>,
    starts: Vec<usize>,
    /// The send buffer (address and length).
    buf: usize,
    buf_len: usize,
    key: RingAead,
    claims: Claims,
}

impl Job {
    /// Copies and seals the records of claimed run `r`.
    fn seal_run(&self, r: usize) -> Result<(), RecordError> {
        let recs = &self.recs[self.runs[r].clone()];
        let (Some(first), Some(last)) = (recs.first(), recs.last()) else {
            return Ok(());
        };
        let (a, b) = (first.at, last.end());
        if b > self.buf_len {
            return Err(RecordError::BadLength(b));
        }
        // SAFETY: the send buffer is valid for writes of `buf_len` bytes
        // until every claimed run is sealed (the submitter's contract, see
        // `Batch::new`), and no other reference to `[a, b)` exists while
        // this one lives: runs are disjoint ranges of the buffer (the plan
        // lays records one after another), run `r` was claimed by this
        // thread alone, and the submitter touches it only once its state
        // says sealed.
        let out = unsafe { std::slice::from_raw_parts_mut((self.buf as *mut u8).add(a), b - a) };
        let mut key = self.key.clone();
        for p in recs {
            let rec = &mut out[p.at - a..p.end() - a];
            self.gather(p.src, &mut rec[HEADER_LEN..HEADER_LEN + p.len]);
            record::seal_planned(rec, p, &mut key)?;
        }
        Ok(())
    }

    /// Copies the plaintext at `src` (in the concatenated ranges) to `dst`.
    fn gather(&self, src: usize, dst: &mut [u8]) {
        let mut i = self.starts.partition_point(|&s| s <= src).saturating_sub(1);
        let (mut off, mut at) = (src - self.starts[i], 0);
        while at < dst.len() && i < self.src.len() {
            let (addr, len) = self.src[i];
            let k = (len - off).min(dst.len() - at);
            // SAFETY: the caller's ranges are valid for reads until every
            // claimed run is sealed (the submitter's contract, see
            // `Batch::new`); they are only read, and `dst` is in the send
            // buffer, another allocation.
            let s = unsafe { std::slice::from_raw_parts((addr as *const u8).add(off), k) };
            dst[at..at + k].copy_from_slice(s);
            at += k;
            (i, off) = (i + 1, 0);
        }
    }

    /// Seals claimed run `r`; whether it went well.
    fn run(&self, r: usize) -> bool {
        let ok = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.seal_run(r)));
        matches!(ok, Ok(Ok(())))
    }

    /// A helper's part: seals runs until none is left to claim.
    fn work(&self) {
        let n = self.claims.work(|r| self.run(r));
        HELPED.fetch_add(n, Ordering::Relaxed);
    }
}

/// The planned records of one send, being sealed (see the module
/// documentation).
pub(crate) struct Batch {
    job: Arc<Job>,
    /// Runs the submitter has found sealed, in order.
    ready: usize,
}

impl Batch {
    /// A batch of `recs` (planned for the plaintext `bufs`, in the buffer
    /// at `buf`, `buf_len` bytes), cut into runs of about `run` plaintext
    /// bytes, offered to the helpers if `share`.
    ///
    /// # Safety
    ///
    /// `bufs` and `[buf, buf + buf_len)` stay valid (the latter for
    /// writes, and not otherwise accessed in the ranges of the records)
    /// until the batch is dropped; the records lie inside the buffer.
    pub(crate) unsafe fn new(
        recs: Vec<Planned>,
        bufs: &[&[u8]],
        buf: *mut u8,
        buf_len: usize,
        key: RingAead,
        run: usize,
        share: bool,
    ) -> Batch {
        let runs = record::runs(&recs, run);
        let mut starts = Vec::with_capacity(bufs.len());
        let mut at = 0;
        for b in bufs {
            starts.push(at);
            at += b.len();
        }
        let job = Arc::new(Job {
            claims: Claims::new(runs.len()),
            recs,
            runs,
            src: bufs
                .iter()
                .map(|b| (b.as_ptr() as usize, b.len()))
                .collect(),
            starts,
            buf: buf as usize,
            buf_len,
            key,
        });
        if share && job.runs.len() > 1 {
            POOL.offer(&job);
        }
        Batch { job, ready: 0 }
    }

    /// Whether every run is sealed (and found so by [`Batch::sealed_to`]).
    pub(crate) fn done(&self) -> bool {
        self.ready == self.job.runs.len()
    }

    /// The buffer offset up to which records are sealed, from the start
    /// of the batch (runs sealed in order); a failed run is an error.
    pub(crate) fn sealed_to(&mut self) -> Result<usize, RecordError> {
        let j = &self.job;
        j.claims
            .advance(&mut self.ready)
            .map_err(|()| RecordError::Seal)?;
        Ok(match self.ready {
            0 => j.recs.first().map_or(0, |p| p.at),
            k => j.recs[j.runs[k - 1].end - 1].end(),
        })
    }

    /// Seals the next unclaimed run on this thread, or, if none is left,
    /// waits until a helper seals one (a bounded wait: a claimed run is
    /// being sealed).
    pub(crate) fn help_or_wait(&self) {
        self.job.claims.help_or_wait(|r| self.job.run(r));
    }
}

impl Drop for Batch {
    fn drop(&mut self) {
        self.job.claims.close();
    }
}

/// Runs sealed by helpers since the process started.
static HELPED: AtomicU64 = AtomicU64::new(0);

/// Runs sealed by the helpers so far (tests: the helpers took part).
#[cfg(all(test, not(ferry_loom)))]
pub(crate) fn runs_helped() -> u64 {
    HELPED.load(Ordering::Relaxed)
}

/// The sealing helpers' queue: batches offered, once per helper asked.
struct Pool {
    queue: Mutex<VecDeque<Arc<Job>>>,
    ready: Condvar,
}

/// Batches in the queue (read by spinning helpers without the lock).
static QUEUED: AtomicUsize = AtomicUsize::new(0);

/// How long an idle helper looks for the next batch before it sleeps.
const SPIN: Duration = Duration::from_micros(50);
/// Batches offered at most this far apart are a stream (helpers spin).
const STREAM_GAP: Duration = Duration::from_micros(100);
/// When the last batch was offered (ns after `origin`), and whether it
/// came within [`STREAM_GAP`] of the one before.
static LAST_OFFER: AtomicU64 = AtomicU64::new(0);
static STREAMING: AtomicBool = AtomicBool::new(false);

fn origin() -> Instant {
    static ORIGIN: OnceLock<Instant> = OnceLock::new();
    *ORIGIN.get_or_init(Instant::now)
}

static POOL: Pool = Pool {
    queue: Mutex::new(VecDeque::new()),
    ready: Condvar::new(),
};

impl Pool {
    fn offer(&self, job: &Arc<Job>) {
        let helpers = helpers();
        if helpers == 0 {
            return;
        }
        let mut q = ferry_core::__private::sync::lock(&self.queue);
        // A batch no helper took in time was finished by its submitter.
        q.retain(|j| j.claims.open());
        for _ in 0..helpers.min(job.runs.len() - 1) {
            q.push_back(Arc::clone(job));
        }
        QUEUED.store(q.len(), Ordering::Release);
        drop(q);
        let now = u64::try_from(origin().elapsed().as_nanos()).unwrap_or(u64::MAX);
        let last = LAST_OFFER.swap(now, Ordering::AcqRel);
        let gap = Duration::from_nanos(now.saturating_sub(last));
        STREAMING.store(gap < STREAM_GAP, Ordering::Release);
        self.ready.notify_all();
    }

    fn helper(&self) {
        loop {
            let job = {
                // A stream of sends offers a batch every few tens of
                // microseconds (a target answering 64 KiB reads: one per
                // answer): then spin a little for the next one before
                // sleeping (measured: 50 µs beat none and 200 µs). Lone
                // transfers do not make a helper spin (it took a core from
                // the peer: 64 KiB x 1 went 0.41 -> 0.23 GB/s). No core
                // spins while idle.
                let until = Instant::now() + SPIN;
                while STREAMING.load(Ordering::Acquire)
                    && QUEUED.load(Ordering::Acquire) == 0
                    && Instant::now() < until
                {
                    for _ in 0..64 {
                        std::hint::spin_loop();
                    }
                }
                let mut q = ferry_core::__private::sync::lock(&self.queue);
                loop {
                    if let Some(j) = q.pop_front() {
                        QUEUED.store(q.len(), Ordering::Release);
                        break j;
                    }
                    q = self.ready.wait(q).unwrap_or_else(|p| p.into_inner());
                }
            };
            job.work();
        }
    }
}

/// The helpers running (started on the first call).
pub(crate) fn helpers() -> usize {
    static HELPERS: OnceLock<usize> = OnceLock::new();
    *HELPERS.get_or_init(|| {
        let cpus = std::thread::available_parallelism().map_or(1, usize::from);
        let want = std::env::var("FERRY_SEAL_HELPERS")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .unwrap_or(usize::from(cpus >= 2))
            .min(8);
        (0..want)
            .filter(|i| {
                std::thread::Builder::new()
                    .name(format!("ferry-seal-{i}"))
                    .stack_size(256 * 1024)
                    .spawn(|| POOL.helper())
                    .is_ok()
            })
            .count()
    })
}

#[cfg(all(test, not(ferry_loom)))]
mod tests {
    use super::*;
    use crate::tls::conn::RingAead;
    use ferry_tcp_proto::record::{record_len, Writer, MAX_RECORD, NONCE_LEN, OVERHEAD};
    use ring::aead::{LessSafeKey, UnboundKey, AES_128_GCM};

    fn key() -> RingAead {
        let k = UnboundKey::new(&AES_128_GCM, &[7u8; 16]).unwrap();
        RingAead(Arc::new(LessSafeKey::new(k)))
    }

    /// The records of `bufs` sealed one by one (the reference).
    fn serial(bufs: &[&[u8]], iv: [u8; NONCE_LEN]) -> Vec<u8> {
        let all = bufs.concat();
        let mut lens: Vec<usize> = bufs.iter().map(|b| b.len()).collect();
        let (mut w, mut aead, mut at) = (Writer::new(iv, 9), key(), 0);
        let mut out = Vec::new();
        loop {
            let l = record_len(lens.iter().copied());
            if l == 0 {
                return out;
            }
            let mut rec = vec![0u8; l + OVERHEAD];
            rec[HEADER_LEN..HEADER_LEN + l].copy_from_slice(&all[at..at + l]);
            let n = w.seal(&mut rec, l, 23, &mut aead).unwrap();
            out.extend_from_slice(&rec[..n]);
            at += l;
            let mut left = l;
            for x in lens.iter_mut() {
                let k = left.min(*x);
                (*x, left) = (*x - k, left - k);
            }
        }
    }

    /// A batch sealed by the helpers alone, by its submitter alone, or by
    /// both, makes the bytes of the records sealed one by one.
    #[test]
    fn a_batch_seals_what_one_thread_would() {
        let data: Vec<u8> = (0..3_000_000u32).map(|i| (i * 7 + i / 300) as u8).collect();
        let bufs: Vec<&[u8]> = vec![&data[..5], &data[5..1_048_600], &data[1_048_600..2_900_000]];
        let iv = [3u8; NONCE_LEN];
        let want = serial(&bufs, iv);
        let lens: Vec<usize> = bufs.iter().map(|b| b.len()).collect();
        let helpers = helpers();
        for (mode, share) in [("submitter", false), ("both", true), ("helpers", true)] {
            if mode == "helpers" && helpers == 0 {
                eprintln!("skipped: the helpers alone (no helper thread here)");
                continue;
            }
            let mut w = Writer::new(iv, 9);
            let mut recs = Vec::new();
            let got = w.plan(&lens, 0, 4 << 20, &mut recs).unwrap();
            assert_eq!(got, 2_900_000);
            let end = recs.last().unwrap().end();
            let mut buf = vec![0u8; (4 << 20) + 2 * MAX_RECORD];
            let before = runs_helped();
            // SAFETY: `bufs` and `buf` outlive the batch, which is dropped
            // before either is used again.
            let mut b = unsafe {
                Batch::new(
                    recs,
                    &bufs,
                    buf.as_mut_ptr(),
                    buf.len(),
                    key(),
                    64 << 10,
                    share,
                )
            };
            while !b.done() {
                b.sealed_to().unwrap();
                if b.done() {
                    break;
                }
                if mode == "helpers" {
                    std::thread::park();
                } else {
                    b.help_or_wait();
                }
            }
            assert_eq!(b.sealed_to().unwrap(), end);
            drop(b);
            assert!(buf[..end] == want[..], "{mode}: the records differ");
            if mode == "helpers" {
                assert!(runs_helped() > before);
            }
        }
    }
}

/// Model checks of [`Claims`] with loom: every interleaving (and every
/// reordering the memory orderings allow) of a submitter and a helper on
/// the real claim code, each run's bytes a loom cell (loom reports a data
/// race if two threads touch one unordered). Run by CI with the other
/// models: `RUSTFLAGS="--cfg ferry_loom" cargo test -p ferry-tcp --lib
/// loom_model`. Checked to bite: `close` without its wait fails the
/// second model (a race on the reused bytes), `work` without its unpark
/// the first (a deadlock). A relaxed store of a run's state passes: loom
/// orders memory at an `unpark` itself, so the helper's unpark after
/// each run stands in for the state's release there (std's `park` gives
/// that ordering only once the parked thread wakes, hence the release).
#[cfg(all(test, ferry_loom))]
mod loom_model {
    use super::*;
    use loom::cell::UnsafeCell;
    use loom::sync::Arc;

    /// A batch's claims and its runs' bytes (0: not sealed yet).
    struct Shared {
        claims: Claims,
        bytes: Vec<UnsafeCell<u8>>,
    }

    impl Shared {
        fn new(runs: usize) -> Arc<Shared> {
            Arc::new(Shared {
                claims: Claims::new(runs),
                bytes: (0..runs).map(|_| UnsafeCell::new(0)).collect(),
            })
        }

        /// Seals run `r` (writes its bytes); run `fail` fails instead.
        fn seal(&self, r: usize, fail: Option<usize>) -> bool {
            // SAFETY: loom checks it: only the claimer of `r` writes.
            self.bytes[r].with_mut(|p| unsafe { *p = r as u8 + 1 });
            fail != Some(r)
        }
    }

    /// The helper of the pool: works the batch once (as `Pool::helper`).
    fn helper(s: &Arc<Shared>, fail: Option<usize>) -> loom::thread::JoinHandle<()> {
        let s = Arc::clone(s);
        loom::thread::spawn(move || {
            s.claims.work(|r| s.seal(r, fail));
        })
    }

    /// The submitter's loop (as `TlsConn::seal_and_write`): it reads each
    /// run once sealed and sees the sealed bytes; it finishes (never
    /// parks for ever), and after `close` it may reuse the memory.
    #[test]
    fn the_submitter_reads_only_sealed_runs_and_always_wakes() {
        loom::model(|| {
            let runs = 3;
            let s = Shared::new(runs);
            let h = helper(&s, None);
            let (mut ready, mut read) = (0, 0);
            loop {
                s.claims.advance(&mut ready).unwrap();
                while read < ready {
                    // SAFETY: loom checks it (the run is sealed).
                    let b = s.bytes[read].with(|p| unsafe { *p });
                    assert_eq!(b, read as u8 + 1, "run {read}");
                    read += 1;
                }
                if ready == runs {
                    break;
                }
                s.claims.help_or_wait(|r| s.seal(r, None));
            }
            s.claims.close();
            for c in &s.bytes {
                // SAFETY: loom checks it (the buffer reused).
                c.with_mut(|p| unsafe { *p = 0 });
            }
            h.join().unwrap();
        });
    }

    /// A submitter leaving early (an error, a failed run) closes the
    /// claims: after `close` no helper touches the memory, and a failed
    /// run reads as failed.
    #[test]
    fn close_waits_for_every_claimed_run() {
        loom::model(|| {
            let runs = 2;
            let s = Shared::new(runs);
            let h = helper(&s, Some(0));
            s.claims.help_or_wait(|r| s.seal(r, Some(0)));
            s.claims.close();
            for c in &s.bytes {
                // SAFETY: loom checks it (the buffer reused).
                c.with_mut(|p| unsafe { *p = 0 });
            }
            // Run 0 was claimed first (by either thread) and failed: once
            // the claims are closed, the submitter's look says so.
            let mut ready = 0;
            assert!(s.claims.advance(&mut ready).is_err());
            assert_eq!(ready, 0);
            h.join().unwrap();
        });
    }
}
