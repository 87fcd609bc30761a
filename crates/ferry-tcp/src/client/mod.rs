//! The initiator side: peers, their connections, request pipelining and
//! batch driving.
//!
//! Callers write their frames themselves (header and payload from registered
//! memory in one `writev`), under a per-connection write lock. One reader
//! task per connection reads responses and completes requests; READ payloads
//! go from the socket straight into the destination region, which a
//! [`RegionGuard`] keeps registered until the request completes.
//!
//! - [`peer`]: an opened peer, its connection slots and control requests;
//! - [`connect`]: dialing, handshake and the same-host path negotiation;
//! - [`conn`]: one connection's operations in flight and their completion;
//! - [`reader`]: the reader task that completes them from responses;
//! - [`send`]: planned wire operations, their frames, and sending them;
//! - [`batch`]: running a batch (validation, planning, retry, notification)
//!   through its [`ferry_core::raw::BatchDriver`];
//! - [`wire_ops`]: per-request wire-operation counting for one pass.

mod batch;
mod conn;
mod connect;
mod peer;
mod reader;
mod send;
mod wire_ops;

pub use peer::Peer;
