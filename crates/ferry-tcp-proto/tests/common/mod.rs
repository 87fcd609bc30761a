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
