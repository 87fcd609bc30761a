//! The real NIXL library for the tests: the pinned wheel
//! (`ferry_nixl::test_support::PINNED_WHEEL`), pip-installed into a
//! virtual environment under the target directory, once
//! (`<target>/tmp/nixl/venv`, stamped with the version).
//!
//! Where it cannot be had (no `python3`, or the registry unreachable), the
//! engine factory returns `Error::Unavailable` with the reason, so that the
//! tests skip saying so — unless `FERRY_REQUIRE_BACKENDS` lists `nixl`, when
//! the same error fails them.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use ferry_core::{Error, Result};
use ferry_nixl::test_support::install_pinned_wheel;
use ferry_nixl::{NixlConfig, NixlEngine};

fn venv_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("nixl")
        .join("venv")
}

/// The real `libnixl_capi.so` (installed on first use), or why there is none.
pub fn nixl_library() -> Result<PathBuf> {
    static LIB: OnceLock<std::result::Result<PathBuf, String>> = OnceLock::new();
    LIB.get_or_init(|| install_pinned_wheel(&venv_dir()))
        .clone()
        .map_err(|reason| Error::Unavailable {
            backend: "nixl".to_owned(),
            reason,
        })
}

/// A test configuration on the real library.
pub fn config() -> Result<NixlConfig> {
    NixlConfig::builder().library(nixl_library()?).build()
}

/// `NixlEngine::start` on `cfg`.
pub async fn start(cfg: NixlConfig) -> Result<NixlEngine> {
    // SAFETY: the library is NIXL's own libnixl_capi.so from the pinned
    // wheel (or one named by the test, which must be NIXL's).
    unsafe { NixlEngine::start(cfg) }.await
}

/// An engine on the real library.
pub async fn engine() -> Result<Arc<NixlEngine>> {
    Ok(Arc::new(start(config()?).await?))
}

/// A loopback address nothing listens on (bound, then released).
pub fn unused_port() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr");
    drop(l);
    addr.to_string()
}

/// The test virtual environment.
pub fn venv() -> &'static Path {
    static V: OnceLock<PathBuf> = OnceLock::new();
    V.get_or_init(venv_dir)
}
