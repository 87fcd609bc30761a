//! Which generation of Mooncake's TCP wire a peer speaks, read from the
//! segment descriptor it publishes, and whether this engine can talk to it.
//!
//! Mooncake's TCP transport changed where data goes twice, and a build of
//! one generation cannot reach a peer of another: it connects to a port
//! where the peer runs something else (its handshake listener), or to port
//! 0. The library does not notice: the transfer fails, or hangs until the
//! peer's handshake listener gives up on the bytes (60 s), or, for a write,
//! is reported sent. Each generation's segment descriptor has a different
//! shape, so `open_segment` reads the peer's descriptor first (the same way
//! the library will: the P2P handshake's metadata request, or a `GET` from
//! an HTTP metadata server) and refuses a peer of another generation with
//! [`Error::Protocol`] naming both.
//!
//! | generation | data goes to | descriptor (protocol `tcp`) |
//! |---|---|---|
//! | v0.2.x | the RPC port of the peer's metadata entry | no `timestamp` |
//! | v0.3.0–v0.3.4 | RPC port + 1 | `timestamp`, no `tcp_data_port` |
//! | v0.3.5–v0.3.11 | `tcp_data_port` | `tcp_data_port`, no `tcp_proto_version` |
//! | ≥ v0.3.12 | `tcp_data_port`, acknowledged framing | `tcp_proto_version` ≥ 2 |
//!
//! The last two talk to each other (a ≥ v0.3.12 initiator uses the old
//! framing towards a peer without `tcp_proto_version`; a ≥ v0.3.12 target
//! serves old-framing requests). This engine's own generation comes from
//! its symbols (see [`Generation`]), which match these boundaries release
//! by release. A descriptor that cannot be fetched or read (etcd or redis
//! metadata, an unreachable peer, a test library) is no reason to refuse:
//! the library then decides, as before.
//!
//! The P2P metadata request: `u64` length (host order; Ferry builds only
//! for little-endian targets), one type byte (1 = metadata), then JSON (the
//! requester's own descriptor, which the peer ignores). The reply has the
//! same framing; builds whose framing had no type byte start the payload
//! with `{`.

use std::time::Duration;

use ferry_core::{Error, Result};
use http_body_util::{BodyExt, Empty, Limited};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::config::P2P_HANDSHAKE;
use crate::library::Generation;

/// Set to `0` to skip the check (for a development build between releases
/// whose symbols and wire disagree; the library then decides, as before).
pub(crate) const PEER_CHECK_ENV: &str = "FERRY_MOONCAKE_PEER_CHECK";

/// Whether `open_segment` checks the peer's generation.
pub(crate) fn peer_check_enabled() -> bool {
    std::env::var(PEER_CHECK_ENV).map_or(true, |v| v != "0")
}

/// Bound of the whole descriptor fetch (connect, request, reply).
const FETCH_TIMEOUT: Duration = Duration::from_secs(5);

/// Largest descriptor read (Mooncake's own default bound is 1 MiB, raised
/// up to 128 MiB with `MC_HANDSHAKE_MAX_LENGTH`).
const MAX_DESCRIPTOR: u64 = 128 << 20;

/// The metadata request type of Mooncake's handshake framing.
const METADATA_REQUEST: u8 = 1;

/// Where a generation's TCP transport sends data (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum TcpWire {
    /// v0.2.x: the RPC port.
    RpcPort,
    /// v0.3.0–v0.3.4: the RPC port + 1.
    RpcPortPlusOne,
    /// v0.3.5–v0.3.11: `tcp_data_port`, unacknowledged.
    DataPort,
    /// ≥ v0.3.12: `tcp_data_port`, acknowledged when both ends are.
    Acknowledged,
}

impl TcpWire {
    /// The wire of this engine's library.
    pub(crate) fn of_generation(generation: Generation) -> TcpWire {
        match generation {
            Generation::V0_2_0 => TcpWire::RpcPort,
            Generation::V0_3_0 => TcpWire::RpcPortPlusOne,
            Generation::V0_3_5 | Generation::V0_3_6 | Generation::V0_3_11 => TcpWire::DataPort,
            Generation::V0_3_12 => TcpWire::Acknowledged,
        }
    }

    /// The wire a `tcp` segment descriptor shows; `None` for anything else
    /// (another protocol, not an object).
    pub(crate) fn of_descriptor(desc: &Value) -> Option<TcpWire> {
        let desc = desc.as_object()?;
        if desc.get("protocol")?.as_str()? != "tcp" {
            return None;
        }
        let proto_version = desc.get("tcp_proto_version").and_then(Value::as_i64);
        let data_port = desc.get("tcp_data_port").and_then(Value::as_i64);
        Some(match (proto_version, data_port) {
            (Some(v), _) if v >= 2 => TcpWire::Acknowledged,
            (_, Some(p)) if p > 0 => TcpWire::DataPort,
            _ if desc.contains_key("timestamp") => TcpWire::RpcPortPlusOne,
            _ => TcpWire::RpcPort,
        })
    }

    /// The releases that speak it.
    pub(crate) fn releases(self) -> &'static str {
        match self {
            TcpWire::RpcPort => "Mooncake v0.2.x (before v0.3.0)",
            TcpWire::RpcPortPlusOne => "Mooncake v0.3.0–v0.3.4",
            TcpWire::DataPort => "Mooncake v0.3.5–v0.3.11",
            TcpWire::Acknowledged => "Mooncake v0.3.12 or later",
        }
    }

    /// What the descriptor of this wire shows, for messages.
    fn shape(self) -> &'static str {
        match self {
            TcpWire::RpcPort => "no timestamp, no tcp_data_port",
            TcpWire::RpcPortPlusOne => "a timestamp, no tcp_data_port",
            TcpWire::DataPort => "tcp_data_port, no tcp_proto_version",
            TcpWire::Acknowledged => "tcp_proto_version 2",
        }
    }

    /// Where an initiator of this wire sends data, for messages.
    fn sends_to(self) -> &'static str {
        match self {
            TcpWire::RpcPort => "the peer's RPC port",
            TcpWire::RpcPortPlusOne => "the peer's RPC port + 1",
            TcpWire::DataPort | TcpWire::Acknowledged => "the tcp_data_port the peer publishes",
        }
    }

    /// Where a target of this wire receives data, for messages.
    fn receives_on(self) -> &'static str {
        match self {
            TcpWire::RpcPort => "its RPC port",
            TcpWire::RpcPortPlusOne => "its RPC port + 1",
            TcpWire::DataPort | TcpWire::Acknowledged => "the tcp_data_port it publishes",
        }
    }

    /// Which peers an engine of this wire talks to, for the capability
    /// report.
    pub(crate) fn peers_detail(self) -> &'static str {
        match self {
            TcpWire::RpcPort => {
                "Mooncake v0.2.x peers only; open_segment refuses a peer of v0.3.0 or later \
                 (protocol error naming both) where its segment descriptor can be read"
            }
            TcpWire::RpcPortPlusOne => {
                "Mooncake v0.3.0–v0.3.4 peers only; open_segment refuses others (protocol \
                 error naming both) where their segment descriptor can be read"
            }
            TcpWire::DataPort => {
                "Mooncake v0.3.5 or later; open_segment refuses older peers (protocol error \
                 naming both) where their segment descriptor can be read"
            }
            TcpWire::Acknowledged => {
                "Mooncake v0.3.5 or later; v0.3.5–v0.3.11 peers neither acknowledge writes \
                 (Ferry confirms writes to them by reading them back, unless confirm_writes \
                 is off) nor check addresses; open_segment refuses older peers (protocol \
                 error naming both) where their segment descriptor can be read"
            }
        }
    }

    /// Which wires interoperate: those that send data to the same place.
    fn family(self) -> u8 {
        match self {
            TcpWire::RpcPort => 0,
            TcpWire::RpcPortPlusOne => 1,
            TcpWire::DataPort | TcpWire::Acknowledged => 2,
        }
    }

    /// `Err(Error::Protocol)` naming both generations when an engine of
    /// `self` (library `local`) cannot exchange bytes with a peer of `peer`.
    pub(crate) fn check_peer(self, local: Generation, peer: TcpWire, name: &str) -> Result<()> {
        if self.family() == peer.family() {
            return Ok(());
        }
        Err(Error::Protocol {
            peer: name.to_owned(),
            reason: format!(
                "the peer is {} (its segment descriptor has {}), this engine is {}: their TCP \
                 transports cannot exchange bytes (this engine sends data to {}, the peer \
                 receives it on {}); run Mooncake builds of one generation on both sides \
                 (v0.3.5 and later talk to each other)",
                peer.releases(),
                peer.shape(),
                local.mooncake_version(),
                self.sends_to(),
                peer.receives_on(),
            ),
        })
    }
}

/// The segment descriptor `name` publishes, fetched the way the library
/// will fetch it with `metadata`; `None` when it cannot be (see the module
/// docs: never a reason to refuse).
pub(crate) async fn fetch_descriptor(metadata: &str, name: &str) -> Option<Value> {
    let fetch = async {
        if metadata == P2P_HANDSHAKE {
            p2p_descriptor(name).await
        } else if metadata.starts_with("http://") {
            http_descriptor(metadata, name).await
        } else {
            None
        }
    };
    match tokio::time::timeout(FETCH_TIMEOUT, fetch).await {
        Ok(d) => d,
        Err(_) => {
            tracing::debug!(
                segment = name,
                "mooncake: no segment descriptor within {FETCH_TIMEOUT:?}"
            );
            None
        }
    }
}

/// `host:port` of a P2P segment name (`[v6]:port` too).
fn host_port(name: &str) -> Option<(String, u16)> {
    let (host, port) = name.rsplit_once(':')?;
    let port: u16 = port.parse().ok()?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    (!host.is_empty() && port != 0).then(|| (host.to_owned(), port))
}

/// The P2P handshake's metadata request (see the module docs).
async fn p2p_descriptor(name: &str) -> Option<Value> {
    let (host, port) = host_port(name)?;
    let mut s = TcpStream::connect((host.as_str(), port)).await.ok()?;
    // The peer ignores the requester's descriptor; this one says who asks.
    // (It is also longer than the 24-byte request header of any other TCP
    // protocol a port might speak, so such a listener never waits for more.)
    let body = br#"{"name":"ferry-descriptor-probe","protocol":"tcp","buffers":[]}"#;
    let mut req = Vec::with_capacity(9 + body.len());
    req.extend_from_slice(&(body.len() as u64 + 1).to_le_bytes());
    req.push(METADATA_REQUEST);
    req.extend_from_slice(body);
    s.write_all(&req).await.ok()?;
    let mut len = [0u8; 8];
    s.read_exact(&mut len).await.ok()?;
    let len = u64::from_le_bytes(len);
    if len == 0 || len > MAX_DESCRIPTOR {
        return None;
    }
    let mut reply = Vec::new();
    (&mut s).take(len).read_to_end(&mut reply).await.ok()?;
    if reply.len() as u64 != len {
        return None;
    }
    let json = match reply[0] {
        METADATA_REQUEST => &reply[1..],
        // Another request type: not a metadata reply.
        0..=3 => return None,
        // Framing without a type byte.
        _ => &reply[..],
    };
    serde_json::from_slice(json).ok()
}

/// The key Mooncake stores `name`'s descriptor under; `cluster` is
/// `MC_METADATA_CLUSTER_ID`, which ≥ v0.3.12 put in front of every key
/// (older builds ignore it; a key not found is no reason to refuse).
fn metadata_key(name: &str, cluster: Option<&str>) -> String {
    let mut prefix = "mooncake/".to_owned();
    if let Some(c) = cluster.filter(|c| !c.is_empty()) {
        prefix.push_str(c);
        if !c.ends_with('/') {
            prefix.push('/');
        }
    }
    if name.contains('/') {
        format!("{prefix}{name}")
    } else {
        format!("{prefix}ram/{name}")
    }
}

/// `GET <metadata>?key=<key>` from an HTTP metadata server, as Mooncake's
/// HTTP plugin does (the key escaped like `curl_easy_escape`).
async fn http_descriptor(metadata: &str, name: &str) -> Option<Value> {
    const UNRESERVED: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
        .remove(b'-')
        .remove(b'.')
        .remove(b'_')
        .remove(b'~');
    let cluster = std::env::var("MC_METADATA_CLUSTER_ID").ok();
    let key = metadata_key(name, cluster.as_deref());
    let target = format!(
        "{metadata}?key={}",
        percent_encoding::utf8_percent_encode(&key, UNRESERVED)
    );
    let url = url::Url::parse(&target).ok()?;
    let host = url
        .host_str()?
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_owned();
    let port = url.port_or_known_default()?;
    let stream = TcpStream::connect((host.as_str(), port)).await.ok()?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .ok()?;
    let conn = tokio::spawn(conn);
    let path = match url.query() {
        Some(q) => format!("{}?{q}", url.path()),
        None => url.path().to_owned(),
    };
    let authority = match url.port() {
        Some(p) => format!("{}:{p}", url.host_str()?),
        None => url.host_str()?.to_owned(),
    };
    let request = hyper::Request::get(path)
        .header(hyper::header::HOST, authority)
        .body(Empty::<Bytes>::new())
        .ok()?;
    let got = async {
        let response = sender.send_request(request).await.ok()?;
        if response.status() != hyper::StatusCode::OK {
            return None;
        }
        let body = Limited::new(response.into_body(), MAX_DESCRIPTOR as usize)
            .collect()
            .await
            .ok()?
            .to_bytes();
        serde_json::from_slice(&body).ok()
    }
    .await;
    conn.abort();
    got
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn descriptors_of_each_generation() {
        let v020 = json!({"name": "a", "protocol": "tcp", "buffers": []});
        let v030 = json!({"name": "a", "protocol": "tcp", "timestamp": "t", "buffers": []});
        let v036 = json!({"name": "a", "protocol": "tcp", "tcp_data_port": 4000, "timestamp": "t"});
        let v0312 = json!({"name": "a", "protocol": "tcp", "tcp_data_port": 4000,
                           "tcp_proto_version": 2, "timestamp": "t"});
        assert_eq!(TcpWire::of_descriptor(&v020), Some(TcpWire::RpcPort));
        assert_eq!(TcpWire::of_descriptor(&v030), Some(TcpWire::RpcPortPlusOne));
        assert_eq!(TcpWire::of_descriptor(&v036), Some(TcpWire::DataPort));
        assert_eq!(TcpWire::of_descriptor(&v0312), Some(TcpWire::Acknowledged));
        let rdma = json!({"name": "a", "protocol": "rdma", "tcp_data_port": 0});
        assert_eq!(TcpWire::of_descriptor(&rdma), None);
        assert_eq!(TcpWire::of_descriptor(&json!([1, 2])), None);
    }

    #[test]
    fn only_generations_that_send_to_the_same_place_interoperate() {
        let wires = [
            TcpWire::RpcPort,
            TcpWire::RpcPortPlusOne,
            TcpWire::DataPort,
            TcpWire::Acknowledged,
        ];
        for a in wires {
            for b in wires {
                let ok = a == b || (a.family() == 2 && b.family() == 2);
                let r = a.check_peer(Generation::V0_3_6, b, "peer:1");
                assert_eq!(r.is_ok(), ok, "{a:?} -> {b:?}");
                if let Err(Error::Protocol { peer, reason }) = r {
                    assert_eq!(peer, "peer:1");
                    assert!(reason.contains(a.sends_to()), "{reason}");
                    assert!(reason.contains(b.releases()), "{reason}");
                    assert!(reason.contains("Mooncake v0.3.6"), "{reason}");
                }
            }
        }
    }

    #[test]
    fn keys_and_names() {
        assert_eq!(metadata_key("ferry-1-0", None), "mooncake/ram/ferry-1-0");
        assert_eq!(metadata_key("x/y", None), "mooncake/x/y");
        assert_eq!(metadata_key("a", Some("c1")), "mooncake/c1/ram/a");
        assert_eq!(
            host_port("127.0.0.1:15000"),
            Some(("127.0.0.1".to_owned(), 15000))
        );
        assert_eq!(host_port("[::1]:15000"), Some(("::1".to_owned(), 15000)));
        assert_eq!(host_port("ferry-1-0"), None);
        assert_eq!(host_port("h:0"), None);
    }

    /// A one-shot listener answering the first connection with `reply`
    /// after reading `expect` bytes; what it read.
    async fn responder(
        expect: usize,
        reply: Vec<u8>,
    ) -> (String, tokio::task::JoinHandle<Vec<u8>>) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let task = tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            let mut got = vec![0u8; expect];
            s.read_exact(&mut got).await.unwrap();
            s.write_all(&reply).await.unwrap();
            s.shutdown().await.unwrap();
            got
        });
        (addr, task)
    }

    fn framed(type_byte: Option<u8>, json: &str) -> Vec<u8> {
        let len = json.len() + usize::from(type_byte.is_some());
        let mut v = (len as u64).to_le_bytes().to_vec();
        v.extend(type_byte);
        v.extend_from_slice(json.as_bytes());
        v
    }

    #[tokio::test]
    async fn p2p_metadata_request_and_both_reply_framings() {
        let desc = r#"{"name":"127.0.0.1:1","protocol":"tcp","tcp_data_port":4000}"#;
        for type_byte in [Some(METADATA_REQUEST), None] {
            // The request: u64 length, type 1, JSON; read 9 bytes of it.
            let (addr, task) = responder(9, framed(type_byte, desc)).await;
            let got = fetch_descriptor(P2P_HANDSHAKE, &addr)
                .await
                .expect("descriptor");
            assert_eq!(TcpWire::of_descriptor(&got), Some(TcpWire::DataPort));
            let head = task.await.unwrap();
            let len = u64::from_le_bytes(head[..8].try_into().unwrap());
            assert!(
                len > 24,
                "request shorter than other protocols' headers: {len}"
            );
            assert_eq!(head[8], METADATA_REQUEST);
        }
        // Another reply type, a closed connection, garbage: no descriptor.
        let (addr, _t) = responder(9, framed(Some(0), desc)).await;
        assert!(fetch_descriptor(P2P_HANDSHAKE, &addr).await.is_none());
        let (addr, _t) = responder(9, Vec::new()).await;
        assert!(fetch_descriptor(P2P_HANDSHAKE, &addr).await.is_none());
        let (addr, _t) = responder(9, u64::MAX.to_le_bytes().to_vec()).await;
        assert!(fetch_descriptor(P2P_HANDSHAKE, &addr).await.is_none());
        assert!(fetch_descriptor("etcd://127.0.0.1:2379", "x")
            .await
            .is_none());
    }

    #[tokio::test]
    async fn http_metadata_get_with_the_escaped_key() {
        let body = r#"{"name":"ferry-1-0","protocol":"tcp"}"#;
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            let mut head = Vec::new();
            let mut b = [0u8; 1];
            while !head.ends_with(b"\r\n\r\n") {
                s.read_exact(&mut b).await.unwrap();
                head.push(b[0]);
            }
            let reply = format!(
                "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{body}",
                body.len()
            );
            s.write_all(reply.as_bytes()).await.unwrap();
            String::from_utf8(head).unwrap()
        });
        let url = format!("http://{addr}/metadata");
        let got = fetch_descriptor(&url, "ferry-1-0")
            .await
            .expect("descriptor");
        assert_eq!(TcpWire::of_descriptor(&got), Some(TcpWire::RpcPort));
        let head = server.await.unwrap();
        assert!(
            head.starts_with("GET /metadata?key=mooncake%2Fram%2Fferry-1-0 HTTP/1.1\r\n"),
            "{head}"
        );
    }
}
