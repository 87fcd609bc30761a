//! Socket I/O: vectored reads straight into caller memory with a bounded
//! busy-poll before sleeping, and vectored writes.
//!
//! Reading a payload also reads up to one following frame header in the same
//! system call (`readv` of `[payload, header]`), so a pipelined stream of
//! frames costs about one call per frame while payload bytes still land
//! directly in their destination.
//!
//! Registered memory is addressed through [`Bytes`] — a raw pointer and a
//! length — and handed to `recvmsg(2)` / `sendmsg(2)` as `iovec`s, so no
//! Rust reference to registered memory ever exists: peers (and other
//! connections) may read and write it concurrently, the way a NIC's DMA
//! does, without breaking Rust's aliasing rules.
//! (The one CPU access: a [`FrameReader`] with its lookahead on copies
//! bytes it read past a header into the destination, through raw pointers;
//! see [`FrameReader::set_lookahead`].)

use std::future::Future;
use std::io;
use std::marker::PhantomData;
use std::os::fd::AsRawFd;
use std::task::Poll;
use std::time::{Duration, Instant};

use crate::stream::Stream;

use crate::frame::HEADER_LEN;

/// Most iovecs per system call (Linux `IOV_MAX`).
const IOV_MAX: usize = 1024;

/// A byte range for socket I/O: a pointer and a length, borrowed for `'a`
/// from a Rust buffer, or (unsafely) made from registered memory.
#[derive(Clone, Copy, Debug)]
pub struct Bytes<'a> {
    ptr: *mut u8,
    len: usize,
    _life: PhantomData<&'a mut [u8]>,
}

// SAFETY: a `Bytes` is an address range; the memory it names is valid for
// `'a` by construction (`from_mut` / `from_ref` borrow it, `from_raw`'s
// caller guarantees it), and it is only ever accessed by the kernel inside a
// system call, never through a Rust reference. Moving the range to another
// thread changes nothing about that.
unsafe impl Send for Bytes<'_> {}
// SAFETY: as above; sharing the address range is harmless.
unsafe impl Sync for Bytes<'_> {}

impl<'a> Bytes<'a> {
    /// A range the kernel may write into.
    pub fn from_mut(s: &'a mut [u8]) -> Self {
        Bytes {
            ptr: s.as_mut_ptr(),
            len: s.len(),
            _life: PhantomData,
        }
    }

    /// A range the kernel only reads (only ever passed to `sendmsg`).
    pub fn from_ref(s: &'a [u8]) -> Self {
        Bytes {
            ptr: s.as_ptr() as *mut u8,
            len: s.len(),
            _life: PhantomData,
        }
    }

    /// An empty range.
    pub fn empty() -> Self {
        Bytes {
            ptr: std::ptr::NonNull::<u8>::dangling().as_ptr(),
            len: 0,
            _life: PhantomData,
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the range is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The range without its first `n` bytes (`n ≤ len`).
    fn skip(self, n: usize) -> Self {
        let n = n.min(self.len);
        Bytes {
            // `wrapping_add` keeps this safe code; n ≤ len keeps it in range.
            ptr: self.ptr.wrapping_add(n),
            len: self.len - n,
            _life: PhantomData,
        }
    }

    /// Appends the bytes of the range to `out`.
    ///
    /// Reads the memory with the CPU instead of `sendmsg(2)`: the same
    /// reads of the same range, under the same contract (the range is
    /// valid for reads while the value exists: `from_ref` / `from_mut`
    /// borrow it, `from_raw`'s caller guarantees it).
    pub fn append_to(&self, out: &mut Vec<u8>) {
        // SAFETY: `[ptr, ptr+len)` is valid for reads for the value's
        // lifetime (see above), and `out`'s buffer is another allocation.
        // Nothing writes the range through a Rust reference meanwhile; a
        // remote peer or the kernel may change registered memory as for
        // `sendmsg`, which sends whatever bytes are there (u8 has no
        // invalid values).
        out.extend_from_slice(unsafe { std::slice::from_raw_parts(self.ptr, self.len) });
    }

    fn iovec(self) -> libc::iovec {
        libc::iovec {
            iov_base: self.ptr.cast(),
            iov_len: self.len,
        }
    }
}

impl Bytes<'static> {
    /// A range of raw memory.
    ///
    /// # Safety
    ///
    /// `[ptr, ptr+len)` must stay valid for reads (and, if it is read into,
    /// for writes) for as long as the value or a copy of it is used — in
    /// this crate, a [`ferry_core::RegionGuard`] covering it is held.
    pub unsafe fn from_raw(ptr: *mut u8, len: usize) -> Self {
        Bytes {
            ptr,
            len,
            _life: PhantomData,
        }
    }
}

fn timed_out() -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, "peer made no progress in time")
}

fn too_slow() -> io::Error {
    io::Error::new(
        io::ErrorKind::TimedOut,
        "peer moved the payload slower than the minimum rate",
    )
}

pub use ferry_tcp_proto::time::{Pace, Time};

/// This driver's clock as the core reads it: the time since the first
/// look (a process-wide origin on the monotonic clock).
#[inline]
pub fn now() -> Time {
    let nanos = origin().elapsed().as_nanos();
    Time::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX))
}

/// `t` of [`now`]'s clock as an instant (a year from now if the clock
/// cannot go that far).
pub fn instant(t: Time) -> Instant {
    origin()
        .checked_add(Duration::from_nanos(t.as_nanos()))
        .unwrap_or_else(|| Instant::now() + Duration::from_secs(365 * 86_400))
}

/// When moving `bytes` at `pace`, starting now, must have finished.
pub fn deadline(pace: &Pace, bytes: u64) -> Instant {
    instant(pace.deadline(now(), bytes))
}

fn origin() -> Instant {
    static ORIGIN: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    *ORIGIN.get_or_init(Instant::now)
}

/// The wait allowed now for the next progress toward `deadline` (an
/// error once it has passed).
fn wait(pace: &Pace, deadline: Time) -> io::Result<Duration> {
    pace.wait(now(), deadline).ok_or_else(too_slow)
}

fn retry(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
    )
}

/// `recvmsg(2)` or `sendmsg(2)` (with `MSG_NOSIGNAL`) of `iov` on `stream`'s
/// socket, non-blocking.
fn sys_msg(stream: &Stream, iov: &mut [libc::iovec], send: bool) -> io::Result<usize> {
    if iov.is_empty() {
        return Ok(0);
    }
    if let Some(tls) = stream.tls() {
        return tls_msg(tls, iov, send);
    }
    // SAFETY: an all-zero msghdr is a valid "no address, no control data"
    // header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_mut_ptr();
    msg.msg_iovlen = iov.len() as _;
    let fd = stream.as_raw_fd();
    // SAFETY: `fd` is the stream's open socket (borrowed for the call);
    // every iovec names memory that is valid for the access: Rust buffers
    // borrowed by their `Bytes`, or registered memory kept registered by a
    // RegionGuard held by the caller (see `Bytes::from_raw`). The kernel
    // bounds its accesses by the iovec lengths.
    let r = unsafe {
        if send {
            libc::sendmsg(fd, &msg, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT)
        } else {
            libc::recvmsg(fd, &mut msg, libc::MSG_DONTWAIT)
        }
    };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r as usize)
    }
}

/// [`sys_msg`] under TLS: the same ranges, through the session (see
/// [`crate::tls::conn`]).
fn tls_msg(tls: &crate::tls::conn::TlsConn, iov: &[libc::iovec], send: bool) -> io::Result<usize> {
    if send {
        let bufs: Vec<io::IoSlice<'_>> = iov
            .iter()
            .map(|v| {
                // SAFETY: as for `sendmsg` in `sys_msg`: each iovec names
                // memory valid for reads of its length for this call (a
                // Rust buffer borrowed by its `Bytes`, or registered memory
                // a caller's RegionGuard keeps registered); rustls only
                // copies out of it.
                let b = unsafe { std::slice::from_raw_parts(v.iov_base as *const u8, v.iov_len) };
                io::IoSlice::new(b)
            })
            .collect();
        tls.send(&bufs)
    } else {
        // SAFETY: as for `recvmsg` in `sys_msg`: each iovec names memory
        // valid for writes of its length for this call.
        unsafe { tls.recv(iov) }
    }
}

/// One non-blocking read into `segs` (the first from `first_off`) then
/// `tail` — the tail only if every segment fits in this call.
fn raw_read(
    stream: &Stream,
    segs: &[Bytes<'_>],
    first_off: usize,
    tail: Bytes<'_>,
) -> io::Result<usize> {
    let n = segs.len().min(IOV_MAX - 1);
    let mut iov: Vec<libc::iovec> = Vec::with_capacity(n + 1);
    for (i, s) in segs[..n].iter().enumerate() {
        let s = if i == 0 { s.skip(first_off) } else { *s };
        if !s.is_empty() {
            iov.push(s.iovec());
        }
    }
    if n == segs.len() && !tail.is_empty() {
        iov.push(tail.iovec());
    }
    sys_msg(stream, &mut iov, false)
}

/// Longest stretch a busy-polling reader keeps its worker thread without
/// yielding to the runtime (other tasks on that worker wait at most this
/// long; see [`read_with`]).
pub const SPIN_SLICE: Duration = Duration::from_micros(20);

/// Extends a reader's busy-poll past its base window for as long as it
/// returns true (checked between attempts; it must turn false on its own,
/// e.g. a bounded time after the connection's last activity, so that an
/// idle connection sleeps).
pub type SpinWhile = std::sync::Arc<dyn Fn() -> bool + Send + Sync>;

/// Called with `true` on every round of polling and with `false` right
/// before a read sleeps in the kernel (see [`crate::same_host::stage::AckLane`]: the
/// initiator's reader takes acknowledgements posted in shared memory).
/// Returns whether it completed something: the poller then yields at once,
/// so that the task it woke runs now rather than after the next slice.
pub type SpinHook = std::sync::Arc<dyn Fn(bool) -> bool + Send + Sync>;

/// A pause in polling that is not a sleep: while `active` says so, a
/// reader whose polling has ended waits for the socket or for `nudge`
/// without calling its hook with `false` (so it still counts as polling:
/// the initiator's reader while a caller moves a long stream through the
/// staging area, which nudges it when done), then polls again.
#[derive(Clone)]
pub struct Pause {
    /// Whether to pause rather than sleep.
    pub active: std::sync::Arc<dyn Fn() -> bool + Send + Sync>,
    /// Ends a pause (a permit given while no pause waits ends the next).
    pub nudge: std::sync::Arc<tokio::sync::Notify>,
}

/// The polling / sleeping / timeout logic of every read: `attempt` is one
/// non-blocking read. Polls for up to `spin` first, and then for as long
/// as `extend` says (yielding to other tasks between attempts), then sleeps
/// until readable; waiting longer than `timeout` (if given) is a
/// `TimedOut` error. `Ok(0)` is EOF.
#[allow(clippy::too_many_arguments)]
async fn read_with<F>(
    stream: &Stream,
    mut attempt: F,
    spin: Duration,
    extend: Option<&SpinWhile>,
    hook: Option<&SpinHook>,
    pause: Option<&Pause>,
    timeout: Option<Duration>,
) -> io::Result<usize>
where
    F: FnMut() -> io::Result<usize>,
{
    // A busy stream never returns Pending on its own: take part in Tokio's
    // cooperative budget so other tasks (and timers) keep running.
    tokio::task::consume_budget().await;
    match attempt() {
        Err(e) if retry(&e) => {}
        other => return other,
    }
    let until = timeout.map(|t| tokio::time::Instant::now() + t);
    loop {
        if let Some(n) = spin_phase(&mut attempt, spin, extend, hook).await {
            return n;
        }
        let Some(p) = pause.filter(|p| (p.active)()) else {
            break;
        };
        let nudged = p.nudge.notified();
        let mut nudged = std::pin::pin!(nudged);
        nudged.as_mut().enable();
        if !(p.active)() {
            continue;
        }
        let expired = async {
            match until {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            r = stream.readable() => {
                r?;
                match stream.try_io(tokio::io::Interest::READABLE, &mut attempt) {
                    Err(e) if retry(&e) => {}
                    other => return other,
                }
            }
            _ = &mut nudged => {}
            _ = expired => return Err(timed_out()),
        }
    }
    // What is left of `timeout` (a pause took some of it).
    let left = until.map(|at| at.saturating_duration_since(tokio::time::Instant::now()));
    sleep_phase(stream, attempt, extend, hook, left).await
}

/// The polling part of [`read_with`]: `Some` with the read's result, or
/// `None` once polling is over.
async fn spin_phase<F>(
    attempt: &mut F,
    spin: Duration,
    extend: Option<&SpinWhile>,
    hook: Option<&SpinHook>,
) -> Option<io::Result<usize>>
where
    F: FnMut() -> io::Result<usize>,
{
    if !spin.is_zero() || extend.is_some() {
        let start = Instant::now();
        // Yield at once (a task this one just woke runs next on this
        // worker), then only every SPIN_SLICE: each yield re-queues the
        // task and makes the runtime wake a parked worker thread to steal
        // it, and those wake-ups (tens of µs of CPU each on a VM) cost the
        // peer process its core.
        let mut yielded = None::<Instant>;
        loop {
            let now = Instant::now();
            // A reader that serves blocked callers polls only while
            // requests are outstanding (ferry_core::assist::quiet): the
            // callers poll when they wait. Its sleep arms a quiet socket
            // (crate::quiet), which a caller driving it disarms, so the
            // answers it reads wake no runtime thread. (With the socket
            // registered with the runtime for good, every answer woke one,
            // and a runtime thread polling between calls measured better.)
            let base = if ferry_core::assist::quiet() {
                Duration::ZERO
            } else {
                spin
            };
            if now.duration_since(start) >= base && !extend.is_some_and(|f| f()) {
                break;
            }
            let woke = hook.is_some_and(|h| h(true));
            // A blocked caller waiting to read its own answer takes over
            // at the yield (ferry_core::assist).
            if woke
                || yielded.is_none_or(|y| now.duration_since(y) >= SPIN_SLICE)
                || ferry_core::assist::should_yield()
            {
                tokio::task::yield_now().await;
                yielded = Some(Instant::now());
            } else {
                std::hint::spin_loop();
            }
            match attempt() {
                Err(e) if retry(&e) => {}
                other => return Some(other),
            }
        }
    }
    None
}

/// The sleeping part of [`read_with`]: tells the hook, then waits until
/// readable (or for `timeout`).
async fn sleep_phase<F>(
    stream: &Stream,
    mut attempt: F,
    extend: Option<&SpinWhile>,
    hook: Option<&SpinHook>,
    timeout: Option<Duration>,
) -> io::Result<usize>
where
    F: FnMut() -> io::Result<usize>,
{
    if let Some(h) = hook {
        if h(false) {
            tokio::task::yield_now().await;
        }
    }
    let wait = async {
        // Told the hook we poll (a blocked caller drives us): tell it we
        // sleep again before we do.
        let mut polling = false;
        loop {
            // Driven by a blocked caller whose answer is due: poll, don't
            // wait for readiness (ferry_core::assist::driven).
            let readable = stream.readable();
            let mut readable = std::pin::pin!(readable);
            let ready = std::future::poll_fn(|cx| {
                // Checked before waiting: a quiet stream's wait arms its
                // readiness, which then wakes a runtime thread for the
                // answer the caller reads itself.
                if ferry_core::assist::driven() && extend.is_some_and(|f| f()) {
                    return Poll::Ready(None);
                }
                match readable.as_mut().poll(cx) {
                    Poll::Ready(r) => Poll::Ready(Some(r)),
                    Poll::Pending if polling => {
                        polling = false;
                        if hook.is_some_and(|h| h(false)) {
                            // It took work on the way: look again.
                            Poll::Ready(None)
                        } else {
                            Poll::Pending
                        }
                    }
                    Poll::Pending => Poll::Pending,
                }
            })
            .await;
            match ready {
                Some(r) => {
                    r?;
                    match stream.try_io(tokio::io::Interest::READABLE, &mut attempt) {
                        Err(e) if retry(&e) => continue,
                        other => return other,
                    }
                }
                None => {
                    // Polled by a blocked caller from here (the readiness
                    // armed when it last slept would only wake a runtime
                    // thread).
                    stream.unarm_readable();
                    if ferry_core::assist::driven() {
                        if let Some(h) = hook {
                            // Poll the hook's work too, and tell it so (the
                            // peer then answers there, with no frame).
                            polling = true;
                            if h(true) {
                                tokio::task::yield_now().await;
                                continue;
                            }
                        }
                    }
                    match attempt() {
                        Err(e) if retry(&e) => tokio::task::yield_now().await,
                        other => return other,
                    }
                }
            }
        }
    };
    match timeout {
        None => wait.await,
        Some(t) => tokio::time::timeout(t, wait)
            .await
            .unwrap_or_else(|_| Err(timed_out())),
    }
}

/// Reads at least one byte into `buf` (no polling). `Ok(0)` is EOF.
pub async fn read_some(
    stream: &Stream,
    buf: &mut [u8],
    timeout: Option<Duration>,
) -> io::Result<usize> {
    let b = Bytes::from_mut(buf);
    read_with(
        stream,
        || raw_read(stream, &[b], 0, Bytes::empty()),
        Duration::ZERO,
        None,
        None,
        None,
        timeout,
    )
    .await
}

fn raw_write(stream: &Stream, bufs: &[Bytes<'_>], first_off: usize) -> io::Result<usize> {
    let n = bufs.len().min(IOV_MAX);
    let mut iov: Vec<libc::iovec> = Vec::with_capacity(n);
    for (i, b) in bufs[..n].iter().enumerate() {
        let b = if i == 0 { b.skip(first_off) } else { *b };
        if !b.is_empty() {
            iov.push(b.iovec());
        }
    }
    sys_msg(stream, &mut iov, true)
}

/// Writes every byte of `bufs` in order, at most [`IOV_MAX`] ranges per
/// call. A stall longer than `pace.stall`, or not having finished within
/// `pace`'s deadline for the total, is `TimedOut`.
pub async fn write_all(stream: &Stream, bufs: &[Bytes<'_>], pace: Pace) -> io::Result<()> {
    let total: u64 = bufs.iter().map(|b| b.len() as u64).sum();
    let deadline = pace.deadline(now(), total);
    let mut idx = 0;
    let mut off = 0;
    loop {
        while idx < bufs.len() && off == bufs[idx].len() {
            idx += 1;
            off = 0;
        }
        if idx == bufs.len() {
            if let Some(tls) = stream.tls() {
                flush_tls(stream, tls, pace, deadline).await?;
            }
            return Ok(());
        }
        tokio::task::consume_budget().await;
        let rest = &bufs[idx..];
        let written = match raw_write(stream, rest, off) {
            Ok(w) => w,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                let wait = async {
                    loop {
                        stream.writable().await?;
                        let r = stream.try_io(tokio::io::Interest::WRITABLE, || {
                            raw_write(stream, rest, off)
                        });
                        match r {
                            Err(e) if retry(&e) => continue,
                            other => return other,
                        }
                    }
                };
                tokio::time::timeout(self::wait(&pace, deadline)?, wait)
                    .await
                    .unwrap_or_else(|_| Err(timed_out()))?
            }
            Err(e) => return Err(e),
        };
        if written == 0 {
            return Err(io::Error::new(io::ErrorKind::WriteZero, "socket closed"));
        }
        let mut p = Progress { idx, off };
        p.advance(bufs.len(), |i| bufs[i].len(), written);
        (idx, off) = (p.idx, p.off);
    }
}

/// Waits until the TLS records of what was written are in the socket (a
/// write returns only then, as on a clear socket), bounded as the write.
async fn flush_tls(
    stream: &Stream,
    tls: &crate::tls::conn::TlsConn,
    pace: Pace,
    deadline: Time,
) -> io::Result<()> {
    match tls.flush() {
        Ok(()) => return Ok(()),
        Err(e) if retry(&e) => {}
        Err(e) => return Err(e),
    }
    let wait = async {
        loop {
            stream.writable().await?;
            match stream.try_io(tokio::io::Interest::WRITABLE, || tls.flush()) {
                Err(e) if retry(&e) => continue,
                other => return other,
            }
        }
    };
    tokio::time::timeout(self::wait(&pace, deadline)?, wait)
        .await
        .unwrap_or_else(|_| Err(timed_out()))
}

/// Writes plain byte slices (handshake and control messages).
pub async fn write_all_slices(stream: &Stream, bufs: &[&[u8]], pace: Pace) -> io::Result<()> {
    let bufs: Vec<Bytes<'_>> = bufs.iter().map(|b| Bytes::from_ref(b)).collect();
    write_all(stream, &bufs, pace).await
}

use ferry_tcp_proto::recv::{Progress, RecvCursor};

/// Frame reader over one socket: the system calls and the waiting around
/// a [`RecvCursor`], which keeps the header, the bytes read past it and
/// the frame's deadline.
pub struct FrameReader {
    cur: RecvCursor,
    spin: Duration,
    /// Polls longer while this says so (see [`SpinWhile`]).
    extend: Option<SpinWhile>,
    /// Called while polling and before sleeping (see [`SpinHook`]).
    hook: Option<SpinHook>,
    /// Pauses instead of sleeping while it says so (see [`Pause`]).
    pause: Option<Pause>,
}

/// What [`FrameReader::next_header`] found.
pub enum Next {
    /// A complete header.
    Header([u8; HEADER_LEN]),
    /// The peer closed the connection between frames.
    Eof,
    /// No frame started within the idle deadline.
    Idle,
}

impl FrameReader {
    /// Reads up to [`LOOKAHEAD`] bytes past each header in the same system
    /// call, so a frame with a short body (a CWRITE's segment table) costs
    /// one `recvmsg` instead of two. Later reads take those bytes first;
    /// only the reader may read the stream from then on.
    ///
    /// For the same-host path, whose requests carry no payload: a payload
    /// that starts inside the lookahead (a WRITE sent on such a connection)
    /// has its first bytes copied into its destination by the CPU rather
    /// than by `recvmsg` (same bytes, same checks before).
    pub fn set_lookahead(&mut self) {
        self.cur.set_lookahead();
    }

    /// Moves lookahead bytes into `dst` (from `off`); returns how many.
    fn take_ahead(&mut self, dst: Bytes<'_>, off: usize) -> usize {
        let ahead = self.cur.ahead();
        let n = ahead.len().min(dst.len().saturating_sub(off));
        if n > 0 {
            // SAFETY: `dst` names memory valid for writes (`Bytes`
            // contract: a Rust buffer borrowed mutably, or registered
            // memory a held RegionGuard keeps valid); `off + n <= len`;
            // the source is this reader's own buffer, disjoint from it.
            unsafe {
                std::ptr::copy_nonoverlapping(ahead.as_ptr(), dst.ptr.wrapping_add(off), n);
            }
            self.cur.consume_ahead(n);
        }
        n
    }

    /// One non-blocking read of the rest of the header and, with the
    /// lookahead on, of what follows it (only when the lookahead is
    /// drained). Accounts what it read.
    fn read_header_part(&mut self, stream: &Stream) -> io::Result<usize> {
        let (tail, ahead) = self.cur.header_bufs();
        let want = tail.len();
        let ahead = ahead.map_or_else(Bytes::empty, Bytes::from_mut);
        let n = raw_read(stream, &[Bytes::from_mut(tail)], 0, ahead)?;
        self.cur.account_header(n, want);
        Ok(n)
    }

    /// Keeps polling past the base window while `extend` returns true.
    pub fn set_spin_while(&mut self, extend: SpinWhile) {
        self.extend = Some(extend);
    }

    /// Calls `hook` while polling and before sleeping (see [`SpinHook`]).
    pub fn set_spin_hook(&mut self, hook: SpinHook) {
        self.hook = Some(hook);
    }

    /// Pauses rather than sleeps while `pause` says so (see [`Pause`]).
    pub fn set_pause(&mut self, pause: Pause) {
        self.pause = Some(pause);
    }

    /// A reader polling for `spin` before sleeping; `pace` bounds waits
    /// inside a frame.
    pub fn new(spin: Duration, pace: Pace) -> Self {
        FrameReader {
            cur: RecvCursor::new(pace),
            spin,
            extend: None,
            hook: None,
            pause: None,
        }
    }

    /// Starts the deadline of a frame whose remaining bytes (after the
    /// header) number `bytes`: every read of the frame must finish by then,
    /// whatever pieces it is read in.
    pub fn begin_frame(&mut self, bytes: u64) {
        self.cur.begin_frame(now(), bytes);
    }

    /// Tries, without waiting, to complete the next header. Returns whether
    /// one is complete.
    pub fn poll_header_now(&mut self, stream: &Stream) -> io::Result<bool> {
        while !self.cur.header_from_ahead() {
            match self.read_header_part(stream) {
                Ok(0) => return Ok(false),
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(true)
    }

    /// Reads the next header. Waiting for its first byte is bounded by
    /// `idle` (`None`: no deadline; on expiry [`Next::Idle`]); once it has
    /// started, the rest must come within the stall deadline.
    pub async fn next_header(
        &mut self,
        stream: &Stream,
        idle: Option<Duration>,
    ) -> io::Result<Next> {
        self.cur.end_frame();
        while !self.cur.header_from_ahead() {
            let started = self.cur.header_started();
            let timeout = if started {
                Some(self.cur.pace().stall)
            } else {
                idle
            };
            // The lookahead is drained here (`header_from_ahead`).
            let (tail, ahead) = self.cur.header_bufs();
            let want = tail.len();
            let tail = Bytes::from_mut(tail);
            let ahead = ahead.map_or_else(Bytes::empty, Bytes::from_mut);
            let r = read_with(
                stream,
                || raw_read(stream, &[tail], 0, ahead),
                self.spin,
                self.extend.as_ref(),
                self.hook.as_ref(),
                self.pause.as_ref(),
                timeout,
            )
            .await;
            let n = match r {
                Err(e) if e.kind() == io::ErrorKind::TimedOut && !started => return Ok(Next::Idle),
                other => other?,
            };
            if n == 0 {
                return if !started {
                    Ok(Next::Eof)
                } else {
                    Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "connection closed inside a frame header",
                    ))
                };
            }
            self.cur.account_header(n, want);
        }
        Ok(Next::Header(self.cur.take_header()))
    }

    /// Reads exactly `dst.len()` payload bytes into `dst`, topping up the
    /// next header in the same calls (so `dst` must end a frame).
    pub async fn read_payload(&mut self, stream: &Stream, dst: Bytes<'_>) -> io::Result<()> {
        self.read_v(stream, &[dst], true).await
    }

    /// Reads exactly `dst.len()` bytes of a frame that continues after them
    /// (no top-up of the next header).
    pub async fn read_part(&mut self, stream: &Stream, dst: Bytes<'_>) -> io::Result<()> {
        self.read_v(stream, &[dst], false).await
    }

    /// Reads exactly the bytes of every range of `segs`, in order, with as
    /// few calls as possible (one `readv` over all of them and, if `topup`,
    /// the next header — so they must end the frame).
    pub async fn read_v(
        &mut self,
        stream: &Stream,
        segs: &[Bytes<'_>],
        topup: bool,
    ) -> io::Result<()> {
        let deadline = self
            .cur
            .read_deadline(now, segs.iter().map(|s| s.len() as u64).sum());
        let mut p = Progress::default();
        loop {
            if p.settle(segs.len(), |i| segs[i].len()) {
                return Ok(());
            }
            // Bytes the last header read brought along come first.
            let got = self.take_ahead(segs[p.idx], p.off);
            if got > 0 {
                p.off += got;
                continue;
            }
            let wait = wait(&self.cur.pace(), deadline)?;
            let rest = &segs[p.idx..];
            let tail = if topup {
                Bytes::from_mut(self.cur.header_tail())
            } else {
                Bytes::empty()
            };
            let off = p.off;
            let n = read_with(
                stream,
                || raw_read(stream, rest, off, tail),
                self.spin,
                self.extend.as_ref(),
                self.hook.as_ref(),
                self.pause.as_ref(),
                Some(wait),
            )
            .await?;
            if n == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "connection closed inside a frame payload",
                ));
            }
            let past = p.advance(segs.len(), |i| segs[i].len(), n);
            self.cur.account_topup(past);
        }
    }

    /// Reads and throws away `len` payload bytes (a refused WRITE), through
    /// a small fixed scratch buffer; `ends_frame` as for
    /// [`FrameReader::read_payload`] versus [`FrameReader::read_part`].
    pub async fn discard(
        &mut self,
        stream: &Stream,
        mut len: u64,
        ends_frame: bool,
    ) -> io::Result<()> {
        let mut scratch = [0u8; 8192];
        while len > 0 {
            let n = len.min(scratch.len() as u64) as usize;
            let last = len == n as u64;
            self.read_v(
                stream,
                &[Bytes::from_mut(&mut scratch[..n])],
                ends_frame && last,
            )
            .await?;
            len -= n as u64;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_tcp_proto::recv::LOOKAHEAD;

    /// Frames whose bodies end inside, at, or past the lookahead come out
    /// whole and in order, pipelined or not.
    #[tokio::test]
    async fn lookahead_keeps_the_stream_in_order() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut tx = tokio::net::TcpStream::connect(l.local_addr().unwrap())
            .await
            .unwrap();
        let (rx, _) = l.accept().await.unwrap();
        let rx = Stream::Tcp(rx);
        let bodies = [
            24usize,
            0,
            LOOKAHEAD - HEADER_LEN,
            LOOKAHEAD,
            3 * LOOKAHEAD + 5,
            7,
        ];
        let mut wire = Vec::new();
        for (i, &n) in bodies.iter().enumerate() {
            wire.extend(std::iter::repeat_n(i as u8, HEADER_LEN));
            wire.extend((0..n).map(|j| (j as u8).wrapping_mul(31).wrapping_add(i as u8)));
        }
        use tokio::io::AsyncWriteExt;
        tx.write_all(&wire).await.unwrap();
        let mut rd = FrameReader::new(Duration::ZERO, Pace::stall_only(Duration::from_secs(5)));
        rd.set_lookahead();
        for (i, &n) in bodies.iter().enumerate() {
            let Next::Header(h) = rd.next_header(&rx, None).await.unwrap() else {
                panic!("no header {i}");
            };
            assert_eq!(h, [i as u8; HEADER_LEN]);
            let mut body = vec![0u8; n];
            if n > 1 {
                // In two pieces, the first not ending the frame.
                let (a, b) = body.split_at_mut(n / 2);
                rd.read_part(&rx, Bytes::from_mut(a)).await.unwrap();
                rd.read_payload(&rx, Bytes::from_mut(b)).await.unwrap();
            } else {
                rd.read_payload(&rx, Bytes::from_mut(&mut body))
                    .await
                    .unwrap();
            }
            let want: Vec<u8> = (0..n)
                .map(|j| (j as u8).wrapping_mul(31).wrapping_add(i as u8))
                .collect();
            assert_eq!(body, want, "body {i}");
        }
        assert!(!rd.poll_header_now(&rx).unwrap());
    }
}
