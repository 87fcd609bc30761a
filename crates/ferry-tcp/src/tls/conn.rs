//! A TLS session driven by the connection's own non-blocking I/O.
//!
//! After the handshake (tokio-rustls drives that part), the rustls
//! connection state and the TCP socket live here and [`crate::io`] calls
//! [`TlsConn::recv`] / [`TlsConn::send`] where it would call `recvmsg` /
//! `sendmsg` on a clear socket: the frame code, its polling, pacing and
//! deadlines run unchanged, and a byte costs one encryption (or
//! decryption) and the copies rustls makes, with no relay task and no
//! extra socket in between.
//!
//! Invariants:
//! - Each call is non-blocking and holds the state's lock only for its
//!   own duration, so the connection's reader and its writers take turns
//!   without waiting for the network.
//! - `recv` returns `WouldBlock` only after the socket itself did (which
//!   clears Tokio's readiness), and [`TlsConn::has_plaintext`] tells
//!   [`crate::stream::Stream::readable`] about plaintext already decrypted,
//!   so a reader never sleeps on a socket while its bytes sit in rustls.
//! - `send` accepts plaintext only after every earlier record went out to
//!   the socket, and [`TlsConn::flush`] pushes the rest: a caller's
//!   `write_all` returns only once its records are in the kernel (as on a
//!   clear socket).
//! - End of stream (`close_notify` or a TCP FIN without it) reads as
//!   `Ok(0)`; a TLS error (bad record, an alert such as a refused
//!   certificate) is an `InvalidData` error whose source is the
//!   [`rustls::Error`] (see [`crate::tls::rustls_error`]).

use std::io::{self, IoSlice, Read, Write};
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::{Mutex, MutexGuard};

use tokio::net::TcpStream;

/// Unsent TLS bytes a connection buffers before `send` stops taking
/// plaintext (rustls's default is 64 KiB; larger batches of records mean
/// fewer system calls per MiB).
const SEND_BUFFER: usize = 256 << 10;

/// Ciphertext taken from the socket per `recv` (see [`State`]).
const READ_BUFFER: usize = 64 << 10;

/// The TCP socket as rustls's non-blocking byte source and sink: plain
/// `recv` / `sendmsg` system calls, as [`crate::io`] makes on a clear
/// socket. Not Tokio's `try_read` / `try_write`: those return
/// `WouldBlock` without asking the kernel while the runtime's readiness
/// flag is clear, so a reader polling for an answer would see it only once
/// the reactor next ran (figures: crates/ferry-tcp/BENCHMARKS.md). A `WouldBlock` from here clears the readiness through the caller's
/// `Stream::try_io`, as on a clear socket.
struct Sock<'a>(&'a TcpStream);

fn last_os<T>(r: isize, ok: impl FnOnce(usize) -> T) -> io::Result<T> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ok(r as usize))
    }
}

impl Read for Sock<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        // SAFETY: `buf` is valid for writes of its length; the socket is
        // open while borrowed.
        let r = unsafe {
            libc::recv(
                self.0.as_raw_fd(),
                buf.as_mut_ptr().cast(),
                buf.len(),
                libc::MSG_DONTWAIT,
            )
        };
        last_os(r, |n| n)
    }
}

impl Write for Sock<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.write_vectored(&[IoSlice::new(buf)])
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        // SAFETY: an all-zero msghdr is a valid "no address, no control
        // data" header.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        // IoSlice is ABI-compatible with iovec (std guarantees it on Unix).
        msg.msg_iov = bufs.as_ptr() as *mut libc::iovec;
        msg.msg_iovlen = bufs.len().min(1024) as _;
        // SAFETY: the iovecs name the borrowed slices, valid for reads for
        // the call; the socket is open while borrowed.
        let r = unsafe {
            libc::sendmsg(
                self.0.as_raw_fd(),
                &msg,
                libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
            )
        };
        last_os(r, |n| n)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// A TLS connection over a TCP socket registered with the current runtime.
pub struct TlsConn {
    tcp: TcpStream,
    addrs: (SocketAddr, SocketAddr),
    state: Mutex<State>,
}

/// The session and the ciphertext read from the socket but not yet given
/// to rustls (`inbuf[pos..len]`): one `recv` takes up to [`READ_BUFFER`]
/// bytes, where rustls alone would read 4 KiB per system call.
struct State {
    conn: rustls::Connection,
    inbuf: Box<[u8]>,
    pos: usize,
    len: usize,
}

impl std::fmt::Debug for TlsConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsConn")
            .field("addrs", &self.addrs)
            .finish_non_exhaustive()
    }
}

/// A [`TlsConn`] taken off its runtime (to serve it on another thread).
pub struct Detached {
    fd: OwnedFd,
    addrs: (SocketAddr, SocketAddr),
    state: State,
}

fn tls_io_error(e: rustls::Error) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e)
}

impl TlsConn {
    /// Takes over a connection whose handshake is complete.
    pub fn new(
        tcp: TcpStream,
        addrs: (SocketAddr, SocketAddr),
        mut conn: rustls::Connection,
    ) -> TlsConn {
        conn.set_buffer_limit(Some(SEND_BUFFER));
        TlsConn::with_state(
            tcp,
            addrs,
            State {
                conn,
                inbuf: vec![0u8; READ_BUFFER].into_boxed_slice(),
                pos: 0,
                len: 0,
            },
        )
    }

    fn with_state(tcp: TcpStream, addrs: (SocketAddr, SocketAddr), state: State) -> TlsConn {
        TlsConn {
            tcp,
            addrs,
            state: Mutex::new(state),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding it leaves rustls's state as it was between
        // two of its own calls: still consistent.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The TCP socket.
    pub fn tcp(&self) -> &TcpStream {
        &self.tcp
    }

    /// The TCP connection's (local, peer) addresses.
    pub fn addrs(&self) -> (SocketAddr, SocketAddr) {
        self.addrs
    }

    /// Whether a read would return without the socket: decrypted plaintext
    /// is waiting, or the stream has ended or failed.
    pub fn has_plaintext(&self) -> bool {
        let mut st = self.lock();
        if st.pos < st.len {
            return true;
        }
        match st.conn.process_new_packets() {
            Ok(io) => io.plaintext_bytes_to_read() > 0 || io.peer_has_closed(),
            Err(_) => true,
        }
    }

    /// Reads plaintext into the ranges of `iov` in order, non-blocking:
    /// what rustls has decrypted, else records from the socket until some
    /// plaintext comes out. `Ok(0)` is the end of the stream; `WouldBlock`
    /// means the socket is empty and no plaintext is waiting.
    ///
    /// # Safety
    ///
    /// Each iovec names memory valid for writes of its length for the
    /// duration of the call (ranges may overlap: each is written through a
    /// slice of its own that ends before the next one is made).
    pub unsafe fn recv(&self, iov: &[libc::iovec]) -> io::Result<usize> {
        let mut st = self.lock();
        loop {
            let mut got = 0;
            let mut ended = false;
            'fill: for v in iov {
                // SAFETY: the caller's contract; this slice is the only
                // reference to the range while it lives (to the end of
                // this iteration).
                let b = unsafe { std::slice::from_raw_parts_mut(v.iov_base as *mut u8, v.iov_len) };
                let mut at = 0;
                while at < b.len() {
                    match st.conn.reader().read(&mut b[at..]) {
                        Ok(0) => {
                            ended = true;
                            break;
                        }
                        Ok(n) => at += n,
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                        // A FIN without close_notify: the end, as on a
                        // clear socket (frames carry their own lengths, so
                        // a cut stream is a lost connection, never a
                        // shorter message).
                        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
                            ended = true;
                            break;
                        }
                        Err(e) => return Err(e),
                    }
                }
                got += at;
                if at < b.len() {
                    break 'fill;
                }
            }
            if got > 0 || ended || iov.iter().all(|v| v.iov_len == 0) {
                return Ok(got);
            }
            // At the end of the stream (0) the processing below makes the
            // reader report it.
            if st.pos == st.len {
                let State {
                    inbuf, pos, len, ..
                } = &mut *st;
                let n = Sock(&self.tcp).read(inbuf)?;
                (*pos, *len) = (0, n);
            }
            let State {
                conn,
                inbuf,
                pos,
                len,
            } = &mut *st;
            // A whole slice reader never fails; at the end of the stream
            // (nothing read) rustls notes it and the reader reports it.
            *pos += conn.read_tls(&mut &inbuf[*pos..*len])?;
            let processed = conn.process_new_packets();
            // Answers rustls owes the peer (an alert, a key update) go out
            // now if the socket takes them; a later send flushes the rest.
            let _ = flush_state(conn, &self.tcp);
            processed.map_err(tls_io_error)?;
        }
    }

    /// Takes plaintext from `bufs` (records are sealed at once and written
    /// as far as the socket takes them). `WouldBlock` when earlier records
    /// are still waiting for the socket (then nothing was taken).
    pub fn send(&self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        let mut st = self.lock();
        flush_state(&mut st.conn, &self.tcp)?;
        let n = st.conn.writer().write_vectored(bufs)?;
        if n == 0 && bufs.iter().any(|b| !b.is_empty()) {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        match flush_state(&mut st.conn, &self.tcp) {
            Err(e) if e.kind() != io::ErrorKind::WouldBlock => Err(e),
            _ => Ok(n),
        }
    }

    /// Writes records still waiting for the socket: `Ok` once none is
    /// left, `WouldBlock` if the socket is full.
    pub fn flush(&self) -> io::Result<()> {
        flush_state(&mut self.lock().conn, &self.tcp)
    }

    /// Takes the connection off its runtime.
    pub fn detach(self) -> io::Result<Detached> {
        let state = self.state.into_inner().unwrap_or_else(|p| p.into_inner());
        Ok(Detached {
            fd: self.tcp.into_std()?.into(),
            addrs: self.addrs,
            state,
        })
    }
}

impl Detached {
    /// Registers the connection with the current runtime.
    pub fn attach(self) -> io::Result<TlsConn> {
        let tcp = TcpStream::from_std(self.fd.into())?;
        Ok(TlsConn::with_state(tcp, self.addrs, self.state))
    }
}

fn flush_state(st: &mut rustls::Connection, tcp: &TcpStream) -> io::Result<()> {
    while st.wants_write() {
        if st.write_tls(&mut Sock(tcp))? == 0 {
            return Err(io::Error::new(io::ErrorKind::WriteZero, "socket closed"));
        }
    }
    Ok(())
}
