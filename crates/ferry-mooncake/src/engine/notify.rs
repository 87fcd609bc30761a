//! Notifications: whether the build can send and receive them (probed at
//! start-up where the symbols cannot tell), sending one after a batch, and
//! taking the ones received.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::Arc;

use ferry_core::{Error, MissingCapability, Notification, Operation, Result};

use super::poller::Core;
use super::{blocking, cstring, lock, MooncakeEngine, RawEngine, BACKEND};
use crate::codes::call_error;
use crate::config::MooncakeConfig;
use crate::library::{CNotifyMsg, Generation, MooncakeLibrary};

extern "C" {
    /// libc's `free`, for notification buffers of v0.3.5 (see
    /// `take_notifications`).
    fn free(ptr: *mut c_void);
}

impl MooncakeEngine {
    /// Why notifications do not work with this build (a placeholder when
    /// they do).
    fn notify_missing(&self) -> MissingCapability {
        self.inner
            .notify_gap
            .clone()
            .unwrap_or_else(|| MissingCapability {
                operation: Operation::Notify,
                reason: "notifications work with this build".into(),
                min_version: None,
            })
    }

    /// Whether notifications work with this build and transport.
    pub(super) fn has_notify(&self) -> bool {
        self.inner.notify_gap.is_none()
    }

    /// The error of a notification call this build cannot serve.
    pub(super) fn refuse_notify(&self) -> Error {
        let m = self.notify_missing();
        Error::Unsupported {
            backend: BACKEND.into(),
            operation: Operation::Notify,
            reason: m.reason,
            min_version: m.min_version,
        }
    }

    /// Hands notification `n` to the library for segment `c_id`
    /// (`genNotifyInEngine`; sent after a batch is done).
    pub(super) async fn gen_notify(&self, c_id: i32, n: &Notification) -> Result<()> {
        let gen = self
            .inner
            .lib
            .api
            .gen_notify
            .ok_or_else(|| self.refuse_notify())?;
        let name = cstring("name", &n.name)?;
        let msg = cstring("message", &n.message)?;
        let this = Arc::clone(&self.inner);
        let rc = blocking(move || {
            let m = CNotifyMsg {
                name: name.as_ptr() as *mut c_char,
                msg: msg.as_ptr() as *mut c_char,
            };
            // SAFETY: live engine; the strings outlive the call and Mooncake
            // copies them.
            unsafe { gen(this.raw(), c_id as u64, m) }
        })
        .await?;
        if rc != 0 {
            let code = i64::from(rc);
            if crate::codes::MooncakeErrorCode::from_raw(code)
                == Some(crate::codes::MooncakeErrorCode::Metadata)
            {
                if let Some(peer) = lock(&self.inner.segments).unacknowledged_peer_name(c_id) {
                    // A peer of v0.3.5–v0.3.11 (see `peer_wire`): its TCP
                    // engine rejects notifications before v0.3.8.
                    return Err(Error::Unsupported {
                        backend: BACKEND.into(),
                        operation: Operation::Notify,
                        reason: format!(
                            "the peer {peer} is Mooncake v0.3.5–v0.3.11 and rejected the \
                             notification (genNotifyInEngine returned {}): TCP engines \
                             before v0.3.8 reject every notification; the data before it \
                             moved",
                            crate::codes::code_name(code)
                        ),
                        min_version: Some("Mooncake v0.3.8 at the peer".into()),
                    });
                }
            }
            return Err(call_error("genNotifyInEngine", code));
        }
        Ok(())
    }

    /// Moves what the library received into the engine's inbox (without
    /// the start-up probe's). The library's queue is emptied inside a
    /// blocking task that runs to its end even if the caller's future is
    /// dropped, and what it took goes into the inbox the engine owns, never
    /// into the future's result: a dropped `take_notifications` or
    /// `next_notification` loses nothing.
    async fn pull(&self) -> Result<()> {
        let lib = &self.inner.lib;
        let get = match (self.has_notify(), lib.api.get_notifs) {
            (true, Some(g)) => g,
            _ => return Err(self.refuse_notify()),
        };
        let free_notifs = lib.api.free_notifs;
        let this = Arc::clone(&self.inner);
        blocking(move || {
            // Pulls one at a time, so that what one took is queued before
            // the next takes more (the library's order is kept).
            let _pulling = this.inbox.pull_guard();
            let mut size: c_int = 0;
            // SAFETY: live engine; `size` is writable.
            let arr = unsafe { get(this.raw(), &mut size) };
            let n = usize::try_from(size).unwrap_or(0);
            if arr.is_null() || n == 0 {
                return;
            }
            for i in 0..n {
                // SAFETY: the library returned an array of `size` entries.
                let m = unsafe { *arr.add(i) };
                let text = |p: *mut c_char| {
                    if p.is_null() {
                        String::new()
                    } else {
                        // SAFETY: NUL-terminated strings owned by the array.
                        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
                    }
                };
                let n = Notification::new(text(m.name), text(m.msg));
                if n.name != this.probe_name {
                    // Unbounded (see `Inner::inbox`): refused only once
                    // the engine is gone, when nobody can take it.
                    let _ = this.inbox.push(n);
                }
            }
            match free_notifs {
                // SAFETY: the array and size the library returned, freed once.
                Some(f) => unsafe {
                    f(arr, size);
                },
                // Only v0.3.5 lacks freeNotifsMsgBuf, and notifications are
                // refused there (see `notify_gap`): its strings are not ours.
                // SAFETY: the array was allocated with malloc, freed once.
                None => unsafe { free(arr.cast()) },
            }
        })
        .await
    }

    /// `take_notifications`: the notifications received so far.
    pub(super) async fn take_received(&self) -> Result<Vec<Notification>> {
        self.pull().await?;
        Ok(self.inner.inbox.take_all())
    }

    /// `next_notification`: pulls from the library until a wanted one came.
    pub(super) async fn next_received(&self, name: Option<&str>) -> Result<Notification> {
        if !self.has_notify() || self.inner.lib.api.get_notifs.is_none() {
            return Err(self.refuse_notify());
        }
        self.inner.inbox.pull_then(name, || self.pull()).await
    }
}

/// Why notifications do not work with this build and transport (`None`:
/// they do). Mooncake v0.3.5's `getNotifsFromEngine` returns names and
/// messages in strings it has already freed; TCP engines of v0.3.5–v0.3.7
/// never install the handler that receives notifications (only the RDMA
/// transport did, until v0.3.8), so the peer rejects them. v0.3.6 and v0.3.8
/// export the same symbols, so on that generation with TCP the engine sends
/// one notification to itself at start-up to find out.
pub(super) async fn notify_gap(
    lib: &MooncakeLibrary,
    config: &MooncakeConfig,
    core: &Arc<Core>,
    segment_name: &str,
    probe_name: &str,
) -> Option<MissingCapability> {
    let tcp = config.protocol == "tcp";
    let gap = |reason: String, version: &str| {
        Some(MissingCapability {
            operation: Operation::Notify,
            reason,
            min_version: Some(format!("Mooncake {version}")),
        })
    };
    if !lib.has_notify() {
        return gap(
            format!(
                "{} ({}) has no submitTransferWithNotify/getNotifsFromEngine/genNotifyInEngine",
                lib.path().display(),
                lib.generation()
            ),
            if tcp { "v0.3.8" } else { "v0.3.6" },
        );
    }
    match lib.generation() {
        Generation::V0_3_5 => gap(
            format!(
                "{} (v0.3.5) returns notification names and messages in strings it has \
                 already freed{}",
                lib.path().display(),
                if tcp {
                    ", and its TCP engines reject incoming notifications"
                } else {
                    ""
                }
            ),
            if tcp { "v0.3.8" } else { "v0.3.6" },
        ),
        Generation::V0_3_6 if tcp => {
            let gen = lib.api.gen_notify?;
            let (open, close) = (lib.api.open_segment, lib.api.close_segment);
            let engine = RawEngine(core.raw.0);
            let seg = CString::new(segment_name).ok()?;
            let name = CString::new(probe_name).ok()?;
            let probed = blocking(move || {
                let e = engine;
                // SAFETY: live engine (the caller holds the Core); the
                // strings outlive the calls.
                let id = unsafe { open(e.0, seg.as_ptr()) };
                if id < 0 {
                    return Err(format!("openSegment of its own segment returned {id}"));
                }
                let msg = CNotifyMsg {
                    name: name.as_ptr() as *mut c_char,
                    msg: c"".as_ptr() as *mut c_char,
                };
                // SAFETY: live engine and segment; Mooncake copies the strings.
                let rc = unsafe { gen(e.0, id as u64, msg) };
                // SAFETY: the segment opened above, closed once.
                unsafe { close(e.0, id) };
                if rc == 0 {
                    Ok(())
                } else {
                    Err(format!(
                        "a notification this engine sent to itself was rejected ({})",
                        crate::codes::code_name(i64::from(rc))
                    ))
                }
            })
            .await;
            match probed {
                Ok(Ok(())) => None,
                Ok(Err(why)) | Err(Error::Canceled(why)) => gap(
                    format!(
                        "{} ({}, v0.3.6–v0.3.10 by its symbols) is a build whose TCP engines \
                         reject incoming notifications (v0.3.6 and v0.3.7): {why}",
                        lib.path().display(),
                        lib.generation()
                    ),
                    "v0.3.8",
                ),
                Err(e) => gap(format!("probing notifications failed: {e}"), "v0.3.8"),
            }
        }
        _ => None,
    }
}
