//! What the simulators share: a seedable generator of schedules.

/// SplitMix64: small, seedable, enough for schedules (not for secrets).
pub struct Rng(pub u64);

#[allow(dead_code)] // each simulator uses its part
impl Rng {
    /// The next 64 random bits.
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (0 for `n` = 0).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next() % n
        }
    }

    /// True with the given chance.
    pub fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

/// How a simulator runs its seeds (`run_seed(seed)` returns its steps and
/// panics when an invariant breaks):
///
/// - `FERRY_SIM_SEED=N`: that seed only (the replay a failure prints);
/// - with a planted `mutant` (`--cfg ferry_mutant="…"`): the seeds until one
///   finds it, printing the seed, the steps before it and what broke; none
///   finding it fails the test. `FERRY_SIM_MUTANT_ALL=1` runs every seed
///   and counts those that find it;
/// - otherwise `FERRY_SIM_SEEDS` seeds (default `default_seeds`), a failure
///   printing its seed and the one-line command that replays it, the run
///   ending with `sim NAME: N seeds, M steps in T s`.
///
/// `name` is the simulator's name in messages, `test` its test target.
/// Returns the steps run (0 for a mutant run or a replay).
#[allow(dead_code)] // sim_grants reports copies too and runs its own loop
pub fn run_seeds(
    name: &str,
    test: &str,
    default_seeds: u64,
    mutant: Option<&str>,
    run_seed: impl Fn(u64) -> u64 + std::panic::RefUnwindSafe,
) -> u64 {
    use std::time::Instant;
    let var = |k: &str| std::env::var(k).ok().and_then(|s| s.parse::<u64>().ok());
    if let Some(seed) = var("FERRY_SIM_SEED") {
        let steps = run_seed(seed);
        eprintln!("sim {name}: seed {seed} passed, {steps} steps");
        return 0;
    }
    let seeds = var("FERRY_SIM_SEEDS").unwrap_or(default_seeds);
    let start = Instant::now();
    let mut steps = 0;
    if let Some(m) = mutant {
        // A planted bug: the simulator must find it.
        let quiet = std::panic::take_hook();
        std::panic::set_hook(Box::new(|_| {}));
        let all = std::env::var_os("FERRY_SIM_MUTANT_ALL").is_some();
        let (mut found, mut finders) = (None, 0u64);
        for seed in 0..seeds {
            match std::panic::catch_unwind(|| run_seed(seed)) {
                Ok(n) => steps += n,
                Err(e) => {
                    finders += 1;
                    if found.is_none() {
                        let msg = e
                            .downcast_ref::<String>()
                            .cloned()
                            .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                            .unwrap_or_else(|| "a panic".into());
                        found = Some((seed, msg, steps, start.elapsed()));
                    }
                    if !all {
                        break;
                    }
                }
            }
        }
        std::panic::set_hook(quiet);
        if all {
            eprintln!("sim {name}: mutant {m} found by {finders} of {seeds} seeds");
        }
        match found {
            Some((seed, msg, before, t)) => eprintln!(
                "sim {name}: mutant {m} found at seed {seed} (after {before} steps of the \
                 seeds before it, {:.2} s): {msg}",
                t.as_secs_f64()
            ),
            None => panic!("sim {name}: mutant {m} not found in {seeds} seeds"),
        }
        return 0;
    }
    for seed in 0..seeds {
        match std::panic::catch_unwind(|| run_seed(seed)) {
            Ok(n) => steps += n,
            Err(e) => {
                eprintln!(
                    "sim {name}: seed {seed} failed; replay with \
                     FERRY_SIM_SEED={seed} cargo test -p ferry-tcp-proto --test {test}"
                );
                std::panic::resume_unwind(e);
            }
        }
    }
    eprintln!(
        "sim {name}: {seeds} seeds, {steps} steps in {:.1} s",
        start.elapsed().as_secs_f64()
    );
    steps
}

/// The target core's memory bound (invariant (e) of `sim_target` and
/// `sim_pair`): the answers between flushes (ids, frames up to the flush
/// threshold plus one frame with 512 indices) and one buffer (a
/// notification or a segment table).
#[allow(dead_code)] // sim_grants and sim_handshake do not check it
pub const HELD_BOUND: usize = {
    use ferry_tcp_proto::frame::{HEADER_LEN, MAX_ACKS, MAX_NOTIFY_MESSAGE, SEGMENT_LEN};
    MAX_ACKS as usize * 8 * 2
        + 16 * 1024
        + 2 * (HEADER_LEN + 512 * 4)
        + 256
        + MAX_NOTIFY_MESSAGE as usize
        + 512 * SEGMENT_LEN
        + 512 * 4 * 2
};
