//! The same-host path: cross-memory attach (`process_vm_readv` /
//! `process_vm_writev`) between two engines on one machine.
//!
//! The **target stays in control of its memory**. An initiator that has
//! negotiated the path sends CWRITE / CREAD frames naming, per segment,
//! the target range (with its generation) and its own registered source or
//! destination; the target checks the target range under its
//! [`ferry_core::RegionGuard`] exactly as for socket frames, then
//! itself copies with `process_vm_readv` (CWRITE: from the initiator into
//! its region) or `process_vm_writev` (CREAD: from its region into the
//! initiator), and acknowledges. No process ever writes another's memory:
//! the target writes only its own regions, and the initiator's memory is
//! written only at the addresses the initiator named (which it checked
//! against its own regions and keeps registered until the answer).
//!
//! Negotiation (one SAME_HOST request per connection, after the
//! authenticated handshake; a second one closes the connection): the
//! initiator first proves to the kernel which process it is, connecting to
//! the target's per-connection credential socket ([`CredListener`],
//! [`cred_connect`]), then announces its boot id, PID namespace, PID and
//! the address of a probe word holding a fresh random nonce. The target
//! accepts only if the boot id and PID namespace are its own, the PID is
//! the process `SO_PEERCRED` names (of its uid or an allowed one), and —
//! only then looked at — that process holds the very socket of this
//! connection and a `process_vm_readv` of the probe returns the nonce
//! ([`check_offer_on`] has the order). Otherwise it answers with one
//! generic refusal (no errno: the reason goes to its log), and the
//! connection carries payloads on the socket as before. See the module
//! above for the PID-reuse window that remains around each copy.

use std::os::fd::{AsFd, AsRawFd};

use tokio::net::TcpStream;

use crate::negotiate::{CredInvite, HostKey, MAX_CRED_NAME};
use crate::stream::Stream;

pub use ferry_tcp_proto::offer::{Offer, Refusal, BOOT_ID_LEN, OFFER_LEN};

/// `EPERM`, `ESRCH`, … for the common errnos, else `errno N`.
pub fn errno_name(errno: i32) -> String {
    let name = match errno {
        libc::EPERM => "EPERM",
        libc::ESRCH => "ESRCH",
        libc::EFAULT => "EFAULT",
        libc::EACCES => "EACCES",
        libc::ENOSYS => "ENOSYS",
        libc::EINVAL => "EINVAL",
        libc::ENOMEM => "ENOMEM",
        libc::ENOENT => "ENOENT",
        libc::EBADF => "EBADF",
        libc::EPROTOTYPE => "EPROTOTYPE",
        libc::EOPNOTSUPP => "EOPNOTSUPP",
        _ => return format!("errno {errno}"),
    };
    name.to_owned()
}

/// This process's boot id (zero-padded), or the reason it is unknown.
pub fn boot_id() -> Result<[u8; BOOT_ID_LEN], String> {
    let s = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map_err(|e| format!("cannot read the boot id: {e}"))?;
    let s = s.trim().as_bytes();
    let mut out = [0u8; BOOT_ID_LEN];
    let n = s.len().min(BOOT_ID_LEN);
    out[..n].copy_from_slice(&s[..n]);
    Ok(out)
}

/// The inode of this process's PID namespace.
pub fn pid_namespace() -> Result<u64, String> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self/ns/pid")
        .map(|m| m.ino())
        .map_err(|e| format!("cannot read the PID namespace: {e}"))
}

/// This process's [`HostKey`] (boot id and PID namespace), read once per
/// engine; `None` where either cannot be read (no `/proc`).
pub fn host_key() -> Option<HostKey> {
    Some(HostKey::new(&boot_id().ok()?, pid_namespace().ok()?))
}

/// A probe word the target reads to test its access, and the offer that
/// announces it. The word must stay alive until the target answered.
pub fn make_offer() -> Result<(Box<[u8; 16]>, Offer), String> {
    let probe: Box<[u8; 16]> = Box::new(rand::random());
    let offer = Offer {
        boot_id: boot_id()?,
        pidns: pid_namespace()?,
        pid: std::process::id() as u64,
        probe_addr: probe.as_ptr() as u64,
        nonce: *probe,
    };
    Ok((probe, offer))
}

/// Target side: whether the initiator behind `stream`, whose credentials
/// `proof` carries, may be reached by cross-memory attach; `Err(detail)`
/// otherwise (for this process's log only: the peer is told nothing but
/// "refused", [`Refusal::Refused`]). See [`check_offer_on`]. Used by the
/// tests (through `test_support`).
#[cfg_attr(not(feature = "test-support"), allow(dead_code))]
pub fn check_offer(
    stream: &TcpStream,
    offer: &Offer,
    proof: Proven,
    uids: &[u32],
) -> Result<Initiator, String> {
    let addrs = (
        stream
            .local_addr()
            .map_err(|e| format!("local address: {e}"))?,
        stream
            .peer_addr()
            .map_err(|e| format!("peer address: {e}"))?,
    );
    check_offer_on(addrs, offer, proof, uids)
}

/// [`check_offer`] for the TCP connection with these (local, peer)
/// addresses.
///
/// Order (nothing is done to the named process before it is proven):
/// 1. boot id and PID namespace against this process's (no system call
///    on any other process);
/// 2. the offered PID must be the process the kernel attests connected
///    to this connection's credential socket and sent its token
///    (`SO_PEERCRED` of `proof`), and its uid this process's effective uid
///    or one of `uids` (the operator's `same_host_uids`);
/// 3. that process is pinned: the pidfd `SO_PEERPIDFD` gave (Linux ≥ 6.5),
///    else `pidfd_open(2)` of its PID followed by a check that it still
///    holds its end of the credential connection (so the pidfd cannot
///    name a process that got the PID after the prover exited);
/// 4. the pinned process holds this very TCP connection's socket
///    (`/proc/PID/fd`), and a `process_vm_readv` of its probe returns its
///    nonce (the kernel grants this process ptrace-level access to it);
/// 5. it is still alive (so the PID named the pinned process throughout).
pub fn check_offer_on(
    addrs: (std::net::SocketAddr, std::net::SocketAddr),
    offer: &Offer,
    proof: Proven,
    uids: &[u32],
) -> Result<Initiator, String> {
    if boot_id().ok().as_ref() != Some(&offer.boot_id) {
        return Err("another boot id (another host)".to_owned());
    }
    if pid_namespace().ok() != Some(offer.pidns) {
        return Err("another PID namespace".to_owned());
    }
    let pid = i32::try_from(offer.pid).unwrap_or(0);
    if pid <= 0 || pid != proof.pid {
        return Err(format!(
            "the offer names PID {} but the credential socket was connected by PID {}",
            offer.pid, proof.pid
        ));
    }
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    if proof.uid != me && !uids.contains(&proof.uid) {
        return Err(format!(
            "PID {pid} runs as uid {}, not this process's uid {me} nor one of same_host_uids",
            proof.uid
        ));
    }
    let initiator = match proof.pidfd {
        Some(fd) => Initiator::with_pidfd(pid, fd),
        None => {
            let pinned = Initiator::new(pid);
            // Pinned after the connect: the prover must still hold its end
            // (else the PID may have passed to another process).
            if !pinned.pinned() || stream_closed(proof.conn.as_raw_fd()) {
                return Err(format!(
                    "PID {pid} exited, or left its credential connection, before it was pinned"
                ));
            }
            pinned
        }
    };
    match socket_owned_by(addrs, pid) {
        Ok(true) => {}
        Ok(false) => return Err(format!("PID {pid} does not hold this connection's socket")),
        Err(e) => {
            return Err(format!(
                "cannot check that PID {pid} holds this connection's socket: {}",
                errno_name(e)
            ))
        }
    }
    let mut got = [0u8; 16];
    let dst = [iov(got.as_mut_ptr(), got.len())];
    let src = [iov(offer.probe_addr as *mut u8, 16)];
    // SAFETY: `dst` covers `got`, a local array alive for the call; the
    // remote range is only read, in another address space (of the process
    // proven above).
    match unsafe { copy(initiator.remote(), false, &dst, &src) } {
        Ok(16) if got == offer.nonce => {}
        Ok(_) => return Err("the probe read back other bytes than its nonce".to_owned()),
        Err(e) => return Err(format!("process_vm_readv of the probe: {}", errno_name(e))),
    }
    // Alive now, so the PID named the pinned process throughout.
    if !initiator.alive() {
        return Err(format!("PID {pid} exited during the checks"));
    }
    drop(proof.conn);
    Ok(initiator)
}

/// What the kernel attests about the process that connected to a
/// [`CredListener`] and sent its token.
#[derive(Debug)]
pub struct Proven {
    /// Its PID (`SO_PEERCRED`, as of its `connect(2)`).
    pub pid: i32,
    /// Its effective uid then.
    pub uid: u32,
    /// A pidfd of it (`SO_PEERPIDFD`, Linux ≥ 6.5), pinned at its
    /// `connect(2)`; `None` where the kernel has none.
    pidfd: Option<std::os::fd::OwnedFd>,
    /// The connection (held until the checks are done).
    conn: std::os::unix::net::UnixStream,
}

/// `SO_PEERPIDFD` (asm-generic's value; `None` on the architectures that
/// number it otherwise: they fall back to `pidfd_open`).
const SO_PEERPIDFD: Option<libc::c_int> =
    if cfg!(any(target_arch = "sparc", target_arch = "sparc64",)) {
        None
    } else {
        Some(77)
    };

/// The most queued connections one [`CredListener::prove`] looks at
/// (the rest are closed unread when the listener is dropped).
const MAX_CRED_TRIES: usize = 1024;

/// Target side of [`crate::negotiate::SAME_HOST_CRED`]: an abstract Unix
/// socket of random name, one per connection, announced in the target's
/// hello with a random token. It lives until the connection's SAME_HOST
/// offer (or its end).
#[derive(Debug)]
pub struct CredListener {
    listener: std::os::unix::net::UnixListener,
    invite: CredInvite,
}

impl CredListener {
    /// Binds a fresh abstract socket (non-blocking, close-on-exec).
    pub fn bind() -> Result<CredListener, String> {
        use std::os::linux::net::SocketAddrExt;
        let id: u128 = rand::random();
        let name = format!("ferry-cred-{id:032x}").into_bytes();
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(&name)
            .map_err(|e| format!("abstract socket name: {e}"))?;
        let listener = std::os::unix::net::UnixListener::bind_addr(&addr)
            .map_err(|e| format!("credential socket: {e}"))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| format!("credential socket: {e}"))?;
        Ok(CredListener {
            listener,
            invite: CredInvite {
                token: rand::random(),
                name,
            },
        })
    }

    /// What the target's hello announces.
    pub fn invite(&self) -> &CredInvite {
        &self.invite
    }

    /// The queued connection that sent the token (the initiator connects
    /// and sends it before its offer, so it is there when the offer is
    /// read), with the kernel's word on who made it. Never blocks; other
    /// connections are closed.
    pub fn prove(&self) -> Result<Proven, String> {
        for _ in 0..MAX_CRED_TRIES {
            let conn = match self.listener.accept() {
                Ok((c, _)) => c,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(format!("credential socket: accept: {e}")),
            };
            let mut got = [0u8; 16];
            // SAFETY: `got` is a local buffer of 16 bytes.
            let n = unsafe {
                libc::recv(
                    conn.as_raw_fd(),
                    got.as_mut_ptr().cast(),
                    got.len(),
                    libc::MSG_DONTWAIT,
                )
            };
            let same = got
                .iter()
                .zip(&self.invite.token)
                .fold(0u8, |d, (a, b)| d | (a ^ b))
                == 0;
            if n != 16 || !same {
                continue;
            }
            let cred = peer_cred(conn.as_raw_fd())
                .map_err(|e| format!("SO_PEERCRED: {}", errno_name(e)))?;
            let pidfd = peer_pidfd(conn.as_raw_fd());
            return Ok(Proven {
                pid: cred.pid,
                uid: cred.uid,
                pidfd,
                conn,
            });
        }
        Err("no connection to the credential socket carried this connection's token".to_owned())
    }
}

/// Initiator side of [`crate::negotiate::SAME_HOST_CRED`]: connects to
/// the target's credential socket and sends the token. The connection
/// must stay open until the target has answered the offer. Never blocks
/// (a full queue is an error).
pub fn cred_connect(invite: &CredInvite) -> Result<std::os::unix::net::UnixStream, String> {
    use std::os::fd::FromRawFd;
    if invite.name.is_empty() || invite.name.len() > MAX_CRED_NAME {
        return Err("invalid credential socket name".to_owned());
    }
    // SAFETY: socket takes constants and returns a new descriptor or -1.
    let fd = unsafe {
        libc::socket(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
            0,
        )
    };
    if fd < 0 {
        return Err(format!("socket: {}", errno_name(last_errno())));
    }
    // SAFETY: a fresh descriptor returned to us above.
    let conn = unsafe { std::os::unix::net::UnixStream::from_raw_fd(fd) };
    // SAFETY: an all-zero sockaddr_un is valid.
    let mut sa: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    sa.sun_family = libc::AF_UNIX as libc::sa_family_t;
    // sun_path[0] stays 0: the abstract namespace.
    for (d, s) in sa.sun_path[1..].iter_mut().zip(&invite.name) {
        *d = *s as libc::c_char;
    }
    let len = std::mem::size_of::<libc::sa_family_t>() + 1 + invite.name.len();
    // SAFETY: `sa` is a valid sockaddr_un and `len` covers the family, the
    // zero byte and the name.
    let r = unsafe {
        libc::connect(
            conn.as_raw_fd(),
            (&sa as *const libc::sockaddr_un).cast(),
            len as libc::socklen_t,
        )
    };
    if r < 0 {
        return Err(format!(
            "connecting to the target's credential socket: {}",
            errno_name(last_errno())
        ));
    }
    use std::io::Write;
    (&conn)
        .write_all(&invite.token)
        .map_err(|e| format!("sending the credential token: {e}"))?;
    Ok(conn)
}

/// Initiator side: the target's process as the kernel attests it on the
/// credential connection — the process that listens on the socket
/// (`SO_PEERCRED`; for a connected socket, the listener's credentials),
/// pinned by `SO_PEERPIDFD` (Linux ≥ 6.5; else `pidfd_open(2)` of its
/// PID). Granted copies go only to that process
/// ([`crate::same_host::grant::ClientGrants::open`]).
pub fn attested_target(conn: &std::os::unix::net::UnixStream) -> Result<Initiator, String> {
    let cred =
        peer_cred(conn.as_raw_fd()).map_err(|e| format!("SO_PEERCRED: {}", errno_name(e)))?;
    if cred.pid <= 0 {
        return Err("SO_PEERCRED: no PID".to_owned());
    }
    Ok(match peer_pidfd(conn.as_raw_fd()) {
        Some(fd) => Initiator::with_pidfd(cred.pid, fd),
        None => Initiator::new(cred.pid),
    })
}

/// `SO_PEERPIDFD` of the socket `fd`, where the kernel has it.
fn peer_pidfd(fd: std::os::fd::RawFd) -> Option<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    let opt = SO_PEERPIDFD?;
    let mut pidfd: libc::c_int = -1;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `pidfd` and `len` are valid for the int-sized option; on
    // success the kernel installs a new descriptor we own.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            opt,
            (&mut pidfd as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    // SAFETY: a fresh descriptor returned to us above.
    (r == 0 && pidfd >= 0).then(|| unsafe { std::os::fd::OwnedFd::from_raw_fd(pidfd) })
}

/// Whether the peer of the socket `fd` has closed it (or reset it).
fn stream_closed(fd: std::os::fd::RawFd) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLRDHUP,
        revents: 0,
    };
    // SAFETY: one valid pollfd, zero timeout.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    n != 0 && (n < 0 || p.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0)
}

/// The `/proc/net/tcp*` form of a socket address.
fn proc_addr(a: &std::net::SocketAddr) -> String {
    match a.ip() {
        std::net::IpAddr::V4(v4) => {
            format!("{:08X}:{:04X}", u32::from_ne_bytes(v4.octets()), a.port())
        }
        std::net::IpAddr::V6(v6) => {
            let o = v6.octets();
            let words: String = o
                .chunks_exact(4)
                .map(|c| format!("{:08X}", u32::from_ne_bytes([c[0], c[1], c[2], c[3]])))
                .collect();
            format!("{words}:{:04X}", a.port())
        }
    }
}

/// Whether process `pid` holds the other end of `stream` (a socket whose
/// local address is our peer address and remote address ours). `Err`:
/// errno of a lookup that failed.
fn socket_owned_by(
    (ours, theirs): (std::net::SocketAddr, std::net::SocketAddr),
    pid: i32,
) -> Result<bool, i32> {
    let errno = |e: std::io::Error| e.raw_os_error().unwrap_or(libc::EIO);
    let (want_local, want_remote) = (proc_addr(&theirs), proc_addr(&ours));
    let mut inode = None;
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() > 9 && f[1] == want_local && f[2] == want_remote {
                inode = Some(f[9].to_owned());
            }
        }
    }
    let Some(inode) = inode else { return Ok(false) };
    let want = format!("socket:[{inode}]");
    for entry in std::fs::read_dir(format!("/proc/{pid}/fd")).map_err(errno)? {
        let Ok(entry) = entry else { continue };
        if std::fs::read_link(entry.path()).is_ok_and(|l| l.as_os_str() == want.as_str()) {
            return Ok(true);
        }
    }
    Ok(false)
}

/// The credentials (`SO_PEERCRED`) of the peer of the Unix stream socket
/// `fd`, as of its `connect(2)` (or `listen(2)`, seen from the connecting
/// side); the errno if the kernel gives none.
fn peer_cred(fd: std::os::fd::RawFd) -> Result<libc::ucred, i32> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are valid for SO_PEERCRED's ucred.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if r < 0 {
        return Err(last_errno());
    }
    Ok(cred)
}

/// An iovec.
pub fn iov(ptr: *mut u8, len: usize) -> libc::iovec {
    libc::iovec {
        iov_base: ptr.cast(),
        iov_len: len,
    }
}

/// A process to copy with: its PID and, where it is pinned, the
/// descriptor that reports its exit and its open `/proc/PID/mem`
/// (borrowed from the [`Initiator`] that owns them).
///
/// A copy of one range of at most [`MEM_FILE_MAX`] bytes goes through the
/// mem file: it is bound to the process's address space when opened, not
/// to its PID, so it can never reach another process (after an exit or an
/// `exec` the kernel moves nothing and the copy is `ESRCH`), and it needs
/// no question beforehand. Every other copy first asks the exit watch —
/// one non-blocking system call, never a cached verdict — and makes no
/// copy once it reports the exit (`ESRCH`); see the module's safety notes
/// for the window that remains there.
#[derive(Clone, Copy, Debug)]
pub struct Remote<'a> {
    /// Its PID.
    pub pid: i32,
    watch: Option<Watch<'a>>,
    mem: Option<std::os::fd::BorrowedFd<'a>>,
}

/// The largest copy made through `/proc/PID/mem` ([`Remote`]). The kernel
/// moves such a copy through a page of its own (two memory copies where
/// `process_vm_*` makes one), which costs more than the exit-watch
/// question it saves above one page (BENCHMARKS.md, `cma` small copies).
pub const MEM_FILE_MAX: usize = 4096;

/// What reports a pinned process's exit: an epoll instance watching its
/// pidfd (`epoll_wait(2)` with a zero timeout), or the pidfd itself
/// (`poll(2)`) where no epoll instance could be made.
///
/// Both answer from the same kernel event: the process's exit wakes the
/// pidfd's wait queue, which puts the pidfd on the epoll instance's ready
/// list in that same wake-up, before the parent is told and so before the
/// process can be reaped and its PID handed out again. The epoll instance
/// is level-triggered: once there, the pidfd stays reported. An
/// `epoll_wait` with nothing ready only looks at the ready list, where a
/// `poll` asks the pidfd each time: about 0.2 µs against 0.4–0.5 µs here
/// (`BENCHMARKS.md`, `cma::Remote::alive`), paid on every copy.
#[derive(Clone, Copy, Debug)]
struct Watch<'a> {
    fd: std::os::fd::BorrowedFd<'a>,
    epoll: bool,
}

impl Remote<'static> {
    /// A process named by its PID only (nothing to poll): for benchmarks
    /// and tests that copy with this very process.
    #[cfg_attr(not(feature = "test-support"), allow(dead_code))]
    pub fn unpinned(pid: i32) -> Remote<'static> {
        Remote {
            pid,
            watch: None,
            mem: None,
        }
    }
}

impl Remote<'_> {
    /// False once the process's exit is reported (true when unpinned).
    pub fn alive(self) -> bool {
        self.watch
            .is_none_or(|w| !exited(w.fd.as_raw_fd(), w.epoll))
    }
}

/// One non-blocking look at an exit watch (`epoll`: an epoll instance
/// holding the pidfd; else the pidfd): true once its process has exited,
/// or when the call fails (no copy on doubt).
fn exited(fd: std::os::fd::RawFd, epoll: bool) -> bool {
    if epoll {
        let mut ev = libc::epoll_event { events: 0, u64: 0 };
        // SAFETY: room for one event, zero timeout (never sleeps).
        let n = unsafe { libc::epoll_wait(fd, &mut ev, 1, 0) };
        return n != 0;
    }
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd, zero timeout.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    n != 0
}

/// An epoll instance (close-on-exec) watching `pidfd` for its process's
/// exit (`EPOLLIN`, level-triggered), or `None` if one cannot be made.
fn exit_watch(pidfd: &std::os::fd::OwnedFd) -> Option<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    // SAFETY: epoll_create1 takes flags and returns a new descriptor (or
    // -1), which we own.
    let ep = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
    if ep < 0 {
        return None;
    }
    // SAFETY: a fresh descriptor returned to us above.
    let ep = unsafe { std::os::fd::OwnedFd::from_raw_fd(ep) };
    let mut ev = libc::epoll_event {
        events: libc::EPOLLIN as u32,
        u64: 0,
    };
    // SAFETY: both descriptors are open; `ev` is a valid event.
    let r = unsafe {
        libc::epoll_ctl(
            ep.as_raw_fd(),
            libc::EPOLL_CTL_ADD,
            pidfd.as_raw_fd(),
            &mut ev,
        )
    };
    (r == 0).then_some(ep)
}

/// One `process_vm_readv` (`write_remote` false: from `remote` in the
/// process into `local`) or `process_vm_writev` (true: from `local` into
/// `remote`) call, made only if the process's exit watch (if any) does
/// not report its exit right before; returns the bytes moved or the errno
/// (`ESRCH` for a reported exit).
///
/// # Safety
///
/// Every `local` range must be valid for writes (readv) or reads (writev)
/// for the duration of the call. The remote ranges are checked by the
/// kernel (a bad one is `EFAULT`, never a fault in this process).
pub unsafe fn copy(
    to: Remote<'_>,
    write_remote: bool,
    local: &[libc::iovec],
    remote: &[libc::iovec],
) -> Result<usize, i32> {
    if let (Some(mem), [l], [r]) = (to.mem, local, remote) {
        if l.iov_len == r.iov_len && l.iov_len > 0 && l.iov_len <= MEM_FILE_MAX {
            // SAFETY: the caller's guarantee for the local range.
            return unsafe { copy_mem(mem, write_remote, l, r.iov_base as u64) };
        }
    }
    if !to.alive() {
        return Err(libc::ESRCH);
    }
    let pid = to.pid;
    // SAFETY: the caller guarantees the local ranges; the iovec arrays are
    // live slices of the lengths passed.
    let n = unsafe {
        if write_remote {
            libc::process_vm_writev(
                pid,
                local.as_ptr(),
                local.len() as libc::c_ulong,
                remote.as_ptr(),
                remote.len() as libc::c_ulong,
                0,
            )
        } else {
            libc::process_vm_readv(
                pid,
                local.as_ptr(),
                local.len() as libc::c_ulong,
                remote.as_ptr(),
                remote.len() as libc::c_ulong,
                0,
            )
        }
    };
    if n < 0 {
        Err(std::io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EIO))
    } else {
        Ok(n as usize)
    }
}

/// One `pwrite(2)` (`write_remote`) or `pread(2)` of `/proc/PID/mem` at
/// `remote`: the bytes moved, `ESRCH` when the address space it was
/// opened on is gone (the process exited or replaced it with `exec`: the
/// kernel then moves nothing and returns 0), `EFAULT` for a remote range
/// that is not mapped (the kernel's `EIO`), or the errno.
///
/// # Safety
///
/// `local` must be valid for reads (`write_remote`) or writes for the
/// duration of the call.
unsafe fn copy_mem(
    mem: std::os::fd::BorrowedFd<'_>,
    write_remote: bool,
    local: &libc::iovec,
    remote: u64,
) -> Result<usize, i32> {
    // Beyond `i64::MAX` no address is mapped in any process.
    let Ok(at) = libc::off64_t::try_from(remote) else {
        return Err(libc::EFAULT);
    };
    // SAFETY: the caller guarantees the local range; the kernel checks the
    // remote one against the address space the file was opened on.
    let n = unsafe {
        if write_remote {
            libc::pwrite64(mem.as_raw_fd(), local.iov_base, local.iov_len, at)
        } else {
            libc::pread64(mem.as_raw_fd(), local.iov_base, local.iov_len, at)
        }
    };
    match n {
        0 => Err(libc::ESRCH),
        n if n < 0 => Err(match last_errno() {
            libc::EIO => libc::EFAULT,
            e => e,
        }),
        n => Ok(n as usize),
    }
}

/// Moves `len` bytes between `local` and `remote` (one range each),
/// continuing after short counts. `Err(errno)` if the kernel refuses or
/// makes no progress.
///
/// # Safety
///
/// As for [`copy`], for `[local, local+len)`.
pub unsafe fn copy_all(
    to: Remote<'_>,
    write_remote: bool,
    local: *mut u8,
    remote: u64,
    len: usize,
) -> Result<(), i32> {
    let mut done = 0;
    while done < len {
        let l = [iov(local.wrapping_add(done), len - done)];
        let r = [iov(
            (remote as usize).wrapping_add(done) as *mut u8,
            len - done,
        )];
        // SAFETY: the caller guarantees the local range.
        match unsafe { copy(to, write_remote, &l, &r) }? {
            0 => return Err(libc::EFAULT),
            n => done += n,
        }
    }
    Ok(())
}

/// Copies of at least this many bytes are split over the helper threads.
/// Smaller ones are not worth waking a helper (BENCHMARKS.md).
pub const PARALLEL_MIN: usize = 8 << 20;

/// One part of a split copy: `(local, remote, len)` ranges, done in order.
struct Job {
    pid: i32,
    /// The exit watch of `Remote` (-1: none) and whether it is an epoll
    /// instance, open until the submitter has received `done` (it waits
    /// for it, holding the `Initiator`).
    watch: (std::os::fd::RawFd, bool),
    write_remote: bool,
    parts: Vec<(usize, u64, usize)>,
    done: std::sync::mpsc::SyncSender<Result<(), i32>>,
}

/// Helper threads for large copies: `FERRY_CMA_HELPERS=N` (at most 16),
/// by default one when the process may run on two or more CPUs, none
/// otherwise. A target splits a copy of at least [`PARALLEL_MIN`] bytes
/// between its connection thread and the helpers: one thread's
/// `process_vm_readv` pins and copies page by page, and two move about
/// twice as much. Started on first use; they wait on a channel (a short
/// spin after each job, then sleep: no core spins while idle).
struct Pool {
    jobs: std::sync::Mutex<std::sync::mpsc::Sender<Job>>,
    helpers: usize,
}

/// Helper threads started for split copies (0 unless `FERRY_CMA_HELPERS`).
pub fn helpers() -> usize {
    pool().helpers
}

fn pool() -> &'static Pool {
    static POOL: std::sync::OnceLock<Pool> = std::sync::OnceLock::new();
    POOL.get_or_init(|| {
        let cpus = std::thread::available_parallelism().map_or(1, usize::from);
        let helpers = std::env::var("FERRY_CMA_HELPERS")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .unwrap_or(usize::from(cpus >= 2))
            .min(16);
        let (tx, rx) = std::sync::mpsc::channel::<Job>();
        let rx = std::sync::Arc::new(std::sync::Mutex::new(rx));
        let mut started = 0;
        for i in 0..helpers {
            let rx = std::sync::Arc::clone(&rx);
            let spawned = std::thread::Builder::new()
                .name(format!("ferry-cma-{i}"))
                .spawn(move || helper(&rx));
            if spawned.is_ok() {
                started += 1;
            }
        }
        Pool {
            jobs: std::sync::Mutex::new(tx),
            helpers: started,
        }
    })
}

fn helper(rx: &std::sync::Mutex<std::sync::mpsc::Receiver<Job>>) {
    loop {
        let job = {
            let rx = ferry_core::__private::sync::lock(rx);
            // Spin briefly for the next part of a stream of copies.
            let spin_until = std::time::Instant::now() + std::time::Duration::from_micros(50);
            let mut got = None;
            while std::time::Instant::now() < spin_until {
                match rx.try_recv() {
                    Ok(j) => {
                        got = Some(j);
                        break;
                    }
                    Err(std::sync::mpsc::TryRecvError::Empty) => std::hint::spin_loop(),
                    Err(std::sync::mpsc::TryRecvError::Disconnected) => return,
                }
            }
            match got {
                Some(j) => j,
                None => match rx.recv() {
                    Ok(j) => j,
                    Err(_) => return,
                },
            }
        };
        let (fd, epoll) = job.watch;
        let watch = (fd >= 0).then(|| Watch {
            // SAFETY: the submitter holds the descriptor open until it has
            // received this result (see copy_split).
            fd: unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) },
            epoll,
        });
        let to = Remote {
            pid: job.pid,
            watch,
            mem: None,
        };
        let r = job.parts.iter().try_for_each(|&(l, r, n)| {
            // SAFETY: the submitter of the job holds the local ranges
            // valid until it has received this result (see copy_split).
            unsafe { copy_all(to, job.write_remote, l as *mut u8, r, n) }
        });
        let _ = job.done.send(r);
    }
}

/// Moves every `(local, remote)` pair (equal lengths), splitting the bytes
/// over the helper threads and this one when there are at least
/// [`PARALLEL_MIN`] of them. Returns only after every part has finished.
///
/// # Safety
///
/// As for [`copy`], for every local range, until this returns.
pub unsafe fn copy_split(
    to: Remote<'_>,
    write_remote: bool,
    pairs: &[(usize, u64, usize)],
) -> Result<(), i32> {
    let total: usize = pairs.iter().map(|p| p.2).sum();
    let pool = pool();
    let ways = if total >= PARALLEL_MIN {
        (pool.helpers + 1).min(total / (PARALLEL_MIN / 2)).max(1)
    } else {
        1
    };
    // Cut the ranges into `ways` parts of about total / ways bytes
    // (page-aligned cuts).
    let per = (total / ways + 4095) & !4095;
    let mut parts: Vec<Vec<(usize, u64, usize)>> = vec![Vec::new()];
    let mut room = per;
    for &(mut l, mut r, mut n) in pairs {
        while n > 0 {
            if room == 0 && parts.len() < ways {
                parts.push(Vec::new());
                room = per;
            }
            let take = if parts.len() < ways { n.min(room) } else { n };
            if let Some(last) = parts.last_mut() {
                last.push((l, r, take));
            }
            l += take;
            r += take as u64;
            n -= take;
            room = room.saturating_sub(take);
        }
    }
    let mut waits = Vec::new();
    let mut first = None;
    for (i, part) in parts.into_iter().enumerate() {
        if i == 0 {
            first = Some(part);
            continue;
        }
        let (done, wait) = std::sync::mpsc::sync_channel(1);
        let job = Job {
            pid: to.pid,
            watch: to
                .watch
                .map_or((-1, false), |w| (w.fd.as_raw_fd(), w.epoll)),
            write_remote,
            parts: part,
            done,
        };
        let sent = ferry_core::__private::sync::lock(&pool.jobs).send(job);
        match sent {
            Ok(()) => waits.push(wait),
            // No helper left: do it here.
            Err(std::sync::mpsc::SendError(job)) => {
                let r = job.parts.iter().try_for_each(|&(l, r, n)| {
                    // SAFETY: the caller's guarantee.
                    unsafe { copy_all(to, write_remote, l as *mut u8, r, n) }
                });
                waits.push({
                    let (tx, rx) = std::sync::mpsc::sync_channel(1);
                    let _ = tx.send(r);
                    rx
                });
            }
        }
    }
    let mut result = first.unwrap_or_default().iter().try_for_each(|&(l, r, n)| {
        // SAFETY: the caller's guarantee.
        unsafe { copy_all(to, write_remote, l as *mut u8, r, n) }
    });
    // Wait for every helper before the caller may release the memory.
    for w in waits {
        let r = w.recv().unwrap_or(Err(libc::EIO));
        if result.is_ok() {
            result = r;
        }
    }
    result
}

/// The initiator process a connection copies with, pinned by a pidfd
/// where the kernel has them (Linux ≥ 5.3): a copy is never made once
/// that process has exited (each copy asks its exit watch right before
/// it, see [`Remote`]), so a PID reused by another process is never
/// reached but in the window the module's safety notes describe.
#[derive(Debug)]
pub struct Initiator {
    /// Its PID.
    pub pid: i32,
    pidfd: Option<std::os::fd::OwnedFd>,
    /// An epoll instance watching `pidfd` (see [`Watch`]); `None`: the
    /// pidfd is polled itself.
    watch: Option<std::os::fd::OwnedFd>,
    /// `/proc/PID/mem` of the process `pidfd` pins (see [`Remote`]);
    /// `None` where it cannot be opened or proven to be that process's.
    mem: Option<std::fs::File>,
}

impl Initiator {
    /// Pins `pid` with `pidfd_open(2)` (none where the kernel has no
    /// pidfds). The caller must check afterwards that the pinned process
    /// is the one it means ([`check_offer`] does).
    pub fn new(pid: i32) -> Initiator {
        // SAFETY: pidfd_open takes a PID and flags and returns a new fd
        // (or -1), which we own.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        let pidfd = (fd >= 0).then(|| {
            use std::os::fd::FromRawFd;
            // SAFETY: a fresh descriptor returned to us above.
            unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as i32) }
        });
        let watch = pidfd.as_ref().and_then(exit_watch);
        let mem = pidfd.as_ref().and_then(|fd| open_mem(pid, fd));
        Initiator {
            pid,
            pidfd,
            watch,
            mem,
        }
    }

    /// The process `pidfd` pins, whose PID is `pid`.
    pub fn with_pidfd(pid: i32, pidfd: std::os::fd::OwnedFd) -> Initiator {
        Initiator {
            pid,
            watch: exit_watch(&pidfd),
            mem: open_mem(pid, &pidfd),
            pidfd: Some(pidfd),
        }
    }

    /// Whether the process is pinned by a pidfd (false where the kernel
    /// has none).
    pub fn pinned(&self) -> bool {
        self.pidfd.is_some()
    }

    /// The process to copy with: every copy asks its exit watch first.
    pub fn remote(&self) -> Remote<'_> {
        let watch = match (&self.watch, &self.pidfd) {
            (Some(ep), _) => Some(Watch {
                fd: ep.as_fd(),
                epoll: true,
            }),
            (None, Some(fd)) => Some(Watch {
                fd: fd.as_fd(),
                epoll: false,
            }),
            (None, None) => None,
        };
        Remote {
            pid: self.pid,
            watch,
            mem: self.mem.as_ref().map(|f| f.as_fd()),
        }
    }

    /// False once the process has exited (its pidfd reports it).
    pub fn alive(&self) -> bool {
        self.remote().alive()
    }

    /// A copy of the initiator's descriptor number `fd` (`pidfd_getfd`,
    /// Linux ≥ 5.6), or the errno (`ENOSYS` without a pidfd).
    fn take_fd(&self, fd: u32) -> Result<std::os::fd::OwnedFd, i32> {
        use std::os::fd::FromRawFd;
        let Some(pidfd) = &self.pidfd else {
            return Err(libc::ENOSYS);
        };
        let fd = i32::try_from(fd).map_err(|_| libc::EBADF)?;
        // SAFETY: pidfd_getfd takes a pidfd we own, a descriptor number in
        // that process and flags; it returns a new descriptor (close-on-
        // exec) that we own, or -1.
        let got = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) };
        if got < 0 {
            return Err(last_errno());
        }
        // SAFETY: a fresh descriptor returned to us above.
        Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(got as i32) })
    }

    /// Takes over and maps the staging area the initiator offered as its
    /// descriptor number `fd` (see [`crate::same_host::stage`]): only a memfd sealed
    /// against shrinking, of at least [`crate::same_host::stage::AREA_LEN`] bytes.
    pub fn take_stage(&self, fd: u32, grants: bool) -> Result<crate::same_host::stage::Area, i32> {
        crate::same_host::stage::Area::adopt(self.take_fd(fd)?, grants)
    }

    /// Takes over the control channel the initiator offered: its end
    /// `fd` of a Unix socket pair, duplicated into this process with
    /// `pidfd_getfd(2)` (Linux ≥ 5.6). The kernel allows that under the
    /// same ptrace-attach check as `process_vm_readv`, so it grants
    /// nothing the copies do not already need. Accepted only if it is a
    /// Unix stream socket made by that very process (its peer credentials
    /// name the initiator's PID). `Err(errno)` otherwise (`ENOSYS` without
    /// pidfds, `EPROTOTYPE` for another kind of descriptor, `EACCES` for
    /// a socket made by another process).
    pub fn take_channel(&self, fd: u32) -> Result<std::os::unix::net::UnixStream, i32> {
        let owned = self.take_fd(fd)?;
        let int_opt = |level, name| -> Result<libc::c_int, i32> {
            let mut v: libc::c_int = 0;
            let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
            // SAFETY: `v` and `len` are valid for the int-sized option.
            let r = unsafe {
                libc::getsockopt(
                    owned.as_raw_fd(),
                    level,
                    name,
                    (&mut v as *mut libc::c_int).cast(),
                    &mut len,
                )
            };
            if r < 0 {
                Err(last_errno())
            } else {
                Ok(v)
            }
        };
        let domain = int_opt(libc::SOL_SOCKET, libc::SO_DOMAIN).map_err(|_| libc::EPROTOTYPE)?;
        let kind = int_opt(libc::SOL_SOCKET, libc::SO_TYPE).map_err(|_| libc::EPROTOTYPE)?;
        if domain != libc::AF_UNIX || kind != libc::SOCK_STREAM {
            return Err(libc::EPROTOTYPE);
        }
        let cred = peer_cred(owned.as_raw_fd())?;
        if cred.pid != self.pid {
            return Err(libc::EACCES);
        }
        let stream = std::os::unix::net::UnixStream::from(owned);
        stream
            .set_nonblocking(true)
            .map_err(|e| e.raw_os_error().unwrap_or(libc::EIO))?;
        Ok(stream)
    }
}

/// `/proc/PID/mem` of the process `pidfd` pins, opened for reading and
/// writing, or `None`: no `/proc` of this PID namespace, no access (the
/// same ptrace-attach check as `process_vm_*`), or no proof that the file
/// is that process's. The proof: the pidfd names `pid` (its `fdinfo`)
/// and its process is still alive after the open, so the PID named that
/// process throughout and the file is bound to its address space.
fn open_mem(pid: i32, pidfd: &std::os::fd::OwnedFd) -> Option<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    // `/proc` must be this PID namespace's: its `self` is this process.
    static OWN_PROC: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let own = *OWN_PROC.get_or_init(|| {
        std::fs::read_link("/proc/self")
            .is_ok_and(|p| p.as_os_str() == std::process::id().to_string().as_str())
    });
    if !own || pid <= 0 {
        return None;
    }
    let fdinfo =
        std::fs::read_to_string(format!("/proc/self/fdinfo/{}", pidfd.as_raw_fd())).ok()?;
    let named = fdinfo
        .lines()
        .find_map(|l| l.strip_prefix("Pid:"))
        .and_then(|v| v.trim().parse::<i32>().ok());
    if named != Some(pid) {
        return None;
    }
    let mem = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(format!("/proc/{pid}/mem"))
        .map_err(|e| tracing::debug!(pid, error = %e, "no /proc/PID/mem: copies go by PID"))
        .ok()?;
    (!exited(pidfd.as_raw_fd(), false)).then_some(mem)
}

/// The calling thread's errno.
fn last_errno() -> i32 {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

impl Initiator {
    /// Whether a copy for this initiator may go ahead: its process is
    /// alive (pidfd) and it has not closed (or reset) `stream`. One
    /// `poll(2)` for both checks.
    pub fn alive_for(&self, stream: &Stream) -> bool {
        let mut p = [
            libc::pollfd {
                fd: stream.as_raw_fd(),
                events: libc::POLLRDHUP,
                revents: 0,
            },
            libc::pollfd {
                fd: self.pidfd.as_ref().map_or(-1, |f| f.as_raw_fd()),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: two valid pollfds (a negative fd is ignored), zero
        // timeout.
        let n = unsafe { libc::poll(p.as_mut_ptr(), 2, 0) };
        if n < 0 {
            return !peer_closed(stream) && self.alive();
        }
        let closed = p[0].revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0;
        let exited = p[1].revents != 0;
        !closed && !exited
    }
}

/// Whether the initiator has closed (or reset) `stream`: checked right
/// before each copy, so a target never copies for a connection its
/// initiator has given up (see the README for the remaining window).
pub fn peer_closed(stream: &Stream) -> bool {
    let mut p = libc::pollfd {
        fd: stream.as_raw_fd(),
        events: libc::POLLRDHUP,
        revents: 0,
    };
    // SAFETY: one valid pollfd, zero timeout.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    n > 0 && p.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offers_round_trip_and_reasons_are_named() {
        let (_probe, offer) = make_offer().expect("linux");
        assert_eq!(Offer::decode(&offer.encode()), offer);
        assert_eq!(
            Refusal::describe(Refusal::ProbeFailed as u64, libc::EPERM as u64, errno_name),
            "process_vm_readv: EPERM"
        );
        assert_eq!(errno_name(12345), "errno 12345");
    }

    /// The core's host token is the MAC ferry-core's `raw::auth::proof`
    /// computes, keyed by `boot id/PID-namespace inode`, as it was when
    /// the token was computed with it (a change here is a wire change:
    /// peers of two builds would never agree on one host).
    #[test]
    fn host_tokens_are_the_proof_keyed_by_boot_and_namespace() {
        let (boot, ns) = (boot_id().expect("linux"), pid_namespace().expect("linux"));
        let end = boot.iter().position(|&b| b == 0).unwrap_or(boot.len());
        let key = format!("{}/{ns}", String::from_utf8_lossy(&boot[..end]));
        let (ni, nt) = ([1u8; 32], [2u8; 32]);
        assert_eq!(
            crate::negotiate::host_token(&host_key().expect("linux"), &ni, &nt),
            ferry_core::raw::auth::proof(&key, b"ferry-tcp host", &ni, &nt)
        );
    }

    /// Item 6 of issue 41: the copy itself asks the pidfd (no cached
    /// verdict). An `Initiator` of this very process's PID but with the
    /// pidfd of a child that exited: the kernel would allow the copy, the
    /// pidfd's exit report stops it, and the destination stays untouched.
    #[test]
    fn a_pidfd_reporting_exit_prevents_the_copy() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("sleep");
        let theirs = Initiator::new(child.id() as i32);
        assert!(theirs.pinned() && theirs.alive());
        let me = std::process::id() as i32;
        let src = vec![7u8; 4096];
        let mut dst = vec![0u8; 4096];
        let pidfd = theirs.pidfd.as_ref().expect("pinned").try_clone().unwrap();
        let mixed = Initiator::with_pidfd(me, pidfd);
        // SAFETY: `dst` is a live local buffer of that length.
        let r = unsafe {
            copy_all(
                mixed.remote(),
                false,
                dst.as_mut_ptr(),
                src.as_ptr() as u64,
                dst.len(),
            )
        };
        assert_eq!(r, Ok(()), "alive: the copy is made");
        assert!(dst == src);
        dst.fill(0);
        child.kill().expect("kill");
        child.wait().expect("reap");
        assert!(!theirs.alive(), "the pidfd reports the exit at once");
        // SAFETY: as above.
        let r = unsafe {
            copy_all(
                mixed.remote(),
                false,
                dst.as_mut_ptr(),
                src.as_ptr() as u64,
                dst.len(),
            )
        };
        assert_eq!(
            r,
            Err(libc::ESRCH),
            "no copy once the pidfd reports the exit"
        );
        assert!(dst.iter().all(|&b| b == 0), "nothing was copied");
        let pairs = [(dst.as_mut_ptr() as usize, src.as_ptr() as u64, dst.len())];
        assert_eq!(
            // SAFETY: as above, through the split path (one part here).
            unsafe { copy_split(mixed.remote(), false, &pairs) },
            Err(libc::ESRCH)
        );
        assert!(dst.iter().all(|&b| b == 0), "nothing was copied");
        // A reaped PID cannot be pinned (grants need a pin).
        assert!(!Initiator::new(child.id() as i32).pinned());
    }

    /// Both kinds of exit watch (the epoll instance an `Initiator` makes,
    /// and the pidfd polled itself where none can be made) say alive while
    /// the process lives, and report its exit before it is reaped (a
    /// zombie's PID cannot be handed out yet), and still after.
    #[test]
    fn both_exit_watches_report_the_exit_before_the_reap() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("sleep");
        let pinned = Initiator::new(child.id() as i32);
        assert!(pinned.watch.is_some(), "an epoll instance was made");
        let pidfd = pinned.pidfd.as_ref().expect("pinned");
        let by_epoll = pinned.remote();
        let by_poll = Remote {
            pid: pinned.pid,
            watch: Some(Watch {
                fd: pidfd.as_fd(),
                epoll: false,
            }),
            mem: None,
        };
        assert!(by_epoll.watch.is_some_and(|w| w.epoll));
        for _ in 0..1000 {
            assert!(by_epoll.alive() && by_poll.alive(), "alive while it lives");
        }
        child.kill().expect("kill");
        let start = std::time::Instant::now();
        while by_poll.alive() {
            assert!(start.elapsed() < std::time::Duration::from_secs(10));
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        // The pidfd reports the exit: the epoll instance does too, at once
        // and every time after, and the process is not reaped yet.
        for _ in 0..3 {
            assert!(!by_epoll.alive(), "the epoll watch reports what poll does");
        }
        // SAFETY: siginfo_t is plain data; all zeroes is a valid value.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: waitid on our own child with WNOWAIT: it stays a zombie.
        let r = unsafe {
            libc::waitid(
                libc::P_PID,
                child.id(),
                &mut info,
                libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
            )
        };
        assert_eq!(r, 0);
        // SAFETY: filled by waitid for an exited child.
        assert_eq!(unsafe { info.si_pid() }, child.id() as i32, "a zombie");
        child.wait().expect("reap");
        assert!(
            !by_epoll.alive() && !by_poll.alive(),
            "reported after the reap"
        );
    }

    /// A child forked from this process (so `buf` lies at the same address
    /// in it), that waits for a byte on `go` and then replaces itself with
    /// `sleep 30` (or, on end of file, exits).
    fn forked_child(go: std::os::fd::RawFd) -> i32 {
        let path = std::ffi::CString::new("/bin/sleep").unwrap();
        let arg0 = std::ffi::CString::new("sleep").unwrap();
        let arg1 = std::ffi::CString::new("30").unwrap();
        let argv = [arg0.as_ptr(), arg1.as_ptr(), std::ptr::null()];
        // SAFETY: the child calls only async-signal-safe functions (read,
        // execv, _exit) on data prepared before the fork.
        unsafe {
            let pid = libc::fork();
            assert!(pid >= 0, "fork");
            if pid == 0 {
                let mut b = 0u8;
                if libc::read(go, (&mut b as *mut u8).cast(), 1) == 1 {
                    libc::execv(path.as_ptr(), argv.as_ptr());
                }
                libc::_exit(0);
            }
            pid
        }
    }

    /// Issue 41 (item 6): a copy of one page goes through the process's
    /// `/proc/PID/mem`, bound to its address space and not to its PID:
    /// it lands while the process lives, and once the process has exited
    /// (still a zombie here, so its PID cannot have been handed out) or
    /// has replaced its image with `exec`, the kernel moves nothing — with
    /// no exit watch asked at all. A copy by PID after the `exec` would
    /// reach the new image.
    #[test]
    fn one_page_copies_go_to_the_address_space_not_the_pid() {
        let buf = vec![0u8; 4096];
        let src = vec![0x5au8; 4096];
        let mut back = vec![0u8; 4096];
        for end in ["exit", "exec"] {
            let mut fds = [0; 2];
            // SAFETY: `fds` has room for the two descriptors.
            assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
            let pid = forked_child(fds[0]);
            // SAFETY: our copy of the read end; the child has its own.
            unsafe { libc::close(fds[0]) };
            let theirs = Initiator::new(pid);
            assert!(theirs.mem.is_some(), "{end}: the mem file is open");
            let by_mem = Remote {
                watch: None,
                ..theirs.remote()
            };
            // SAFETY: `src` is a live buffer of that length.
            let r = unsafe {
                copy_all(
                    by_mem,
                    true,
                    src.as_ptr().cast_mut(),
                    buf.as_ptr() as u64,
                    4096,
                )
            };
            assert_eq!(r, Ok(()), "{end}: alive, the copy lands");
            // SAFETY: `back` is a live buffer of that length.
            unsafe {
                copy_all(
                    Remote::unpinned(pid),
                    false,
                    back.as_mut_ptr(),
                    buf.as_ptr() as u64,
                    4096,
                )
            }
            .expect("read back by PID");
            assert!(back == src, "{end}: the bytes are in the child");
            assert!(buf.iter().all(|&b| b == 0), "not in this process");
            if end == "exit" {
                // SAFETY: signals our own child.
                unsafe { libc::kill(pid, libc::SIGKILL) };
                let start = std::time::Instant::now();
                while theirs.alive() {
                    assert!(start.elapsed() < std::time::Duration::from_secs(10));
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
            } else {
                // SAFETY: one byte from a live buffer.
                assert_eq!(unsafe { libc::write(fds[1], b"x".as_ptr().cast(), 1) }, 1);
                let start = std::time::Instant::now();
                while std::fs::read_link(format!("/proc/{pid}/exe"))
                    .is_ok_and(|p| !p.ends_with("sleep"))
                {
                    assert!(start.elapsed() < std::time::Duration::from_secs(10));
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
                assert!(theirs.alive(), "exec is no exit");
            }
            // SAFETY: as above.
            let r = unsafe {
                copy_all(
                    by_mem,
                    true,
                    src.as_ptr().cast_mut(),
                    buf.as_ptr() as u64,
                    4096,
                )
            };
            assert_eq!(r, Err(libc::ESRCH), "{end}: nothing moves");
            // SAFETY: our own child, reaped once.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
                libc::waitpid(pid, std::ptr::null_mut(), 0);
                libc::close(fds[1]);
            }
        }
    }

    #[test]
    fn copies_within_this_process() {
        let src = vec![7u8; 100_000];
        let mut dst = vec![0u8; 100_000];
        let pid = Remote::unpinned(std::process::id() as i32);
        // SAFETY: `dst` is a live local buffer of that length.
        unsafe { copy_all(pid, false, dst.as_mut_ptr(), src.as_ptr() as u64, dst.len()) }
            .expect("copy");
        assert_eq!(src, dst);
        // SAFETY: as above; the remote address is unmapped, which the
        // kernel reports as EFAULT.
        let e = unsafe { copy_all(pid, false, dst.as_mut_ptr(), 8, 16) };
        assert_eq!(e, Err(libc::EFAULT));
        // Split over two helpers (only this test uses the pool in this
        // binary): several ranges, uneven lengths.
        std::env::set_var("FERRY_CMA_HELPERS", "2");
        let src: Vec<u8> = (0..5_000_000u32).map(|i| (i % 251) as u8).collect();
        let mut dst = vec![0u8; src.len()];
        let pairs = [
            (dst.as_mut_ptr() as usize, src.as_ptr() as u64, 1_234_567),
            (
                dst.as_mut_ptr() as usize + 1_234_567,
                src.as_ptr() as u64 + 1_234_567,
                src.len() - 1_234_567,
            ),
        ];
        // SAFETY: `dst` is live and of that length until the call returns.
        unsafe { copy_split(pid, false, &pairs) }.expect("split copy");
        assert!(src == dst);
    }
}
