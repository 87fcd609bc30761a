//! Runs `ferry metadata-server` and speaks HTTP/1.1 to it over plain
//! `std::net::TcpStream`s, the way Mooncake's libcurl client does: the
//! protocol (GET/PUT/DELETE `PATH?key=K`), its status codes, percent-encoded
//! keys, `Expect: 100-continue`, keep-alive, the limits, the timeouts and the
//! shutdown on SIGINT/SIGTERM.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::process::{Child, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// Guards against a hung server or client; never a timing assertion.
const GUARD: Duration = Duration::from_secs(60);

mod common;
use common::ferry;

/// A running `ferry metadata-server`, killed on drop so a failed test leaves
/// no process behind.
struct Server {
    child: Child,
    /// `host:port` it listens on.
    addr: String,
    /// The metadata path, e.g. `/metadata`.
    path: String,
    stdout: BufReader<std::process::ChildStdout>,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    /// Starts the server on a free loopback port with `extra` arguments and
    /// reads the URL it prints.
    fn start(extra: &[&str]) -> Self {
        let mut child = ferry()
            .args(["metadata-server", "--listen", "127.0.0.1:0"])
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn ferry metadata-server");
        let mut stdout = BufReader::new(child.stdout.take().expect("stdout"));
        // Read on a thread, so a server that never prints fails the test
        // instead of hanging it.
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let r = stdout.read_line(&mut line);
            let _ = tx.send((r.map(|_| line), stdout));
        });
        let (line, stdout) = rx
            .recv_timeout(GUARD)
            .expect("the server printed no line within the guard time");
        let line = line.expect("read the URL line");
        let url = line
            .strip_suffix('\n')
            .and_then(|l| l.strip_prefix("metadata server listening on http://"))
            .unwrap_or_else(|| panic!("unexpected first line {line:?}"));
        let (addr, path) = url.split_at(url.find('/').expect("a path in the URL"));
        let server = Self {
            child,
            addr: addr.to_owned(),
            path: path.to_owned(),
            stdout,
        };
        assert!(
            server.addr.starts_with("127.0.0.1:") && !server.addr.ends_with(":0"),
            "not the bound port: {line:?}"
        );
        server
    }

    /// `PATH?key=` followed by `encoded_key` as given (already encoded).
    fn target(&self, encoded_key: &str) -> String {
        format!("{}?key={encoded_key}", self.path)
    }

    fn connect(&self) -> TcpStream {
        let s = TcpStream::connect(&self.addr).expect("connect");
        s.set_read_timeout(Some(GUARD)).expect("read timeout");
        s.set_write_timeout(Some(GUARD)).expect("write timeout");
        s
    }

    /// One request on a fresh connection (`Connection: close`).
    fn request(&self, method: &str, target: &str, headers: &[(&str, &str)], body: &[u8]) -> Reply {
        let mut s = self.connect();
        write_request(&mut s, method, target, headers, Some(body), true);
        read_reply(&mut BufReader::new(s), method == "HEAD")
    }

    fn put(&self, encoded_key: &str, value: &[u8]) -> Reply {
        self.request("PUT", &self.target(encoded_key), &[], value)
    }

    fn get(&self, encoded_key: &str) -> Reply {
        self.request("GET", &self.target(encoded_key), &[], b"")
    }

    fn delete(&self, encoded_key: &str) -> Reply {
        self.request("DELETE", &self.target(encoded_key), &[], b"")
    }

    /// Sends `signal` and waits (bounded) for the exit.
    #[cfg(unix)]
    fn signal_and_wait(&mut self, signal: nix::sys::signal::Signal) -> ExitStatus {
        let pid = nix::unistd::Pid::from_raw(i32::try_from(self.child.id()).expect("pid"));
        nix::sys::signal::kill(pid, signal).expect("send the signal");
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return status;
            }
            assert!(
                start.elapsed() < GUARD,
                "still running {GUARD:?} after {signal}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

#[derive(Debug)]
struct Reply {
    status: u16,
    /// Names in lower case.
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Reply {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// Writes a request head, and the body when given (`Content-Length` is set
/// from it unless `headers` set it).
fn write_request(
    s: &mut TcpStream,
    method: &str,
    target: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
    close: bool,
) {
    let mut head = format!("{method} {target} HTTP/1.1\r\nHost: metadata\r\n");
    if close {
        head.push_str("Connection: close\r\n");
    }
    let sets_length = headers.iter().any(|(n, _)| {
        n.eq_ignore_ascii_case("content-length") || n.eq_ignore_ascii_case("transfer-encoding")
    });
    if let (Some(b), false) = (body, sets_length) {
        head.push_str(&format!("Content-Length: {}\r\n", b.len()));
    }
    for (n, v) in headers {
        head.push_str(&format!("{n}: {v}\r\n"));
    }
    head.push_str("\r\n");
    let mut bytes = head.into_bytes();
    bytes.extend_from_slice(body.unwrap_or_default());
    s.write_all(&bytes).expect("write the request");
}

/// Reads one response (the server always sends `Content-Length`).
fn read_reply(r: &mut impl BufRead, head_request: bool) -> Reply {
    let mut line = String::new();
    r.read_line(&mut line).expect("read the status line");
    let status = line
        .strip_prefix("HTTP/1.1 ")
        .and_then(|rest| rest.get(..3))
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("bad status line {line:?}"));
    let mut headers = Vec::new();
    loop {
        line.clear();
        r.read_line(&mut line).expect("read a header");
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        let (n, v) = l.split_once(':').expect("a header line");
        headers.push((n.to_ascii_lowercase(), v.trim().to_owned()));
    }
    let mut reply = Reply {
        status,
        headers,
        body: Vec::new(),
    };
    if !head_request && status != 100 {
        let len: usize = reply
            .header("content-length")
            .expect("content-length")
            .parse()
            .expect("numeric content-length");
        reply.body = vec![0; len];
        r.read_exact(&mut reply.body).expect("read the body");
    }
    reply
}

/// Deterministic bytes covering every byte value.
fn pattern(len: usize) -> Vec<u8> {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

#[test]
fn put_then_get_returns_the_bytes_and_their_content_type() {
    let s = Server::start(&[]);
    let value = br#"{"name":"10.0.0.1:12345","protocol":"tcp","buffers":[]}"#;
    let r = s.request(
        "PUT",
        &s.target("k"),
        &[("Content-Type", "application/json")],
        value,
    );
    assert_eq!((r.status, r.text().as_str()), (200, "metadata updated\n"));
    let r = s.get("k");
    assert_eq!(r.status, 200);
    assert_eq!(r.body, value);
    assert_eq!(r.header("content-type"), Some("application/json"));

    // A PUT replaces the value; without a Content-Type it is served as bytes.
    assert_eq!(s.put("k", b"v2").status, 200);
    let r = s.get("k");
    assert_eq!((r.status, r.body.as_slice()), (200, &b"v2"[..]));
    assert_eq!(r.header("content-type"), Some("application/octet-stream"));

    // An empty value is a value.
    assert_eq!(s.put("empty", b"").status, 200);
    let r = s.get("empty");
    assert_eq!((r.status, r.body.len()), (200, 0));
}

#[test]
fn get_of_a_missing_key_is_404() {
    let s = Server::start(&[]);
    let r = s.get("mooncake%2Fram%2Fnobody");
    assert_eq!((r.status, r.text().as_str()), (404, "metadata not found\n"));
    assert_eq!(r.header("content-type"), Some("text/plain; charset=utf-8"));
}

#[test]
fn delete_removes_the_key_and_deleting_a_missing_key_is_404() {
    let s = Server::start(&[]);
    assert_eq!(s.put("k", b"v").status, 200);
    let r = s.delete("k");
    assert_eq!((r.status, r.text().as_str()), (200, "metadata deleted\n"));
    assert_eq!(s.get("k").status, 404);
    assert_eq!(s.delete("k").status, 404);
    // The key can be stored again.
    assert_eq!(s.put("k", b"v").status, 200);
    assert_eq!(s.get("k").body, b"v");
}

#[test]
fn binary_and_large_values_round_trip() {
    let s = Server::start(&[]);
    let every_byte: Vec<u8> = (0..=255u8).chain((0..=255u8).rev()).collect();
    assert_eq!(s.put("bin", &every_byte).status, 200);
    assert_eq!(s.get("bin").body, every_byte);

    let large = pattern(8 << 20);
    assert_eq!(s.put("large", &large).status, 200);
    let r = s.get("large");
    assert_eq!(r.status, 200);
    assert!(r.body == large, "the 8 MiB value came back changed");
}

#[test]
fn a_value_over_the_default_16_mib_is_413_before_its_body_is_sent() {
    let s = Server::start(&[]);
    // curl sends `Expect: 100-continue` for large bodies and waits: the
    // answer must come from the Content-Length alone.
    let mut c = s.connect();
    let too_long = ((16 << 20) + 1).to_string();
    write_request(
        &mut c,
        "PUT",
        &s.target("big"),
        &[("Content-Length", &too_long), ("Expect", "100-continue")],
        None,
        true,
    );
    let r = read_reply(&mut BufReader::new(c), false);
    assert_eq!(r.status, 413, "{}", r.text());
    assert!(r.text().contains("16777216"), "{}", r.text());
    assert_eq!(s.get("big").status, 404);

    // Exactly the limit is accepted.
    let at_limit = pattern(16 << 20);
    assert_eq!(s.put("big", &at_limit).status, 200);
    assert_eq!(s.get("big").body.len(), 16 << 20);
}

#[test]
fn a_chunked_value_over_the_limit_is_413() {
    let s = Server::start(&["--max-value-size", "1KiB"]);
    let mut c = s.connect();
    let mut body = format!("{:x}\r\n", 1025).into_bytes();
    body.extend(pattern(1025));
    body.extend_from_slice(b"\r\n0\r\n\r\n");
    write_request(
        &mut c,
        "PUT",
        &s.target("big"),
        &[("Transfer-Encoding", "chunked")],
        Some(&body),
        true,
    );
    let r = read_reply(&mut BufReader::new(c), false);
    assert_eq!(r.status, 413, "{}", r.text());
    assert_eq!(s.get("big").status, 404);
    // 1 KiB itself fits.
    assert_eq!(s.put("big", &pattern(1024)).status, 200);
}

#[test]
fn percent_encoded_keys_are_decoded_like_mooncakes_curl_escape() {
    let s = Server::start(&[]);
    // Mooncake escapes with curl_easy_escape: everything but A-Za-z0-9-._~.
    assert_eq!(
        s.put("mooncake%2Fram%2F10.0.0.1%3A12345", b"desc").status,
        200
    );
    // The same key, sent unescaped or escaped differently.
    assert_eq!(s.get("mooncake/ram/10.0.0.1:12345").body, b"desc");
    assert_eq!(s.get("mooncake%2fram%2f10%2E0.0.1:12345").body, b"desc");
    assert_eq!(s.get("mooncake%2Fram%2F10.0.0.2%3A12345").status, 404);

    // As in a form (Go's and aiohttp's query parsers): `+` is a space, `%2B` a plus.
    assert_eq!(s.put("a+b", b"space").status, 200);
    assert_eq!(s.put("a%2Bb", b"plus").status, 200);
    assert_eq!(s.get("a%20b").body, b"space");
    assert_eq!(s.get("a%2bb").body, b"plus");

    // Non-UTF-8 bytes are a key like any other; the first `key` counts.
    assert_eq!(s.put("%FF%00x", b"raw").status, 200);
    let r = s.request(
        "GET",
        &format!("{}?other=1&key=%FF%00x&key=y", s.path),
        &[],
        b"",
    );
    assert_eq!(r.body, b"raw");
    assert_eq!(s.delete("%ff%00x").status, 200);
}

#[test]
fn paths_other_than_the_metadata_path_are_404() {
    let s = Server::start(&[]);
    assert_eq!(s.put("k", b"v").status, 200);
    for target in ["/", "/metadata/?key=k", "/metadatax?key=k", "/other?key=k"] {
        let r = s.request("GET", target, &[], b"");
        assert_eq!(r.status, 404, "{target}: {}", r.text());
        assert!(r.text().contains("/metadata"), "{target}: {}", r.text());
    }

    let custom = Server::start(&["--path", "/mooncake/meta"]);
    assert_eq!(custom.path, "/mooncake/meta");
    assert_eq!(custom.put("k", b"v").status, 200);
    assert_eq!(custom.get("k").body, b"v");
    assert_eq!(
        custom.request("GET", "/metadata?key=k", &[], b"").status,
        404
    );
}

#[test]
fn other_methods_are_405_and_say_which_are_allowed() {
    let s = Server::start(&[]);
    for method in ["POST", "PATCH", "OPTIONS", "BREW"] {
        let r = s.request(method, &s.target("k"), &[], b"v");
        assert_eq!(r.status, 405, "{method}: {}", r.text());
        assert_eq!(
            r.header("allow"),
            Some("GET, HEAD, PUT, DELETE"),
            "{method}"
        );
    }
    assert_eq!(s.get("k").status, 404, "a refused method stored nothing");
}

#[test]
fn a_missing_or_empty_key_is_400() {
    let s = Server::start(&[]);
    for target in [
        "/metadata",
        "/metadata?",
        "/metadata?key=",
        "/metadata?keys=a",
    ] {
        for method in ["GET", "PUT", "DELETE"] {
            let r = s.request(method, target, &[], b"");
            assert_eq!(r.status, 400, "{method} {target}: {}", r.text());
            assert!(r.text().contains("key"), "{}", r.text());
        }
    }
}

#[test]
fn head_answers_the_headers_of_get_without_the_body() {
    let s = Server::start(&[]);
    assert_eq!(s.put("k", b"12345").status, 200);
    let r = s.request("HEAD", &s.target("k"), &[], b"");
    assert_eq!(r.status, 200);
    assert_eq!(r.header("content-length"), Some("5"));
    assert_eq!(s.request("HEAD", &s.target("nope"), &[], b"").status, 404);
}

#[test]
fn a_put_past_max_keys_or_max_total_size_is_507() {
    let s = Server::start(&["--max-keys", "2", "--max-total-size", "100"]);
    assert_eq!(s.put("a", b"1").status, 200);
    assert_eq!(s.put("b", b"2").status, 200);
    let r = s.put("c", b"3");
    assert_eq!(r.status, 507, "{}", r.text());
    assert!(r.text().contains("2 keys"), "{}", r.text());
    // Replacing a value needs no new key; deleting makes room.
    assert_eq!(s.put("a", b"11").status, 200);
    assert_eq!(s.delete("b").status, 200);
    assert_eq!(s.put("c", b"3").status, 200);

    // 100 bytes of keys plus values: "a" + 99 fits, "a" + 100 does not.
    assert_eq!(s.delete("c").status, 200);
    assert_eq!(s.put("a", &[7; 99]).status, 200);
    let r = s.put("a", &[7; 100]);
    assert_eq!(r.status, 507, "{}", r.text());
    assert!(r.text().contains("100 bytes"), "{}", r.text());
    assert_eq!(s.get("a").body, [7; 99], "a refused PUT left the old value");
}

#[test]
fn keep_alive_and_expect_100_continue_work_as_curl_uses_them() {
    let s = Server::start(&[]);
    let mut c = s.connect();
    let mut r = BufReader::new(c.try_clone().expect("clone"));
    let value = pattern(300_000);
    // PUT like libcurl with a large body: headers, wait for 100, then the body.
    write_request(
        &mut c,
        "PUT",
        &s.target("mooncake%2Fram%2Fx"),
        &[
            ("Content-Type", "application/json"),
            ("Content-Length", &value.len().to_string()),
            ("Expect", "100-continue"),
        ],
        None,
        false,
    );
    assert_eq!(read_reply(&mut r, false).status, 100);
    c.write_all(&value).expect("send the body");
    assert_eq!(read_reply(&mut r, false).status, 200);
    // The same connection serves the next requests.
    write_request(
        &mut c,
        "GET",
        &s.target("mooncake%2Fram%2Fx"),
        &[],
        None,
        false,
    );
    let got = read_reply(&mut r, false);
    assert_eq!(got.status, 200);
    assert!(got.body == value);
    write_request(
        &mut c,
        "DELETE",
        &s.target("mooncake%2Fram%2Fx"),
        &[],
        None,
        false,
    );
    assert_eq!(read_reply(&mut r, false).status, 200);
}

#[test]
fn a_client_that_stalls_is_disconnected_after_the_timeout() {
    let s = Server::start(&["--timeout", "500ms"]);

    // Half a request head.
    let mut c = s.connect();
    c.write_all(b"GET /metadata?key=k HTTP/1.1\r\nHost: x\r\n")
        .expect("write");
    let mut rest = Vec::new();
    // The server closes (EOF), perhaps after a 408 of hyper's; a read error
    // (reset) counts as closed too. GUARD bounds the read if it never does.
    let _ = c.read_to_end(&mut rest);
    let text = String::from_utf8_lossy(&rest);
    assert!(
        rest.is_empty() || text.starts_with("HTTP/1.1 408"),
        "{text}"
    );

    // Part of a body: 408, then the connection closes.
    let mut c = s.connect();
    write_request(
        &mut c,
        "PUT",
        &s.target("k"),
        &[("Content-Length", "10")],
        Some(b"abc"),
        false,
    );
    let mut r = BufReader::new(c);
    let reply = read_reply(&mut r, false);
    assert_eq!(reply.status, 408, "{}", reply.text());
    let mut rest = Vec::new();
    let _ = r.read_to_end(&mut rest);
    assert!(rest.is_empty(), "{rest:?}");
    assert_eq!(s.get("k").status, 404, "a partial body stored nothing");

    // An idle keep-alive connection is closed too.
    let mut c = s.connect();
    write_request(&mut c, "GET", &s.target("k"), &[], None, false);
    let mut r = BufReader::new(c);
    assert_eq!(read_reply(&mut r, false).status, 404);
    let mut rest = Vec::new();
    let _ = r.read_to_end(&mut rest);
    assert!(rest.is_empty(), "{rest:?}");
}

#[test]
fn a_client_that_stops_reading_is_disconnected_after_the_timeout() {
    let s = Server::start(&["--timeout", "300ms"]);
    let value = pattern(16 << 20);
    assert_eq!(s.put("big", &value).status, 200);
    let mut c = s.connect();
    write_request(&mut c, "GET", &s.target("big"), &[], None, true);
    // Read nothing for a while: the socket buffers (a few MiB on loopback)
    // fill, the server's write stalls, and it gives up after 300 ms.
    std::thread::sleep(Duration::from_secs(2));
    let mut got = Vec::new();
    let _ = c.read_to_end(&mut got);
    assert!(
        got.len() < value.len(),
        "the whole value arrived ({} bytes): the stalled write was not cut",
        got.len()
    );
    // The server still serves others.
    assert_eq!(s.get("nope").status, 404);
}

#[test]
fn connections_past_max_connections_wait_for_a_free_slot() {
    let s = Server::start(&["--max-connections", "1", "--timeout", "60s"]);
    // The first connection stays open (keep-alive) and holds the only slot.
    let mut first = s.connect();
    write_request(&mut first, "GET", &s.target("k"), &[], None, false);
    let mut first_reader = BufReader::new(first.try_clone().expect("clone"));
    assert_eq!(read_reply(&mut first_reader, false).status, 404);

    let mut second = s.connect();
    write_request(&mut second, "GET", &s.target("k"), &[], None, true);
    second
        .set_read_timeout(Some(Duration::from_millis(300)))
        .expect("read timeout");
    let mut byte = [0u8; 1];
    match second.read(&mut byte) {
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) => {}
        other => panic!("the second connection was served at once: {other:?}"),
    }
    // Freeing the slot lets it through.
    first.shutdown(Shutdown::Both).expect("close the first");
    drop(first_reader);
    second.set_read_timeout(Some(GUARD)).expect("read timeout");
    assert_eq!(read_reply(&mut BufReader::new(second), false).status, 404);
}

#[cfg(unix)]
#[test]
fn sigterm_and_sigint_exit_0_promptly_with_no_more_output() {
    use nix::sys::signal::Signal;
    for signal in [Signal::SIGTERM, Signal::SIGINT] {
        let mut s = Server::start(&[]);
        assert_eq!(s.put("k", b"v").status, 200);
        // An idle keep-alive connection must not hold the shutdown up.
        let mut idle = s.connect();
        write_request(&mut idle, "GET", &s.target("k"), &[], None, false);
        let mut idle_reader = BufReader::new(idle.try_clone().expect("clone"));
        assert_eq!(read_reply(&mut idle_reader, false).status, 200);

        let start = Instant::now();
        let status = s.signal_and_wait(signal);
        assert_eq!(status.code(), Some(0), "{signal}: {status}");
        // Generous: the only wait inside is for requests in flight (none).
        assert!(
            start.elapsed() < Duration::from_secs(4),
            "{signal}: took {:?}",
            start.elapsed()
        );
        let mut rest = String::new();
        s.stdout.read_to_string(&mut rest).expect("read stdout");
        assert_eq!(rest, "", "{signal}: stdout after the URL line");
        let mut closed = Vec::new();
        let _ = idle_reader.read_to_end(&mut closed);
        assert!(closed.is_empty(), "{closed:?}");
    }
}

#[test]
fn a_port_in_use_is_one_error_line_and_exit_1() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = taken.local_addr().expect("addr").to_string();
    let out = ferry()
        .args(["metadata-server", "--listen", &addr])
        .output()
        .expect("run ferry");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(out.stdout.is_empty());
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.starts_with(&format!("error: binding {addr}: ")),
        "{err}"
    );
}

#[test]
fn bad_options_are_usage_errors() {
    for (args, says) in [
        (&["--path", "metadata"][..], "must start with /"),
        (&["--path", "/m?x=1"], "must not contain"),
        (&["--max-value-size", "0"], "at least 1 byte"),
        (&["--max-keys", "0"], "at least 1"),
        (&["--timeout", "0s"], "longer than zero"),
    ] {
        let out = ferry()
            .arg("metadata-server")
            .args(args)
            .output()
            .expect("run ferry");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(says), "{args:?}: {err}");
    }
}
