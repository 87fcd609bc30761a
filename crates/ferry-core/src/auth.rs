//! The HMAC-SHA256 challenge–response primitives of the backends' shared
//! secret handshakes (TCP and verbs), written once.
//!
//! Each side sends a fresh random nonce; each proves the secret with
//! `HMAC-SHA256(secret, label ‖ initiator nonce ‖ target nonce)`, where the
//! label names the protocol and the direction (so that a proof is worthless
//! for another protocol, for the other direction, or, the nonces being
//! fresh, on another connection). Proofs are checked in constant time.
//! Framing, labels and the order of messages stay each protocol's own.

use hmac::{Hmac, Mac};
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

/// Bytes of a nonce.
pub const NONCE_LEN: usize = 32;
/// Bytes of a proof (an HMAC-SHA256 tag).
pub const MAC_LEN: usize = 32;

/// HMAC-SHA256(secret, label ‖ initiator nonce ‖ target nonce).
fn mac(
    secret: &str,
    label: &[u8],
    initiator: &[u8; NONCE_LEN],
    target: &[u8; NONCE_LEN],
) -> HmacSha256 {
    // HMAC takes keys of any length: new_from_slice cannot fail here.
    let mut m = match HmacSha256::new_from_slice(secret.as_bytes()) {
        Ok(m) => m,
        Err(_) => unreachable!("HMAC accepts keys of any length"),
    };
    m.update(label);
    m.update(initiator);
    m.update(target);
    m
}

/// The proof of `secret` for the direction `label` on the connection whose
/// nonces are `initiator` (the connecting side's) and `target`.
pub fn proof(
    secret: &str,
    label: &[u8],
    initiator: &[u8; NONCE_LEN],
    target: &[u8; NONCE_LEN],
) -> [u8; MAC_LEN] {
    mac(secret, label, initiator, target)
        .finalize()
        .into_bytes()
        .into()
}

/// Whether `got` is the proof [`proof`] computes for these arguments,
/// compared in constant time (a proof of the wrong length is refused).
pub fn verify(
    secret: &str,
    label: &[u8],
    initiator: &[u8; NONCE_LEN],
    target: &[u8; NONCE_LEN],
    got: &[u8],
) -> bool {
    mac(secret, label, initiator, target)
        .verify_slice(got)
        .is_ok()
}

/// A fresh random nonce (from the thread-local CSPRNG, seeded by the
/// operating system).
pub fn nonce() -> [u8; NONCE_LEN] {
    rand::random()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_proof_is_hmac_sha256_of_label_and_both_nonces() {
        // Computed independently (Python's hmac module).
        let expected = "79ea5b68db6535e357b7b3fa0faa3bde6998590292469297cd1e5d417c21dfe3";
        let p = proof("k3y", b"ferry-test label", &[1; NONCE_LEN], &[2; NONCE_LEN]);
        let hex: String = p.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, expected);
    }

    #[test]
    fn verify_accepts_only_the_same_secret_label_and_nonces() {
        let (a, b) = ([3; NONCE_LEN], [4; NONCE_LEN]);
        let p = proof("s", b"x initiator", &a, &b);
        assert!(verify("s", b"x initiator", &a, &b, &p));
        assert!(!verify("t", b"x initiator", &a, &b, &p));
        assert!(!verify("s", b"x target", &a, &b, &p));
        assert!(!verify("s", b"x initiator", &b, &a, &p));
        assert!(!verify("s", b"x initiator", &a, &b, &p[..31]));
        assert!(!verify("s", b"x initiator", &a, &b, &[]));
    }

    #[test]
    fn nonces_are_fresh() {
        assert_ne!(nonce(), nonce());
    }
}
