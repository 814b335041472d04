//! A tracker writing TensorBoard event files, byte-compatible with what
//! TensorFlow's and tensorboardX's `SummaryWriter` produce.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use super::event::{file_version_event, summary_event, SummaryValue};
use super::tfrecord::write_record;
use super::{
    finished_error, run_dir, unix_time, write_config_json, LogValue, StepCounter, Tracker,
};
use crate::{Error, Result};

/// Writes `{logging_dir}/{project_name}/events.out.tfevents.{unix_secs}.{hostname}`.
///
/// Point `tensorboard --logdir {logging_dir}` at it. Each [`Tracker::log`]
/// call becomes one `Event` at its step: floats and integers as scalars
/// (TensorBoard stores them as 32-bit floats), text as text-plugin summaries
/// (rendered as Markdown). The file is flushed after every event.
///
/// [`Tracker::store_init_configuration`] writes the configuration twice:
/// as `config.json` beside the event file (for programs), and as a text
/// summary tagged [`Self::CONFIG_TAG`] at step 0 holding the pretty-printed JSON as a
/// Markdown code block (for the TensorBoard "Text" tab). It does not use the
/// HParams plugin, whose table needs metrics declared up front.
#[derive(Debug)]
pub struct TensorBoardTracker {
    dir: PathBuf,
    path: PathBuf,
    // `None` once finished.
    out: Option<BufWriter<File>>,
    steps: StepCounter,
}

impl TensorBoardTracker {
    /// The tag under which [`Tracker::store_init_configuration`] writes the configuration.
    pub const CONFIG_TAG: &'static str = "config";

    /// Creates `{logging_dir}/{project_name}/` and a new event file in it,
    /// starting with the `file_version` record TensorBoard expects.
    ///
    /// If a file of the same name exists (two writers in the same second), a
    /// `.1`, `.2`, ... suffix is added; TensorBoard reads any file whose name
    /// contains `tfevents`.
    pub fn new(project_name: &str, logging_dir: impl AsRef<Path>) -> Result<Self> {
        let dir = run_dir(project_name, logging_dir.as_ref())?;
        let now = unix_time();
        let base = format!("events.out.tfevents.{}.{}", now as u64, hostname());
        let (path, file) = create_unique(&dir, &base)?;
        let mut out = BufWriter::new(file);
        write_record(&mut out, &file_version_event(now))
            .and_then(|()| out.flush())
            .map_err(|e| Error::io("writing", &path, e))?;
        Ok(Self {
            dir,
            path,
            out: Some(out),
            steps: StepCounter::default(),
        })
    }

    /// The event file.
    pub fn event_path(&self) -> &Path {
        &self.path
    }

    /// The folder holding the event file and `config.json`.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn write_event(&mut self, step: u64, values: &[SummaryValue<'_>]) -> Result<()> {
        let out = self
            .out
            .as_mut()
            .ok_or_else(|| finished_error("tensorboard"))?;
        let step = i64::try_from(step)
            .map_err(|_| Error::Usage(format!("step {step} does not fit TensorBoard's int64")))?;
        let payload = summary_event(unix_time(), step, values);
        write_record(out, &payload)
            .and_then(|()| out.flush())
            .map_err(|e| Error::io("writing", &self.path, e))
    }
}

impl Tracker for TensorBoardTracker {
    fn name(&self) -> &str {
        "tensorboard"
    }

    fn store_init_configuration(&mut self, config: &serde_json::Value) -> Result<()> {
        if self.out.is_none() {
            return Err(finished_error("tensorboard"));
        }
        write_config_json(&self.dir.join("config.json"), config)?;
        let pretty = serde_json::to_string_pretty(config).map_err(|e| Error::Json {
            path: self.dir.join("config.json"),
            reason: e.to_string(),
        })?;
        // Four-space indentation makes a Markdown code block, so the text tab
        // shows the JSON verbatim instead of reflowing it.
        let markdown: String = pretty.lines().map(|l| format!("    {l}\n")).collect();
        let value = SummaryValue::Text {
            tag: Self::CONFIG_TAG,
            text: &markdown,
        };
        // Step 0 without touching the step counter: the configuration is not a
        // training step.
        self.write_event(0, &[value])
    }

    fn log(&mut self, values: &BTreeMap<String, LogValue>, step: Option<u64>) -> Result<()> {
        if self.out.is_none() {
            return Err(finished_error("tensorboard"));
        }
        let step = self.steps.resolve(step);
        let summary: Vec<SummaryValue<'_>> = values
            .iter()
            .map(|(tag, value)| match value {
                LogValue::Float(f) => SummaryValue::Scalar {
                    tag,
                    value: *f as f32,
                },
                LogValue::Int(i) => SummaryValue::Scalar {
                    tag,
                    value: *i as f32,
                },
                LogValue::Text(text) => SummaryValue::Text { tag, text },
            })
            .collect();
        self.write_event(step, &summary)
    }

    fn finish(&mut self) -> Result<()> {
        if let Some(mut out) = self.out.take() {
            out.flush()
                .map_err(|e| Error::io("writing", &self.path, e))?;
        }
        Ok(())
    }
}

/// Opens `dir/base`, or `dir/base.N` for the first free N, without ever
/// truncating an existing event file.
fn create_unique(dir: &Path, base: &str) -> Result<(PathBuf, File)> {
    for n in 0u32.. {
        let name = if n == 0 {
            base.to_owned()
        } else {
            format!("{base}.{n}")
        };
        let path = dir.join(name);
        match OpenOptions::new().write(true).create_new(true).open(&path) {
            Ok(file) => return Ok((path, file)),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(Error::io("creating", &path, e)),
        }
    }
    unreachable!("u32 suffixes exhausted")
}

/// The machine's name for the file name, as TensorFlow puts it there.
///
/// Read from the kernel or the environment since the standard library has no
/// portable call and accel-core takes no libc dependency for it; characters
/// that would make an awkward file name are replaced.
fn hostname() -> String {
    let raw = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .or_else(|_| std::fs::read_to_string("/etc/hostname"))
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .or_else(|| std::env::var("COMPUTERNAME").ok())
        .unwrap_or_default();
    let name: String = raw
        .trim()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') {
                c
            } else {
                '_'
            }
        })
        .collect();
    if name.is_empty() {
        "localhost".to_owned()
    } else {
        name
    }
}

#[cfg(test)]
mod tests {
    use super::super::tfrecord::masked_crc32c;
    use super::*;

    // ---- an independent reader: TFRecord framing and a generic protobuf decoder ----

    /// Splits a TFRecord stream into payloads, checking both CRCs of each record.
    fn read_records(mut bytes: &[u8]) -> std::result::Result<Vec<Vec<u8>>, String> {
        let mut records = Vec::new();
        while !bytes.is_empty() {
            if bytes.len() < 12 {
                return Err(format!("truncated header ({} bytes)", bytes.len()));
            }
            let len_bytes = &bytes[..8];
            let len_crc = u32::from_le_bytes(bytes[8..12].try_into().unwrap());
            if masked_crc32c(len_bytes) != len_crc {
                return Err("length CRC mismatch".into());
            }
            let len = u64::from_le_bytes(len_bytes.try_into().unwrap()) as usize;
            let rest = &bytes[12..];
            if rest.len() < len + 4 {
                return Err(format!(
                    "truncated payload: need {}, have {}",
                    len + 4,
                    rest.len()
                ));
            }
            let payload = &rest[..len];
            let crc = u32::from_le_bytes(rest[len..len + 4].try_into().unwrap());
            if masked_crc32c(payload) != crc {
                return Err("payload CRC mismatch".into());
            }
            records.push(payload.to_vec());
            bytes = &rest[len + 4..];
        }
        Ok(records)
    }

    #[derive(Debug, Clone, PartialEq)]
    enum Field {
        Varint(u64),
        Fixed64(u64),
        Fixed32(u32),
        Bytes(Vec<u8>),
    }

    fn read_varint(bytes: &[u8], pos: &mut usize) -> u64 {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let b = bytes[*pos];
            *pos += 1;
            v |= ((b & 0x7f) as u64) << shift;
            if b & 0x80 == 0 {
                break;
            }
        }
        v
    }

    /// Decodes one message into (field number, value) pairs in wire order.
    fn decode(bytes: &[u8]) -> Vec<(u64, Field)> {
        let mut pos = 0;
        let mut fields = Vec::new();
        while pos < bytes.len() {
            let key = read_varint(bytes, &mut pos);
            let field = match key & 7 {
                0 => Field::Varint(read_varint(bytes, &mut pos)),
                1 => {
                    pos += 8;
                    Field::Fixed64(u64::from_le_bytes(bytes[pos - 8..pos].try_into().unwrap()))
                }
                2 => {
                    let len = read_varint(bytes, &mut pos) as usize;
                    pos += len;
                    Field::Bytes(bytes[pos - len..pos].to_vec())
                }
                5 => {
                    pos += 4;
                    Field::Fixed32(u32::from_le_bytes(bytes[pos - 4..pos].try_into().unwrap()))
                }
                w => panic!("unexpected wire type {w}"),
            };
            fields.push((key >> 3, field));
        }
        fields
    }

    fn get(fields: &[(u64, Field)], number: u64) -> Option<&Field> {
        fields.iter().find(|(n, _)| *n == number).map(|(_, f)| f)
    }

    fn get_all(fields: &[(u64, Field)], number: u64) -> Vec<&Field> {
        fields
            .iter()
            .filter(|(n, _)| *n == number)
            .map(|(_, f)| f)
            .collect()
    }

    fn bytes_of(f: Option<&Field>) -> &[u8] {
        match f {
            Some(Field::Bytes(b)) => b,
            other => panic!("expected bytes, got {other:?}"),
        }
    }

    /// A decoded `Event`.
    #[derive(Debug, PartialEq)]
    struct Event {
        wall_time: f64,
        step: i64,
        file_version: Option<String>,
        scalars: Vec<(String, f32)>,
        texts: Vec<(String, String)>,
    }

    fn decode_event(payload: &[u8]) -> Event {
        let f = decode(payload);
        let wall_time = match get(&f, 1) {
            Some(Field::Fixed64(bits)) => f64::from_bits(*bits),
            other => panic!("wall_time: {other:?}"),
        };
        let step = match get(&f, 2) {
            Some(Field::Varint(v)) => *v as i64,
            None => 0,
            other => panic!("step: {other:?}"),
        };
        let file_version =
            get(&f, 3).map(|v| String::from_utf8(bytes_of(Some(v)).to_vec()).unwrap());
        let mut scalars = Vec::new();
        let mut texts = Vec::new();
        if let Some(summary) = get(&f, 5) {
            for value in get_all(&decode(bytes_of(Some(summary))), 1) {
                let v = decode(bytes_of(Some(value)));
                let tag = String::from_utf8(bytes_of(get(&v, 1)).to_vec()).unwrap();
                match (get(&v, 2), get(&v, 8)) {
                    (Some(Field::Fixed32(bits)), None) => {
                        scalars.push((tag, f32::from_bits(*bits)))
                    }
                    (None, Some(tensor)) => {
                        let meta = decode(bytes_of(get(&v, 9)));
                        let plugin = decode(bytes_of(get(&meta, 1)));
                        assert_eq!(bytes_of(get(&plugin, 1)), b"text");
                        let t = decode(bytes_of(Some(tensor)));
                        assert_eq!(get(&t, 1), Some(&Field::Varint(7)), "dtype DT_STRING");
                        let s = bytes_of(get(&t, 8)).to_vec();
                        texts.push((tag, String::from_utf8(s).unwrap()));
                    }
                    other => panic!("value of unknown kind: {other:?}"),
                }
            }
        }
        Event {
            wall_time,
            step,
            file_version,
            scalars,
            texts,
        }
    }

    fn log_pairs(t: &mut TensorBoardTracker, pairs: &[(&str, LogValue)], step: Option<u64>) {
        let map: BTreeMap<String, LogValue> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect();
        t.log(&map, step).unwrap();
    }

    // ---- tests ----

    #[test]
    fn the_event_file_round_trips_through_an_independent_reader() {
        let dir = tempfile::tempdir().unwrap();
        let mut t = TensorBoardTracker::new("proj", dir.path()).unwrap();
        let name = t
            .event_path()
            .file_name()
            .unwrap()
            .to_string_lossy()
            .into_owned();
        assert!(name.starts_with("events.out.tfevents."), "{name}");
        assert_eq!(t.event_path().parent().unwrap(), dir.path().join("proj"));

        log_pairs(
            &mut t,
            &[("loss", 0.5.into()), ("lr", 1e-3.into())],
            Some(10),
        );
        log_pairs(
            &mut t,
            &[("loss", 0.25f32.into()), ("epoch", 2i64.into())],
            None,
        );
        log_pairs(&mut t, &[("sample", "**hello** world".into())], Some(100));
        // Read before `finish`: each log is flushed.
        let records = read_records(&std::fs::read(t.event_path()).unwrap()).unwrap();
        t.finish().unwrap();

        let events: Vec<Event> = records.iter().map(|r| decode_event(r)).collect();
        assert_eq!(events.len(), 4);
        assert_eq!(events[0].file_version.as_deref(), Some("brain.Event:2"));
        assert!(events[0].wall_time > 1.6e9);
        assert!(events[0].scalars.is_empty());

        assert_eq!(events[1].step, 10);
        assert_eq!(
            events[1].scalars,
            [("loss".into(), 0.5), ("lr".into(), 1e-3f32)]
        );
        assert_eq!(events[2].step, 11);
        assert_eq!(
            events[2].scalars,
            [("epoch".into(), 2.0), ("loss".into(), 0.25)]
        );
        assert_eq!(events[3].step, 100);
        assert_eq!(
            events[3].texts,
            [("sample".into(), "**hello** world".into())]
        );
        assert!(events[1..].iter().all(|e| e.file_version.is_none()));
        assert!(events.windows(2).all(|w| w[0].wall_time <= w[1].wall_time));
    }

    #[test]
    fn the_configuration_is_a_text_summary_and_config_json() {
        let dir = tempfile::tempdir().unwrap();
        let mut t = TensorBoardTracker::new("proj", dir.path()).unwrap();
        let config = serde_json::json!({"lr": 0.001, "model": "mlp"});
        t.store_init_configuration(&config).unwrap();
        t.finish().unwrap();

        let read: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(t.dir().join("config.json")).unwrap())
                .unwrap();
        assert_eq!(read, config);

        let records = read_records(&std::fs::read(t.event_path()).unwrap()).unwrap();
        let event = decode_event(&records[1]);
        assert_eq!(event.step, 0);
        let (tag, text) = &event.texts[0];
        assert_eq!(tag, TensorBoardTracker::CONFIG_TAG);
        let unindented: String = text.lines().map(|l| &l[4..]).collect::<Vec<_>>().join("\n");
        assert_eq!(
            serde_json::from_str::<serde_json::Value>(&unindented).unwrap(),
            config
        );
    }

    #[test]
    fn garbled_or_truncated_files_fail_the_crc_checks() {
        let dir = tempfile::tempdir().unwrap();
        let mut t = TensorBoardTracker::new("proj", dir.path()).unwrap();
        log_pairs(&mut t, &[("loss", 1.0.into())], Some(1));
        t.finish().unwrap();
        let good = std::fs::read(t.event_path()).unwrap();
        assert_eq!(read_records(&good).unwrap().len(), 2);

        // A flipped bit in the last payload byte before its CRC.
        let mut garbled = good.clone();
        let at = garbled.len() - 5;
        garbled[at] ^= 0x01;
        assert_eq!(read_records(&garbled).unwrap_err(), "payload CRC mismatch");

        // A flipped bit in the first length.
        let mut bad_len = good.clone();
        bad_len[0] ^= 0x80;
        assert_eq!(read_records(&bad_len).unwrap_err(), "length CRC mismatch");

        // A file cut mid-record, as a crash during a write could leave it.
        let cut = &good[..good.len() - 3];
        assert!(read_records(cut)
            .unwrap_err()
            .starts_with("truncated payload"));
    }

    #[test]
    fn two_writers_in_the_same_second_get_distinct_files() {
        let dir = tempfile::tempdir().unwrap();
        let a = TensorBoardTracker::new("proj", dir.path()).unwrap();
        let b = TensorBoardTracker::new("proj", dir.path()).unwrap();
        assert_ne!(a.event_path(), b.event_path());
    }

    #[test]
    fn logging_after_finish_is_a_usage_error() {
        let dir = tempfile::tempdir().unwrap();
        let mut t = TensorBoardTracker::new("proj", dir.path()).unwrap();
        t.finish().unwrap();
        let err = t.log(&BTreeMap::new(), Some(0)).unwrap_err();
        assert!(matches!(err, Error::Usage(_)), "{err}");
    }

    /// Writes an event file for checking with Python's TensorBoard by hand:
    /// `TB_INTEROP_DIR=/tmp/tb cargo test -p accel-core trackers::tensorboard::tests::interop -- --ignored`.
    #[test]
    #[ignore = "writes into $TB_INTEROP_DIR for a manual check with Python tensorboard"]
    fn interop_sample_for_python_tensorboard() {
        let dir = std::env::var("TB_INTEROP_DIR").expect("set TB_INTEROP_DIR");
        let mut t = TensorBoardTracker::new("interop", &dir).unwrap();
        t.store_init_configuration(&serde_json::json!({"lr": 0.001, "batch_size": 32}))
            .unwrap();
        for step in 0..5u64 {
            let loss = 1.0 / (step as f64 + 1.0);
            log_pairs(
                &mut t,
                &[("loss", loss.into()), ("tokens", (step * 1000).into())],
                Some(step),
            );
        }
        log_pairs(&mut t, &[("sample", "**hello** from rust".into())], Some(4));
        t.finish().unwrap();
        println!("{}", t.event_path().display());
    }
}
