//! [`Drain`]: counts the calls in flight so that `shutdown` can refuse new
//! ones and wait for the rest.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::sync::Notify;

use crate::error::Error;

/// Calls in flight and whether new ones are still admitted.
///
/// [`Drain::enter`] admits a call (its [`Active`] guard counts it until
/// dropped) or refuses it with [`Error::Canceled`] once [`Drain::close`]
/// was called; [`Drain::idle`] waits until no guard is left. A guard
/// taken before `close` is always waited for: `enter` counts first and
/// checks the flag after, `close` sets the flag first and reads the count
/// after (both `SeqCst`), so one of the two sees the other.
#[derive(Debug, Default)]
pub struct Drain {
    closed: AtomicBool,
    active: AtomicUsize,
    idle: Notify,
}

/// One admitted call; dropping it ends the call for [`Drain::idle`].
#[derive(Debug)]
#[must_use = "the call counts only while the guard lives"]
pub struct Active {
    drain: Arc<Drain>,
}

impl Drain {
    /// A drain admitting calls.
    pub fn new() -> Arc<Drain> {
        Arc::new(Drain::default())
    }

    /// Admits one call, or refuses it with [`Error::Canceled`] naming
    /// `what` once the drain is closed.
    pub fn enter(self: &Arc<Self>, what: &str) -> Result<Active, Error> {
        self.active.fetch_add(1, Ordering::SeqCst);
        let guard = Active {
            drain: Arc::clone(self),
        };
        if self.closed.load(Ordering::SeqCst) {
            drop(guard);
            return Err(Error::Canceled(format!(
                "{what}: the engine is shutting down"
            )));
        }
        Ok(guard)
    }

    /// [`Drain::enter`] for a caller that holds the drain for the whole
    /// call and needs no error (a fast path that declines instead): a
    /// borrowed guard, no reference count touched. `None` once closed.
    pub fn admit(&self) -> Option<Admitted<'_>> {
        self.active.fetch_add(1, Ordering::SeqCst);
        let guard = Admitted(self);
        if self.closed.load(Ordering::SeqCst) {
            drop(guard);
            return None;
        }
        Some(guard)
    }

    /// The end of one admitted call (both guards').
    fn leave(&self) {
        // Only a closed drain has waiters ([`Drain::idle`] is awaited
        // after [`Drain::close`]), so an open one skips the notification
        // (a lock) on every call. Both sides are SeqCst: either this
        // load sees the close, or the waiter's look at `active`, which
        // comes after its close, sees this decrement.
        if self.active.fetch_sub(1, Ordering::SeqCst) == 1 && self.closed.load(Ordering::SeqCst) {
            self.idle.notify_waiters();
        }
    }

    /// Refuses every call from now on. Idempotent.
    pub fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
    }

    /// Whether [`Drain::close`] was called.
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }

    /// Calls admitted and not yet ended.
    pub fn active(&self) -> usize {
        self.active.load(Ordering::SeqCst)
    }

    /// After [`Drain::close`]: waits until no admitted call is left (at
    /// once if none is); the count only falls then, so this ends once the
    /// calls in flight have. Before the close, only the count at the
    /// moment is looked at: a call ending later wakes no one (its guard
    /// skips the notification while the drain is open).
    pub async fn idle(&self) {
        loop {
            let notified = self.idle.notified();
            tokio::pin!(notified);
            // Registered before the look, so a last guard dropped between
            // the look and the await still wakes us.
            notified.as_mut().enable();
            if self.active.load(Ordering::SeqCst) == 0 {
                return;
            }
            notified.await;
        }
    }
}

impl Drop for Active {
    fn drop(&mut self) {
        self.drain.leave();
    }
}

/// One call admitted by [`Drain::admit`]; dropping it ends the call.
#[derive(Debug)]
#[must_use = "the call counts only while the guard lives"]
pub struct Admitted<'a>(&'a Drain);

impl Drop for Admitted<'_> {
    fn drop(&mut self) {
        self.0.leave();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn close_refuses_new_calls_and_idle_waits_for_the_admitted() {
        let d = Drain::new();
        let a = d.enter("transfer").unwrap();
        let b = d.enter("transfer").unwrap();
        d.close();
        let e = d.enter("register").unwrap_err();
        assert!(
            matches!(e, Error::Canceled(ref m) if m.contains("register")),
            "{e}"
        );
        assert_eq!(d.active(), 2, "a refused call does not stay counted");
        let waiter = tokio::spawn({
            let d = Arc::clone(&d);
            async move { d.idle().await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiter.is_finished(), "two calls are still in flight");
        drop(a);
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiter.is_finished(), "one call is still in flight");
        drop(b);
        tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("idle ends once the last call has")
            .unwrap();
    }

    #[tokio::test]
    async fn an_admitted_call_is_waited_for_and_a_closed_drain_admits_none() {
        let d = Drain::new();
        let a = d.admit().expect("an open drain admits");
        assert_eq!(d.active(), 1);
        d.close();
        assert!(d.admit().is_none());
        assert_eq!(d.active(), 1, "a refused admission does not stay counted");
        let waiter = tokio::spawn({
            let d = Arc::clone(&d);
            async move { d.idle().await }
        });
        tokio::task::yield_now().await;
        assert!(
            !waiter.is_finished(),
            "the admitted call is still in flight"
        );
        drop(a);
        tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("idle ends once the admitted call has")
            .unwrap();
    }

    #[tokio::test]
    async fn idle_with_nothing_in_flight_returns_at_once() {
        let d = Drain::new();
        d.idle().await;
        d.close();
        d.idle().await;
    }
}
