//! `ferry metadata-server`: the HTTP metadata service of Mooncake Transfer
//! Engine, so that Mooncake builds without `P2PHANDSHAKE` (v0.2.x) and
//! Ferry's tests need no etcd, no Go and no Python next to them.
//!
//! # Protocol
//!
//! Mooncake's `HTTPStoragePlugin` (the metadata connection string
//! `http://HOST:PORT/metadata`) sends, through libcurl:
//!
//! | request | answer here |
//! | --- | --- |
//! | `GET <path>?key=K` | `200` with the stored bytes; `404` when `K` is not stored |
//! | `PUT <path>?key=K`, the value as body | `200`: stored, replacing any previous value |
//! | `DELETE <path>?key=K` | `200`: removed; `404` when `K` is not stored |
//!
//! Mooncake (v0.2.0 to the current one alike) treats `200` as success and any
//! other status as a failure; it reads the body only on `GET`. The statuses
//! are those of Mooncake's own servers (the Python `mooncake_http_metadata_server`
//! and `mooncake_master --enable_http_metadata_server`); its older Go example
//! answers `200` to a `DELETE` of a missing key, which Mooncake's client would
//! accept just as well.
//!
//! `K` is percent-decoded as a form value (`%2F` is `/`, `+` is a space), as
//! Go's and aiohttp's query parsers do: Mooncake escapes every byte but
//! `A-Za-z0-9-._~` with `curl_easy_escape`, so its keys
//! (`mooncake/ram/NAME`, `mooncake/rpc_meta/NAME`, with a cluster prefix in
//! newer builds) arrive as `mooncake%2Fram%2F…`. Keys are compared as bytes;
//! the first `key` parameter counts. `HEAD` is `GET` without the body.
//!
//! A `GET` answers with the `Content-Type` the value was `PUT` with
//! (`application/json` from Mooncake), `application/octet-stream` when it had
//! none. Every other answer is a short `text/plain` line.
//!
//! # Errors and limits
//!
//! - `400`: no `key` parameter, or an empty one; an unreadable body.
//! - `404`: a path other than the metadata path (exact match, no trailing `/`).
//! - `405`: a method other than `GET`, `HEAD`, `PUT`, `DELETE` (with `Allow`).
//! - `408`: a `PUT` body not received within the timeout (the connection closes).
//! - `413`: a value larger than the maximum value size (16 MiB by default),
//!   refused from its `Content-Length` before any of it is read, so a client
//!   that sent `Expect: 100-continue` (curl does for larger bodies) is told
//!   without sending it.
//! - `507`: a `PUT` that would store more keys (65536) or more bytes, keys
//!   plus values (1 GiB), than allowed. Replacing a value needs no new key.
//! - Request heads larger than 64 KiB get hyper's `431`/`414`.
//!
//! Time bounds: a client has the timeout (10 s by default) to send a request
//! head (an idle keep-alive connection is closed after it too; curl reconnects
//! on its own), the same to send a `PUT` body, and the same for each write of
//! a response that makes no progress. At most `max_connections` connections
//! are served at once; more wait in the listen backlog. The store lives in
//! memory only; it is lost when the server exits.
//!
//! # Shutting down
//!
//! On the first SIGINT or SIGTERM the server stops accepting, lets requests in
//! flight finish (5 s at most), closes idle connections and exits with
//! status 0. A second signal exits at once.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use anyhow::Context as _;
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use hyper::body::{Body, Bytes, Incoming};
use hyper::header::{HeaderValue, ALLOW, CONNECTION, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinSet;
use tokio::time::Sleep;

use crate::util::{parse_count, parse_duration, parse_positive_size};

const EXAMPLES: &str = "\
Examples:
  ferry metadata-server                                # http://127.0.0.1:8080/metadata
  ferry metadata-server --listen 0.0.0.0:8080          # reachable from other machines
  ferry metadata-server --listen 127.0.0.1:0           # any free port; the URL is printed
  # then, for Mooncake (or a mooncake:// Ferry URL), instead of P2PHANDSHAKE:
  ferry caps --backend 'mooncake://?lib=/opt/mooncake/libtransfer_engine.so&metadata=http%3A%2F%2F127.0.0.1%3A8080%2Fmetadata&protocol=tcp&host=127.0.0.1'

It prints one line, `metadata server listening on http://ADDR/PATH`, then
serves Mooncake's HTTP metadata protocol on that URL until SIGINT or SIGTERM:
  GET    PATH?key=K   200 and the value, 404 if K is not stored
  PUT    PATH?key=K   200, the body becomes K's value
  DELETE PATH?key=K   200, or 404 if K is not stored
K is percent-decoded (Mooncake sends mooncake%2Fram%2F…). Other paths get 404,
other methods 405, a missing key 400, a value over --max-value-size 413, a PUT
past --max-keys or --max-total-size 507. Values live in memory only. The first
SIGINT/SIGTERM lets requests in flight finish (5 s at most) and exits 0; a
second exits at once.

This is the single-machine option, kept for tests and for Mooncake builds
without P2PHANDSHAKE on one host: no leases (a crashed node's entry stays),
no watches, no replication. For a cluster use etcd: Mooncake's etcd://
metadata, and metadata=etcd://… on Ferry's tcp:// and verbs:// engines
(feature `etcd`), whose names expire with a dead node's lease.";

/// Arguments of `ferry metadata-server`.
#[derive(clap::Args, Debug)]
#[command(after_help = EXAMPLES)]
pub struct MetadataServerArgs {
    /// Address to listen on, HOST:PORT (port 0 picks a free one; the printed
    /// URL has the real port).
    #[arg(long, default_value = "127.0.0.1:8080")]
    listen: String,

    /// URL path of the metadata endpoint (the path of Mooncake's metadata
    /// connection string).
    #[arg(long, default_value = "/metadata", value_parser = parse_path)]
    path: String,

    /// Largest value one PUT may store; larger ones get 413.
    #[arg(long, value_parser = parse_positive_size, default_value = "16MiB")]
    max_value_size: u64,

    /// Most keys stored at once; a PUT that would add one more gets 507.
    #[arg(long, value_parser = parse_count, default_value = "65536")]
    max_keys: usize,

    /// Most bytes stored at once, keys plus values; a PUT past it gets 507.
    #[arg(long, value_parser = parse_positive_size, default_value = "1GiB")]
    max_total_size: u64,

    /// Most connections served at once; more wait in the listen backlog.
    #[arg(long, value_parser = parse_count, default_value = "1024")]
    max_connections: usize,

    /// Time a client has to send a request head (and an idle keep-alive
    /// connection stays open), to send a PUT body, and for each stalled write
    /// of a response.
    #[arg(long, value_parser = parse_positive_duration, default_value = "10s")]
    timeout: Duration,
}

/// Runs `ferry metadata-server` until SIGINT or SIGTERM.
pub async fn run(args: MetadataServerArgs) -> anyhow::Result<()> {
    let limits = args.limits();
    // Handlers first: a signal sent as soon as the URL is printed must stop
    // the server, not kill it.
    let mut signals = Signals::install()?;
    let listener = TcpListener::bind(&args.listen)
        .await
        .with_context(|| format!("binding {}", args.listen))?;
    let addr = listener.local_addr().context("reading the bound address")?;
    announce(addr, &args.path)?;
    tracing::info!(?limits, "metadata server started");

    let (first_tx, first_rx) = tokio::sync::oneshot::channel::<()>();
    let (second_tx, second_rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        signals.next().await;
        let _ = first_tx.send(());
        signals.next().await;
        let _ = second_tx.send(());
    });
    let shutdown = async {
        // An error means the signal task is gone: stop rather than run unstoppable.
        let _ = first_rx.await;
        tracing::info!("signal received: shutting down");
    };
    tokio::select! {
        () = serve(listener, args.path, limits, shutdown) => {}
        Ok(()) = second_rx => eprintln!("second signal: exiting without waiting for requests in flight"),
    }
    Ok(())
}

impl MetadataServerArgs {
    fn limits(&self) -> Limits {
        Limits {
            max_value_size: saturating_usize(self.max_value_size),
            max_keys: self.max_keys,
            max_total_size: saturating_usize(self.max_total_size),
            max_connections: self.max_connections,
            header_timeout: self.timeout,
            body_timeout: self.timeout,
            write_timeout: self.timeout,
        }
    }
}

/// Prints the one line users and tests read, and flushes it.
fn announce(addr: SocketAddr, path: &str) -> anyhow::Result<()> {
    use std::io::Write as _;
    let mut out = io::stdout().lock();
    writeln!(out, "metadata server listening on http://{addr}{path}")
        .and_then(|()| out.flush())
        .context("writing to stdout")
}

/// Bounds on what clients can make the server hold. [`Limits::default`] is
/// what `ferry metadata-server` uses without options.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Largest value one `PUT` may store, in bytes; larger ones get `413`.
    pub max_value_size: usize,
    /// Most keys stored at once; a `PUT` of a new key past it gets `507`.
    pub max_keys: usize,
    /// Most bytes stored at once, keys plus values; a `PUT` past it gets `507`.
    pub max_total_size: usize,
    /// Most connections served at once (at least one is always allowed);
    /// further ones wait, unaccepted, in the listen backlog.
    pub max_connections: usize,
    /// Time to receive a whole request head, counted from when the server
    /// starts waiting for it (so it also closes idle keep-alive connections).
    pub header_timeout: Duration,
    /// Time to receive a whole `PUT` body; past it the answer is `408` and
    /// the connection closes.
    pub body_timeout: Duration,
    /// Time one write of a response may stay blocked (a client that does not
    /// read); past it the connection closes.
    pub write_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_value_size: 16 << 20,
            max_keys: 65_536,
            max_total_size: 1 << 30,
            max_connections: 1024,
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(10),
            write_timeout: Duration::from_secs(10),
        }
    }
}

/// Largest request head (request line plus headers, so also the longest key)
/// a connection buffers; hyper answers `431`/`414` above it.
const MAX_HEAD_SIZE: usize = 64 << 10;
/// How long requests in flight may still run once shutdown starts.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);
/// The methods the metadata path answers, for `405`'s `Allow`.
const ALLOWED: &str = "GET, HEAD, PUT, DELETE";

/// Serves Mooncake's HTTP metadata protocol on `listener` until `shutdown`
/// completes, with an empty in-memory store.
///
/// Requests for `path` (exact match; a missing leading `/` is added) are
/// answered as the [module documentation](self) describes; every other path
/// gets `404`. Never panics on client input; a failing connection is dropped
/// and logged at debug level, a failing `accept` is logged and retried.
///
/// When `shutdown` completes it stops accepting, asks every connection to
/// close after its current request, waits at most 5 s for them, drops the
/// rest and returns. The store is dropped with it.
pub async fn serve(
    listener: TcpListener,
    path: String,
    limits: Limits,
    shutdown: impl Future<Output = ()>,
) {
    let path = if path.starts_with('/') {
        path
    } else {
        format!("/{path}")
    };
    let state = Arc::new(State {
        path,
        limits,
        store: Mutex::new(Store::default()),
    });
    let permits = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut connections = JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        let next = async {
            // Take a slot before accepting, so excess clients wait in the
            // backlog instead of holding sockets here.
            let permit = Arc::clone(&permits).acquire_owned().await;
            (permit, listener.accept().await)
        };
        tokio::select! {
            () = &mut shutdown => break,
            // Reap finished connections so the set stays as small as the cap.
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            (permit, accepted) = next => {
                let Ok(permit) = permit else { break }; // never closed
                match accepted {
                    Ok((stream, peer)) => {
                        let state = Arc::clone(&state);
                        let stop = stop_rx.clone();
                        connections.spawn(async move {
                            serve_connection(stream, peer, state, stop).await;
                            drop(permit);
                        });
                    }
                    Err(e) => {
                        // Out of descriptors and the like: wait, do not spin.
                        tracing::warn!("accepting a connection: {e}");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            }
        }
    }
    drop(listener);
    let _ = stop_tx.send(true);
    let drain = async { while connections.join_next().await.is_some() {} };
    if tokio::time::timeout(SHUTDOWN_GRACE, drain).await.is_err() {
        tracing::warn!(
            "{} connections still busy after {SHUTDOWN_GRACE:?}: closing them",
            connections.len()
        );
        connections.shutdown().await;
    }
}

/// One HTTP/1.1 connection (keep-alive, pipelining as hyper does it).
async fn serve_connection(
    stream: TcpStream,
    peer: SocketAddr,
    state: Arc<State>,
    mut stop: watch::Receiver<bool>,
) {
    let _ = stream.set_nodelay(true);
    let limits = state.limits;
    let io = TokioIo::new(WriteTimeout::new(stream, limits.write_timeout));
    let service = hyper::service::service_fn(move |req| {
        let state = Arc::clone(&state);
        async move { Ok::<_, Infallible>(handle(&state, req).await) }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .max_buf_size(MAX_HEAD_SIZE)
        .serve_connection(io, service);
    tokio::pin!(conn);
    let result = tokio::select! {
        r = conn.as_mut() => r,
        // The guard `wait_for` returns is dropped at once (it is not `Send`).
        _ = async { stop.wait_for(|stop| *stop).await.map(|_| ()) } => {
            conn.as_mut().graceful_shutdown();
            conn.await
        }
    };
    if let Err(e) = result {
        tracing::debug!(%peer, "connection closed: {e}");
    }
}

/// Shared by every connection.
#[derive(Debug)]
struct State {
    path: String,
    limits: Limits,
    store: Mutex<Store>,
}

impl State {
    /// The store; a handler that panicked cannot have left it inconsistent
    /// (every update is one map operation plus one counter), so poisoning is
    /// ignored.
    fn store(&self) -> std::sync::MutexGuard<'_, Store> {
        ferry::__private::sync::lock(&self.store)
    }
}

/// The key-value store and the byte count the limits are checked against.
#[derive(Debug, Default)]
struct Store {
    map: std::collections::HashMap<Vec<u8>, Entry>,
    /// Sum of key and value lengths.
    bytes: usize,
}

#[derive(Debug, Clone)]
struct Entry {
    value: Bytes,
    content_type: Option<HeaderValue>,
}

/// Why a `PUT` was refused for lack of room.
#[derive(Debug, PartialEq, Eq)]
enum NoRoom {
    Keys,
    Bytes,
}

impl Store {
    fn put(&mut self, key: Vec<u8>, entry: Entry, limits: &Limits) -> Result<(), NoRoom> {
        let old = self.map.get(&key).map(|e| key.len() + e.value.len());
        if old.is_none() && self.map.len() >= limits.max_keys {
            return Err(NoRoom::Keys);
        }
        let bytes = (self.bytes - old.unwrap_or(0)).saturating_add(key.len() + entry.value.len());
        if bytes > limits.max_total_size {
            return Err(NoRoom::Bytes);
        }
        self.bytes = bytes;
        self.map.insert(key, entry);
        Ok(())
    }

    fn remove(&mut self, key: &[u8]) -> bool {
        match self.map.remove(key) {
            Some(e) => {
                self.bytes -= key.len() + e.value.len();
                true
            }
            None => false,
        }
    }
}

type Reply = Response<Full<Bytes>>;

async fn handle(state: &State, req: Request<Incoming>) -> Reply {
    if req.uri().path() != state.path {
        return text(
            StatusCode::NOT_FOUND,
            &format!("not found: the metadata path is {}", state.path),
        );
    }
    let method = req.method().clone();
    if !matches!(
        method,
        Method::GET | Method::HEAD | Method::PUT | Method::DELETE
    ) {
        let mut r = text(
            StatusCode::METHOD_NOT_ALLOWED,
            &format!("method {method} not allowed: use {ALLOWED}"),
        );
        r.headers_mut()
            .insert(ALLOW, HeaderValue::from_static(ALLOWED));
        return r;
    }
    let key = match req.uri().query().and_then(query_key) {
        Some(k) if !k.is_empty() => k,
        _ => {
            return text(
                StatusCode::BAD_REQUEST,
                "missing key parameter: use ?key=<percent-encoded key>",
            )
        }
    };
    let reply = match method {
        Method::PUT => put(state, key.clone(), req).await,
        Method::DELETE => {
            if state.store().remove(&key) {
                text(StatusCode::OK, "metadata deleted")
            } else {
                text(StatusCode::NOT_FOUND, "metadata not found")
            }
        }
        _ => get(state, &key),
    };
    tracing::debug!(
        "{method} {:?}: {}",
        String::from_utf8_lossy(&key),
        reply.status()
    );
    reply
}

fn get(state: &State, key: &[u8]) -> Reply {
    let Some(entry) = state.store().map.get(key).cloned() else {
        return text(StatusCode::NOT_FOUND, "metadata not found");
    };
    let mut r = Response::new(Full::new(entry.value));
    r.headers_mut().insert(
        CONTENT_TYPE,
        entry
            .content_type
            .unwrap_or_else(|| HeaderValue::from_static("application/octet-stream")),
    );
    r
}

async fn put(state: &State, key: Vec<u8>, req: Request<Incoming>) -> Reply {
    let limits = state.limits;
    let too_large = || {
        text(
            StatusCode::PAYLOAD_TOO_LARGE,
            &format!("value too large: at most {} bytes", limits.max_value_size),
        )
    };
    // From Content-Length, before reading (or asking for, with 100-continue)
    // any of the body.
    if req.body().size_hint().lower() > limits.max_value_size as u64 {
        return too_large();
    }
    let content_type = req.headers().get(CONTENT_TYPE).cloned();
    let body = Limited::new(req.into_body(), limits.max_value_size);
    let value = match tokio::time::timeout(limits.body_timeout, body.collect()).await {
        Ok(Ok(collected)) => collected.to_bytes(),
        Ok(Err(e)) if e.downcast_ref::<LengthLimitError>().is_some() => return too_large(),
        Ok(Err(e)) => return text(StatusCode::BAD_REQUEST, &format!("reading the body: {e}")),
        Err(_) => {
            let mut r = text(
                StatusCode::REQUEST_TIMEOUT,
                &format!("body not received within {:?}", limits.body_timeout),
            );
            r.headers_mut()
                .insert(CONNECTION, HeaderValue::from_static("close"));
            return r;
        }
    };
    let entry = Entry {
        value,
        content_type,
    };
    match state.store().put(key, entry, &limits) {
        Ok(()) => text(StatusCode::OK, "metadata updated"),
        Err(NoRoom::Keys) => text(
            StatusCode::INSUFFICIENT_STORAGE,
            &format!("store full: at most {} keys", limits.max_keys),
        ),
        Err(NoRoom::Bytes) => text(
            StatusCode::INSUFFICIENT_STORAGE,
            &format!(
                "store full: at most {} bytes of keys and values",
                limits.max_total_size
            ),
        ),
    }
}

/// A short `text/plain` answer.
fn text(status: StatusCode, message: &str) -> Reply {
    let mut r = Response::new(Full::new(Bytes::from(format!("{message}\n"))));
    *r.status_mut() = status;
    r.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

/// The first `key` parameter of a query string, decoded as
/// `application/x-www-form-urlencoded` (`+` is a space, `%XX` a byte; a
/// malformed `%` stays as it is), as bytes.
fn query_key(query: &str) -> Option<Vec<u8>> {
    query.split('&').find_map(|pair| {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        (form_decode(name) == b"key").then(|| form_decode(value))
    })
}

fn form_decode(s: &str) -> Vec<u8> {
    let plus_as_space: Vec<u8> = s
        .bytes()
        .map(|b| if b == b'+' { b' ' } else { b })
        .collect();
    percent_encoding::percent_decode(&plus_as_space).collect()
}

/// An I/O stream whose writes fail with `TimedOut` once one stays blocked for
/// `timeout` (the peer stopped reading). Reads pass through: hyper bounds the
/// request head and [`put`] the body.
#[derive(Debug)]
struct WriteTimeout<S> {
    inner: S,
    timeout: Duration,
    /// Running while a write is blocked; cleared by any progress.
    blocked: Option<Pin<Box<Sleep>>>,
}

impl<S> WriteTimeout<S> {
    fn new(inner: S, timeout: Duration) -> Self {
        Self {
            inner,
            timeout,
            blocked: None,
        }
    }

    /// Maps a write's result: progress clears the timer, `Pending` starts it
    /// (or fails once it has run out).
    fn watch<T>(&mut self, cx: &mut Context<'_>, r: Poll<io::Result<T>>) -> Poll<io::Result<T>> {
        if r.is_ready() {
            self.blocked = None;
            return r;
        }
        let timeout = self.timeout;
        let timer = self
            .blocked
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
        match timer.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("the peer read nothing for {timeout:?}"),
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for WriteTimeout<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for WriteTimeout<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.watch(cx, r)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.watch(cx, r)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let r = Pin::new(&mut self.inner).poll_flush(cx);
        self.watch(cx, r)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let r = Pin::new(&mut self.inner).poll_shutdown(cx);
        self.watch(cx, r)
    }
}

/// SIGINT and SIGTERM, installed before the server announces itself.
struct Signals {
    #[cfg(unix)]
    interrupt: tokio::signal::unix::Signal,
    #[cfg(unix)]
    terminate: tokio::signal::unix::Signal,
}

impl Signals {
    fn install() -> anyhow::Result<Self> {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            Ok(Self {
                interrupt: signal(SignalKind::interrupt())
                    .context("installing a SIGINT handler")?,
                terminate: signal(SignalKind::terminate())
                    .context("installing a SIGTERM handler")?,
            })
        }
        #[cfg(not(unix))]
        {
            Ok(Self {})
        }
    }

    /// The next SIGINT or SIGTERM (Ctrl-C elsewhere). Returns at once if the
    /// handlers are gone, so that the server stops rather than runs unstoppable.
    async fn next(&mut self) {
        #[cfg(unix)]
        tokio::select! {
            _ = self.interrupt.recv() => {}
            _ = self.terminate.recv() => {}
        }
        #[cfg(not(unix))]
        let _ = tokio::signal::ctrl_c().await;
    }
}

fn saturating_usize(n: u64) -> usize {
    usize::try_from(n).unwrap_or(usize::MAX)
}

/// `--path`: an absolute URL path without query or fragment.
fn parse_path(s: &str) -> Result<String, String> {
    if !s.starts_with('/') {
        return Err(format!("{s:?}: the path must start with /"));
    }
    if let Some(c) = s
        .chars()
        .find(|c| matches!(c, '?' | '#') || c.is_whitespace() || c.is_control())
    {
        return Err(format!("{s:?}: the path must not contain {c:?}"));
    }
    Ok(s.to_owned())
}

/// `--timeout`: a duration above zero.
fn parse_positive_duration(s: &str) -> Result<Duration, String> {
    match parse_duration(s)? {
        d if d.is_zero() => Err(format!("{s:?}: must be longer than zero")),
        d => Ok(d),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_form_decoded_and_the_first_key_counts() {
        assert_eq!(
            query_key("key=mooncake%2Fram%2F127.0.0.1%3A12345").as_deref(),
            Some(&b"mooncake/ram/127.0.0.1:12345"[..])
        );
        assert_eq!(
            query_key("a=1&key=x+y%2By&key=z").as_deref(),
            Some(&b"x y+y"[..])
        );
        assert_eq!(query_key("k%65y=v").as_deref(), Some(&b"v"[..]));
        assert_eq!(query_key("key=%ff%00").as_deref(), Some(&[0xff, 0][..]));
        assert_eq!(query_key("key=50%").as_deref(), Some(&b"50%"[..]));
        assert_eq!(query_key("key").as_deref(), Some(&b""[..]));
        assert_eq!(query_key("keys=a"), None);
        assert_eq!(query_key(""), None);
    }

    #[test]
    fn the_store_counts_keys_and_bytes_and_replacing_needs_no_new_key() {
        let limits = Limits {
            max_keys: 2,
            max_total_size: 20,
            ..Limits::default()
        };
        let entry = |v: &'static [u8]| Entry {
            value: Bytes::from_static(v),
            content_type: None,
        };
        let mut s = Store::default();
        assert_eq!(s.put(b"a".to_vec(), entry(b"1234"), &limits), Ok(()));
        assert_eq!(s.put(b"b".to_vec(), entry(b"1234"), &limits), Ok(()));
        assert_eq!(s.bytes, 10);
        assert_eq!(s.put(b"c".to_vec(), entry(b""), &limits), Err(NoRoom::Keys));
        assert_eq!(s.put(b"a".to_vec(), entry(b"123456789"), &limits), Ok(()));
        assert_eq!(s.bytes, 15);
        assert_eq!(
            s.put(b"b".to_vec(), entry(b"1234567890"), &limits),
            Err(NoRoom::Bytes)
        );
        assert_eq!(s.bytes, 15);
        assert!(s.remove(b"a"));
        assert!(!s.remove(b"a"));
        assert_eq!(s.bytes, 5);
        assert_eq!(s.put(b"c".to_vec(), entry(b""), &limits), Ok(()));
    }

    #[test]
    fn the_cli_defaults_are_the_default_limits() {
        use clap::Parser as _;
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            args: MetadataServerArgs,
        }
        let cli = Cli::parse_from(["ferry"]);
        assert_eq!(cli.args.limits(), Limits::default());
        assert_eq!(cli.args.listen, "127.0.0.1:8080");
        assert_eq!(cli.args.path, "/metadata");
    }

    #[test]
    fn paths_and_timeouts_are_validated() {
        assert_eq!(parse_path("/metadata").as_deref(), Ok("/metadata"));
        assert!(parse_path("metadata").is_err());
        assert!(parse_path("/m?key=a").is_err());
        assert!(parse_path("/m d").is_err());
        assert!(parse_positive_duration("0s").is_err());
        assert_eq!(parse_positive_duration("1s"), Ok(Duration::from_secs(1)));
    }
}
