//! [`ParsedUrl`]: the one parser of Ferry's configuration URLs, used by
//! every backend and by the facade.

use std::fmt;
use std::net::Ipv6Addr;
use std::str::FromStr;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::redact::{is_secret_key, redact_url};
use crate::secret::Secret;

/// A configuration URL split into its parts, with its query decoded.
/// `Debug` shows the redacted URL and the keys not yet taken, never a
/// value.
///
/// # Grammar
///
/// `scheme://[userinfo@]authority[/path][?query]`
///
/// - **scheme**: a letter, then letters, digits, `+`, `-` or `.`; compared
///   in lower case (`TCP://` is `tcp://`).
/// - **userinfo** (`user:pass@`): split off and kept as a [`Secret`]; no
///   backend takes one, so [`ParsedUrl::finish`] refuses it unless the
///   backend took it ([`ParsedUrl::take_userinfo`]).
/// - **authority**: what comes before the first `/` or `?` (`host:port`,
///   `[::1]:7000`, a device name, or nothing); percent-decoded, `+` kept.
///   [`ParsedUrl::host_port`] splits `host:port`.
/// - **path**: from the first `/` before the query, as written; a path
///   other than `/` is refused by [`ParsedUrl::finish`] unless taken.
/// - **query**: `key=value` pairs separated by `&` (empty pairs, as in
///   `a=1&&b=2&`, are skipped). Keys and values are percent-decoded
///   strictly: every `%` must be followed by two hex digits (`%+5`, `%G1`
///   and a truncated `%4` are [`Error::InvalidArgument`] naming the key) and
///   the result must be UTF-8. `+` decodes to a space, as in
///   `application/x-www-form-urlencoded` (what every Ferry parser did before
///   this one); a literal `+` is written `%2B`. Keys are case-sensitive and
///   compared after decoding, so `s%65cret=…` is the key `secret`, and a key
///   given twice however it is spelled (`port=1&p%6Frt=2`) is refused
///   naming it. A key without `=` (a *bare* key, `?strict`) has no value:
///   [`ParsedUrl::take_bool`] reads it as `true`, the other getters refuse
///   it; `key=` has the empty value.
/// - **fragment** (`#…`): refused. No Ferry URL takes one, and silently
///   dropping it would cut a value that contains an unencoded `#` (a secret
///   `ab#cd` would become `ab`); write `#` in a value as `%23`.
///
/// # Use
///
/// A backend parses once, takes each key it knows with a typed getter
/// (which removes it), then calls [`ParsedUrl::finish`], which refuses
/// whatever is left, naming it and listing every key that was asked for.
/// The facade takes Ferry's own keys first and hands the same `ParsedUrl`
/// to the backend. Every message quotes the URL only through
/// [`crate::raw::redact_url`], and never quotes the value of a secret-like
/// key ([`crate::raw::is_secret_key`]).
///
/// ```
/// # fn main() -> ferry_core::Result<()> {
/// use ferry_core::raw::ParsedUrl;
///
/// let mut url = ParsedUrl::parse("demo://host:7?count=3&fast&name=a%20b+c")?;
/// assert_eq!(url.scheme(), "demo");
/// assert_eq!(url.host_port()?, ("host", Some(7)));
/// let count: u32 = url.take("count")?.unwrap_or(1);
/// let fast = url.take_bool("fast")?.unwrap_or(false);
/// let name = url.take_str("name")?;
/// let secret = url.take_secret("secret")?; // absent: None
/// url.finish()?; // nothing left over
/// assert_eq!((count, fast, name.as_deref(), secret), (3, true, Some("a b c"), None));
///
/// let mut url = ParsedUrl::parse("demo://?count=3&colour=blue")?;
/// url.take::<u32>("count")?;
/// let e = url.finish().unwrap_err().to_string();
/// assert!(e.contains("`colour`") && e.contains("known: count"), "{e}");
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct ParsedUrl {
    scheme: String,
    userinfo: Option<Secret>,
    authority: String,
    path: String,
    path_taken: bool,
    params: Vec<Param>,
    /// Every key a getter asked for, in order: the "known" list of
    /// [`ParsedUrl::finish`].
    known: Vec<String>,
    shown: String,
    label: String,
}

#[derive(Clone)]
struct Param {
    key: String,
    /// `None`: a bare key (no `=`).
    value: Option<String>,
    taken: bool,
    /// The pair as written (percent-encoded), for
    /// [`ParsedUrl::shown_params`].
    raw_key: String,
    raw_value: Option<String>,
}

impl Param {
    /// `key=value` as written, the value hidden (`…`) if the key is
    /// secret-like.
    fn shown(&self) -> String {
        match &self.raw_value {
            None => self.raw_key.clone(),
            Some(_) if is_secret_key(&self.key) => format!("{}=…", self.raw_key),
            Some(v) => format!("{}={v}", self.raw_key),
        }
    }
}

/// Percent-encodes everything but ASCII letters, digits and `-._~`.
fn encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn invalid(msg: String) -> Error {
    Error::InvalidArgument(msg)
}

/// Why a component did not decode.
enum Bad {
    /// The malformed escape as written (up to three characters).
    Escape(String),
    /// The bytes decoded are not UTF-8.
    Utf8,
}

impl Bad {
    /// The reason, quoting the escape only when `show` is set.
    fn describe(&self, show: bool) -> String {
        match self {
            Bad::Escape(e) if show => format!(
                "malformed percent-escape {e:?} (a `%` must be followed by two hex digits; \
                 write `%` itself as %25)"
            ),
            Bad::Escape(_) => "a malformed percent-escape (a `%` must be followed by two hex \
                               digits; write `%` itself as %25)"
                .to_owned(),
            Bad::Utf8 => "bytes that are not UTF-8 once percent-decoded".to_owned(),
        }
    }
}

fn hex(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

/// Strict percent-decoding; `+` is a space where `plus_is_space`.
fn decode(s: &str, plus_is_space: bool) -> std::result::Result<String, Bad> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' => match (
                b.get(i + 1).and_then(|&c| hex(c)),
                b.get(i + 2).and_then(|&c| hex(c)),
            ) {
                (Some(h), Some(l)) => {
                    out.push(h << 4 | l);
                    i += 3;
                }
                _ => {
                    let end = (i + 3).min(b.len());
                    return Err(Bad::Escape(
                        String::from_utf8_lossy(&b[i..end]).into_owned(),
                    ));
                }
            },
            b'+' if plus_is_space => {
                out.push(b' ');
                i += 1;
            }
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8(out).map_err(|_| Bad::Utf8)
}

fn valid_scheme(s: &str) -> bool {
    let mut chars = s.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
}

/// What [`ParsedUrl::take`] says a value should have been.
fn expected<T>() -> String {
    let name = std::any::type_name::<T>();
    match name.rsplit("::").next().unwrap_or(name) {
        "u8" => "an integer 0..=255".to_owned(),
        "u16" => "an integer 0..=65535".to_owned(),
        "u32" => format!("an integer 0..={}", u32::MAX),
        "u64" | "u128" | "usize" => "a non-negative integer".to_owned(),
        "i8" | "i16" | "i32" | "i64" | "i128" | "isize" => "an integer".to_owned(),
        "f32" | "f64" => "a number".to_owned(),
        "bool" => "true or false".to_owned(),
        "SocketAddr" => "a socket address such as 127.0.0.1:0 or [::1]:0".to_owned(),
        "IpAddr" => "an IP address".to_owned(),
        short => format!("a valid {short}"),
    }
}

impl ParsedUrl {
    /// Splits and decodes `url` (see [`ParsedUrl`]).
    ///
    /// Errors ([`Error::InvalidArgument`], the URL quoted redacted): no
    /// `scheme://`, a malformed scheme, a fragment, a malformed
    /// percent-escape or non-UTF-8 text in the authority or in a key or
    /// value (naming the key; the escape is quoted unless the key is
    /// secret-like), a key with no name (`=x`), a key given twice (named).
    pub fn parse(url: &str) -> Result<ParsedUrl> {
        let shown = redact_url(url);
        let Some((scheme, rest)) = url.split_once("://") else {
            return Err(invalid(format!(
                "URL {shown:?} has no scheme; expected SCHEME://… (tcp://, mooncake://, verbs://, \
                 nixl://, …)"
            )));
        };
        if !valid_scheme(scheme) {
            return Err(invalid(format!(
                "URL {shown:?} has a malformed scheme (a letter, then letters, digits, `+`, `-` \
                 or `.`)"
            )));
        }
        let scheme = scheme.to_ascii_lowercase();
        let label = format!("{scheme} URL");
        if rest.contains('#') {
            return Err(invalid(format!(
                "{label} {shown:?} has a fragment (`#…`), which no Ferry URL takes; write a `#` \
                 inside a value as %23"
            )));
        }
        let (before_query, query) = match rest.split_once('?') {
            Some((b, q)) => (b, q),
            None => (rest, ""),
        };
        let (authority, path) = match before_query.find('/') {
            Some(i) => (&before_query[..i], &before_query[i..]),
            None => (before_query, ""),
        };
        let (userinfo, authority) = match authority.rsplit_once('@') {
            Some((u, a)) => (Some(Secret::new(u)), a),
            None => (None, authority),
        };
        let authority = decode(authority, false).map_err(|e| {
            invalid(format!(
                "{label} {shown:?}: the address part has {}",
                e.describe(true)
            ))
        })?;
        let mut params: Vec<Param> = Vec::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (raw_key, raw_value) = match pair.split_once('=') {
                Some((k, v)) => (k, Some(v)),
                None => (pair, None),
            };
            let key = decode(raw_key, true).map_err(|e| {
                invalid(format!(
                    "{label} {shown:?}: the parameter name {raw_key:?} has {}",
                    e.describe(true)
                ))
            })?;
            if key.is_empty() {
                return Err(invalid(format!(
                    "{label} {shown:?}: a parameter has no name (`=…`)"
                )));
            }
            let value = match raw_value {
                None => None,
                Some(v) => Some(decode(v, true).map_err(|e| {
                    invalid(format!(
                        "{label} parameter `{key}`: the value has {}",
                        e.describe(!is_secret_key(&key))
                    ))
                })?),
            };
            if params.iter().any(|p| p.key == key) {
                return Err(invalid(format!(
                    "{label} {shown:?}: parameter `{key}` given twice"
                )));
            }
            params.push(Param {
                key,
                value,
                taken: false,
                raw_key: raw_key.to_owned(),
                raw_value: raw_value.map(str::to_owned),
            });
        }
        Ok(ParsedUrl {
            scheme,
            userinfo,
            authority,
            path: path.to_owned(),
            path_taken: false,
            params,
            known: Vec::new(),
            shown,
            label,
        })
    }

    /// The scheme, in lower case.
    pub fn scheme(&self) -> &str {
        &self.scheme
    }

    /// The authority (`host:port`, a device name, …), percent-decoded;
    /// empty if the URL has none (`mooncake://?…`).
    pub fn authority(&self) -> &str {
        &self.authority
    }

    /// The path as written (`""` when there is none; `"/"` for
    /// `tcp://h:1/`). [`ParsedUrl::finish`] refuses a path other than `/`
    /// unless [`ParsedUrl::take_path`] took it.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// Takes the path (so that [`ParsedUrl::finish`] accepts it).
    pub fn take_path(&mut self) -> String {
        self.path_taken = true;
        self.path.clone()
    }

    /// Takes the userinfo (`user:pass@`), if any, so that
    /// [`ParsedUrl::finish`] accepts it.
    pub fn take_userinfo(&mut self) -> Option<Secret> {
        self.userinfo.take()
    }

    /// The URL with its secrets hidden ([`crate::raw::redact_url`]): the
    /// only form of it a message may quote.
    pub fn shown(&self) -> &str {
        &self.shown
    }

    /// `"SCHEME URL"`, how messages name the URL (`tcp URL parameter …`).
    pub fn label(&self) -> &str {
        &self.label
    }

    /// Splits the authority into host and port: `h:7000` gives `("h",
    /// Some(7000))`, `[::1]:7000` gives `("[::1]", Some(7000))` (brackets
    /// kept), `h` and `h:` give `("h", None)`.
    ///
    /// Errors ([`Error::InvalidArgument`]): an unclosed `[`, a bracketed
    /// host that is not an IPv6 address, an IPv6 address without brackets,
    /// a port that is not a number 0..=65535.
    pub fn host_port(&self) -> Result<(&str, Option<u16>)> {
        let (label, shown) = (&self.label, &self.shown);
        let a = self.authority.as_str();
        let (host, port) = if let Some(rest) = a.strip_prefix('[') {
            let end = rest.find(']').ok_or_else(|| {
                invalid(format!("{label} {shown:?}: unclosed `[` in the address"))
            })?;
            if Ipv6Addr::from_str(&rest[..end]).is_err() {
                return Err(invalid(format!(
                    "{label} {shown:?}: {:?} in brackets is not an IPv6 address",
                    &rest[..end]
                )));
            }
            let port = match &rest[end + 1..] {
                "" => None,
                p => Some(p.strip_prefix(':').ok_or_else(|| {
                    invalid(format!(
                        "{label} {shown:?}: expected `:PORT` after the bracketed address"
                    ))
                })?),
            };
            (&a[..end + 2], port)
        } else {
            match a.split_once(':') {
                Some((_, p)) if p.contains(':') => {
                    return Err(invalid(format!(
                        "{label} {shown:?}: an IPv6 address goes in brackets ([::1]:7000)"
                    )))
                }
                Some((h, p)) => (h, Some(p)),
                None => (a, None),
            }
        };
        let port = match port {
            None | Some("") => None,
            Some(p) => Some(
                p.parse::<u16>()
                    .ok()
                    .filter(|_| p.bytes().all(|b| b.is_ascii_digit()))
                    .ok_or_else(|| {
                        invalid(format!(
                            "{label} {shown:?}: port {p:?} is not a number 0..=65535"
                        ))
                    })?,
            ),
        };
        Ok((host, port))
    }

    /// Adds the parameter `key=value` as if the URL had it (for tools that
    /// combine a URL with settings of their own, such as `ferry serve
    /// --secret-file`), without a URL string being written: refused
    /// ([`Error::InvalidArgument`]) if the URL already has `key`. The
    /// redacted form ([`ParsedUrl::shown`]) gains it, hidden if `key` is
    /// secret-like.
    pub fn insert(&mut self, key: &str, value: &str) -> Result<()> {
        if key.is_empty() {
            return Err(invalid(format!("{}: a parameter needs a name", self.label)));
        }
        if self.params.iter().any(|p| p.key == key) {
            return Err(invalid(format!(
                "{} {:?} already has the parameter `{key}`",
                self.label, self.shown
            )));
        }
        let param = Param {
            key: key.to_owned(),
            value: Some(value.to_owned()),
            taken: false,
            raw_key: encode(key),
            raw_value: Some(encode(value)),
        };
        if !self.shown.contains('?') {
            self.shown.push('?');
        } else if !(self.shown.ends_with('?') || self.shown.ends_with('&')) {
            self.shown.push('&');
        }
        self.shown.push_str(&param.shown());
        self.params.push(param);
        Ok(())
    }

    /// Every parameter (taken or not) in URL order: its decoded key and
    /// the pair as written, `key=…` for a secret-like key (the pieces of
    /// [`ParsedUrl::shown`], to print a URL with some parameters left out).
    pub fn shown_params(&self) -> impl Iterator<Item = (&str, String)> + '_ {
        self.params.iter().map(|p| (p.key.as_str(), p.shown()))
    }

    /// Whether `key` is present and not yet taken.
    pub fn contains(&self, key: &str) -> bool {
        self.params.iter().any(|p| !p.taken && p.key == key)
    }

    /// The decoded keys not yet taken, in URL order.
    pub fn keys(&self) -> impl Iterator<Item = &str> + '_ {
        self.params
            .iter()
            .filter(|p| !p.taken)
            .map(|p| p.key.as_str())
    }

    fn note(&mut self, key: &str) {
        if !self.known.iter().any(|k| k == key) {
            self.known.push(key.to_owned());
        }
    }

    /// Takes `key`: `None` if absent, `Some(None)` for a bare key,
    /// `Some(Some(value))` otherwise. Every getter goes through it (and so
    /// adds `key` to the list [`ParsedUrl::finish`] names).
    pub fn take_value(&mut self, key: &str) -> Option<Option<String>> {
        self.note(key);
        let p = self.params.iter_mut().find(|p| !p.taken && p.key == key)?;
        p.taken = true;
        Some(p.value.take())
    }

    /// Takes `key` as text (`key=` gives `""`; a bare key is refused).
    pub fn take_str(&mut self, key: &str) -> Result<Option<String>> {
        match self.take_value(key) {
            None => Ok(None),
            Some(Some(v)) => Ok(Some(v)),
            Some(None) => Err(invalid(format!(
                "{} parameter `{key}` has no value (expected `{key}=…`)",
                self.label
            ))),
        }
    }

    /// Takes `key` and converts it with `parse`; `None` from `parse` is an
    /// error saying the value is not `expected` (see
    /// [`ParsedUrl::bad_value`]).
    pub fn take_with<T>(
        &mut self,
        key: &str,
        expected: &str,
        parse: impl FnOnce(&str) -> Option<T>,
    ) -> Result<Option<T>> {
        let Some(v) = self.take_str(key)? else {
            return Ok(None);
        };
        match parse(&v) {
            Some(t) => Ok(Some(t)),
            None => Err(self.bad_value(key, &v, expected)),
        }
    }

    /// Takes `key` parsed with [`FromStr`]; the error names the key, the
    /// value (unless the key is secret-like) and the type expected.
    pub fn take<T: FromStr>(&mut self, key: &str) -> Result<Option<T>> {
        self.take_with(key, &expected::<T>(), |v| v.parse().ok())
    }

    /// Takes `key` as a boolean: `1`/`0`, `true`/`false`, `yes`/`no`,
    /// `on`/`off` in any case; a bare key (`?strict`) is `true`.
    pub fn take_bool(&mut self, key: &str) -> Result<Option<bool>> {
        match self.take_value(key) {
            None => Ok(None),
            Some(None) => Ok(Some(true)),
            Some(Some(v)) => match v.to_ascii_lowercase().as_str() {
                "1" | "true" | "yes" | "on" => Ok(Some(true)),
                "0" | "false" | "no" | "off" => Ok(Some(false)),
                _ => Err(self.bad_value(key, &v, "a boolean (1/0, true/false, yes/no, on/off)")),
            },
        }
    }

    /// Takes `key` as a whole number of milliseconds.
    pub fn take_duration_ms(&mut self, key: &str) -> Result<Option<Duration>> {
        self.take_with(key, "a whole number of milliseconds", |v| {
            v.parse().ok().map(Duration::from_millis)
        })
    }

    /// Takes `key` as a whole number of microseconds.
    pub fn take_duration_us(&mut self, key: &str) -> Result<Option<Duration>> {
        self.take_with(key, "a whole number of microseconds", |v| {
            v.parse().ok().map(Duration::from_micros)
        })
    }

    /// Takes `key` as a comma-separated list, items trimmed, empty items
    /// dropped (`a, b,,c` gives `a`, `b`, `c`).
    pub fn take_list(&mut self, key: &str) -> Result<Option<Vec<String>>> {
        Ok(self.take_str(key)?.map(|v| {
            v.split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(str::to_owned)
                .collect()
        }))
    }

    /// Takes `key` as a [`Secret`]; an empty value (or a bare key) is
    /// refused. No message ever quotes it.
    pub fn take_secret(&mut self, key: &str) -> Result<Option<Secret>> {
        match self.take_value(key) {
            None => Ok(None),
            Some(Some(v)) if !v.is_empty() => Ok(Some(Secret::new(v))),
            Some(_) => Err(invalid(format!(
                "{} parameter `{key}` is empty (a shared secret must not be)",
                self.label
            ))),
        }
    }

    /// The error for a value of `key` that is not `expected`: names the
    /// key, the value (unless the key is secret-like, then never) and what
    /// was expected. For backends' own checks, in the same words.
    pub fn bad_value(&self, key: &str, value: &str, expected: &str) -> Error {
        if is_secret_key(key) {
            invalid(format!(
                "{} parameter `{key}`: the value given is not {expected}",
                self.label
            ))
        } else {
            invalid(format!(
                "{} parameter `{key}`: {value:?} is not {expected}",
                self.label
            ))
        }
    }

    /// For a backend whose URL carries everything in parameters
    /// (`mooncake://?…`, `nixl://?…`): refuses another scheme, and an
    /// address or a path, with a message quoting the URL (secrets hidden)
    /// and `example`, a URL of the right shape.
    pub fn expect_params_only(&self, scheme: &str, example: &str) -> Result<()> {
        let shown = &self.shown;
        if self.scheme != scheme {
            return Err(invalid(format!(
                "URL {shown:?} is not a {scheme}:// URL (scheme {:?})",
                self.scheme
            )));
        }
        if !self.authority.is_empty() || !(self.path.is_empty() || self.path == "/") {
            return Err(invalid(format!(
                "{scheme} URL {shown:?}: give everything as parameters, e.g. {example}"
            )));
        }
        Ok(())
    }

    /// Ends parsing: refuses a userinfo or a path (other than `/`) that was
    /// not taken, and the first key that was not taken, naming it and
    /// listing every key a getter asked for (the keys this backend knows).
    pub fn finish(self) -> Result<()> {
        let (label, shown) = (&self.label, &self.shown);
        if self.userinfo.is_some() {
            return Err(invalid(format!(
                "{label} {shown:?} has user information (`…@` before the address), which it \
                 does not take"
            )));
        }
        if !(self.path_taken || self.path.is_empty() || self.path == "/") {
            return Err(invalid(format!(
                "{label} {shown:?} has a path, which it does not take"
            )));
        }
        if let Some(p) = self.params.iter().find(|p| !p.taken) {
            let known = if self.known.is_empty() {
                "it takes none".to_owned()
            } else {
                format!("known: {}", self.known.join(", "))
            };
            return Err(invalid(format!(
                "unknown {label} parameter `{}` ({known})",
                p.key
            )));
        }
        Ok(())
    }
}

impl fmt::Debug for ParsedUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ParsedUrl")
            .field("url", &self.shown)
            .field("keys", &self.keys().collect::<Vec<_>>())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(r: Result<impl fmt::Debug>) -> String {
        match r {
            Err(Error::InvalidArgument(m)) => m,
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
    }

    #[test]
    fn splits_every_part() {
        let mut u = ParsedUrl::parse("TCP://u:p@h%41:7/x/y?a=1&b=&c&d=x%3Dy").unwrap();
        assert_eq!(u.scheme(), "tcp");
        assert_eq!(u.label(), "tcp URL");
        assert_eq!(u.authority(), "hA:7");
        assert_eq!(u.host_port().unwrap(), ("hA", Some(7)));
        assert_eq!(u.path(), "/x/y");
        assert_eq!(u.keys().collect::<Vec<_>>(), ["a", "b", "c", "d"]);
        assert_eq!(u.take_str("a").unwrap().as_deref(), Some("1"));
        assert_eq!(u.take_str("b").unwrap().as_deref(), Some(""));
        assert!(u.contains("c"));
        assert_eq!(u.take_value("c"), Some(None));
        assert!(!u.contains("c"));
        assert_eq!(u.take_str("d").unwrap().as_deref(), Some("x=y"));
        assert_eq!(u.take_str("d").unwrap(), None, "taken once");
        assert!(err(u.clone().finish()).contains("user information"));
        assert_eq!(u.take_userinfo().unwrap().expose(), "u:p");
        assert!(err(u.clone().finish()).contains("has a path"));
        assert_eq!(u.take_path(), "/x/y");
        u.finish().unwrap();
    }

    #[test]
    fn empty_query_and_empty_pairs() {
        for url in ["tcp://h", "tcp://h?", "tcp://h/?", "tcp://h?&&", "tcp://"] {
            let u = ParsedUrl::parse(url).unwrap();
            assert_eq!(u.keys().count(), 0, "{url}");
            u.finish().unwrap();
        }
        let u = ParsedUrl::parse("tcp://h?a=1&&b=2&").unwrap();
        assert_eq!(u.keys().collect::<Vec<_>>(), ["a", "b"]);
        assert_eq!(ParsedUrl::parse("mooncake://?x=1").unwrap().authority(), "");
    }

    #[test]
    fn percent_decoding_of_keys_and_values() {
        let mut u =
            ParsedUrl::parse("x://?s%65cret=a%26b%3D&na+me=%2B+%20&%E2%82%AC=%e2%82%ac").unwrap();
        assert_eq!(u.take_secret("secret").unwrap().unwrap().expose(), "a&b=");
        assert_eq!(u.take_str("na me").unwrap().as_deref(), Some("+  "));
        assert_eq!(u.take_str("€").unwrap().as_deref(), Some("€"));
        u.finish().unwrap();
        // `+` is literal outside the query.
        assert_eq!(ParsedUrl::parse("x://a+b").unwrap().authority(), "a+b");
    }

    #[test]
    fn malformed_escapes_are_refused_naming_the_key() {
        for (url, key, escape) in [
            ("x://?port=%+5", "port", "%+5"),
            ("x://?port=1%G1", "port", "%G1"),
            ("x://?port=%4", "port", "%4"),
            ("x://?port=%", "port", "%"),
            ("x://?a=1&port=%-1", "port", "%-1"),
        ] {
            let m = err(ParsedUrl::parse(url));
            assert!(m.contains(&format!("`{key}`")), "{url}: {m}");
            assert!(m.contains(&format!("{escape:?}")), "{url}: {m}");
            assert!(m.contains("percent-escape"), "{url}: {m}");
        }
        // In a key, in the address, and bytes that are not UTF-8.
        assert!(err(ParsedUrl::parse("x://?po%zzrt=1")).contains("\"po%zzrt\""));
        assert!(err(ParsedUrl::parse("x://h%2?a=1")).contains("address part"));
        assert!(err(ParsedUrl::parse("x://?name=%FF")).contains("not UTF-8"));
        // A secret's malformed value is not quoted, not even its escape.
        for url in [
            "x://?secret=hunter2%+5",
            "x://?s%65cret=%G1hunter2",
            "x://?password=ab%4",
        ] {
            let m = err(ParsedUrl::parse(url));
            assert!(
                !m.contains("hunter2") && !m.contains("%+5") && !m.contains("%G1"),
                "{m}"
            );
            assert!(!m.contains("ab%4") && !m.contains("\"%4\""), "{m}");
            assert!(m.contains("malformed percent-escape"), "{m}");
        }
    }

    #[test]
    fn duplicates_are_refused_naming_the_key() {
        for url in [
            "x://?port=1&port=2",
            "x://?port=1&p%6Frt=2",
            "x://?%70ort=1&port",
            "x://?port&port",
        ] {
            let m = err(ParsedUrl::parse(url));
            assert!(m.contains("parameter `port` given twice"), "{url}: {m}");
        }
        let m = err(ParsedUrl::parse("x://?secret=hunter2&s%65cret=hunter3"));
        assert!(m.contains("`secret` given twice"), "{m}");
        assert!(!m.contains("hunter"), "{m}");
        // Keys are case-sensitive: these are two keys.
        ParsedUrl::parse("x://?port=1&PORT=2").unwrap();
    }

    #[test]
    fn unknown_keys_are_refused_naming_them_and_the_known_ones() {
        let mut u = ParsedUrl::parse("x://?a=1&colour=blue").unwrap();
        assert_eq!(u.take::<u8>("a").unwrap(), Some(1));
        assert_eq!(u.take::<u8>("b").unwrap(), None);
        let m = err(u.finish());
        assert_eq!(m, "unknown x URL parameter `colour` (known: a, b)");
        let m = err(ParsedUrl::parse("x://?c").unwrap().finish());
        assert!(m.contains("`c`") && m.contains("it takes none"), "{m}");
    }

    #[test]
    fn typed_getters() {
        let mut u = ParsedUrl::parse(
            "x://?n=7&big=300&neg=-1&b1=YES&b0=off&bare&bad=maybe&ms=1500&us=7&l=a,%20b,,c&e=",
        )
        .unwrap();
        assert_eq!(u.take::<u64>("n").unwrap(), Some(7));
        let m = err(u.take::<u8>("big"));
        assert_eq!(
            m,
            "x URL parameter `big`: \"300\" is not an integer 0..=255"
        );
        assert!(err(u.take::<u64>("neg")).contains("not a non-negative integer"));
        assert_eq!(u.take_bool("b1").unwrap(), Some(true));
        assert_eq!(u.take_bool("b0").unwrap(), Some(false));
        assert_eq!(u.take_bool("bare").unwrap(), Some(true));
        assert_eq!(u.take_bool("absent").unwrap(), None);
        assert!(err(u.take_bool("bad")).contains("\"maybe\" is not a boolean"));
        assert_eq!(
            u.take_duration_ms("ms").unwrap(),
            Some(Duration::from_millis(1500))
        );
        assert_eq!(
            u.take_duration_us("us").unwrap(),
            Some(Duration::from_micros(7))
        );
        assert_eq!(u.take_list("l").unwrap().unwrap(), ["a", "b", "c"]);
        assert!(err(u.take_bool("e")).contains("\"\" is not a boolean"));
        u.finish().unwrap();
        // A bare key has no value for the other getters.
        let mut u = ParsedUrl::parse("x://?port&secret").unwrap();
        assert_eq!(
            err(u.take::<u16>("port")),
            "x URL parameter `port` has no value (expected `port=…`)"
        );
        assert!(err(u.take_secret("secret")).contains("`secret` is empty"));
        let mut u = ParsedUrl::parse("x://?secret=").unwrap();
        assert!(err(u.take_secret("secret")).contains("`secret` is empty"));
    }

    #[test]
    fn values_of_secret_keys_are_never_quoted() {
        let mut u = ParsedUrl::parse("x://?secret=hunter2&token=hunter2").unwrap();
        let m = err(u.take::<u32>("secret"));
        assert!(!m.contains("hunter2") && m.contains("`secret`"), "{m}");
        let m = err(u.take_bool("token"));
        assert!(!m.contains("hunter2"), "{m}");
        let m = u.bad_value("password", "hunter2", "short");
        assert!(!m.to_string().contains("hunter2"), "{m}");
        // Nor in Debug, which shows keys only.
        let u = ParsedUrl::parse("x://u:hunter2@h/hunter2?secret=hunter2&a=1").unwrap();
        let d = format!("{u:?}");
        assert!(!d.contains("hunter2"), "{d}");
    }

    #[test]
    fn structural_errors() {
        assert!(err(ParsedUrl::parse("127.0.0.1:0")).contains("no scheme"));
        assert!(err(ParsedUrl::parse("://x")).contains("malformed scheme"));
        assert!(err(ParsedUrl::parse("t cp://x")).contains("malformed scheme"));
        assert!(err(ParsedUrl::parse("1tcp://x")).contains("malformed scheme"));
        ParsedUrl::parse("a+b.c-d://x").unwrap();
        // Fragments are refused, and not quoted.
        let m = err(ParsedUrl::parse("tcp://h:1?secret=ab#hunter2"));
        assert!(m.contains("fragment") && !m.contains("hunter2"), "{m}");
        assert!(err(ParsedUrl::parse("tcp://h:1#x")).contains("fragment"));
        assert!(err(ParsedUrl::parse("tcp://h:1?=x")).contains("no name"));
    }

    #[test]
    fn inserted_parameters_are_parsed_and_shown_redacted() {
        let mut u = ParsedUrl::parse("tcp://h:1").unwrap();
        u.insert("secret", "a&b c+").unwrap();
        u.insert("tls", "require").unwrap();
        assert_eq!(u.shown(), "tcp://h:1?secret=…&tls=require");
        assert!(err(u.insert("tls", "on")).contains("already has the parameter `tls`"));
        let shown: Vec<_> = u.shown_params().collect();
        assert_eq!(
            shown,
            [
                ("secret", "secret=…".to_owned()),
                ("tls", "tls=require".to_owned())
            ]
        );
        assert_eq!(u.take_secret("secret").unwrap().unwrap().expose(), "a&b c+");
        assert_eq!(u.take_str("tls").unwrap().as_deref(), Some("require"));
        u.finish().unwrap();
        let mut u = ParsedUrl::parse("mooncake://?lib=/a%20b.so&s%65cret=x&bare").unwrap();
        u.insert("strict", "1").unwrap();
        assert_eq!(
            u.shown(),
            "mooncake://?lib=/a%20b.so&s%65cret=…&bare&strict=1"
        );
        let pairs: Vec<String> = u.shown_params().map(|(_, p)| p).collect();
        assert_eq!(pairs, ["lib=/a%20b.so", "s%65cret=…", "bare", "strict=1"]);
        let mut u = ParsedUrl::parse("tcp://h:1?").unwrap();
        u.insert("a", "1").unwrap();
        assert_eq!(u.shown(), "tcp://h:1?a=1");
    }

    #[test]
    fn hosts_and_ports() {
        let hp = |url: &str| {
            ParsedUrl::parse(url)
                .unwrap()
                .host_port()
                .map(|(h, p)| (h.to_owned(), p))
        };
        assert_eq!(hp("x://h:7000").unwrap(), ("h".to_owned(), Some(7000)));
        assert_eq!(hp("x://h").unwrap(), ("h".to_owned(), None));
        assert_eq!(hp("x://h:").unwrap(), ("h".to_owned(), None));
        assert_eq!(hp("x://[::1]:9").unwrap(), ("[::1]".to_owned(), Some(9)));
        assert_eq!(hp("x://[::1]").unwrap(), ("[::1]".to_owned(), None));
        assert_eq!(hp("x://").unwrap(), (String::new(), None));
        for (url, want) in [
            ("x://[::1:1", "unclosed"),
            ("x://[nope]:1", "not an IPv6 address"),
            ("x://[::1]x", "`:PORT`"),
            ("x://::1", "brackets"),
            ("x://h:70000", "not a number 0..=65535"),
            ("x://h:+1", "not a number"),
            ("x://h:x", "not a number"),
        ] {
            let m = err(hp(url));
            assert!(m.contains(want), "{url}: {m}");
        }
    }
}
