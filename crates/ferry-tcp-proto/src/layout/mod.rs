//! Byte layouts of the same-host path's shared memory: the staging area
//! ([`area`]) and its grants page ([`grants`]). The driver maps them and
//! reads and writes them with atomics; these are the offsets and sizes
//! both processes agree on, and the pure encodings inside them.

pub mod area;
pub mod grants;
