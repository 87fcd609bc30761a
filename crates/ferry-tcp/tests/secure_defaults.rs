//! Secure by default beyond loopback: an engine that other hosts could
//! reach refuses to start without a secret unless told `insecure=1`.

use ferry_core::{Error, TransferEngine};
use ferry_tcp::{TcpConfig, TcpEngine};

#[tokio::test]
async fn an_engine_reachable_by_other_hosts_needs_a_secret_or_insecure() {
    // 0.0.0.0: every interface.
    let e = TcpEngine::start(TcpConfig::from_url("tcp://0.0.0.0:0").unwrap())
        .await
        .unwrap_err();
    match &e {
        Error::InvalidArgument(m) => {
            for needle in [
                "without a secret",
                "read and write every registered byte",
                "FERRY_SECRET",
                "insecure=1",
            ] {
                assert!(m.contains(needle), "{needle:?} missing from: {m}");
            }
        }
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
    let with_secret = TcpEngine::start(TcpConfig::from_url("tcp://0.0.0.0:0?secret=s").unwrap())
        .await
        .expect("a secret makes it acceptable");
    assert!(with_secret.segment_name().starts_with("0.0.0.0:"));
    let insecure = TcpEngine::start(TcpConfig::from_url("tcp://0.0.0.0:0?insecure=1").unwrap())
        .await
        .expect("insecure=1 accepts the exposure");
    drop(insecure);
    // Loopback needs neither.
    TcpEngine::start(TcpConfig::from_url("tcp://127.0.0.1:0").unwrap())
        .await
        .expect("loopback");
    TcpEngine::start(TcpConfig::from_url("tcp://[::1]:0").unwrap())
        .await
        .map(drop)
        .or_else(|e| match e {
            // A host without IPv6 cannot bind ::1 at all.
            Error::Io { .. } => Ok(()),
            e => Err(e),
        })
        .expect("loopback v6");
    assert!(TcpConfig::from_url("tcp://0.0.0.0:0?insecure=yes").is_err());
}
