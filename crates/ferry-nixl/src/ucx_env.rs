//! A guard against a crash at process exit of the `nixl-cu12` wheel's UCX.
//!
//! The wheel bundles its own `libibverbs` and `libnl-3`/`libnl-route-3`
//! (renamed, e.g. `libnl-route-3-3ad497a3.so.200.26.0`), but its EFA
//! transport module `ucx/libuct_ib_efa.so` also links the system's
//! `libefa.so.1`, which pulls in the system's `libibverbs.so.1` and
//! `libnl-route-3.so.200`. On a host with rdma-core installed (Debian's
//! `libibverbs1`, which every RDMA host and the real Mooncake wheels need),
//! UCX loads that module when the UCX plugin starts, so two copies of
//! libnl-route live in the process, and the process takes SIGSEGV in
//! `rtnl_tc_unregister` (libnl-route's destructor) when it exits, after
//! `main` returned: the exit status of every program using the backend, and
//! of a Python interpreter using the wheel, becomes "killed by signal 11".
//! Measured with nixl-cu12 1.5.1 on Debian 12 with `libibverbs1` 44.0.
//!
//! The EFA module drives only AWS Elastic Fabric Adapters. Where the host
//! has none, Ferry keeps UCX from loading it (`UCX_MODULES=^efa`, read by
//! UCX when its plugin loads) — unless `UCX_MODULES` is already set, which
//! is the operator's choice and is never changed. Where an EFA device
//! exists nothing is changed (the module is needed there).

use std::path::Path;
use std::sync::OnceLock;

/// The environment variable UCX reads its module allow-list from.
pub(crate) const UCX_MODULES: &str = "UCX_MODULES";

/// The value Ferry sets where the host has no EFA device.
pub(crate) const WITHOUT_EFA: &str = "^efa";

/// What was decided, for the engine's report.
static DECISION: OnceLock<String> = OnceLock::new();

/// Whether this host has an EFA device or driver (`/sys/module/efa`, or an
/// RDMA device whose driver is `efa`).
pub(crate) fn host_has_efa(sys: &Path) -> bool {
    if sys.join("module/efa").exists() {
        return true;
    }
    let Ok(devs) = std::fs::read_dir(sys.join("class/infiniband")) else {
        return false;
    };
    devs.flatten().any(|d| {
        std::fs::read_link(d.path().join("device/driver"))
            .ok()
            .and_then(|p| p.file_name().map(|n| n == "efa"))
            .unwrap_or(false)
    })
}

/// The value to set, if any: `None` when the operator set `UCX_MODULES`
/// (`current`) or the host has an EFA device.
pub(crate) fn modules_to_set(
    current: Option<&std::ffi::OsStr>,
    has_efa: bool,
) -> Option<&'static str> {
    match current {
        Some(_) => None,
        None if has_efa => None,
        None => Some(WITHOUT_EFA),
    }
}

/// Applies the guard once per process, before the first NIXL library is
/// loaded; returns what was decided (also in the engine's report).
///
/// # Safety
///
/// May set an environment variable: no other thread may read or write the
/// process environment through libc (`getenv`, `setenv`) at that moment.
/// Rust code that uses `std::env` is safe (std takes its own lock); the
/// caller is loading native code, the one place this crate is allowed to
/// run its initialisation.
pub(crate) unsafe fn apply() -> &'static str {
    DECISION.get_or_init(|| {
        let current = std::env::var_os(UCX_MODULES);
        let has_efa = host_has_efa(Path::new("/sys"));
        match modules_to_set(current.as_deref(), has_efa) {
            Some(v) => {
                // See the function's safety contract.
                std::env::set_var(UCX_MODULES, v);
                tracing::info!(
                    "ferry: set {UCX_MODULES}={v}: this host has no EFA device, and UCX's EFA \
                     module of the nixl wheel crashes the process at exit where rdma-core is \
                     installed"
                );
                format!(
                    "{UCX_MODULES}={v} set by Ferry (no EFA device here; UCX's EFA module of \
                     the nixl wheel crashes processes at exit beside rdma-core)"
                )
            }
            None => match current {
                Some(v) => format!(
                    "{UCX_MODULES}={} (the operator's; unchanged)",
                    v.to_string_lossy()
                ),
                None => format!("{UCX_MODULES} unset (an EFA device is present)"),
            },
        }
    })
}

/// What [`apply`] decided, if it ran.
pub(crate) fn decision() -> Option<&'static str> {
    DECISION.get().map(String::as_str)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::OsStr;

    #[test]
    fn the_operators_value_is_never_changed() {
        assert_eq!(modules_to_set(Some(OsStr::new("all")), false), None);
        assert_eq!(modules_to_set(Some(OsStr::new("")), true), None);
    }

    #[test]
    fn efa_is_excluded_only_without_an_efa_device() {
        assert_eq!(modules_to_set(None, false), Some(WITHOUT_EFA));
        assert_eq!(modules_to_set(None, true), None);
    }

    #[test]
    fn efa_devices_are_found_by_module_or_driver() {
        let d = tempdir();
        assert!(!host_has_efa(&d));
        // A device whose driver is efa.
        let dev = d.join("class/infiniband/rdmap0s6/device");
        std::fs::create_dir_all(&dev).unwrap();
        std::os::unix::fs::symlink("/nonexistent/bus/pci/drivers/efa", dev.join("driver")).unwrap();
        assert!(host_has_efa(&d));
        // Another driver is not EFA.
        let d2 = tempdir();
        let dev2 = d2.join("class/infiniband/rxe0/device");
        std::fs::create_dir_all(&dev2).unwrap();
        std::os::unix::fs::symlink("/nonexistent/drivers/rdma_rxe", dev2.join("driver")).unwrap();
        assert!(!host_has_efa(&d2));
        std::fs::create_dir_all(d2.join("module/efa")).unwrap();
        assert!(host_has_efa(&d2));
        let _ = std::fs::remove_dir_all(&d);
        let _ = std::fs::remove_dir_all(&d2);
    }

    fn tempdir() -> std::path::PathBuf {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static N: AtomicUsize = AtomicUsize::new(0);
        let p = std::env::temp_dir().join(format!(
            "ferry-nixl-efa-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        p
    }
}
