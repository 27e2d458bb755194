//! Pagoda end-to-end harness.
