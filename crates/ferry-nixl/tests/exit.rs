//! A process that used the engine exits cleanly: on a host with rdma-core
//! installed, the `nixl-cu12` wheel's UCX EFA module loads a second copy of
//! libnl-route and the process takes SIGSEGV in libnl's destructor after
//! `main` returns, unless the backend keeps UCX from loading that module
//! where no EFA device exists (`src/ucx_env.rs`).
//!
//! The process under test is this binary itself, running the ignored
//! `child_moves_bytes_then_exits` test (`FERRY_NIXL_EXIT_CHILD=1`).

mod common;

use ferry_core::DynTransferEngine;
use std::process::Command;
use std::sync::Arc;

use ferry_core::conformance::skip_unavailable;
use ferry_core::{HostBuffer, Location, RegisteredBuffer, TransferEngine, TransferRequest};

const CHILD_ENV: &str = "FERRY_NIXL_EXIT_CHILD";
const LEN: usize = 1 << 20;

/// Two engines, one 1 MiB write between them, bytes checked, then the
/// process ends as a test binary does (`exit` after `main`).
#[test]
#[ignore = "helper process of a_process_that_used_the_engine_exits_cleanly"]
fn child_moves_bytes_then_exits() {
    if std::env::var_os(CHILD_ENV).is_none() {
        return;
    }
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let a: Arc<dyn DynTransferEngine> = common::engine().await.expect("engine a");
        let b: Arc<dyn DynTransferEngine> = common::engine().await.expect("engine b");
        let dst = RegisteredBuffer::new(Arc::clone(&b), LEN)
            .await
            .expect("register b");
        let src = HostBuffer::new(LEN).expect("buffer");
        src.fill(0xa7);
        // SAFETY: `src` outlives its registration (released below).
        let region = unsafe { src.region(Location::cpu(0)) };
        a.register(region).await.expect("register a");
        let seg = a.open_segment(b.segment_name()).await.expect("open b");
        a.transfer(
            seg,
            TransferRequest::write(src.addr(), dst.addr(), LEN as u64),
        )
        .await
        .expect("write");
        assert!(
            dst.memory().to_vec().iter().all(|&x| x == 0xa7),
            "bytes did not land"
        );
        let info = a.backend_info();
        let ucx = info
            .details
            .iter()
            .find(|(k, _)| k == "ucx modules")
            .map(|(_, v)| v.clone())
            .unwrap_or_default();
        println!("UCX {ucx}");
        a.close_segment(seg).await.expect("close");
        a.unregister(src.addr()).await.expect("unregister");
        dst.release().await.expect("release");
    });
}

#[test]
fn a_process_that_used_the_engine_exits_cleanly() {
    if let Err(e) = common::nixl_library() {
        skip_unavailable("a_process_that_used_the_engine_exits_cleanly", &e);
        return;
    }
    let out = Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "--ignored",
            "--exact",
            "child_moves_bytes_then_exits",
            "--nocapture",
        ])
        .env(CHILD_ENV, "1")
        .env_remove("UCX_MODULES")
        .output()
        .expect("running the child");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "the process that used the engine ended with {}:\n{stdout}\n{stderr}",
        out.status
    );
    assert!(
        stdout.contains("1 passed"),
        "the child did not run: {stdout}"
    );
    let line = stdout
        .lines()
        .find(|l| l.starts_with("UCX "))
        .unwrap_or_default();
    // Without an EFA device the guard is applied and reported; with one,
    // the report says it was left alone.
    assert!(
        line.contains("UCX_MODULES=^efa set by Ferry") || line.contains("EFA device is present"),
        "the report does not say what was decided about UCX's modules: {line:?}"
    );
}

/// The operator's `UCX_MODULES` is never changed, and the report says so.
#[test]
fn the_operators_ucx_modules_is_kept() {
    if let Err(e) = common::nixl_library() {
        skip_unavailable("the_operators_ucx_modules_is_kept", &e);
        return;
    }
    // `^efa,cuda` excludes the EFA module too, so the child exits cleanly
    // on any host while the value stays the operator's.
    let out = Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "--ignored",
            "--exact",
            "child_moves_bytes_then_exits",
            "--nocapture",
        ])
        .env(CHILD_ENV, "1")
        .env("UCX_MODULES", "^efa,cuda")
        .output()
        .expect("running the child");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "child failed: {}\n{stdout}",
        out.status
    );
    assert!(
        stdout.contains("UCX UCX_MODULES=^efa,cuda (the operator's; unchanged)"),
        "{stdout}"
    );
}
