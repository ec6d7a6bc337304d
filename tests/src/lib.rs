//! Cross-crate scenario tests live in `tests/tests/`.
