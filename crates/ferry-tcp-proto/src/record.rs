//! TLS 1.3 records after the handshake (RFC 8446 §5), without the crypto
//! and without the socket.
//!
//! rustls runs the handshake; from then on the driver moves the records
//! itself and this module decides everything about them: the record
//! header and its limits, the sequence numbers and nonces of each
//! direction, the inner content type (application data, the post-handshake
//! messages `KeyUpdate` and `NewSessionTicket`, alerts), the padding, how
//! a stream of plaintext is cut into records, and — the point of it —
//! **where each record's ciphertext lands**. The AEAD itself comes in
//! through [`Aead`] (the driver's is ring's).
//!
//! # Receiving
//!
//! [`Reader::step`] is given the destination the caller wants the next
//! plaintext in (one range) and answers with what to do:
//!
//! - a record whose ciphertext fits inside the destination is received
//!   **directly there** and decrypted in place: its plaintext ends up at
//!   the start of the range, where the caller wants it, and the type byte
//!   and tag left behind are overwritten by the next record. When the
//!   destination is larger than the largest record (plus its header), the
//!   reader receives the stream, headers included, straight into it up to
//!   one record short of its end ("bulk"), and decrypts each record
//!   towards the front (ring's `open_within` shifts as it decrypts): one
//!   system call for many records.
//! - anything else (a record straddling the end of the destination, a
//!   small destination such as a frame header) goes through a
//!   per-connection bounce buffer and is copied out.
//!
//! A record received partly into the destination stays there between two
//! calls: the next call must pass the same destination (the same address,
//! advanced by the plaintext delivered). Anything else is
//! [`RecordError::WrongDestination`]: the reader never decrypts into memory
//! the current call did not pass.
//!
//! # Sending
//!
//! [`record_len`] cuts the plaintext: a large range (a payload) gets
//! records of its own, the last of them [`SHORT_TAIL`] bytes long, so that
//! the receiver decrypts every other record of the range in place and
//! copies only the short one; small ranges (headers) share records.
//! [`Writer::seal`] numbers, seals and frames a record the driver copied
//! the plaintext into (the source memory is never modified).
//! [`Writer::plan`] does the same cutting and numbering for a whole send
//! at once: each [`Planned`] record says where its plaintext comes from,
//! where it lands in the send buffer and its nonce, so that the driver can
//! seal the records of a send on several threads ([`seal_planned`], in
//! runs cut by [`runs`]) and write each run once it is sealed.

use std::collections::VecDeque;
use std::fmt;
use std::ops::Range;

/// A record header: type, legacy version, length.
pub const HEADER_LEN: usize = 5;
/// Most plaintext bytes in a record.
pub const MAX_PLAINTEXT: usize = 1 << 14;
/// Most bytes after a record's header (RFC 8446 §5.2: 2^14 + 256).
pub const MAX_CIPHERTEXT: usize = MAX_PLAINTEXT + 256;
/// Most bytes a record takes on the wire.
pub const MAX_RECORD: usize = HEADER_LEN + MAX_CIPHERTEXT;
/// The AEAD tag of the TLS 1.3 suites.
pub const TAG_LEN: usize = 16;
/// A TLS 1.3 nonce.
pub const NONCE_LEN: usize = 12;
/// Bytes a record adds to its plaintext: header, inner type, tag.
pub const OVERHEAD: usize = HEADER_LEN + 1 + TAG_LEN;

/// Destinations at least this long receive records in place; shorter ones
/// (frame headers, small bodies) through the bounce buffer.
pub const DIRECT_MIN: usize = 8 << 10;
/// A plaintext range at least this long gets records of its own (see
/// [`record_len`]).
pub const BIG: usize = DIRECT_MIN;
/// The length of the last record of a large range: the receiver copies
/// that record (its type byte would land past the destination), so it is
/// kept short. At least 17 bytes, so that the record before it, with its
/// type byte and tag, still fits the destination.
pub const SHORT_TAIL: usize = 32;
/// Records sealed with one key before the sender changes it (AES-GCM's
/// confidentiality limit is 2^24.5 full records, RFC 8446 §5.5; rustls
/// updates at 2^23; this leaves a wide margin).
pub const KEY_UPDATE_AFTER: u64 = 1 << 22;

/// Most stream bytes one bulk read takes into the destination (what
/// follows is decrypted while the kernel's copy is still in cache).
pub const BULK_MAX: usize = 256 << 10;
/// The bounce buffer (two largest records and room to spare).
const BOUNCE: usize = 64 << 10;
/// A read with nothing known about what comes takes up to this much.
const COLD_READ: usize = 16 << 10;
/// Most post-handshake message bytes buffered.
const MAX_HANDSHAKE: usize = 64 << 10;

/// Inner content types (RFC 8446 §5.1).
pub const CONTENT_ALERT: u8 = 21;
/// See [`CONTENT_ALERT`].
pub const CONTENT_HANDSHAKE: u8 = 22;
/// See [`CONTENT_ALERT`].
pub const CONTENT_APPLICATION_DATA: u8 = 23;
/// Handshake message types after the handshake.
const HS_NEW_SESSION_TICKET: u8 = 4;
const HS_KEY_UPDATE: u8 = 24;
/// Alert descriptions with a meaning here.
const ALERT_CLOSE_NOTIFY: u8 = 0;
const ALERT_USER_CANCELED: u8 = 90;

/// Why the record layer gave up on a connection (each is fatal).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RecordError {
    /// A header that is not TLS 1.3's encrypted record (type 23, version
    /// 0x0303).
    BadHeader {
        /// Outer content type.
        typ: u8,
        /// Legacy version field.
        version: u16,
    },
    /// A record length outside `17 ..= 2^14 + 256`, or an inner plaintext
    /// longer than 2^14 + 1.
    BadLength(usize),
    /// The record did not authenticate (forged, corrupted, wrong key).
    BadRecordMac,
    /// An inner plaintext of zeros only (no content type).
    NoContentType,
    /// An inner content type not allowed after the handshake.
    UnexpectedContentType(u8),
    /// A malformed alert record.
    BadAlert,
    /// The peer sent a fatal alert (its description).
    Alert(u8),
    /// A post-handshake message that is malformed or not accepted.
    BadHandshake(&'static str),
    /// The caller passed another destination while a record was half
    /// received in the previous one.
    WrongDestination,
    /// A sequence number would wrap.
    SequenceExhausted,
    /// The AEAD failed to seal (the driver's key is unusable).
    Seal,
}

impl fmt::Display for RecordError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RecordError::BadHeader { typ, version } => write!(
                f,
                "TLS record header of type {typ} version {version:#06x} (want 23, 0x0303)"
            ),
            RecordError::BadLength(n) => write!(f, "TLS record length {n} out of bounds"),
            RecordError::BadRecordMac => {
                f.write_str("TLS record failed authentication (bad_record_mac)")
            }
            RecordError::NoContentType => f.write_str("TLS record without a content type"),
            RecordError::UnexpectedContentType(t) => {
                write!(f, "TLS record of unexpected content type {t}")
            }
            RecordError::BadAlert => f.write_str("malformed TLS alert"),
            RecordError::Alert(d) => write!(f, "the peer sent TLS alert {d} ({})", alert_name(*d)),
            RecordError::BadHandshake(w) => write!(f, "TLS post-handshake message: {w}"),
            RecordError::WrongDestination => f.write_str(
                "a TLS record was half received into one destination and the next read passed another",
            ),
            RecordError::SequenceExhausted => f.write_str("TLS sequence number exhausted"),
            RecordError::Seal => f.write_str("TLS record sealing failed"),
        }
    }
}

impl std::error::Error for RecordError {}

/// The name of an alert description (RFC 8446 §6).
pub fn alert_name(d: u8) -> &'static str {
    match d {
        0 => "close_notify",
        10 => "unexpected_message",
        20 => "bad_record_mac",
        22 => "record_overflow",
        40 => "handshake_failure",
        42 => "bad_certificate",
        43 => "unsupported_certificate",
        44 => "certificate_revoked",
        45 => "certificate_expired",
        46 => "certificate_unknown",
        47 => "illegal_parameter",
        48 => "unknown_ca",
        49 => "access_denied",
        50 => "decode_error",
        51 => "decrypt_error",
        70 => "protocol_version",
        71 => "insufficient_security",
        80 => "internal_error",
        90 => "user_canceled",
        109 => "missing_extension",
        110 => "unsupported_extension",
        116 => "certificate_required",
        _ => "unknown alert",
    }
}

/// The AEAD of one direction's current key (the driver's).
pub trait Aead {
    /// Authenticates and decrypts `in_out[src..]` (ciphertext, then the
    /// tag), writing the plaintext at `in_out[..]` (it may overlap the
    /// input: `open_within`). Returns the plaintext length, or `None` if
    /// the record does not authenticate.
    fn open_within(
        &mut self,
        nonce: [u8; NONCE_LEN],
        aad: [u8; HEADER_LEN],
        in_out: &mut [u8],
        src: usize,
    ) -> Option<usize>;

    /// Encrypts `in_out` in place and returns the tag.
    fn seal(
        &mut self,
        nonce: [u8; NONCE_LEN],
        aad: [u8; HEADER_LEN],
        in_out: &mut [u8],
    ) -> Option<[u8; TAG_LEN]>;
}

/// One direction's IV and sequence number.
#[derive(Clone, Debug)]
struct Seq {
    iv: [u8; NONCE_LEN],
    seq: u64,
}

impl Seq {
    /// The next record's nonce (RFC 8446 §5.3: the IV XOR the sequence
    /// number, left-padded), and the number advanced.
    fn next(&mut self) -> Result<[u8; NONCE_LEN], RecordError> {
        let mut n = self.iv;
        for (b, s) in n[NONCE_LEN - 8..].iter_mut().zip(self.seq.to_be_bytes()) {
            *b ^= s;
        }
        self.seq = self
            .seq
            .checked_add(1)
            .ok_or(RecordError::SequenceExhausted)?;
        Ok(n)
    }
}

/// The body length of a record with header `h` (checked).
pub fn parse_header(h: [u8; HEADER_LEN]) -> Result<usize, RecordError> {
    let version = u16::from_be_bytes([h[1], h[2]]);
    if h[0] != CONTENT_APPLICATION_DATA || version != 0x0303 {
        return Err(RecordError::BadHeader { typ: h[0], version });
    }
    let len = usize::from(u16::from_be_bytes([h[3], h[4]]));
    if !(1 + TAG_LEN..=MAX_CIPHERTEXT).contains(&len) {
        return Err(RecordError::BadLength(len));
    }
    Ok(len)
}

/// The header of a record whose body (ciphertext and tag) is `len` bytes.
pub fn header(len: usize) -> [u8; HEADER_LEN] {
    let l = (len as u16).to_be_bytes();
    [CONTENT_APPLICATION_DATA, 0x03, 0x03, l[0], l[1]]
}

/// Opens a record: `in_out[src..]` is its body, the inner plaintext goes
/// to `in_out[..]`. Returns its content type and content length (padding
/// stripped).
fn open_record<A: Aead>(
    seq: &mut Seq,
    aead: &mut A,
    h: [u8; HEADER_LEN],
    in_out: &mut [u8],
    src: usize,
) -> Result<(u8, usize), RecordError> {
    let nonce = seq.next()?;
    let m = aead
        .open_within(nonce, h, in_out, src)
        .ok_or(RecordError::BadRecordMac)?;
    if m > MAX_PLAINTEXT + 1 {
        return Err(RecordError::BadLength(m));
    }
    let inner = in_out.get(..m).ok_or(RecordError::BadRecordMac)?;
    let at = inner
        .iter()
        .rposition(|&b| b != 0)
        .ok_or(RecordError::NoContentType)?;
    Ok((inner[at], at))
}

/// A post-handshake message the driver acts on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Message {
    /// The peer changed its sending key: change ours for receiving
    /// ([`Reader::set_key`]); with `requested`, send a `KeyUpdate` of our
    /// own before the next application data.
    KeyUpdate {
        /// `update_requested`.
        requested: bool,
    },
    /// A session ticket (the message body), for a client to keep or drop.
    NewSessionTicket(Vec<u8>),
}

/// What [`Reader::step`] wants next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// This many plaintext bytes were written at the start of the
    /// destination.
    Delivered(usize),
    /// Read from the socket into `dst` (a range of the destination; may be
    /// empty), then into `bounce` (a range of [`Reader::bounce_mut`]), in
    /// one system call; then [`Reader::received`].
    Read {
        /// Where in the destination.
        dst: Range<usize>,
        /// Where in the bounce buffer.
        bounce: Range<usize>,
    },
    /// A post-handshake message waits: [`Reader::take_message`].
    Message,
    /// The peer closed the stream (`close_notify`, or the socket ended).
    Closed,
}

/// Stream bytes received into the caller's destination and not yet
/// decrypted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Run {
    /// The address of the destination the next call must pass.
    addr: usize,
    /// Offset of the first undecrypted stream byte.
    c: usize,
    /// Stream bytes at `c`.
    have: usize,
}

/// The receiving direction (see the module documentation).
pub struct Reader {
    seq: Seq,
    /// The bounce buffer; raw stream bytes are `buf[rs..re]`.
    buf: Vec<u8>,
    rs: usize,
    re: usize,
    /// Decrypted plaintext not yet delivered: `plain[ps..]`.
    plain: Vec<u8>,
    ps: usize,
    /// The record whose body comes next: its body length and header.
    hdr: Option<(usize, [u8; HEADER_LEN])>,
    run: Option<Run>,
    /// The read planned by the last step.
    plan: Option<(Range<usize>, Range<usize>)>,
    /// Post-handshake bytes not yet a whole message.
    hs: Vec<u8>,
    msgs: VecDeque<Message>,
    closed: bool,
    /// Most stream bytes one bulk read takes into the destination.
    pub bulk_max: usize,
}

impl fmt::Debug for Reader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Reader")
            .field("seq", &self.seq.seq)
            .field("raw", &(self.re - self.rs))
            .field("pending", &(self.plain.len() - self.ps))
            .field("run", &self.run)
            .field("closed", &self.closed)
            .finish_non_exhaustive()
    }
}

impl Reader {
    /// A reader whose first record has sequence number `seq` under `iv`,
    /// with `pending` plaintext decrypted before it took over (delivered
    /// first).
    pub fn new(iv: [u8; NONCE_LEN], seq: u64, pending: Vec<u8>) -> Reader {
        Reader {
            seq: Seq { iv, seq },
            buf: vec![0u8; BOUNCE],
            rs: 0,
            re: 0,
            plain: pending,
            ps: 0,
            hdr: None,
            run: None,
            plan: None,
            hs: Vec::new(),
            msgs: VecDeque::new(),
            closed: false,
            bulk_max: BULK_MAX,
        }
    }

    /// The receiving key changed (after a peer's `KeyUpdate`): records from
    /// the next on use `iv`, from sequence number 0.
    pub fn set_key(&mut self, iv: [u8; NONCE_LEN]) {
        self.seq = Seq { iv, seq: 0 };
    }

    /// The next post-handshake message.
    pub fn take_message(&mut self) -> Option<Message> {
        self.msgs.pop_front()
    }

    /// Whether a step would make progress without the socket (plaintext or
    /// a whole record buffered, a message waiting, or the end).
    pub fn ready(&self) -> bool {
        if self.closed || !self.msgs.is_empty() || self.ps < self.plain.len() {
            return true;
        }
        if let Some(run) = self.run {
            return match self.hdr {
                Some((len, _)) => run.have >= len,
                None => false,
            };
        }
        let raw = &self.buf[self.rs..self.re];
        match self.hdr {
            Some((len, _)) => raw.len() >= len,
            None => {
                raw.len() >= HEADER_LEN && {
                    let h = [raw[0], raw[1], raw[2], raw[3], raw[4]];
                    // A bad header is ready too: the step reports it.
                    parse_header(h).map_or(true, |len| raw.len() >= HEADER_LEN + len)
                }
            }
        }
    }

    /// The bounce buffer, for the read a [`Step::Read`] planned.
    pub fn bounce_mut(&mut self) -> &mut [u8] {
        &mut self.buf
    }

    /// The planned read brought `n` bytes (0: the socket ended).
    pub fn received(&mut self, n: usize) {
        let Some((dst, bounce)) = self.plan.take() else {
            return;
        };
        if n == 0 {
            self.closed = true;
            return;
        }
        let d = n.min(dst.len());
        if d > 0 {
            if let Some(run) = self.run.as_mut() {
                run.have += d;
            }
        }
        let b = (n - d).min(bounce.len());
        if b > 0 {
            self.re = bounce.start + b;
        }
    }

    /// One step towards filling `dst` (see [`Step`]).
    pub fn step<A: Aead>(&mut self, dst: &mut [u8], aead: &mut A) -> Result<Step, RecordError> {
        self.plan = None;
        if !self.msgs.is_empty() {
            return Ok(Step::Message);
        }
        if self.ps < self.plain.len() {
            let k = (self.plain.len() - self.ps).min(dst.len());
            dst[..k].copy_from_slice(&self.plain[self.ps..self.ps + k]);
            self.ps += k;
            if self.ps == self.plain.len() {
                self.plain.clear();
                self.ps = 0;
            }
            return Ok(Step::Delivered(k));
        }
        if self.closed {
            return Ok(Step::Closed);
        }
        let addr = dst.as_ptr() as usize;
        if let Some(run) = self.run {
            if run.addr != addr || run.c + run.have > dst.len() {
                return Err(RecordError::WrongDestination);
            }
            let p = self.run_records(dst, aead)?;
            if p > 0 {
                return Ok(Step::Delivered(p));
            }
            if !self.msgs.is_empty() {
                return Ok(Step::Message);
            }
            if self.closed {
                return Ok(Step::Closed);
            }
            if let Some(plan) = self.plan_run(dst) {
                return Ok(plan);
            }
        }
        if dst.is_empty() {
            return Ok(Step::Delivered(0));
        }
        self.bounce_step(dst, aead)
    }

    /// Decrypts the whole records of the run in `dst`; returns the
    /// plaintext delivered at its start.
    fn run_records<A: Aead>(&mut self, dst: &mut [u8], aead: &mut A) -> Result<usize, RecordError> {
        let Some(mut run) = self.run.take() else {
            return Ok(0);
        };
        let mut p = 0;
        loop {
            if self.hdr.is_none() {
                if run.have < HEADER_LEN {
                    break;
                }
                let mut h = [0u8; HEADER_LEN];
                h.copy_from_slice(&dst[run.c..run.c + HEADER_LEN]);
                self.hdr = Some((parse_header(h)?, h));
                run.c += HEADER_LEN;
                run.have -= HEADER_LEN;
            }
            let Some((len, h)) = self.hdr else { break };
            if run.have < len {
                break;
            }
            let end = run.c + len;
            let (typ, m) = open_record(&mut self.seq, aead, h, &mut dst[p..end], run.c - p)?;
            self.hdr = None;
            run.c = end;
            run.have -= len;
            if typ == CONTENT_APPLICATION_DATA {
                p += m;
            } else {
                self.absorb(typ, &dst[p..p + m])?;
                if !self.msgs.is_empty() || self.closed {
                    break;
                }
            }
        }
        if run.have > 0 && !self.closed {
            run.addr += p;
            run.c -= p;
            self.run = Some(run);
        }
        Ok(p)
    }

    /// The next read of a run in `dst` (`None`: the run moved to the
    /// bounce buffer instead).
    fn plan_run(&mut self, dst: &[u8]) -> Option<Step> {
        let run = self.run?;
        let n = dst.len();
        let end = run.c + run.have;
        // Any record whose header starts before `bulk` ends inside `dst`.
        let bulk = n.saturating_sub(MAX_RECORD).min(end + self.bulk_max);
        let plan = match self.hdr {
            Some((len, _)) if run.c + len <= n => {
                let e = run.c + len;
                if bulk > e {
                    Some((end..bulk, 0..0))
                } else {
                    // Exactly this record, and the next header aside.
                    self.rs = 0;
                    self.re = 0;
                    Some((end..e, 0..HEADER_LEN))
                }
            }
            None if run.c + HEADER_LEN <= bulk => Some((end..bulk, 0..0)),
            _ => None,
        };
        match plan {
            Some((d, b)) => {
                self.plan = Some((d.clone(), b.clone()));
                Some(Step::Read { dst: d, bounce: b })
            }
            None => {
                // The record does not fit: its bytes go to the bounce
                // buffer (ahead of any there, which come later).
                self.run = None;
                self.prepend_raw(&dst[run.c..end]);
                None
            }
        }
    }

    fn prepend_raw(&mut self, bytes: &[u8]) {
        let k = bytes.len();
        if k == 0 {
            return;
        }
        if self.rs >= k {
            self.rs -= k;
        } else {
            let raw = self.re - self.rs;
            if k + raw > self.buf.len() {
                self.buf.resize(k + raw, 0);
            }
            self.buf.copy_within(self.rs..self.re, k);
            self.rs = 0;
            self.re = k + raw;
        }
        self.buf[self.rs..self.rs + k].copy_from_slice(bytes);
    }

    /// Makes room for `need` more raw bytes after `re`.
    fn room(&mut self, need: usize) {
        if self.re + need > self.buf.len() {
            self.buf.copy_within(self.rs..self.re, 0);
            self.re -= self.rs;
            self.rs = 0;
            if self.re + need > self.buf.len() {
                self.buf.resize(self.re + need, 0);
            }
        }
    }

    fn bounce_step<A: Aead>(&mut self, dst: &mut [u8], aead: &mut A) -> Result<Step, RecordError> {
        let n = dst.len();
        loop {
            if self.hdr.is_none() && self.re - self.rs >= HEADER_LEN {
                let mut h = [0u8; HEADER_LEN];
                h.copy_from_slice(&self.buf[self.rs..self.rs + HEADER_LEN]);
                self.hdr = Some((parse_header(h)?, h));
                self.rs += HEADER_LEN;
            }
            let avail = self.re - self.rs;
            match self.hdr {
                Some((len, h)) if avail >= len => {
                    let at = self.rs;
                    let (typ, m) =
                        open_record(&mut self.seq, aead, h, &mut self.buf[at..at + len], 0)?;
                    self.hdr = None;
                    self.rs += len;
                    if self.rs == self.re {
                        (self.rs, self.re) = (0, 0);
                    }
                    if typ == CONTENT_APPLICATION_DATA {
                        let k = m.min(n);
                        dst[..k].copy_from_slice(&self.buf[at..at + k]);
                        self.plain.clear();
                        self.plain.extend_from_slice(&self.buf[at + k..at + m]);
                        self.ps = 0;
                        if k > 0 {
                            return Ok(Step::Delivered(k));
                        }
                    } else {
                        let content = self.buf[at..at + m].to_vec();
                        self.absorb(typ, &content)?;
                        if !self.msgs.is_empty() {
                            return Ok(Step::Message);
                        }
                        if self.closed {
                            return Ok(Step::Closed);
                        }
                    }
                }
                Some((len, _)) => {
                    if n >= DIRECT_MIN && len <= n {
                        // In place: what came already moves over.
                        dst[..avail].copy_from_slice(&self.buf[self.rs..self.re]);
                        (self.rs, self.re) = (0, 0);
                        self.run = Some(Run {
                            addr: dst.as_ptr() as usize,
                            c: 0,
                            have: avail,
                        });
                        return Ok(self.plan_run(dst).unwrap_or(Step::Delivered(0)));
                    }
                    let need = len - avail + HEADER_LEN;
                    self.room(need);
                    return Ok(self.plan_bounce(self.re..self.re + need));
                }
                None => {
                    if avail == 0 && n >= DIRECT_MIN + MAX_RECORD {
                        (self.rs, self.re) = (0, 0);
                        self.run = Some(Run {
                            addr: dst.as_ptr() as usize,
                            c: 0,
                            have: 0,
                        });
                        return Ok(self.plan_run(dst).unwrap_or(Step::Delivered(0)));
                    }
                    let need = COLD_READ.max(HEADER_LEN - avail);
                    self.room(need);
                    return Ok(self.plan_bounce(self.re..self.re + need));
                }
            }
        }
    }

    fn plan_bounce(&mut self, b: Range<usize>) -> Step {
        self.plan = Some((0..0, b.clone()));
        Step::Read {
            dst: 0..0,
            bounce: b,
        }
    }

    /// A record other than application data.
    fn absorb(&mut self, typ: u8, content: &[u8]) -> Result<(), RecordError> {
        match typ {
            CONTENT_ALERT => {
                let &[_level, desc] = content else {
                    return Err(RecordError::BadAlert);
                };
                match desc {
                    ALERT_CLOSE_NOTIFY => self.closed = true,
                    ALERT_USER_CANCELED => {}
                    d => return Err(RecordError::Alert(d)),
                }
                Ok(())
            }
            CONTENT_HANDSHAKE => {
                if content.is_empty() {
                    return Err(RecordError::BadHandshake("empty handshake record"));
                }
                if self.hs.len() + content.len() > MAX_HANDSHAKE {
                    return Err(RecordError::BadHandshake("message too long"));
                }
                self.hs.extend_from_slice(content);
                while self.hs.len() >= 4 {
                    let len = u32::from_be_bytes([0, self.hs[1], self.hs[2], self.hs[3]]) as usize;
                    if self.hs.len() < 4 + len {
                        break;
                    }
                    let body = self.hs[4..4 + len].to_vec();
                    let typ = self.hs[0];
                    self.hs.drain(..4 + len);
                    match typ {
                        HS_KEY_UPDATE => {
                            let requested = match body[..] {
                                [0] => false,
                                [1] => true,
                                _ => return Err(RecordError::BadHandshake("malformed KeyUpdate")),
                            };
                            // The key changes after this record: nothing
                            // may follow in it (RFC 8446 §5.1).
                            if !self.hs.is_empty() {
                                return Err(RecordError::BadHandshake(
                                    "data after a KeyUpdate in its record",
                                ));
                            }
                            self.msgs.push_back(Message::KeyUpdate { requested });
                        }
                        HS_NEW_SESSION_TICKET => {
                            self.msgs.push_back(Message::NewSessionTicket(body));
                        }
                        _ => return Err(RecordError::BadHandshake("unexpected message type")),
                    }
                }
                // A KeyUpdate cut across records would change keys mid-message.
                Ok(())
            }
            t => Err(RecordError::UnexpectedContentType(t)),
        }
    }
}

/// The plaintext length of the next record, given the lengths of the
/// ranges still to send (the first: what is left of the current one).
///
/// A range of at least [`BIG`] bytes (a payload) gets records of its own
/// that end with it, the last [`SHORT_TAIL`] bytes long; smaller ranges
/// share records, up to the next large one. 0 when nothing is left.
pub fn record_len<I: IntoIterator<Item = usize>>(lens: I) -> usize {
    let mut it = lens.into_iter().skip_while(|&l| l == 0);
    let Some(first) = it.next() else {
        return 0;
    };
    if first >= BIG {
        // What is left stays large (records of its own) until the tail.
        return if first - SHORT_TAIL <= MAX_PLAINTEXT {
            first - SHORT_TAIL
        } else if first - MAX_PLAINTEXT >= BIG {
            MAX_PLAINTEXT
        } else {
            first - BIG
        };
    }
    let mut total = first;
    for l in it {
        if total >= MAX_PLAINTEXT || l >= BIG {
            break;
        }
        total += l;
    }
    total.min(MAX_PLAINTEXT)
}

/// A record of a planned batch ([`Writer::plan`]): where its plaintext
/// comes from, where it is sealed, and under which nonce. Sealing one
/// needs nothing but this and the key ([`seal_planned`]), so the records
/// of a batch can be sealed on several threads, in any order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Planned {
    /// Where its plaintext starts, counted in the concatenated ranges the
    /// plan was made for.
    pub src: usize,
    /// Its plaintext length (at most [`MAX_PLAINTEXT`]).
    pub len: usize,
    /// Where the record (its header) starts in the send buffer.
    pub at: usize,
    /// Its nonce.
    pub nonce: [u8; NONCE_LEN],
}

impl Planned {
    /// The buffer offset just past the record.
    pub fn end(&self) -> usize {
        self.at + self.len + OVERHEAD
    }
}

/// Seals planned record `p` in `rec` (the send buffer from `p.at`, at
/// least `p.len + OVERHEAD` long), whose `rec[HEADER_LEN..][..p.len]` holds
/// the plaintext the driver copied there. Returns the record's length.
pub fn seal_planned<A: Aead>(
    rec: &mut [u8],
    p: &Planned,
    aead: &mut A,
) -> Result<usize, RecordError> {
    seal_record(rec, p.len, CONTENT_APPLICATION_DATA, p.nonce, aead)
}

/// Cuts the records of a plan into runs of consecutive records of at least
/// `bytes` plaintext each (the last may be shorter): the units a driver
/// hands out to its sealing threads and writes to the socket in order.
/// Returns ranges of indices into `recs`, covering all of them in order.
pub fn runs(recs: &[Planned], bytes: usize) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let (mut start, mut sum) = (0, 0);
    for (i, r) in recs.iter().enumerate() {
        sum += r.len;
        if sum >= bytes.max(1) {
            out.push(start..i + 1);
            (start, sum) = (i + 1, 0);
        }
    }
    if start < recs.len() {
        out.push(start..recs.len());
    }
    out
}

fn seal_record<A: Aead>(
    rec: &mut [u8],
    len: usize,
    typ: u8,
    nonce: [u8; NONCE_LEN],
    aead: &mut A,
) -> Result<usize, RecordError> {
    let body = len + 1 + TAG_LEN;
    let total = HEADER_LEN + body;
    if len > MAX_PLAINTEXT || rec.len() < total {
        return Err(RecordError::BadLength(len));
    }
    let h = header(body);
    rec[..HEADER_LEN].copy_from_slice(&h);
    rec[HEADER_LEN + len] = typ;
    let tag = aead
        .seal(nonce, h, &mut rec[HEADER_LEN..HEADER_LEN + len + 1])
        .ok_or(RecordError::Seal)?;
    rec[HEADER_LEN + len + 1..total].copy_from_slice(&tag);
    Ok(total)
}

/// The sending direction: numbers and seals records.
#[derive(Debug)]
pub struct Writer {
    seq: Seq,
    /// Records sealed with the current key.
    sealed: u64,
    /// Records after which [`Writer::key_update_due`] says so.
    pub limit: u64,
}

impl Writer {
    /// A writer whose first record has sequence number `seq` under `iv`.
    pub fn new(iv: [u8; NONCE_LEN], seq: u64) -> Writer {
        Writer {
            seq: Seq { iv, seq },
            sealed: 0,
            limit: KEY_UPDATE_AFTER,
        }
    }

    /// Whether the key has sealed enough records to be changed now.
    pub fn key_update_due(&self) -> bool {
        self.sealed >= self.limit
    }

    /// The sending key changed (after our `KeyUpdate` went into the
    /// stream).
    pub fn set_key(&mut self, iv: [u8; NONCE_LEN]) {
        self.seq = Seq { iv, seq: 0 };
        self.sealed = 0;
    }

    /// Seals a record in `rec`, whose `rec[HEADER_LEN..][..len]` holds the
    /// content: writes the header, the type byte and the tag. `rec` must
    /// be at least `len + OVERHEAD` long. Returns the record's length.
    pub fn seal<A: Aead>(
        &mut self,
        rec: &mut [u8],
        len: usize,
        typ: u8,
        aead: &mut A,
    ) -> Result<usize, RecordError> {
        if len > MAX_PLAINTEXT || rec.len() < len + OVERHEAD {
            return Err(RecordError::BadLength(len));
        }
        let nonce = self.seq.next()?;
        let total = seal_record(rec, len, typ, nonce, aead)?;
        self.sealed += 1;
        Ok(total)
    }

    /// Plans the application-data records of the plaintext ranges of
    /// lengths `lens` (cut as [`record_len`] says), laid one after another
    /// in a send buffer from offset `at`, a record starting only before
    /// offset `until` (the buffer needs [`MAX_RECORD`] bytes past it).
    /// Appends them to `out` and returns the plaintext they take (a prefix
    /// of the ranges). Stops where the key must change
    /// ([`Writer::key_update_due`]).
    ///
    /// The records are numbered now: the driver seals every one of them
    /// ([`seal_planned`]) before it seals anything else with this writer.
    pub fn plan(
        &mut self,
        lens: &[usize],
        mut at: usize,
        until: usize,
        out: &mut Vec<Planned>,
    ) -> Result<usize, RecordError> {
        let (mut i, mut off, mut src) = (0, 0, 0);
        while at < until && !self.key_update_due() {
            while i < lens.len() && off == lens[i] {
                (i, off) = (i + 1, 0);
            }
            let rest =
                lens[i.min(lens.len())..]
                    .iter()
                    .enumerate()
                    .map(|(k, &l)| if k == 0 { l - off } else { l });
            let len = record_len(rest);
            if len == 0 {
                break;
            }
            let nonce = self.seq.next()?;
            self.sealed += 1;
            out.push(Planned {
                src,
                len,
                at,
                nonce,
            });
            at += len + OVERHEAD;
            src += len;
            // Advance (i, off) by `len`.
            let mut left = len;
            while left > 0 {
                let k = left.min(lens[i] - off);
                off += k;
                left -= k;
                if left > 0 {
                    (i, off) = (i + 1, 0);
                }
            }
        }
        Ok(src)
    }

    /// Seals our `KeyUpdate` (`update_not_requested`, or `requested`) into
    /// `rec` (at least 5 + [`OVERHEAD`] bytes); the caller then changes
    /// the key ([`Writer::set_key`]).
    pub fn seal_key_update<A: Aead>(
        &mut self,
        rec: &mut [u8],
        requested: bool,
        aead: &mut A,
    ) -> Result<usize, RecordError> {
        if rec.len() < HEADER_LEN + 5 {
            return Err(RecordError::BadLength(rec.len()));
        }
        rec[HEADER_LEN..HEADER_LEN + 5].copy_from_slice(&[
            HS_KEY_UPDATE,
            0,
            0,
            1,
            u8::from(requested),
        ]);
        self.seal(rec, 5, CONTENT_HANDSHAKE, aead)
    }

    /// Seals a `close_notify` alert into `rec`.
    pub fn seal_close_notify<A: Aead>(
        &mut self,
        rec: &mut [u8],
        aead: &mut A,
    ) -> Result<usize, RecordError> {
        if rec.len() < HEADER_LEN + 2 {
            return Err(RecordError::BadLength(rec.len()));
        }
        rec[HEADER_LEN..HEADER_LEN + 2].copy_from_slice(&[1, ALERT_CLOSE_NOTIFY]);
        self.seal(rec, 2, CONTENT_ALERT, aead)
    }
}
