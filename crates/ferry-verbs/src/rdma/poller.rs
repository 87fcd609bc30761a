//! The completion thread: sleeps in `poll(2)` on the completion channel, the
//! device's asynchronous-event descriptor and a wake-up pipe; re-arms and
//! drains every CQ that signalled, and breaks the connection whose QP or CQ
//! an asynchronous error event names (a QP can fail without a completion).
//! No Tokio worker ever blocks on the device and nothing spins while idle.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::thread::JoinHandle;

use ferry_core::{Error, Result};
use rdma_mummy_sys as sys;
use sideway::ibverbs::completion::{BasicCompletionQueue, CompletionChannel};
use sideway::ibverbs::device_context::DeviceContext;

use super::conn::Conn;

/// A connection the completion thread serves: an opener's [`Conn`] or an
/// owner's passive queue pair.
pub(crate) trait Watched: Send + Sync {
    /// Re-arms the CQ and applies every queued completion.
    fn drain_cq(&self);
    /// An asynchronous error event (`event`) named the QP or CQ.
    fn fail(&self, event: &str);
    /// The peer, for logs.
    fn peer(&self) -> &str;
    /// The engine stops: fail what is outstanding with `err` (the device
    /// touches none of its memory afterwards). Nothing by default.
    fn cancel(&self, err: &Error) {
        let _ = err;
    }
}

type Registry = Arc<Mutex<HashMap<usize, Weak<dyn Watched>>>>;

pub(crate) struct Poller {
    registry: Registry,
    wake_tx: OwnedFd,
    stop: Arc<AtomicBool>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

use ferry_core::__private::sync::lock;

impl Poller {
    pub(crate) fn start(
        ctx: Arc<DeviceContext>,
        channel: Arc<CompletionChannel>,
    ) -> Result<Arc<Poller>> {
        let mut fds = [0i32; 2];
        // SAFETY: `fds` has room for the two descriptors pipe2 writes.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_NONBLOCK | libc::O_CLOEXEC) } != 0 {
            return Err(Error::io(
                "creating the completion thread's wake-up pipe",
                &std::io::Error::last_os_error(),
            ));
        }
        // SAFETY: both descriptors were just created and are owned here.
        let (wake_rx, wake_tx) =
            unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        let registry: Registry = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let registry = Arc::clone(&registry);
            let stop = Arc::clone(&stop);
            std::thread::Builder::new()
                .name("ferry-verbs-cq".into())
                .spawn(move || run(ctx, channel, wake_rx, registry, stop))
                .map_err(|e| Error::io("starting the completion thread", &e))?
        };
        Ok(Arc::new(Poller {
            registry,
            wake_tx,
            stop,
            thread: Mutex::new(Some(thread)),
        }))
    }

    /// Routes the events of `cq` and of the QP (`keys`: CQ and QP
    /// addresses) to `target` and arms the CQ.
    pub(crate) fn watch(
        &self,
        cq: &BasicCompletionQueue,
        keys: [usize; 2],
        target: Weak<dyn Watched>,
    ) -> Result<()> {
        {
            let mut reg = lock(&self.registry);
            for k in keys {
                reg.insert(k, target.clone());
            }
        }
        Conn::arm_cq(cq)
    }

    pub(crate) fn unwatch(&self, keys: &[usize]) {
        let mut reg = lock(&self.registry);
        for k in keys {
            reg.remove(k);
        }
    }

    /// Whether the caller runs on the completion thread.
    pub(crate) fn is_current(&self) -> bool {
        lock(&self.thread)
            .as_ref()
            .is_some_and(|t| t.thread().id() == std::thread::current().id())
    }

    /// Stops the thread and waits for it.
    pub(crate) fn stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
        // SAFETY: writing one byte from a valid buffer to our own pipe.
        unsafe { libc::write(self.wake_tx.as_raw_fd(), [1u8].as_ptr().cast(), 1) };
        // Not holding the lock while joining: the completion thread asks
        // `is_current` when it drops a connection.
        let thread = lock(&self.thread).take();
        if let Some(t) = thread {
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
    }
}

impl Drop for Poller {
    fn drop(&mut self) {
        self.stop();
    }
}

fn run(
    ctx: Arc<DeviceContext>,
    channel: Arc<CompletionChannel>,
    wake_rx: OwnedFd,
    registry: Registry,
    stop: Arc<AtomicBool>,
) {
    let chan_fd = channel.as_raw_fd();
    // SAFETY: the context outlives this thread (we hold an Arc).
    let raw_ctx = unsafe { ctx.context() }.as_ptr();
    // SAFETY: reading a plain field of the open context.
    let async_fd = unsafe { (*raw_ctx).async_fd };
    // SAFETY: the descriptor belongs to the context; only its flags change.
    let async_ok = unsafe {
        let fl = libc::fcntl(async_fd, libc::F_GETFL);
        fl >= 0 && libc::fcntl(async_fd, libc::F_SETFL, fl | libc::O_NONBLOCK) == 0
    };
    // SAFETY: the channel outlives this thread (we hold an Arc).
    let chan = unsafe { channel.comp_channel() }.as_ptr();
    loop {
        let mut fds = [
            libc::pollfd {
                fd: chan_fd,
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: wake_rx.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                // A negative descriptor is ignored by poll(2).
                fd: if async_ok { async_fd } else { -1 },
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: `fds` is a valid array of three pollfd; infinite timeout.
        let rc = unsafe { libc::poll(fds.as_mut_ptr(), 3, -1) };
        if rc < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            tracing::error!(error = %e, "poll on the completion channel failed; completion thread stops");
            return;
        }
        if stop.load(Ordering::SeqCst) {
            cancel_all(&registry);
            return;
        }
        if fds[1].revents != 0 {
            let mut buf = [0u8; 16];
            // SAFETY: reading into a valid buffer from our own non-blocking pipe.
            unsafe { libc::read(wake_rx.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        }
        if fds[2].revents != 0 {
            async_events(raw_ctx, &registry);
        }
        if fds[0].revents == 0 {
            continue;
        }
        loop {
            let mut cq: *mut sys::ibv_cq = std::ptr::null_mut();
            let mut ctx: *mut std::ffi::c_void = std::ptr::null_mut();
            // SAFETY: valid channel; the fd is non-blocking, so this returns
            // -1 (EAGAIN) when no event is queued.
            let got = unsafe { sys::ibv_get_cq_event(chan, &mut cq, &mut ctx) };
            if got != 0 || cq.is_null() {
                break;
            }
            // Take a strong reference before acknowledging: a CQ being
            // destroyed waits in ibv_destroy_cq for this acknowledgement,
            // and a live Conn keeps its CQ alive.
            let conn = lock(&registry).get(&(cq as usize)).and_then(Weak::upgrade);
            // SAFETY: `cq` was returned by ibv_get_cq_event and is not yet
            // destroyed (destroy waits for this ack).
            unsafe { sys::ibv_ack_cq_events(cq, 1) };
            if let Some(conn) = conn {
                conn.drain_cq();
            }
        }
    }
}

/// The completion thread stops: no completion will be applied any more,
/// so every watched connection fails what it has outstanding (a transfer
/// in flight ends with `Canceled` instead of waiting forever).
fn cancel_all(registry: &Registry) {
    let watched: Vec<Arc<dyn Watched>> = {
        let reg = lock(registry);
        let mut seen = std::collections::HashSet::new();
        reg.values()
            .filter_map(Weak::upgrade)
            .filter(|w| seen.insert(Arc::as_ptr(w).cast::<()>() as usize))
            .collect()
    };
    let err = Error::Canceled("the verbs engine shut down".to_owned());
    for w in watched {
        w.cancel(&err);
    }
}

/// Event types of `enum ibv_event_type` that concern one QP or CQ.
const EVENT_CQ_ERR: u32 = 0;
const EVENT_QP_FATAL: u32 = 1;
const EVENT_QP_REQ_ERR: u32 = 2;
const EVENT_QP_ACCESS_ERR: u32 = 3;
const EVENT_DEVICE_FATAL: u32 = 8;

fn event_name(t: u32) -> &'static str {
    match t {
        EVENT_CQ_ERR => "IBV_EVENT_CQ_ERR",
        EVENT_QP_FATAL => "IBV_EVENT_QP_FATAL",
        EVENT_QP_REQ_ERR => "IBV_EVENT_QP_REQ_ERR",
        EVENT_QP_ACCESS_ERR => "IBV_EVENT_QP_ACCESS_ERR",
        EVENT_DEVICE_FATAL => "IBV_EVENT_DEVICE_FATAL",
        9 => "IBV_EVENT_PORT_ACTIVE",
        10 => "IBV_EVENT_PORT_ERR",
        _ => "another asynchronous event",
    }
}

/// Drains the device's asynchronous events; error events break the
/// connection they name (all of them for a fatal device error).
fn async_events(ctx: *mut sys::ibv_context, registry: &Registry) {
    loop {
        let mut ev = std::mem::MaybeUninit::<sys::ibv_async_event>::zeroed();
        // SAFETY: valid context; the descriptor is non-blocking, so this
        // returns -1 when no event is queued.
        if unsafe { sys::ibv_get_async_event(ctx, ev.as_mut_ptr()) } != 0 {
            return;
        }
        let base = ev.as_mut_ptr().cast::<u8>();
        // The event type is read as a plain integer (a value unknown to the
        // bindings' Rust enum must not be materialised as that enum).
        // SAFETY: the struct was filled by the call; the offset is that of
        // a 4-byte C enum field.
        let kind = unsafe {
            base.add(std::mem::offset_of!(sys::ibv_async_event, event_type))
                .cast::<u32>()
                .read()
        };
        // SAFETY: the element union starts the struct; for the QP/CQ events
        // it holds a pointer, otherwise we do not use it.
        let element = unsafe { base.cast::<usize>().read() };
        let name = event_name(kind);
        let targets: Vec<Arc<dyn Watched>> = match kind {
            EVENT_CQ_ERR | EVENT_QP_FATAL | EVENT_QP_REQ_ERR | EVENT_QP_ACCESS_ERR => {
                lock(registry)
                    .get(&element)
                    .and_then(Weak::upgrade)
                    .into_iter()
                    .collect()
            }
            EVENT_DEVICE_FATAL => lock(registry).values().filter_map(Weak::upgrade).collect(),
            _ => Vec::new(),
        };
        // SAFETY: acknowledges the event just received (a QP or CQ being
        // destroyed waits for this).
        unsafe { sys::ibv_ack_async_event(ev.as_mut_ptr()) };
        if targets.is_empty() {
            tracing::debug!(event = name, "verbs asynchronous event");
        }
        for c in targets {
            // Completions already queued carry the precise error: apply them
            // before failing the rest as flushed.
            c.drain_cq();
            tracing::warn!(event = name, peer = %c.peer(), "verbs asynchronous error: breaking the connection");
            c.fail(name);
        }
    }
}
