//! Helpers shared by the integration tests.

pub mod ordered_json;
