//! Layers with candle-nn constructor signatures.
