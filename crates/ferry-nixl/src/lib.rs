#![doc = include_str!("../README.md")]
#![deny(unsafe_op_in_unsafe_fn)]

#[cfg(not(target_os = "linux"))]
compile_error!("ferry-nixl supports Linux only (NIXL does)");

mod agent;
mod config;
mod control;
mod engine;
mod library;
mod poller;
/// For tests (feature `test-support`, off by default; not part of the API).
#[cfg(feature = "test-support")]
pub mod test_support;
mod ucx_env;

pub use config::{NixlConfig, NixlConfigBuilder, URL_PARAMETERS};
pub use engine::{LibraryTrust, NixlEngine};
pub use library::{
    active_python_wheel_library, wheel_library_in, Generation, LibrarySource, NixlLibrary,
    DEFAULT_LIBRARY, LIBRARY_ENV, OPTIONAL_SYMBOLS, REQUIRED_SYMBOLS, WHEEL_LIBRARY_DIRS,
};
