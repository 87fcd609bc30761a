//! The control channel's authentication exchange, run at the start of every
//! control connection before any queue-pair data, region table, rkey or
//! notification crosses it.
//!
//! ```text
//! opener → owner   Auth { version, secret: bool, nonce_o }
//! owner  → opener  Challenge { secret: bool, nonce_t }     (or Refused)
//! with a secret on both sides:
//! opener → owner   Proof { HMAC(secret, "…initiator" ‖ nonce_o ‖ nonce_t) }
//! owner  → opener  Proof { HMAC(secret, "…target" ‖ nonce_o ‖ nonce_t) }  (or Refused)
//! ```
//!
//! A side that speaks the negotiated hello (protocol 4 and later) puts
//! [`wire::NEGOTIATE_MARK`] in the last 8 bytes of its nonce (24 stay
//! random); [`initiator`] returns whether the owner's nonce carries it,
//! which is how the opener knows it may send `Offer` instead of protocol
//! 3's `Hello`. The `Auth` frame itself is protocol 3's in every build.
//!
//! Nonces are 32 random bytes per connection and side, so a recorded proof
//! is worthless on another connection; proofs are compared in constant time
//! (`verify_slice`). A side with a secret accepts nothing from a side
//! without one: the owner refuses and drops the connection, the opener fails
//! with [`Error::Authentication`]. Every frame of the exchange is read with
//! the small [`HANDSHAKE_MAX_FRAME`] bound; the callers run the exchange
//! under the connect deadline.
#![cfg_attr(not(feature = "rdma"), allow(dead_code))]

use ferry_core::raw::auth::{nonce, proof, verify};
use ferry_core::{Error, Result};
use tokio::io::{AsyncRead, AsyncWrite};

use crate::negotiate::VersionRange;
use crate::wire::{self, Msg, HANDSHAKE_MAX_FRAME, VERSION};

const INITIATOR_LABEL: &[u8] = b"ferry-verbs/2 initiator";
const TARGET_LABEL: &[u8] = b"ferry-verbs/2 target";

/// How the owner's refusal reason starts when authentication failed (the
/// opener maps such a refusal to [`Error::Authentication`]).
const AUTH_REFUSAL: &str = "authentication failed";

// The proofs are `ferry_core::raw::auth`'s: HMAC-SHA256(secret,
// label ‖ opener nonce ‖ owner nonce) with the labels above.

fn auth_error(peer: &str, reason: impl Into<String>) -> Error {
    Error::Authentication {
        peer: peer.to_owned(),
        reason: reason.into(),
    }
}

fn unavailable(peer: &str, reason: impl Into<String>) -> Error {
    Error::SegmentUnavailable {
        name: peer.to_owned(),
        reason: reason.into(),
    }
}

fn protocol(peer: &str, reason: impl Into<String>) -> Error {
    Error::Protocol {
        peer: peer.to_owned(),
        reason: reason.into(),
    }
}

/// The opener's error for an owner's `Refused { reason }`.
fn refused(peer: &str, reason: String) -> Error {
    if reason.starts_with(AUTH_REFUSAL) {
        auth_error(peer, format!("the peer refused: {reason}"))
    } else {
        unavailable(peer, format!("refused: {reason}"))
    }
}

pub(crate) fn kind(m: &Msg) -> &'static str {
    match m {
        Msg::Auth { .. } => "Auth",
        Msg::Challenge { .. } => "Challenge",
        Msg::Proof { .. } => "Proof",
        Msg::Hello { .. } => "Hello",
        Msg::Welcome { .. } => "Welcome",
        Msg::Refused { .. } => "Refused",
        Msg::TableRequest => "TableRequest",
        Msg::Table { .. } => "Table",
        Msg::RegionAdded(_) => "RegionAdded",
        Msg::RegionRemoved { .. } => "RegionRemoved",
        Msg::Notify { .. } => "Notify",
        Msg::NotifyAck => "NotifyAck",
        Msg::Offer { .. } => "Offer",
        Msg::Agreed { .. } => "Agreed",
        Msg::Incompatible { .. } => "Incompatible",
    }
}

async fn send<S: AsyncWrite + Unpin>(stream: &mut S, peer: &str, msg: &Msg) -> Result<()> {
    wire::write_msg(stream, msg).await.map_err(|e| {
        unavailable(
            peer,
            format!("sending {} on the control channel: {e}", kind(msg)),
        )
    })
}

async fn recv<S: AsyncRead + Unpin>(stream: &mut S, peer: &str) -> Result<Option<Msg>> {
    wire::read_msg_max(stream, peer, HANDSHAKE_MAX_FRAME).await
}

/// Best effort: the connection is dropped right after.
async fn refuse<S: AsyncWrite + Unpin>(stream: &mut S, reason: &str) {
    let _ = wire::write_msg(
        stream,
        &Msg::Refused {
            reason: reason.to_owned(),
        },
    )
    .await;
}

/// The opener's side, first thing on a new control connection. `peer` is
/// the segment name (for errors). Returns once the owner is authenticated
/// (with a secret) or both sides agreed to run without one; `Ok(true)` if
/// the owner's nonce carries the negotiation mark. `negotiates`: mark this
/// side's nonce (a side capped at protocol 3 does not).
///
/// Errors: [`Error::Authentication`] if the owner does not prove `secret`,
/// has no secret while this side has one, requires one this side lacks, or
/// refused this side's proof; [`Error::SegmentUnavailable`] for another
/// refusal or a closed channel; [`Error::Protocol`] for an unexpected frame.
pub(crate) async fn initiator<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    peer: &str,
    secret: Option<&str>,
    negotiates: bool,
) -> Result<bool> {
    let no = if negotiates {
        wire::mark(nonce())
    } else {
        nonce()
    };
    send(
        stream,
        peer,
        &Msg::Auth {
            version: VERSION,
            secret: secret.is_some(),
            nonce: no,
        },
    )
    .await?;
    let nt = match recv(stream, peer).await? {
        Some(Msg::Challenge {
            secret: theirs,
            nonce,
        }) => match (secret.is_some(), theirs) {
            (true, false) => {
                return Err(auth_error(
                    peer,
                    "this engine has a shared secret but the peer has none, so it cannot \
                     prove it: configure the same `secret=` on both engines",
                ))
            }
            (false, true) => {
                return Err(auth_error(
                    peer,
                    "the peer requires a shared secret and this engine has none: \
                     configure the same `secret=` on both engines",
                ))
            }
            _ => nonce,
        },
        Some(Msg::Refused { reason }) => return Err(refused(peer, reason)),
        Some(other) => {
            return Err(protocol(
                peer,
                format!("expected Challenge, got {}", kind(&other)),
            ))
        }
        None => {
            return Err(unavailable(
                peer,
                "the peer closed the control channel during authentication \
                 (it may speak an older protocol version)",
            ))
        }
    };
    let marked = wire::is_marked(&nt);
    let Some(secret) = secret else {
        return Ok(marked);
    };
    send(
        stream,
        peer,
        &Msg::Proof {
            mac: proof(secret, INITIATOR_LABEL, &no, &nt),
        },
    )
    .await?;
    match recv(stream, peer).await? {
        Some(Msg::Proof { mac }) => {
            if verify(secret, TARGET_LABEL, &no, &nt, &mac) {
                Ok(marked)
            } else {
                Err(auth_error(
                    peer,
                    "the peer did not prove knowledge of the shared secret",
                ))
            }
        }
        Some(Msg::Refused { reason }) => Err(refused(peer, reason)),
        Some(other) => Err(protocol(
            peer,
            format!("expected Proof, got {}", kind(&other)),
        )),
        None => Err(auth_error(
            peer,
            "the peer closed the control channel instead of answering this engine's proof \
             (a different shared secret?)",
        )),
    }
}

/// The owner's side, first thing on an accepted control connection. `peer`
/// is the remote address (for errors). On any error the caller drops the
/// connection; nothing but `Challenge`, `Proof` and `Refused` has been sent.
/// `negotiates`: mark this side's nonce; `versions`: this side's range (for
/// the refusal of an older opener). Returns whether the opener's nonce
/// carries the negotiation mark.
///
/// Errors: [`Error::Authentication`] if the opener does not prove `secret`
/// (or has none while this side has one, or has one while this side has
/// none); [`Error::Protocol`] for another first frame or version;
/// [`Error::PeerLost`] if the opener closes the connection first.
pub(crate) async fn target<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    peer: &str,
    secret: Option<&str>,
    negotiates: bool,
    versions: VersionRange,
) -> Result<bool> {
    let closed = || Error::PeerLost {
        peer: peer.to_owned(),
        reason: "the opener closed the control channel during authentication".to_owned(),
    };
    let (no, theirs) = match recv(stream, peer).await? {
        Some(Msg::Auth {
            version,
            secret: theirs,
            nonce,
        }) if version == VERSION => (nonce, theirs),
        Some(Msg::Auth { version, .. } | Msg::Hello { version, .. }) => {
            let reason = if version == VERSION {
                format!(
                    "the opener skipped the authentication exchange that protocol version \
                     {VERSION} begins with"
                )
            } else {
                format!(
                    "protocol version {version} is not supported: this engine speaks {versions}; \
                     upgrade the opener to a build that speaks {} or later",
                    versions.min
                )
            };
            refuse(stream, &reason).await;
            return Err(protocol(peer, reason));
        }
        Some(other) => {
            return Err(protocol(
                peer,
                format!("expected Auth, got {}", kind(&other)),
            ))
        }
        None => return Err(closed()),
    };
    if secret.is_some() && !theirs {
        refuse(
            stream,
            &format!(
                "{AUTH_REFUSAL}: the owner of this segment requires a shared secret \
                 (`secret=`) and the opener has none"
            ),
        )
        .await;
        return Err(auth_error(peer, "the opener has no shared secret"));
    }
    let nt = if negotiates {
        wire::mark(nonce())
    } else {
        nonce()
    };
    let marked = wire::is_marked(&no);
    send(
        stream,
        peer,
        &Msg::Challenge {
            secret: secret.is_some(),
            nonce: nt,
        },
    )
    .await?;
    let Some(secret) = secret else {
        if theirs {
            // The opener requires a proof this side cannot give; it gives up.
            return Err(auth_error(
                peer,
                "the opener has a shared secret and this engine has none",
            ));
        }
        return Ok(marked);
    };
    match recv(stream, peer).await? {
        Some(Msg::Proof { mac }) if verify(secret, INITIATOR_LABEL, &no, &nt, &mac) => {}
        Some(Msg::Proof { .. }) => {
            refuse(stream, &format!("{AUTH_REFUSAL}: wrong shared secret")).await;
            return Err(auth_error(
                peer,
                "the opener did not prove knowledge of the shared secret",
            ));
        }
        Some(other) => {
            return Err(protocol(
                peer,
                format!("expected Proof, got {}", kind(&other)),
            ))
        }
        None => return Err(closed()),
    }
    send(
        stream,
        peer,
        &Msg::Proof {
            mac: proof(secret, TARGET_LABEL, &no, &nt),
        },
    )
    .await?;
    Ok(marked)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::NONCE_LEN;
    use tokio::io::{duplex, AsyncReadExt};

    const RANGE: VersionRange = VersionRange { min: 3, max: 4 };

    async fn run(
        initiator_secret: Option<&str>,
        target_secret: Option<&str>,
    ) -> (Result<()>, Result<()>) {
        let (mut a, mut b) = duplex(1 << 16);
        let i = async {
            let r = initiator(&mut a, "owner", initiator_secret, true)
                .await
                .map(|_| ());
            // The opener drops the connection on failure.
            drop(a);
            r
        };
        let t = async {
            let r = target(&mut b, "opener", target_secret, true, RANGE)
                .await
                .map(|_| ());
            drop(b);
            r
        };
        tokio::join!(i, t)
    }

    #[tokio::test]
    async fn same_secret_and_no_secret_succeed() {
        let (i, t) = run(Some("s3cret"), Some("s3cret")).await;
        assert!(i.is_ok() && t.is_ok(), "{i:?} {t:?}");
        let (i, t) = run(None, None).await;
        assert!(i.is_ok() && t.is_ok(), "{i:?} {t:?}");
    }

    #[tokio::test]
    async fn wrong_secret_is_refused_on_both_sides() {
        let (i, t) = run(Some("right"), Some("wrong")).await;
        assert!(matches!(i, Err(Error::Authentication { .. })), "{i:?}");
        assert!(matches!(t, Err(Error::Authentication { .. })), "{t:?}");
    }

    #[tokio::test]
    async fn a_missing_secret_fails_clearly_either_way() {
        let (i, t) = run(None, Some("s")).await;
        match &i {
            Err(Error::Authentication { reason, .. }) => {
                assert!(reason.contains("secret"), "{reason}")
            }
            other => panic!("expected Authentication, got {other:?}"),
        }
        assert!(matches!(t, Err(Error::Authentication { .. })), "{t:?}");
        let (i, t) = run(Some("s"), None).await;
        match &i {
            Err(Error::Authentication { reason, .. }) => {
                assert!(reason.contains("has none"), "{reason}")
            }
            other => panic!("expected Authentication, got {other:?}"),
        }
        assert!(t.is_err(), "{t:?}");
    }

    /// A peer that replays a proof made for other nonces is refused: the
    /// owner's nonce is fresh on every connection.
    #[tokio::test]
    async fn a_replayed_proof_is_refused() {
        let secret = "s";
        let (mut a, mut b) = duplex(1 << 16);
        let owner =
            tokio::spawn(async move { target(&mut b, "opener", Some(secret), true, RANGE).await });
        let no = [7u8; NONCE_LEN];
        wire::write_msg(
            &mut a,
            &Msg::Auth {
                version: VERSION,
                secret: true,
                nonce: no,
            },
        )
        .await
        .unwrap();
        let Some(Msg::Challenge { nonce: nt, .. }) = wire::read_msg(&mut a, "o").await.unwrap()
        else {
            panic!("no challenge")
        };
        // A proof for an earlier owner nonce (and one for the wrong direction).
        let stale = proof(secret, INITIATOR_LABEL, &no, &[0u8; NONCE_LEN]);
        assert_ne!(nt, [0u8; NONCE_LEN]);
        wire::write_msg(&mut a, &Msg::Proof { mac: stale })
            .await
            .unwrap();
        match wire::read_msg(&mut a, "o").await.unwrap() {
            Some(Msg::Refused { reason }) => assert!(reason.starts_with(AUTH_REFUSAL), "{reason}"),
            other => panic!("expected a refusal, got {other:?}"),
        }
        assert!(matches!(
            owner.await.unwrap(),
            Err(Error::Authentication { .. })
        ));
        // Nothing follows the refusal.
        let mut rest = Vec::new();
        a.read_to_end(&mut rest).await.unwrap();
        assert!(rest.is_empty(), "{} bytes after the refusal", rest.len());
        // The target's proof differs from the initiator's for the same nonces.
        assert_ne!(
            proof(secret, INITIATOR_LABEL, &no, &nt),
            proof(secret, TARGET_LABEL, &no, &nt)
        );
    }

    #[tokio::test]
    async fn old_protocol_and_oversized_first_frames_are_refused() {
        let (mut a, mut b) = duplex(1 << 16);
        let owner =
            tokio::spawn(async move { target(&mut b, "opener", Some("s"), true, RANGE).await });
        wire::write_msg(
            &mut a,
            &Msg::Hello {
                version: 1,
                endpoint: wire::QpEndpoint {
                    qpn: 1,
                    psn: 2,
                    lid: 3,
                    gid: [0; 16],
                    mtu: 3,
                },
                name: "old".into(),
            },
        )
        .await
        .unwrap();
        match wire::read_msg(&mut a, "o").await.unwrap() {
            Some(Msg::Refused { reason }) => assert!(reason.contains("version 1"), "{reason}"),
            other => panic!("expected a refusal, got {other:?}"),
        }
        assert!(matches!(owner.await.unwrap(), Err(Error::Protocol { .. })));

        let (mut a, mut b) = duplex(1 << 16);
        let owner = tokio::spawn(async move { target(&mut b, "opener", None, true, RANGE).await });
        tokio::io::AsyncWriteExt::write_all(&mut a, &(16u32 << 20).to_be_bytes())
            .await
            .unwrap();
        assert!(matches!(owner.await.unwrap(), Err(Error::Protocol { .. })));
    }
}
