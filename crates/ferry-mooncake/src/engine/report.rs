//! What the engine can do and guarantees with the loaded build: the native
//! capabilities and the capability report (`backend_info`).

use ferry_core::{BackendInfo, Capabilities, MissingCapability, Operation};

use super::{MooncakeEngine, BACKEND};
use crate::config::MooncakeConfig;
use crate::library::{Generation, MooncakeLibrary};

impl MooncakeEngine {
    /// The capabilities this engine has natively (`capabilities()`).
    pub(super) fn native_caps(&self) -> Capabilities {
        let mut caps = Capabilities::default();
        caps.batch_register = true;
        caps.batch_unregister = true;
        caps.batch_transfer = true;
        caps.async_batch = true;
        caps.batch_wait = true;
        caps.notify = self.has_notify();
        caps.landed_writes =
            !sends_unacknowledged(&self.inner.lib, &self.inner.config) || self.confirms_writes();
        caps.peer_validation = !sends_unacknowledged(&self.inner.lib, &self.inner.config);
        caps
    }

    /// Whether writes are confirmed by reading them back (see `landed`).
    pub(super) fn confirms_writes(&self) -> bool {
        self.inner.scratch.is_some() && sends_unacknowledged(&self.inner.lib, &self.inner.config)
    }

    /// What "completed" means and whether the peer checks addresses, in
    /// words for the capability report.
    fn guarantees(&self) -> (String, &'static str) {
        if !sends_unacknowledged(&self.inner.lib, &self.inner.config) {
            return (
                "landed (acknowledged by the peer)".into(),
                "yes (the peer refuses addresses outside its registered regions)",
            );
        }
        let completion = if self.confirms_writes() {
            "landed: this build's TCP transport reports a write completed when it is sent, so \
             Ferry reads each write's last byte back until it shows before reporting it \
             completed (acknowledged by the library from Mooncake v0.3.12)"
        } else {
            "sent, not landed: this build's TCP transport reports a write completed when it \
             is handed to the socket, before the peer has written it, and confirm_writes is \
             off (acknowledged from Mooncake v0.3.12)"
        };
        (
            completion.into(),
            "no: this build's TCP transport writes at the peer wherever the address points, \
             registered or not, and reports success; Ferry checks peers in this process \
             itself (checked at the peer from Mooncake v0.3.12)",
        )
    }

    /// The guarantees this engine cannot give natively, with reasons.
    fn guarantees_missing(&self) -> Vec<MissingCapability> {
        if !sends_unacknowledged(&self.inner.lib, &self.inner.config) {
            return Vec::new();
        }
        let lib = &self.inner.lib;
        let min_version = Some(Generation::V0_3_12.mooncake_version());
        vec![
            MissingCapability {
                operation: Operation::LandedWrites,
                reason: format!(
                    "{} ({}) reports a TCP write completed when it is sent, with no \
                     acknowledgement from the peer{}",
                    lib.path().display(),
                    lib.generation(),
                    if self.confirms_writes() {
                        ""
                    } else {
                        " (Ferry confirms landings itself unless confirm_writes=0 or strict=1)"
                    }
                ),
                min_version: min_version.clone(),
            },
            MissingCapability {
                operation: Operation::PeerValidation,
                reason: format!(
                    "{} ({}) writes and reads at the peer wherever the address points \
                     (mapped but unregistered memory is overwritten)",
                    lib.path().display(),
                    lib.generation()
                ),
                min_version,
            },
        ]
    }

    /// The capability report (`backend_info()`): the library, how it was
    /// found, its generation, and what it does not do natively.
    pub(super) fn capability_report(&self) -> BackendInfo {
        let lib = &self.inner.lib;
        let mut details = vec![("library".to_owned(), lib.path().display().to_string())];
        if lib.requested_path() != lib.path() {
            details.push((
                "library requested".to_owned(),
                lib.requested_path().display().to_string(),
            ));
        }
        details.extend([
            ("library source".to_owned(), lib.source().to_string()),
            ("generation".to_owned(), generation_detail(lib)),
            ("metadata".to_owned(), self.inner.config.metadata.clone()),
            ("protocol".to_owned(), self.inner.config.protocol.clone()),
            ("segment".to_owned(), self.inner.segment_name.clone()),
        ]);
        let (completion, validation) = self.guarantees();
        details.push(("completion".to_owned(), completion));
        details.push(("peer address validation".to_owned(), validation.to_owned()));
        if self.inner.config.protocol == "tcp" {
            details.push((
                "peer generations".to_owned(),
                super::peer_wire::TcpWire::of_generation(lib.generation())
                    .peers_detail()
                    .to_owned(),
            ));
        }
        if self.inner.config.protocol == "tcp" && lib.generation() == Generation::V0_3_6 {
            details.push((
                "bad peer addresses".to_owned(),
                "a TCP transfer to an unmapped address crashes the peer on Mooncake \
                 v0.3.6–v0.3.8 (its error log prints the address as a C string; fixed in \
                 v0.3.9; this build's symbols cannot tell which it is)"
                    .to_owned(),
            ));
        }
        let mut not_native = Vec::new();
        not_native.extend(self.inner.notify_gap.clone());
        not_native.extend(self.guarantees_missing());
        let mut emulated = Vec::new();
        if self.confirms_writes() {
            emulated.push((
                Operation::LandedWrites,
                "Ferry reads each write's last byte back until it shows".to_owned(),
            ));
        }
        BackendInfo {
            backend: BACKEND.into(),
            details,
            not_native,
            emulated,
        }
    }
}

/// Whether the build's transport reports a write completed when it is sent
/// (Mooncake's TCP transport before v0.3.12 has no acknowledgement, and no
/// address check at the target either).
pub(super) fn sends_unacknowledged(lib: &MooncakeLibrary, config: &MooncakeConfig) -> bool {
    config.protocol == "tcp" && lib.generation() < Generation::V0_3_12
}

fn generation_detail(lib: &MooncakeLibrary) -> String {
    let g = lib.generation();
    let note = match g {
        Generation::V0_2_0 => {
            "no getLocalIpAndPort; createTransferEngine may take 4 or 5 arguments"
        }
        Generation::V0_3_0 => "getLocalIpAndPort present; no notification symbols",
        Generation::V0_3_5 => "submitTransferWithNotify present; no freeNotifsMsgBuf",
        Generation::V0_3_6 => "freeNotifsMsgBuf present; no discoverTopology",
        Generation::V0_3_11 => "discoverTopology present; no getNicLoadStats",
        Generation::V0_3_12 => "getNicLoadStats present",
    };
    format!("Mooncake {} or later ({note})", g.version())
}
