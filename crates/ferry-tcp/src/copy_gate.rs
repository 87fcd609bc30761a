//! The gate of a segment handle's copies on the calling thread (granted
//! same-host copies: `transfer`'s first try and the fast path).
//!
//! Invariant: no copy admitted by [`CopyGate::enter`] is still running
//! when [`CopyGate::close`] returns, and none is admitted after it.
//!
//! One word holds the count of copies running (times two) and the closed
//! flag (bit 0). A copy enters with one read-modify-write (add 2) and
//! looks at the flag in the value it replaced; `close` sets the flag with
//! one read-modify-write and then waits for the count to reach zero. All
//! of them are SeqCst, and read-modify-writes of one word are totally
//! ordered: either the copy's add comes first (then `close` counts it and
//! waits for it) or the flag's set does (then the copy sees the flag and
//! backs out). The loom model below checks it. A tokio `RwLock` did the
//! same through a semaphore whose release takes a mutex: a few tens of
//! nanoseconds on every 4 KiB call.

#[cfg(ferry_loom)]
use loom::sync::atomic::AtomicUsize;
#[cfg(not(ferry_loom))]
use std::sync::atomic::AtomicUsize;
use std::sync::atomic::Ordering::SeqCst;

const CLOSED: usize = 1;
const ONE: usize = 2;

/// See the [module](self).
#[derive(Debug)]
pub(crate) struct CopyGate(AtomicUsize);

/// One admitted copy; dropping it ends the copy.
#[must_use = "the copy is admitted only while the pass lives"]
pub(crate) struct CopyPass<'a>(&'a CopyGate);

impl CopyGate {
    pub(crate) fn new() -> CopyGate {
        CopyGate(AtomicUsize::new(0))
    }

    /// Admits one copy, or `None` once [`CopyGate::close`] began.
    pub(crate) fn enter(&self) -> Option<CopyPass<'_>> {
        if self.0.fetch_add(ONE, SeqCst) & CLOSED != 0 {
            self.0.fetch_sub(ONE, SeqCst);
            return None;
        }
        Some(CopyPass(self))
    }

    /// Admits no copy from now on and returns once none is running. A
    /// copy here is at most 128 KiB (a few microseconds), so this yields
    /// the thread rather than sleeping; it never awaits, so a caller's
    /// future dropped around it cannot leave the gate half closed.
    pub(crate) fn close(&self) {
        self.0.fetch_or(CLOSED, SeqCst);
        while self.0.load(SeqCst) >= ONE {
            #[cfg(ferry_loom)]
            loom::thread::yield_now();
            #[cfg(not(ferry_loom))]
            std::thread::yield_now();
        }
    }
}

impl Drop for CopyPass<'_> {
    fn drop(&mut self) {
        self.0 .0.fetch_sub(ONE, SeqCst);
    }
}

#[cfg(all(test, not(ferry_loom)))]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, AtomicU64};
    use std::sync::Arc;

    #[test]
    fn closed_admits_nothing_and_a_refused_entry_leaves_no_count() {
        let g = CopyGate::new();
        let p = g.enter().expect("open admits");
        drop(p);
        g.close();
        assert!(g.enter().is_none());
        assert!(g.enter().is_none());
        // Refused entries took their count back: a second close returns.
        g.close();
    }

    /// Threads copying in a loop while another closes: after `close`
    /// returns, no copy runs (the "memory" is not written again).
    #[test]
    fn no_copy_runs_after_close_returns() {
        for _ in 0..50 {
            let g = Arc::new(CopyGate::new());
            let memory = Arc::new(AtomicU64::new(0));
            let closed = Arc::new(AtomicBool::new(false));
            let copiers: Vec<_> = (0..3)
                .map(|_| {
                    let (g, memory, closed) = (g.clone(), memory.clone(), closed.clone());
                    std::thread::spawn(move || {
                        for _ in 0..2000 {
                            if let Some(_pass) = g.enter() {
                                assert!(!closed.load(SeqCst), "a copy after close returned");
                                memory.fetch_add(1, SeqCst);
                            }
                        }
                    })
                })
                .collect();
            std::thread::yield_now();
            g.close();
            closed.store(true, SeqCst);
            let settled = memory.load(SeqCst);
            for c in copiers {
                c.join().unwrap();
            }
            assert_eq!(memory.load(SeqCst), settled, "memory changed after close");
        }
    }
}

#[cfg(all(test, ferry_loom))]
mod loom_model {
    use super::*;
    use loom::cell::UnsafeCell;
    use loom::sync::Arc;

    /// A copier against a closer that reuses the memory once `close`
    /// returned: loom reports a data race on `memory` if a copy can
    /// overlap the reuse.
    #[test]
    fn loom_model_no_copy_after_close() {
        loom::model(|| {
            struct Shared {
                gate: CopyGate,
                memory: UnsafeCell<u64>,
            }
            let s = Arc::new(Shared {
                gate: CopyGate::new(),
                memory: UnsafeCell::new(0),
            });
            let copier = {
                let s = Arc::clone(&s);
                loom::thread::spawn(move || {
                    if let Some(_pass) = s.gate.enter() {
                        s.memory.with_mut(|m| unsafe { *m = 1 });
                    }
                })
            };
            s.gate.close();
            s.memory.with_mut(|m| unsafe { *m = 2 });
            copier.join().unwrap();
        });
    }
}
