//! Declares the workspace's `ferry_loom` cfg: under loom's model checker
//! the staging area has fewer slots and lane entries
//! (`layout::area::SLOTS`, `ACKS`), the same as in ferry-tcp's ring code.
fn main() {
    println!("cargo::rustc-check-cfg=cfg(ferry_loom)");
}
