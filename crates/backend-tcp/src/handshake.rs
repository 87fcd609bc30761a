//! The connection handshake: versions, names, optional HMAC-SHA256
//! challenge–response in both directions, and the target's region table.

use std::time::Duration;

use hmac::{Hmac, Mac};
use sha2::Sha256;
use tokio::net::TcpStream;
use transport_core::{Error, RegionTable, Result};

use crate::frame::{
    decode_table, encode_table, Hello, FLAG_AUTH, HELLO_FIXED, MAX_REJECT_MSG, MAX_TABLE_ENTRIES,
    NONCE_LEN, REJECT, VERSION, WELCOME,
};
use crate::io::{read_some, write_all_slices as write_all};

type HmacSha256 = Hmac<Sha256>;

const CLIENT_LABEL: &[u8] = b"ferry-tcp/1 initiator";
const SERVER_LABEL: &[u8] = b"ferry-tcp/1 target";

/// HMAC-SHA256(secret, label || initiator nonce || target nonce).
fn mac(secret: &str, label: &[u8], nc: &[u8; NONCE_LEN], ns: &[u8; NONCE_LEN]) -> HmacSha256 {
    // HMAC accepts keys of any length; new_from_slice cannot fail for it.
    let mut m = match HmacSha256::new_from_slice(secret.as_bytes()) {
        Ok(m) => m,
        Err(_) => unreachable!("HMAC takes keys of any length"),
    };
    m.update(label);
    m.update(nc);
    m.update(ns);
    m
}

fn proof(secret: &str, label: &[u8], nc: &[u8; NONCE_LEN], ns: &[u8; NONCE_LEN]) -> [u8; 32] {
    mac(secret, label, nc, ns).finalize().into_bytes().into()
}

fn verify(
    secret: &str,
    label: &[u8],
    nc: &[u8; NONCE_LEN],
    ns: &[u8; NONCE_LEN],
    got: &[u8],
) -> bool {
    // Constant-time comparison.
    mac(secret, label, nc, ns).verify_slice(got).is_ok()
}

fn nonce() -> [u8; NONCE_LEN] {
    rand::random()
}

fn io_err(peer: &str, what: &str, e: std::io::Error) -> Error {
    match e.kind() {
        std::io::ErrorKind::TimedOut => Error::Timeout {
            operation: format!("handshake ({what})"),
            peer: Some(peer.to_owned()),
            // The handshake as a whole runs under the connect timeout; this
            // is the stall inside it.
            after: Duration::ZERO,
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

async fn read_exact(stream: &TcpStream, buf: &mut [u8], timeout: Duration) -> std::io::Result<()> {
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

async fn read_hello(stream: &TcpStream, peer: &str, timeout: Duration) -> Result<Hello> {
    let mut fixed = [0u8; HELLO_FIXED];
    read_exact(stream, &mut fixed, timeout)
        .await
        .map_err(|e| io_err(peer, "hello", e))?;
    let (mut hello, name_len) = Hello::decode_fixed(&fixed).map_err(|e| Error::Protocol {
        peer: peer.to_owned(),
        reason: e.0,
    })?;
    let mut name = vec![0u8; name_len];
    read_exact(stream, &mut name, timeout)
        .await
        .map_err(|e| io_err(peer, "hello name", e))?;
    hello.name = String::from_utf8(name).map_err(|_| Error::Protocol {
        peer: peer.to_owned(),
        reason: "engine name is not UTF-8".to_owned(),
    })?;
    Ok(hello)
}

async fn send_reject(stream: &TcpStream, reason: &str, timeout: Duration) {
    let mut msg = reason.as_bytes();
    if msg.len() > MAX_REJECT_MSG {
        msg = &msg[..MAX_REJECT_MSG];
    }
    let len = (msg.len() as u16).to_le_bytes();
    // Best effort: the connection is closed right after.
    let _ = write_all(stream, &[&[REJECT], &len, msg], timeout).await;
}

/// What an initiator learns from a successful handshake.
pub struct Welcome {
    /// The target's registered regions, sorted.
    pub table: Vec<(u64, u64)>,
}

/// Initiator side. `peer` is the segment name (for errors). With a secret,
/// the target must prove it too.
pub async fn client(
    stream: &TcpStream,
    peer: &str,
    my_name: &str,
    secret: Option<&str>,
    timeout: Duration,
) -> Result<Welcome> {
    let nc = nonce();
    let hello = Hello {
        version: VERSION,
        flags: if secret.is_some() { FLAG_AUTH } else { 0 },
        nonce: nc,
        name: my_name.to_owned(),
    };
    write_all(stream, &[&hello.encode()], timeout)
        .await
        .map_err(|e| io_err(peer, "sending hello", e))?;
    let server = read_hello(stream, peer, timeout).await?;
    if server.version != VERSION {
        return Err(Error::Protocol {
            peer: peer.to_owned(),
            reason: format!(
                "peer speaks ferry-tcp protocol version {}, this engine version {VERSION}",
                server.version
            ),
        });
    }
    let ns = server.nonce;
    let my_proof = match secret {
        Some(s) => proof(s, CLIENT_LABEL, &nc, &ns),
        None => [0u8; 32],
    };
    write_all(stream, &[&my_proof], timeout)
        .await
        .map_err(|e| io_err(peer, "sending proof", e))?;
    let mut status = [0u8; 1];
    read_exact(stream, &mut status, timeout)
        .await
        .map_err(|e| io_err(peer, "waiting for welcome", e))?;
    match status[0] {
        WELCOME => {}
        REJECT => {
            let mut len = [0u8; 2];
            read_exact(stream, &mut len, timeout)
                .await
                .map_err(|e| io_err(peer, "rejection", e))?;
            let len = (u16::from_le_bytes(len) as usize).min(MAX_REJECT_MSG);
            let mut msg = vec![0u8; len];
            let _ = read_exact(stream, &mut msg, timeout).await;
            let reason = String::from_utf8_lossy(&msg).into_owned();
            return Err(if reason.starts_with("authentication") {
                Error::Authentication {
                    peer: peer.to_owned(),
                    reason,
                }
            } else {
                Error::SegmentUnavailable {
                    name: peer.to_owned(),
                    reason: format!("the peer refused the connection: {reason}"),
                }
            });
        }
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
        .map_err(|e| io_err(peer, "target proof", e))?;
    if let Some(s) = secret {
        if !verify(s, SERVER_LABEL, &nc, &ns, &server_proof) {
            return Err(Error::Authentication {
                peer: peer.to_owned(),
                reason: "the target did not prove knowledge of the shared secret".to_owned(),
            });
        }
    }
    let mut count = [0u8; 4];
    read_exact(stream, &mut count, timeout)
        .await
        .map_err(|e| io_err(peer, "region table", e))?;
    let count = u32::from_le_bytes(count);
    if count > MAX_TABLE_ENTRIES {
        return Err(Error::Protocol {
            peer: peer.to_owned(),
            reason: format!("region table of {count} entries exceeds {MAX_TABLE_ENTRIES}"),
        });
    }
    let mut raw = vec![0u8; count as usize * 16];
    read_exact(stream, &mut raw, timeout)
        .await
        .map_err(|e| io_err(peer, "region table", e))?;
    let table = decode_table(&raw).map_err(|e| Error::Protocol {
        peer: peer.to_owned(),
        reason: e.0,
    })?;
    Ok(Welcome { table })
}

/// The live regions as a wire table (at most [`MAX_TABLE_ENTRIES`]; a target
/// with more regions advertises the first ones and initiators fall back to
/// the target's own checks for the rest).
pub fn table_bytes(regions: &RegionTable) -> (u32, Vec<u8>) {
    let list: Vec<(u64, u64)> = regions
        .regions()
        .iter()
        .take(MAX_TABLE_ENTRIES as usize)
        .map(|r| (r.addr(), r.len()))
        .collect();
    (list.len() as u32, encode_table(&list))
}

/// Target side. Returns the initiator's engine name. Refuses (and sends a
/// rejection) on a bad magic, version or proof, before touching memory.
pub async fn server(
    stream: &TcpStream,
    peer_addr: &str,
    my_name: &str,
    secret: Option<&str>,
    regions: &RegionTable,
    timeout: Duration,
) -> Result<String> {
    let client = read_hello(stream, peer_addr, timeout).await?;
    let ns = nonce();
    let hello = Hello {
        version: VERSION,
        flags: if secret.is_some() { FLAG_AUTH } else { 0 },
        nonce: ns,
        name: my_name.to_owned(),
    };
    write_all(stream, &[&hello.encode()], timeout)
        .await
        .map_err(|e| io_err(peer_addr, "sending hello", e))?;
    if client.version != VERSION {
        send_reject(
            stream,
            &format!("unsupported protocol version {}", client.version),
            timeout,
        )
        .await;
        return Err(Error::Protocol {
            peer: peer_addr.to_owned(),
            reason: format!("peer speaks protocol version {}", client.version),
        });
    }
    let nc = client.nonce;
    let mut client_proof = [0u8; 32];
    read_exact(stream, &mut client_proof, timeout)
        .await
        .map_err(|e| io_err(peer_addr, "initiator proof", e))?;
    if let Some(s) = secret {
        if !verify(s, CLIENT_LABEL, &nc, &ns, &client_proof) {
            send_reject(
                stream,
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
    let my_proof = match secret {
        Some(s) => proof(s, SERVER_LABEL, &nc, &ns),
        None => [0u8; 32],
    };
    let (count, table) = table_bytes(regions);
    write_all(
        stream,
        &[&[WELCOME], &my_proof, &count.to_le_bytes(), &table],
        timeout,
    )
    .await
    .map_err(|e| io_err(peer_addr, "sending welcome", e))?;
    Ok(client.name)
}
