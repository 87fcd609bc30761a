//! The handshake messages: the [`Hello`] each side sends first, its flags,
//! and the first byte of the target's final message ([`WELCOME`] or
//! [`REJECT`]).

use super::*;

/// Fixed part of a hello: magic, version, flags, nonce, name length.
pub const HELLO_FIXED: usize = 4 + 2 + 2 + NONCE_LEN + 2;

/// Hello flag: the sender holds a shared secret (server: requires proof).
pub const FLAG_AUTH: u16 = 1;
/// Hello flag: the sender negotiates versions and features (an extension
/// block follows the target's hello and precedes the initiator's proof;
/// see [`crate::negotiate`]). Peers before version 6 ignore it.
pub const FLAG_EXT: u16 = 2;

/// The first message of each side.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hello {
    /// Protocol version of the sender.
    pub version: u16,
    /// Flags ([`FLAG_AUTH`]).
    pub flags: u16,
    /// Random challenge.
    pub nonce: [u8; NONCE_LEN],
    /// The sender's engine name.
    pub name: String,
}

impl Hello {
    /// Encodes the hello (the name is truncated to [`MAX_NAME`] bytes at a
    /// character boundary).
    pub fn encode(&self) -> Vec<u8> {
        let mut name = self.name.as_str();
        while name.len() > MAX_NAME {
            let mut cut = MAX_NAME;
            while !name.is_char_boundary(cut) {
                cut -= 1;
            }
            name = &name[..cut];
        }
        let mut out = Vec::with_capacity(HELLO_FIXED + name.len());
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&self.version.to_le_bytes());
        out.extend_from_slice(&self.flags.to_le_bytes());
        out.extend_from_slice(&self.nonce);
        out.extend_from_slice(&(name.len() as u16).to_le_bytes());
        out.extend_from_slice(name.as_bytes());
        out
    }

    /// Decodes the fixed part; returns the hello without its name and the
    /// name length to read next. Checks magic and the name limit but not the
    /// version (the caller answers a version mismatch politely).
    pub fn decode_fixed(buf: &[u8; HELLO_FIXED]) -> Result<(Hello, usize), DecodeError> {
        if buf[..4] != MAGIC {
            return Err(bad("bad magic: not a ferry-tcp peer"));
        }
        let version = u16::from_le_bytes([buf[4], buf[5]]);
        let flags = u16::from_le_bytes([buf[6], buf[7]]);
        let mut nonce = [0u8; NONCE_LEN];
        nonce.copy_from_slice(&buf[8..8 + NONCE_LEN]);
        let name_len = u16::from_le_bytes([buf[8 + NONCE_LEN], buf[9 + NONCE_LEN]]) as usize;
        if name_len > MAX_NAME {
            return Err(bad(format!("name of {name_len} bytes exceeds {MAX_NAME}")));
        }
        Ok((
            Hello {
                version,
                flags,
                nonce,
                name: String::new(),
            },
            name_len,
        ))
    }
}

/// First byte of the target's final handshake message: welcome.
pub const WELCOME: u8 = 0;
/// First byte of the target's final handshake message: rejection. A
/// rejection is `REJECT, status u8, len u16, reason` and may also come
/// instead of the target's hello (a target that is busy refuses before
/// reading anything).
pub const REJECT: u8 = 1;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hello_roundtrip_and_garbage() {
        let h = Hello {
            version: VERSION,
            flags: FLAG_AUTH,
            nonce: [7; NONCE_LEN],
            name: "é".repeat(200),
        };
        let bytes = h.encode();
        let fixed: [u8; HELLO_FIXED] = bytes[..HELLO_FIXED].try_into().unwrap();
        let (d, n) = Hello::decode_fixed(&fixed).unwrap();
        assert!(n <= MAX_NAME);
        assert_eq!(bytes.len(), HELLO_FIXED + n);
        assert!(std::str::from_utf8(&bytes[HELLO_FIXED..]).is_ok());
        assert_eq!((d.version, d.flags, d.nonce), (h.version, h.flags, h.nonce));
        assert!(Hello::decode_fixed(&[0x47; HELLO_FIXED]).is_err());
    }
}
