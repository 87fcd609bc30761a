//! Registering memory. Registration changes two tables, the library's and
//! Ferry's `RegionTable`, with `await`s in between, so `register`,
//! `batch_register` and `batch_unregister` run to completion in a task of
//! their own: a caller that drops the future does not leave a region in one
//! table and not the other, or a batch half registered.

use std::ffi::{c_void, CString};
use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use ferry_core::{Error, MemoryRegion, RegionInfo, Result};

use super::{blocking, cstring, Inner, MooncakeEngine};
use crate::codes::{call_error, MooncakeErrorCode};
use crate::library::CBufferEntry;

/// Counts a registration in flight (see
/// [`MooncakeEngine::registrations_in_flight`]) until dropped.
struct InFlight(Arc<Inner>);

impl InFlight {
    fn new(inner: &Arc<Inner>) -> InFlight {
        inner.registering.fetch_add(1, Ordering::AcqRel);
        InFlight(Arc::clone(inner))
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.registering.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Runs `f` in a task of its own and waits for it: dropping the returned
/// future leaves `f` running to its end. If the task does not finish (it
/// panicked, or the runtime is shutting down), `lost` says what that means.
async fn run_to_end<T: Send + 'static>(
    inner: &Arc<Inner>,
    f: impl Future<Output = Result<T>> + Send + 'static,
    lost: impl FnOnce(String) -> Error,
) -> Result<T> {
    let counted = InFlight::new(inner);
    tokio::spawn(async move {
        let _counted = counted;
        f.await
    })
    .await
    .map_err(|e| lost(format!("a Mooncake registration task did not finish: {e}")))?
}

/// `run_to_end` of an unregister: a task that did not finish left its
/// regions registered (`Canceled`, which `RegisteredBuffer` leaks on).
async fn to_completion<T: Send + 'static>(
    inner: &Arc<Inner>,
    f: impl Future<Output = Result<T>> + Send + 'static,
) -> Result<T> {
    run_to_end(inner, f, Error::Canceled).await
}

/// `run_to_end` of a register whose first region starts at `addr`: a task
/// that did not finish may have left it registered (`RegionHeld`).
async fn register_to_completion(
    inner: &Arc<Inner>,
    addr: u64,
    f: impl Future<Output = Result<()>> + Send + 'static,
) -> Result<()> {
    run_to_end(inner, f, |why| held_after_failed_register(addr, &why)).await
}

/// A failed register that may have left the region at `addr` in the
/// library: it stays in Ferry's table too, so that a later `unregister`
/// asks the library again, and `RegisteredBuffer` leaks its memory.
fn held_after_failed_register(addr: u64, why: &str) -> Error {
    Error::RegionHeld {
        addr,
        reason: format!(
            "the registration failed ({why}) and may have stayed in the Mooncake library; \
             it stays in Ferry's table: unregister it (to retry the library's unregister) \
             before freeing the memory"
        ),
    }
}

/// Asks the library to let go of `addr` alone: whether it surely does not
/// hold it any more (`unregisterLocalMemory` answered 0, or
/// `ERR_ADDRESS_NOT_REGISTERED`).
async fn released_alone(inner: &Arc<Inner>, addr: u64) -> bool {
    let this = Arc::clone(inner);
    let one = blocking(move || {
        // SAFETY: live engine; no transfer uses the region (it is being
        // registered or unregistered under the registry lock).
        unsafe { (this.lib.api.unregister)(this.raw(), addr as usize as *mut c_void) }
    })
    .await;
    let released = match one {
        Ok(0) => true,
        Ok(rc) => {
            MooncakeErrorCode::from_raw(i64::from(rc))
                == Some(MooncakeErrorCode::AddressNotRegistered)
        }
        Err(_) => false,
    };
    if !released {
        tracing::warn!(
            addr,
            answer = ?one,
            "ferry: mooncake kept a region it was asked to let go of; it stays registered"
        );
    }
    released
}

fn check_host(region: &MemoryRegion) -> Result<()> {
    if region.location().is_host() {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "the mooncake backend registers host memory only; {} is not (the C API does not \
             say whether the library was built with CUDA)",
            region.location()
        )))
    }
}

impl MooncakeEngine {
    /// `register`: the region goes into the `RegionTable` and the library,
    /// or into neither.
    pub(super) async fn register_one(&self, region: MemoryRegion) -> Result<()> {
        check_host(&region)?;
        let loc = cstring("location", region.location().as_str())?;
        let inner = Arc::clone(&self.inner);
        let at = region.addr();
        register_to_completion(&self.inner, at, async move {
            let _registering = inner.registry.read().await;
            let (addr, len) = (region.addr(), region.len());
            inner.regions.insert(region)?;
            let this = Arc::clone(&inner);
            let rc = blocking(move || {
                // SAFETY: live engine; the caller promised (MemoryRegion) that
                // the range is valid while registered; `loc` outlives the call.
                unsafe {
                    (this.lib.api.register)(
                        this.raw(),
                        addr as usize as *mut c_void,
                        len as usize,
                        loc.as_ptr(),
                        1,
                    )
                }
            })
            .await;
            match rc {
                Ok(0) => Ok(()),
                Ok(rc) => {
                    // The library refused it: it registered nothing.
                    inner.regions.remove(addr).await?;
                    Err(call_error("registerLocalMemory", i64::from(rc)))
                }
                Err(e) => {
                    // The call did not run to an answer: the library may
                    // have registered it. Out of the table only once the
                    // library surely does not have it.
                    if released_alone(&inner, addr).await {
                        inner.regions.remove(addr).await?;
                        Err(e)
                    } else {
                        Err(held_after_failed_register(addr, &e.to_string()))
                    }
                }
            }
        })
        .await
    }

    /// `unregister`: waits for the transfers using the region, then takes
    /// it out of the library and only then out of the `RegionTable`.
    /// Dropped while waiting, the region stays registered. From the moment
    /// no transfer uses it, the rest runs to its end on a task of its own;
    /// meanwhile the region still occupies its range in the table, so a
    /// register of the same memory is `RegionOverlap` until the library has
    /// let go of it (before, the table forgot it first, and such a register
    /// reached the library while it still held the range:
    /// `ERR_ADDRESS_OVERLAPPED`). If the library refuses, the region stays
    /// registered in both.
    pub(super) async fn unregister_one(&self, addr: u64) -> Result<()> {
        // Registrations under way end first.
        drop(self.inner.registry.write().await);
        let removal = self.inner.regions.remove_in_steps(addr).await?;
        let inner = Arc::clone(&self.inner);
        to_completion(&self.inner, async move {
            let this = Arc::clone(&inner);
            let rc = blocking(move || {
                // SAFETY: live engine; no transfer uses the region any more.
                unsafe { (this.lib.api.unregister)(this.raw(), addr as usize as *mut c_void) }
            })
            .await?;
            if rc != 0 {
                // `removal` dropped unfinished: still registered in both.
                return Err(call_error("unregisterLocalMemory", i64::from(rc)));
            }
            removal.finish();
            Ok(())
        })
        .await
    }

    /// `batch_register`: every region or none, in both tables.
    pub(super) async fn register_all(&self, regions: Vec<MemoryRegion>) -> Result<()> {
        let fail = |index: usize, source: Error| Error::BatchRegisterFailed {
            index,
            addr: regions[index].addr(),
            source: Box::new(source),
        };
        for (i, r) in regions.iter().enumerate() {
            if let Err(e) = check_host(r) {
                return Err(fail(i, e));
            }
        }
        let inner = Arc::clone(&self.inner);
        let at = regions.first().map(|r| r.addr()).unwrap_or(0);
        register_to_completion(&self.inner, at, register_batch(inner, regions)).await
    }

    /// `batch_unregister`: waits for the transfers using each region, then
    /// takes them out of the library and only then out of the
    /// `RegionTable`, like `unregister`; the first error.
    ///
    /// A failed `unregisterLocalMemoryBatch` returns one code for the whole
    /// list and does not say which addresses it released (the real TCP
    /// transport releases every address it can and returns its first
    /// error). Each region is then asked for alone: `unregisterLocalMemory`
    /// answering 0 released it now, `ERR_ADDRESS_NOT_REGISTERED` means the
    /// batch call did (Ferry registered it, installs one transport, and no
    /// other call can take it out meanwhile: the region still occupies its
    /// range in the table); both leave the table. Any other answer keeps
    /// the region registered in both tables (usable; a later `unregister`
    /// asks the library again). The error is the library's
    /// ([`Error::Backend`] naming `unregisterLocalMemoryBatch` and the
    /// code), or the first table error (`RegionNotRegistered`,
    /// `RegionHeld`) of an address that came before.
    pub(super) async fn unregister_all(&self, addrs: &[u64]) -> Result<()> {
        let inner = Arc::clone(&self.inner);
        let addrs = addrs.to_vec();
        to_completion(&self.inner, async move {
            // Registrations under way end first.
            drop(inner.registry.write().await);
            let mut first = None;
            // Idle, closed to new transfers, still occupying their ranges:
            // a `Removal` dropped unfinished reopens its region.
            let mut removals = Vec::new();
            for &a in &addrs {
                match inner.regions.remove_in_steps(a).await {
                    Ok(r) => removals.push((a, r)),
                    Err(e) => {
                        first.get_or_insert(e);
                    }
                }
            }
            if removals.is_empty() {
                return first.map_or(Ok(()), Err);
            }
            let this = Arc::clone(&inner);
            let batch: Vec<u64> = removals.iter().map(|(a, _)| *a).collect();
            // `?`: the call did not run to an answer; every region stays
            // registered (its removal dropped unfinished).
            let rc = blocking(move || {
                let mut ptrs: Vec<*mut c_void> =
                    batch.iter().map(|&a| a as usize as *mut c_void).collect();
                // SAFETY: live engine; regions no transfer uses any more.
                unsafe {
                    (this.lib.api.unregister_batch)(this.raw(), ptrs.as_mut_ptr(), ptrs.len())
                }
            })
            .await?;
            if rc == 0 {
                for (_, removal) in removals {
                    removal.finish();
                }
                return first.map_or(Ok(()), Err);
            }
            first.get_or_insert(call_error("unregisterLocalMemoryBatch", i64::from(rc)));
            for (a, removal) in removals {
                if released_alone(&inner, a).await {
                    removal.finish();
                }
                // Otherwise `removal` dropped unfinished: registered in both.
            }
            first.map_or(Ok(()), Err)
        })
        .await
    }
}

/// Unregisters `addrs` from the library (the undo of a failed batch
/// register); the addresses it may still hold.
async fn undo_in_library(inner: &Arc<Inner>, addrs: Vec<u64>) -> Vec<u64> {
    let this = Arc::clone(inner);
    let batch = addrs.clone();
    let rc = blocking(move || {
        let mut ptrs: Vec<*mut c_void> = batch.iter().map(|&a| a as usize as *mut c_void).collect();
        // SAFETY: live engine; addresses of regions this call registered
        // (unknown ones are reported, not touched).
        unsafe { (this.lib.api.unregister_batch)(this.raw(), ptrs.as_mut_ptr(), ptrs.len()) }
    })
    .await;
    if matches!(rc, Ok(0)) {
        return Vec::new();
    }
    // One code for the whole list (the addresses of the failed group were
    // likely never registered: ERR_ADDRESS_NOT_REGISTERED): each alone.
    let mut kept = Vec::new();
    for a in addrs {
        if !released_alone(inner, a).await {
            kept.push(a);
        }
    }
    kept
}

/// The body of `batch_register` (run to completion, see `to_completion`).
async fn register_batch(inner: Arc<Inner>, owned: Vec<MemoryRegion>) -> Result<()> {
    // The table takes the regions; the library calls below need only
    // their bounds and locations.
    let regions: Vec<RegionInfo> = owned.iter().map(MemoryRegion::info).collect();
    let fail = |index: usize, source: Error| Error::BatchRegisterFailed {
        index,
        addr: regions[index].addr(),
        source: Box::new(source),
    };
    // Every location as a C string before anything is registered: a
    // failure below is then the library's only.
    let mut groups: Vec<(String, CString, Vec<usize>)> = Vec::new();
    for (i, r) in regions.iter().enumerate() {
        let loc = r.location().as_str();
        match groups.iter_mut().find(|(l, _, _)| l == loc) {
            Some((_, _, v)) => v.push(i),
            None => {
                let c = cstring("location", loc).map_err(|e| fail(i, e))?;
                groups.push((loc.to_owned(), c, vec![i]));
            }
        }
    }
    let _registering = inner.registry.read().await;
    for (i, r) in owned.into_iter().enumerate() {
        if let Err(e) = inner.regions.insert(r) {
            for done in &regions[..i] {
                let _ = inner.regions.remove(done.addr()).await;
            }
            return Err(fail(i, e));
        }
    }
    // One C call per location, in first-appearance order.
    let mut registered: Vec<usize> = Vec::new();
    for (_, loc_c, idx) in groups {
        let this = Arc::clone(&inner);
        let mut entries: Vec<CBufferEntry> = idx
            .iter()
            .map(|&i| CBufferEntry {
                addr: regions[i].addr() as usize as *mut c_void,
                length: regions[i].len() as usize,
            })
            .collect();
        let rc = blocking(move || {
            // SAFETY: live engine; every range is a region the caller
            // promised valid; `entries` and `loc_c` outlive the call.
            unsafe {
                (this.lib.api.register_batch)(
                    this.raw(),
                    entries.as_mut_ptr(),
                    entries.len(),
                    loc_c.as_ptr(),
                )
            }
        })
        .await;
        let err = match rc {
            Ok(0) => None,
            Ok(rc) => Some(call_error("registerLocalMemoryBatch", i64::from(rc))),
            Err(e) => Some(e),
        };
        if let Some(e) = err {
            // All or nothing: undo the groups already registered (and
            // this one, in case the library registered part of it).
            let undo: Vec<u64> = registered
                .iter()
                .chain(&idx)
                .map(|&i| regions[i].addr())
                .collect();
            let kept = undo_in_library(&inner, undo).await;
            // Out of Ferry's table last, and only what the library surely
            // let go of: a region it may still have stays (a later
            // `unregister` asks it again).
            for r in regions.iter().filter(|r| !kept.contains(&r.addr())) {
                let _ = inner.regions.remove(r.addr()).await;
            }
            if let Some(&addr) = kept.first() {
                return Err(held_after_failed_register(
                    addr,
                    &format!(
                        "region {} of the batch: {e}; the library refused to undo {} \
                         region(s) registered before",
                        idx[0],
                        kept.len()
                    ),
                ));
            }
            return Err(fail(idx[0], e));
        }
        registered.extend(idx);
    }
    Ok(())
}
