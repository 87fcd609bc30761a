//! Socket I/O: vectored reads straight into caller memory with a bounded
//! busy-poll before sleeping, and vectored writes.
//!
//! Reading a payload also reads up to one following frame header in the same
//! system call (`readv` of `[payload, header]`), so a pipelined stream of
//! frames costs about one call per frame while payload bytes still land
//! directly in their destination.

use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::time::{Duration, Instant};

use socket2::SockRef;
use tokio::net::TcpStream;

use crate::frame::HEADER_LEN;

/// Most iovecs per system call (Linux `IOV_MAX`).
const IOV_MAX: usize = 1024;

fn timed_out() -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, "peer made no progress in time")
}

/// One non-blocking `readv` into `a` then `b`, bypassing Tokio's readiness
/// cache.
fn raw_read(stream: &TcpStream, a: &mut [u8], b: &mut [u8]) -> io::Result<usize> {
    let sock = SockRef::from(stream);
    if b.is_empty() {
        (&*sock).read(a)
    } else {
        (&*sock).read_vectored(&mut [IoSliceMut::new(a), IoSliceMut::new(b)])
    }
}

fn retry(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
    )
}

/// Reads at least one byte into `a` then `b` (one `readv`). Polls for up to
/// `spin` first (yielding to other tasks between attempts), then sleeps until
/// readable; waiting longer than `timeout` (if given) is a `TimedOut` error.
/// `Ok(0)` is EOF.
///
/// (Slices rather than `IoSliceMut`s cross the awaits: the latter are not
/// `Send`.)
pub async fn read_some(
    stream: &TcpStream,
    a: &mut [u8],
    b: &mut [u8],
    spin: Duration,
    timeout: Option<Duration>,
) -> io::Result<usize> {
    read_with(stream, || raw_read(stream, a, b), spin, timeout).await
}

/// One non-blocking `readv` into `segs` (the first from `first_off`) then
/// `tail`.
fn raw_readv(
    stream: &TcpStream,
    segs: &mut [&mut [u8]],
    first_off: usize,
    tail: &mut [u8],
) -> io::Result<usize> {
    let n = segs.len().min(IOV_MAX - 1);
    let all = n == segs.len();
    let mut iov: Vec<IoSliceMut<'_>> = Vec::with_capacity(n + 1);
    for (i, s) in segs[..n].iter_mut().enumerate() {
        iov.push(IoSliceMut::new(if i == 0 {
            &mut s[first_off..]
        } else {
            s
        }));
    }
    // The tail (next header) may only follow the last payload slice.
    if all && !tail.is_empty() {
        iov.push(IoSliceMut::new(tail));
    }
    let sock = SockRef::from(stream);
    (&*sock).read_vectored(&mut iov)
}

/// The polling / sleeping / timeout logic of every read: `attempt` is one
/// non-blocking read.
async fn read_with<F>(
    stream: &TcpStream,
    mut attempt: F,
    spin: Duration,
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
    if !spin.is_zero() {
        let start = Instant::now();
        while start.elapsed() < spin {
            tokio::task::yield_now().await;
            match attempt() {
                Err(e) if retry(&e) => {}
                other => return other,
            }
        }
    }
    let wait = async {
        loop {
            stream.readable().await?;
            match stream.try_io(tokio::io::Interest::READABLE, &mut attempt) {
                Err(e) if retry(&e) => continue,
                other => return other,
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

fn raw_write(stream: &TcpStream, bufs: &[&[u8]], first_off: usize) -> io::Result<usize> {
    let n = bufs.len().min(IOV_MAX);
    let mut iov: Vec<IoSlice<'_>> = Vec::with_capacity(n);
    for (i, b) in bufs[..n].iter().enumerate() {
        iov.push(IoSlice::new(if i == 0 { &b[first_off..] } else { b }));
    }
    let sock = SockRef::from(stream);
    (&*sock).write_vectored(&iov)
}

/// Writes every byte of `bufs` in order, at most [`IOV_MAX`] slices per
/// call. A stall longer than `timeout` is `TimedOut`.
pub async fn write_all(stream: &TcpStream, bufs: &[&[u8]], timeout: Duration) -> io::Result<()> {
    let mut idx = 0;
    let mut off = 0;
    loop {
        while idx < bufs.len() && off == bufs[idx].len() {
            idx += 1;
            off = 0;
        }
        if idx == bufs.len() {
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
                tokio::time::timeout(timeout, wait)
                    .await
                    .unwrap_or_else(|_| Err(timed_out()))?
            }
            Err(e) => return Err(e),
        };
        if written == 0 {
            return Err(io::Error::new(io::ErrorKind::WriteZero, "socket closed"));
        }
        // Advance (idx, off) by `written` bytes.
        let mut left = written;
        while left > 0 {
            let avail = bufs[idx].len() - off;
            if left >= avail {
                left -= avail;
                idx += 1;
                off = 0;
            } else {
                off += left;
                left = 0;
            }
        }
    }
}

/// Frame reader over one socket: a header buffer that payload reads top up
/// opportunistically.
pub struct FrameReader {
    hdr: [u8; HEADER_LEN],
    filled: usize,
    spin: Duration,
    timeout: Duration,
}

/// What [`FrameReader::next_header`] found.
pub enum Next {
    /// A complete header.
    Header([u8; HEADER_LEN]),
    /// The peer closed the connection between frames.
    Eof,
}

impl FrameReader {
    /// Changes how long the reader polls before sleeping.
    pub fn set_spin(&mut self, spin: Duration) {
        self.spin = spin;
    }

    /// A reader polling for `spin` before sleeping; `timeout` bounds waits
    /// inside a frame.
    pub fn new(spin: Duration, timeout: Duration) -> Self {
        FrameReader {
            hdr: [0; HEADER_LEN],
            filled: 0,
            spin,
            timeout,
        }
    }

    /// Tries, without waiting, to complete the next header. Returns whether
    /// one is complete.
    pub fn poll_header_now(&mut self, stream: &TcpStream) -> io::Result<bool> {
        while self.filled < HEADER_LEN {
            match raw_read(stream, &mut self.hdr[self.filled..], &mut []) {
                Ok(0) => return Ok(false),
                Ok(n) => self.filled += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(true)
    }

    /// Reads the next header. Waiting for its first byte has no deadline
    /// (an idle connection is fine); once it has started, the rest must come
    /// within the timeout.
    pub async fn next_header(&mut self, stream: &TcpStream) -> io::Result<Next> {
        while self.filled < HEADER_LEN {
            let timeout = (self.filled > 0).then_some(self.timeout);
            let n = read_some(
                stream,
                &mut self.hdr[self.filled..],
                &mut [],
                self.spin,
                timeout,
            )
            .await?;
            if n == 0 {
                return if self.filled == 0 {
                    Ok(Next::Eof)
                } else {
                    Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "connection closed inside a frame header",
                    ))
                };
            }
            self.filled += n;
        }
        self.filled = 0;
        Ok(Next::Header(self.hdr))
    }

    /// Reads exactly `dst.len()` payload bytes into `dst`, topping up the
    /// next header in the same calls (so `dst` must end a frame).
    pub async fn read_payload(&mut self, stream: &TcpStream, dst: &mut [u8]) -> io::Result<()> {
        self.read_into(stream, dst, true).await
    }

    /// Reads exactly `dst.len()` bytes of a frame that continues after them
    /// (no top-up of the next header).
    pub async fn read_part(&mut self, stream: &TcpStream, dst: &mut [u8]) -> io::Result<()> {
        self.read_into(stream, dst, false).await
    }

    async fn read_into(
        &mut self,
        stream: &TcpStream,
        dst: &mut [u8],
        topup: bool,
    ) -> io::Result<()> {
        let mut done = 0;
        while done < dst.len() {
            let tail: &mut [u8] = if topup {
                &mut self.hdr[self.filled..]
            } else {
                &mut []
            };
            let n = read_some(
                stream,
                &mut dst[done..],
                tail,
                self.spin,
                Some(self.timeout),
            )
            .await?;
            if n == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "connection closed inside a frame payload",
                ));
            }
            let rest = dst.len() - done;
            if n > rest {
                self.filled += n - rest;
                done = dst.len();
            } else {
                done += n;
            }
        }
        Ok(())
    }

    /// Reads exactly the bytes of every slice of `segs`, in order, with as
    /// few calls as possible (one `readv` over all of them and the next
    /// header).
    pub async fn read_payload_v(
        &mut self,
        stream: &TcpStream,
        segs: &mut [&mut [u8]],
    ) -> io::Result<()> {
        let (mut idx, mut off) = (0usize, 0usize);
        loop {
            while idx < segs.len() && off == segs[idx].len() {
                idx += 1;
                off = 0;
            }
            if idx == segs.len() {
                return Ok(());
            }
            let rest = &mut segs[idx..];
            let tail = &mut self.hdr[self.filled..];
            let n = read_with(
                stream,
                || raw_readv(stream, rest, off, tail),
                self.spin,
                Some(self.timeout),
            )
            .await?;
            if n == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "connection closed inside a frame payload",
                ));
            }
            let mut left = n;
            while left > 0 && idx < segs.len() {
                let avail = segs[idx].len() - off;
                if left >= avail {
                    left -= avail;
                    idx += 1;
                    off = 0;
                } else {
                    off += left;
                    left = 0;
                }
            }
            self.filled += left;
        }
    }

    /// Reads and throws away `len` payload bytes (a refused WRITE), through
    /// a small fixed scratch buffer; `ends_frame` as for
    /// [`FrameReader::read_payload`] versus [`FrameReader::read_part`].
    pub async fn discard(
        &mut self,
        stream: &TcpStream,
        mut len: u64,
        ends_frame: bool,
    ) -> io::Result<()> {
        let mut scratch = [0u8; 8192];
        while len > 0 {
            let n = len.min(scratch.len() as u64) as usize;
            let last = len == n as u64;
            self.read_into(stream, &mut scratch[..n], ends_frame && last)
                .await?;
            len -= n as u64;
        }
        Ok(())
    }
}
