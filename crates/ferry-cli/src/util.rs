//! Parsing and formatting helpers shared by the subcommands.

use std::time::Duration;

use ferry::{HostBuffer, Operation};

/// Parses a byte size: `4096`, `4K`/`4KiB` (×1024), `4KB` (×1000), likewise
/// `M`/`MiB`/`MB`, `G`/`GiB`/`GB`. Case-insensitive, no fractions.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, unit) = t.split_at(split);
    if digits.is_empty() {
        return Err(format!(
            "{s:?} is not a size (examples: 4096, 4KiB, 16MiB, 1GB)"
        ));
    }
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("{s:?}: number out of range"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "kb" => 1_000,
        "m" | "mib" => 1 << 20,
        "mb" => 1_000_000,
        "g" | "gib" => 1 << 30,
        "gb" => 1_000_000_000,
        other => {
            return Err(format!(
                "{s:?}: unknown unit {other:?} (use B, K/KiB, KB, M/MiB, MB, G/GiB, GB)"
            ))
        }
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("{s:?}: size out of range"))
}

/// Like [`parse_size`] but refuses zero.
pub fn parse_positive_size(s: &str) -> Result<u64, String> {
    match parse_size(s)? {
        0 => Err(format!("{s:?}: must be at least 1 byte")),
        n => Ok(n),
    }
}

/// Parses an address: `0x7f…` (hex) or decimal.
pub fn parse_addr(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let r = match t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => t.parse(),
    };
    r.map_err(|_| format!("{s:?} is not an address (use 0x… hex or decimal)"))
}

/// Parses a positive count (batch sizes).
pub fn parse_count(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(0) => Err(format!("{s:?}: must be at least 1")),
        Ok(n) => Ok(n),
        Err(_) => Err(format!("{s:?} is not a positive integer")),
    }
}

/// Parses a duration such as `250ms`, `2s`, `1m`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s.trim())
        .map_err(|e| format!("{s:?} is not a duration (examples: 250ms, 2s): {e}"))
}

/// Parses an operation name (`batch_transfer`, `notify`, …).
pub fn parse_operation(s: &str) -> Result<Operation, String> {
    s.parse::<Operation>().map_err(|e| e.to_string())
}

/// `4 KiB`, `16 MiB`, `1.5 GiB`, `512 B`.
pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else if (v - v.round()).abs() < 1e-9 {
        format!("{} {}", v.round() as u64, UNITS[u])
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// Deterministic non-trivial bytes for `[offset, offset + out.len())` of a
/// stream identified by `seed`.
pub fn pattern(seed: u64, offset: u64, out: &mut [u8]) {
    for (i, b) in out.iter_mut().enumerate() {
        let x = offset.wrapping_add(i as u64);
        *b = (x.wrapping_mul(131) ^ (x >> 9) ^ seed.wrapping_mul(0x9e37_79b9)) as u8 | 1;
    }
}

/// Fills the whole of `buf` with [`pattern`] (in 1 MiB pieces).
pub fn fill_pattern(buf: &HostBuffer, seed: u64) -> ferry::Result<()> {
    let mut chunk = vec![0u8; (1 << 20).min(buf.len())];
    let mut off = 0usize;
    while off < buf.len() {
        let n = chunk.len().min(buf.len() - off);
        pattern(seed, off as u64, &mut chunk[..n]);
        buf.write(off, &chunk[..n])?;
        off += n;
    }
    Ok(())
}

/// How many bytes of `buf` differ from [`pattern`] with `seed`.
pub fn count_changed(buf: &HostBuffer, seed: u64) -> ferry::Result<u64> {
    let mut want = vec![0u8; (1 << 20).min(buf.len())];
    let mut have = vec![0u8; want.len()];
    let mut changed = 0u64;
    let mut off = 0usize;
    while off < buf.len() {
        let n = want.len().min(buf.len() - off);
        pattern(seed, off as u64, &mut want[..n]);
        buf.read(off, &mut have[..n])?;
        changed += want[..n]
            .iter()
            .zip(&have[..n])
            .filter(|(a, b)| a != b)
            .count() as u64;
        off += n;
    }
    Ok(changed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("4KiB"), Ok(4096));
        assert_eq!(parse_size("4k"), Ok(4096));
        assert_eq!(parse_size("4KB"), Ok(4000));
        assert_eq!(parse_size("16MiB"), Ok(16 << 20));
        assert_eq!(parse_size("2GiB"), Ok(2 << 30));
        assert!(parse_size("4XB").is_err());
        assert!(parse_size("KiB").is_err());
        assert!(parse_size("-1").is_err());
        assert!(parse_size("99999999999999999999G").is_err());
        assert!(parse_positive_size("0").is_err());
    }

    #[test]
    fn addrs_and_counts() {
        assert_eq!(parse_addr("0x10"), Ok(16));
        assert_eq!(parse_addr("16"), Ok(16));
        assert!(parse_addr("0xzz").is_err());
        assert_eq!(parse_count("8"), Ok(8));
        assert!(parse_count("0").is_err());
    }

    #[test]
    fn human() {
        assert_eq!(human_bytes(4096), "4 KiB");
        assert_eq!(human_bytes(16 << 20), "16 MiB");
        assert_eq!(human_bytes(1536), "1.5 KiB");
        assert_eq!(human_bytes(12), "12 B");
    }

    #[test]
    fn pattern_is_position_dependent_and_nonzero() {
        let mut a = [0u8; 64];
        let mut b = [0u8; 64];
        pattern(1, 0, &mut a);
        pattern(1, 0, &mut b);
        assert_eq!(a, b);
        pattern(2, 0, &mut b);
        assert_ne!(a, b);
        assert!(a.iter().all(|x| *x != 0));
    }
}

/// `--secret-file`, shared by every subcommand that opens an engine (the
/// one way to give a secret: [`ferry::secret`]).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct SecretArgs {
    /// Read the backend's shared secret from this file (its first line).
    /// Or set FERRY_SECRET, or FERRY_SECRET_FILE to a file; `secret=` in
    /// the URL is visible to every user of this machine.
    #[arg(long, value_name = "PATH")]
    pub secret_file: Option<std::path::PathBuf>,
}

/// Parses `backend` (a URL from the command line) and adds the shared
/// secret the one way every subcommand takes it ([`ferry::secret`]):
/// `--secret-file`, `FERRY_SECRET` or `FERRY_SECRET_FILE`; given two ways,
/// an error. A secret written in the URL itself is used, with a warning:
/// the process list shows it.
pub fn backend_url(backend: &str, secret: &SecretArgs) -> anyhow::Result<ferry::raw::ParsedUrl> {
    use anyhow::Context;
    use ferry::secret as s;
    let mut url = ferry::raw::ParsedUrl::parse(backend)
        .with_context(|| format!("opening {}", ferry::raw::redact_url(backend)))?;
    static WARNED: std::sync::Once = std::sync::Once::new();
    if s::url_shows_secret(&url) {
        WARNED.call_once(|| {
            eprintln!(
                "warning: the secret given in --backend is visible to every user of this machine \
             (/proc/PID/cmdline); use --secret-file, {} or {} instead",
                s::SECRET_ENV,
                s::SECRET_FILE_ENV
            )
        });
    }
    if let Some(path) = &secret.secret_file {
        let env = [s::SECRET_ENV, s::SECRET_FILE_ENV]
            .into_iter()
            .find(|k| std::env::var_os(k).is_some_and(|v| !v.is_empty()));
        if let Some(k) = env {
            anyhow::bail!(
                "a shared secret is given two ways, by --secret-file and by {k}; give it one \
                 way only"
            );
        }
        if s::url_has_secret(&url) {
            anyhow::bail!(
                "a shared secret is given two ways, by --secret-file and by the URL; give it \
                 one way only"
            );
        }
        let path = path
            .to_str()
            .context("the --secret-file path is not UTF-8")?;
        url.insert(s::SECRET_FILE_KEY, path)?;
    }
    s::from_environment(&mut url)?;
    Ok(url)
}
