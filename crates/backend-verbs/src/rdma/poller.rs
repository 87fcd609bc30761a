//! The completion thread: sleeps in `poll(2)` on the completion channel (and
//! a wake-up pipe), then re-arms and drains every CQ that signalled. No Tokio
//! worker ever blocks on the device and nothing spins while idle.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::thread::JoinHandle;

use rdma_mummy_sys as sys;
use sideway::ibverbs::completion::{BasicCompletionQueue, CompletionChannel};
use transport_core::{Error, Result};

use super::conn::Conn;

type Registry = Arc<Mutex<HashMap<usize, Weak<Conn>>>>;

pub(crate) struct Poller {
    registry: Registry,
    wake_tx: OwnedFd,
    stop: Arc<AtomicBool>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Poller {
    pub(crate) fn start(channel: Arc<CompletionChannel>) -> Result<Arc<Poller>> {
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
                .spawn(move || run(channel, wake_rx, registry, stop))
                .map_err(|e| Error::io("starting the completion thread", &e))?
        };
        Ok(Arc::new(Poller {
            registry,
            wake_tx,
            stop,
            thread: Mutex::new(Some(thread)),
        }))
    }

    /// Routes the events of `cq` to `conn` and arms the CQ.
    pub(crate) fn watch(&self, cq: &BasicCompletionQueue, conn: &Arc<Conn>) -> Result<()> {
        lock(&self.registry).insert(conn.cq_key(), Arc::downgrade(conn));
        Conn::arm_cq(cq)
    }

    pub(crate) fn unwatch(&self, key: usize) {
        lock(&self.registry).remove(&key);
    }

    /// Stops the thread and waits for it.
    pub(crate) fn stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
        // SAFETY: writing one byte from a valid buffer to our own pipe.
        unsafe { libc::write(self.wake_tx.as_raw_fd(), [1u8].as_ptr().cast(), 1) };
        if let Some(t) = lock(&self.thread).take() {
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
    channel: Arc<CompletionChannel>,
    wake_rx: OwnedFd,
    registry: Registry,
    stop: Arc<AtomicBool>,
) {
    let chan_fd = channel.as_raw_fd();
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
        ];
        // SAFETY: `fds` is a valid array of two pollfd; infinite timeout.
        let rc = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
        if rc < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            tracing::error!(error = %e, "poll on the completion channel failed; completion thread stops");
            return;
        }
        if stop.load(Ordering::SeqCst) {
            return;
        }
        if fds[1].revents != 0 {
            let mut buf = [0u8; 16];
            // SAFETY: reading into a valid buffer from our own non-blocking pipe.
            unsafe { libc::read(wake_rx.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
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
