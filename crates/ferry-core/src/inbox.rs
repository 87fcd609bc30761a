//! An engine's queue of received notifications: bounded, drained by
//! `take_notifications`, awaited by `next_notification`.
//!
//! The queue belongs to the engine, never to a caller's future: what a
//! backend received (from its wire, or from a C library's own queue) goes
//! here first, and a caller takes it out in one synchronous step. So a
//! dropped `next_notification` or `take_notifications` future (a
//! `tokio::time::timeout`, a `select!`) loses nothing: either the caller
//! got the notification, or it is still queued for the next call.
//!
//! Backends whose library keeps its own queue (Mooncake, NIXL) pull from it
//! with [`Inbox::pull_then`]: the pull runs to its end even when the
//! caller's future is dropped (it is a blocking task), and it puts what it
//! took into the inbox, not into the future's result.

use std::collections::VecDeque;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::Notify;

use crate::__private::sync::lock;
use crate::inbound::NotificationsDropped;
use crate::types::Notification;

/// Bytes counted for each queued notification besides its strings (the
/// `Notification` itself, its queue slot and allocator headers).
pub const NOTIFICATION_OVERHEAD: usize = std::mem::size_of::<Notification>() + 64;

/// Bytes a notification is counted for in an inbox (its strings as
/// allocated plus [`NOTIFICATION_OVERHEAD`]).
pub fn notification_cost(n: &Notification) -> usize {
    n.name.capacity() + n.message.capacity() + NOTIFICATION_OVERHEAD
}

/// Why [`Inbox::push`] refused a notification.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PushRefused {
    /// The inbox holds its most notifications or bytes: the consumer is
    /// behind. The sender should see a retryable "queue full".
    Full,
    /// The engine shut down.
    Closed,
}

#[derive(Debug, Default)]
struct State {
    /// Oldest first.
    queue: VecDeque<Notification>,
    /// Bytes counted for `queue` (see [`notification_cost`]).
    bytes: usize,
    closed: bool,
}

/// The queue (see the module docs).
#[derive(Debug)]
pub struct Inbox {
    state: Mutex<State>,
    /// Every waiter is told of every arrival (each looks for its own name).
    arrived: Notify,
    max_count: usize,
    max_bytes: usize,
    /// Serialises pulls from a library's own queue, so that what one pull
    /// took is queued before the next pull takes more (order is kept).
    pulling: Mutex<()>,
    /// Notifications refused because the inbox was full, and because it
    /// was closed (see [`Inbox::dropped`]).
    dropped_full: AtomicU64,
    dropped_closed: AtomicU64,
}

/// The inbox was closed: the engine shut down.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Closed;

impl From<Closed> for crate::Error {
    fn from(_: Closed) -> crate::Error {
        crate::Error::Canceled("the engine shut down while waiting for a notification".to_owned())
    }
}

impl Inbox {
    /// An empty inbox holding at most `max_count` notifications and
    /// `max_bytes` bytes (as counted by [`notification_cost`]).
    pub fn new(max_count: usize, max_bytes: usize) -> Inbox {
        Inbox {
            state: Mutex::new(State::default()),
            arrived: Notify::new(),
            max_count,
            max_bytes,
            pulling: Mutex::new(()),
            dropped_full: AtomicU64::new(0),
            dropped_closed: AtomicU64::new(0),
        }
    }

    /// Notifications refused so far (by [`Inbox::push`], or reported by
    /// the backend with [`Inbox::count_refused`]), by reason.
    pub fn dropped(&self) -> NotificationsDropped {
        NotificationsDropped {
            full: self.dropped_full.load(Ordering::Relaxed),
            closed: self.dropped_closed.load(Ordering::Relaxed),
        }
    }

    /// Counts a notification the backend refused without offering it to
    /// [`Inbox::push`] (a fault test's switch, say), for
    /// [`Inbox::dropped`].
    pub fn count_refused(&self, why: PushRefused) {
        let counter = match why {
            PushRefused::Full => &self.dropped_full,
            PushRefused::Closed => &self.dropped_closed,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// Queues `n` (newest last) and wakes every waiter, unless the inbox is
    /// full or closed; a refused notification is dropped (and counted in
    /// [`Inbox::dropped`]).
    pub fn push(&self, n: Notification) -> Result<(), PushRefused> {
        let cost = notification_cost(&n);
        {
            let mut s = lock(&self.state);
            if s.closed {
                self.count_refused(PushRefused::Closed);
                return Err(PushRefused::Closed);
            }
            if s.queue.len() >= self.max_count || s.bytes.saturating_add(cost) > self.max_bytes {
                self.count_refused(PushRefused::Full);
                return Err(PushRefused::Full);
            }
            s.queue.push_back(n);
            s.bytes += cost;
        }
        self.arrived.notify_waiters();
        Ok(())
    }

    /// Takes every queued notification, oldest first.
    pub fn take_all(&self) -> Vec<Notification> {
        let mut s = lock(&self.state);
        s.bytes = 0;
        Vec::from(std::mem::take(&mut s.queue))
    }

    /// Takes the oldest notification (the oldest whose name is `name`, if
    /// given), leaving every other one queued.
    pub fn take_next(&self, name: Option<&str>) -> Option<Notification> {
        let mut s = lock(&self.state);
        let at = match name {
            None => (!s.queue.is_empty()).then_some(0),
            Some(want) => s.queue.iter().position(|n| n.name == want),
        }?;
        let n = s.queue.remove(at)?;
        s.bytes = s.bytes.saturating_sub(notification_cost(&n));
        Some(n)
    }

    /// How many notifications are queued.
    pub fn len(&self) -> usize {
        lock(&self.state).queue.len()
    }

    /// Whether none is queued.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Closes the inbox: pushes are refused and waiters return [`Closed`]
    /// once nothing they want is queued. What is queued stays takeable.
    pub fn close(&self) {
        lock(&self.state).closed = true;
        self.arrived.notify_waiters();
    }

    /// Waits for the oldest notification (named `name`, if given) and takes
    /// it. Cancel-safe: a dropped future has taken nothing.
    pub async fn next(&self, name: Option<&str>) -> Result<Notification, Closed> {
        loop {
            let arrived = self.arrived.notified();
            let mut arrived = std::pin::pin!(arrived);
            if let Some(done) = self.look(arrived.as_mut(), name) {
                return done;
            }
            arrived.await;
        }
    }

    /// Registers `arrived` (before looking, so that an arrival between the
    /// look and the wait still wakes the caller), then takes a wanted
    /// notification if one is queued: `None` means wait on `arrived`.
    fn look(
        &self,
        arrived: std::pin::Pin<&mut tokio::sync::futures::Notified<'_>>,
        name: Option<&str>,
    ) -> Option<Result<Notification, Closed>> {
        arrived.enable();
        if let Some(n) = self.take_next(name) {
            return Some(Ok(n));
        }
        lock(&self.state).closed.then_some(Err(Closed))
    }

    /// [`Inbox::next`] for a backend whose library keeps its own queue:
    /// calls `pull` (which moves what the library received into this
    /// inbox, see [`Inbox::pull_guard`]) until a wanted notification is
    /// queued, sleeping between pulls from 50 µs up to 5 ms while nothing
    /// comes (and waking at once when another caller's pull brings one).
    /// Cancel-safe as long as `pull` puts what it takes into the inbox
    /// before its own future can be dropped (a blocking task does).
    pub async fn pull_then<E, F, Fut>(
        &self,
        name: Option<&str>,
        mut pull: F,
    ) -> Result<Notification, E>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<(), E>>,
        E: From<Closed>,
    {
        let mut pause = Duration::from_micros(50);
        loop {
            let arrived = self.arrived.notified();
            let mut arrived = std::pin::pin!(arrived);
            if let Some(done) = self.look(arrived.as_mut(), name) {
                return done.map_err(E::from);
            }
            pull().await?;
            if let Some(n) = self.take_next(name) {
                return Ok(n);
            }
            tokio::select! {
                _ = arrived => {}
                _ = tokio::time::sleep(pause) => {}
            }
            pause = (pause * 2).min(Duration::from_millis(5));
        }
    }

    /// Held by a pull from a library's own queue while it takes and
    /// pushes, so that concurrent pulls keep the library's order. Blocking
    /// (a std mutex): take it inside the blocking task that pulls.
    pub fn pull_guard(&self) -> std::sync::MutexGuard<'_, ()> {
        lock(&self.pulling)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn note(name: &str, msg: &str) -> Notification {
        Notification::new(name, msg)
    }

    #[test]
    fn bounded_by_count_and_bytes() {
        let inbox = Inbox::new(2, usize::MAX);
        inbox.push(note("a", "1")).unwrap();
        inbox.push(note("a", "2")).unwrap();
        assert_eq!(inbox.push(note("a", "3")), Err(PushRefused::Full));
        assert_eq!(inbox.take_all().len(), 2);
        inbox.push(note("a", "4")).unwrap();
        let small = Inbox::new(100, notification_cost(&note("a", "1")) + 1);
        small.push(note("a", "1")).unwrap();
        assert_eq!(small.push(note("a", "2")), Err(PushRefused::Full));
        assert_eq!(small.take_next(None), Some(note("a", "1")));
        small.push(note("a", "2")).unwrap();
        assert_eq!((inbox.dropped().full, small.dropped().full), (1, 1));
        small.close();
        assert_eq!(small.push(note("a", "3")), Err(PushRefused::Closed));
        small.count_refused(PushRefused::Full);
        let d = small.dropped();
        assert_eq!((d.full, d.closed, d.total()), (2, 1, 3));
    }

    #[test]
    fn take_next_by_name_keeps_the_others_in_order() {
        let inbox = Inbox::new(10, usize::MAX);
        for (n, m) in [("p0", "1"), ("p1", "2"), ("p0", "3"), ("p1", "4")] {
            inbox.push(note(n, m)).unwrap();
        }
        assert_eq!(inbox.take_next(Some("p1")), Some(note("p1", "2")));
        assert_eq!(inbox.take_next(Some("nobody")), None);
        assert_eq!(
            inbox.take_all(),
            vec![note("p0", "1"), note("p0", "3"), note("p1", "4")]
        );
    }

    #[tokio::test]
    async fn a_waiter_gets_what_arrives_later_and_a_dropped_one_takes_nothing() {
        let inbox = Arc::new(Inbox::new(10, usize::MAX));
        // Dropped while waiting: takes nothing.
        let r = tokio::time::timeout(Duration::from_millis(5), inbox.next(None)).await;
        assert!(r.is_err());
        inbox.push(note("x", "kept")).unwrap();
        let waiter = {
            let inbox = Arc::clone(&inbox);
            tokio::spawn(async move { inbox.next(Some("y")).await })
        };
        tokio::time::sleep(Duration::from_millis(5)).await;
        inbox.push(note("y", "wanted")).unwrap();
        assert_eq!(waiter.await.unwrap(), Ok(note("y", "wanted")));
        assert_eq!(inbox.take_all(), vec![note("x", "kept")]);
    }

    #[tokio::test]
    async fn close_ends_waiters_and_refuses_pushes() {
        let inbox = Arc::new(Inbox::new(10, usize::MAX));
        let waiter = {
            let inbox = Arc::clone(&inbox);
            tokio::spawn(async move { inbox.next(None).await })
        };
        tokio::time::sleep(Duration::from_millis(5)).await;
        inbox.close();
        assert_eq!(waiter.await.unwrap(), Err(Closed));
        assert_eq!(inbox.push(note("a", "b")), Err(PushRefused::Closed));
    }

    #[tokio::test]
    async fn pull_then_polls_a_library_queue_until_a_wanted_one_comes() {
        let inbox = Inbox::new(10, usize::MAX);
        let library = Mutex::new(VecDeque::from(vec![
            vec![],
            vec![note("other", "1")],
            vec![],
            vec![note("want", "2"), note("other", "3")],
        ]));
        let got: Result<Notification, Closed> = inbox
            .pull_then(Some("want"), || {
                let batch = lock(&library).pop_front().unwrap_or_default();
                for n in batch {
                    inbox.push(n).unwrap();
                }
                async { Ok(()) }
            })
            .await;
        assert_eq!(got, Ok(note("want", "2")));
        assert_eq!(
            inbox.take_all(),
            vec![note("other", "1"), note("other", "3")]
        );
    }
}
