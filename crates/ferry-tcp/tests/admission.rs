//! Connections per source are capped: one source holding idle connections
//! cannot take every established slot from the others.

mod common;

use std::time::Duration;

use common::mem;
use ferry_core::{TransferEngine, TransferRequest};
use ferry_tcp::{TcpConfig, TcpEngine};

/// An attacker on 127.0.0.2 opens five times `max_inbound` connections,
/// completes each handshake (no secret) and holds them all idle;
/// legitimate engines on 127.0.0.1 then connect and write one after
/// another. The attacker keeps at most its share (a quarter of
/// `max_inbound`: its own idle connections are evicted for its new ones),
/// so at least 95 % of the legitimate handshakes (here: all) succeed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_source_holding_idle_connections_leaves_room_for_others() {
    let max_inbound = 16;
    let b = TcpEngine::start(
        TcpConfig::builder()
            .max_inbound(max_inbound)
            .build()
            .unwrap(),
    )
    .await
    .unwrap();
    let target = mem(&b, 4096, 0).await;
    let name = b.segment_name().to_owned();
    let mut held = Vec::new();
    let mut attacker_admitted = 0;
    for _ in 0..5 * max_inbound {
        let sock = tokio::net::TcpSocket::new_v4().unwrap();
        sock.bind("127.0.0.2:0".parse().unwrap()).unwrap();
        let s = sock.connect(name.parse().unwrap()).await.unwrap();
        // A refused handshake panics inside its task: counted, not fatal.
        if let Ok((s, _)) = tokio::spawn(common::raw_handshake_on(s)).await {
            attacker_admitted += 1;
            held.push(s);
        }
    }
    // Their evictions have run.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut ok = 0;
    let tries = 40;
    for i in 0..tries {
        let a = TcpEngine::start(TcpConfig::default()).await.unwrap();
        let src = mem(&a, 4096, i as u8).await;
        let r = async {
            let seg = a.open_segment(&name).await?;
            a.transfer(seg, TransferRequest::write(src.addr(), target.addr(), 4096))
                .await
        }
        .await;
        match r {
            Ok(()) => ok += 1,
            Err(e) => eprintln!("legitimate client {i}: {e}"),
        }
    }
    eprintln!(
        "attacker handshakes admitted {attacker_admitted}/{}, legitimate writes {ok}/{tries}",
        5 * max_inbound
    );
    assert!(
        ok * 100 >= tries * 95,
        "only {ok} of {tries} legitimate clients got through"
    );
    drop(held);
}

/// The bound is configurable and never above `max_inbound`.
#[test]
fn the_per_source_bound_is_a_share_of_max_inbound() {
    let c = TcpConfig::default();
    assert_eq!(c.per_source_limit(), c.max_inbound / 4);
    let c = TcpConfig::from_url("tcp://127.0.0.1:0?max_inbound=8&max_per_source=3").unwrap();
    assert_eq!(c.per_source_limit(), 3);
    let c = TcpConfig::from_url("tcp://127.0.0.1:0?max_inbound=8&max_per_source=100").unwrap();
    assert_eq!(c.per_source_limit(), 8);
    let c = TcpConfig::from_url("tcp://127.0.0.1:0?max_inbound=2").unwrap();
    assert_eq!(c.per_source_limit(), 1);
}
