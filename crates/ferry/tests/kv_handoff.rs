//! Runs the `kv_handoff` example end to end (the example's own checks fail
//! the test if any byte is wrong or the notification does not arrive).

#[allow(dead_code)]
#[path = "../examples/kv_handoff.rs"]
mod example;

#[cfg(feature = "tcp")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_handoff_example_runs_over_tcp() {
    let s = example::run("tcp://127.0.0.1:0").await.expect("hand-off");
    assert_eq!(
        s.requests,
        example::LAYERS * example::allocate_blocks().len()
    );
    assert_eq!(s.notification.name, "prefill-0");
    assert!(s.notification.message.starts_with("req-42 kv-ready"));
    // Strict mode must work too when the TCP backend is fully native.
    let strict = example::run("tcp://127.0.0.1:0?strict=1").await;
    match strict {
        Ok(s) => assert!(
            s.support.iter().all(|(_, k)| *k == "native"),
            "{:?}",
            s.support
        ),
        Err(e) => panic!("strict run failed: {e}"),
    }
}

/// The same hand-off over a Mooncake test library (current generation, with
/// native notifications): only the URL changes.
#[cfg(feature = "mooncake")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_handoff_example_runs_over_mooncake() {
    use mooncake_testlibs::{library_path, Generation};
    let url = format!(
        "mooncake://?lib={}&metadata=P2PHANDSHAKE&protocol=tcp&host=127.0.0.1",
        library_path(Generation::Current).display()
    );
    let s = example::run(&url).await.expect("hand-off over mooncake");
    assert_eq!(
        s.requests,
        example::LAYERS * example::allocate_blocks().len()
    );
    assert_eq!(s.notification.name, "prefill-0");
}
