//! The skip policy of the conformance suite: only `Error::Unavailable` may
//! turn a check into a skip, and `FERRY_REQUIRE_BACKENDS` turns even that
//! into a failure for the backends it lists.
//!
//! One test only: it sets the process environment, which the other tests of
//! a binary would race with.

use ferry_core::DynTransferEngine;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use ferry_core::conformance::{
    check_capability_honesty, check_identity, check_unregister_in_flight, EngineFactory, Outcome,
    REQUIRE_BACKENDS_ENV,
};
use ferry_core::{Error, Result};
use futures::FutureExt as _;

/// A factory whose every engine fails to start with the given error.
struct Failing(Error);

#[async_trait::async_trait]
impl EngineFactory for Failing {
    async fn create(&self) -> Result<Arc<dyn DynTransferEngine>> {
        Err(self.0.clone())
    }
}

fn unavailable(backend: &str) -> Error {
    Error::Unavailable {
        backend: backend.to_owned(),
        reason: "no device on this machine".to_owned(),
    }
}

/// The outcome of every check that goes through a factory, or the panic
/// message of the first that panics.
async fn outcome(err: Error) -> std::result::Result<Outcome, String> {
    let f: Arc<dyn EngineFactory> = Arc::new(Failing(err));
    let mut last = None;
    for adapted in [false, true] {
        for run in [
            check_identity(Arc::clone(&f), adapted).boxed(),
            check_capability_honesty(Arc::clone(&f), adapted).boxed(),
            check_unregister_in_flight(Arc::clone(&f), adapted).boxed(),
        ] {
            match AssertUnwindSafe(run).catch_unwind().await {
                Ok(o) => last = Some(o),
                Err(p) => {
                    return Err(p
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| p.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                        .unwrap_or_default())
                }
            }
        }
    }
    Ok(last.expect("ran at least one check"))
}

#[tokio::test]
async fn only_unavailable_skips_and_required_backends_never_do() {
    std::env::remove_var(REQUIRE_BACKENDS_ENV);

    // Unavailable, not required: a skip naming the reason.
    match outcome(unavailable("verbs")).await {
        Ok(Outcome::Skipped(reason)) => {
            assert!(reason.contains("no device on this machine"), "{reason}");
            assert!(reason.contains("verbs"), "{reason}");
        }
        other => panic!("Unavailable should skip, got {other:?}"),
    }

    // Any other factory error is a failure, never a skip.
    for err in [
        Error::InvalidArgument("bad URL parameter".to_owned()),
        Error::Timeout {
            operation: "starting the engine".to_owned(),
            peer: None,
            after: std::time::Duration::from_secs(1),
        },
    ] {
        let shown = err.to_string();
        match outcome(err).await {
            Err(msg) => {
                assert!(msg.contains("only Unavailable may skip"), "{msg}");
                assert!(msg.contains(&shown), "{msg}");
            }
            Ok(o) => panic!("a factory failing with {shown:?} gave {o:?} instead of failing"),
        }
    }

    // Required: the skip of a listed backend is a failure with the reason.
    std::env::set_var(REQUIRE_BACKENDS_ENV, "inproc, TCP ,verbs");
    match outcome(unavailable("verbs")).await {
        Err(msg) => {
            assert!(msg.contains(REQUIRE_BACKENDS_ENV), "{msg}");
            assert!(msg.contains("no device on this machine"), "{msg}");
        }
        Ok(o) => panic!("a required backend skipped: {o:?}"),
    }
    // ... and a backend the list does not name still skips.
    assert!(matches!(
        outcome(unavailable("mooncake")).await,
        Ok(Outcome::Skipped(_))
    ));
    std::env::remove_var(REQUIRE_BACKENDS_ENV);
}
