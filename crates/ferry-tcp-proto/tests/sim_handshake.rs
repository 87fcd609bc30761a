//! Deterministic simulation of the handshake (issue 42): the initiator's
//! real core ([`handshake::Initiator`]) against the target's
//! ([`handshake::Target`]), or against doubles of the builds that do not
//! negotiate (versions 3 to 5: hello, proof, WELCOME or REJECT), or
//! against a hostile peer, over simulated byte pipes. One seed is one
//! schedule: which builds meet (version ranges old and new), their
//! secrets (equal, different, missing on one side), their TLS settings
//! (off, on, require; either identity), and the faults: bytes moved in
//! pieces of random size through bounded pipes, a connection cut at a
//! random step, a side stopped past the other's timeout (virtual time),
//! a byte flipped in transit, the negotiation flag stripped from the
//! initiator's hello (the downgrade sentinel must catch it), a man in the
//! middle of TLS (each side sees another exporter: the proofs must fail
//! with a secret), and garbage from either side.
//!
//! The test plays the driver (ferry-tcp's `handshake::drive`): it writes
//! and reads what a core asks, runs a stand-in for TLS (a marker each way,
//! then the exporter), and, on the target, sends the WELCOME the engine
//! sends once the core is done. Checked for every seed:
//! - no panic on any input, and every read a core asks for is bounded
//!   ([`handshake::MAX_READ`]) before any byte of it arrives;
//! - both sides end (done, or failed with a typed reason) within the
//!   step budget: timeouts on virtual time unblock every wait;
//! - without faults, the outcome is the one PROTOCOL.md §1 gives for that
//!   pair: both agree (same version, TLS on both or neither, each side's
//!   view of the other's features, the same same-host verdict, the table
//!   as sent, every byte consumed), or each fails with the expected kind
//!   (no common version: `Protocol`; wrong or missing secret:
//!   `Authentication` / a REJECT `AuthFailed`; TLS requirements that
//!   differ: `Authentication`);
//! - with a shared secret, whatever is flipped or stripped on the way,
//!   two sides that both succeed agree on what was announced.
//!
//! `cargo test -p ferry-tcp-proto --test sim_handshake` runs
//! [`DEFAULT_SEEDS`] seeds and prints what it ran; `FERRY_SIM_SEEDS=N`
//! runs N; a failure prints its seed and `FERRY_SIM_SEED=<s>`, which
//! replays it. Under a planted mutant (`RUSTFLAGS='--cfg
//! ferry_mutant="…"'`: `downgrade_unchecked`, the sentinel ignored;
//! `proof_unbound_from_tls`, the exporter left out of the proofs' labels)
//! the test expects the simulator to find it and prints the first seed
//! that did.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

mod common;

use common::Rng;
use ferry_tcp_proto::frame::{
    encode_table, Hello, Status, TableEntry, FLAG_AUTH, HELLO_FIXED, MAGIC, MAX_NAME, REJECT,
    WELCOME,
};
use ferry_tcp_proto::handshake::{
    self, labels, proof, reject_bytes, verify, ClientOutcome, Failure, Handshake, Instr, Settings,
    TlsIdentity, TlsSettings, Transport, Verified, MAX_READ,
};
use ferry_tcp_proto::negotiate::{
    self, our_features, CredInvite, FeatureSettings, HostKey, VersionRange,
};

const DEFAULT_SEEDS: u64 = 20_000;
/// The drivers' stall timeout, in virtual milliseconds.
const TIMEOUT: u64 = 2_000;
const MAX_STEPS: u64 = 50_000;
/// The longest write a side makes (a hello with its name and block, a
/// rejection, a welcome with the sim's table).
const MAX_WRITE: usize = HELLO_FIXED + MAX_NAME + 2 + 1024 + 4 + 1024 + 32 + 8 + 24 * 8;

const OLD: VersionRange = VersionRange { min: 4, max: 6 };
const NEWER: VersionRange = VersionRange { min: 6, max: 8 };
const FUTURE: VersionRange = VersionRange { min: 7, max: 9 };

fn host_keys() -> &'static [HostKey; 2] {
    static KEYS: OnceLock<[HostKey; 2]> = OnceLock::new();
    KEYS.get_or_init(|| [HostKey::new(b"boot-a", 1), HostKey::new(b"boot-b", 1)])
}

/// How a side ended.
#[derive(Debug)]
enum Out {
    /// Initiator core: connected.
    Welcome(handshake::Welcome),
    /// Initiator core: dial again with this version.
    Redial(u16),
    /// Target core: verified (the sim sent the WELCOME).
    Verified(Verified),
    /// A double of an older build: connected.
    LegacyOk,
    /// A hostile peer stopped.
    Hostile,
    /// The stand-in for TLS failed (the peer did not run TLS).
    TlsFailed,
    /// Failed, typed.
    Failed(Failure),
}

/// What the sim drives: a core, or a double, as one interface.
trait Peer {
    fn start(&mut self) -> Instr<Out>;
    fn written(&mut self) -> Instr<Out>;
    fn received(&mut self, b: &[u8]) -> Instr<Out>;
    fn tls_done(&mut self, exporter: [u8; 32]) -> Instr<Out>;
    fn cred_bound(&mut self, invite: Option<CredInvite>) -> Instr<Out>;
    fn transport_failed(&mut self, kind: Transport) -> Failure;
}

fn map<D>(i: Instr<D>, f: impl FnOnce(D) -> Out) -> Instr<Out> {
    match i {
        Instr::Write {
            bytes,
            what,
            best_effort,
        } => Instr::Write {
            bytes,
            what,
            best_effort,
        },
        Instr::Read {
            len,
            what,
            best_effort,
        } => Instr::Read {
            len,
            what,
            best_effort,
        },
        Instr::Tls { client } => Instr::Tls { client },
        Instr::BindCred => Instr::BindCred,
        Instr::Done(d) => Instr::Done(f(d)),
        Instr::Fail(f) => Instr::Fail(f),
    }
}

struct Core<H>(H, fn(<H as Handshake>::Done) -> Out)
where
    H: Handshake;

impl<H: Handshake> Peer for Core<H> {
    fn start(&mut self) -> Instr<Out> {
        map(self.0.start(), self.1)
    }
    fn written(&mut self) -> Instr<Out> {
        map(self.0.written(), self.1)
    }
    fn received(&mut self, b: &[u8]) -> Instr<Out> {
        map(self.0.received(b), self.1)
    }
    fn tls_done(&mut self, exporter: [u8; 32]) -> Instr<Out> {
        map(self.0.tls_done("SIM_TLS13", exporter), self.1)
    }
    fn cred_bound(&mut self, invite: Option<CredInvite>) -> Instr<Out> {
        map(self.0.cred_bound(invite), self.1)
    }
    fn transport_failed(&mut self, kind: Transport) -> Failure {
        self.0.transport_failed(kind)
    }
}

fn write(bytes: Vec<u8>) -> Instr<Out> {
    Instr::Write {
        bytes,
        what: "double",
        best_effort: false,
    }
}

fn read(len: usize) -> Instr<Out> {
    Instr::Read {
        len,
        what: "double",
        best_effort: false,
    }
}

fn double_fails(reason: &str) -> Instr<Out> {
    Instr::Fail(Failure::Protocol {
        peer: "double".into(),
        reason: reason.into(),
    })
}

/// A target of a build that does not negotiate (version `v`): its hello,
/// then REJECT BadVersion for another version, or the proof check and
/// WELCOME.
struct LegacyTarget {
    v: u16,
    secret: Option<&'static str>,
    ns: [u8; 32],
    nc: [u8; 32],
    fixed: [u8; HELLO_FIXED],
    step: u8,
    /// Why it refused (`None`: it welcomed).
    refused: Option<Failure>,
}

impl Peer for LegacyTarget {
    fn start(&mut self) -> Instr<Out> {
        self.step = 0;
        read(HELLO_FIXED)
    }
    fn written(&mut self) -> Instr<Out> {
        match self.step {
            2 => {
                self.step = 3;
                read(32)
            }
            4 => match self.refused.take() {
                None => Instr::Done(Out::LegacyOk),
                Some(f) => Instr::Fail(f),
            },
            _ => double_fails("out of order"),
        }
    }
    fn received(&mut self, b: &[u8]) -> Instr<Out> {
        match self.step {
            0 => {
                self.fixed.copy_from_slice(b);
                let Ok((h, n)) = Hello::decode_fixed(&self.fixed) else {
                    return double_fails("bad hello");
                };
                self.nc = h.nonce;
                self.step = 1;
                read(n)
            }
            1 => {
                let Ok((h, _)) = Hello::decode_fixed(&self.fixed) else {
                    return double_fails("bad hello");
                };
                let auth = if self.secret.is_some() { FLAG_AUTH } else { 0 };
                let mut out = Hello {
                    version: self.v,
                    flags: auth,
                    nonce: self.ns,
                    name: "legacy-target".into(),
                }
                .encode();
                if h.version != self.v {
                    out.extend(reject_bytes(Status::BadVersion, "version"));
                    self.refused = Some(Failure::Protocol {
                        peer: "double".into(),
                        reason: "version".into(),
                    });
                    self.step = 4;
                    return write(out);
                }
                self.step = 2;
                write(out)
            }
            3 => {
                let (ci, ct) = labels(None, None);
                self.step = 4;
                if let Some(s) = self.secret {
                    if !verify(s, &ci, &self.nc, &self.ns, b) {
                        self.refused = Some(Failure::Authentication {
                            peer: "double".into(),
                            reason: "proof".into(),
                        });
                        return write(reject_bytes(Status::AuthFailed, "authentication failed"));
                    }
                }
                let p = self
                    .secret
                    .map_or([0; 32], |s| proof(s, &ct, &self.nc, &self.ns));
                let mut out = vec![WELCOME];
                out.extend_from_slice(&p);
                out.extend_from_slice(&1000u32.to_le_bytes());
                out.extend_from_slice(&0u32.to_le_bytes());
                write(out)
            }
            _ => double_fails("out of order"),
        }
    }
    fn tls_done(&mut self, _: [u8; 32]) -> Instr<Out> {
        double_fails("no TLS here")
    }
    fn cred_bound(&mut self, _: Option<CredInvite>) -> Instr<Out> {
        double_fails("no credentials here")
    }
    fn transport_failed(&mut self, kind: Transport) -> Failure {
        Failure::Transport {
            what: "double",
            kind,
            unanswered: false,
        }
    }
}

/// An initiator of a build that does not negotiate (version `v`).
struct LegacyInitiator {
    v: u16,
    secret: Option<&'static str>,
    nc: [u8; 32],
    ns: [u8; 32],
    fixed: [u8; HELLO_FIXED],
    step: u8,
}

impl Peer for LegacyInitiator {
    fn start(&mut self) -> Instr<Out> {
        let auth = if self.secret.is_some() { FLAG_AUTH } else { 0 };
        write(
            Hello {
                version: self.v,
                flags: auth,
                nonce: self.nc,
                name: "legacy-initiator".into(),
            }
            .encode(),
        )
    }
    fn written(&mut self) -> Instr<Out> {
        match self.step {
            0 => {
                self.step = 1;
                read(HELLO_FIXED)
            }
            3 => {
                self.step = 4;
                read(1)
            }
            _ => double_fails("out of order"),
        }
    }
    fn received(&mut self, b: &[u8]) -> Instr<Out> {
        match self.step {
            1 => {
                self.fixed.copy_from_slice(b);
                let Ok((h, n)) = Hello::decode_fixed(&self.fixed) else {
                    return double_fails("bad hello");
                };
                if h.version != self.v {
                    return double_fails("the target speaks another version");
                }
                self.ns = h.nonce;
                self.step = 2;
                read(n)
            }
            2 => {
                let (ci, _) = labels(None, None);
                let p = self
                    .secret
                    .map_or([0; 32], |s| proof(s, &ci, &self.nc, &self.ns));
                self.step = 3;
                write(p.to_vec())
            }
            4 if b == [WELCOME] => {
                self.step = 5;
                read(32)
            }
            4 => Instr::Fail(Failure::Rejected {
                status: None,
                reason: "legacy initiator refused".into(),
            }),
            5 => {
                let (_, ct) = labels(None, None);
                if let Some(s) = self.secret {
                    if !verify(s, &ct, &self.nc, &self.ns, b) {
                        return double_fails("the target did not prove the secret");
                    }
                }
                self.step = 6;
                read(8)
            }
            6 => {
                let count = u32::from_le_bytes([b[4], b[5], b[6], b[7]]) as usize;
                if count > 8 {
                    return double_fails("table too long for the double");
                }
                self.step = 7;
                read(count * 24)
            }
            7 => Instr::Done(Out::LegacyOk),
            _ => double_fails("out of order"),
        }
    }
    fn tls_done(&mut self, _: [u8; 32]) -> Instr<Out> {
        double_fails("no TLS here")
    }
    fn cred_bound(&mut self, _: Option<CredInvite>) -> Instr<Out> {
        double_fails("no credentials here")
    }
    fn transport_failed(&mut self, kind: Transport) -> Failure {
        Failure::Transport {
            what: "double",
            kind,
            unanswered: false,
        }
    }
}

/// Garbage, or the start of a handshake going wrong: a few writes of
/// hostile bytes, reads of whatever comes.
struct Hostile {
    rng: Rng,
    left: u32,
}

impl Hostile {
    fn garbage(&mut self) -> Vec<u8> {
        let r = &mut self.rng;
        let mut out = match r.below(6) {
            // A hello whose fields are random.
            0 => {
                let mut h = MAGIC.to_vec();
                h.extend((0..HELLO_FIXED - 4).map(|_| r.next() as u8));
                h
            }
            // A REJECT, a WELCOME with a huge table, an over-long block.
            1 => vec![REJECT, r.next() as u8, 0xff, 0xff],
            2 => {
                let mut w = vec![WELCOME];
                w.extend([0u8; 32]);
                w.extend(1000u32.to_le_bytes());
                w.extend((r.next() as u32).to_le_bytes());
                w
            }
            3 => vec![0xff, 0xff],
            // A Mooncake-like or HTTP-like start.
            4 => b"GET / HTTP/1.1\r\n".to_vec(),
            _ => Vec::new(),
        };
        let n = r.below(64) as usize;
        out.extend((0..n).map(|_| r.next() as u8));
        out
    }
}

impl Peer for Hostile {
    fn start(&mut self) -> Instr<Out> {
        write(self.garbage())
    }
    fn written(&mut self) -> Instr<Out> {
        let n = self.rng.below(48) as usize;
        read(n)
    }
    fn received(&mut self, _: &[u8]) -> Instr<Out> {
        if self.left == 0 {
            return Instr::Done(Out::Hostile);
        }
        self.left -= 1;
        write(self.garbage())
    }
    fn tls_done(&mut self, _: [u8; 32]) -> Instr<Out> {
        Instr::Done(Out::Hostile)
    }
    fn cred_bound(&mut self, _: Option<CredInvite>) -> Instr<Out> {
        Instr::Done(Out::Hostile)
    }
    fn transport_failed(&mut self, kind: Transport) -> Failure {
        Failure::Transport {
            what: "hostile",
            kind,
            unanswered: false,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Core(VersionRange),
    Legacy(u16),
    Hostile,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    None,
    /// Both directions closed at this step.
    Cut(u64),
    /// Side 0 (initiator) or 1 stopped from a step for this long.
    Stall(usize, u64, u64),
    /// A byte of direction 0 (to the target) or 1, at this offset, xored.
    Flip(usize, usize, u8),
    /// FLAG_EXT cleared in the initiator's hello.
    StripExt,
    /// TLS runs through a man in the middle: other exporters each side.
    MitmTls,
}

#[derive(Clone, Copy, Debug)]
struct Cfg {
    kinds: [Kind; 2],
    secrets: [Option<&'static str>; 2],
    tls: [Option<TlsSettings>; 2],
    same_host: [bool; 2],
    /// The two sides' host keys are the same (one host).
    one_host: bool,
    table: usize,
    capacity: usize,
    fault: Fault,
}

fn draw(rng: &mut Rng) -> Cfg {
    let core = |r: &mut Rng| {
        Kind::Core(match r.below(8) {
            0 => NEWER,
            1 => FUTURE,
            _ => OLD,
        })
    };
    let mut kinds = [core(rng), core(rng)];
    match rng.below(10) {
        0 => kinds[1] = Kind::Legacy(3 + rng.below(3) as u16),
        1 => kinds[0] = Kind::Legacy(3 + rng.below(3) as u16),
        2 => kinds[rng.below(2) as usize] = Kind::Hostile,
        _ => {}
    }
    let secret = |r: &mut Rng| match r.below(6) {
        0 => None,
        1 => Some("other"),
        _ => Some("s3cret"),
    };
    let tls = |r: &mut Rng| match r.below(4) {
        0 | 1 => None,
        k => Some(TlsSettings {
            required: k == 3,
            identity: if r.chance(80) {
                TlsIdentity::Secret
            } else {
                TlsIdentity::Certificates
            },
        }),
    };
    let fault = match rng.below(12) {
        0 => Fault::Cut(rng.below(40)),
        1 => Fault::Stall(
            rng.below(2) as usize,
            rng.below(30),
            if rng.chance(50) {
                TIMEOUT * 2
            } else {
                TIMEOUT / 4
            },
        ),
        2 => Fault::Flip(
            rng.below(2) as usize,
            rng.below(160) as usize,
            1 << rng.below(8),
        ),
        3 => Fault::StripExt,
        4 => Fault::MitmTls,
        _ => Fault::None,
    };
    Cfg {
        kinds,
        secrets: if rng.chance(60) {
            let s = secret(rng);
            [s, s]
        } else {
            [secret(rng), secret(rng)]
        },
        tls: [tls(rng), tls(rng)],
        same_host: [rng.chance(70), rng.chance(70)],
        one_host: rng.chance(60),
        table: rng.below(4) as usize,
        // Socket buffers hold a handshake's messages; the pieces moved
        // per step (1 to 64 bytes) make the reads and writes partial.
        capacity: 1024 + rng.below(3072) as usize,
        fault,
    }
}

fn settings(cfg: &Cfg, side: usize, range: VersionRange) -> Settings<'static> {
    let features = our_features(
        FeatureSettings {
            same_host_on: cfg.same_host[side],
            tls_on: cfg.tls[side].is_some(),
            unix: true,
            stage: true,
            grant: true,
        },
        side == 0,
    );
    let keys = host_keys();
    let key = if cfg.one_host { &keys[0] } else { &keys[side] };
    Settings {
        name: if side == 0 { "initiator" } else { "target" },
        peer: if side == 0 {
            "target:7000"
        } else {
            "10.0.0.1:5000"
        },
        secret: cfg.secrets[side],
        features,
        host_key: Some(key),
        tls: cfg.tls[side],
        versions: range,
    }
}

fn make(cfg: &Cfg, side: usize, hello_version: u16, rng: &mut Rng) -> Box<dyn Peer> {
    let mut nonce = [0u8; 32];
    nonce.iter_mut().for_each(|b| *b = rng.next() as u8);
    match cfg.kinds[side] {
        Kind::Core(range) if side == 0 => Box::new(Core(
            handshake::Initiator::new(settings(cfg, 0, range), hello_version, nonce),
            |o| match o {
                ClientOutcome::Welcome(w) => Out::Welcome(w),
                ClientOutcome::Redial(v) => Out::Redial(v),
            },
        )),
        Kind::Core(range) => Box::new(Core(
            handshake::Target::new(settings(cfg, 1, range), nonce),
            Out::Verified,
        )),
        Kind::Legacy(v) if side == 0 => Box::new(LegacyInitiator {
            v,
            secret: cfg.secrets[0],
            nc: nonce,
            ns: [0; 32],
            fixed: [0; HELLO_FIXED],
            step: 0,
        }),
        Kind::Legacy(v) => Box::new(LegacyTarget {
            v,
            secret: cfg.secrets[1],
            ns: nonce,
            nc: [0; 32],
            fixed: [0; HELLO_FIXED],
            step: 0,
            refused: None,
        }),
        Kind::Hostile => Box::new(Hostile {
            rng: Rng(rng.next()),
            left: rng.below(4) as u32,
        }),
    }
}

/// One direction of a connection: bounded like a socket buffer.
#[derive(Default)]
struct Pipe {
    q: VecDeque<u8>,
    /// Bytes that went into it so far (offsets for faults).
    sent: usize,
    /// The writer closed it (or the connection was cut).
    closed: bool,
    /// The reader is gone.
    gone: bool,
}

const TLS_MARKER: &[u8; 8] = b"SIMTLS13";

enum Op {
    Write {
        bytes: Vec<u8>,
        done: usize,
        best_effort: bool,
        /// The TLS stand-in's marker (then its read).
        tls: bool,
    },
    Read {
        buf: Vec<u8>,
        got: usize,
        best_effort: bool,
        tls: bool,
    },
    /// Target core done: the WELCOME the engine sends, then finished.
    Welcome {
        bytes: Vec<u8>,
        done: usize,
        verified: Option<Verified>,
    },
    Finished(Out),
}

struct Side {
    peer: Box<dyn Peer>,
    op: Op,
    last: u64,
}

struct World {
    cfg: Cfg,
    rng: Rng,
    now: u64,
    step: u64,
    /// 0: initiator → target, 1: target → initiator.
    pipes: [Pipe; 2],
    sides: [Side; 2],
    exporters: [[u8; 32]; 2],
    table: Vec<TableEntry>,
    /// When the stalled side stopped (`Fault::Stall`).
    stall_start: Option<u64>,
}

impl World {
    fn instr(&mut self, s: usize, i: Instr<Out>) {
        let op = match i {
            Instr::Write {
                bytes, best_effort, ..
            } => {
                assert!(bytes.len() <= MAX_WRITE, "a write of {} bytes", bytes.len());
                Op::Write {
                    bytes,
                    done: 0,
                    best_effort,
                    tls: false,
                }
            }
            Instr::Read {
                len, best_effort, ..
            } => {
                assert!(len <= MAX_READ, "a read of {len} bytes asked for");
                Op::Read {
                    buf: vec![0; len],
                    got: 0,
                    best_effort,
                    tls: false,
                }
            }
            Instr::Tls { client } => {
                assert_eq!(client, s == 0, "only the initiator is the TLS client");
                Op::Write {
                    bytes: TLS_MARKER.to_vec(),
                    done: 0,
                    best_effort: false,
                    tls: true,
                }
            }
            Instr::BindCred => {
                assert_eq!(s, 1, "only a target binds a credential socket");
                let invite = self.rng.chance(80).then(|| CredInvite {
                    token: [7; 16],
                    name: b"ferry-cred-sim".to_vec(),
                });
                let next = self.sides[s].peer.cred_bound(invite);
                return self.instr(s, next);
            }
            Instr::Done(Out::Verified(v)) => {
                let mut bytes = vec![WELCOME];
                bytes.extend_from_slice(&v.proof);
                bytes.extend_from_slice(&1000u32.to_le_bytes());
                bytes.extend_from_slice(&(self.table.len() as u32).to_le_bytes());
                bytes.extend(encode_table(&self.table));
                Op::Welcome {
                    bytes,
                    done: 0,
                    verified: Some(v),
                }
            }
            Instr::Done(o) => Op::Finished(o),
            Instr::Fail(f) => Op::Finished(Out::Failed(f)),
        };
        self.set(s, op);
    }

    fn set(&mut self, s: usize, op: Op) {
        if matches!(op, Op::Finished(_)) {
            // Closing: the peer reads an end, its writes fail.
            self.pipes[s].closed = true;
            self.pipes[1 - s].gone = true;
        }
        self.sides[s].op = op;
        self.sides[s].last = self.now;
    }

    fn fail_transport(&mut self, s: usize, kind: Transport) {
        let f = self.sides[s].peer.transport_failed(kind);
        assert!(
            matches!(f, Failure::Transport { .. }),
            "a transport failure reads as {f:?}"
        );
        self.set(s, Op::Finished(Out::Failed(f)));
    }

    /// The driver's stall timer fired: a best-effort step ends as if
    /// done, any other fails the handshake.
    fn timed_out(&mut self, s: usize) {
        let op = std::mem::replace(&mut self.sides[s].op, Op::Finished(Out::Hostile));
        let next = match op {
            Op::Write {
                best_effort: true, ..
            } => self.sides[s].peer.written(),
            Op::Read {
                buf,
                best_effort: true,
                ..
            } => self.sides[s].peer.received(&buf),
            Op::Welcome { verified, .. } => {
                let v = verified.unwrap_or_else(|| unreachable!());
                return self.set(s, Op::Finished(Out::Verified(v)));
            }
            _ => return self.fail_transport(s, Transport::TimedOut),
        };
        self.instr(s, next);
    }

    fn stalled(&self, s: usize) -> bool {
        match self.cfg.fault {
            Fault::Stall(side, from, ms) => {
                side == s && self.step >= from && {
                    // Stopped for `ms` from the time of step `from`.
                    self.now < self.stall_start.unwrap_or(u64::MAX).saturating_add(ms)
                }
            }
            _ => false,
        }
    }

    /// Moves some bytes of side `s`'s operation.
    fn act(&mut self, s: usize) {
        let cap = self.cfg.capacity;
        let piece = 1 + self.rng.below(64) as usize;
        let op = std::mem::replace(&mut self.sides[s].op, Op::Finished(Out::Hostile));
        let op = match op {
            Op::Write {
                bytes,
                mut done,
                best_effort,
                tls,
            } => {
                let pipe = &mut self.pipes[s];
                if pipe.gone && !pipe.closed {
                    // The reader left: like a socket's buffer, the bytes
                    // are taken (and never read).
                    done = bytes.len();
                }
                if pipe.closed {
                    if best_effort {
                        self.sides[s].op = Op::Finished(Out::Hostile);
                        let next = self.sides[s].peer.written();
                        return self.instr(s, next);
                    }
                    self.sides[s].op = Op::Finished(Out::Hostile);
                    return self.fail_transport(s, Transport::Closed);
                }
                let room = cap.saturating_sub(pipe.q.len());
                let n = piece.min(room).min(bytes.len() - done);
                for &b in &bytes[done..done + n] {
                    let mut b = b;
                    match self.cfg.fault {
                        Fault::Flip(d, at, x) if d == s && at == pipe.sent => b ^= x,
                        Fault::StripExt if s == 0 && pipe.sent == 6 => b &= !2,
                        _ => {}
                    }
                    pipe.q.push_back(b);
                    pipe.sent += 1;
                }
                done += n;
                if n > 0 {
                    self.sides[s].last = self.now;
                }
                if done == bytes.len() {
                    self.sides[s].last = self.now;
                    if tls {
                        Op::Read {
                            buf: vec![0; TLS_MARKER.len()],
                            got: 0,
                            best_effort: false,
                            tls: true,
                        }
                    } else {
                        self.sides[s].op = Op::Finished(Out::Hostile);
                        let next = self.sides[s].peer.written();
                        return self.instr(s, next);
                    }
                } else {
                    Op::Write {
                        bytes,
                        done,
                        best_effort,
                        tls,
                    }
                }
            }
            Op::Read {
                mut buf,
                mut got,
                best_effort,
                tls,
            } => {
                let pipe = &mut self.pipes[1 - s];
                let n = piece.min(pipe.q.len()).min(buf.len() - got);
                for b in &mut buf[got..got + n] {
                    *b = pipe.q.pop_front().unwrap_or(0);
                }
                got += n;
                if n > 0 {
                    self.sides[s].last = self.now;
                }
                if got == buf.len() {
                    self.sides[s].last = self.now;
                    self.sides[s].op = Op::Finished(Out::Hostile);
                    let next = if tls {
                        if buf != TLS_MARKER {
                            return self.set(s, Op::Finished(Out::TlsFailed));
                        }
                        self.sides[s].peer.tls_done(self.exporters[s])
                    } else {
                        self.sides[s].peer.received(&buf)
                    };
                    return self.instr(s, next);
                }
                if pipe.q.is_empty() && pipe.closed {
                    self.sides[s].op = Op::Finished(Out::Hostile);
                    if best_effort {
                        let next = self.sides[s].peer.received(&buf);
                        return self.instr(s, next);
                    }
                    return self.fail_transport(s, Transport::Closed);
                }
                Op::Read {
                    buf,
                    got,
                    best_effort,
                    tls,
                }
            }
            Op::Welcome {
                bytes,
                mut done,
                verified,
            } => {
                let pipe = &mut self.pipes[s];
                if pipe.closed || pipe.gone {
                    // The initiator gave up: the target's handshake is
                    // done all the same (the engine's welcome failed).
                    return self.set(
                        s,
                        Op::Finished(Out::Verified(verified.unwrap_or_else(|| unreachable!()))),
                    );
                }
                let room = cap.saturating_sub(pipe.q.len());
                let n = piece.min(room).min(bytes.len() - done);
                for &b in &bytes[done..done + n] {
                    let b = match self.cfg.fault {
                        Fault::Flip(1, at, x) if at == pipe.sent => b ^ x,
                        _ => b,
                    };
                    pipe.q.push_back(b);
                    pipe.sent += 1;
                }
                done += n;
                if n > 0 {
                    self.sides[s].last = self.now;
                }
                if done == bytes.len() {
                    return self.set(
                        s,
                        Op::Finished(Out::Verified(verified.unwrap_or_else(|| unreachable!()))),
                    );
                }
                Op::Welcome {
                    bytes,
                    done,
                    verified,
                }
            }
            done @ Op::Finished(_) => done,
        };
        self.sides[s].op = op;
    }
}

impl World {
    fn finished(&self, s: usize) -> bool {
        matches!(self.sides[s].op, Op::Finished(_))
    }
}

/// Runs one connection; returns both outcomes and the bytes left unread
/// in each direction.
fn connect(
    cfg: &Cfg,
    rng: &mut Rng,
    hello_version: u16,
    steps: &mut u64,
) -> ([Out; 2], [usize; 2]) {
    let mut exporter = [0u8; 32];
    exporter.iter_mut().for_each(|b| *b = rng.next() as u8);
    let mut other = exporter;
    if cfg.fault == Fault::MitmTls {
        other[0] ^= 1;
    }
    let table: Vec<TableEntry> = (0..cfg.table)
        .map(|i| TableEntry {
            addr: 0x10_0000 * (i as u64 + 1),
            len: 4096,
            gen: i as u32 + 1,
        })
        .collect();
    let sides = [
        Side {
            peer: make(cfg, 0, hello_version, rng),
            op: Op::Finished(Out::Hostile),
            last: 0,
        },
        Side {
            peer: make(cfg, 1, hello_version, rng),
            op: Op::Finished(Out::Hostile),
            last: 0,
        },
    ];
    let mut w = World {
        cfg: *cfg,
        rng: Rng(rng.next()),
        now: 0,
        step: 0,
        pipes: [Pipe::default(), Pipe::default()],
        sides,
        exporters: [exporter, other],
        table,
        stall_start: None,
    };
    for s in 0..2 {
        let first = w.sides[s].peer.start();
        w.instr(s, first);
    }
    while !(w.finished(0) && w.finished(1)) {
        w.step += 1;
        *steps += 1;
        assert!(w.step < MAX_STEPS, "still running after {MAX_STEPS} steps");
        if let Fault::Stall(_, from, _) = w.cfg.fault {
            if w.step >= from && w.stall_start.is_none() {
                w.stall_start = Some(w.now);
            }
        }
        if w.cfg.fault == Fault::Cut(w.step) {
            for p in &mut w.pipes {
                p.closed = true;
                p.gone = true;
            }
        }
        // Time: small steps, now and then a jump.
        w.now += if w.rng.chance(1) { 200 } else { w.rng.below(3) };
        // Timeouts (the drivers' stall timers).
        for s in 0..2 {
            if !w.finished(s) && !w.stalled(s) && w.now - w.sides[s].last > TIMEOUT {
                w.timed_out(s);
            }
        }
        let s = w.rng.below(2) as usize;
        if !w.finished(s) && !w.stalled(s) {
            w.act(s);
        }
    }
    let left = [w.pipes[0].q.len(), w.pipes[1].q.len()];
    let outs = w.sides.map(|side| match side.op {
        Op::Finished(o) => o,
        _ => unreachable!(),
    });
    (outs, left)
}

/// What PROTOCOL.md §1 says a fault-free handshake between these two ends
/// with.
#[derive(Debug, PartialEq, Eq)]
enum Expect {
    /// Both connect (the initiator possibly after a redial).
    Both,
    /// The initiator fails with this kind; the target fails too (any way).
    InitiatorFails(&'static str),
    /// The target fails with this kind and the initiator too (any way).
    TargetFails(&'static str),
    /// The target verified the initiator; the initiator refuses the target.
    InitiatorRefuses(&'static str),
}

fn expect(cfg: &Cfg) -> Option<Expect> {
    use Expect::*;
    let [i, t] = cfg.kinds;
    let (ti, tt) = (cfg.tls[0], cfg.tls[1]);
    // The version, and the TLS decision, as the two sides decide it.
    match (i, t) {
        (Kind::Core(ri), Kind::Core(rt)) => {
            if ri.highest_common(rt).is_none() {
                return Some(TargetFails("Protocol"));
            }
            match (ti, tt) {
                (Some(a), Some(b)) if a.identity != b.identity => {
                    return Some(TargetFails("Authentication"))
                }
                (Some(a), None) if a.required => return Some(InitiatorFails("Authentication")),
                (None, Some(b)) if b.required => return Some(TargetFails("Authentication")),
                _ => {}
            }
        }
        (Kind::Core(ri), Kind::Legacy(v)) => {
            if ti.is_some_and(|t| t.required) {
                return Some(InitiatorFails("Authentication"));
            }
            if !(ri.contains(v) && v <= 5) {
                return Some(InitiatorFails("Protocol"));
            }
        }
        (Kind::Legacy(v), Kind::Core(rt)) => {
            if !(rt.contains(v) && v <= 5) {
                return Some(TargetFails("Protocol"));
            }
            if tt.is_some_and(|t| t.required) {
                return Some(TargetFails("Authentication"));
            }
        }
        _ => return None,
    }
    Some(match cfg.secrets {
        [a, Some(b)] if a != Some(b) => TargetFails("Authentication"),
        [Some(_), None] => InitiatorRefuses("Authentication"),
        _ => Both,
    })
}

/// Whether a fault-free handshake of this pair would run TLS.
fn uses_tls(cfg: &Cfg) -> bool {
    match (cfg.kinds, cfg.tls) {
        ([Kind::Core(ri), Kind::Core(rt)], [Some(a), Some(b)]) => {
            ri.highest_common(rt).is_some() && a.identity == b.identity
        }
        _ => false,
    }
}

fn kind_of(o: &Out) -> &'static str {
    match o {
        Out::Failed(Failure::Protocol { .. }) => "Protocol",
        Out::Failed(Failure::Authentication { .. }) => "Authentication",
        Out::Failed(Failure::Rejected {
            status: Some(Status::AuthFailed),
            ..
        }) => "Authentication",
        Out::Failed(Failure::Rejected {
            status: Some(Status::BadVersion),
            ..
        }) => "Protocol",
        Out::Failed(Failure::Transport { .. }) => "Transport",
        Out::Failed(_) => "Failed",
        Out::TlsFailed => "TlsFailed",
        _ => "Ok",
    }
}

fn ok(o: &Out) -> bool {
    matches!(o, Out::Welcome(_) | Out::Verified(_) | Out::LegacyOk)
}

/// What the seeds ran into, for the summary line.
static STATS: [AtomicU64; 8] = [const { AtomicU64::new(0) }; 8];
const STAT_NAMES: [&str; 8] = [
    "both connected",
    "of them under TLS",
    "redialed",
    "Protocol",
    "Authentication",
    "Transport",
    "timed out",
    "foreign or not Ferry",
];

fn count(o: &Out) {
    let add = |i: usize| {
        STATS[i].fetch_add(1, Ordering::Relaxed);
    };
    match o {
        Out::Failed(Failure::Transport {
            kind: Transport::TimedOut,
            ..
        }) => {
            add(5);
            add(6);
        }
        Out::Failed(Failure::NotFerry(_) | Failure::Foreign { .. }) => add(7),
        o => match kind_of(o) {
            "Protocol" => add(3),
            "Authentication" => add(4),
            "Transport" => add(5),
            _ => {}
        },
    }
}

fn run_seed(seed: u64) -> u64 {
    let mut rng = Rng(seed ^ 0x6a09_e667_f3bc_c908);
    let cfg = draw(&mut rng);
    let mut steps = 0;
    let mut hello_version = negotiate::LEGACY_VERSION;
    let (outs, left) = loop {
        let (outs, left) = connect(&cfg, &mut rng, hello_version, &mut steps);
        match outs[0] {
            Out::Redial(v) if v != hello_version => hello_version = v,
            _ => break (outs, left),
        }
    };
    if ok(&outs[0]) && ok(&outs[1]) {
        STATS[0].fetch_add(1, Ordering::Relaxed);
        if matches!(&outs[0], Out::Welcome(w) if w.agreement.tls.is_some()) {
            STATS[1].fetch_add(1, Ordering::Relaxed);
        }
    }
    if hello_version != negotiate::LEGACY_VERSION {
        STATS[2].fetch_add(1, Ordering::Relaxed);
    }
    outs.iter().for_each(count);
    let ctx = format!(
        "seed {seed}: {cfg:?}\n  initiator: {:?}\n  target: {:?}",
        outs[0], outs[1]
    );
    // Two sides that both succeed agree, when the secret covers what was
    // announced (or nothing was altered).
    if let (Out::Welcome(w), Out::Verified(v)) = (&outs[0], &outs[1]) {
        let shared = cfg.secrets[0].is_some() && cfg.secrets[0] == cfg.secrets[1];
        if cfg.fault == Fault::None || shared {
            let (a, b) = (&w.agreement, &v.agreement);
            assert_eq!(a.version, b.version, "versions differ: {ctx}");
            assert_eq!(
                a.tls.is_some(),
                b.tls.is_some(),
                "TLS on one side only: {ctx}"
            );
            assert_eq!(
                a.theirs, b.ours,
                "the initiator's view of the target: {ctx}"
            );
            assert_eq!(
                a.ours, b.theirs,
                "the target's view of the initiator: {ctx}"
            );
            assert_eq!(a.same_host_token, b.same_host_token, "same host: {ctx}");
            if cfg.fault == Fault::None {
                let both_on = cfg.same_host[0] && cfg.same_host[1];
                assert_eq!(a.same_host_token, both_on.then_some(cfg.one_host), "{ctx}");
            }
        }
    }
    if cfg.fault == Fault::StripExt {
        if let (Kind::Core(_), Kind::Core(_)) = (cfg.kinds[0], cfg.kinds[1]) {
            assert!(
                !ok(&outs[0]),
                "a stripped negotiation flag went unnoticed: {ctx}"
            );
        }
    }
    if cfg.fault == Fault::MitmTls && cfg.secrets[0].is_some() && cfg.secrets[0] == cfg.secrets[1] {
        if let Out::Welcome(w) = &outs[0] {
            assert!(
                w.agreement.tls.is_none(),
                "a proof crossed two TLS sessions: {ctx}"
            );
        }
    }
    let faultless = cfg.fault == Fault::None || (cfg.fault == Fault::MitmTls && !uses_tls(&cfg));
    if cfg.fault == Fault::MitmTls && uses_tls(&cfg) && expect(&cfg) == Some(Expect::Both) {
        // Each side's proof was made on its own TLS session: refused.
        let shared = cfg.secrets[0].is_some();
        assert!(
            !shared || kind_of(&outs[1]) == "Authentication",
            "target: {ctx}"
        );
        assert!(
            !shared || kind_of(&outs[0]) == "Authentication",
            "initiator: {ctx}"
        );
    }
    if let (true, Some(e)) = (faultless, expect(&cfg)) {
        let (ki, kt) = (kind_of(&outs[0]), kind_of(&outs[1]));
        match e {
            Expect::Both => {
                assert!(
                    ok(&outs[0]) && ok(&outs[1]),
                    "expected both to connect: {ctx}"
                );
                assert_eq!(left, [0, 0], "bytes left unread: {ctx}");
                if let Out::Welcome(w) = &outs[0] {
                    if matches!(outs[1], Out::Verified(_)) {
                        assert_eq!(w.table.len(), cfg.table, "{ctx}");
                    }
                }
            }
            Expect::InitiatorFails(k) => {
                assert_eq!(ki, k, "initiator: {ctx}");
                assert!(!ok(&outs[1]), "the target connected: {ctx}");
            }
            Expect::TargetFails(k) => {
                assert_eq!(kt, k, "target: {ctx}");
                assert!(!ok(&outs[0]), "the initiator connected: {ctx}");
                if let Kind::Core(_) = cfg.kinds[0] {
                    assert_eq!(ki, k, "initiator (a REJECT of that kind): {ctx}");
                }
            }
            Expect::InitiatorRefuses(k) => {
                assert!(ok(&outs[1]), "target: {ctx}");
                if let Kind::Core(_) = cfg.kinds[0] {
                    assert_eq!(ki, k, "initiator: {ctx}");
                } else {
                    assert!(!ok(&outs[0]), "initiator: {ctx}");
                }
            }
        }
    }
    steps
}

fn mutant() -> Option<&'static str> {
    if cfg!(ferry_mutant = "downgrade_unchecked") {
        Some("downgrade_unchecked")
    } else if cfg!(ferry_mutant = "proof_unbound_from_tls") {
        Some("proof_unbound_from_tls")
    } else {
        None
    }
}

#[test]
fn handshake_cores_agree_or_fail_typed_under_faults() {
    let steps = common::run_seeds(
        "handshake",
        "sim_handshake",
        DEFAULT_SEEDS,
        mutant(),
        run_seed,
    );
    if steps > 0 {
        let stats: Vec<String> = STAT_NAMES
            .iter()
            .zip(&STATS)
            .map(|(n, v)| format!("{n} {}", v.load(Ordering::Relaxed)))
            .collect();
        eprintln!("sim handshake (sides): {}", stats.join(", "));
    }
}
