//! `ferry bench`: throughput and latency of one backend, with the raw-TCP
//! and memcpy baselines measured in the same run.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use ferry::registry::OpenOptions;
use ferry::{
    Engine, Notification, RegisteredBuffer, SegmentId, TransferEngine, TransferOp, TransferRequest,
};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

use crate::rawtcp;
use crate::util::{
    fill_pattern, human_bytes, parse_addr, parse_count, parse_duration, parse_positive_size,
    pattern,
};

/// Seed of the pattern `ferry serve` and the loopback target fill their
/// region with (so that reads move non-trivial bytes).
pub const TARGET_SEED: u64 = 0xfe77;

const EXAMPLES: &str = "\
Examples:
  # the default sweep: two TCP engines on loopback in this process
  ferry bench
  # a quick look at a few points, machine-readable
  ferry bench --blocks 4KiB,1MiB --batches 1,16 --duration 100ms --json
  # the sweep as a chart: GB/s against block size, baselines as reference lines
  ferry bench --plot bench.svg
  # asynchronous batches (submit + wait) in strict mode: nothing emulated
  ferry bench --api async --backend 'tcp://127.0.0.1:0?strict=1'
  # another backend
  ferry bench --backend 'mooncake://?lib=/opt/mooncake/libtransfer_engine.so&metadata=P2PHANDSHAKE&protocol=tcp&host=127.0.0.1'
  # same host, two processes: the cross-memory path and the socket path,
  # raw TCP and memcpy, in one run (tcp backend)
  ferry bench --same-host --blocks 4KiB,1MiB,16MiB --batches 1 --json
  # against `ferry serve` on another machine (copy the line it prints)
  ferry bench --peer 10.0.0.2:7000 --remote-addr 0x7f3a5c000000 --remote-len 268435456 --raw-peer 10.0.0.2:7001

Each point runs --duration (or until --total bytes), after --warmup. Requests of a
batch go to distinct, non-adjacent places so the adapter cannot merge them; batch
after batch moves on through --span bytes (64 MiB: memory out of the CPU caches)
and so do the baselines; after each point one block is read back and compared, so
the numbers are for bytes that really arrived. Ratios are ferry GB/s divided by the
baseline's at the same block size: raw TCP is the better of one and two plain tokio
streams writing block-sized chunks to a sink; memcpy is one thread copying
block-sized chunks. --span of one batch measures cache-resident bytes instead.";

/// Arguments of `ferry bench`.
#[derive(clap::Args, Debug, Clone)]
#[command(after_help = EXAMPLES)]
pub struct BenchArgs {
    /// Backend URL for the engines of this process (`ferry caps --help` lists the schemes).
    /// The shared secret comes from --secret-file, FERRY_SECRET or FERRY_SECRET_FILE.
    #[arg(long, default_value = "tcp://127.0.0.1:0")]
    backend: String,

    #[command(flatten)]
    secret: crate::util::SecretArgs,

    /// Drive a remote `ferry serve` at this segment name (host:port) instead
    /// of a second engine in this process. Needs --remote-addr and --remote-len.
    #[arg(long, requires_all = ["remote_addr", "remote_len"])]
    peer: Option<String>,

    /// Start of the region `ferry serve` registered (it prints it), hex 0x… or decimal.
    #[arg(long, value_parser = parse_addr, requires = "peer")]
    remote_addr: Option<u64>,

    /// Length of that region (e.g. 256MiB).
    #[arg(long, value_parser = parse_positive_size, requires = "peer")]
    remote_len: Option<u64>,

    /// With --peer: the raw-TCP sink `ferry serve` printed, for the raw-TCP
    /// baseline over the same network. Without it, that baseline is left out.
    #[arg(long, requires = "peer")]
    raw_peer: Option<String>,

    /// Same host, two processes: start `ferry serve` as a child process on
    /// loopback and measure against it twice, with the same-host path
    /// (`same_host=cma`: cross-memory attach) and without it
    /// (`same_host=off`: the socket), next to the raw-TCP and memcpy
    /// baselines of the same run. Rows carry the path. TCP backend only.
    #[arg(long, conflicts_with = "peer")]
    same_host: bool,

    /// Serve this process's engine metrics at `http://ADDR/metrics`
    /// while the bench runs (Prometheus text exposition; port 0 picks one,
    /// printed to stderr).
    #[arg(long, value_name = "ADDR")]
    metrics_listen: Option<String>,

    /// With --metrics-listen: after the results are printed, keep serving
    /// `/metrics` this long (or until Ctrl-C) before exiting, so that a
    /// scraper sees the final counts.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration, requires = "metrics_listen")]
    metrics_linger: Option<Duration>,

    /// Open this process's engines without the metrics and tracing layers
    /// (to measure what they cost: run with and without, interleaved).
    #[arg(long)]
    no_layers: bool,

    /// Block sizes (bytes per request), comma-separated.
    #[arg(long, value_delimiter = ',', value_parser = parse_positive_size,
          default_value = "4KiB,16KiB,64KiB,256KiB,1MiB,4MiB,16MiB")]
    blocks: Vec<u64>,

    /// Batch sizes (requests per batch; 1 uses the single-transfer call), comma-separated.
    #[arg(long, value_delimiter = ',', value_parser = parse_count, default_value = "1,4,16")]
    batches: Vec<usize>,

    /// Operations to measure, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "write,read")]
    ops: Vec<OpArg>,

    /// How a batch is issued: `sync` = batch_transfer (a batch of 1: transfer),
    /// `async` = submit then wait.
    #[arg(long, value_enum, default_value = "sync")]
    api: Api,

    /// Bytes each point cycles through on both sides, one batch after
    /// another on the next block × batch bytes (so do the memcpy and
    /// kernel-copy baselines; raw TCP always cycles through 64 MiB): the default, larger than the CPU
    /// caches, measures memory the CPU has not just touched, as when a KV
    /// cache moves. A span of one batch (e.g. `--span 1MiB --batches 1`
    /// at 1 MiB) keeps every transfer and baseline copy on the same,
    /// cache-resident bytes. Capped at --region-size.
    #[arg(long, value_parser = parse_positive_size, default_value = "64MiB")]
    span: u64,

    /// Registered bytes on each side; a point whose block × batch does not fit is skipped.
    #[arg(long, value_parser = parse_positive_size, default_value = "256MiB")]
    region_size: u64,

    /// Measuring time per point (after the warm-up).
    #[arg(long, value_parser = parse_duration, default_value = "250ms")]
    duration: Duration,

    /// Most bytes moved per point (whichever of this and --duration comes first).
    #[arg(long, value_parser = parse_positive_size, default_value = "2GiB")]
    total: u64,

    /// Warm-up time per point, not measured.
    #[arg(long, value_parser = parse_duration, default_value = "50ms")]
    warmup: Duration,

    /// Skip the raw-TCP and memcpy baselines (ratios are then left out).
    #[arg(long)]
    no_baselines: bool,

    /// Print a JSON array (one object per point) instead of the table.
    #[arg(long)]
    json: bool,

    /// Also draw the rows as a chart into this SVG file: GB/s against block
    /// size (log axes), one line per batch size and operation, with the
    /// baselines of the run.
    #[arg(long, value_name = "FILE.svg", value_parser = crate::plot::parse_plot_path)]
    plot: Option<std::path::PathBuf>,

    /// `--same-host`: the target child's PID, for the kernel-copy baseline
    /// (set internally, not a flag).
    #[arg(skip)]
    cma_pid: Option<i32>,
}

/// An operation to measure.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum OpArg {
    Write,
    Read,
}

impl OpArg {
    fn op(self) -> TransferOp {
        match self {
            OpArg::Write => TransferOp::Write,
            OpArg::Read => TransferOp::Read,
        }
    }
    fn name(self) -> &'static str {
        match self {
            OpArg::Write => "write",
            OpArg::Read => "read",
        }
    }
}

/// How batches are issued.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Api {
    /// `batch_transfer` (and `transfer` for a batch of one).
    Sync,
    /// `submit` + `wait`.
    Async,
}

/// One measured point (a row of the table, an object of `--json`).
#[derive(Debug, Serialize)]
struct Point {
    backend: String,
    /// `loopback` or the peer's segment name.
    target: String,
    /// The payload path to the target as the engine reports it (tcp
    /// backend: `cma`, or `tcp (reason)`), when known.
    path: Option<String>,
    op: &'static str,
    api: &'static str,
    block: u64,
    batch: usize,
    /// Bytes the point's batches cycled through (see `--span`).
    span: u64,
    gbps: f64,
    transfers_per_s: f64,
    p50_us: f64,
    p99_us: f64,
    ratio_raw_tcp: Option<f64>,
    ratio_memcpy: Option<f64>,
    raw_tcp_gbps: Option<f64>,
    raw_tcp_streams: Option<usize>,
    memcpy_gbps: Option<f64>,
    /// `--same-host`: one `process_vm_readv` per block from the target
    /// process, in a plain loop (the kernel's cross-memory copy with no
    /// engine around it: the ceiling of the cma path).
    raw_cma_gbps: Option<f64>,
    /// gbps ÷ raw_cma_gbps.
    ratio_raw_cma: Option<f64>,
    batches_measured: usize,
    bytes: u64,
    seconds: f64,
    verified: bool,
}

#[derive(Clone, Copy, Debug, Default)]
struct Baseline {
    raw_tcp: Option<(f64, usize)>,
    memcpy: Option<f64>,
    raw_cma: Option<f64>,
}

struct Setup {
    engine: Arc<Engine>,
    /// Keeps the in-process target alive (loopback mode).
    target: Option<(Arc<Engine>, RegisteredBuffer<Engine>)>,
    segment: SegmentId,
    remote_addr: u64,
    local: RegisteredBuffer<Engine>,
    scratch: RegisteredBuffer<Engine>,
    /// Usable bytes on both sides.
    window: u64,
    target_label: String,
    raw_sink: Option<String>,
    sink_task: Option<tokio::task::JoinHandle<()>>,
    notify: bool,
}

/// Runs `ferry bench`.
pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    if args.ops.is_empty() || args.blocks.is_empty() || args.batches.is_empty() {
        bail!("--ops, --blocks and --batches each need at least one value");
    }
    if let Some(addr) = &args.metrics_listen {
        let bound = crate::metrics_http::start(addr, ferry::Metrics::global().clone()).await?;
        eprintln!("metrics: http://{bound}/metrics");
    }
    if args.same_host {
        return run_same_host(args).await;
    }
    let (results, base_by_block, setup) = sweep(&args).await?;
    plot(&args, &results)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&results)?);
    } else {
        print_table(&args, &setup, &results, &base_by_block);
    }
    linger(&args).await?;
    setup.close().await
}

/// `--metrics-linger`: keeps serving `/metrics` after the results, with
/// the engines still open (an engine's series leave the exposition when
/// it is dropped), for that long or until Ctrl-C.
async fn linger(args: &BenchArgs) -> anyhow::Result<()> {
    let Some(linger) = args.metrics_linger else {
        return Ok(());
    };
    use std::io::Write as _;
    std::io::stdout().flush()?;
    eprintln!(
        "metrics: serving for {} more (Ctrl-C to stop)",
        humantime::format_duration(linger)
    );
    tokio::select! {
        () = tokio::time::sleep(linger) => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    Ok(())
}

/// `--plot`: draws the rows into the SVG file.
fn plot(args: &BenchArgs, results: &[Point]) -> anyhow::Result<()> {
    if let Some(path) = &args.plot {
        crate::plot::write_svg(path, results)?;
        eprintln!("chart written to {}", path.display());
    }
    Ok(())
}

/// A `ferry serve` child process (killed on drop).
struct ServeChild(std::process::Child);

impl Drop for ServeChild {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `--same-host`: a `ferry serve` child on loopback, measured with the
/// cross-memory path forced on, then off; one table (or JSON array).
async fn run_same_host(args: BenchArgs) -> anyhow::Result<()> {
    use std::io::BufRead;
    if !args.backend.starts_with("tcp://") {
        bail!("--same-host needs the tcp backend (--backend tcp://127.0.0.1:0?...)");
    }
    let exe = std::env::current_exe().context("finding the ferry executable")?;
    let mut child = std::process::Command::new(exe)
        .args([
            "serve",
            "--backend",
            "tcp://127.0.0.1:0",
            "--raw-listen",
            "127.0.0.1:0",
        ])
        .arg("--size")
        .arg(args.region_size.to_string())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .context("starting `ferry serve` as the target process")?;
    let stdout = child.stdout.take().context("no stdout from ferry serve")?;
    let child = ServeChild(child);
    // Read until the line with the target's coordinates, then keep
    // draining so the child never blocks on a full pipe.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut sent = false;
        for line in std::io::BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if !sent && line.starts_with("drive it with:") {
                let _ = tx.send(line);
                sent = true;
            }
        }
    });
    let line = tokio::task::spawn_blocking(move || rx.recv_timeout(Duration::from_secs(30)))
        .await?
        .context("`ferry serve` did not print its coordinates")?;
    let words: Vec<&str> = line.split_whitespace().collect();
    let after = |flag: &str| {
        words
            .iter()
            .position(|w| *w == flag)
            .and_then(|i| words.get(i + 1))
            .map(|w| w.to_string())
    };
    let peer = after("--peer").context("no --peer in ferry serve's line")?;
    let addr = after("--remote-addr").context("no --remote-addr")?;
    let len = after("--remote-len").context("no --remote-len")?;
    let mut results = Vec::new();
    let mut bases = BTreeMap::new();
    // Every mode's engines stay open until the end (`--metrics-linger`
    // serves the series of both).
    let mut setups = Vec::new();
    for mode in ["cma", "off"] {
        let sep = if args.backend.contains('?') { '&' } else { '?' };
        let mut a = args.clone();
        a.same_host = false;
        a.backend = format!("{}{sep}same_host={mode}", args.backend);
        a.peer = Some(peer.clone());
        a.remote_addr = Some(parse_addr(&addr).map_err(anyhow::Error::msg)?);
        a.remote_len = Some(parse_positive_size(&len).map_err(anyhow::Error::msg)?);
        a.raw_peer = after("--raw-peer");
        a.cma_pid = i32::try_from(child.0.id()).ok();
        let (r, b, setup) = sweep(&a)
            .await
            .with_context(|| format!("same_host={mode}"))?;
        results.extend(r);
        bases.extend(b);
        setups.push((a, setup));
    }
    plot(&args, &results)?;
    if let Some((a, setup)) = setups.last() {
        if args.json {
            println!("{}", serde_json::to_string_pretty(&results)?);
        } else {
            print_table(a, setup, &results, &bases);
        }
    }
    linger(&args).await?;
    for (_, setup) in setups {
        setup.close().await?;
    }
    drop(child);
    Ok(())
}

/// Runs every point of `args` (with its baselines); returns the rows, the
/// baselines by block size and the setup (to close).
async fn sweep(args: &BenchArgs) -> anyhow::Result<(Vec<Point>, BTreeMap<u64, Baseline>, Setup)> {
    let max_block = *args.blocks.iter().max().unwrap_or(&4096);
    let setup = setup(args, max_block).await?;

    // The points to run, grouped by block size so that each block's
    // baselines are measured right before its points.
    let mut blocks = args.blocks.clone();
    blocks.sort_unstable();
    blocks.dedup();
    let mut plan: Vec<(u64, Vec<(usize, OpArg)>)> = Vec::new();
    let mut skipped = Vec::new();
    for &block in &blocks {
        let mut points = Vec::new();
        for &batch in &args.batches {
            if block.saturating_mul(batch as u64) > setup.window {
                skipped.push(format!("{} × {batch}", human_bytes(block)));
                continue;
            }
            for &op in &args.ops {
                points.push((batch, op));
            }
        }
        if !points.is_empty() {
            plan.push((block, points));
        }
    }
    if plan.is_empty() {
        bail!(
            "no point fits: every block × batch exceeds the {} region (raise --region-size{})",
            human_bytes(setup.window),
            if args.peer.is_some() {
                " or serve a larger --size"
            } else {
                ""
            }
        );
    }
    if !skipped.is_empty() {
        eprintln!(
            "note: skipping {} (block × batch exceeds the {} region; see --region-size)",
            skipped.join(", "),
            human_bytes(setup.window)
        );
    }

    let baselines = !args.no_baselines;
    let steps: usize = plan
        .iter()
        .map(|(_, p)| p.len() + if baselines { 1 } else { 0 })
        .sum();
    let bar = ProgressBar::new(steps as u64);
    bar.set_style(
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:32} {pos}/{len} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.enable_steady_tick(Duration::from_millis(120));

    let backend = setup.engine.scheme().to_owned();
    let mut results = Vec::new();
    let mut base_by_block = BTreeMap::new();
    for (seed, (block, points)) in plan.iter().enumerate() {
        let block = *block;
        let base = if baselines {
            bar.set_message(format!("baselines at {}", human_bytes(block)));
            let b = measure_baselines(args, &setup, block).await?;
            bar.inc(1);
            b
        } else {
            Baseline::default()
        };
        base_by_block.insert(block, base);
        for &(batch, op) in points {
            bar.set_message(format!(
                "{backend} {} {} × {batch}",
                op.name(),
                human_bytes(block)
            ));
            let p = measure_point(args, &setup, block, batch, op, seed as u64, base)
                .await
                .with_context(|| format!("{} of {} × {batch}", op.name(), human_bytes(block)))?;
            results.push(Point {
                backend: backend.clone(),
                target: setup.target_label.clone(),
                path: path_to_target(&setup),
                ..p
            });
            bar.inc(1);
        }
    }
    bar.finish_and_clear();
    Ok((results, base_by_block, setup))
}

/// The path the engine reports to the target (`peer NAME` in its details).
fn path_to_target(setup: &Setup) -> Option<String> {
    let name = match &setup.target {
        Some((t, _)) => t.segment_name().to_owned(),
        None => setup.target_label.clone(),
    };
    let key = format!("peer {name}");
    setup
        .engine
        .backend_info()
        .details
        .into_iter()
        .find(|(k, _)| *k == key)
        .map(|(_, v)| v.trim_start_matches("path: ").to_owned())
}

impl Setup {
    /// Closes the segment and unregisters every buffer (waiting for
    /// transfers in flight) before the memory is freed.
    async fn close(self) -> anyhow::Result<()> {
        self.engine
            .close_segment(self.segment)
            .await
            .context("closing the target segment")?;
        self.scratch.release().await?;
        self.local.release().await?;
        if let Some((_, target)) = self.target {
            target.release().await?;
        }
        if let Some(task) = self.sink_task {
            task.abort();
        }
        Ok(())
    }
}

async fn setup(args: &BenchArgs, max_block: u64) -> anyhow::Result<Setup> {
    let parsed = crate::util::backend_url(&args.backend, &args.secret)?;
    let open = |what: &'static str| {
        let url = args.backend.clone();
        let parsed = parsed.clone();
        let layers = !args.no_layers;
        async move {
            let options = if layers {
                OpenOptions::default()
            } else {
                OpenOptions::default().metrics(None).tracing(false)
            };
            Engine::open_parsed(parsed, options)
                .await
                .with_context(|| format!("opening the {what} engine ({})", redact(&url)))
        }
    };
    let engine = Arc::new(open("local").await?);
    let region = usize::try_from(args.region_size).context("--region-size is too large")?;
    type Target = Option<(Arc<Engine>, RegisteredBuffer<Engine>)>;
    let (target, segment, remote_addr, remote_len, label, raw_sink, sink_task): (
        Target,
        _,
        _,
        _,
        _,
        _,
        _,
    ) = match &args.peer {
        None => {
            let target = Arc::new(open("target").await?);
            let buf = RegisteredBuffer::new(Arc::clone(&target), region)
                .await
                .context("registering the target region")?;
            fill_pattern(buf.memory(), TARGET_SEED)?;
            let seg = engine
                .open_segment(target.segment_name())
                .await
                .context("opening the target's segment")?;
            let addr = buf.addr();
            let len = buf.len() as u64;
            let (sink, task) = if args.no_baselines {
                (None, None)
            } else {
                let l = tokio::net::TcpListener::bind("127.0.0.1:0")
                    .await
                    .context("binding the raw-TCP sink")?;
                let a = l.local_addr()?.to_string();
                let stats = Arc::default();
                (Some(a), Some(tokio::spawn(rawtcp::run_sink(l, stats))))
            };
            (
                Some((target, buf)),
                seg,
                addr,
                len,
                "loopback".to_owned(),
                sink,
                task,
            )
        }
        Some(peer) => {
            let (addr, len) = (
                args.remote_addr.unwrap_or_default(),
                args.remote_len.unwrap_or_default(),
            );
            if addr.checked_add(len).is_none() {
                bail!("--remote-addr {addr:#x} + --remote-len {len} overflows the address space");
            }
            let seg = engine
                .open_segment(peer)
                .await
                .with_context(|| format!("opening the peer segment {peer}"))?;
            (
                None,
                seg,
                addr,
                len,
                peer.clone(),
                args.raw_peer.clone(),
                None,
            )
        }
    };
    let window = remote_len.min(args.region_size);
    let local_len = usize::try_from(window).context("region too large")?;
    let local = RegisteredBuffer::new(Arc::clone(&engine), local_len)
        .await
        .context("registering the local region")?;
    let scratch_len = usize::try_from(max_block).context("block too large")?;
    let scratch = RegisteredBuffer::new(Arc::clone(&engine), scratch_len)
        .await
        .context("registering the read-back buffer")?;
    let notify = args.peer.is_some() && engine.capabilities().notify;
    Ok(Setup {
        engine,
        target,
        segment,
        remote_addr,
        local,
        scratch,
        window,
        target_label: label,
        raw_sink,
        sink_task,
        notify,
    })
}

/// A backend URL with secrets hidden, for messages: the redaction every
/// parser uses (`ferry_core::raw::redact_url`: `secret` in the query,
/// userinfo, paths), not one of our own that knew only the query.
pub fn redact(url: &str) -> String {
    crate::serve::redact_url(url)
}

async fn measure_baselines(
    args: &BenchArgs,
    setup: &Setup,
    block: u64,
) -> anyhow::Result<Baseline> {
    let b = usize::try_from(block)?;
    let raw_tcp = match &setup.raw_sink {
        Some(sink) => {
            let one = rawtcp::measure(sink, b, 1, args.duration, args.total).await?;
            let two = rawtcp::measure(sink, b, 2, args.duration, args.total).await?;
            Some(if two > one { (two, 2) } else { (one, 1) })
        }
        None => None,
    };
    let (duration, total) = (args.duration, args.total);
    let span = usize::try_from(args.span.min(setup.window))?;
    let memcpy = tokio::task::spawn_blocking(move || memcpy_gbps(b, span, duration, total))
        .await
        .context("memcpy baseline task failed")?;
    let raw_cma = match args.cma_pid {
        Some(pid) => {
            let remote = setup.remote_addr;
            let r = tokio::task::spawn_blocking(move || {
                crate::kernel_copy::kernel_copy_gbps(pid, remote, b, span, duration, total)
            })
            .await
            .context("kernel-copy baseline task failed")?;
            match r {
                Ok(g) => Some(g),
                Err(e) => {
                    eprintln!("note: no kernel-copy baseline: process_vm_readv: {e:?}");
                    None
                }
            }
        }
        None => None,
    };
    Ok(Baseline {
        raw_tcp,
        memcpy: Some(memcpy),
        raw_cma,
    })
}

/// One thread copying `block`-sized chunks between two `span`-byte (at
/// least one block) buffers, slot by slot, for `duration` or `total` bytes.
fn memcpy_gbps(block: usize, span: usize, duration: Duration, total: u64) -> f64 {
    let slots = (span / block).max(1);
    let src = vec![0xa5u8; slots * block];
    let mut dst = vec![0u8; slots * block];
    // Touch every page once so that page faults are not measured.
    dst.copy_from_slice(&src);
    let start = Instant::now();
    let mut copied = 0u64;
    let mut slot = 0;
    while copied < total && (copied == 0 || start.elapsed() < duration) {
        for _ in 0..16 {
            let r = slot * block..(slot + 1) * block;
            dst[r.clone()].copy_from_slice(&src[r]);
            std::hint::black_box(&mut dst);
            copied += block as u64;
            slot = (slot + 1) % slots;
        }
    }
    copied as f64 / start.elapsed().as_secs_f64() / 1e9
}

async fn one_batch(
    engine: &Engine,
    api: Api,
    segment: SegmentId,
    requests: &[TransferRequest],
) -> ferry::Result<()> {
    if api == Api::Async {
        let id = engine.submit(segment, requests, None).await?;
        engine.wait(id).await?.into_result()
    } else if let [single] = requests {
        engine.transfer(segment, *single).await
    } else {
        engine
            .batch_transfer(segment, requests, None)
            .await?
            .into_result()
    }
}

async fn measure_point(
    args: &BenchArgs,
    setup: &Setup,
    block: u64,
    batch: usize,
    op: OpArg,
    seed: u64,
    base: Baseline,
) -> anyhow::Result<Point> {
    let engine = &*setup.engine;
    let local = setup.local.memory();
    let b = usize::try_from(block)?;
    let batch_bytes = block * batch as u64;
    // The batches cycle through `windows` consecutive batch-sized windows
    // of the span (the same ones on both sides).
    let windows = (args.span.min(setup.window) / batch_bytes).max(1);
    // Prepare local memory: a distinct pattern per slot to write, zeros to
    // be overwritten by reads.
    let mut slot_bytes = vec![0u8; b];
    for slot in 0..windows as usize * batch {
        if op == OpArg::Write {
            pattern(
                seed.wrapping_mul(1000).wrapping_add(slot as u64),
                0,
                &mut slot_bytes,
            );
        }
        local.write(slot * b, &slot_bytes)?;
    }
    // In window w, request i: local slot i <-> remote slot batch-1-i of
    // that window. Local ranges are adjacent but remote ones run
    // backwards, so the adapter's coalescing cannot merge them: the point
    // measures `batch` requests of `block` bytes.
    let window = |w: u64| -> Vec<TransferRequest> {
        (0..batch)
            .map(|i| TransferRequest {
                op: op.op(),
                local_addr: setup.local.addr() + w * batch_bytes + (i as u64) * block,
                remote_addr: setup.remote_addr + w * batch_bytes + ((batch - 1 - i) as u64) * block,
                len: block,
            })
            .collect()
    };
    let all: Vec<Vec<TransferRequest>> = (0..windows).map(window).collect();
    let mut next = 0usize;

    let warm_start = Instant::now();
    loop {
        one_batch(engine, args.api, setup.segment, &all[next]).await?;
        next = (next + 1) % all.len();
        if warm_start.elapsed() >= args.warmup {
            break;
        }
    }

    let mut samples = Vec::new();
    let mut bytes = 0u64;
    let mut last = next;
    let start = Instant::now();
    while samples.len() < 2 || (start.elapsed() < args.duration && bytes < args.total) {
        let t = Instant::now();
        one_batch(engine, args.api, setup.segment, &all[next]).await?;
        samples.push(t.elapsed());
        bytes += batch_bytes;
        last = next;
        next = (next + 1) % all.len();
    }
    let seconds = start.elapsed().as_secs_f64();

    // Read back remote slot batch-1 of the last window, which that
    // window's local slot 0 was written to (or read from), and compare.
    let last = last as u64;
    let check = TransferRequest::read(
        setup.scratch.addr(),
        setup.remote_addr + last * batch_bytes + (batch as u64 - 1) * block,
        block,
    );
    engine
        .transfer(setup.segment, check)
        .await
        .context("reading a block back for verification")?;
    let mut want = vec![0u8; b];
    let mut have = vec![0u8; b];
    local.read((last * batch_bytes) as usize, &mut want)?;
    setup.scratch.memory().read(0, &mut have)?;
    if want != have {
        let at = want
            .iter()
            .zip(&have)
            .position(|(a, b)| a != b)
            .unwrap_or(0);
        bail!(
            "verification failed: remote block at {:#x} differs from local block at {:#x} at byte {at}",
            check.remote_addr,
            setup.local.addr() + last * batch_bytes
        );
    }

    if setup.notify {
        let msg = Notification::new(
            "ferry-bench",
            format!(
                "{} block={block} batch={batch} transfers={} bytes={bytes}",
                op.name(),
                samples.len() * batch
            ),
        );
        engine
            .batch_transfer(setup.segment, &[], Some(&msg))
            .await
            .context("sending the end-of-point notification")?
            .into_result()?;
    }

    samples.sort_unstable();
    let gbps = bytes as f64 / seconds / 1e9;
    Ok(Point {
        backend: String::new(),
        target: String::new(),
        path: None,
        op: op.name(),
        api: match args.api {
            Api::Sync => "sync",
            Api::Async => "async",
        },
        block,
        batch,
        span: windows * batch_bytes,
        gbps,
        transfers_per_s: (samples.len() * batch) as f64 / seconds,
        p50_us: percentile(&samples, 50.0),
        p99_us: percentile(&samples, 99.0),
        ratio_raw_tcp: base.raw_tcp.map(|(g, _)| gbps / g),
        ratio_memcpy: base.memcpy.map(|g| gbps / g),
        raw_tcp_gbps: base.raw_tcp.map(|(g, _)| g),
        raw_tcp_streams: base.raw_tcp.map(|(_, s)| s),
        memcpy_gbps: base.memcpy,
        raw_cma_gbps: base.raw_cma,
        ratio_raw_cma: base.raw_cma.map(|g| gbps / g),
        batches_measured: samples.len(),
        bytes,
        seconds,
        verified: true,
    })
}

/// Nearest-rank percentile of sorted samples, in microseconds.
fn percentile(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1].as_secs_f64() * 1e6
}

fn print_table(
    args: &BenchArgs,
    setup: &Setup,
    results: &[Point],
    baselines: &BTreeMap<u64, Baseline>,
) {
    let backend = setup.engine.scheme();
    let where_ = if args.same_host {
        "two processes on this host (a `ferry serve` child)".to_owned()
    } else if args.peer.is_some() {
        format!("against {}", setup.target_label)
    } else {
        "two engines on loopback in this process".to_owned()
    };
    println!(
        "ferry bench: {backend}, {where_}; region {}, {:?} per point",
        human_bytes(setup.window),
        args.duration
    );
    println!();
    println!(
        "{:<9} {:<5} {:>8} {:>5} {:>8} {:>13} {:>9} {:>9} {:>8} {:>8}  path",
        "backend",
        "op",
        "block",
        "batch",
        "GB/s",
        "transfers/s",
        "p50 µs",
        "p99 µs",
        "×rawTCP",
        "×memcpy",
    );
    for p in results {
        println!(
            "{:<9} {:<5} {:>8} {:>5} {:>8.3} {:>13.0} {:>9.1} {:>9.1} {:>8} {:>8}  {}",
            p.backend,
            p.op,
            human_bytes(p.block),
            p.batch,
            p.gbps,
            p.transfers_per_s,
            p.p50_us,
            p.p99_us,
            ratio(p.ratio_raw_tcp),
            ratio(p.ratio_memcpy),
            p.path.as_deref().unwrap_or("-"),
        );
    }
    if baselines
        .values()
        .any(|b| b.raw_tcp.is_some() || b.memcpy.is_some())
    {
        println!();
        println!("baselines, same run:");
        println!(
            "{:>8} {:>14} {:>8} {:>12} {:>17}",
            "block", "raw TCP GB/s", "streams", "memcpy GB/s", "kernel CMA GB/s"
        );
        for (block, b) in baselines {
            println!(
                "{:>8} {:>14} {:>8} {:>12} {:>17}",
                human_bytes(*block),
                b.raw_tcp.map_or("-".to_owned(), |(g, _)| format!("{g:.3}")),
                b.raw_tcp.map_or("-".to_owned(), |(_, s)| s.to_string()),
                b.memcpy.map_or("-".to_owned(), |g| format!("{g:.3}")),
                b.raw_cma.map_or("-".to_owned(), |g| format!("{g:.3}")),
            );
        }
        println!();
        println!(
            "raw TCP: better of 1 and 2 plain tokio streams writing block-sized chunks{}; \
             memcpy: one thread; kernel CMA (--same-host): one thread calling \
             process_vm_readv on the target child, one block per call; \
             ×: ferry GB/s ÷ baseline GB/s at the same block size.",
            if args.peer.is_some() {
                if setup.raw_sink.is_some() {
                    " to the peer's sink"
                } else {
                    " (left out: pass --raw-peer)"
                }
            } else {
                " over loopback"
            }
        );
    }
    println!(
        "every point verified by reading one block back; transfers, memcpy and kernel CMA \
         cycle through --span {} (raw TCP: 64 MiB).",
        crate::util::human_bytes(args.span)
    );
}

fn ratio(r: Option<f64>) -> String {
    r.map_or("-".to_owned(), |r| format!("{r:.2}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_use_nearest_rank() {
        let s: Vec<Duration> = (1..=100).map(Duration::from_micros).collect();
        assert_eq!(percentile(&s, 50.0), 50.0);
        assert_eq!(percentile(&s, 99.0), 99.0);
        assert_eq!(percentile(&s[..1], 99.0), 1.0);
        assert_eq!(percentile(&[], 50.0), 0.0);
    }

    #[test]
    fn secrets_are_redacted() {
        assert_eq!(
            redact("tcp://h:1?secret=abc&strict=1"),
            "tcp://h:1?secret=…&strict=1"
        );
        assert_eq!(redact("tcp://h:1"), "tcp://h:1");
        // Userinfo and paths too (the earlier helper of this file kept them).
        for url in [
            "tcp://user:abc@h:1",
            "tcp://h:1/abc?strict=1",
            "mooncake://h:1/abc#abc",
        ] {
            let shown = redact(url);
            assert!(!shown.contains("abc"), "{url} -> {shown}");
        }
    }

    #[test]
    fn memcpy_baseline_moves_bytes() {
        assert!(memcpy_gbps(4096, 1 << 16, Duration::from_millis(5), 1 << 20) > 0.0);
    }
}
