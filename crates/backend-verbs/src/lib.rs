//! backend-verbs (work in progress).
