//! `ferry serve`: a target for cross-machine runs.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use ferry::raw::ParsedUrl;
use ferry::registry::OpenOptions;
use ferry::{Engine, Location, RegisteredBuffer, TransferEngine};

use crate::bench::TARGET_SEED;
use crate::rawtcp::{self, SinkStats};
use crate::util::{count_changed, fill_pattern, human_bytes, parse_positive_size};

const EXAMPLES: &str = "\
Examples:
  # on the target machine (listen on an address the other machine can reach;
  # the secret comes from a file or FERRY_SECRET, never the command line)
  FERRY_SECRET=s3cret ferry serve --backend tcp://10.0.0.2:7000 --size 256MiB
  ferry serve --backend tcp://10.0.0.2:7000 --secret-file /etc/ferry/secret --size 256MiB
  # with the raw-TCP baseline sink (off by default; unauthenticated: trusted
  # networks only)
  ferry serve --backend tcp://10.0.0.2:7000 --size 256MiB --raw-listen 10.0.0.2:7001
  # it prints the command to run on the other machine, e.g.
  ferry bench --peer 10.0.0.2:7000 --remote-addr 0x7f3a5c000000 --remote-len 268435456 --raw-peer 10.0.0.2:7001
  # TLS 1.3 (identity derived from the secret; or --tls-cert/--tls-key/--tls-ca)
  FERRY_SECRET=s3cret ferry serve --backend tcp://10.0.0.2:7000 --tls require
  # on one machine, for a try
  ferry serve --size 64MiB

The region is filled with a known pattern. serve prints the notifications it
receives (ferry bench sends one per point; at most 20 a second are shown, peer
text escaped), and on Ctrl-C (or SIGTERM) a summary: notifications, bytes the
peers reported, raw-TCP baseline streams, and how many bytes of the region
differ from the initial pattern. A second Ctrl-C / SIGTERM exits at once.";

/// Most notifications printed per second; the rest are counted.
const PRINTED_PER_SECOND: u32 = 20;

/// Longest notification text printed (characters); longer ones are cut.
const PRINTED_CHARS: usize = 200;

/// How long unregistering the region may take after a stop signal. The TCP
/// backend bounds it by its payload deadlines (stall + 64 MiB / min_rate);
/// this is a last resort for any backend.
const RELEASE_BOUND: Duration = Duration::from_secs(60);

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

    /// Address for the raw-TCP baseline sink (`host:port`; port 0 picks
    /// one). Off by default: the sink has no authentication (it only counts
    /// bytes; at most 8 streams, each dropped after 10 s without data), so
    /// enable it on trusted networks only. `off` is accepted too.
    #[arg(long)]
    raw_listen: Option<String>,

    #[command(flatten)]
    secret: crate::util::SecretArgs,

    /// Serve on an address other hosts can reach without a secret (TCP
    /// backend) or without authentication at all (NIXL's metadata
    /// listener): anyone who can reach the port can then read and write
    /// the served region. Without it such a `serve` refuses to start.
    #[arg(long)]
    insecure: bool,

    /// Serve the engine's metrics at `http://ADDR/metrics` (Prometheus
    /// text exposition; port 0 picks one, printed at start). Off by
    /// default; the endpoint has no authentication (it reveals peers'
    /// names and traffic, nothing else).
    #[arg(long, value_name = "ADDR")]
    metrics_listen: Option<String>,

    #[command(flatten)]
    tls: TlsArgs,
}

/// TLS 1.3 settings of the TCP backend (`ferry serve`, `ferry caps`),
/// added to its parsed URL as `tls=`, `tls_cert=`, `tls_key=`, `tls_ca=`.
#[derive(clap::Args, Debug, Default)]
pub struct TlsArgs {
    /// TLS 1.3 on the TCP socket path: `off`, `on` (with every peer that
    /// has it on, in clear with the others) or `require` (refuse peers
    /// without it). Without --tls-cert/--tls-key/--tls-ca the identity is
    /// derived from the shared secret. The same-host path is never
    /// encrypted (it does not leave the machine).
    #[arg(long, value_name = "MODE", value_parser = ["off", "on", "require"])]
    tls: Option<String>,

    /// PEM certificate chain this engine presents (with --tls-key, --tls-ca).
    #[arg(long, value_name = "PATH", requires = "tls")]
    tls_cert: Option<PathBuf>,

    /// PEM private key of --tls-cert.
    #[arg(long, value_name = "PATH", requires = "tls")]
    tls_key: Option<PathBuf>,

    /// PEM CA certificates the peer's chain must chain to (checked in both
    /// directions: mutual authentication).
    #[arg(long, value_name = "PATH", requires = "tls")]
    tls_ca: Option<PathBuf>,
}

impl TlsArgs {
    /// Adds these settings to `url` (an error if the URL sets them too,
    /// or is not a tcp URL).
    pub fn apply(&self, url: &mut ParsedUrl) -> anyhow::Result<()> {
        let Some(mode) = &self.tls else {
            return Ok(());
        };
        if url.scheme() != "tcp" {
            bail!("--tls applies to the tcp backend only");
        }
        if url.keys().any(|k| k.starts_with("tls")) {
            bail!("the backend URL already has TLS settings; give them one way only");
        }
        url.insert("tls", mode)?;
        for (k, p) in [
            ("tls_cert", &self.tls_cert),
            ("tls_key", &self.tls_key),
            ("tls_ca", &self.tls_ca),
        ] {
            if let Some(p) = p {
                let p = p
                    .to_str()
                    .with_context(|| format!("--{} is not UTF-8", k.replace('_', "-")))?;
                url.insert(k, p)?;
            }
        }
        Ok(())
    }
}

/// A backend URL with every secret hidden, for messages (the one
/// redaction every parser uses: `ferry_core::raw::redact_url`).
pub fn redact_url(url: &str) -> String {
    ferry::raw::redact_url(url)
}

/// Runs `ferry serve` until Ctrl-C / SIGTERM.
pub async fn run(args: ServeArgs) -> anyhow::Result<()> {
    // Signals first, so that none is lost while starting.
    let mut stop = stop_signals()?;
    // The URL is parsed once; what the flags add goes into the parsed URL.
    let mut url = crate::util::backend_url(&args.backend, &args.secret)?;
    args.tls.apply(&mut url)?;
    if args.insecure && matches!(url.scheme(), "tcp" | "nixl") {
        url.insert("insecure", "1")?;
    }
    let shown = url.shown().to_owned();
    let client = client_url(&url);
    let secured = ferry::secret::url_has_secret(&url);
    let engine = Arc::new(
        Engine::open_parsed(url, OpenOptions::default())
            .await
            .with_context(|| format!("opening {shown}"))?,
    );
    let metrics_addr = match &args.metrics_listen {
        Some(addr) => {
            Some(crate::metrics_http::start(addr, ferry::Metrics::global().clone()).await?)
        }
        None => None,
    };
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
        Some("off") | None => None,
        Some(a) => Some(a.to_owned()),
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
        engine.scheme()
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
    if let Some(a) = metrics_addr {
        println!("metrics: http://{a}/metrics");
    }
    let mut cmd = format!(
        "{}ferry bench --peer {segment} --remote-addr {:#x} --remote-len {}",
        if secured {
            "FERRY_SECRET=<the same secret> "
        } else {
            ""
        },
        buf.addr(),
        buf.len()
    );
    if client != "tcp://127.0.0.1:0" {
        cmd.push_str(&format!(" --backend '{client}'"));
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
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    loop {
        tokio::select! {
            _ = &mut stop => break,
            _ = tick.tick(), if notify => received.drain(&engine).await?,
        }
    }
    // What arrived since the last poll.
    if notify {
        received.drain(&engine).await?;
    }
    received.flush_hidden();
    let Received {
        notes,
        written,
        read,
        ..
    } = received;
    if let Some(s) = sink {
        s.abort();
    }
    let changed = count_changed(buf.memory(), TARGET_SEED)?;
    println!(
        "received: {notes} notifications; peers reported {} written and {} read; \
         raw-TCP sink: {} streams, {}; region: {changed} of {} bytes differ from the initial pattern",
        reported(written),
        reported(read),
        stats.streams.load(Ordering::Relaxed),
        human_bytes(stats.bytes.load(Ordering::Relaxed)),
        buf.len()
    );
    // Bounded: in-flight payloads into the region finish or are cut at the
    // backend's minimum rate; a second signal exits at once meanwhile.
    match tokio::time::timeout(RELEASE_BOUND, buf.release()).await {
        Ok(r) => r.context("unregistering the region")?,
        Err(_) => bail!(
            "unregistering the region did not finish within {RELEASE_BOUND:?}; exiting anyway"
        ),
    }
    Ok(())
}

/// A byte count a peer reported (saturating; peers can claim anything).
fn reported(n: u64) -> String {
    if n == u64::MAX {
        "at least 16 EiB (saturated)".to_owned()
    } else {
        human_bytes(n)
    }
}

/// Text from a peer, made safe to print: control characters (newlines,
/// escape sequences) and bidirectional or invisible formatting characters
/// are escaped, and long text is cut to `max` characters.
fn printable(s: &str, max: usize) -> String {
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i == max {
            out.push_str(&format!("… ({} bytes)", s.len()));
            break;
        }
        let hidden = matches!(c, '\u{200B}'..='\u{200F}' | '\u{202A}'..='\u{202E}' | '\u{2066}'..='\u{2069}' | '\u{FEFF}');
        if c.is_control() || c == '\\' || hidden {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

/// Notifications seen so far and the byte counts peers reported in them
/// (all saturating: peers control them).
#[derive(Debug)]
struct Received {
    notes: u64,
    written: u64,
    read: u64,
    /// Start of the current one-second printing window.
    window: Instant,
    /// Notifications printed in it.
    printed: u32,
    /// Notifications not printed since the last notice.
    hidden: u64,
}

impl Default for Received {
    fn default() -> Self {
        Received {
            notes: 0,
            written: 0,
            read: 0,
            window: Instant::now(),
            printed: 0,
            hidden: 0,
        }
    }
}

impl Received {
    /// Takes the notifications that arrived, prints (at most
    /// [`PRINTED_PER_SECOND`]) and counts them.
    async fn drain(&mut self, engine: &Engine) -> anyhow::Result<()> {
        let batch = engine
            .take_notifications()
            .await
            .context("taking notifications")?;
        for n in batch {
            self.notes = self.notes.saturating_add(1);
            if self.window.elapsed() >= Duration::from_secs(1) {
                self.flush_hidden();
                self.window = Instant::now();
                self.printed = 0;
            }
            if self.printed < PRINTED_PER_SECOND {
                self.printed += 1;
                println!(
                    "notification from {}: {}",
                    printable(&n.name, PRINTED_CHARS),
                    printable(&n.message, PRINTED_CHARS)
                );
            } else {
                self.hidden += 1;
            }
            if let Some(bytes) = field(&n.message, "bytes") {
                if n.message.starts_with("write") {
                    self.written = self.written.saturating_add(bytes);
                } else if n.message.starts_with("read") {
                    self.read = self.read.saturating_add(bytes);
                }
            }
        }
        Ok(())
    }

    /// Says how many notifications were not printed, if any.
    fn flush_hidden(&mut self) {
        if self.hidden > 0 {
            println!(
                "({} more notifications not shown; at most {PRINTED_PER_SECOND} a second are)",
                self.hidden
            );
            self.hidden = 0;
        }
    }
}

/// The URL the bench's own engine would use: for TCP any address and port
/// with the same parameters; for Mooncake the same parameters without the
/// server's own identity (`name=`, `port=`: a second engine with the
/// server's name would overwrite its metadata entry, and on v0.2.0-era
/// builds a clash on its port aborts the process); for NIXL likewise (the
/// port is the server's metadata listener, the name its agent's); secrets
/// are shown as `…` for the user to fill.
fn client_url(url: &ParsedUrl) -> String {
    let (base, left_out): (String, &[&str]) = match url.scheme() {
        // The bench's engine only dials out: loopback (no secret needed
        // for its own listener).
        "tcp" => ("tcp://127.0.0.1:0".to_owned(), &[]),
        s @ ("mooncake" | "nixl") => (format!("{s}://"), &["name", "port"]),
        s => (format!("{s}://{}", url.authority()), &[]),
    };
    // The secret is never printed: the bench takes it as serve does
    // (`ferry::secret`).
    let kept: Vec<String> = url
        .shown_params()
        .filter(|(key, _)| {
            !left_out.contains(key)
                && !key.eq_ignore_ascii_case("secret")
                && !key.eq_ignore_ascii_case(ferry::secret::SECRET_FILE_KEY)
        })
        .map(|(_, pair)| pair)
        .collect();
    if kept.is_empty() {
        base
    } else {
        format!("{base}?{}", kept.join("&"))
    }
}

/// `key=N` in a space-separated message.
fn field(message: &str, key: &str) -> Option<u64> {
    message
        .split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('=')?.parse().ok())
}

/// Resolves on the first SIGINT (Ctrl-C) or SIGTERM; a second one exits
/// the process at once (status 130).
fn stop_signals() -> anyhow::Result<tokio::sync::oneshot::Receiver<()>> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate()).context("installing a SIGTERM handler")?;
        let mut int = signal(SignalKind::interrupt()).context("installing a SIGINT handler")?;
        tokio::spawn(async move {
            let mut tx = Some(tx);
            loop {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = int.recv() => {}
                }
                match tx.take() {
                    Some(tx) => {
                        eprintln!("ferry serve: stopping (signal again to exit at once)");
                        let _ = tx.send(());
                    }
                    None => {
                        eprintln!("ferry serve: second signal, exiting now");
                        std::process::exit(130);
                    }
                }
            }
        });
    }
    #[cfg(not(unix))]
    {
        tokio::spawn(async move {
            if tokio::signal::ctrl_c().await.is_ok() {
                let _ = tx.send(());
            }
            if tokio::signal::ctrl_c().await.is_ok() {
                std::process::exit(130);
            }
        });
    }
    Ok(rx)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn client(url: &str) -> String {
        client_url(&ParsedUrl::parse(url).unwrap())
    }

    #[test]
    fn helpers() {
        assert_eq!(
            client("tcp://10.0.0.2:7000?secret=x&connections=2"),
            "tcp://127.0.0.1:0?connections=2"
        );
        assert_eq!(client("tcp://10.0.0.2:7000"), "tcp://127.0.0.1:0");
        // The server's own name and port never go into the client's URL.
        assert_eq!(
            client("mooncake://?lib=/l.so&metadata=http://m:8080/metadata&name=srv&port=15000"),
            "mooncake://?lib=/l.so&metadata=http://m:8080/metadata"
        );
        assert_eq!(client("mooncake://?name=srv"), "mooncake://");
        assert_eq!(client("mooncake://?n%61me=srv"), "mooncake://");
        assert_eq!(
            client("nixl://?backends=UCX&port=7000&name=srv"),
            "nixl://?backends=UCX"
        );
        assert_eq!(client("verbs://mlx5_0?port=1"), "verbs://mlx5_0?port=1");
        assert_eq!(field("write block=4096 bytes=123", "bytes"), Some(123));
        assert_eq!(field("write block=4096", "bytes"), None);
    }

    #[test]
    fn secrets_are_redacted_after_decoding() {
        for url in [
            "tcp://h:1?secret=hunter2",
            "tcp://h:1?%73ecret=hunter2",
            "tcp://h:1?SECRET=hunter2",
            "tcp://h:1?connections=2&%53%65%63%72%65%74=hunter2",
            "tcp://h:1?secret%20=hunter2",
        ] {
            let r = redact_url(url);
            assert!(!r.contains("hunter2"), "{url} -> {r}");
            assert!(!client(url).contains("hunter2"), "{url}");
            assert!(!ParsedUrl::parse(url).unwrap().shown().contains("hunter2"));
        }
        assert_eq!(
            redact_url("tcp://h:1?connections=2&secret=x"),
            "tcp://h:1?connections=2&secret=…"
        );
    }

    #[test]
    fn peer_text_is_escaped_and_counters_saturate() {
        let evil = "x\nreceived: 999 notifications\u{1b}[2J\u{202e}";
        let p = printable(evil, 200);
        assert!(
            !p.contains('\n') && !p.contains('\u{1b}') && !p.contains('\u{202e}'),
            "{p}"
        );
        assert!(printable(&"a".repeat(1000), 10).starts_with("aaaaaaaaaa… (1000 bytes)"));
        let mut r = Received::default();
        for _ in 0..2 {
            r.written = r.written.saturating_add(u64::MAX);
        }
        assert_eq!(reported(r.written), "at least 16 EiB (saturated)");
    }
}
