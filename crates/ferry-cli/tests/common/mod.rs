//! What the CLI's integration tests share: the `ferry` binary under test,
//! and a child process killed on drop with its stdout as lines.
#![allow(dead_code)] // each test file uses its own part

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// How long a child may take to print an expected line: a liveness bound
/// (a child that never starts fails the test instead of hanging it), not a
/// timing assertion.
pub const LIVENESS: Duration = Duration::from_secs(60);

/// The `ferry` binary of this build, with `RUST_LOG` cleared so that its
/// output is what the tests parse.
pub fn ferry() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_ferry"));
    c.env_remove("RUST_LOG");
    c
}

/// A child process, killed and reaped on drop (a failed test leaves no
/// process behind), its stdout read line by line on a thread of its own.
/// Its stderr is dropped unless `FERRY_REAL_PEER_LOGS` is set (then it
/// shows, a real peer library's logs included).
pub struct Proc {
    pub child: Child,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
}

impl Proc {
    /// Spawns `cmd` (its stdout and stderr are set here).
    pub fn spawn(mut cmd: Command) -> Proc {
        let stderr = if std::env::var_os("FERRY_REAL_PEER_LOGS").is_some() {
            Stdio::inherit()
        } else {
            Stdio::null()
        };
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .expect("spawn the child process");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Proc {
            child,
            lines,
            seen: Vec::new(),
        }
    }

    /// The rest of the first line from here on that starts with `prefix`;
    /// every line read is kept ([`Proc::seen`]). Panics, quoting the lines
    /// seen, if none comes within [`LIVENESS`] or the child closes stdout.
    pub fn line_after(&mut self, prefix: &str) -> String {
        loop {
            let line = self.lines.recv_timeout(LIVENESS).unwrap_or_else(|e| {
                panic!("no line starting {prefix:?} ({e}); got {:?}", self.seen)
            });
            self.seen.push(line.clone());
            if let Some(rest) = line.strip_prefix(prefix) {
                return rest.to_owned();
            }
        }
    }

    /// The next line (kept in [`Proc::seen`]); an error once the child
    /// closed its stdout, or after [`LIVENESS`] without one.
    pub fn next_line(&mut self) -> Result<String, mpsc::RecvTimeoutError> {
        let line = self.lines.recv_timeout(LIVENESS)?;
        self.seen.push(line.clone());
        Ok(line)
    }

    /// The lines read so far, in order.
    pub fn seen(&self) -> &[String] {
        &self.seen
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
