//! Declares the crate's own cfg: `ferry_loom` runs the ring and lane code
//! on loom's atomics (see `same_host::stage::loom_model`).
fn main() {
    println!("cargo::rustc-check-cfg=cfg(ferry_loom)");
}
