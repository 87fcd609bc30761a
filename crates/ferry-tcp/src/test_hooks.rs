//! Fault-injection points for the crate's own tests (feature `test-hooks`,
//! which only this crate's dev-dependency on itself turns on). Each acts
//! only in a process whose environment names it, so a test can make a
//! child process misbehave at an exact point of the protocol.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

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

/// `FERRY_TCP_TEST_PAUSE_BEFORE_LETTING_GO=1` (read once per process): a
/// writer of queued small calls pauses 2 ms between its last look at the
/// queue and letting go of the write lock, the window in which a caller
/// that found the lock taken queues its call and leaves it to the holder
/// (`client::send::write_queued`).
pub(crate) fn before_letting_go() {
    static ON: OnceLock<bool> = OnceLock::new();
    if *ON.get_or_init(|| std::env::var_os("FERRY_TCP_TEST_PAUSE_BEFORE_LETTING_GO").is_some()) {
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
}
