//! ferry-cli (work in progress).
fn main() {}
