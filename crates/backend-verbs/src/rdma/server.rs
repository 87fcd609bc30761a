//! The owner's side: accept control connections, build the passive queue
//! pair each opener targets, serve the region table and take notifications.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use transport_core::{Error, Notification, Result};

use super::device;
use super::Inner;
use crate::auth;
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
    let secret = inner.dev.cfg.secret.as_deref();
    let handshake = async {
        auth::target(&mut stream, peer, secret).await?;
        wire::read_msg_max(&mut stream, peer, wire::HANDSHAKE_MAX_FRAME).await
    };
    let hello = tokio::time::timeout(deadline, handshake)
        .await
        .map_err(|_| Error::Timeout {
            operation: "waiting for the verbs authentication and hello".into(),
            peer: Some(peer.to_owned()),
            after: deadline,
        })??;
    let (remote, name) = match hello {
        Some(Msg::Hello {
            version,
            endpoint,
            name,
        }) => {
            if version != wire::VERSION {
                let reason = format!(
                    "protocol version {version} is not supported (this engine speaks {})",
                    wire::VERSION
                );
                let _ = wire::write_msg(
                    &mut stream,
                    &Msg::Refused {
                        reason: reason.clone(),
                    },
                )
                .await;
                return Err(Error::Protocol {
                    peer: peer.to_owned(),
                    reason,
                });
            }
            (endpoint, name)
        }
        Some(other) => {
            return Err(Error::Protocol {
                peer: peer.to_owned(),
                reason: format!("expected Hello, got {other:?}"),
            })
        }
        None => return Ok(()),
    };
    let dev = Arc::clone(&inner.dev);
    let setup = (|| {
        let cq = dev.create_cq(4, false)?;
        let mut qp = dev.create_qp(&cq, 1, 1)?;
        let psn = device::random_psn();
        let local = dev.endpoint(&qp, psn);
        let mtu = device::agree_mtu(local.mtu, remote.mtu);
        dev.connect_qp(&mut qp, psn, &remote, mtu)?;
        Ok::<_, Error>((cq, qp, wire::QpEndpoint { mtu, ..local }))
    })();
    let (_cq, _qp, local) = match setup {
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
    let (push_tx, mut push_rx) = mpsc::unbounded_channel::<Msg>();
    let id = inner.next_sub.fetch_add(1, Ordering::Relaxed);
    inner.subscribers().insert(id, push_tx.clone());
    let _unsub = Unsubscribe(Arc::clone(&inner), id);
    let welcome = Msg::Welcome {
        endpoint: local,
        regions: inner.region_snapshot(),
    };
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
        match wire::read_msg(&mut rd, peer).await {
            Ok(Some(Msg::TableRequest)) => {
                let _ = push_tx.send(Msg::Table {
                    regions: inner.region_snapshot(),
                });
            }
            Ok(Some(Msg::Notify { name, message })) => {
                let n = Notification::new(name, message);
                match n.validate() {
                    Ok(()) => {
                        inner.push_notification(n);
                        let _ = push_tx.send(Msg::NotifyAck);
                    }
                    Err(e) => {
                        break Err(Error::Protocol {
                            peer: peer.to_owned(),
                            reason: e.to_string(),
                        })
                    }
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
    // The passive QP and CQ are dropped here: the opener's QP sees its
    // peer disappear.
    result
}

struct Unsubscribe(Arc<Inner>, u64);

impl Drop for Unsubscribe {
    fn drop(&mut self) {
        self.0.subscribers().remove(&self.1);
    }
}
