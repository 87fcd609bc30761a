//! Blocking callers that drive an engine's I/O themselves.
//!
//! An engine's background work (a TCP connection's reader, which reads the
//! answers and completes the operations they belong to) runs as a task on
//! the engine's Tokio runtime. A caller that is itself a task on that
//! runtime gets its result on the same worker thread, for free. A caller
//! that *blocks* a thread outside the runtime (a Python thread in
//! `batch_transfer_sync_write`, a C caller) gets it only through a
//! cross-thread wake-up: the worker that completed the operation must
//! `unpark` the caller, and a parked thread takes tens of microseconds to run
//! again on a VM, longer than a whole 4 KiB transfer on the same host
//! (figures: docs/benchmarks/ferry-core.md, from
//! `crates/ferry/examples/blocking_latency.rs`).
//!
//! This module removes that hop (leader/follower): a background task made
//! with [`Task`] can be *driven by a blocked caller*. [`block_on`] runs a
//! future on the calling thread; every assisted task that the future used
//! (it calls [`Handle::offer`], e.g. when it sends a request on a
//! connection) is taken over by the calling thread while it waits: the
//! caller polls the task itself, reads its own answer and completes its own
//! operation (and any other that arrives meanwhile), with no wake-up in
//! between. When the caller's future is done it hands the task back to the
//! runtime.
//!
//! One thread polls a task at a time: the runtime's pump or one blocked
//! caller. Other blocked callers wait for their wake-up as before. The task
//! is always polled with the same waker (its slot's), which forwards a
//! wake-up to whoever owns the task at that moment, so readiness and timers
//! registered by one owner reach the next.
//!
//! Nothing here is unsafe; the futures only change threads between polls,
//! which `Send` allows.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::future::Future;
use std::pin::{pin, Pin};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll, Wake, Waker};
use std::thread::Thread;
use std::time::{Duration, Instant};

use crate::__private::sync::lock;

type BoxFut = Pin<Box<dyn Future<Output = ()> + Send>>;

/// Where an assisted task lives between polls.
struct Slot {
    state: Mutex<SlotState>,
    /// A blocked caller found the task busy and waits to take it: the task
    /// should yield at its next chance ([`should_yield`]).
    wanted: Arc<AtomicBool>,
    /// Blocked callers have driven the task: when the runtime polls it,
    /// it serves callers that take it over when they wait ([`quiet`]).
    served_callers: AtomicBool,
}

#[derive(Default)]
struct SlotState {
    /// The task's future; `None` while someone polls it (or once finished).
    fut: Option<BoxFut>,
    /// Finished (returned `Ready`) or canceled (its pump was dropped).
    done: bool,
    /// The pump's waker (the runtime's task), when it last found the
    /// future away.
    pump: Option<Waker>,
    /// The blocked caller that holds the future now, if any.
    driver: Option<Waker>,
    /// Blocked callers that found it held by another caller, oldest
    /// first: when it is handed back one of them is woken to take it over
    /// (leader/follower) instead of spinning meanwhile ([`next_driver`]).
    /// All of them when it finishes.
    waiting: VecDeque<Arc<Signal>>,
    /// Woken since it was last polled: it must be polled again.
    woken: bool,
}

/// The one waker the future is ever polled with: records the wake-up and
/// passes it to the current owner.
struct SlotWaker(Weak<Slot>);

impl Wake for SlotWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        let Some(slot) = self.0.upgrade() else { return };
        let to = {
            let mut s = lock(&slot.state);
            s.woken = true;
            match &s.driver {
                Some(d) => Some(d.clone()),
                None => s.pump.clone(),
            }
        };
        if let Some(w) = to {
            w.wake();
        }
    }
}

/// A background task that blocked callers may drive: make it, give its
/// [`Handle`] to whatever starts work the task finishes, then
/// [`Task::spawn`] it.
pub struct Task {
    slot: Arc<Slot>,
}

/// Names an assisted task to the blocked caller of the current thread
/// ([`Handle::offer`]). Holds it weakly: a handle keeps nothing alive.
#[derive(Clone)]
pub struct Handle(Weak<Slot>);

impl std::fmt::Debug for Handle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("assist::Handle")
    }
}

impl Default for Task {
    fn default() -> Self {
        Task::new()
    }
}

impl Task {
    /// A task not yet started.
    pub fn new() -> Task {
        Task {
            slot: Arc::new(Slot {
                state: Mutex::new(SlotState::default()),
                wanted: Arc::new(AtomicBool::new(false)),
                served_callers: AtomicBool::new(false),
            }),
        }
    }

    /// Its handle.
    pub fn handle(&self) -> Handle {
        Handle(Arc::downgrade(&self.slot))
    }

    /// Spawns `fut` on the current runtime (panics outside one, like
    /// `tokio::spawn`). Aborting the returned handle drops the future,
    /// also when a blocked caller holds it at that moment (it is dropped
    /// when the caller hands it back).
    pub fn spawn<F>(self, fut: F) -> tokio::task::JoinHandle<()>
    where
        F: Future<Output = ()> + Send + 'static,
    {
        lock(&self.slot.state).fut = Some(Box::pin(fut));
        tokio::spawn(Pump {
            slot: self.slot,
            waker: None,
        })
    }
}

/// The runtime's side: polls the future whenever no blocked caller does.
struct Pump {
    slot: Arc<Slot>,
    /// Built once (the slot's waker).
    waker: Option<Waker>,
}

impl Future for Pump {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let slot = Arc::clone(&self.slot);
        let waker = self
            .waker
            .get_or_insert_with(|| Waker::from(Arc::new(SlotWaker(Arc::downgrade(&slot)))))
            .clone();
        let mut fut = {
            let mut s = lock(&slot.state);
            if s.done {
                return Poll::Ready(());
            }
            if !s.pump.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                s.pump = Some(cx.waker().clone());
            }
            if s.fut.is_some() && slot.wanted.swap(false, Ordering::Relaxed) {
                // A blocked caller waits for it (it made the task yield):
                // leave it to the caller for one round of the scheduler.
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            match s.fut.take() {
                Some(f) => {
                    s.woken = false;
                    f
                }
                // A blocked caller has it: it wakes us when it hands it
                // back with work left.
                None => return Poll::Pending,
            }
        };
        let out = poll_as(&slot, &mut fut, &waker, By::Pump, None);
        let mut s = lock(&slot.state);
        match out {
            Poll::Ready(()) => {
                s.done = true;
                Poll::Ready(())
            }
            Poll::Pending => {
                s.fut = Some(fut);
                Poll::Pending
            }
        }
    }
}

impl Drop for Pump {
    fn drop(&mut self) {
        // Aborted (or finished): the future goes now, or when the caller
        // that holds it hands it back.
        let fut = {
            let mut s = lock(&self.slot.state);
            s.done = true;
            s.fut.take()
        };
        drop(fut);
    }
}

/// The assisted task being polled on a thread.
struct Current {
    /// Its slot's `wanted` flag.
    wanted: Arc<AtomicBool>,
    /// A blocked caller polls it.
    driven: bool,
    /// See [`quiet`].
    quiet: bool,
    /// A blocked caller hands it back: it should not keep the caller.
    handing_back: bool,
    /// The signal of the blocked caller that drives it, if one does: once
    /// woken (its own call completed, most often by this very task), the
    /// task should let the caller return ([`should_yield`]).
    caller: Option<Arc<Signal>>,
}

thread_local! {
    /// The assisted task being polled on this thread, if any.
    static CURRENT: RefCell<Option<Current>> = const { RefCell::new(None) };
}

/// How a task is polled.
#[derive(Clone, Copy, PartialEq, Eq)]
enum By {
    /// The runtime's pump.
    Pump,
    /// A blocked caller waiting for its own answer.
    Caller,
    /// A blocked caller handing it back: one last poll so that it waits
    /// for readiness, polled as the pump would poll it ([`quiet`]).
    HandBack,
}

/// Polls `fut` as the task of `slot`: [`should_yield`] inside sees it.
fn poll_as(
    slot: &Slot,
    fut: &mut BoxFut,
    waker: &Waker,
    by: By,
    caller: Option<&Arc<Signal>>,
) -> Poll<()> {
    struct Restore(Option<Current>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let prev = self.0.take();
            CURRENT.with(|c| *c.borrow_mut() = prev);
        }
    }
    let current = Current {
        wanted: Arc::clone(&slot.wanted),
        driven: by == By::Caller,
        quiet: by == By::HandBack
            || (by == By::Pump && slot.served_callers.load(Ordering::Relaxed)),
        handing_back: by == By::HandBack,
        caller: caller.filter(|_| by == By::Caller).cloned(),
    };
    let _restore = Restore(CURRENT.with(|c| c.borrow_mut().replace(current)));
    fut.as_mut().poll(&mut Context::from_waker(waker))
}

/// Whether the assisted task running on this thread should yield now: a
/// blocked caller waits to drive it (it then reads its own answer), the
/// caller that drove it is handing it back and must not be kept, or the
/// caller that drives it was woken (its own call may be done: a caller
/// must not go on reading other callers' answers after its own arrived,
/// which, while a long batch's answers kept coming, kept a 4 KiB call
/// until the whole batch was answered). A task that polls in a loop (a
/// reader spinning for an answer, or reading answer after answer) checks
/// this between attempts. `false` outside an assisted task.
pub fn should_yield() -> bool {
    CURRENT.with(|c| {
        c.borrow().as_ref().is_some_and(|cur| {
            cur.handing_back
                || cur.wanted.load(Ordering::Relaxed)
                || cur
                    .caller
                    .as_ref()
                    .is_some_and(|s| s.woken.load(Ordering::Acquire))
        })
    })
}

/// Whether the assisted task running on this thread is driven by a blocked
/// caller right now. Such a task should poll (try its read, then yield)
/// rather than wait for readiness while the caller's answer is due: the
/// caller's thread is spinning for it anyway, and readiness would reach it
/// only through the runtime's I/O driver thread, the wake-up this module
/// exists to avoid.
pub fn driven() -> bool {
    CURRENT.with(|c| c.borrow().as_ref().is_some_and(|cur| cur.driven))
}

/// Whether the assisted task running on this thread serves blocked
/// callers and is not driven by one now (the runtime polls it, or a caller
/// hands it back). Such a task should not poll for work that may come
/// (a reader's busy-poll after an answer, for a next request): the
/// callers take it over and poll themselves when they wait, and a runtime
/// thread polling meanwhile only takes a CPU from them (and from the peer,
/// on a small host). It should wait for readiness instead, and poll only
/// while requests are outstanding.
pub fn quiet() -> bool {
    CURRENT.with(|c| c.borrow().as_ref().is_some_and(|cur| cur.quiet))
}

thread_local! {
    /// The tasks offered to this thread's [`block_on`] (`None`: the thread
    /// is not in one).
    static OFFERED: RefCell<Option<Vec<Weak<Slot>>>> = const { RefCell::new(None) };
}

impl Handle {
    /// Test support: waits (up to `limit`) until the task rests in its
    /// slot, polled by nobody and with no wake-up pending, then gives the
    /// runtime a moment to run any pump poll still queued.
    #[cfg(test)]
    fn wait_parked(&self, limit: Duration) {
        let start = Instant::now();
        while start.elapsed() < limit {
            let parked = self.0.upgrade().is_some_and(|slot| {
                let s = lock(&slot.state);
                s.fut.is_some() && s.driver.is_none() && !s.woken
            });
            if parked {
                break;
            }
            std::thread::sleep(Duration::from_micros(100));
        }
        std::thread::sleep(Duration::from_micros(300));
    }

    /// Tells the blocked caller of this thread, if there is one, that the
    /// future it runs waits for this task: it then drives the task itself
    /// while it waits. No-op on any other thread (a runtime worker, a
    /// thread outside [`block_on`]).
    pub fn offer(&self) {
        OFFERED.with(|o| {
            if let Some(list) = o.borrow_mut().as_mut() {
                if !list.iter().any(|w| w.ptr_eq(&self.0)) {
                    list.push(self.0.clone());
                }
            }
        });
    }
}

/// Wakes the thread in [`block_on`].
struct Signal {
    woken: AtomicBool,
    /// The [`block_on`] call it belongs to has not returned yet.
    active: AtomicBool,
    thread: Thread,
}

/// Marks a [`block_on`] call's signal as no longer waiting (also on a
/// panic), so that a hand-back does not choose it ([`next_driver`]).
struct Returned<'a>(&'a Signal);

impl Drop for Returned<'_> {
    fn drop(&mut self) {
        self.0.active.store(false, Ordering::Release);
    }
}

impl Wake for Signal {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.store(true, Ordering::Release);
        // Cheap when the thread is not parked (no system call).
        self.thread.unpark();
    }
}

/// How long a blocked caller with nothing to drive spins (yielding the CPU)
/// for its wake-up before it sleeps: waking a sleeping thread costs tens of
/// microseconds on a VM.
const SPIN: Duration = Duration::from_micros(50);

/// A task this thread holds, handed back when dropped (also on a panic).
struct Held {
    slot: Arc<Slot>,
    fut: Option<BoxFut>,
    waker: Waker,
    /// The signal of the caller that holds it.
    me: Arc<Signal>,
}

impl Held {
    /// Polls the task once. Returns whether it asks to be polled again at
    /// once (it yielded) — `false` once it waits on readiness or a timer,
    /// or has finished.
    fn poll(&mut self) -> bool {
        let Some(fut) = self.fut.as_mut() else {
            return false;
        };
        lock(&self.slot.state).woken = false;
        match poll_as(&self.slot, fut, &self.waker, By::Caller, Some(&self.me)) {
            Poll::Ready(()) => {
                self.fut = None;
                let (pump, waiting) = {
                    let mut s = lock(&self.slot.state);
                    s.done = true;
                    s.driver = None;
                    (s.pump.take(), take_waiting(&mut s))
                };
                // Let the pump and the waiting callers see that it is over.
                if let Some(p) = pump {
                    p.wake();
                }
                waiting.iter().for_each(Signal::wake_by_ref);
                false
            }
            Poll::Pending => lock(&self.slot.state).woken,
        }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let Some(mut fut) = self.fut.take() else {
            return;
        };
        // Left polling (it yielded): poll it once more as the pump would
        // (`quiet`), so that it waits for readiness, instead of waking a
        // runtime thread to poll it, which on a small host takes the CPU
        // from this thread's next call and from the peer.
        if lock(&self.slot.state).woken && !std::thread::panicking() {
            lock(&self.slot.state).woken = false;
            if poll_as(&self.slot, &mut fut, &self.waker, By::HandBack, None).is_ready() {
                let (pump, waiting) = {
                    let mut s = lock(&self.slot.state);
                    s.done = true;
                    s.driver = None;
                    (s.pump.take(), take_waiting(&mut s))
                };
                drop(fut);
                if let Some(p) = pump {
                    p.wake();
                }
                waiting.iter().for_each(Signal::wake_by_ref);
                return;
            }
        }
        let (pump, drop_it, waiting) = {
            let mut s = lock(&self.slot.state);
            s.driver = None;
            if s.done {
                (None, Some(fut), take_waiting(&mut s))
            } else {
                s.fut = Some(fut);
                // Work left (it yielded, or was woken while we held it):
                // the runtime's pump takes over now (unless a waiting
                // caller takes it first).
                let next = next_driver(&mut s.waiting);
                (
                    if s.woken { s.pump.clone() } else { None },
                    None,
                    next.into_iter().collect(),
                )
            }
        };
        drop(drop_it);
        if let Some(p) = pump {
            p.wake();
        }
        // Finished: every waiting caller sees it; else the one chosen
        // takes it over.
        waiting.iter().for_each(Signal::wake_by_ref);
    }
}

/// What [`take`] found.
enum Taken {
    Held(Held),
    /// Another blocked caller polls it right now (it wakes us when it
    /// hands it back).
    BusyCaller,
    /// The runtime polls it right now (asked to yield).
    BusyPump,
    /// Finished or canceled.
    Gone,
}

/// The waiting caller to wake when a task is handed back, taken off
/// `waiting`: the oldest whose call still waits (in [`block_on`] and not
/// woken already). Callers whose call has returned are dropped from the
/// list; one already woken (its answer came, or a wake-up is on its way)
/// looks at the task anyway when it runs, so nobody more is woken.
///
/// Waking only one keeps a hand-back, which ends every call driven by a
/// caller, to one thread switch: waking all of them (ten Python threads on
/// one connection, as vLLM's connector does) made each call cost a switch
/// per waiting thread, all but one of which found the task taken again.
/// A caller not woken is not stranded: its answer wakes it as before,
/// read by whoever drives the task then (the next caller, or the
/// runtime's pump).
fn next_driver(waiting: &mut VecDeque<Arc<Signal>>) -> Option<Arc<Signal>> {
    let mut chosen = None;
    while let Some(w) = waiting.pop_front() {
        if !w.active.load(Ordering::Acquire) {
            continue;
        }
        if !w.woken.load(Ordering::Acquire) {
            chosen = Some(w);
        }
        break;
    }
    // Callers whose call has returned are not waiting any more.
    waiting.retain(|w| w.active.load(Ordering::Acquire));
    chosen
}

/// Every waiting caller of a finished task, to wake.
fn take_waiting(s: &mut SlotState) -> VecDeque<Arc<Signal>> {
    std::mem::take(&mut s.waiting)
}

/// Takes the task of `slot` if nobody polls it now.
fn take(slot: Arc<Slot>, me: &Arc<Signal>) -> Taken {
    let fut = {
        let mut s = lock(&slot.state);
        if s.done {
            return Taken::Gone;
        }
        if s.driver.is_some() {
            if !s.waiting.iter().any(|w| Arc::ptr_eq(w, me)) {
                s.waiting.push_back(Arc::clone(me));
            }
            return Taken::BusyCaller;
        }
        let Some(f) = s.fut.take() else {
            // The runtime polls it: ask it to yield.
            slot.wanted.store(true, Ordering::Relaxed);
            return Taken::BusyPump;
        };
        slot.wanted.store(false, Ordering::Relaxed);
        slot.served_callers.store(true, Ordering::Relaxed);
        // Driving it, not waiting for it.
        s.waiting.retain(|w| !Arc::ptr_eq(w, me));
        s.driver = Some(Waker::from(Arc::clone(me)));
        f
    };
    let waker = Waker::from(Arc::new(SlotWaker(Arc::downgrade(&slot))));
    Taken::Held(Held {
        slot,
        fut: Some(fut),
        waker,
        me: Arc::clone(me),
    })
}

/// Leaves the thread's offer list as it was (nested calls, panics).
struct OfferScope(Option<Vec<Weak<Slot>>>);

impl Drop for OfferScope {
    fn drop(&mut self) {
        let prev = self.0.take();
        OFFERED.with(|o| *o.borrow_mut() = prev);
    }
}

fn take_offers() -> Vec<Weak<Slot>> {
    OFFERED.with(|o| match o.borrow_mut().as_mut() {
        Some(list) => std::mem::take(list),
        None => Vec::new(),
    })
}

/// Runs `fut` to completion on the calling thread, which blocks, inside
/// the runtime of `rt` (for timers and spawned tasks), and drives the
/// assisted tasks `fut` offers while it waits (see the module's docs).
/// With nothing to drive it spins briefly, then sleeps until woken.
///
/// For threads outside the runtime (Python threads, C callers). Called on
/// a runtime worker it would block that worker like any blocking call:
/// don't.
///
/// The first poll uses a waker that never wakes, and costs nothing else: a
/// call whose future is done at once (a same-host copy the peer granted)
/// returns without building this caller's signal. A future that is not
/// done is polled again at once with the real waker (a future answers to
/// the waker of its latest poll), so no wake-up is lost.
pub fn block_on<F: Future>(rt: &tokio::runtime::Handle, fut: F) -> F::Output {
    let _enter = rt.enter();
    let _scope = OfferScope(OFFERED.with(|o| o.borrow_mut().replace(Vec::new())));
    let mut fut = pin!(fut);
    if let Poll::Ready(out) = fut.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        return out;
    }
    let signal = Arc::new(Signal {
        woken: AtomicBool::new(false),
        active: AtomicBool::new(true),
        thread: std::thread::current(),
    });
    let _returned = Returned(&signal);
    let me = Waker::from(Arc::clone(&signal));
    let mut cx = Context::from_waker(&me);
    // Tasks offered but busy elsewhere when we looked: tried again.
    let mut wanted: Vec<Weak<Slot>> = Vec::new();
    let mut held: Vec<Held> = Vec::new();
    // Takes what is free of `wanted` into `held`: whether it took any,
    // and whether any is busy on the runtime (which yields it soon).
    let grab = |wanted: &mut Vec<Weak<Slot>>, held: &mut Vec<Held>| {
        let before = held.len();
        let mut on_pump = false;
        wanted.retain(|w| match w.upgrade() {
            None => false,
            Some(slot) => match take(slot, &signal) {
                Taken::Held(h) => {
                    held.push(h);
                    false
                }
                Taken::BusyCaller => true,
                Taken::BusyPump => {
                    on_pump = true;
                    true
                }
                Taken::Gone => false,
            },
        });
        (held.len() > before, on_pump)
    };
    // The future's waker is still the one that never wakes: until it was
    // polled with ours, the loop must not sleep.
    let mut noop_waker = true;
    loop {
        // The first round: polled already (above), its offers are taken
        // first, as after any poll.
        if !noop_waker {
            signal.woken.store(false, Ordering::Relaxed);
            if let Poll::Ready(out) = fut.as_mut().poll(&mut cx) {
                // Not a caller to choose for the tasks handed back from
                // here on (`held` hands its tasks back as it drops).
                signal.active.store(false, Ordering::Release);
                return out;
            }
        }
        for w in take_offers() {
            let known = wanted.iter().any(|x| x.ptr_eq(&w))
                || held
                    .iter()
                    .any(|h| std::ptr::eq(Arc::as_ptr(&h.slot), w.as_ptr()));
            if !known {
                wanted.push(w);
            }
        }
        let (_, mut on_pump) = grab(&mut wanted, &mut held);
        let mut again = false;
        for h in &mut held {
            again |= h.poll();
        }
        held.retain(|h| h.fut.is_some());
        // (Not `again || take(..)`: the flag must clear even when a held
        // task asks for another round, or the future is never polled again.)
        let first_round = std::mem::take(&mut noop_waker);
        if again || first_round {
            continue;
        }
        // Nothing to poll at once: wait for a wake-up (ours, or a held
        // task's), taking a busy task as soon as it comes free. Spin only
        // if that may come soon without one: we hold a task, or wait for
        // one the runtime is asked to yield. A task another caller holds
        // wakes us when it is handed back (and that caller completes our
        // work meanwhile): spinning then only takes the CPU it needs.
        let start = Instant::now();
        let spin = !held.is_empty() || on_pump || wanted.is_empty();
        while !signal.woken.load(Ordering::Acquire) {
            if !wanted.is_empty() {
                let (took, pump) = grab(&mut wanted, &mut held);
                if took {
                    break;
                }
                on_pump = pump;
            }
            if (spin || on_pump) && start.elapsed() < SPIN {
                std::thread::yield_now();
            } else {
                // `unpark` before `park` makes `park` return at once, so no
                // wake-up is lost between the check and the sleep.
                std::thread::park();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap()
    }

    /// A task that answers requests sent over a channel: driven by the
    /// runtime when nobody blocks, by the blocked caller otherwise (its
    /// thread is the one that runs the task's code).
    #[test]
    fn a_blocked_caller_drives_the_offered_task_on_its_own_thread() {
        let rt = runtime();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(
            tokio::sync::oneshot::Sender<std::thread::ThreadId>,
            u32,
        )>();
        let task = Task::new();
        let handle = task.handle();
        let join = {
            let _g = rt.enter();
            task.spawn(async move {
                while let Some((reply, _n)) = rx.recv().await {
                    let _ = reply.send(std::thread::current().id());
                }
            })
        };
        let me = std::thread::current().id();
        // Blocked callers: the answer comes from this very thread. A caller
        // whose offer meets the pump in the middle of a poll (a wake-up
        // still queued on the worker from the call before, or the worker
        // preempted mid-poll on a loaded host) is served by the pump,
        // which is correct, only slower; so each call starts once the task
        // rests in its slot, and a few such calls are allowed. Without the
        // offer, every call is served on the worker.
        let mut on_worker = Vec::new();
        for i in 0..100 {
            handle.wait_parked(Duration::from_secs(5));
            let (rtx, rrx) = tokio::sync::oneshot::channel();
            let ran_on = block_on(rt.handle(), async {
                handle.offer();
                // The caller takes the task before the request exists, as
                // a connection's caller does before its answer can arrive.
                tokio::task::yield_now().await;
                tx.send((rtx, i)).unwrap();
                rrx.await.unwrap()
            });
            if ran_on != me {
                on_worker.push(i);
            }
        }
        assert!(
            on_worker.len() <= 5,
            "calls served on the runtime's worker, not the blocked caller: {on_worker:?}"
        );
        // A task on the runtime: the pump answers, on a worker.
        let ran_on = rt.block_on(async {
            let (rtx, rrx) = tokio::sync::oneshot::channel();
            tx.send((rtx, 0)).unwrap();
            rrx.await.unwrap()
        });
        assert_ne!(ran_on, me);
        drop(tx);
        rt.block_on(join).unwrap();
    }

    /// Without an offer the caller only waits: the task runs on the
    /// runtime, and a wake-up from there ends the wait.
    /// The first poll's waker never wakes (a call done at once skips the
    /// caller's signal): a future that is not done must be polled again
    /// with the real waker before the caller sleeps, or a wake-up sent to
    /// the waker of its latest poll is lost and the caller sleeps for ever.
    #[test]
    fn a_wake_up_after_the_first_poll_reaches_the_caller() {
        let rt = runtime();
        let waker: Arc<Mutex<Option<Waker>>> = Arc::default();
        let done = Arc::new(AtomicBool::new(false));
        let polls = Arc::new(AtomicUsize::new(0));
        let (tx, rx) = std::sync::mpsc::channel();
        let caller = std::thread::spawn({
            let (waker, done, polls) = (waker.clone(), done.clone(), polls.clone());
            let handle = rt.handle().clone();
            move || {
                block_on(
                    &handle,
                    std::future::poll_fn(|cx| {
                        polls.fetch_add(1, Ordering::SeqCst);
                        if done.load(Ordering::SeqCst) {
                            return Poll::Ready(());
                        }
                        *lock(&waker) = Some(cx.waker().clone());
                        Poll::Pending
                    }),
                );
                tx.send(()).unwrap();
            }
        });
        // Once the caller sleeps (its future polled at least twice: the
        // quiet poll, then with its own waker), the wake-up comes from here.
        let bound = Instant::now() + Duration::from_secs(10);
        while polls.load(Ordering::SeqCst) < 2 && Instant::now() < bound {
            std::thread::sleep(Duration::from_millis(1));
        }
        std::thread::sleep(Duration::from_millis(20));
        done.store(true, Ordering::SeqCst);
        let w = lock(&waker).take().expect("the future left a waker");
        w.wake();
        rx.recv_timeout(Duration::from_secs(10))
            .expect("the caller was woken and returned");
        caller.join().unwrap();
    }

    #[test]
    fn without_an_offer_the_task_stays_on_the_runtime() {
        let rt = runtime();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<
            tokio::sync::oneshot::Sender<std::thread::ThreadId>,
        >();
        let task = Task::new();
        let _g = rt.enter();
        let join = task.spawn(async move {
            while let Some(reply) = rx.recv().await {
                let _ = reply.send(std::thread::current().id());
            }
        });
        drop(_g);
        let (rtx, rrx) = tokio::sync::oneshot::channel();
        tx.send(rtx).unwrap();
        let ran_on = block_on(rt.handle(), async { rrx.await.unwrap() });
        assert_ne!(ran_on, std::thread::current().id());
        drop(tx);
        rt.block_on(join).unwrap();
    }

    /// Many callers at once on one task: each gets its own answer, none
    /// hangs, whoever drives completes the others' work too.
    #[test]
    fn many_blocked_callers_share_one_task() {
        let rt = runtime();
        let (tx, mut rx) =
            tokio::sync::mpsc::unbounded_channel::<(tokio::sync::oneshot::Sender<u64>, u64)>();
        let task = Task::new();
        let handle = task.handle();
        let join = {
            let _g = rt.enter();
            task.spawn(async move {
                while let Some((reply, n)) = rx.recv().await {
                    // Let timers and other owners interleave.
                    tokio::task::yield_now().await;
                    let _ = reply.send(n * 2);
                }
            })
        };
        let done = Arc::new(AtomicUsize::new(0));
        std::thread::scope(|s| {
            for t in 0..8u64 {
                let (tx, handle, rt, done) = (tx.clone(), handle.clone(), rt.handle(), &done);
                s.spawn(move || {
                    for i in 0..500u64 {
                        let n = t * 1000 + i;
                        let (rtx, rrx) = tokio::sync::oneshot::channel();
                        tx.send((rtx, n)).unwrap();
                        let got = block_on(rt, async {
                            handle.offer();
                            rrx.await.unwrap()
                        });
                        assert_eq!(got, n * 2);
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                });
            }
        });
        assert_eq!(done.load(Ordering::Relaxed), 8 * 500);
        drop(tx);
        rt.block_on(join).unwrap();
    }

    /// A task waiting on a timer while a caller holds it: the timer's
    /// wake-up reaches the caller, and once it hands the task back, the
    /// runtime's pump (not the gone caller) gets later wake-ups.
    #[test]
    fn timers_reach_whoever_holds_the_task() {
        let rt = runtime();
        let (tx, mut rx) =
            tokio::sync::mpsc::unbounded_channel::<tokio::sync::oneshot::Sender<()>>();
        let task = Task::new();
        let handle = task.handle();
        let join = {
            let _g = rt.enter();
            task.spawn(async move {
                while let Some(reply) = rx.recv().await {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    let _ = reply.send(());
                }
            })
        };
        for _ in 0..5 {
            let (rtx, rrx) = tokio::sync::oneshot::channel();
            tx.send(rtx).unwrap();
            block_on(rt.handle(), async {
                handle.offer();
                rrx.await.unwrap()
            });
            // The caller returns before the task goes back to its loop:
            // the next request is served by the runtime.
            let (rtx, rrx) = tokio::sync::oneshot::channel();
            tx.send(rtx).unwrap();
            rt.block_on(async { tokio::time::timeout(Duration::from_secs(5), rrx).await })
                .expect("the pump serves the task once the caller is gone")
                .unwrap();
        }
        drop(tx);
        rt.block_on(join).unwrap();
    }

    /// A caller hands a task that asks to be polled again (a reader
    /// between answers) back with one last poll on its own thread, with
    /// `quiet()` on and `driven()` off, and wakes no runtime thread when
    /// that poll leaves it waiting.
    #[test]
    fn the_hand_back_is_one_quiet_poll_on_the_callers_thread() {
        let rt = runtime();
        let (polls, handle, join) =
            recording_task(&rt, || (std::thread::current().id(), quiet(), driven()));
        let me = std::thread::current().id();
        let before = lock(&polls).len();
        // The call ends once the caller has driven the task (not after a
        // fixed number of yields: on a loaded machine the runtime may hold
        // the task through them), with a liveness bound.
        let bound = Instant::now() + Duration::from_secs(20);
        let mut offered = false;
        block_on(
            rt.handle(),
            std::future::poll_fn(|cx| {
                if !offered {
                    handle.offer();
                    offered = true;
                }
                let drove = lock(&polls)[before..]
                    .iter()
                    .any(|&(t, q, d)| t == me && d && !q);
                if drove || Instant::now() > bound {
                    Poll::Ready(())
                } else {
                    cx.waker().wake_by_ref();
                    Poll::Pending
                }
            }),
        );
        let after = lock(&polls).clone();
        let mine = &after[before..];
        assert!(
            mine.iter().any(|&(t, q, d)| t == me && d && !q),
            "the caller never drove the task: {mine:?}"
        );
        assert_eq!(
            mine.last().copied(),
            Some((me, true, false)),
            "the last poll is not the caller's quiet hand-back: {mine:?}"
        );
        // Nothing woke the pump: no poll follows on the runtime.
        std::thread::sleep(Duration::from_millis(50));
        let later = lock(&polls).clone();
        assert_eq!(later.len(), after.len(), "{later:?}");
        join.abort();
    }

    /// An assisted task that records `record()` at every poll and, while a
    /// caller drives it, asks to be polled again (a reader polling for an
    /// answer); started and resting in its slot.
    #[allow(clippy::type_complexity)]
    fn recording_task<R: Send + 'static>(
        rt: &tokio::runtime::Runtime,
        record: impl Fn() -> R + Send + 'static,
    ) -> (Arc<Mutex<Vec<R>>>, Handle, tokio::task::JoinHandle<()>) {
        let polls: Arc<Mutex<Vec<R>>> = Arc::default();
        let task = Task::new();
        let handle = task.handle();
        let join = {
            let polls = Arc::clone(&polls);
            let _g = rt.enter();
            task.spawn(std::future::poll_fn(move |cx| {
                lock(&polls).push(record());
                if driven() {
                    cx.waker().wake_by_ref();
                }
                Poll::<()>::Pending
            }))
        };
        // Rests only once the runtime polled it the first time: before
        // that its slot looks parked, yet the runtime's first poll is
        // still to come (on a loaded machine, after the test's own polls:
        // the hand-back test saw it as a pump poll after the hand-back,
        // 7 times in 30 runs beside two busy loops).
        let bound = Instant::now() + Duration::from_secs(5);
        while lock(&polls).is_empty() && Instant::now() < bound {
            std::thread::sleep(Duration::from_micros(100));
        }
        handle.wait_parked(Duration::from_secs(5));
        (polls, handle, join)
    }

    fn signal(active: bool, woken: bool) -> Arc<Signal> {
        Arc::new(Signal {
            woken: AtomicBool::new(woken),
            active: AtomicBool::new(active),
            thread: std::thread::current(),
        })
    }

    /// A caller driving a task that has more work queued (a reader with a
    /// long batch's answers still coming) gets its own answer and returns:
    /// the task, checking `should_yield` between items, lets it go once the
    /// caller is woken, instead of working through the whole queue first.
    #[test]
    fn a_caller_whose_answer_came_is_let_go_by_a_busy_task() {
        enum Msg {
            Reply(tokio::sync::oneshot::Sender<()>),
            Fill,
        }
        const FILL: usize = 10_000;
        let rt = runtime();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Msg>();
        let done = Arc::new(AtomicUsize::new(0));
        let task = Task::new();
        let handle = task.handle();
        let join = {
            let _g = rt.enter();
            let done = Arc::clone(&done);
            task.spawn(async move {
                loop {
                    if should_yield() {
                        tokio::task::yield_now().await;
                    }
                    match rx.recv().await {
                        Some(Msg::Reply(r)) => {
                            let _ = r.send(());
                        }
                        Some(Msg::Fill) => {}
                        None => break,
                    }
                    done.fetch_add(1, Ordering::Relaxed);
                }
            })
        };
        for _ in 0..20 {
            handle.wait_parked(Duration::from_secs(5));
            let before = done.load(Ordering::Relaxed);
            let (rtx, rrx) = tokio::sync::oneshot::channel();
            let seen = block_on(rt.handle(), async {
                handle.offer();
                tokio::task::yield_now().await;
                // The answer first, then a long queue of other work.
                tx.send(Msg::Reply(rtx)).unwrap();
                for _ in 0..FILL {
                    tx.send(Msg::Fill).unwrap();
                }
                rrx.await.unwrap();
                // Still held by this caller here: nobody else polls it.
                done.load(Ordering::Relaxed) - before
            });
            assert!(
                seen <= 2,
                "the caller worked through {seen} items of other work before it could return"
            );
            // The rest is done by the runtime (or the next caller).
            let target = before + FILL + 1;
            let start = Instant::now();
            while done.load(Ordering::Relaxed) < target {
                assert!(
                    start.elapsed() < Duration::from_secs(10),
                    "the queue was not worked off"
                );
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        drop(tx);
        rt.block_on(join).unwrap();
    }

    /// A hand-back chooses one caller to wake: the oldest still in its
    /// call and not already woken; callers whose call returned leave the
    /// list; a caller already woken counts as the one (it looks anyway).
    #[test]
    fn a_hand_back_wakes_one_caller_that_still_waits() {
        let (gone, a, b, c) = (
            signal(false, false),
            signal(true, false),
            signal(true, false),
            signal(false, false),
        );
        let mut q = VecDeque::from([gone, Arc::clone(&a), Arc::clone(&b), c]);
        let chosen = next_driver(&mut q).expect("a caller to wake");
        assert!(Arc::ptr_eq(&chosen, &a));
        assert_eq!(q.len(), 1, "the returned caller behind is dropped too");
        assert!(Arc::ptr_eq(&q[0], &b));

        let woken = signal(true, true);
        let mut q = VecDeque::from([woken, Arc::clone(&b)]);
        assert!(next_driver(&mut q).is_none(), "one is on its way already");
        assert_eq!(q.len(), 1);
        assert!(Arc::ptr_eq(&q[0], &b), "the others keep waiting");

        let mut q = VecDeque::from([signal(false, false), signal(false, true)]);
        assert!(next_driver(&mut q).is_none());
        assert!(q.is_empty());
    }

    /// Aborting the task while a caller holds it drops the future when the
    /// caller hands it back; the caller itself is not hurt.
    #[test]
    fn abort_while_held_drops_the_future() {
        let rt = runtime();
        struct Flag(Arc<AtomicBool>);
        impl Drop for Flag {
            fn drop(&mut self) {
                self.0.store(true, Ordering::SeqCst);
            }
        }
        let dropped = Arc::new(AtomicBool::new(false));
        let task = Task::new();
        let handle = task.handle();
        let flag = Flag(Arc::clone(&dropped));
        let join = {
            let _g = rt.enter();
            task.spawn(async move {
                let _flag = flag;
                std::future::pending::<()>().await;
            })
        };
        let abort = join.abort_handle();
        block_on(rt.handle(), async {
            handle.offer();
            // Let the caller take the task, then abort it meanwhile.
            tokio::task::yield_now().await;
            abort.abort();
            tokio::time::sleep(Duration::from_millis(20)).await;
        });
        assert!(rt.block_on(join).unwrap_err().is_cancelled());
        assert!(dropped.load(Ordering::SeqCst));
    }
}
