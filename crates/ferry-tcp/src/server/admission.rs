//! Admission: the handshake budget and its per-source eviction, the
//! established connections and their per-source share, and the accept loop
//! that runs each inbound connection's handshake before serving it.

use super::serve::{serve, serve_on_thread, ConnState, Served};
use super::*;

impl Core {
    fn pick_evictable(&self) -> Option<Arc<Live>> {
        let live = lock(&self.live);
        let mut per_source: HashMap<IpAddr, usize> = HashMap::new();
        for l in live.values() {
            *per_source.entry(l.source).or_default() += 1;
        }
        let now = self.now_ms();
        let min = self.config.evict_idle.as_millis() as u64;
        live.values()
            .filter(|l| !l.evicted.load(Ordering::Acquire))
            .filter_map(|l| {
                let since = l.idle_since.load(Ordering::Acquire);
                let idle = now.saturating_sub(since);
                let n = per_source.get(&l.source).copied().unwrap_or(0);
                (since != 0 && idle >= min).then_some((n, idle, l))
            })
            .max_by_key(|(n, idle, _)| (*n, *idle))
            .map(|(_, _, l)| Arc::clone(l))
    }

    /// An idle connection of `source` not already chosen for eviction (the
    /// longest idle).
    fn idle_of(&self, source: IpAddr) -> Option<Arc<Live>> {
        let live = lock(&self.live);
        let now = self.now_ms();
        live.values()
            .filter(|l| l.source == source && !l.evicted.load(Ordering::Acquire))
            .filter_map(|l| {
                let since = l.idle_since.load(Ordering::Acquire);
                (since != 0).then_some((now.saturating_sub(since), l))
            })
            .max_by_key(|(idle, _)| *idle)
            .map(|(_, l)| Arc::clone(l))
    }

    /// Connections of `source` established now (not being evicted).
    fn count_of(&self, source: IpAddr) -> usize {
        lock(&self.live)
            .values()
            .filter(|l| l.source == source && !l.evicted.load(Ordering::Acquire))
            .count()
    }

    /// Admits a connection that completed its handshake, evicting an idle
    /// one if `max_inbound` are established, or one of its source's own if
    /// that source holds its share ([`TcpConfig::per_source_limit`]);
    /// `Err(reason)`: refuse it (`Busy`).
    fn admit(&self, source: IpAddr) -> Result<Admitted<'_>, &'static str> {
        if self.count_of(source) >= self.config.per_source_limit() {
            match self.idle_of(source) {
                Some(victim) if !victim.evicted.swap(true, Ordering::AcqRel) => {
                    victim.evict.notify_one();
                }
                _ => return Err("too many connections from this source"),
            }
        }
        if self.established.fetch_add(1, Ordering::AcqRel) >= self.config.max_inbound {
            match self.pick_evictable() {
                Some(victim) if !victim.evicted.swap(true, Ordering::AcqRel) => {
                    victim.evict.notify_one();
                }
                _ => {
                    self.established.fetch_sub(1, Ordering::AcqRel);
                    return Err("too many connections");
                }
            }
        }
        let id = self.next_live.fetch_add(1, Ordering::Relaxed);
        let live = Arc::new(Live {
            source,
            idle_since: AtomicU64::new(0),
            evicted: AtomicBool::new(false),
            evict: Notify::new(),
        });
        lock(&self.live).insert(id, Arc::clone(&live));
        Ok(Admitted {
            core: self,
            id,
            live,
        })
    }
}

/// Inbound connections in the handshake, by source address; each can be
/// evicted through its sender.
#[derive(Default)]
struct Handshakes {
    next: u64,
    total: usize,
    by_source: HashMap<IpAddr, BTreeMap<u64, oneshot::Sender<()>>>,
}

impl Handshakes {
    fn add(&mut self, ip: IpAddr) -> (u64, oneshot::Receiver<()>) {
        let (tx, rx) = oneshot::channel();
        self.next += 1;
        self.by_source.entry(ip).or_default().insert(self.next, tx);
        self.total += 1;
        (self.next, rx)
    }

    fn remove(&mut self, ip: IpAddr, id: u64) {
        if let Some(m) = self.by_source.get_mut(&ip) {
            if m.remove(&id).is_some() {
                self.total -= 1;
            }
            if m.is_empty() {
                self.by_source.remove(&ip);
            }
        }
    }

    /// Evicts the oldest handshake of the source holding the most; false
    /// if there was none.
    fn evict_one(&mut self) -> bool {
        let Some(ip) = self
            .by_source
            .iter()
            .max_by_key(|(_, m)| m.len())
            .map(|(ip, _)| *ip)
        else {
            self.total = 0;
            return false;
        };
        if let Some(m) = self.by_source.get_mut(&ip) {
            if let Some((_, tx)) = m.pop_first() {
                self.total -= 1;
                let _ = tx.send(());
            }
            if m.is_empty() {
                self.by_source.remove(&ip);
            }
        }
        true
    }
}

/// The "source" a connection counts against for handshake fairness: its
/// IPv4 address, or the /64 prefix of its IPv6 address (one host commonly
/// holds a whole /64).
fn source_of(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let bits = u128::from(v6) & !((1u128 << 64) - 1);
                IpAddr::V6(std::net::Ipv6Addr::from(bits))
            }
        },
        v4 => v4,
    }
}

/// Refuses a connection with `Busy` without waiting (a fresh socket's send
/// buffer is empty, so the rejection fits) and closes it.
fn refuse_now(stream: TcpStream, reason: &str) {
    let _ = stream.try_write(&handshake::reject_bytes(Status::Busy, reason));
    let _ = socket2::SockRef::from(&stream).shutdown(std::net::Shutdown::Write);
}

/// Accepts connections until aborted; dropping this future aborts every
/// connection it serves.
pub async fn accept_loop(listener: TcpListener, core: Arc<Core>) {
    let mut conns = JoinSet::new();
    let handshakes = Arc::new(Mutex::new(Handshakes::default()));
    loop {
        let (stream, addr) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        while conns.try_join_next().is_some() {}
        if core.established() >= core.config.max_inbound && core.pick_evictable().is_none() {
            tracing::debug!(%addr, limit = core.config.max_inbound, "refusing connection: too many established connections");
            refuse_now(stream, "too many connections");
            continue;
        }
        let (id, evicted) = {
            let mut h = lock(&handshakes);
            while h.total >= core.config.max_handshakes && h.evict_one() {}
            h.add(source_of(addr.ip()))
        };
        let core = Arc::clone(&core);
        let handshakes = Arc::clone(&handshakes);
        conns.spawn(async move {
            let r = serve_conn(stream, addr, &core, &handshakes, id, evicted).await;
            if let Err(e) = r {
                tracing::debug!(peer = %addr, error = %e, "inbound connection ended");
            }
        });
    }
}

/// An admitted connection; leaves the established set when dropped.
struct Admitted<'a> {
    core: &'a Core,
    id: u64,
    live: Arc<Live>,
}

impl Drop for Admitted<'_> {
    fn drop(&mut self) {
        lock(&self.core.live).remove(&self.id);
        self.core.established.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Runs the handshake of one inbound connection (within its budget), then
/// serves it.
async fn serve_conn(
    stream: TcpStream,
    addr: SocketAddr,
    core: &Arc<Core>,
    handshakes: &Mutex<Handshakes>,
    id: u64,
    mut evicted: oneshot::Receiver<()>,
) -> Result<(), Error> {
    let _ = stream.set_nodelay(true);
    let mut stream = Stream::Tcp(stream);
    let cfg = &core.config;
    let peer = addr.to_string();
    let hs = tokio::select! {
        r = tokio::time::timeout(
            cfg.handshake_timeout,
            handshake::server(
                &mut stream,
                &peer,
                &core.name,
                cfg.secret.as_ref().map(ferry_core::Secret::expose),
                cfg.handshake_timeout,
                crate::negotiate::our_features(cfg.feature_settings(), false),
                core.host_key.as_ref(),
                core.tls.as_deref(),
            ),
        ) => Some(r),
        _ = &mut evicted => None,
    };
    lock(handshakes).remove(source_of(addr.ip()), id);
    let verified = match hs {
        None => {
            handshake::send_reject(
                &stream,
                Status::Busy,
                "too many connections in the handshake",
                REJECT_TIMEOUT,
            )
            .await;
            return Err(Error::SegmentUnavailable {
                name: peer,
                reason: "evicted from the handshake budget".to_owned(),
            });
        }
        Some(Err(_)) => {
            return Err(Error::Timeout {
                operation: "handshake".to_owned(),
                peer: Some(peer),
                after: cfg.handshake_timeout,
            })
        }
        Some(Ok(r)) => r?,
    };
    let mut verified = verified;
    let admitted = match core.admit(source_of(addr.ip())) {
        Ok(a) => a,
        Err(why) => {
            handshake::send_reject(&stream, Status::Busy, why, REJECT_TIMEOUT).await;
            return Err(Error::SegmentUnavailable {
                name: peer,
                reason: format!("refused: {why}"),
            });
        }
    };
    if core.is_closed() {
        return Err(Error::SegmentUnavailable {
            name: peer,
            reason: "the engine shut down".to_owned(),
        });
    }
    handshake::send_welcome(
        &stream,
        &peer,
        &verified,
        cfg.idle_timeout,
        core.table_bytes(),
        cfg.handshake_timeout,
    )
    .await?;
    let served = core.served.peer(&verified.name);
    let peer = format!("{} ({peer})", verified.name.escape_default());
    let agreed = verified.agreement.clone();
    let cred = verified.cred.take();
    tracing::debug!(
        %peer,
        version = agreed.version,
        peer_versions = %agreed.peer_versions,
        negotiated = agreed.peer_negotiates,
        "peer connected"
    );
    // From here on the runtime hears of the socket only while a task waits
    // on it (see crate::quiet).
    let stream = stream
        .quiet()
        .map_err(|e| Error::io("setting the connection up", &e))?;
    let terms = ferry_tcp_proto::target::SameHostTerms::new(
        cfg.same_host != SameHost::Off,
        &agreed,
        !stream.is_unix(),
    );
    let first = ConnState {
        rd: FrameReader::new(cfg.spin, core.pace()),
        conn: ferry_tcp_proto::target::TargetConn::with_same_host(terms),
        cma_pid: None,
        stage: None,
        agreed,
        cred,
        served,
    };
    match serve(stream, &peer, core, &admitted.live, first).await? {
        Served::Closed => Ok(()),
        Served::ToThread(stream, st) => {
            let (core, live) = (Arc::clone(core), Arc::clone(&admitted.live));
            serve_on_thread(stream, peer, core, live, *st).await
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handshake_sources_and_eviction() {
        let a: IpAddr = "2001:db8::1".parse().unwrap();
        let b: IpAddr = "2001:db8::ffff:1".parse().unwrap();
        assert_eq!(source_of(a), source_of(b), "one /64, one source");
        let m: IpAddr = "::ffff:10.0.0.1".parse().unwrap();
        assert_eq!(source_of(m), "10.0.0.1".parse::<IpAddr>().unwrap());

        // The source holding the most slots loses its oldest one.
        let mut h = Handshakes::default();
        let x: IpAddr = "10.0.0.1".parse().unwrap();
        let y: IpAddr = "10.0.0.2".parse().unwrap();
        let (_, mut legit) = h.add(y);
        let (_, mut first) = h.add(x);
        let (_, mut second) = h.add(x);
        assert!(h.evict_one());
        assert!(first.try_recv().is_ok(), "the oldest of the biggest source");
        assert!(second.try_recv().is_err() && legit.try_recv().is_err());
        assert_eq!(h.total, 2);
        assert!(h.evict_one() && h.evict_one() && !h.evict_one());
        assert_eq!(h.total, 0);
    }
}
