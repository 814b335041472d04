//! Model size accounting, device-map planning, checkpoint loading and offload.
#![warn(missing_docs)]
