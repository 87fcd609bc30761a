//! Engine configuration and its URL form.

use std::fmt;
use std::time::Duration;

use ferry_core::{Error, Result};

use crate::frame::MAX_OP_LEN;
use crate::same_host::cma::SameHost;

/// Configuration of a [`crate::TcpEngine`].
///
/// `Default` gives an engine listening on `127.0.0.1:0` (an ephemeral
/// loopback port), without authentication, with one connection per peer.
/// `Debug` never prints the secret.
#[derive(Clone)]
pub struct TcpConfig {
    /// Address to listen on, `host:port` (`0` picks a free port). The
    /// engine's segment name is the address actually bound.
    pub listen: String,
    /// Shared secret. When set, the engine refuses inbound peers that do not
    /// prove they know it (HMAC-SHA256 challenge–response) and refuses to
    /// talk to targets that do not prove it back. `None`: no authentication.
    pub secret: Option<String>,
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
    pub tls_cert: Option<std::path::PathBuf>,
    /// PEM private key of `tls_cert` (URL `tls_key=`).
    pub tls_key: Option<std::path::PathBuf>,
    /// PEM CA certificates that peers' chains must chain to (URL
    /// `tls_ca=`): both directions are checked (mutual authentication).
    pub tls_ca: Option<std::path::PathBuf>,
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
            insecure: false,
            tls: crate::tls::TlsMode::Off,
            tls_cert: None,
            tls_key: None,
            tls_ca: None,
        }
    }
}

impl fmt::Debug for TcpConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TcpConfig")
            .field("listen", &self.listen)
            .field("secret", &self.secret.as_ref().map(|_| "<redacted>"))
            .field("connections", &self.connections)
            .field("connect_timeout", &self.connect_timeout)
            .field("request_timeout", &self.request_timeout)
            .field("stall_timeout", &self.stall_timeout)
            .field("min_rate", &self.min_rate)
            .field("handshake_timeout", &self.handshake_timeout)
            .field("max_handshakes", &self.max_handshakes)
            .field("idle_timeout", &self.idle_timeout)
            .field("evict_idle", &self.evict_idle)
            .field("chunk_size", &self.chunk_size)
            .field("max_batch", &self.max_batch)
            .field("max_inbound", &self.max_inbound)
            .field("max_per_source", &self.max_per_source)
            .field("spin", &self.spin)
            .field("spin_pending", &self.spin_pending)
            .field("socket_buffer", &self.socket_buffer)
            .field("same_host", &self.same_host)
            .field("same_host_unix", &self.same_host_unix)
            .field("same_host_chunk", &self.same_host_chunk)
            .field("same_host_stage", &self.same_host_stage)
            .field("insecure", &self.insecure)
            .field("tls", &self.tls)
            .field("tls_cert", &self.tls_cert)
            .field("tls_key", &self.tls_key)
            .field("tls_ca", &self.tls_ca)
            .finish()
    }
}

fn invalid(msg: String) -> Error {
    Error::InvalidArgument(msg)
}

fn parse_num(key: &str, value: &str) -> Result<u64> {
    value
        .parse::<u64>()
        .map_err(|_| invalid(format!("tcp URL parameter {key}={value:?} is not a number")))
}

impl TcpConfig {
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
    /// | `insecure`           | `insecure`        | `1`: listen beyond loopback without a secret (refused otherwise) |
    /// | `tls`                | `tls`             | `off` (default), `on` (with peers that have it) or `require` |
    /// | `tls_cert`           | `tls_cert`        | PEM certificate chain file (with `tls_key`, `tls_ca`) |
    /// | `tls_key`            | `tls_key`         | PEM private key file                     |
    /// | `tls_ca`             | `tls_ca`          | PEM CA file peers' chains are checked against |
    ///
    /// An unknown parameter, a repeated one, a value out of range or another
    /// scheme than `tcp` is [`Error::InvalidArgument`] naming it.
    pub fn from_url(url: &str) -> Result<TcpConfig> {
        // Messages quote the URL with its secrets hidden.
        let shown = ferry_core::raw::redact_url(url);
        let parsed =
            url::Url::parse(url).map_err(|e| invalid(format!("bad tcp URL {shown:?}: {e}")))?;
        if parsed.scheme() != "tcp" {
            return Err(invalid(format!(
                "URL {shown:?} has scheme {:?}; the tcp backend needs tcp://HOST:PORT",
                parsed.scheme()
            )));
        }
        let host = parsed
            .host_str()
            .filter(|h| !h.is_empty())
            .ok_or_else(|| invalid(format!("tcp URL {shown:?} has no host")))?;
        if !(parsed.path().is_empty() || parsed.path() == "/") {
            return Err(invalid(format!(
                "tcp URL {shown:?} has a path; only tcp://HOST:PORT?params is accepted"
            )));
        }
        let port = parsed.port().unwrap_or(0);
        let mut cfg = TcpConfig {
            listen: format!("{host}:{port}"),
            ..TcpConfig::default()
        };
        let mut seen = std::collections::HashSet::new();
        for (key, value) in parsed.query_pairs() {
            if !seen.insert(key.to_string()) {
                return Err(invalid(format!("tcp URL parameter {key} is given twice")));
            }
            match key.as_ref() {
                "secret" => {
                    if value.is_empty() {
                        return Err(invalid("tcp URL parameter secret is empty".to_owned()));
                    }
                    cfg.secret = Some(value.to_string());
                }
                "insecure" => {
                    cfg.insecure = match value.as_ref() {
                        "1" | "true" => true,
                        "0" | "false" => false,
                        v => {
                            return Err(invalid(format!(
                                "tcp URL parameter insecure={v:?} must be 1 or 0"
                            )))
                        }
                    }
                }
                "tls" => {
                    cfg.tls = crate::tls::TlsMode::parse(&value).ok_or_else(|| {
                        invalid(format!(
                            "tcp URL parameter tls={value:?} must be off, on or require"
                        ))
                    })?
                }
                "tls_cert" | "tls_key" | "tls_ca" => {
                    if value.is_empty() {
                        return Err(invalid(format!("tcp URL parameter {key} is empty")));
                    }
                    let path = Some(std::path::PathBuf::from(value.as_ref()));
                    match key.as_ref() {
                        "tls_cert" => cfg.tls_cert = path,
                        "tls_key" => cfg.tls_key = path,
                        _ => cfg.tls_ca = path,
                    }
                }
                "connections" => cfg.connections = parse_num(&key, &value)? as usize,
                "timeout_ms" => {
                    cfg.request_timeout = Duration::from_millis(parse_num(&key, &value)?)
                }
                "connect_timeout_ms" => {
                    cfg.connect_timeout = Duration::from_millis(parse_num(&key, &value)?)
                }
                "chunk_size" => cfg.chunk_size = parse_num(&key, &value)? as usize,
                "max_batch" => cfg.max_batch = parse_num(&key, &value)? as usize,
                "max_inbound" => cfg.max_inbound = parse_num(&key, &value)? as usize,
                "max_per_source" => {
                    let n: u64 = value.parse().map_err(|_| {
                        invalid(format!("tcp URL parameter max_per_source={value:?} is not a number"))
                    })?;
                    cfg.max_per_source = n as usize;
                }
                "stall_timeout_ms" => {
                    cfg.stall_timeout = Duration::from_millis(parse_num(&key, &value)?)
                }
                "min_rate" => cfg.min_rate = parse_num(&key, &value)?,
                "handshake_timeout_ms" => {
                    cfg.handshake_timeout = Duration::from_millis(parse_num(&key, &value)?)
                }
                "max_handshakes" => cfg.max_handshakes = parse_num(&key, &value)? as usize,
                "idle_timeout_ms" => {
                    cfg.idle_timeout = Duration::from_millis(parse_num(&key, &value)?)
                }
                "evict_idle_ms" => cfg.evict_idle = Duration::from_millis(parse_num(&key, &value)?),
                "spin_us" => cfg.spin = Duration::from_micros(parse_num(&key, &value)?),
                "spin_pending_us" => {
                    cfg.spin_pending = Duration::from_micros(parse_num(&key, &value)?)
                }
                "socket_buffer" => {
                    let n = parse_num(&key, &value)? as usize;
                    cfg.socket_buffer = (n > 0).then_some(n);
                }
                "same_host" => {
                    cfg.same_host = SameHost::parse(&value).ok_or_else(|| {
                        invalid(format!(
                            "tcp URL parameter same_host={value:?} must be auto, cma or off"
                        ))
                    })?
                }
                "same_host_chunk" => {
                    let n = parse_num(&key, &value)?;
                    if !(4096..=crate::frame::MAX_OP_LEN).contains(&n) {
                        return Err(invalid(format!(
                            "tcp URL parameter same_host_chunk={n} must be 4096..={}",
                            crate::frame::MAX_OP_LEN
                        )));
                    }
                    cfg.same_host_chunk = n as usize;
                }
                "same_host_stage" => {
                    cfg.same_host_stage = if value == "off" {
                        None
                    } else {
                        let n = parse_num(&key, &value)?;
                        if !(1..=crate::frame::MAX_OP_LEN).contains(&n) {
                            return Err(invalid(format!(
                                "tcp URL parameter same_host_stage={n} must be 1..={} or off",
                                crate::frame::MAX_OP_LEN
                            )));
                        }
                        Some(n as usize)
                    }
                }
                "same_host_control" => {
                    cfg.same_host_unix = match &*value {
                        "unix" => true,
                        "tcp" => false,
                        _ => {
                            return Err(invalid(format!(
                                "tcp URL parameter same_host_control={value:?} must be unix or tcp"
                            )))
                        }
                    }
                }
                other => {
                    return Err(invalid(format!(
                        "unknown tcp URL parameter {other:?}; known: secret, connections, \
                         timeout_ms, connect_timeout_ms, chunk_size, max_batch, max_inbound, \
                         stall_timeout_ms, min_rate, handshake_timeout_ms, max_handshakes, \
                         idle_timeout_ms, evict_idle_ms, spin_us, spin_pending_us, socket_buffer, same_host, \
                         same_host_control, same_host_chunk, same_host_stage, insecure, \
                         tls, tls_cert, tls_key, tls_ca"
                    )))
                }
            }
        }
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
        if self.secret.as_deref() == Some("") {
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
        assert_eq!(c.secret.as_deref(), Some("s&x"));
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
    }
}
