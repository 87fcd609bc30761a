//! The same-host path: how two engines of one machine move payloads without
//! the socket, in one place. PROTOCOL.md §5 has the bytes; this is the
//! protocol's shape, its states and the invariants the code keeps.
//!
//! **Negotiation** (per connection, after the authenticated handshake;
//! [`cma`]). The initiator offers the path only to a peer that can be on
//! this host (a negotiating peer proves it with a keyed hash of boot id and
//! PID namespace; an older one must be on loopback or this connection's own
//! address). A target of this build first has the initiator prove who it
//! is to the kernel: its hello names an abstract Unix socket it opened for
//! this connection, with a token; the initiator connects to it and sends
//! the token before its offer ([`crate::negotiate::SAME_HOST_CRED`]). Its
//! SAME_HOST request carries boot id, PID namespace, PID, the address of a
//! probe word holding a fresh nonce, and optionally the number of its end
//! of a Unix socket pair (the control channel) and of a sealed memfd (the
//! staging area). The target checks boot id and namespace, then that the
//! PID is the process the kernel attests connected to the credential
//! socket (`SO_PEERCRED`), of its own uid or one the operator allows; only
//! then does it pin that process (`SO_PEERPIDFD`, else `pidfd_open` and a
//! re-check) and act on it: that it holds this very connection's socket
//! and that `process_vm_readv` of the probe returns the nonce (the kernel
//! grants it ptrace-level access); it takes the channel and the area with
//! `pidfd_getfd`, maps the area only if it is a tmpfs memfd of exactly its
//! size sealed against shrinking and growing, and answers SAME_HOST_OK
//! with a verdict for each. States: `offered → agreed` (the connection
//! moves to a thread of the target's own and, with the channel, onto the
//! Unix socket) or `offered → refused` (one answer for every reason, no
//! errno: the reason is logged by the target; the connection stays a
//! socket connection, and a second offer closes it).
//!
//! **Moving bytes.** Frames of 8 MiB and more: CWRITE / CREAD, one
//! cross-memory copy by the target (split over a helper thread) into or out
//! of the initiator's own registered memory ([`cma`]). Smaller frames:
//! SWRITE / SREAD through the staging area's two rings of slots, both
//! processes copying at once ([`stage`]); the target acknowledges staged
//! requests in the area's lane while the initiator's reader polls it, with
//! a WAKE frame once it sleeps (a Dekker pair, model-checked with loom).
//! With granted copies agreed (a page after the area's rings; [`grant`])
//! the initiator copies calls of up to 128 KiB itself, straight into (out
//! of) the target's registered memory, under grants the target publishes
//! per region and generation and revokes in `unregister`: no frame, no
//! round trip, no target on a CPU. The area needs both processes on a CPU
//! at once: calls longer than the rings stage while the CPUs are calm and
//! copy granted (without grants: take the kernel copy) while the kernel
//! reports CPU pressure; where it reports none, the streams' own waits and
//! measured rates decide ([`choice`]).
//!
//! **Invariants.**
//! - The target copies only into (out of) ranges it checked under their
//!   region guards, and into the initiator only at addresses the initiator
//!   named and holds registered.
//! - Every frame has one deadline from its first byte, `stall_timeout +
//!   bytes / min_rate`, on both sides; an initiator's batch deadline counts
//!   from before its first frame, staged bytes included.
//! - No byte of the initiator's memory changes after `unregister` returns:
//!   copies out of the area into it are made by the initiator under a gate
//!   that failing the connection closes; a CREAD that ends without the
//!   target's answer keeps its memory registered until the target has
//!   closed its side of the connection, which it does only after its
//!   copies returned ([`fence`]), else `unregister` fails with `RegionHeld`
//!   and the memory is leaked, never freed.
//! - No byte of the target's memory changes after its `unregister`
//!   returns: the grant is revoked first and `unregister` waits until no
//!   initiator's mark names it (a Dekker pair, model-checked with loom);
//!   a mark that stays past the stall timeout makes it fail with
//!   `RegionHeld`, the region still registered.
//! - Nothing a peer writes into the area can make the target fault or
//!   touch memory outside its checked ranges: slot addresses stay inside
//!   the mapping, counters are only compared.
//! - The target makes no system call on a process (no `process_vm_*`, no
//!   `pidfd_getfd`, no `/proc/PID/fd`) before the peer has proven it is
//!   that process (above), and tells a refused peer nothing about it.
//!
//! **Safety notes: PID reuse.** A copy of one range of at most one page
//! ([`cma::MEM_FILE_MAX`]) — most granted calls, and the small CWRITE /
//! CREAD segments — goes through the peer's `/proc/PID/mem`, opened once
//! per connection on the pinned process (proven: its pidfd names that PID
//! and is alive after the open). The file is bound to that process's
//! address space, not to its PID: once the process exits, or replaces its
//! image with `exec`, the kernel moves nothing through it, so such a copy
//! can never reach another process, at any time. The kernel writes
//! through it as a debugger does (`FOLL_FORCE`): a page the peer
//! registered but mapped read-only is written where `process_vm_writev`
//! would fail; register writable memory.
//!
//! Every other copy is made by PID (`process_vm_readv` /
//! `process_vm_writev` have no pidfd form). Each such copy — the target's
//! CWRITE / CREAD, every part of a split copy, every continuation after a
//! short count, the initiator's granted copy — first asks the peer's
//! pidfd (one non-blocking `epoll_wait(2)` on an epoll instance watching
//! it, or `poll(2)` of the pidfd where no epoll instance can be made;
//! never a cached verdict; [`cma::Remote`]) and is not made once it
//! reports the exit. What remains is the window between that question and
//! the system call: a
//! thread preempted (or stopped) there for as long as it takes the peer to
//! exit, be reaped, and its PID to be handed to another process — which
//! the kernel does only after every other free PID of the namespace was
//! given out (`pid_max` ≥ 32 768 by default) — would copy into or out of
//! that process. The copy then still needs the ptrace-level access the
//! copier has to it, and touches only the addresses the request named.
//! Without pidfds (Linux < 5.3) nothing is polled (and no mem file is
//! opened) and this window is the whole connection; the target refuses
//! the path without a pin.

pub(crate) mod choice;
pub(crate) mod cma;
pub(crate) mod fence;
pub(crate) mod grant;
pub(crate) mod stage;
