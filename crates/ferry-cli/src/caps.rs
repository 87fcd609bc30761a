//! `ferry caps`: the capability report a person reads before deploying.

use anyhow::Context;
use ferry::registry::OpenOptions;
use ferry::{Engine, Operation, Support, TransferEngine};
use serde::Serialize;

use crate::util::parse_operation;

const EXAMPLES: &str = "\
Examples:
  ferry caps
  ferry caps --backend 'tcp://127.0.0.1:0?strict=1'
  # what was negotiated with a peer (tcp): both version ranges, the version in
  # use, each optional feature on/off and why, the payload path
  ferry caps --peer 127.0.0.1:7000
  # with TLS (the line `tls  on: TLS13_…` names the cipher suite)
  FERRY_SECRET=S ferry caps --backend tcp://127.0.0.1:0 --tls require --peer 10.0.0.2:7000
  ferry caps --backend 'mooncake://?lib=/opt/mooncake/libtransfer_engine.so&metadata=P2PHANDSHAKE&protocol=tcp&host=127.0.0.1'
  ferry caps --backend 'verbs://mlx5_0?port=1&gid_index=3'
  # several transports: which one was chosen to the peer, and why
  ferry caps --backend 'multi://?transports=verbs,tcp' --peer 'ferry-multi:verbs=…;tcp=10.0.0.2:7000'
  # in a start-up script: fail unless batches and notifications are native
  ferry caps --backend \"$FERRY_URL\" --strict --require batch_transfer,notify || exit 1

Backend URLs (the scheme is also the cargo feature that compiles the backend in):
  tcp://HOST:PORT[?tls=on]              tokio TCP (default feature); the secret: FERRY_SECRET,
                                        FERRY_SECRET_FILE or --secret-file (or secret_file=PATH)
  mooncake://?lib=PATH&metadata=…&…     Mooncake Transfer Engine, loaded at run time
  verbs://DEVICE?port=N&gid_index=N     RDMA verbs
  multi://?transports=a,b&a.url=…       one engine over several, best first (`<name>.url`
                                        percent-encoded; tcp defaults to tcp://0.0.0.0:0)
Ferry's own parameters, on any URL: strict=1 (no emulation), coalesce=0,
max_concurrency=N, require=op,op.

Operations: batch_register, batch_unregister, batch_transfer, async_batch,
batch_wait, notify (optional); register, unregister, open_segment, transfer
(always available).

Exit status: 0 when everything --require names is available; 3 when some is
missing (each is listed with the reason); 1 on other errors; 2 on usage errors.";

/// Arguments of `ferry caps`.
#[derive(clap::Args, Debug)]
#[command(after_help = EXAMPLES)]
pub struct CapsArgs {
    /// Backend URL to open and describe.
    #[arg(long, default_value = "tcp://127.0.0.1:0")]
    backend: String,

    /// Operations that must be available, comma-separated; exit status 3 if any is not.
    #[arg(long, value_delimiter = ',', value_parser = parse_operation)]
    require: Vec<Operation>,

    /// Strict mode (as `?strict=1`): emulated operations count as missing.
    #[arg(long)]
    strict: bool,

    /// Open these peers' segments first (repeatable), so that the report
    /// shows the path to each (tcp: `peer HOST:PORT  path: cma` or
    /// `path: tcp (reason)`).
    #[arg(long)]
    peer: Vec<String>,

    /// Print the report as JSON.
    #[arg(long)]
    json: bool,

    #[command(flatten)]
    tls: crate::serve::TlsArgs,

    #[command(flatten)]
    secret: crate::util::SecretArgs,
}

/// Required capabilities are missing (exit status 3).
#[derive(Debug)]
pub struct MissingRequired(pub String);

impl std::fmt::Display for MissingRequired {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for MissingRequired {}

#[derive(Serialize)]
struct JsonOp {
    operation: &'static str,
    support: &'static str,
    via: Option<String>,
    reason: Option<String>,
    min_version: Option<String>,
}

/// One feature of a negotiated connection.
#[derive(Serialize)]
struct JsonFeature {
    name: &'static str,
    on: bool,
    why_off: Option<String>,
}

/// What was negotiated with one peer (tcp backend).
#[derive(Serialize)]
struct JsonPeer {
    peer: String,
    this_engine_versions: String,
    peer_versions: String,
    peer_negotiates: bool,
    version: u16,
    features: Vec<JsonFeature>,
    path: String,
    path_detail: String,
    /// The TLS cipher suite and identity, if the connection runs TLS.
    tls: Option<String>,
    /// Why TLS is off, if it is.
    tls_off: Option<String>,
}

/// On a multi engine: the transport chosen to one peer, and why.
#[derive(Serialize)]
struct JsonChoice {
    peer: String,
    transport: String,
    address: String,
    ours: Vec<String>,
    theirs: Vec<String>,
    reason: String,
    failovers: u64,
}

#[derive(Serialize)]
struct JsonReport {
    backend: String,
    segment: String,
    strict: bool,
    details: Vec<(String, String)>,
    max_batch_len: Option<usize>,
    operations: Vec<JsonOp>,
    required: Vec<&'static str>,
    missing: Vec<String>,
    peers: Vec<JsonPeer>,
    /// On a multi engine, the transport chosen to each peer.
    transports: Vec<JsonChoice>,
}

/// Runs `ferry caps`.
pub async fn run(args: CapsArgs) -> anyhow::Result<()> {
    // The URL is parsed once; what the flags add goes into the parsed URL
    // (`--strict` only where the URL does not say).
    let mut url = crate::util::backend_url(&args.backend, &args.secret)?;
    if args.strict && !url.contains("strict") {
        url.insert("strict", "1")?;
    }
    args.tls.apply(&mut url)?;
    let shown = url.shown().to_owned();
    let engine = Engine::open_parsed(url, OpenOptions::default())
        .await
        .with_context(|| format!("opening {shown}"))?;
    for p in &args.peer {
        engine
            .open_segment(p)
            .await
            .with_context(|| format!("opening the peer segment {p}"))?;
    }
    let mut report = engine.report();
    // The report's details were taken at start-up; the per-peer paths are
    // live (backend_info is not cached).
    report.info.details = engine.backend_info().details;
    let missing = report.missing(&args.require);
    // What was negotiated with each peer (backends that negotiate).
    #[cfg(feature = "tcp")]
    let peers: Vec<ferry::PeerReport> = args
        .peer
        .iter()
        .filter_map(|p| engine.peer_report(p))
        .collect();
    #[cfg(not(feature = "tcp"))]
    let peers: Vec<std::convert::Infallible> = Vec::new();
    // On a multi engine: which transport was chosen to each peer, and why.
    let choices: Vec<ferry::multi::Choice> = args
        .peer
        .iter()
        .filter_map(|p| engine.transport_choice(p))
        .collect();

    if args.json {
        let operations = report
            .operations
            .iter()
            .map(|(op, s)| {
                let (via, m) = match s {
                    Support::Native => (None, None),
                    Support::Emulated { via, missing } => (Some(via.clone()), Some(missing)),
                    Support::Unsupported(m) => (None, Some(m)),
                };
                JsonOp {
                    operation: op.name(),
                    support: s.kind(),
                    via,
                    reason: m.map(|m| m.reason.clone()),
                    min_version: m.and_then(|m| m.min_version.clone()),
                }
            })
            .collect();
        let j = JsonReport {
            backend: report.info.backend.clone(),
            segment: engine.segment_name().to_owned(),
            strict: report.strict,
            details: report.info.details.clone(),
            max_batch_len: report.native.max_batch_len,
            operations,
            required: args.require.iter().map(|o| o.name()).collect(),
            missing: missing.iter().map(ToString::to_string).collect(),
            peers: peers.iter().map(json_peer).collect(),
            transports: choices
                .iter()
                .map(|c| JsonChoice {
                    peer: c.peer.clone(),
                    transport: c.transport.clone(),
                    address: c.address.clone(),
                    ours: c.ours.clone(),
                    theirs: c.theirs.clone(),
                    reason: c.reason.clone(),
                    failovers: c.failovers,
                })
                .collect(),
        };
        println!("{}", serde_json::to_string_pretty(&j)?);
    } else {
        print!("{report}");
        if !report.info.details.iter().any(|(k, _)| k == "segment") {
            println!("segment: {}", engine.segment_name());
        }
        if !args.require.is_empty() && missing.is_empty() {
            let names: Vec<&str> = args.require.iter().map(|o| o.name()).collect();
            println!("required: {} — all available", names.join(", "));
        }
        for c in &choices {
            println!("transport to {}: {c}", c.peer);
        }
        for p in &peers {
            println!("negotiated with {p}");
        }
    }
    if missing.is_empty() {
        Ok(())
    } else {
        let list: Vec<String> = missing.iter().map(ToString::to_string).collect();
        Err(MissingRequired(format!(
            "the {} backend lacks required capabilities: {}",
            report.info.backend,
            list.join("; ")
        ))
        .into())
    }
}

#[cfg(feature = "tcp")]
fn json_peer(p: &ferry::PeerReport) -> JsonPeer {
    JsonPeer {
        peer: p.peer.clone(),
        this_engine_versions: p.ours.to_string(),
        peer_versions: p.theirs.to_string(),
        peer_negotiates: p.peer_negotiates,
        version: p.version,
        features: p
            .features
            .iter()
            .map(|f| JsonFeature {
                name: f.name,
                on: f.off.is_none(),
                why_off: f.off.as_ref().map(ToString::to_string),
            })
            .collect(),
        path: p.path.clone(),
        path_detail: p.path_detail.clone(),
        tls: p.tls.as_ref().ok().cloned(),
        tls_off: p.tls.as_ref().err().map(ToString::to_string),
    }
}

#[cfg(not(feature = "tcp"))]
fn json_peer(p: &std::convert::Infallible) -> JsonPeer {
    match *p {}
}
