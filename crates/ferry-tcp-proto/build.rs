//! Declares the workspace's cfgs:
//! - `ferry_loom`: under loom's model checker the staging area has fewer
//!   slots and lane entries (`layout::area::SLOTS`, `ACKS`), the same as
//!   in ferry-tcp's ring code;
//! - `ferry_mutant`: a known bug (or a check taken out) planted into the core, one at a
//!   time, to show that the simulators find it (`grants::Unregistration`,
//!   `batch::Flow`, `batch::Requests`, `initiator`, `handshake`;
//!   `RUSTFLAGS='--cfg ferry_mutant="…"'`, never in a build that ships).
fn main() {
    println!("cargo::rustc-check-cfg=cfg(ferry_loom)");
    println!("cargo::rustc-check-cfg=cfg(ferry_mutant, values(\"grant_outlives_region\", \"notify_before_data\", \"deadline_per_slot\", \"window_waits_forever\", \"downgrade_unchecked\", \"proof_unbound_from_tls\", \"cread_unfenced\"))");
}
