//! # ferry-tcp-proto
//!
//! The sans-IO core of Ferry's TCP protocol (see `PROTOCOL.md` in
//! ferry-tcp): what the two sides of a connection say to each other and
//! decide, apart from how the bytes travel. ferry-tcp is its driver: it
//! owns the sockets, the tasks, the clocks and the system calls, and
//! re-exports these modules under their old paths (`crate::frame`,
//! `crate::negotiate`, …).
//!
//! No tokio, no libc, no clock reads, no `/proc`: time, randomness and
//! what the system says (boot id, PID namespace, errno values as raw
//! `i32`) come in as arguments. Everything here is pure and never panics
//! on peer bytes.
//!
//! It grows step by step (issue 42: the protocol as state machines driven
//! by events, checked by deterministic simulation). Today it holds:
//!
//! - [`batch`]: the initiator's batch: planning into frames, each
//!   request's answers, the deadline, the stale retry, the notification
//!   after the data;
//! - [`foreign`]: peers that are not Ferry, recognised from their first
//!   bytes, and the answer in Mooncake's framing;
//! - [`frame`]: the wire format, every frame's encoder and decoder;
//! - [`handshake`]: the handshake of both sides as state machines
//!   (hellos, extension blocks, the TLS decision, the proofs, the
//!   welcome's table, rejections), the driver doing the reads, writes and
//!   TLS;
//! - [`negotiate`]: versions, features and the extension blocks of the
//!   handshake, and the same-host token;
//! - [`offer`]: the same-host offer and the target's refusal codes;
//! - [`layout`]: the byte layout of the same-host staging area and of its
//!   grants page, and the verdict slot of a staged read;
//! - [`initiator`]: the initiator's side of a connection: operations in
//!   flight by id, the checks of every answer, the send window;
//! - [`grants`]: the target's same-host grants as bookkeeping, and the
//!   order in which a region leaves (grant, marks, table, generation);
//! - [`time`]: points on the driver's clock and the pace a peer must keep
//!   (deadlines computed from a `now` passed in);
//! - [`recv`]: the receiving side of a connection without its reads: the
//!   next header, the bytes read past it, the frame's deadline;
//! - [`target`]: the target's side of a connection for the requests
//!   served on the socket: region checks, what to read or send, the
//!   answers owed;
//! - [`record`]: TLS 1.3 records after the handshake: header limits,
//!   nonces, content types, key updates, where each record's ciphertext
//!   lands, how plaintext is cut into records (the AEAD comes in).
//!
//! The per-frame encoders and decoders and the small lookups are
//! `#[inline]`: inside ferry-tcp the optimiser could inline them into the
//! driver (local ThinLTO); across a crate boundary only `#[inline]` (or a
//! small leaf) allows it, and moving them must not add a call per frame.
#![forbid(unsafe_code)]

pub mod batch;
pub mod foreign;
pub mod frame;
pub mod grants;
pub mod handshake;
pub mod initiator;
pub mod layout;
pub mod negotiate;
pub mod offer;
pub mod record;
pub mod recv;
pub mod target;
pub mod time;
