//! Runs the Python package's pytest suite (`crates/ferry-py/pytests`) from
//! `cargo test`, on a fresh machine as on a developer's:
//!
//! 1. a virtual environment under the target directory
//!    (`<target>/tmp/ferry-py/venv`), made with `python3 -m venv`, with
//!    maturin, pytest and numpy installed from the package registry (once);
//! 2. `maturin build` of the abi3 wheel (with the `etcd` feature where a
//!    `protoc` that compiles protobuf's well-known types is found) and
//!    `pip install` of that wheel (so the wheel itself is what is tested;
//!    where `FERRY_PY_WHEEL` names a wheel built beforehand, that one:
//!    `.ci/run` passes its `manylinux_2_28` wheel), plus `cargo build -p ferry-cli`
//!    for `ferry serve`, the Rust peer of the interop test. Both use their own
//!    target directory (`<target>/tmp/ferry-py/target`): the outer `cargo
//!    test` holds the lock of the main one;
//! 3. pytest, with the Mooncake test libraries (v0.2.0 and current) and the
//!    `ferry` binary passed in environment variables. The test fails when
//!    pytest fails. mypy (pinned) is installed into the venvs for
//!    `pytests/test_typing.py`, which type-checks the stubs.
//!
//! 4. `mooncake_wheels`: the real Mooncake wheels from the package registry
//!    (`mooncake-transfer-engine==0.3.3`, `mooncake-transfer-engine-non-cuda
//!    ==0.3.13.post1`), each in its own kept venv
//!    (`<target>/tmp/ferry-py/venv-mc033`, `venv-mc0313`) with Ferry's wheel,
//!    run `pytests/test_wheel.py` (`mooncake-py://`). They skip (printed) only
//!    where python3 is missing, the registry is unreachable or the wheel does
//!    not import (libibverbs.so.1 missing); `FERRY_REQUIRE_BACKENDS` listing
//!    `mooncake-py` turns that skip into a failure.
//! 5. `etcd_mode`: `pytests/test_etcd.py` (`ferry.mooncake` in etcd mode
//!    against a real etcd it starts), in the main venv and, with a
//!    Mooncake node beside Ferry's, in the wheels' venvs. Skips (printed)
//!    without etcd or a wheel built without `protoc`; `FERRY_REQUIRE_BACKENDS`
//!    listing `etcd` turns that skip into a failure.
//!
//! Only a machine without `python3` at all skips (printed); a missing
//! `venv` module, a failed install or build is a failure with the reason.
//! `.ci/run` installs python3 and python3-venv where they are missing.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;

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

/// What the build step made: the wheel, and the PATH and cargo it used.
struct Built {
    python: String,
    wheel: PathBuf,
    work: PathBuf,
}

/// Builds the wheel once per test binary (both tests need it; the second
/// waits for the first), or takes the one `FERRY_PY_WHEEL` names.
fn built() -> Option<Built> {
    static BUILT: Mutex<Option<(String, PathBuf)>> = Mutex::new(None);
    let python = find_python()?;
    let work = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("ferry-py");
    let mut slot = BUILT.lock().unwrap_or_else(|p| p.into_inner());
    if slot.is_none() {
        let given = std::env::var_os("FERRY_PY_WHEEL").map(PathBuf::from);
        *slot = Some((python.clone(), build(&python, &work, given)));
    }
    let (python, wheel) = slot.clone()?;
    Some(Built {
        python,
        wheel,
        work,
    })
}

fn pip_install(vpython: &Path, what: &str, args: &[&str]) -> std::process::Output {
    eprintln!("ferry-py pytest: pip install {what}");
    Command::new(vpython)
        .args(["-m", "pip", "install", "--disable-pip-version-check", "-q"])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("cannot run pip: {e}"))
}

fn make_venv(python: &str, venv: &Path) {
    if venv.join("bin/python").exists() {
        return;
    }
    let out = Command::new(python)
        .args(["-m", "venv"])
        .arg(venv)
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

/// The two suites run one after the other, not on two test threads at
/// once: each starts processes with real Mooncake wheels (and the NIXL
/// wheel), which take ports and CPU of their own; side by side on a
/// 2-CPU machine the 0.3.3 wheel once aborted inside `initialize` (SIGABRT
/// in `test_install_in_process`, with the other suite's wheel engines
/// running beside it).
static ONE_SUITE_AT_A_TIME: Mutex<()> = Mutex::new(());

#[test]
fn pytest_suite() {
    let _one = ONE_SUITE_AT_A_TIME
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    let Some(Built {
        python: _,
        wheel,
        work,
    }) = built()
    else {
        // Not silent: the notice bypasses the harness's output capture.
        eprintln!(
            "skipped: ferry-py pytest_suite: python3 not found (install python3 and python3-venv; \
             .ci/run does)"
        );
        return;
    };
    let root = workspace_root();
    let crate_dir = root.join("crates/ferry-py");
    let vpython = work.join("venv/bin/python");
    let target = work.join("target");
    install_wheel(&vpython, &wheel);
    run(
        "building ferry serve (the Rust peer)",
        Command::new(cargo())
            .args(["build", "-p", "ferry-cli", "--manifest-path"])
            .arg(root.join("Cargo.toml"))
            .env("CARGO_TARGET_DIR", &target),
    );

    // The real NIXL library (the pinned wheel, shared with ferry-nixl's
    // tests); without it test_nixl.py skips, or fails when nixl is required.
    let nixl_venv = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("nixl/venv");
    let nixl_lib = match ferry_nixl::test_support::install_pinned_wheel(&nixl_venv) {
        Ok(lib) => Some(lib),
        Err(reason) => {
            eprintln!("ferry-py pytest_suite: no NIXL library for test_nixl.py: {reason}");
            None
        }
    };

    // 3. pytest, from a directory outside the source tree so that the
    // installed wheel (not python/ferry) is imported.
    let ferry_bin = target.join("debug/ferry");
    let mut pytest = Command::new(&vpython);
    if let Some(lib) = &nixl_lib {
        pytest.env("FERRY_TEST_NIXL_LIB", lib);
    }
    let status = pytest
        .args(["-m", "pytest", "-v", "-p", "no:cacheprovider", "-rs"])
        .arg(crate_dir.join("pytests"))
        // Run by `etcd_mode`.
        .arg("--ignore")
        .arg(crate_dir.join("pytests/test_etcd.py"))
        .current_dir(&work)
        .env("FERRY_TEST_MOONCAKE_OLD", library_path(Generation::V0_2_0))
        .env(
            "FERRY_TEST_MOONCAKE_CURRENT",
            library_path(Generation::Current),
        )
        .env("FERRY_TEST_FERRY_BIN", &ferry_bin)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env_remove("PYTHONPATH")
        .env_remove("FERRY_TEST_WHEEL")
        .env_remove("FERRY_URL")
        .env_remove("FERRY_MOONCAKE_SHIM")
        .status()
        .expect("running pytest");
    assert!(
        status.success(),
        "the ferry-py pytest suite failed ({status}); its output is above"
    );
}

fn install_wheel(vpython: &Path, wheel: &Path) {
    run(
        "installing the wheel",
        Command::new(vpython)
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
}

/// Whether `FERRY_REQUIRE_BACKENDS` lists `backend`.
fn required(backend: &str) -> bool {
    std::env::var("FERRY_REQUIRE_BACKENDS")
        .unwrap_or_default()
        .split(',')
        .any(|b| b.trim() == backend)
}

/// Skips (printed) or, when `mooncake-py` is required, fails.
fn unavailable(reason: &str) {
    assert!(
        !required("mooncake-py"),
        "mooncake-py is required (FERRY_REQUIRE_BACKENDS) but {reason}"
    );
    eprintln!("skipped: ferry-py mooncake_wheels: {reason}");
}

/// The real Mooncake wheels from the package registry, each in its own
/// virtual environment (`<target>/tmp/ferry-py/venv-<name>`, kept), with
/// Ferry's wheel: `pytests/test_wheel.py` runs `ferry.mooncake` over them
/// (`mooncake-py://`) and against a plain-wheel process. 0.3.3 lacks the
/// batch calls and imports only with `ASAN_OPTIONS=verify_asan_link_order=0`;
/// 0.3.13.post1 (non-CUDA) has them natively.
#[test]
fn mooncake_wheels() {
    let _one = ONE_SUITE_AT_A_TIME
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    let Some(Built {
        python,
        wheel,
        work,
    }) = built()
    else {
        unavailable("python3 not found (install python3 and python3-venv; .ci/run does)");
        return;
    };
    let crate_dir = workspace_root().join("crates/ferry-py");
    for (name, requirement) in MOONCAKE_WHEELS {
        let vpython = match mooncake_venv(&python, &work, &wheel, name, requirement) {
            Ok(p) => p,
            Err(reason) => return unavailable(&reason),
        };
        install_mypy(&vpython);
        let status = Command::new(&vpython)
            .args(["-m", "pytest", "-v", "-p", "no:cacheprovider", "-rs"])
            .arg(crate_dir.join("pytests/test_wheel.py"))
            // The stubs against the real wheel's module, in its venv.
            .arg(crate_dir.join("pytests/test_typing.py"))
            .current_dir(&work)
            .env("FERRY_TEST_WHEEL", requirement)
            .env("ASAN_OPTIONS", ASAN_OPTIONS)
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .env_remove("PYTHONPATH")
            .env_remove("FERRY_URL")
            .env_remove("FERRY_MOONCAKE_SHIM")
            .env_remove("MC_FORCE_TCP")
            .status()
            .expect("running pytest");
        assert!(
            status.success(),
            "test_wheel.py over {requirement} failed ({status}); its output is above"
        );
    }
}

/// The real Mooncake wheels: the venv's name and the requirement.
const MOONCAKE_WHEELS: [(&str, &str); 2] = [
    ("mc033", "mooncake-transfer-engine==0.3.3"),
    ("mc0313", "mooncake-transfer-engine-non-cuda==0.3.13.post1"),
];

/// The kept venv `<work>/venv-<name>` with `requirement` (installed
/// once) and Ferry's `wheel`: its python, or why it cannot be had (the
/// registry unreachable, the wheel does not import).
fn mooncake_venv(
    python: &str,
    work: &Path,
    wheel: &Path,
    name: &str,
    requirement: &str,
) -> Result<PathBuf, String> {
    let venv = work.join(format!("venv-{name}"));
    make_venv(python, &venv);
    let vpython = venv.join("bin/python");
    let stamp = venv.join(".ferry-wheel-installed");
    if !stamp.exists() {
        let out = pip_install(&vpython, requirement, &[requirement, "pytest>=7"]);
        if !out.status.success() {
            return Err(format!(
                "`pip install {requirement}` failed (registry unreachable?): {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        std::fs::write(&stamp, b"ok\n").expect("writing the venv stamp");
    }
    install_wheel(&vpython, wheel);
    // The wheels link libibverbs.so.1 (Debian: libibverbs1; .ci/run
    // installs it).
    let probe = Command::new(&vpython)
        .args(["-c", "import mooncake.engine"])
        .env("ASAN_OPTIONS", ASAN_OPTIONS)
        .output()
        .expect("running python");
    if !probe.status.success() {
        return Err(format!(
            "{requirement} does not import: {}",
            String::from_utf8_lossy(&probe.stderr).trim()
        ));
    }
    Ok(vpython)
}

/// `pytests/test_etcd.py`: `ferry.mooncake` in etcd mode on `tcp://`
/// against a real etcd the module starts, in the main venv (two Ferry
/// nodes) and in each real Mooncake wheel's venv (a Mooncake node beside
/// Ferry nodes on one etcd). The module skips where etcd is not installed
/// or the wheel lacks the `etcd` feature (built without `protoc`), and
/// fails instead when `FERRY_REQUIRE_BACKENDS` lists `etcd`; without the
/// Mooncake venvs (registry unreachable) the Mooncake part skips, or
/// fails when `etcd` or `mooncake-py` is required.
#[test]
fn etcd_mode() {
    let _one = ONE_SUITE_AT_A_TIME
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    let Some(Built {
        python,
        wheel,
        work,
    }) = built()
    else {
        assert!(
            !required("etcd"),
            "etcd is required (FERRY_REQUIRE_BACKENDS) but python3 was not found"
        );
        eprintln!("skipped: ferry-py etcd_mode: python3 not found");
        return;
    };
    let module = workspace_root().join("crates/ferry-py/pytests/test_etcd.py");
    let pytest = |vpython: &Path, requirement: Option<&str>| {
        let mut cmd = Command::new(vpython);
        cmd.args(["-m", "pytest", "-v", "-p", "no:cacheprovider", "-rs"])
            .arg(&module)
            .current_dir(&work)
            .env("ASAN_OPTIONS", ASAN_OPTIONS)
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .env_remove("PYTHONPATH")
            .env_remove("FERRY_URL")
            .env_remove("FERRY_MOONCAKE_SHIM")
            .env_remove("FERRY_TEST_WHEEL");
        if let Some(r) = requirement {
            // The Ferry-only tests ran in the main venv.
            cmd.args(["-k", "mooncake_wheel"])
                .env("FERRY_TEST_WHEEL", r);
        }
        let status = cmd.status().expect("running pytest");
        assert!(
            status.success(),
            "test_etcd.py ({}) failed ({status}); its output is above",
            requirement.unwrap_or("Ferry nodes")
        );
    };
    let vpython = work.join("venv/bin/python");
    install_wheel(&vpython, &wheel);
    pytest(&vpython, None);
    for (name, requirement) in MOONCAKE_WHEELS {
        match mooncake_venv(&python, &work, &wheel, name, requirement) {
            Ok(vpython) => pytest(&vpython, Some(requirement)),
            Err(reason) => {
                assert!(
                    !required("etcd") && !required("mooncake-py"),
                    "a Mooncake node beside Ferry in etcd is required (FERRY_REQUIRE_BACKENDS) \
                     but {reason}"
                );
                eprintln!("skipped: ferry-py etcd_mode with {requirement}: {reason}");
            }
        }
    }
}

/// What 0.3.3's wheel needs to import (it links an ASan runtime that is
/// not first in the library list); harmless for the others.
const ASAN_OPTIONS: &str = "verify_asan_link_order=0:detect_leaks=0";

/// 1-2 of the module docs: the venv with the tools, the wheel built (or
/// `given`, a wheel built beforehand: `.ci/run` passes its
/// `manylinux_2_28` wheel in `FERRY_PY_WHEEL`).
fn build(python: &str, work: &Path, given: Option<PathBuf>) -> PathBuf {
    let crate_dir = workspace_root().join("crates/ferry-py");
    let venv = work.join("venv");
    let target = work.join("target");
    let dist = work.join("dist");
    let bin = venv.join("bin");
    let vpython = bin.join("python");
    make_venv(python, &venv);
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
    install_mypy(&vpython);

    if let Some(wheel) = given {
        assert!(
            wheel.is_file(),
            "FERRY_PY_WHEEL={} is not a file",
            wheel.display()
        );
        check_abi3(&wheel);
        eprintln!(
            "ferry-py pytest: testing the given wheel {}",
            wheel.display()
        );
        return wheel;
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
    // The `etcd` feature (ferry.mooncake in etcd mode) where its build can
    // run: etcd-client's build script runs `protoc` on protos that import
    // protobuf's well-known types. Without them the wheel lacks etcd and
    // pytests/test_etcd.py skips (fails when FERRY_REQUIRE_BACKENDS lists
    // etcd), so the README's test command needs no protoc.
    let features: &[&str] = match protoc_builds_etcd(&path) {
        Ok(()) => &["--features", "etcd"],
        Err(why) => {
            eprintln!(
                "ferry-py pytest: {why}: building the wheel without the `etcd` feature \
                 (apt-get install protobuf-compiler libprotobuf-dev)"
            );
            &[]
        }
    };
    run(
        "building the abi3 wheel",
        Command::new(bin.join("maturin"))
            .args(["build", "--profile", "dev"])
            .args(features)
            .arg("--interpreter")
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
    check_abi3(&wheels[0]);
    wheels[0].clone()
}

/// Whether etcd-client's build script can run: a `protoc` (`$PROTOC`, or
/// on `path`) that compiles a file importing protobuf's well-known types,
/// as etcd's protos do. Debian's `protobuf-compiler` ships those in
/// `libprotobuf-dev`, only recommended: a `protoc` without them failed the
/// wheel's build here (`google/protobuf/descriptor.proto: File not found`).
fn protoc_builds_etcd(path: &std::ffi::OsStr) -> Result<(), String> {
    let protoc = match std::env::var_os("PROTOC") {
        Some(p) => PathBuf::from(p),
        None => std::env::split_paths(path)
            .map(|d| d.join("protoc"))
            .find(|p| p.is_file())
            .ok_or("protoc not found")?,
    };
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("protoc-probe");
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    std::fs::write(
        dir.join("probe.proto"),
        "syntax = \"proto3\";\nimport \"google/protobuf/descriptor.proto\";\n",
    )
    .map_err(|e| format!("the probe file: {e}"))?;
    let mut cmd = Command::new(&protoc);
    cmd.arg("-I").arg(&dir);
    if let Some(inc) = std::env::var_os("PROTOC_INCLUDE") {
        cmd.arg("-I").arg(inc);
    }
    let out = cmd
        .arg("--descriptor_set_out")
        .arg(dir.join("probe.bin"))
        .arg(dir.join("probe.proto"))
        .output()
        .map_err(|e| format!("{}: {e}", protoc.display()))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{} cannot compile protobuf's well-known types ({}; apt-get install \
             libprotobuf-dev)",
            protoc.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

fn check_abi3(wheel: &Path) {
    let name = wheel.file_name().unwrap_or_default().to_string_lossy();
    assert!(
        name.contains("-cp39-abi3-"),
        "the wheel is not an abi3 wheel for CPython >= 3.9: {name}"
    );
}

/// The type checker of `pytests/test_typing.py`, pinned: its verdicts
/// are what the test compares.
const MYPY: &str = "mypy==2.4.1";

/// mypy for `pytests/test_typing.py` (the stubs type-checked), installed
/// once into `vpython`'s venv; without it that test skips, or fails when
/// `FERRY_REQUIRE_BACKENDS` lists `mypy`.
fn install_mypy(vpython: &Path) {
    let present = Command::new(vpython)
        .args(["-c", "import mypy"])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if present {
        return;
    }
    let out = pip_install(vpython, "mypy", &[MYPY]);
    if !out.status.success() {
        eprintln!(
            "ferry-py pytest: mypy could not be installed (test_typing.py will skip): {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
}
