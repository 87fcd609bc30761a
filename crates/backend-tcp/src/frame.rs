//! The wire format (see `PROTOCOL.md` in the crate root for the prose
//! version): fixed 32-byte little-endian frame headers, the handshake
//! messages, the limits every decoder enforces and the error codes.
//!
//! Everything here is pure: decoders take bytes and return either a frame or
//! a [`DecodeError`]; they never allocate from a peer-supplied length
//! without checking it against a limit first, and never panic.

use std::fmt;

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
/// Longest notification name (same as transport-core).
pub const MAX_NOTIFY_NAME: u64 = transport_core::MAX_NOTIFICATION_NAME as u64;
/// Longest notification message (same as transport-core).
pub const MAX_NOTIFY_MESSAGE: u64 = transport_core::MAX_NOTIFICATION_MESSAGE as u64;

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
    /// Same-host negotiation: an offer of [`crate::same_host::cma::OFFER_LEN`] bytes
    /// follows; `a` = 1 + the initiator's descriptor number of the control
    /// channel it offers (0: none), `b` = 1 + that of the staging area
    /// (0: none; see [`crate::same_host::stage`]).
    pub const SAME_HOST: u8 = 0x07;
    /// Cross-memory write: `aux` segments of 24 bytes follow (target addr,
    /// len, generation, initiator source addr); the target copies them.
    pub const CWRITE: u8 = 0x08;
    /// Cross-memory read: same segments; the target copies its ranges into
    /// the initiator's destinations.
    pub const CREAD: u8 = 0x09;
    /// Staged write: segments as for CWRITE (initiator addr 0) follow; the
    /// payload comes through the staging area ([`crate::same_host::stage`]).
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
    /// ([`crate::same_host::cma::Refusal`]), `b` an errno or 0.
    SameHostRefused = 11,
    /// A cross-memory copy failed (`a`/`b`: the target range); the
    /// initiator's range could not be read or written.
    CopyFailed = 12,
}

impl Status {
    /// Parses a status byte.
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

/// A decoded request (initiator → target).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Request {
    /// `len` payload bytes follow, to be stored at `addr`.
    Write {
        /// Request id.
        id: u64,
        /// Target address.
        addr: u64,
        /// Payload length (≤ [`MAX_OP_LEN`]).
        len: u64,
        /// Generation of the target region the sender saw.
        gen: u32,
    },
    /// Send `len` bytes from `addr`.
    Read {
        /// Request id.
        id: u64,
        /// Target address.
        addr: u64,
        /// Length (≤ [`MAX_OP_LEN`]).
        len: u64,
        /// Generation of the target region the sender saw.
        gen: u32,
    },
    /// A notification of `name_len` + `msg_len` bytes follows.
    Notify {
        /// Request id.
        id: u64,
        /// Name bytes (≤ [`MAX_NOTIFY_NAME`]).
        name_len: u64,
        /// Message bytes (≤ [`MAX_NOTIFY_MESSAGE`]).
        msg_len: u64,
    },
    /// Send back the region table.
    Table {
        /// Request id.
        id: u64,
    },
    /// `count` segments of 16 bytes follow, then `total` payload bytes.
    WriteV {
        /// Request id.
        id: u64,
        /// Segments (1..=[`MAX_SEGMENTS`]).
        count: u32,
        /// Sum of the segment lengths (≤ [`MAX_OP_LEN`]).
        total: u64,
    },
    /// `count` segments of 16 bytes follow; send their bytes back.
    ReadV {
        /// Request id.
        id: u64,
        /// Segments (1..=[`MAX_SEGMENTS`]).
        count: u32,
        /// Sum of the segment lengths (≤ [`MAX_OP_LEN`]).
        total: u64,
    },
    /// Same-host negotiation; an offer follows.
    SameHost {
        /// Request id.
        id: u64,
        /// The initiator's descriptor number of the Unix socket it offers
        /// as the connection's control channel, if any.
        channel: Option<u32>,
        /// Its descriptor number of the staging area it offers, if any.
        stage: Option<u32>,
    },
    /// Cross-memory write (read when `read`): `count` segments of
    /// [`CMA_SEGMENT_LEN`] bytes follow, no payload. `staged`: SWRITE /
    /// SREAD, the payload moves through the staging area.
    Cma {
        /// Request id.
        id: u64,
        /// CREAD / SREAD rather than CWRITE / SWRITE.
        read: bool,
        /// SWRITE / SREAD rather than CWRITE / CREAD.
        staged: bool,
        /// Segments (1..=[`MAX_SEGMENTS`]).
        count: u32,
        /// Sum of the segment lengths (≤ [`MAX_OP_LEN`]).
        total: u64,
    },
}

impl Request {
    /// Encodes the header of this request.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let h = match *self {
            Request::Write { id, addr, len, gen } => Header {
                kind: kind::WRITE,
                aux: gen,
                id,
                a: addr,
                b: len,
                ..Default::default()
            },
            Request::Read { id, addr, len, gen } => Header {
                kind: kind::READ,
                aux: gen,
                id,
                a: addr,
                b: len,
                ..Default::default()
            },
            Request::Notify {
                id,
                name_len,
                msg_len,
            } => Header {
                kind: kind::NOTIFY,
                id,
                a: name_len,
                b: msg_len,
                ..Default::default()
            },
            Request::Table { id } => Header {
                kind: kind::TABLE,
                id,
                ..Default::default()
            },
            Request::WriteV { id, count, total } => Header {
                kind: kind::WRITEV,
                aux: count,
                id,
                b: total,
                ..Default::default()
            },
            Request::ReadV { id, count, total } => Header {
                kind: kind::READV,
                aux: count,
                id,
                b: total,
                ..Default::default()
            },
            Request::SameHost { id, channel, stage } => Header {
                kind: kind::SAME_HOST,
                id,
                a: channel.map_or(0, |fd| u64::from(fd) + 1),
                b: stage.map_or(0, |fd| u64::from(fd) + 1),
                ..Default::default()
            },
            Request::Cma {
                id,
                read,
                staged,
                count,
                total,
            } => Header {
                kind: match (staged, read) {
                    (false, false) => kind::CWRITE,
                    (false, true) => kind::CREAD,
                    (true, false) => kind::SWRITE,
                    (true, true) => kind::SREAD,
                },
                aux: count,
                id,
                b: total,
                ..Default::default()
            },
        };
        h.encode()
    }

    /// Decodes and validates a request header. A WRITE longer than
    /// [`MAX_OP_LEN`] is an error: its payload cannot be skipped safely.
    pub fn decode(buf: &[u8; HEADER_LEN]) -> Result<Request, DecodeError> {
        let h = Header::decode(buf)?;
        let aux_allowed = matches!(
            h.kind,
            kind::WRITEV
                | kind::READV
                | kind::WRITE
                | kind::READ
                | kind::CWRITE
                | kind::CREAD
                | kind::SWRITE
                | kind::SREAD
        );
        if h.status != 0 || (h.aux != 0 && !aux_allowed) {
            return Err(bad("request with non-zero status or count field"));
        }
        match h.kind {
            kind::READV => {
                if h.aux == 0 || h.aux > MAX_SEGMENTS || h.a != 0 || h.b > MAX_OP_LEN {
                    return Err(bad(format!(
                        "READV of {} segments / {} bytes exceeds the limits",
                        h.aux, h.b
                    )));
                }
                Ok(Request::ReadV {
                    id: h.id,
                    count: h.aux,
                    total: h.b,
                })
            }
            kind::WRITEV => {
                if h.aux == 0 || h.aux > MAX_SEGMENTS || h.a != 0 || h.b > MAX_OP_LEN {
                    return Err(bad(format!(
                        "WRITEV of {} segments / {} bytes exceeds the limits",
                        h.aux, h.b
                    )));
                }
                Ok(Request::WriteV {
                    id: h.id,
                    count: h.aux,
                    total: h.b,
                })
            }
            kind::WRITE | kind::READ => {
                if h.b > MAX_OP_LEN {
                    return Err(bad(format!(
                        "request length {} exceeds the limit of {MAX_OP_LEN}",
                        h.b
                    )));
                }
                Ok(if h.kind == kind::WRITE {
                    Request::Write {
                        id: h.id,
                        addr: h.a,
                        len: h.b,
                        gen: h.aux,
                    }
                } else {
                    Request::Read {
                        id: h.id,
                        addr: h.a,
                        len: h.b,
                        gen: h.aux,
                    }
                })
            }
            kind::NOTIFY => {
                if h.a > MAX_NOTIFY_NAME || h.b > MAX_NOTIFY_MESSAGE {
                    return Err(bad(format!(
                        "notification of {}+{} bytes exceeds the limits",
                        h.a, h.b
                    )));
                }
                Ok(Request::Notify {
                    id: h.id,
                    name_len: h.a,
                    msg_len: h.b,
                })
            }
            kind::TABLE => {
                if h.a != 0 || h.b != 0 {
                    return Err(bad("TABLE request with operands"));
                }
                Ok(Request::Table { id: h.id })
            }
            kind::SAME_HOST => {
                let fd_max = u64::from(i32::MAX as u32) + 1;
                if h.a > fd_max || h.b > fd_max {
                    return Err(bad("SAME_HOST request with bad operands"));
                }
                Ok(Request::SameHost {
                    id: h.id,
                    channel: h.a.checked_sub(1).map(|fd| fd as u32),
                    stage: h.b.checked_sub(1).map(|fd| fd as u32),
                })
            }
            kind::CWRITE | kind::CREAD | kind::SWRITE | kind::SREAD => {
                if h.aux == 0 || h.aux > MAX_SEGMENTS || h.a != 0 || h.b > MAX_OP_LEN {
                    return Err(bad(format!(
                        "CWRITE/CREAD of {} segments / {} bytes exceeds the limits",
                        h.aux, h.b
                    )));
                }
                Ok(Request::Cma {
                    id: h.id,
                    read: h.kind == kind::CREAD || h.kind == kind::SREAD,
                    staged: h.kind == kind::SWRITE || h.kind == kind::SREAD,
                    count: h.aux,
                    total: h.b,
                })
            }
            k => Err(bad(format!("unknown request kind {k:#04x}"))),
        }
    }
}

/// A decoded response (target → initiator).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Response {
    /// Request `id` succeeded.
    Ok {
        /// Request id.
        id: u64,
    },
    /// `count` ids (8 bytes each) follow; all succeeded.
    OkMany {
        /// Number of ids (1..=[`MAX_ACKS`]).
        count: u32,
    },
    /// Request `id` failed.
    Err {
        /// Request id.
        id: u64,
        /// Why.
        status: Status,
        /// Faulty address.
        addr: u64,
        /// Faulty length.
        len: u64,
    },
    /// READ `id` succeeded; `len` payload bytes follow.
    Data {
        /// Request id.
        id: u64,
        /// Payload length (≤ [`MAX_OP_LEN`]).
        len: u64,
    },
    /// TABLE `id` answer; `count` entries of [`TABLE_ENTRY_LEN`] bytes follow.
    Table {
        /// Request id.
        id: u64,
        /// Entries (≤ [`MAX_TABLE_ENTRIES`]).
        count: u32,
    },
    /// READV `id` answer: `failed` segment indices (u32) follow, then `len`
    /// bytes, the payloads of the other segments in order.
    DataV {
        /// Request id.
        id: u64,
        /// Why the listed segments failed (`None` when none did).
        status: Option<Status>,
        /// Number of failed segments (≤ [`MAX_SEGMENTS`]).
        failed: u32,
        /// Payload bytes that follow (≤ [`MAX_OP_LEN`]).
        len: u64,
    },
    /// WRITEV `id` landed except `count` segments (u32 indices follow),
    /// which failed with `status`.
    ErrV {
        /// Request id.
        id: u64,
        /// Why the listed segments failed.
        status: Status,
        /// Number of failed segments (1..=[`MAX_SEGMENTS`]).
        count: u32,
    },
    /// SAME_HOST `id` accepted (the same-host path is agreed).
    SameHostOk {
        /// Request id.
        id: u64,
        /// `Ok`: the target took the offered control channel and the
        /// connection continues on it; `Err(errno)`: it stays on this
        /// socket (0: no channel was offered).
        channel: std::result::Result<(), u32>,
        /// `Ok`: the target mapped the offered staging area; `Err(errno)`:
        /// it did not (0: none was offered).
        stage: std::result::Result<(), u32>,
    },
    /// Acknowledgements wait in the staging area's lane
    /// ([`crate::same_host::stage::AckLane`]).
    Wake,
}

impl Response {
    /// Encodes the header of this response.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let h = match *self {
            Response::Ok { id } => Header {
                kind: kind::OK,
                id,
                ..Default::default()
            },
            Response::OkMany { count } => Header {
                kind: kind::OKS,
                aux: count,
                ..Default::default()
            },
            Response::Err {
                id,
                status,
                addr,
                len,
            } => Header {
                kind: kind::ERR,
                status: status as u8,
                id,
                a: addr,
                b: len,
                ..Default::default()
            },
            Response::Data { id, len } => Header {
                kind: kind::DATA,
                id,
                b: len,
                ..Default::default()
            },
            Response::Table { id, count } => Header {
                kind: kind::TABLE_REPLY,
                aux: count,
                id,
                ..Default::default()
            },
            Response::DataV {
                id,
                status,
                failed,
                len,
            } => Header {
                kind: kind::DATAV,
                status: status.map_or(0, |s| s as u8),
                aux: failed,
                id,
                b: len,
                ..Default::default()
            },
            Response::ErrV { id, status, count } => Header {
                kind: kind::ERRV,
                status: status as u8,
                aux: count,
                id,
                ..Default::default()
            },
            Response::SameHostOk { id, channel, stage } => Header {
                kind: kind::SAME_HOST_OK,
                id,
                aux: match stage {
                    Ok(()) => 1,
                    Err(0) => 0,
                    Err(e) => e.saturating_add(2),
                },
                a: u64::from(channel.is_ok()),
                b: channel.err().map_or(0, u64::from),
                ..Default::default()
            },
            Response::Wake => Header {
                kind: kind::WAKE,
                ..Default::default()
            },
        };
        h.encode()
    }

    /// Decodes and validates a response header.
    pub fn decode(buf: &[u8; HEADER_LEN]) -> Result<Response, DecodeError> {
        let h = Header::decode(buf)?;
        match h.kind {
            kind::OK => Ok(Response::Ok { id: h.id }),
            kind::OKS => {
                if h.aux == 0 || h.aux > MAX_ACKS {
                    return Err(bad(format!("OKS with {} ids (1..={MAX_ACKS})", h.aux)));
                }
                Ok(Response::OkMany { count: h.aux })
            }
            kind::ERR => {
                let status = Status::from_u8(h.status)
                    .ok_or_else(|| bad(format!("unknown status code {}", h.status)))?;
                Ok(Response::Err {
                    id: h.id,
                    status,
                    addr: h.a,
                    len: h.b,
                })
            }
            kind::DATA => {
                if h.b > MAX_OP_LEN {
                    return Err(bad(format!("DATA of {} bytes exceeds the limit", h.b)));
                }
                Ok(Response::Data { id: h.id, len: h.b })
            }
            kind::TABLE_REPLY => {
                if h.aux > MAX_TABLE_ENTRIES {
                    return Err(bad(format!(
                        "region table of {} entries exceeds {MAX_TABLE_ENTRIES}",
                        h.aux
                    )));
                }
                Ok(Response::Table {
                    id: h.id,
                    count: h.aux,
                })
            }
            kind::DATAV => {
                let status = match (h.aux, h.status) {
                    (0, 0) => None,
                    (0, _) => return Err(bad("DATAV without failures carries a status")),
                    (_, st) => Some(
                        Status::from_u8(st)
                            .ok_or_else(|| bad(format!("unknown status code {st}")))?,
                    ),
                };
                if h.aux > MAX_SEGMENTS || h.b > MAX_OP_LEN || h.a != 0 {
                    return Err(bad(format!(
                        "DATAV with {} failures / {} bytes exceeds the limits",
                        h.aux, h.b
                    )));
                }
                Ok(Response::DataV {
                    id: h.id,
                    status,
                    failed: h.aux,
                    len: h.b,
                })
            }
            kind::ERRV => {
                let status = Status::from_u8(h.status)
                    .ok_or_else(|| bad(format!("unknown status code {}", h.status)))?;
                if h.aux == 0 || h.aux > MAX_SEGMENTS {
                    return Err(bad(format!("ERRV with {} indices", h.aux)));
                }
                Ok(Response::ErrV {
                    id: h.id,
                    status,
                    count: h.aux,
                })
            }
            kind::SAME_HOST_OK => {
                let errno =
                    u32::try_from(h.b).map_err(|_| bad("SAME_HOST_OK errno out of range"))?;
                let stage = match h.aux {
                    0 => Err(0),
                    1 => Ok(()),
                    e => Err(e - 2),
                };
                if stage == Err(0) && h.aux != 0 {
                    return Err(bad("SAME_HOST_OK with bad operands"));
                }
                match h.a {
                    1 if errno == 0 => Ok(Response::SameHostOk {
                        id: h.id,
                        channel: Ok(()),
                        stage,
                    }),
                    0 => Ok(Response::SameHostOk {
                        id: h.id,
                        channel: Err(errno),
                        stage,
                    }),
                    _ => Err(bad("SAME_HOST_OK with bad operands")),
                }
            }
            kind::WAKE => {
                if h.id != 0 || h.a != 0 || h.b != 0 || h.aux != 0 || h.status != 0 {
                    return Err(bad("WAKE with operands"));
                }
                Ok(Response::Wake)
            }
            k => Err(bad(format!("unknown response kind {k:#04x}"))),
        }
    }
}

/// One WRITEV/READV segment: target address, length and the generation of
/// the target region the sender saw.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    /// Target address.
    pub addr: u64,
    /// Length (> 0).
    pub len: u64,
    /// Region generation.
    pub gen: u32,
}

/// Decodes WRITEV/READV segments ([`SEGMENT_LEN`] bytes each: `addr u64,
/// len u32, generation u32`). Every length must be non-zero and the lengths
/// must add up to `total`.
pub fn decode_segments(buf: &[u8], total: u64) -> Result<Vec<Segment>, DecodeError> {
    if buf.len() % SEGMENT_LEN != 0 || buf.len() / SEGMENT_LEN > MAX_SEGMENTS as usize {
        return Err(bad("segment table has a bad length"));
    }
    let mut sum = 0u64;
    let mut out = Vec::with_capacity(buf.len() / SEGMENT_LEN);
    for e in buf.chunks_exact(SEGMENT_LEN) {
        let addr = le64(&e[..8]);
        let len = u32::from_le_bytes([e[8], e[9], e[10], e[11]]) as u64;
        let gen = u32::from_le_bytes([e[12], e[13], e[14], e[15]]);
        if len == 0 {
            return Err(bad("WRITEV/READV segment of zero bytes"));
        }
        sum = sum.saturating_add(len);
        out.push(Segment { addr, len, gen });
    }
    if sum != total {
        return Err(bad(format!(
            "WRITEV/READV segments add up to {sum} bytes, the header says {total}"
        )));
    }
    Ok(out)
}

/// Encodes WRITEV/READV segments; lengths must fit in a u32 (they are at
/// most [`MAX_OP_LEN`]).
pub fn encode_segments(segs: &[Segment]) -> Vec<u8> {
    let mut out = Vec::with_capacity(segs.len() * SEGMENT_LEN);
    for s in segs {
        out.extend_from_slice(&s.addr.to_le_bytes());
        out.extend_from_slice(&(s.len.min(u32::MAX as u64) as u32).to_le_bytes());
        out.extend_from_slice(&s.gen.to_le_bytes());
    }
    out
}

/// Size of one CWRITE/CREAD segment: `addr u64, len u32, generation
/// u32, initiator addr u64`.
pub const CMA_SEGMENT_LEN: usize = 24;

/// One CWRITE/CREAD segment: a WRITEV/READV segment plus the initiator's
/// own (registered) source or destination address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CmaSegment {
    /// The target range and its generation.
    pub seg: Segment,
    /// The initiator's address.
    pub local: u64,
}

/// Decodes CWRITE/CREAD segments (same rules as [`decode_segments`]).
pub fn decode_cma_segments(buf: &[u8], total: u64) -> Result<Vec<CmaSegment>, DecodeError> {
    if buf.len() % CMA_SEGMENT_LEN != 0 || buf.len() / CMA_SEGMENT_LEN > MAX_SEGMENTS as usize {
        return Err(bad("CWRITE/CREAD segment table has a bad length"));
    }
    let mut plain = Vec::with_capacity(buf.len() / CMA_SEGMENT_LEN * SEGMENT_LEN);
    let mut locals = Vec::with_capacity(buf.len() / CMA_SEGMENT_LEN);
    for e in buf.chunks_exact(CMA_SEGMENT_LEN) {
        plain.extend_from_slice(&e[..SEGMENT_LEN]);
        locals.push(le64(&e[SEGMENT_LEN..]));
    }
    let segs = decode_segments(&plain, total)?;
    Ok(segs
        .into_iter()
        .zip(locals)
        .map(|(seg, local)| CmaSegment { seg, local })
        .collect())
}

/// Encodes CWRITE/CREAD segments.
pub fn encode_cma_segments(segs: &[CmaSegment]) -> Vec<u8> {
    let mut out = Vec::with_capacity(segs.len() * CMA_SEGMENT_LEN);
    for s in segs {
        out.extend_from_slice(&encode_segments(std::slice::from_ref(&s.seg)));
        out.extend_from_slice(&s.local.to_le_bytes());
    }
    out
}

/// Decodes `n` little-endian u64 ids from `buf` (exactly `8*n` bytes).
pub fn decode_ids(buf: &[u8]) -> impl Iterator<Item = u64> + '_ {
    buf.chunks_exact(8).map(le64)
}

/// One entry of a region table: a registered region and its generation
/// (a number the target gives each registration; frames name it so that a
/// frame never lands in memory registered after it was sent).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TableEntry {
    /// Start of the region.
    pub addr: u64,
    /// Length (> 0).
    pub len: u64,
    /// Generation (never 0).
    pub gen: u32,
}

/// Decodes a region table: [`TABLE_ENTRY_LEN`]-byte entries `(addr u64,
/// len u64, generation u32, reserved u32)`. Entries must be non-empty, must
/// not wrap and must be sorted without overlap; the result is what an
/// initiator validates requests against.
pub fn decode_table(buf: &[u8]) -> Result<Vec<TableEntry>, DecodeError> {
    if buf.len() % TABLE_ENTRY_LEN != 0 || buf.len() / TABLE_ENTRY_LEN > MAX_TABLE_ENTRIES as usize
    {
        return Err(bad("region table has a bad length"));
    }
    let mut out = Vec::with_capacity(buf.len() / TABLE_ENTRY_LEN);
    let mut prev_end = 0u64;
    for (i, e) in buf.chunks_exact(TABLE_ENTRY_LEN).enumerate() {
        let addr = le64(&e[..8]);
        let len = le64(&e[8..16]);
        let gen = u32::from_le_bytes([e[16], e[17], e[18], e[19]]);
        let end = addr
            .checked_add(len)
            .ok_or_else(|| bad(format!("region {i} wraps around")))?;
        if len == 0 || (i > 0 && addr < prev_end) {
            return Err(bad(format!("region {i} is empty, unsorted or overlapping")));
        }
        prev_end = end;
        out.push(TableEntry { addr, len, gen });
    }
    Ok(out)
}

/// Encodes a region table (entries sorted by address).
pub fn encode_table(regions: &[TableEntry]) -> Vec<u8> {
    let mut out = Vec::with_capacity(regions.len() * TABLE_ENTRY_LEN);
    for r in regions {
        out.extend_from_slice(&r.addr.to_le_bytes());
        out.extend_from_slice(&r.len.to_le_bytes());
        out.extend_from_slice(&r.gen.to_le_bytes());
        out.extend_from_slice(&[0u8; 4]);
    }
    out
}

/// The generation of the entry of a sorted table that contains all of
/// `[addr, addr+len)`, if one does.
pub fn table_lookup(table: &[TableEntry], addr: u64, len: u64) -> Option<u32> {
    let end = addr.checked_add(len)?;
    if len == 0 {
        return None;
    }
    let i = table.partition_point(|e| e.addr <= addr);
    let e = table.get(i.checked_sub(1)?)?;
    (addr >= e.addr && end <= e.addr + e.len).then_some(e.gen)
}

/// Whether `[addr, addr+len)` lies inside one entry of a sorted table.
pub fn table_contains(table: &[TableEntry], addr: u64, len: u64) -> bool {
    table_lookup(table, addr, len).is_some()
}

/// Fixed part of a hello: magic, version, flags, nonce, name length.
pub const HELLO_FIXED: usize = 4 + 2 + 2 + NONCE_LEN + 2;

/// Hello flag: the sender holds a shared secret (server: requires proof).
pub const FLAG_AUTH: u16 = 1;
/// Hello flag: the sender negotiates versions and features (an extension
/// block follows the target's hello and precedes the initiator's proof;
/// see [`crate::negotiate`]). Peers before version 6 ignore it.
pub const FLAG_EXT: u16 = 2;

/// The first message of each side.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hello {
    /// Protocol version of the sender.
    pub version: u16,
    /// Flags ([`FLAG_AUTH`]).
    pub flags: u16,
    /// Random challenge.
    pub nonce: [u8; NONCE_LEN],
    /// The sender's engine name.
    pub name: String,
}

impl Hello {
    /// Encodes the hello (the name is truncated to [`MAX_NAME`] bytes at a
    /// character boundary).
    pub fn encode(&self) -> Vec<u8> {
        let mut name = self.name.as_str();
        while name.len() > MAX_NAME {
            let mut cut = MAX_NAME;
            while !name.is_char_boundary(cut) {
                cut -= 1;
            }
            name = &name[..cut];
        }
        let mut out = Vec::with_capacity(HELLO_FIXED + name.len());
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&self.version.to_le_bytes());
        out.extend_from_slice(&self.flags.to_le_bytes());
        out.extend_from_slice(&self.nonce);
        out.extend_from_slice(&(name.len() as u16).to_le_bytes());
        out.extend_from_slice(name.as_bytes());
        out
    }

    /// Decodes the fixed part; returns the hello without its name and the
    /// name length to read next. Checks magic and the name limit but not the
    /// version (the caller answers a version mismatch politely).
    pub fn decode_fixed(buf: &[u8; HELLO_FIXED]) -> Result<(Hello, usize), DecodeError> {
        if buf[..4] != MAGIC {
            return Err(bad("bad magic: not a ferry-tcp peer"));
        }
        let version = u16::from_le_bytes([buf[4], buf[5]]);
        let flags = u16::from_le_bytes([buf[6], buf[7]]);
        let mut nonce = [0u8; NONCE_LEN];
        nonce.copy_from_slice(&buf[8..8 + NONCE_LEN]);
        let name_len = u16::from_le_bytes([buf[8 + NONCE_LEN], buf[9 + NONCE_LEN]]) as usize;
        if name_len > MAX_NAME {
            return Err(bad(format!("name of {name_len} bytes exceeds {MAX_NAME}")));
        }
        Ok((
            Hello {
                version,
                flags,
                nonce,
                name: String::new(),
            },
            name_len,
        ))
    }
}

/// First byte of the target's final handshake message: welcome.
pub const WELCOME: u8 = 0;
/// First byte of the target's final handshake message: rejection. A
/// rejection is `REJECT, status u8, len u16, reason` and may also come
/// instead of the target's hello (a target that is busy refuses before
/// reading anything).
pub const REJECT: u8 = 1;

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn roundtrip_requests_and_responses() {
        let reqs = [
            Request::Write {
                id: 7,
                addr: 0x1000,
                len: 4096,
                gen: 3,
            },
            Request::Read {
                id: u64::MAX,
                addr: 1,
                len: MAX_OP_LEN,
                gen: u32::MAX,
            },
            Request::Notify {
                id: 3,
                name_len: 4,
                msg_len: 0,
            },
            Request::Table { id: 9 },
            Request::WriteV {
                id: 10,
                count: MAX_SEGMENTS,
                total: MAX_OP_LEN,
            },
            Request::ReadV {
                id: 11,
                count: 1,
                total: 1,
            },
            Request::SameHost {
                id: 12,
                channel: None,
                stage: None,
            },
            Request::SameHost {
                id: 14,
                channel: Some(7),
                stage: Some(9),
            },
            Request::Cma {
                id: 13,
                read: true,
                staged: false,
                count: 2,
                total: 9,
            },
            Request::Cma {
                id: 14,
                read: false,
                staged: false,
                count: MAX_SEGMENTS,
                total: MAX_OP_LEN,
            },
            Request::Cma {
                id: 15,
                read: false,
                staged: true,
                count: 3,
                total: 1 << 20,
            },
            Request::Cma {
                id: 16,
                read: true,
                staged: true,
                count: 1,
                total: 1,
            },
        ];
        for r in reqs {
            assert_eq!(Request::decode(&r.encode()), Ok(r));
        }
        let resps = [
            Response::Ok { id: 1 },
            Response::OkMany { count: MAX_ACKS },
            Response::Err {
                id: 2,
                status: Status::AddressNotRegistered,
                addr: 5,
                len: 6,
            },
            Response::Data { id: 3, len: 77 },
            Response::Table { id: 4, count: 2 },
            Response::ErrV {
                id: 5,
                status: Status::AddressNotRegistered,
                count: 3,
            },
            Response::SameHostOk {
                id: 0,
                channel: Ok(()),
                stage: Ok(()),
            },
            Response::SameHostOk {
                id: 0,
                channel: Err(38),
                stage: Err(0),
            },
            Response::SameHostOk {
                id: 0,
                channel: Ok(()),
                stage: Err(1),
            },
            Response::Wake,
            Response::DataV {
                id: 6,
                status: None,
                failed: 0,
                len: 100,
            },
            Response::DataV {
                id: 7,
                status: Some(Status::AddressNotRegistered),
                failed: 2,
                len: 0,
            },
        ];
        for r in resps {
            assert_eq!(Response::decode(&r.encode()), Ok(r));
        }
    }

    #[test]
    fn limits_are_enforced() {
        let big = Header {
            kind: kind::WRITE,
            b: MAX_OP_LEN + 1,
            ..Default::default()
        };
        assert!(Request::decode(&big.encode()).is_err());
        let oks = Header {
            kind: kind::OKS,
            aux: MAX_ACKS + 1,
            ..Default::default()
        };
        assert!(Response::decode(&oks.encode()).is_err());
        let table = Header {
            kind: kind::TABLE_REPLY,
            aux: MAX_TABLE_ENTRIES + 1,
            ..Default::default()
        };
        assert!(Response::decode(&table.encode()).is_err());
        let e = |addr, len| TableEntry { addr, len, gen: 1 };
        assert!(decode_table(&encode_table(&[e(10, 5), e(12, 5)])).is_err());
        assert!(decode_table(&encode_table(&[e(u64::MAX, 5)])).is_err());
        assert_eq!(
            decode_table(&encode_table(&[e(10, 5), e(15, 5)])).unwrap(),
            vec![e(10, 5), e(15, 5)]
        );
    }

    #[test]
    fn table_lookups() {
        let t = [
            TableEntry {
                addr: 0x1000,
                len: 0x100,
                gen: 1,
            },
            TableEntry {
                addr: 0x2000,
                len: 0x10,
                gen: 2,
            },
        ];
        assert_eq!(table_lookup(&t, 0x2008, 8), Some(2));
        assert!(table_contains(&t, 0x1000, 0x100));
        assert!(table_contains(&t, 0x2008, 8));
        assert!(!table_contains(&t, 0x10ff, 2));
        assert!(!table_contains(&t, 0x0fff, 1));
        assert!(!table_contains(&t, 0x2000, 0));
        assert!(!table_contains(&t, u64::MAX, 2));
        assert!(!table_contains(&[], 0, 1));
    }

    #[test]
    fn hello_roundtrip_and_garbage() {
        let h = Hello {
            version: VERSION,
            flags: FLAG_AUTH,
            nonce: [7; NONCE_LEN],
            name: "é".repeat(200),
        };
        let bytes = h.encode();
        let fixed: [u8; HELLO_FIXED] = bytes[..HELLO_FIXED].try_into().unwrap();
        let (d, n) = Hello::decode_fixed(&fixed).unwrap();
        assert!(n <= MAX_NAME);
        assert_eq!(bytes.len(), HELLO_FIXED + n);
        assert!(std::str::from_utf8(&bytes[HELLO_FIXED..]).is_ok());
        assert_eq!((d.version, d.flags, d.nonce), (h.version, h.flags, h.nonce));
        assert!(Hello::decode_fixed(&[0x47; HELLO_FIXED]).is_err());
    }

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

        /// Valid headers survive a round trip whatever the field values.
        #[test]
        fn request_roundtrip(id in any::<u64>(), addr in any::<u64>(), len in 0..=MAX_OP_LEN, gen in any::<u32>(), w in any::<bool>()) {
            let r = if w { Request::Write { id, addr, len, gen } } else { Request::Read { id, addr, len, gen } };
            prop_assert_eq!(Request::decode(&r.encode()), Ok(r));
        }
    }
}
