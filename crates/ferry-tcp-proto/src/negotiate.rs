//! Version and feature negotiation (PROTOCOL.md §1.1): the extension block
//! each side of a negotiated handshake sends, how the pair settles on one
//! version and a set of features, and the report of what was settled.
//!
//! A hello with [`FLAG_EXT`](crate::frame::FLAG_EXT) says "I negotiate";
//! its version field stays [`LEGACY_VERSION`] so that a peer that predates
//! negotiation (version 4 or 5, which ignore unknown flags) reads a hello
//! it accepts (TLS 1.3's `legacy_version` + `supported_versions`). The
//! range and the features travel in an extension block of type-length-value
//! entries; a receiver skips the types it does not know, so a new feature
//! is a new entry or a new bit, never a new version.
//!
//! Everything here is pure and never panics on peer bytes.

use std::fmt;

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// The version field of every hello this build sends first (and the
/// newest version a peer that does not negotiate can speak).
pub const LEGACY_VERSION: u16 = 5;
/// Oldest protocol version this build speaks (with a peer that does not
/// negotiate: its hello names it).
pub const MIN_VERSION: u16 = 4;
/// Newest protocol version this build speaks: 6 is version 5's frames
/// with the negotiated handshake.
pub const MAX_VERSION: u16 = 6;
/// Longest extension block (its entries, without the length prefix).
pub const MAX_EXT_LEN: usize = 1024;

/// Extension type: the sender's version range (`min u16, max u16`).
const EXT_VERSIONS: u16 = 1;
/// Extension type: the sender's features (`has u64, on u64`).
const EXT_FEATURES: u16 = 2;
/// Extension type: the same-host token (32 bytes, see [`host_token`]).
const EXT_HOST: u16 = 3;
/// Extension type: how the sender names itself in TLS (1 byte,
/// ferry-tcp's `tls::Identity`); only from a side with TLS on.
const EXT_TLS: u16 = 4;
/// Extension type: the target's credential invitation ([`CredInvite`]:
/// a 16-byte token, then the abstract Unix socket name, 1 to
/// [`MAX_CRED_NAME`] bytes); only from a target, to an initiator that
/// announced [`SAME_HOST_CRED`].
const EXT_CRED: u16 = 5;
/// Longest abstract socket name in a [`CredInvite`] (`sun_path` less its
/// leading zero byte).
pub const MAX_CRED_NAME: usize = 107;

/// A range of protocol versions, both ends included.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VersionRange {
    /// Oldest version.
    pub min: u16,
    /// Newest version.
    pub max: u16,
}

impl VersionRange {
    /// This build's range.
    pub const OURS: VersionRange = VersionRange {
        min: MIN_VERSION,
        max: MAX_VERSION,
    };

    /// The newest version both ranges contain, if any.
    pub fn highest_common(self, other: VersionRange) -> Option<u16> {
        let hi = self.max.min(other.max);
        (hi >= self.min.max(other.min)).then_some(hi)
    }

    /// Whether `v` lies in the range.
    pub fn contains(self, v: u16) -> bool {
        (self.min..=self.max).contains(&v)
    }
}

impl fmt::Display for VersionRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.min == self.max {
            write!(f, "{}", self.min)
        } else {
            write!(f, "{}..={}", self.min, self.max)
        }
    }
}

/// One optional feature: a bit in the FEATURES extension.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Feature {
    /// Its bit.
    pub bit: u64,
    /// Its name in reports.
    pub name: &'static str,
    /// The version that introduced it (a peer that does not negotiate has
    /// it from this version on).
    pub since: u16,
    /// The setting of this engine that turns it off.
    pub setting: &'static str,
}

/// The same-host path (SAME_HOST, CWRITE, CREAD; version 3).
pub const SAME_HOST: Feature = Feature {
    bit: 1,
    name: "same-host",
    since: 3,
    setting: "same_host=off",
};
/// The same-host control channel (a Unix socket pair; version 4).
pub const CONTROL_CHANNEL: Feature = Feature {
    bit: 2,
    name: "control-channel",
    since: 4,
    setting: "same_host_control=tcp",
};
/// The staging area (SWRITE, SREAD; version 5).
pub const STAGING: Feature = Feature {
    bit: 4,
    name: "staging-area",
    since: 5,
    setting: "same_host_stage=off",
};
/// The acknowledgement lane of the staging area (WAKE; version 5). This
/// build uses a staging area only with its lane.
pub const ACK_LANE: Feature = Feature {
    bit: 8,
    name: "ack-lane",
    since: 5,
    setting: "same_host_stage=off",
};

/// Granted copies on the same-host path: the initiator copies into the
/// target's memory itself, under grants the target publishes in a page
/// of the staging area (see [`crate::layout::grants`]). Negotiated
/// only: no version implies it.
pub const GRANTS: Feature = Feature {
    bit: 32,
    name: "granted-copy",
    since: u16::MAX,
    setting: "same_host_grant=off",
};

/// Kernel-attested credentials for the same-host offer: the initiator
/// connects to a Unix socket the target named in its hello
/// ([`CredInvite`]) and sends the connection's token there before its
/// SAME_HOST offer; the target reads that connection's `SO_PEERCRED` /
/// `SO_PEERPIDFD` and accepts only an offer naming that very process (of
/// its own uid, or one the operator allows). A target of this build
/// refuses the same-host path to a peer without it. Negotiated only.
pub const SAME_HOST_CRED: Feature = Feature {
    bit: 64,
    name: "same-host-cred",
    since: u16::MAX,
    setting: "same_host=off",
};

/// TLS 1.3 on the socket path (PROTOCOL.md §1.3). Not one of
/// [`FEATURES`], which are the same-host path's: it is reported apart,
/// with its cipher suite.
pub const TLS: Feature = Feature {
    bit: 16,
    name: "tls",
    since: u16::MAX,
    setting: "tls=off",
};

/// Every optional feature this build implements, in report order.
pub const FEATURES: [Feature; 6] = [
    SAME_HOST,
    CONTROL_CHANNEL,
    STAGING,
    ACK_LANE,
    GRANTS,
    SAME_HOST_CRED,
];

/// A target's invitation to prove the initiator's credentials
/// ([`SAME_HOST_CRED`]): where to connect and what to send.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CredInvite {
    /// Sent by the initiator on the Unix connection: binds it to this
    /// TCP connection's handshake.
    pub token: [u8; 16],
    /// The abstract Unix socket name (without the leading zero byte).
    pub name: Vec<u8>,
}

/// What one side says about its features: the ones it implements (`has`)
/// and the ones its settings leave on (`on`, a subset).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FeatureSet {
    /// Implemented.
    pub has: u64,
    /// Implemented and enabled.
    pub on: u64,
}

impl FeatureSet {
    /// The features a peer that does not negotiate has at `version`
    /// (whether its settings leave them on is unknown: assumed on; the
    /// same-host answer tells).
    pub fn implied_by(version: u16) -> FeatureSet {
        let has = FEATURES
            .iter()
            .filter(|f| version >= f.since)
            .fold(0, |m, f| m | f.bit);
        FeatureSet { has, on: has }
    }

    /// Whether `f` is implemented and on.
    pub fn enabled(&self, f: Feature) -> bool {
        self.on & f.bit != 0
    }
}

/// One side's extension block, decoded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Extensions {
    /// The versions it speaks.
    pub versions: VersionRange,
    /// Its features.
    pub features: FeatureSet,
    /// Its same-host token, if it offers the same-host path.
    pub host: Option<[u8; 32]>,
    /// Its TLS identity kind (ferry-tcp's `tls::Identity`), if it has TLS
    /// on.
    pub tls: Option<u8>,
    /// A target's credential invitation ([`SAME_HOST_CRED`]).
    pub cred: Option<CredInvite>,
}

impl Extensions {
    /// Encodes the block with its u16 length prefix.
    pub fn encode(&self) -> Vec<u8> {
        let mut body = Vec::with_capacity(64);
        let mut entry = |t: u16, v: &[u8]| {
            body.extend_from_slice(&t.to_le_bytes());
            body.extend_from_slice(&(v.len() as u16).to_le_bytes());
            body.extend_from_slice(v);
        };
        let mut vr = [0u8; 4];
        vr[..2].copy_from_slice(&self.versions.min.to_le_bytes());
        vr[2..].copy_from_slice(&self.versions.max.to_le_bytes());
        entry(EXT_VERSIONS, &vr);
        let mut fs = [0u8; 16];
        fs[..8].copy_from_slice(&self.features.has.to_le_bytes());
        fs[8..].copy_from_slice(&self.features.on.to_le_bytes());
        entry(EXT_FEATURES, &fs);
        if let Some(t) = &self.host {
            entry(EXT_HOST, t);
        }
        if let Some(t) = self.tls {
            entry(EXT_TLS, &[t]);
        }
        if let Some(c) = &self.cred {
            entry(EXT_CRED, &[c.token.as_slice(), &c.name].concat());
        }
        let mut out = Vec::with_capacity(2 + body.len());
        out.extend_from_slice(&(body.len() as u16).to_le_bytes());
        out.extend_from_slice(&body);
        out
    }

    /// Decodes a block's entries (without the length prefix). Unknown
    /// types are skipped; a known type of the wrong length, a truncated
    /// entry, a missing or empty version range are errors.
    pub fn decode(body: &[u8]) -> Result<Extensions, String> {
        if body.len() > MAX_EXT_LEN {
            return Err(format!(
                "extension block of {} bytes exceeds {MAX_EXT_LEN}",
                body.len()
            ));
        }
        let (mut versions, mut features, mut host, mut tls, mut cred) =
            (None, FeatureSet::default(), None, None, None);
        let mut rest = body;
        while !rest.is_empty() {
            let [t0, t1, l0, l1, tail @ ..] = rest else {
                return Err("truncated extension entry".to_owned());
            };
            let (t, len) = (
                u16::from_le_bytes([*t0, *t1]),
                u16::from_le_bytes([*l0, *l1]) as usize,
            );
            let Some((v, after)) = tail.split_at_checked(len) else {
                return Err(format!("extension {t} of {len} bytes is truncated"));
            };
            rest = after;
            match (t, v) {
                (EXT_VERSIONS, [a, b, c, d]) => {
                    let r = VersionRange {
                        min: u16::from_le_bytes([*a, *b]),
                        max: u16::from_le_bytes([*c, *d]),
                    };
                    if r.min > r.max || r.min == 0 {
                        return Err(format!("invalid version range {}..={}", r.min, r.max));
                    }
                    versions = Some(r);
                }
                (EXT_FEATURES, v) if v.len() == 16 => {
                    let word = |s: &[u8]| {
                        let mut b = [0u8; 8];
                        b.copy_from_slice(s);
                        u64::from_le_bytes(b)
                    };
                    let (has, on) = (word(&v[..8]), word(&v[8..]));
                    features = FeatureSet { has, on: on & has };
                }
                (EXT_HOST, v) if v.len() == 32 => {
                    let mut b = [0u8; 32];
                    b.copy_from_slice(v);
                    host = Some(b);
                }
                (EXT_TLS, [t]) => tls = Some(*t),
                (EXT_CRED, v) if v.len() > 16 && v.len() <= 16 + MAX_CRED_NAME => {
                    let mut token = [0u8; 16];
                    token.copy_from_slice(&v[..16]);
                    cred = Some(CredInvite {
                        token,
                        name: v[16..].to_vec(),
                    });
                }
                (EXT_VERSIONS | EXT_FEATURES | EXT_HOST | EXT_TLS | EXT_CRED, v) => {
                    return Err(format!("extension {t} has a length of {}", v.len()));
                }
                _ => {}
            }
        }
        let versions = versions.ok_or("the extension block names no version range")?;
        Ok(Extensions {
            versions,
            features,
            host,
            tls,
            cred,
        })
    }
}

/// A hello nonce whose last 8 bytes are this marker came from a target
/// that negotiates but answered a hello without [`crate::frame::FLAG_EXT`]
/// (TLS 1.3's downgrade sentinel): an initiator that sent the flag and
/// sees the marker knows the flag was stripped on the way.
pub const DOWNGRADE_SENTINEL: [u8; 8] = *b"FRY-LGCY";

/// Marks a target's nonce with [`DOWNGRADE_SENTINEL`].
pub fn mark_legacy(nonce: &mut [u8; 32]) {
    nonce[24..].copy_from_slice(&DOWNGRADE_SENTINEL);
}

/// Whether a target's nonce carries [`DOWNGRADE_SENTINEL`].
pub fn is_marked_legacy(nonce: &[u8; 32]) -> bool {
    nonce[24..] == DOWNGRADE_SENTINEL
}

/// What two processes share exactly when they run on one boot of one
/// machine in one PID namespace: the key of [`host_token`], the string
/// `boot id ‖ "/" ‖ PID-namespace inode`. The driver reads both once (at
/// engine start) from `/proc`; this module never does.
#[derive(Clone, PartialEq, Eq)]
pub struct HostKey(String);

impl HostKey {
    /// The key of a process whose boot id is `boot_id` (ASCII,
    /// zero-padded: the bytes up to the first zero count) and whose PID
    /// namespace has the inode `pid_namespace`.
    pub fn new(boot_id: &[u8], pid_namespace: u64) -> HostKey {
        let end = boot_id
            .iter()
            .position(|&b| b == 0)
            .unwrap_or(boot_id.len());
        HostKey(format!(
            "{}/{pid_namespace}",
            String::from_utf8_lossy(&boot_id[..end])
        ))
    }
}

impl fmt::Debug for HostKey {
    // The boot id is the secret of the token: never printed.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("HostKey(..)")
    }
}

/// The same-host token of this process for one handshake:
/// `HMAC-SHA256(key, "ferry-tcp host" ‖ nonce_i ‖ nonce_t)` with the
/// [`HostKey`] `boot id ‖ "/" ‖ PID-namespace inode`. Two processes get the
/// same token exactly when they share the boot and the PID namespace; the
/// token reveals nothing else (the boot id is 122 random bits, and the
/// nonces are fresh).
pub fn host_token(key: &HostKey, initiator: &[u8; 32], target: &[u8; 32]) -> [u8; 32] {
    // The MAC of ferry-core's `raw::auth::proof`, written out here (that
    // crate needs tokio); ferry-tcp tests that the two agree.
    // HMAC takes keys of any length: new_from_slice cannot fail.
    let mut m = match Hmac::<Sha256>::new_from_slice(key.0.as_bytes()) {
        Ok(m) => m,
        Err(_) => unreachable!("HMAC accepts keys of any length"),
    };
    m.update(b"ferry-tcp host");
    m.update(initiator);
    m.update(target);
    m.finalize().into_bytes().into()
}

/// What one handshake settled.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Agreement {
    /// The peer's versions (a peer that does not negotiate: just its
    /// hello's version).
    pub peer_versions: VersionRange,
    /// Whether the peer negotiated (sent an extension block).
    pub peer_negotiates: bool,
    /// The version in use.
    pub version: u16,
    /// This engine's features for this connection.
    pub ours: FeatureSet,
    /// The peer's (implied by its version if it does not negotiate).
    pub theirs: FeatureSet,
    /// Both sent the same same-host token (`None`: the peer does not
    /// negotiate, or one side sent no token).
    pub same_host_token: Option<bool>,
    /// The TLS session: its cipher suite and how the peers were named
    /// (`None`: in clear).
    pub tls: Option<String>,
    /// The target's credential invitation (initiator side; `None`: the
    /// target sent none).
    pub cred: Option<CredInvite>,
}

impl Agreement {
    /// Whether both sides have `f` on.
    pub fn both(&self, f: Feature) -> bool {
        self.ours.enabled(f) && self.theirs.enabled(f)
    }

    /// Why `f` is off on this connection, or `None` if both have it on.
    pub fn why_off(&self, f: Feature) -> Option<FeatureOff> {
        if self.ours.has & f.bit == 0 {
            Some(FeatureOff::ThisEngineLacks)
        } else if self.theirs.has & f.bit == 0 {
            Some(FeatureOff::PeerLacks)
        } else if !self.ours.enabled(f) {
            Some(FeatureOff::DisabledHere(f.setting))
        } else if !self.theirs.enabled(f) {
            Some(FeatureOff::DisabledByPeer)
        } else {
            None
        }
    }
}

/// The message for a pair with no common version: both ranges, and which
/// side to upgrade.
pub fn no_common_version(ours: VersionRange, theirs: VersionRange, peer_role: &str) -> String {
    let upgrade = if theirs.max < ours.min {
        format!("upgrade the {peer_role}")
    } else {
        format!("upgrade this engine (the {peer_role} is newer)")
    };
    format!(
        "no common ferry-tcp protocol version: this engine speaks {ours}, the {peer_role} {theirs}; {upgrade}"
    )
}

/// The settings of an engine that decide its features
/// ([`our_features`]): a plain copy of five fields of its configuration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FeatureSettings {
    /// `same_host` is not `off`.
    pub same_host_on: bool,
    /// `tls` is not `off`.
    pub tls_on: bool,
    /// `same_host_control=unix` (an initiator offers the control channel).
    pub unix: bool,
    /// `same_host_stage` is not `off` (an initiator offers a staging area).
    pub stage: bool,
    /// `same_host_grant` is on.
    pub grant: bool,
}

/// This engine's features for a connection, given its settings: an
/// initiator's `same_host`, `same_host_control` and `same_host_stage`, or
/// a target's `same_host` (a target takes whatever channel and area an
/// agreed initiator offers); either side's `same_host_grant`.
pub fn our_features(cfg: FeatureSettings, initiator: bool) -> FeatureSet {
    let has = FEATURES.iter().fold(TLS.bit, |m, f| m | f.bit);
    let mut on = has;
    if !cfg.same_host_on {
        on = TLS.bit;
    }
    if !cfg.tls_on {
        on &= !TLS.bit;
    }
    if initiator {
        if !cfg.unix {
            on &= !CONTROL_CHANNEL.bit;
        }
        if !cfg.stage {
            on &= !(STAGING.bit | ACK_LANE.bit);
        }
    }
    // Either side may refuse granted copies: an initiator that will not
    // copy, a target that will not grant.
    if !cfg.grant {
        on &= !GRANTS.bit;
    }
    FeatureSet { has, on }
}

/// Why a feature is off on a connection.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum FeatureOff {
    /// This engine does not implement it.
    ThisEngineLacks,
    /// The peer does not implement it (older build).
    PeerLacks,
    /// A setting of this engine turned it off (the setting).
    DisabledHere(&'static str),
    /// The peer has it but its settings turned it off.
    DisabledByPeer,
    /// It applies only between processes on one host, and the peer is not
    /// (or could not be shown to be) on this host.
    NotSameHost,
    /// The peer refused it when offered, for this reason.
    Refused(String),
    /// It needs another feature that is off.
    Needs(&'static str),
}

impl fmt::Display for FeatureOff {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FeatureOff::ThisEngineLacks => f.write_str("this engine lacks it"),
            FeatureOff::PeerLacks => f.write_str("the peer lacks it"),
            FeatureOff::DisabledHere(s) => write!(f, "disabled here ({s})"),
            FeatureOff::DisabledByPeer => f.write_str("disabled by the peer's settings"),
            FeatureOff::NotSameHost => f.write_str("the peer is not on this host"),
            FeatureOff::Refused(r) => write!(f, "refused by the peer: {r}"),
            FeatureOff::Needs(n) => write!(f, "needs {n}, which is off"),
        }
    }
}

/// One feature's state on a connection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FeatureState {
    /// The feature's name (`same-host`, `control-channel`, …).
    pub name: &'static str,
    /// `None`: on; else why it is off.
    pub off: Option<FeatureOff>,
}

/// The per-feature states of an initiator's connection, filled in as the
/// same-host negotiation goes (its [`PeerReport::features`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FeatureReport {
    /// Every optional feature, on or off and why.
    pub states: Vec<FeatureState>,
}

impl FeatureReport {
    /// Every feature off for the reason the handshake gives (on if both
    /// have it on, until the same-host answer says otherwise).
    pub fn new(agreed: &Agreement) -> FeatureReport {
        FeatureReport {
            states: FEATURES
                .iter()
                .map(|f| FeatureState {
                    name: f.name,
                    off: agreed.why_off(*f),
                })
                .collect(),
        }
    }

    /// Sets `f` on (`None`) or off.
    pub fn set(&mut self, f: Feature, off: Option<FeatureOff>) {
        if let Some(s) = self.states.iter_mut().find(|s| s.name == f.name) {
            s.off = off;
        }
    }

    /// The same-host path is not used, for `why`: every feature that the
    /// handshake left on depends on it.
    pub fn off_all(&mut self, why: FeatureOff) {
        for s in &mut self.states {
            if s.off.is_none() {
                s.off = Some(if s.name == SAME_HOST.name {
                    why.clone()
                } else {
                    FeatureOff::Needs(SAME_HOST.name)
                });
            } else if s.name == SAME_HOST.name {
                s.off = Some(why.clone());
            }
        }
    }

    /// The target took the same-host path; the control channel is off
    /// for `channel` (`None`: on), the staging area for `stage` (see
    /// [`offered`]); granted copies and the acknowledgement lane need the
    /// area.
    pub fn same_host_on(
        &mut self,
        agreed: &Agreement,
        channel: Option<FeatureOff>,
        stage: Option<FeatureOff>,
    ) {
        self.set(SAME_HOST, None);
        self.set(CONTROL_CHANNEL, channel);
        self.set(STAGING, stage.clone());
        if stage.is_some() {
            self.set(
                GRANTS,
                agreed
                    .why_off(GRANTS)
                    .or(Some(FeatureOff::Needs(STAGING.name))),
            );
        }
        self.set(
            ACK_LANE,
            match stage {
                None => None,
                Some(FeatureOff::Refused(_)) => Some(FeatureOff::Needs(STAGING.name)),
                Some(_) => agreed
                    .why_off(ACK_LANE)
                    .or(Some(FeatureOff::Needs(STAGING.name))),
            },
        );
    }
}

/// What became of a part of the same-host offer (the control channel,
/// the staging area): off for the reason the handshake gave (`agreed`),
/// not made here (`made`: why not), refused by the target (`answer`), or
/// on (`None`).
pub fn offered(
    agreed: &Option<FeatureOff>,
    made: Result<(), &String>,
    answer: Result<(), &String>,
) -> Option<FeatureOff> {
    match (agreed, made, answer) {
        (Some(why), _, _) => Some(why.clone()),
        (None, Err(e), _) | (None, Ok(()), Err(e)) => Some(FeatureOff::Refused(e.clone())),
        (None, Ok(()), Ok(())) => None,
    }
}

/// Whether an initiator offers the same-host path: both sides have it on
/// and the peer is on this host (`local`: both sent the same host token,
/// or, for a peer that does not negotiate, its address is local).
pub fn same_host_plan(agreed: &Agreement, local: bool) -> Result<(), FeatureOff> {
    match agreed.why_off(SAME_HOST) {
        Some(why) => Err(why),
        None if !local => Err(FeatureOff::NotSameHost),
        None => Ok(()),
    }
}

/// What an initiator negotiated with one peer on its latest connection
/// (ferry-tcp's `TcpEngine::peer_report`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerReport {
    /// The peer's segment name.
    pub peer: String,
    /// The versions this engine speaks.
    pub ours: VersionRange,
    /// The versions the peer speaks (a peer that does not negotiate: the
    /// one its hello names).
    pub theirs: VersionRange,
    /// Whether the peer negotiated (false: a build before version 6).
    pub peer_negotiates: bool,
    /// The version in use.
    pub version: u16,
    /// Every optional feature, on or off and why.
    pub features: Vec<FeatureState>,
    /// The payload path: `socket`, `same-host cma` or `same-host staged`.
    pub path: String,
    /// The path's details, as `backend_info` shows them (`tcp (reason)`,
    /// `cma (notes)`).
    pub path_detail: String,
    /// TLS on the connection: `Ok(cipher suite and identity)` (e.g.
    /// `TLS13_AES_256_GCM_SHA384, identity derived from the shared
    /// secret`), or why it is off.
    pub tls: std::result::Result<String, FeatureOff>,
}

impl fmt::Display for PeerReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "peer {}", self.peer)?;
        writeln!(
            f,
            "  versions: this engine {}, peer {}{}",
            self.ours,
            self.theirs,
            if self.peer_negotiates {
                ""
            } else {
                " (does not negotiate)"
            }
        )?;
        writeln!(f, "  version in use: {}", self.version)?;
        for s in &self.features {
            match &s.off {
                None => writeln!(f, "  {:<16} on", s.name)?,
                Some(why) => writeln!(f, "  {:<16} off: {why}", s.name)?,
            }
        }
        match &self.tls {
            Ok(suite) => writeln!(f, "  {:<16} on: {suite}", TLS.name)?,
            Err(why) => writeln!(f, "  {:<16} off: {why}", TLS.name)?,
        }
        write!(f, "  path: {} ({})", self.path, self.path_detail)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn highest_common_version() {
        let ours = VersionRange { min: 4, max: 6 };
        assert_eq!(
            ours.highest_common(VersionRange { min: 5, max: 9 }),
            Some(6)
        );
        assert_eq!(
            ours.highest_common(VersionRange { min: 2, max: 4 }),
            Some(4)
        );
        assert_eq!(ours.highest_common(VersionRange { min: 7, max: 9 }), None);
        assert_eq!(ours.highest_common(VersionRange { min: 1, max: 3 }), None);
        let m = no_common_version(ours, VersionRange { min: 1, max: 3 }, "target");
        assert!(
            m.contains("4..=6") && m.contains("1..=3") && m.contains("upgrade the target"),
            "{m}"
        );
        let m = no_common_version(ours, VersionRange { min: 7, max: 9 }, "initiator");
        assert!(m.contains("upgrade this engine"), "{m}");
    }

    #[test]
    fn extensions_round_trip_and_skip_unknown_types() {
        let e = Extensions {
            versions: VersionRange { min: 4, max: 6 },
            features: FeatureSet { has: 15, on: 5 },
            host: Some([7; 32]),
            tls: Some(1),
            cred: Some(CredInvite {
                token: [5; 16],
                name: b"ferry-cred-test".to_vec(),
            }),
        };
        let bytes = e.encode();
        let len = u16::from_le_bytes([bytes[0], bytes[1]]) as usize;
        assert_eq!(len + 2, bytes.len());
        assert_eq!(Extensions::decode(&bytes[2..]).unwrap(), e);
        // A future peer's extension (type 99) is skipped.
        let mut body = bytes[2..].to_vec();
        body.extend_from_slice(&99u16.to_le_bytes());
        body.extend_from_slice(&3u16.to_le_bytes());
        body.extend_from_slice(b"new");
        assert_eq!(Extensions::decode(&body).unwrap(), e);
        // `on` is clipped to `has`.
        let odd = Extensions {
            features: FeatureSet { has: 1, on: 3 },
            ..e.clone()
        };
        assert_eq!(
            Extensions::decode(&odd.encode()[2..]).unwrap().features.on,
            1
        );
    }

    #[test]
    fn bad_blocks_are_errors_not_panics() {
        assert!(Extensions::decode(&[]).is_err(), "no version range");
        assert!(
            Extensions::decode(&[1, 0, 4, 0, 6, 0]).is_err(),
            "truncated"
        );
        assert!(
            Extensions::decode(&[1, 0, 4, 0, 6, 0, 4, 0]).is_err(),
            "min > max"
        );
        assert!(
            Extensions::decode(&[1, 0, 2, 0, 6, 0]).is_err(),
            "wrong length"
        );
        assert!(Extensions::decode(&[9]).is_err());
        assert!(Extensions::decode(&vec![0; MAX_EXT_LEN + 1]).is_err());
        // Arbitrary bytes never panic.
        let mut x: u32 = 0x9e37_79b9;
        for n in 0..2000usize {
            let v: Vec<u8> = (0..n % 64)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 17;
                    x ^= x << 5;
                    (x % 8) as u8
                })
                .collect();
            let _ = Extensions::decode(&v);
        }
    }

    #[test]
    fn legacy_versions_imply_their_features() {
        let v4 = FeatureSet::implied_by(4);
        assert!(v4.enabled(SAME_HOST) && v4.enabled(CONTROL_CHANNEL));
        assert!(!v4.enabled(STAGING) && !v4.enabled(ACK_LANE));
        let v5 = FeatureSet::implied_by(5);
        assert!(FEATURES
            .iter()
            .all(|f| v5.enabled(*f) != (*f == GRANTS || *f == SAME_HOST_CRED)));
        assert!(
            !FeatureSet::implied_by(u16::MAX - 1).enabled(GRANTS),
            "granted copies are negotiated only"
        );
    }

    #[test]
    fn reasons_name_the_side() {
        let a = Agreement {
            peer_versions: VersionRange { min: 4, max: 4 },
            peer_negotiates: false,
            version: 4,
            ours: FeatureSet { has: 15, on: 13 },
            theirs: FeatureSet::implied_by(4),
            same_host_token: None,
            tls: None,
            cred: None,
        };
        assert_eq!(a.why_off(SAME_HOST), None);
        assert_eq!(
            a.why_off(CONTROL_CHANNEL),
            Some(FeatureOff::DisabledHere("same_host_control=tcp"))
        );
        assert_eq!(a.why_off(STAGING), Some(FeatureOff::PeerLacks));
        let b = Agreement {
            theirs: FeatureSet { has: 15, on: 0 },
            ours: FeatureSet { has: 15, on: 15 },
            ..a
        };
        assert_eq!(b.why_off(SAME_HOST), Some(FeatureOff::DisabledByPeer));
    }

    #[test]
    fn host_tokens_agree_exactly_on_one_boot_and_namespace() {
        let mut boot = [0u8; 48];
        boot[..3].copy_from_slice(b"b-1");
        let key = HostKey::new(&boot, 7);
        assert_eq!(key.0, "b-1/7", "the bytes up to the first zero");
        assert_eq!(format!("{key:?}"), "HostKey(..)");
        let (ni, nt) = ([1u8; 32], [2u8; 32]);
        let t = host_token(&key, &ni, &nt);
        assert_eq!(t, host_token(&HostKey::new(b"b-1", 7), &ni, &nt));
        assert_ne!(t, host_token(&HostKey::new(b"b-1", 8), &ni, &nt));
        assert_ne!(t, host_token(&HostKey::new(b"b-2", 7), &ni, &nt));
        assert_ne!(t, host_token(&key, &nt, &ni));
    }

    #[test]
    fn the_report_follows_the_same_host_answer() {
        // A version-5 peer: everything agreed but grants and credentials.
        let a = Agreement {
            peer_versions: VersionRange { min: 5, max: 5 },
            peer_negotiates: false,
            version: 5,
            ours: our_features(
                FeatureSettings {
                    same_host_on: true,
                    tls_on: false,
                    unix: true,
                    stage: true,
                    grant: true,
                },
                true,
            ),
            theirs: FeatureSet::implied_by(5),
            same_host_token: None,
            tls: None,
            cred: None,
        };
        assert_eq!(same_host_plan(&a, false), Err(FeatureOff::NotSameHost));
        assert_eq!(same_host_plan(&a, true), Ok(()));
        let state = |r: &FeatureReport, f: Feature| {
            r.states
                .iter()
                .find(|s| s.name == f.name)
                .and_then(|s| s.off.clone())
        };
        let refused = "EPERM".to_owned();
        // The channel taken, the area refused by the target.
        let mut r = FeatureReport::new(&a);
        let channel = offered(&None, Ok(()), Ok(()));
        let stage = offered(&None, Ok(()), Err(&refused));
        assert_eq!(stage, Some(FeatureOff::Refused(refused.clone())));
        r.same_host_on(&a, channel, stage);
        assert_eq!(state(&r, SAME_HOST), None);
        assert_eq!(state(&r, CONTROL_CHANNEL), None);
        assert_eq!(state(&r, STAGING), Some(FeatureOff::Refused(refused)));
        assert_eq!(state(&r, ACK_LANE), Some(FeatureOff::Needs(STAGING.name)));
        assert_eq!(state(&r, GRANTS), Some(FeatureOff::PeerLacks));
        // The path refused: what the handshake left on needs it.
        let mut r = FeatureReport::new(&a);
        r.off_all(FeatureOff::Refused("no".into()));
        assert_eq!(state(&r, SAME_HOST), Some(FeatureOff::Refused("no".into())));
        assert_eq!(
            state(&r, CONTROL_CHANNEL),
            Some(FeatureOff::Needs(SAME_HOST.name))
        );
        assert_eq!(state(&r, GRANTS), Some(FeatureOff::PeerLacks));
        // Not agreed: the handshake's reason wins over what was made.
        let why = Some(FeatureOff::DisabledHere("same_host_stage=off"));
        assert_eq!(offered(&why, Err(&"x".to_owned()), Ok(())), why);
    }

    #[test]
    fn the_downgrade_sentinel_marks_a_nonce() {
        let mut n = [3u8; 32];
        assert!(!is_marked_legacy(&n));
        mark_legacy(&mut n);
        assert!(is_marked_legacy(&n));
    }
}
