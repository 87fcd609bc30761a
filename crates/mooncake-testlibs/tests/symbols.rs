//! Each test library exports exactly its generation's symbols, and the
//! pre-v0.2.0 library really implements its own (older) ABI.

use std::ffi::{c_char, c_int, c_void, CString};

use mooncake_testlibs::{all_known_symbols, broken_library_path, library_path, Broken, Generation};

fn exported(path: &std::path::Path) -> Vec<&'static str> {
    // SAFETY: the test libraries have no initialisers with side effects.
    let lib = unsafe { libloading::Library::new(path) }.expect("load test library");
    all_known_symbols()
        .into_iter()
        .filter(|s| {
            // SAFETY: only the symbol's presence is checked; it is never called.
            unsafe { lib.get::<*const c_void>(s.as_bytes()) }.is_ok()
        })
        .collect()
}

#[test]
fn every_generation_exports_exactly_its_symbols() {
    for gen in Generation::ALL {
        assert_eq!(exported(&library_path(gen)), gen.symbols(), "{gen}");
    }
}

#[test]
fn broken_libraries_are_broken_as_described() {
    let missing = exported(&broken_library_path(Broken::MissingSubmitTransfer));
    let mut want = Generation::V0_3_0.symbols();
    want.retain(|s| *s != "submitTransfer");
    assert_eq!(missing, want);
    assert!(exported(&broken_library_path(Broken::NotMooncake)).is_empty());
}

#[repr(C)]
struct Req {
    opcode: c_int,
    source: *mut c_void,
    target_id: i32,
    target_offset: u64,
    length: u64,
}

#[repr(C)]
#[derive(Default)]
struct Status {
    status: c_int,
    transferred: u64,
}

type Create0 = unsafe extern "C" fn(*const c_char) -> *mut c_void;
type Init0 = unsafe extern "C" fn(*mut c_void, *const c_char, *const c_char, u64) -> c_int;
type Install0 = unsafe extern "C" fn(*mut c_void, *const c_char, *mut *mut c_void) -> *mut c_void;
type Reg = unsafe extern "C" fn(*mut c_void, *mut c_void, usize, *const c_char, c_int) -> c_int;
type Open = unsafe extern "C" fn(*mut c_void, *const c_char) -> i32;
type Alloc = unsafe extern "C" fn(*mut c_void, usize) -> u64;
type Submit = unsafe extern "C" fn(*mut c_void, u64, *mut Req, usize) -> c_int;
type GetStatus = unsafe extern "C" fn(*mut c_void, u64, usize, *mut Status) -> c_int;
type Free = unsafe extern "C" fn(*mut c_void, u64) -> c_int;
type Destroy = unsafe extern "C" fn(*mut c_void);

/// Drives the pre-v0.2.0 library through its own ABI (transport handle for
/// batches): two engines, a write between them, bytes checked.
#[test]
fn pre_v0_2_0_library_moves_bytes_through_its_own_abi() {
    let (dir, meta) = mooncake_testlibs::file_metadata("pre020");
    let path = library_path(Generation::PreV0_2_0);
    // SAFETY: loading the test library runs no initialisers.
    let lib = unsafe { libloading::Library::new(&path) }.unwrap();
    // SAFETY: (whole block) the declared types match the C definitions in
    // csrc/mooncake_testlib.c for TL_GEN=0; buffers outlive the engines.
    unsafe {
        let create: Create0 = *lib.get(b"createTransferEngine").unwrap();
        let init: Init0 = *lib.get(b"initTransferEngine").unwrap();
        let install: Install0 = *lib.get(b"installOrGetTransport").unwrap();
        let reg: Reg = *lib.get(b"registerLocalMemory").unwrap();
        let open: Open = *lib.get(b"openSegment").unwrap();
        let alloc: Alloc = *lib.get(b"allocateBatchID").unwrap();
        let submit: Submit = *lib.get(b"submitTransfer").unwrap();
        let status: GetStatus = *lib.get(b"getTransferStatus").unwrap();
        let free: Free = *lib.get(b"freeBatchID").unwrap();
        let destroy: Destroy = *lib.get(b"destroyTransferEngine").unwrap();

        let meta = CString::new(meta).unwrap();
        let host = CString::new("127.0.0.1").unwrap();
        let tcp = CString::new("tcp").unwrap();
        let cpu = CString::new("cpu:0").unwrap();
        let mut src = vec![7u8; 4096];
        let mut dst = vec![0u8; 4096];
        let a = create(meta.as_ptr());
        let b = create(meta.as_ptr());
        assert!(!a.is_null() && !b.is_null());
        let na = CString::new("pre-a").unwrap();
        let nb = CString::new("pre-b").unwrap();
        assert_eq!(init(a, na.as_ptr(), host.as_ptr(), 0), 0);
        assert_eq!(init(b, nb.as_ptr(), host.as_ptr(), 0), 0);
        let xa = install(a, tcp.as_ptr(), std::ptr::null_mut());
        assert!(!xa.is_null());
        assert!(!install(b, tcp.as_ptr(), std::ptr::null_mut()).is_null());
        assert_eq!(
            reg(a, src.as_mut_ptr().cast(), src.len(), cpu.as_ptr(), 1),
            0
        );
        assert_eq!(
            reg(b, dst.as_mut_ptr().cast(), dst.len(), cpu.as_ptr(), 1),
            0
        );
        let seg = open(a, nb.as_ptr());
        assert!(seg > 0, "openSegment returned {seg}");
        let batch = alloc(xa, 1);
        assert_ne!(batch, u64::MAX);
        let mut req = Req {
            opcode: 1,
            source: src.as_mut_ptr().cast(),
            target_id: seg,
            target_offset: dst.as_ptr() as u64 + 100,
            length: 1000,
        };
        assert_eq!(submit(xa, batch, &mut req, 1), 0);
        let mut st = Status::default();
        loop {
            assert_eq!(status(xa, batch, 0, &mut st), 0);
            if st.status >= 2 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert_eq!(st.status, 4, "completed");
        assert_eq!(free(xa, batch), 0);
        // Before v0.3.12 a completed write lands some time later (the TCP
        // transport does not wait for the peer): wait for its last byte,
        // which lands last, before destroying the engines.
        let last = dst.as_ptr().add(1099);
        let started = std::time::Instant::now();
        while last.read_volatile() != 7 {
            assert!(
                started.elapsed() < std::time::Duration::from_secs(30),
                "the write never landed"
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        destroy(a);
        destroy(b);
        assert!(dst[..100].iter().all(|&x| x == 0));
        assert!(dst[100..1100].iter().all(|&x| x == 7));
        assert!(dst[1100..].iter().all(|&x| x == 0));
    }
    let _ = std::fs::remove_dir_all(dir);
}
