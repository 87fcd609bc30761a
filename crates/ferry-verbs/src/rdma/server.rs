//! The owner's side: accept control connections, build the passive queue
//! pair each opener targets (with a receive ring for the notifications it
//! SENDs), serve the region table and answer notifications.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferry_core::__private::sync::lock;
use ferry_core::{Error, Result};
use rdma_mummy_sys as sys;
use sideway::ibverbs::completion::{BasicCompletionQueue, CompletionQueue};
use sideway::ibverbs::queue_pair::{BasicQueuePair, QueuePair};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, Notify};

use super::conn::{NOTIFY_RING, NOTIFY_SLOT};
use super::device::{self, Slots};
use super::poller::{Poller, Watched};
use super::Inner;
use crate::handshake;
use crate::negotiate::{Feature, PeerProtocol};
use crate::wire::{self, Msg};

pub(crate) async fn accept_loop(listener: TcpListener, inner: std::sync::Weak<Inner>) {
    loop {
        let (stream, addr) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "verbs control listener: accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Some(engine) = inner.upgrade() else {
            return;
        };
        let _ = stream.set_nodelay(true);
        tokio::spawn(async move {
            let peer = addr.to_string();
            match serve(stream, &peer, engine).await {
                Err(e @ Error::Authentication { .. }) => {
                    tracing::warn!(peer, error = %e, "verbs control connection refused");
                }
                Err(e) => tracing::debug!(peer, error = %e, "verbs control connection ended"),
                Ok(()) => {}
            }
        });
    }
}

async fn serve(mut stream: TcpStream, peer: &str, inner: Arc<Inner>) -> Result<()> {
    let deadline = Duration::from_millis(inner.dev.cfg.connect_timeout_ms);
    // Authentication first: nothing about this engine (queue pair, regions,
    // rkeys) is sent, and no notification is taken, before it succeeds.
    let secret = inner
        .dev
        .cfg
        .secret
        .as_ref()
        .map(ferry_core::Secret::expose);
    let offer = inner.offer();
    let hello = tokio::time::timeout(
        deadline,
        handshake::accept(&mut stream, peer, secret, &offer),
    )
    .await
    .map_err(|_| Error::Timeout {
        operation: "waiting for the verbs authentication and hello".into(),
        peer: Some(peer.to_owned()),
        after: deadline,
    })??;
    let Some(hello) = hello else {
        return Ok(());
    };
    let (remote, name, agreement) = (hello.endpoint, hello.name, hello.agreement);
    // The passive queue pair, its CQ (on the engine's completion channel)
    // and the receive ring for notifications: blocking verbs calls, off the
    // async workers.
    let setup = {
        let dev = Arc::clone(&inner.dev);
        tokio::task::spawn_blocking(move || {
            let cq = dev.create_cq(NOTIFY_RING as u32 + 4, true)?;
            let mut qp = dev.create_qp(&cq, 1, NOTIFY_RING as u32, 1)?;
            let ring = Slots::new(&dev, NOTIFY_RING, NOTIFY_SLOT)?;
            let psn = device::random_psn();
            let local = dev.endpoint(&qp, psn);
            let mtu = device::agree_mtu(local.mtu, remote.mtu);
            dev.connect_qp(&mut qp, psn, &remote, mtu)?;
            Ok::<_, Error>((cq, qp, ring, wire::QpEndpoint { mtu, ..local }))
        })
        .await
        .map_err(|e| Error::Canceled(format!("setting up the passive queue pair: {e}")))
        .and_then(|r| r)
    };
    let (cq, qp, ring, local) = match setup {
        Ok(s) => s,
        Err(e) => {
            let _ = wire::write_msg(
                &mut stream,
                &Msg::Refused {
                    reason: e.to_string(),
                },
            )
            .await;
            return Err(e);
        }
    };
    // Subscribe to region changes before the snapshot so none is missed.
    // The queue to this peer is bounded: a peer that does not read it is
    // disconnected (it reconnects with a fresh table).
    // Without `region_push` the opener is not subscribed: it fetches the
    // table on a miss.
    let (push_tx, mut push_rx) = mpsc::channel::<Msg>(PUSH_QUEUE);
    let kill = Arc::new(Notify::new());
    let id = inner.next_sub.fetch_add(1, Ordering::Relaxed);
    if agreement.features.contains(Feature::RegionPush) {
        inner
            .subscribers()
            .insert(id, (push_tx.clone(), Arc::clone(&kill)));
    }
    let protocol = PeerProtocol::new(peer, false, &agreement);
    tracing::debug!(peer, %protocol, "verbs control channel agreed");
    inner.inbound().insert(id, protocol);
    let _unsub = Unsubscribe(Arc::clone(&inner), id);
    // SAFETY: only the address is used, as a map key.
    let qp_key = unsafe { qp.qp() }.as_ptr() as usize;
    let passive = Arc::new(Passive {
        peer: peer.to_owned(),
        engine: Arc::downgrade(&inner),
        cq,
        qp: Mutex::new(Some(qp)),
        ring,
        answers: push_tx.clone(),
        kill: Arc::clone(&kill),
        poller: Arc::clone(&inner.poller),
        qp_key,
    });
    let weak: std::sync::Weak<dyn Watched> = Arc::downgrade(&passive) as _;
    inner
        .poller
        .watch(&passive.cq, [passive.cq_key(), qp_key], weak)?;
    for slot in 0..NOTIFY_RING {
        passive.post_recv(slot)?;
    }
    let welcome = handshake::welcome(&agreement, local, inner.region_snapshot());
    let (mut rd, mut wr) = stream.into_split();
    wire::write_msg(&mut wr, &welcome)
        .await
        .map_err(|e| Error::io(format!("sending welcome to {peer}"), &e))?;
    tracing::debug!(peer, opener = %name, qpn = local.qpn, "verbs peer connected");
    let writer = tokio::spawn(async move {
        while let Some(m) = push_rx.recv().await {
            if wire::write_msg(&mut wr, &m).await.is_err() {
                return;
            }
        }
    });
    let result = loop {
        let msg = tokio::select! {
            m = wire::read_msg(&mut rd, peer) => m,
            () = kill.notified() => break Err(Error::QueueFull {
                backend: crate::BACKEND.to_owned(),
                queue: ferry_core::Queue::Control,
                what: format!("the control queue to {peer} (it does not read it)"),
                limit: Some(PUSH_QUEUE as u64),
            }),
        };
        match msg {
            Ok(Some(Msg::TableRequest)) => {
                let table = Msg::Table {
                    regions: inner.region_snapshot(),
                };
                if push_tx.try_send(table).is_err() {
                    kill.notify_one();
                }
            }
            Ok(Some(other)) => {
                break Err(Error::Protocol {
                    peer: peer.to_owned(),
                    reason: format!("unexpected frame {other:?}"),
                })
            }
            Ok(None) => break Ok(()),
            Err(e) => break Err(e),
        }
    };
    writer.abort();
    // The passive QP is destroyed when the last reference to `passive`
    // goes (here, or in the completion thread): the opener's QP sees its
    // peer disappear.
    drop(passive);
    result
}

/// Messages queued for one opener's control channel (region changes,
/// table answers, notification answers).
pub(crate) const PUSH_QUEUE: usize = 256;

/// The owner's side of one connection: the passive queue pair, whose
/// receive ring takes the notifications the opener SENDs after its data.
struct Passive {
    peer: String,
    engine: std::sync::Weak<Inner>,
    cq: Arc<BasicCompletionQueue>,
    /// `None` once destroyed (in `Drop`, before the ring is deregistered).
    qp: Mutex<Option<BasicQueuePair>>,
    ring: Slots,
    answers: mpsc::Sender<Msg>,
    kill: Arc<Notify>,
    poller: Arc<Poller>,
    qp_key: usize,
}

impl Passive {
    fn cq_key(&self) -> usize {
        // SAFETY: only the address is used, as a map key.
        unsafe { self.cq.cq() }.as_ptr() as usize
    }

    /// Posts the receive of ring slot `slot`.
    fn post_recv(&self, slot: usize) -> Result<()> {
        let qp = lock(&self.qp);
        let Some(qp) = qp.as_ref() else {
            return Ok(());
        };
        let mut sge = sys::ibv_sge {
            addr: self.ring.addr(slot),
            length: self.ring.slot_len() as u32,
            lkey: self.ring.lkey(),
        };
        let mut wr = sys::ibv_recv_wr {
            wr_id: slot as u64,
            next: std::ptr::null_mut(),
            sg_list: &mut sge,
            num_sge: 1,
        };
        let mut bad = std::ptr::null_mut();
        // SAFETY: the QP is alive (locked); the WR and SGE live until the
        // call returns; the slot lies in the registered ring, which outlives
        // the QP (destroyed first in Drop), and no receive uses it now.
        let rc = unsafe { sys::ibv_post_recv(qp.qp().as_ptr(), &mut wr, &mut bad) };
        if rc != 0 {
            return Err(device::verbs_error(
                "ibv_post_recv",
                &std::io::Error::from_raw_os_error(rc),
            ));
        }
        Ok(())
    }

    /// A notification arrived in `slot` (`len` bytes): queue it or refuse
    /// it, answer the opener, and give the slot back to the device.
    fn on_receive(&self, slot: usize, len: usize) {
        // SAFETY: the receive of `slot` completed; it is reposted below,
        // after this copy.
        let bytes = unsafe { self.ring.read(slot, len) };
        let answer = match wire::decode_notification(&bytes, &self.peer) {
            Ok(n) => match self.engine.upgrade() {
                Some(engine) => match engine.accept_notification(n) {
                    Ok(()) => Msg::NotifyAck,
                    Err((full, reason)) => Msg::Notify { full, reason },
                },
                None => Msg::Notify {
                    full: false,
                    reason: "the engine is shutting down".to_owned(),
                },
            },
            Err(e) => Msg::Notify {
                full: false,
                reason: format!("malformed notification: {e}"),
            },
        };
        if let Err(e) = self.post_recv(slot) {
            tracing::warn!(peer = %self.peer, error = %e, "reposting a notification receive failed");
            self.kill.notify_one();
        }
        // At most NOTIFY_RING answers are outstanding per connection; a
        // full queue means the peer stopped reading: disconnect it.
        if self.answers.try_send(answer).is_err() {
            self.kill.notify_one();
        }
    }
}

impl Watched for Passive {
    fn drain_cq(&self) {
        // SAFETY: the CQ lives as long as `self`.
        let cq = unsafe { self.cq.cq() }.as_ptr();
        // SAFETY: valid CQ; re-arm before draining so no completion is missed.
        unsafe { sys::ibv_req_notify_cq(cq, 0) };
        let mut wcs: [std::mem::MaybeUninit<sys::ibv_wc>; 16] =
            [const { std::mem::MaybeUninit::uninit() }; 16];
        loop {
            // SAFETY: valid CQ; `wcs` has room for 16 entries.
            let n = unsafe { sys::ibv_poll_cq(cq, 16, wcs.as_mut_ptr().cast()) };
            if n <= 0 {
                if n < 0 {
                    self.kill.notify_one();
                }
                return;
            }
            for wc in &wcs[..n as usize] {
                // SAFETY: the first `n` entries were written by ibv_poll_cq.
                let wc = unsafe { wc.assume_init_ref() };
                let slot = wc.wr_id as usize;
                if wc.status == sys::ibv_wc_status::IBV_WC_SUCCESS
                    && wc.opcode == sys::ibv_wc_opcode::IBV_WC_RECV
                    && slot < self.ring.count()
                {
                    self.on_receive(slot, wc.byte_len as usize);
                } else if wc.status != sys::ibv_wc_status::IBV_WC_WR_FLUSH_ERR {
                    tracing::debug!(
                        peer = %self.peer,
                        status = device::wc_status_name(wc.status),
                        "passive queue pair completion in error"
                    );
                    self.kill.notify_one();
                }
            }
        }
    }

    fn fail(&self, _event: &str) {
        self.kill.notify_one();
    }

    fn peer(&self) -> &str {
        &self.peer
    }
}

impl Drop for Passive {
    fn drop(&mut self) {
        self.poller.unwatch(&[self.cq_key(), self.qp_key]);
        // The QP goes before the ring it receives into (a field, dropped
        // after this).
        drop(lock(&self.qp).take());
    }
}

struct Unsubscribe(Arc<Inner>, u64);

impl Drop for Unsubscribe {
    fn drop(&mut self) {
        self.0.subscribers().remove(&self.1);
        self.0.inbound().remove(&self.1);
    }
}
