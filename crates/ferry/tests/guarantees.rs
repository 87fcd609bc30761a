//! The two guarantees (`landed_writes`, `peer_validation`) through the
//! facade: reported per build, emulated or refused as the mode says, and
//! accepted by `require=`.
#![cfg(all(feature = "mooncake", feature = "tcp"))]

use ferry::{Engine, Error, Operation, Support, TransferEngine};
use mooncake_testlibs::{library_path, Generation};

fn url(gen: Generation, extra: &str) -> String {
    format!(
        "mooncake://?lib={}&metadata=P2PHANDSHAKE&host=127.0.0.1{extra}",
        library_path(gen).display()
    )
}

#[tokio::test]
async fn tcp_backend_gives_both_guarantees_natively() {
    let e = Engine::open("tcp://127.0.0.1:0?require=landed_writes,peer_validation")
        .await
        .unwrap();
    let r = e.report();
    assert_eq!(r.guarantees.len(), Operation::GUARANTEES.len());
    for (op, s) in &r.guarantees {
        assert_eq!(*s, Support::Native, "{op}");
    }
    assert!(
        r.to_string()
            .contains("guarantees:\n  landed_writes     yes"),
        "{r}"
    );
}

#[tokio::test]
async fn current_mooncake_gives_both_guarantees_natively() {
    let e = Engine::open(&url(
        Generation::Current,
        "&strict=1&require=landed_writes,peer_validation",
    ))
    .await
    .unwrap();
    let c = e.capabilities();
    assert!(c.landed_writes && c.peer_validation);
    assert_eq!(e.report().support(Operation::LandedWrites), Support::Native);
}

#[tokio::test]
async fn old_mooncake_confirms_landed_writes_and_reports_it_emulated() {
    let e = Engine::open(&url(Generation::V0_3_0, "&require=landed_writes"))
        .await
        .unwrap();
    let r = e.report();
    match r.support(Operation::LandedWrites) {
        Support::Emulated { via, missing } => {
            assert!(via.contains("last byte"), "{via}");
            assert_eq!(missing.min_version.as_deref(), Some("Mooncake v0.3.12"));
        }
        other => panic!("landed_writes on v0.3.0: {other:?}"),
    }
    match r.support(Operation::PeerValidation) {
        Support::Unsupported(m) => {
            assert_eq!(m.min_version.as_deref(), Some("Mooncake v0.3.12"))
        }
        other => panic!("peer_validation on v0.3.0: {other:?}"),
    }
    let text = r.to_string();
    assert!(text.contains("  landed_writes     emulated ("), "{text}");
    assert!(text.contains("  peer_validation   no: "), "{text}");
}

#[tokio::test]
async fn old_mooncake_in_strict_mode_refuses_landed_writes_up_front() {
    let e = Engine::open(&url(
        Generation::V0_3_0,
        "&strict=1&require=batch_transfer,landed_writes",
    ))
    .await
    .unwrap_err();
    let Error::MissingCapabilities { missing, .. } = &e else {
        panic!("expected MissingCapabilities, got {e}");
    };
    assert_eq!(missing.len(), 1, "{e}");
    assert_eq!(missing[0].operation, Operation::LandedWrites);
    assert_eq!(missing[0].min_version.as_deref(), Some("Mooncake v0.3.12"));
    assert!(missing[0].reason.contains("when it is sent"), "{e}");
    // Strict without the requirement opens, and says writes complete on "sent".
    let e = Engine::open(&url(Generation::V0_3_0, "&strict=1"))
        .await
        .unwrap();
    assert!(!e.capabilities().landed_writes);
    assert!(
        e.report()
            .to_string()
            .contains("completion: sent, not landed"),
        "{}",
        e.report()
    );
}

#[tokio::test]
async fn peer_validation_cannot_be_required_of_old_builds_in_any_mode() {
    for extra in [
        "&require=peer_validation",
        "&strict=1&require=peer_validation",
    ] {
        let e = Engine::open(&url(Generation::V0_3_6, extra))
            .await
            .unwrap_err();
        match &e {
            Error::MissingCapabilities { missing, .. } => {
                assert_eq!(missing[0].operation, Operation::PeerValidation, "{e}")
            }
            other => panic!("{extra}: {other}"),
        }
    }
}

#[tokio::test]
async fn confirm_writes_param_is_checked() {
    let e = Engine::open(&url(Generation::V0_3_0, "&confirm_writes=maybe"))
        .await
        .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    // Explicitly on in strict mode: the backend confirms, the report says so.
    let e = Engine::open(&url(Generation::V0_3_0, "&strict=1&confirm_writes=1"))
        .await
        .unwrap();
    assert!(e.capabilities().landed_writes);
}
