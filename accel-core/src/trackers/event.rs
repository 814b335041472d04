//! The few protobuf messages a TensorBoard event file needs, encoded by hand.
//!
//! accel-core has no protobuf dependency and the subset used here is tiny:
//! varints, 32/64-bit fixed numbers and length-delimited fields. Field numbers
//! follow TensorFlow's `event.proto`, `summary.proto`, `tensor.proto` and
//! `tensor_shape.proto`. Like proto3 serialisers, scalar fields holding their
//! default value (0, empty string) are left out; readers decode them the same.

/// Protobuf wire types (the low three bits of a field key).
const WIRE_VARINT: u8 = 0;
const WIRE_FIXED64: u8 = 1;
const WIRE_LEN: u8 = 2;
const WIRE_FIXED32: u8 = 5;

/// `tensorflow.DataType.DT_STRING`.
const DT_STRING: u64 = 7;
/// `tensorboard.DataClass.DATA_CLASS_TENSOR`: the text plugin's data class.
const DATA_CLASS_TENSOR: u64 = 2;

/// The `file_version` every event file starts with; TensorBoard uses it to
/// recognise the format.
pub(crate) const FILE_VERSION: &str = "brain.Event:2";

/// An append-only protobuf encoder.
#[derive(Debug, Default)]
pub(crate) struct ProtoWriter {
    buf: Vec<u8>,
}

impl ProtoWriter {
    /// An empty message.
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// The encoded bytes.
    pub(crate) fn into_bytes(self) -> Vec<u8> {
        self.buf
    }

    fn varint(&mut self, mut v: u64) {
        while v >= 0x80 {
            self.buf.push((v as u8) | 0x80);
            v >>= 7;
        }
        self.buf.push(v as u8);
    }

    fn key(&mut self, field: u32, wire: u8) {
        self.varint(((field as u64) << 3) | wire as u64);
    }

    /// A `uint64`/`int64`/enum field. Negative `int64`s are passed as their
    /// two's-complement `u64`, which is how protobuf encodes them (10 bytes).
    pub(crate) fn uint64(&mut self, field: u32, v: u64) {
        if v != 0 {
            self.key(field, WIRE_VARINT);
            self.varint(v);
        }
    }

    /// An `int64` field.
    pub(crate) fn int64(&mut self, field: u32, v: i64) {
        self.uint64(field, v as u64);
    }

    /// A `double` field.
    pub(crate) fn double(&mut self, field: u32, v: f64) {
        // Compare bits, not values: -0.0 and NaN payloads are not the default.
        if v.to_bits() != 0 {
            self.key(field, WIRE_FIXED64);
            self.buf.extend_from_slice(&v.to_le_bytes());
        }
    }

    /// A `bytes`/`string` field, always written (callers skip empty ones
    /// when the field is optional; repeated fields must keep empty entries).
    pub(crate) fn bytes(&mut self, field: u32, v: &[u8]) {
        self.key(field, WIRE_LEN);
        self.varint(v.len() as u64);
        self.buf.extend_from_slice(v);
    }

    /// A `string` field, skipped when empty (the proto3 default).
    pub(crate) fn string(&mut self, field: u32, v: &str) {
        if !v.is_empty() {
            self.bytes(field, v.as_bytes());
        }
    }

    /// An embedded message field, always written: a present empty message
    /// differs from an absent one for oneof members such as `Event.summary`.
    pub(crate) fn message(&mut self, field: u32, msg: ProtoWriter) {
        self.bytes(field, &msg.buf);
    }
}

/// One entry of a `Summary`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum SummaryValue<'a> {
    /// A scalar, shown by TensorBoard's scalars dashboard.
    Scalar {
        /// The chart name.
        tag: &'a str,
        /// The value; `simple_value` is a 32-bit float in the format.
        value: f32,
    },
    /// A string, shown by TensorBoard's text dashboard (rendered as Markdown).
    Text {
        /// The entry name.
        tag: &'a str,
        /// The text.
        text: &'a str,
    },
}

/// `Summary.Value` field numbers.
mod value_field {
    pub const TAG: u32 = 1;
    pub const SIMPLE_VALUE: u32 = 2;
    pub const TENSOR: u32 = 8;
    pub const METADATA: u32 = 9;
}

impl SummaryValue<'_> {
    fn encode(&self) -> ProtoWriter {
        let mut v = ProtoWriter::new();
        match self {
            SummaryValue::Scalar { tag, value } => {
                v.string(value_field::TAG, tag);
                // Written even when 0.0: `simple_value` is a oneof member, and an
                // absent member would make the entry a value of no kind at all.
                v.key(value_field::SIMPLE_VALUE, WIRE_FIXED32);
                v.buf.extend_from_slice(&value.to_le_bytes());
            }
            SummaryValue::Text { tag, text } => {
                v.string(value_field::TAG, tag);
                // SummaryMetadata { plugin_data { plugin_name: "text" }, data_class }
                // as written by tensorboard.plugins.text.summary; the plugin's
                // `TextPluginData { version: 0 }` content serialises to nothing.
                let mut plugin_data = ProtoWriter::new();
                plugin_data.string(1, "text");
                let mut metadata = ProtoWriter::new();
                metadata.message(1, plugin_data);
                metadata.uint64(4, DATA_CLASS_TENSOR);
                v.message(value_field::METADATA, metadata);
                // A rank-0 DT_STRING TensorProto: the text plugin renders a
                // scalar string as one Markdown block rather than a table.
                let mut tensor = ProtoWriter::new();
                tensor.uint64(1, DT_STRING);
                tensor.message(2, ProtoWriter::new()); // TensorShapeProto with no dims
                tensor.bytes(8, text.as_bytes()); // string_val, kept even if empty
                v.message(value_field::TENSOR, tensor);
            }
        }
        v
    }
}

/// `Event` field numbers.
mod event_field {
    pub const WALL_TIME: u32 = 1;
    pub const STEP: u32 = 2;
    pub const FILE_VERSION: u32 = 3;
    pub const SUMMARY: u32 = 5;
}

/// The first event of every file: `Event { wall_time, file_version: "brain.Event:2" }`.
pub(crate) fn file_version_event(wall_time: f64) -> Vec<u8> {
    let mut e = ProtoWriter::new();
    e.double(event_field::WALL_TIME, wall_time);
    e.string(event_field::FILE_VERSION, FILE_VERSION);
    e.into_bytes()
}

/// `Event { wall_time, step, summary { value: [...] } }`.
pub(crate) fn summary_event(wall_time: f64, step: i64, values: &[SummaryValue<'_>]) -> Vec<u8> {
    let mut summary = ProtoWriter::new();
    for value in values {
        summary.message(1, value.encode());
    }
    let mut e = ProtoWriter::new();
    e.double(event_field::WALL_TIME, wall_time);
    e.int64(event_field::STEP, step);
    e.message(event_field::SUMMARY, summary);
    e.into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn varint_bytes(v: u64) -> Vec<u8> {
        let mut w = ProtoWriter::new();
        w.varint(v);
        w.into_bytes()
    }

    #[test]
    fn varints_use_seven_bits_per_byte_low_group_first() {
        assert_eq!(varint_bytes(0), [0x00]);
        assert_eq!(varint_bytes(1), [0x01]);
        assert_eq!(varint_bytes(127), [0x7f]);
        assert_eq!(varint_bytes(128), [0x80, 0x01]);
        assert_eq!(varint_bytes(300), [0xac, 0x02]);
        assert_eq!(varint_bytes(u64::MAX).len(), 10);
    }

    #[test]
    fn negative_int64_takes_ten_bytes() {
        let mut w = ProtoWriter::new();
        w.int64(2, -1);
        assert_eq!(
            w.into_bytes(),
            [0x10, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01]
        );
    }

    #[test]
    fn the_file_version_event_matches_its_hand_encoding() {
        let bytes = file_version_event(1.5);
        let mut expected = vec![0x09]; // field 1, fixed64
        expected.extend_from_slice(&1.5f64.to_le_bytes());
        expected.extend_from_slice(&[0x1a, 13]); // field 3, length 13
        expected.extend_from_slice(b"brain.Event:2");
        assert_eq!(bytes, expected);
    }

    #[test]
    fn a_scalar_event_matches_its_hand_encoding() {
        let bytes = summary_event(
            2.0,
            300,
            &[SummaryValue::Scalar {
                tag: "loss",
                value: 0.0,
            }],
        );
        let mut expected = vec![0x09];
        expected.extend_from_slice(&2.0f64.to_le_bytes());
        expected.extend_from_slice(&[0x10, 0xac, 0x02]); // step 300
                                                         // summary (field 5) { value (field 1) { tag "loss", simple_value 0.0 } }
        let value = [0x0a, 4, b'l', b'o', b's', b's', 0x15, 0, 0, 0, 0];
        expected.extend_from_slice(&[0x2a, value.len() as u8 + 2, 0x0a, value.len() as u8]);
        expected.extend_from_slice(&value);
        assert_eq!(bytes, expected);
    }

    #[test]
    fn a_text_value_carries_the_text_plugin_metadata_and_a_string_tensor() {
        let v = SummaryValue::Text {
            tag: "note",
            text: "hi",
        }
        .encode()
        .into_bytes();
        let mut expected = vec![0x0a, 4];
        expected.extend_from_slice(b"note");
        // metadata (9) { plugin_data (1) { plugin_name (1) "text" }, data_class (4) 2 }
        expected.extend_from_slice(&[0x4a, 10, 0x0a, 6, 0x0a, 4]);
        expected.extend_from_slice(b"text");
        expected.extend_from_slice(&[0x20, 2]);
        // tensor (8) { dtype (1) 7, tensor_shape (2) {}, string_val (8) "hi" }
        expected.extend_from_slice(&[0x42, 8, 0x08, 7, 0x12, 0, 0x42, 2]);
        expected.extend_from_slice(b"hi");
        assert_eq!(v, expected);
    }
}
