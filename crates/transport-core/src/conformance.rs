//! The conformance suite (filled in by the conformance work).
