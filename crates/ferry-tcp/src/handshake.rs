//! The connection handshake: versions, names, optional HMAC-SHA256
//! challenge–response in both directions, and the target's region table.
//!
//! The decisions are the sans-IO core's (`ferry_tcp_proto::handshake`,
//! PROTOCOL.md §3.3): this module executes its instructions on a
//! [`Stream`] ([`drive`], one loop for both sides) and turns its typed
//! failures into this crate's errors.

use std::time::Duration;

use crate::stream::Stream;
use crate::tls::{TlsContext, TlsMode};
use ferry_core::raw::auth::nonce;
use ferry_core::{Error, Result};
use ferry_tcp_proto::handshake::{
    self as core, Failure, Handshake, Instr, Settings, TlsSettings, Transport,
};

use crate::frame::{Status, WELCOME};
use crate::io::{read_some, write_all_slices, Pace};
use crate::negotiate::{self, FeatureSet, HostKey, VersionRange};

pub use ferry_tcp_proto::handshake::{reject_bytes, ClientOutcome, Welcome};

fn io_err(peer: &str, what: &str, timeout: Duration, e: std::io::Error) -> Error {
    // Under TLS: an alert such as the target refusing our certificate
    // (TLS 1.3 checks the client's only after the client's side of the
    // handshake is done, so the refusal arrives with the first read).
    if let Some(err) = crate::tls::io_error_tls(peer, "the peer", &e) {
        return err;
    }
    match e.kind() {
        std::io::ErrorKind::TimedOut => Error::Timeout {
            operation: format!("handshake ({what})"),
            peer: Some(peer.to_owned()),
            after: timeout,
        },
        std::io::ErrorKind::UnexpectedEof
        | std::io::ErrorKind::ConnectionReset
        | std::io::ErrorKind::BrokenPipe
        | std::io::ErrorKind::ConnectionAborted => Error::PeerLost {
            peer: peer.to_owned(),
            reason: format!("during handshake ({what}): {e}"),
        },
        _ => Error::io(format!("handshake with {peer} ({what})"), &e),
    }
}

async fn write_all(stream: &Stream, bufs: &[&[u8]], timeout: Duration) -> std::io::Result<()> {
    write_all_slices(stream, bufs, Pace::stall_only(timeout)).await
}

async fn read_exact(stream: &Stream, buf: &mut [u8], timeout: Duration) -> std::io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        let n = read_some(stream, &mut buf[done..], Some(timeout)).await?;
        if n == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "connection closed",
            ));
        }
        done += n;
    }
    Ok(())
}

/// Sends a rejection (`REJECT, status, len u16, reason`), best effort: the
/// connection is closed right after.
pub async fn send_reject(stream: &Stream, status: Status, reason: &str, timeout: Duration) {
    let _ = write_all(stream, &[&reject_bytes(status, reason)], timeout).await;
}

/// The initiator's error for a target's rejection.
fn rejected(peer: &str, status: Option<Status>, reason: String) -> Error {
    match status {
        Some(Status::AuthFailed) => Error::Authentication {
            peer: peer.to_owned(),
            reason,
        },
        Some(Status::Busy) => Error::SegmentUnavailable {
            name: peer.to_owned(),
            reason: format!("the peer is busy, try again: {reason}"),
        },
        Some(Status::BadVersion) => Error::Protocol {
            peer: peer.to_owned(),
            reason: format!("the peer refused our protocol version: {reason}"),
        },
        _ => Error::SegmentUnavailable {
            name: peer.to_owned(),
            reason: format!("the peer refused the connection: {reason}"),
        },
    }
}

/// The error for a connection closed before the target's first byte: a
/// ferry-tcp target always answers a hello (with its own, or a
/// rejection), so this peer is something else.
fn not_ferry_target(peer: &str, e: &Error) -> Error {
    Error::Protocol {
        peer: peer.to_owned(),
        reason: format!(
            "the peer closed the connection on our hello without answering ({e}): it is not a \
             ferry-tcp target (a Mooncake Transfer Engine handshake port does this, for \
             example); check the peer's address and backend"
        ),
    }
}

/// The error of an I/O failure `e` under the core's current step.
fn transport_error<H: Handshake>(
    hs: &mut H,
    peer: &str,
    timeout: Duration,
    e: std::io::Error,
) -> Error {
    let kind = match e.kind() {
        std::io::ErrorKind::TimedOut => Transport::TimedOut,
        std::io::ErrorKind::UnexpectedEof
        | std::io::ErrorKind::ConnectionReset
        | std::io::ErrorKind::BrokenPipe
        | std::io::ErrorKind::ConnectionAborted => Transport::Closed,
        _ => Transport::Other,
    };
    let Failure::Transport {
        what, unanswered, ..
    } = hs.transport_failed(kind)
    else {
        return io_err(peer, "handshake", timeout, e);
    };
    match io_err(peer, what, timeout, e) {
        err @ Error::PeerLost { .. } if unanswered => not_ferry_target(peer, &err),
        err => err,
    }
}

/// The error of a failure the core decided.
fn failure_error(f: Failure, peer: &str) -> Error {
    match f {
        Failure::Transport { what, .. } => Error::PeerLost {
            peer: peer.to_owned(),
            reason: format!("during handshake ({what})"),
        },
        Failure::NotFerry(reason) => Error::Protocol {
            peer: peer.to_owned(),
            reason,
        },
        Failure::Foreign { reason, recognised } => {
            if recognised {
                tracing::warn!(%peer, "refused a connection: {reason}");
            } else {
                tracing::debug!(%peer, "refused a connection: {reason}");
            }
            Error::Protocol {
                peer: peer.to_owned(),
                reason,
            }
        }
        Failure::Rejected { status, reason } => rejected(peer, status, reason),
        Failure::Protocol { peer, reason } => Error::Protocol { peer, reason },
        Failure::Authentication { peer, reason } => Error::Authentication { peer, reason },
    }
}

/// Runs a handshake core on `stream` to its end: writes and reads what it
/// asks (each within `timeout` of stall), runs TLS with `tls` (after
/// which `stream` is TLS's plaintext end), binds the credential socket
/// into `cred` (target), and returns its outcome or its failure as an
/// error.
async fn drive<H: Handshake>(
    hs: &mut H,
    stream: &mut Stream,
    peer: &str,
    timeout: Duration,
    tls: Option<&TlsContext>,
    cred: &mut Option<crate::same_host::cma::CredListener>,
) -> Result<H::Done> {
    let mut next = hs.start();
    loop {
        next = match next {
            Instr::Write {
                bytes, best_effort, ..
            } => match write_all(stream, &[&bytes], timeout).await {
                Err(e) if !best_effort => return Err(transport_error(hs, peer, timeout, e)),
                _ => hs.written(),
            },
            Instr::Read {
                len, best_effort, ..
            } => {
                let mut buf = vec![0u8; len];
                match read_exact(stream, &mut buf, timeout).await {
                    Err(e) if !best_effort => return Err(transport_error(hs, peer, timeout, e)),
                    _ => hs.received(&buf),
                }
            }
            Instr::Tls { client } => {
                let Some(t) = tls else {
                    return Err(Error::Protocol {
                        peer: peer.to_owned(),
                        reason: "TLS asked for with TLS off".to_owned(),
                    });
                };
                let session = if client {
                    t.connect(stream, peer, timeout).await?
                } else {
                    t.accept(stream, peer, timeout).await?
                };
                hs.tls_done(&session.suite, session.exporter)
            }
            Instr::BindCred => match crate::same_host::cma::CredListener::bind() {
                Ok(l) => {
                    let invite = l.invite().clone();
                    *cred = Some(l);
                    hs.cred_bound(Some(invite))
                }
                Err(why) => {
                    tracing::debug!(%peer, %why, "no credential socket");
                    hs.cred_bound(None)
                }
            },
            Instr::Done(d) => return Ok(d),
            Instr::Fail(f) => return Err(failure_error(f, peer)),
        }
    }
}

/// The core's settings of a side.
fn settings<'a>(
    my_name: &'a str,
    peer: &'a str,
    secret: Option<&'a str>,
    features: FeatureSet,
    host_key: Option<&'a HostKey>,
    tls: Option<&TlsContext>,
) -> Settings<'a> {
    Settings {
        name: my_name,
        peer,
        secret,
        features,
        host_key,
        tls: tls.map(|t| TlsSettings {
            required: t.mode == TlsMode::Require,
            identity: t.identity,
        }),
        versions: VersionRange::OURS,
    }
}

/// Initiator side. `peer` is the segment name (for errors). With a secret,
/// the target must prove it too. `hello_version` is
/// [`negotiate::LEGACY_VERSION`] unless the target is known to speak only
/// an older one ([`ClientOutcome::Redial`]); `features` are this engine's.
///
/// With `tls` and a target that has TLS on, the TLS handshake runs right
/// after the extension blocks, and `stream` becomes its plaintext end.
#[allow(clippy::too_many_arguments)]
pub async fn client(
    stream: &mut Stream,
    peer: &str,
    my_name: &str,
    secret: Option<&str>,
    timeout: Duration,
    hello_version: u16,
    features: FeatureSet,
    host_key: Option<&HostKey>,
    tls: Option<&TlsContext>,
) -> Result<ClientOutcome> {
    let s = settings(my_name, peer, secret, features, host_key, tls);
    let mut hs = core::Initiator::new(s, hello_version, nonce());
    drive(&mut hs, stream, peer, timeout, tls, &mut None).await
}

/// An initiator that proved itself (or a target without a secret): the
/// target answers with [`send_welcome`] or [`send_reject`].
pub struct Verified {
    /// The initiator's engine name (informational).
    pub name: String,
    /// The version and features settled.
    pub agreement: negotiate::Agreement,
    /// The connection's credential socket, for its SAME_HOST offer (only
    /// with an initiator of this host that has [`negotiate::SAME_HOST_CRED`]
    /// on).
    pub cred: Option<crate::same_host::cma::CredListener>,
    proof: [u8; 32],
}

/// Target side, up to the verdict. Refuses (and sends a rejection) on a bad
/// magic, version or proof, before touching memory. A peer that is not
/// Ferry (recognised from its first bytes where possible, see
/// [`ferry_tcp_proto::foreign`]) is answered in its own framing where that framing
/// can carry a refusal, and refused with an error that names it.
///
/// With `tls` and an initiator that has TLS on, the TLS handshake runs
/// right after the initiator's extension block, and `stream` becomes its
/// plaintext end.
#[allow(clippy::too_many_arguments)]
pub async fn server(
    stream: &mut Stream,
    peer_addr: &str,
    my_name: &str,
    secret: Option<&str>,
    timeout: Duration,
    features: FeatureSet,
    host_key: Option<&HostKey>,
    tls: Option<&TlsContext>,
) -> Result<Verified> {
    let s = settings(my_name, peer_addr, secret, features, host_key, tls);
    let mut hs = core::Target::new(s, nonce());
    let mut cred = None;
    let v = drive(&mut hs, stream, peer_addr, timeout, tls, &mut cred).await?;
    Ok(Verified {
        name: v.name,
        agreement: v.agreement,
        cred: cred.filter(|_| v.keep_cred),
        proof: v.proof,
    })
}

/// Completes a target's handshake: WELCOME, its proof, the idle deadline
/// and the region table (`count` entries, encoded).
pub async fn send_welcome(
    stream: &Stream,
    peer_addr: &str,
    v: &Verified,
    idle: Duration,
    table: (u32, Vec<u8>),
    timeout: Duration,
) -> Result<()> {
    let idle_ms = u32::try_from(idle.as_millis()).unwrap_or(u32::MAX).max(1);
    write_all(
        stream,
        &[
            &[WELCOME],
            &v.proof,
            &idle_ms.to_le_bytes(),
            &table.0.to_le_bytes(),
            &table.1,
        ],
        timeout,
    )
    .await
    .map_err(|e| io_err(peer_addr, "sending welcome", timeout, e))
}

/// The outcome of the same-host negotiation on one connection.
pub enum SameHostVerdict {
    /// Payloads move by cross-memory attach; `channel`: the target took
    /// the offered control channel (`Ok`), or the reason it did not.
    Cma {
        /// `Ok` if the connection continues on the offered channel.
        channel: std::result::Result<(), String>,
        /// `Ok` if the target mapped the offered staging area, else why
        /// not.
        stage: std::result::Result<(), String>,
        /// The target's process as the kernel attests it on the
        /// credential connection (`None`: the target sent no invitation,
        /// an older build; or why it could not be read).
        target: Option<std::result::Result<crate::same_host::cma::Initiator, String>>,
    },
    /// Payloads move on the socket, for this reason.
    Refused(String),
}

/// Initiator side, right after the welcome: offers the same-host path
/// (SAME_HOST with this process's boot id, PID namespace, PID and a probe
/// word, and `channel`'s descriptor number as the control channel) and
/// reads the target's verdict. `channel` (this process's copy of the
/// target's end) and `stage` (the staging area) must stay open until
/// this returns. With the target's credential invitation `cred`
/// ([`negotiate::SAME_HOST_CRED`]), this process first connects to its
/// credential socket and sends the token there (if it cannot, no offer is
/// made), and holds that connection until the verdict. Errors are I/O or
/// protocol failures of the connection itself.
pub async fn offer_same_host(
    stream: &Stream,
    peer: &str,
    channel: Option<std::os::fd::RawFd>,
    stage: Option<std::os::fd::RawFd>,
    cred: Option<&negotiate::CredInvite>,
    timeout: Duration,
) -> Result<SameHostVerdict> {
    let (probe, offer) = match crate::same_host::cma::make_offer() {
        Ok(x) => x,
        Err(reason) => return Ok(SameHostVerdict::Refused(reason)),
    };
    let proof = match cred.map(crate::same_host::cma::cred_connect).transpose() {
        Ok(p) => p,
        Err(reason) => return Ok(SameHostVerdict::Refused(reason)),
    };
    let bytes = core::offer_bytes(
        channel.and_then(|fd| u32::try_from(fd).ok()),
        stage.and_then(|fd| u32::try_from(fd).ok()),
        &offer,
    );
    write_all(stream, &[&bytes], timeout)
        .await
        .map_err(|e| io_err(peer, "same-host offer", timeout, e))?;
    let mut resp = [0u8; crate::frame::HEADER_LEN];
    read_exact(stream, &mut resp, timeout)
        .await
        .map_err(|e| io_err(peer, "same-host verdict", timeout, e))?;
    // The target has read the probe and checked the credentials (or
    // given up) once it answered.
    drop(probe);
    let target = proof.as_ref().map(crate::same_host::cma::attested_target);
    drop(proof);
    let errno_name = crate::same_host::cma::errno_name;
    let why = |errno: u32, none: &str, what: &str| match errno {
        0 => none.to_owned(),
        e => format!("{what}: {}", errno_name(e as i32)),
    };
    match core::offer_answer(&resp) {
        Ok(core::OfferAnswer::Taken { channel, stage }) => Ok(SameHostVerdict::Cma {
            channel: channel.map_err(|e| why(e, "no channel offered", "pidfd_getfd")),
            stage: stage.map_err(|e| why(e, "no staging area offered", "staging area")),
            target,
        }),
        Ok(core::OfferAnswer::Refused { code, errno }) => Ok(SameHostVerdict::Refused(
            crate::same_host::cma::Refusal::describe(code, errno, errno_name),
        )),
        Err(reason) => Err(Error::Protocol {
            peer: peer.to_owned(),
            reason,
        }),
    }
}

#[cfg(test)]
mod tests {
    use ferry_core::raw::auth;

    #[test]
    fn the_cores_proofs_are_ferry_cores() {
        let (nc, nt) = ([5u8; 32], [9u8; 32]);
        for label in [
            b"ferry-tcp/2 initiator".as_slice(),
            b"ferry-tcp/6 target xyz",
        ] {
            let p = ferry_tcp_proto::handshake::proof("s3cret", label, &nc, &nt);
            assert_eq!(p, auth::proof("s3cret", label, &nc, &nt));
            assert!(auth::verify("s3cret", label, &nc, &nt, &p));
            assert!(ferry_tcp_proto::handshake::verify(
                "s3cret", label, &nc, &nt, &p
            ));
            assert!(!ferry_tcp_proto::handshake::verify(
                "other", label, &nc, &nt, &p
            ));
        }
    }
}
