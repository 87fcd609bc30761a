//! Requests (initiator → target): [`Request`], encoded into and decoded
//! from a frame [`Header`].

use super::*;

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
    #[inline]
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
    #[inline]
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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn roundtrip_requests() {
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
    }

    #[test]
    fn limits_are_enforced() {
        let big = Header {
            kind: kind::WRITE,
            b: MAX_OP_LEN + 1,
            ..Default::default()
        };
        assert!(Request::decode(&big.encode()).is_err());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4096))]

        /// Valid headers survive a round trip whatever the field values.
        #[test]
        fn request_roundtrip(id in any::<u64>(), addr in any::<u64>(), len in 0..=MAX_OP_LEN, gen in any::<u32>(), w in any::<bool>()) {
            let r = if w { Request::Write { id, addr, len, gen } } else { Request::Read { id, addr, len, gen } };
            prop_assert_eq!(Request::decode(&r.encode()), Ok(r));
        }
    }
}
