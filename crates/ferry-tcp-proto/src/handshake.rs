//! The connection handshake of both sides (PROTOCOL.md §1, §3.3) as two
//! state machines, [`Initiator`] and [`Target`], that ask their driver for
//! each step: write these bytes, read this many, run the TLS handshake,
//! bind the credential socket, done, or fail with this reason. The proofs
//! (HMAC-SHA256 with the labels of §1 and §1.3), the version and feature
//! negotiation, the TLS decision and the checks of every field are made
//! here; the nonces come in as arguments, and so does everything the
//! driver learns (the bytes read, the TLS session's exporter).
//!
//! Every event returns the next [`Instr`]; the driver executes it and
//! answers with the matching event ([`Handshake::written`] after a
//! `Write`, [`Handshake::received`] with exactly the bytes of a `Read`,
//! …), or, when the connection fails under a step, asks
//! [`Handshake::transport_failed`] what that failure means. Every length
//! read is bounded before it is asked for (a hello name ≤ 256 bytes, an
//! extension block ≤ 1 KiB, a rejection ≤ 1 KiB, a region table ≤ 65 536
//! entries): see [`MAX_READ`].

use std::time::Duration;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::foreign::{self, Foreign};
use crate::frame::{
    decode_table, Hello, Status, TableEntry, FLAG_AUTH, FLAG_EXT, HELLO_FIXED, MAGIC,
    MAX_REJECT_MSG, MAX_TABLE_ENTRIES, NONCE_LEN, REJECT, TABLE_ENTRY_LEN, WELCOME,
};
use crate::frame::{Request, Response, HEADER_LEN};
use crate::negotiate::{
    self, Agreement, CredInvite, Extensions, FeatureSet, HostKey, VersionRange, LEGACY_VERSION,
    MAX_EXT_LEN,
};
use crate::offer::Offer;

/// Bytes of a proof (an HMAC-SHA256 tag).
pub const PROOF_LEN: usize = 32;

/// The longest [`Instr::Read`] either side ever asks for: a region table
/// of [`MAX_TABLE_ENTRIES`] entries (every other read is at most 1 KiB).
pub const MAX_READ: usize = MAX_TABLE_ENTRIES as usize * TABLE_ENTRY_LEN;

/// The labels of a handshake that does not negotiate (PROTOCOL.md §1).
const CLIENT_LABEL: &[u8] = b"ferry-tcp/2 initiator";
const SERVER_LABEL: &[u8] = b"ferry-tcp/2 target";

/// How a side names itself in TLS (the value of the TLS extension).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TlsIdentity {
    /// An Ed25519 key derived from the shared secret.
    Secret = 1,
    /// Certificate files and a CA.
    Certificates = 2,
}

impl TlsIdentity {
    /// From the extension's byte.
    pub fn from_u8(v: u8) -> Option<TlsIdentity> {
        match v {
            1 => Some(TlsIdentity::Secret),
            2 => Some(TlsIdentity::Certificates),
            _ => None,
        }
    }

    /// For reports.
    pub fn describe(self) -> &'static str {
        match self {
            TlsIdentity::Secret => "identity derived from the shared secret",
            TlsIdentity::Certificates => "certificates",
        }
    }
}

/// A side's TLS settings (`None` in [`Settings::tls`]: `tls=off`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TlsSettings {
    /// `tls=require` (else `on`).
    pub required: bool,
    /// How this side names itself.
    pub identity: TlsIdentity,
}

/// What a side brings to a handshake.
#[derive(Clone, Copy, Debug)]
pub struct Settings<'a> {
    /// This engine's name (sent in its hello).
    pub name: &'a str,
    /// The peer, as errors name it: the segment name (initiator), the
    /// peer's address (target).
    pub peer: &'a str,
    /// The shared secret, if any.
    pub secret: Option<&'a str>,
    /// This engine's features for the connection
    /// ([`negotiate::our_features`]).
    pub features: FeatureSet,
    /// This process's host key (`None`: unknown; no same-host token).
    pub host_key: Option<&'a HostKey>,
    /// TLS (`None`: off).
    pub tls: Option<TlsSettings>,
    /// The versions this side speaks: [`VersionRange::OURS`] (another
    /// range only in simulations of other builds).
    pub versions: VersionRange,
}

/// What the driver does next.
#[derive(Debug, PartialEq, Eq)]
pub enum Instr<D> {
    /// Write all of `bytes` (doing `what`, for errors), then
    /// [`Handshake::written`]. With `best_effort` the handshake fails
    /// next whatever happens: a failure to write is ignored.
    Write {
        /// The bytes.
        bytes: Vec<u8>,
        /// What is being sent.
        what: &'static str,
        /// Ignore a failure.
        best_effort: bool,
    },
    /// Read exactly `len` bytes (≤ [`MAX_READ`]), then
    /// [`Handshake::received`] with them. With `best_effort`, a failure
    /// hands over what arrived (zeros after it).
    Read {
        /// How many.
        len: usize,
        /// What is being read.
        what: &'static str,
        /// Hand over a short read.
        best_effort: bool,
    },
    /// Run the TLS 1.3 handshake on the connection (`client`: as the TLS
    /// client, the initiator), then [`Handshake::tls_done`]; everything
    /// after it goes inside TLS. A failure of TLS is the driver's error.
    Tls {
        /// This side is the TLS client.
        client: bool,
    },
    /// Target: bind this connection's credential socket (PROTOCOL.md §5,
    /// *Credentials*), then [`Handshake::cred_bound`] with its invitation
    /// (`None` if it could not be bound).
    BindCred,
    /// The handshake succeeded.
    Done(D),
    /// The handshake failed.
    Fail(Failure),
}

/// How the connection failed under a step ([`Handshake::transport_failed`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    /// Closed or reset by the peer.
    Closed,
    /// Nothing arrived (or left) within the driver's timeout.
    TimedOut,
    /// Another I/O error.
    Other,
}

/// Why a handshake failed, typed; the driver turns it into its error.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Failure {
    /// The connection failed while doing `what`. `unanswered`: it closed
    /// on the initiator's hello without a byte back (a peer that is not a
    /// ferry-tcp target, PROTOCOL.md §1.2).
    Transport {
        /// The step.
        what: &'static str,
        /// How.
        kind: Transport,
        /// Before the target's first byte.
        unanswered: bool,
    },
    /// Initiator: the target's first bytes are not a hello (the reason
    /// shows them and names the peer where [`foreign`] recognises it).
    NotFerry(String),
    /// Target: the initiator's first [`HELLO_FIXED`] bytes are not a
    /// hello (a Mooncake handshake was answered in its framing).
    Foreign {
        /// What the bytes look like.
        reason: String,
        /// [`foreign::recognise`] knew them (the driver logs it louder).
        recognised: bool,
    },
    /// Initiator: the target rejected the connection (`status` as sent,
    /// `reason` printable).
    Rejected {
        /// The status byte, if known.
        status: Option<Status>,
        /// The target's reason, escaped.
        reason: String,
    },
    /// A protocol violation or an impossible pair (no common version,
    /// downgrade).
    Protocol {
        /// The peer as the error names it.
        peer: String,
        /// Why.
        reason: String,
    },
    /// A proof failed, or the TLS requirements of the two sides differ.
    Authentication {
        /// The peer as the error names it.
        peer: String,
        /// Why.
        reason: String,
    },
}

/// The events of a handshake, common to both sides (one drive loop
/// serves both).
pub trait Handshake {
    /// What a successful handshake yields.
    type Done;
    /// The first step.
    fn start(&mut self) -> Instr<Self::Done>;
    /// The bytes of the last `Write` are sent.
    fn written(&mut self) -> Instr<Self::Done>;
    /// The bytes of the last `Read` arrived.
    fn received(&mut self, bytes: &[u8]) -> Instr<Self::Done>;
    /// The TLS handshake is done: its cipher suite and 32 bytes of its
    /// exporter (label `EXPORTER-ferry-tcp`).
    fn tls_done(&mut self, suite: &str, exporter: [u8; 32]) -> Instr<Self::Done>;
    /// The credential socket is bound (target).
    fn cred_bound(&mut self, invite: Option<CredInvite>) -> Instr<Self::Done>;
    /// The connection failed under the current step: what that means.
    fn transport_failed(&mut self, kind: Transport) -> Failure;
}

/// The bytes of a rejection: `REJECT, status, len u16, reason` (the
/// reason cut to [`MAX_REJECT_MSG`] bytes).
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

fn mac(secret: &str, label: &[u8], nc: &[u8; NONCE_LEN], nt: &[u8; NONCE_LEN]) -> Hmac<Sha256> {
    // HMAC takes keys of any length: new_from_slice cannot fail.
    let mut m = match Hmac::<Sha256>::new_from_slice(secret.as_bytes()) {
        Ok(m) => m,
        Err(_) => unreachable!("HMAC accepts keys of any length"),
    };
    m.update(label);
    m.update(nc);
    m.update(nt);
    m
}

/// `HMAC-SHA256(secret, label ‖ nonce_i ‖ nonce_t)`: ferry-core's
/// `raw::auth::proof`, written out here (that crate needs tokio);
/// ferry-tcp tests that the two agree.
pub fn proof(secret: &str, label: &[u8], nc: &[u8; NONCE_LEN], nt: &[u8; NONCE_LEN]) -> [u8; 32] {
    mac(secret, label, nc, nt).finalize().into_bytes().into()
}

/// Whether `got` is [`proof`]'s, compared in constant time.
pub fn verify(
    secret: &str,
    label: &[u8],
    nc: &[u8; NONCE_LEN],
    nt: &[u8; NONCE_LEN],
    got: &[u8],
) -> bool {
    mac(secret, label, nc, nt).verify_slice(got).is_ok()
}

/// The proof labels: the legacy ones, or for a negotiated handshake the
/// version-6 labels followed by both extension blocks (initiator's, then
/// target's, as sent) and, under TLS, 32 bytes of the TLS exporter, so the
/// proofs hold only on the TLS session they were made in.
pub fn labels(exts: Option<(&[u8], &[u8])>, exporter: Option<&[u8; 32]>) -> (Vec<u8>, Vec<u8>) {
    match exts {
        None => (CLIENT_LABEL.to_vec(), SERVER_LABEL.to_vec()),
        Some((ei, et)) => {
            // Mutant: the proofs no longer bound to the TLS session.
            let exporter = exporter.filter(|_| !cfg!(ferry_mutant = "proof_unbound_from_tls"));
            let x: &[u8] = exporter.map_or(&[], |x| x.as_slice());
            let tail: Vec<u8> = [ei, et, x].concat();
            (
                [b"ferry-tcp/6 initiator".as_slice(), &tail].concat(),
                [b"ferry-tcp/6 target".as_slice(), &tail].concat(),
            )
        }
    }
}

/// What a side announces: its range, its features, its host token for
/// these nonces (with the same-host path on and a host key), its TLS
/// identity (with TLS on) and a target's credential invitation.
pub fn our_extensions(
    s: &Settings<'_>,
    nc: &[u8; 32],
    nt: &[u8; 32],
    cred: Option<CredInvite>,
) -> Extensions {
    let features = s.features;
    Extensions {
        versions: s.versions,
        features,
        host: s
            .host_key
            .filter(|_| features.enabled(negotiate::SAME_HOST))
            .map(|k| negotiate::host_token(k, nc, nt)),
        tls: s
            .tls
            .filter(|_| features.enabled(negotiate::TLS))
            .map(|t| t.identity as u8),
        cred,
    }
}

/// Whether a connection runs TLS (PROTOCOL.md §1.3): `Ok(true)` if both
/// sides have it on with the same kind of identity, `Ok(false)` to stay in
/// clear, `Err(reason)` if this side requires TLS and the peer cannot (or
/// the two identities differ). `theirs`: `None` for a peer that does not
/// negotiate.
pub fn tls_plan(
    tls: Option<TlsSettings>,
    theirs: Option<&Extensions>,
    peer_role: &str,
) -> Result<bool, String> {
    let Some(ours) = tls else {
        return Ok(false);
    };
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
        return if ours.required {
            Err(format!("tls=require here, but {why}"))
        } else {
            Ok(false)
        };
    }
    let kind = theirs.and_then(|t| t.tls).and_then(TlsIdentity::from_u8);
    if kind == Some(ours.identity) {
        return Ok(true);
    }
    Err(format!(
        "TLS identities differ: this engine uses {}, the {peer_role} {}; give both sides \
         tls_cert, tls_key and tls_ca, or neither (the identity is then derived from the shared \
         secret)",
        ours.identity.describe(),
        kind.map_or("an unknown kind", TlsIdentity::describe)
    ))
}

/// The agreement's TLS description of a session.
fn tls_text(tls: Option<TlsSettings>, suite: &str) -> Option<String> {
    tls.map(|t| format!("{suite}, {}", t.identity.describe()))
}

/// The printable text of a peer's reason (escaped, at most
/// [`MAX_REJECT_MSG`] characters).
fn printable(msg: &[u8]) -> String {
    String::from_utf8_lossy(msg)
        .chars()
        .flat_map(char::escape_default)
        .take(MAX_REJECT_MSG)
        .collect()
}

/// An extension block's length prefix, checked.
fn ext_len(bytes: &[u8]) -> Result<usize, String> {
    let n = match bytes {
        [a, b] => u16::from_le_bytes([*a, *b]) as usize,
        _ => return Err("truncated extension block length".to_owned()),
    };
    if n > MAX_EXT_LEN {
        return Err(format!(
            "extension block of {n} bytes exceeds {MAX_EXT_LEN}"
        ));
    }
    Ok(n)
}

/// A hello's name, checked.
fn hello_name(mut hello: Hello, bytes: &[u8]) -> Result<Hello, String> {
    hello.name =
        String::from_utf8(bytes.to_vec()).map_err(|_| "engine name is not UTF-8".to_owned())?;
    Ok(hello)
}

/// The initiator's failure for a target whose first bytes are `first`.
fn not_ferry(first: &[u8]) -> Failure {
    let what = foreign::describe(first).unwrap_or_else(|| "not a ferry-tcp target".to_owned());
    Failure::NotFerry(format!("the peer answered with {first:02x?}: {what}"))
}

/// Where an initiator's handshake is (PROTOCOL.md §3.3).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InitiatorState {
    /// Sending its hello.
    SendHello,
    /// Waiting for the target's first byte (a hello's, or a REJECT).
    AwaitFirst,
    /// Reading the rest of the target's hello.
    ReadHello,
    /// Reading the target's name.
    ReadName,
    /// Reading the length of the target's extension block.
    ReadExtLen,
    /// Reading the target's extension block.
    ReadExt,
    /// Sending its own extension block alone (TLS follows).
    SendExt,
    /// The TLS handshake runs.
    Tls,
    /// Sending its proof (after its block, in clear).
    SendProof,
    /// Waiting for WELCOME or REJECT.
    AwaitWelcome,
    /// Reading the target's proof.
    ReadProof,
    /// Reading the idle deadline and the table's length.
    ReadTableHead,
    /// Reading the region table.
    ReadTable,
    /// Reading a rejection's status and length.
    ReadReject,
    /// Reading a rejection's reason.
    ReadRejectMsg,
    /// Sending its block to a target it gives up on (so the target can
    /// log why), then failing.
    Refusing,
    /// Succeeded (or must dial again).
    Done,
    /// Failed.
    Failed,
}

/// What an initiator learns from a successful handshake.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Welcome {
    /// The target's registered regions with their generations, sorted.
    pub table: Vec<TableEntry>,
    /// The target's idle deadline for this connection (`None`: none).
    pub idle: Option<Duration>,
    /// The version and features settled.
    pub agreement: Agreement,
}

/// How an initiator's handshake ended without an error.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClientOutcome {
    /// Connected.
    Welcome(Welcome),
    /// The target does not negotiate and speaks only this older version,
    /// which this build speaks too: it has refused the hello (it names
    /// [`LEGACY_VERSION`]); dial again with a hello of this version.
    Redial(u16),
}

/// The initiator's side of the handshake.
#[derive(Debug)]
pub struct Initiator<'a> {
    s: Settings<'a>,
    hello_version: u16,
    nc: [u8; NONCE_LEN],
    state: InitiatorState,
    fixed: [u8; HELLO_FIXED],
    server: Option<Hello>,
    ext_len: usize,
    /// Both blocks as sent, the initiator's first.
    exts: Option<(Vec<u8>, Vec<u8>)>,
    agreement: Option<Agreement>,
    exporter: Option<[u8; 32]>,
    idle_ms: u32,
    reject_status: u8,
    failure: Option<Failure>,
}

impl<'a> Initiator<'a> {
    /// An initiator with the nonce `nc` (fresh randomness) sending a hello
    /// of `hello_version` ([`LEGACY_VERSION`] unless the target is known
    /// to speak only an older one, [`ClientOutcome::Redial`]).
    pub fn new(s: Settings<'a>, hello_version: u16, nc: [u8; NONCE_LEN]) -> Initiator<'a> {
        Initiator {
            s,
            hello_version,
            nc,
            state: InitiatorState::SendHello,
            fixed: [0; HELLO_FIXED],
            server: None,
            ext_len: 0,
            exts: None,
            agreement: None,
            exporter: None,
            idle_ms: 0,
            reject_status: 0,
            failure: None,
        }
    }

    /// Where it is.
    pub fn state(&self) -> InitiatorState {
        self.state
    }

    fn read(
        &mut self,
        state: InitiatorState,
        len: usize,
        what: &'static str,
    ) -> Instr<ClientOutcome> {
        self.state = state;
        Instr::Read {
            len,
            what,
            best_effort: false,
        }
    }

    fn fail(&mut self, f: Failure) -> Instr<ClientOutcome> {
        self.state = InitiatorState::Failed;
        Instr::Fail(f)
    }

    fn protocol(&mut self, reason: impl Into<String>) -> Instr<ClientOutcome> {
        let peer = self.s.peer.to_owned();
        self.fail(Failure::Protocol {
            peer,
            reason: reason.into(),
        })
    }

    /// Sends its block (the target logs why), then fails with `f`.
    fn refuse(&mut self, my_raw: Vec<u8>, f: Failure) -> Instr<ClientOutcome> {
        self.state = InitiatorState::Refusing;
        self.failure = Some(f);
        Instr::Write {
            bytes: my_raw,
            what: "sending the extension block",
            best_effort: true,
        }
    }

    fn ns(&self) -> [u8; NONCE_LEN] {
        self.server.as_ref().map_or([0; NONCE_LEN], |h| h.nonce)
    }

    fn on_hello(&mut self, bytes: &[u8]) -> Instr<ClientOutcome> {
        self.fixed[1..].copy_from_slice(bytes);
        if self.fixed[..4] != MAGIC {
            let first = self.fixed;
            return self.fail(not_ferry(&first[..8]));
        }
        match Hello::decode_fixed(&self.fixed) {
            Ok((hello, name_len)) => {
                self.server = Some(hello);
                self.read(InitiatorState::ReadName, name_len, "hello name")
            }
            Err(e) => self.protocol(e.0),
        }
    }

    fn on_name(&mut self, bytes: &[u8]) -> Instr<ClientOutcome> {
        let Some(hello) = self.server.take() else {
            return self.protocol("handshake driven out of order");
        };
        let hello = match hello_name(hello, bytes) {
            Ok(h) => h,
            Err(reason) => return self.protocol(reason),
        };
        let negotiates = hello.flags & FLAG_EXT != 0;
        let v = hello.version;
        let ns = hello.nonce;
        self.server = Some(hello);
        if negotiates {
            return self.read(InitiatorState::ReadExtLen, 2, "extension block");
        }
        // A target that does not negotiate.
        if let Err(reason) = tls_plan(self.s.tls, None, "target") {
            let peer = self.s.peer.to_owned();
            return self.fail(Failure::Authentication { peer, reason });
        }
        // Mutant: the downgrade sentinel ignored.
        if negotiate::is_marked_legacy(&ns) && !cfg!(ferry_mutant = "downgrade_unchecked") {
            return self.protocol(
                "the target negotiates but did not see our negotiation flag: the handshake was \
                 altered on the way (downgrade refused)",
            );
        }
        if !(self.s.versions.contains(v) && v <= LEGACY_VERSION) {
            let theirs = VersionRange { min: v, max: v };
            let reason = negotiate::no_common_version(self.s.versions, theirs, "target");
            return self.protocol(reason);
        }
        if v != self.hello_version {
            // It has refused our hello already; it speaks `v`, and so do we.
            self.state = InitiatorState::Done;
            return Instr::Done(ClientOutcome::Redial(v));
        }
        self.agreement = Some(Agreement {
            peer_versions: VersionRange { min: v, max: v },
            peer_negotiates: false,
            version: v,
            ours: self.s.features,
            theirs: FeatureSet::implied_by(v),
            same_host_token: None,
            tls: None,
            cred: None,
        });
        self.send_proof(Vec::new())
    }

    fn on_ext(&mut self, body: &[u8]) -> Instr<ClientOutcome> {
        let theirs = match Extensions::decode(body) {
            Ok(t) => t,
            Err(reason) => return self.protocol(reason),
        };
        let mut their_raw = (body.len() as u16).to_le_bytes().to_vec();
        their_raw.extend_from_slice(body);
        let ns = self.ns();
        let mine = our_extensions(&self.s, &self.nc, &ns, None);
        let my_raw = mine.encode();
        let Some(version) = self.s.versions.highest_common(theirs.versions) else {
            let reason = negotiate::no_common_version(self.s.versions, theirs.versions, "target");
            let peer = self.s.peer.to_owned();
            return self.refuse(my_raw, Failure::Protocol { peer, reason });
        };
        let same_host_token = match (mine.host, theirs.host) {
            (Some(a), Some(b)) => Some(a == b),
            _ => None,
        };
        let use_tls = match tls_plan(self.s.tls, Some(&theirs), "target") {
            Ok(b) => b,
            Err(reason) => {
                let peer = self.s.peer.to_owned();
                return self.refuse(my_raw, Failure::Authentication { peer, reason });
            }
        };
        let features = self.s.features;
        self.agreement = Some(Agreement {
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
                .filter(|_| features.enabled(negotiate::SAME_HOST_CRED)),
        });
        self.exts = Some((my_raw.clone(), their_raw));
        if use_tls {
            // The block goes in clear, then the TLS handshake runs on the
            // same socket, then everything else inside it.
            self.state = InitiatorState::SendExt;
            return Instr::Write {
                bytes: my_raw,
                what: "sending the extension block",
                best_effort: false,
            };
        }
        self.send_proof(my_raw)
    }

    /// Writes `prefix` (its block, when not sent before TLS) and its proof.
    fn send_proof(&mut self, mut prefix: Vec<u8>) -> Instr<ClientOutcome> {
        let exts = self
            .exts
            .as_ref()
            .map(|(m, t)| (m.as_slice(), t.as_slice()));
        let (label, _) = labels(exts, self.exporter.as_ref());
        let my_proof = match self.s.secret {
            Some(s) => proof(s, &label, &self.nc, &self.ns()),
            None => [0u8; PROOF_LEN],
        };
        prefix.extend_from_slice(&my_proof);
        self.state = InitiatorState::SendProof;
        Instr::Write {
            bytes: prefix,
            what: "sending proof",
            best_effort: false,
        }
    }

    fn on_proof(&mut self, got: &[u8]) -> Instr<ClientOutcome> {
        if let Some(s) = self.s.secret {
            let exts = self
                .exts
                .as_ref()
                .map(|(m, t)| (m.as_slice(), t.as_slice()));
            let (_, label) = labels(exts, self.exporter.as_ref());
            if !verify(s, &label, &self.nc, &self.ns(), got) {
                let peer = self.s.peer.to_owned();
                return self.fail(Failure::Authentication {
                    peer,
                    reason: "the target did not prove knowledge of the shared secret".to_owned(),
                });
            }
        }
        self.read(InitiatorState::ReadTableHead, 8, "region table")
    }

    fn on_table_head(&mut self, b: &[u8]) -> Instr<ClientOutcome> {
        let word = |i: usize| {
            b.get(i..i + 4)
                .map_or(0, |w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]))
        };
        self.idle_ms = word(0);
        let count = word(4);
        if count > MAX_TABLE_ENTRIES {
            return self.protocol(format!(
                "region table of {count} entries exceeds {MAX_TABLE_ENTRIES}"
            ));
        }
        self.read(
            InitiatorState::ReadTable,
            count as usize * TABLE_ENTRY_LEN,
            "region table",
        )
    }

    fn on_table(&mut self, raw: &[u8]) -> Instr<ClientOutcome> {
        let table = match decode_table(raw) {
            Ok(t) => t,
            Err(e) => return self.protocol(e.0),
        };
        let Some(agreement) = self.agreement.take() else {
            return self.protocol("handshake driven out of order");
        };
        self.state = InitiatorState::Done;
        let idle_ms = self.idle_ms;
        Instr::Done(ClientOutcome::Welcome(Welcome {
            table,
            idle: (idle_ms > 0).then(|| Duration::from_millis(idle_ms as u64)),
            agreement,
        }))
    }

    fn on_reject_msg(&mut self, msg: &[u8]) -> Instr<ClientOutcome> {
        let status = Status::from_u8(self.reject_status);
        self.fail(Failure::Rejected {
            status,
            reason: printable(msg),
        })
    }
}

impl Handshake for Initiator<'_> {
    type Done = ClientOutcome;

    fn start(&mut self) -> Instr<ClientOutcome> {
        let auth = if self.s.secret.is_some() {
            FLAG_AUTH
        } else {
            0
        };
        let hello = Hello {
            version: self.hello_version,
            flags: auth | FLAG_EXT,
            nonce: self.nc,
            name: self.s.name.to_owned(),
        };
        self.state = InitiatorState::SendHello;
        Instr::Write {
            bytes: hello.encode(),
            what: "sending hello",
            best_effort: false,
        }
    }

    fn written(&mut self) -> Instr<ClientOutcome> {
        use InitiatorState as S;
        match self.state {
            // A busy target rejects before its hello.
            S::SendHello => self.read(S::AwaitFirst, 1, "hello"),
            S::SendExt => {
                self.state = S::Tls;
                Instr::Tls { client: true }
            }
            S::SendProof => self.read(S::AwaitWelcome, 1, "waiting for welcome"),
            S::Refusing => {
                let f = self.failure.take().unwrap_or(Failure::Protocol {
                    peer: self.s.peer.to_owned(),
                    reason: "handshake driven out of order".to_owned(),
                });
                self.fail(f)
            }
            _ => self.protocol("handshake driven out of order"),
        }
    }

    fn received(&mut self, bytes: &[u8]) -> Instr<ClientOutcome> {
        use InitiatorState as S;
        match self.state {
            S::AwaitFirst | S::AwaitWelcome => {
                let first = bytes.first().copied().unwrap_or(0);
                match (self.state, first) {
                    (_, REJECT) => self.read(S::ReadReject, 3, "rejection"),
                    (S::AwaitFirst, b) if b == MAGIC[0] => {
                        self.fixed[0] = b;
                        self.read(S::ReadHello, HELLO_FIXED - 1, "hello")
                    }
                    (S::AwaitFirst, b) => self.fail(not_ferry(&[b])),
                    (_, WELCOME) => self.read(S::ReadProof, PROOF_LEN, "target proof"),
                    (_, other) => {
                        self.protocol(format!("unexpected handshake status byte {other}"))
                    }
                }
            }
            S::ReadHello if bytes.len() == HELLO_FIXED - 1 => self.on_hello(bytes),
            S::ReadName => self.on_name(bytes),
            S::ReadExtLen => match ext_len(bytes) {
                Ok(n) => {
                    self.ext_len = n;
                    self.read(S::ReadExt, n, "extension block")
                }
                Err(reason) => self.protocol(reason),
            },
            S::ReadExt if bytes.len() == self.ext_len => self.on_ext(bytes),
            S::ReadProof => self.on_proof(bytes),
            S::ReadTableHead => self.on_table_head(bytes),
            S::ReadTable => self.on_table(bytes),
            S::ReadReject => {
                let (status, len) = match bytes {
                    [s, a, b] => (*s, u16::from_le_bytes([*a, *b]) as usize),
                    _ => (0, 0),
                };
                self.reject_status = status;
                self.state = S::ReadRejectMsg;
                Instr::Read {
                    len: len.min(MAX_REJECT_MSG),
                    what: "rejection",
                    best_effort: true,
                }
            }
            S::ReadRejectMsg => self.on_reject_msg(bytes),
            _ => self.protocol("handshake driven out of order"),
        }
    }

    fn tls_done(&mut self, suite: &str, exporter: [u8; 32]) -> Instr<ClientOutcome> {
        if self.state != InitiatorState::Tls {
            return self.protocol("handshake driven out of order");
        }
        self.exporter = Some(exporter);
        if let Some(a) = self.agreement.as_mut() {
            a.tls = tls_text(self.s.tls, suite);
        }
        self.send_proof(Vec::new())
    }

    fn cred_bound(&mut self, _: Option<CredInvite>) -> Instr<ClientOutcome> {
        self.protocol("handshake driven out of order")
    }

    fn transport_failed(&mut self, kind: Transport) -> Failure {
        use InitiatorState as S;
        let what = match self.state {
            S::SendHello => "sending hello",
            S::AwaitFirst | S::ReadHello => "hello",
            S::ReadName => "hello name",
            S::ReadExtLen | S::ReadExt => "extension block",
            S::SendExt | S::Refusing => "sending the extension block",
            S::Tls => "TLS handshake",
            S::SendProof => "sending proof",
            S::AwaitWelcome => "waiting for welcome",
            S::ReadProof => "target proof",
            S::ReadTableHead | S::ReadTable => "region table",
            S::ReadReject | S::ReadRejectMsg => "rejection",
            S::Done | S::Failed => "after the handshake",
        };
        let unanswered = self.state == S::AwaitFirst;
        self.state = S::Failed;
        Failure::Transport {
            what,
            kind,
            unanswered,
        }
    }
}

/// Where a target's handshake is (PROTOCOL.md §3.3).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TargetState {
    /// Reading the initiator's hello (its fixed part).
    ReadHello,
    /// Reading the initiator's name.
    ReadName,
    /// The driver binds the credential socket.
    BindCred,
    /// Sending its hello (and, negotiating, its extension block).
    SendHello,
    /// Reading the length of the initiator's extension block.
    ReadExtLen,
    /// Reading the initiator's extension block.
    ReadExt,
    /// The TLS handshake runs.
    Tls,
    /// Reading the initiator's proof.
    ReadProof,
    /// Sending a rejection, then failing.
    Refusing,
    /// The initiator is verified: the driver admits it (WELCOME) or
    /// refuses it.
    Done,
    /// Failed.
    Failed,
}

/// An initiator that proved itself (or any initiator, without a secret):
/// the driver answers with WELCOME (its [`Verified::proof`]) or REJECT.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Verified {
    /// The initiator's engine name (informational).
    pub name: String,
    /// The version and features settled.
    pub agreement: Agreement,
    /// Keep the credential socket: the initiator is on this host and both
    /// have the same-host credentials on.
    pub keep_cred: bool,
    /// The target's proof for the WELCOME (zeros without a secret).
    pub proof: [u8; PROOF_LEN],
}

/// The target's side of the handshake.
#[derive(Debug)]
pub struct Target<'a> {
    s: Settings<'a>,
    ns: [u8; NONCE_LEN],
    state: TargetState,
    client: Option<Hello>,
    negotiates: bool,
    speaks: bool,
    ext_len: usize,
    mine: Option<Extensions>,
    /// Both blocks as sent, the initiator's first.
    exts: Option<(Vec<u8>, Vec<u8>)>,
    agreement: Option<Agreement>,
    exporter: Option<[u8; 32]>,
    keep_cred: bool,
    failure: Option<Failure>,
}

impl<'a> Target<'a> {
    /// A target with the nonce `ns` (fresh randomness).
    pub fn new(s: Settings<'a>, ns: [u8; NONCE_LEN]) -> Target<'a> {
        Target {
            s,
            ns,
            state: TargetState::ReadHello,
            client: None,
            negotiates: false,
            speaks: false,
            ext_len: 0,
            mine: None,
            exts: None,
            agreement: None,
            exporter: None,
            keep_cred: false,
            failure: None,
        }
    }

    /// Where it is.
    pub fn state(&self) -> TargetState {
        self.state
    }

    fn read(&mut self, state: TargetState, len: usize, what: &'static str) -> Instr<Verified> {
        self.state = state;
        Instr::Read {
            len,
            what,
            best_effort: false,
        }
    }

    fn fail(&mut self, f: Failure) -> Instr<Verified> {
        self.state = TargetState::Failed;
        Instr::Fail(f)
    }

    fn protocol(&mut self, reason: impl Into<String>) -> Instr<Verified> {
        let peer = self.s.peer.to_owned();
        self.fail(Failure::Protocol {
            peer,
            reason: reason.into(),
        })
    }

    /// The initiator as errors name it once its name is known.
    fn named(&self) -> String {
        let name = self.client.as_ref().map_or("", |h| h.name.as_str());
        format!("{} ({})", name.escape_default(), self.s.peer)
    }

    fn nc(&self) -> [u8; NONCE_LEN] {
        self.client.as_ref().map_or([0; NONCE_LEN], |h| h.nonce)
    }

    /// Sends a rejection (best effort), then fails with `f`.
    fn reject(&mut self, status: Status, reason: &str, f: Failure) -> Instr<Verified> {
        self.state = TargetState::Refusing;
        self.failure = Some(f);
        Instr::Write {
            bytes: reject_bytes(status, reason),
            what: "sending a rejection",
            best_effort: true,
        }
    }

    /// Refuses a peer that is not Ferry: a Mooncake handshake is answered
    /// in its framing (best effort) first.
    fn foreign(&mut self, first: &[u8]) -> Instr<Verified> {
        let what = foreign::recognise(first);
        let reason = foreign::describe(first)
            .unwrap_or_else(|| "not a ferry-tcp peer (bad magic)".to_owned());
        let f = Failure::Foreign {
            reason,
            recognised: what.is_some(),
        };
        let Some(Foreign::Mooncake(t)) = what else {
            return self.fail(f);
        };
        self.state = TargetState::Refusing;
        self.failure = Some(f);
        Instr::Write {
            bytes: foreign::mooncake_refusal(t, foreign::MOONCAKE_REASON),
            what: "answering a Mooncake handshake",
            best_effort: true,
        }
    }

    fn on_hello(&mut self, fixed: &[u8]) -> Instr<Verified> {
        let Ok(fixed) = <[u8; HELLO_FIXED]>::try_from(fixed) else {
            return self.protocol("handshake driven out of order");
        };
        if fixed[..4] != MAGIC {
            return self.foreign(&fixed);
        }
        match Hello::decode_fixed(&fixed) {
            Ok((hello, name_len)) => {
                self.client = Some(hello);
                self.read(TargetState::ReadName, name_len, "hello name")
            }
            Err(e) => self.protocol(e.0),
        }
    }

    fn on_name(&mut self, bytes: &[u8]) -> Instr<Verified> {
        let Some(hello) = self.client.take() else {
            return self.protocol("handshake driven out of order");
        };
        let hello = match hello_name(hello, bytes) {
            Ok(h) => h,
            Err(reason) => return self.protocol(reason),
        };
        self.negotiates = hello.flags & FLAG_EXT != 0;
        let v = hello.version;
        self.client = Some(hello);
        let auth = if self.s.secret.is_some() {
            FLAG_AUTH
        } else {
            0
        };
        if self.negotiates {
            // The credential socket of this connection (SAME_HOST_CRED):
            // bound before the initiator's block is known (it follows
            // ours), kept only for a same-host initiator that has the
            // proof on.
            let f = self.s.features;
            if f.enabled(negotiate::SAME_HOST_CRED) && f.enabled(negotiate::SAME_HOST) {
                self.state = TargetState::BindCred;
                return Instr::BindCred;
            }
            return self.cred_bound(None);
        }
        // A peer that does not negotiate: answer in its version if this
        // build speaks it, marking the nonce (see `negotiate`).
        negotiate::mark_legacy(&mut self.ns);
        self.speaks = self.s.versions.contains(v) && v <= LEGACY_VERSION;
        let hello = Hello {
            version: if self.speaks { v } else { LEGACY_VERSION },
            flags: auth,
            nonce: self.ns,
            name: self.s.name.to_owned(),
        };
        self.state = TargetState::SendHello;
        Instr::Write {
            bytes: hello.encode(),
            what: "sending hello",
            best_effort: false,
        }
    }

    /// After a legacy hello is sent: refuse, or read the proof.
    fn legacy(&mut self) -> Instr<Verified> {
        let v = self.client.as_ref().map_or(0, |h| h.version);
        if !self.speaks {
            let theirs = VersionRange { min: v, max: v };
            let reason = negotiate::no_common_version(self.s.versions, theirs, "initiator");
            let peer = self.named();
            let f = Failure::Protocol {
                peer,
                reason: reason.clone(),
            };
            return self.reject(Status::BadVersion, &reason, f);
        }
        self.agreement = Some(Agreement {
            peer_versions: VersionRange { min: v, max: v },
            peer_negotiates: false,
            version: v,
            ours: self.s.features,
            theirs: FeatureSet::implied_by(v),
            same_host_token: None,
            tls: None,
            cred: None,
        });
        if let Err(reason) = tls_plan(self.s.tls, None, "initiator") {
            let peer = self.named();
            let f = Failure::Authentication {
                peer,
                reason: reason.clone(),
            };
            return self.reject(Status::AuthFailed, &reason, f);
        }
        self.read(TargetState::ReadProof, PROOF_LEN, "initiator proof")
    }

    fn on_ext(&mut self, body: &[u8]) -> Instr<Verified> {
        let theirs = match Extensions::decode(body) {
            Ok(t) => t,
            Err(reason) => return self.protocol(reason),
        };
        let mut their_raw = (body.len() as u16).to_le_bytes().to_vec();
        their_raw.extend_from_slice(body);
        let Some(version) = self.s.versions.highest_common(theirs.versions) else {
            let reason =
                negotiate::no_common_version(self.s.versions, theirs.versions, "initiator");
            let peer = self.named();
            let f = Failure::Protocol {
                peer,
                reason: reason.clone(),
            };
            return self.reject(Status::BadVersion, &reason, f);
        };
        let mine_host = self.mine.as_ref().and_then(|m| m.host);
        let same_host_token = match (mine_host, theirs.host) {
            (Some(a), Some(b)) => Some(a == b),
            _ => None,
        };
        let use_tls = match tls_plan(self.s.tls, Some(&theirs), "initiator") {
            Ok(b) => b,
            Err(reason) => {
                let peer = self.named();
                let f = Failure::Authentication {
                    peer,
                    reason: reason.clone(),
                };
                return self.reject(Status::AuthFailed, &reason, f);
            }
        };
        let agreement = Agreement {
            peer_versions: theirs.versions,
            peer_negotiates: true,
            version,
            ours: self.s.features,
            theirs: theirs.features,
            same_host_token,
            tls: None,
            cred: None,
        };
        self.keep_cred = self.mine.as_ref().is_some_and(|m| m.cred.is_some())
            && agreement.both(negotiate::SAME_HOST)
            && agreement.both(negotiate::SAME_HOST_CRED)
            && same_host_token == Some(true);
        self.agreement = Some(agreement);
        let my_raw = self
            .mine
            .as_ref()
            .map(Extensions::encode)
            .unwrap_or_default();
        self.exts = Some((their_raw, my_raw));
        if use_tls {
            self.state = TargetState::Tls;
            return Instr::Tls { client: false };
        }
        self.read(TargetState::ReadProof, PROOF_LEN, "initiator proof")
    }

    fn on_proof(&mut self, got: &[u8]) -> Instr<Verified> {
        let nc = self.nc();
        let exts = self
            .exts
            .as_ref()
            .map(|(i, t)| (i.as_slice(), t.as_slice()));
        let (client_label, server_label) = labels(exts, self.exporter.as_ref());
        if let Some(s) = self.s.secret {
            if !verify(s, &client_label, &nc, &self.ns, got) {
                let name = self.client.as_ref().map_or("", |h| h.name.as_str());
                let f = Failure::Authentication {
                    peer: format!("{name} ({})", self.s.peer),
                    reason: "the initiator did not prove knowledge of the shared secret".to_owned(),
                };
                return self.reject(
                    Status::AuthFailed,
                    "authentication failed: wrong or missing shared secret",
                    f,
                );
            }
        }
        let Some(agreement) = self.agreement.take() else {
            return self.protocol("handshake driven out of order");
        };
        self.state = TargetState::Done;
        Instr::Done(Verified {
            name: self.client.take().map(|h| h.name).unwrap_or_default(),
            agreement,
            keep_cred: self.keep_cred,
            proof: match self.s.secret {
                Some(s) => proof(s, &server_label, &nc, &self.ns),
                None => [0u8; PROOF_LEN],
            },
        })
    }
}

impl Handshake for Target<'_> {
    type Done = Verified;

    fn start(&mut self) -> Instr<Verified> {
        self.read(TargetState::ReadHello, HELLO_FIXED, "hello")
    }

    fn written(&mut self) -> Instr<Verified> {
        use TargetState as S;
        match self.state {
            S::SendHello if self.negotiates => self.read(S::ReadExtLen, 2, "extension block"),
            S::SendHello => self.legacy(),
            S::Refusing => {
                let f = self.failure.take().unwrap_or(Failure::Protocol {
                    peer: self.s.peer.to_owned(),
                    reason: "handshake driven out of order".to_owned(),
                });
                self.fail(f)
            }
            _ => self.protocol("handshake driven out of order"),
        }
    }

    fn received(&mut self, bytes: &[u8]) -> Instr<Verified> {
        use TargetState as S;
        match self.state {
            S::ReadHello => self.on_hello(bytes),
            S::ReadName => self.on_name(bytes),
            S::ReadExtLen => match ext_len(bytes) {
                Ok(n) => {
                    self.ext_len = n;
                    self.read(S::ReadExt, n, "extension block")
                }
                Err(reason) => self.protocol(reason),
            },
            S::ReadExt if bytes.len() == self.ext_len => self.on_ext(bytes),
            S::ReadProof => self.on_proof(bytes),
            _ => self.protocol("handshake driven out of order"),
        }
    }

    fn tls_done(&mut self, suite: &str, exporter: [u8; 32]) -> Instr<Verified> {
        if self.state != TargetState::Tls {
            return self.protocol("handshake driven out of order");
        }
        self.exporter = Some(exporter);
        if let Some(a) = self.agreement.as_mut() {
            a.tls = tls_text(self.s.tls, suite);
        }
        self.read(TargetState::ReadProof, PROOF_LEN, "initiator proof")
    }

    fn cred_bound(&mut self, invite: Option<CredInvite>) -> Instr<Verified> {
        if !matches!(self.state, TargetState::BindCred | TargetState::ReadName) || !self.negotiates
        {
            return self.protocol("handshake driven out of order");
        }
        let nc = self.nc();
        let mine = our_extensions(&self.s, &nc, &self.ns, invite);
        let auth = if self.s.secret.is_some() {
            FLAG_AUTH
        } else {
            0
        };
        let hello = Hello {
            version: LEGACY_VERSION,
            flags: auth | FLAG_EXT,
            nonce: self.ns,
            name: self.s.name.to_owned(),
        };
        let mut bytes = hello.encode();
        bytes.extend_from_slice(&mine.encode());
        self.mine = Some(mine);
        self.state = TargetState::SendHello;
        Instr::Write {
            bytes,
            what: "sending hello",
            best_effort: false,
        }
    }

    fn transport_failed(&mut self, kind: Transport) -> Failure {
        use TargetState as S;
        let what = match self.state {
            S::ReadHello => "hello",
            S::ReadName => "hello name",
            S::BindCred | S::SendHello => "sending hello",
            S::ReadExtLen | S::ReadExt => "extension block",
            S::Tls => "TLS handshake",
            S::ReadProof => "initiator proof",
            S::Refusing => "sending a rejection",
            S::Done | S::Failed => "after the handshake",
        };
        self.state = S::Failed;
        Failure::Transport {
            what,
            kind,
            unanswered: false,
        }
    }
}

/// The target's answer to an initiator's same-host offer (PROTOCOL.md §5),
/// sent after the WELCOME.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OfferAnswer {
    /// The path is on (SAME_HOST_OK): the control channel and the staging
    /// area taken, or the errno why not (0: not offered).
    Taken {
        /// The control channel.
        channel: Result<(), u32>,
        /// The staging area.
        stage: Result<(), u32>,
    },
    /// Refused (ERR `SameHostRefused`): an [`crate::offer::Refusal`] code
    /// and the errno it carries.
    Refused {
        /// The refusal's code.
        code: u64,
        /// Its errno (0: none).
        errno: u64,
    },
}

/// The bytes of an initiator's same-host offer: the SAME_HOST header
/// naming the descriptors offered as control channel and staging area,
/// then the offer.
pub fn offer_bytes(channel: Option<u32>, stage: Option<u32>, offer: &Offer) -> Vec<u8> {
    let mut out = Request::SameHost {
        id: 0,
        channel,
        stage,
    }
    .encode()
    .to_vec();
    out.extend_from_slice(&offer.encode());
    out
}

/// The target's answer to a same-host offer, from its one header; any
/// other frame is a protocol error (the reason names it).
pub fn offer_answer(header: &[u8; HEADER_LEN]) -> Result<OfferAnswer, String> {
    match Response::decode(header) {
        Ok(Response::SameHostOk {
            id: 0,
            channel,
            stage,
        }) => Ok(OfferAnswer::Taken { channel, stage }),
        Ok(Response::Err {
            id: 0,
            status: Status::SameHostRefused,
            addr,
            len,
        }) => Ok(OfferAnswer::Refused {
            code: addr,
            errno: len,
        }),
        other => Err(format!(
            "unexpected answer to the same-host offer: {other:?}"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> Settings<'static> {
        Settings {
            name: "t",
            peer: "10.0.0.1:5",
            secret: None,
            features: FeatureSet::default(),
            host_key: None,
            tls: None,
            versions: VersionRange::OURS,
        }
    }

    #[test]
    fn a_mooncake_dialer_is_answered_in_its_framing() {
        let hello = foreign::mooncake_refusal(Some(0), "{\"local_nic_path\":\"x\",\"peer\":1}");
        let mut t = Target::new(settings(), [1; NONCE_LEN]);
        assert!(matches!(
            t.start(),
            Instr::Read {
                len: HELLO_FIXED,
                ..
            }
        ));
        let Instr::Write {
            bytes, best_effort, ..
        } = t.received(&hello[..HELLO_FIXED])
        else {
            panic!("no answer");
        };
        assert!(best_effort);
        assert_eq!(foreign::recognise(&bytes), Some(Foreign::Mooncake(Some(0))));
        assert_eq!(t.state(), TargetState::Refusing);
        let Instr::Fail(Failure::Foreign { reason, recognised }) = t.written() else {
            panic!("not refused");
        };
        assert!(recognised && reason.contains("Mooncake"), "{reason}");
        // Garbage is refused without an answer.
        let mut t = Target::new(settings(), [1; NONCE_LEN]);
        t.start();
        let r = t.received(&[0x55; HELLO_FIXED]);
        assert!(
            matches!(
                r,
                Instr::Fail(Failure::Foreign {
                    recognised: false,
                    ..
                })
            ),
            "{r:?}"
        );
    }

    #[test]
    fn the_offers_answer_is_read_from_one_header() {
        let ok = Response::SameHostOk {
            id: 0,
            channel: Ok(()),
            stage: Err(13),
        }
        .encode();
        assert_eq!(
            offer_answer(&ok),
            Ok(OfferAnswer::Taken {
                channel: Ok(()),
                stage: Err(13)
            })
        );
        let refused = Response::Err {
            id: 0,
            status: Status::SameHostRefused,
            addr: 1,
            len: 0,
        }
        .encode();
        assert_eq!(
            offer_answer(&refused),
            Ok(OfferAnswer::Refused { code: 1, errno: 0 })
        );
        let other = Response::Ok { id: 0 }.encode();
        let why = offer_answer(&other).unwrap_err();
        assert!(
            why.starts_with("unexpected answer to the same-host offer: Ok(Ok"),
            "{why}"
        );
    }

    #[test]
    fn an_initiator_names_what_answered() {
        let mut i = Initiator::new(settings(), LEGACY_VERSION, [2; NONCE_LEN]);
        assert!(matches!(i.start(), Instr::Write { .. }));
        assert!(matches!(i.written(), Instr::Read { len: 1, .. }));
        let Instr::Fail(Failure::NotFerry(reason)) = i.received(b"H") else {
            panic!("not refused");
        };
        assert_eq!(
            reason,
            "the peer answered with [48]: not a ferry-tcp target"
        );
        assert_eq!(i.state(), InitiatorState::Failed);
    }
}
