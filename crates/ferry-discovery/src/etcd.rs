//! The etcd implementation (feature `etcd`).

use std::fmt::Display;
use std::future::Future;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, PutOptions, Txn, TxnOp, TxnOpResponse,
    WatchOptions,
};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

use crate::{
    segment_key, Descriptor, Error, Registration, Result, SegmentEvent, BACKEND, DEFAULT_TIMEOUT,
};

/// What every operation shares: the client, the endpoints (for messages)
/// and the per-request timeout.
#[derive(Clone)]
struct Ctx {
    client: Client,
    endpoints: Arc<str>,
    timeout: Duration,
}

impl Ctx {
    fn down(&self, what: &str, why: impl Display) -> Error {
        Error::Unavailable {
            backend: BACKEND.to_owned(),
            reason: format!("{what}: etcd at {} failed: {why}", self.endpoints),
        }
    }

    /// Runs one etcd request, bounded by the timeout.
    async fn call<T>(
        &self,
        what: &str,
        f: impl Future<Output = std::result::Result<T, etcd_client::Error>>,
    ) -> Result<T> {
        match tokio::time::timeout(self.timeout, f).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(self.down(what, e)),
            Err(_) => Err(self.down(what, format_args!("no answer within {:?}", self.timeout))),
        }
    }
}

fn conflict(name: &str, key: &str, holder: i64) -> Error {
    Error::InvalidArgument(format!(
        "segment {name:?} is already published in etcd at {key} by another engine \
         (lease {holder:x}); choose another name, or wait until that engine shuts down \
         or its lease expires"
    ))
}

/// The lease id as etcdctl prints it.
fn hex(lease: i64) -> String {
    format!("{lease:x}")
}

/// A connection to etcd for publishing, looking up and watching segments.
///
/// Cheap to clone; every clone shares one gRPC channel.
#[derive(Clone)]
pub struct EtcdDiscovery {
    ctx: Ctx,
    prefix: String,
    lease_ttl_secs: i64,
}

impl std::fmt::Debug for EtcdDiscovery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdDiscovery")
            .field("endpoints", &self.ctx.endpoints)
            .field("prefix", &self.prefix)
            .field("lease_ttl_secs", &self.lease_ttl_secs)
            .finish()
    }
}

impl EtcdDiscovery {
    /// Connects to etcd at `endpoints` (`host:port` or `http://host:port`)
    /// with [`DEFAULT_TIMEOUT`] for connecting and for each request.
    /// `lease_ttl` is rounded up to whole seconds (etcd's unit); etcd may
    /// grant more (it raises TTLs below its minimum, 2 s with default
    /// election settings).
    ///
    /// Fails with [`Error::Unavailable`] when no endpoint answers within
    /// the timeout, [`Error::InvalidArgument`] for no endpoint or a zero TTL.
    pub async fn connect<S: AsRef<str>>(
        endpoints: &[S],
        prefix: &str,
        lease_ttl: Duration,
    ) -> Result<Self> {
        Self::connect_with_timeout(endpoints, prefix, lease_ttl, DEFAULT_TIMEOUT).await
    }

    /// [`EtcdDiscovery::connect`] with a timeout of its own for connecting
    /// and for each request.
    pub async fn connect_with_timeout<S: AsRef<str>>(
        endpoints: &[S],
        prefix: &str,
        lease_ttl: Duration,
        timeout: Duration,
    ) -> Result<Self> {
        let eps: Vec<String> = endpoints.iter().map(|e| e.as_ref().to_owned()).collect();
        if eps.is_empty() {
            return Err(Error::InvalidArgument("no etcd endpoint given".into()));
        }
        if lease_ttl.is_zero() {
            return Err(Error::InvalidArgument("the etcd lease TTL is zero".into()));
        }
        let lease_ttl_secs = lease_ttl.as_secs() as i64 + i64::from(lease_ttl.subsec_nanos() > 0);
        let endpoints: Arc<str> = eps.join(",").into();
        let unavailable = |why: String| Error::Unavailable {
            backend: BACKEND.to_owned(),
            reason: format!("cannot connect to etcd at {endpoints}: {why}"),
        };
        let options = ConnectOptions::new()
            .with_connect_timeout(timeout)
            // A hung etcd (not a closed connection) ends the open streams
            // (keep-alive, watch) within 10 s plus the timeout. Not more
            // often, and not while idle: etcd's gRPC server refuses pings
            // closer than 5 s (--grpc-keepalive-min-time) or without an open
            // stream with GOAWAY "too_many_pings", which drops the streams.
            .with_keep_alive(Duration::from_secs(10), timeout)
            .with_keep_alive_while_idle(false);
        // One deadline for building the client and the first answer (the
        // channel connects lazily: ask something to know etcd is there).
        let attempt = async {
            let client = Client::connect(&eps, Some(options)).await?;
            client.clone().status().await?;
            Ok::<_, etcd_client::Error>(client)
        };
        let client = match tokio::time::timeout(timeout, attempt).await {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => return Err(unavailable(e.to_string())),
            Err(_) => return Err(unavailable(format!("no answer within {timeout:?}"))),
        };
        let ctx = Ctx {
            client,
            endpoints,
            timeout,
        };
        Ok(EtcdDiscovery {
            ctx,
            prefix: prefix.trim_end_matches('/').to_owned(),
            lease_ttl_secs: lease_ttl_secs.max(1),
        })
    }

    /// The key prefix (without a trailing `/`).
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The lease TTL publications ask for (whole seconds).
    pub fn lease_ttl(&self) -> Duration {
        Duration::from_secs(self.lease_ttl_secs as u64)
    }

    /// Publishes `descriptor` at `<prefix>/segments/<name>`, bound to a new
    /// lease, if no one holds that name: the key is created in one etcd
    /// transaction that compares its create revision with 0, so of two
    /// engines racing for one name exactly one wins; the other gets
    /// [`Error::InvalidArgument`] naming the segment, the key and the
    /// lease that holds it.
    ///
    /// A background task (on the current tokio runtime) keeps the lease
    /// alive (every third of its TTL) and, when etcd comes back after an
    /// outage, re-publishes: it keeps the lease if it is still alive, else
    /// binds the key to a new one (creating it again if it expired
    /// meanwhile). The key is removed by [`Publication::shutdown`], by
    /// dropping the [`Publication`] (best effort), or by etcd when the
    /// lease expires (the process died or lost etcd for longer than the
    /// TTL).
    pub async fn publish(&self, descriptor: &Descriptor) -> Result<Publication> {
        descriptor.validate()?;
        let name = descriptor.name.clone();
        let key = segment_key(&self.prefix, &name);
        let value = descriptor.to_json();
        let (lease, granted) = grant(&self.ctx, &name, self.lease_ttl_secs).await?;
        if let Err(e) = create(&self.ctx, &name, &key, &value, lease).await {
            let mut c = self.ctx.client.clone();
            let _ = self.ctx.call("revoke", c.lease_revoke(lease)).await;
            return Err(e);
        }
        let current = Arc::new(AtomicI64::new(lease));
        let (stop_tx, stop_rx) = oneshot::channel();
        let task = tokio::spawn(keeper(
            self.ctx.clone(),
            Published {
                name: name.clone(),
                key: key.clone(),
                value,
                ttl_secs: self.lease_ttl_secs,
                lease: current.clone(),
            },
            stop_rx,
        ));
        Ok(Publication {
            name,
            key,
            granted: Duration::from_secs(granted.max(1) as u64),
            lease: current,
            stop: Some(stop_tx),
            task: Some(task),
        })
    }

    /// The descriptor published under `name`.
    ///
    /// [`Error::SegmentUnavailable`] when no such key exists (never
    /// published, its lease expired, or it was revoked at shutdown);
    /// [`Error::Unavailable`] when etcd does not answer;
    /// [`Error::Protocol`] when the value is not a descriptor.
    pub async fn lookup(&self, name: &str) -> Result<Descriptor> {
        self.resolve(name).await.map(|r| r.descriptor)
    }

    /// [`EtcdDiscovery::lookup`], with the lease the key is bound to.
    pub async fn resolve(&self, name: &str) -> Result<Registration> {
        let key = segment_key(&self.prefix, name);
        let mut c = self.ctx.client.clone();
        let what = format!("looking up segment {name:?} ({key})");
        let resp = self.ctx.call(&what, c.get(key.as_str(), None)).await?;
        match resp.kvs().first() {
            Some(kv) => registration(&key, kv),
            None => Err(Error::SegmentUnavailable {
                name: name.to_owned(),
                reason: format!(
                    "not published in etcd at {} (key {key}): never published, \
                     or its lease expired (the engine died or lost etcd for longer \
                     than its lease TTL) or was revoked at shutdown",
                    self.ctx.endpoints
                ),
            }),
        }
    }

    /// Watches the key of segment `name` from now on: each publication
    /// (also at new addresses) is a [`SegmentEvent::Registered`], each
    /// deletion (lease expired or revoked) a [`SegmentEvent::Deleted`].
    /// An etcd outage is ridden out: the watch resumes where it stopped
    /// and, where etcd lost its history, reports the state it finds.
    pub async fn watch(&self, name: &str) -> Result<SegmentWatch> {
        let key = segment_key(&self.prefix, name);
        let what = format!("watching segment {name:?} ({key})");
        let mut c = self.ctx.client.clone();
        let resp = self.ctx.call(&what, c.get(key.as_str(), None)).await?;
        let revision = resp.header().map_or(0, |h| h.revision());
        let last = resp.kvs().first().map(seen);
        let (tx, rx) = mpsc::channel(64);
        let task = tokio::spawn(watcher(
            self.ctx.clone(),
            name.to_owned(),
            key,
            revision + 1,
            last,
            tx,
        ));
        Ok(SegmentWatch { rx, task })
    }
}

/// Grants a lease of `ttl_secs`; returns its id and the TTL etcd granted.
async fn grant(ctx: &Ctx, name: &str, ttl_secs: i64) -> Result<(i64, i64)> {
    let mut c = ctx.client.clone();
    let what = format!("granting a lease for segment {name:?}");
    let resp = ctx.call(&what, c.lease_grant(ttl_secs, None)).await?;
    if !resp.error().is_empty() {
        return Err(ctx.down(&what, resp.error()));
    }
    Ok((resp.id(), resp.ttl()))
}

/// Creates `key` bound to `lease` if it does not exist.
async fn create(ctx: &Ctx, name: &str, key: &str, value: &str, lease: i64) -> Result<()> {
    let txn = Txn::new()
        .when([Compare::create_revision(key, CompareOp::Equal, 0)])
        .and_then([TxnOp::put(
            key,
            value,
            Some(PutOptions::new().with_lease(lease)),
        )])
        .or_else([TxnOp::get(key, None)]);
    let mut c = ctx.client.clone();
    let what = format!(
        "publishing segment {name:?} at {key} (lease {})",
        hex(lease)
    );
    let resp = ctx.call(&what, c.txn(txn)).await?;
    if resp.succeeded() {
        return Ok(());
    }
    let holder = resp
        .op_responses()
        .into_iter()
        .find_map(|r| match r {
            TxnOpResponse::Get(g) => g.kvs().first().map(|kv| kv.lease()),
            _ => None,
        })
        .unwrap_or(0);
    Err(conflict(name, key, holder))
}

/// What the keeper task keeps published.
struct Published {
    name: String,
    key: String,
    value: String,
    ttl_secs: i64,
    /// The lease the key is bound to now (replaced on re-publication).
    lease: Arc<AtomicI64>,
}

/// Keeps the lease alive; re-publishes after an outage; revokes the lease
/// when told to stop (or when the [`Publication`] is dropped).
async fn keeper(ctx: Ctx, p: Published, mut stop: oneshot::Receiver<oneshot::Sender<Result<()>>>) {
    let period = Duration::from_millis((p.ttl_secs as u64 * 1000 / 3).max(100));
    let reply = 'run: loop {
        let lease = p.lease.load(Ordering::SeqCst);
        let why = tokio::select! {
            r = &mut stop => break 'run r.ok(),
            why = keep_alive(&ctx, lease, period) => why,
        };
        tracing::warn!(
            segment = %p.name,
            lease = %hex(lease),
            "etcd lease keep-alive ended ({why}); re-publishing"
        );
        loop {
            let r = tokio::select! {
                r = &mut stop => break 'run r.ok(),
                r = republish(&ctx, &p, lease) => r,
            };
            match r {
                Ok(()) => break,
                Err(e) => {
                    tracing::warn!(segment = %p.name, "re-publishing failed: {e}");
                    tokio::select! {
                        r = &mut stop => break 'run r.ok(),
                        _ = tokio::time::sleep(period) => {}
                    }
                }
            }
        }
    };
    let lease = p.lease.load(Ordering::SeqCst);
    let mut c = ctx.client.clone();
    let what = format!(
        "revoking lease {} of segment {:?} ({}): the key stays until the lease expires \
         (at most {} s)",
        hex(lease),
        p.name,
        p.key,
        p.ttl_secs
    );
    let r = ctx.call(&what, c.lease_revoke(lease)).await.map(drop);
    if let Some(reply) = reply {
        let _ = reply.send(r);
    }
}

/// Sends keep-alives for `lease` every `period` until something fails;
/// returns what.
async fn keep_alive(ctx: &Ctx, lease: i64, period: Duration) -> String {
    let mut c = ctx.client.clone();
    let (mut keeper, mut stream) = match ctx
        .call("lease keep-alive", c.lease_keep_alive(lease))
        .await
    {
        Ok(k) => k,
        Err(e) => return e.to_string(),
    };
    loop {
        tokio::time::sleep(period).await;
        if let Err(e) = keeper.keep_alive().await {
            return e.to_string();
        }
        match tokio::time::timeout(ctx.timeout, stream.message()).await {
            Ok(Ok(Some(r))) if r.ttl() > 0 => {}
            Ok(Ok(Some(_))) => return format!("lease {} expired", hex(lease)),
            Ok(Ok(None)) => return "etcd closed the keep-alive stream".into(),
            Ok(Err(e)) => return e.to_string(),
            Err(_) => return format!("no keep-alive answer within {:?}", ctx.timeout),
        }
    }
}

/// Makes the key exist again with our value: keeps `old` when it is alive
/// and still holds the key, else binds the key to a new lease (replacing
/// our own entry, or creating it if it is gone). Fails with a conflict
/// when another engine took the name meanwhile.
async fn republish(ctx: &Ctx, p: &Published, old: i64) -> Result<()> {
    let mut c = ctx.client.clone();
    let got = ctx
        .call("re-publishing (get)", c.get(p.key.as_str(), None))
        .await?;
    let holder = got.kvs().first().map(|kv| kv.lease());
    if holder == Some(old) {
        let ttl = ctx
            .call("re-publishing (lease TTL)", c.lease_time_to_live(old, None))
            .await?;
        if ttl.ttl() > 0 {
            return Ok(());
        }
    }
    let (lease, _) = grant(ctx, &p.name, p.ttl_secs).await?;
    p.lease.store(lease, Ordering::SeqCst);
    // Our own entry (bound to the dying lease): rebind it in place.
    let replace = Txn::new()
        .when([Compare::lease(p.key.as_str(), CompareOp::Equal, old)])
        .and_then([TxnOp::put(
            p.key.as_str(),
            p.value.as_str(),
            Some(PutOptions::new().with_lease(lease)),
        )]);
    let replaced = ctx.call("re-publishing (replace)", c.txn(replace)).await?;
    let r = if replaced.succeeded() {
        Ok(())
    } else {
        create(ctx, &p.name, &p.key, &p.value, lease).await
    };
    match r {
        Ok(()) => {
            tracing::info!(
                segment = %p.name,
                lease = %hex(lease),
                "re-published in etcd"
            );
            Ok(())
        }
        Err(e) => {
            p.lease.store(old, Ordering::SeqCst);
            let _ = ctx.call("revoke", c.lease_revoke(lease)).await;
            Err(e)
        }
    }
}

/// The descriptor stored in `kv` (at `key`) and its lease.
fn registration(key: &str, kv: &etcd_client::KeyValue) -> Result<Registration> {
    Ok(Registration {
        descriptor: Descriptor::from_json(key, kv.value())?,
        lease: kv.lease(),
    })
}

/// What a watch remembers of the key's state.
fn seen(kv: &etcd_client::KeyValue) -> (i64, Vec<u8>) {
    (kv.mod_revision(), kv.value().to_vec())
}

/// Follows `key` from `revision`, reporting changes on `tx`; re-watches
/// after an outage, first reporting the state found if it differs from
/// the last one seen (`last`: the mod revision and value of the key,
/// `None` when
/// absent).
async fn watcher(
    ctx: Ctx,
    name: String,
    key: String,
    mut revision: i64,
    mut last: Option<(i64, Vec<u8>)>,
    tx: mpsc::Sender<Result<SegmentEvent>>,
) {
    let retry = Duration::from_millis(200);
    let mut resync = false;
    loop {
        if tx.is_closed() {
            return;
        }
        let mut c = ctx.client.clone();
        if resync {
            let got = match ctx.call("watch (resync)", c.get(key.as_str(), None)).await {
                Ok(g) => g,
                Err(_) => {
                    tokio::time::sleep(retry).await;
                    continue;
                }
            };
            revision = got.header().map_or(0, |h| h.revision()) + 1;
            let now = got.kvs().first();
            // The value too: an etcd restarted without its data counts
            // revisions from 1 again.
            if now.map(seen) != last {
                last = now.map(seen);
                let ev = match now {
                    Some(kv) => registration(&key, kv).map(SegmentEvent::Registered),
                    None => Ok(SegmentEvent::Deleted { name: name.clone() }),
                };
                if tx.send(ev).await.is_err() {
                    return;
                }
            }
        }
        resync = true;
        let options = WatchOptions::new().with_start_revision(revision);
        let mut stream = match ctx
            .call("watch", c.watch(key.as_str(), Some(options)))
            .await
        {
            Ok(s) => s,
            Err(_) => {
                tokio::time::sleep(retry).await;
                continue;
            }
        };
        loop {
            let resp = match stream.message().await {
                Ok(Some(r)) => r,
                Ok(None) | Err(_) => break,
            };
            if resp.canceled() {
                break;
            }
            for ev in resp.events() {
                let Some(kv) = ev.kv() else { continue };
                revision = kv.mod_revision() + 1;
                let out = match ev.event_type() {
                    EventType::Put => {
                        last = Some(seen(kv));
                        registration(&key, kv).map(SegmentEvent::Registered)
                    }
                    EventType::Delete => {
                        last = None;
                        Ok(SegmentEvent::Deleted { name: name.clone() })
                    }
                };
                if tx.send(out).await.is_err() {
                    return;
                }
            }
        }
        tracing::debug!(segment = %name, "etcd watch ended; re-watching");
        tokio::time::sleep(retry).await;
    }
}

/// A published segment: the key exists while this lives (and etcd does).
///
/// [`Publication::shutdown`] revokes the lease, deleting the key at once;
/// dropping it does the same in the background, best effort (within a
/// tokio runtime that keeps running).
#[derive(Debug)]
pub struct Publication {
    name: String,
    key: String,
    granted: Duration,
    lease: Arc<AtomicI64>,
    stop: Option<oneshot::Sender<oneshot::Sender<Result<()>>>>,
    task: Option<JoinHandle<()>>,
}

impl Publication {
    /// The segment name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The etcd key (`<prefix>/segments/<name>`).
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The lease the key is bound to now (a new one after a re-publication
    /// that found the old one expired).
    pub fn lease_id(&self) -> i64 {
        self.lease.load(Ordering::SeqCst)
    }

    /// The TTL etcd granted at publication.
    pub fn lease_ttl(&self) -> Duration {
        self.granted
    }

    /// Stops the keep-alives and revokes the lease: the key is gone when
    /// this returns Ok. [`Error::Unavailable`] when etcd did not answer
    /// (the key then goes when the lease expires).
    pub async fn shutdown(mut self) -> Result<()> {
        let (tx, rx) = oneshot::channel();
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(tx);
        }
        let r = rx.await.unwrap_or_else(|_| {
            Err(Error::Canceled(format!(
                "the keep-alive task of segment {:?} ended before revoking lease {}",
                self.name,
                hex(self.lease_id())
            )))
        });
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
        r
    }
}

impl Drop for Publication {
    fn drop(&mut self) {
        // Dropping the sender tells the task to revoke the lease and end.
        drop(self.stop.take());
    }
}

/// A watch on one segment name ([`EtcdDiscovery::watch`]); dropping it
/// ends the watch.
#[derive(Debug)]
pub struct SegmentWatch {
    rx: mpsc::Receiver<Result<SegmentEvent>>,
    task: JoinHandle<()>,
}

impl SegmentWatch {
    /// The next change of the segment (waits for one).
    pub async fn next(&mut self) -> Result<SegmentEvent> {
        self.rx
            .recv()
            .await
            .unwrap_or_else(|| Err(Error::Canceled("the etcd watch task ended".into())))
    }
}

impl Drop for SegmentWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}
