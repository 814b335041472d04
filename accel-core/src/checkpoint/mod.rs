//! Checkpoint files: safetensors I/O, sharded model saving and atomic folders.
