//! The schemes of this build, as [`crate::registry`] registers them, and
//! the start of a backend from its typed configuration
//! ([`crate::Engine::start`]). Both go through the same start function per
//! backend and the same generic stack.

#[cfg(any(
    feature = "tcp",
    feature = "mooncake",
    feature = "verbs",
    feature = "nixl"
))]
use std::future::Future;

#[cfg(feature = "inproc")]
use ferry_core::raw::ParsedUrl;
#[cfg(any(feature = "mooncake", feature = "nixl"))]
use ferry_core::AdapterConfig;
#[cfg(any(
    feature = "tcp",
    feature = "mooncake",
    feature = "verbs",
    feature = "nixl"
))]
use ferry_core::Result;

use crate::config::{BackendConfig, BackendKind};
use crate::registry::{stacking, Scheme, SchemeContext, Starting};

/// The wire-protocol range a scheme with segment discovery publishes
/// (`None`: the scheme takes no discovery). A backend that does not
/// report its range publishes `0..=0`.
pub(crate) fn discovery(kind: BackendKind) -> Option<(u16, u16)> {
    match kind {
        BackendKind::Tcp => Some(tcp_range()),
        BackendKind::Verbs => Some((0, 0)),
        _ => None,
    }
}

#[cfg(feature = "tcp")]
fn tcp_range() -> (u16, u16) {
    let ours = ferry_tcp::VersionRange::OURS;
    (ours.min, ours.max)
}

#[cfg(not(feature = "tcp"))]
fn tcp_range() -> (u16, u16) {
    (0, 0)
}

/// Adds discovery to `scheme` where `kind` takes it.
#[cfg(any(
    feature = "tcp",
    feature = "mooncake",
    feature = "verbs",
    feature = "nixl"
))]
fn with_discovery(scheme: Scheme, kind: BackendKind) -> Scheme {
    match discovery(kind) {
        Some((min, max)) => scheme.with_discovery(min, max),
        None => scheme,
    }
}

/// Every scheme this build includes.
pub(crate) fn schemes() -> Vec<Scheme> {
    #[allow(unused_mut)]
    let mut schemes: Vec<Scheme> = Vec::new();
    #[cfg(feature = "tcp")]
    schemes.push(with_discovery(
        Scheme::new("tcp", |url, _| {
            Ok(start_tcp(ferry_tcp::TcpConfig::from_parts(url)?))
        }),
        BackendKind::Tcp,
    ));
    #[cfg(feature = "mooncake")]
    schemes.push(with_discovery(
        Scheme::new("mooncake", |url, cx| {
            Ok(start_mooncake(
                ferry_mooncake::MooncakeConfig::from_parts(url)?,
                cx.adapter(),
            ))
        }),
        BackendKind::Mooncake,
    ));
    #[cfg(feature = "verbs")]
    schemes.push(with_discovery(
        Scheme::new("verbs", |url, _| {
            Ok(start_verbs(ferry_verbs::VerbsConfig::from_parts(url)?))
        }),
        BackendKind::Verbs,
    ));
    #[cfg(feature = "nixl")]
    schemes.push(with_discovery(
        Scheme::new("nixl", |url, cx| {
            Ok(start_nixl(
                ferry_nixl::NixlConfig::from_parts(url)?,
                cx.adapter(),
            ))
        }),
        BackendKind::Nixl,
    ));
    #[cfg(feature = "inproc")]
    schemes.push(Scheme::new("inproc", inproc));
    // A multi engine publishes its multi segment name (every transport it
    // listens on) with Ferry's TCP wire-protocol range; peers open it by
    // the logical name as any Ferry engine.
    let (min, max) = tcp_range();
    schemes.push(
        Scheme::new(crate::multi::SCHEME, |url, _| crate::multi::from_url(url))
            .with_discovery(min, max),
    );
    schemes
}

/// The fast path of `segment` of `backend` (the backend under a stack),
/// for the backends of this build that have one: TCP.
pub(crate) fn fast_path(
    backend: &dyn std::any::Any,
    segment: ferry_core::SegmentId,
) -> Option<ferry_core::FastPath> {
    let _ = (backend, segment);
    #[cfg(feature = "tcp")]
    if let Some(tcp) = backend.downcast_ref::<ferry_tcp::TcpEngine>() {
        return tcp.fast_path(segment);
    }
    None
}

/// The backend `config` names, starting, into its stack.
pub(crate) fn start(config: BackendConfig, context: &SchemeContext) -> Starting {
    let _ = context;
    match config {
        #[cfg(feature = "tcp")]
        BackendConfig::Tcp(c) => stacking(start_tcp(c), context),
        #[cfg(feature = "mooncake")]
        BackendConfig::Mooncake(c) => stacking(start_mooncake(c, context.adapter()), context),
        #[cfg(feature = "verbs")]
        BackendConfig::Verbs(c) => stacking(start_verbs(c), context),
        #[cfg(feature = "nixl")]
        BackendConfig::Nixl(c) => stacking(start_nixl(c, context.adapter()), context),
    }
}

#[cfg(feature = "tcp")]
fn start_tcp(
    c: ferry_tcp::TcpConfig,
) -> impl Future<Output = Result<ferry_tcp::TcpEngine>> + Send + 'static {
    ferry_tcp::TcpEngine::start(c)
}

#[cfg(feature = "mooncake")]
fn start_mooncake(
    mut c: ferry_mooncake::MooncakeConfig,
    adapter: &AdapterConfig,
) -> impl Future<Output = Result<ferry_mooncake::MooncakeEngine>> + Send + 'static {
    // Strict mode emulates nothing, including the backend's own
    // confirmation of landed writes, unless asked for by name.
    c.confirm_writes = c.confirm_writes.or(Some(!adapter.strict));
    // The URL's `lib=` (or FERRY_MOONCAKE_LIB) names the library;
    // `Engine::open` documents that the configuration chooses native code
    // run in this process.
    ferry_mooncake::MooncakeEngine::start_trusted(
        c,
        ferry_mooncake::LibraryTrust::OperatorConfigured,
    )
}

#[cfg(feature = "verbs")]
fn start_verbs(
    c: ferry_verbs::VerbsConfig,
) -> impl Future<Output = Result<ferry_verbs::VerbsEngine>> + Send + 'static {
    ferry_verbs::VerbsEngine::start(c)
}

#[cfg(feature = "nixl")]
fn start_nixl(
    c: ferry_nixl::NixlConfig,
    adapter: &AdapterConfig,
) -> impl Future<Output = Result<ferry_nixl::NixlEngine>> + Send + 'static {
    let _ = adapter;
    // As for Mooncake: the URL's `lib=` (or FERRY_NIXL_LIB, the loader
    // path, the active Python's wheel) is the operator's.
    ferry_nixl::NixlEngine::start_trusted(c, ferry_nixl::LibraryTrust::OperatorConfigured)
}

/// `inproc://[name]?caps=none|all|op,op&pace_us=N`: engines of this
/// process only, moving real bytes, with the native capabilities listed in
/// `caps` (default `all`): everything else the capability adapter emulates
/// (or, with `strict=1`, refuses). For tests and for trying an application
/// against an engine that lacks batch calls. `pace_us` makes each chunk of
/// a transfer pause (see `InprocEngine::set_pace`).
#[cfg(feature = "inproc")]
fn inproc(
    mut url: ParsedUrl,
    _: &SchemeContext,
) -> ferry_core::Result<
    impl std::future::Future<Output = ferry_core::Result<ferry_core::inproc::InprocEngine>>
        + Send
        + 'static,
> {
    use ferry_core::{Capabilities, Operation};
    let name = url.authority().to_owned();
    let mut caps = Capabilities::all();
    if let Some(value) = url.take_value("caps") {
        caps = Capabilities::default();
        match value.as_deref().unwrap_or("") {
            "none" | "" => {}
            "all" => caps = Capabilities::all(),
            list => {
                for op in list.split(',').filter(|op| !op.trim().is_empty()) {
                    caps.set(op.parse::<Operation>()?, true);
                }
            }
        }
    }
    let pace = url.take_duration_us("pace_us")?;
    url.finish()?;
    Ok(async move {
        let engine = ferry_core::inproc::InprocEngine::new(&name, caps)?;
        engine.set_pace(pace);
        Ok(engine)
    })
}
