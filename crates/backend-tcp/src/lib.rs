//! backend-tcp (work in progress).
