//! A backend outside Ferry registers its scheme and is opened through
//! `ferry::Engine::open` like Ferry's own: `Relay`, defined here (not in
//! the workspace's backends), moves bytes through ferry-core's in-process
//! engine and declares no optional operation native, so the default stack
//! the registry puts over it emulates batches.

use std::sync::Arc;

use ferry::raw::ParsedUrl;
use ferry::registry::{self, RegisterError, Registry, Scheme, SchemeContext};
use ferry::{
    BackendInfo, Capabilities, Engine, Error, MemoryRegion, Operation, RegisteredBuffer, Result,
    SegmentId, Support, TransferEngine, TransferRequest,
};
use ferry_core::inproc::InprocEngine;

/// A backend of a crate other than Ferry's: the basic operations only.
struct Relay {
    inner: InprocEngine,
    /// From the URL's `label=`.
    label: String,
}

impl TransferEngine for Relay {
    fn backend_name(&self) -> &str {
        "relay"
    }
    fn segment_name(&self) -> &str {
        self.inner.segment_name()
    }
    fn capabilities(&self) -> Capabilities {
        // No batch, async-batch or notification call of its own.
        let mut caps = Capabilities::default();
        caps.memory = self.inner.capabilities().memory;
        caps
    }
    fn backend_info(&self) -> BackendInfo {
        self.inner.backend_info()
    }
    async fn register(&self, region: MemoryRegion) -> Result<()> {
        self.inner.register(region).await
    }
    async fn unregister(&self, addr: u64) -> Result<()> {
        self.inner.unregister(addr).await
    }
    async fn open_segment(&self, name: &str) -> Result<SegmentId> {
        self.inner.open_segment(name).await
    }
    async fn close_segment(&self, segment: SegmentId) -> Result<()> {
        self.inner.close_segment(segment).await
    }
    async fn transfer(&self, segment: SegmentId, request: TransferRequest) -> Result<()> {
        self.inner.transfer(segment, request).await
    }
}

/// `relay://NAME?label=TEXT`.
fn relay() -> Scheme {
    Scheme::new("relay", |mut url: ParsedUrl, _: &SchemeContext| {
        let name = url.authority().to_owned();
        let label = url.take_str("label")?.unwrap_or_default();
        url.finish()?;
        Ok(async move {
            Ok(Relay {
                inner: InprocEngine::new(&name, Capabilities::all())?,
                label,
            })
        })
    })
}

/// Registers `relay` in the global registry once for this test binary
/// (the tests run in one process, in any order).
fn registered() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| registry::register(relay()).unwrap());
}

#[tokio::test]
async fn an_outside_scheme_opens_through_engine_open_and_moves_bytes() {
    registered();
    let a = Arc::new(Engine::open("relay://reg-a?label=prefill").await.unwrap());
    let b = Arc::new(Engine::open("relay://reg-b").await.unwrap());
    assert_eq!(a.scheme(), "relay");
    assert_eq!(a.kind(), None);
    assert_eq!(a.backend_name(), "relay");
    assert_eq!(a.backend::<Relay>().unwrap().label, "prefill");
    assert!(a.backend::<InprocEngine>().is_none());
    // The default stack is over it: batches are emulated, and reported so.
    assert!(matches!(
        a.report().support(Operation::BatchTransfer),
        Support::Emulated { .. }
    ));

    let src = RegisteredBuffer::new(Arc::clone(&a), 8192).await.unwrap();
    let dst = RegisteredBuffer::new(Arc::clone(&b), 8192).await.unwrap();
    let data: Vec<u8> = (0..8192u32).map(|i| (i % 251) as u8).collect();
    src.memory().write(0, &data).unwrap();
    let peer = a.open_segment(b.segment_name()).await.unwrap();
    a.transfer(peer, TransferRequest::write(src.addr(), dst.addr(), 4096))
        .await
        .unwrap();
    let requests = [TransferRequest::write(
        src.addr() + 4096,
        dst.addr() + 4096,
        4096,
    )];
    a.batch_transfer(peer, &requests, None).await.unwrap();
    let mut got = vec![0u8; 8192];
    dst.memory().read(0, &mut got).unwrap();
    assert_eq!(got, data);
    // The metrics layer counted the bytes and the emulated batch.
    let m = a.metrics();
    assert!(m.bytes_total() >= 8192, "{m:?}");
    assert!(m.emulated.values().sum::<u64>() >= 1, "{m:?}");
}

#[tokio::test]
async fn the_outside_scheme_keeps_the_rules_of_the_one_parser() {
    registered();
    // Ferry's own parameters are taken before the constructor sees the URL.
    let e = Engine::open("relay://reg-c?strict=1&require=transfer")
        .await
        .unwrap();
    assert!(e.adapter_config().strict);
    // A key given twice, however it is spelled, is refused naming it.
    for url in [
        "relay://reg-d?label=a&label=b",
        "relay://reg-d?label=a&l%61bel=b",
    ] {
        let err = Engine::open(url).await.unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
        assert!(err.to_string().contains("`label` given twice"), "{err}");
    }
    // An unknown key is refused naming it and the known ones.
    let err = Engine::open("relay://reg-d?colour=blue").await.unwrap_err();
    let m = err.to_string();
    assert!(m.contains("`colour`") && m.contains("label"), "{m}");
    assert!(m.contains("strict"), "{m}");
    // `require=` of an operation the stack cannot give in strict mode.
    let err = Engine::open("relay://reg-e?strict=1&require=batch_transfer")
        .await
        .unwrap_err();
    assert!(matches!(err, Error::MissingCapabilities { .. }), "{err}");
}

#[test]
fn a_taken_scheme_is_refused_with_a_typed_error() {
    registered();
    assert_eq!(
        registry::register(relay()),
        Err(RegisterError::Taken {
            scheme: "relay".to_owned()
        })
    );
    // Ferry's own schemes are taken too.
    #[cfg(feature = "tcp")]
    assert_eq!(
        registry::register(Scheme::new("TCP", |_: ParsedUrl, _: &SchemeContext| {
            Ok(async { Err::<Relay, _>(Error::InvalidArgument("unused".into())) })
        })),
        Err(RegisterError::Taken {
            scheme: "tcp".to_owned()
        })
    );
    assert!(Registry::global().contains("relay"));
}

#[tokio::test]
async fn a_registry_of_ones_own_opens_only_its_schemes() {
    let mine = Registry::empty();
    mine.register(relay()).unwrap();
    let e = mine.open("relay://reg-own").await.unwrap();
    assert_eq!(e.scheme(), "relay");
    let err = mine.open("tcp://127.0.0.1:0").await.unwrap_err();
    #[cfg(feature = "tcp")]
    assert!(err.to_string().contains("unknown backend \"tcp\""), "{err}");
    let err = mine.open("udp://h:1").await.unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    assert!(err.to_string().contains("relay://"), "{err}");
    let _ = err;
}
