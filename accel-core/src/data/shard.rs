//! Which batches each process sees: a line-by-line port of Accelerate's
//! `BatchSamplerShard` (accelerate 1.15, `data_loader.py`), plus the `remainder`
//! that `Accelerator.gather_for_metrics` uses to drop the padding samples of the
//! last step.
//!
//! The port is exact on purpose, quirks included (for example `__len__` can be
//! larger than the number of batches a process really gets with
//! `split_batches` and `even_batches == false`): a multi-process run must see
//! the same samples, in the same order, as the same run under Accelerate, and
//! every process must agree on how many steps an epoch has.

use crate::{Error, Result};

/// Settings of the sharding (Accelerate's `BatchSamplerShard` arguments).
///
/// [`Default`] is a single process with Accelerate's defaults
/// (`split_batches = false`, `even_batches = true`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardConfig {
    /// Number of processes running concurrently (at least 1).
    pub num_processes: usize,
    /// Index of this process, `0..num_processes`.
    pub process_index: usize,
    /// Split every batch of the wrapped sampler into `num_processes` pieces
    /// (one per process) instead of giving each process whole batches in turn.
    /// Needs a batch size that is a multiple of `num_processes`.
    pub split_batches: bool,
    /// Wrap around to the first samples so that every process gets the same
    /// number of full batches; when false the last batches may be short or
    /// missing on some processes.
    pub even_batches: bool,
}

impl Default for ShardConfig {
    fn default() -> Self {
        Self {
            num_processes: 1,
            process_index: 0,
            split_batches: false,
            even_batches: true,
        }
    }
}

impl ShardConfig {
    /// Checks what `BatchSamplerShard.__init__` checks (a batch size divisible
    /// by the number of processes with `split_batches`), plus the settings
    /// Python would silently turn into garbage or a crash: no process at all,
    /// a process index out of range, and a zero batch size (which torch's
    /// `BatchSampler` rejects).
    fn validate(&self, batch_size: usize) -> Result<()> {
        if self.num_processes == 0 {
            return Err(Error::Config {
                key: "num_processes".into(),
                reason: "must be at least 1".into(),
            });
        }
        if self.process_index >= self.num_processes {
            return Err(Error::Config {
                key: "process_index".into(),
                reason: format!(
                    "{} is out of range for {} processes",
                    self.process_index, self.num_processes
                ),
            });
        }
        if batch_size == 0 {
            return Err(Error::Config {
                key: "batch_size".into(),
                reason: "must be at least 1".into(),
            });
        }
        if self.split_batches && !batch_size.is_multiple_of(self.num_processes) {
            return Err(Error::Config {
                key: "split_batches".into(),
                reason: format!(
                    "the batch size ({batch_size}) needs to be a round multiple of the \
                     number of processes ({})",
                    self.num_processes
                ),
            });
        }
        Ok(())
    }
}

/// The batches (lists of sample indices) this process sees in one epoch, given
/// the batches of the whole (unsharded) sampler for that epoch and the
/// `batch_size` and `drop_last` of that sampler: exactly
/// `list(BatchSamplerShard(batch_sampler, num_processes, process_index,
/// split_batches, even_batches))`.
///
/// Batches shorter than `batch_size` are allowed anywhere (as from a custom
/// sampler) and are treated as Accelerate treats them; batches longer than
/// `batch_size` are refused with [`Error::Usage`] because Accelerate's
/// wrap-around arithmetic goes wrong on them.
///
/// Accelerate's `prepare_data_loader` does not wrap the sampler at all with a
/// single process, whereas a one-process `BatchSamplerShard` with
/// `even_batches` still pads a short last batch to `batch_size`; callers that
/// mirror `prepare_data_loader` should skip sharding when
/// `num_processes == 1`.
///
/// ```
/// use accel_core::data::{shard_batches, ShardConfig};
/// // 5 samples, batch size 2, two processes: the short batch [4] is completed
/// // with sample 0 for process 0, and process 1 continues with samples 1 and 2.
/// let batches = vec![vec![0, 1], vec![2, 3], vec![4]];
/// let p0 = ShardConfig { num_processes: 2, process_index: 0, ..ShardConfig::default() };
/// let p1 = ShardConfig { process_index: 1, ..p0 };
/// assert_eq!(shard_batches(&batches, 2, false, &p0).unwrap(), vec![vec![0, 1], vec![4, 0]]);
/// assert_eq!(shard_batches(&batches, 2, false, &p1).unwrap(), vec![vec![2, 3], vec![1, 2]]);
/// ```
pub fn shard_batches(
    batches: &[Vec<usize>],
    batch_size: usize,
    drop_last: bool,
    config: &ShardConfig,
) -> Result<Vec<Vec<usize>>> {
    config.validate(batch_size)?;
    if let Some(i) = batches.iter().position(|b| b.len() > batch_size) {
        return Err(Error::Usage(format!(
            "shard_batches: batch {i} has {} samples, more than the batch size {batch_size}",
            batches[i].len()
        )));
    }
    Ok(if config.split_batches {
        iter_with_split(batches, batch_size, drop_last, config)
    } else {
        iter_with_no_split(batches, batch_size, drop_last, config)
    })
}

/// Python's `seq[lo:hi]` for `0 <= lo <= hi`: clamps to the length instead of
/// panicking, which the short last batch relies on.
fn py_slice(seq: &[usize], lo: usize, hi: usize) -> Vec<usize> {
    let n = seq.len();
    seq[lo.min(n)..hi.min(n)].to_vec()
}

/// `BatchSamplerShard._iter_with_split`.
fn iter_with_split(
    batches: &[Vec<usize>],
    batch_size: usize,
    drop_last: bool,
    config: &ShardConfig,
) -> Vec<Vec<usize>> {
    let batch_length = batch_size / config.num_processes;
    let lo = batch_length * config.process_index;
    let hi = batch_length * (config.process_index + 1);
    let mut out = Vec::new();
    for batch in batches {
        // If the batch is full, this process takes its piece of it.
        if batch.len() == batch_size {
            out.push(batch[lo..hi].to_vec());
        }
    }

    // `initial_data` is the first batch; `len(initial_data) > 0` also guards the
    // empty sampler, where Python's `batch` is never bound.
    let (Some(initial_data), Some(last)) = (batches.first(), batches.last()) else {
        return out;
    };
    // If drop_last is set or the last batch was full, iteration is over.
    if drop_last || initial_data.is_empty() || last.len() >= batch_size {
        return out;
    }
    if !config.even_batches {
        // Only the processes whose piece of the short batch is non-empty get it.
        if last.len() > lo {
            out.push(py_slice(last, lo, hi));
        }
    } else {
        // For degenerate cases where the dataset has fewer than batch_size
        // samples, the first batch is doubled until it can fill a batch.
        // (Python doubles the first batch in place, so with a single batch the
        // short batch is doubled too; both ways the result is the short batch
        // followed by the first samples cycled, so the slice is the same.)
        let mut initial = initial_data.clone();
        while initial.len() < batch_size {
            initial.extend_from_within(..);
        }
        let mut padded = last.clone();
        padded.extend_from_slice(&initial);
        out.push(py_slice(&padded, lo, hi));
    }
    out
}

/// `BatchSamplerShard._iter_with_no_split` (the `batch_size is not None` path:
/// our sampler always has a batch size).
fn iter_with_no_split(
    batches: &[Vec<usize>],
    batch_size: usize,
    drop_last: bool,
    config: &ShardConfig,
) -> Vec<Vec<usize>> {
    let np = config.num_processes;
    let pi = config.process_index;
    let mut out = Vec::new();
    // The indices of the first `num_processes` batches, to circle back to at the end.
    let mut initial_data: Vec<usize> = Vec::new();
    let mut batch_to_yield: Option<&Vec<usize>> = None;
    for (idx, batch) in batches.iter().enumerate() {
        if !drop_last && idx < np {
            initial_data.extend_from_slice(batch);
        }
        // This process's batch of the current round is only handed out once the
        // round is known to end with a full batch, so that every process gets
        // one and they stay in step.
        if idx % np == pi {
            batch_to_yield = Some(batch);
        }
        if idx % np == np - 1 && batch.len() == batch_size {
            // Always `Some` here: the round's slot `pi <= np - 1` was just filled.
            if let Some(b) = batch_to_yield.take() {
                out.push(b.clone());
            }
        }
    }

    // If drop_last is set (or the sampler was empty), iteration is over.
    if drop_last || initial_data.is_empty() {
        return out;
    }
    // `initial_data` is non-empty, so there is at least one batch.
    let last_idx = batches.len() - 1;
    let last = &batches[last_idx];
    if !config.even_batches {
        // Python's `if batch_to_yield:`: None and an empty list are both false.
        if let Some(b) = batch_to_yield.filter(|b| !b.is_empty()) {
            out.push(b.clone());
        }
        return out;
    }

    // The pending batch is handed out as is when it is full.
    if let Some(b) = batch_to_yield.filter(|b| !b.is_empty() && b.len() == batch_size) {
        out.push(b.clone());
    }

    // For degenerate cases where the dataset has fewer than
    // num_processes * batch_size samples, repeat what there is.
    let min_length_needed = np * batch_size;
    while initial_data.len() < min_length_needed {
        initial_data.extend_from_within(..);
    }

    // If the last batch seen was full, its process has had it: move to the next slot.
    let mut idx = last_idx;
    let mut batch: Vec<usize> = last.clone();
    if batch.len() == batch_size {
        batch.clear();
        idx += 1;
    }

    // Complete the short batch and add batches from the start of the epoch
    // until the round is complete, so every process yields as many batches.
    let mut cycle_index = 0;
    while !idx.is_multiple_of(np) || !batch.is_empty() {
        // `batch.len() <= batch_size` (checked in `shard_batches`), so this
        // never goes below `cycle_index` as it could in Python.
        let end_index = cycle_index + batch_size - batch.len();
        let take = py_slice(&initial_data, cycle_index, end_index);
        batch.extend_from_slice(&take);
        if idx % np == pi {
            out.push(std::mem::take(&mut batch));
        }
        cycle_index = end_index;
        batch.clear();
        idx += 1;
    }
    out
}

/// Number of batches per process: `len(BatchSamplerShard(...))` for a wrapped
/// sampler of `num_batches` batches of (at most) `batch_size` samples.
///
/// This is Accelerate's `__len__`, which is what every process plans an epoch
/// with. It may exceed `shard_batches(..).len()` in one case, as in
/// Accelerate: with `split_batches`, `even_batches == false` and
/// `drop_last == false`, a process whose piece of the short last batch is
/// empty gets one batch fewer.
///
/// Fails as [`shard_batches`] does for invalid settings (Accelerate's
/// constructor raises before `__len__` can be called).
pub fn sharded_len(
    num_batches: usize,
    batch_size: usize,
    drop_last: bool,
    config: &ShardConfig,
) -> Result<usize> {
    config.validate(batch_size)?;
    let np = config.num_processes;
    if config.split_batches {
        // Splitting batches does not change the number of batches.
        return Ok(num_batches);
    }
    if num_batches.is_multiple_of(np) {
        return Ok(num_batches / np);
    }
    let length = num_batches / np;
    Ok(if drop_last {
        length
    } else if config.even_batches {
        // Evening the batches always completes the last round.
        length + 1
    } else if config.process_index < num_batches % np {
        // Otherwise only the processes that the last round reaches get one more.
        length + 1
    } else {
        length
    })
}

/// The number of real (not padded) samples in the last global step, as
/// Accelerate's `DataLoaderShard.remainder` that `gather_for_metrics` cuts the
/// gathered last step to (`data[:remainder]`), so that samples repeated to even
/// out the processes are not counted twice.
///
/// Mirrors `DataLoaderStateMixin.begin`: `None` (Accelerate's `-1`, "do not
/// truncate") when `drop_last` is set, otherwise
/// `Some(dataset_len % total_batch_size)` with `total_batch_size = batch_size`
/// under `split_batches` and `batch_size * num_processes` otherwise. The value
/// does not depend on `even_batches` or `process_index`. `Some(0)` also means
/// the gathered data is kept whole. A zero total batch size (an invalid
/// setting) gives `None`, as Accelerate swallows the division error.
pub fn remainder(
    dataset_len: usize,
    batch_size: usize,
    drop_last: bool,
    config: &ShardConfig,
) -> Option<usize> {
    if drop_last {
        return None;
    }
    // `DataLoaderShard.total_batch_size`: with one process Accelerate does not
    // wrap the sampler, which gives `batch_size` as well.
    let total_batch_size = if config.split_batches {
        batch_size
    } else {
        batch_size.checked_mul(config.num_processes)?
    };
    dataset_len.checked_rem(total_batch_size)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(num_processes: usize, process_index: usize, split: bool, even: bool) -> ShardConfig {
        ShardConfig {
            num_processes,
            process_index,
            split_batches: split,
            even_batches: even,
        }
    }

    /// torch's `BatchSampler(SequentialSampler(range(n)), bs, drop_last)`.
    fn sequential(n: usize, bs: usize, drop_last: bool) -> Vec<Vec<usize>> {
        (0..n)
            .collect::<Vec<_>>()
            .chunks(bs)
            .filter(|c| !drop_last || c.len() == bs)
            .map(|c| c.to_vec())
            .collect()
    }

    fn all(
        n: usize,
        bs: usize,
        drop_last: bool,
        np: usize,
        split: bool,
        even: bool,
    ) -> Vec<Vec<Vec<usize>>> {
        let b = sequential(n, bs, drop_last);
        (0..np)
            .map(|p| shard_batches(&b, bs, drop_last, &cfg(np, p, split, even)).unwrap())
            .collect()
    }

    #[test]
    fn whole_batches_go_to_processes_in_turn() {
        let got = all(24, 3, false, 2, false, true);
        assert_eq!(
            got[0],
            vec![
                vec![0, 1, 2],
                vec![6, 7, 8],
                vec![12, 13, 14],
                vec![18, 19, 20]
            ]
        );
        assert_eq!(
            got[1],
            vec![
                vec![3, 4, 5],
                vec![9, 10, 11],
                vec![15, 16, 17],
                vec![21, 22, 23]
            ]
        );
    }

    #[test]
    fn a_short_last_round_is_completed_from_the_start_of_the_epoch() {
        // Accelerate's own test: 21 samples, batch size 3, two processes.
        let got = all(21, 3, false, 2, false, true);
        assert_eq!(got[0].last().unwrap(), &vec![18, 19, 20]);
        assert_eq!(got[1].last().unwrap(), &vec![0, 1, 2]);
        // 22 samples: the short batch [21] is completed with 0 and 1.
        let got = all(22, 3, false, 2, false, true);
        assert_eq!(got[1].last().unwrap(), &vec![21, 0, 1]);
        assert_eq!(got[0].len(), got[1].len());
    }

    #[test]
    fn drop_last_stops_at_the_last_complete_round() {
        let got = all(21, 3, true, 2, false, true);
        assert_eq!(got[0].len(), 3);
        assert_eq!(got[1].len(), 3);
        assert_eq!(got[1].last().unwrap(), &vec![15, 16, 17]);
    }

    #[test]
    fn uneven_batches_leave_the_tail_as_it_is() {
        let got = all(22, 3, false, 2, false, false);
        assert_eq!(got[0].last().unwrap(), &vec![18, 19, 20]);
        assert_eq!(got[1].last().unwrap(), &vec![21]);
        let got = all(21, 3, false, 2, false, false);
        assert_eq!(got[0].len(), 4);
        assert_eq!(got[1].len(), 3);
    }

    #[test]
    fn a_tiny_dataset_is_repeated_until_every_process_has_a_full_batch() {
        // 2 samples, batch size 3, three processes: 0,1 then 0 / 1,0,1 / 0,1,0.
        let got = all(2, 3, false, 3, false, true);
        assert_eq!(
            got,
            vec![
                vec![vec![0, 1, 0]],
                vec![vec![1, 0, 1]],
                vec![vec![0, 1, 0]]
            ]
        );
    }

    #[test]
    fn split_batches_give_each_process_a_slice_of_every_batch() {
        let got = all(8, 4, false, 2, true, true);
        assert_eq!(got[0], vec![vec![0, 1], vec![4, 5]]);
        assert_eq!(got[1], vec![vec![2, 3], vec![6, 7]]);
        // A short last batch [8, 9, 10] is completed with the first batch.
        let got = all(11, 4, false, 2, true, true);
        assert_eq!(got[0].last().unwrap(), &vec![8, 9]);
        assert_eq!(got[1].last().unwrap(), &vec![10, 0]);
        // Without even batches process 1 gets just [10], and with one sample
        // left nothing at all.
        let got = all(11, 4, false, 2, true, false);
        assert_eq!(got[1].last().unwrap(), &vec![10]);
        let got = all(9, 4, false, 2, true, false);
        assert_eq!(got[0].last().unwrap(), &vec![8]);
        assert_eq!(got[1].len(), 2);
    }

    #[test]
    fn one_process_with_even_batches_still_pads_the_last_batch() {
        // As BatchSamplerShard does; prepare_data_loader avoids it by not sharding.
        let got = all(1, 2, false, 1, false, true);
        assert_eq!(got, vec![vec![vec![0, 0]]]);
    }

    #[test]
    fn an_empty_sampler_gives_no_batches() {
        for (split, even, drop) in [
            (false, true, false),
            (true, true, false),
            (false, false, true),
        ] {
            assert!(all(0, 2, drop, 2, split, even).iter().all(|p| p.is_empty()));
        }
    }

    #[test]
    fn invalid_settings_are_config_errors() {
        let b = sequential(6, 3, false);
        for bad in [
            cfg(2, 0, true, true),
            cfg(0, 0, false, true),
            cfg(2, 2, false, true),
        ] {
            assert!(matches!(
                shard_batches(&b, 3, false, &bad),
                Err(Error::Config { .. })
            ));
            assert!(matches!(
                sharded_len(b.len(), 3, false, &bad),
                Err(Error::Config { .. })
            ));
        }
        assert!(matches!(
            shard_batches(&b, 0, false, &cfg(1, 0, false, true)),
            Err(Error::Config { .. })
        ));
        // A batch longer than the batch size is a usage error, not silent garbage.
        assert!(matches!(
            shard_batches(&b, 2, false, &cfg(1, 0, false, true)),
            Err(Error::Usage(_))
        ));
    }

    #[test]
    fn length_follows_accelerate_len() {
        // 11 batches over 4 processes: 2 full rounds and 3 batches left.
        let c = |p, split, even| cfg(4, p, split, even);
        assert_eq!(sharded_len(11, 4, false, &c(3, false, true)).unwrap(), 3);
        assert_eq!(sharded_len(11, 4, true, &c(0, false, true)).unwrap(), 2);
        assert_eq!(sharded_len(11, 4, false, &c(2, false, false)).unwrap(), 3);
        assert_eq!(sharded_len(11, 4, false, &c(3, false, false)).unwrap(), 2);
        assert_eq!(sharded_len(11, 4, false, &c(3, true, false)).unwrap(), 11);
        assert_eq!(sharded_len(12, 4, false, &c(0, false, false)).unwrap(), 3);
    }

    #[test]
    fn remainder_counts_the_real_samples_of_the_last_global_step() {
        // 9 samples, batch size 5 per process, two processes: the one step has 9 real samples.
        assert_eq!(remainder(9, 5, false, &cfg(2, 0, false, true)), Some(9));
        assert_eq!(remainder(21, 3, false, &cfg(2, 1, false, true)), Some(3));
        assert_eq!(remainder(20, 4, false, &cfg(2, 0, true, true)), Some(0));
        assert_eq!(remainder(22, 4, false, &cfg(2, 0, true, false)), Some(2));
        assert_eq!(remainder(22, 4, true, &cfg(2, 0, true, true)), None);
        assert_eq!(remainder(22, 0, false, &cfg(2, 0, false, true)), None);
    }

    /// Parses "0 1,2 3" (batches split by ',', indices by ' ') as written by
    /// `tests/data/gen_shard_cases.py`.
    fn parse_batches(text: &str) -> Vec<Vec<usize>> {
        if text.is_empty() {
            return Vec::new();
        }
        text.split(',')
            .map(|b| b.split(' ').map(|i| i.parse().unwrap()).collect())
            .collect()
    }

    #[test]
    fn every_case_recorded_with_the_real_accelerate_matches() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/data/batch_sampler_shard_cases.json"
        );
        let text = std::fs::read_to_string(path).unwrap();
        let json: serde_json::Value = serde_json::from_str(&text).unwrap();
        let cases = json["cases"].as_array().unwrap();
        assert!(cases.len() > 2000, "only {} cases", cases.len());
        let mut checked = 0;
        for case in cases {
            let f = case.as_array().unwrap();
            let u = |i: usize| f[i].as_u64().unwrap() as usize;
            let (n, bs, np) = (u(0), u(1), u(2));
            let (split, even, drop_last) = (u(3) == 1, u(4) == 1, u(5) == 1);
            let want_rem = f[6].as_i64().unwrap();
            let what =
                format!("n={n} bs={bs} np={np} split={split} even={even} drop_last={drop_last}");

            let got_rem = remainder(n, bs, drop_last, &cfg(np, 0, split, even));
            assert_eq!(
                got_rem.map_or(-1, |r| r as i64),
                want_rem,
                "remainder, {what}"
            );

            let batches = sequential(n, bs, drop_last);
            let shards = f[7].as_array().unwrap();
            assert_eq!(shards.len(), np, "{what}");
            for (p, shard) in shards.iter().enumerate() {
                let config = cfg(np, p, split, even);
                let want_len = shard[0].as_u64().unwrap() as usize;
                let want = parse_batches(shard[1].as_str().unwrap());
                let got = shard_batches(&batches, bs, drop_last, &config).unwrap();
                assert_eq!(got, want, "batches of process {p}, {what}");
                let got_len = sharded_len(batches.len(), bs, drop_last, &config).unwrap();
                assert_eq!(got_len, want_len, "len of process {p}, {what}");
                checked += 1;
            }
        }
        assert!(checked > 5000, "only {checked} shards checked");
    }
}
