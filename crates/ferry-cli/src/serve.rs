//! `ferry serve`: a target for cross-machine runs.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use ferry::{Engine, Location, RegisteredBuffer, TransferEngine};

use crate::bench::{redact, TARGET_SEED};
use crate::rawtcp::{self, SinkStats};
use crate::util::{count_changed, fill_pattern, human_bytes, parse_positive_size};

const EXAMPLES: &str = "\
Examples:
  # on the target machine (listen on an address the other machine can reach)
  ferry serve --backend tcp://10.0.0.2:7000 --size 256MiB --raw-listen 10.0.0.2:7001
  # it prints the command to run on the other machine, e.g.
  ferry bench --peer 10.0.0.2:7000 --remote-addr 0x7f3a5c000000 --remote-len 268435456 --raw-peer 10.0.0.2:7001
  # on one machine, for a try
  ferry serve --size 64MiB

The region is filled with a known pattern. serve prints every notification it
receives (ferry bench sends one per point), and on Ctrl-C (or SIGTERM) a summary:
notifications, bytes the peers reported, raw-TCP baseline streams, and how many
bytes of the region differ from the initial pattern.";

/// Arguments of `ferry serve`.
#[derive(clap::Args, Debug)]
#[command(after_help = EXAMPLES)]
pub struct ServeArgs {
    /// Backend URL; for TCP the address peers connect to (port 0 picks one).
    #[arg(long, default_value = "tcp://127.0.0.1:0")]
    backend: String,

    /// Bytes to register (e.g. 256MiB).
    #[arg(long, value_parser = parse_positive_size, default_value = "64MiB")]
    size: u64,

    /// Memory location of the region (Mooncake notation: cpu:0, *).
    #[arg(long, default_value = "cpu:0")]
    location: Location,

    /// Address for the raw-TCP baseline sink (default: the segment's host, any port,
    /// when the segment name is `host:port`; none otherwise);
    /// `off` to disable.
    #[arg(long)]
    raw_listen: Option<String>,
}

/// Runs `ferry serve` until Ctrl-C / SIGTERM.
pub async fn run(args: ServeArgs) -> anyhow::Result<()> {
    let engine = Arc::new(
        Engine::open(&args.backend)
            .await
            .with_context(|| format!("opening {}", redact(&args.backend)))?,
    );
    let size = usize::try_from(args.size).context("--size is too large for this machine")?;
    let buf = RegisteredBuffer::with_location(Arc::clone(&engine), size, args.location.clone())
        .await
        .with_context(|| {
            format!(
                "registering {} at {}",
                human_bytes(args.size),
                args.location
            )
        })?;
    fill_pattern(buf.memory(), TARGET_SEED)?;

    let segment = engine.segment_name().to_owned();
    let raw_listen = match args.raw_listen.as_deref() {
        Some("off") => None,
        Some(a) => Some(a.to_owned()),
        // Only where the segment name is an address (`host:port`); a name
        // registered with a metadata server says nothing about where to
        // listen (pass --raw-listen then).
        None => segment
            .rsplit_once(':')
            .filter(|(_, port)| port.parse::<u16>().is_ok())
            .map(|(host, _)| format!("{host}:0")),
    };
    let stats = Arc::new(SinkStats::default());
    let (raw_addr, sink) = match raw_listen {
        Some(a) => {
            let l = tokio::net::TcpListener::bind(&a)
                .await
                .with_context(|| format!("binding the raw-TCP sink on {a}"))?;
            let addr = l.local_addr()?.to_string();
            (
                Some(addr),
                Some(tokio::spawn(rawtcp::run_sink(l, Arc::clone(&stats)))),
            )
        }
        None => (None, None),
    };

    println!(
        "ferry serve: backend {}, segment {segment}",
        engine.kind().scheme()
    );
    println!(
        "region: addr {:#x} len {} ({}) location {}",
        buf.addr(),
        buf.len(),
        human_bytes(args.size),
        args.location
    );
    if let Some(a) = &raw_addr {
        println!("raw-TCP sink: {a}");
    }
    let mut cmd = format!(
        "ferry bench --peer {segment} --remote-addr {:#x} --remote-len {}",
        buf.addr(),
        buf.len()
    );
    if args.backend != "tcp://127.0.0.1:0" {
        cmd.push_str(&format!(" --backend '{}'", client_url(&args.backend)));
    }
    if let Some(a) = &raw_addr {
        cmd.push_str(&format!(" --raw-peer {a}"));
    }
    println!("drive it with: {cmd}");
    let notify = engine.capabilities().notify;
    if !notify {
        println!(
            "note: this backend cannot receive notifications; only region changes are reported"
        );
    }
    println!("serving until Ctrl-C");

    let mut received = Received::default();
    let stop = shutdown_signal();
    tokio::pin!(stop);
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    loop {
        tokio::select! {
            r = &mut stop => { r?; break; }
            _ = tick.tick(), if notify => received.drain(&engine).await?,
        }
    }
    // What arrived since the last poll.
    if notify {
        received.drain(&engine).await?;
    }
    let Received {
        notes,
        written,
        read,
    } = received;
    if let Some(s) = sink {
        s.abort();
    }
    let changed = count_changed(buf.memory(), TARGET_SEED)?;
    println!(
        "received: {notes} notifications; peers reported {} written and {} read; \
         raw-TCP sink: {} streams, {}; region: {changed} of {} bytes differ from the initial pattern",
        human_bytes(written),
        human_bytes(read),
        stats.streams.load(Ordering::Relaxed),
        human_bytes(stats.bytes.load(Ordering::Relaxed)),
        buf.len()
    );
    buf.release().await.context("unregistering the region")?;
    Ok(())
}

/// Notifications seen so far and the byte counts peers reported in them.
#[derive(Debug, Default)]
struct Received {
    notes: u64,
    written: u64,
    read: u64,
}

impl Received {
    /// Takes the notifications that arrived, prints and counts them.
    async fn drain(&mut self, engine: &Engine) -> anyhow::Result<()> {
        for n in engine
            .take_notifications()
            .await
            .context("taking notifications")?
        {
            self.notes += 1;
            println!("notification from {}: {}", n.name, n.message);
            if let Some(bytes) = field(&n.message, "bytes") {
                if n.message.starts_with("write") {
                    self.written += bytes;
                } else if n.message.starts_with("read") {
                    self.read += bytes;
                }
            }
        }
        Ok(())
    }
}

/// The URL the bench's own engine would use: for TCP any address and port
/// with the same parameters; for Mooncake the same parameters without the
/// server's own identity (`name=`, `port=`: a second engine with the
/// server's name would overwrite its metadata entry, and on v0.2.0-era
/// builds a clash on its port aborts the process); secrets are shown as `…`
/// for the user to fill.
fn client_url(url: &str) -> String {
    let redacted = redact(url);
    if let Some(rest) = redacted.strip_prefix("tcp://") {
        return match rest.split_once('?') {
            Some((_, q)) => format!("tcp://0.0.0.0:0?{q}"),
            None => "tcp://0.0.0.0:0".to_owned(),
        };
    }
    if let Some((base, query)) = redacted.split_once('?') {
        if base.starts_with("mooncake:") {
            let kept: Vec<&str> = query
                .split('&')
                .filter(|kv| {
                    let key = kv.split_once('=').map_or(*kv, |(k, _)| k);
                    key != "name" && key != "port"
                })
                .collect();
            return if kept.is_empty() {
                base.to_owned()
            } else {
                format!("{base}?{}", kept.join("&"))
            };
        }
    }
    redacted
}

/// `key=N` in a space-separated message.
fn field(message: &str, key: &str) -> Option<u64> {
    message
        .split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('=')?.parse().ok())
}

async fn shutdown_signal() -> anyhow::Result<()> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate()).context("installing a SIGTERM handler")?;
        tokio::select! {
            r = tokio::signal::ctrl_c() => r.context("waiting for Ctrl-C")?,
            _ = term.recv() => {}
        }
        Ok(())
    }
    #[cfg(not(unix))]
    {
        tokio::signal::ctrl_c().await.context("waiting for Ctrl-C")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn helpers() {
        assert_eq!(
            client_url("tcp://10.0.0.2:7000?secret=x"),
            "tcp://0.0.0.0:0?secret=…"
        );
        assert_eq!(client_url("tcp://10.0.0.2:7000"), "tcp://0.0.0.0:0");
        // The server's own name and port never go into the client's URL.
        assert_eq!(
            client_url("mooncake://?lib=/l.so&metadata=http://m:8080/metadata&name=srv&port=15000"),
            "mooncake://?lib=/l.so&metadata=http://m:8080/metadata"
        );
        assert_eq!(client_url("mooncake://?name=srv"), "mooncake://");
        assert_eq!(field("write block=4096 bytes=123", "bytes"), Some(123));
        assert_eq!(field("write block=4096", "bytes"), None);
    }
}
