//! ferry (work in progress).
