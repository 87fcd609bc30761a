//! Hiding secrets in URLs before they reach a message.

/// Keys whose values are secrets (compared after percent-decoding,
/// trimmed, in any case).
const SECRET_KEYS: &[&str] = &["secret", "password", "passwd", "token", "psk", "key"];

/// `url` with everything that may hold a secret replaced by `…`, for
/// errors and log lines; it works on malformed URLs too (they are what
/// errors quote). Hidden: the value of every query parameter whose key
/// decodes to a secret-like name (`secret`, `password`, `token`, …,
/// however it is percent-encoded or cased), the userinfo (`user:pass@`),
/// a path (`tcp://h:1/x`: some backends take none, and a secret put there
/// by mistake must not be echoed) and a fragment.
pub fn redact_url(url: &str) -> String {
    let (scheme, rest) = match url.find("://") {
        Some(i) => (&url[..i + 3], &url[i + 3..]),
        None => ("", url),
    };
    let (rest, fragment) = match rest.split_once('#') {
        Some((r, _)) => (r, true),
        None => (rest, false),
    };
    let (before_query, query) = match rest.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (rest, None),
    };
    let (authority, path) = match before_query.find('/') {
        Some(i) => (&before_query[..i], &before_query[i..]),
        None => (before_query, ""),
    };
    let mut out = String::with_capacity(url.len());
    out.push_str(scheme);
    match authority.rsplit_once('@') {
        Some((_, host)) => {
            out.push_str("…@");
            out.push_str(host);
        }
        None => out.push_str(authority),
    }
    if !path.is_empty() && path != "/" {
        out.push_str("/…");
    } else {
        out.push_str(path);
    }
    if let Some(q) = query {
        out.push('?');
        let parts: Vec<String> = q
            .split('&')
            .map(|p| {
                let key = p.split_once('=').map_or(p, |(k, _)| k);
                if is_secret_key(key) {
                    format!("{key}=…")
                } else {
                    p.to_owned()
                }
            })
            .collect();
        out.push_str(&parts.join("&"));
    }
    if fragment {
        out.push_str("#…");
    }
    out
}

/// Whether a raw (possibly percent-encoded) query key names a secret.
pub fn is_secret_key(raw: &str) -> bool {
    let decoded = percent_decode(&raw.replace('+', " "));
    let k = decoded.trim().to_ascii_lowercase();
    SECRET_KEYS.contains(&k.as_str()) || k.contains("secret")
}

/// Percent-decoding that never fails: an escape that is not two hex digits
/// stays as it is; invalid UTF-8 is replaced.
fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |j: usize| b.get(j).and_then(|&c| (c as char).to_digit(16));
        if b[i] == b'%' {
            if let (Some(h), Some(l)) = (hex(i + 1), hex(i + 2)) {
                out.push((h * 16 + l) as u8);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_are_hidden_in_every_position() {
        let cases = [
            ("tcp://h:1?secret=hunter2", "tcp://h:1?secret=…"),
            (
                "tcp://h:1?connections=2&secret=hunter2&x=1",
                "tcp://h:1?connections=2&secret=…&x=1",
            ),
            ("tcp://h:1?%73ecret=hunter2", "tcp://h:1?%73ecret=…"),
            ("tcp://h:1?SECRET=hunter2", "tcp://h:1?SECRET=…"),
            ("tcp://h:1?secret+=hunter2", "tcp://h:1?secret+=…"),
            ("tcp://h:1?psk=hunter2", "tcp://h:1?psk=…"),
            ("tcp://user:hunter2@h:1", "tcp://…@h:1"),
            ("tcp://h:1/hunter2", "tcp://h:1/…"),
            ("tcp://h:1/?a=1#hunter2", "tcp://h:1/?a=1#…"),
            ("h:1?secret=hunter2", "h:1?secret=…"),
            ("tcp://[::1:1?secret=hunter2", "tcp://[::1:1?secret=…"),
            (
                "tcp://h:1?secret_file=/etc/hunter2",
                "tcp://h:1?secret_file=…",
            ),
            (
                "tcp://h:1?a=%zz&secret=hunter2%",
                "tcp://h:1?a=%zz&secret=…",
            ),
        ];
        for (url, want) in cases {
            let got = redact_url(url);
            assert_eq!(got, want, "{url}");
            assert!(!got.contains("hunter2"), "{url} -> {got}");
        }
        // Nothing to hide: unchanged.
        for url in [
            "tcp://h:1",
            "tcp://h:1?connections=2",
            "mooncake://?lib=/x.so&name=a",
        ] {
            assert_eq!(redact_url(url), url);
        }
    }
}
