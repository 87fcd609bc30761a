//! backend-mooncake (work in progress).
