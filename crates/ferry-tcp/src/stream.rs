//! The byte stream a connection runs on: the TCP connection it was made
//! on, or — once two engines on one host have agreed the same-host path —
//! the Unix socket pair the target took over from the initiator (see
//! [`crate::same_host::cma`]). Frames, acknowledgements and notifications are the
//! same on both; a Unix socket only makes each of them cheaper (a loopback
//! TCP `sendmsg` runs the whole TCP/IP stack for the receiver).

use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};

use tokio::io::Interest;
use tokio::net::{TcpStream, UnixStream};

use crate::quiet::Quiet;
use crate::tls::conn::{Detached, TlsConn};

/// A connection's socket, registered with the current Tokio runtime.
#[derive(Debug)]
pub enum Stream {
    /// The TCP connection (every connection starts here).
    Tcp(TcpStream),
    /// The same-host control channel: one end of a Unix socket pair.
    Unix(UnixStream),
    /// A TCP connection under TLS: the socket and the session's state,
    /// driven by the connection's own reads and writes (see
    /// [`crate::tls::conn`]).
    Tls(Box<TlsConn>),
    /// A clear TCP or Unix socket whose readiness reaches the runtime only
    /// while a task waits for it (see [`crate::quiet`]): what a connection
    /// runs on once its handshake is over.
    Quiet(Quiet),
}

/// A [`Stream`] taken off its runtime (see [`Stream::into_owned`]).
pub enum OwnedStream {
    /// A clear socket: Unix (`true`) or TCP.
    Fd(bool, OwnedFd),
    /// A TLS connection with its session.
    Tls(Box<Detached>),
}

impl Stream {
    /// Waits until the socket may be readable.
    pub async fn readable(&self) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.readable().await,
            Stream::Unix(s) => s.readable().await,
            Stream::Tls(t) => {
                if t.has_plaintext() {
                    return Ok(());
                }
                t.tcp().readable().await
            }
            Stream::Quiet(q) => q.readable().await,
        }
    }

    /// A reader that polls the socket itself from now on: readability
    /// armed by an earlier wait need not wake the runtime (see
    /// [`crate::quiet`]; no-op on other streams).
    pub fn unarm_readable(&self) {
        if let Stream::Quiet(q) = self {
            // Failing to disarm costs one wake-up, nothing else.
            let _ = q.unarm_readable();
        }
    }

    /// Waits until the socket may be writable.
    pub async fn writable(&self) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.writable().await,
            Stream::Unix(s) => s.writable().await,
            Stream::Tls(t) => t.tcp().writable().await,
            Stream::Quiet(q) => q.writable().await,
        }
    }

    /// Runs the non-blocking `f` on the socket, clearing the readiness
    /// `interest` if it would block (as `TcpStream::try_io`).
    pub fn try_io<R>(
        &self,
        interest: Interest,
        f: impl FnOnce() -> io::Result<R>,
    ) -> io::Result<R> {
        match self {
            Stream::Tcp(s) => s.try_io(interest, f),
            Stream::Unix(s) => s.try_io(interest, f),
            Stream::Tls(t) => t.tcp().try_io(interest, f),
            // No readiness is cached: the next wait asks the kernel.
            Stream::Quiet(_) => f(),
        }
    }

    /// The TCP connection's (local, peer) addresses (`None` on the
    /// same-host channel).
    pub fn tcp_addrs(&self) -> Option<(SocketAddr, SocketAddr)> {
        match self {
            Stream::Tcp(s) => Some((s.local_addr().ok()?, s.peer_addr().ok()?)),
            Stream::Tls(t) => Some(t.addrs()),
            Stream::Unix(_) => None,
            Stream::Quiet(q) => q.tcp_addrs(),
        }
    }

    /// Whether this runs under TLS.
    #[cfg_attr(not(feature = "test-support"), allow(dead_code))]
    pub fn is_tls(&self) -> bool {
        matches!(self, Stream::Tls(..))
    }

    /// Whether this is the same-host Unix channel.
    pub fn is_unix(&self) -> bool {
        match self {
            Stream::Unix(_) => true,
            Stream::Quiet(q) => q.is_unix(),
            _ => false,
        }
    }

    /// The same stream with quiet readiness (see [`crate::quiet`]), for a
    /// connection whose handshake is over; TLS stays as it is.
    pub fn quiet(self) -> io::Result<Stream> {
        Ok(match self {
            Stream::Tcp(s) => Stream::Quiet(Quiet::new(s.into_std()?.into(), false)?),
            Stream::Unix(s) => Stream::Quiet(Quiet::new(s.into_std()?.into(), true)?),
            other => other,
        })
    }

    /// Deregisters the socket from this runtime (to move it to another).
    pub fn into_owned(self) -> io::Result<OwnedStream> {
        Ok(match self {
            Stream::Tcp(s) => OwnedStream::Fd(false, s.into_std()?.into()),
            Stream::Unix(s) => OwnedStream::Fd(true, s.into_std()?.into()),
            Stream::Tls(t) => OwnedStream::Tls(Box::new(t.detach()?)),
            Stream::Quiet(q) => {
                let unix = q.is_unix();
                OwnedStream::Fd(unix, q.into_fd())
            }
        })
    }

    /// Registers a stream taken by [`Stream::into_owned`] with the
    /// current runtime (a clear socket quietly, see [`Stream::quiet`]: only
    /// running connections move).
    pub fn from_owned(owned: OwnedStream) -> io::Result<Stream> {
        Ok(match owned {
            OwnedStream::Fd(unix, fd) => Stream::Quiet(Quiet::new(fd, unix)?),
            OwnedStream::Tls(d) => Stream::Tls(Box::new(d.attach()?)),
        })
    }

    /// The TLS connection, if this runs under TLS.
    pub fn tls(&self) -> Option<&TlsConn> {
        match self {
            Stream::Tls(t) => Some(t),
            _ => None,
        }
    }
}

impl AsRawFd for Stream {
    fn as_raw_fd(&self) -> RawFd {
        match self {
            Stream::Tcp(s) => s.as_raw_fd(),
            Stream::Unix(s) => s.as_raw_fd(),
            Stream::Tls(t) => t.tcp().as_raw_fd(),
            Stream::Quiet(q) => q.as_raw_fd(),
        }
    }
}

impl AsFd for Stream {
    fn as_fd(&self) -> BorrowedFd<'_> {
        match self {
            Stream::Tcp(s) => s.as_fd(),
            Stream::Unix(s) => s.as_fd(),
            Stream::Tls(t) => t.tcp().as_fd(),
            Stream::Quiet(q) => q.as_fd(),
        }
    }
}
