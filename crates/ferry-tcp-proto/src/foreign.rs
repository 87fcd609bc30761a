//! Peers that are not Ferry: recognising them from their first bytes, and
//! refusing them with a message that says so instead of a bare reset.
//!
//! The one such peer a KV-cache deployment commonly points at a Ferry port
//! by mistake is a Mooncake Transfer Engine. Its P2P handshake
//! (`SocketHandShakePlugin` in Mooncake's `transfer_metadata_plugin.cpp`,
//! framing in `common.h` `writeString` / `readString`) sends, on a fresh
//! connection, `length u64` (host order, little-endian on the platforms it
//! supports; the payload's length, at most 1 MiB), then a request type byte
//! (0 connection, 1 metadata, 2 notify, 3 probe in newer builds; absent in
//! its oldest protocol) and a JSON object; the listener answers in the same
//! framing. A Mooncake dialer that reaches a Ferry target is therefore
//! recognised, logged, and answered with a Mooncake frame whose JSON
//! carries the reason in `reply_msg` (the field Mooncake's handshake
//! reports when a peer rejects it) and in `protocol` (which Mooncake names
//! when it cannot use the segment descriptor a metadata request returned:
//! `Unsupported segment descriptor, name … protocol ferry-tcp: …`). A Ferry initiator that reaches a Mooncake listener sends
//! its hello, which the listener reads as an over-long length and closes on
//! without answering: see [`crate::handshake`]'s `NotFerry` for that case.
//!
//! Pure: the handshake core ([`crate::handshake::Target`]) recognises the
//! peer and writes the answer; the driver logs it.

/// The reason a Mooncake dialer is told.
pub const MOONCAKE_REASON: &str =
    "ferry-tcp: this port is a Ferry target, not a Mooncake Transfer Engine";

/// Mooncake's largest handshake message (`readString`'s `kMaxLength`).
const MOONCAKE_MAX_LEN: u64 = 1 << 20;

/// Mooncake handshake request types, by value.
fn mooncake_type(b: u8) -> Option<&'static str> {
    match b {
        0 => Some("connection"),
        1 => Some("metadata"),
        2 => Some("notify"),
        3 => Some("probe"),
        _ => None,
    }
}

/// A recognised foreign peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Foreign {
    /// A Mooncake Transfer Engine handshake message (its request type, or
    /// `None` for its oldest, untyped protocol).
    Mooncake(Option<u8>),
    /// An HTTP request or response.
    Http,
    /// A TLS record.
    Tls,
}

/// Recognises a foreign peer from the first bytes it sent.
pub fn recognise(first: &[u8]) -> Option<Foreign> {
    if first.len() >= 10 {
        let mut len = [0u8; 8];
        len.copy_from_slice(&first[..8]);
        let len = u64::from_le_bytes(len);
        if (2..=MOONCAKE_MAX_LEN).contains(&len) {
            if mooncake_type(first[8]).is_some() && first[9] == b'{' {
                return Some(Foreign::Mooncake(Some(first[8])));
            }
            if first[8] == b'{' {
                return Some(Foreign::Mooncake(None));
            }
        }
    }
    const HTTP: [&[u8]; 6] = [b"GET ", b"POST", b"PUT ", b"HEAD", b"HTTP", b"DELE"];
    if HTTP.iter().any(|m| first.starts_with(m)) {
        return Some(Foreign::Http);
    }
    if first.len() >= 2 && first[0] == 0x16 && first[1] == 0x03 {
        return Some(Foreign::Tls);
    }
    None
}

/// A sentence naming what `first` looks like, if it is recognised.
pub fn describe(first: &[u8]) -> Option<String> {
    Some(match recognise(first)? {
        Foreign::Mooncake(t) => format!(
            "a Mooncake Transfer Engine handshake ({}), not a ferry-tcp peer: point Mooncake \
             at a Mooncake engine, or use Ferry's mooncake backend to talk to it",
            t.and_then(mooncake_type).unwrap_or("old protocol")
        ),
        Foreign::Http => "an HTTP peer (a metadata server?), not a ferry-tcp peer".to_owned(),
        Foreign::Tls => "a TLS peer, not a ferry-tcp peer".to_owned(),
    })
}

/// The Mooncake frame refusing a Mooncake handshake of type `t`: a JSON
/// object whose `reply_msg` (what Mooncake reports for a rejected
/// connection handshake) and `protocol` (what it reports for a segment
/// descriptor it cannot use, the answer to a metadata request) both carry
/// `reason`.
pub fn mooncake_refusal(t: Option<u8>, reason: &str) -> Vec<u8> {
    let mut quoted = String::new();
    for c in reason.chars() {
        match c {
            '"' => quoted.push_str("\\\""),
            '\\' => quoted.push_str("\\\\"),
            c if (c as u32) < 0x20 => quoted.push(' '),
            c => quoted.push(c),
        }
    }
    let json = format!("{{\"reply_msg\":\"{quoted}\",\"protocol\":\"{quoted}\"}}\n");
    let body_len = json.len() as u64 + u64::from(t.is_some());
    let mut out = Vec::with_capacity(9 + json.len());
    out.extend_from_slice(&body_len.to_le_bytes());
    if let Some(t) = t {
        out.push(t);
    }
    out.extend_from_slice(json.as_bytes());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recognises_mooncake_handshakes() {
        let msg = mooncake_refusal(Some(0), "x");
        assert_eq!(recognise(&msg), Some(Foreign::Mooncake(Some(0))));
        let old = mooncake_refusal(None, "x");
        assert_eq!(recognise(&old), Some(Foreign::Mooncake(None)));
        // A ferry hello is not one.
        let hello = crate::frame::Hello {
            version: 5,
            flags: 0,
            nonce: [0; 32],
            name: "a".into(),
        }
        .encode();
        assert_eq!(recognise(&hello), None);
        assert_eq!(recognise(b"GET / HTTP/1.1\r\n"), Some(Foreign::Http));
        assert_eq!(recognise(&[0x16, 3, 1, 0]), Some(Foreign::Tls));
        assert_eq!(recognise(&[]), None);
        let d = describe(&msg).unwrap();
        assert!(d.contains("Mooncake") && d.contains("connection"), "{d}");
    }

    #[test]
    fn the_refusal_is_a_mooncake_frame() {
        let f = mooncake_refusal(Some(1), "say \"no\"");
        let len = u64::from_le_bytes(f[..8].try_into().unwrap());
        assert_eq!(len as usize, f.len() - 8);
        assert_eq!(f[8], 1);
        let json = std::str::from_utf8(&f[9..]).unwrap();
        assert!(
            json.starts_with("{\"reply_msg\":\"say \\\"no\\\"\",\"protocol\":"),
            "{json}"
        );
    }
}
