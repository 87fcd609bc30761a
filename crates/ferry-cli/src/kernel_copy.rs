//! The kernel's cross-memory copy with no engine around it, for `ferry
//! bench --same-host`: the ceiling of the same-host path.

use std::io::IoSliceMut;
use std::time::{Duration, Instant};

use nix::sys::uio::{process_vm_readv, RemoteIoVec};
use nix::unistd::Pid;

/// One `process_vm_readv` of `block` bytes from `remote` in process `pid`
/// into a local buffer, repeated slot after slot through `span` bytes (at
/// least one block) on both sides for `duration` or `total` bytes; GB/s.
/// `Err(errno)` if the kernel refuses or moves nothing.
pub fn kernel_copy_gbps(
    pid: i32,
    remote: u64,
    block: usize,
    span: usize,
    duration: Duration,
    total: u64,
) -> Result<f64, nix::errno::Errno> {
    let block = block.max(1);
    let slots = (span / block).max(1);
    let mut local = vec![1u8; slots * block];
    let start = Instant::now();
    let mut copied = 0u64;
    let mut slot = 0;
    while copied < total && (copied == 0 || start.elapsed() < duration) {
        let off = slot * block;
        let mut done = 0;
        while done < block {
            let mut into = [IoSliceMut::new(&mut local[off + done..off + block])];
            let from = [RemoteIoVec {
                base: remote as usize + off + done,
                len: block - done,
            }];
            match process_vm_readv(Pid::from_raw(pid), &mut into, &from)? {
                0 => return Err(nix::errno::Errno::EFAULT),
                n => done += n,
            }
        }
        copied += block as u64;
        slot = (slot + 1) % slots;
    }
    std::hint::black_box(&local);
    Ok(copied as f64 / start.elapsed().as_secs_f64() / 1e9)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_from_this_process_and_names_the_refusal() {
        let src = vec![7u8; 1 << 16];
        let g = kernel_copy_gbps(
            std::process::id() as i32,
            src.as_ptr() as u64,
            4096,
            src.len(),
            Duration::from_millis(5),
            1 << 20,
        )
        .expect("a copy from this very process");
        assert!(g > 0.0);
        let e = kernel_copy_gbps(
            std::process::id() as i32,
            8,
            4096,
            4096,
            Duration::from_millis(1),
            4096,
        )
        .unwrap_err();
        assert_eq!(e, nix::errno::Errno::EFAULT);
        assert_eq!(format!("{e:?}"), "EFAULT");
    }
}
