//! Moves a buffer between two engines, on one machine or two.
//!
//! ```text
//! # machine B (10.0.0.2): serve a 256 MiB buffer
//! cargo run --release -p ferry-tcp --example demo -- serve 'tcp://10.0.0.2:7000?secret=s3cret' 268435456
//! #   prints: segment 10.0.0.2:7000 buffer 0x7f12a4000000 len 268435456
//! # machine A (10.0.0.1): write 256 MiB into it, notify, read it back, verify
//! cargo run --release -p ferry-tcp --example demo -- send 'tcp://10.0.0.1:0?secret=s3cret' 10.0.0.2:7000 0x7f12a4000000 268435456
//! ```

use std::time::{Duration, Instant};

use ferry_core::{HostBuffer, Location, Notification, TransferEngine, TransferRequest};
use ferry_tcp::{TcpConfig, TcpEngine};

fn usage() -> ! {
    eprintln!("usage: demo serve URL LEN | demo send URL PEER_HOST:PORT REMOTE_ADDR LEN");
    std::process::exit(2)
}

fn parse_u64(s: &str) -> u64 {
    let r = match s.strip_prefix("0x") {
        Some(h) => u64::from_str_radix(h, 16),
        None => s.parse(),
    };
    r.unwrap_or_else(|_| usage())
}

fn checksum(b: &HostBuffer) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    b.to_vec().hash(&mut h);
    h.finish()
}

#[tokio::main]
async fn main() -> ferry_core::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("serve") if args.len() == 3 => {
            let engine = TcpEngine::start(TcpConfig::from_url(&args[1])?).await?;
            let buf = HostBuffer::new(parse_u64(&args[2]) as usize)?;
            engine
                // SAFETY: the buffer outlives its registration (unregistered before it is dropped).
                .register(unsafe { buf.region(Location::cpu(0)) })
                .await?;
            println!(
                "segment {} buffer {:#x} len {}",
                engine.segment_name(),
                buf.addr(),
                buf.len()
            );
            loop {
                for n in engine.take_notifications().await? {
                    println!(
                        "notification {}: {} (buffer checksum {:#018x})",
                        n.name,
                        n.message,
                        checksum(&buf)
                    );
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        Some("send") if args.len() == 5 => {
            let engine = TcpEngine::start(TcpConfig::from_url(&args[1])?).await?;
            let remote = parse_u64(&args[3]);
            let len = parse_u64(&args[4]) as usize;
            let src = HostBuffer::new(len)?;
            let pattern: Vec<u8> = (0..len).map(|i| (i * 7 + i / 4096) as u8).collect();
            src.write(0, &pattern)?;
            let back = HostBuffer::new(len)?;
            engine
                // SAFETY: the buffer outlives its registration (unregistered before it is dropped).
                .register(unsafe { src.region(Location::cpu(0)) })
                .await?;
            engine
                // SAFETY: the buffer outlives its registration (unregistered before it is dropped).
                .register(unsafe { back.region(Location::cpu(0)) })
                .await?;
            let seg = engine.open_segment(&args[2]).await?;
            let block = 4 << 20;
            let reqs: Vec<TransferRequest> = (0..len.div_ceil(block))
                .map(|i| {
                    let off = (i * block) as u64;
                    let n = block.min(len - i * block) as u64;
                    TransferRequest::write(src.addr() + off, remote + off, n)
                })
                .collect();
            let t = Instant::now();
            let note = Notification::new(engine.segment_name(), format!("{len} bytes written"));
            engine
                .batch_transfer(seg, &reqs, Some(&note))
                .await?
                .into_result()?;
            let d = t.elapsed();
            println!(
                "wrote {len} bytes in {d:?} ({:.2} GB/s)",
                len as f64 / d.as_secs_f64() / 1e9
            );
            let reads: Vec<TransferRequest> = reqs
                .iter()
                .map(|r| {
                    TransferRequest::read(
                        back.addr() + (r.local_addr - src.addr()),
                        r.remote_addr,
                        r.len,
                    )
                })
                .collect();
            engine
                .batch_transfer(seg, &reads, None)
                .await?
                .into_result()?;
            let ok = back.to_vec() == pattern;
            println!(
                "read back and verified: {}",
                if ok { "identical" } else { "MISMATCH" }
            );
            engine.unregister(src.addr()).await?;
            engine.unregister(back.addr()).await?;
            if !ok {
                std::process::exit(1);
            }
            Ok(())
        }
        _ => usage(),
    }
}
