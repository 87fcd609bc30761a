//! Pins the TCP-transport semantics the test libraries reproduce from real
//! Mooncake builds, straight through their C API (not through Ferry's
//! `MooncakeEngine`, which confirms landings on its own):
//!
//! - before v0.3.12 (v0.2.0 … v0.3.6) a WRITE is COMPLETED before its bytes
//!   land in the peer's memory, the last byte lands last, and the peer
//!   checks no address: mapped but unregistered memory is overwritten, an
//!   unmapped target is silently dropped (still COMPLETED); READs are served
//!   from wherever they point (FAILED only where nothing is mapped) and see
//!   the bytes as they are before a pending landing;
//! - from v0.3.12 a WRITE is COMPLETED only once its bytes are there, and a
//!   READ or WRITE outside the peer's registered memory is FAILED.
//!
//! The late landing is made observable with the libraries' test-only
//! `land_delay=<ms>` (carried in `installTransport`'s NIC priority matrix).

use std::alloc::{alloc, dealloc, Layout};
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::PathBuf;
use std::sync::atomic::{fence, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use libloading::Library;
use mooncake_testlibs::{file_metadata, library_path, Generation as Lib};

// ------------------------------------------------------------------ C API

type Handle = *mut c_void;

#[repr(C)]
struct CRequest {
    opcode: c_int,
    source: *mut c_void,
    target_id: i32,
    padding: u32,
    target_offset: u64,
    length: u64,
}

#[repr(C)]
#[derive(Default)]
struct CStatus {
    status: c_int,
    transferred_bytes: u64,
}

type Create4Fn = unsafe extern "C" fn(*const c_char, *const c_char, *const c_char, u64) -> Handle;
type Create5Fn =
    unsafe extern "C" fn(*const c_char, *const c_char, *const c_char, u64, c_int) -> Handle;
type DestroyFn = unsafe extern "C" fn(Handle);
type InstallFn = unsafe extern "C" fn(Handle, *const c_char, *mut *mut c_void) -> Handle;
type OpenSegmentFn = unsafe extern "C" fn(Handle, *const c_char) -> i32;
type RegisterFn = unsafe extern "C" fn(Handle, *mut c_void, usize, *const c_char, c_int) -> c_int;
type AllocateFn = unsafe extern "C" fn(Handle, usize) -> u64;
type SubmitFn = unsafe extern "C" fn(Handle, u64, *mut CRequest, usize) -> c_int;
type StatusFn = unsafe extern "C" fn(Handle, u64, usize, *mut CStatus) -> c_int;
type FreeBatchFn = unsafe extern "C" fn(Handle, u64) -> c_int;
type LocalIpAndPortFn = unsafe extern "C" fn(Handle, *mut c_char, usize) -> c_int;

const READ: c_int = 0;
const WRITE: c_int = 1;
const COMPLETED: c_int = 4;
const FAILED: c_int = 6;

/// The entry points these tests call, from one test library.
struct Api {
    gen: Lib,
    create4: Option<Create4Fn>,
    create5: Option<Create5Fn>,
    destroy: DestroyFn,
    install: InstallFn,
    open_segment: OpenSegmentFn,
    register: RegisterFn,
    allocate: AllocateFn,
    submit: SubmitFn,
    status: StatusFn,
    free_batch: FreeBatchFn,
    local_ip_and_port: Option<LocalIpAndPortFn>,
}

/// Loads the test library of `gen` (never unloaded: engines' threads are
/// joined by `destroyTransferEngine`, but keeping it loaded is simplest).
fn api(gen: Lib) -> Api {
    assert!(gen >= Lib::V0_2_0, "pre-v0.2.0 has another API");
    // SAFETY: the test libraries have no initialisers with preconditions.
    let lib = unsafe { Library::new(library_path(gen)) }
        .unwrap_or_else(|e| panic!("loading the {gen} test library: {e}"));
    let lib: &'static Library = Box::leak(Box::new(lib));
    macro_rules! sym {
        ($name:literal) => {
            // SAFETY: the type is the symbol's C signature in the test
            // libraries (csrc/mooncake_testlib.c).
            *unsafe { lib.get(concat!($name, "\0").as_bytes()) }
                .unwrap_or_else(|e| panic!("{gen}: {}: {e}", $name))
        };
    }
    macro_rules! opt {
        ($name:literal) => {
            // SAFETY: as for `sym!`.
            unsafe { lib.get(concat!($name, "\0").as_bytes()) }
                .ok()
                .map(|s| *s)
        };
    }
    let v0_2_0 = gen == Lib::V0_2_0;
    Api {
        gen,
        create4: if v0_2_0 {
            Some(sym!("createTransferEngine"))
        } else {
            None
        },
        create5: if v0_2_0 {
            None
        } else {
            Some(sym!("createTransferEngine"))
        },
        destroy: sym!("destroyTransferEngine"),
        install: sym!("installTransport"),
        open_segment: sym!("openSegment"),
        register: sym!("registerLocalMemory"),
        allocate: sym!("allocateBatchID"),
        submit: sym!("submitTransfer"),
        status: sym!("getTransferStatus"),
        free_batch: sym!("freeBatchID"),
        local_ip_and_port: opt!("getLocalIpAndPort"),
    }
}

// ------------------------------------------------------------------ memory

/// Page-aligned memory that the peer's server thread may write at any time:
/// only touched through raw pointers, byte reads are volatile.
struct Mem {
    ptr: *mut u8,
    len: usize,
}

impl Mem {
    fn new(len: usize, fill: u8) -> Mem {
        let layout = Layout::from_size_align(len, 4096).unwrap();
        // SAFETY: len > 0 in every test.
        let ptr = unsafe { alloc(layout) };
        assert!(!ptr.is_null(), "out of memory");
        // SAFETY: ptr is valid for len bytes.
        unsafe { ptr.write_bytes(fill, len) };
        Mem { ptr, len }
    }

    fn addr(&self) -> u64 {
        self.ptr as u64
    }

    fn get(&self, i: usize) -> u8 {
        assert!(i < self.len);
        // SAFETY: in bounds; volatile because another thread writes it.
        unsafe { self.ptr.add(i).read_volatile() }
    }

    fn set(&self, i: usize, v: u8) {
        assert!(i < self.len);
        // SAFETY: in bounds.
        unsafe { self.ptr.add(i).write_volatile(v) }
    }

    fn fill_with(&self, f: impl Fn(usize) -> u8) {
        for i in 0..self.len {
            self.set(i, f(i));
        }
    }

    /// A copy, to take once nothing writes the memory any more.
    fn to_vec(&self) -> Vec<u8> {
        fence(Ordering::Acquire);
        let mut v = vec![0u8; self.len];
        // SAFETY: both valid for len bytes, distinct allocations.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr, v.as_mut_ptr(), self.len) };
        v
    }
}

impl Drop for Mem {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { dealloc(self.ptr, Layout::from_size_align(self.len, 4096).unwrap()) }
    }
}

fn pattern(i: usize) -> u8 {
    (i.wrapping_mul(7).wrapping_add(3) % 251) as u8
}

/// An address below `vm.mmap_min_addr` (64 KiB by default, never less than
/// one page on Linux with a non-zero setting): nothing is mapped there.
const UNMAPPED: u64 = 0x1000;

// ------------------------------------------------------------------ engines

static NAMES: AtomicU64 = AtomicU64::new(0);

/// One engine of the test library, destroyed on drop.
struct Engine<'a> {
    api: &'a Api,
    h: Handle,
    /// The name a peer opens this engine's segment by.
    segment: String,
}

impl<'a> Engine<'a> {
    /// An engine on loopback: `P2PHANDSHAKE` where the library has it, else
    /// the `file://` metadata directory `meta`; `matrix` is the NIC matrix
    /// handed to `installTransport` (the test-only knobs).
    fn new(api: &'a Api, meta: &str, matrix: &str) -> Engine<'a> {
        let (h, segment) = if let Some(create4) = api.create4 {
            // v0.2.0 listens on, and publishes, the port it is given.
            let name = format!(
                "old-tcp-{}-{}",
                std::process::id(),
                NAMES.fetch_add(1, Ordering::Relaxed)
            );
            let port = std::net::TcpListener::bind("0.0.0.0:0")
                .and_then(|l| l.local_addr())
                .expect("a free port")
                .port();
            let meta = CString::new(meta).unwrap();
            let cname = CString::new(name.clone()).unwrap();
            // SAFETY: valid C strings; the 4-argument v0.2.0 signature.
            let h = unsafe {
                create4(
                    meta.as_ptr(),
                    cname.as_ptr(),
                    c"127.0.0.1".as_ptr(),
                    port.into(),
                )
            };
            (h, name)
        } else {
            let create5 = api.create5.unwrap();
            // SAFETY: valid C strings; the 5-argument signature.
            let h = unsafe {
                create5(
                    c"P2PHANDSHAKE".as_ptr(),
                    c"127.0.0.1:0".as_ptr(),
                    c"127.0.0.1".as_ptr(),
                    0,
                    0,
                )
            };
            assert!(!h.is_null(), "{}: createTransferEngine failed", api.gen);
            let mut buf = [0 as c_char; 128];
            let get = api.local_ip_and_port.expect("getLocalIpAndPort");
            // SAFETY: h is a live engine, buf is writable for its length.
            assert_eq!(unsafe { get(h, buf.as_mut_ptr(), buf.len()) }, 0);
            // SAFETY: the library wrote a NUL-terminated string.
            let seg = unsafe { CStr::from_ptr(buf.as_ptr()) };
            (h, seg.to_str().unwrap().to_owned())
        };
        assert!(!h.is_null(), "{}: createTransferEngine failed", api.gen);
        let engine = Engine { api, h, segment };
        let matrix = CString::new(matrix).unwrap();
        let mut args: [*mut c_void; 2] = [matrix.as_ptr() as *mut c_void, std::ptr::null_mut()];
        // SAFETY: live engine, valid C string, NULL-terminated args.
        let x = unsafe { (api.install)(h, c"tcp".as_ptr(), args.as_mut_ptr()) };
        assert!(!x.is_null(), "{}: installTransport failed", api.gen);
        engine
    }

    fn register(&self, m: &Mem) {
        // SAFETY: live engine; m outlives the engine in every test (declared
        // before it, so dropped after it).
        let rc = unsafe { (self.api.register)(self.h, m.ptr.cast(), m.len, c"cpu:0".as_ptr(), 1) };
        assert_eq!(rc, 0, "{}: registerLocalMemory", self.api.gen);
    }

    fn open(&self, peer: &Engine<'_>) -> i32 {
        let name = CString::new(peer.segment.clone()).unwrap();
        // SAFETY: live engine, valid C string.
        let seg = unsafe { (self.api.open_segment)(self.h, name.as_ptr()) };
        assert!(seg >= 0, "{}: openSegment({})", self.api.gen, peer.segment);
        seg
    }

    /// Submits one request and waits (up to 60 s) for a terminal status,
    /// which it returns the moment it is seen.
    fn transfer(&self, opcode: c_int, seg: i32, local: &Mem, remote: u64, len: u64) -> c_int {
        assert!(len as usize <= local.len);
        // SAFETY: live engine.
        let batch = unsafe { (self.api.allocate)(self.h, 1) };
        assert_ne!(batch, u64::MAX, "{}: allocateBatchID", self.api.gen);
        let mut req = CRequest {
            opcode,
            source: local.ptr.cast(),
            target_id: seg,
            padding: 0,
            target_offset: remote,
            length: len,
        };
        // SAFETY: live engine and batch; one valid request.
        let rc = unsafe { (self.api.submit)(self.h, batch, &mut req, 1) };
        assert_eq!(rc, 0, "{}: submitTransfer", self.api.gen);
        let deadline = Instant::now() + Duration::from_secs(60);
        let status = loop {
            let mut st = CStatus::default();
            // SAFETY: live engine and batch, task 0 exists.
            let rc = unsafe { (self.api.status)(self.h, batch, 0, &mut st) };
            assert_eq!(rc, 0, "{}: getTransferStatus", self.api.gen);
            if st.status >= 2 {
                if st.status == COMPLETED {
                    assert_eq!(st.transferred_bytes, len);
                }
                break st.status;
            }
            assert!(
                Instant::now() < deadline,
                "{}: the transfer hangs",
                self.api.gen
            );
            std::thread::sleep(Duration::from_micros(200));
        };
        // SAFETY: live engine; the task is terminal.
        assert_eq!(unsafe { (self.api.free_batch)(self.h, batch) }, 0);
        status
    }
}

impl Drop for Engine<'_> {
    fn drop(&mut self) {
        // SAFETY: created by this library, destroyed once.
        unsafe { (self.api.destroy)(self.h) }
    }
}

/// The shared metadata string of a test (a `file://` directory for v0.2.0,
/// removed on drop).
struct Meta {
    url: String,
    dir: Option<PathBuf>,
}

impl Meta {
    fn new(gen: Lib) -> Meta {
        if gen.has_p2p_handshake() {
            Meta {
                url: "P2PHANDSHAKE".to_owned(),
                dir: None,
            }
        } else {
            let (dir, url) = file_metadata("old-tcp");
            Meta {
                url,
                dir: Some(dir),
            }
        }
    }
}

impl Drop for Meta {
    fn drop(&mut self) {
        if let Some(d) = &self.dir {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}

/// Polls `byte` of `m` until it is `want` (up to 30 s); whether it got there.
fn wait_for_byte(m: &Mem, byte: usize, want: u8) -> bool {
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        if m.get(byte) == want {
            return true;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    false
}

const BIG: usize = 8 << 20;
const OLD: u8 = 0x11;
const NEW_LAST: u8 = 0xEE;

// ------------------------------------------------------------------ scenarios

/// An 8 MiB WRITE into registered memory, the peer landing it 1 s after
/// receiving it.
fn write_then_land(gen: Lib) {
    let api = api(gen);
    let meta = Meta::new(gen);
    let src = Mem::new(BIG, 0);
    src.fill_with(pattern);
    src.set(BIG - 1, NEW_LAST);
    let dst = Mem::new(BIG, OLD);
    let readback = Mem::new(BIG, 0);
    let server = Engine::new(&api, &meta.url, "land_delay=1000");
    let client = Engine::new(&api, &meta.url, "");
    server.register(&dst);
    client.register(&src);
    client.register(&readback);
    let seg = client.open(&server);

    let st = client.transfer(WRITE, seg, &src, dst.addr(), BIG as u64);
    let last_at_completion = dst.get(BIG - 1);
    assert_eq!(st, COMPLETED, "{gen}: the write");
    if gen.has_old_tcp_transport() {
        assert_eq!(
            last_at_completion, OLD,
            "{gen}: the last byte had landed when the write was reported COMPLETED"
        );
        // A READ is not held back by the pending landing: it sees the old
        // bytes.
        let st = client.transfer(READ, seg, &readback, dst.addr(), BIG as u64);
        assert_eq!(st, COMPLETED, "{gen}: the read after the write");
        assert_eq!(
            readback.get(BIG - 1),
            OLD,
            "{gen}: a READ right after the write waited for its landing"
        );
        assert!(
            wait_for_byte(&dst, BIG - 1, NEW_LAST),
            "{gen}: the written bytes never landed"
        );
    } else {
        assert_eq!(
            last_at_completion, NEW_LAST,
            "{gen}: COMPLETED before the bytes were in the peer's memory"
        );
    }
    // The last byte lands last: once it is there, so is everything else.
    assert!(
        dst.to_vec() == src.to_vec(),
        "{gen}: the last byte landed before the rest"
    );
}

/// A WRITE into memory of the peer's process that the peer never
/// registered.
fn write_to_unregistered(gen: Lib) {
    let api = api(gen);
    let meta = Meta::new(gen);
    let src = Mem::new(3 * 4096, 0);
    src.fill_with(pattern);
    let registered = Mem::new(4096, OLD);
    let stray = Mem::new(5 * 4096, OLD);
    let server = Engine::new(&api, &meta.url, "land_delay=0");
    let client = Engine::new(&api, &meta.url, "");
    server.register(&registered);
    client.register(&src);
    let seg = client.open(&server);

    let at = 4096 + 100;
    let len = src.len;
    assert!(at + len <= stray.len);
    let st = client.transfer(WRITE, seg, &src, stray.addr() + at as u64, len as u64);
    if gen.has_old_tcp_transport() {
        assert_eq!(st, COMPLETED, "{gen}: the write to unregistered memory");
        assert!(
            wait_for_byte(&stray, at + len - 1, src.get(len - 1)),
            "{gen}: the write to mapped, unregistered memory never landed"
        );
        let mut want = vec![OLD; stray.len];
        want[at..at + len].copy_from_slice(&src.to_vec());
        assert!(
            stray.to_vec() == want,
            "{gen}: unregistered memory holds other bytes than written"
        );
    } else {
        assert_eq!(st, FAILED, "{gen}: the write to unregistered memory");
        std::thread::sleep(Duration::from_millis(100));
        assert!(
            stray.to_vec().iter().all(|&b| b == OLD),
            "{gen}: unregistered memory was written"
        );
    }
    assert!(registered.to_vec().iter().all(|&b| b == OLD));
}

/// A WRITE to an address where nothing is mapped in the peer's process;
/// then the peer still serves.
fn write_to_unmapped(gen: Lib) {
    let api = api(gen);
    let meta = Meta::new(gen);
    let src = Mem::new(64 << 10, 0);
    src.fill_with(pattern);
    let dst = Mem::new(64 << 10, OLD);
    let server = Engine::new(&api, &meta.url, "land_delay=0");
    let client = Engine::new(&api, &meta.url, "");
    server.register(&dst);
    client.register(&src);
    let seg = client.open(&server);

    let st = client.transfer(WRITE, seg, &src, UNMAPPED, src.len as u64);
    if gen.has_old_tcp_transport() {
        assert_eq!(
            st, COMPLETED,
            "{gen}: a write to an unmapped address (dropped by the peer)"
        );
    } else {
        assert_eq!(st, FAILED, "{gen}: a write to an unmapped address");
    }
    // Give the (dropped) landing time to happen, then the peer still works.
    std::thread::sleep(Duration::from_millis(100));
    let st = client.transfer(WRITE, seg, &src, dst.addr(), src.len as u64);
    assert_eq!(st, COMPLETED, "{gen}: a write after the unmapped one");
    assert!(wait_for_byte(&dst, dst.len - 1, src.get(src.len - 1)));
    assert!(dst.to_vec() == src.to_vec(), "{gen}: bytes after the drop");
}

/// READs outside the peer's registered memory.
fn reads_outside_registered(gen: Lib) {
    let api = api(gen);
    let meta = Meta::new(gen);
    let local = Mem::new(2 * 4096, 0);
    let registered = Mem::new(4096, OLD);
    let stray = Mem::new(2 * 4096, 0);
    stray.fill_with(pattern);
    let server = Engine::new(&api, &meta.url, "");
    let client = Engine::new(&api, &meta.url, "");
    server.register(&registered);
    client.register(&local);
    let seg = client.open(&server);

    let st = client.transfer(READ, seg, &local, stray.addr() + 10, 4096 + 100);
    if gen.has_old_tcp_transport() {
        assert_eq!(
            st, COMPLETED,
            "{gen}: a read of mapped, unregistered memory"
        );
        assert!(
            local.to_vec()[..4096 + 100] == stray.to_vec()[10..4096 + 110],
            "{gen}: the bytes read from unregistered memory"
        );
    } else {
        assert_eq!(st, FAILED, "{gen}: a read of unregistered memory");
    }
    let st = client.transfer(READ, seg, &local, UNMAPPED, 4096);
    assert_eq!(st, FAILED, "{gen}: a read of an unmapped address");
    // The connection survives both.
    let st = client.transfer(READ, seg, &local, registered.addr(), 4096);
    assert_eq!(st, COMPLETED, "{gen}: a read after the failed ones");
    assert!(local.to_vec()[..4096].iter().all(|&b| b == OLD));
}

// ------------------------------------------------------------------ tests

#[test]
fn v0_3_6_write_is_completed_before_it_lands() {
    write_then_land(Lib::V0_3_6);
}

#[test]
fn v0_2_0_write_is_completed_before_it_lands() {
    write_then_land(Lib::V0_2_0);
}

#[test]
fn current_write_is_completed_after_it_lands() {
    write_then_land(Lib::Current);
}

#[test]
fn v0_3_6_write_to_mapped_unregistered_memory_lands() {
    write_to_unregistered(Lib::V0_3_6);
}

#[test]
fn v0_2_0_write_to_mapped_unregistered_memory_lands() {
    write_to_unregistered(Lib::V0_2_0);
}

#[test]
fn current_write_to_unregistered_memory_fails_untouched() {
    write_to_unregistered(Lib::Current);
}

#[test]
fn v0_3_6_write_to_unmapped_address_is_completed_and_dropped() {
    write_to_unmapped(Lib::V0_3_6);
}

#[test]
fn v0_2_0_write_to_unmapped_address_is_completed_and_dropped() {
    write_to_unmapped(Lib::V0_2_0);
}

#[test]
fn current_write_to_unmapped_address_fails() {
    write_to_unmapped(Lib::Current);
}

#[test]
fn v0_3_6_reads_are_served_without_an_address_check() {
    reads_outside_registered(Lib::V0_3_6);
}

#[test]
fn current_reads_outside_registered_memory_fail() {
    reads_outside_registered(Lib::Current);
}

/// Destroying an engine with landings still pending drops them, at once.
#[test]
fn v0_3_6_destroy_drops_pending_landings() {
    let gen = Lib::V0_3_6;
    let api = api(gen);
    let meta = Meta::new(gen);
    let src = Mem::new(1 << 20, 0x5A);
    let dst = Mem::new(1 << 20, OLD);
    let client = Engine::new(&api, &meta.url, "");
    let server = Engine::new(&api, &meta.url, "land_delay=60000");
    server.register(&dst);
    client.register(&src);
    let seg = client.open(&server);
    for _ in 0..3 {
        let st = client.transfer(WRITE, seg, &src, dst.addr(), src.len as u64);
        assert_eq!(st, COMPLETED, "{gen}: the write");
    }
    let t = Instant::now();
    drop(server);
    assert!(
        t.elapsed() < Duration::from_secs(20),
        "{gen}: destroy waited for the pending landings ({:?})",
        t.elapsed()
    );
    std::thread::sleep(Duration::from_millis(50));
    assert!(
        dst.to_vec().iter().all(|&b| b == OLD),
        "{gen}: a landing pending at destroy was applied"
    );
}

/// With at most 1 MiB of received payload held (`land_cap_mib=1`), an
/// 8 MiB WRITE lands in 1 MiB pieces, each after the previous one landed:
/// the sender waits (back-pressure), and the write completes, whole.
#[test]
fn v0_3_6_full_landing_queue_holds_the_sender_back() {
    let gen = Lib::V0_3_6;
    let api = api(gen);
    let meta = Meta::new(gen);
    let src = Mem::new(BIG, 0);
    src.fill_with(pattern);
    src.set(BIG - 1, NEW_LAST);
    let dst = Mem::new(BIG, OLD);
    let server = Engine::new(&api, &meta.url, "land_delay=100,land_cap_mib=1");
    let client = Engine::new(&api, &meta.url, "");
    server.register(&dst);
    client.register(&src);
    let seg = client.open(&server);
    let t = Instant::now();
    let st = client.transfer(WRITE, seg, &src, dst.addr(), BIG as u64);
    let took = t.elapsed();
    assert_eq!(st, COMPLETED, "{gen}: the write");
    // Seven pieces had to land (100 ms each) before the eighth was taken.
    assert!(
        took >= Duration::from_millis(650),
        "{gen}: the sender was not held back ({took:?})"
    );
    assert!(
        wait_for_byte(&dst, BIG - 1, NEW_LAST),
        "{gen}: never landed"
    );
    assert!(dst.to_vec() == src.to_vec(), "{gen}: the bytes");
}
