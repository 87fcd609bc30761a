//! No URL parser of the workspace quotes a secret: the facade's
//! (`EngineConfig`, dispatching to tcp, mooncake and nixl), tcp's,
//! mooncake's, nixl's, verbs' and the shared `ParsedUrl` itself get URLs
//! with a secret in the query (`secret=`, `password=`, `token=`, a
//! percent-encoded key, a malformed escape inside the secret), in the path,
//! in the userinfo and after a `#`, each URL wrong in some way; no error
//! (`Display` or `Debug`) contains the secret. And no configuration that
//! holds one prints it.

use ferry_core::raw::ParsedUrl;
use ferry_core::{Error, Secret};

const SECRET: &str = "hunter2";

/// URLs that must fail to parse, each with the secret somewhere in it.
fn bad_urls() -> Vec<String> {
    let mut out = Vec::new();
    for scheme in ["tcp", "mooncake", "nixl", "verbs", "TCP", "t cp", ""] {
        let s = if scheme.is_empty() {
            String::new()
        } else {
            format!("{scheme}://")
        };
        for host in ["h:1", ""] {
            out.extend([
                // In the query: plain, other secret-like keys, encoded
                // keys, repeated, upper case, with another parameter wrong.
                format!("{s}{host}?secret={SECRET}&bogus=1"),
                format!("{s}{host}?password={SECRET}&bogus=1"),
                format!("{s}{host}?token={SECRET}&port=x"),
                format!("{s}{host}?%73ecret={SECRET}&connections=x"),
                format!("{s}{host}?s%65cret={SECRET}&secret={SECRET}"),
                format!("{s}{host}?SECRET={SECRET}&secret={SECRET}"),
                format!("{s}{host}?secret={SECRET}&timeout_ms=soon"),
                format!("{s}{host}?secret={SECRET}&port=%zz"),
                // A malformed escape inside the secret (quoting the escape
                // would quote part of it).
                format!("{s}{host}?secret={SECRET}%+5"),
                format!("{s}{host}?secret=%G1{SECRET}"),
                format!("{s}{host}?secret={SECRET}%4"),
                format!("{s}{host}?password={SECRET}%"),
                // In the path, the userinfo, the fragment.
                format!("{s}{host}/p?secret={SECRET}"),
                format!("{s}{host}/{SECRET}"),
                format!("{s}{host}/{SECRET}?bogus=1"),
                format!("{s}u:{SECRET}@{host}"),
                format!("{s}u:{SECRET}@{host}?bogus=1"),
                format!("{s}{SECRET}@{host}"),
                format!("{s}{host}?bogus=1#{SECRET}"),
                format!("{s}{host}?secret=ab#{SECRET}"),
            ]);
        }
        out.push(format!("{s}[::1?secret={SECRET}"));
    }
    out
}

/// Runs `parse` on every bad URL: no error quotes the secret; returns how
/// many were refused.
fn check<T>(what: &str, parse: impl Fn(&str) -> Result<T, Error>) -> usize {
    let mut refused = 0;
    for url in bad_urls() {
        if let Err(e) = parse(&url) {
            refused += 1;
            let text = format!("{e} {e:?}");
            assert!(!text.contains(SECRET), "{what}: {url:?} -> {text}");
        }
    }
    refused
}

#[test]
fn no_parser_quotes_a_secret() {
    let total = bad_urls().len();
    let counts = [
        ("facade", check("facade", ferry::EngineConfig::from_url)),
        ("tcp", check("tcp", ferry_tcp::TcpConfig::from_url)),
        (
            "mooncake",
            check("mooncake", ferry_mooncake::MooncakeConfig::from_url),
        ),
        ("nixl", check("nixl", ferry_nixl::NixlConfig::from_url)),
        ("verbs", check("verbs", ferry_verbs::VerbsConfig::from_url)),
        (
            "ParsedUrl",
            check("ParsedUrl", |u| ParsedUrl::parse(u)?.finish()),
        ),
    ];
    // Every URL is wrong for every parser: each refuses all of them.
    for (what, refused) in counts {
        assert_eq!(refused, total, "{what} accepted some of the bad URLs");
    }
}

#[test]
fn typed_getters_never_quote_a_secret_like_value() {
    for url in [format!(
        "x://?secret={SECRET}&password={SECRET}&token={SECRET}&s%65cret_file={SECRET}"
    )] {
        let mut u = ParsedUrl::parse(&url).unwrap();
        let errors = [
            u.take::<u64>("secret").unwrap_err(),
            u.take_bool("password").unwrap_err(),
            u.take_duration_ms("token").unwrap_err(),
            u.take_with("secret_file", "short", |_| None::<()>)
                .unwrap_err(),
        ];
        for e in errors {
            let text = format!("{e} {e:?}");
            assert!(!text.contains(SECRET), "{url} -> {text}");
        }
    }
}

#[test]
fn no_configuration_prints_its_secret() {
    let tcp =
        ferry_tcp::TcpConfig::from_url(&format!("tcp://127.0.0.1:0?secret={SECRET}")).unwrap();
    let verbs = ferry_verbs::VerbsConfig::from_url(&format!("verbs://?secret={SECRET}")).unwrap();
    let facade =
        ferry::EngineConfig::from_url(&format!("tcp://127.0.0.1:0?s%65cret={SECRET}")).unwrap();
    let built = ferry_tcp::TcpConfig::builder()
        .secret(Secret::new(SECRET))
        .build()
        .unwrap();
    let parsed = ParsedUrl::parse(&format!("tcp://u:{SECRET}@h/{SECRET}?secret={SECRET}")).unwrap();
    let secret = Secret::new(SECRET);
    for text in [
        format!("{tcp:?}"),
        format!("{tcp:#?}"),
        format!("{verbs:?}"),
        format!("{facade:?}"),
        format!("{built:?}"),
        format!("{parsed:?}"),
        format!("{secret} {secret:?} {secret:#?}"),
    ] {
        assert!(!text.contains(SECRET), "{text}");
    }
    assert!(format!("{tcp:?}").contains("<redacted>"));
    assert_eq!(tcp.secret.as_ref().map(Secret::expose), Some(SECRET));
    assert_eq!(verbs.secret.as_ref().map(Secret::expose), Some(SECRET));
}
