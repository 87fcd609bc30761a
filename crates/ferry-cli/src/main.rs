//! `ferry`: benchmark a backend, print its capabilities, serve a region for a
//! remote benchmark, or run a Mooncake-compatible HTTP metadata server.
#![forbid(unsafe_code)]

mod bench;
mod caps;
mod kernel_copy;
mod metadata_server;
mod metrics_http;
mod plot;
mod rawtcp;
mod serve;
mod util;

use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

const EXAMPLES: &str = "\
Examples:
  ferry bench                      # TCP on loopback: the table, with raw-TCP and memcpy baselines
  ferry bench --json --blocks 4KiB,1MiB --batches 1,16
  ferry caps --backend 'mooncake://?lib=/opt/mooncake/libtransfer_engine.so&metadata=P2PHANDSHAKE&protocol=tcp&host=127.0.0.1'
  ferry caps --strict --require batch_transfer,notify
  ferry serve --backend tcp://10.0.0.2:7000 --size 256MiB
  ferry metadata-server --listen 127.0.0.1:8080 # single machine, Mooncake builds without P2PHANDSHAKE

Errors print one line; -v adds the cause chain and info logs, -vv debug logs
(RUST_LOG overrides the log filter).";

/// Move bytes between the memories of cooperating processes: benchmark,
/// inspect and serve Ferry transfer engines.
#[derive(Parser, Debug)]
#[command(name = "ferry", version, after_help = EXAMPLES, propagate_version = true)]
struct Cli {
    /// More output: -v shows the error cause chain and info logs, -vv debug logs.
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    verbose: u8,

    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Measure throughput and latency (GB/s, transfers/s, p50/p99) against
    /// raw-TCP and memcpy baselines from the same run.
    Bench(bench::BenchArgs),
    /// Print what a backend does natively, what is emulated and what is
    /// missing, with reasons and versions.
    Caps(caps::CapsArgs),
    /// Register a region and serve it to a remote `ferry bench` until Ctrl-C.
    Serve(serve::ServeArgs),
    /// Serve Mooncake Transfer Engine's HTTP metadata protocol
    /// (GET/PUT/DELETE PATH?key=K) from memory until Ctrl-C, for Mooncake
    /// builds that need a metadata server: the single-machine option (no
    /// leases, no watches); clusters use etcd.
    MetadataServer(metadata_server::MetadataServerArgs),
}

fn init_tracing(verbose: u8) {
    use tracing_subscriber::EnvFilter;
    let level = match verbose {
        0 => "warn",
        1 => "info",
        2 => "debug",
        _ => "trace",
    };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(level));
    // From -vv on, a line per closed span too: the `ferry_batch` span of
    // every transfer and batch (engine, peer, op, bytes, outcome, time).
    let spans = if verbose >= 2 {
        tracing_subscriber::fmt::format::FmtSpan::CLOSE
    } else {
        tracing_subscriber::fmt::format::FmtSpan::NONE
    };
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_span_events(spans)
        .with_writer(std::io::stderr)
        .try_init();
}

fn main() -> ExitCode {
    // `--version`: the crate version and the wire-protocol ranges.
    let version: &'static str = Box::leak(ferry::version_line().into_boxed_str());
    let cli = match Cli::from_arg_matches(&Cli::command().version(version).get_matches()) {
        Ok(c) => c,
        Err(e) => e.exit(),
    };
    let verbose = cli.verbose;
    init_tracing(verbose);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    // The command runs on a worker thread, as a server's request handlers
    // would, not on the thread parked in `block_on`: waking that thread costs
    // a futex round trip per completion and would inflate every latency.
    let task = runtime.spawn(async move {
        match cli.command {
            Command::Bench(a) => bench::run(a).await,
            Command::Caps(a) => caps::run(a).await,
            Command::Serve(a) => serve::run(a).await,
            Command::MetadataServer(a) => metadata_server::run(a).await,
        }
    });
    let result = runtime.block_on(task).unwrap_or_else(|join| {
        Err(anyhow::anyhow!(
            "the command's task ended abnormally: {join}"
        ))
    });
    // Background tasks (unregister-on-drop, sinks) must not keep us alive.
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            report_error(&e, verbose);
            if e.downcast_ref::<caps::MissingRequired>().is_some() {
                ExitCode::from(3)
            } else {
                ExitCode::FAILURE
            }
        }
    }
}

/// One line by default (`context: cause: cause`); with -v the top line and
/// one `caused by:` line per cause.
fn report_error(e: &anyhow::Error, verbose: u8) {
    if verbose == 0 {
        eprintln!("error: {e:#}");
    } else {
        eprintln!("error: {e}");
        for cause in e.chain().skip(1) {
            eprintln!("  caused by: {cause}");
        }
    }
}
