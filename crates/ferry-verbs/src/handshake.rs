//! The control channel's handshake, both sides: authentication
//! (`crate::auth`), then the hello that agrees on the protocol version and
//! features and exchanges the queue pairs and the owner's region table.
//!
//! ```text
//! opener → owner   Auth { 3, secret, nonce_o }          nonce_o marked if the opener negotiates
//! owner  → opener  Challenge { secret, nonce_t }        nonce_t marked if the owner negotiates
//!                  (Proof each way with a secret: the proofs cover both nonces, marks included)
//! owner's nonce marked and the opener negotiates:
//! opener → owner   Offer { versions, endpoint, name, extensions }
//! owner  → opener  Agreed { versions, version, extensions, endpoint, regions }
//!                  | Incompatible { versions, reason } | Refused { reason }
//! otherwise (protocol 3, the frames of 7c3e5e6 byte for byte):
//! opener → owner   Hello { 3, endpoint, name }
//! owner  → opener  Welcome { endpoint, regions } | Refused { reason }
//! ```
//!
//! The owner takes either hello from any opener, so an opener of protocol
//! 3 (which ignores the mark) is served protocol 3, and a protocol-3 owner
//! (which never marks) is sent only protocol 3's frames. Both sides of a
//! negotiated hello compute [`negotiate::choose`] over the two offers; the
//! opener checks that the owner's choice is the same. The queue-pair setup
//! between the owner's reading of the hello and its answer is the caller's
//! ([`accept`], then [`welcome`]).
#![cfg_attr(not(feature = "rdma"), allow(dead_code))]

use ferry_core::{Error, Result};
use tokio::io::{AsyncRead, AsyncWrite};

use crate::auth;
use crate::negotiate::{self, Agreement, Feature, FeatureSet, NoCommonVersion, Offer};
use crate::wire::{self, Extension, Msg, QpEndpoint, RemoteRegion, HANDSHAKE_MAX_FRAME};

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

/// The typed refusal, as the public error.
pub(crate) fn no_common_version(peer: &str, e: &NoCommonVersion) -> Error {
    protocol(peer, e.to_string())
}

/// The extensions announcing `offer`'s features.
pub(crate) fn extensions(offer: &Offer) -> Vec<Extension> {
    offer
        .features
        .iter()
        .map(|f| Extension {
            id: f.id(),
            body: Vec::new(),
        })
        .collect()
}

/// The offer a peer's range and extensions make: known ids are features,
/// unknown ones are ignored (kept for the report).
pub(crate) fn offer_of(versions: negotiate::VersionRange, exts: &[Extension]) -> Offer {
    let mut features = FeatureSet::default();
    let mut unknown = Vec::new();
    for e in exts {
        match Feature::from_id(e.id) {
            Some(f) => features.insert(f),
            None => unknown.push(e.id),
        }
    }
    Offer {
        versions,
        features,
        unknown,
    }
}

/// What the opener learned from the owner.
#[derive(Debug)]
pub(crate) struct Opened {
    pub endpoint: QpEndpoint,
    pub regions: Vec<RemoteRegion>,
    pub agreement: Agreement,
}

/// The opener's side: authentication, then `Offer` (to an owner that
/// marked its nonce, when `local` negotiates) or protocol 3's `Hello`.
/// `peer` is the segment name, `name` this engine's.
///
/// Errors: those of [`auth::initiator`]; [`Error::Protocol`] when no version
/// is common (naming both ranges and the side to upgrade), when the owner's
/// answer is malformed or its choice differs from [`negotiate::choose`];
/// [`Error::SegmentUnavailable`] for a refusal or a closed channel.
pub(crate) async fn open<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    peer: &str,
    secret: Option<&str>,
    local: &Offer,
    endpoint: QpEndpoint,
    name: &str,
) -> Result<Opened> {
    // Nothing (not even this side's queue pair) is sent before the peer is
    // authenticated.
    let owner_negotiates = auth::initiator(stream, peer, secret, local.negotiates()).await?;
    if local.negotiates() && owner_negotiates {
        let offer = Msg::Offer {
            versions: local.versions,
            endpoint,
            name: name.to_owned(),
            extensions: extensions(local),
        };
        send(stream, peer, &offer).await?;
        return match wire::read_msg(stream, peer).await? {
            Some(Msg::Agreed {
                versions,
                version,
                extensions,
                endpoint,
                regions,
            }) => {
                let theirs = offer_of(versions, &extensions);
                let agreement = negotiate::choose(local, &theirs, true)
                    .map_err(|e| no_common_version(peer, &e))?;
                if agreement.version != version {
                    return Err(protocol(
                        peer,
                        format!(
                            "the owner chose protocol {version}, but the highest common version \
                             of {} and {} is {}",
                            local.versions, theirs.versions, agreement.version
                        ),
                    ));
                }
                Ok(Opened {
                    endpoint,
                    regions,
                    agreement,
                })
            }
            Some(Msg::Incompatible { versions, reason }) => {
                let e = NoCommonVersion {
                    opener: local.versions,
                    owner: versions,
                };
                Err(protocol(peer, format!("{e} (the owner: {reason})")))
            }
            Some(Msg::Refused { reason }) => Err(unavailable(peer, format!("refused: {reason}"))),
            Some(other) => Err(protocol(
                peer,
                format!("expected Agreed, got {}", auth::kind(&other)),
            )),
            None => Err(unavailable(
                peer,
                "the peer closed the control channel during the handshake",
            )),
        };
    }
    // The owner speaks protocol 3 only (or this side is capped at 3, and
    // like a protocol-3 build knows nothing of the owner's range).
    let mut agreement = negotiate::choose(local, &Offer::legacy(), true)
        .map_err(|e| no_common_version(peer, &e))?;
    agreement.negotiated = false;
    let hello = Msg::Hello {
        version: negotiate::OLDEST,
        endpoint,
        name: name.to_owned(),
    };
    send(stream, peer, &hello).await?;
    match wire::read_msg(stream, peer).await? {
        Some(Msg::Welcome { endpoint, regions }) => Ok(Opened {
            endpoint,
            regions,
            agreement,
        }),
        Some(Msg::Refused { reason }) => Err(unavailable(peer, format!("refused: {reason}"))),
        Some(other) => Err(protocol(
            peer,
            format!("expected Welcome, got {}", auth::kind(&other)),
        )),
        None => Err(unavailable(
            peer,
            "the peer closed the control channel during the handshake",
        )),
    }
}

/// What the owner learned from an opener.
#[derive(Debug)]
pub(crate) struct Inbound {
    pub endpoint: QpEndpoint,
    pub name: String,
    pub agreement: Agreement,
}

/// The owner's side up to the hello: authentication, then `Hello` (protocol
/// 3) or `Offer`. `Ok(None)`: the opener closed the channel after
/// authenticating. On `Err` the caller drops the connection; the opener
/// was told why where it can be (`Refused`, `Incompatible`).
///
/// Errors: those of [`auth::target`]; [`Error::Protocol`] for an
/// unexpected or malformed frame, a `Hello` of another version, or no
/// common version (both ranges named).
pub(crate) async fn accept<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    peer: &str,
    secret: Option<&str>,
    local: &Offer,
) -> Result<Option<Inbound>> {
    auth::target(stream, peer, secret, local.negotiates(), local.versions).await?;
    match wire::read_msg_max(stream, peer, HANDSHAKE_MAX_FRAME).await? {
        Some(Msg::Hello {
            version,
            endpoint,
            name,
        }) => {
            let theirs = negotiate::VersionRange {
                min: version,
                max: version,
            };
            let chosen = if version == negotiate::OLDEST {
                negotiate::choose(local, &Offer::legacy(), false)
            } else {
                Err(NoCommonVersion {
                    opener: theirs,
                    owner: local.versions,
                })
            };
            match chosen {
                Ok(mut agreement) => {
                    agreement.negotiated = false;
                    Ok(Some(Inbound {
                        endpoint,
                        name,
                        agreement,
                    }))
                }
                Err(e) => {
                    refuse(stream, &e.to_string()).await;
                    Err(no_common_version(peer, &e))
                }
            }
        }
        Some(Msg::Offer {
            versions,
            endpoint,
            name,
            extensions,
        }) if local.negotiates() => {
            let theirs = offer_of(versions, &extensions);
            match negotiate::choose(local, &theirs, false) {
                Ok(agreement) => Ok(Some(Inbound {
                    endpoint,
                    name,
                    agreement,
                })),
                Err(e) => {
                    let _ = wire::write_msg(
                        stream,
                        &Msg::Incompatible {
                            versions: local.versions,
                            reason: e.to_string(),
                        },
                    )
                    .await;
                    Err(no_common_version(peer, &e))
                }
            }
        }
        Some(other) => Err(protocol(
            peer,
            format!("expected Hello, got {}", auth::kind(&other)),
        )),
        None => Ok(None),
    }
}

/// The owner's answer to the hello of `agreement`: `Agreed` to an `Offer`,
/// protocol 3's `Welcome` to a `Hello`.
pub(crate) fn welcome(
    agreement: &Agreement,
    endpoint: QpEndpoint,
    regions: Vec<RemoteRegion>,
) -> Msg {
    if agreement.negotiated {
        Msg::Agreed {
            versions: agreement.local.versions,
            version: agreement.version,
            extensions: extensions(&agreement.local),
            endpoint,
            regions,
        }
    } else {
        Msg::Welcome { endpoint, regions }
    }
}

async fn send<S: AsyncWrite + Unpin>(stream: &mut S, peer: &str, msg: &Msg) -> Result<()> {
    wire::write_msg(stream, msg)
        .await
        .map_err(|e| unavailable(peer, format!("sending {}: {e}", auth::kind(msg))))
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

#[cfg(test)]
#[path = "handshake_tests.rs"]
mod tests;
