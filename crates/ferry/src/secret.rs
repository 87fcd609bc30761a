//! One way to give a shared secret, for every program.
//!
//! The TCP and verbs backends take a shared secret (`secret=`). A secret
//! written in a URL on a command line is visible to every user of the
//! machine (`/proc/PID/cmdline`), so programs take it from elsewhere, all
//! in the same way:
//!
//! | source | what it holds |
//! |---|---|
//! | `FERRY_SECRET` (environment) | the secret |
//! | `FERRY_SECRET_FILE` (environment) | the path of a file whose first line is the secret |
//! | `secret_file=PATH` (URL parameter) | the same, named in the URL (a path shows nothing) |
//! | `secret=` (URL parameter) | the secret itself: for URLs built in code; on a command line it is warned about |
//!
//! Exactly one source may give it: two (even the same value twice) is an
//! error naming both, never the value. The library itself reads no
//! environment: [`EngineConfig::from_url`](crate::EngineConfig::from_url)
//! resolves `secret_file=`; [`from_environment`] adds what the
//! environment gives, and `ferry serve`, `ferry bench`, `ferry caps` and
//! the Python package call it on every URL they open. A scheme that takes
//! no secret (`inproc`, `mooncake`, `nixl`) ignores the environment.

use std::path::{Path, PathBuf};

use ferry_core::raw::ParsedUrl;
use ferry_core::{Error, Result, Secret};

/// The environment variable that holds the secret.
pub const SECRET_ENV: &str = "FERRY_SECRET";
/// The environment variable that names a file holding the secret.
pub const SECRET_FILE_ENV: &str = "FERRY_SECRET_FILE";
/// The URL parameter that names a file holding the secret.
pub const SECRET_FILE_KEY: &str = "secret_file";

/// The schemes whose backends take `secret=` (`multi` passes it to its
/// transports that take one).
const TAKES_SECRET: &[&str] = &["tcp", "verbs", "multi"];

/// Whether the backend of `scheme` takes `secret=`.
pub(crate) fn takes_secret(scheme: &str) -> bool {
    TAKES_SECRET.contains(&scheme)
}

/// Reads a secret file: its first line (a trailing `\r` dropped). An
/// empty first line, or a file that cannot be read, is an error naming
/// the path (never the content).
pub fn read_secret_file(path: &Path) -> Result<Secret> {
    let text = Secret::new(std::fs::read_to_string(path).map_err(|e| {
        Error::InvalidArgument(format!("reading the secret file {}: {e}", path.display()))
    })?);
    let line = text
        .expose()
        .lines()
        .next()
        .unwrap_or("")
        .trim_end_matches('\r');
    if line.is_empty() {
        return Err(Error::InvalidArgument(format!(
            "the secret file {} is empty (its first line is the secret)",
            path.display()
        )));
    }
    Ok(Secret::new(line))
}

/// Whether `url` gives a secret itself (`secret=` or `secret_file=`, any
/// case).
pub fn url_has_secret(url: &ParsedUrl) -> bool {
    url.keys()
        .any(|k| k.eq_ignore_ascii_case("secret") || k.eq_ignore_ascii_case(SECRET_FILE_KEY))
}

/// Whether `url` has the secret itself written in it (`secret=`), which
/// on a command line every user of the machine can read.
pub fn url_shows_secret(url: &ParsedUrl) -> bool {
    url.keys().any(|k| k.eq_ignore_ascii_case("secret"))
}

/// Replaces `secret_file=PATH` in `url` by `secret=` with the file's
/// first line. Both in one URL is an error.
pub(crate) fn resolve_url_file(url: &mut ParsedUrl) -> Result<()> {
    if !url.contains(SECRET_FILE_KEY) {
        return Ok(());
    }
    if url_shows_secret(url) {
        return Err(two_ways(
            "`secret=` in the URL",
            "`secret_file=` in the URL",
        ));
    }
    let Some(path) = url.take_str(SECRET_FILE_KEY)? else {
        return Ok(());
    };
    let secret = read_secret_file(Path::new(&path))?;
    url.insert("secret", secret.expose())
}

/// Adds the secret the environment gives (`FERRY_SECRET`, or the file
/// `FERRY_SECRET_FILE` names) to `url`, for a scheme that takes one.
/// `Ok(true)` if it added one. An error if both variables are set, or if
/// the URL gives a secret too (see the [module](self) for the rule).
pub fn from_environment(url: &mut ParsedUrl) -> Result<bool> {
    from_sources(
        url,
        std::env::var(SECRET_ENV).ok(),
        std::env::var_os(SECRET_FILE_ENV).map(PathBuf::from),
    )
}

fn from_sources(
    url: &mut ParsedUrl,
    secret: Option<String>,
    file: Option<PathBuf>,
) -> Result<bool> {
    if !TAKES_SECRET.contains(&url.scheme()) {
        return Ok(false);
    }
    let secret = secret.filter(|s| !s.is_empty()).map(Secret::new);
    let file = file.filter(|p| !p.as_os_str().is_empty());
    let env = match (secret, file) {
        (None, None) => return Ok(false),
        (Some(_), Some(_)) => return Err(two_ways(SECRET_ENV, SECRET_FILE_ENV)),
        (Some(s), None) => (SECRET_ENV, s),
        (None, Some(p)) => (SECRET_FILE_ENV, read_secret_file(&p)?),
    };
    if url_has_secret(url) {
        return Err(two_ways("the URL (`secret=` or `secret_file=`)", env.0));
    }
    url.insert("secret", env.1.expose())?;
    Ok(true)
}

fn two_ways(a: &str, b: &str) -> Error {
    Error::InvalidArgument(format!(
        "a shared secret is given two ways, by {a} and by {b}; give it one way only"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn url(s: &str) -> ParsedUrl {
        ParsedUrl::parse(s).unwrap()
    }

    fn secret_of(mut u: ParsedUrl) -> Option<String> {
        u.take_secret("secret")
            .unwrap()
            .map(|s| s.expose().to_owned())
    }

    fn file(content: &str) -> (tempdir::Dir, PathBuf) {
        let d = tempdir::Dir::new();
        let p = d.0.join("secret");
        std::fs::write(&p, content).unwrap();
        (d, p)
    }

    /// A directory removed on drop (no crate for one test helper).
    mod tempdir {
        pub struct Dir(pub std::path::PathBuf);
        impl Dir {
            pub fn new() -> Dir {
                use std::sync::atomic::{AtomicU32, Ordering};
                static N: AtomicU32 = AtomicU32::new(0);
                let p = std::env::temp_dir().join(format!(
                    "ferry-secret-test-{}-{}",
                    std::process::id(),
                    N.fetch_add(1, Ordering::Relaxed)
                ));
                std::fs::create_dir_all(&p).unwrap();
                Dir(p)
            }
        }
        impl Drop for Dir {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.0);
            }
        }
    }

    #[test]
    fn each_source_alone_gives_the_secret() {
        let (_d, p) = file("from-file\r\nignored\n");
        let mut u = url("tcp://h:1");
        assert!(from_sources(&mut u, Some("from-env".into()), None).unwrap());
        assert_eq!(secret_of(u).as_deref(), Some("from-env"));
        let mut u = url("tcp://h:1");
        assert!(from_sources(&mut u, None, Some(p.clone())).unwrap());
        assert_eq!(secret_of(u).as_deref(), Some("from-file"));
        let mut u = url(&format!("verbs://?secret_file={}", p.display()));
        resolve_url_file(&mut u).unwrap();
        assert_eq!(secret_of(u).as_deref(), Some("from-file"));
        // Nothing anywhere: nothing added.
        let mut u = url("tcp://h:1");
        assert!(!from_sources(&mut u, None, None).unwrap());
        assert!(!from_sources(&mut u, Some(String::new()), None).unwrap());
        assert_eq!(secret_of(u), None);
    }

    #[test]
    fn two_sources_are_refused_naming_them_not_the_value() {
        let (_d, p) = file("s3cret-file");
        let msg = |r: Result<bool>| match r {
            Err(Error::InvalidArgument(m)) => m,
            other => panic!("expected a refusal, got {other:?}"),
        };
        let m = msg(from_sources(
            &mut url("tcp://h:1"),
            Some("s3cret-env".into()),
            Some(p.clone()),
        ));
        assert!(m.contains(SECRET_ENV) && m.contains(SECRET_FILE_ENV), "{m}");
        // The same value twice is still two ways.
        let m = msg(from_sources(
            &mut url("tcp://h:1?secret=s3cret-env"),
            Some("s3cret-env".into()),
            None,
        ));
        assert!(m.contains("URL") && m.contains(SECRET_ENV), "{m}");
        let m = msg(from_sources(
            &mut url("tcp://h:1?secret_file=/x"),
            Some("s3cret-env".into()),
            None,
        ));
        assert!(m.contains("URL"), "{m}");
        let mut u = url(&format!("tcp://h:1?secret=a&secret_file={}", p.display()));
        let m = match resolve_url_file(&mut u) {
            Err(Error::InvalidArgument(m)) => m,
            other => panic!("{other:?}"),
        };
        assert!(m.contains("secret_file"), "{m}");
        assert!(!m.contains("s3cret"), "no secret in a message: {m}");
    }

    #[test]
    fn bad_files_are_errors_naming_the_path() {
        let (_d, p) = file("\nsecond line");
        let e = read_secret_file(&p).unwrap_err().to_string();
        assert!(
            e.contains("is empty") && e.contains(&p.display().to_string()),
            "{e}"
        );
        let missing = p.with_file_name("missing");
        let e = read_secret_file(&missing).unwrap_err().to_string();
        assert!(e.contains("missing"), "{e}");
    }

    #[test]
    fn schemes_without_a_secret_ignore_the_environment() {
        for s in ["inproc://", "mooncake://", "nixl://"] {
            let mut u = url(s);
            assert!(
                !from_sources(&mut u, Some("x".into()), None).unwrap(),
                "{s}"
            );
            assert_eq!(u.keys().count(), 0);
        }
    }

    #[test]
    fn the_shown_url_hides_the_added_secret() {
        let mut u = url("tcp://h:1?strict=1");
        from_sources(&mut u, Some("hunter2".into()), None).unwrap();
        assert!(!u.shown().contains("hunter2"), "{}", u.shown());
    }
}
