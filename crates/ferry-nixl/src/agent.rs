//! A NIXL agent through the C API: the only module that calls into the
//! library. Every call is made under one lock per agent (NIXL's own Rust
//! users call an agent from one thread; Ferry's engine is called from many
//! tasks at once), and the agent is also created with NIXL's strict thread
//! synchronisation for its own progress thread.

use std::ffi::{c_char, c_void, CString};
use std::sync::{Arc, Mutex, MutexGuard};

use ferry_core::{Error, Result};

use crate::library::{self, status, AgentConfig, Handle, NixlLibrary, Status};

/// An opaque C handle that is only ever passed back to the library.
#[derive(Debug)]
pub(crate) struct Raw(pub(crate) Handle);
// SAFETY: the handles are pointers to C++ objects that Ferry never
// dereferences; every use goes through the agent's call lock.
unsafe impl Send for Raw {}
// SAFETY: as above.
unsafe impl Sync for Raw {}

/// The error for a failed call.
pub(crate) fn backend_error(operation: &str, code: Status) -> Error {
    Error::Backend {
        backend: "nixl".to_owned(),
        operation: operation.to_owned(),
        code: i64::from(code),
        name: status::name(code).to_owned(),
    }
}

fn check(operation: &str, code: Status) -> Result<()> {
    if code == status::SUCCESS {
        Ok(())
    } else {
        Err(backend_error(operation, code))
    }
}

fn cstring(what: &str, s: &str) -> Result<CString> {
    CString::new(s).map_err(|_| Error::InvalidArgument(format!("{what} contains a NUL byte")))
}

/// One NIXL agent and the backends created on it.
pub(crate) struct Agent {
    lib: Arc<NixlLibrary>,
    raw: Raw,
    backends: Mutex<Vec<(String, Raw)>>,
    calls: Mutex<()>,
    name: String,
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent").field("name", &self.name).finish()
    }
}

/// A posted transfer request. Dropping it without [`Agent::release`]
/// leaks it (and NIXL keeps whatever it refers to): that is the safe
/// default for a request NIXL may still be running.
#[derive(Debug)]
pub(crate) struct XferReq(Raw);

/// The state of a posted request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum XferState {
    InProgress,
    Done,
    Failed(Status),
}

/// A list of descriptors `(addr, len)`.
pub(crate) type Descs<'a> = &'a [(u64, u64)];

impl Agent {
    /// Creates the agent `name` with NIXL's progress thread as asked and no
    /// NIXL listener (Ferry exchanges metadata itself).
    pub(crate) fn create(
        lib: Arc<NixlLibrary>,
        name: &str,
        progress_thread: bool,
    ) -> Result<Agent> {
        let c_name = cstring("the agent name", name)?;
        let cfg = AgentConfig {
            enable_prog_thread: progress_thread,
            enable_listen_thread: false,
            listen_port: 0,
            thread_sync: library::THREAD_SYNC_STRICT,
            num_workers: 1,
            pthr_delay_us: 0,
            lthr_delay_us: 100_000,
            capture_telemetry: false,
        };
        let mut raw: Handle = std::ptr::null_mut();
        // SAFETY: valid C string, config and out-pointer for the duration of
        // the call.
        let code = unsafe { (lib.api.create_configured_agent)(c_name.as_ptr(), &cfg, &mut raw) };
        check("nixl_capi_create_configured_agent", code)?;
        if raw.is_null() {
            return Err(backend_error(
                "nixl_capi_create_configured_agent",
                status::BACKEND,
            ));
        }
        Ok(Agent {
            lib,
            raw: Raw(raw),
            backends: Mutex::new(Vec::new()),
            calls: Mutex::new(()),
            name: name.to_owned(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, ()> {
        ferry_core::__private::sync::lock(&self.calls)
    }

    /// The agent's name.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// The plugins NIXL can load (`UCX`, `POSIX`, …).
    pub(crate) fn available_plugins(&self) -> Result<Vec<String>> {
        let api = &self.lib.api;
        let _g = self.lock();
        let mut list: Handle = std::ptr::null_mut();
        // SAFETY: live agent, valid out-pointer.
        check("nixl_capi_get_available_plugins", unsafe {
            (api.get_available_plugins)(self.raw.0, &mut list)
        })?;
        let mut n = 0usize;
        // SAFETY: `list` was just created by the library.
        let sized = unsafe { (api.string_list_size)(list, &mut n) };
        let mut out = Vec::new();
        if sized == status::SUCCESS {
            for i in 0..n {
                let mut s: *const c_char = std::ptr::null();
                // SAFETY: index below the size; the string lives as long as
                // the list, and is copied before the list is destroyed.
                if unsafe { (api.string_list_get)(list, i, &mut s) } == status::SUCCESS {
                    // SAFETY: see above.
                    if let Some(s) = unsafe { library::c_string(s) } {
                        out.push(s);
                    }
                }
            }
        }
        // SAFETY: destroyed once, after its last use.
        unsafe { (api.destroy_string_list)(list) };
        check("nixl_capi_string_list_size", sized)?;
        Ok(out)
    }

    /// Creates the backend `plugin` with its plugin's default parameters.
    pub(crate) fn create_backend(&self, plugin: &str) -> Result<()> {
        let api = &self.lib.api;
        let c_plugin = cstring("the backend name", plugin)?;
        let _g = self.lock();
        let mut mems: Handle = std::ptr::null_mut();
        let mut params: Handle = std::ptr::null_mut();
        // SAFETY: live agent, valid C string and out-pointers.
        let code = unsafe {
            (api.get_plugin_params)(self.raw.0, c_plugin.as_ptr(), &mut mems, &mut params)
        };
        if code != status::SUCCESS {
            return Err(library::unavailable(format!(
                "NIXL cannot load its {plugin} plugin (nixl_capi_get_plugin_params returned {}); \
                 is the plugin directory next to libnixl_capi.so, or NIXL_PLUGIN_DIR set?",
                status::name(code)
            )));
        }
        let mut backend: Handle = std::ptr::null_mut();
        // SAFETY: as above; `params` came from the library.
        let created =
            unsafe { (api.create_backend)(self.raw.0, c_plugin.as_ptr(), params, &mut backend) };
        // SAFETY: each destroyed once, after its last use.
        unsafe {
            (api.destroy_mem_list)(mems);
            (api.destroy_params)(params);
        }
        check("nixl_capi_create_backend", created)?;
        ferry_core::__private::sync::lock(&self.backends).push((plugin.to_owned(), Raw(backend)));
        Ok(())
    }

    /// The agent's metadata blob (what a peer loads to reach it).
    pub(crate) fn local_md(&self) -> Result<Vec<u8>> {
        let _g = self.lock();
        let mut data: *mut c_void = std::ptr::null_mut();
        let mut len = 0usize;
        // SAFETY: live agent, valid out-pointers.
        check("nixl_capi_get_local_md", unsafe {
            (self.lib.api.get_local_md)(self.raw.0, &mut data, &mut len)
        })?;
        if data.is_null() {
            return Ok(Vec::new());
        }
        // SAFETY: the library returned `len` bytes it allocated with malloc;
        // copied, then freed exactly once.
        let out = unsafe { std::slice::from_raw_parts(data as *const u8, len) }.to_vec();
        // SAFETY: see above.
        unsafe { library::free(data) };
        Ok(out)
    }

    /// Loads a peer's metadata; returns the peer's agent name.
    pub(crate) fn load_remote_md(&self, md: &[u8]) -> Result<String> {
        if md.is_empty() {
            return Err(Error::InvalidArgument("empty NIXL metadata".to_owned()));
        }
        let _g = self.lock();
        let mut name: *mut c_char = std::ptr::null_mut();
        // SAFETY: live agent, `md` valid for `len` bytes, valid out-pointer.
        check("nixl_capi_load_remote_md", unsafe {
            (self.lib.api.load_remote_md)(self.raw.0, md.as_ptr().cast(), md.len(), &mut name)
        })?;
        // SAFETY: a strdup'ed string, copied then freed exactly once.
        let out = unsafe { library::c_string(name) };
        if !name.is_null() {
            // SAFETY: see above.
            unsafe { library::free(name.cast()) };
        }
        out.ok_or_else(|| backend_error("nixl_capi_load_remote_md", status::BACKEND))
    }

    /// Forgets a peer's metadata (and its connection).
    pub(crate) fn invalidate_remote_md(&self, remote: &str) -> Result<()> {
        let c = cstring("the agent name", remote)?;
        let _g = self.lock();
        // SAFETY: live agent, valid C string.
        check("nixl_capi_invalidate_remote_md", unsafe {
            (self.lib.api.invalidate_remote_md)(self.raw.0, c.as_ptr())
        })
    }

    /// Builds a registration descriptor list of `mem_type`.
    fn reg_dlist(&self, mem_type: i32, descs: &[(u64, u64, u64)]) -> Result<Raw> {
        let api = &self.lib.api;
        let mut list: Handle = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        check("nixl_capi_create_reg_dlist", unsafe {
            (api.create_reg_dlist)(mem_type, &mut list)
        })?;
        for &(addr, len, dev) in descs {
            // SAFETY: `list` is live; no metadata bytes.
            let code = unsafe {
                (api.reg_dlist_add_desc)(
                    list,
                    addr as usize,
                    len as usize,
                    dev,
                    std::ptr::null(),
                    0,
                )
            };
            if code != status::SUCCESS {
                // SAFETY: destroyed once.
                unsafe { (api.destroy_reg_dlist)(list) };
                return Err(backend_error("nixl_capi_reg_dlist_add_desc", code));
            }
        }
        Ok(Raw(list))
    }

    /// Registers (or, with `register == false`, deregisters) `descs`
    /// (`addr`, `len`, device) of `mem_type` with every backend, in one
    /// call.
    pub(crate) fn register(
        &self,
        mem_type: i32,
        descs: &[(u64, u64, u64)],
        register: bool,
    ) -> Result<()> {
        let api = &self.lib.api;
        let _g = self.lock();
        let list = self.reg_dlist(mem_type, descs)?;
        let (f, what) = if register {
            (api.register_mem, "nixl_capi_register_mem")
        } else {
            (api.deregister_mem, "nixl_capi_deregister_mem")
        };
        // SAFETY: live agent and list; no optional arguments (every backend).
        let code = unsafe { f(self.raw.0, list.0, std::ptr::null_mut()) };
        // SAFETY: destroyed once, after its last use.
        unsafe { (api.destroy_reg_dlist)(list.0) };
        check(what, code)
    }

    fn xfer_dlist(&self, descs: Descs<'_>) -> Result<Raw> {
        let api = &self.lib.api;
        let mut list: Handle = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        check("nixl_capi_create_xfer_dlist", unsafe {
            (api.create_xfer_dlist)(library::MEM_DRAM, &mut list)
        })?;
        for &(addr, len) in descs {
            // SAFETY: `list` is live.
            let code = unsafe { (api.xfer_dlist_add_desc)(list, addr as usize, len as usize, 0) };
            if code != status::SUCCESS {
                // SAFETY: destroyed once.
                unsafe { (api.destroy_xfer_dlist)(list) };
                return Err(backend_error("nixl_capi_xfer_dlist_add_desc", code));
            }
        }
        Ok(Raw(list))
    }

    /// Creates and posts one transfer request: `local[i]` ↔ `remote[i]`
    /// with `remote_agent`, carrying `notif` (delivered by NIXL after the
    /// data). `Err` means NIXL took nothing; `Ok` gives the posted request
    /// and its state right after posting.
    pub(crate) fn post(
        &self,
        write: bool,
        local: Descs<'_>,
        remote: Descs<'_>,
        remote_agent: &str,
        notif: Option<&[u8]>,
    ) -> Result<(XferReq, XferState)> {
        let api = &self.lib.api;
        let c_remote = cstring("the agent name", remote_agent)?;
        let _g = self.lock();
        let l = self.xfer_dlist(local)?;
        let r = match self.xfer_dlist(remote) {
            Ok(r) => r,
            Err(e) => {
                // SAFETY: destroyed once.
                unsafe { (api.destroy_xfer_dlist)(l.0) };
                return Err(e);
            }
        };
        let mut args: Handle = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        let mut code = unsafe { (api.create_opt_args)(&mut args) };
        if code == status::SUCCESS {
            if let Some(msg) = notif {
                // SAFETY: live args; `msg` valid for its length (copied).
                code =
                    unsafe { (api.opt_args_set_notif_msg)(args, msg.as_ptr().cast(), msg.len()) };
                if code == status::SUCCESS {
                    // SAFETY: live args.
                    code = unsafe { (api.opt_args_set_has_notif)(args, true) };
                }
            }
        }
        let mut req: Handle = std::ptr::null_mut();
        if code == status::SUCCESS {
            let op = if write {
                library::OP_WRITE
            } else {
                library::OP_READ
            };
            // SAFETY: live agent, lists, args; valid C string, out-pointer.
            code = unsafe {
                (api.create_xfer_req)(self.raw.0, op, l.0, r.0, c_remote.as_ptr(), &mut req, args)
            };
            if code != status::SUCCESS {
                req = std::ptr::null_mut();
            }
        }
        let mut posted = status::BACKEND;
        if !req.is_null() {
            // SAFETY: live agent, request and args.
            posted = unsafe { (api.post_xfer_req)(self.raw.0, req, args) };
        }
        // SAFETY: each destroyed once; NIXL copied what it keeps.
        unsafe {
            if !args.is_null() {
                (api.destroy_opt_args)(args);
            }
            (api.destroy_xfer_dlist)(l.0);
            (api.destroy_xfer_dlist)(r.0);
        }
        if req.is_null() {
            return Err(backend_error("nixl_capi_create_xfer_req", code));
        }
        let req = XferReq(Raw(req));
        match posted {
            status::SUCCESS => Ok((req, XferState::Done)),
            status::IN_PROG => Ok((req, XferState::InProgress)),
            failed => {
                // Not posted: NIXL holds no transfer; release what it made.
                drop(_g);
                if let Err(leaked) = self.release(req) {
                    tracing::warn!(?leaked, "ferry: NIXL kept a request that failed to post");
                }
                Err(backend_error("nixl_capi_post_xfer_req", failed))
            }
        }
    }

    /// The state of a posted request (this call also progresses it when
    /// NIXL has no progress thread).
    pub(crate) fn state(&self, req: &XferReq) -> XferState {
        let _g = self.lock();
        // SAFETY: live agent and request.
        match unsafe { (self.lib.api.get_xfer_status)(self.raw.0, req.0 .0) } {
            status::SUCCESS => XferState::Done,
            status::IN_PROG => XferState::InProgress,
            code => XferState::Failed(code),
        }
    }

    /// Releases a request. NIXL releases a request still in progress only
    /// if its backend can abort it; otherwise the request is handed back
    /// (`Err`), still owned by NIXL's transfer, and must be kept.
    pub(crate) fn release(&self, req: XferReq) -> std::result::Result<(), XferReq> {
        let api = &self.lib.api;
        let _g = self.lock();
        // SAFETY: live agent and request.
        let code = unsafe { (api.release_xfer_req)(self.raw.0, req.0 .0) };
        if code != status::SUCCESS {
            return Err(req);
        }
        // SAFETY: released above, so the wrapper holds nothing; destroyed
        // once.
        unsafe { (api.destroy_xfer_req)(req.0 .0) };
        Ok(())
    }

    /// Takes the notifications NIXL received: `(sender agent, bytes)`.
    pub(crate) fn take_notifs(&self) -> Result<Vec<(String, Vec<u8>)>> {
        let api = &self.lib.api;
        let _g = self.lock();
        let mut map: Handle = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        check("nixl_capi_create_notif_map", unsafe {
            (api.create_notif_map)(&mut map)
        })?;
        let mut out = Vec::new();
        // SAFETY: live agent and map; no optional arguments.
        let code = unsafe { (api.get_notifs)(self.raw.0, map, std::ptr::null_mut()) };
        if code == status::SUCCESS {
            let mut agents = 0usize;
            // SAFETY: live map, valid out-pointer.
            unsafe { (api.notif_map_size)(map, &mut agents) };
            for i in 0..agents {
                let mut name: *const c_char = std::ptr::null();
                // SAFETY: index below the size; the name lives with the map.
                if unsafe { (api.notif_map_get_agent_at)(map, i, &mut name) } != status::SUCCESS
                    || name.is_null()
                {
                    continue;
                }
                // SAFETY: see above.
                let sender = unsafe { library::c_string(name) }.unwrap_or_default();
                let mut n = 0usize;
                // SAFETY: live map, the name it gave.
                unsafe { (api.notif_map_get_notifs_size)(map, name, &mut n) };
                for j in 0..n {
                    let mut data: *const c_void = std::ptr::null();
                    let mut len = 0usize;
                    // SAFETY: index below the size; the bytes live with the
                    // map and are copied before it is destroyed.
                    let got =
                        unsafe { (api.notif_map_get_notif)(map, name, j, &mut data, &mut len) };
                    if got == status::SUCCESS {
                        let bytes = if data.is_null() {
                            Vec::new()
                        } else {
                            // SAFETY: see above.
                            unsafe { std::slice::from_raw_parts(data as *const u8, len) }.to_vec()
                        };
                        out.push((sender.clone(), bytes));
                    }
                }
            }
        }
        // SAFETY: destroyed once, after its last use.
        unsafe { (api.destroy_notif_map)(map) };
        check("nixl_capi_get_notifs", code)?;
        Ok(out)
    }

    /// Sends a notification without data.
    pub(crate) fn gen_notif(&self, remote: &str, msg: &[u8]) -> Result<()> {
        let c = cstring("the agent name", remote)?;
        let _g = self.lock();
        // SAFETY: live agent; valid C string and bytes (copied).
        check("nixl_capi_gen_notif", unsafe {
            (self.lib.api.gen_notif)(
                self.raw.0,
                c.as_ptr(),
                msg.as_ptr().cast(),
                msg.len(),
                std::ptr::null_mut(),
            )
        })
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let api = &self.lib.api;
        let backends = std::mem::take(ferry_core::__private::sync::get_mut(&mut self.backends));
        // SAFETY: called once, when nothing else holds the agent (every
        // engine task holds an Arc to it). Destroying the agent tears down
        // its backends; `nixl_capi_destroy_backend` then only deletes the
        // C wrapper, which holds a pointer it does not dereference.
        unsafe {
            (api.destroy_agent)(self.raw.0);
            for (_, b) in backends {
                (api.destroy_backend)(b.0);
            }
        }
    }
}
