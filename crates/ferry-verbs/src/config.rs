//! [`VerbsConfig`]: every knob of the verbs backend, parsed from a
//! `verbs://DEVICE?key=value&...` URL.

use std::net::SocketAddr;

use ferry_core::{Error, Result};

/// Configuration of a [`crate::VerbsEngine`].
///
/// Build it with [`VerbsConfig::from_url`] or start from
/// [`VerbsConfig::default`] and set fields. Values that depend on the device
/// (`None` fields, and limits such as `sq_depth`) are resolved, and clamped
/// to what the device supports, when the engine starts; the resolved values
/// appear in [`ferry_core::TransferEngine::backend_info`].
///
/// URL form: `verbs://DEVICE?param=value&...`, where an empty `DEVICE`
/// (`verbs://` or `verbs://?port=1`) selects the first device that has an
/// active port. Parameters (all optional):
///
/// | parameter | meaning | default |
/// |---|---|---|
/// | `port` | physical port number (1-based) | `1` |
/// | `gid_index` | source GID table index (RoCE needs one) | best in the GID table: RoCE v2 with an IPv4-mapped address, else RoCE v2, else the first non-zero GID |
/// | `listen` | TCP address of the control channel; also the segment name peers open | `127.0.0.1:0` |
/// | `mtu` | path MTU cap in bytes: 256, 512, 1024, 2048 or 4096 | the port's active MTU |
/// | `sq_depth` | send queue depth (work requests in flight per peer) | `256` |
/// | `max_sge` | scatter/gather entries per work request | `16` |
/// | `signal_every` | request a completion every N work requests (the last of each posted chain is always signalled) | `16` |
/// | `max_message` | largest work request in bytes (bigger requests are split); `k`/`m`/`g` suffixes are KiB/MiB/GiB | the port's `max_msg_sz` |
/// | `timeout` | local ACK timeout exponent: 4.096 µs × 2^`timeout` per attempt (0–31) | `16` (≈ 268 ms) |
/// | `retry_cnt` | transport retries before a request fails with "retry exceeded" (0–7) | `7` |
/// | `rnr_retry` | receiver-not-ready retries (0–7, 7 = infinite) | `7` |
/// | `min_rnr_timer` | RNR NAK timer code (0–31) | `12` |
/// | `max_rd_atomic` | RDMA READs in flight per QP, both directions | `16` |
/// | `hop_limit` | GRH hop limit (RoCE / routed IB) | `64` |
/// | `traffic_class` | GRH traffic class (DSCP << 2 for RoCE) | `0` |
/// | `sl` | service level | `0` |
/// | `connect_timeout_ms` | control-channel connect and handshake deadline | `10000` |
/// | `stall_timeout_ms` | no work completion for this long while work requests are outstanding (and at least twice the retry window, `timeout` × (`retry_cnt` + 1)): the device is taken to have stalled, the queue pair is destroyed and its requests fail `PeerLost` | `60000` |
/// | `secret` | shared secret (percent-encoded, non-empty): every control connection starts with a mutual HMAC-SHA256 challenge–response, and a peer that does not prove the same secret gets no queue pair, region table or rkey | none (unauthenticated) |
/// | `test_protocol_max` | **test only**: announce protocol versions up to this one (3 makes the engine speak exactly as a protocol-3 build, 7c3e5e6) | the newest this build speaks |
/// | `test_features_off` | **test only**: comma-separated optional features this engine does not announce (`notify`, `region_push`, `table_fetch`) | none |
///
/// An unknown parameter, a repeated one or a malformed value is
/// [`Error::InvalidArgument`] naming it. `Debug` never prints the secret.
#[derive(Clone, PartialEq, Eq)]
pub struct VerbsConfig {
    /// Device name (`mlx5_0`, `rxe0`); `None` = the first with an active port.
    pub device: Option<String>,
    /// Physical port number, 1-based.
    pub port: u8,
    /// Source GID index; `None` = choose from the GID table (see above).
    pub gid_index: Option<u32>,
    /// Control-channel listen address; the bound address is the segment name.
    pub listen: SocketAddr,
    /// Path MTU cap in bytes (256…4096, a power of two); `None` = active MTU.
    pub mtu: Option<u32>,
    /// Send queue depth per queue pair (clamped to the device's `max_qp_wr`).
    pub sq_depth: u32,
    /// Scatter/gather entries per work request (clamped to the device).
    pub max_sge: u32,
    /// Selective signalling interval (clamped to `1..=sq_depth/2`).
    pub signal_every: u32,
    /// Largest single work request in bytes; `None` = the port's maximum.
    pub max_message: Option<u64>,
    /// Local ACK timeout exponent (0–31).
    pub timeout: u8,
    /// Transport retry count (0–7).
    pub retry_cnt: u8,
    /// RNR retry count (0–7; 7 means infinite).
    pub rnr_retry: u8,
    /// Minimum RNR NAK timer code (0–31).
    pub min_rnr_timer: u8,
    /// Outstanding RDMA READs per queue pair (clamped to the device).
    pub max_rd_atomic: u8,
    /// GRH hop limit.
    pub hop_limit: u8,
    /// GRH traffic class.
    pub traffic_class: u8,
    /// Service level (0–15).
    pub service_level: u8,
    /// Control-channel connect and handshake deadline, in milliseconds.
    pub connect_timeout_ms: u64,
    /// How long a queue pair may go without any work completion while work
    /// requests are outstanding before the device is taken to have stalled
    /// (milliseconds; the engine waits at least twice the transport retry
    /// window). The connection is then broken: its queue pair destroyed,
    /// its requests failed `PeerLost`, their memory released.
    pub stall_timeout_ms: u64,
    /// Shared secret of the control channel; `None` = unauthenticated.
    ///
    /// With a secret, every control connection begins with a mutual
    /// HMAC-SHA256 challenge–response over fresh random nonces,
    /// before any queue-pair data, region table or rkey is sent and before
    /// any notification is accepted. Opening a segment whose owner does not
    /// prove the same secret (or has none) fails with
    /// [`Error::Authentication`]; an inbound peer that does not prove it is
    /// refused and disconnected. An engine without a secret cannot open a
    /// segment of an engine that has one ([`Error::Authentication`] too).
    /// Must not be empty.
    pub secret: Option<String>,
    /// **Test only** (for cross-version tests): the newest control-channel
    /// protocol version this engine announces; `Some(3)` makes it speak
    /// exactly as a build of protocol 3 (7c3e5e6: no negotiated hello).
    /// Values are clamped to the versions this build speaks.
    #[doc(hidden)]
    pub test_protocol_max: Option<u16>,
    /// **Test only**: optional features this engine does not announce, so
    /// that no connection uses them.
    #[doc(hidden)]
    pub test_features_off: Vec<crate::Feature>,
}

impl std::fmt::Debug for VerbsConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsConfig")
            .field("device", &self.device)
            .field("port", &self.port)
            .field("gid_index", &self.gid_index)
            .field("listen", &self.listen)
            .field("mtu", &self.mtu)
            .field("sq_depth", &self.sq_depth)
            .field("max_sge", &self.max_sge)
            .field("signal_every", &self.signal_every)
            .field("max_message", &self.max_message)
            .field("timeout", &self.timeout)
            .field("retry_cnt", &self.retry_cnt)
            .field("rnr_retry", &self.rnr_retry)
            .field("min_rnr_timer", &self.min_rnr_timer)
            .field("max_rd_atomic", &self.max_rd_atomic)
            .field("hop_limit", &self.hop_limit)
            .field("traffic_class", &self.traffic_class)
            .field("service_level", &self.service_level)
            .field("connect_timeout_ms", &self.connect_timeout_ms)
            .field("stall_timeout_ms", &self.stall_timeout_ms)
            .field("secret", &self.secret.as_ref().map(|_| "<redacted>"))
            .field("test_protocol_max", &self.test_protocol_max)
            .field("test_features_off", &self.test_features_off)
            .finish()
    }
}

impl Default for VerbsConfig {
    fn default() -> Self {
        VerbsConfig {
            device: None,
            port: 1,
            gid_index: None,
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            mtu: None,
            sq_depth: 256,
            max_sge: 16,
            signal_every: 16,
            max_message: None,
            timeout: 16,
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 12,
            max_rd_atomic: 16,
            hop_limit: 64,
            traffic_class: 0,
            service_level: 0,
            connect_timeout_ms: 10_000,
            stall_timeout_ms: 60_000,
            secret: None,
            test_protocol_max: None,
            test_features_off: Vec::new(),
        }
    }
}

const PARAMS: &[&str] = &[
    "port",
    "gid_index",
    "listen",
    "mtu",
    "sq_depth",
    "max_sge",
    "signal_every",
    "max_message",
    "timeout",
    "retry_cnt",
    "rnr_retry",
    "min_rnr_timer",
    "max_rd_atomic",
    "hop_limit",
    "traffic_class",
    "sl",
    "connect_timeout_ms",
    "stall_timeout_ms",
    "secret",
    "test_protocol_max",
    "test_features_off",
];

fn bad(param: &str, value: &str, why: &str) -> Error {
    Error::InvalidArgument(format!(
        "verbs URL parameter `{param}`: {value:?} is not {why}"
    ))
}

fn num<T: std::str::FromStr + PartialOrd + Copy + std::fmt::Display>(
    param: &str,
    value: &str,
    min: T,
    max: T,
) -> Result<T> {
    match value.parse::<T>() {
        Ok(v) if v >= min && v <= max => Ok(v),
        _ => Err(bad(
            param,
            value,
            &format!("an integer between {min} and {max}"),
        )),
    }
}

fn size(param: &str, value: &str) -> Result<u64> {
    let lower = value.to_ascii_lowercase();
    let (digits, shift) = match lower.as_bytes().last() {
        Some(b'k') => (&lower[..lower.len() - 1], 10),
        Some(b'm') => (&lower[..lower.len() - 1], 20),
        Some(b'g') => (&lower[..lower.len() - 1], 30),
        _ => (lower.as_str(), 0),
    };
    digits
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(1u64 << shift))
        .filter(|n| *n > 0)
        .ok_or_else(|| bad(param, value, "a positive byte count (suffixes k, m, g)"))
}

fn decode(s: &str) -> Result<String> {
    // Minimal percent-decoding for values such as `listen=%5B::1%5D:0`.
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' => {
                let hex = s
                    .get(i + 1..i + 3)
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
                    .ok_or_else(|| {
                        Error::InvalidArgument(format!("verbs URL: bad percent escape in {s:?}"))
                    })?;
                out.push(hex);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out)
        .map_err(|_| Error::InvalidArgument(format!("verbs URL: {s:?} is not UTF-8")))
}

impl VerbsConfig {
    /// Parses `verbs://DEVICE?param=value&...` (see the type's docs for every
    /// parameter).
    ///
    /// Fails with [`Error::InvalidArgument`] naming the offending part: a
    /// scheme other than `verbs`, an unknown or repeated parameter, or a
    /// value out of range.
    pub fn from_url(url: &str) -> Result<VerbsConfig> {
        let rest = url.strip_prefix("verbs://").ok_or_else(|| {
            Error::InvalidArgument(format!(
                "{:?} is not a verbs URL (expected `verbs://DEVICE?param=value&...`)",
                ferry_core::raw::redact_url(url)
            ))
        })?;
        let (device, query) = match rest.split_once('?') {
            Some((d, q)) => (d, Some(q)),
            None => (rest, None),
        };
        let device = device.trim_end_matches('/');
        if device.contains('/') || device.contains(':') {
            return Err(Error::InvalidArgument(format!(
                "verbs URL: the device part {device:?} must be a bare device name such as `rxe0` or `mlx5_0`"
            )));
        }
        let mut cfg = VerbsConfig {
            device: (!device.is_empty()).then(|| device.to_owned()),
            ..Default::default()
        };
        let mut seen: Vec<String> = Vec::new();
        for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
            let (key, raw) = pair.split_once('=').ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "verbs URL parameter `{pair}` has no value (expected `{pair}=...`)"
                ))
            })?;
            let key = decode(key)?;
            // A malformed secret is reported without its text.
            let value = decode(raw).map_err(|e| {
                if key == "secret" {
                    Error::InvalidArgument(
                        "verbs URL parameter `secret`: bad percent escape or not UTF-8".to_owned(),
                    )
                } else {
                    e
                }
            })?;
            if !PARAMS.contains(&key.as_str()) {
                return Err(Error::InvalidArgument(format!(
                    "unknown verbs URL parameter `{key}`; known: {}",
                    PARAMS.join(", ")
                )));
            }
            if seen.contains(&key) {
                return Err(Error::InvalidArgument(format!(
                    "verbs URL parameter `{key}` is given twice"
                )));
            }
            seen.push(key.clone());
            let v = value.as_str();
            match key.as_str() {
                "port" => cfg.port = num(&key, v, 1u8, 255)?,
                "gid_index" => cfg.gid_index = Some(num(&key, v, 0u32, 255)?),
                "listen" => {
                    cfg.listen = v
                        .parse()
                        .map_err(|_| bad(&key, v, "a socket address such as 127.0.0.1:0"))?
                }
                "mtu" => {
                    let m = num(&key, v, 256u32, 4096)?;
                    if !m.is_power_of_two() {
                        return Err(bad(&key, v, "one of 256, 512, 1024, 2048, 4096"));
                    }
                    cfg.mtu = Some(m);
                }
                "sq_depth" => cfg.sq_depth = num(&key, v, 2u32, 1 << 16)?,
                "max_sge" => cfg.max_sge = num(&key, v, 1u32, 1024)?,
                "signal_every" => cfg.signal_every = num(&key, v, 1u32, 1 << 15)?,
                "max_message" => cfg.max_message = Some(size(&key, v)?),
                "timeout" => cfg.timeout = num(&key, v, 0u8, 31)?,
                "retry_cnt" => cfg.retry_cnt = num(&key, v, 0u8, 7)?,
                "rnr_retry" => cfg.rnr_retry = num(&key, v, 0u8, 7)?,
                "min_rnr_timer" => cfg.min_rnr_timer = num(&key, v, 0u8, 31)?,
                "max_rd_atomic" => cfg.max_rd_atomic = num(&key, v, 1u8, 255)?,
                "hop_limit" => cfg.hop_limit = num(&key, v, 1u8, 255)?,
                "traffic_class" => cfg.traffic_class = num(&key, v, 0u8, 255)?,
                "sl" => cfg.service_level = num(&key, v, 0u8, 15)?,
                "connect_timeout_ms" => cfg.connect_timeout_ms = num(&key, v, 1u64, 3_600_000)?,
                "stall_timeout_ms" => cfg.stall_timeout_ms = num(&key, v, 1u64, 86_400_000)?,
                "secret" => {
                    if v.is_empty() {
                        return Err(Error::InvalidArgument(
                            "verbs URL parameter `secret` is empty".to_owned(),
                        ));
                    }
                    cfg.secret = Some(value.clone());
                }
                "test_protocol_max" => {
                    cfg.test_protocol_max = Some(num(
                        &key,
                        v,
                        crate::negotiate::OLDEST,
                        crate::negotiate::NEWEST,
                    )?)
                }
                "test_features_off" => {
                    for name in v.split(',').filter(|n| !n.is_empty()) {
                        let f = crate::Feature::from_name(name).ok_or_else(|| {
                            bad(&key, name, "a feature: notify, region_push or table_fetch")
                        })?;
                        cfg.test_features_off.push(f);
                    }
                }
                _ => unreachable!("checked against PARAMS above"),
            }
        }
        Ok(cfg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_device() {
        let c = VerbsConfig::from_url("verbs://").unwrap();
        assert_eq!(c, VerbsConfig::default());
        let c = VerbsConfig::from_url("verbs://rxe0").unwrap();
        assert_eq!(c.device.as_deref(), Some("rxe0"));
        let c = VerbsConfig::from_url("verbs://?port=2").unwrap();
        assert_eq!(c.device, None);
        assert_eq!(c.port, 2);
    }

    #[test]
    fn every_parameter() {
        let c = VerbsConfig::from_url(
            "verbs://mlx5_0?port=1&gid_index=3&listen=10.0.0.1:7000&mtu=1024&sq_depth=64\
             &max_sge=4&signal_every=8&max_message=1m&timeout=14&retry_cnt=6&rnr_retry=5\
             &min_rnr_timer=10&max_rd_atomic=8&hop_limit=32&traffic_class=106&sl=3\
             &connect_timeout_ms=500&stall_timeout_ms=1500",
        )
        .unwrap();
        assert_eq!(c.device.as_deref(), Some("mlx5_0"));
        assert_eq!(c.gid_index, Some(3));
        assert_eq!(c.listen, "10.0.0.1:7000".parse().unwrap());
        assert_eq!(c.mtu, Some(1024));
        assert_eq!(c.sq_depth, 64);
        assert_eq!(c.max_sge, 4);
        assert_eq!(c.signal_every, 8);
        assert_eq!(c.max_message, Some(1 << 20));
        assert_eq!(
            (c.timeout, c.retry_cnt, c.rnr_retry, c.min_rnr_timer),
            (14, 6, 5, 10)
        );
        assert_eq!(
            (
                c.max_rd_atomic,
                c.hop_limit,
                c.traffic_class,
                c.service_level
            ),
            (8, 32, 106, 3)
        );
        assert_eq!(c.connect_timeout_ms, 500);
        assert_eq!(c.stall_timeout_ms, 1500);
        assert_eq!(VerbsConfig::default().stall_timeout_ms, 60_000);
        assert!(VerbsConfig::from_url("verbs://?stall_timeout_ms=0").is_err());
        assert_eq!(c.secret, None);
        let v6 = VerbsConfig::from_url("verbs://?listen=%5B::1%5D:0").unwrap();
        assert_eq!(v6.listen, "[::1]:0".parse().unwrap());
    }

    #[test]
    fn test_only_protocol_knobs() {
        let c = VerbsConfig::from_url(
            "verbs://?test_protocol_max=3&test_features_off=notify,table_fetch",
        )
        .unwrap();
        assert_eq!(c.test_protocol_max, Some(3));
        assert_eq!(
            c.test_features_off,
            vec![crate::Feature::Notify, crate::Feature::TableFetch]
        );
        assert!(VerbsConfig::from_url("verbs://?test_protocol_max=2").is_err());
        assert!(VerbsConfig::from_url("verbs://?test_protocol_max=99").is_err());
        assert!(VerbsConfig::from_url("verbs://?test_features_off=bogus").is_err());
    }

    #[test]
    fn secret_is_decoded_and_never_printed() {
        let c = VerbsConfig::from_url("verbs://rxe0?secret=s%26x%3Dy&port=1").unwrap();
        assert_eq!(c.secret.as_deref(), Some("s&x=y"));
        let shown = format!("{c:?}");
        assert!(!shown.contains("s&x=y"), "Debug leaks the secret: {shown}");
        assert!(shown.contains("<redacted>"), "{shown}");
        assert!(format!("{:?}", VerbsConfig::default()).contains("secret: None"));
    }

    #[test]
    fn errors_name_the_parameter() {
        let msg = |u: &str| VerbsConfig::from_url(u).unwrap_err().to_string();
        assert!(msg("verbs://rxe0?colour=blue").contains("`colour`"));
        assert!(msg("verbs://?port=0").contains("`port`"));
        assert!(msg("verbs://?mtu=1000").contains("`mtu`"));
        assert!(msg("verbs://?timeout=40").contains("`timeout`"));
        assert!(msg("verbs://?listen=nowhere").contains("`listen`"));
        assert!(msg("verbs://?port=1&port=2").contains("twice"));
        assert!(msg("verbs://?port").contains("`port`"));
        assert!(msg("verbs://?max_message=0").contains("`max_message`"));
        assert!(msg("verbs://?secret=").contains("`secret`"));
        assert!(msg("verbs://?secret=a&secret=b").contains("twice"));
        assert!(msg("tcp://rxe0").contains("not a verbs URL"));
        assert!(msg("verbs://host:1234").contains("device"));
        for u in ["verbs://?x=%zz", "verbs://?gid_index=-1"] {
            assert!(matches!(
                VerbsConfig::from_url(u),
                Err(Error::InvalidArgument(_))
            ));
        }
    }
}
