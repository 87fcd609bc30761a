//! Shared helpers for the Mooncake backend tests: configs that point at the
//! faithful C-ABI test libraries (NOT Mooncake) of `mooncake-testlibs`.
#![allow(dead_code)]

use std::sync::atomic::{AtomicU64, Ordering};

use ferry_mooncake::{MooncakeConfig, MooncakeEngine, P2P_HANDSHAKE};
use mooncake_testlibs::{file_metadata, library_path, Generation as Lib};

/// The generations the backend supports (all but pre-v0.2.0).
pub const SUPPORTED: [Lib; 5] = [
    Lib::V0_2_0,
    Lib::V0_3_0,
    Lib::V0_3_5,
    Lib::V0_3_6,
    Lib::Current,
];

/// The backend's name for a test library's generation.
pub fn detected(gen: Lib) -> ferry_mooncake::Generation {
    use ferry_mooncake::Generation as G;
    match gen {
        Lib::PreV0_2_0 => panic!("pre-v0.2.0 is refused"),
        Lib::V0_2_0 => G::V0_2_0,
        Lib::V0_3_0 => G::V0_3_0,
        Lib::V0_3_5 => G::V0_3_5,
        Lib::V0_3_6 => G::V0_3_6,
        Lib::Current => G::V0_3_12,
    }
}

/// A metadata string every engine of one test shares: `P2PHANDSHAKE` where
/// the library has it, else a fresh `file://` directory (the test
/// libraries' stand-in for a metadata server).
pub fn metadata_for(gen: Lib) -> String {
    if gen.has_p2p_handshake() {
        P2P_HANDSHAKE.to_owned()
    } else {
        file_metadata(gen.version()).1
    }
}

static NAMES: AtomicU64 = AtomicU64::new(0);

/// A config for `gen` with `metadata`: a unique server name where the
/// metadata is a service (with `P2PHANDSHAKE` Mooncake names the segment
/// `host:port` itself and Ferry refuses `name=`). `stall` is `""` or
/// `"@stall=<ms>"`: the test libraries' convention, carried in the NIC
/// matrix (`device=`, ignored by real tcp transports), that makes the
/// engine's server sleep before serving each read or write.
pub fn config(gen: Lib, metadata: &str, stall: &str) -> MooncakeConfig {
    let name = (metadata != P2P_HANDSHAKE).then(|| {
        format!(
            "mc-{}-{}-{}",
            gen.version(),
            std::process::id(),
            NAMES.fetch_add(1, Ordering::Relaxed)
        )
    });
    // `MooncakeConfig` is #[non_exhaustive]: fields are set one by one.
    let mut config = MooncakeConfig::default();
    config.library = Some(library_path(gen));
    config.metadata = metadata.to_owned();
    config.name = name;
    config.device = stall.strip_prefix('@').map(str::to_owned);
    config
}

/// Starts an engine on `gen`.
pub async fn start(gen: Lib, metadata: &str) -> MooncakeEngine {
    start_engine(config(gen, metadata, ""))
        .await
        .unwrap_or_else(|e| panic!("starting an engine on the {gen} test library: {e}"))
}

/// `MooncakeEngine::start` for the tests, whose libraries are the ones this
/// workspace builds (or deliberately broken ones it builds to be refused).
pub async fn start_engine(config: MooncakeConfig) -> ferry_core::Result<MooncakeEngine> {
    // SAFETY: every library the tests name is built by mooncake-testlibs
    // from this repository's sources (Mooncake's C API, or a library that
    // is meant to be refused before any of its functions is called).
    unsafe { MooncakeEngine::start(config) }.await
}
