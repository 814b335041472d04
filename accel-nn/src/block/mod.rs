//! The block protocol.
