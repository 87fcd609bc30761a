//! For the tests of this crate and of the crates that use it (not part of
//! the API): the pinned NIXL wheel, installed from the package registry.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::library::wheel_library_in;

/// The wheel the tests install, and so the NIXL release they run.
pub const PINNED_WHEEL: &str = "nixl-cu12==1.5.1";

/// Whether pip's output says the registry could not be reached.
pub fn registry_unreachable(out: &str) -> bool {
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

/// Installs [`PINNED_WHEEL`] (`pip install --no-deps`: it imports and runs
/// without torch and without a GPU) into a virtual environment at `venv`
/// (made with `python3 -m venv`, or `$FERRY_PYTHON`) unless a stamp there
/// says it is installed, and returns its `libnixl_capi.so`. `Err(reason)`
/// when it cannot be had here: no `python3`, or the registry unreachable.
///
/// # Panics
///
/// When pip fails for any other reason, or the environment cannot be made.
pub fn install_pinned_wheel(venv: &Path) -> Result<PathBuf, String> {
    let stamp = venv.join(".ferry-nixl-installed");
    if std::fs::read_to_string(&stamp).is_ok_and(|s| s.trim() == PINNED_WHEEL) {
        if let Some(lib) = wheel_library_in(venv) {
            return Ok(lib);
        }
    }
    let python = std::env::var("FERRY_PYTHON").unwrap_or_else(|_| "python3".to_owned());
    if !venv.join("bin/python").exists() {
        let out = Command::new(&python)
            .args(["-m", "venv"])
            .arg(venv)
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
        "ferry-nixl tests: pip install --no-deps {PINNED_WHEEL} into {}",
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
            PINNED_WHEEL,
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
                "the package registry is unreachable; pip install {PINNED_WHEEL} failed:\n{text}"
            ));
        }
        panic!("pip install --no-deps {PINNED_WHEEL} failed:\n{text}");
    }
    let lib = wheel_library_in(venv).unwrap_or_else(|| {
        panic!(
            "{PINNED_WHEEL} installed into {} but libnixl_capi.so is not where the backend looks",
            venv.display()
        )
    });
    std::fs::write(&stamp, PINNED_WHEEL).expect("writing the venv stamp");
    Ok(lib)
}
