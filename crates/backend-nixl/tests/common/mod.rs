//! The real NIXL library for the tests: the pinned `nixl-cu12` wheel from
//! the package registry, pip-installed (`--no-deps`: it imports and runs
//! without torch and without a GPU) into a virtual environment under the
//! target directory, once (`<target>/tmp/nixl/venv`, stamped with the
//! version).
//!
//! Where it cannot be had (no `python3`, or the registry unreachable), the
//! engine factory returns `Error::Unavailable` with the reason, so that the
//! tests skip saying so — unless `FERRY_REQUIRE_BACKENDS` lists `nixl`, when
//! the same error fails them.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, OnceLock};

use backend_nixl::{wheel_library_in, NixlConfig, NixlEngine};
use transport_core::{Error, Result};

/// The wheel the tests install, and the NIXL release it is.
pub const NIXL_WHEEL: &str = "nixl-cu12==1.5.1";

fn venv_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("nixl")
        .join("venv")
}

fn unavailable(reason: String) -> Error {
    Error::Unavailable {
        backend: "nixl".to_owned(),
        reason,
    }
}

/// pip output that means the registry could not be reached.
fn registry_unreachable(out: &str) -> bool {
    [
        "NewConnectionError",
        "Network is unreachable",
        "Temporary failure in name resolution",
        "Name or service not known",
        "ConnectTimeoutError",
        "ReadTimeoutError",
        "Connection refused",
        "No matching distribution found",
        "Could not fetch URL",
    ]
    .iter()
    .any(|m| out.contains(m))
}

fn install() -> std::result::Result<PathBuf, String> {
    let venv = venv_dir();
    let stamp = venv.join(".ferry-nixl-installed");
    if std::fs::read_to_string(&stamp).is_ok_and(|s| s.trim() == NIXL_WHEEL) {
        if let Some(lib) = wheel_library_in(&venv) {
            return Ok(lib);
        }
    }
    let python = std::env::var("FERRY_PYTHON").unwrap_or_else(|_| "python3".to_owned());
    if !venv.join("bin/python").exists() {
        let out = Command::new(&python)
            .args(["-m", "venv"])
            .arg(&venv)
            .output()
            .map_err(|e| format!("{python} cannot be run ({e}); install python3 with venv"))?;
        assert!(
            out.status.success(),
            "`{python} -m venv {}` failed (on Debian: apt-get install python3-venv):\n{}",
            venv.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    eprintln!(
        "backend-nixl tests: pip install --no-deps {NIXL_WHEEL} into {}",
        venv.display()
    );
    let out = Command::new(venv.join("bin/python"))
        .args([
            "-m",
            "pip",
            "install",
            "--disable-pip-version-check",
            "-q",
            "--no-deps",
            NIXL_WHEEL,
        ])
        .output()
        .map_err(|e| format!("cannot run pip: {e}"))?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if !out.status.success() {
        if registry_unreachable(&text) {
            return Err(format!(
                "the package registry is unreachable; pip install {NIXL_WHEEL} failed:\n{text}"
            ));
        }
        panic!("pip install --no-deps {NIXL_WHEEL} failed:\n{text}");
    }
    let lib = wheel_library_in(&venv).unwrap_or_else(|| {
        panic!(
            "{NIXL_WHEEL} installed into {} but libnixl_capi.so is not where the backend looks",
            venv.display()
        )
    });
    std::fs::write(&stamp, NIXL_WHEEL).expect("writing the venv stamp");
    Ok(lib)
}

/// The real `libnixl_capi.so` (installed on first use), or why there is none.
pub fn nixl_library() -> Result<PathBuf> {
    static LIB: OnceLock<std::result::Result<PathBuf, String>> = OnceLock::new();
    LIB.get_or_init(install).clone().map_err(unavailable)
}

/// A test configuration on the real library.
pub fn config() -> Result<NixlConfig> {
    Ok(NixlConfig {
        library: Some(nixl_library()?),
        ..NixlConfig::default()
    })
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

/// The venv's site-packages (for tests that point at files in the wheel).
pub fn venv() -> &'static Path {
    static V: OnceLock<PathBuf> = OnceLock::new();
    V.get_or_init(venv_dir)
}
