//! Runs the Python package's pytest suite (`crates/ferry-py/pytests`) from
//! `cargo test`, on a fresh machine as on a developer's:
//!
//! 1. a virtual environment under the target directory
//!    (`<target>/tmp/ferry-py/venv`), made with `python3 -m venv`, with
//!    maturin, pytest and numpy installed from the package registry (once);
//! 2. `maturin build` of the abi3 wheel and `pip install` of that wheel (so
//!    the wheel itself is what is tested), plus `cargo build -p ferry-cli`
//!    for `ferry serve`, the Rust peer of the interop test. Both use their own
//!    target directory (`<target>/tmp/ferry-py/target`): the outer `cargo
//!    test` holds the lock of the main one;
//! 3. pytest, with the Mooncake test libraries (v0.2.0 and current) and the
//!    `ferry` binary passed in environment variables. The test fails when
//!    pytest fails.
//!
//! Only a machine without `python3` at all skips (printed); a missing
//! `venv` module, a failed install or build is a failure with the reason.
//! `.ci/run` installs python3 and python3-venv where they are missing.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use mooncake_testlibs::{library_path, Generation};

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .expect("crates/ferry-py sits two levels below the workspace root")
        .to_path_buf()
}

/// `python3` (or `$FERRY_PYTHON`) if it can be run.
fn find_python() -> Option<String> {
    let candidate = std::env::var("FERRY_PYTHON").unwrap_or_else(|_| "python3".to_owned());
    let ok = Command::new(&candidate)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    ok.then_some(candidate)
}

/// Runs `cmd`, panicking with `what`, the command line and its output if it
/// cannot start or fails. Output goes to the test's stdout/stderr.
fn run(what: &str, cmd: &mut Command) {
    let line = format!("{cmd:?}");
    eprintln!("ferry-py pytest: {what}: {line}");
    let status = cmd
        .status()
        .unwrap_or_else(|e| panic!("{what}: cannot run {line}: {e}"));
    assert!(status.success(), "{what} failed ({status}): {line}");
}

/// Like `run` but returns whether it succeeded (for optional steps).
fn try_run(what: &str, cmd: &mut Command) -> bool {
    eprintln!("ferry-py pytest: {what}: {cmd:?}");
    cmd.status().map(|s| s.success()).unwrap_or(false)
}

fn cargo() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| env!("CARGO").to_owned())
}

#[test]
fn pytest_suite() {
    let Some(python) = find_python() else {
        // Not silent: the notice bypasses the harness's output capture.
        eprintln!(
            "skipped: ferry-py pytest_suite: python3 not found (install python3 and python3-venv; \
             .ci/run does)"
        );
        return;
    };
    let root = workspace_root();
    let crate_dir = root.join("crates/ferry-py");
    let work = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("ferry-py");
    let venv = work.join("venv");
    let target = work.join("target");
    let dist = work.join("dist");
    let bin = venv.join("bin");
    let vpython = bin.join("python");

    // 1. The virtual environment and the tools.
    if !vpython.exists() {
        let out = Command::new(&python)
            .args(["-m", "venv"])
            .arg(&venv)
            .output()
            .unwrap_or_else(|e| panic!("cannot run {python} -m venv: {e}"));
        assert!(
            out.status.success(),
            "`{python} -m venv {}` failed: the venv module is missing or broken \
             (on Debian/Ubuntu: apt-get install python3-venv):\n{}",
            venv.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let stamp = venv.join(".ferry-tools-installed");
    if !stamp.exists() {
        run(
            "installing maturin and pytest from the package registry",
            Command::new(&vpython).args([
                "-m",
                "pip",
                "install",
                "--disable-pip-version-check",
                "-q",
                "maturin>=1.5,<2",
                "pytest>=7",
            ]),
        );
        // numpy widens the memory-object tests (__array_interface__, a
        // registered array kept alive); they skip without it.
        if !try_run(
            "installing numpy (optional)",
            Command::new(&vpython).args([
                "-m",
                "pip",
                "install",
                "--disable-pip-version-check",
                "-q",
                "numpy",
            ]),
        ) {
            eprintln!("ferry-py pytest: numpy could not be installed; its tests will skip");
        }
        std::fs::write(&stamp, b"ok\n").expect("writing the venv stamp");
    }

    // 2. The wheel, installed, and the Rust peer.
    let cargo = cargo();
    let cargo_dir = Path::new(&cargo)
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default();
    let path = std::env::join_paths([bin.clone(), cargo_dir].into_iter().chain(
        std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()),
    ))
    .expect("PATH");
    let _ = std::fs::remove_dir_all(&dist);
    run(
        "building the abi3 wheel",
        Command::new(bin.join("maturin"))
            .args(["build", "--profile", "dev", "--interpreter"])
            .arg(&vpython)
            .arg("-m")
            .arg(crate_dir.join("Cargo.toml"))
            .arg("-o")
            .arg(&dist)
            .env("CARGO_TARGET_DIR", &target)
            .env("CARGO", &cargo)
            .env("PATH", &path),
    );
    let wheels: Vec<PathBuf> = std::fs::read_dir(&dist)
        .expect("maturin's output directory")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "whl"))
        .collect();
    assert_eq!(
        wheels.len(),
        1,
        "expected one wheel in {}: {wheels:?}",
        dist.display()
    );
    let wheel = &wheels[0];
    let name = wheel.file_name().unwrap_or_default().to_string_lossy();
    assert!(
        name.contains("-cp39-abi3-"),
        "the wheel is not an abi3 wheel for CPython >= 3.9: {name}"
    );
    run(
        "installing the wheel",
        Command::new(&vpython)
            .args([
                "-m",
                "pip",
                "install",
                "--disable-pip-version-check",
                "-q",
                "--force-reinstall",
                "--no-deps",
            ])
            .arg(wheel),
    );
    run(
        "building ferry serve (the Rust peer)",
        Command::new(&cargo)
            .args(["build", "-p", "ferry-cli", "--manifest-path"])
            .arg(root.join("Cargo.toml"))
            .env("CARGO_TARGET_DIR", &target),
    );

    // 3. pytest, from a directory outside the source tree so that the
    // installed wheel (not python/ferry) is imported.
    let ferry_bin = target.join("debug/ferry");
    let status = Command::new(&vpython)
        .args(["-m", "pytest", "-v", "-p", "no:cacheprovider", "-rs"])
        .arg(crate_dir.join("pytests"))
        .current_dir(&work)
        .env("FERRY_TEST_MOONCAKE_OLD", library_path(Generation::V0_2_0))
        .env(
            "FERRY_TEST_MOONCAKE_CURRENT",
            library_path(Generation::Current),
        )
        .env("FERRY_TEST_FERRY_BIN", &ferry_bin)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env_remove("PYTHONPATH")
        .status()
        .expect("running pytest");
    assert!(
        status.success(),
        "the ferry-py pytest suite failed ({status}); its output is above"
    );
}
