//! Ferry's metadata exchange for NIXL agents: how a peer obtains an
//! agent's NIXL metadata, and how the agent takes memory back.
//!
//! Every engine listens on TCP (`host:port`, its segment name). An
//! initiator that opens the segment connects and keeps the connection for
//! as long as the segment is open. Frames are `u32 len` (little-endian,
//! bytes after the length) `| u8 kind | payload`, at most [`MAX_FRAME`]:
//!
//! | kind | direction | payload |
//! |---|---|---|
//! | `HELLO` 0x01 | initiator → target | magic `FERRY-NIXL`, `u16 min`, `u16 max` version |
//! | `STATE` 0x02 | target → initiator | `u16 version`, agent name, NIXL metadata, regions |
//! | `FETCH` 0x03 | initiator → target | — (asks for a fresh `STATE`) |
//! | `REVOKE` 0x04 | target → initiator | `u64 seq`, `u64 addr` |
//! | `REVOKED` 0x05 | initiator → target | `u64 seq` |
//! | `REFUSE` 0x06 | target → initiator, initiator → target | reason (UTF-8) |
//! | `CONFIRM` 0x07 | initiator → target | `u64 token`, sender agent name |
//! | `CONFIRMED` 0x08 | target → initiator | `u64 token`, `u8 ok` |
//!
//! Strings and blobs are `u32 len | bytes`; regions are `u32 n` then `n ×
//! (u64 addr, u64 len)`.
//!
//! The invariants:
//!
//! - A `STATE` lists exactly the regions registered with NIXL at the moment
//!   it was written, and its metadata (from `nixl_capi_get_local_md`)
//!   describes at least those. The initiator loads the metadata with
//!   `nixl_capi_load_remote_md` and mirrors the regions; it checks every
//!   remote address against the mirror before NIXL sees it, and fetches a
//!   fresh `STATE` once when an address misses (the peer may have
//!   registered memory after the segment was opened).
//! - The target takes a region out of its advertised set and writes
//!   `REVOKE` on every connection under one lock, the same lock under which
//!   a `STATE` is built and written: on each connection a `STATE` that
//!   lists the region is always followed by its `REVOKE`.
//! - The initiator applies frames in order, refuses new transfers into a
//!   revoked region at once, and answers `REVOKED` only when none of its
//!   transfers into the region is in flight (NIXL reported each one
//!   terminal). The target deregisters the memory from NIXL, and its
//!   `unregister` returns, only after every connection answered or was
//!   closed by its peer (end of stream: the initiator closes it only once
//!   NIXL released its last request on it). A connection that ended any
//!   other way (reset, error, a refused frame) proves nothing: the regions
//!   advertised to that peer, or being revoked from it, stay registered
//!   for the life of the engine (`RegionHeld`).
//! - An initiator whose connection ends without its asking aborts the
//!   requests still in flight on it (the peer can no longer revoke), and
//!   keeps their regions' guards (UCX may not stop an operation already on
//!   the wire); it answers no `REVOKE` of a region such a guard holds.
//!   Where it gave up a connection that still works (a frame it could not
//!   take), it sends `REFUSE` first, which the target takes as an abnormal
//!   end, so that its later close is not read as "nothing in flight".
//!
//! - A batch with a notification is finished only when the peer has it:
//!   the notification travels as a NIXL notification (on the transfer
//!   request, so after the data), carrying a token; the initiator then
//!   sends `CONFIRM` and the target answers `CONFIRMED` once it has taken
//!   that token from NIXL into its queue (`ok = 0` if it did not arrive
//!   within 10 s).
//!
//! Versions: this is version 1; a target that shares no version with the
//! initiator answers `REFUSE` naming both ranges.

use ferry_core::{Error, Result};

/// Longest frame accepted (a metadata blob of many regions fits easily).
pub(crate) const MAX_FRAME: usize = 64 << 20;
/// The protocol versions this build speaks.
pub(crate) const VERSION_MIN: u16 = 1;
pub(crate) const VERSION_MAX: u16 = 1;
/// The magic that opens a `HELLO`.
pub(crate) const MAGIC: &[u8; 10] = b"FERRY-NIXL";

pub(crate) const HELLO: u8 = 0x01;
pub(crate) const STATE: u8 = 0x02;
pub(crate) const FETCH: u8 = 0x03;
pub(crate) const REVOKE: u8 = 0x04;
pub(crate) const REVOKED: u8 = 0x05;
pub(crate) const REFUSE: u8 = 0x06;
pub(crate) const CONFIRM: u8 = 0x07;
pub(crate) const CONFIRMED: u8 = 0x08;

/// What a target advertises.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct State {
    pub version: u16,
    pub agent: String,
    pub metadata: Vec<u8>,
    pub regions: Vec<(u64, u64)>,
}

/// One decoded frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Frame {
    Hello { min: u16, max: u16 },
    State(State),
    Fetch,
    Revoke { seq: u64, addr: u64 },
    Revoked { seq: u64 },
    Refuse(String),
    Confirm { token: u64, sender: String },
    Confirmed { token: u64, ok: bool },
}

impl Frame {
    /// The frame with its length prefix.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut b = vec![0u8; 4];
        match self {
            Frame::Hello { min, max } => {
                b.push(HELLO);
                b.extend_from_slice(MAGIC);
                b.extend_from_slice(&min.to_le_bytes());
                b.extend_from_slice(&max.to_le_bytes());
            }
            Frame::State(s) => {
                b.push(STATE);
                b.extend_from_slice(&s.version.to_le_bytes());
                put_bytes(&mut b, s.agent.as_bytes());
                put_bytes(&mut b, &s.metadata);
                b.extend_from_slice(&(s.regions.len() as u32).to_le_bytes());
                for (a, l) in &s.regions {
                    b.extend_from_slice(&a.to_le_bytes());
                    b.extend_from_slice(&l.to_le_bytes());
                }
            }
            Frame::Fetch => b.push(FETCH),
            Frame::Revoke { seq, addr } => {
                b.push(REVOKE);
                b.extend_from_slice(&seq.to_le_bytes());
                b.extend_from_slice(&addr.to_le_bytes());
            }
            Frame::Revoked { seq } => {
                b.push(REVOKED);
                b.extend_from_slice(&seq.to_le_bytes());
            }
            Frame::Refuse(r) => {
                b.push(REFUSE);
                b.extend_from_slice(r.as_bytes());
            }
            Frame::Confirm { token, sender } => {
                b.push(CONFIRM);
                b.extend_from_slice(&token.to_le_bytes());
                put_bytes(&mut b, sender.as_bytes());
            }
            Frame::Confirmed { token, ok } => {
                b.push(CONFIRMED);
                b.extend_from_slice(&token.to_le_bytes());
                b.push(u8::from(*ok));
            }
        }
        let len = (b.len() - 4) as u32;
        b[..4].copy_from_slice(&len.to_le_bytes());
        b
    }

    /// Decodes the bytes after the length prefix; `peer` names the sender
    /// in the error.
    pub(crate) fn decode(body: &[u8], peer: &str) -> Result<Frame> {
        let mut r = Reader { b: body, peer };
        let kind = r.u8()?;
        let f = match kind {
            HELLO => {
                let magic = r.take(MAGIC.len())?;
                if magic != MAGIC {
                    return Err(r.err("not a Ferry NIXL peer (bad magic)".to_owned()));
                }
                Frame::Hello {
                    min: r.u16()?,
                    max: r.u16()?,
                }
            }
            STATE => {
                let version = r.u16()?;
                let agent = String::from_utf8(r.bytes()?.to_vec())
                    .map_err(|_| r.err("agent name is not UTF-8".to_owned()))?;
                let metadata = r.bytes()?.to_vec();
                let n = r.u32()? as usize;
                if n > r.b.len() / 16 {
                    return Err(r.err(format!("{n} regions do not fit in the frame")));
                }
                let mut regions = Vec::with_capacity(n);
                for _ in 0..n {
                    regions.push((r.u64()?, r.u64()?));
                }
                Frame::State(State {
                    version,
                    agent,
                    metadata,
                    regions,
                })
            }
            FETCH => Frame::Fetch,
            REVOKE => Frame::Revoke {
                seq: r.u64()?,
                addr: r.u64()?,
            },
            REVOKED => Frame::Revoked { seq: r.u64()? },
            REFUSE => Frame::Refuse(String::from_utf8_lossy(r.b).into_owned()),
            CONFIRM => Frame::Confirm {
                token: r.u64()?,
                sender: String::from_utf8_lossy(r.bytes()?).into_owned(),
            },
            CONFIRMED => Frame::Confirmed {
                token: r.u64()?,
                ok: match r.u8()? {
                    0 => false,
                    1 => true,
                    v => return Err(r.err(format!("CONFIRMED flag {v}"))),
                },
            },
            other => return Err(r.err(format!("unknown frame kind {other:#04x}"))),
        };
        if kind != REFUSE && !r.b.is_empty() {
            return Err(r.err(format!("{} bytes after the frame", r.b.len())));
        }
        Ok(f)
    }
}

fn put_bytes(b: &mut Vec<u8>, v: &[u8]) {
    b.extend_from_slice(&(v.len() as u32).to_le_bytes());
    b.extend_from_slice(v);
}

struct Reader<'a> {
    b: &'a [u8],
    peer: &'a str,
}

impl<'a> Reader<'a> {
    fn err(&self, reason: String) -> Error {
        Error::Protocol {
            peer: self.peer.to_owned(),
            reason,
        }
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.b.len() < n {
            return Err(self.err("truncated frame".to_owned()));
        }
        let (h, t) = self.b.split_at(n);
        self.b = t;
        Ok(h)
    }
    fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16> {
        let mut a = [0u8; 2];
        a.copy_from_slice(self.take(2)?);
        Ok(u16::from_le_bytes(a))
    }
    fn u32(&mut self) -> Result<u32> {
        let mut a = [0u8; 4];
        a.copy_from_slice(self.take(4)?);
        Ok(u32::from_le_bytes(a))
    }
    fn u64(&mut self) -> Result<u64> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(a))
    }
    fn bytes(&mut self) -> Result<&'a [u8]> {
        let n = self.u32()? as usize;
        self.take(n)
    }
}

/// Reads one frame; `Ok(None)` at a clean end of stream.
pub(crate) async fn read_frame<R: tokio::io::AsyncRead + Unpin>(
    r: &mut R,
    peer: &str,
) -> Result<Option<Frame>> {
    use tokio::io::AsyncReadExt;
    let mut len = [0u8; 4];
    match r.read_exact(&mut len).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(Error::io(format!("reading from {peer}"), &e)),
    }
    let len = u32::from_le_bytes(len) as usize;
    if len == 0 || len > MAX_FRAME {
        return Err(Error::Protocol {
            peer: peer.to_owned(),
            reason: format!("frame of {len} bytes (limit {MAX_FRAME})"),
        });
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body)
        .await
        .map_err(|e| Error::io(format!("reading from {peer}"), &e))?;
    Frame::decode(&body, peer).map(Some)
}

/// Writes one frame.
pub(crate) async fn write_frame<W: tokio::io::AsyncWrite + Unpin>(
    w: &mut W,
    frame: &Frame,
    peer: &str,
) -> Result<()> {
    use tokio::io::AsyncWriteExt;
    w.write_all(&frame.encode())
        .await
        .map_err(|e| Error::io(format!("writing to {peer}"), &e))
}

/// The target's write half of a peer's control connection, which keeps
/// whether one of its writes took a reset.
///
/// Linux reports a received `RST` once, to whichever call on the socket
/// comes first. When a write of the target (a `REVOKE` from `unregister`,
/// a `STATE`) takes it, the read that follows returns 0, as at the clean
/// close that shows "nothing in flight". The reader therefore asks this
/// writer, under its lock, before it takes an end of stream as clean:
/// every write runs under that lock, so a reset taken by a write is
/// recorded before the reader can look. A reset that comes after the
/// peer's `FIN` (the target wrote to a socket the peer had closed) is
/// reported as `EPIPE`, not `ECONNRESET`, and does not count: the `FIN`
/// came first.
pub(crate) struct PeerWriter {
    half: tokio::net::tcp::OwnedWriteHalf,
    reset: bool,
}

impl PeerWriter {
    pub(crate) fn new(half: tokio::net::tcp::OwnedWriteHalf) -> Self {
        Self { half, reset: false }
    }

    /// Writes one frame; a reset it meets is kept (see [`Self::was_reset`]).
    pub(crate) async fn send(&mut self, frame: &Frame, peer: &str) -> Result<()> {
        use tokio::io::AsyncWriteExt;
        self.half.write_all(&frame.encode()).await.map_err(|e| {
            if e.kind() == std::io::ErrorKind::ConnectionReset {
                self.reset = true;
            }
            Error::io(format!("writing to {peer}"), &e)
        })
    }

    /// Whether a write took the connection's reset.
    pub(crate) fn was_reset(&self) -> bool {
        self.reset
    }

    /// Shuts the write side down (a `FIN`).
    pub(crate) async fn shutdown(&mut self) -> std::io::Result<()> {
        use tokio::io::AsyncWriteExt;
        self.half.shutdown().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(f: Frame) {
        let enc = f.encode();
        let len = u32::from_le_bytes([enc[0], enc[1], enc[2], enc[3]]) as usize;
        assert_eq!(len, enc.len() - 4);
        assert_eq!(Frame::decode(&enc[4..], "p").unwrap(), f);
    }

    #[test]
    fn frames_round_trip() {
        round_trip(Frame::Hello { min: 1, max: 3 });
        round_trip(Frame::State(State {
            version: 1,
            agent: "a".into(),
            metadata: vec![1, 2, 3],
            regions: vec![(0x1000, 4096), (u64::MAX - 1, 1)],
        }));
        round_trip(Frame::Fetch);
        round_trip(Frame::Revoke { seq: 7, addr: 9 });
        round_trip(Frame::Revoked { seq: 7 });
        round_trip(Frame::Refuse("no".into()));
        round_trip(Frame::Confirm {
            token: 5,
            sender: "agent".into(),
        });
        round_trip(Frame::Confirmed { token: 5, ok: true });
    }

    #[test]
    fn bad_frames_are_protocol_errors_never_panics() {
        let state = Frame::State(State {
            version: 1,
            agent: "agent".into(),
            metadata: vec![9; 40],
            regions: vec![(1, 2), (3, 4)],
        })
        .encode();
        // Every truncation and every single-byte corruption decodes to a
        // frame or a typed error.
        for cut in 0..state.len() - 4 {
            let _ = Frame::decode(&state[4..4 + cut], "p");
        }
        for i in 4..state.len() {
            for v in [0u8, 0x7f, 0xff] {
                let mut b = state.clone();
                b[i] = v;
                let _ = Frame::decode(&b[4..], "p");
            }
        }
        assert!(matches!(
            Frame::decode(&[0x42], "p"),
            Err(Error::Protocol { .. })
        ));
        assert!(matches!(
            Frame::decode(b"\x01NOT-FERRY\x01\x00\x01\x00", "p"),
            Err(Error::Protocol { .. })
        ));
        // A region count that cannot fit is refused before allocating.
        let mut huge = vec![STATE, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        huge.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            Frame::decode(&huge, "p"),
            Err(Error::Protocol { .. })
        ));
    }
}

/// [`PeerWriter`] on real loopback sockets: the kernel behaviour it exists
/// for (a reset's error taken by a write, the read then at end of stream),
/// and a write after a clean close.
#[cfg(test)]
mod end_of_stream {
    use super::*;
    use tokio::io::AsyncReadExt;
    use tokio::net::{TcpListener, TcpStream};

    async fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let peer = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
        let (ours, _) = l.accept().await.unwrap();
        (ours, peer)
    }

    /// The case a read alone gets wrong: the reset's error goes to a
    /// write, and the read that follows says end of stream.
    #[tokio::test]
    async fn a_reset_taken_by_a_write_is_kept() {
        let (ours, peer) = pair().await;
        peer.set_zero_linger().unwrap();
        drop(peer);
        ours.readable().await.unwrap();
        let (mut rd, wr) = ours.into_split();
        let mut w = PeerWriter::new(wr);
        let r = w.send(&Frame::Revoke { seq: 1, addr: 0 }, "p").await;
        assert!(r.is_err(), "the write takes the reset: {r:?}");
        let mut b = [0u8; 1];
        assert_eq!(
            rd.read(&mut b).await.unwrap(),
            0,
            "the read then reports end of stream, as at a clean close"
        );
        assert!(w.was_reset(), "the writer kept the reset");
    }

    /// The peer closed first; a later write draws its `RST` (`EPIPE` on
    /// the next write): still a clean close.
    #[tokio::test]
    async fn writes_after_a_clean_close_are_not_a_reset() {
        let (ours, peer) = pair().await;
        drop(peer);
        ours.readable().await.unwrap();
        let (mut rd, wr) = ours.into_split();
        let mut w = PeerWriter::new(wr);
        let first = w.send(&Frame::Revoke { seq: 1, addr: 0 }, "p").await;
        assert!(first.is_ok(), "{first:?}");
        // The peer's kernel answers that write with a reset.
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        let second = w.send(&Frame::Revoke { seq: 2, addr: 0 }, "p").await;
        assert!(second.is_err(), "{second:?}");
        let mut b = [0u8; 1];
        assert_eq!(rd.read(&mut b).await.unwrap(), 0);
        assert!(!w.was_reset(), "the FIN came first");
    }
}
