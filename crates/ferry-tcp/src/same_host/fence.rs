//! Holding memory a same-host target may still write.
//!
//! On the same-host path the target copies into this process's memory
//! itself (`process_vm_writev` for a CREAD). It checks that the initiator
//! still wants the copy right before making it, but nothing can make that
//! check and the copy one step: a target stopped between them (SIGSTOP, a
//! cgroup freeze, a debugger, swap) copies whenever it runs again. So an
//! operation of that kind that ends without the target's answer (its batch
//! expired, the connection failed or was dropped) does not release its
//! region guards. They go to a fence, which releases them only on proof
//! that the target will copy no more: the end of the target's side of the
//! connection. The target closes its socket only after its copies have
//! returned (they run on the thread that owns the socket), and a target
//! process that dies closes it too; this side shuts down its writing half
//! only (the target reads the end of the stream and stops), and the fence
//! reads on until the stream ends.
//!
//! A target that gives no such proof within the patience (`stall_timeout`)
//! leaves the guards marked with [`RegionGuard::hold_unproven`]:
//! `unregister` then fails with `RegionHeld` instead of waiting, the
//! memory is leaked rather than freed (`RegisteredBuffer`), and the fence
//! keeps waiting, so the region leaves the table once the target does end
//! the connection.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferry_core::__private::sync::lock;
use ferry_core::RegionGuard;

use crate::stream::Stream;
use ferry_tcp_proto::initiator::Fence;
use ferry_tcp_proto::time::Time;

/// Holds `guards` until the peer's side of `stream` has ended (see the
/// module's comment); after `patience` without that, marks them unproven
/// naming `peer`. Never blocks the caller: the wait runs on a thread of
/// its own.
pub(crate) fn hold_until_closed(
    stream: &Stream,
    guards: Vec<Arc<RegionGuard>>,
    patience: Duration,
    peer: &str,
) {
    let reason = format!(
        "the same-host peer {peer} may still copy into it: a transfer into it was given up, \
         and the peer has not closed its connection within {patience:?} (is its process \
         stopped?)"
    );
    let fd = match stream.as_fd().try_clone_to_owned() {
        Ok(fd) => fd,
        Err(e) => return keep_forever(guards, &format!("{reason}; cannot watch it: {e}")),
    };
    // Shared with the thread, so that the guards survive a failed spawn.
    let held = Arc::new(Mutex::new(guards));
    let (inner, why) = (Arc::clone(&held), reason.clone());
    let spawned = std::thread::Builder::new()
        .name("ferry-cma-fence".to_owned())
        .stack_size(64 * 1024)
        .spawn(move || {
            wait_for_end(&fd, patience, || {
                tracing::warn!(reason = %why, "holding memory a same-host peer may still write");
                for g in lock(&inner).iter() {
                    g.hold_unproven(why.clone());
                }
            });
            // Proven: the peer's side has ended.
            lock(&inner).clear();
        });
    if let Err(e) = spawned {
        let guards = std::mem::take(&mut *lock(&held));
        keep_forever(guards, &format!("{reason}; cannot watch it: {e}"));
    }
}

/// Marks `guards` unproven and never drops them: the regions stay
/// registered (and so unfreeable) for the life of the process.
fn keep_forever(guards: Vec<Arc<RegionGuard>>, reason: &str) {
    tracing::warn!(%reason, "leaking memory a same-host peer may still write");
    for g in &guards {
        g.hold_unproven(reason.to_owned());
    }
    std::mem::forget(guards);
}

/// Reads `fd` (discarding what arrives) until the stream ends or fails;
/// calls `late` once if that takes longer than `patience` (the core's
/// [`Fence`] decides both).
fn wait_for_end(fd: &OwnedFd, patience: Duration, late: impl FnOnce()) {
    let mut fence = Fence::new(crate::io::now(), patience);
    let mut late = Some(late);
    let mut scratch = [0u8; 4096];
    loop {
        let timeout = match fence.poll_timeout() {
            Some(until) => {
                let left = crate::io::now().until(until);
                // Rounded up: never report late before the patience is over.
                left.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32
            }
            None => -1,
        };
        let mut p = libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        let n = unsafe { libc::poll(&mut p, 1, timeout) };
        if n < 0 {
            if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            // Cannot watch: treated as no proof, forever.
            if fence.on_timeout(Time::NEVER) {
                if let Some(f) = late.take() {
                    f();
                }
            }
            std::thread::sleep(Duration::from_secs(1));
            continue;
        }
        if n == 0 {
            if fence.on_timeout(crate::io::now()) {
                if let Some(f) = late.take() {
                    f();
                }
            }
            continue;
        }
        // SAFETY: `scratch` is valid for writes of its length; the socket
        // is non-blocking (its file description is shared with the
        // connection's registered stream).
        let r = unsafe {
            libc::recv(
                fd.as_raw_fd(),
                scratch.as_mut_ptr().cast(),
                scratch.len(),
                libc::MSG_DONTWAIT,
            )
        };
        let ended = match r {
            0 => true,
            n if n > 0 => false,
            _ => !matches!(
                std::io::Error::last_os_error().kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
            ),
        };
        // The stream's end, a reset, or any other failure of the stream:
        // the peer's side is gone.
        if ended {
            fence.on_peer_end();
            return;
        }
    }
}
