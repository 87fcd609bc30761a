//! The capability report of every generation, asserted exactly (native and
//! through the default adapter), plus the strict-mode refusal.

mod common;

use ferry_core::DynTransferEngine;
use std::sync::Arc;

use common::{metadata_for, start, SUPPORTED};
use ferry_core::{AdapterConfig, CapabilityAdapter, Error, Operation, TransferEngine};
use ferry_mooncake::MooncakeEngine;
use mooncake_testlibs::{library_path, Generation as Lib};

fn expected(gen: Lib, engine: &MooncakeEngine) -> String {
    let path = library_path(gen).display().to_string();
    let (generation, metadata) = match gen {
        Lib::V0_2_0 => (
            "Mooncake v0.2.0 or later (no getLocalIpAndPort; createTransferEngine may take 4 or 5 arguments)",
            engine.config().metadata.clone(),
        ),
        Lib::V0_3_0 => (
            "Mooncake v0.3.0 or later (getLocalIpAndPort present; no notification symbols)",
            "P2PHANDSHAKE".to_owned(),
        ),
        Lib::V0_3_5 => (
            "Mooncake v0.3.5 or later (submitTransferWithNotify present; no freeNotifsMsgBuf)",
            "P2PHANDSHAKE".to_owned(),
        ),
        Lib::V0_3_6 => (
            "Mooncake v0.3.6 or later (freeNotifsMsgBuf present; no discoverTopology)",
            "P2PHANDSHAKE".to_owned(),
        ),
        Lib::Current => (
            "Mooncake v0.3.12 or later (getNicLoadStats present)",
            "P2PHANDSHAKE".to_owned(),
        ),
        Lib::PreV0_2_0 => unreachable!(),
    };
    let mut s = format!(
        "backend: mooncake\n\
         library: {path}\n\
         library source: engine config (lib=)\n\
         generation: {generation}\n\
         metadata: {metadata}\n\
         protocol: tcp\n\
         segment: {}\n",
        engine.segment_name()
    );
    // The TCP transport's guarantees: acknowledged writes and address checks
    // at the target arrived in v0.3.12 (upstream #2850 and #2314); before,
    // Ferry confirms writes itself.
    let old = gen < Lib::Current;
    if old {
        s.push_str(
            "completion: landed: this build's TCP transport reports a write completed when \
             it is sent, so Ferry reads each write's last byte back until it shows before \
             reporting it completed (acknowledged by the library from Mooncake v0.3.12)\n\
             peer address validation: no: this build's TCP transport writes at the peer \
             wherever the address points, registered or not, and reports success; Ferry \
             checks peers in this process itself (checked at the peer from Mooncake v0.3.12)\n",
        );
    } else {
        s.push_str(
            "completion: landed (acknowledged by the peer)\n\
             peer address validation: yes (the peer refuses addresses outside its registered \
             regions)\n",
        );
    }
    // Which peers it talks to (where data goes changed in v0.3.0 and v0.3.5).
    s.push_str(match gen {
        Lib::V0_2_0 => {
            "peer generations: Mooncake v0.2.x peers only; open_segment refuses a peer of \
             v0.3.0 or later (protocol error naming both) where its segment descriptor can be \
             read\n"
        }
        Lib::V0_3_0 => {
            "peer generations: Mooncake v0.3.0–v0.3.4 peers only; open_segment refuses others \
             (protocol error naming both) where their segment descriptor can be read\n"
        }
        Lib::Current => {
            "peer generations: Mooncake v0.3.5 or later; v0.3.5–v0.3.11 peers neither \
             acknowledge writes (Ferry confirms writes to them by reading them back, unless \
             confirm_writes is off) nor check addresses; open_segment refuses older peers \
             (protocol error naming both) where their segment descriptor can be read\n"
        }
        _ => {
            "peer generations: Mooncake v0.3.5 or later; open_segment refuses older peers \
             (protocol error naming both) where their segment descriptor can be read\n"
        }
    });
    if gen == Lib::V0_3_6 {
        s.push_str(
            "bad peer addresses: a TCP transfer to an unmapped address crashes the peer on \
             Mooncake v0.3.6–v0.3.8 (its error log prints the address as a C string; fixed in \
             v0.3.9; this build's symbols cannot tell which it is)\n",
        );
    }
    s.push_str(
        "max batch length: unlimited\n\
         memory: host yes, cuda no\n\
         operations:\n  \
         batch_register    native\n  \
         batch_unregister  native\n  \
         batch_transfer    native\n  \
         async_batch       native\n  \
         batch_wait        native\n",
    );
    let v = gen.version();
    match gen {
        Lib::V0_2_0 | Lib::V0_3_0 => s.push_str(&format!(
            "  notify            unsupported: {path} ({v}) has no \
             submitTransferWithNotify/getNotifsFromEngine/genNotifyInEngine; needs Mooncake v0.3.8\n"
        )),
        Lib::V0_3_5 => s.push_str(&format!(
            "  notify            unsupported: {path} (v0.3.5) returns notification names and \
             messages in strings it has already freed, and its TCP engines reject incoming \
             notifications; needs Mooncake v0.3.8\n"
        )),
        Lib::V0_3_6 => s.push_str(&format!(
            "  notify            unsupported: {path} ({v}, v0.3.6–v0.3.10 by its symbols) is a \
             build whose TCP engines reject incoming notifications (v0.3.6 and v0.3.7): a \
             notification this engine sent to itself was rejected (ERR_METADATA); needs \
             Mooncake v0.3.8\n"
        )),
        _ => s.push_str("  notify            native\n"),
    }
    s.push_str("guarantees:\n");
    if old {
        s.push_str(&format!(
            "  landed_writes     emulated (Ferry reads each write's last byte back until it \
             shows): {path} ({v}) reports a TCP write completed when it is sent, with no \
             acknowledgement from the peer; native with Mooncake v0.3.12\n  \
             peer_validation   no: {path} ({v}) writes and reads at the peer wherever the \
             address points (mapped but unregistered memory is overwritten); from Mooncake \
             v0.3.12\n"
        ));
    } else {
        s.push_str("  landed_writes     yes\n  peer_validation   yes\n");
    }
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capability_report_of_every_generation() {
    for gen in SUPPORTED {
        let engine = start(gen, &metadata_for(gen)).await;
        let want = expected(gen, &engine);
        let shared: Arc<dyn DynTransferEngine> = Arc::new(engine);
        let report =
            CapabilityAdapter::from_arc(Arc::clone(&shared), AdapterConfig::default()).report();
        let text = report.to_string();
        println!("--- {gen} ---\n{text}");
        assert_eq!(text, want, "{gen}");
        assert_eq!(
            report.native, report.effective,
            "{gen}: the adapter emulates nothing here (the backend confirms writes itself)"
        );
        let notify = report.info.note(Operation::Notify);
        if gen < Lib::Current {
            assert_eq!(
                notify.and_then(|m| m.min_version.clone()),
                Some("Mooncake v0.3.8".into())
            );
        } else {
            assert!(notify.is_none());
        }
        let details: Vec<&str> = report
            .info
            .details
            .iter()
            .map(|(k, _)| k.as_str())
            .collect();
        assert!(details.contains(&"library") && details.contains(&"generation"));

        // Strict mode names the missing operation and the version that adds it.
        let strict = CapabilityAdapter::from_arc(shared, AdapterConfig::strict());
        let got = strict.require(&[
            Operation::BatchRegister,
            Operation::AsyncBatch,
            Operation::Notify,
        ]);
        if gen < Lib::Current {
            match got {
                Err(Error::MissingCapabilities { backend, missing }) => {
                    assert_eq!(backend, "mooncake");
                    assert_eq!(missing.len(), 1);
                    assert_eq!(missing[0].operation, Operation::Notify);
                    assert_eq!(missing[0].min_version.as_deref(), Some("Mooncake v0.3.8"));
                }
                other => panic!("{gen}: expected MissingCapabilities, got {other:?}"),
            }
        } else {
            got.unwrap();
        }
    }
}
