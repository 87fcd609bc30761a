//! The connection handshake: versions, names, optional HMAC-SHA256
//! challenge–response in both directions, and the target's region table.

use std::time::Duration;

use crate::stream::Stream;
use crate::tls::{Identity, Session, TlsContext, TlsMode};
use ferry_core::raw::auth::{nonce, proof, verify};
use ferry_core::{Error, Result};

use crate::frame::{
    decode_table, Hello, Status, TableEntry, FLAG_AUTH, FLAG_EXT, HELLO_FIXED, MAGIC,
    MAX_REJECT_MSG, MAX_TABLE_ENTRIES, REJECT, TABLE_ENTRY_LEN, WELCOME,
};
use crate::io::{read_some, write_all_slices, Pace};
use crate::negotiate::{
    self, Agreement, Extensions, FeatureSet, HostKey, VersionRange, LEGACY_VERSION, MAX_EXT_LEN,
    MIN_VERSION,
};

const CLIENT_LABEL: &[u8] = b"ferry-tcp/2 initiator";
const SERVER_LABEL: &[u8] = b"ferry-tcp/2 target";

// The proofs are `ferry_core::raw::auth`'s: HMAC-SHA256(secret,
// label || initiator nonce || target nonce) with the labels above.

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

/// Reads the fixed part of a hello whose first byte is `first` (already
/// read).
async fn read_fixed(
    stream: &Stream,
    peer: &str,
    first: u8,
    timeout: Duration,
) -> Result<[u8; HELLO_FIXED]> {
    let mut fixed = [0u8; HELLO_FIXED];
    fixed[0] = first;
    read_exact(stream, &mut fixed[1..], timeout)
        .await
        .map_err(|e| io_err(peer, "hello", timeout, e))?;
    Ok(fixed)
}

/// Decodes a hello's fixed part (magic already checked) and reads its name.
async fn finish_hello(
    stream: &Stream,
    peer: &str,
    fixed: &[u8; HELLO_FIXED],
    timeout: Duration,
) -> Result<Hello> {
    let (mut hello, name_len) = Hello::decode_fixed(fixed).map_err(|e| Error::Protocol {
        peer: peer.to_owned(),
        reason: e.0,
    })?;
    let mut name = vec![0u8; name_len];
    read_exact(stream, &mut name, timeout)
        .await
        .map_err(|e| io_err(peer, "hello name", timeout, e))?;
    hello.name = String::from_utf8(name).map_err(|_| Error::Protocol {
        peer: peer.to_owned(),
        reason: "engine name is not UTF-8".to_owned(),
    })?;
    Ok(hello)
}

async fn read_first(stream: &Stream, peer: &str, what: &str, timeout: Duration) -> Result<u8> {
    let mut b = [0u8; 1];
    read_exact(stream, &mut b, timeout)
        .await
        .map_err(|e| io_err(peer, what, timeout, e))?;
    Ok(b[0])
}

/// Sends a rejection (`REJECT, status, len u16, reason`), best effort: the
/// connection is closed right after.
pub async fn send_reject(stream: &Stream, status: Status, reason: &str, timeout: Duration) {
    let _ = write_all(stream, &[&reject_bytes(status, reason)], timeout).await;
}

/// The bytes of a rejection.
pub fn reject_bytes(status: Status, reason: &str) -> Vec<u8> {
    let mut msg = reason.as_bytes();
    if msg.len() > MAX_REJECT_MSG {
        msg = &msg[..MAX_REJECT_MSG];
    }
    let mut out = Vec::with_capacity(4 + msg.len());
    out.push(REJECT);
    out.push(status as u8);
    out.extend_from_slice(&(msg.len() as u16).to_le_bytes());
    out.extend_from_slice(msg);
    out
}

/// Reads the rest of a rejection (its `REJECT` byte already read) and turns
/// it into the initiator's error.
async fn read_reject(stream: &Stream, peer: &str, timeout: Duration) -> Error {
    let mut head = [0u8; 3];
    if let Err(e) = read_exact(stream, &mut head, timeout).await {
        return io_err(peer, "rejection", timeout, e);
    }
    let len = (u16::from_le_bytes([head[1], head[2]]) as usize).min(MAX_REJECT_MSG);
    let mut msg = vec![0u8; len];
    let _ = read_exact(stream, &mut msg, timeout).await;
    // The text comes from the peer: keep it printable.
    let reason: String = String::from_utf8_lossy(&msg)
        .chars()
        .flat_map(char::escape_default)
        .take(MAX_REJECT_MSG)
        .collect();
    match Status::from_u8(head[0]) {
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

/// What an initiator learns from a successful handshake.
pub struct Welcome {
    /// The target's registered regions with their generations, sorted.
    pub table: Vec<TableEntry>,
    /// The target's idle deadline for this connection (`None`: none).
    pub idle: Option<Duration>,
    /// The version and features settled.
    pub agreement: Agreement,
}

/// How an initiator's handshake ended without an error.
pub enum ClientOutcome {
    /// Connected.
    Welcome(Welcome),
    /// The target does not negotiate and speaks only this older version,
    /// which this build speaks too: it has refused the hello (it names
    /// [`LEGACY_VERSION`]); dial again with a hello of this version.
    Redial(u16),
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

/// The error for a target whose first bytes are not a ferry-tcp hello.
fn not_ferry_bytes(peer: &str, first: &[u8]) -> Error {
    let what =
        crate::foreign::describe(first).unwrap_or_else(|| "not a ferry-tcp target".to_owned());
    Error::Protocol {
        peer: peer.to_owned(),
        reason: format!("the peer answered with {:02x?}: {what}", first),
    }
}

/// The proof labels: the legacy ones, or for a negotiated handshake the
/// version-6 labels followed by both extension blocks (so a MITM cannot
/// alter what either side announced without failing the proofs).
///
/// Under TLS the tail ends with 32 bytes of the TLS exporter
/// ([`crate::tls::Session::exporter`]): the proofs then hold only on the
/// TLS session they were made in, so a man in the middle that ran its own
/// TLS session with each side could not relay them.
fn labels(exts: Option<(&[u8], &[u8])>, exporter: Option<&[u8; 32]>) -> (Vec<u8>, Vec<u8>) {
    match exts {
        None => (CLIENT_LABEL.to_vec(), SERVER_LABEL.to_vec()),
        Some((ei, et)) => {
            let x: &[u8] = exporter.map_or(&[], |x| x.as_slice());
            let tail: Vec<u8> = [ei, et, x].concat();
            (
                [b"ferry-tcp/6 initiator".as_slice(), &tail].concat(),
                [b"ferry-tcp/6 target".as_slice(), &tail].concat(),
            )
        }
    }
}

/// Reads an extension block (u16 length, then the entries).
async fn read_ext(stream: &Stream, peer: &str, timeout: Duration) -> Result<(Vec<u8>, Extensions)> {
    let mut len = [0u8; 2];
    read_exact(stream, &mut len, timeout)
        .await
        .map_err(|e| io_err(peer, "extension block", timeout, e))?;
    let n = u16::from_le_bytes(len) as usize;
    if n > MAX_EXT_LEN {
        return Err(Error::Protocol {
            peer: peer.to_owned(),
            reason: format!("extension block of {n} bytes exceeds {MAX_EXT_LEN}"),
        });
    }
    let mut body = vec![0u8; n];
    read_exact(stream, &mut body, timeout)
        .await
        .map_err(|e| io_err(peer, "extension block", timeout, e))?;
    let ext = Extensions::decode(&body).map_err(|reason| Error::Protocol {
        peer: peer.to_owned(),
        reason,
    })?;
    let mut raw = len.to_vec();
    raw.extend_from_slice(&body);
    Ok((raw, ext))
}

/// What a side announces: this build's range, its features, and (when it
/// has the same-host path on and knows its [`HostKey`]) its host token for
/// these nonces.
fn our_extensions(
    features: FeatureSet,
    host_key: Option<&HostKey>,
    tls: Option<&TlsContext>,
    nc: &[u8; 32],
    nt: &[u8; 32],
    cred: Option<&crate::same_host::cma::CredListener>,
) -> Extensions {
    Extensions {
        versions: VersionRange::OURS,
        features,
        host: host_key
            .filter(|_| features.enabled(negotiate::SAME_HOST))
            .map(|k| negotiate::host_token(k, nc, nt)),
        tls: tls
            .filter(|_| features.enabled(negotiate::TLS))
            .map(|t| t.identity as u8),
        cred: cred.map(|c| c.invite().clone()),
    }
}

/// Whether a connection runs TLS (PROTOCOL.md §1.3): `Ok(true)` if both
/// sides have it on with the same kind of identity, `Ok(false)` to stay
/// in clear, `Err(reason)` if this side requires TLS and the peer cannot
/// (or the two identities differ).
fn tls_plan(
    tls: Option<&TlsContext>,
    theirs: Option<&Extensions>,
    peer_role: &str,
) -> std::result::Result<bool, String> {
    let Some(ours) = tls else {
        return Ok(false);
    };
    let required = ours.mode == TlsMode::Require;
    let lacking = match theirs {
        None => Some(format!(
            "the {peer_role} does not negotiate (a Ferry build before protocol version 6): it \
             cannot speak TLS"
        )),
        Some(t) if t.features.has & negotiate::TLS.bit == 0 => {
            Some(format!("the {peer_role} lacks TLS (an older Ferry build)"))
        }
        Some(t) if !t.features.enabled(negotiate::TLS) => {
            Some(format!("the {peer_role} has TLS off (tls=off)"))
        }
        Some(_) => None,
    };
    if let Some(why) = lacking {
        return if required {
            Err(format!("tls=require here, but {why}"))
        } else {
            Ok(false)
        };
    }
    let kind = theirs.and_then(|t| t.tls).and_then(Identity::from_u8);
    if kind == Some(ours.identity) {
        return Ok(true);
    }
    Err(format!(
        "TLS identities differ: this engine uses {}, the {peer_role} {}; give both sides \
         tls_cert, tls_key and tls_ca, or neither (the identity is then derived from the shared \
         secret)",
        ours.identity.describe(),
        kind.map_or("an unknown kind", Identity::describe)
    ))
}

/// The agreement's TLS description of a session.
fn tls_text(tls: Option<&TlsContext>, session: &Option<Session>) -> Option<String> {
    match (tls, session) {
        (Some(t), Some(s)) => Some(format!("{}, {}", s.suite, t.identity.describe())),
        _ => None,
    }
}

/// Initiator side. `peer` is the segment name (for errors). With a secret,
/// the target must prove it too. `hello_version` is [`LEGACY_VERSION`]
/// unless the target is known to speak only an older one
/// ([`ClientOutcome::Redial`]); `features` are this engine's.
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
    let nc = nonce();
    let auth = if secret.is_some() { FLAG_AUTH } else { 0 };
    let hello = Hello {
        version: hello_version,
        flags: auth | FLAG_EXT,
        nonce: nc,
        name: my_name.to_owned(),
    };
    write_all(stream, &[&hello.encode()], timeout)
        .await
        .map_err(|e| io_err(peer, "sending hello", timeout, e))?;
    // A busy target rejects before its hello.
    let first = match read_first(stream, peer, "hello", timeout).await {
        Ok(b) => b,
        Err(e @ Error::PeerLost { .. }) => return Err(not_ferry_target(peer, &e)),
        Err(e) => return Err(e),
    };
    if first == REJECT {
        return Err(read_reject(stream, peer, timeout).await);
    }
    if first != MAGIC[0] {
        return Err(not_ferry_bytes(peer, &[first]));
    }
    let fixed = read_fixed(stream, peer, first, timeout).await?;
    if fixed[..4] != MAGIC {
        return Err(not_ferry_bytes(peer, &fixed[..8]));
    }
    let server = finish_hello(stream, peer, &fixed, timeout).await?;
    let ns = server.nonce;
    let (ext_bytes, agreement, use_tls) = if server.flags & FLAG_EXT != 0 {
        let (their_raw, theirs) = read_ext(stream, peer, timeout).await?;
        let mine = our_extensions(features, host_key, tls, &nc, &ns, None);
        let my_raw = mine.encode();
        let Some(version) = VersionRange::OURS.highest_common(theirs.versions) else {
            // Tell the target our range (it logs the refusal), then give up.
            let _ = write_all(stream, &[&my_raw], timeout).await;
            return Err(Error::Protocol {
                peer: peer.to_owned(),
                reason: negotiate::no_common_version(VersionRange::OURS, theirs.versions, "target"),
            });
        };
        let same_host_token = match (mine.host, theirs.host) {
            (Some(a), Some(b)) => Some(a == b),
            _ => None,
        };
        let use_tls = match tls_plan(tls, Some(&theirs), "target") {
            Ok(b) => b,
            Err(reason) => {
                // Tell the target (it logs the refusal), then give up.
                let _ = write_all(stream, &[&my_raw], timeout).await;
                return Err(Error::Authentication {
                    peer: peer.to_owned(),
                    reason,
                });
            }
        };
        let agreement = Agreement {
            peer_versions: theirs.versions,
            peer_negotiates: true,
            version,
            ours: features,
            theirs: theirs.features,
            same_host_token,
            tls: None,
            // Used only if both have the proof on (the target sends an
            // invitation only then).
            cred: theirs
                .cred
                .clone()
                .filter(|_| features.enabled(negotiate::SAME_HOST_CRED)),
        };
        (Some((my_raw, their_raw)), agreement, use_tls)
    } else {
        if let Err(reason) = tls_plan(tls, None, "target") {
            return Err(Error::Authentication {
                peer: peer.to_owned(),
                reason,
            });
        }
        if negotiate::is_marked_legacy(&ns) {
            return Err(Error::Protocol {
                peer: peer.to_owned(),
                reason: "the target negotiates but did not see our negotiation flag: the \
                         handshake was altered on the way (downgrade refused)"
                    .to_owned(),
            });
        }
        let v = server.version;
        if !(MIN_VERSION..=LEGACY_VERSION).contains(&v) {
            return Err(Error::Protocol {
                peer: peer.to_owned(),
                reason: negotiate::no_common_version(
                    VersionRange::OURS,
                    VersionRange { min: v, max: v },
                    "target",
                ),
            });
        }
        if v != hello_version {
            // It has refused our hello already; it speaks `v`, and so do we.
            return Ok(ClientOutcome::Redial(v));
        }
        let agreement = Agreement {
            peer_versions: VersionRange { min: v, max: v },
            peer_negotiates: false,
            version: v,
            ours: features,
            theirs: FeatureSet::implied_by(v),
            same_host_token: None,
            tls: None,
            cred: None,
        };
        (None, agreement, false)
    };
    let (ext_bytes, mut agreement, use_tls) = (ext_bytes, agreement, use_tls);
    let my_ext: &[u8] = ext_bytes.as_ref().map_or(&[], |(m, _)| m.as_slice());
    // Under TLS the block goes in clear, then the TLS handshake runs on
    // the same socket, then everything else inside it.
    let session = match tls.filter(|_| use_tls) {
        Some(t) => {
            write_all(stream, &[my_ext], timeout)
                .await
                .map_err(|e| io_err(peer, "sending the extension block", timeout, e))?;
            Some(t.connect(stream, peer, timeout).await?)
        }
        None => None,
    };
    agreement.tls = tls_text(tls, &session);
    let (client_label, server_label) = labels(
        ext_bytes
            .as_ref()
            .map(|(m, t)| (m.as_slice(), t.as_slice())),
        session.as_ref().map(|s| &s.exporter),
    );
    let my_proof = match secret {
        Some(s) => proof(s, &client_label, &nc, &ns),
        None => [0u8; 32],
    };
    let my_ext: &[u8] = if session.is_some() { &[] } else { my_ext };
    write_all(stream, &[my_ext, &my_proof], timeout)
        .await
        .map_err(|e| io_err(peer, "sending proof", timeout, e))?;
    match read_first(stream, peer, "waiting for welcome", timeout).await? {
        WELCOME => {}
        REJECT => return Err(read_reject(stream, peer, timeout).await),
        other => {
            return Err(Error::Protocol {
                peer: peer.to_owned(),
                reason: format!("unexpected handshake status byte {other}"),
            })
        }
    }
    let mut server_proof = [0u8; 32];
    read_exact(stream, &mut server_proof, timeout)
        .await
        .map_err(|e| io_err(peer, "target proof", timeout, e))?;
    if let Some(s) = secret {
        if !verify(s, &server_label, &nc, &ns, &server_proof) {
            return Err(Error::Authentication {
                peer: peer.to_owned(),
                reason: "the target did not prove knowledge of the shared secret".to_owned(),
            });
        }
    }
    let mut fixed = [0u8; 8];
    read_exact(stream, &mut fixed, timeout)
        .await
        .map_err(|e| io_err(peer, "region table", timeout, e))?;
    let idle_ms = u32::from_le_bytes([fixed[0], fixed[1], fixed[2], fixed[3]]);
    let count = u32::from_le_bytes([fixed[4], fixed[5], fixed[6], fixed[7]]);
    if count > MAX_TABLE_ENTRIES {
        return Err(Error::Protocol {
            peer: peer.to_owned(),
            reason: format!("region table of {count} entries exceeds {MAX_TABLE_ENTRIES}"),
        });
    }
    let mut raw = vec![0u8; count as usize * TABLE_ENTRY_LEN];
    read_exact(stream, &mut raw, timeout)
        .await
        .map_err(|e| io_err(peer, "region table", timeout, e))?;
    let table = decode_table(&raw).map_err(|e| Error::Protocol {
        peer: peer.to_owned(),
        reason: e.0,
    })?;
    Ok(ClientOutcome::Welcome(Welcome {
        table,
        idle: (idle_ms > 0).then(|| Duration::from_millis(idle_ms as u64)),
        agreement,
    }))
}

/// An initiator that proved itself (or a target without a secret): the
/// target answers with [`send_welcome`] or [`send_reject`].
pub struct Verified {
    /// The initiator's engine name (informational).
    pub name: String,
    /// The version and features settled.
    pub agreement: Agreement,
    /// The connection's credential socket, for its SAME_HOST offer (only
    /// with an initiator of this host that has [`negotiate::SAME_HOST_CRED`]
    /// on).
    pub cred: Option<crate::same_host::cma::CredListener>,
    proof: [u8; 32],
}

/// Target side, up to the verdict. Refuses (and sends a rejection) on a bad
/// magic, version or proof, before touching memory. A peer that is not
/// Ferry (recognised from its first bytes where possible, see
/// [`crate::foreign`]) is answered in its own framing where that framing
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
    let first = read_first(stream, peer_addr, "hello", timeout).await?;
    let fixed = read_fixed(stream, peer_addr, first, timeout).await?;
    if fixed[..4] != MAGIC {
        return Err(crate::foreign::refuse(stream, peer_addr, &fixed, timeout).await);
    }
    let client = finish_hello(stream, peer_addr, &fixed, timeout).await?;
    let mut ns = nonce();
    let auth = if secret.is_some() { FLAG_AUTH } else { 0 };
    let nc = client.nonce;
    let mut cred = None;
    let (ext_bytes, agreement, use_tls) = if client.flags & FLAG_EXT != 0 {
        // The credential socket of this connection (SAME_HOST_CRED): bound
        // before the initiator's block is known (it follows ours), kept
        // only for a same-host initiator that has the proof on.
        if features.enabled(negotiate::SAME_HOST_CRED) && features.enabled(negotiate::SAME_HOST) {
            match crate::same_host::cma::CredListener::bind() {
                Ok(l) => cred = Some(l),
                Err(why) => tracing::debug!(peer = %peer_addr, %why, "no credential socket"),
            }
        }
        let mine = our_extensions(features, host_key, tls, &nc, &ns, cred.as_ref());
        let my_raw = mine.encode();
        let hello = Hello {
            version: LEGACY_VERSION,
            flags: auth | FLAG_EXT,
            nonce: ns,
            name: my_name.to_owned(),
        };
        write_all(stream, &[&hello.encode(), &my_raw], timeout)
            .await
            .map_err(|e| io_err(peer_addr, "sending hello", timeout, e))?;
        let (their_raw, theirs) = read_ext(stream, peer_addr, timeout).await?;
        let Some(version) = VersionRange::OURS.highest_common(theirs.versions) else {
            let reason =
                negotiate::no_common_version(VersionRange::OURS, theirs.versions, "initiator");
            send_reject(stream, Status::BadVersion, &reason, timeout).await;
            return Err(Error::Protocol {
                peer: format!("{} ({peer_addr})", client.name.escape_default()),
                reason,
            });
        };
        let same_host_token = match (mine.host, theirs.host) {
            (Some(a), Some(b)) => Some(a == b),
            _ => None,
        };
        let use_tls = match tls_plan(tls, Some(&theirs), "initiator") {
            Ok(b) => b,
            Err(reason) => {
                send_reject(stream, Status::AuthFailed, &reason, timeout).await;
                return Err(Error::Authentication {
                    peer: format!("{} ({peer_addr})", client.name.escape_default()),
                    reason,
                });
            }
        };
        let agreement = Agreement {
            peer_versions: theirs.versions,
            peer_negotiates: true,
            version,
            ours: features,
            theirs: theirs.features,
            same_host_token,
            tls: None,
            cred: None,
        };
        if !(agreement.both(negotiate::SAME_HOST)
            && agreement.both(negotiate::SAME_HOST_CRED)
            && same_host_token == Some(true))
        {
            cred = None;
        }
        (Some((their_raw, my_raw)), agreement, use_tls)
    } else {
        // A peer that does not negotiate: answer in its version if this
        // build speaks it, marking the nonce (see `negotiate`).
        negotiate::mark_legacy(&mut ns);
        let v = client.version;
        let speaks = (MIN_VERSION..=LEGACY_VERSION).contains(&v);
        let hello = Hello {
            version: if speaks { v } else { LEGACY_VERSION },
            flags: auth,
            nonce: ns,
            name: my_name.to_owned(),
        };
        write_all(stream, &[&hello.encode()], timeout)
            .await
            .map_err(|e| io_err(peer_addr, "sending hello", timeout, e))?;
        if !speaks {
            let reason = negotiate::no_common_version(
                VersionRange::OURS,
                VersionRange { min: v, max: v },
                "initiator",
            );
            send_reject(stream, Status::BadVersion, &reason, timeout).await;
            return Err(Error::Protocol {
                peer: format!("{} ({peer_addr})", client.name.escape_default()),
                reason,
            });
        }
        let agreement = Agreement {
            peer_versions: VersionRange { min: v, max: v },
            peer_negotiates: false,
            version: v,
            ours: features,
            theirs: FeatureSet::implied_by(v),
            same_host_token: None,
            tls: None,
            cred: None,
        };
        if let Err(reason) = tls_plan(tls, None, "initiator") {
            send_reject(stream, Status::AuthFailed, &reason, timeout).await;
            return Err(Error::Authentication {
                peer: format!("{} ({peer_addr})", client.name.escape_default()),
                reason,
            });
        }
        (None, agreement, false)
    };
    let mut agreement = agreement;
    let session = match tls.filter(|_| use_tls) {
        Some(t) => Some(t.accept(stream, peer_addr, timeout).await?),
        None => None,
    };
    agreement.tls = tls_text(tls, &session);
    let (client_label, server_label) = labels(
        ext_bytes
            .as_ref()
            .map(|(i, t)| (i.as_slice(), t.as_slice())),
        session.as_ref().map(|s| &s.exporter),
    );
    let mut client_proof = [0u8; 32];
    read_exact(stream, &mut client_proof, timeout)
        .await
        .map_err(|e| io_err(peer_addr, "initiator proof", timeout, e))?;
    if let Some(s) = secret {
        if !verify(s, &client_label, &nc, &ns, &client_proof) {
            send_reject(
                stream,
                Status::AuthFailed,
                "authentication failed: wrong or missing shared secret",
                timeout,
            )
            .await;
            return Err(Error::Authentication {
                peer: format!("{} ({peer_addr})", client.name),
                reason: "the initiator did not prove knowledge of the shared secret".to_owned(),
            });
        }
    }
    Ok(Verified {
        name: client.name,
        agreement,
        cred,
        proof: match secret {
            Some(s) => proof(s, &server_label, &nc, &ns),
            None => [0u8; 32],
        },
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
    let hdr = crate::frame::Request::SameHost {
        id: 0,
        channel: channel.and_then(|fd| u32::try_from(fd).ok()),
        stage: stage.and_then(|fd| u32::try_from(fd).ok()),
    }
    .encode();
    write_all(stream, &[&hdr, &offer.encode()], timeout)
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
    match crate::frame::Response::decode(&resp) {
        Ok(crate::frame::Response::SameHostOk {
            id: 0,
            channel,
            stage,
        }) => Ok(SameHostVerdict::Cma {
            channel: channel.map_err(|errno| match errno {
                0 => "no channel offered".to_owned(),
                e => format!(
                    "pidfd_getfd: {}",
                    crate::same_host::cma::errno_name(e as i32)
                ),
            }),
            stage: stage.map_err(|errno| match errno {
                0 => "no staging area offered".to_owned(),
                e => format!(
                    "staging area: {}",
                    crate::same_host::cma::errno_name(e as i32)
                ),
            }),
            target,
        }),
        Ok(crate::frame::Response::Err {
            id: 0,
            status: Status::SameHostRefused,
            addr,
            len,
        }) => Ok(SameHostVerdict::Refused(
            crate::same_host::cma::Refusal::describe(addr, len, crate::same_host::cma::errno_name),
        )),
        other => Err(Error::Protocol {
            peer: peer.to_owned(),
            reason: format!("unexpected answer to the same-host offer: {other:?}"),
        }),
    }
}
