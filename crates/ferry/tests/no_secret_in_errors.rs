//! No secret in any error: the facade's URL parsing (one `ParsedUrl`,
//! Ferry's keys taken, the rest handed to the backend) quotes URLs through
//! the one redaction helper, with the secret in any position and whatever
//! makes the URL wrong. (`tests/tests/no_secret_in_parse_errors.rs` runs
//! the same on every backend's parser directly.)

use ferry::EngineConfig;

const SECRET: &str = "hunter2";

/// URLs that fail to parse, each with the secret somewhere in it.
fn bad_urls() -> Vec<String> {
    let mut out = Vec::new();
    for scheme in ["tcp", "mooncake", "verbs", "nixl", "t cp", ""] {
        let s = if scheme.is_empty() {
            String::new()
        } else {
            format!("{scheme}://")
        };
        out.extend([
            // In the query (plain, percent-encoded key, upper case), with an
            // unknown parameter, a bad number, a bad host or a path.
            format!("{s}h:1?secret={SECRET}&bogus=1"),
            format!("{s}h:1?%73ecret={SECRET}&connections=x"),
            format!("{s}h:1?SECRET={SECRET}&secret={SECRET}"),
            format!("{s}[::1?secret={SECRET}"),
            format!("{s}h:1/p?secret={SECRET}"),
            // In the path, the userinfo and the fragment.
            format!("{s}h:1/{SECRET}"),
            format!("{s}u:{SECRET}@h:1?bogus=1"),
            format!("{s}u:{SECRET}@h:1"),
            format!("{s}h:1?bogus=1#{SECRET}"),
            format!("{s}h:1?secret=ab#{SECRET}"),
            // Other secret-like keys, and a malformed escape inside the
            // secret (quoting the escape would quote part of it).
            format!("{s}h:1?password={SECRET}&bogus=1"),
            format!("{s}h:1?secret={SECRET}%+5"),
            format!("{s}h:1?s%65cret=%G1{SECRET}"),
            format!("{s}h:1?secret={SECRET}%4"),
            // Ferry's own parameters wrong, with a secret for the backend.
            format!("{s}h:1?secret={SECRET}&strict=maybe"),
            format!("{s}h:1?secret={SECRET}&require=teleport"),
        ]);
    }
    out
}

#[test]
fn parsers_never_quote_a_secret() {
    let mut failures = 0;
    for url in bad_urls() {
        match EngineConfig::from_url(&url) {
            Ok(_) => {}
            Err(e) => {
                failures += 1;
                let text = format!("{e} {e:?}");
                assert!(!text.contains(SECRET), "{url:?} -> {text}");
            }
        }
    }
    assert_eq!(
        failures,
        bad_urls().len(),
        "some of the bad URLs were accepted"
    );
}

#[test]
fn the_tcp_parser_never_quotes_a_secret_directly() {
    for url in bad_urls() {
        if let Err(e) = ferry::tcp::TcpConfig::from_url(&url) {
            let text = format!("{e} {e:?}");
            assert!(!text.contains(SECRET), "{url:?} -> {text}");
        }
    }
}
