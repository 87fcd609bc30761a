//! Staging rings: how the same-host path moves frames below 8 MiB.
//!
//! One cross-memory copy (`process_vm_readv`) by the target is slower than
//! a user-space memcpy (the kernel pins and maps the other process's pages
//! one by one; BENCHMARKS.md). For frames from
//! [`crate::TcpConfig::same_host_stage`] (1 byte: all) up to
//! [`crate::same_host::cma::PARALLEL_MIN`] (8 MiB) the bytes move through a small
//! shared memory area instead, as two pipelined copies made by the two
//! processes at once: the initiator copies its registered memory into a
//! slot while the target copies the previous slot into (out of) its
//! registered memory — the way MPI and NCCL move bytes between processes
//! of one host. The slots stay in the CPU caches, so each side touches the
//! slow memory once, and each copy runs on its own core.
//!
//! The area is a sealed memfd the initiator makes and offers with its
//! SAME_HOST request; the target takes it over with `pidfd_getfd` (as it
//! takes the control channel) and maps it only if it is a tmpfs memfd of
//! exactly [`AREA_LEN`] bytes that can no longer shrink or grow
//! ([`Area::adopt`]): a peer cannot make the target fault by truncating
//! it, nor by offering hugetlbfs memory whose pages run out (SIGBUS), and
//! holes it punches read as zeros.
//! Two rings, one per direction, of [`SLOTS`] slots of [`SLOT`] bytes; a
//! ring's `head` counts the slots its producer has filled, `tail` those its
//! consumer has emptied. Each side keeps its own position and reads the
//! other's counter only to learn whether a slot is ready: whatever a peer
//! writes into the area, slot addresses stay inside it, and the target
//! copies only into (out of) ranges it checked under their region guards.
//! What a peer can do to the area is no more than it can do by sending
//! garbage bytes over the socket.
//!
//! Each staged request starts at a fresh slot. An SWRITE's stream is the
//! bytes of its segments in order; an SREAD's is one verdict slot (bit `i`
//! of its first [`VERDICT_LEN`] bytes set: segment `i` was refused, no
//! bytes for it follow) and then the bytes of the accepted segments. The
//! target acknowledges an SWRITE once it has copied every slot out, and an
//! SREAD once the initiator has emptied every slot it filled: the
//! acknowledgement comes after the data, as everywhere else.

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};

// The counters of the rings and the lane: plain atomics, or loom's when
// the model checker runs the ring and lane code (`--cfg ferry_loom`, see
// the `loom_model` tests).
#[cfg(ferry_loom)]
use loom::sync::atomic::{fence, AtomicU64};
#[cfg(not(ferry_loom))]
use std::sync::atomic::{fence, AtomicU64};
use std::time::{Duration, Instant};

pub use ferry_tcp_proto::layout::area::{
    refused, verdict, ACKS, AREA_LEN, RING_BYTES, SLOT, SLOTS, VERDICT_LEN,
};
use ferry_tcp_proto::layout::area::{
    ACK_HEAD, ACK_POLLING, ACK_RING, ACK_TAIL, CONTROL, TARGET_SLEPT,
};

/// Spin this long for the other side before yielding the CPU.
const SPIN: Duration = Duration::from_micros(50);
/// Then yield the CPU between checks for this long, before sleeping.
const YIELD: Duration = Duration::from_micros(200);
/// A wait at least this long counts for [`Watch::slept`]: the other side
/// lost its CPU for a scheduler's time slice.
const DESCHEDULED: Duration = Duration::from_millis(2);
/// Longest single sleep once the other side is slow (it was descheduled,
/// or stalls): a sleep ends earlier when the other side moves its counter
/// (see [`Sleeper`]); between sleeps the wait checks that the other side
/// is alive and the stall timeout.
const NAP: Duration = Duration::from_millis(1);

/// The direction of a ring.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dir {
    /// Initiator → target (SWRITE payloads).
    ToTarget = 0,
    /// Target → initiator (SREAD verdicts and payloads).
    ToInitiator = 1,
}

/// Why a wait on the other side ended without the slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stop {
    /// No progress for the stall timeout.
    Stalled,
    /// The other side is gone (connection closed, process exited).
    Gone,
}

impl Stop {
    /// The error that ends the connection whose stream stopped: a
    /// [`Error::Timeout`](ferry_core::Error::Timeout) naming `peer`
    /// after `after`, or [`Error::PeerLost`](ferry_core::Error::PeerLost)
    /// for `gone`.
    pub fn error(self, peer: &str, after: Duration, gone: &str) -> ferry_core::Error {
        match self {
            Stop::Stalled => ferry_core::Error::Timeout {
                operation: "moving a payload through the same-host staging area".to_owned(),
                peer: Some(peer.to_owned()),
                after,
            },
            Stop::Gone => ferry_core::Error::PeerLost {
                peer: peer.to_owned(),
                reason: gone.to_owned(),
            },
        }
    }
}

/// The shared staging area of one connection, mapped in this process.
#[derive(Debug)]
pub struct Area {
    base: NonNull<u8>,
    fd: OwnedFd,
    /// Bytes mapped: [`AREA_LEN`], or with a grants page
    /// ([`crate::same_host::grant`]) [`AREA_LEN`] + [`GRANTS_LEN`].
    len: usize,
}

/// Bytes of the grants page an area may carry after its rings.
pub use crate::same_host::grant::GRANTS_LEN;

// SAFETY: the mapping is plain shared memory owned by this value until it
// is dropped; every access goes through atomics (counters) or raw copies
// whose callers hold the ring discipline (see `Ring`).
unsafe impl Send for Area {}
// SAFETY: as above.
unsafe impl Sync for Area {}

/// The seals an area must carry before a target maps it.
const SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;

impl Area {
    /// Makes a new area (initiator side): a memfd of [`AREA_LEN`] bytes
    /// (and a grants page after them, if `grants`), sealed against
    /// shrinking and growing, mapped here.
    pub fn create(grants: bool) -> Result<Area, String> {
        let len = Area::len_for(grants);
        // SAFETY: a NUL-terminated name and flags; returns a new fd or -1.
        let fd = unsafe {
            libc::memfd_create(
                c"ferry-stage".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
        if fd < 0 {
            return Err(format!(
                "memfd_create: {}",
                crate::same_host::cma::errno_name(errno())
            ));
        }
        // SAFETY: a fresh descriptor we own.
        let fd = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        // SAFETY: plain calls on our own descriptor.
        let sized = unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) };
        if sized < 0 {
            return Err(format!(
                "ftruncate: {}",
                crate::same_host::cma::errno_name(errno())
            ));
        }
        // SAFETY: as above.
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, SEALS) } < 0 {
            return Err(format!(
                "sealing: {}",
                crate::same_host::cma::errno_name(errno())
            ));
        }
        Area::map(fd, len).map_err(|e| format!("mmap: {}", crate::same_host::cma::errno_name(e)))
    }

    /// The size of an area with or without a grants page.
    pub fn len_for(grants: bool) -> usize {
        AREA_LEN + if grants { GRANTS_LEN } else { 0 }
    }

    /// Maps an area the initiator offered (target side), after checking
    /// everything the target relies on to touch it safely: a memfd on
    /// tmpfs (shared memory backed by ordinary pages, where a hole the
    /// initiator punches reads as zeros and a write allocates a page — no
    /// SIGBUS; a hugetlbfs memfd would fault once the huge-page pool is
    /// exhausted), of exactly [`AREA_LEN`] bytes, sealed against shrinking
    /// and growing (its size, and so the mapping, cannot change).
    /// `Err(errno)` otherwise: `EPERM` not sealed against shrinking or
    /// growing; `EOPNOTSUPP` not on tmpfs (hugetlbfs, any other file
    /// system); `EINVAL` not a sealable file or not exactly `AREA_LEN`
    /// bytes. With `grants` (the connection agreed them) the area must
    /// carry the grants page too: exactly [`Area::len_for`] bytes.
    pub fn adopt(fd: OwnedFd, grants: bool) -> Result<Area, i32> {
        let len = Area::len_for(grants);
        const TMPFS_MAGIC: i64 = 0x0102_1994;
        // SAFETY: a plain query on a descriptor we own.
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 {
            return Err(libc::EINVAL);
        }
        let needed = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
        if seals & needed != needed {
            return Err(libc::EPERM);
        }
        // SAFETY: `fs` is a valid out-parameter for fstatfs.
        let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
        // SAFETY: as above, on a descriptor we own.
        if unsafe { libc::fstatfs(fd.as_raw_fd(), &mut fs) } < 0 {
            return Err(libc::EINVAL);
        }
        #[allow(clippy::unnecessary_cast)] // f_type's type differs by arch
        if fs.f_type as i64 != TMPFS_MAGIC {
            return Err(libc::EOPNOTSUPP);
        }
        // SAFETY: `st` is a valid out-parameter for fstat.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } < 0
            || st.st_mode & libc::S_IFMT != libc::S_IFREG
            || st.st_size as u64 != len as u64
        {
            return Err(libc::EINVAL);
        }
        Area::map(fd, len)
    }

    fn map(fd: OwnedFd, len: usize) -> Result<Area, i32> {
        // SAFETY: a new shared mapping of `len` bytes of a file at least
        // that long (sealed against shrinking, so it stays backed).
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(errno());
        }
        let base = NonNull::new(p.cast::<u8>()).ok_or(libc::ENOMEM)?;
        Ok(Area { base, fd, len })
    }

    /// The grants page, if this area has one.
    pub fn grants(&self) -> Option<crate::same_host::grant::Page<'_>> {
        (self.len >= AREA_LEN + GRANTS_LEN).then(|| {
            // SAFETY: the page starts at AREA_LEN (a multiple of the page
            // size) inside this mapping, which outlives the borrow, and is
            // accessed only through atomics.
            unsafe { crate::same_host::grant::Page::new(self.base.as_ptr().add(AREA_LEN)) }
        })
    }

    /// The descriptor (offered to the target by its number).
    pub fn raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// One of the two rings.
    pub fn ring(&self, dir: Dir) -> Ring<'_> {
        let d = dir as usize;
        // SAFETY: the control page holds four 64-byte-aligned u64 counters
        // at offsets 0, 64, 128, 192 (page-aligned mapping); AtomicU64 has
        // the layout of u64 and every access to them is atomic.
        let counter = |i: usize| unsafe { &*self.base.as_ptr().add(i * 64).cast::<AtomicU64>() };
        // SAFETY: each counter's sleeper flag, the u64 after it on its
        // cache line (offset i * 64 + 8), as above.
        let flag = |i: usize| unsafe { &*self.base.as_ptr().add(i * 64 + 8).cast::<AtomicU64>() };
        Ring {
            head: counter(2 * d),
            tail: counter(2 * d + 1),
            head_sleeper: flag(2 * d),
            tail_sleeper: flag(2 * d + 1),
            // SAFETY: inside the mapping: CONTROL + 2 rings of slots.
            slots: unsafe { self.base.as_ptr().add(CONTROL + d * SLOTS as usize * SLOT) },
        }
    }
}

impl Area {
    /// The target's count of its waits on the initiator that had to sleep
    /// (the initiator lost its CPU): the target adds to it, the initiator
    /// reads it only to choose between the area and the kernel copy for
    /// its long frames ([`crate::same_host::choice`]). Whatever a peer
    /// writes here changes that choice and nothing else. A target that
    /// predates it leaves it at zero.
    pub fn target_slept(&self) -> &std::sync::atomic::AtomicU64 {
        // SAFETY: the control page holds this u64 at a 64-byte-aligned
        // offset no other field uses (page-aligned mapping); every access
        // to it is atomic.
        unsafe {
            &*self
                .base
                .as_ptr()
                .add(TARGET_SLEPT)
                .cast::<std::sync::atomic::AtomicU64>()
        }
    }

    /// The acknowledgement lane (see [`AckLane`]).
    pub fn acks(&self) -> AckLane<'_> {
        // SAFETY: the control page holds the three counters at 64-byte-
        // aligned offsets and ACKS u64 entries from ACK_RING (2048 + 256 ×
        // 8 = 4096 ≤ CONTROL); every access to them is atomic.
        let at = |off: usize| unsafe { &*self.base.as_ptr().add(off).cast::<AtomicU64>() };
        AckLane {
            head: at(ACK_HEAD),
            tail: at(ACK_TAIL),
            polling: at(ACK_POLLING),
            // SAFETY: inside the control page, 8-byte aligned.
            ring: unsafe { self.base.as_ptr().add(ACK_RING).cast::<AtomicU64>() },
        }
    }
}

/// The acknowledgement lane: the target posts the ids of staged requests
/// that succeeded here, instead of sending OK frames, while the
/// initiator's reader is polling (`polling` set) — the reader takes them
/// between its polls of the socket: no `sendmsg` for the target and no
/// `recvmsg` for the reader. The flag and the lane form a Dekker pair:
/// the target posts, then reads the flag, and if the reader has stopped
/// polling sends a WAKE frame on the socket; the reader clears the flag,
/// then takes what was posted, then sleeps on the socket. Whichever order
/// the two run in, no acknowledgement waits for a sleeping reader.
pub struct AckLane<'a> {
    head: &'a AtomicU64,
    tail: &'a AtomicU64,
    polling: &'a AtomicU64,
    ring: *const AtomicU64,
}

// SAFETY: a view into an Area (Send + Sync) of atomics only.
unsafe impl Send for AckLane<'_> {}
// SAFETY: as above.
unsafe impl Sync for AckLane<'_> {}

impl AckLane<'_> {
    fn entry(&self, seq: u64) -> &AtomicU64 {
        // SAFETY: (seq % ACKS) < ACKS entries, inside the control page.
        unsafe { &*self.ring.add((seq % ACKS) as usize) }
    }

    /// Target: posts `id` at position `*head` if the lane has room
    /// (`false`: full, acknowledge on the socket instead); then tells
    /// whether the initiator's reader will see it without a WAKE frame.
    pub fn post(&self, head: &mut u64, id: u64) -> Option<bool> {
        if head.wrapping_sub(self.tail.load(Ordering::Acquire)) >= ACKS {
            return None;
        }
        self.entry(*head).store(id, Ordering::Relaxed);
        *head = head.wrapping_add(1);
        self.head.store(*head, Ordering::Release);
        // Dekker: the new head is ordered before the look at the flag (the
        // reader orders its clearing of the flag before its look at the
        // head the same way), so one of the two sees the other.
        fence(Ordering::SeqCst);
        Some(self.polling.load(Ordering::Relaxed) != 0)
    }

    /// Initiator: marks its reader polling (`true`) or about to sleep, then
    /// hands every posted id from position `*tail` on to `take`.
    pub fn take(&self, polling: bool, tail: &mut u64, mut take: impl FnMut(u64)) {
        if (self.polling.load(Ordering::Relaxed) != 0) != polling {
            self.polling.store(u64::from(polling), Ordering::Relaxed);
            if !polling {
                // Dekker (see `post`): clearing the flag is ordered before
                // the look at the head below. Setting it needs no fence: a
                // target that misses it sends a WAKE frame it could have
                // spared.
                fence(Ordering::SeqCst);
            }
        }
        let head = self.head.load(Ordering::Acquire);
        // A target that claims more than the lane holds is lying: take
        // what the lane can hold (the ids then fail as unknown requests).
        let n = head.wrapping_sub(*tail).min(ACKS);
        for _ in 0..n {
            take(self.entry(*tail).load(Ordering::Relaxed));
            *tail = tail.wrapping_add(1);
        }
        if n > 0 {
            self.tail.store(*tail, Ordering::Release);
        }
    }
}

impl Drop for Area {
    fn drop(&mut self) {
        // SAFETY: our own mapping of `len` bytes; no Ring or Page outlives
        // the Area (they borrow it).
        if unsafe { libc::munmap(self.base.as_ptr().cast(), self.len) } < 0 {
            // Cannot happen for an exact-size tmpfs mapping (checked in
            // `adopt`); say so rather than leak silently.
            tracing::warn!(
                errno = %crate::same_host::cma::errno_name(errno()),
                "munmap of a staging area failed: its mapping is leaked"
            );
        }
    }
}

/// One direction of an [`Area`].
pub struct Ring<'a> {
    head: &'a AtomicU64,
    tail: &'a AtomicU64,
    /// Set while the consumer sleeps on `head` (see [`Sleeper`]).
    head_sleeper: &'a AtomicU64,
    /// Set while the producer sleeps on `tail`.
    tail_sleeper: &'a AtomicU64,
    slots: *mut u8,
}

// SAFETY: a Ring is a view into an Area (Send + Sync, borrowed for the
// Ring's life): its counters are atomics, its slots shared plain memory.
unsafe impl Send for Ring<'_> {}
// SAFETY: as above.
unsafe impl Sync for Ring<'_> {}

impl Ring<'_> {
    fn slot(&self, seq: u64) -> *mut u8 {
        // SAFETY: (seq % SLOTS) * SLOT + SLOT ≤ the ring's bytes.
        unsafe { self.slots.add((seq % SLOTS) as usize * SLOT) }
    }

    /// Whether the producer may fill slot `seq`.
    fn writable(&self, seq: u64) -> bool {
        seq.wrapping_sub(self.tail.load(Ordering::Acquire)) < SLOTS
    }

    /// Whether the consumer may empty slot `seq`.
    fn readable(&self, seq: u64) -> bool {
        self.head
            .load(Ordering::Acquire)
            .wrapping_sub(seq)
            .wrapping_sub(1)
            < SLOTS
    }

    /// Whether the consumer has emptied every slot before `end`.
    pub fn drained(&self, end: u64) -> bool {
        end.wrapping_sub(self.tail.load(Ordering::Acquire)) == 0
    }

    /// Producer: slot `*seq`, filled, goes to the consumer (its bytes are
    /// visible to it before the new `head`); advances `*seq`.
    fn publish(&self, seq: &mut u64) {
        *seq = seq.wrapping_add(1);
        self.head.store(*seq, Ordering::Release);
        self.head_waiter().wake();
    }

    /// Consumer: slot `*seq`, emptied, goes back to the producer (every
    /// read of it happens before the new `tail`); advances `*seq`.
    fn release(&self, seq: &mut u64) {
        *seq = seq.wrapping_add(1);
        self.tail.store(*seq, Ordering::Release);
        self.tail_waiter().wake();
    }

    /// The consumer's sleeper: it waits on `head`.
    fn head_waiter(&self) -> Sleeper<'_> {
        Sleeper {
            counter: self.head,
            flag: self.head_sleeper,
        }
    }

    /// The producer's sleeper: it waits on `tail`.
    pub fn tail_waiter(&self) -> Sleeper<'_> {
        Sleeper {
            counter: self.tail,
            flag: self.tail_sleeper,
        }
    }
}

/// A counter of a ring and the flag its one waiter sets while it sleeps,
/// so that a side descheduled for milliseconds (two busy CPUs) wakes its
/// peer the moment it moves the counter instead of the peer napping in
/// fixed steps: the kernel's futex on the counter's low 32 bits, which
/// works across the two processes (a shared mapping, so not a private
/// futex). The flag and the counter form a Dekker pair: the waiter sets
/// the flag, then reads the counter; the other side moves the counter,
/// then reads the flag — with a full fence between each pair, at least one
/// of them sees the other's store, so either the waiter does not sleep or
/// it is woken (`loom_model` checks this). A peer that writes the flag
/// can only cost futile wake-ups, or a sleep until [`NAP`] ends.
pub struct Sleeper<'a> {
    counter: &'a AtomicU64,
    flag: &'a AtomicU64,
}

impl Sleeper<'_> {
    /// After moving the counter: wakes a waiter that sleeps on it.
    /// Returns whether it woke (or would have woken) one.
    fn wake(&self) -> bool {
        fence(Ordering::SeqCst);
        // The waiter clears the flag itself once awake (clearing it here
        // could erase the flag of its next sleep).
        let sleeping = self.flag.load(Ordering::Relaxed) != 0;
        #[cfg(not(ferry_loom))]
        if sleeping {
            futex_wake(self.counter.as_ptr() as usize);
        }
        sleeping
    }

    /// Announces a sleep: returns the counter's value the sleep is on, or
    /// `None` if `ready()` already holds (no sleep; the flag is cleared).
    fn prepare(&self, ready: &impl Fn() -> bool) -> Option<u64> {
        self.flag.store(1, Ordering::Relaxed);
        fence(Ordering::SeqCst);
        let seen = self.counter.load(Ordering::Acquire);
        if ready() {
            self.flag.store(0, Ordering::Relaxed);
            return None;
        }
        Some(seen)
    }

    /// Ends a sleep (woken or not).
    fn done(&self) {
        self.flag.store(0, Ordering::Relaxed);
    }
}

/// Sleeps while the 32-bit word at `word` (the low half of a ring
/// counter: little-endian) equals `seen`'s low half, at most `max`
/// (spurious returns are fine: the caller checks again). An address, not
/// a reference: a sleep handed to the blocking pool may outlive the wait
/// that started it, and then its area may be gone (the call fails with
/// EFAULT; nothing is read or written by this process).
#[cfg(not(ferry_loom))]
fn futex_wait(word: usize, seen: u64, max: Duration) {
    let ts = libc::timespec {
        tv_sec: max.as_secs() as libc::time_t,
        tv_nsec: max.subsec_nanos() as libc::c_long,
    };
    // SAFETY: FUTEX_WAIT only reads the word (inside the kernel, which
    // checks the address) and sleeps; `ts` is a valid relative timeout for
    // the call's duration.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word as *const u32,
            libc::FUTEX_WAIT,
            seen as u32,
            &ts as *const libc::timespec,
        )
    };
}

#[cfg(not(ferry_loom))]
fn futex_wake(word: usize) {
    // SAFETY: FUTEX_WAKE does not touch memory; it keys the wait queue on
    // the address.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word as *const u32,
            libc::FUTEX_WAKE,
            i32::MAX,
        )
    };
}

/// One sleep of a slow wait, on `on`'s counter: on this thread where
/// `blocking` (a thread the engine owns), else on the blocking pool, so
/// that a caller's runtime is never blocked.
async fn sleep_on(on: &Sleeper<'_>, ready: &impl Fn() -> bool, blocking: bool) {
    let Some(seen) = on.prepare(ready) else {
        return;
    };
    #[cfg(not(ferry_loom))]
    {
        let word = on.counter.as_ptr() as usize;
        if blocking {
            futex_wait(word, seen, NAP);
        } else {
            let _ = tokio::task::spawn_blocking(move || futex_wait(word, seen, NAP)).await;
        }
    }
    #[cfg(ferry_loom)]
    {
        let _ = (seen, blocking);
        tokio::time::sleep(NAP).await;
    }
    on.done();
}

/// What a wait checks besides its condition.
pub struct Watch<'a> {
    /// Whether the other side is still there (checked once the wait is
    /// slow: it may make a system call).
    pub alive: &'a (dyn Fn() -> bool + Sync),
    /// Give up after this long without progress.
    pub stall: Duration,
    /// Give up at this instant whatever the progress: the deadline of the
    /// whole frame (`stall_timeout + bytes / min_rate` from its first
    /// byte, as on the socket), so that a peer publishing one slot just
    /// inside the stall timeout cannot stretch a frame without bound.
    pub deadline: Option<Instant>,
    /// Whether a slow wait may block this thread (a thread the engine
    /// owns); otherwise its sleeps run on the runtime's blocking pool.
    pub blocking: bool,
    /// Counts the waits that lasted [`DESCHEDULED`] or more: the other
    /// side lost its CPU for a time slice (see
    /// [`crate::same_host::choice::PathChoice`]).
    pub slept: Option<&'a std::sync::atomic::AtomicU64>,
}

impl Watch<'_> {
    fn expired(&self, waited: Duration) -> bool {
        waited >= self.stall || self.deadline.is_some_and(|d| Instant::now() >= d)
    }
}

/// Waits until `ready()`: spins briefly (the other side is copying a slot,
/// a few µs), then yields the CPU, then sleeps on `on`'s counter until the
/// other side moves it (at most [`NAP`] at a time, checking that the other
/// side is alive), for at most the stall timeout. Sleeping rather than
/// spinning once the other side is slow is what keeps the path fast when
/// busy processes compete for the CPUs: a spinning waiter takes the CPU
/// the side it waits for needs, a sleeping one is woken the moment it can
/// go on.
pub async fn wait(
    ready: impl Fn() -> bool,
    on: &Sleeper<'_>,
    watch: &Watch<'_>,
) -> Result<(), Stop> {
    if ready() {
        return Ok(());
    }
    let start = Instant::now();
    let mut n = 0u32;
    let mut counted = false;
    loop {
        for _ in 0..64 {
            std::hint::spin_loop();
        }
        if ready() {
            return Ok(());
        }
        n += 1;
        if n % 16 != 0 {
            continue;
        }
        let waited = start.elapsed();
        if waited < SPIN {
            continue;
        }
        // Let the runtime run other tasks (and notice cancellation).
        tokio::task::yield_now().await;
        if waited < YIELD {
            std::thread::yield_now();
            continue;
        }
        if !(watch.alive)() {
            return Err(Stop::Gone);
        }
        if watch.expired(waited) {
            return Err(Stop::Stalled);
        }
        // A wait that lasts a time slice: the other side was descheduled
        // for one (CPU pressure), not a passing preemption.
        if let (false, true, Some(slept)) = (counted, waited >= DESCHEDULED, watch.slept) {
            slept.fetch_add(1, Ordering::Relaxed);
            counted = true;
        }
        sleep_on(on, &ready, watch.blocking).await;
    }
}

/// A contiguous piece of a staged stream: `len` bytes at `ptr`, or `len`
/// bytes to skip (a refused segment) when `ptr` is null.
#[derive(Clone, Copy, Debug)]
pub struct Piece {
    /// Start (null: skip).
    pub ptr: *mut u8,
    /// Length.
    pub len: usize,
}

// SAFETY: a Piece is an address range; who dereferences it states why
// it is valid (`put` / `get`).
unsafe impl Send for Piece {}
// SAFETY: as above.
unsafe impl Sync for Piece {}

/// Copies `pieces` in order into `ring` from slot `*seq` on, publishing
/// each slot as it fills and the last one partly filled; advances `*seq`.
///
/// # Safety
///
/// Every piece is non-null and valid for reads of its length until this
/// returns; only this caller produces into `ring`, from `*seq`.
pub async unsafe fn put(
    ring: &Ring<'_>,
    seq: &mut u64,
    pieces: &[Piece],
    watch: &Watch<'_>,
) -> Result<(), Stop> {
    let mut fill = 0usize;
    for p in pieces {
        let mut at = 0usize;
        while at < p.len {
            if fill == 0 {
                let s = *seq;
                wait(|| ring.writable(s), &ring.tail_waiter(), watch).await?;
            }
            let take = (p.len - at).min(SLOT - fill);
            // SAFETY: the source by the caller's guarantee; the slot is
            // inside the area and ours until published (writable).
            unsafe {
                std::ptr::copy_nonoverlapping(p.ptr.add(at), ring.slot(*seq).add(fill), take)
            };
            fill += take;
            at += take;
            if fill == SLOT {
                ring.publish(seq);
                fill = 0;
            }
        }
    }
    if fill > 0 {
        ring.publish(seq);
    }
    Ok(())
}

/// A lock held around each copy out of a slot into memory, and the flag
/// under it that says the copies must stop (the operations failed and
/// their memory went back to the caller).
pub struct Gate<'a> {
    /// Held for each copy.
    pub lock: &'a std::sync::Mutex<()>,
    /// Set (by whoever then takes the lock) when copies must stop.
    pub closed: &'a AtomicBool,
}

/// Takes the bytes `put` produced for `pieces` (the same lengths, in the
/// same order) out of `ring` from slot `*seq` on, copying them to the
/// non-null pieces and dropping those of null ones; releases each slot
/// once emptied and advances `*seq`. With a gate, each copy happens under
/// its lock and only while it is open (`Err(Gone)` once closed).
///
/// # Safety
///
/// Every non-null piece is valid for writes of its length until this
/// returns (or, with a gate, until the gate closes); only this caller
/// consumes from `ring`, from `*seq`.
pub async unsafe fn get(
    ring: &Ring<'_>,
    seq: &mut u64,
    pieces: &[Piece],
    watch: &Watch<'_>,
    gate: Option<&Gate<'_>>,
) -> Result<(), Stop> {
    let total: usize = pieces.iter().map(|p| p.len).sum();
    let mut fill = 0usize;
    let mut moved = 0usize;
    for p in pieces {
        let mut at = 0usize;
        while at < p.len {
            if fill == 0 {
                let s = *seq;
                wait(|| ring.readable(s), &ring.head_waiter(), watch).await?;
            }
            let take = (p.len - at).min(SLOT - fill);
            if !p.ptr.is_null() {
                let _held = match gate {
                    Some(g) => {
                        let held = ferry_core::__private::sync::lock(g.lock);
                        if g.closed.load(Ordering::Acquire) {
                            return Err(Stop::Gone);
                        }
                        Some(held)
                    }
                    None => None,
                };
                // SAFETY: the slot is published (readable) and inside the
                // area; the destination by the caller's guarantee.
                unsafe { copy_out(p.ptr.add(at), ring.slot(*seq).add(fill), take) };
            }
            fill += take;
            at += take;
            moved += take;
            if fill == SLOT || moved == total {
                ring.release(seq);
                fill = 0;
            }
        }
    }
    Ok(())
}

/// Copies below this size use plain stores.
const STREAM_MIN: usize = 4096;

/// Copies `n` bytes from a slot to the destination memory, with
/// non-temporal (streaming) stores on x86-64 for copies of at least
/// [`STREAM_MIN`] bytes: the destination — the registered memory a KV
/// block lands in — is written around the caches instead of being read
/// into them first, so the consumer of a ring stops being its bottleneck
/// (BENCHMARKS.md). Ends with a store fence:
/// the bytes are visible to every core before anything this thread stores
/// (or sends) afterwards.
///
/// # Safety
///
/// `src` valid for reads and `dst` for writes of `n` bytes; they do not
/// overlap.
unsafe fn copy_out(dst: *mut u8, src: *const u8, n: usize) {
    #[cfg(target_arch = "x86_64")]
    if n >= STREAM_MIN {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
        // Plain copy up to the first 16-byte-aligned destination address.
        let head = dst.align_offset(16).min(n);
        // SAFETY: within both ranges (head ≤ n).
        unsafe { std::ptr::copy_nonoverlapping(src, dst, head) };
        let mut i = head;
        while i + 64 <= n {
            // SAFETY: [i, i + 64) is within both ranges; `dst + i` is
            // 16-byte aligned (as _mm_stream_si128 requires), the loads are
            // unaligned ones; SSE2 is part of the x86-64 baseline.
            unsafe {
                let s = src.add(i).cast::<__m128i>();
                let d = dst.add(i).cast::<__m128i>();
                let (a, b, c, e) = (
                    _mm_loadu_si128(s),
                    _mm_loadu_si128(s.add(1)),
                    _mm_loadu_si128(s.add(2)),
                    _mm_loadu_si128(s.add(3)),
                );
                _mm_stream_si128(d, a);
                _mm_stream_si128(d.add(1), b);
                _mm_stream_si128(d.add(2), c);
                _mm_stream_si128(d.add(3), e);
            }
            i += 64;
        }
        // SAFETY: the rest of both ranges; then order the streaming stores
        // before every later store of this thread.
        unsafe {
            std::ptr::copy_nonoverlapping(src.add(i), dst.add(i), n - i);
            _mm_sfence();
        }
        return;
    }
    // SAFETY: the caller's guarantee.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, n) };
}

/// The calling thread's errno.
fn errno() -> i32 {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    /// Streams `lens` (pieces of one request each, `keep[i]` false: the
    /// consumer drops piece `i`) through the ring to the initiator from one
    /// thread to another, twice in a row; returns what the consumer got.
    fn stream(area: &Area, lens: &[usize], keep: &[bool]) -> (Vec<u8>, Vec<u8>) {
        let src: Vec<u8> = (0..lens.iter().sum::<usize>())
            .map(|i| (i * 7 + i / 251) as u8)
            .collect();
        let mut dst = vec![0u8; src.len()];
        let alive = || true;
        let watch = Watch {
            alive: &alive,
            stall: Duration::from_secs(10),
            deadline: None,
            // The blocking-pool sleeps of a caller's runtime.
            blocking: false,
            slept: None,
        };
        std::thread::scope(|s| {
            let producer = s.spawn(|| {
                let ring = area.ring(Dir::ToInitiator);
                let mut seq = 0;
                let mut at = 0;
                let pieces: Vec<Piece> = lens
                    .iter()
                    .map(|&n| {
                        let p = Piece {
                            ptr: src[at..].as_ptr().cast_mut(),
                            len: n,
                        };
                        at += n;
                        p
                    })
                    .collect();
                for _ in 0..2 {
                    // SAFETY: the pieces lie in `src`, unchanged meanwhile.
                    runtime()
                        .block_on(unsafe { put(&ring, &mut seq, &pieces, &watch) })
                        .unwrap();
                }
            });
            let ring = area.ring(Dir::ToInitiator);
            let mut seq = 0;
            for _ in 0..2 {
                let mut at = 0;
                let pieces: Vec<Piece> = lens
                    .iter()
                    .zip(keep)
                    .map(|(&n, &k)| {
                        let p = Piece {
                            ptr: if k {
                                dst[at..].as_mut_ptr()
                            } else {
                                std::ptr::null_mut()
                            },
                            len: n,
                        };
                        at += n;
                        p
                    })
                    .collect();
                // SAFETY: the non-null pieces lie in `dst`, ours.
                runtime()
                    .block_on(unsafe { get(&ring, &mut seq, &pieces, &watch, None) })
                    .unwrap();
            }
            producer.join().unwrap();
        });
        (src, dst)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// The streaming copy moves exactly the bytes of a plain copy, for
        /// any destination alignment and length.
        #[test]
        fn copy_out_is_a_plain_copy(len in 0usize..70_000, d in 0usize..64, s in 0usize..64) {
            let src: Vec<u8> = (0..len + 64).map(|i| (i % 253) as u8).collect();
            let mut dst = vec![0xeeu8; len + 128];
            // SAFETY: both ranges lie in their vectors and do not overlap.
            unsafe { copy_out(dst[d..].as_mut_ptr(), src[s..].as_ptr(), len) };
            prop_assert!(dst[..d].iter().all(|b| *b == 0xee));
            prop_assert!(dst[d..d + len] == src[s..s + len]);
            prop_assert!(dst[d + len..].iter().all(|b| *b == 0xee));
        }

        /// Streams of any shape cross the ring between two threads byte
        /// for byte, in step from one request to the next; pieces the
        /// consumer drops leave its memory untouched.
        #[test]
        fn streams_cross_between_threads_exactly(
            shape in proptest::collection::vec((1usize..150_000, any::<bool>()), 1..5)
        ) {
            let area = Area::create(false).unwrap();
            let lens: Vec<usize> = shape.iter().map(|s| s.0).collect();
            let keep: Vec<bool> = shape.iter().map(|s| s.1).collect();
            let (src, dst) = stream(&area, &lens, &keep);
            let mut at = 0;
            for (n, k) in lens.iter().zip(&keep) {
                if *k {
                    prop_assert!(dst[at..at + n] == src[at..at + n]);
                } else {
                    prop_assert!(dst[at..at + n].iter().all(|b| *b == 0));
                }
                at += n;
            }
        }
    }

    #[test]
    fn waits_end_when_the_other_side_is_gone_or_stalls() {
        let rt = runtime();
        let area = Area::create(false).unwrap();
        let ring = area.ring(Dir::ToTarget);
        let on = ring.tail_waiter();
        let gone = || false;
        let w = Watch {
            alive: &gone,
            stall: Duration::from_secs(10),
            deadline: None,
            blocking: true,
            slept: None,
        };
        let t = Instant::now();
        assert_eq!(rt.block_on(wait(|| false, &on, &w)), Err(Stop::Gone));
        assert!(t.elapsed() < Duration::from_secs(5));
        let alive = || true;
        let w = Watch {
            alive: &alive,
            stall: Duration::from_millis(30),
            deadline: None,
            blocking: true,
            slept: None,
        };
        let t = Instant::now();
        assert_eq!(rt.block_on(wait(|| false, &on, &w)), Err(Stop::Stalled));
        assert!(t.elapsed() >= Duration::from_millis(30));
        assert_eq!(rt.block_on(wait(|| true, &on, &w)), Ok(()));
    }

    /// A frame's deadline ends a stream that keeps making progress, just
    /// inside the stall timeout each time: the consumer gives up at the
    /// deadline, not after the stall timeout of the last slot.
    #[test]
    fn the_frame_deadline_ends_a_trickling_stream() {
        let area = Area::create(false).unwrap();
        let alive = || true;
        let stall = Duration::from_millis(200);
        let src = vec![3u8; 8 * SLOT];
        let mut dst = vec![0u8; 8 * SLOT];
        let start = Instant::now();
        let w = Watch {
            alive: &alive,
            stall,
            deadline: Some(start + Duration::from_millis(500)),
            blocking: true,
            slept: None,
        };
        let (r, took) = std::thread::scope(|s| {
            s.spawn(|| {
                let ring = area.ring(Dir::ToTarget);
                let quick = Watch {
                    alive: &alive,
                    stall: Duration::from_secs(1),
                    deadline: None,
                    blocking: true,
                    slept: None,
                };
                let mut seq = 0;
                // One slot every 150 ms: always inside the stall timeout.
                for i in 0..8 {
                    std::thread::sleep(Duration::from_millis(150));
                    let piece = [Piece {
                        ptr: src[i * SLOT..].as_ptr().cast_mut(),
                        len: SLOT,
                    }];
                    // SAFETY: the piece lies in `src`, unchanged meanwhile.
                    let put = unsafe { put(&ring, &mut seq, &piece, &quick) };
                    if runtime().block_on(put).is_err() || start.elapsed() > Duration::from_secs(3)
                    {
                        break;
                    }
                }
            });
            let ring = area.ring(Dir::ToTarget);
            let out = [Piece {
                ptr: dst.as_mut_ptr(),
                len: dst.len(),
            }];
            let mut seq = 0;
            // SAFETY: `dst` is ours.
            let r = runtime().block_on(unsafe { get(&ring, &mut seq, &out, &w, None) });
            (r, start.elapsed())
        });
        assert_eq!(r, Err(Stop::Stalled));
        // 8 slots at 150 ms would end after 1.2 s; the deadline is 0.5 s.
        assert!(
            took >= Duration::from_millis(500) && took < Duration::from_millis(1100),
            "gave up after {took:?}"
        );
    }

    /// Once its gate is closed, a consumer copies nothing more out.
    #[test]
    fn a_closed_gate_stops_the_copies() {
        let area = Area::create(false).unwrap();
        let rt = runtime();
        let alive = || true;
        let w = Watch {
            alive: &alive,
            stall: Duration::from_secs(10),
            deadline: None,
            blocking: true,
            slept: None,
        };
        let src = vec![7u8; 1000];
        let mut dst = vec![0u8; 1000];
        let ring = area.ring(Dir::ToInitiator);
        let (mut p, mut c) = (0, 0);
        let piece = [Piece {
            ptr: src.as_ptr().cast_mut(),
            len: src.len(),
        }];
        // SAFETY: `src` is ours.
        rt.block_on(unsafe { put(&ring, &mut p, &piece, &w) })
            .unwrap();
        let lock = std::sync::Mutex::new(());
        let closed = AtomicBool::new(true);
        let gate = Gate {
            lock: &lock,
            closed: &closed,
        };
        let out = [Piece {
            ptr: dst.as_mut_ptr(),
            len: dst.len(),
        }];
        // SAFETY: `dst` is ours.
        let r = rt.block_on(unsafe { get(&ring, &mut c, &out, &w, Some(&gate)) });
        assert_eq!(r, Err(Stop::Gone));
        assert!(dst.iter().all(|b| *b == 0));
    }

    /// The lane: posts report whether the reader polls, a full lane
    /// refuses, ids come out in order, and a target claiming more than the
    /// lane holds yields at most a lane's worth.
    #[test]
    fn the_lane_hands_over_ids_in_order_and_reports_the_reader() {
        let area = Area::create(false).unwrap();
        let lane = area.acks();
        let (mut head, mut tail) = (0u64, 0u64);
        let mut got = Vec::new();
        assert_eq!(lane.post(&mut head, 7), Some(false));
        lane.take(true, &mut tail, |id| got.push(id));
        assert_eq!(got, [7]);
        for id in 0..ACKS {
            assert_eq!(lane.post(&mut head, 100 + id), Some(true));
        }
        assert_eq!(lane.post(&mut head, 9), None, "full");
        got.clear();
        lane.take(false, &mut tail, |id| got.push(id));
        assert_eq!(got, (100..100 + ACKS).collect::<Vec<_>>());
        assert_eq!(lane.post(&mut head, 8), Some(false));
        // A lying head: at most ACKS entries are taken.
        let liar = area.acks();
        liar.head.store(tail + 10 * ACKS, Ordering::SeqCst);
        got.clear();
        lane.take(true, &mut tail, |id| got.push(id));
        assert_eq!(got.len() as u64, ACKS);
    }

    /// Posting from one thread while another polls and sometimes stops
    /// polling: every id is taken either while polling or after a post
    /// that reported a sleeping reader (which then gets a WAKE) — none is
    /// left behind.
    #[test]
    fn no_acknowledgement_waits_for_a_sleeping_reader() {
        let area = Area::create(false).unwrap();
        let n = 20_000u64;
        let wakes = AtomicU64::new(0);
        let done = AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| {
                let lane = area.acks();
                let mut head = 0;
                for id in 1..=n {
                    loop {
                        match lane.post(&mut head, id) {
                            Some(true) => break,
                            Some(false) => {
                                wakes.fetch_add(1, Ordering::SeqCst);
                                break;
                            }
                            None => std::hint::spin_loop(),
                        }
                    }
                }
                done.store(true, Ordering::SeqCst);
            });
            let lane = area.acks();
            let mut tail = 0;
            let mut next = 1;
            let mut seen_wakes = 0;
            let mut round = 0u64;
            while next <= n {
                round += 1;
                // Poll a while, then "sleep": stop polling and take the rest.
                let polling = round % 3 != 0;
                lane.take(polling, &mut tail, |id| {
                    assert_eq!(id, next);
                    next += 1;
                });
                if !polling {
                    // Asleep until a WAKE (or the producer ends).
                    while wakes.load(Ordering::SeqCst) == seen_wakes {
                        if done.load(Ordering::SeqCst) && wakes.load(Ordering::SeqCst) == seen_wakes
                        {
                            assert_eq!(
                                lane.head.load(Ordering::SeqCst),
                                tail,
                                "an acknowledgement was left for a sleeping reader"
                            );
                            break;
                        }
                        std::hint::spin_loop();
                    }
                    seen_wakes = wakes.load(Ordering::SeqCst);
                }
            }
        });
    }
}

/// Model checks of the ring counters and the acknowledgement lane with
/// `loom`: every interleaving (and every reordering the memory orderings
/// allow) of the real `Ring` and `AckLane` code on loom's atomics. Run by
/// CI as `RUSTFLAGS="--cfg ferry_loom" cargo test -p ferry-tcp --lib
/// loom_model` (with fewer slots and lane entries, see [`SLOTS`], [`ACKS`]).
#[cfg(all(test, ferry_loom))]
mod loom_model {
    use super::*;
    use loom::sync::Arc;

    /// The counters of one ring, and one stamp per slot standing for its
    /// bytes (relaxed: only the ring's own orderings may make them visible).
    struct RingMem {
        head: AtomicU64,
        tail: AtomicU64,
        head_sleeper: AtomicU64,
        tail_sleeper: AtomicU64,
        stamps: Vec<AtomicU64>,
    }

    impl RingMem {
        fn new() -> Arc<RingMem> {
            Arc::new(RingMem {
                head: AtomicU64::new(0),
                tail: AtomicU64::new(0),
                head_sleeper: AtomicU64::new(0),
                tail_sleeper: AtomicU64::new(0),
                stamps: (0..SLOTS).map(|_| AtomicU64::new(0)).collect(),
            })
        }
        fn ring(&self) -> Ring<'_> {
            Ring {
                head: &self.head,
                tail: &self.tail,
                head_sleeper: &self.head_sleeper,
                tail_sleeper: &self.tail_sleeper,
                slots: std::ptr::null_mut(),
            }
        }
        fn stamp(&self, seq: u64) -> &AtomicU64 {
            &self.stamps[(seq % SLOTS) as usize]
        }
    }

    /// Producer and consumer of one ring, wrapping around it: the consumer
    /// sees each slot's contents as the producer left them when it
    /// published the slot (so publishing orders the bytes before the
    /// counter), and the producer never refills a slot the consumer has not
    /// released (so it never sees a later stamp).
    #[test]
    fn the_ring_hands_each_slot_over_once_in_order() {
        loom::model(|| {
            let n = SLOTS + 1;
            let mem = RingMem::new();
            let m = Arc::clone(&mem);
            let producer = loom::thread::spawn(move || {
                let ring = m.ring();
                let mut seq = 0;
                for i in 0..n {
                    while !ring.writable(seq) {
                        loom::thread::yield_now();
                    }
                    m.stamp(seq).store(i + 1, Ordering::Relaxed);
                    ring.publish(&mut seq);
                }
            });
            let ring = mem.ring();
            let mut seq = 0;
            for i in 0..n {
                while !ring.readable(seq) {
                    loom::thread::yield_now();
                }
                assert_eq!(mem.stamp(seq).load(Ordering::Relaxed), i + 1, "slot {seq}");
                ring.release(&mut seq);
            }
            producer.join().unwrap();
            assert!(ring.drained(n));
        });
    }

    /// The sleeper's Dekker pair: a waiter that decides to sleep on a
    /// counter value the other side has already moved past is woken (the
    /// futex then returns at once too, but only if the value differs in
    /// the kernel's view: the wake is what the model proves).
    #[test]
    fn a_sleeping_waiter_is_never_missed() {
        loom::model(|| {
            let mem = RingMem::new();
            let m = Arc::clone(&mem);
            let mover = loom::thread::spawn(move || {
                // What `publish` does: move the counter, then wake.
                m.head.store(1, Ordering::Release);
                m.ring().head_waiter().wake()
            });
            let ring = mem.ring();
            let on = ring.head_waiter();
            let slept_on = on.prepare(&|| ring.readable(0));
            let woke = mover.join().unwrap();
            if slept_on == Some(0) {
                assert!(woke, "a waiter slept on a value nobody woke it from");
            }
            on.done();
        });
    }

    struct LaneMem {
        head: AtomicU64,
        tail: AtomicU64,
        polling: AtomicU64,
        entries: Vec<AtomicU64>,
    }

    impl LaneMem {
        fn new() -> Arc<LaneMem> {
            Arc::new(LaneMem {
                head: AtomicU64::new(0),
                tail: AtomicU64::new(0),
                polling: AtomicU64::new(0),
                entries: (0..ACKS).map(|_| AtomicU64::new(0)).collect(),
            })
        }
        fn lane(&self) -> AckLane<'_> {
            AckLane {
                head: &self.head,
                tail: &self.tail,
                polling: &self.polling,
                ring: self.entries.as_ptr(),
            }
        }
    }

    /// The Dekker pair: the reader polls, then says it is about to sleep
    /// and takes what was posted; the target posts one id meanwhile.
    /// Whatever the interleaving, either the reader took the id before
    /// sleeping, or the target was told to send a WAKE frame — no
    /// acknowledgement waits for a sleeping reader.
    #[test]
    fn no_acknowledgement_waits_for_a_sleeping_reader() {
        loom::model(|| {
            let mem = LaneMem::new();
            let m = Arc::clone(&mem);
            let target = loom::thread::spawn(move || {
                let mut head = 0;
                m.lane().post(&mut head, 7)
            });
            let lane = mem.lane();
            let mut tail = 0;
            let mut got = Vec::new();
            lane.take(true, &mut tail, |id| got.push(id));
            lane.take(false, &mut tail, |id| got.push(id));
            // The reader sleeps on the socket now.
            let posted = target.join().unwrap();
            assert!(
                got == [7] || posted == Some(false),
                "took {got:?}, the target was told {posted:?}"
            );
        });
    }

    /// More acknowledgements than the lane holds: each id arrives exactly
    /// once — through the lane in order, or (lane full) on the socket —
    /// and the reader never takes an entry the target has not written.
    #[test]
    fn a_full_lane_loses_and_repeats_nothing() {
        loom::model(|| {
            let ids = ACKS + 1;
            let mem = LaneMem::new();
            let m = Arc::clone(&mem);
            let target = loom::thread::spawn(move || {
                let lane = m.lane();
                let mut head = 0;
                let mut on_socket = Vec::new();
                for id in 1..=ids {
                    if lane.post(&mut head, id).is_none() {
                        on_socket.push(id);
                    }
                }
                on_socket
            });
            let lane = mem.lane();
            let mut tail = 0;
            let mut got = Vec::new();
            for _ in 0..2 {
                lane.take(true, &mut tail, |id| got.push(id));
            }
            let on_socket = target.join().unwrap();
            lane.take(false, &mut tail, |id| got.push(id));
            assert!(got.windows(2).all(|w| w[0] < w[1]), "lane order: {got:?}");
            let mut all: Vec<u64> = got.iter().chain(&on_socket).copied().collect();
            all.sort_unstable();
            assert_eq!(
                all,
                (1..=ids).collect::<Vec<_>>(),
                "lane {got:?}, socket {on_socket:?}"
            );
        });
    }
}
