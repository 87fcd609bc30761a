#![doc = include_str!("../README.md")]
#![deny(unsafe_op_in_unsafe_fn)]

#[cfg(not(all(
    target_os = "linux",
    any(target_arch = "x86_64", target_arch = "aarch64")
)))]
compile_error!(
    "ferry-mooncake supports Linux on x86-64 and AArch64 only: it calls \
     createTransferEngine through a 5-argument signature that is sound on 4-argument \
     builds only under those calling conventions (see library.rs)"
);

mod codes;
mod config;
mod engine;
mod library;

pub use codes::{code_name, MooncakeErrorCode};
pub use config::{MooncakeConfig, MooncakeConfigBuilder, P2P_HANDSHAKE, URL_PARAMETERS};
pub use engine::{LibraryTrust, MooncakeEngine};
pub use library::{
    Generation, LibrarySource, MooncakeLibrary, DEFAULT_LIBRARY, LIBRARY_ENV, OPTIONAL_SYMBOLS,
    REQUIRED_SYMBOLS,
};
