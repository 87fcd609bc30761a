//! Fault-injection points for the crate's own tests (feature `test-hooks`,
//! which only this crate's dev-dependency on itself turns on). Each acts
//! only in a process whose environment names it, so a test can make a
//! child process misbehave at an exact point of the protocol.

use std::sync::atomic::{AtomicBool, Ordering};

/// `FERRY_TCP_TEST_STOP_BEFORE_CREAD=1`: the target stops its own process
/// (SIGSTOP) once, on its first CREAD, after it has checked that the
/// initiator still wants the copy and before it copies — the window no
/// check can close (see `client::fence`).
pub(crate) fn between_check_and_copy(read: bool) {
    static FIRED: AtomicBool = AtomicBool::new(false);
    if read
        && std::env::var_os("FERRY_TCP_TEST_STOP_BEFORE_CREAD").is_some()
        && !FIRED.swap(true, Ordering::Relaxed)
    {
        // SAFETY: raise(3) has no preconditions; SIGSTOP stops this
        // process until a SIGCONT.
        unsafe { libc::raise(libc::SIGSTOP) };
    }
}

/// `FERRY_TCP_TEST_STOP_AFTER_MARK=1`: the initiator stops its own
/// process (SIGSTOP) once, on its first granted copy, after it has marked
/// the copy and found the grant valid and before it copies — the window
/// in which the target's `unregister` must wait for it (see
/// `same_host::grant`).
pub(crate) fn between_mark_and_copy() {
    static FIRED: AtomicBool = AtomicBool::new(false);
    if std::env::var_os("FERRY_TCP_TEST_STOP_AFTER_MARK").is_some()
        && !FIRED.swap(true, Ordering::Relaxed)
    {
        // SAFETY: raise(3) has no preconditions; SIGSTOP stops this
        // process until a SIGCONT.
        unsafe { libc::raise(libc::SIGSTOP) };
    }
}
