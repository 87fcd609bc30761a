//! Making a connection to a peer: dialing, the handshake, and the
//! same-host path negotiation (whether payloads move by cross-memory
//! attach on it); then its reader task.

use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use ferry_core::__private::sync::lock;
use ferry_core::{Error, Result};

use super::conn::{ClientStage, Conn, ConnShared, PendingMap};
use super::peer::Peer;
use super::reader::reader_task;
use crate::config::SameHost;
use crate::handshake;
use crate::io::Pace;
use crate::negotiate::{self, Agreement, FeatureOff, FeatureReport, PeerReport};
use crate::stream::Stream;

/// The error for a peer that cannot be reached.
fn connect_error(name: &str, e: &std::io::Error) -> Error {
    Error::SegmentUnavailable {
        name: name.to_owned(),
        reason: format!("cannot connect: {e}"),
    }
}

/// Whether the peer of `stream` can be on this host, judged from
/// addresses alone (for a peer that does not negotiate, which sends no
/// host token): a loopback address, or the address this connection leaves
/// from (Linux routes a connection to one of its own addresses with that
/// address as the source).
fn peer_may_be_local(stream: &Stream) -> bool {
    if stream.is_unix() {
        return true;
    }
    match stream.tcp_addrs().map(|(l, p)| (p, l)) {
        Some((p, l)) => {
            let canon = |ip: std::net::IpAddr| ip.to_canonical();
            canon(p.ip()).is_loopback() || canon(p.ip()) == canon(l.ip())
        }
        None => false,
    }
}

impl Peer {
    /// Dials the peer once (TCP, nodelay, buffers).
    async fn dial(&self) -> Result<Stream> {
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
        Ok(Stream::Tcp(stream))
    }

    /// Dials and runs the handshake (within `connect_timeout`), dialing
    /// once more with an older hello if the target speaks only an older
    /// version this build speaks (remembered for the next connections).
    async fn dial_and_greet(&self) -> Result<(Stream, handshake::Welcome)> {
        let cfg = &self.core.config;
        let features = negotiate::our_features(cfg.feature_settings(), true);
        loop {
            let hello_version = self.hello_version.load(Ordering::Relaxed);
            let mut stream = self.dial().await?;
            match handshake::client(
                &mut stream,
                &self.name,
                &self.core.name,
                cfg.secret.as_ref().map(ferry_core::Secret::expose),
                cfg.connect_timeout,
                hello_version,
                features,
                self.core.host_key.as_ref(),
                self.core.tls.as_deref(),
            )
            .await?
            {
                handshake::ClientOutcome::Welcome(w) => return Ok((stream, w)),
                handshake::ClientOutcome::Redial(v) if v != hello_version => {
                    tracing::debug!(peer = %self.name, version = v, "the target speaks an older version: dialing again with its hello");
                    self.hello_version.store(v, Ordering::Relaxed);
                }
                handshake::ClientOutcome::Redial(v) => {
                    return Err(Error::Protocol {
                        peer: self.name.clone(),
                        reason: format!("the target refused a version-{v} hello it named itself"),
                    })
                }
            }
        }
    }

    pub(crate) async fn connect(&self) -> Result<Conn> {
        let cfg = &self.core.config;
        let (stream, welcome) = self.dial_and_greet().await?;
        *ferry_core::__private::sync::write(&self.table) = Arc::new(welcome.table);
        let agreed = welcome.agreement;
        // Whether to offer the same-host path at all: both sides have it
        // on, and the peer is on this host (both sent the same host token,
        // or, for a peer that does not negotiate, its address is local).
        // A remote peer thus never sees this process's PID, boot id,
        // namespace or addresses, and no area or socket pair is made.
        let local = agreed
            .same_host_token
            .unwrap_or_else(|| peer_may_be_local(&stream));
        let plan = negotiate::same_host_plan(&agreed, local);
        let mut report = FeatureReport::new(&agreed);
        let (stream, cma, staged) = match plan {
            Err(why) => {
                let text = match &why {
                    FeatureOff::DisabledHere(s) => s.to_string(),
                    FeatureOff::DisabledByPeer => "the peer disables it (same_host=off)".to_owned(),
                    other => other.to_string(),
                };
                *lock(&self.path) = Some(format!("tcp ({text})"));
                if cfg.same_host == SameHost::Cma {
                    return Err(Error::SegmentUnavailable {
                        name: self.name.clone(),
                        reason: format!("same_host=cma, but the path cannot apply: {text}"),
                    });
                }
                report.off_all(why);
                (stream, false, None)
            }
            Ok(()) => self.offer_path(stream, &agreed, &mut report).await?,
        };
        let path = match (cma, staged.as_ref().map(|s| s.grants.is_some())) {
            (false, _) => "socket",
            (true, None) => "same-host cma",
            (true, Some(false)) => "same-host staged",
            (true, Some(true)) => "same-host granted",
        };
        *lock(&self.report) = Some(PeerReport {
            peer: self.name.clone(),
            ours: negotiate::VersionRange::OURS,
            theirs: agreed.peer_versions,
            peer_negotiates: agreed.peer_negotiates,
            version: agreed.version,
            features: report.states,
            path: path.to_owned(),
            path_detail: self.path().unwrap_or_default(),
            tls: match &agreed.tls {
                Some(t) => Ok(t.clone()),
                None => Err(agreed
                    .why_off(negotiate::TLS)
                    .unwrap_or(FeatureOff::ThisEngineLacks)),
            },
        });
        self.same_host
            .store(cma, std::sync::atomic::Ordering::Relaxed);
        // The reader: a task that a caller blocked on this connection's
        // answer (a Python thread) drives itself, see ferry_core::assist.
        let reader = ferry_core::assist::Task::new();
        // From here on the runtime hears of the socket only while a task
        // waits on it (see crate::quiet).
        let stream = stream
            .quiet()
            .map_err(|e| Error::io("setting the connection up", &e))?;
        let shared = Arc::new(ConnShared {
            assist: reader.handle(),
            rt: tokio::runtime::Handle::current(),
            answered: tokio::sync::Notify::new(),
            window_waiters: std::sync::atomic::AtomicUsize::new(0),
            stream,
            peer: self.name.clone(),
            pending: Mutex::new(PendingMap::new()),
            write_lock: tokio::sync::Mutex::new(()),
            outbox: Mutex::new(Vec::new()),
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
        let reader = reader
            .spawn(reader_task(
                Arc::clone(&shared),
                cfg.spin,
                cfg.spin_pending,
                idle,
            ))
            .abort_handle();
        Ok(Conn { shared, reader })
    }

    /// Offers the same-host path on a connection that may take it (see
    /// `handshake::offer_same_host`): the control channel and staging
    /// area the agreement allows; returns the stream to use, whether the
    /// path is on, and the staging area with its grants; `report` says
    /// what became of each feature.
    async fn offer_path(
        &self,
        stream: Stream,
        agreed: &Agreement,
        report: &mut FeatureReport,
    ) -> Result<(Stream, bool, Option<ClientStage>)> {
        let cfg = &self.core.config;
        let offer = Offer::new(agreed, cfg.same_host_stage);
        let verdict = handshake::offer_same_host(
            &stream,
            &self.name,
            offer
                .pair
                .as_ref()
                .ok()
                .map(|(_, theirs)| theirs.as_raw_fd()),
            offer.area.as_ref().ok().map(|(a, _)| a.raw_fd()),
            agreed.cred.as_ref(),
            cfg.connect_timeout,
        )
        .await?;
        let (channel, stage, target) = match verdict {
            handshake::SameHostVerdict::Cma {
                channel,
                stage,
                target,
            } => (channel, stage, target),
            handshake::SameHostVerdict::Refused(reason) => {
                tracing::debug!(peer = %self.name, %reason, "same-host path not used");
                *lock(&self.path) = Some(format!("tcp ({reason})"));
                if cfg.same_host == SameHost::Cma {
                    return Err(Error::SegmentUnavailable {
                        name: self.name.clone(),
                        reason: format!("same_host=cma, but the path is refused: {reason}"),
                    });
                }
                report.off_all(FeatureOff::Refused(reason));
                return Ok((stream, false, None));
            }
        };
        // The target holds its own copy of its end now (or never will):
        // ours of it goes.
        let ours = offer.pair.map(|(ours, _theirs)| ours);
        // Not offered: why not; not taken: the target's reason.
        report.same_host_on(
            agreed,
            negotiate::offered(
                &offer.channel,
                ours.as_ref().map(|_| ()),
                channel.as_ref().copied(),
            ),
            negotiate::offered(
                &offer.stage,
                offer.area.as_ref().map(|_| ()),
                stage.as_ref().copied(),
            ),
        );
        let mut notes = Vec::new();
        let stream =
            self.control_stream(ours.and_then(|u| channel.map(|()| u)), stream, &mut notes);
        let staged = match (offer.area, stage) {
            (Ok((area, min)), Ok(())) => {
                Some(self.client_stage(area, min, offer.grants, target, report))
            }
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
        Ok((stream, true, staged))
    }

    /// The stream the connection continues on: the control channel the
    /// target took (`unix`: ours of it; the target closes the TCP
    /// connection), or `stream` if there is none to use (why: in `notes`).
    fn control_stream(
        &self,
        unix: std::result::Result<std::os::unix::net::UnixStream, String>,
        stream: Stream,
        notes: &mut Vec<String>,
    ) -> Stream {
        let unix = unix.and_then(|u| {
            u.set_nonblocking(true)
                .and_then(|()| tokio::net::UnixStream::from_std(u))
                .map_err(|e| format!("the channel: {e}"))
        });
        match unix {
            Ok(u) => Stream::Unix(u),
            Err(why) => {
                tracing::debug!(peer = %self.name, %why, "same-host control on TCP");
                notes.push(format!("control on the tcp socket: {why}"));
                stream
            }
        }
    }

    /// The staging area the target mapped (frames of at least `min`
    /// bytes go through it), with the target's grants if they are agreed
    /// (`grants`: why not) and open (`target`: the process they reach).
    fn client_stage(
        &self,
        area: crate::same_host::stage::Area,
        min: usize,
        grants: Option<FeatureOff>,
        target: Option<std::result::Result<crate::same_host::cma::Initiator, String>>,
        report: &mut FeatureReport,
    ) -> ClientStage {
        let cfg = &self.core.config;
        let area = Arc::new(area);
        let grants = match grants {
            Some(why) => Err(why),
            None => crate::same_host::grant::ClientGrants::open(Arc::clone(&area), target)
                .map_err(FeatureOff::Refused),
        };
        if let Err(why) = &grants {
            tracing::debug!(peer = %self.name, %why, "no granted copies");
        }
        report.set(negotiate::GRANTS, grants.as_ref().err().cloned());
        ClientStage::new(
            area,
            grants.ok().map(Arc::new),
            min,
            cfg.stall_timeout.min(cfg.request_timeout),
        )
    }
}

/// What this side offers with the same-host path, as far as the
/// agreement allows (each feature: `None`, agreed, or why not): the
/// control channel, a Unix socket pair whose other end the target takes
/// over (see `cma`; without one the connection stays on TCP); the staging
/// area (see `stage`); and the grants, which ride on the area (a page
/// after its rings).
struct Offer {
    channel: Option<FeatureOff>,
    stage: Option<FeatureOff>,
    grants: Option<FeatureOff>,
    /// Ours and the target's end of the channel, or why none.
    pair: std::result::Result<
        (
            std::os::unix::net::UnixStream,
            std::os::unix::net::UnixStream,
        ),
        String,
    >,
    /// The area and the least frame that goes through it, or why none.
    area: std::result::Result<(crate::same_host::stage::Area, usize), String>,
}

impl Offer {
    /// Makes what `agreed` allows (`stage_min`: the `same_host_stage`
    /// setting).
    fn new(agreed: &Agreement, stage_min: Option<usize>) -> Offer {
        let channel = agreed.why_off(negotiate::CONTROL_CHANNEL);
        let stage = agreed
            .why_off(negotiate::STAGING)
            .or_else(|| agreed.why_off(negotiate::ACK_LANE));
        let grants = agreed.why_off(negotiate::GRANTS);
        let with_grants = stage.is_none() && grants.is_none();
        let pair = match &channel {
            None => std::os::unix::net::UnixStream::pair().map_err(|e| format!("socketpair: {e}")),
            Some(FeatureOff::DisabledHere(s)) => Err(s.to_string()),
            Some(why) => Err(why.to_string()),
        };
        let area = match (&stage, stage_min) {
            (None, Some(min)) => {
                crate::same_host::stage::Area::create(with_grants).map(|a| (a, min))
            }
            (Some(FeatureOff::DisabledHere(s)), _) => Err(s.to_string()),
            (Some(why), _) => Err(why.to_string()),
            (None, None) => Err("same_host_stage=off".to_owned()),
        };
        Offer {
            channel,
            stage,
            grants,
            pair,
            area,
        }
    }
}
