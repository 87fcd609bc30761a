//! The wire format (see `PROTOCOL.md` in ferry-tcp's root for the prose
//! version): fixed 32-byte little-endian frame headers, the handshake
//! messages, the limits every decoder enforces and the error codes.
//!
//! Everything here is pure: decoders take bytes and return either a frame or
//! a [`DecodeError`]; they never allocate from a peer-supplied length
//! without checking it against a limit first, and never panic.
//!
//! This module holds what every frame shares: the limits, the frame
//! [`kind`]s, [`Status`], [`DecodeError`] and the [`Header`]. The rest is
//! split along the format's seams and re-exported here, so that every item
//! is reached as `crate::frame::X`: `request` ([`Request`]), `response`
//! ([`Response`]), `tables` (WRITEV/READV and CWRITE/CREAD segments, id
//! lists, the region table) and `handshake` ([`Hello`], [`WELCOME`],
//! [`REJECT`]).

use std::fmt;

mod handshake;
mod request;
mod response;
mod tables;

pub use handshake::*;
pub use request::*;
pub use response::*;
pub use tables::*;

/// Magic that opens both hello messages.
pub const MAGIC: [u8; 4] = *b"FRY\x01";
/// The version field of the hellos this crate sends first (2: region
/// generations in WRITE/READ frames, segments and tables; typed
/// rejections; idle deadline in the welcome; 3: the same-host path,
/// SAME_HOST / CWRITE / CREAD; 4: the same-host control channel,
/// SAME_HOST_OK; 5: the staging area, SWRITE / SREAD). The versions this
/// crate speaks, 4 to 6, are negotiated: see [`crate::negotiate`].
pub const VERSION: u16 = crate::negotiate::LEGACY_VERSION;
/// Size of every frame header.
pub const HEADER_LEN: usize = 32;
/// Largest payload one WRITE, READ or DATA frame may carry (initiators split
/// larger requests into chunks).
pub const MAX_OP_LEN: u64 = 64 << 20;
/// Most ids one OKS frame may acknowledge.
pub const MAX_ACKS: u32 = 512;
/// Most segments one WRITEV frame may carry.
pub const MAX_SEGMENTS: u32 = 512;
/// Most regions a region table (Welcome or TABLE frame) may list.
pub const MAX_TABLE_ENTRIES: u32 = 65_536;
/// Size of one region table entry: `addr u64, len u64, generation u32,
/// reserved u32`.
pub const TABLE_ENTRY_LEN: usize = 24;
/// Size of one WRITEV/READV segment: `addr u64, len u32, generation u32`.
pub const SEGMENT_LEN: usize = 16;
/// Longest engine name in a hello.
pub const MAX_NAME: usize = 256;
/// Longest reason text in a handshake rejection.
pub const MAX_REJECT_MSG: usize = 1024;
/// Size of nonces and MACs.
pub const NONCE_LEN: usize = 32;
/// Longest notification name (ferry-core's `MAX_NOTIFICATION_NAME`;
/// ferry-tcp asserts that the two agree).
pub const MAX_NOTIFY_NAME: u64 = 256;
/// Longest notification message (ferry-core's `MAX_NOTIFICATION_MESSAGE`;
/// ferry-tcp asserts that the two agree).
pub const MAX_NOTIFY_MESSAGE: u64 = 64 * 1024;

/// Request kinds (initiator → target).
pub mod kind {
    /// Payload follows; store it at `a` (addr), `b` bytes, in the region
    /// of generation `aux`.
    pub const WRITE: u8 = 0x01;
    /// Send back `b` bytes from `a`, in the region of generation `aux`.
    pub const READ: u8 = 0x02;
    /// A notification: `a` name bytes then `b` message bytes follow.
    pub const NOTIFY: u8 = 0x03;
    /// Send back the current region table.
    pub const TABLE: u8 = 0x04;
    /// `aux` segments `(addr u64, len u32, generation u32)` of 16 bytes
    /// follow, then their payloads in order (`b` bytes in total).
    pub const WRITEV: u8 = 0x05;
    /// `aux` segments as for WRITEV follow (`b` bytes in total to send
    /// back).
    pub const READV: u8 = 0x06;
    /// Same-host negotiation: an offer of [`crate::offer::OFFER_LEN`] bytes
    /// follows; `a` = 1 + the initiator's descriptor number of the control
    /// channel it offers (0: none), `b` = 1 + that of the staging area
    /// (0: none; see [`crate::layout::area`]).
    pub const SAME_HOST: u8 = 0x07;
    /// Cross-memory write: `aux` segments of 24 bytes follow (target addr,
    /// len, generation, initiator source addr); the target copies them.
    pub const CWRITE: u8 = 0x08;
    /// Cross-memory read: same segments; the target copies its ranges into
    /// the initiator's destinations.
    pub const CREAD: u8 = 0x09;
    /// Staged write: segments as for CWRITE (initiator addr 0) follow; the
    /// payload comes through the staging area ([`crate::layout::area`]).
    pub const SWRITE: u8 = 0x0a;
    /// Staged read: segments as for CREAD (initiator addr 0); the verdict
    /// and payload come through the staging area.
    pub const SREAD: u8 = 0x0b;
    /// Request `id` succeeded.
    pub const OK: u8 = 0x81;
    /// `aux` request ids (u64 each) follow; all succeeded.
    pub const OKS: u8 = 0x82;
    /// Request `id` failed with `status`; `a`/`b` are the faulty range.
    pub const ERR: u8 = 0x83;
    /// READ `id` succeeded; `b` payload bytes follow.
    pub const DATA: u8 = 0x84;
    /// TABLE `id` answer; `aux` entries of 24 bytes follow ([`super::TABLE_ENTRY_LEN`]).
    pub const TABLE_REPLY: u8 = 0x85;
    /// WRITEV `id` landed except `aux` segments (u32 indices follow), which
    /// failed with `status`.
    pub const ERRV: u8 = 0x86;
    /// READV `id` answer: `aux` failed segment indices (u32) follow, then
    /// `b` bytes: the payloads of the other segments, in order.
    pub const DATAV: u8 = 0x87;
    /// SAME_HOST `id` accepted: `a` = 1 if the target took the offered
    /// control channel (the connection continues on it), else 0 with the
    /// errno of the failed attempt in `b` (0: none offered); `aux` = 1 if
    /// it mapped the offered staging area, 0 if none was offered, else
    /// 2 + the errno of the failed attempt.
    pub const SAME_HOST_OK: u8 = 0x88;
    /// Acknowledgements were posted in the staging area's lane while the
    /// initiator's reader had stopped polling it: take them (no operands).
    pub const WAKE: u8 = 0x89;
}

/// Error codes carried in ERR frames and handshake rejections.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Status {
    /// `[a, a+b)` is not inside one region registered with the target.
    AddressNotRegistered = 1,
    /// The length exceeds a protocol limit.
    TooLarge = 2,
    /// The target's notification queue is full.
    NotifyQueueFull = 3,
    /// The notification is not valid UTF-8 or contains NUL.
    NotifyInvalid = 4,
    /// The target is shutting down.
    ShuttingDown = 5,
    /// Handshake: unsupported protocol version.
    BadVersion = 6,
    /// Handshake: authentication failed.
    AuthFailed = 7,
    /// Handshake: too many connections.
    Busy = 8,
    /// Malformed input.
    Malformed = 9,
    /// `[a, a+b)` lies in a region registered after the frame was sent (its
    /// generation differs from the frame's): refused, nothing touched.
    StaleRegion = 10,
    /// SAME_HOST refused: `a` is the reason code
    /// ([`crate::offer::Refusal`]), `b` an errno or 0.
    SameHostRefused = 11,
    /// A cross-memory copy failed (`a`/`b`: the target range); the
    /// initiator's range could not be read or written.
    CopyFailed = 12,
}

impl Status {
    /// Parses a status byte.
    #[inline]
    pub fn from_u8(v: u8) -> Option<Status> {
        Some(match v {
            1 => Status::AddressNotRegistered,
            2 => Status::TooLarge,
            3 => Status::NotifyQueueFull,
            4 => Status::NotifyInvalid,
            5 => Status::ShuttingDown,
            6 => Status::BadVersion,
            7 => Status::AuthFailed,
            8 => Status::Busy,
            9 => Status::Malformed,
            10 => Status::StaleRegion,
            11 => Status::SameHostRefused,
            12 => Status::CopyFailed,
            _ => return None,
        })
    }
}

/// Why bytes could not be decoded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DecodeError(pub String);

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

fn bad(msg: impl Into<String>) -> DecodeError {
    DecodeError(msg.into())
}

/// The raw fields of a frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Header {
    /// Frame kind (see [`kind`]).
    pub kind: u8,
    /// Status code (ERR frames), else 0.
    pub status: u8,
    /// Count field (OKS, TABLE_REPLY), else 0.
    pub aux: u32,
    /// Request id chosen by the initiator.
    pub id: u64,
    /// First operand (address, name length).
    pub a: u64,
    /// Second operand (length, message length).
    pub b: u64,
}

impl Header {
    /// Encodes the header.
    #[inline]
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut out = [0u8; HEADER_LEN];
        out[0] = self.kind;
        out[1] = self.status;
        out[4..8].copy_from_slice(&self.aux.to_le_bytes());
        out[8..16].copy_from_slice(&self.id.to_le_bytes());
        out[16..24].copy_from_slice(&self.a.to_le_bytes());
        out[24..32].copy_from_slice(&self.b.to_le_bytes());
        out
    }

    /// Decodes the raw fields (checks only the reserved bytes).
    #[inline]
    pub fn decode(buf: &[u8; HEADER_LEN]) -> Result<Header, DecodeError> {
        if buf[2] != 0 || buf[3] != 0 {
            return Err(bad("reserved header bytes are not zero"));
        }
        Ok(Header {
            kind: buf[0],
            status: buf[1],
            aux: u32::from_le_bytes([buf[4], buf[5], buf[6], buf[7]]),
            id: le64(&buf[8..16]),
            a: le64(&buf[16..24]),
            b: le64(&buf[24..32]),
        })
    }
}

fn le64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_le_bytes(a)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4096))]

        /// The decoders accept or refuse arbitrary bytes without panicking,
        /// and whatever they accept re-encodes to the same bytes and
        /// respects the limits.
        #[test]
        fn decoders_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let mut hdr = [0u8; HEADER_LEN];
            let n = bytes.len().min(HEADER_LEN);
            hdr[..n].copy_from_slice(&bytes[..n]);
            if let Ok(r) = Request::decode(&hdr) {
                prop_assert_eq!(r.encode(), hdr);
                match r {
                    Request::Write { len, .. } | Request::Read { len, .. } =>
                        prop_assert!(len <= MAX_OP_LEN),
                    Request::Notify { name_len, msg_len, .. } =>
                        prop_assert!(name_len <= MAX_NOTIFY_NAME && msg_len <= MAX_NOTIFY_MESSAGE),
                    Request::Table { .. } => {}
                    Request::WriteV { count, total, .. } | Request::ReadV { count, total, .. }
                    | Request::Cma { count, total, .. } =>
                        prop_assert!((1..=MAX_SEGMENTS).contains(&count) && total <= MAX_OP_LEN),
                    Request::SameHost { .. } => {}
                }
            }
            if let Ok(r) = Response::decode(&hdr) {
                match r {
                    Response::OkMany { count } => prop_assert!((1..=MAX_ACKS).contains(&count)),
                    Response::Table { count, .. } => prop_assert!(count <= MAX_TABLE_ENTRIES),
                    Response::Data { len, .. } => prop_assert!(len <= MAX_OP_LEN),
                    Response::ErrV { count, .. } => prop_assert!((1..=MAX_SEGMENTS).contains(&count)),
                    Response::DataV { failed, len, .. } =>
                        prop_assert!(failed <= MAX_SEGMENTS && len <= MAX_OP_LEN),
                    _ => {}
                }
            }
            let mut fixed = [0u8; HELLO_FIXED];
            let m = bytes.len().min(HELLO_FIXED);
            fixed[..m].copy_from_slice(&bytes[..m]);
            if let Ok((_, name_len)) = Hello::decode_fixed(&fixed) {
                prop_assert!(name_len <= MAX_NAME);
            }
            if let Ok(t) = decode_table(&bytes) {
                for w in t.windows(2) {
                    prop_assert!(w[0].addr + w[0].len <= w[1].addr);
                }
            }
            let _ = decode_ids(&bytes).count();
            if let Ok(segs) = decode_segments(&bytes, bytes.len() as u64) {
                prop_assert!(segs.iter().all(|s| s.len > 0));
            }
        }
    }
}
