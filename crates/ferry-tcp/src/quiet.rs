//! A socket whose readiness reaches the runtime only while a task waits
//! for it.
//!
//! A socket registered with Tokio directly is in the runtime's epoll set
//! for good, edge-triggered: every segment that arrives wakes the runtime
//! thread parked in `epoll_wait`, whether or not any task waits for it.
//! That is a wake-up per answer even while the answer's reader is busy
//! polling the socket itself (a blocked caller driving its connection,
//! `ferry_core::assist`, or a reader in its spin window), and on a small VM
//! each such wake-up of an idle CPU costs tens of microseconds of that CPU
//! — the CPU the peer process needed (figures:
//! crates/ferry-tcp/BENCHMARKS.md).
//!
//! Here the socket sits in an epoll set of its own per direction, with
//! `EPOLLONESHOT`; only those small sets are registered with the runtime.
//! A task that is about to wait arms its direction (`epoll_ctl(MOD)`),
//! which reports readiness already present at once; one event disarms it
//! again. So the runtime hears of the socket only when a task waits on it.
//! The cost is one `epoll_ctl` and one `epoll_wait(0)` per wait: about a
//! microsecond, against a wake-up per segment.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::io::unix::AsyncFd;

/// One direction's epoll set, holding only the socket.
#[derive(Debug)]
struct Arm {
    ep: AsyncFd<OwnedFd>,
    events: u32,
    /// Armed and not yet reported, as far as this side knows (a hint: a
    /// wrong `true` costs one system call, a wrong `false` one wake-up).
    armed: AtomicBool,
}

impl Arm {
    fn new(sock: RawFd, events: u32) -> io::Result<Arm> {
        // SAFETY: epoll_create1 takes no pointers; a non-negative result is
        // a new descriptor that only this OwnedFd owns.
        let ep = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if ep < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `ep` was just created and is owned by nobody else.
        let ep = unsafe { OwnedFd::from_raw_fd(ep) };
        // Added disarmed (a one-shot entry with no events is reported for
        // nothing but errors, once): the first wait arms it.
        let mut ev = libc::epoll_event {
            events: libc::EPOLLONESHOT as u32,
            u64: 0,
        };
        // SAFETY: both descriptors are open; `ev` is a valid epoll_event
        // that the kernel only reads.
        if unsafe { libc::epoll_ctl(ep.as_raw_fd(), libc::EPOLL_CTL_ADD, sock, &mut ev) } < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: an OwnedFd's descriptor stays open and the same for as
        // long as the OwnedFd lives, and the AsyncFd owns it.
        let ep = unsafe { AsyncFd::register_with_interest(ep, tokio::io::Interest::READABLE) }
            .map_err(io::Error::from)?;
        Ok(Arm {
            ep,
            events,
            armed: AtomicBool::new(false),
        })
    }

    /// Arms the socket for this direction: readiness present now or later
    /// is reported once.
    fn arm(&self, sock: RawFd) -> io::Result<()> {
        self.armed.store(true, Ordering::Relaxed);
        self.modify(sock, self.events)
    }

    /// Disarms it if armed: a task that polls the socket itself needs no
    /// report (it would only wake a runtime thread).
    fn disarm(&self, sock: RawFd) -> io::Result<()> {
        if self.armed.swap(false, Ordering::Relaxed) {
            self.modify(sock, 0)?;
        }
        Ok(())
    }

    fn modify(&self, sock: RawFd, events: u32) -> io::Result<()> {
        let mut ev = libc::epoll_event {
            events: events | libc::EPOLLONESHOT as u32,
            u64: 0,
        };
        // SAFETY: both descriptors are open (the socket outlives its arms,
        // see `Quiet`'s field order); `ev` is only read.
        let r = unsafe {
            libc::epoll_ctl(
                self.ep.get_ref().as_raw_fd(),
                libc::EPOLL_CTL_MOD,
                sock,
                &mut ev,
            )
        };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Takes the reported event, if any (the set is then empty again).
    fn take(&self) -> io::Result<bool> {
        let mut ev = libc::epoll_event { events: 0, u64: 0 };
        // SAFETY: `ev` has room for the one event asked for; timeout 0
        // never blocks.
        let n = unsafe { libc::epoll_wait(self.ep.get_ref().as_raw_fd(), &mut ev, 1, 0) };
        if n < 0 {
            let e = io::Error::last_os_error();
            return if e.kind() == io::ErrorKind::Interrupted {
                Ok(false)
            } else {
                Err(e)
            };
        }
        if n > 0 {
            self.armed.store(false, Ordering::Relaxed);
        }
        Ok(n > 0)
    }

    /// Waits until the socket may be ready in this direction.
    async fn wait(&self, sock: RawFd) -> io::Result<()> {
        loop {
            self.arm(sock)?;
            let mut ready = self.ep.readable().await?;
            let got = self.take()?;
            // Cleared after taking: an event reported since then sets the
            // runtime's readiness again (and the loop arms anew anyway).
            ready.clear_ready();
            if got {
                return Ok(());
            }
        }
    }
}

/// A connected, non-blocking TCP or Unix socket with quiet readiness (see
/// the module's docs).
#[derive(Debug)]
pub struct Quiet {
    // Dropped before the socket: closing a set removes the socket from it.
    rd: Arm,
    wr: Arm,
    sock: OwnedFd,
    unix: bool,
    addrs: Option<(std::net::SocketAddr, std::net::SocketAddr)>,
}

impl Quiet {
    /// Takes over a connected socket (made non-blocking). Call it inside
    /// a Tokio runtime (it panics outside one, like `TcpStream::from_std`).
    pub fn new(sock: OwnedFd, unix: bool) -> io::Result<Quiet> {
        let (sock, addrs) = if unix {
            (sock, None)
        } else {
            // The same descriptor, typed for its addresses (no copy of it).
            let s = std::net::TcpStream::from(sock);
            let a = (s.local_addr()?, s.peer_addr()?);
            (OwnedFd::from(s), Some(a))
        };
        let fd = sock.as_raw_fd();
        // SAFETY: fcntl on an open descriptor, no pointers.
        let fl = unsafe { libc::fcntl(fd, libc::F_GETFL) };
        // SAFETY: as above.
        if fl < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Quiet {
            rd: Arm::new(fd, (libc::EPOLLIN | libc::EPOLLRDHUP) as u32)?,
            wr: Arm::new(fd, libc::EPOLLOUT as u32)?,
            sock,
            unix,
            addrs,
        })
    }

    /// Waits until the socket may be readable (or has failed).
    pub async fn readable(&self) -> io::Result<()> {
        self.rd.wait(self.sock.as_raw_fd()).await
    }

    /// Waits until the socket may be writable (or has failed).
    pub async fn writable(&self) -> io::Result<()> {
        self.wr.wait(self.sock.as_raw_fd()).await
    }

    /// Stops a wait's arming from reporting readability: for a reader that
    /// polls the socket itself from now on (see the module's docs).
    pub fn unarm_readable(&self) -> io::Result<()> {
        self.rd.disarm(self.sock.as_raw_fd())
    }

    /// Whether it is the same-host Unix channel.
    pub fn is_unix(&self) -> bool {
        self.unix
    }

    /// The TCP connection's (local, peer) addresses.
    pub fn tcp_addrs(&self) -> Option<(std::net::SocketAddr, std::net::SocketAddr)> {
        self.addrs
    }

    /// The socket, leaving the runtime (its sets are closed).
    pub fn into_fd(self) -> OwnedFd {
        let Quiet { rd, wr, sock, .. } = self;
        drop(rd);
        drop(wr);
        sock
    }
}

impl AsRawFd for Quiet {
    fn as_raw_fd(&self) -> RawFd {
        self.sock.as_raw_fd()
    }
}

impl AsFd for Quiet {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.sock.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::time::Duration;

    fn pair() -> (Quiet, std::net::TcpStream) {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let a = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        a.set_nonblocking(true).unwrap();
        (Quiet::new(OwnedFd::from(a), false).unwrap(), b)
    }

    /// Readable only once bytes arrive, also when they arrived before the
    /// wait (arming reports present readiness), and again for the next.
    #[tokio::test]
    async fn readable_when_bytes_arrive_before_or_during_the_wait() {
        let (q, mut peer) = pair();
        let w = tokio::time::timeout(Duration::from_millis(50), q.readable()).await;
        assert!(w.is_err(), "readable with nothing sent");
        peer.write_all(b"x").unwrap();
        tokio::time::timeout(Duration::from_secs(5), q.readable())
            .await
            .expect("bytes already there are reported")
            .unwrap();
        // Still unread: reported again.
        tokio::time::timeout(Duration::from_secs(5), q.readable())
            .await
            .expect("unread bytes are reported again")
            .unwrap();
        let mut s = std::net::TcpStream::from(q.sock.try_clone().unwrap());
        let mut b = [0u8; 8];
        assert_eq!(s.read(&mut b).unwrap(), 1);
        let w = tokio::time::timeout(Duration::from_millis(50), q.readable()).await;
        assert!(w.is_err(), "readable after the bytes were read");
        let waiter = async {
            q.readable().await.unwrap();
        };
        let send = async {
            tokio::time::sleep(Duration::from_millis(20)).await;
            peer.write_all(b"y").unwrap();
        };
        tokio::time::timeout(Duration::from_secs(5), async { tokio::join!(waiter, send) })
            .await
            .expect("bytes sent during the wait are reported");
        // EOF counts as readable.
        assert_eq!(s.read(&mut b).unwrap(), 1);
        drop(peer);
        tokio::time::timeout(Duration::from_secs(5), q.readable())
            .await
            .expect("the peer's close is reported")
            .unwrap();
        assert_eq!(s.read(&mut b).unwrap(), 0);
    }

    /// Writable with room; not while the buffers are full; again once the
    /// peer reads.
    #[tokio::test]
    async fn writable_follows_the_send_buffer() {
        let (q, mut peer) = pair();
        tokio::time::timeout(Duration::from_secs(5), q.writable())
            .await
            .expect("an empty send buffer is writable")
            .unwrap();
        let mut s = std::net::TcpStream::from(q.sock.try_clone().unwrap());
        let chunk = vec![7u8; 1 << 16];
        let mut sent = 0usize;
        loop {
            match s.write(&chunk) {
                Ok(n) => sent += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => panic!("{e}"),
            }
        }
        let w = tokio::time::timeout(Duration::from_millis(50), q.writable()).await;
        assert!(w.is_err(), "writable with full buffers");
        let reader = std::thread::spawn(move || {
            let mut b = vec![0u8; 1 << 16];
            let mut got = 0;
            while got < sent {
                got += peer.read(&mut b).unwrap();
            }
            got
        });
        tokio::time::timeout(Duration::from_secs(5), q.writable())
            .await
            .expect("writable once the peer reads")
            .unwrap();
        assert!(reader.join().unwrap() >= 1);
    }

    /// No runtime wake-up for bytes nobody waits for: the sets are
    /// disarmed after a wait is over (the property the module exists for).
    #[test]
    fn a_set_nobody_waits_on_reports_nothing() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let _in = rt.enter();
        let (q, mut peer) = pair();
        peer.write_all(b"x").unwrap();
        rt.block_on(q.readable()).unwrap();
        let mut s = std::net::TcpStream::from(q.sock.try_clone().unwrap());
        let mut b = [0u8; 8];
        assert_eq!(s.read(&mut b).unwrap(), 1);
        // More bytes while nobody waits: the read set stays empty.
        peer.write_all(b"yz").unwrap();
        std::thread::sleep(Duration::from_millis(20));
        assert!(!q.rd.take().unwrap(), "a disarmed set reported bytes");
        // Arming reports them.
        q.rd.arm(q.as_raw_fd()).unwrap();
        assert!(
            q.rd.take().unwrap(),
            "arming did not report bytes already there"
        );
    }
}
