//! The control channel's frames: queue-pair connection data, the peer's
//! region table (address, length, rkey) and notifications, over TCP.
//!
//! A frame is a big-endian `u32` payload length, then the payload: one kind
//! byte and the fields, big-endian, strings as `u32` length + UTF-8. Decoding
//! checks every length against the frame; a malformed frame is
//! [`Error::Protocol`], never a panic.
//!
//! Every connection starts with the authentication exchange (`Auth`,
//! `Challenge`, then with a shared secret one `Proof` each way; see
//! `crate::auth`), read with [`HANDSHAKE_MAX_FRAME`] as the frame bound;
//! only then come `Hello` (queue pair) and `Welcome` (queue pair, regions).
//!
//! From protocol 4 the owner marks its `Challenge` nonce
//! ([`NEGOTIATE_MARK`]) and an opener that sees the mark sends `Offer`
//! (its version range and feature extensions) instead of `Hello`; the owner
//! answers `Agreed` (its range and extensions, the chosen version) instead
//! of `Welcome`, or `Incompatible`. A protocol-3 peer sees only the frames
//! of protocol 3 (see `crate::handshake` and `PROTOCOL.md`).
//!
//! Notifications do not travel here (protocol 3): the opener SENDs them on
//! the queue pair, after the batch's work requests
//! ([`encode_notification`]), so that the owner sees one only after the
//! data it announces. The owner answers each, in the order received, here:
//! `NotifyAck` (queued) or `Notify` (not queued, and why).
#![cfg_attr(not(feature = "rdma"), allow(dead_code))]

use ferry_core::{Error, Result};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::negotiate::VersionRange;

/// Protocol version carried in `Auth` and `Hello` (2: the authentication
/// exchange comes first; 3: notifications are SENT on the queue pair and
/// answered here in order). Every build since sends 3 there: the `Auth`
/// frame is protocol 3's, and the range a build speaks travels in `Offer`.
pub(crate) const VERSION: u16 = 3;
/// The last 8 bytes of a nonce from a side that speaks the negotiated hello
/// (protocol 4 and later); the first 24 are random. A protocol-3 peer takes
/// the whole as a nonce; the proofs cover it, so with a shared secret it
/// cannot be stripped unnoticed.
pub(crate) const NEGOTIATE_MARK: [u8; 8] = *b"fv/nego\x01";
/// `nonce` with [`NEGOTIATE_MARK`] in its last bytes.
pub(crate) fn mark(mut nonce: [u8; NONCE_LEN]) -> [u8; NONCE_LEN] {
    nonce[NONCE_LEN - NEGOTIATE_MARK.len()..].copy_from_slice(&NEGOTIATE_MARK);
    nonce
}

/// Whether `nonce` carries [`NEGOTIATE_MARK`].
pub(crate) fn is_marked(nonce: &[u8; NONCE_LEN]) -> bool {
    nonce[NONCE_LEN - NEGOTIATE_MARK.len()..] == NEGOTIATE_MARK
}

/// Most extensions one `Offer` or `Agreed` may carry.
pub(crate) const MAX_EXTENSIONS: usize = 256;
/// Largest frame accepted (a region table of ~700k entries).
pub(crate) const MAX_FRAME: u32 = 16 << 20;
/// Largest frame accepted during the handshake (authentication and `Hello`):
/// an unauthenticated peer cannot make the owner allocate more.
pub(crate) const HANDSHAKE_MAX_FRAME: u32 = 4096;
/// Length of an authentication nonce.
pub(crate) const NONCE_LEN: usize = 32;
/// Length of an HMAC-SHA256 proof.
pub(crate) const MAC_LEN: usize = 32;

/// One region of the peer's table, as RDMA needs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RemoteRegion {
    pub addr: u64,
    pub len: u64,
    pub rkey: u32,
}

/// The addressing data of one side of a reliable connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct QpEndpoint {
    pub qpn: u32,
    pub psn: u32,
    pub lid: u16,
    pub gid: [u8; 16],
    /// Path MTU as the verbs enum value (1 = 256 … 5 = 4096).
    pub mtu: u8,
}

/// Every control-channel message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Msg {
    /// Opener → owner, first frame: protocol version, whether the opener
    /// holds a shared secret, and its random nonce.
    Auth {
        version: u16,
        secret: bool,
        nonce: [u8; NONCE_LEN],
    },
    /// Owner → opener: whether the owner holds a shared secret, and its
    /// random nonce.
    Challenge {
        secret: bool,
        nonce: [u8; NONCE_LEN],
    },
    /// Either way: HMAC-SHA256 over a direction label and both nonces.
    Proof { mac: [u8; MAC_LEN] },
    /// Opener → owner: my queue pair and my name.
    Hello {
        version: u16,
        endpoint: QpEndpoint,
        name: String,
    },
    /// Owner → opener: its queue pair (already in RTS) and region table.
    Welcome {
        endpoint: QpEndpoint,
        regions: Vec<RemoteRegion>,
    },
    /// Owner → opener: the connection is refused.
    Refused { reason: String },
    /// Opener → owner: send the current region table.
    TableRequest,
    /// Owner → opener: answer to `TableRequest`.
    Table { regions: Vec<RemoteRegion> },
    /// Owner → opener: a region was registered.
    RegionAdded(RemoteRegion),
    /// Owner → opener: the region at `addr` was unregistered.
    RegionRemoved { addr: u64 },
    /// Owner → opener: the oldest unanswered notification the opener SENT
    /// on the queue pair was NOT queued: the owner's queue is full (`full`;
    /// `reason` names the bound) or the owner refuses notifications.
    Notify { full: bool, reason: String },
    /// Owner → opener: the oldest unanswered notification is queued.
    NotifyAck,
    /// Opener → owner (protocol 4+, instead of `Hello`, only to an owner
    /// whose nonce carried [`NEGOTIATE_MARK`]): the versions and extensions
    /// it speaks, its queue pair and its name.
    Offer {
        versions: VersionRange,
        endpoint: QpEndpoint,
        name: String,
        extensions: Vec<Extension>,
    },
    /// Owner → opener (answer to `Offer`, instead of `Welcome`): the owner's
    /// versions and extensions, the version chosen, its queue pair and its
    /// region table.
    Agreed {
        versions: VersionRange,
        version: u16,
        extensions: Vec<Extension>,
        endpoint: QpEndpoint,
        regions: Vec<RemoteRegion>,
    },
    /// Owner → opener (answer to `Offer`): no common version; the owner's
    /// range and why. The connection is closed after it.
    Incompatible {
        versions: VersionRange,
        reason: String,
    },
}

/// One extension of `Offer` / `Agreed`: an id and a body. The features of
/// this build have empty bodies; a receiver ignores ids it does not know
/// (and the bodies of those it knows, reserved for parameters).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Extension {
    pub id: u16,
    pub body: Vec<u8>,
}

const HELLO: u8 = 1;
const WELCOME: u8 = 2;
const REFUSED: u8 = 3;
const TABLE_REQUEST: u8 = 4;
const TABLE: u8 = 5;
const REGION_ADDED: u8 = 6;
const REGION_REMOVED: u8 = 7;
const NOTIFY: u8 = 8;
const NOTIFY_ACK: u8 = 9;
const AUTH: u8 = 10;
const CHALLENGE: u8 = 11;
const PROOF: u8 = 12;
const OFFER: u8 = 13;
const AGREED: u8 = 14;
const INCOMPATIBLE: u8 = 15;

/// Largest SEND payload of a notification: name and message, each as `u32`
/// length + UTF-8.
pub(crate) const NOTIFICATION_MAX_PAYLOAD: usize =
    4 + ferry_core::MAX_NOTIFICATION_NAME + 4 + ferry_core::MAX_NOTIFICATION_MESSAGE;

/// The SEND payload of a notification.
pub(crate) fn encode_notification(n: &ferry_core::Notification) -> Vec<u8> {
    let mut out = Vec::with_capacity(8 + n.name.len() + n.message.len());
    put_str(&mut out, &n.name);
    put_str(&mut out, &n.message);
    out
}

/// Decodes (and validates) a notification SEND payload.
pub(crate) fn decode_notification(buf: &[u8], peer: &str) -> Result<ferry_core::Notification> {
    let mut r = Reader { buf, pos: 0, peer };
    let name = r.string()?;
    let message = r.string()?;
    if r.pos != buf.len() {
        return Err(r.err("trailing bytes after a notification".into()));
    }
    let n = ferry_core::Notification::new(name, message);
    n.validate()?;
    Ok(n)
}

fn put_endpoint(out: &mut Vec<u8>, e: &QpEndpoint) {
    out.extend_from_slice(&e.qpn.to_be_bytes());
    out.extend_from_slice(&e.psn.to_be_bytes());
    out.extend_from_slice(&e.lid.to_be_bytes());
    out.extend_from_slice(&e.gid);
    out.push(e.mtu);
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u32).to_be_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn put_region(out: &mut Vec<u8>, r: &RemoteRegion) {
    out.extend_from_slice(&r.addr.to_be_bytes());
    out.extend_from_slice(&r.len.to_be_bytes());
    out.extend_from_slice(&r.rkey.to_be_bytes());
}

fn put_range(out: &mut Vec<u8>, v: &VersionRange) {
    out.extend_from_slice(&v.min.to_be_bytes());
    out.extend_from_slice(&v.max.to_be_bytes());
}

/// `u16` count, then per extension `u16` id, `u16` body length, body. The
/// encoder's callers keep counts and bodies within the bounds (this build's
/// extensions have empty bodies).
fn put_extensions(out: &mut Vec<u8>, es: &[Extension]) {
    out.extend_from_slice(&(es.len().min(MAX_EXTENSIONS) as u16).to_be_bytes());
    for e in es.iter().take(MAX_EXTENSIONS) {
        let body = &e.body[..e.body.len().min(u16::MAX as usize)];
        out.extend_from_slice(&e.id.to_be_bytes());
        out.extend_from_slice(&(body.len() as u16).to_be_bytes());
        out.extend_from_slice(body);
    }
}

fn put_regions(out: &mut Vec<u8>, rs: &[RemoteRegion]) {
    out.extend_from_slice(&(rs.len() as u32).to_be_bytes());
    for r in rs {
        put_region(out, r);
    }
}

impl Msg {
    /// The frame payload (without the length prefix).
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(64);
        match self {
            Msg::Hello {
                version,
                endpoint,
                name,
            } => {
                out.push(HELLO);
                out.extend_from_slice(&version.to_be_bytes());
                put_endpoint(&mut out, endpoint);
                put_str(&mut out, name);
            }
            Msg::Welcome { endpoint, regions } => {
                out.push(WELCOME);
                put_endpoint(&mut out, endpoint);
                put_regions(&mut out, regions);
            }
            Msg::Refused { reason } => {
                out.push(REFUSED);
                put_str(&mut out, reason);
            }
            Msg::TableRequest => out.push(TABLE_REQUEST),
            Msg::Table { regions } => {
                out.push(TABLE);
                put_regions(&mut out, regions);
            }
            Msg::RegionAdded(r) => {
                out.push(REGION_ADDED);
                put_region(&mut out, r);
            }
            Msg::RegionRemoved { addr } => {
                out.push(REGION_REMOVED);
                out.extend_from_slice(&addr.to_be_bytes());
            }
            Msg::Notify { full, reason } => {
                out.push(NOTIFY);
                out.push(u8::from(*full));
                put_str(&mut out, reason);
            }
            Msg::NotifyAck => out.push(NOTIFY_ACK),
            Msg::Auth {
                version,
                secret,
                nonce,
            } => {
                out.push(AUTH);
                out.extend_from_slice(&version.to_be_bytes());
                out.push(u8::from(*secret));
                out.extend_from_slice(nonce);
            }
            Msg::Challenge { secret, nonce } => {
                out.push(CHALLENGE);
                out.push(u8::from(*secret));
                out.extend_from_slice(nonce);
            }
            Msg::Proof { mac } => {
                out.push(PROOF);
                out.extend_from_slice(mac);
            }
            Msg::Offer {
                versions,
                endpoint,
                name,
                extensions,
            } => {
                out.push(OFFER);
                put_range(&mut out, versions);
                put_endpoint(&mut out, endpoint);
                put_str(&mut out, name);
                put_extensions(&mut out, extensions);
            }
            Msg::Agreed {
                versions,
                version,
                extensions,
                endpoint,
                regions,
            } => {
                out.push(AGREED);
                put_range(&mut out, versions);
                out.extend_from_slice(&version.to_be_bytes());
                put_extensions(&mut out, extensions);
                put_endpoint(&mut out, endpoint);
                put_regions(&mut out, regions);
            }
            Msg::Incompatible { versions, reason } => {
                out.push(INCOMPATIBLE);
                put_range(&mut out, versions);
                put_str(&mut out, reason);
            }
        }
        out
    }

    /// Decodes one frame payload; `peer` only shapes the error.
    pub(crate) fn decode(buf: &[u8], peer: &str) -> Result<Msg> {
        let mut r = Reader { buf, pos: 0, peer };
        let msg = match r.u8()? {
            HELLO => Msg::Hello {
                version: r.u16()?,
                endpoint: r.endpoint()?,
                name: r.string()?,
            },
            WELCOME => Msg::Welcome {
                endpoint: r.endpoint()?,
                regions: r.regions()?,
            },
            REFUSED => Msg::Refused {
                reason: r.string()?,
            },
            TABLE_REQUEST => Msg::TableRequest,
            TABLE => Msg::Table {
                regions: r.regions()?,
            },
            REGION_ADDED => Msg::RegionAdded(r.region()?),
            REGION_REMOVED => Msg::RegionRemoved { addr: r.u64()? },
            NOTIFY => Msg::Notify {
                full: r.flag()?,
                reason: r.string()?,
            },
            NOTIFY_ACK => Msg::NotifyAck,
            AUTH => Msg::Auth {
                version: r.u16()?,
                secret: r.flag()?,
                nonce: r.array()?,
            },
            CHALLENGE => Msg::Challenge {
                secret: r.flag()?,
                nonce: r.array()?,
            },
            PROOF => Msg::Proof { mac: r.array()? },
            OFFER => Msg::Offer {
                versions: r.range()?,
                endpoint: r.endpoint()?,
                name: r.string()?,
                extensions: r.extensions()?,
            },
            AGREED => {
                let versions = r.range()?;
                let version = r.u16()?;
                if !versions.contains(version) {
                    return Err(r.err(format!(
                        "the chosen version {version} is outside the owner's range {versions}"
                    )));
                }
                Msg::Agreed {
                    versions,
                    version,
                    extensions: r.extensions()?,
                    endpoint: r.endpoint()?,
                    regions: r.regions()?,
                }
            }
            INCOMPATIBLE => Msg::Incompatible {
                versions: r.range()?,
                reason: r.string()?,
            },
            k => return Err(r.err(format!("unknown frame kind {k}"))),
        };
        if r.pos != buf.len() {
            return Err(r.err(format!(
                "{} trailing bytes after a frame",
                buf.len() - r.pos
            )));
        }
        Ok(msg)
    }
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    peer: &'a str,
}

impl Reader<'_> {
    fn err(&self, reason: String) -> Error {
        Error::Protocol {
            peer: self.peer.to_owned(),
            reason,
        }
    }
    fn take(&mut self, n: usize) -> Result<&[u8]> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|e| *e <= self.buf.len())
            .ok_or_else(|| self.err(format!("frame truncated at byte {}", self.pos)))?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8> {
        Ok(self.array::<1>()?[0])
    }
    fn flag(&mut self) -> Result<bool> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            b => Err(self.err(format!("flag byte {b} is neither 0 nor 1"))),
        }
    }
    fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_be_bytes(self.array()?))
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_be_bytes(self.array()?))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_be_bytes(self.array()?))
    }
    fn string(&mut self) -> Result<String> {
        let n = self.u32()? as usize;
        let bytes = self.take(n)?.to_vec();
        String::from_utf8(bytes).map_err(|_| self.err("a string is not UTF-8".into()))
    }
    fn endpoint(&mut self) -> Result<QpEndpoint> {
        Ok(QpEndpoint {
            qpn: self.u32()?,
            psn: self.u32()?,
            lid: self.u16()?,
            gid: self.array()?,
            mtu: self.u8()?,
        })
    }
    fn range(&mut self) -> Result<VersionRange> {
        let (min, max) = (self.u16()?, self.u16()?);
        VersionRange::new(min, max)
            .ok_or_else(|| self.err(format!("version range {min}..={max} is empty")))
    }
    fn extensions(&mut self) -> Result<Vec<Extension>> {
        let n = self.u16()? as usize;
        // Each extension is at least 4 bytes: refuse counts the frame cannot
        // hold before allocating.
        if n > MAX_EXTENSIONS || n.saturating_mul(4) > self.buf.len() - self.pos {
            return Err(self.err(format!(
                "extension count {n} exceeds the frame or {MAX_EXTENSIONS}"
            )));
        }
        let mut out: Vec<Extension> = Vec::with_capacity(n);
        for _ in 0..n {
            let id = self.u16()?;
            let len = self.u16()? as usize;
            let body = self.take(len)?.to_vec();
            if out.iter().any(|e| e.id == id) {
                return Err(self.err(format!("extension {id} appears twice")));
            }
            out.push(Extension { id, body });
        }
        Ok(out)
    }
    fn region(&mut self) -> Result<RemoteRegion> {
        Ok(RemoteRegion {
            addr: self.u64()?,
            len: self.u64()?,
            rkey: self.u32()?,
        })
    }
    fn regions(&mut self) -> Result<Vec<RemoteRegion>> {
        let n = self.u32()? as usize;
        // Each region is 20 bytes: refuse counts the frame cannot hold before
        // allocating.
        if n.saturating_mul(20) > self.buf.len() - self.pos {
            return Err(self.err(format!("region count {n} exceeds the frame")));
        }
        (0..n).map(|_| self.region()).collect()
    }
}

/// Writes one frame.
pub(crate) async fn write_msg<W: AsyncWrite + Unpin>(w: &mut W, msg: &Msg) -> std::io::Result<()> {
    let payload = msg.encode();
    let mut frame = Vec::with_capacity(4 + payload.len());
    frame.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    frame.extend_from_slice(&payload);
    w.write_all(&frame).await?;
    w.flush().await
}

/// Reads one frame. `Ok(None)` is a clean end of stream between frames.
pub(crate) async fn read_msg<R: AsyncRead + Unpin>(r: &mut R, peer: &str) -> Result<Option<Msg>> {
    read_msg_max(r, peer, MAX_FRAME).await
}

/// [`read_msg`] refusing frames longer than `max` bytes (before allocating).
pub(crate) async fn read_msg_max<R: AsyncRead + Unpin>(
    r: &mut R,
    peer: &str,
    max: u32,
) -> Result<Option<Msg>> {
    let mut len = [0u8; 4];
    match r.read_exact(&mut len).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(Error::io(format!("reading from {peer}"), &e)),
    }
    let len = u32::from_be_bytes(len);
    if len == 0 || len > max {
        return Err(Error::Protocol {
            peer: peer.to_owned(),
            reason: format!("frame length {len} is outside 1..={max}"),
        });
    }
    let mut buf = vec![0u8; len as usize];
    r.read_exact(&mut buf)
        .await
        .map_err(|e| Error::io(format!("reading from {peer}"), &e))?;
    Msg::decode(&buf, peer).map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all() -> Vec<Msg> {
        let ep = QpEndpoint {
            qpn: 0x11,
            psn: 0xabcdef,
            lid: 7,
            gid: [0xfe; 16],
            mtu: 3,
        };
        let r = RemoteRegion {
            addr: 0x7f00_0000_1000,
            len: 1 << 20,
            rkey: 0x1234,
        };
        vec![
            Msg::Hello {
                version: VERSION,
                endpoint: ep,
                name: "127.0.0.1:5000".into(),
            },
            Msg::Welcome {
                endpoint: ep,
                regions: vec![r, r],
            },
            Msg::Refused {
                reason: "no".into(),
            },
            Msg::TableRequest,
            Msg::Table { regions: vec![] },
            Msg::RegionAdded(r),
            Msg::RegionRemoved { addr: 42 },
            Msg::Notify {
                full: true,
                reason: "1024 notifications".into(),
            },
            Msg::NotifyAck,
            Msg::Auth {
                version: VERSION,
                secret: true,
                nonce: [9; NONCE_LEN],
            },
            Msg::Challenge {
                secret: false,
                nonce: [3; NONCE_LEN],
            },
            Msg::Proof {
                mac: [0xaa; MAC_LEN],
            },
            Msg::Offer {
                versions: VersionRange { min: 3, max: 4 },
                endpoint: ep,
                name: "127.0.0.1:5000".into(),
                extensions: vec![
                    Extension {
                        id: 1,
                        body: vec![],
                    },
                    Extension {
                        id: 900,
                        body: vec![1, 2, 3],
                    },
                ],
            },
            Msg::Agreed {
                versions: VersionRange { min: 3, max: 9 },
                version: 4,
                extensions: vec![Extension {
                    id: 3,
                    body: vec![],
                }],
                endpoint: ep,
                regions: vec![r],
            },
            Msg::Incompatible {
                versions: VersionRange { min: 5, max: 6 },
                reason: "upgrade".into(),
            },
        ]
    }

    #[test]
    fn round_trip() {
        for m in all() {
            assert_eq!(Msg::decode(&m.encode(), "p").unwrap(), m);
        }
    }

    #[test]
    fn malformed_frames_are_protocol_errors() {
        for m in all() {
            let enc = m.encode();
            for cut in 0..enc.len() {
                assert!(matches!(
                    Msg::decode(&enc[..cut], "p"),
                    Err(Error::Protocol { .. })
                ));
            }
            let mut long = enc.clone();
            long.push(0);
            assert!(matches!(
                Msg::decode(&long, "p"),
                Err(Error::Protocol { .. })
            ));
        }
        assert!(matches!(
            Msg::decode(&[99], "p"),
            Err(Error::Protocol { .. })
        ));
        // A region count far beyond the frame is refused before allocating.
        let mut huge = vec![TABLE];
        huge.extend_from_slice(&u32::MAX.to_be_bytes());
        assert!(matches!(
            Msg::decode(&huge, "p"),
            Err(Error::Protocol { .. })
        ));
    }

    #[tokio::test]
    async fn framing_over_a_stream() {
        let (mut a, mut b) = tokio::io::duplex(1 << 16);
        for m in all() {
            write_msg(&mut a, &m).await.unwrap();
        }
        drop(a);
        for m in all() {
            assert_eq!(read_msg(&mut b, "p").await.unwrap(), Some(m));
        }
        assert_eq!(read_msg(&mut b, "p").await.unwrap(), None);
        let (mut a, mut b) = tokio::io::duplex(64);
        a.write_all(&(MAX_FRAME + 1).to_be_bytes()).await.unwrap();
        assert!(matches!(
            read_msg(&mut b, "p").await,
            Err(Error::Protocol { .. })
        ));
        // Before authentication, a frame above the small bound is refused
        // from its length prefix alone.
        let (mut a, mut b) = tokio::io::duplex(64);
        a.write_all(&(HANDSHAKE_MAX_FRAME + 1).to_be_bytes())
            .await
            .unwrap();
        assert!(matches!(
            read_msg_max(&mut b, "p", HANDSHAKE_MAX_FRAME).await,
            Err(Error::Protocol { .. })
        ));
    }

    #[test]
    fn notification_payloads_round_trip_and_malformed_ones_are_refused() {
        let n = ferry_core::Notification::new("name", "message");
        let enc = encode_notification(&n);
        assert_eq!(decode_notification(&enc, "p").unwrap(), n);
        for cut in 0..enc.len() {
            assert!(decode_notification(&enc[..cut], "p").is_err());
        }
        let big = ferry_core::Notification::new(
            "n".repeat(ferry_core::MAX_NOTIFICATION_NAME),
            "m".repeat(ferry_core::MAX_NOTIFICATION_MESSAGE),
        );
        assert_eq!(encode_notification(&big).len(), NOTIFICATION_MAX_PAYLOAD);
        let too_big = ferry_core::Notification::new("n", "m".repeat(NOTIFICATION_MAX_PAYLOAD));
        assert!(decode_notification(&encode_notification(&too_big), "p").is_err());
    }

    #[test]
    fn malformed_negotiation_frames_are_protocol_errors() {
        let ep = QpEndpoint {
            qpn: 1,
            psn: 2,
            lid: 3,
            gid: [4; 16],
            mtu: 3,
        };
        let offer = |min: u16, max: u16, extensions: Vec<Extension>| {
            let mut enc = Msg::Offer {
                versions: VersionRange { min: 3, max: 4 },
                endpoint: ep,
                name: "n".into(),
                extensions,
            }
            .encode();
            enc[1..3].copy_from_slice(&min.to_be_bytes());
            enc[3..5].copy_from_slice(&max.to_be_bytes());
            enc
        };
        let protocol_error = |b: &[u8]| matches!(Msg::decode(b, "p"), Err(Error::Protocol { .. }));
        // An empty range.
        assert!(protocol_error(&offer(5, 4, vec![])));
        assert!(!protocol_error(&offer(4, 4, vec![])));
        // The same extension twice.
        let dup = vec![
            Extension {
                id: 2,
                body: vec![],
            },
            Extension {
                id: 2,
                body: vec![9],
            },
        ];
        assert!(protocol_error(&offer(3, 4, dup)));
        // An extension count the frame cannot hold.
        let mut huge = offer(3, 4, vec![]);
        let at = huge.len() - 2;
        huge[at..].copy_from_slice(&u16::MAX.to_be_bytes());
        assert!(protocol_error(&huge));
        // An extension body longer than the frame.
        let mut long = offer(3, 4, vec![]);
        let at = long.len() - 2;
        long[at..].copy_from_slice(&1u16.to_be_bytes());
        long.extend_from_slice(&7u16.to_be_bytes());
        long.extend_from_slice(&100u16.to_be_bytes());
        assert!(protocol_error(&long));
        // A chosen version outside the owner's own range.
        let mut agreed = Msg::Agreed {
            versions: VersionRange { min: 3, max: 4 },
            version: 4,
            extensions: vec![],
            endpoint: ep,
            regions: vec![],
        }
        .encode();
        agreed[5..7].copy_from_slice(&7u16.to_be_bytes());
        assert!(protocol_error(&agreed));
    }

    #[test]
    fn nonce_marks() {
        let n = [0x5a; NONCE_LEN];
        assert!(!is_marked(&n));
        let m = mark(n);
        assert!(is_marked(&m));
        assert_eq!(
            m[..NONCE_LEN - NEGOTIATE_MARK.len()],
            n[..NONCE_LEN - NEGOTIATE_MARK.len()]
        );
    }

    proptest::proptest! {
        /// Any bytes decode to a frame or a protocol error, never a panic;
        /// and what decodes re-encodes to the same bytes.
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..200)) {
            match Msg::decode(&bytes, "p") {
                Ok(m) => proptest::prop_assert_eq!(m.encode(), bytes),
                Err(e) => proptest::prop_assert!(matches!(e, Error::Protocol { .. }), "{:?}", e),
            }
        }

        /// The same, for bytes that start as a negotiated hello or answer.
        #[test]
        fn arbitrary_negotiation_frames_never_panic(
            kind in proptest::sample::select(vec![OFFER, AGREED, INCOMPATIBLE]),
            rest in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..120),
        ) {
            let mut bytes = vec![kind];
            bytes.extend_from_slice(&rest);
            match Msg::decode(&bytes, "p") {
                Ok(m) => proptest::prop_assert_eq!(m.encode(), bytes),
                Err(e) => proptest::prop_assert!(matches!(e, Error::Protocol { .. }), "{:?}", e),
            }
        }

        /// Offers with arbitrary ranges and extensions round-trip.
        #[test]
        fn offers_round_trip(
            min in 0u16..100, span in 0u16..100,
            ids in proptest::collection::btree_set(proptest::prelude::any::<u16>(), 0..20),
            name in "[a-z0-9.:]{0,40}",
        ) {
            let m = Msg::Offer {
                versions: VersionRange { min, max: min + span },
                endpoint: QpEndpoint { qpn: 1, psn: 2, lid: 3, gid: [7; 16], mtu: 5 },
                name,
                extensions: ids.into_iter().map(|id| Extension { id, body: vec![id as u8; (id % 5) as usize] }).collect(),
            };
            proptest::prop_assert_eq!(Msg::decode(&m.encode(), "p").unwrap(), m);
        }
    }

    #[test]
    fn auth_flag_must_be_a_boolean() {
        let mut enc = Msg::Challenge {
            secret: true,
            nonce: [0; NONCE_LEN],
        }
        .encode();
        enc[1] = 2;
        assert!(matches!(
            Msg::decode(&enc, "p"),
            Err(Error::Protocol { .. })
        ));
    }
}
