//! Throughput benchmark (placeholder, being written).
fn main() {}
