//! Engine configuration and its URL form.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use ferry_core::raw::ParsedUrl;
use ferry_core::{Error, Result, Secret};

use crate::frame::MAX_OP_LEN;
use crate::negotiate::FeatureSettings;

/// The `same_host` setting.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SameHost {
    /// Use cross-memory attach when the peer is on this host and the
    /// kernel allows it; otherwise the socket (with the reason reported).
    #[default]
    Auto,
    /// Require it: connecting to a peer that cannot use it fails with the
    /// reason. As a target, same as `Auto`.
    Cma,
    /// Never: payloads always travel on the socket; as a target, refuse
    /// initiators that ask.
    Off,
}

impl SameHost {
    /// Parses `auto`, `cma` or `off`.
    pub fn parse(s: &str) -> Option<SameHost> {
        match s {
            "auto" => Some(SameHost::Auto),
            "cma" => Some(SameHost::Cma),
            "off" => Some(SameHost::Off),
            _ => None,
        }
    }
}

impl fmt::Display for SameHost {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SameHost::Auto => "auto",
            SameHost::Cma => "cma",
            SameHost::Off => "off",
        })
    }
}

/// Configuration of a [`crate::TcpEngine`].
///
/// `Default` gives an engine listening on `127.0.0.1:0` (an ephemeral
/// loopback port), without authentication, with one connection per peer.
/// `Debug` never prints the secret (a [`Secret`]).
///
/// `#[non_exhaustive]`: build it with [`TcpConfig::builder`] (which
/// validates like [`TcpConfig::from_url`]), parse it with
/// [`TcpConfig::from_url`], or start from `default()` and assign fields.
///
/// ```
/// use ferry_core::Secret;
/// use ferry_tcp::TcpConfig;
///
/// let config = TcpConfig::builder()
///     .listen("10.0.0.1:7000")
///     .secret(Secret::new("s3cret"))
///     .connections(4)
///     .build()?;
/// assert_eq!(config.connections, 4);
/// assert!(!format!("{config:?}").contains("s3cret"));
/// // The same from a URL.
/// let parsed = TcpConfig::from_url("tcp://10.0.0.1:7000?secret=s3cret&connections=4")?;
/// assert_eq!(format!("{parsed:?}"), format!("{config:?}"));
/// // Out of range: refused naming the field.
/// let e = TcpConfig::builder().connections(0).build().unwrap_err();
/// assert!(e.to_string().contains("connections"));
/// # Ok::<(), ferry_core::Error>(())
/// ```
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct TcpConfig {
    /// Address to listen on, `host:port` (`0` picks a free port). The
    /// engine's segment name is the address actually bound.
    pub listen: String,
    /// Shared secret. When set, the engine refuses inbound peers that do not
    /// prove they know it (HMAC-SHA256 challenge–response) and refuses to
    /// talk to targets that do not prove it back. `None`: no authentication.
    pub secret: Option<Secret>,
    /// TCP connections opened to each peer (1..=16). Requests (and chunks of
    /// large requests) are spread over them round-robin.
    pub connections: usize,
    /// Deadline for connecting to a peer and completing the handshake (as
    /// an initiator).
    pub connect_timeout: Duration,
    /// Base deadline of a batch once sent: a batch of `n` bytes must
    /// complete within `request_timeout + n / min_rate`. On expiry only that
    /// batch's requests fail, with [`Error::Timeout`]; the connection is
    /// dropped only if the peer has sent nothing for `request_timeout`.
    pub request_timeout: Duration,
    /// Inside a frame, a peer must make progress within `stall_timeout`
    /// and finish a payload of `n` bytes within `stall_timeout + n /
    /// min_rate`; otherwise the connection is dropped. This bounds how long
    /// a payload in flight holds a region (and so `unregister`).
    pub stall_timeout: Duration,
    /// Minimum progress rate, bytes per second, of payloads and batches in
    /// flight (see `request_timeout` and `stall_timeout`).
    pub min_rate: u64,
    /// Deadline for an inbound connection to complete the handshake (as a
    /// target). Short: a connection in the handshake holds a slot of the
    /// small handshake budget.
    pub handshake_timeout: Duration,
    /// Most inbound connections in the handshake at once, apart from the
    /// `max_inbound` established ones. When full, a new connection evicts
    /// the oldest handshake of the source address holding the most of
    /// them (which receives `Busy`), so a flood from some addresses cannot
    /// keep peers at other addresses — or a fast legitimate handshake —
    /// out.
    pub max_handshakes: usize,
    /// An established inbound connection with no request for this long is
    /// closed (whether or not a secret is set). Initiators learn it in the
    /// handshake and retire their idle connections before it expires.
    pub idle_timeout: Duration,
    /// When `max_inbound` connections are established, a newly
    /// authenticated one evicts an established connection that has been
    /// idle at least this long (of the source address holding the most,
    /// the longest idle); if none has, it is refused with `Busy`.
    pub evict_idle: Duration,
    /// Requests longer than this are split into chunks of at most this many
    /// bytes (1..=64 MiB), spread over the connections.
    pub chunk_size: usize,
    /// Most requests one batch may hold.
    pub max_batch: usize,
    /// Most established inbound connections served at once; more are
    /// refused with `Busy`.
    pub max_inbound: usize,
    /// Most established inbound connections from one source (an IPv4
    /// address, or an IPv6 /64) at once: beyond it the source's own idle
    /// connection is evicted, or the new one refused with `Busy`, so one
    /// source holding idle connections cannot take every slot from the
    /// others. `0`: a quarter of `max_inbound` (at least 1), the default.
    pub max_per_source: usize,
    /// How long an idle connection polls the socket before sleeping in the
    /// kernel (bounded busy-poll: lower latency, no spinning while idle).
    /// Zero disables polling.
    pub spin: Duration,
    /// While an initiator's connection has requests outstanding, its reader
    /// keeps polling for responses until this long after the connection's
    /// last activity (a request sent or a response received), decided as
    /// it polls; then it sleeps. Polling avoids the wake-up latency of an
    /// idle CPU (tens of µs per wake-up on small VMs) at the cost of a core
    /// polling while transfers are in flight — never while idle (with
    /// nothing outstanding only `spin` applies). Zero: `spin` only.
    pub spin_pending: Duration,
    /// `SO_SNDBUF`/`SO_RCVBUF` in bytes; `None` leaves the kernel's
    /// auto-tuning alone.
    pub socket_buffer: Option<usize>,
    /// The same-host path (cross-memory attach between engines on one
    /// machine): `Auto` uses it when the peer is on this host and the
    /// kernel allows it, `Cma` requires it (connecting fails with the
    /// reason otherwise), `Off` never uses it (and refuses initiators that
    /// ask). See the README for requirements and the security model.
    pub same_host: SameHost,
    /// On the same-host path, move the connection's frames to a Unix
    /// socket pair the target takes over (`true`, the default: each
    /// request and acknowledgement costs a few µs less than on loopback
    /// TCP), or keep them on the TCP connection (`false`). Either way a
    /// target that cannot take the pair (no `pidfd_getfd`) keeps TCP and
    /// the report says why.
    pub same_host_unix: bool,
    /// On the same-host path, requests larger than this are split into
    /// CWRITE / CREAD frames of this size (instead of `chunk_size`): each
    /// frame is one kernel copy, which the target may split over its copy
    /// helper (see the README), so large frames copy fastest. 4 KiB to
    /// 64 MiB.
    pub same_host_chunk: usize,
    /// On the same-host path, frames of at least this many bytes (and
    /// below [`crate::same_host::cma::PARALLEL_MIN`], 8 MiB) move through the
    /// connection's staging area — two pipelined copies, one by each
    /// process — instead of one cross-memory copy by the target (see
    /// [`crate::same_host::stage`]). `None` (URL `same_host_stage=off`): never; no
    /// area is offered. Default 1: every frame below 8 MiB (small ones
    /// gain too: no `process_vm_*` call and no liveness check per copy).
    pub same_host_stage: Option<usize>,
    /// On the same-host path, let the initiator copy frames below 8 MiB
    /// straight into (out of) the target's registered memory under the
    /// grants the target publishes (`true`, the default; with a peer that
    /// has them, and only with a staging area, whose page they use): one
    /// `process_vm_writev` per call instead of a round trip through the
    /// target (see [`crate::same_host::grant`]). Off (URL
    /// `same_host_grant=off`): an initiator never copies, a target grants
    /// nothing (its peers then stage, as with an older target).
    pub same_host_grant: bool,
    /// As a target, the uids besides this process's effective uid whose
    /// processes may get the same-host path (URL `same_host_uids=1000,1001`;
    /// default none). The target copies with its own privileges into and
    /// out of the initiator's memory, so it accepts only an initiator the
    /// kernel attests is of its own uid or of one listed here.
    pub same_host_uids: Vec<u32>,
    /// Listen on an address other hosts can reach without a `secret`
    /// (URL `insecure=1`). Without it [`crate::TcpEngine::start`] refuses
    /// such an engine: anyone who can reach its port could read and write
    /// every registered byte. Loopback addresses need no secret.
    pub insecure: bool,
    /// TLS 1.3 on the socket path (URL `tls=off|on|require`, see
    /// [`crate::tls`]): `Off` (default) never; `On` with every peer that
    /// has it on, in clear with the others; `Require` refuses peers
    /// without it. The same-host path is not encrypted (it never leaves
    /// the machine).
    pub tls: crate::tls::TlsMode,
    /// PEM certificate chain this engine presents (URL `tls_cert=`);
    /// with `tls_key` and `tls_ca`. Without the three, the TLS identity is
    /// derived from `secret`.
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of `tls_cert` (URL `tls_key=`).
    pub tls_key: Option<PathBuf>,
    /// PEM CA certificates that peers' chains must chain to (URL
    /// `tls_ca=`): both directions are checked (mutual authentication).
    pub tls_ca: Option<PathBuf>,
}

impl Default for TcpConfig {
    fn default() -> Self {
        TcpConfig {
            listen: "127.0.0.1:0".to_owned(),
            secret: None,
            connections: 1,
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(30),
            stall_timeout: Duration::from_secs(10),
            min_rate: 4 << 20,
            handshake_timeout: Duration::from_secs(2),
            max_handshakes: 128,
            idle_timeout: Duration::from_secs(300),
            evict_idle: Duration::from_secs(1),
            chunk_size: 1 << 20,
            max_batch: 65_536,
            max_inbound: 1024,
            max_per_source: 0,
            spin: Duration::from_micros(50),
            spin_pending: Duration::from_micros(200),
            socket_buffer: None,
            same_host: SameHost::Auto,
            same_host_unix: true,
            same_host_chunk: 16 << 20,
            same_host_stage: Some(1),
            same_host_grant: true,
            same_host_uids: Vec::new(),
            insecure: false,
            tls: crate::tls::TlsMode::Off,
            tls_cert: None,
            tls_key: None,
            tls_ca: None,
        }
    }
}

ferry_core::__config_builder! {
    /// Builds a [`TcpConfig`] ([`TcpConfig::builder`]): one setter per
    /// field; `build()` validates.
    pub struct TcpConfigBuilder for TcpConfig {
        into listen: String,
        some secret: Secret,
        set connections: usize,
        set connect_timeout: Duration,
        set request_timeout: Duration,
        set stall_timeout: Duration,
        set min_rate: u64,
        set handshake_timeout: Duration,
        set max_handshakes: usize,
        set idle_timeout: Duration,
        set evict_idle: Duration,
        set chunk_size: usize,
        set max_batch: usize,
        set max_inbound: usize,
        set max_per_source: usize,
        set spin: Duration,
        set spin_pending: Duration,
        set socket_buffer: Option<usize>,
        set same_host: SameHost,
        set same_host_unix: bool,
        set same_host_chunk: usize,
        set same_host_stage: Option<usize>,
        set same_host_grant: bool,
        set same_host_uids: Vec<u32>,
        set insecure: bool,
        set tls: crate::tls::TlsMode,
        some tls_cert: PathBuf,
        some tls_key: PathBuf,
        some tls_ca: PathBuf,
    }
}

fn invalid(msg: String) -> Error {
    Error::InvalidArgument(msg)
}

/// `*dst = v` if there is a value.
fn set<T>(dst: &mut T, v: Option<T>) {
    if let Some(v) = v {
        *dst = v;
    }
}

impl TcpConfig {
    /// The settings that decide this engine's features in a handshake
    /// ([`crate::negotiate::our_features`]).
    pub(crate) fn feature_settings(&self) -> FeatureSettings {
        FeatureSettings {
            same_host_on: self.same_host != SameHost::Off,
            tls_on: self.tls != crate::tls::TlsMode::Off,
            unix: self.same_host_unix,
            stage: self.same_host_stage.is_some(),
            grant: self.same_host_grant,
        }
    }

    /// The effective per-source bound (see [`TcpConfig::max_per_source`]).
    pub fn per_source_limit(&self) -> usize {
        match self.max_per_source {
            0 => (self.max_inbound / 4).max(1),
            n => n.min(self.max_inbound),
        }
    }

    /// The deadline for moving `bytes` on top of `base`: `base + bytes /
    /// min_rate` (saturating).
    pub fn deadline_for(&self, base: Duration, bytes: u64) -> Duration {
        let per = Duration::try_from_secs_f64(bytes as f64 / self.min_rate.max(1) as f64)
            .unwrap_or(Duration::MAX);
        base.saturating_add(per)
    }

    /// Parses `tcp://HOST:PORT?param=value&...` into a configuration.
    ///
    /// `HOST:PORT` is the listen address (`[::1]:7000` for IPv6; the port
    /// defaults to 0, an ephemeral port). Parameters (all optional; the
    /// defaults are those of [`TcpConfig::default`]):
    ///
    /// | parameter            | field             | meaning                                  |
    /// |----------------------|-------------------|------------------------------------------|
    /// | `secret`             | `secret`          | shared secret (percent-encoded)          |
    /// | `connections`        | `connections`     | connections per peer, 1..=16             |
    /// | `timeout_ms`         | `request_timeout` | batch / progress deadline, ms (> 0)      |
    /// | `connect_timeout_ms` | `connect_timeout` | connect + handshake deadline, ms (> 0)   |
    /// | `chunk_size`         | `chunk_size`      | split size in bytes, 1..=67108864        |
    /// | `max_batch`          | `max_batch`       | most requests per batch (> 0)            |
    /// | `max_inbound`        | `max_inbound`     | most established inbound connections (> 0) |
    /// | `max_per_source`     | `max_per_source`  | most of them from one source (0: a quarter of `max_inbound`) |
    /// | `stall_timeout_ms`   | `stall_timeout`   | in-frame progress deadline, ms (> 0)     |
    /// | `min_rate`           | `min_rate`        | minimum bytes/s of payloads in flight (> 0) |
    /// | `handshake_timeout_ms` | `handshake_timeout` | inbound handshake deadline, ms (> 0) |
    /// | `max_handshakes`     | `max_handshakes`  | inbound handshakes at once (> 0)         |
    /// | `idle_timeout_ms`    | `idle_timeout`    | idle inbound connection deadline, ms (> 0) |
    /// | `evict_idle_ms`      | `evict_idle`      | idle time after which a connection may be evicted for a new one, ms |
    /// | `spin_us`            | `spin`            | busy-poll before sleeping, µs (0: none)  |
    /// | `spin_pending_us`    | `spin_pending`    | same while requests are outstanding, µs  |
    /// | `socket_buffer`      | `socket_buffer`   | SO_SNDBUF/SO_RCVBUF bytes (0: kernel)    |
    /// | `same_host`          | `same_host`       | `auto`, `cma` or `off` (same-host path)  |
    /// | `same_host_control`  | `same_host_unix`  | `unix` (true) or `tcp` (false): where a same-host connection's frames go |
    /// | `same_host_chunk`    | `same_host_chunk` | bytes per CWRITE / CREAD frame on the same-host path (4096..=64 MiB) |
    /// | `same_host_stage`    | `same_host_stage` | smallest frame moved through the staging area, bytes (1..=64 MiB), or `off` |
    /// | `same_host_grant`    | `same_host_grant` | `on` (default) or `off`: the initiator copies into memory the target granted (off on either side: never) |
    /// | `same_host_uids`     | `same_host_uids`  | comma-separated uids whose processes a target also accepts on the same-host path (besides its own) |
    /// | `insecure`           | `insecure`        | `1`: listen beyond loopback without a secret (refused otherwise) |
    /// | `tls`                | `tls`             | `off` (default), `on` (with peers that have it) or `require` |
    /// | `tls_cert`           | `tls_cert`        | PEM certificate chain file (with `tls_key`, `tls_ca`) |
    /// | `tls_key`            | `tls_key`         | PEM private key file                     |
    /// | `tls_ca`             | `tls_ca`          | PEM CA file peers' chains are checked against |
    ///
    /// The URL is parsed by [`ParsedUrl`] (strict percent-decoding, `+` is
    /// a space, no fragment, no userinfo). An unknown parameter (named,
    /// with the list of known ones), a repeated one, a malformed
    /// percent-escape, a value out of range, a path or another scheme than
    /// `tcp` is [`Error::InvalidArgument`] naming it; no message quotes the
    /// secret. `insecure` takes `1`/`0` or `true`/`false` only.
    pub fn from_url(url: &str) -> Result<TcpConfig> {
        TcpConfig::from_parts(ParsedUrl::parse(url)?)
    }

    /// [`TcpConfig::from_url`] on a URL already parsed (the facade takes
    /// its own parameters out of it first, then hands it over): takes every
    /// parameter above, then refuses what is left.
    pub fn from_parts(mut url: ParsedUrl) -> Result<TcpConfig> {
        // Messages quote the URL with its secrets hidden.
        let shown = url.shown().to_owned();
        if url.scheme() != "tcp" {
            return Err(invalid(format!(
                "URL {shown:?} has scheme {:?}; the tcp backend needs tcp://HOST:PORT",
                url.scheme()
            )));
        }
        if !(url.path().is_empty() || url.path() == "/") {
            return Err(invalid(format!(
                "tcp URL {shown:?} has a path; only tcp://HOST:PORT?params is accepted"
            )));
        }
        let (host, port) = url.host_port()?;
        if host.is_empty() {
            return Err(invalid(format!("tcp URL {shown:?} has no host")));
        }
        let mut cfg = TcpConfig {
            listen: format!("{host}:{}", port.unwrap_or(0)),
            ..TcpConfig::default()
        };
        cfg.secret = url.take_secret("secret")?;
        set(&mut cfg.connections, url.take("connections")?);
        set(
            &mut cfg.request_timeout,
            url.take_duration_ms("timeout_ms")?,
        );
        set(
            &mut cfg.connect_timeout,
            url.take_duration_ms("connect_timeout_ms")?,
        );
        set(&mut cfg.chunk_size, url.take("chunk_size")?);
        set(&mut cfg.max_batch, url.take("max_batch")?);
        set(&mut cfg.max_inbound, url.take("max_inbound")?);
        set(&mut cfg.max_per_source, url.take("max_per_source")?);
        set(
            &mut cfg.stall_timeout,
            url.take_duration_ms("stall_timeout_ms")?,
        );
        set(&mut cfg.min_rate, url.take("min_rate")?);
        set(
            &mut cfg.handshake_timeout,
            url.take_duration_ms("handshake_timeout_ms")?,
        );
        set(&mut cfg.max_handshakes, url.take("max_handshakes")?);
        set(
            &mut cfg.idle_timeout,
            url.take_duration_ms("idle_timeout_ms")?,
        );
        set(&mut cfg.evict_idle, url.take_duration_ms("evict_idle_ms")?);
        set(&mut cfg.spin, url.take_duration_us("spin_us")?);
        set(
            &mut cfg.spin_pending,
            url.take_duration_us("spin_pending_us")?,
        );
        if let Some(n) = url.take::<usize>("socket_buffer")? {
            cfg.socket_buffer = (n > 0).then_some(n);
        }
        set(
            &mut cfg.same_host,
            url.take_with("same_host", "auto, cma or off", SameHost::parse)?,
        );
        set(
            &mut cfg.same_host_unix,
            url.take_with("same_host_control", "unix or tcp", |v| match v {
                "unix" => Some(true),
                "tcp" => Some(false),
                _ => None,
            })?,
        );
        set(
            &mut cfg.same_host_chunk,
            url.take_with(
                "same_host_chunk",
                &format!("a byte count 4096..={MAX_OP_LEN}"),
                |v| {
                    let n = v.parse::<u64>().ok()?;
                    (4096..=MAX_OP_LEN).contains(&n).then_some(n as usize)
                },
            )?,
        );
        set(
            &mut cfg.same_host_stage,
            url.take_with(
                "same_host_stage",
                &format!("a byte count 1..={MAX_OP_LEN} or off"),
                |v| {
                    if v == "off" {
                        return Some(None);
                    }
                    let n = v.parse::<u64>().ok()?;
                    (1..=MAX_OP_LEN).contains(&n).then_some(Some(n as usize))
                },
            )?,
        );
        set(
            &mut cfg.same_host_grant,
            url.take_with("same_host_grant", "on or off", |v| match v {
                "on" => Some(true),
                "off" => Some(false),
                _ => None,
            })?,
        );
        set(
            &mut cfg.same_host_uids,
            url.take_with("same_host_uids", "comma-separated uids", |v| {
                v.split(',')
                    .filter(|u| !u.is_empty())
                    .map(|u| u.trim().parse::<u32>().ok())
                    .collect::<Option<Vec<u32>>>()
            })?,
        );
        // Deliberately strict (not `take_bool`: no `yes`/`on`, no bare
        // key): it opens the engine to every host that can reach it.
        set(
            &mut cfg.insecure,
            url.take_with("insecure", "1 or 0 (true or false)", |v| match v {
                "1" | "true" => Some(true),
                "0" | "false" => Some(false),
                _ => None,
            })?,
        );
        if let Some(v) = url.take_str("tls")? {
            cfg.tls = crate::tls::TlsMode::parse(&v).ok_or_else(|| {
                invalid(format!(
                    "tcp URL parameter `tls`: {v:?} must be off, on or require"
                ))
            })?;
        }
        for key in ["tls_cert", "tls_key", "tls_ca"] {
            let Some(value) = url.take_str(key)? else {
                continue;
            };
            if value.is_empty() {
                return Err(invalid(format!("tcp URL parameter `{key}` is empty")));
            }
            let path = Some(PathBuf::from(value));
            match key {
                "tls_cert" => cfg.tls_cert = path,
                "tls_key" => cfg.tls_key = path,
                _ => cfg.tls_ca = path,
            }
        }
        url.finish()?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks every field's range ([`Error::InvalidArgument`] naming it).
    pub fn validate(&self) -> Result<()> {
        if !(1..=16).contains(&self.connections) {
            return Err(invalid(format!(
                "connections must be 1..=16, not {}",
                self.connections
            )));
        }
        if self.chunk_size == 0 || self.chunk_size as u64 > MAX_OP_LEN {
            return Err(invalid(format!(
                "chunk_size must be 1..={MAX_OP_LEN}, not {}",
                self.chunk_size
            )));
        }
        if self.request_timeout.is_zero() {
            return Err(invalid("timeout_ms (request_timeout) must be > 0".into()));
        }
        if self.connect_timeout.is_zero() {
            return Err(invalid(
                "connect_timeout_ms (connect_timeout) must be > 0".into(),
            ));
        }
        if self.max_batch == 0 {
            return Err(invalid("max_batch must be > 0".into()));
        }
        if self.max_inbound == 0 {
            return Err(invalid("max_inbound must be > 0".into()));
        }
        if self.max_handshakes == 0 {
            return Err(invalid("max_handshakes must be > 0".into()));
        }
        if self.min_rate == 0 {
            return Err(invalid("min_rate must be > 0".into()));
        }
        for (name, d) in [
            ("stall_timeout_ms (stall_timeout)", self.stall_timeout),
            (
                "handshake_timeout_ms (handshake_timeout)",
                self.handshake_timeout,
            ),
            ("idle_timeout_ms (idle_timeout)", self.idle_timeout),
        ] {
            if d.is_zero() {
                return Err(invalid(format!("{name} must be > 0")));
            }
        }
        if self.secret.as_ref().is_some_and(Secret::is_empty) {
            return Err(invalid("secret must not be empty".into()));
        }
        let files = [&self.tls_cert, &self.tls_key, &self.tls_ca]
            .iter()
            .filter(|f| f.is_some())
            .count();
        if files != 0 && files != 3 {
            return Err(invalid(
                "tls_cert, tls_key and tls_ca go together (each side presents its chain and \
                 checks the peer's against the CA)"
                    .into(),
            ));
        }
        if self.tls != crate::tls::TlsMode::Off && files == 0 && self.secret.is_none() {
            return Err(invalid(
                "tls=on/require needs a shared secret (the TLS identity is derived from it) \
                 or tls_cert, tls_key and tls_ca"
                    .into(),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_parameter() {
        let c = TcpConfig::from_url(
            "tcp://0.0.0.0:7000?secret=s%26x&connections=4&timeout_ms=1500&connect_timeout_ms=20\
             &chunk_size=65536&max_batch=10&max_inbound=3&spin_us=0&spin_pending_us=7&socket_buffer=1048576\
             &stall_timeout_ms=5&min_rate=9&handshake_timeout_ms=6&max_handshakes=7&idle_timeout_ms=8\
             &evict_idle_ms=0&same_host=off&same_host_control=tcp&same_host_chunk=8192",
        )
        .unwrap();
        assert_eq!(c.stall_timeout, Duration::from_millis(5));
        assert_eq!(c.min_rate, 9);
        assert_eq!(c.handshake_timeout, Duration::from_millis(6));
        assert_eq!(c.max_handshakes, 7);
        assert_eq!(c.idle_timeout, Duration::from_millis(8));
        assert_eq!(c.evict_idle, Duration::ZERO);
        assert_eq!(c.same_host, SameHost::Off);
        assert_eq!(TcpConfig::default().same_host, SameHost::Auto);
        assert_eq!(SameHost::parse("cma"), Some(SameHost::Cma));
        assert_eq!(SameHost::parse("on"), None);
        assert!(TcpConfig::from_url("tcp://h:1?same_host=yes").is_err());
        assert!(!c.same_host_unix);
        assert!(TcpConfig::default().same_host_unix);
        assert!(TcpConfig::from_url("tcp://h:1?same_host_control=udp").is_err());
        assert_eq!(c.same_host_chunk, 8192);
        assert_eq!(TcpConfig::default().same_host_chunk, 16 << 20);
        assert!(TcpConfig::from_url("tcp://h:1?same_host_chunk=100").is_err());
        assert_eq!(TcpConfig::default().same_host_stage, Some(1));
        let staged = |v: &str| TcpConfig::from_url(&format!("tcp://h:1?same_host_stage={v}"));
        assert_eq!(staged("off").unwrap().same_host_stage, None);
        assert_eq!(staged("4096").unwrap().same_host_stage, Some(4096));
        assert!(staged("0").is_err());
        assert!(staged("134217728").is_err());
        assert!(staged("big").is_err());
        assert!(TcpConfig::from_url("tcp://h:1?same_host_chunk=134217728").is_err());
        assert_eq!(
            c.deadline_for(Duration::from_secs(1), 18),
            Duration::from_secs(3)
        );
        assert!(TcpConfig::from_url("tcp://h:1?min_rate=0").is_err());
        assert!(TcpConfig::from_url("tcp://h:1?idle_timeout_ms=0").is_err());
        assert_eq!(c.listen, "0.0.0.0:7000");
        assert_eq!(c.secret.as_ref().map(Secret::expose), Some("s&x"));
        assert_eq!(c.connections, 4);
        assert_eq!(c.request_timeout, Duration::from_millis(1500));
        assert_eq!(c.connect_timeout, Duration::from_millis(20));
        assert_eq!(c.chunk_size, 65536);
        assert_eq!(c.max_batch, 10);
        assert_eq!(c.max_inbound, 3);
        assert_eq!(c.spin, Duration::ZERO);
        assert_eq!(c.spin_pending, Duration::from_micros(7));
        assert_eq!(c.socket_buffer, Some(1 << 20));
        assert!(!format!("{c:?}").contains("s&x"), "Debug leaks the secret");
    }

    #[test]
    fn defaults_and_ipv6() {
        let c = TcpConfig::from_url("tcp://127.0.0.1").unwrap();
        assert_eq!(c.listen, "127.0.0.1:0");
        let c = TcpConfig::from_url("tcp://[::1]:9000").unwrap();
        assert_eq!(c.listen, "[::1]:9000");
        assert_eq!(TcpConfig::default().listen, "127.0.0.1:0");
    }

    #[test]
    fn rejects_bad_input_naming_it() {
        let e = TcpConfig::from_url("tcp://h:1?colour=blue").unwrap_err();
        assert!(
            matches!(&e, Error::InvalidArgument(m) if m.contains("colour")),
            "{e}"
        );
        let e = TcpConfig::from_url("tcp://h:1?connections=0").unwrap_err();
        assert!(matches!(&e, Error::InvalidArgument(m) if m.contains("connections")));
        let e = TcpConfig::from_url("tcp://h:1?timeout_ms=x").unwrap_err();
        assert!(matches!(&e, Error::InvalidArgument(m) if m.contains("timeout_ms")));
        let e = TcpConfig::from_url("tcp://h:1?spin_us=1&spin_us=2").unwrap_err();
        assert!(matches!(&e, Error::InvalidArgument(m) if m.contains("spin_us")));
        assert!(TcpConfig::from_url("rdma://h:1").is_err());
        assert!(TcpConfig::from_url("tcp://h:1/path").is_err());
        assert!(TcpConfig::from_url("tcp://h:1?chunk_size=0").is_err());
        // Strict percent-decoding (the `url` crate let `%+5` through as it
        // was), no fragment, no userinfo, names the known parameters.
        let msg = |u: &str| TcpConfig::from_url(u).unwrap_err().to_string();
        assert!(msg("tcp://h:1?connections=%+5").contains("`connections`"));
        assert!(msg("tcp://h:1?timeout_ms=1%G1").contains("percent-escape"));
        assert!(msg("tcp://h:1#x").contains("fragment"));
        assert!(msg("tcp://u:p@h:1").contains("user information"));
        assert!(
            msg("tcp://h:1?c%6Fnnections=1&connections=2").contains("`connections` given twice")
        );
        let m = msg("tcp://h:1?colour=blue");
        assert!(
            m.contains("known: secret, connections, timeout_ms") && m.contains("tls_ca"),
            "{m}"
        );
        assert!(msg("tcp://h:1?secret").contains("`secret` is empty"));
        assert!(msg("tcp://h:1?tls_ca=").contains("`tls_ca` is empty"));
        // `insecure` stays strict: no `yes`/`on`, no bare key.
        for u in [
            "tcp://h:1?insecure=on",
            "tcp://h:1?insecure=yes",
            "tcp://h:1?insecure",
        ] {
            assert!(msg(u).contains("`insecure`"), "{u}");
        }
        assert!(msg("tcp://h:99999").contains("port"));
        assert!(msg("tcp://:1").contains("no host"));
        // An encoded key is the key it decodes to.
        let c = TcpConfig::from_url("tcp://h:1?s%65cret=x%2By+z&insecure=true").unwrap();
        assert_eq!(c.secret.as_ref().map(Secret::expose), Some("x+y z"));
        assert!(c.insecure);
    }

    #[test]
    fn builder_sets_and_validates() {
        let c = TcpConfig::builder()
            .listen("0.0.0.0:7000")
            .secret(Secret::new("s3cret"))
            .connections(4)
            .socket_buffer(Some(1 << 20))
            .tls_ca("/etc/ca.pem")
            .tls_cert("/etc/c.pem")
            .tls_key("/etc/k.pem")
            .build()
            .unwrap();
        assert_eq!(c.listen, "0.0.0.0:7000");
        assert_eq!(c.secret.as_ref().map(Secret::expose), Some("s3cret"));
        assert_eq!((c.connections, c.socket_buffer), (4, Some(1 << 20)));
        assert_eq!(
            c.tls_ca.as_deref(),
            Some(std::path::Path::new("/etc/ca.pem"))
        );
        let shown = format!("{c:?}");
        assert!(
            !shown.contains("s3cret") && shown.contains("<redacted>"),
            "{shown}"
        );
        for bad in [
            TcpConfig::builder().connections(17),
            TcpConfig::builder().secret(""),
            TcpConfig::builder().tls_ca("/etc/ca.pem"),
            TcpConfig::builder().request_timeout(Duration::ZERO),
        ] {
            assert!(matches!(bad.build(), Err(Error::InvalidArgument(_))));
        }
    }
}
