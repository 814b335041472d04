//! Process groups, collectives and launching for accel-rs.
#![warn(missing_docs)]

mod error;
pub use error::{Error, Result};
