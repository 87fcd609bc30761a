//! In-process engine (filled in by the conformance work).
