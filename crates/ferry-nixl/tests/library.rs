//! Loading: the real library is found and dated; an absent or foreign one
//! makes the backend `Unavailable`, naming what was tried.

mod common;

use std::path::Path;

use ferry_core::conformance::skip_unavailable;
use ferry_core::{Error, TransferEngine};
use ferry_nixl::{Generation, LibrarySource, NixlConfig, NixlLibrary};

#[test]
fn an_absent_library_is_unavailable_naming_the_path() {
    let cfg = NixlConfig::builder()
        .library("/nonexistent/libnixl_capi.so")
        .build()
        .unwrap();
    // SAFETY: the path does not exist; nothing is loaded.
    match unsafe { NixlLibrary::resolve(&cfg) } {
        Err(Error::Unavailable { backend, reason }) => {
            assert_eq!(backend, "nixl");
            assert!(reason.contains("/nonexistent/libnixl_capi.so"), "{reason}");
            assert!(reason.contains("lib="), "{reason}");
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
}

#[test]
fn a_library_that_is_not_nixl_is_refused_before_any_call() {
    // The C library: loadable, exports none of NIXL's symbols.
    // SAFETY: libc is already loaded in this process; only symbols are
    // looked up.
    match unsafe { NixlLibrary::load(Path::new("libc.so.6")) } {
        Err(Error::Unavailable { reason, .. }) => {
            assert!(reason.contains("not NIXL's C API"), "{reason}")
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
}

#[test]
fn the_real_library_is_loaded_and_dated() {
    let path = match common::nixl_library() {
        Ok(p) => p,
        Err(e) => {
            skip_unavailable("the_real_library_is_loaded_and_dated", &e);
            return;
        }
    };
    // SAFETY: NIXL's own libnixl_capi.so from the pinned wheel.
    let lib = unsafe { NixlLibrary::load(&path) }.expect("loading the wheel's library");
    assert_eq!(lib.generation(), Generation::V1_5, "nixl-cu12 1.5.1");
    assert_eq!(lib.source(), &LibrarySource::Config);
    assert!(lib
        .optional_symbols()
        .contains(&"nixl_capi_opt_args_set_custom_param"));
    // The wheel is found as the active Python's when VIRTUAL_ENV names it.
    assert_eq!(
        ferry_nixl::wheel_library_in(common::venv()).as_deref(),
        Some(path.as_path())
    );
}

#[test]
fn an_unknown_plugin_is_unavailable_naming_what_exists() {
    let mut cfg = match common::config() {
        Ok(c) => c,
        Err(e) => {
            skip_unavailable("an_unknown_plugin_is_unavailable_naming_what_exists", &e);
            return;
        }
    };
    cfg.backends = vec!["NO_SUCH_PLUGIN".into()];
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    match rt.block_on(common::start(cfg)) {
        Err(Error::Unavailable { reason, .. }) => {
            assert!(reason.contains("NO_SUCH_PLUGIN"), "{reason}");
            assert!(
                reason.contains("UCX"),
                "names the plugins that exist: {reason}"
            );
        }
        Ok(e) => panic!(
            "started with a plugin that does not exist: {}",
            e.segment_name()
        ),
        Err(other) => panic!("expected Unavailable, got {other}"),
    }
}

#[test]
fn capability_report_names_the_library_and_every_operation_native() {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let e = match common::engine().await {
            Ok(e) => e,
            Err(err) => {
                skip_unavailable("capability_report_names_the_library", &err);
                return;
            }
        };
        let info = e.backend_info();
        assert_eq!(info.backend, "nixl");
        let lib = info
            .details
            .iter()
            .find(|(k, _)| k == "library")
            .map(|(_, v)| v.clone())
            .unwrap_or_default();
        assert!(lib.ends_with("libnixl_capi.so"), "{lib}");
        let caps = e.capabilities();
        for op in ferry_core::Operation::OPTIONAL {
            assert!(caps.supports(op), "{op} should be native");
        }
        assert!(info.not_native.is_empty());
    });
}
