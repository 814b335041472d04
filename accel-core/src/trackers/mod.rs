//! Experiment trackers: JSONL and TensorBoard event files.
