//! Responses (target → initiator): [`Response`], encoded into and decoded
//! from a frame [`Header`].

use super::*;

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
    /// (the staging area's acknowledgement lane, [`crate::layout::area::ACK_RING`]).
    Wake,
}

impl Response {
    /// Encodes the header of this response.
    #[inline]
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
    #[inline]
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_responses() {
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
    }
}
