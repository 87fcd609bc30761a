//! Builds the test libraries into `OUT_DIR` as real shared objects.
//!
//! The `cc` crate finds the C compiler (honouring `CC`, `CFLAGS`, the target
//! triple); it is then driven directly with `-shared`, because `cc::Build`
//! only produces static archives.

use std::path::{Path, PathBuf};
use std::process::Command;

/// (output file stem, C source, extra defines)
const LIBS: &[(&str, &str, &[&str])] = &[
    (
        "mooncake_testlib_pre_v0_2_0",
        "csrc/mooncake_testlib.c",
        &["TL_GEN=0"],
    ),
    (
        "mooncake_testlib_v0_2_0",
        "csrc/mooncake_testlib.c",
        &["TL_GEN=1"],
    ),
    (
        "mooncake_testlib_v0_3_0",
        "csrc/mooncake_testlib.c",
        &["TL_GEN=2"],
    ),
    (
        "mooncake_testlib_v0_3_5",
        "csrc/mooncake_testlib.c",
        &["TL_GEN=3"],
    ),
    (
        "mooncake_testlib_v0_3_6",
        "csrc/mooncake_testlib.c",
        &["TL_GEN=4"],
    ),
    (
        "mooncake_testlib_v0_3_12",
        "csrc/mooncake_testlib.c",
        &["TL_GEN=5"],
    ),
    (
        "mooncake_testlib_missing_submit",
        "csrc/mooncake_testlib.c",
        &["TL_GEN=2", "TL_OMIT_SUBMIT=1"],
    ),
    ("not_mooncake", "csrc/not_mooncake.c", &[]),
];

fn main() {
    println!("cargo:rerun-if-changed=csrc");
    println!("cargo:rerun-if-changed=build.rs");
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let compiler = cc::Build::new()
        .pic(true)
        .opt_level(1)
        .debug(true)
        .cargo_metadata(false)
        .get_compiler();
    for (stem, src, defines) in LIBS {
        build_one(
            &compiler,
            Path::new(src),
            &out.join(format!("lib{stem}.so")),
            defines,
        );
    }
}

fn build_one(compiler: &cc::Tool, src: &Path, dest: &Path, defines: &[&str]) {
    let mut cmd: Command = compiler.to_command();
    cmd.args([
        "-shared",
        "-fvisibility=hidden",
        "-std=gnu11",
        "-Wall",
        "-Wextra",
    ]);
    cmd.args(["-Wno-unused-parameter", "-Wno-unused-function"]);
    for d in defines {
        cmd.arg(format!("-D{d}"));
    }
    cmd.arg("-o").arg(dest).arg(src).arg("-lpthread");
    let status = cmd
        .status()
        .unwrap_or_else(|e| panic!("cannot run the C compiler {:?}: {e}", compiler.path()));
    assert!(
        status.success(),
        "building {} from {} failed ({status})",
        dest.display(),
        src.display()
    );
}
