//! Making a connection to a peer: dialing, the handshake, and the
//! same-host path negotiation (whether payloads move by cross-memory
//! attach on it); then its reader task.

use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use transport_core::raw::lock;
use transport_core::{Error, Result};

use super::conn::{ClientStage, Conn, ConnShared, PendingMap};
use super::peer::Peer;
use super::reader::reader_task;
use crate::cma::SameHost;
use crate::handshake;
use crate::io::Pace;
use crate::stream::Stream;

/// The error for a peer that cannot be reached.
fn connect_error(name: &str, e: &std::io::Error) -> Error {
    Error::SegmentUnavailable {
        name: name.to_owned(),
        reason: format!("cannot connect: {e}"),
    }
}

impl Peer {
    pub(crate) async fn connect(&self) -> Result<Conn> {
        let cfg = &self.core.config;
        let addr = tokio::net::lookup_host(&self.name)
            .await
            .map_err(|e| connect_error(&self.name, &e))?
            .next()
            .ok_or_else(|| Error::SegmentUnavailable {
                name: self.name.clone(),
                reason: "the name resolves to no address".to_owned(),
            })?;
        let sock = if addr.is_ipv4() {
            tokio::net::TcpSocket::new_v4()
        } else {
            tokio::net::TcpSocket::new_v6()
        }
        .map_err(|e| Error::io("creating a socket", &e))?;
        if let Some(n) = cfg.socket_buffer {
            let _ = sock.set_send_buffer_size(n as u32);
            let _ = sock.set_recv_buffer_size(n as u32);
        }
        let stream = sock
            .connect(addr)
            .await
            .map_err(|e| connect_error(&self.name, &e))?;
        let _ = stream.set_nodelay(true);
        let stream = Stream::Tcp(stream);
        let welcome = handshake::client(
            &stream,
            &self.name,
            &self.core.name,
            cfg.secret.as_deref(),
            cfg.connect_timeout,
        )
        .await?;
        *transport_core::raw::write(&self.table) = Arc::new(welcome.table);
        let mut staged = None;
        let (stream, cma) = match cfg.same_host {
            SameHost::Off => {
                *lock(&self.path) = Some("tcp (same_host=off)".to_owned());
                (stream, false)
            }
            mode => {
                // The control channel offered to the target: a Unix socket
                // pair whose other end it takes over (see `cma`). Without
                // one the connection stays on TCP.
                let pair = if cfg.same_host_unix {
                    std::os::unix::net::UnixStream::pair().map_err(|e| format!("socketpair: {e}"))
                } else {
                    Err("same_host_control=tcp".to_owned())
                };
                let offered = pair.as_ref().ok().map(|(_, theirs)| theirs.as_raw_fd());
                // The staging area offered with it (see `stage`).
                let area = match cfg.same_host_stage {
                    Some(min) => crate::stage::Area::create().map(|a| (a, min)),
                    None => Err("same_host_stage=off".to_owned()),
                };
                let verdict = handshake::offer_same_host(
                    &stream,
                    &self.name,
                    offered,
                    area.as_ref().ok().map(|(a, _)| a.raw_fd()),
                    cfg.connect_timeout,
                )
                .await?;
                // The target holds its own copy of its end now (or never
                // will): ours of it goes.
                let ours = pair.map(|(ours, _theirs)| ours);
                match verdict {
                    handshake::SameHostVerdict::Cma { channel, stage } => {
                        // Not offered: why not; not taken: the target's reason.
                        let unix = ours.and_then(|u| channel.map(|()| u));
                        let mut notes = Vec::new();
                        let stream = match unix.and_then(|u| {
                            u.set_nonblocking(true)
                                .and_then(|()| tokio::net::UnixStream::from_std(u))
                                .map_err(|e| format!("the channel: {e}"))
                        }) {
                            // The target closes the TCP connection.
                            Ok(u) => Stream::Unix(u),
                            Err(why) => {
                                tracing::debug!(peer = %self.name, %why, "same-host control on TCP");
                                notes.push(format!("control on the tcp socket: {why}"));
                                stream
                            }
                        };
                        staged = match (area, stage) {
                            (Ok((area, min)), Ok(())) => Some(ClientStage::new(
                                area,
                                min,
                                cfg.stall_timeout.min(cfg.request_timeout),
                            )),
                            (Err(why), _) | (Ok(_), Err(why)) => {
                                if cfg.same_host_stage.is_some() {
                                    tracing::debug!(peer = %self.name, %why, "no staging area");
                                    notes.push(format!("no staging: {why}"));
                                }
                                None
                            }
                        };
                        *lock(&self.path) = Some(if notes.is_empty() {
                            "cma".to_owned()
                        } else {
                            format!("cma ({})", notes.join("; "))
                        });
                        (stream, true)
                    }
                    handshake::SameHostVerdict::Refused(reason) => {
                        tracing::debug!(peer = %self.name, %reason, "same-host path not used");
                        *lock(&self.path) = Some(format!("tcp ({reason})"));
                        if mode == SameHost::Cma {
                            return Err(Error::SegmentUnavailable {
                                name: self.name.clone(),
                                reason: format!("same_host=cma, but the path is refused: {reason}"),
                            });
                        }
                        (stream, false)
                    }
                }
            }
        };
        self.same_host
            .store(cma, std::sync::atomic::Ordering::Relaxed);
        let shared = Arc::new(ConnShared {
            stream,
            peer: self.name.clone(),
            pending: Mutex::new(PendingMap::default()),
            write_lock: tokio::sync::Mutex::new(()),
            next_id: AtomicU64::new(1),
            dead: AtomicBool::new(false),
            retired: AtomicBool::new(false),
            pace: Pace {
                stall: cfg.stall_timeout,
                min_rate: cfg.min_rate,
            },
            born: Instant::now(),
            last_rx: AtomicU64::new(0),
            cma,
            stage: staged,
            activity_us: AtomicU64::new(0),
        });
        // Retire idle connections well before the target's idle deadline.
        let idle = welcome.idle.map(|d| d / 2);
        let reader = tokio::spawn(reader_task(
            Arc::clone(&shared),
            cfg.spin,
            cfg.spin_pending,
            idle,
        ))
        .abort_handle();
        Ok(Conn { shared, reader })
    }
}
