//! [`VerbsConfig`]: every knob of the verbs backend, parsed from a
//! `verbs://DEVICE?key=value&...` URL.

use std::net::SocketAddr;

use ferry_core::raw::ParsedUrl;
use ferry_core::{Error, Result, Secret};

/// Configuration of a [`crate::VerbsEngine`].
///
/// Build it with [`VerbsConfig::from_url`], with [`VerbsConfig::builder`]
/// (which validates the same ranges), or start from
/// [`VerbsConfig::default`] and set fields (`#[non_exhaustive]`: no struct
/// literal outside this crate). Values that depend on the device
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
/// The URL is parsed by [`ParsedUrl`]: strict percent-decoding (`+` is a
/// space; `%+5` is refused, it used to be read as `%05`), no fragment, no
/// userinfo. An unknown parameter (named, with the known ones), a repeated
/// one or a malformed value is [`Error::InvalidArgument`] naming it; no
/// message quotes the secret. `Debug` never prints the secret (a
/// [`Secret`]).
///
/// ```
/// use ferry_core::Secret;
/// use ferry_verbs::VerbsConfig;
///
/// let config = VerbsConfig::builder()
///     .device("mlx5_0")
///     .gid_index(Some(3))
///     .listen("10.0.0.1:7000".parse().unwrap())
///     .secret(Secret::new("s3cret"))
///     .build()?;
/// assert_eq!(
///     config,
///     VerbsConfig::from_url("verbs://mlx5_0?gid_index=3&listen=10.0.0.1:7000&secret=s3cret")?
/// );
/// assert!(!format!("{config:?}").contains("s3cret"));
/// assert!(VerbsConfig::builder().retry_cnt(8).build().is_err());
/// # Ok::<(), ferry_core::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
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
    pub secret: Option<Secret>,
    /// **Test only** (for cross-version tests): the newest control-channel
    /// protocol version this engine announces; `Some(3)` makes it speak
    /// exactly as a build of protocol 3 (7c3e5e6: no negotiated hello).
    /// Values are clamped to the versions this build speaks. Set only
    /// through the URL key of the same name: not part of the API.
    pub(crate) test_protocol_max: Option<u16>,
    /// **Test only**: optional features this engine does not announce, so
    /// that no connection uses them. Set only through the URL key of the
    /// same name: not part of the API.
    pub(crate) test_features_off: Vec<crate::Feature>,
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

ferry_core::__config_builder! {
    /// Builds a [`VerbsConfig`] ([`VerbsConfig::builder`]): one setter per
    /// field (but the test-only ones); `build()` validates.
    pub struct VerbsConfigBuilder for VerbsConfig {
        some device: String,
        set port: u8,
        set gid_index: Option<u32>,
        set listen: SocketAddr,
        set mtu: Option<u32>,
        set sq_depth: u32,
        set max_sge: u32,
        set signal_every: u32,
        set max_message: Option<u64>,
        set timeout: u8,
        set retry_cnt: u8,
        set rnr_retry: u8,
        set min_rnr_timer: u8,
        set max_rd_atomic: u8,
        set hop_limit: u8,
        set traffic_class: u8,
        set service_level: u8,
        set connect_timeout_ms: u64,
        set stall_timeout_ms: u64,
        some secret: Secret,
    }
}

/// The integer parameters: URL key, smallest and largest value.
const RANGES: [(&str, u64, u64); 16] = [
    ("port", 1, 255),
    ("gid_index", 0, 255),
    ("sq_depth", 2, 1 << 16),
    ("max_sge", 1, 1024),
    ("signal_every", 1, 1 << 15),
    ("timeout", 0, 31),
    ("retry_cnt", 0, 7),
    ("rnr_retry", 0, 7),
    ("min_rnr_timer", 0, 31),
    ("max_rd_atomic", 1, 255),
    ("hop_limit", 1, 255),
    ("traffic_class", 0, 255),
    ("sl", 0, 15),
    ("connect_timeout_ms", 1, 3_600_000),
    ("stall_timeout_ms", 1, 86_400_000),
    ("mtu", 256, 4096),
];

fn range_of(key: &str) -> (u64, u64) {
    RANGES
        .iter()
        .find(|(k, _, _)| *k == key)
        .map(|&(_, lo, hi)| (lo, hi))
        .expect("a key of RANGES")
}

fn between(key: &str) -> String {
    let (lo, hi) = range_of(key);
    format!("an integer between {lo} and {hi}")
}

const MTUS: &str = "one of 256, 512, 1024, 2048, 4096";
const SIZE: &str = "a positive byte count (suffixes k, m, g)";

/// `1m` → 1 MiB; `None` for zero or anything else than digits with an
/// optional `k`/`m`/`g`.
fn size(value: &str) -> Option<u64> {
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
}

/// Takes the integer parameter `key` within its range of [`RANGES`].
fn take_num(url: &mut ParsedUrl, key: &str) -> Result<Option<u64>> {
    let (lo, hi) = range_of(key);
    url.take_with(key, &between(key), |v| {
        v.parse::<u64>().ok().filter(|n| (lo..=hi).contains(n))
    })
}

/// `*dst = v` (narrowed: the range was checked) if there is a value.
fn set<T: TryFrom<u64>>(dst: &mut T, v: Option<u64>) {
    if let Some(v) = v.and_then(|v| T::try_from(v).ok()) {
        *dst = v;
    }
}

impl VerbsConfig {
    /// Parses `verbs://DEVICE?param=value&...` (see the type's docs for every
    /// parameter).
    ///
    /// Fails with [`Error::InvalidArgument`] naming the offending part: a
    /// scheme other than `verbs`, an unknown or repeated parameter, a
    /// malformed percent-escape, or a value out of range.
    pub fn from_url(url: &str) -> Result<VerbsConfig> {
        VerbsConfig::from_parts(ParsedUrl::parse(url)?)
    }

    /// [`VerbsConfig::from_url`] on a URL already parsed (the facade takes
    /// its own parameters out of it first): takes every parameter, then
    /// refuses what is left.
    pub fn from_parts(mut url: ParsedUrl) -> Result<VerbsConfig> {
        if url.scheme() != "verbs" {
            return Err(Error::InvalidArgument(format!(
                "{:?} is not a verbs URL (expected `verbs://DEVICE?param=value&...`)",
                url.shown()
            )));
        }
        let device = url.authority().to_owned();
        if device.contains(':') || !(url.path().is_empty() || url.path() == "/") {
            return Err(Error::InvalidArgument(format!(
                "verbs URL {:?}: the device part must be a bare device name such as `rxe0` or \
                 `mlx5_0`",
                url.shown()
            )));
        }
        let mut cfg = VerbsConfig {
            device: (!device.is_empty()).then_some(device),
            ..Default::default()
        };
        set(&mut cfg.port, take_num(&mut url, "port")?);
        cfg.gid_index = take_num(&mut url, "gid_index")?.map(|n| n as u32);
        if let Some(a) = url.take::<SocketAddr>("listen")? {
            cfg.listen = a;
        }
        let (lo, hi) = range_of("mtu");
        cfg.mtu = url.take_with("mtu", MTUS, |v| {
            v.parse::<u32>()
                .ok()
                .filter(|m| (lo..=hi).contains(&u64::from(*m)) && m.is_power_of_two())
        })?;
        set(&mut cfg.sq_depth, take_num(&mut url, "sq_depth")?);
        set(&mut cfg.max_sge, take_num(&mut url, "max_sge")?);
        set(&mut cfg.signal_every, take_num(&mut url, "signal_every")?);
        cfg.max_message = url.take_with("max_message", SIZE, size)?;
        set(&mut cfg.timeout, take_num(&mut url, "timeout")?);
        set(&mut cfg.retry_cnt, take_num(&mut url, "retry_cnt")?);
        set(&mut cfg.rnr_retry, take_num(&mut url, "rnr_retry")?);
        set(&mut cfg.min_rnr_timer, take_num(&mut url, "min_rnr_timer")?);
        set(&mut cfg.max_rd_atomic, take_num(&mut url, "max_rd_atomic")?);
        set(&mut cfg.hop_limit, take_num(&mut url, "hop_limit")?);
        set(&mut cfg.traffic_class, take_num(&mut url, "traffic_class")?);
        set(&mut cfg.service_level, take_num(&mut url, "sl")?);
        set(
            &mut cfg.connect_timeout_ms,
            take_num(&mut url, "connect_timeout_ms")?,
        );
        set(
            &mut cfg.stall_timeout_ms,
            take_num(&mut url, "stall_timeout_ms")?,
        );
        cfg.secret = url.take_secret("secret")?;
        let (oldest, newest) = (crate::negotiate::OLDEST, crate::negotiate::NEWEST);
        cfg.test_protocol_max = url.take_with(
            "test_protocol_max",
            &format!("an integer between {oldest} and {newest}"),
            |v| {
                v.parse::<u16>()
                    .ok()
                    .filter(|n| (oldest..=newest).contains(n))
            },
        )?;
        for name in url.take_list("test_features_off")?.unwrap_or_default() {
            let f = crate::Feature::from_name(&name).ok_or_else(|| {
                url.bad_value(
                    "test_features_off",
                    &name,
                    "a feature: notify, region_push or table_fetch",
                )
            })?;
            cfg.test_features_off.push(f);
        }
        url.finish()?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks every field's range (the ranges of the URL parameters, see
    /// the type's docs): [`Error::InvalidArgument`] naming the parameter.
    pub fn validate(&self) -> Result<()> {
        let bad = |key: &str, value: u64, expected: &str| {
            Error::InvalidArgument(format!("verbs config `{key}`: {value} is not {expected}"))
        };
        let mut numbers = vec![
            ("port", u64::from(self.port)),
            ("sq_depth", u64::from(self.sq_depth)),
            ("max_sge", u64::from(self.max_sge)),
            ("signal_every", u64::from(self.signal_every)),
            ("timeout", u64::from(self.timeout)),
            ("retry_cnt", u64::from(self.retry_cnt)),
            ("rnr_retry", u64::from(self.rnr_retry)),
            ("min_rnr_timer", u64::from(self.min_rnr_timer)),
            ("max_rd_atomic", u64::from(self.max_rd_atomic)),
            ("hop_limit", u64::from(self.hop_limit)),
            ("traffic_class", u64::from(self.traffic_class)),
            ("sl", u64::from(self.service_level)),
            ("connect_timeout_ms", self.connect_timeout_ms),
            ("stall_timeout_ms", self.stall_timeout_ms),
        ];
        if let Some(g) = self.gid_index {
            numbers.push(("gid_index", u64::from(g)));
        }
        for (key, value) in numbers {
            let (lo, hi) = range_of(key);
            if !(lo..=hi).contains(&value) {
                return Err(bad(key, value, &between(key)));
            }
        }
        if let Some(m) = self.mtu {
            if !((256..=4096).contains(&m) && m.is_power_of_two()) {
                return Err(bad("mtu", u64::from(m), MTUS));
            }
        }
        if self.max_message == Some(0) {
            return Err(bad("max_message", 0, SIZE));
        }
        if self.secret.as_ref().is_some_and(Secret::is_empty) {
            return Err(Error::InvalidArgument(
                "verbs config `secret` is empty (a shared secret must not be)".to_owned(),
            ));
        }
        if self.device.as_deref() == Some("") {
            return Err(Error::InvalidArgument(
                "verbs config `device` is empty (use None for the first active device)".to_owned(),
            ));
        }
        Ok(())
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
        assert_eq!(c.secret.as_ref().map(Secret::expose), Some("s&x=y"));
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
        // Strict percent-decoding: the hand-made decoder read `%+5` as
        // `%05` (u8::from_str_radix accepts a sign); now refused, naming
        // the key. A secret's bad escape is never quoted.
        assert!(msg("verbs://?port=%+5").contains("`port`"));
        assert!(msg("verbs://?port=%+5").contains("percent-escape"));
        let m = msg("verbs://?secret=hunter2%+5");
        assert!(
            m.contains("`secret`") && !m.contains("hunter2") && !m.contains("%+5"),
            "{m}"
        );
        assert!(msg("verbs://?port=1&p%6Frt=2").contains("`port` given twice"));
        assert!(msg("verbs://rxe0/x").contains("device"));
        assert!(msg("verbs://rxe0#frag").contains("fragment"));
        assert!(msg("verbs://u:hunter2@rxe0").contains("user information"));
        assert!(!msg("verbs://u:hunter2@rxe0").contains("hunter2"));
        let m = msg("verbs://?colour=blue");
        assert!(
            m.contains("known: port, gid_index, listen") && m.contains("test_features_off"),
            "{m}"
        );
        // An encoded key is the key it decodes to.
        let c = VerbsConfig::from_url("verbs://?s%65cret=a+b").unwrap();
        assert_eq!(c.secret.as_ref().map(Secret::expose), Some("a b"));
    }

    #[test]
    fn builder_validates_like_the_url() {
        let c = VerbsConfig::builder()
            .device("rxe0")
            .port(2)
            .mtu(Some(1024))
            .secret("s")
            .build()
            .unwrap();
        assert_eq!(
            c,
            VerbsConfig::from_url("verbs://rxe0?port=2&mtu=1024&secret=s").unwrap()
        );
        for (b, key) in [
            (VerbsConfig::builder().port(0), "`port`"),
            (VerbsConfig::builder().mtu(Some(1000)), "`mtu`"),
            (VerbsConfig::builder().timeout(32), "`timeout`"),
            (VerbsConfig::builder().sq_depth(1), "`sq_depth`"),
            (VerbsConfig::builder().service_level(16), "`sl`"),
            (
                VerbsConfig::builder().stall_timeout_ms(0),
                "`stall_timeout_ms`",
            ),
            (VerbsConfig::builder().max_message(Some(0)), "`max_message`"),
            (VerbsConfig::builder().secret(""), "`secret`"),
        ] {
            let e = b.build().unwrap_err().to_string();
            assert!(e.contains(key), "{key}: {e}");
        }
    }
}
