//! Pagoda worker.
pub mod model;
pub mod cache;
pub mod sampling;
pub mod scheduler;
