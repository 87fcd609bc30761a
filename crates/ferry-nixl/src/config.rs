//! Engine configuration and the `nixl://` URL.

use std::path::PathBuf;
use std::time::Duration;

use ferry_core::raw::ParsedUrl;
use ferry_core::{Error, Result};

/// Everything [`crate::NixlEngine::start`] needs.
///
/// `Default` gives: library resolved as described in
/// [`crate::NixlLibrary::resolve`], the `UCX` NIXL backend, the metadata
/// listener on `127.0.0.1` with a port the system chooses, a generated agent
/// name, NIXL's progress thread on, and a per-batch deadline of 30 s + 1 ns
/// per byte.
///
/// `#[non_exhaustive]`: build it with [`NixlConfig::builder`] (which
/// validates like [`NixlConfig::from_url`]), parse it, or start from
/// `default()` and assign fields.
///
/// ```
/// use ferry_nixl::NixlConfig;
///
/// let config = NixlConfig::builder()
///     .backends(vec!["UCX".to_owned(), "POSIX".to_owned()])
///     .host("10.0.0.2")
///     .port(7000)
///     .build()?;
/// assert_eq!(
///     config,
///     NixlConfig::from_url("nixl://?backends=UCX,POSIX&host=10.0.0.2&port=7000")?
/// );
/// assert!(NixlConfig::builder().backends(Vec::new()).build().is_err());
/// # Ok::<(), ferry_core::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct NixlConfig {
    /// Path of `libnixl_capi.so`; `None` = environment variable, then the
    /// loader's search path, then the active Python's `nixl` wheel.
    pub library: Option<PathBuf>,
    /// NIXL backend plugins to create on the agent (`UCX`, …), each with
    /// its plugin's default parameters.
    pub backends: Vec<String>,
    /// Address Ferry's metadata listener binds and announces (the segment
    /// name is `host:port`).
    pub host: String,
    /// Port of the metadata listener (0: the system chooses).
    pub port: u16,
    /// The NIXL agent name (unique among the agents that talk to each
    /// other). `None`: `ferry-<pid>-<n>-<port>`.
    pub name: Option<String>,
    /// Whether NIXL runs its own progress thread (`enable_prog_thread`);
    /// without it transfers progress only while Ferry polls them.
    pub progress_thread: bool,
    /// Fixed part of each batch's deadline.
    pub timeout: Duration,
    /// Per-byte part of each batch's deadline, in nanoseconds.
    pub timeout_ns_per_byte: u64,
    /// Let the metadata listener bind an address other hosts can reach
    /// (URL `insecure=1`). The listener has no authentication: whoever
    /// connects receives this agent's NIXL metadata (the remote keys of
    /// every registered region) and can then read and write all of it with
    /// an agent of their own. Without this flag
    /// [`crate::NixlEngine::start`] refuses a `host` that is not a
    /// loopback address; with it the engine starts and logs a warning.
    pub insecure: bool,
}

impl Default for NixlConfig {
    fn default() -> Self {
        NixlConfig {
            library: None,
            backends: vec!["UCX".to_owned()],
            host: "127.0.0.1".to_owned(),
            port: 0,
            name: None,
            progress_thread: true,
            timeout: Duration::from_secs(30),
            timeout_ns_per_byte: 1,
            insecure: false,
        }
    }
}

ferry_core::__config_builder! {
    /// Builds a [`NixlConfig`] ([`NixlConfig::builder`]): one setter per
    /// field; `build()` validates.
    pub struct NixlConfigBuilder for NixlConfig {
        some library: PathBuf,
        set backends: Vec<String>,
        into host: String,
        set port: u16,
        some name: String,
        set progress_thread: bool,
        set timeout: Duration,
        set timeout_ns_per_byte: u64,
        set insecure: bool,
    }
}

/// The URL parameters [`NixlConfig::from_url`] accepts.
pub const URL_PARAMETERS: [&str; 9] = [
    "lib",
    "backends",
    "host",
    "port",
    "name",
    "progress_thread",
    "timeout_ms",
    "ns_per_byte",
    "insecure",
];

impl NixlConfig {
    /// Parses `nixl://?param=value&…`. Parameters (all optional; values
    /// percent-decoded):
    ///
    /// | parameter | meaning | default |
    /// |---|---|---|
    /// | `lib` | path of `libnixl_capi.so` | `FERRY_NIXL_LIB`, the loader, the Python wheel |
    /// | `backends` | comma-separated NIXL backend plugins | `UCX` |
    /// | `host` | address of the metadata listener | `127.0.0.1` |
    /// | `port` | port of the metadata listener (0: any) | `0` |
    /// | `name` | NIXL agent name | `ferry-<pid>-<n>-<port>` |
    /// | `progress_thread` | `1`/`0`: NIXL's own progress thread | `1` |
    /// | `timeout_ms` | fixed part of each batch's deadline | `30000` |
    /// | `ns_per_byte` | per-byte part of the deadline, ns | `1` |
    /// | `insecure` | `1`/`0`: allow a `host` beyond loopback (no authentication) | `0` |
    ///
    /// The URL is parsed by [`ParsedUrl`]: strict percent-decoding (`+` is
    /// a space), no fragment, no userinfo; `progress_thread` takes `1`/`0`,
    /// `true`/`false`, `yes`/`no`, `on`/`off`; `insecure` only `1`/`0`
    /// or `true`/`false`.
    ///
    /// Errors ([`Error::InvalidArgument`], the URL quoted with its secrets
    /// hidden): another scheme, a host or path in the URL (put them in
    /// parameters), an unknown parameter (named, with the known ones) or a
    /// repeated one (named), a malformed percent-escape, an unparsable
    /// number or flag, an empty `backends`, `host` or `name`, a NUL byte
    /// anywhere.
    pub fn from_url(url: &str) -> Result<NixlConfig> {
        NixlConfig::from_parts(ParsedUrl::parse(url)?)
    }

    /// [`NixlConfig::from_url`] on a URL already parsed (the facade takes
    /// its own parameters out of it first): takes the parameters of
    /// [`URL_PARAMETERS`], then refuses what is left.
    pub fn from_parts(mut url: ParsedUrl) -> Result<NixlConfig> {
        url.expect_params_only("nixl", "nixl://?backends=UCX&host=10.0.0.1&port=7000")?;
        let mut cfg = NixlConfig::default();
        if let Some(v) = url.take_str("lib")? {
            cfg.library = Some(PathBuf::from(v));
        }
        if let Some(v) = url.take_list("backends")? {
            cfg.backends = v;
        }
        if let Some(v) = url.take_str("host")? {
            cfg.host = v;
        }
        if let Some(p) = url.take::<u16>("port")? {
            cfg.port = p;
        }
        cfg.name = url.take_str("name")?;
        if let Some(v) = url.take_bool("progress_thread")? {
            cfg.progress_thread = v;
        }
        if let Some(d) = url.take_duration_ms("timeout_ms")? {
            cfg.timeout = d;
        }
        if let Some(n) = url.take("ns_per_byte")? {
            cfg.timeout_ns_per_byte = n;
        }
        // Deliberately strict (no `yes`/`on`, no bare key): it opens the
        // agent's memory to every host that can reach the listener.
        if let Some(v) = url.take_with("insecure", "1 or 0 (true or false)", |v| match v {
            "1" | "true" => Some(true),
            "0" | "false" => Some(false),
            _ => None,
        })? {
            cfg.insecure = v;
        }
        url.finish()?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks the fields that must not be empty or contain NUL bytes.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: &str| Err(Error::InvalidArgument(format!("nixl config: {m}")));
        if self.backends.is_empty() {
            return bad("`backends` names no NIXL backend");
        }
        if self.host.is_empty() {
            return bad("`host` is empty");
        }
        if self.name.as_ref().is_some_and(String::is_empty) {
            return bad("`name` is empty");
        }
        let texts = self
            .backends
            .iter()
            .chain(std::iter::once(&self.host))
            .chain(self.name.iter());
        if texts.into_iter().any(|s| s.contains('\0')) {
            return bad("values may not contain NUL bytes");
        }
        Ok(())
    }

    /// The deadline of a batch moving `bytes` bytes: `timeout` +
    /// `timeout_ns_per_byte` × `bytes` (saturating).
    pub fn deadline_for(&self, bytes: u64) -> Duration {
        self.timeout.saturating_add(Duration::from_nanos(
            bytes.saturating_mul(self.timeout_ns_per_byte),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_parameter() {
        let c = NixlConfig::from_url(
            "nixl://?lib=/opt/nixl/libnixl_capi.so&backends=UCX,POSIX&host=10.0.0.2&port=7000\
             &name=prefill-0&progress_thread=0&timeout_ms=5000&ns_per_byte=2",
        )
        .unwrap();
        assert_eq!(
            c,
            NixlConfig {
                library: Some(PathBuf::from("/opt/nixl/libnixl_capi.so")),
                backends: vec!["UCX".into(), "POSIX".into()],
                host: "10.0.0.2".into(),
                port: 7000,
                name: Some("prefill-0".into()),
                progress_thread: false,
                timeout: Duration::from_secs(5),
                timeout_ns_per_byte: 2,
                insecure: false,
            }
        );
        assert_eq!(
            NixlConfig::from_url("nixl://").unwrap(),
            NixlConfig::default()
        );
        assert_eq!(c.deadline_for(1000), Duration::from_nanos(5_000_002_000));
    }

    #[test]
    fn rejects_bad_urls_naming_the_problem() {
        let err = |u: &str| match NixlConfig::from_url(u) {
            Err(Error::InvalidArgument(m)) => m,
            other => panic!("{u}: expected InvalidArgument, got {other:?}"),
        };
        assert!(err("nixl://?colour=blue").contains("`colour`"));
        assert!(err("nixl://?port=1&port=2").contains("`port` given twice"));
        assert!(err("nixl://?port=70000").contains("an integer 0..=65535"));
        assert!(err("nixl://?timeout_ms=soon").contains("`timeout_ms`"));
        assert!(err("nixl://?progress_thread=maybe").contains("`progress_thread`"));
        assert!(err("tcp://?lib=x").contains("not a nixl://"));
        assert!(err("nixl://somehost:1/").contains("parameters"));
        assert!(err("nixl://?backends=,").contains("no NIXL backend"));
        assert!(err("nixl://?name=a%00b").contains("NUL"));
        // Strict percent-decoding (the `url` crate let `%+5` through as it
        // was), encoded keys, no fragment, the known parameters listed, and
        // the URL quoted redacted (it used to be quoted as given).
        assert!(err("nixl://?port=%+5").contains("`port`"));
        assert!(err("nixl://?port=1&p%6Frt=2").contains("`port` given twice"));
        assert!(err("nixl://?colour=blue").contains(&URL_PARAMETERS.join(", ")));
        assert!(err("nixl://?lib=x#frag").contains("fragment"));
        let m = err("nixl://u:hunter2@h/hunter2?secret=hunter2");
        assert!(!m.contains("hunter2"), "{m}");
        let m = err("tcp://?secret=hunter2");
        assert!(!m.contains("hunter2"), "{m}");
        let c = NixlConfig::from_url("nixl://?b%61ckends=UCX,+POSIX&progress_thread=off").unwrap();
        assert_eq!(c.backends, ["UCX", "POSIX"]);
        assert!(!c.progress_thread);
        assert!(NixlConfig::builder().name("").build().is_err());
        // `insecure` is strict.
        assert!(
            NixlConfig::from_url("nixl://?host=0.0.0.0&insecure=1")
                .unwrap()
                .insecure
        );
        assert!(
            !NixlConfig::from_url("nixl://?insecure=false")
                .unwrap()
                .insecure
        );
        for u in [
            "nixl://?insecure=on",
            "nixl://?insecure=yes",
            "nixl://?insecure",
        ] {
            assert!(err(u).contains("`insecure`"), "{u}");
        }
    }
}
