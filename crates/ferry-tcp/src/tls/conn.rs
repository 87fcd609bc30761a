//! A TLS 1.3 session after its handshake: Ferry's own record layer.
//!
//! rustls runs the handshake ([`super`]); then its traffic keys move here
//! and [`crate::io`] calls [`TlsConn::recv`] / [`TlsConn::send`] where it
//! would call `recvmsg` / `sendmsg` on a clear socket. The record logic
//! (headers, nonces, content types, key updates, where each record's
//! ciphertext lands, how plaintext is cut into records) is the sans-IO
//! [`ferry_tcp_proto::record`]; this driver makes the system calls and
//! gives it ring's AEAD. A byte costs one encryption (sending: one copy
//! into the send buffer, sealed there; a large send's records are planned
//! at once and sealed on two threads while the sealed ones are written,
//! see [`super::seal`]) or one decryption (receiving:
//! records that fit the caller's destination are received there and
//! decrypted in place; the others through a small bounce buffer).
//!
//! Invariants:
//! - Each call is non-blocking and holds its direction's lock only for
//!   its own duration (the reader and the writers do not wait for each
//!   other).
//! - `recv` returns `WouldBlock` only after the socket itself did (which
//!   clears Tokio's readiness), and [`TlsConn::has_plaintext`] tells
//!   [`crate::stream::Stream::readable`] about what is already buffered,
//!   so a reader never sleeps on a socket while its bytes sit here.
//! - A record half received into a caller's destination is finished only
//!   in the same destination on the next call; another destination is an
//!   error ([`RecordError::WrongDestination`]), never a write elsewhere.
//! - `send` never modifies the caller's memory, accepts plaintext only
//!   after every earlier record went out, and [`TlsConn::flush`] pushes
//!   the rest: a caller's `write_all` returns only once its records are in
//!   the kernel (as on a clear socket).
//! - End of stream (`close_notify` or a TCP FIN without it) reads as
//!   `Ok(0)`; a record error (forged record, a peer's alert such as a
//!   refused certificate) is an `InvalidData` error whose source is the
//!   [`RecordError`] (see [`crate::tls::io_error_tls`]), and it stays.

use std::io::{self, IoSlice};
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use ferry_tcp_proto::record::{
    self, Aead, Message, Reader, RecordError, Step, Writer, HEADER_LEN, NONCE_LEN, OVERHEAD,
    TAG_LEN,
};

use super::seal::Batch;
use ring::aead::{self as raead, LessSafeKey, UnboundKey};
use ring::hkdf;
use tokio::net::TcpStream;

/// Records a connection seals before writing them out in one `sendmsg`:
/// larger batches mean fewer system calls and wake-ups of the receiver per
/// MiB (measured: 256 KiB cost about 8 % more CPU per GB than 1 MiB, both
/// sides together; 2 and 4 MiB no less than 1 MiB).
const SEND_BUFFER: usize = 1 << 20;

/// Sends of at least this much plaintext are sealed with the helpers'
/// help ([`super::seal`]), in runs of [`RUN`] bytes, each written as soon
/// as it and those before it are sealed; smaller ones are sealed here and
/// written at once. Measured (64 KiB and 1 MiB x 1 and x 16, both
/// directions, interleaved rounds): runs of 32 KiB beat 16 and 64 KiB;
/// sharing from 40 KiB (a target's 64 KiB answers, one send each) gained
/// nothing at 64 KiB x 16 on a quiet machine and cost 64 KiB x 1 a third
/// (the helper's wake-up beside a lone transfer), so 64 KiB sends stay on
/// their thread.
const PARALLEL_MIN: usize = 128 << 10;
/// See [`PARALLEL_MIN`].
const RUN: usize = 32 << 10;

/// A TLS 1.3 suite's AEAD and hash.
#[derive(Clone, Copy)]
pub(crate) struct Suite {
    aead: &'static raead::Algorithm,
    hkdf: hkdf::Algorithm,
}

impl Suite {
    /// The suites Ferry's configurations allow (ring's TLS 1.3 suites).
    pub(crate) fn of(s: rustls::CipherSuite) -> Option<Suite> {
        let (aead, hkdf) = match s {
            rustls::CipherSuite::TLS13_AES_128_GCM_SHA256 => {
                (&raead::AES_128_GCM, hkdf::HKDF_SHA256)
            }
            rustls::CipherSuite::TLS13_AES_256_GCM_SHA384 => {
                (&raead::AES_256_GCM, hkdf::HKDF_SHA384)
            }
            rustls::CipherSuite::TLS13_CHACHA20_POLY1305_SHA256 => {
                (&raead::CHACHA20_POLY1305, hkdf::HKDF_SHA256)
            }
            _ => return None,
        };
        Some(Suite { aead, hkdf })
    }
}

struct Len(usize);

impl hkdf::KeyType for Len {
    fn len(&self) -> usize {
        self.0
    }
}

/// HKDF-Expand-Label(secret, label, "", out.len()) (RFC 8446 §7.1).
fn expand_label(alg: hkdf::Algorithm, secret: &[u8], label: &[u8], out: &mut [u8]) {
    let prk = hkdf::Prk::new_less_safe(alg, secret);
    let len = (out.len() as u16).to_be_bytes();
    let label_len = [(6 + label.len()) as u8];
    let info: [&[u8]; 5] = [&len, &label_len, b"tls13 ", label, &[0]];
    // Lengths here (≤ 48 bytes) are far below HKDF's limit: cannot fail.
    let _ = prk
        .expand(&info, Len(out.len()))
        .and_then(|okm| okm.fill(out));
}

/// One direction's traffic secret and the AEAD of its current key.
pub(crate) struct Keys {
    suite: Suite,
    secret: Vec<u8>,
    aead: RingAead,
    iv: [u8; NONCE_LEN],
}

impl Keys {
    /// The keys of traffic secret `secret`.
    pub(crate) fn new(suite: Suite, secret: Vec<u8>) -> Keys {
        let mut key = vec![0u8; suite.aead.key_len()];
        expand_label(suite.hkdf, &secret, b"key", &mut key);
        let mut iv = [0u8; NONCE_LEN];
        expand_label(suite.hkdf, &secret, b"iv", &mut iv);
        // The key has the algorithm's length: cannot fail.
        let unbound = UnboundKey::new(suite.aead, &key).unwrap_or_else(|_| unreachable!());
        Keys {
            suite,
            secret,
            aead: RingAead(Arc::new(LessSafeKey::new(unbound))),
            iv,
        }
    }

    /// Whether these are the key and IV rustls extracted.
    pub(crate) fn matches(&self, extracted: &rustls::ConnectionTrafficSecrets) -> bool {
        use rustls::ConnectionTrafficSecrets as S;
        let (key, iv) = match extracted {
            S::Aes128Gcm { key, iv }
            | S::Aes256Gcm { key, iv }
            | S::Chacha20Poly1305 { key, iv } => (key, iv),
            _ => return false,
        };
        let mut mine = vec![0u8; self.suite.aead.key_len()];
        expand_label(self.suite.hkdf, &self.secret, b"key", &mut mine);
        mine == key.as_ref() && self.iv[..] == *iv.as_ref()
    }

    /// The keys after a `KeyUpdate` (RFC 8446 §7.2).
    fn next(&self) -> Keys {
        let mut secret = vec![0u8; self.secret.len()];
        expand_label(self.suite.hkdf, &self.secret, b"traffic upd", &mut secret);
        Keys::new(self.suite, secret)
    }
}

/// ring's AEAD (the key is shared with the sealing helpers: ring's keys
/// seal through `&self`).
#[derive(Clone)]
pub(crate) struct RingAead(pub(crate) Arc<LessSafeKey>);

impl Aead for RingAead {
    fn open_within(
        &mut self,
        nonce: [u8; NONCE_LEN],
        aad: [u8; HEADER_LEN],
        in_out: &mut [u8],
        src: usize,
    ) -> Option<usize> {
        self.0
            .open_within(
                raead::Nonce::assume_unique_for_key(nonce),
                raead::Aad::from(aad),
                in_out,
                src..,
            )
            .ok()
            .map(|p| p.len())
    }

    fn seal(
        &mut self,
        nonce: [u8; NONCE_LEN],
        aad: [u8; HEADER_LEN],
        in_out: &mut [u8],
    ) -> Option<[u8; TAG_LEN]> {
        let tag = self
            .0
            .seal_in_place_separate_tag(
                raead::Nonce::assume_unique_for_key(nonce),
                raead::Aad::from(aad),
                in_out,
            )
            .ok()?;
        tag.as_ref().try_into().ok()
    }
}

/// The receiving direction.
struct Rx {
    reader: Reader,
    keys: Keys,
    /// Whether we are the TLS client (which may receive session tickets).
    client: bool,
    failed: Option<RecordError>,
    /// Key updates received.
    updates: u64,
}

/// The sending direction: records sealed in `buf[sent..len]` wait for the
/// socket.
struct Tx {
    writer: Writer,
    keys: Keys,
    buf: Box<[u8]>,
    len: usize,
    sent: usize,
    /// Key updates sent.
    updates: u64,
}

/// A TLS connection over a TCP socket registered with the current runtime.
pub struct TlsConn {
    tcp: TcpStream,
    addrs: (SocketAddr, SocketAddr),
    rx: Mutex<Rx>,
    tx: Mutex<Tx>,
    /// The peer asked for a `KeyUpdate` of ours (the next send pays it).
    owed: AtomicBool,
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
    rx: Rx,
    tx: Tx,
    owed: bool,
}

fn record_error(e: RecordError) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e)
}

/// What the handshake leaves to the record layer.
pub(crate) struct Start {
    /// We are the TLS client.
    pub client: bool,
    /// Our sending keys and the sequence number of our next record.
    pub tx: (Keys, u64),
    /// The peer's, for receiving.
    pub rx: (Keys, u64),
    /// Plaintext rustls decrypted before handing over.
    pub pending: Vec<u8>,
}

impl TlsConn {
    /// Takes over a connection whose handshake is complete.
    pub(crate) fn new(tcp: TcpStream, addrs: (SocketAddr, SocketAddr), s: Start) -> TlsConn {
        let rx = Rx {
            reader: Reader::new(s.rx.0.iv, s.rx.1, s.pending),
            keys: s.rx.0,
            client: s.client,
            failed: None,
            updates: 0,
        };
        let tx = Tx {
            writer: Writer::new(s.tx.0.iv, s.tx.1),
            keys: s.tx.0,
            buf: vec![0u8; SEND_BUFFER + 2 * record::MAX_RECORD].into_boxed_slice(),
            len: 0,
            sent: 0,
            updates: 0,
        };
        TlsConn {
            tcp,
            addrs,
            rx: Mutex::new(rx),
            tx: Mutex::new(tx),
            owed: AtomicBool::new(false),
        }
    }

    fn lock_rx(&self) -> MutexGuard<'_, Rx> {
        // A panic while holding it leaves the state between two steps.
        self.rx.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn lock_tx(&self) -> MutexGuard<'_, Tx> {
        self.tx.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Lowers the number of records sealed under one key before a
    /// `KeyUpdate` (tests: a short transfer crosses several).
    #[cfg(test)]
    pub fn set_key_update_after(&self, records: u64) {
        self.lock_tx().writer.limit = records.max(1);
    }

    /// Key updates (sent, received) so far.
    #[cfg(test)]
    pub fn key_updates(&self) -> (u64, u64) {
        (self.lock_tx().updates, self.lock_rx().updates)
    }

    /// The TCP socket.
    pub fn tcp(&self) -> &TcpStream {
        &self.tcp
    }

    /// The TCP connection's (local, peer) addresses.
    pub fn addrs(&self) -> (SocketAddr, SocketAddr) {
        self.addrs
    }

    /// Whether a read would return without the socket: plaintext or a
    /// whole record is buffered, or the stream has ended or failed.
    pub fn has_plaintext(&self) -> bool {
        let rx = self.lock_rx();
        rx.failed.is_some() || rx.reader.ready()
    }

    /// Reads plaintext into the ranges of `iov` in order, non-blocking.
    /// `Ok(0)` is the end of the stream; `WouldBlock` means the socket is
    /// empty and nothing is buffered.
    ///
    /// # Safety
    ///
    /// Each iovec names memory valid for writes of its length for the
    /// duration of the call (ranges may overlap: each is written through a
    /// slice of its own that ends before the next one is made).
    pub unsafe fn recv(&self, iov: &[libc::iovec]) -> io::Result<usize> {
        let mut rx = self.lock_rx();
        if let Some(e) = &rx.failed {
            return Err(record_error(e.clone()));
        }
        let r = self.recv_locked(&mut rx, iov);
        if let Err(e) = &r {
            if let Some(re) = e.get_ref().and_then(|i| i.downcast_ref::<RecordError>()) {
                rx.failed = Some(re.clone());
            }
        }
        r
    }

    /// [`TlsConn::recv`] under the lock.
    fn recv_locked(&self, rx: &mut Rx, iov: &[libc::iovec]) -> io::Result<usize> {
        let (mut i, mut off, mut got) = (0, 0, 0);
        loop {
            while i < iov.len() && off == iov[i].iov_len {
                (i, off) = (i + 1, 0);
            }
            if i == iov.len() {
                return Ok(got);
            }
            // SAFETY: the caller's contract (`recv`): `iov[i]` is valid for
            // writes of its length during this call; this slice is the only
            // reference to the range while it lives (this iteration).
            let dst = unsafe {
                std::slice::from_raw_parts_mut(
                    (iov[i].iov_base as *mut u8).add(off),
                    iov[i].iov_len - off,
                )
            };
            let Rx { reader, keys, .. } = rx;
            match reader.step(dst, &mut keys.aead).map_err(record_error)? {
                Step::Delivered(0) => {
                    return Err(io::Error::other("TLS record layer made no progress"));
                }
                Step::Delivered(n) => {
                    off += n;
                    got += n;
                }
                Step::Closed => return Ok(got),
                Step::Message => self.message(rx)?,
                Step::Read { dst: d, bounce: b } => {
                    let bounce = &mut reader.bounce_mut()[b];
                    let n = match recv2(&self.tcp, &mut dst[d], bounce) {
                        Ok(n) => n,
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock && got > 0 => {
                            return Ok(got)
                        }
                        Err(e) => return Err(e),
                    };
                    reader.received(n);
                }
            }
        }
    }

    /// Acts on a post-handshake message.
    fn message(&self, rx: &mut Rx) -> io::Result<()> {
        match rx.reader.take_message() {
            Some(Message::KeyUpdate { requested }) => {
                rx.keys = rx.keys.next();
                rx.reader.set_key(rx.keys.iv);
                rx.updates += 1;
                if requested {
                    self.owed.store(true, Ordering::Release);
                }
            }
            // We keep no tickets (a client without them resumes nothing:
            // every handshake is a full one, as Ferry's targets send none).
            Some(Message::NewSessionTicket(_)) if rx.client => {}
            Some(Message::NewSessionTicket(_)) => {
                return Err(record_error(RecordError::BadHandshake(
                    "a session ticket sent to a server",
                )))
            }
            None => {}
        }
        Ok(())
    }

    /// Takes plaintext from `bufs` (sealed into records at once, written as
    /// far as the socket takes them). `WouldBlock` when earlier records
    /// are still waiting for the socket (then nothing was taken).
    pub fn send(&self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        let mut tx = self.lock_tx();
        flush_tx(&mut tx, &self.tcp)?;
        let tx = &mut *tx;
        if self.owed.swap(false, Ordering::AcqRel) || tx.writer.key_update_due() {
            key_update(&mut tx.writer, &mut tx.keys, &mut tx.buf, &mut tx.len)?;
            tx.updates += 1;
        }
        let (mut taken, mut blocked) = (0, false);
        let mut rest: Vec<&[u8]> = bufs.iter().map(|b| &**b).collect();
        while tx.len < SEND_BUFFER {
            let lens: Vec<usize> = rest.iter().map(|b| b.len()).collect();
            let mut recs = Vec::new();
            let got = tx
                .writer
                .plan(&lens, tx.len, SEND_BUFFER, &mut recs)
                .map_err(record_error)?;
            if got > 0 {
                blocked = self.seal_and_write(tx, &rest, recs, blocked)?;
                taken += got;
                rest = skip(&rest, got);
            }
            if tx.writer.key_update_due() {
                key_update(&mut tx.writer, &mut tx.keys, &mut tx.buf, &mut tx.len)?;
                tx.updates += 1;
            } else {
                break;
            }
        }
        match flush_tx(tx, &self.tcp) {
            Err(e) if e.kind() != io::ErrorKind::WouldBlock => Err(e),
            _ => Ok(taken),
        }
    }

    /// Seals planned records `recs` of the plaintext `src` into the send
    /// buffer (from `tx.len`) and, unless the socket was found full
    /// (`blocked`), writes them as they are sealed; large batches are
    /// shared with the sealing helpers ([`super::seal`]). Returns whether
    /// the socket is full.
    fn seal_and_write(
        &self,
        tx: &mut Tx,
        src: &[&[u8]],
        recs: Vec<record::Planned>,
        mut blocked: bool,
    ) -> io::Result<bool> {
        let Some(end) = recs.last().map(|p| p.end()) else {
            return Ok(blocked);
        };
        let plain: usize = recs.iter().map(|p| p.len).sum();
        let share = plain >= PARALLEL_MIN;
        let (base, cap) = (tx.buf.as_mut_ptr(), tx.buf.len());
        // SAFETY: `src` is borrowed for this call and the send buffer is
        // owned by `tx`, borrowed mutably for this call; the batch is
        // dropped (waiting for any helper's work) before this returns, and
        // meanwhile the buffer is only read below, in ranges the batch says
        // are sealed. The plan put the records inside the buffer (a record
        // starts before SEND_BUFFER, and the buffer has room for two more).
        let mut batch =
            unsafe { Batch::new(recs, src, base, cap, tx.keys.aead.clone(), RUN, share) };
        loop {
            let to = batch.sealed_to().map_err(record_error)?;
            let all = batch.done();
            if !blocked && tx.sent < to && (share || all) {
                // SAFETY: `[sent, to)` lies in the buffer, and is sealed:
                // no thread writes it any more (see above).
                let ready = unsafe { std::slice::from_raw_parts(base.add(tx.sent), to - tx.sent) };
                match send1(&self.tcp, ready) {
                    Ok(0) => return Err(io::Error::new(io::ErrorKind::WriteZero, "socket closed")),
                    Ok(n) => tx.sent += n,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => blocked = true,
                    Err(e) => return Err(e),
                }
                continue;
            }
            if all {
                break;
            }
            batch.help_or_wait();
        }
        drop(batch);
        tx.len = end;
        Ok(blocked)
    }

    /// Writes records still waiting for the socket: `Ok` once none is
    /// left, `WouldBlock` if the socket is full.
    pub fn flush(&self) -> io::Result<()> {
        flush_tx(&mut self.lock_tx(), &self.tcp)
    }

    /// Takes the connection off its runtime.
    pub fn detach(self) -> io::Result<Detached> {
        let rx = self.rx.into_inner().unwrap_or_else(|p| p.into_inner());
        let tx = self.tx.into_inner().unwrap_or_else(|p| p.into_inner());
        Ok(Detached {
            fd: self.tcp.into_std()?.into(),
            addrs: self.addrs,
            rx,
            tx,
            owed: self.owed.into_inner(),
        })
    }
}

impl Detached {
    /// Registers the connection with the current runtime.
    pub fn attach(self) -> io::Result<TlsConn> {
        let tcp = TcpStream::from_std(self.fd.into())?;
        Ok(TlsConn {
            tcp,
            addrs: self.addrs,
            rx: Mutex::new(self.rx),
            tx: Mutex::new(self.tx),
            owed: AtomicBool::new(self.owed),
        })
    }
}

/// Appends our `KeyUpdate` under the current key, then changes it.
fn key_update(
    writer: &mut Writer,
    keys: &mut Keys,
    buf: &mut [u8],
    len: &mut usize,
) -> io::Result<()> {
    *len += writer
        .seal_key_update(
            &mut buf[*len..*len + HEADER_LEN + 5 + OVERHEAD],
            false,
            &mut keys.aead,
        )
        .map_err(record_error)?;
    *keys = keys.next();
    writer.set_key(keys.iv);
    Ok(())
}

/// `bufs` without their first `n` bytes.
fn skip<'a>(bufs: &[&'a [u8]], mut n: usize) -> Vec<&'a [u8]> {
    let mut out = Vec::with_capacity(bufs.len());
    for &b in bufs {
        if n >= b.len() {
            n -= b.len();
        } else {
            out.push(&b[n..]);
            n = 0;
        }
    }
    out
}

fn flush_tx(tx: &mut Tx, tcp: &TcpStream) -> io::Result<()> {
    while tx.sent < tx.len {
        let n = send1(tcp, &tx.buf[tx.sent..tx.len])?;
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::WriteZero, "socket closed"));
        }
        tx.sent += n;
    }
    (tx.sent, tx.len) = (0, 0);
    Ok(())
}

fn last_os(r: isize) -> io::Result<usize> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r as usize)
    }
}

/// One non-blocking `sendmsg` of `b` (plain system calls, as [`crate::io`]
/// makes on a clear socket: Tokio's `try_write` would return `WouldBlock`
/// without asking the kernel while its readiness flag is clear).
fn send1(tcp: &TcpStream, b: &[u8]) -> io::Result<usize> {
    // SAFETY: `b` is valid for reads of its length; the socket is open
    // while borrowed.
    let r = unsafe {
        libc::send(
            tcp.as_raw_fd(),
            b.as_ptr().cast(),
            b.len(),
            libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
        )
    };
    last_os(r)
}

/// One non-blocking `recvmsg` into `a` then `b`.
fn recv2(tcp: &TcpStream, a: &mut [u8], b: &mut [u8]) -> io::Result<usize> {
    let mut iov = [
        libc::iovec {
            iov_base: a.as_mut_ptr().cast(),
            iov_len: a.len(),
        },
        libc::iovec {
            iov_base: b.as_mut_ptr().cast(),
            iov_len: b.len(),
        },
    ];
    // SAFETY: an all-zero msghdr is a valid "no address, no control data"
    // header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_mut_ptr();
    msg.msg_iovlen = 2;
    // SAFETY: the iovecs name the two borrowed slices, valid for writes of
    // their lengths for the call; the socket is open while borrowed.
    let r = unsafe { libc::recvmsg(tcp.as_raw_fd(), &mut msg, libc::MSG_DONTWAIT) };
    last_os(r)
}
