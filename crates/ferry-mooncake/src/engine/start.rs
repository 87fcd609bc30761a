//! Start-up: the engine's identity (segment name, host, ports), creating the
//! C engine and installing its transport.

use std::collections::HashSet;
use std::ffi::{c_char, c_void, CStr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex};

use ferry_core::__private::sync::lock;
use ferry_core::raw::BatchTable;
use ferry_core::{Error, RegionTable, Result};

use super::landed::Scratch;
use super::notify::notify_gap;
use super::poller::{poll_loop, Core, Poller};
use super::report::sends_unacknowledged;
use super::segments::{Segments, PEERS};
use super::{blocking, cstring, Inner, LibraryTrust, MooncakeEngine, RawEngine, BACKEND};
use crate::codes::call_error;
use crate::config::{MooncakeConfig, P2P_HANDSHAKE};
use crate::library::{Generation, MooncakeLibrary};

/// Process-wide engine numbers (tell apart engines that reused a segment
/// name).
static ENGINE_IDS: AtomicU64 = AtomicU64::new(1);

/// The NIC priority matrix for `installTransport`'s first argument.
fn device_matrix(device: &str) -> String {
    if device.trim_start().starts_with('{') {
        return device.to_owned();
    }
    let nics: Vec<String> = device
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| format!("{s:?}"))
        .collect();
    format!("{{\"cpu:0\": [[{}], []]}}", nics.join(", "))
}

/// Names in use by the live engines of this process: `local_server_name`s
/// given to the library in metadata-server mode. Mooncake keeps one metadata
/// entry per name, and a second engine with the same name overwrites the
/// first one's entry (and, on builds that bind the port the entry names,
/// throws from inside the C API, which aborts the process).
static LIVE_NAMES: LazyLock<Mutex<HashSet<String>>> = LazyLock::new(|| Mutex::new(HashSet::new()));

/// The `local_server_name` and RPC port to give `createTransferEngine`.
///
/// - `P2PHANDSHAKE` (≥ v0.3.0): Mooncake names the segment
///   `<host part of local_server_name>:<port it picks>` and ignores
///   `ip_or_host_name` and `rpc_port`, so the name given is the host, and
///   `name=` / `port=` are refused as meaningless.
/// - metadata server, v0.2.0 era (no `getLocalIpAndPort`): the library
///   publishes `host:port` as given and its TCP transport binds that port;
///   port 0 would be published as 0 (unreachable), so Ferry picks a free
///   port, and checks a given one is free (a clash throws a C++ exception
///   through the C API, which aborts the process).
/// - metadata server, ≥ v0.3.0: the library picks a random port and
///   announces `MC_TCP_BIND_ADDRESS` or the first LAN address; `host=` and
///   `port=` are ignored by the library (logged).
fn local_identity(
    lib: &MooncakeLibrary,
    config: &MooncakeConfig,
    p2p: bool,
) -> Result<(String, u16, Option<NameReservation>)> {
    if p2p {
        if config.name.is_some() {
            return Err(Error::InvalidArgument(format!(
                "mooncake: name= names the segment only with a metadata server; with \
                 {P2P_HANDSHAKE} Mooncake names it <host>:<port it picks> (set host= to the \
                 address peers should use)"
            )));
        }
        if config.port != 0 {
            return Err(Error::InvalidArgument(format!(
                "mooncake: port= has no effect with {P2P_HANDSHAKE}: Mooncake picks its own \
                 port (the segment name says which)"
            )));
        }
        if lib.generation() == Generation::V0_3_0 {
            // v0.3.0–v0.3.4 listen for TCP data on the RPC port + 1 without
            // checking it is free (a clash throws through the C API and
            // aborts the process), and honour a port in the name: give them
            // a pair of free ports.
            let port = free_port_pair(&config.host)?;
            return Ok((format!("{}:{port}", config.host), 0, None));
        }
        return Ok((config.host.clone(), 0, None));
    }
    static NAMES: AtomicU64 = AtomicU64::new(0);
    let name = config.name.clone().unwrap_or_else(|| {
        format!(
            "ferry-{}-{}",
            std::process::id(),
            NAMES.fetch_add(1, Ordering::Relaxed)
        )
    });
    if !lock(&LIVE_NAMES).insert(name.clone()) {
        return Err(Error::InvalidArgument(format!(
            "mooncake: name {name:?} is in use by a live engine of this process; each \
             engine needs its own name (it is the key of its metadata entry)"
        )));
    }
    let reservation = NameReservation(name.clone());
    if lib.generation() >= Generation::V0_3_0 {
        if std::env::var("MC_TCP_BIND_ADDRESS").map_or(true, |a| a != config.host) {
            tracing::info!(
                host = %config.host,
                "ferry: Mooncake {} in metadata-server mode ignores host= and port=: it \
                 announces MC_TCP_BIND_ADDRESS or the first LAN address, on a port it picks",
                lib.generation()
            );
        }
        return Ok((name, config.port, Some(reservation)));
    }
    let port = if config.port == 0 {
        free_port(&config.host)?
    } else {
        ensure_port_free(&config.host, config.port)?;
        config.port
    };
    Ok((name, port, Some(reservation)))
}

/// A name held in [`LIVE_NAMES`] until the C engine that uses it is
/// destroyed (the reservation lives in its `Core`).
pub(super) struct NameReservation(String);

impl Drop for NameReservation {
    fn drop(&mut self) {
        lock(&LIVE_NAMES).remove(&self.0);
    }
}

/// A port nothing listens on at `host` (see [`free_ports`]).
fn free_port(host: &str) -> Result<u16> {
    free_ports(host, 1)
}

/// A port `p` such that `p` and `p + 1` are both free at `host`.
fn free_port_pair(host: &str) -> Result<u16> {
    free_ports(host, 2)
}

/// A port `p` such that `p .. p + n` are all free at `host` (bound, then
/// released: another process could take one in between, a window of
/// microseconds). Chosen below the kernel's ephemeral range (32768 and up
/// by default), where the outgoing connections of the library itself (old
/// builds open one per request) do not compete, starting at a point that
/// differs per process and per call.
fn free_ports(host: &str, n: u16) -> Result<u16> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let seed = u64::from(std::process::id()).wrapping_mul(7919)
        + NEXT.fetch_add(u64::from(n), Ordering::Relaxed);
    for i in 0..256u64 {
        let p = 20000 + ((seed + u64::from(n) * i) % 10000) as u16;
        let all: std::io::Result<Vec<std::net::TcpListener>> = (0..n)
            .map(|k| std::net::TcpListener::bind(("0.0.0.0", p + k)))
            .collect();
        if all.is_ok() {
            return Ok(p);
        }
    }
    Err(Error::Unavailable {
        backend: BACKEND.into(),
        reason: format!("found no {n} consecutive free TCP ports on host {host:?} in 256 tries"),
    })
}

/// Fails with `InvalidArgument` when `port` cannot be bound: the library
/// would throw from inside the C API (process abort) instead of failing.
fn ensure_port_free(host: &str, port: u16) -> Result<()> {
    // The library binds the IPv4 wildcard address.
    match std::net::TcpListener::bind(("0.0.0.0", port)) {
        Ok(_) => Ok(()),
        Err(e) => Err(Error::InvalidArgument(format!(
            "mooncake: port {port} (host {host}) cannot be bound ({e}); this Mooncake build \
             would abort the process on it, so Ferry refuses it: give a free port, or 0"
        ))),
    }
}

impl MooncakeEngine {
    /// Loads the library (see [`MooncakeLibrary::resolve`]), creates a C
    /// engine, installs the configured transport and returns the engine.
    ///
    /// Errors: [`Error::InvalidArgument`] for a bad config;
    /// [`Error::Unavailable`] when the library cannot be found or loaded, is
    /// not Mooncake, is older than v0.2.0, or cannot create the engine or the
    /// transport (the message says which and why); [`Error::MissingSymbol`]
    /// when a required symbol is missing.
    ///
    /// # Safety
    ///
    /// This loads native code into the process and runs it: the library
    /// `config.library` names (the `lib=` URL parameter), else the one
    /// `FERRY_MOONCAKE_LIB` names, else `libtransfer_engine.so` from the
    /// loader's search path. Whoever sets those chooses code that runs with
    /// the process's rights, so they must come from the operator, never from
    /// a peer or a request. The library must be a Mooncake Transfer Engine
    /// build (or implement the same C API), as [`MooncakeLibrary::load`]
    /// requires.
    pub async unsafe fn start(config: MooncakeConfig) -> Result<MooncakeEngine> {
        config.validate()?;
        let cfg = config.clone();
        // SAFETY: forwarded to the caller (see above).
        let lib = blocking(move || unsafe { MooncakeLibrary::resolve(&cfg) }).await??;
        Self::start_with_library(lib, config).await
    }

    /// [`MooncakeEngine::start`] for code that states, with `trust`, that
    /// the library the configuration resolves to was chosen by the operator
    /// (the `ferry` facade does so for URLs, which it documents as trusted
    /// configuration).
    pub async fn start_trusted(
        config: MooncakeConfig,
        trust: LibraryTrust,
    ) -> Result<MooncakeEngine> {
        let LibraryTrust::OperatorConfigured = trust;
        // SAFETY: `trust` is the caller's statement of `start`'s contract.
        unsafe { Self::start(config) }.await
    }

    /// As [`MooncakeEngine::start`], with a library already loaded (its
    /// `config.library` is ignored).
    pub async fn start_with_library(
        lib: Arc<MooncakeLibrary>,
        config: MooncakeConfig,
    ) -> Result<MooncakeEngine> {
        config.validate()?;
        let p2p = config.metadata == P2P_HANDSHAKE;
        if p2p && lib.api.get_local_ip_and_port.is_none() {
            return Err(Error::Unavailable {
                backend: BACKEND.into(),
                reason: format!(
                    "{} is Mooncake {} (no getLocalIpAndPort): metadata {P2P_HANDSHAKE} needs \
                     Mooncake ≥ v0.3.0; give a metadata server with `metadata=` instead",
                    lib.path().display(),
                    lib.generation()
                ),
            });
        }
        let (server_name, port, reservation) = local_identity(&lib, &config, p2p)?;
        let meta = cstring("metadata", &config.metadata)?;
        let name_c = cstring("name", &server_name)?;
        let host = cstring("host", &config.host)?;
        let proto = cstring("protocol", &config.protocol)?;
        let matrix = match &config.device {
            Some(d) => Some(cstring("device", &device_matrix(d))?),
            None => None,
        };
        let port = u64::from(port);
        let api = lib.api;
        let created = blocking(move || {
            // SAFETY: `create` has the C API's signature (5 arguments, see
            // `library::CreateFn` for why that is sound on 4-argument
            // builds); the strings live until the call returns and Mooncake
            // copies them.
            let h = unsafe { (api.create)(meta.as_ptr(), name_c.as_ptr(), host.as_ptr(), port, 0) };
            if h.is_null() {
                return Err("createTransferEngine returned NULL".to_owned());
            }
            let mut args: [*mut c_void; 2] = [
                matrix
                    .as_ref()
                    .map_or(std::ptr::null_mut(), |m| m.as_ptr() as *mut c_void),
                std::ptr::null_mut(),
            ];
            let args_ptr = if matrix.is_some() {
                args.as_mut_ptr()
            } else {
                std::ptr::null_mut()
            };
            // SAFETY: `h` is a live engine; `proto` and `args` outlive the call.
            let t = unsafe { (api.install_transport)(h, proto.as_ptr(), args_ptr) };
            if t.is_null() {
                // SAFETY: `h` came from `create` and is destroyed once.
                unsafe { (api.destroy)(h) };
                return Err(format!(
                    "installTransport({:?}) returned NULL",
                    proto.to_string_lossy()
                ));
            }
            Ok(RawEngine(h))
        })
        .await?;
        let raw = created.map_err(|what| Error::Unavailable {
            backend: BACKEND.into(),
            reason: format!(
                "{what} ({} {}, metadata {:?}, local_server_name {:?}, host {}, port {}, \
                 protocol {}); the library's log says why",
                lib.path().display(),
                lib.generation(),
                config.metadata,
                server_name,
                config.host,
                port,
                config.protocol
            ),
        })?;
        // From here on the Core destroys the engine when dropped.
        // Also on TCP builds that acknowledge writes: for peers of a
        // generation that does not (see `segments::check_peer_generation`).
        let scratch = ((sends_unacknowledged(&lib, &config) || config.protocol == "tcp")
            && config.confirm_writes != Some(false))
        .then(|| Arc::new(Scratch::new()));
        let core = Arc::new(Core {
            lib: Arc::clone(&lib),
            raw,
            _name: reservation,
            _scratch: scratch.clone(),
        });
        if let Some(s) = &scratch {
            let engine = RawEngine(core.raw.0);
            let addr = s.addr() as usize;
            let loc = cstring("location", "cpu:0")?;
            let rc = blocking(move || {
                let e = engine;
                // SAFETY: live engine (the Core keeps it); the scratch buffer
                // stays allocated until after the engine is destroyed.
                unsafe { (api.register)(e.0, addr as *mut c_void, Scratch::LEN, loc.as_ptr(), 1) }
            })
            .await?;
            if rc != 0 {
                return Err(Error::Unavailable {
                    backend: BACKEND.into(),
                    reason: format!(
                        "registering the write-confirmation probe memory failed: {}",
                        call_error("registerLocalMemory", i64::from(rc))
                    ),
                });
            }
        }
        let segment_name = match (p2p, api.get_local_ip_and_port) {
            (true, Some(get)) => {
                let mut buf = vec![0u8; 256];
                // SAFETY: live engine; the buffer is writable for its length.
                let rc = unsafe { get(core.raw.0, buf.as_mut_ptr().cast::<c_char>(), buf.len()) };
                let got = CStr::from_bytes_until_nul(&buf)
                    .map(|s| s.to_string_lossy().into_owned())
                    .unwrap_or_default();
                if rc != 0 || got.is_empty() {
                    return Err(Error::Unavailable {
                        backend: BACKEND.into(),
                        reason: format!(
                            "getLocalIpAndPort failed ({rc}) on {}",
                            lib.path().display()
                        ),
                    });
                }
                got
            }
            _ => server_name.clone(),
        };
        let uid = ENGINE_IDS.fetch_add(1, Ordering::Relaxed);
        let probe_name = format!("ferry-notify-probe-{uid}");
        let notify_gap = notify_gap(&lib, &config, &core, &segment_name, &probe_name).await;
        let poller = Arc::new(Poller::default());
        // The poller thread is the only owner of the Core from here on, so
        // destroyTransferEngine (which may block: it joins threads and may
        // talk to the metadata server) runs there, never on an async worker.
        let raw = RawEngine(core.raw.0);
        {
            let poller = Arc::clone(&poller);
            std::thread::Builder::new()
                .name("ferry-mooncake-poll".into())
                .spawn(move || poll_loop(&core, &poller))
                .map_err(|e| Error::io("starting the Mooncake status poller", &e))?;
        }
        let regions = RegionTable::new();
        lock(&PEERS).insert(segment_name.clone(), (uid, regions.clone()));
        tracing::info!(
            library = %lib.path().display(),
            generation = %lib.generation(),
            segment = %segment_name,
            protocol = %config.protocol,
            "ferry: Mooncake engine started"
        );
        Ok(MooncakeEngine {
            inner: Arc::new(Inner {
                raw,
                lib,
                poller,
                uid,
                config,
                server_name,
                segment_name,
                regions,
                segments: Mutex::new(Segments::default()),
                batches: BatchTable::new(BACKEND),
                registering: Default::default(),
                registry: Default::default(),
                scratch,
                notify_gap,
                probe_name,
                inbox: ferry_core::raw::Inbox::new(usize::MAX, usize::MAX),
            }),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::device_matrix;

    #[test]
    fn device_filter_becomes_a_nic_priority_matrix() {
        assert_eq!(
            device_matrix("mlx5_0, mlx5_1"),
            r#"{"cpu:0": [["mlx5_0", "mlx5_1"], []]}"#
        );
        let json = r#"{"cuda:0": [["mlx5_2"], ["mlx5_0"]]}"#;
        assert_eq!(device_matrix(json), json);
    }
}
