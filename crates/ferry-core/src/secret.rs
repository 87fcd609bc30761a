//! [`Secret`]: a shared secret that never prints.

use std::fmt;

/// A shared secret (the `secret=` of the TCP and verbs backends).
///
/// `Debug` and `Display` print `<redacted>`, never the value; there is no
/// `Serialize` (with or without the `serde` feature) and no `Deref`: the
/// value is reached only through [`Secret::expose`], at the point where it
/// is used (the HMAC of a handshake, a key derivation). Equality compares
/// every byte whatever the first difference (not a guarantee of constant
/// time, which nothing here needs). The buffer is overwritten with zeros
/// when the `Secret` is dropped (best effort: copies made by callers of
/// `expose` are theirs to wipe).
///
/// ```
/// use ferry_core::Secret;
///
/// let s = Secret::new("hunter2");
/// assert_eq!(s.expose(), "hunter2");
/// assert_eq!(format!("{s} {s:?}"), "<redacted> Secret(<redacted>)");
/// ```
#[derive(Clone, Default)]
pub struct Secret(String);

impl Secret {
    /// Wraps `value`.
    pub fn new(value: impl Into<String>) -> Secret {
        Secret(value.into())
    }

    /// The secret's text.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// The secret's bytes (UTF-8).
    pub fn expose_bytes(&self) -> &[u8] {
        self.0.as_bytes()
    }

    /// Whether the secret is the empty string (which no backend accepts).
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl From<String> for Secret {
    fn from(value: String) -> Secret {
        Secret(value)
    }
}

impl From<&str> for Secret {
    fn from(value: &str) -> Secret {
        Secret(value.to_owned())
    }
}

impl PartialEq for Secret {
    fn eq(&self, other: &Secret) -> bool {
        let (a, b) = (self.0.as_bytes(), other.0.as_bytes());
        a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
    }
}

impl Eq for Secret {}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

impl Drop for Secret {
    fn drop(&mut self) {
        // SAFETY: only zero bytes are written, which leave valid UTF-8.
        let bytes = unsafe { self.0.as_mut_vec() };
        for b in bytes.iter_mut() {
            // SAFETY: `b` is a valid, aligned, exclusive reference. Volatile
            // so that the writes to memory about to be freed are kept.
            unsafe { std::ptr::write_volatile(b, 0) };
        }
        std::sync::atomic::compiler_fence(std::sync::atomic::Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn never_prints_its_value() {
        let s = Secret::new("hunter2");
        for shown in [
            format!("{s}"),
            format!("{s:?}"),
            format!("{s:#?}"),
            format!("{:?}", Some(s.clone())),
            format!("{:>20}", s),
        ] {
            assert!(!shown.contains("hunter2"), "{shown}");
            assert!(shown.contains("<redacted>"), "{shown}");
        }
        assert_eq!(s.expose(), "hunter2");
        assert_eq!(s.expose_bytes(), b"hunter2");
        assert!(!s.is_empty() && Secret::default().is_empty());
    }

    #[test]
    fn equality_compares_values() {
        assert_eq!(Secret::new("a"), Secret::from("a"));
        assert_ne!(Secret::new("a"), Secret::new("b"));
        assert_ne!(Secret::new("a"), Secret::new("ab"));
        assert_eq!(Secret::from(String::from("x")), Secret::new("x"));
    }
}
