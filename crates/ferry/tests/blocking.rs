//! `ferry::blocking::Engine` over real sockets: bytes land where the
//! requests say (same-host path and socket path), from plain threads and
//! from many at once; misuse from an async task is a typed error; a
//! dropped buffer is unregistered.
#![cfg(feature = "tcp")]

use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry::blocking::Engine;
use ferry::{Error, TransferRequest};

const PATHS: [&str; 2] = ["tcp://127.0.0.1:0", "tcp://127.0.0.1:0?same_host=off"];

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[test]
fn writes_and_reads_land_on_both_paths() {
    for url in PATHS {
        let target = Engine::open(url).unwrap();
        let init = Engine::open(url).unwrap();
        let remote = target.buffer(64 << 10).unwrap();
        let local = init.buffer(64 << 10).unwrap();
        let peer = init.open_segment(target.segment_name()).unwrap();
        for (i, len) in [1usize, 4096, 40 << 10].into_iter().enumerate() {
            let data = pattern(i as u8, len);
            local.memory().write(0, &data).unwrap();
            init.transfer(
                peer,
                TransferRequest::write(local.addr(), remote.addr() + 8, len as u64),
            )
            .unwrap();
            let mut got = vec![0; len];
            remote.memory().read(8, &mut got).unwrap();
            assert_eq!(got, data, "{url}: write of {len} bytes");
        }
        // A batch of two writes, then a read back into another place.
        local.memory().write(0, &pattern(9, 8192)).unwrap();
        let report = init
            .batch_transfer(
                peer,
                &[
                    TransferRequest::write(local.addr(), remote.addr(), 4096),
                    TransferRequest::write(local.addr() + 4096, remote.addr() + 4096, 4096),
                ],
                None,
            )
            .unwrap();
        report.into_result().unwrap();
        init.transfer(
            peer,
            TransferRequest::read(local.addr() + 16384, remote.addr(), 8192),
        )
        .unwrap();
        let mut back = vec![0; 8192];
        local.memory().read(16384, &mut back).unwrap();
        assert_eq!(back, pattern(9, 8192), "{url}: read back");
        // A request outside the peer's region fails, typed; the engine
        // stays usable.
        let bad = init.transfer(
            peer,
            TransferRequest::write(local.addr(), remote.addr() + (64 << 10), 4096),
        );
        assert!(bad.is_err(), "{url}: out-of-bounds write succeeded");
        init.transfer(
            peer,
            TransferRequest::write(local.addr(), remote.addr(), 16),
        )
        .unwrap();
    }
}

/// Ten threads on one engine and one segment, each writing its own slot
/// many times: every slot ends with its thread's last bytes.
#[test]
fn many_threads_share_one_engine() {
    for url in PATHS {
        let target = Engine::open(url).unwrap();
        let init = Arc::new(Engine::open(url).unwrap());
        let remote = target.buffer(10 * 4096).unwrap();
        let local = Arc::new(init.buffer(10 * 4096).unwrap());
        let peer = init.open_segment(target.segment_name()).unwrap();
        let remote_addr = remote.addr();
        std::thread::scope(|s| {
            for t in 0..10u64 {
                let (init, local) = (Arc::clone(&init), Arc::clone(&local));
                s.spawn(move || {
                    let off = t * 4096;
                    for round in 0..200u8 {
                        local
                            .memory()
                            .write(off as usize, &pattern(round ^ t as u8, 4096))
                            .unwrap();
                        let r = init.batch_transfer(
                            peer,
                            &[TransferRequest::write(
                                local.addr() + off,
                                remote_addr + off,
                                4096,
                            )],
                            None,
                        );
                        r.unwrap().into_result().unwrap();
                    }
                });
            }
        });
        for t in 0..10u64 {
            let mut got = vec![0; 4096];
            remote.memory().read(t as usize * 4096, &mut got).unwrap();
            assert_eq!(got, pattern(199 ^ t as u8, 4096), "{url}: slot {t}");
        }
    }
}

#[test]
fn a_call_from_an_async_task_is_refused() {
    let engine = Arc::new(Engine::open("tcp://127.0.0.1:0").unwrap());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let name = engine.segment_name().to_owned();
    let err = rt
        .block_on(rt.spawn({
            let (engine, name) = (Arc::clone(&engine), name.clone());
            async move { engine.open_segment(&name) }
        }))
        .unwrap()
        .unwrap_err();
    assert!(
        matches!(&err, Error::InvalidArgument(m) if m.contains("async task")),
        "{err:?}"
    );
    // Outside the task it works.
    engine.open_segment(&name).unwrap();
}

#[test]
fn a_dropped_buffer_is_unregistered() {
    let target = Engine::open("tcp://127.0.0.1:0?same_host=off").unwrap();
    let init = Engine::open("tcp://127.0.0.1:0?same_host=off").unwrap();
    let remote = target.buffer(4096).unwrap();
    let local = init.buffer(4096).unwrap();
    let peer = init.open_segment(target.segment_name()).unwrap();
    let req = TransferRequest::write(local.addr(), remote.addr(), 4096);
    init.transfer(peer, req).unwrap();
    drop(remote);
    // The unregistration runs on the target's runtime: wait for it.
    let start = Instant::now();
    loop {
        match init.transfer(peer, req) {
            Err(_) => break,
            Ok(()) if start.elapsed() < Duration::from_secs(10) => {
                std::thread::sleep(Duration::from_millis(10))
            }
            Ok(()) => panic!("writes into a dropped buffer still succeed after 10 s"),
        }
    }
}

/// An engine started on the program's runtime, called from a plain
/// thread while async code uses the same engine.
#[test]
fn with_the_programs_runtime() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let target = Engine::open("tcp://127.0.0.1:0?same_host=off").unwrap();
    let remote = target.buffer(8192).unwrap();
    let engine = Arc::new(
        rt.block_on(ferry::Engine::open("tcp://127.0.0.1:0?same_host=off"))
            .unwrap(),
    );
    let blocking = Engine::with_runtime(Arc::clone(&engine), rt.handle().clone());
    let local = blocking.buffer(8192).unwrap();
    local.memory().fill(5);
    let peer = blocking.open_segment(target.segment_name()).unwrap();
    let remote_addr = remote.addr();
    let local_addr = local.addr();
    let async_side = rt.spawn({
        let engine = Arc::clone(&engine);
        async move {
            use ferry::TransferEngine;
            for _ in 0..100 {
                engine
                    .transfer(
                        peer,
                        TransferRequest::write(local_addr + 4096, remote_addr + 4096, 4096),
                    )
                    .await?;
            }
            Ok::<_, Error>(())
        }
    });
    for _ in 0..100 {
        blocking
            .transfer(peer, TransferRequest::write(local_addr, remote_addr, 4096))
            .unwrap();
    }
    rt.block_on(async_side).unwrap().unwrap();
    assert_eq!(remote.memory().to_vec(), vec![5; 8192]);
}
