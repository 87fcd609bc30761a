//! No secret in any error: every URL parser (the facade's, tcp's,
//! mooncake's, verbs') quotes URLs through the one redaction helper, with
//! the secret in any position and whatever makes the URL wrong.

use ferry::EngineConfig;

const SECRET: &str = "hunter2";

/// URLs that fail to parse, each with the secret somewhere in it.
fn bad_urls() -> Vec<String> {
    let mut out = Vec::new();
    for scheme in ["tcp", "mooncake", "verbs", "t cp", ""] {
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
            format!("{s}h:1?bogus=1#{SECRET}"),
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
    assert!(failures >= 30, "only {failures} of the URLs were refused");
}

#[test]
fn the_tcp_parser_never_quotes_a_secret_directly() {
    for url in bad_urls() {
        if let Err(e) = ferry::ferry_tcp::TcpConfig::from_url(&url) {
            let text = format!("{e} {e:?}");
            assert!(!text.contains(SECRET), "{url:?} -> {text}");
        }
    }
}
