//! Tests that need a second process: a peer engine in another process (the
//! backend cannot see its regions, so the library's own checks apply), and
//! the library resolution order (environment variable, loader search path),
//! which must not disturb the environment of other tests.
//!
//! The `child_*` tests are helpers the parent tests run in a child process
//! (`--ignored --exact`); run on their own they do nothing useful.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};

use common::{metadata_for, start, start_engine};
use ferry_core::{Error, HostBuffer, Location, MemoryRegion, TransferEngine, TransferRequest};
use ferry_mooncake::{MooncakeConfig, LIBRARY_ENV};
use mooncake_testlibs::{library_path, Generation as Lib};

/// Prints a skip notice past the test harness's output capture (which hides
/// `println!` of passing tests), so a skip never looks like a silent pass.
macro_rules! skip_line {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr().lock(), $($arg)*);
    }};
}

const CHILD_LIB: &str = "FERRY_MC_TEST_CHILD_LIB";
const CHILD_META: &str = "FERRY_MC_TEST_CHILD_META";
const BUF: usize = 64 << 10;

fn child(test: &str) -> Command {
    let mut c = Command::new(std::env::current_exe().expect("test binary path"));
    c.args([
        "--ignored",
        "--exact",
        "--nocapture",
        "--test-threads",
        "1",
        test,
    ]);
    c
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

fn pattern(i: usize) -> u8 {
    (i % 253) as u8
}

/// Child: a peer engine with one 64 KiB region filled with `pattern`,
/// followed by 64 KiB of its own memory it does not register; prints
/// `READY <segment> <addr>`, then answers `DUMP` with both in hex and exits
/// on `QUIT` or end of input.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "helper: run in a child process by cross_process_peer_*"]
async fn child_peer() {
    let Ok(lib) = std::env::var(CHILD_LIB) else {
        // Not a test of its own: only cross_process_peer_* run it, as a child.
        return;
    };
    let meta = std::env::var(CHILD_META).unwrap_or_else(|_| "P2PHANDSHAKE".into());
    let engine = start_engine({
        let mut config = MooncakeConfig::default();
        config.library = Some(lib.into());
        config.metadata = meta.clone();
        config.name =
            (meta != "P2PHANDSHAKE").then(|| format!("child-peer-{}", std::process::id()));
        config
    })
    .await
    .expect("child engine");
    // Twice BUF allocated, the first half registered: the second half is
    // mapped memory of this process that no engine registered, where old
    // builds' unchecked writes land harmlessly (and visibly in DUMP).
    let buf = HostBuffer::new(2 * BUF).unwrap();
    let data: Vec<u8> = (0..BUF).map(pattern).collect();
    buf.write(0, &data).unwrap();
    // SAFETY: `buf` lives until after the unregister at the end.
    let region = unsafe { MemoryRegion::from_raw_parts(buf.as_ptr(), BUF, Location::cpu(0)) };
    engine.register(region).await.unwrap();
    println!("READY {} {}", engine.segment_name(), buf.addr());
    let stdin = std::io::stdin();
    for line in stdin.lock().lines() {
        match line.as_deref().map(str::trim) {
            Ok("DUMP") => println!("DUMP {}", hex(&buf.to_vec())),
            _ => break,
        }
    }
    engine.unregister(buf.addr()).await.unwrap();
}

struct Peer {
    proc: Child,
    out: BufReader<std::process::ChildStdout>,
    segment: String,
    addr: u64,
}

impl Drop for Peer {
    fn drop(&mut self) {
        // A failed assertion must not leave the child running.
        if matches!(self.proc.try_wait(), Ok(None)) {
            let _ = self.proc.kill();
            let _ = self.proc.wait();
        }
    }
}

impl Peer {
    // The child is waited on by `quit`, or killed and waited on by `Drop`
    // (an early panic before `Peer` exists ends the test binary, which the
    // child notices as end of input).
    #[allow(clippy::zombie_processes)]
    fn spawn(gen: Lib, metadata: &str) -> Peer {
        let mut proc = child("child_peer")
            .env(CHILD_LIB, library_path(gen))
            .env(CHILD_META, metadata)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn the child peer");
        let mut out = BufReader::new(proc.stdout.take().unwrap());
        let mut line = String::new();
        loop {
            line.clear();
            assert!(out.read_line(&mut line).unwrap() > 0, "child exited early");
            // libtest may have printed "test child_peer ... " on this line.
            if let Some(rest) = line.find("READY ").map(|i| &line[i + 6..]) {
                let mut it = rest.split_whitespace();
                let segment = it.next().unwrap().to_owned();
                let addr = it.next().unwrap().parse().unwrap();
                return Peer {
                    proc,
                    out,
                    segment,
                    addr,
                };
            }
        }
    }

    fn dump(&mut self) -> Vec<u8> {
        writeln!(self.proc.stdin.as_mut().unwrap(), "DUMP").unwrap();
        let mut line = String::new();
        loop {
            line.clear();
            assert!(self.out.read_line(&mut line).unwrap() > 0, "child exited");
            if let Some(h) = line.find("DUMP ").map(|i| line[i + 5..].trim()) {
                return unhex(h);
            }
        }
    }

    fn quit(mut self) {
        writeln!(self.proc.stdin.as_mut().unwrap(), "QUIT").unwrap();
        self.proc.stdin.take();
        let status = self.proc.wait().unwrap();
        assert!(status.success(), "child peer failed: {status}");
    }
}

async fn cross_process(gen: Lib) {
    let metadata = metadata_for(gen);
    let mut peer = Peer::spawn(gen, &metadata);
    let a = start(gen, &metadata).await;
    let local = HostBuffer::new(BUF).unwrap();
    // SAFETY: the buffer outlives its registration (unregistered before the test ends).
    a.register(unsafe { local.region(Location::cpu(0)) })
        .await
        .unwrap();
    let seg = a.open_segment(&peer.segment).await.unwrap();

    // Read the peer's bytes, then write some of ours back.
    a.transfer(
        seg,
        TransferRequest::read(local.addr(), peer.addr, BUF as u64),
    )
    .await
    .unwrap();
    let want: Vec<u8> = (0..BUF).map(pattern).collect();
    assert_eq!(local.to_vec(), want, "{gen}: bytes read across processes");
    local.fill(0xA5);
    a.transfer(
        seg,
        TransferRequest::write(local.addr(), peer.addr + 8192, 4096),
    )
    .await
    .unwrap();

    // An address the peer has not registered: the backend cannot know the
    // peer's regions, so the library decides.
    let outside = TransferRequest::write(local.addr(), peer.addr + BUF as u64 + 4096, 64);
    let r = a.transfer(seg, outside).await;
    let mut expect = want.clone();
    expect[8192..12288].fill(0xA5);
    expect.resize(2 * BUF, 0);
    if gen.has_old_tcp_transport() {
        // Builds before v0.3.12 check no address at the peer: the write
        // lands in memory the peer never registered (the capability report
        // says `peer_validation: no`), and Ferry's confirmation sees it land.
        assert_eq!(r, Ok(()), "{gen}: an unchecked write outside the region");
        expect[BUF + 4096..BUF + 4096 + 64].fill(0xA5);
    } else {
        match r {
            Err(Error::TransferFailed {
                status, peer: p, ..
            }) => {
                assert_eq!(status, "FAILED (6)", "{gen}");
                assert_eq!(p, peer.segment, "{gen}");
            }
            other => panic!("{gen}: expected the library to fail it, got {other:?}"),
        }
    }
    assert_eq!(peer.dump(), expect, "{gen}: the peer's memory");
    a.close_segment(seg).await.unwrap();
    a.unregister(local.addr()).await.unwrap();
    peer.quit();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cross_process_peer_current() {
    cross_process(Lib::Current).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cross_process_peer_v0_3_0() {
    cross_process(Lib::V0_3_0).await;
}

/// v0.2.0 has no P2PHANDSHAKE: both processes use the test libraries'
/// `file://` metadata directory, and the segment name is the child's
/// `local_server_name`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cross_process_peer_v0_2_0_with_a_metadata_service() {
    cross_process(Lib::V0_2_0).await;
}

/// Child: starts an engine with no library in the config and prints where
/// the library came from, or the error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "helper: run in a child process by library_resolution_order"]
async fn child_resolve() {
    match start_engine(MooncakeConfig::default()).await {
        Ok(e) => println!(
            "RESOLVED {} | {} | {}",
            e.library().path().display(),
            e.library().source(),
            e.generation()
        ),
        Err(err) => println!("FAILED {err}"),
    }
}

fn resolve_in_child(env: Option<&std::path::Path>, ld_path: &std::path::Path) -> String {
    let mut c = child("child_resolve");
    c.env_remove(LIBRARY_ENV).env("LD_LIBRARY_PATH", ld_path);
    if let Some(p) = env {
        c.env(LIBRARY_ENV, p);
    }
    let out = c.output().expect("run child_resolve");
    assert!(out.status.success(), "child_resolve failed: {out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    // libtest may have printed "test child_resolve ... " on the same line.
    text.lines()
        .find_map(|l| {
            l.find("RESOLVED ")
                .or_else(|| l.find("FAILED "))
                .map(|i| l[i..].to_owned())
        })
        .unwrap_or_else(|| panic!("no result line from the child: {out:?}"))
}

#[test]
fn library_resolution_order() {
    let dir = std::env::temp_dir().join(format!("ferry-mc-ld-{}", std::process::id()));
    let empty = dir.join("empty");
    let with_lib = dir.join("with-lib");
    std::fs::create_dir_all(&empty).unwrap();
    std::fs::create_dir_all(&with_lib).unwrap();
    let link = with_lib.join("libtransfer_engine.so");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(library_path(Lib::V0_3_5), &link).unwrap();

    // 2. The environment variable wins over the loader search path.
    let v036 = library_path(Lib::V0_3_6);
    assert_eq!(
        resolve_in_child(Some(&v036), &with_lib),
        format!(
            "RESOLVED {} | environment variable FERRY_MOONCAKE_LIB | v0.3.6",
            v036.display()
        )
    );
    // 3. Without it, libtransfer_engine.so through the loader search path.
    assert_eq!(
        resolve_in_child(None, &with_lib),
        format!(
            "RESOLVED {} | dynamic loader search path | v0.3.5",
            link.display()
        )
    );
    // Nothing found: the backend is unavailable and says what it tried.
    let got = resolve_in_child(None, &empty);
    if got.starts_with("RESOLVED ") {
        skip_line!("skipped: nothing-found case: this machine has a libtransfer_engine.so ({got})");
    } else {
        assert!(
            got.starts_with("FAILED the mooncake backend is unavailable: cannot load libtransfer_engine.so (from the dynamic loader search path)"),
            "{got}"
        );
        assert!(got.contains("FERRY_MOONCAKE_LIB"), "{got}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
