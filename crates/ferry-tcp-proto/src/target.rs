//! The target's side of a connection: for the requests served on the
//! socket (WRITE, READ, WRITEV, READV, NOTIFY, TABLE) and the same-host
//! ones (SAME_HOST, CWRITE / CREAD, SWRITE / SREAD), what each request
//! means for the region table, what the driver must read, send or copy
//! for it, and the answers it owes.
//!
//! The driver reads a header, decodes it ([`Request::decode`]), starts the
//! frame's deadline for [`frame_bytes`] and hands the request to
//! [`TargetConn::on_request`]. The core answers with a [`Step`]: read the
//! payload into these holds (skip those bytes), send these answer bytes
//! and then these holds, read a table or a notification into the core's
//! buffer and come back, or close. Payload bytes never pass through the
//! core: a [`Hold`](Regions::Hold) names registered memory the driver reads
//! into or sends from, and stays held until the driver drops it after the
//! step (the driver's `RegionGuard`).
//!
//! Invariants:
//! - a payload byte is written only into a range the region table granted
//!   for this request ([`Regions::acquire`] with the request's generation),
//!   or thrown away; a refused range is answered with its status, never
//!   partly written;
//! - answers go out in request order; acknowledgements are coalesced (at
//!   most [`MAX_ACKS`] per OKS) and flushed by the driver before it waits
//!   for input, or once [`TargetConn::wants_flush`] says so;
//! - a request that breaks the framing ([`Step::Close`]) is answered with
//!   `Malformed` after every answer before it, and ends the connection;
//! - a same-host copy ([`Step::Copy`], [`Step::Staged`]) names only
//!   ranges the region table granted for this request, with the
//!   initiator's own addresses; one SAME_HOST per connection, CWRITE /
//!   CREAD only once the path is agreed, SWRITE / SREAD only with a
//!   staging area (else `Malformed`);
//! - the memory the core keeps per connection is bounded: the answers
//!   until the next flush (at most [`MAX_ACKS`] ids, [`ACK_FLUSH_FRAMES`]
//!   bytes of other frames plus one), and one table or notification buffer
//!   ([`TargetConn::held_bytes`]).

use crate::frame::{
    decode_cma_segments, decode_segments, CmaSegment, Request, Response, Segment, Status,
    CMA_SEGMENT_LEN, HEADER_LEN, MAX_ACKS, MAX_NOTIFY_MESSAGE, MAX_NOTIFY_NAME, MAX_SEGMENTS,
    SEGMENT_LEN,
};
use crate::negotiate::{Agreement, ACK_LANE, CONTROL_CHANNEL, GRANTS, SAME_HOST, STAGING};
use crate::offer::{Refusal, OFFER_LEN};

/// Acknowledged payload bytes after which the answers are flushed.
pub const ACK_FLUSH_BYTES: u64 = 512 * 1024;
/// Bytes of queued answer frames (errors, same-host answers) after which
/// they are flushed.
pub const ACK_FLUSH_FRAMES: usize = 16 * 1024;

/// The region table as a connection's core sees it.
pub trait Regions {
    /// Registered memory held for one request (the driver's guard): it
    /// stays registered until dropped.
    type Hold;
    /// Holds `[addr, addr+len)` if it lies in one live region whose
    /// generation is `gen`; else the status to answer
    /// (`AddressNotRegistered`, `StaleRegion`).
    fn acquire(&mut self, addr: u64, len: u64, gen: u32) -> Result<Self::Hold, Status>;
}

/// The bytes of the frame that follow the header of `req` and are due by
/// one deadline (`None`: nothing follows).
#[inline]
pub fn frame_bytes(req: &Request) -> Option<u64> {
    let segs = |count: u32, each: usize| u64::from(count) * each as u64;
    match *req {
        Request::Write { len, .. } => Some(len),
        Request::Notify {
            name_len, msg_len, ..
        } => Some(name_len.saturating_add(msg_len)),
        Request::WriteV { count, total, .. } => {
            Some(segs(count, SEGMENT_LEN).saturating_add(total))
        }
        Request::ReadV { count, .. } => Some(segs(count, SEGMENT_LEN)),
        Request::SameHost { .. } => Some(OFFER_LEN as u64),
        Request::Cma { count, .. } => Some(segs(count, CMA_SEGMENT_LEN)),
        Request::Read { .. } | Request::Table { .. } => None,
    }
}

/// One part of a payload to read, in order.
#[derive(Debug)]
pub enum Part<H> {
    /// Read this many bytes into the hold.
    Into(H, u64),
    /// Read and throw away this many bytes (a refused range).
    Skip(u64),
}

/// What the driver does next for the request being served.
#[derive(Debug)]
pub enum Step<H> {
    /// Nothing more: the request is answered (or its answer queued).
    Done,
    /// Read `len` bytes into [`TargetConn::buf`] (a segment table or a
    /// notification; `ends_frame`: they end the frame, so the read may top
    /// up the next header), then call [`TargetConn::on_buf`].
    ReadBuf {
        /// Bytes to read.
        len: usize,
        /// Whether they end the frame.
        ends_frame: bool,
    },
    /// Read the payload into `parts`, in order; the last part ends the
    /// frame. `one_call`: every part is a hold and none overlaps another,
    /// so one vectored read may take them all. Then call
    /// [`TargetConn::received`], and drop the holds.
    Receive {
        /// The parts.
        parts: Vec<Part<H>>,
        /// See above.
        one_call: bool,
        /// Bytes and non-empty ranges that land (for the served counters).
        landed: (u64, u64),
    },
    /// Send `meta` (the answers queued before, then this request's answer
    /// header and tables), then the bytes of every hold in order; then
    /// drop the holds.
    Send {
        /// Answer bytes.
        meta: Vec<u8>,
        /// Registered memory sent after them, with its length.
        holds: Vec<(H, u64)>,
        /// Bytes and non-empty ranges sent (for the served counters).
        landed: (u64, u64),
    },
    /// Send `meta` (the answers queued before), then a TABLE_REPLY for
    /// `id` with the engine's region table.
    Table {
        /// Answer bytes queued before.
        meta: Vec<u8>,
        /// Request id.
        id: u64,
    },
    /// Framing is lost: flush the answers (the last is `Malformed`) and
    /// close the connection, with this reason in the local log.
    Close(String),
    /// A SAME_HOST offer the core has nothing against; its bytes are in
    /// [`TargetConn::buf`] (`OFFER_LEN`). The driver proves it against
    /// the system (PROTOCOL.md §5; whatever fails, the peer is told only
    /// "refused") and calls [`TargetConn::refused`], or takes the
    /// descriptors as `channel` and `stage` say (the area with its grants
    /// page if `grants`) and calls [`TargetConn::agreed`].
    Prove {
        /// Request id.
        id: u64,
        /// The control channel.
        channel: Take,
        /// The staging area.
        stage: Take,
        /// Whether the area carries the grants page.
        grants: bool,
    },
    /// CWRITE / CREAD: check that the initiator has not given up on the
    /// connection (else close it and copy nothing: it may reuse the memory
    /// it named), then copy each held range (see [`Copy`]); then
    /// [`TargetConn::copied`], drop the holds and flush the answers.
    Copy(Copy<H>),
    /// SWRITE / SREAD: move the held ranges through the staging area (an
    /// SREAD's verdict first, naming the refused segments); then
    /// [`TargetConn::staged`], drop the holds and flush the answers.
    Staged(Copy<H>),
}

/// Whether the driver takes a descriptor a SAME_HOST offer names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Take {
    /// None offered (answered as errno 0).
    NotOffered,
    /// Offered, but the handshake did not agree the feature (answered
    /// `EOPNOTSUPP`).
    NotAgreed,
    /// Take this descriptor of the initiator's.
    Fd(u32),
}

/// The copies of a same-host request, as instructions: the bytes never
/// pass through the core. Segment `i` is `segs[i]` (the target range, its
/// generation, and the initiator's address `local`: 0 when staged) and
/// `holds[i]` (the target range held, or the status it was refused with:
/// nothing of it is copied).
#[derive(Debug)]
pub struct Copy<H> {
    /// Request id.
    pub id: u64,
    /// A CREAD / SREAD: the target's ranges go to the initiator.
    pub read: bool,
    /// The segments.
    pub segs: Vec<CmaSegment>,
    /// Their holds.
    pub holds: Vec<Result<H, Status>>,
    /// Every segment is held and none overlaps another: one system call
    /// may copy them all.
    pub one_call: bool,
}

/// What a same-host request moved (for the served counters).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Moved {
    /// From the target to the initiator.
    pub read: bool,
    /// Bytes.
    pub bytes: u64,
    /// Non-empty ranges.
    pub ranges: u64,
}

/// What a connection may agree for the same-host path, from the engine's
/// setting and the handshake.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SameHostTerms {
    /// The engine has the path on (`same_host` is not `off`).
    pub on: bool,
    /// The peer announced the path (feature SAME_HOST).
    pub announced: bool,
    /// The connection can carry an offer (TCP: its peer proves its process
    /// through the credential socket); else an offer is `Malformed`.
    pub provable: bool,
    /// Both agreed the control channel.
    pub channel: bool,
    /// Both agreed the staging area and its acknowledgement lane.
    pub staging: bool,
    /// Both agreed the grants page too.
    pub grants: bool,
}

impl SameHostTerms {
    /// The terms of a connection whose handshake settled `agreed`.
    pub fn new(on: bool, agreed: &Agreement, provable: bool) -> SameHostTerms {
        let staging = agreed.both(STAGING) && agreed.both(ACK_LANE);
        SameHostTerms {
            on,
            announced: agreed.theirs.enabled(SAME_HOST),
            provable,
            channel: agreed.both(CONTROL_CHANNEL),
            staging,
            grants: staging && agreed.both(GRANTS),
        }
    }
}

/// The same-host path of a connection as its core has it (PROTOCOL.md
/// §3.1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SameHost {
    /// No offer yet: CWRITE / CREAD are `Malformed`.
    Unoffered,
    /// An offer being proven by the driver.
    Proving,
    /// The offer was refused (a second one is `Malformed`).
    Refused,
    /// Agreed, with a staging area or not.
    Agreed {
        /// SWRITE / SREAD allowed.
        staging: bool,
    },
}

/// What the engine made of a delivered notification.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Delivered {
    /// Queued for the application.
    Queued,
    /// Not a valid notification (names and lengths the engine refuses).
    Invalid,
    /// The queue is full, or the engine refuses notifications now.
    Full,
}

/// What the core waits for from the driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Awaiting {
    Nothing,
    /// The segment table of a WRITEV or READV.
    Segments {
        id: u64,
        total: u64,
        read: bool,
    },
    /// The bytes of a NOTIFY.
    Notify {
        id: u64,
        name_len: u64,
        msg_len: u64,
    },
    /// The payload of a WRITE or WRITEV.
    Payload {
        id: u64,
        bytes: u64,
        failed: Option<Status>,
    },
    /// The offer of a SAME_HOST.
    Offer {
        id: u64,
        channel: Option<u32>,
        stage: Option<u32>,
    },
    /// The segment table of a CWRITE / CREAD / SWRITE / SREAD.
    CmaTable {
        id: u64,
        read: bool,
        staged: bool,
        total: u64,
        len: usize,
    },
    /// The copies of a same-host request; `failed`: the status of its
    /// refused segments, if any (their indices in `TargetConn::failed`).
    Copied {
        id: u64,
        read: bool,
        total: u64,
        failed: Option<Status>,
    },
}

/// See the module.
#[derive(Debug)]
pub struct TargetConn {
    acks: Vec<u64>,
    frames: Vec<u8>,
    /// Payload bytes covered by the pending acknowledgements.
    bytes: u64,
    buf: Vec<u8>,
    awaiting: Awaiting,
    /// The indices of the failed segments of the WRITEV being received
    /// (or of the same-host request being copied).
    failed: Vec<u32>,
    terms: SameHostTerms,
    same_host: SameHost,
}

impl Default for TargetConn {
    fn default() -> Self {
        TargetConn::new()
    }
}

impl TargetConn {
    /// A connection with nothing owed.
    pub fn new() -> TargetConn {
        TargetConn {
            acks: Vec::with_capacity(MAX_ACKS as usize),
            frames: Vec::new(),
            bytes: 0,
            buf: Vec::new(),
            awaiting: Awaiting::Nothing,
            failed: Vec::new(),
            terms: SameHostTerms::default(),
            same_host: SameHost::Unoffered,
        }
    }

    /// A connection with nothing owed, whose same-host offer is judged by
    /// `terms` (without them the path is off: an offer is refused).
    pub fn with_same_host(terms: SameHostTerms) -> TargetConn {
        TargetConn {
            terms,
            ..TargetConn::new()
        }
    }

    /// The same-host path of the connection.
    #[inline]
    pub fn same_host(&self) -> SameHost {
        self.same_host
    }

    /// Whether answers are queued.
    #[inline]
    pub fn has_answers(&self) -> bool {
        !self.acks.is_empty() || !self.frames.is_empty()
    }

    /// Whether the queued answers should go out now, without waiting for
    /// the next pause in the input.
    #[inline]
    pub fn wants_flush(&self) -> bool {
        self.acks.len() >= MAX_ACKS as usize
            || self.bytes >= ACK_FLUSH_BYTES
            || self.frames.len() >= ACK_FLUSH_FRAMES
    }

    /// The queued answers, encoded (acknowledgements first, as one OK or
    /// OKS, then the other frames), and nothing queued after.
    pub fn take_answers(&mut self) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEADER_LEN + self.acks.len() * 8 + self.frames.len());
        match self.acks.len() {
            0 => {}
            1 => out.extend_from_slice(&Response::Ok { id: self.acks[0] }.encode()),
            n => {
                out.extend_from_slice(&Response::OkMany { count: n as u32 }.encode());
                for id in &self.acks {
                    out.extend_from_slice(&id.to_le_bytes());
                }
            }
        }
        out.extend_from_slice(&self.frames);
        self.acks.clear();
        self.frames.clear();
        self.bytes = 0;
        out
    }

    /// Queues the acknowledgement of `id`, which moved `bytes` payload
    /// bytes.
    #[inline]
    pub fn ack(&mut self, id: u64, bytes: u64) {
        self.acks.push(id);
        self.bytes = self.bytes.saturating_add(bytes);
    }

    /// Counts `bytes` payload bytes toward the next flush (a request whose
    /// answer is an error frame moved them too).
    #[inline]
    pub fn count_bytes(&mut self, bytes: u64) {
        self.bytes = self.bytes.saturating_add(bytes);
    }

    /// Queues an ERR for `id`.
    pub fn err(&mut self, id: u64, status: Status, addr: u64, len: u64) {
        self.frame(
            &Response::Err {
                id,
                status,
                addr,
                len,
            }
            .encode(),
        );
    }

    /// Queues an ERRV for `id`: the segments `failed` (by index) failed
    /// with `status`.
    pub fn errv(&mut self, id: u64, status: Status, failed: &[u32]) {
        self.frame(
            &Response::ErrV {
                id,
                status,
                count: failed.len() as u32,
            }
            .encode(),
        );
        for i in failed {
            self.frames.extend_from_slice(&i.to_le_bytes());
        }
    }

    /// Queues an encoded answer frame.
    #[inline]
    pub fn frame(&mut self, bytes: &[u8]) {
        self.frames.extend_from_slice(bytes);
    }

    /// Framing is lost at request `id`: `Malformed` is queued after every
    /// answer before it, and the connection ends.
    pub fn malformed<H>(&mut self, id: u64, reason: impl Into<String>) -> Step<H> {
        self.awaiting = Awaiting::Nothing;
        self.err(id, Status::Malformed, 0, 0);
        Step::Close(reason.into())
    }

    /// The buffer a [`Step::ReadBuf`] reads into.
    #[inline]
    pub fn buf(&mut self) -> &mut [u8] {
        &mut self.buf
    }

    /// Bytes this core holds for the connection (answers not yet sent and
    /// its buffers), for the bound in the module's invariants.
    pub fn held_bytes(&self) -> usize {
        self.acks.capacity() * 8
            + self.frames.capacity()
            + self.buf.capacity()
            + self.failed.capacity() * 4
    }

    fn read_buf<H>(&mut self, len: usize, ends_frame: bool, then: Awaiting) -> Step<H> {
        self.buf.clear();
        self.buf.resize(len, 0);
        self.awaiting = then;
        Step::ReadBuf { len, ends_frame }
    }

    /// Serves the request whose header was just read.
    pub fn on_request<R: Regions>(&mut self, req: Request, regions: &mut R) -> Step<R::Hold> {
        self.awaiting = Awaiting::Nothing;
        match req {
            Request::Write { id, addr, len, gen } => match regions.acquire(addr, len, gen) {
                Ok(hold) => {
                    self.awaiting = Awaiting::Payload {
                        id,
                        bytes: len,
                        failed: None,
                    };
                    self.failed.clear();
                    Step::Receive {
                        parts: vec![Part::Into(hold, len)],
                        one_call: true,
                        landed: (len, 1),
                    }
                }
                Err(status) => {
                    self.err(id, status, addr, len);
                    Step::Receive {
                        parts: vec![Part::Skip(len)],
                        one_call: false,
                        landed: (0, 0),
                    }
                }
            },
            Request::Read { id, addr, len, gen } => match regions.acquire(addr, len, gen) {
                Ok(hold) => {
                    let mut meta = self.take_answers();
                    meta.extend_from_slice(&Response::Data { id, len }.encode());
                    Step::Send {
                        meta,
                        holds: vec![(hold, len)],
                        landed: (len, 1),
                    }
                }
                Err(status) => {
                    self.err(id, status, addr, len);
                    Step::Done
                }
            },
            Request::Notify {
                id,
                name_len,
                msg_len,
            } => {
                // The decoder bounds both; checked again: a buffer is
                // allocated for them.
                if name_len > MAX_NOTIFY_NAME || msg_len > MAX_NOTIFY_MESSAGE {
                    return self.malformed(id, "NOTIFY longer than the protocol allows");
                }
                let len = (name_len + msg_len) as usize;
                self.read_buf(
                    len,
                    true,
                    Awaiting::Notify {
                        id,
                        name_len,
                        msg_len,
                    },
                )
            }
            Request::WriteV { id, count, .. } | Request::ReadV { id, count, .. }
                if count > MAX_SEGMENTS =>
            {
                self.malformed(id, "more segments than the protocol allows")
            }
            Request::WriteV { id, count, total } => self.read_buf(
                count as usize * SEGMENT_LEN,
                false,
                Awaiting::Segments {
                    id,
                    total,
                    read: false,
                },
            ),
            Request::ReadV { id, count, total } => self.read_buf(
                count as usize * SEGMENT_LEN,
                true,
                Awaiting::Segments {
                    id,
                    total,
                    read: true,
                },
            ),
            Request::Table { id } => Step::Table {
                meta: self.take_answers(),
                id,
            },
            Request::SameHost { id, channel, stage } => {
                self.read_buf(OFFER_LEN, true, Awaiting::Offer { id, channel, stage })
            }
            Request::Cma { id, count, .. } if count > MAX_SEGMENTS => {
                self.malformed(id, "more segments than the protocol allows")
            }
            Request::Cma {
                id,
                read,
                staged,
                count,
                total,
            } => {
                // The buffer only grows: no table zeroed per request.
                let len = count as usize * CMA_SEGMENT_LEN;
                if self.buf.len() < len {
                    self.buf.resize(len, 0);
                }
                self.awaiting = Awaiting::CmaTable {
                    id,
                    read,
                    staged,
                    total,
                    len,
                };
                Step::ReadBuf {
                    len,
                    ends_frame: true,
                }
            }
        }
    }

    /// Decides a SAME_HOST offer whose bytes are in the buffer.
    fn on_offer<H>(&mut self, id: u64, channel: Option<u32>, stage: Option<u32>) -> Step<H> {
        if self.same_host != SameHost::Unoffered {
            return self.malformed(id, "a second SAME_HOST offer on one connection");
        }
        self.same_host = SameHost::Proving;
        let t = self.terms;
        if !t.on {
            self.refused(id, Refusal::Disabled);
            return Step::Done;
        }
        if !t.announced {
            return self.malformed(id, "SAME_HOST from a peer that did not announce it");
        }
        if !t.provable {
            return self.malformed(id, "SAME_HOST on a connection that has agreed it");
        }
        let take = |fd: Option<u32>, agreed: bool| match fd {
            None => Take::NotOffered,
            Some(_) if !agreed => Take::NotAgreed,
            Some(fd) => Take::Fd(fd),
        };
        Step::Prove {
            id,
            channel: take(channel, t.channel),
            stage: take(stage, t.staging),
            grants: t.grants,
        }
    }

    /// The offer of [`Step::Prove`] was refused (`why`: the code the peer
    /// is told, no errno).
    pub fn refused(&mut self, id: u64, why: Refusal) {
        self.same_host = SameHost::Refused;
        self.err(id, Status::SameHostRefused, why as u64, 0);
    }

    /// The offer of [`Step::Prove`] was proven: the path is agreed, with
    /// the control channel and the staging area taken or not (the errno
    /// the peer is told). SAME_HOST_OK is queued; a channel taken carries
    /// the rest of the connection, after the answer is flushed.
    pub fn agreed(&mut self, id: u64, channel: Result<(), u32>, stage: Result<(), u32>) {
        self.same_host = SameHost::Agreed {
            staging: stage.is_ok(),
        };
        self.frame(&Response::SameHostOk { id, channel, stage }.encode());
    }

    /// Decides a same-host request whose segment table is in the buffer.
    fn on_cma_table<R: Regions>(
        &mut self,
        regions: &mut R,
        (id, read, staged, total, len): (u64, bool, bool, u64, usize),
    ) -> Step<R::Hold> {
        let staging = match self.same_host {
            SameHost::Agreed { staging } => staging,
            _ => return self.malformed(id, "CWRITE/CREAD without an agreed same-host path"),
        };
        let segs = match decode_cma_segments(&self.buf[..len], total) {
            Ok(s) => s,
            Err(e) => return self.malformed(id, e.0),
        };
        if staged && !staging {
            return self.malformed(id, "SWRITE/SREAD without a staging area");
        }
        let holds: Vec<Result<R::Hold, Status>> = segs
            .iter()
            .map(|s| regions.acquire(s.seg.addr, s.seg.len, s.seg.gen))
            .collect();
        self.failed.clear();
        self.failed.extend(
            holds
                .iter()
                .enumerate()
                .filter(|(_, h)| h.is_err())
                .map(|(i, _)| i as u32),
        );
        let failed = (!self.failed.is_empty()).then(|| failed_status(&holds));
        let one_call = failed.is_none() && !overlapping_ranges(segs.iter().map(|s| &s.seg));
        self.awaiting = Awaiting::Copied {
            id,
            read,
            total,
            failed,
        };
        let copy = Copy {
            id,
            read,
            segs,
            holds,
            one_call,
        };
        if staged {
            Step::Staged(copy)
        } else {
            Step::Copy(copy)
        }
    }

    /// The same-host request whose copies the driver was executing (its
    /// id, direction, payload bytes and the status of its refused
    /// segments); `None` if none was. Either way nothing is awaited after.
    fn take_copied(&mut self) -> Option<(u64, bool, u64, Option<Status>)> {
        match std::mem::replace(&mut self.awaiting, Awaiting::Nothing) {
            Awaiting::Copied {
                id,
                read,
                total,
                failed,
            } => Some((id, read, total, failed)),
            _ => None,
        }
    }

    /// The copies of a [`Step::Copy`] are done; those of the segments
    /// `copy_failed` (indices, in order) failed. The answer is queued: OK,
    /// or ERRV naming every segment not copied (`StaleRegion` if one was
    /// stale, else `AddressNotRegistered` if one was outside the regions,
    /// else `CopyFailed`).
    pub fn copied(&mut self, segs: &[CmaSegment], copy_failed: &[u32]) -> Moved {
        let Some((id, read, total, failed)) = self.take_copied() else {
            return Moved {
                read: false,
                bytes: 0,
                ranges: 0,
            };
        };
        if failed.is_none() && copy_failed.is_empty() {
            self.ack(id, total);
            let (bytes, ranges) = landed_cma(segs, |_| true);
            return Moved {
                read,
                bytes,
                ranges,
            };
        }
        let mut all: Vec<u32> = self.failed.iter().chain(copy_failed).copied().collect();
        all.sort_unstable();
        all.dedup();
        let status = failed.unwrap_or(Status::CopyFailed);
        let (bytes, ranges) = landed_cma(segs, |i| all.binary_search(&(i as u32)).is_err());
        self.errv(id, status, &all);
        self.count_bytes(total);
        Moved {
            read,
            bytes,
            ranges,
        }
    }

    /// The streams of a [`Step::Staged`] have moved (the target emptied or
    /// the initiator drained every slot). Its answer is queued: ERRV for
    /// refused segments (always on the socket), else the acknowledgement
    /// `post` puts in the area's lane (`Some(true)`: the initiator's reader
    /// polls it; `Some(false)`: it sleeps, a WAKE is queued; `None`: the
    /// lane is full, an OK is queued).
    pub fn staged(&mut self, segs: &[CmaSegment], post: impl FnOnce(u64) -> Option<bool>) -> Moved {
        let Some((id, read, total, failed)) = self.take_copied() else {
            return Moved {
                read: false,
                bytes: 0,
                ranges: 0,
            };
        };
        let (bytes, ranges) = match failed {
            None => {
                match post(id) {
                    Some(true) => {}
                    Some(false) => self.frame(&Response::Wake.encode()),
                    None => self.ack(id, 0),
                }
                landed_cma(segs, |_| true)
            }
            Some(status) => {
                let failed = std::mem::take(&mut self.failed);
                self.errv(id, status, &failed);
                let moved = landed_cma(segs, |i| failed.binary_search(&(i as u32)).is_err());
                self.failed = failed;
                moved
            }
        };
        self.count_bytes(total);
        Moved {
            read,
            bytes,
            ranges,
        }
    }

    /// The bytes of a [`Step::ReadBuf`] are in [`TargetConn::buf`]:
    /// `deliver` takes a notification's name and message (valid UTF-8).
    pub fn on_buf<R: Regions>(
        &mut self,
        regions: &mut R,
        deliver: impl FnOnce(&str, &str) -> Delivered,
    ) -> Step<R::Hold> {
        match std::mem::replace(&mut self.awaiting, Awaiting::Nothing) {
            Awaiting::Notify {
                id,
                name_len,
                msg_len,
            } => {
                let (name, msg) = self.buf.split_at(name_len as usize);
                let verdict = match (std::str::from_utf8(name), std::str::from_utf8(msg)) {
                    (Ok(name), Ok(msg)) => deliver(name, msg),
                    _ => Delivered::Invalid,
                };
                // The notification buffer is not kept (up to 64 KiB).
                self.buf = Vec::new();
                match verdict {
                    Delivered::Queued => self.ack(id, 0),
                    Delivered::Invalid => self.err(id, Status::NotifyInvalid, name_len, msg_len),
                    Delivered::Full => self.err(id, Status::NotifyQueueFull, name_len, msg_len),
                }
                Step::Done
            }
            Awaiting::Segments { id, total, read } => {
                let segs = match decode_segments(&self.buf, total) {
                    Ok(s) => s,
                    Err(e) => return self.malformed(id, e.0),
                };
                let holds: Vec<Result<R::Hold, Status>> = segs
                    .iter()
                    .map(|s| regions.acquire(s.addr, s.len, s.gen))
                    .collect();
                let status = failed_status(&holds);
                self.failed.clear();
                self.failed.extend(
                    holds
                        .iter()
                        .enumerate()
                        .filter(|(_, h)| h.is_err())
                        .map(|(i, _)| i as u32),
                );
                let landed = landed(&segs, |i| holds[i].is_ok());
                if read {
                    let mut meta = self.take_answers();
                    let ok: u64 = segs
                        .iter()
                        .zip(&holds)
                        .filter(|(_, h)| h.is_ok())
                        .map(|(s, _)| s.len)
                        .sum();
                    meta.extend_from_slice(
                        &Response::DataV {
                            id,
                            status: (!self.failed.is_empty()).then_some(status),
                            failed: self.failed.len() as u32,
                            len: ok,
                        }
                        .encode(),
                    );
                    for i in &self.failed {
                        meta.extend_from_slice(&i.to_le_bytes());
                    }
                    let holds = holds
                        .into_iter()
                        .zip(&segs)
                        .filter_map(|(h, s)| h.ok().map(|h| (h, s.len)))
                        .collect();
                    return Step::Send {
                        meta,
                        holds,
                        landed,
                    };
                }
                let one_call = self.failed.is_empty() && !overlapping(&segs);
                let parts = holds
                    .into_iter()
                    .zip(&segs)
                    .map(|(h, s)| match h {
                        Ok(h) => Part::Into(h, s.len),
                        Err(_) => Part::Skip(s.len),
                    })
                    .collect();
                self.awaiting = Awaiting::Payload {
                    id,
                    bytes: total,
                    failed: (!self.failed.is_empty()).then_some(status),
                };
                Step::Receive {
                    parts,
                    one_call,
                    landed,
                }
            }
            Awaiting::Offer { id, channel, stage } => self.on_offer(id, channel, stage),
            Awaiting::CmaTable {
                id,
                read,
                staged,
                total,
                len,
            } => self.on_cma_table(regions, (id, read, staged, total, len)),
            other => {
                self.awaiting = other;
                Step::Close("a table read the core did not ask for".into())
            }
        }
    }

    /// The payload of a [`Step::Receive`] has been read: its answer is
    /// queued (a refused WRITE was answered already).
    pub fn received(&mut self) {
        match std::mem::replace(&mut self.awaiting, Awaiting::Nothing) {
            Awaiting::Payload {
                id,
                bytes,
                failed: None,
            } => self.ack(id, bytes),
            Awaiting::Payload {
                id,
                bytes,
                failed: Some(status),
            } => {
                let failed = std::mem::take(&mut self.failed);
                self.errv(id, status, &failed);
                self.failed = failed;
                self.count_bytes(bytes);
            }
            other => self.awaiting = other,
        }
    }
}

/// The status a request with refused segments is answered with:
/// `StaleRegion` if any was stale (the initiator refreshes its table and
/// retries), else `AddressNotRegistered`.
pub fn failed_status<H>(holds: &[Result<H, Status>]) -> Status {
    if holds.iter().any(|g| matches!(g, Err(Status::StaleRegion))) {
        Status::StaleRegion
    } else {
        Status::AddressNotRegistered
    }
}

/// The bytes and the number of the non-empty segments `ok` accepts (by
/// index): what a served request moved.
pub fn landed(segs: &[Segment], ok: impl Fn(usize) -> bool) -> (u64, u64) {
    segs.iter()
        .enumerate()
        .filter(|&(i, s)| s.len > 0 && ok(i))
        .fold((0, 0), |(b, n), (_, s)| (b.saturating_add(s.len), n + 1))
}

/// [`landed`] for same-host segments.
fn landed_cma(segs: &[CmaSegment], ok: impl Fn(usize) -> bool) -> (u64, u64) {
    segs.iter()
        .enumerate()
        .filter(|&(i, s)| s.seg.len > 0 && ok(i))
        .fold((0, 0), |(b, n), (_, s)| {
            (b.saturating_add(s.seg.len), n + 1)
        })
}

/// Whether any two segments share a byte.
pub fn overlapping(segs: &[Segment]) -> bool {
    overlapping_ranges(segs.iter())
}

/// Whether any two segments share a byte (one segment allocates nothing).
fn overlapping_ranges<'a>(segs: impl ExactSizeIterator<Item = &'a Segment>) -> bool {
    if segs.len() < 2 {
        return false;
    }
    let mut sorted: Vec<(u64, u64)> = segs.map(|s| (s.addr, s.len)).collect();
    sorted.sort_unstable();
    sorted
        .windows(2)
        .any(|w| w[0].0.saturating_add(w[0].1) > w[1].0)
}
