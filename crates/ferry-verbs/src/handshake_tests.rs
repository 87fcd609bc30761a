//! The handshake over in-memory streams: new against new, new against a
//! side capped at protocol 3, and new against the exact frames of protocol
//! 3 as 7c3e5e6 encodes and decodes them (`v3_reference`).

use super::*;
use crate::negotiate::{FeatureState, PeerProtocol, VersionRange};
use crate::wire::NONCE_LEN;
use ferry_core::raw::auth::{nonce, proof, verify};
use tokio::io::{duplex, AsyncReadExt, AsyncWriteExt, DuplexStream};

/// A faithful copy of the frame layout and decoding logic of protocol 3 as
/// 7c3e5e6 has it (`git show 7c3e5e6:crates/ferry-verbs/src/wire.rs`):
/// what a build of that commit accepts and sends. Kept here, unchanged, so
/// that a change to `crate::wire` cannot silently change what a v3 peer is
/// sent.
mod v3_reference {
    pub const VERSION: u16 = 3;
    pub const HANDSHAKE_MAX_FRAME: u32 = 4096;
    pub const INITIATOR_LABEL: &[u8] = b"ferry-verbs/2 initiator";
    pub const TARGET_LABEL: &[u8] = b"ferry-verbs/2 target";

    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct RemoteRegion {
        pub addr: u64,
        pub len: u64,
        pub rkey: u32,
    }

    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct QpEndpoint {
        pub qpn: u32,
        pub psn: u32,
        pub lid: u16,
        pub gid: [u8; 16],
        pub mtu: u8,
    }

    #[derive(Clone, Debug, PartialEq, Eq)]
    pub enum Msg {
        Auth {
            version: u16,
            secret: bool,
            nonce: [u8; 32],
        },
        Challenge {
            secret: bool,
            nonce: [u8; 32],
        },
        Proof {
            mac: [u8; 32],
        },
        Hello {
            version: u16,
            endpoint: QpEndpoint,
            name: String,
        },
        Welcome {
            endpoint: QpEndpoint,
            regions: Vec<RemoteRegion>,
        },
        Refused {
            reason: String,
        },
        TableRequest,
        Table {
            regions: Vec<RemoteRegion>,
        },
        RegionAdded(RemoteRegion),
        RegionRemoved {
            addr: u64,
        },
        Notify {
            full: bool,
            reason: String,
        },
        NotifyAck,
    }

    const HELLO: u8 = 1;
    const WELCOME: u8 = 2;
    const REFUSED: u8 = 3;
    const TABLE_REQUEST: u8 = 4;
    const TABLE: u8 = 5;
    const REGION_ADDED: u8 = 6;
    const REGION_REMOVED: u8 = 7;
    const NOTIFY: u8 = 8;
    const NOTIFY_ACK: u8 = 9;
    const AUTH: u8 = 10;
    const CHALLENGE: u8 = 11;
    const PROOF: u8 = 12;

    fn put_endpoint(out: &mut Vec<u8>, e: &QpEndpoint) {
        out.extend_from_slice(&e.qpn.to_be_bytes());
        out.extend_from_slice(&e.psn.to_be_bytes());
        out.extend_from_slice(&e.lid.to_be_bytes());
        out.extend_from_slice(&e.gid);
        out.push(e.mtu);
    }

    fn put_str(out: &mut Vec<u8>, s: &str) {
        out.extend_from_slice(&(s.len() as u32).to_be_bytes());
        out.extend_from_slice(s.as_bytes());
    }

    fn put_regions(out: &mut Vec<u8>, rs: &[RemoteRegion]) {
        out.extend_from_slice(&(rs.len() as u32).to_be_bytes());
        for r in rs {
            out.extend_from_slice(&r.addr.to_be_bytes());
            out.extend_from_slice(&r.len.to_be_bytes());
            out.extend_from_slice(&r.rkey.to_be_bytes());
        }
    }

    /// 7c3e5e6's `Msg::encode` for the frames of the handshake.
    pub fn encode(m: &Msg) -> Vec<u8> {
        let mut out = Vec::new();
        match m {
            Msg::Hello {
                version,
                endpoint,
                name,
            } => {
                out.push(HELLO);
                out.extend_from_slice(&version.to_be_bytes());
                put_endpoint(&mut out, endpoint);
                put_str(&mut out, name);
            }
            Msg::Welcome { endpoint, regions } => {
                out.push(WELCOME);
                put_endpoint(&mut out, endpoint);
                put_regions(&mut out, regions);
            }
            Msg::Refused { reason } => {
                out.push(REFUSED);
                put_str(&mut out, reason);
            }
            Msg::Auth {
                version,
                secret,
                nonce,
            } => {
                out.push(AUTH);
                out.extend_from_slice(&version.to_be_bytes());
                out.push(u8::from(*secret));
                out.extend_from_slice(nonce);
            }
            Msg::Challenge { secret, nonce } => {
                out.push(CHALLENGE);
                out.push(u8::from(*secret));
                out.extend_from_slice(nonce);
            }
            Msg::Proof { mac } => {
                out.push(PROOF);
                out.extend_from_slice(mac);
            }
            other => panic!("not a handshake frame: {other:?}"),
        }
        out
    }

    /// 7c3e5e6's `Msg::decode`, unchanged but for the error type.
    pub fn decode(buf: &[u8]) -> Result<Msg, String> {
        let mut r = Reader { buf, pos: 0 };
        let msg = match r.u8()? {
            HELLO => Msg::Hello {
                version: r.u16()?,
                endpoint: r.endpoint()?,
                name: r.string()?,
            },
            WELCOME => Msg::Welcome {
                endpoint: r.endpoint()?,
                regions: r.regions()?,
            },
            REFUSED => Msg::Refused {
                reason: r.string()?,
            },
            TABLE_REQUEST => Msg::TableRequest,
            TABLE => Msg::Table {
                regions: r.regions()?,
            },
            REGION_ADDED => Msg::RegionAdded(r.region()?),
            REGION_REMOVED => Msg::RegionRemoved { addr: r.u64()? },
            NOTIFY => Msg::Notify {
                full: r.flag()?,
                reason: r.string()?,
            },
            NOTIFY_ACK => Msg::NotifyAck,
            AUTH => Msg::Auth {
                version: r.u16()?,
                secret: r.flag()?,
                nonce: r.array()?,
            },
            CHALLENGE => Msg::Challenge {
                secret: r.flag()?,
                nonce: r.array()?,
            },
            PROOF => Msg::Proof { mac: r.array()? },
            k => return Err(format!("unknown frame kind {k}")),
        };
        if r.pos != buf.len() {
            return Err(format!(
                "{} trailing bytes after a frame",
                buf.len() - r.pos
            ));
        }
        Ok(msg)
    }

    struct Reader<'a> {
        buf: &'a [u8],
        pos: usize,
    }

    impl Reader<'_> {
        fn take(&mut self, n: usize) -> Result<&[u8], String> {
            let end = self
                .pos
                .checked_add(n)
                .filter(|e| *e <= self.buf.len())
                .ok_or_else(|| format!("frame truncated at byte {}", self.pos))?;
            let s = &self.buf[self.pos..end];
            self.pos = end;
            Ok(s)
        }
        fn array<const N: usize>(&mut self) -> Result<[u8; N], String> {
            let mut a = [0u8; N];
            a.copy_from_slice(self.take(N)?);
            Ok(a)
        }
        fn u8(&mut self) -> Result<u8, String> {
            Ok(self.array::<1>()?[0])
        }
        fn flag(&mut self) -> Result<bool, String> {
            match self.u8()? {
                0 => Ok(false),
                1 => Ok(true),
                b => Err(format!("flag byte {b} is neither 0 nor 1")),
            }
        }
        fn u16(&mut self) -> Result<u16, String> {
            Ok(u16::from_be_bytes(self.array()?))
        }
        fn u32(&mut self) -> Result<u32, String> {
            Ok(u32::from_be_bytes(self.array()?))
        }
        fn u64(&mut self) -> Result<u64, String> {
            Ok(u64::from_be_bytes(self.array()?))
        }
        fn string(&mut self) -> Result<String, String> {
            let n = self.u32()? as usize;
            let bytes = self.take(n)?.to_vec();
            String::from_utf8(bytes).map_err(|_| "a string is not UTF-8".to_owned())
        }
        fn endpoint(&mut self) -> Result<QpEndpoint, String> {
            Ok(QpEndpoint {
                qpn: self.u32()?,
                psn: self.u32()?,
                lid: self.u16()?,
                gid: self.array()?,
                mtu: self.u8()?,
            })
        }
        fn region(&mut self) -> Result<RemoteRegion, String> {
            Ok(RemoteRegion {
                addr: self.u64()?,
                len: self.u64()?,
                rkey: self.u32()?,
            })
        }
        fn regions(&mut self) -> Result<Vec<RemoteRegion>, String> {
            let n = self.u32()? as usize;
            if n.saturating_mul(20) > self.buf.len() - self.pos {
                return Err(format!("region count {n} exceeds the frame"));
            }
            (0..n).map(|_| self.region()).collect()
        }
    }

    /// 7c3e5e6's `write_msg`: `u32` length, payload.
    pub fn frame(payload: &[u8]) -> Vec<u8> {
        let mut f = (payload.len() as u32).to_be_bytes().to_vec();
        f.extend_from_slice(payload);
        f
    }
}

use v3_reference as v3;

const EP_OPENER: QpEndpoint = QpEndpoint {
    qpn: 0x0102_0304,
    psn: 0x00ab_cdef,
    lid: 0x0007,
    gid: [0xfe; 16],
    mtu: 3,
};
const EP_OWNER: QpEndpoint = QpEndpoint {
    qpn: 0x0a0b_0c0d,
    psn: 0x0012_3456,
    lid: 0x0009,
    gid: [0x20; 16],
    mtu: 5,
};

fn v3_ep(e: QpEndpoint) -> v3::QpEndpoint {
    v3::QpEndpoint {
        qpn: e.qpn,
        psn: e.psn,
        lid: e.lid,
        gid: e.gid,
        mtu: e.mtu,
    }
}

fn regions() -> Vec<RemoteRegion> {
    vec![RemoteRegion {
        addr: 0x7f00_0000_1000,
        len: 1 << 20,
        rkey: 0x1234,
    }]
}

/// Reads one frame as a protocol-3 peer does (the v3 decoder).
async fn v3_read(s: &mut DuplexStream) -> v3::Msg {
    let mut len = [0u8; 4];
    s.read_exact(&mut len).await.expect("a frame length");
    let len = u32::from_be_bytes(len);
    assert!(len > 0 && len <= 16 << 20, "frame length {len}");
    let mut buf = vec![0u8; len as usize];
    s.read_exact(&mut buf).await.expect("a frame");
    v3::decode(&buf).unwrap_or_else(|e| panic!("a protocol-3 peer refuses the frame: {e}"))
}

async fn v3_write(s: &mut DuplexStream, m: &v3::Msg) {
    s.write_all(&v3::frame(&v3::encode(m))).await.unwrap();
}

/// The owner's side as `server::serve` runs it: `accept`, then `welcome`.
async fn owner(
    mut s: DuplexStream,
    secret: Option<&'static str>,
    local: Offer,
) -> Result<Option<Agreement>> {
    let Some(inbound) = accept(&mut s, "opener", secret, &local).await? else {
        return Ok(None);
    };
    assert_eq!(inbound.endpoint, EP_OPENER);
    assert_eq!(inbound.name, "opener:1");
    let w = welcome(&inbound.agreement, EP_OWNER, regions());
    wire::write_msg(&mut s, &w).await.unwrap();
    Ok(Some(inbound.agreement))
}

async fn opener(mut s: DuplexStream, secret: Option<&'static str>, local: Offer) -> Result<Opened> {
    let o = open(&mut s, "owner", secret, &local, EP_OPENER, "opener:1").await?;
    assert_eq!(o.endpoint, EP_OWNER);
    assert_eq!(o.regions, regions());
    Ok(o)
}

async fn pair(
    secret: Option<&'static str>,
    opener_offer: Offer,
    owner_offer: Offer,
) -> (Result<Opened>, Result<Option<Agreement>>) {
    let (a, b) = duplex(1 << 16);
    within(async {
        tokio::join!(
            opener(a, secret, opener_offer),
            owner(b, secret, owner_offer)
        )
    })
    .await
}

/// `f`, or a panic after a liveness bound: a handshake that waits for a
/// frame the other side will never send fails instead of hanging.
async fn within<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(std::time::Duration::from_secs(20), f)
        .await
        .expect("the handshake hung (liveness bound)")
}

fn new_build() -> Offer {
    Offer::local(None, &[])
}

fn capped_at_3() -> Offer {
    Offer::local(Some(3), &[])
}

#[tokio::test]
async fn new_and_new_negotiate_the_newest_version_and_every_feature() {
    for secret in [None, Some("s3cret")] {
        let (o, t) = pair(secret, new_build(), new_build()).await;
        let o = o.unwrap();
        let t = t.unwrap().unwrap();
        assert_eq!(o.agreement.version, negotiate::NEWEST);
        assert_eq!(t.version, negotiate::NEWEST);
        assert!(o.agreement.negotiated && t.negotiated);
        assert_eq!(o.agreement.features, FeatureSet::all());
        assert_eq!(t.features, FeatureSet::all());
        let r = PeerProtocol::new("owner", true, &o.agreement);
        assert_eq!(r.remote, VersionRange { min: 3, max: 4 });
        assert!(
            r.features.iter().all(|(_, s)| *s == FeatureState::On),
            "{r}"
        );
    }
}

#[tokio::test]
async fn features_are_the_intersection_on_both_sides() {
    let a = Offer::local(None, &[Feature::Notify]);
    let b = Offer::local(None, &[Feature::TableFetch]);
    let (o, t) = pair(None, a, b).await;
    let (o, t) = (o.unwrap().agreement, t.unwrap().unwrap());
    let want: FeatureSet = [Feature::RegionPush].into_iter().collect();
    assert_eq!(o.features, want);
    assert_eq!(t.features, want);
    let r = PeerProtocol::new("owner", true, &o);
    assert_eq!(
        r.features,
        vec![
            (Feature::Notify, FeatureState::OffHere),
            (Feature::RegionPush, FeatureState::On),
            (Feature::TableFetch, FeatureState::OffPeer),
        ]
    );
}

#[tokio::test]
async fn a_side_capped_at_3_speaks_protocol_3_either_way() {
    for (opener_offer, owner_offer) in [(new_build(), capped_at_3()), (capped_at_3(), new_build())]
    {
        for secret in [None, Some("s")] {
            let (o, t) = pair(secret, opener_offer.clone(), owner_offer.clone()).await;
            let (o, t) = (o.unwrap().agreement, t.unwrap().unwrap());
            assert_eq!((o.version, t.version), (3, 3));
            assert!(!o.negotiated && !t.negotiated);
            assert_eq!(o.features, FeatureSet::all());
            assert_eq!(t.features, FeatureSet::all());
        }
    }
}

/// The exact bytes a 7c3e5e6 opener sends: `Auth` (kind 10, version 3,
/// no secret, its nonce), then `Hello` (kind 1, version 3, queue pair,
/// name), each behind a `u32` length.
#[tokio::test]
async fn a_v3_opener_s_exact_bytes_negotiate_v3() {
    let nonce_o = [0x11u8; 32];
    #[rustfmt::skip]
    let auth: Vec<u8> = [
        &[0, 0, 0, 36][..],          // length
        &[10],                       // AUTH
        &[0, 3],                     // version 3
        &[0],                        // no secret
        &nonce_o,
    ].concat();
    #[rustfmt::skip]
    let hello: Vec<u8> = [
        &[0, 0, 0, 42][..],          // length: 1 + 2 + 27 + 4 + 8
        &[1],                        // HELLO
        &[0, 3],                     // version 3
        &[0x01, 0x02, 0x03, 0x04],   // qpn
        &[0x00, 0xab, 0xcd, 0xef],   // psn
        &[0x00, 0x07],               // lid
        &[0xfe; 16],                 // gid
        &[3],                        // mtu
        &[0, 0, 0, 8], b"opener:1",  // name
    ].concat();
    // The literal bytes are what 7c3e5e6's encoder makes.
    assert_eq!(
        auth,
        v3::frame(&v3::encode(&v3::Msg::Auth {
            version: 3,
            secret: false,
            nonce: nonce_o
        }))
    );
    assert_eq!(
        hello,
        v3::frame(&v3::encode(&v3::Msg::Hello {
            version: 3,
            endpoint: v3_ep(EP_OPENER),
            name: "opener:1".into()
        }))
    );
    let (mut a, b) = duplex(1 << 16);
    let t = tokio::spawn(owner(b, None, new_build()));
    a.write_all(&auth).await.unwrap();
    // The new owner's Challenge is one a v3 opener accepts (its nonce is
    // marked, which a v3 opener does not look at).
    let v3::Msg::Challenge { secret, nonce } = v3_read(&mut a).await else {
        panic!("expected Challenge")
    };
    assert!(!secret);
    assert!(wire::is_marked(&nonce));
    a.write_all(&hello).await.unwrap();
    let w = v3_read(&mut a).await;
    assert_eq!(
        w,
        v3::Msg::Welcome {
            endpoint: v3_ep(EP_OWNER),
            regions: vec![v3::RemoteRegion {
                addr: 0x7f00_0000_1000,
                len: 1 << 20,
                rkey: 0x1234
            }]
        }
    );
    let agreement = within(t).await.unwrap().unwrap().unwrap();
    assert_eq!(agreement.version, 3);
    assert!(!agreement.negotiated);
    assert_eq!(agreement.features, FeatureSet::all());
    let r = PeerProtocol::new("opener", false, &agreement);
    assert_eq!(r.remote, VersionRange { min: 3, max: 3 });
    assert!(
        r.features
            .iter()
            .all(|(_, s)| *s == FeatureState::OnImplied),
        "{r}"
    );
}

/// The same with a shared secret: the v3 opener's proof (7c3e5e6's labels)
/// is accepted and the owner's proof verifies as a v3 opener checks it.
#[tokio::test]
async fn a_v3_opener_with_a_secret_negotiates_v3() {
    let secret = "s3cret";
    let (mut a, b) = duplex(1 << 16);
    let t = tokio::spawn(owner(b, Some(secret), new_build()));
    let no = nonce();
    v3_write(
        &mut a,
        &v3::Msg::Auth {
            version: v3::VERSION,
            secret: true,
            nonce: no,
        },
    )
    .await;
    let v3::Msg::Challenge {
        secret: s,
        nonce: nt,
    } = v3_read(&mut a).await
    else {
        panic!("expected Challenge")
    };
    assert!(s);
    let mac = proof(secret, v3::INITIATOR_LABEL, &no, &nt);
    v3_write(&mut a, &v3::Msg::Proof { mac }).await;
    let v3::Msg::Proof { mac } = v3_read(&mut a).await else {
        panic!("expected Proof")
    };
    assert!(verify(secret, v3::TARGET_LABEL, &no, &nt, &mac));
    v3_write(
        &mut a,
        &v3::Msg::Hello {
            version: 3,
            endpoint: v3_ep(EP_OPENER),
            name: "opener:1".into(),
        },
    )
    .await;
    assert!(matches!(v3_read(&mut a).await, v3::Msg::Welcome { .. }));
    assert_eq!(within(t).await.unwrap().unwrap().unwrap().version, 3);
}

/// A 7c3e5e6 owner, played with the v3 decoder: every frame the new opener
/// sends it is accepted, and the opener settles on protocol 3.
async fn v3_owner(mut b: DuplexStream, secret: Option<&'static str>) -> Vec<v3::Msg> {
    let mut seen = Vec::new();
    let auth = v3_read(&mut b).await;
    let v3::Msg::Auth {
        version,
        secret: theirs,
        nonce: no,
    } = auth.clone()
    else {
        panic!("expected Auth, got {auth:?}")
    };
    // 7c3e5e6's target accepts exactly version 3 here.
    assert_eq!(version, v3::VERSION);
    assert_eq!(theirs, secret.is_some());
    seen.push(auth);
    let nt = nonce();
    v3_write(
        &mut b,
        &v3::Msg::Challenge {
            secret: secret.is_some(),
            nonce: nt,
        },
    )
    .await;
    if let Some(secret) = secret {
        let p = v3_read(&mut b).await;
        let v3::Msg::Proof { mac } = p else {
            panic!("expected Proof, got {p:?}")
        };
        assert!(verify(secret, v3::INITIATOR_LABEL, &no, &nt, &mac));
        v3_write(
            &mut b,
            &v3::Msg::Proof {
                mac: proof(secret, v3::TARGET_LABEL, &no, &nt),
            },
        )
        .await;
    }
    // 7c3e5e6's serve reads the hello with the handshake bound.
    let mut len = [0u8; 4];
    b.read_exact(&mut len).await.unwrap();
    assert!(u32::from_be_bytes(len) <= v3::HANDSHAKE_MAX_FRAME);
    let mut buf = vec![0u8; u32::from_be_bytes(len) as usize];
    b.read_exact(&mut buf).await.unwrap();
    let hello = v3::decode(&buf).expect("a v3 owner accepts the hello");
    let v3::Msg::Hello { version, .. } = hello else {
        panic!("expected Hello, got {hello:?}")
    };
    assert_eq!(version, v3::VERSION);
    seen.push(hello);
    v3_write(
        &mut b,
        &v3::Msg::Welcome {
            endpoint: v3_ep(EP_OWNER),
            regions: vec![v3::RemoteRegion {
                addr: 0x7f00_0000_1000,
                len: 1 << 20,
                rkey: 0x1234,
            }],
        },
    )
    .await;
    seen
}

#[tokio::test]
async fn the_new_opener_sends_a_v3_owner_only_v3_frames() {
    for secret in [None, Some("s3cret")] {
        let (a, b) = duplex(1 << 16);
        let (o, seen) =
            within(async { tokio::join!(opener(a, secret, new_build()), v3_owner(b, secret)) })
                .await;
        let o = o.unwrap();
        assert_eq!(o.agreement.version, 3);
        assert!(!o.agreement.negotiated);
        assert_eq!(o.agreement.features, FeatureSet::all());
        // What the v3 owner decoded: Auth (version 3, marked nonce) and
        // Hello (version 3, this engine's queue pair and name).
        let v3::Msg::Auth { nonce, .. } = &seen[0] else {
            panic!()
        };
        assert!(wire::is_marked(nonce));
        assert_eq!(
            seen[1],
            v3::Msg::Hello {
                version: 3,
                endpoint: v3_ep(EP_OPENER),
                name: "opener:1".into()
            }
        );
        let r = PeerProtocol::new("owner", true, &o.agreement);
        assert!(
            r.to_string()
                .contains("protocol 3 (this engine 3–4, the peer 3: a build without negotiation)"),
            "{r}"
        );
    }
}

/// An owner for tests: answers authentication (no secret) with a marked
/// nonce and returns the stream, ready for the opener's hello.
async fn marked_owner_after_auth(b: &mut DuplexStream) {
    let a = wire::read_msg(b, "o").await.unwrap();
    assert!(matches!(a, Some(Msg::Auth { .. })), "{a:?}");
    wire::write_msg(
        b,
        &Msg::Challenge {
            secret: false,
            nonce: wire::mark(nonce()),
        },
    )
    .await
    .unwrap();
}

/// Sends authentication (no secret, marked) as a negotiating opener.
async fn marked_opener_auth(a: &mut DuplexStream) {
    wire::write_msg(
        a,
        &Msg::Auth {
            version: 3,
            secret: false,
            nonce: wire::mark(nonce()),
        },
    )
    .await
    .unwrap();
    let c = wire::read_msg(a, "t").await.unwrap();
    let Some(Msg::Challenge { nonce, .. }) = c else {
        panic!("expected Challenge, got {c:?}")
    };
    assert!(wire::is_marked(&nonce));
}

#[tokio::test]
async fn disjoint_ranges_are_refused_naming_both_on_both_sides() {
    // A future opener (7–9) at this owner: Incompatible, with the owner's
    // range; the owner's error names both.
    let (mut a, b) = duplex(1 << 16);
    let t = tokio::spawn(owner(b, None, new_build()));
    marked_opener_auth(&mut a).await;
    wire::write_msg(
        &mut a,
        &Msg::Offer {
            versions: VersionRange { min: 7, max: 9 },
            endpoint: EP_OPENER,
            name: "opener:1".into(),
            extensions: vec![],
        },
    )
    .await
    .unwrap();
    match wire::read_msg(&mut a, "t").await.unwrap() {
        Some(Msg::Incompatible { versions, reason }) => {
            assert_eq!(versions, VersionRange { min: 3, max: 4 });
            assert!(
                reason.contains("upgrade the owner to a build that speaks 7"),
                "{reason}"
            );
        }
        other => panic!("expected Incompatible, got {other:?}"),
    }
    match within(t).await.unwrap() {
        Err(Error::Protocol { reason, .. }) => {
            assert!(
                reason.contains("the opener speaks 7–9, the owner speaks 3–4"),
                "{reason}"
            )
        }
        other => panic!("expected a protocol error, got {other:?}"),
    }

    // This opener at a future owner (7–9) that answers Incompatible.
    let (a, mut b) = duplex(1 << 16);
    let o = tokio::spawn(opener(a, None, new_build()));
    marked_owner_after_auth(&mut b).await;
    let offer = wire::read_msg(&mut b, "o").await.unwrap();
    let Some(Msg::Offer {
        versions,
        extensions,
        ..
    }) = offer
    else {
        panic!("expected Offer, got {offer:?}")
    };
    assert_eq!(versions, VersionRange { min: 3, max: 4 });
    assert_eq!(extensions.len(), 3);
    wire::write_msg(
        &mut b,
        &Msg::Incompatible {
            versions: VersionRange { min: 7, max: 9 },
            reason: "too old".into(),
        },
    )
    .await
    .unwrap();
    match within(o).await.unwrap() {
        Err(Error::Protocol { reason, .. }) => {
            assert!(
                reason.contains("the opener speaks 3–4, the owner speaks 7–9"),
                "{reason}"
            );
            assert!(
                reason.contains("upgrade the opener to a build that speaks 7"),
                "{reason}"
            );
        }
        other => panic!("expected a protocol error, got {other:?}"),
    }

    // An opener that only speaks 7+ meeting a protocol-3 owner refuses by
    // itself, sending no hello.
    let (a, b) = duplex(1 << 16);
    let future = Offer {
        versions: VersionRange { min: 7, max: 9 },
        ..new_build()
    };
    let o = tokio::spawn(async move {
        let mut a = a;
        open(&mut a, "owner", None, &future, EP_OPENER, "opener:1").await
    });
    let t = tokio::spawn(async move {
        let mut b = b;
        let _ = v3_read(&mut b).await;
        v3_write(
            &mut b,
            &v3::Msg::Challenge {
                secret: false,
                nonce: nonce(),
            },
        )
        .await;
        let mut rest = Vec::new();
        b.read_to_end(&mut rest).await.unwrap();
        rest
    });
    match within(o).await.unwrap() {
        Err(Error::Protocol { reason, .. }) => {
            assert!(reason.contains("the owner speaks 3;"), "{reason}");
            assert!(reason.contains("upgrade the owner"), "{reason}");
        }
        other => panic!("expected a protocol error, got {other:?}"),
    }
    assert!(
        within(t).await.unwrap().is_empty(),
        "nothing after the challenge"
    );
}

#[tokio::test]
async fn unknown_extensions_are_ignored_and_reported() {
    let (mut a, b) = duplex(1 << 16);
    let t = tokio::spawn(owner(b, None, new_build()));
    marked_opener_auth(&mut a).await;
    wire::write_msg(
        &mut a,
        &Msg::Offer {
            versions: VersionRange { min: 3, max: 6 },
            endpoint: EP_OPENER,
            name: "opener:1".into(),
            extensions: vec![
                Extension {
                    id: 777,
                    body: b"future parameters".to_vec(),
                },
                Extension {
                    id: Feature::Notify.id(),
                    body: vec![],
                },
            ],
        },
    )
    .await
    .unwrap();
    match wire::read_msg(&mut a, "t").await.unwrap() {
        Some(Msg::Agreed {
            versions,
            version,
            extensions,
            endpoint,
            regions: r,
        }) => {
            assert_eq!(versions, VersionRange { min: 3, max: 4 });
            assert_eq!(version, 4);
            // The owner announces its own features; both compute the
            // intersection.
            assert_eq!(extensions.len(), 3);
            assert_eq!(endpoint, EP_OWNER);
            assert_eq!(r, regions());
        }
        other => panic!("expected Agreed, got {other:?}"),
    }
    let agreement = within(t).await.unwrap().unwrap().unwrap();
    assert_eq!(agreement.features, [Feature::Notify].into_iter().collect());
    assert_eq!(agreement.peer.unknown, vec![777]);
    let r = PeerProtocol::new("opener", false, &agreement);
    assert_eq!(r.unknown_extensions, vec![777]);
    assert_eq!(r.remote, VersionRange { min: 3, max: 6 });
}

#[tokio::test]
async fn an_owner_choosing_another_version_is_a_protocol_error() {
    let (a, mut b) = duplex(1 << 16);
    let o = tokio::spawn(opener(a, None, Offer::local(None, &[])));
    marked_owner_after_auth(&mut b).await;
    let _ = wire::read_msg(&mut b, "o").await.unwrap();
    wire::write_msg(
        &mut b,
        &Msg::Agreed {
            versions: VersionRange { min: 3, max: 4 },
            version: 3,
            extensions: vec![],
            endpoint: EP_OWNER,
            regions: regions(),
        },
    )
    .await
    .unwrap();
    match within(o).await.unwrap() {
        Err(Error::Protocol { reason, .. }) => {
            assert!(reason.contains("chose protocol 3"), "{reason}")
        }
        other => panic!("expected a protocol error, got {other:?}"),
    }
}

#[tokio::test]
async fn malformed_or_old_hellos_are_typed_errors() {
    // A malformed Offer (an extension twice): a protocol error, no answer.
    let (mut a, b) = duplex(1 << 16);
    let t = tokio::spawn(owner(b, None, new_build()));
    marked_opener_auth(&mut a).await;
    let bad = Msg::Offer {
        versions: VersionRange { min: 3, max: 4 },
        endpoint: EP_OPENER,
        name: "opener:1".into(),
        extensions: vec![
            Extension {
                id: 1,
                body: vec![],
            },
            Extension {
                id: 1,
                body: vec![],
            },
        ],
    }
    .encode();
    a.write_all(&v3::frame(&bad)).await.unwrap();
    assert!(matches!(
        within(t).await.unwrap(),
        Err(Error::Protocol { .. })
    ));

    // A hello of a version other than 3 (a hypothetical protocol-5 Hello).
    let (mut a, b) = duplex(1 << 16);
    let t = tokio::spawn(owner(b, None, new_build()));
    marked_opener_auth(&mut a).await;
    wire::write_msg(
        &mut a,
        &Msg::Hello {
            version: 5,
            endpoint: EP_OPENER,
            name: "x".into(),
        },
    )
    .await
    .unwrap();
    match wire::read_msg(&mut a, "t").await.unwrap() {
        Some(Msg::Refused { reason }) => {
            assert!(reason.contains("the owner speaks 3–4"), "{reason}")
        }
        other => panic!("expected Refused, got {other:?}"),
    }
    assert!(matches!(
        within(t).await.unwrap(),
        Err(Error::Protocol { .. })
    ));

    // A protocol-2 opener: refused at Auth, naming this range.
    let (mut a, b) = duplex(1 << 16);
    let t = tokio::spawn(owner(b, None, new_build()));
    wire::write_msg(
        &mut a,
        &Msg::Auth {
            version: 2,
            secret: false,
            nonce: [0; NONCE_LEN],
        },
    )
    .await
    .unwrap();
    match wire::read_msg(&mut a, "t").await.unwrap() {
        Some(Msg::Refused { reason }) => {
            assert!(
                reason.contains("version 2 is not supported: this engine speaks 3–4"),
                "{reason}"
            );
            assert!(reason.contains("upgrade the opener"), "{reason}");
        }
        other => panic!("expected Refused, got {other:?}"),
    }
    assert!(matches!(
        within(t).await.unwrap(),
        Err(Error::Protocol { .. })
    ));

    // An owner capped at 3 treats an Offer as protocol 3 does: not a Hello.
    let (mut a, b) = duplex(1 << 16);
    let t = tokio::spawn(owner(b, None, capped_at_3()));
    wire::write_msg(
        &mut a,
        &Msg::Auth {
            version: 3,
            secret: false,
            nonce: wire::mark(nonce()),
        },
    )
    .await
    .unwrap();
    let c = wire::read_msg(&mut a, "t").await.unwrap();
    let Some(Msg::Challenge { nonce, .. }) = c else {
        panic!("{c:?}")
    };
    assert!(!wire::is_marked(&nonce), "a capped owner does not mark");
    wire::write_msg(
        &mut a,
        &Msg::Offer {
            versions: VersionRange { min: 3, max: 4 },
            endpoint: EP_OPENER,
            name: "x".into(),
            extensions: vec![],
        },
    )
    .await
    .unwrap();
    assert!(matches!(
        within(t).await.unwrap(),
        Err(Error::Protocol { .. })
    ));
}
