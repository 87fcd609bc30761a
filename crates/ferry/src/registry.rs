//! The scheme registry: which URL scheme opens which backend.
//!
//! Every backend registers its scheme with a constructor from the parsed
//! URL ([`Scheme::new`]); [`Engine::open`] looks the scheme up here and
//! nowhere else. The schemes of this build (`tcp`, `mooncake`, `verbs`,
//! `nixl` with their cargo features, `inproc` with the feature `inproc`)
//! are in [`Registry::global`] from the start; a program adds its own
//! with [`register`]:
//!
//! ```
//! # #[cfg(feature = "inproc")]
//! # async fn demo() -> ferry::Result<()> {
//! use ferry::registry::{self, Scheme};
//! use ferry_core::inproc::InprocEngine;
//!
//! registry::register(Scheme::new("demo", |mut url, _context| {
//!     let name = url.authority().to_owned();
//!     url.finish()?; // refuses every parameter not taken
//!     Ok(async move { InprocEngine::new(&name, ferry::Capabilities::all()) })
//! }))?;
//! let engine = ferry::Engine::open("demo://a?strict=1").await?;
//! # let _ = engine; Ok(()) }
//! ```
//!
//! # One parser, one set of rules
//!
//! The URL is parsed once, by [`ParsedUrl`] (strict percent-decoding, a
//! key given twice refused naming it, no fragment). Ferry takes its own
//! parameters first, for every scheme alike (`secret_file`, `strict`,
//! `coalesce`, `max_concurrency`, `require`; on the schemes that take
//! segment discovery, `metadata`, `prefix`, `lease_ttl_ms`,
//! `segment_name`; see [`EngineConfig`](crate::EngineConfig)); the
//! constructor takes the backend's own and ends with
//! [`ParsedUrl::finish`], which refuses what is left by name.
//!
//! # The stack
//!
//! Whatever the scheme, the backend the constructor starts goes into the
//! default [`Stack`] (tracing over metrics over the capability adapter),
//! built by one generic function; [`Engine`] holds it as one trait object.

use std::any::Any;
use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;
// A poisoned lock only means a thread panicked while holding it; every
// change to the table is one insert.
use std::sync::{Arc, OnceLock, PoisonError, RwLock};

use ferry_core::layer::{MetricsSnapshot, TracingEngine, TracingLayer};
use ferry_core::raw::ParsedUrl;
use ferry_core::{
    AdapterConfig, BoxFuture, CapabilityAdapter, CapabilityReport, DynTransferEngine, Error,
    FastPath, Layer, Metrics, MetricsLayer, Operation, Result, SegmentId, TransferEngine,
};

use crate::config::{BackendKind, DiscoveryConfig};
use crate::dispatch::{Engine, Stack};

/// What a constructor is given besides the URL: the adapter configuration
/// Ferry took from it (a backend whose defaults follow strict mode reads
/// it; Mooncake's `confirm_writes` does).
#[derive(Clone, Debug)]
pub struct SchemeContext {
    adapter: AdapterConfig,
    observe: Observe,
}

impl SchemeContext {
    /// The capability adapter's configuration (`strict`, `coalesce`, …).
    pub fn adapter(&self) -> &AdapterConfig {
        &self.adapter
    }
}

/// Options of [`Registry::open_parsed`] that a URL does not carry: where
/// the metrics layer counts and whether the tracing layer opens spans.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct OpenOptions {
    /// Where the metrics layer counts: [`Metrics::global`] by default;
    /// `None` switches the layer off.
    pub metrics: Option<Metrics>,
    /// Whether the tracing layer opens a `debug` span per batch (default
    /// on).
    pub tracing: bool,
}

impl Default for OpenOptions {
    fn default() -> Self {
        OpenOptions {
            metrics: Some(Metrics::global().clone()),
            tracing: true,
        }
    }
}

impl OpenOptions {
    /// Counts into `metrics` (`None`: metrics off).
    pub fn metrics(mut self, metrics: Option<Metrics>) -> Self {
        self.metrics = metrics;
        self
    }

    /// Switches the per-batch tracing spans on or off.
    pub fn tracing(mut self, on: bool) -> Self {
        self.tracing = on;
        self
    }
}

/// The observing layers put over the adapter.
#[derive(Clone, Debug)]
pub(crate) struct Observe {
    pub(crate) metrics: Option<Metrics>,
    pub(crate) tracing: bool,
}

impl From<OpenOptions> for Observe {
    fn from(o: OpenOptions) -> Self {
        Observe {
            metrics: o.metrics,
            tracing: o.tracing,
        }
    }
}

/// The default [`Stack`] over `engine`: built here, once, for every
/// scheme.
pub(crate) fn stack<E: TransferEngine>(
    engine: E,
    adapter: AdapterConfig,
    observe: &Observe,
) -> Arc<dyn Stacked> {
    let adapter = CapabilityAdapter::with_config(engine, adapter);
    let metrics = match &observe.metrics {
        Some(m) => MetricsLayer::new(m.clone()).native(adapter.report().native),
        None => MetricsLayer::disabled(),
    };
    let tracing = if observe.tracing {
        TracingLayer::new()
    } else {
        TracingLayer::disabled()
    };
    Arc::new(tracing.layer(metrics.layer(adapter)))
}

/// A backend in its [`Stack`], as [`Engine`] holds it: the trait object
/// every call goes through, plus what the stack's layers answer
/// themselves (the adapter's report, the metrics layer's counters) and the
/// backend itself for [`Engine::backend`].
pub(crate) trait Stacked: DynTransferEngine {
    fn report(&self) -> CapabilityReport;
    fn require(&self, ops: &[Operation]) -> Result<()>;
    fn adapter_config(&self) -> &AdapterConfig;
    fn snapshot(&self) -> MetricsSnapshot;
    fn metrics(&self) -> Option<&Metrics>;
    fn set_peer_path(&self, name: &str, path: &str);
    fn backend(&self) -> &dyn Any;
    /// `path`, a fast path of the backend's `segment`, wrapped by each
    /// layer of the stack, outermost last.
    fn wrap_fast(&self, segment: SegmentId, path: FastPath) -> FastPath;
}

impl<B: TransferEngine> Stacked for Stack<B> {
    fn report(&self) -> CapabilityReport {
        self.get_ref().get_ref().report()
    }
    fn require(&self, ops: &[Operation]) -> Result<()> {
        self.get_ref().get_ref().require(ops)
    }
    fn adapter_config(&self) -> &AdapterConfig {
        self.get_ref().get_ref().config()
    }
    fn snapshot(&self) -> MetricsSnapshot {
        self.get_ref().snapshot()
    }
    fn metrics(&self) -> Option<&Metrics> {
        self.get_ref().metrics()
    }
    fn set_peer_path(&self, name: &str, path: &str) {
        self.get_ref().set_peer_path(name, path);
    }
    fn backend(&self) -> &dyn Any {
        self.get_ref().get_ref().get_ref()
    }
    fn wrap_fast(&self, segment: SegmentId, path: FastPath) -> FastPath {
        let metrics = self.get_ref();
        let adapter = metrics.get_ref();
        TracingEngine::wrap_fast(self, metrics.wrap_fast(segment, adapter.wrap_fast(path)))
    }
}

/// `starting`, then the default stack over what it started.
pub(crate) fn stacking<E: TransferEngine>(
    starting: impl Future<Output = Result<E>> + Send + 'static,
    context: &SchemeContext,
) -> Starting {
    let SchemeContext { adapter, observe } = context.clone();
    Box::pin(async move { Ok(stack(starting.await?, adapter, &observe)) })
}

/// A backend starting: resolves to its stack.
pub(crate) type Starting = BoxFuture<'static, Result<Arc<dyn Stacked>>>;

type Constructor = dyn Fn(ParsedUrl, &SchemeContext) -> Result<Starting> + Send + Sync;

/// One scheme: its name and the constructor that starts a backend from a
/// parsed URL.
#[derive(Clone)]
pub struct Scheme {
    name: String,
    open: Arc<Constructor>,
    /// `Some` for a scheme that takes segment discovery (`metadata=etcd://`):
    /// the wire-protocol range it publishes.
    discovery: Option<(u16, u16)>,
}

impl fmt::Debug for Scheme {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Scheme").field("name", &self.name).finish()
    }
}

impl Scheme {
    /// The scheme `name` (`demo` for `demo://…`; compared in lower case),
    /// opened by `open`: given the URL with Ferry's own parameters taken
    /// out, it takes the backend's (ending with [`ParsedUrl::finish`],
    /// which refuses what is left) and returns the future that starts the
    /// backend. Parsing errors come back from `open` itself, before
    /// anything starts.
    pub fn new<E, F, Fut>(name: &str, open: F) -> Scheme
    where
        E: TransferEngine,
        F: Fn(ParsedUrl, &SchemeContext) -> Result<Fut> + Send + Sync + 'static,
        Fut: Future<Output = Result<E>> + Send + 'static,
    {
        let open = move |url: ParsedUrl, context: &SchemeContext| -> Result<Starting> {
            Ok(stacking(open(url, context)?, context))
        };
        Scheme {
            name: name.to_ascii_lowercase(),
            open: Arc::new(open),
            discovery: None,
        }
    }

    /// This scheme takes segment discovery and publishes `min..=max` as
    /// its wire-protocol range (Ferry's own transports).
    #[cfg_attr(not(any(feature = "tcp", feature = "verbs")), allow(dead_code))]
    pub(crate) fn with_discovery(mut self, min: u16, max: u16) -> Scheme {
        self.discovery = Some((min, max));
        self
    }

    /// The scheme's name, in lower case.
    pub fn name(&self) -> &str {
        &self.name
    }

    pub(crate) fn discovery(&self) -> Option<(u16, u16)> {
        self.discovery
    }
}

/// Why [`Registry::register`] refused a scheme.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum RegisterError {
    /// Another backend holds the scheme already.
    Taken {
        /// The scheme.
        scheme: String,
    },
    /// The name is not a URL scheme (a letter, then letters, digits, `+`,
    /// `-` or `.`).
    Malformed {
        /// The name given.
        scheme: String,
    },
}

impl fmt::Display for RegisterError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RegisterError::Taken { scheme } => write!(
                f,
                "the scheme {scheme}:// is registered already; a scheme opens one backend"
            ),
            RegisterError::Malformed { scheme } => write!(
                f,
                "{scheme:?} is not a URL scheme (a letter, then letters, digits, `+`, `-` or `.`)"
            ),
        }
    }
}

impl std::error::Error for RegisterError {}

impl From<RegisterError> for Error {
    fn from(e: RegisterError) -> Error {
        Error::InvalidArgument(e.to_string())
    }
}

/// Schemes and their constructors. [`Registry::global`] is the one
/// [`Engine::open`] uses; a [`Registry`] of one's own opens with
/// [`Registry::open`]. Cloning shares the table.
#[derive(Clone)]
pub struct Registry {
    schemes: Arc<RwLock<BTreeMap<String, Scheme>>>,
}

impl fmt::Debug for Registry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_set().entries(self.schemes()).finish()
    }
}

impl Default for Registry {
    fn default() -> Self {
        Registry::new()
    }
}

/// Registers `scheme` in [`Registry::global`] (see [`Registry::register`]).
pub fn register(scheme: Scheme) -> std::result::Result<(), RegisterError> {
    Registry::global().register(scheme)
}

impl Registry {
    /// A registry with the schemes of this build (see the module).
    pub fn new() -> Registry {
        let r = Registry::empty();
        for s in crate::builtin::schemes() {
            // Distinct names, checked by a test.
            let _ = r.register(s);
        }
        r
    }

    /// A registry without any scheme.
    pub fn empty() -> Registry {
        Registry {
            schemes: Arc::new(RwLock::new(BTreeMap::new())),
        }
    }

    /// The process-wide registry [`Engine::open`] looks schemes up in.
    pub fn global() -> &'static Registry {
        static GLOBAL: OnceLock<Registry> = OnceLock::new();
        GLOBAL.get_or_init(Registry::new)
    }

    /// Adds `scheme`. Errors: [`RegisterError::Taken`] when the registry
    /// has the scheme already (the first registration stays);
    /// [`RegisterError::Malformed`] for a name that is not a URL scheme.
    pub fn register(&self, scheme: Scheme) -> std::result::Result<(), RegisterError> {
        let mut chars = scheme.name.chars();
        let valid = chars.next().is_some_and(|c| c.is_ascii_alphabetic())
            && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'));
        if !valid {
            return Err(RegisterError::Malformed {
                scheme: scheme.name,
            });
        }
        let mut table = self.schemes.write().unwrap_or_else(PoisonError::into_inner);
        if table.contains_key(&scheme.name) {
            return Err(RegisterError::Taken {
                scheme: scheme.name,
            });
        }
        table.insert(scheme.name.clone(), scheme);
        Ok(())
    }

    /// The registered schemes, sorted.
    pub fn schemes(&self) -> Vec<String> {
        self.schemes
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .keys()
            .cloned()
            .collect()
    }

    /// Whether `scheme` is registered.
    pub fn contains(&self, scheme: &str) -> bool {
        self.schemes
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .contains_key(&scheme.to_ascii_lowercase())
    }

    fn get(&self, scheme: &str) -> Result<Scheme> {
        if let Some(s) = self
            .schemes
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(scheme)
        {
            return Ok(s.clone());
        }
        // A backend of Ferry's whose cargo feature is off names the feature.
        if let Ok(kind) = scheme.parse::<BackendKind>() {
            if !kind.is_enabled() {
                return Err(kind.disabled_error());
            }
        }
        let mut known: Vec<String> = BackendKind::ALL
            .iter()
            .map(|k| k.scheme().to_owned())
            .collect();
        for s in self.schemes() {
            if !known.contains(&s) {
                known.push(s);
            }
        }
        let known: Vec<String> = known.iter().map(|s| format!("{s}://")).collect();
        Err(Error::InvalidArgument(format!(
            "unknown backend {scheme:?}; known: {}",
            known.join(", ")
        )))
    }

    /// Parses `url` and opens the engine its scheme names, with the default
    /// [`OpenOptions`] (see [`Engine::open`]).
    pub async fn open(&self, url: &str) -> Result<Engine> {
        self.open_parsed(ParsedUrl::parse(url)?, OpenOptions::default())
            .await
    }

    /// Opens the engine `url`'s scheme names: Ferry's own parameters are
    /// taken (see the module), the scheme's constructor takes the rest and
    /// starts the backend, which goes into the default [`Stack`]; then
    /// `require=` is checked and, with discovery, the segment published.
    ///
    /// Errors: [`Error::InvalidArgument`] for an unknown scheme (listing
    /// the known ones) or a bad parameter; [`Error::Unavailable`] naming
    /// the cargo feature for a backend of Ferry's this build does not
    /// include; the constructor's and [`Engine::start`]'s errors.
    pub async fn open_parsed(&self, mut url: ParsedUrl, options: OpenOptions) -> Result<Engine> {
        let scheme = self.get(url.scheme())?;
        crate::secret::resolve_url_file(&mut url)?;
        let (adapter, require) = AdapterConfig::take_url_params(&mut url)?;
        let discovery = match scheme.discovery {
            Some(_) => DiscoveryConfig::take_url_params(&mut url)?,
            None => None,
        };
        if discovery.is_some() {
            DiscoveryConfig::check_enabled()?;
        }
        let context = SchemeContext {
            adapter,
            observe: options.into(),
        };
        let starting = (scheme.open)(url, &context)?;
        Engine::launch(&scheme, starting, &require, discovery).await
    }
}

impl SchemeContext {
    pub(crate) fn new(adapter: AdapterConfig, observe: Observe) -> Self {
        SchemeContext { adapter, observe }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_builtin_schemes_are_distinct_and_registered() {
        let names: Vec<String> = crate::builtin::schemes()
            .iter()
            .map(|s| s.name().to_owned())
            .collect();
        let r = Registry::new();
        assert_eq!(r.schemes().len(), names.len(), "{names:?}");
        for kind in BackendKind::ALL {
            assert_eq!(r.contains(kind.scheme()), kind.is_enabled(), "{kind}");
        }
    }

    #[cfg(feature = "tcp")]
    #[test]
    fn malformed_and_taken_schemes_are_refused() {
        let r = Registry::empty();
        let demo =
            || {
                Scheme::new("Demo", |url: ParsedUrl, _: &SchemeContext| {
                    url.finish()?;
                    Ok(async {
                        Err::<ferry_tcp::TcpEngine, _>(Error::InvalidArgument("never".into()))
                    })
                })
            };
        assert_eq!(r.register(demo()), Ok(()));
        assert_eq!(r.schemes(), ["demo"]);
        assert_eq!(
            r.register(demo()),
            Err(RegisterError::Taken {
                scheme: "demo".to_owned()
            })
        );
        let bad = Scheme::new("1x", |_: ParsedUrl, _: &SchemeContext| {
            Ok(async { Err::<ferry_tcp::TcpEngine, _>(Error::InvalidArgument("never".into())) })
        });
        assert!(matches!(
            r.register(bad),
            Err(RegisterError::Malformed { .. })
        ));
    }
}
