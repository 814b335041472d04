//! The shared file every rank maps: layout, atomic counters and byte copies.
//!
//! This is the only module of accel-dist with `unsafe` code. It keeps the
//! mapping behind a safe interface that cannot break memory safety whatever
//! the callers (or the peer processes) do:
//!
//! - The mapping is a [`MmapRaw`]: Rust never holds a `&[u8]`/`&mut [u8]`
//!   over shared bytes, so no aliasing promise is made that another process
//!   could break by writing.
//! - Payload bytes move only through [`Segment::write`] and
//!   [`Segment::read`]: bounds-checked `copy_nonoverlapping` between a
//!   private slice and the mapping. The element types are [`Pod`], so any
//!   bytes a misbehaving peer leaves behind are still valid values; the
//!   worst a protocol bug can do is produce wrong numbers.
//! - Counters are [`AtomicU64`] views of 8-byte-aligned words inside the
//!   mapping, valid as long as the segment lives; atomics are meant to be
//!   shared, and lock-free 64-bit atomics work across processes on the same
//!   physical memory.
//!
//! Layout (all offsets multiples of 64 bytes):
//!
//! ```text
//! header   4096 B   magic:u64 nonce:u64 world:u64 slot_bytes:u64
//! control  world × 256 B   per rank: written, reduced, done (u64 counters),
//!                          then NBUF descriptors of 3 × u64
//! data     world × NBUF × slot_bytes   per rank: NBUF slots
//! ```
#![allow(unsafe_code)]

use std::fs::{File, OpenOptions};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;

use bytemuck::Pod;
use memmap2::{MmapOptions, MmapRaw};

/// Slots per rank: a rank fills slot `s % NBUF` in step `s` while its peers
/// may still be reading the previous step's slot.
pub(crate) const NBUF: usize = 2;
/// Words of a call descriptor (see `collectives.rs`).
pub(crate) const DESC_WORDS: usize = 3;

const MAGIC: u64 = u64::from_le_bytes(*b"ACCELSH1");
const HEADER_BYTES: usize = 4096;
/// One rank's control block; two cache lines keep ranks from false sharing.
const CONTROL_BYTES: usize = 256;
const _: () = assert!(8 * (3 + NBUF * DESC_WORDS) <= CONTROL_BYTES);

/// A rank's progress counters; each holds `step + 1` of the last step that
/// reached the point it names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Counter {
    /// The rank's slot holds its data for the step.
    Written = 0,
    /// The rank's reduced sub-piece is in its slot (all-reduce only).
    Reduced = 1,
    /// The rank has finished reading its peers' slots.
    Done = 2,
}

/// A mapped segment shared by the ranks of one communicator.
pub(crate) struct Segment {
    map: MmapRaw,
    world: usize,
    slot_bytes: usize,
}

impl Segment {
    /// Bytes a segment for `world` ranks with slots of `slot_bytes` needs.
    pub fn size(world: usize, slot_bytes: usize) -> usize {
        HEADER_BYTES + world * CONTROL_BYTES + world * NBUF * slot_bytes
    }

    /// Creates `path` (which must not exist), sizes it and maps it.
    ///
    /// `slot_bytes` must be a positive multiple of 64.
    pub fn create(path: &Path, world: usize, slot_bytes: usize, nonce: u64) -> io::Result<Self> {
        assert!(
            slot_bytes > 0 && slot_bytes.is_multiple_of(64),
            "slot size {slot_bytes}"
        );
        let file = open_options().create_new(true).open(path)?;
        // A fresh file is zero-filled: every counter starts at 0.
        let size = Self::size(world, slot_bytes);
        let mapped = file
            .set_len(size as u64)
            .and_then(|()| reserve(&file, size))
            .and_then(|()| Self::map(&file, world, slot_bytes));
        let seg = mapped.inspect_err(|_| {
            // Ours (create_new): remove it rather than leave it in /dev/shm.
            let _ = std::fs::remove_file(path);
        })?;
        seg.word(8)
            .store(nonce, std::sync::atomic::Ordering::Relaxed);
        seg.word(16)
            .store(world as u64, std::sync::atomic::Ordering::Relaxed);
        seg.word(24)
            .store(slot_bytes as u64, std::sync::atomic::Ordering::Relaxed);
        // Published last: a reader that sees the magic sees the rest.
        seg.word(0)
            .store(MAGIC, std::sync::atomic::Ordering::Release);
        Ok(seg)
    }

    /// Maps a segment another rank created, checking that it is the one
    /// announced (magic, `nonce`, world and slot size).
    pub fn open(path: &Path, world: usize, slot_bytes: usize, nonce: u64) -> io::Result<Self> {
        let file = open_options().open(path)?;
        let len = file.metadata()?.len();
        if len != Self::size(world, slot_bytes) as u64 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "{} has {len} bytes, expected {}",
                    path.display(),
                    Self::size(world, slot_bytes)
                ),
            ));
        }
        let seg = Self::map(&file, world, slot_bytes)?;
        use std::sync::atomic::Ordering::{Acquire, Relaxed};
        let found = (
            seg.word(0).load(Acquire),
            seg.word(8).load(Relaxed),
            seg.word(16).load(Relaxed),
            seg.word(24).load(Relaxed),
        );
        if found != (MAGIC, nonce, world as u64, slot_bytes as u64) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{} is not the announced segment", path.display()),
            ));
        }
        Ok(seg)
    }

    fn map(file: &File, world: usize, slot_bytes: usize) -> io::Result<Self> {
        let map = MmapOptions::new()
            .len(Self::size(world, slot_bytes))
            .map_raw(file)?;
        Ok(Self {
            map,
            world,
            slot_bytes,
        })
    }

    /// Bytes in one slot.
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// The 8-byte word at byte `offset` of the mapping, as an atomic.
    fn word(&self, offset: usize) -> &AtomicU64 {
        assert!(
            offset.is_multiple_of(8) && offset + 8 <= self.map.len(),
            "word {offset}"
        );
        // SAFETY: the mapping is page-aligned and `offset` is a multiple of
        // 8 inside it (checked above), so the pointer is aligned and valid
        // for 8 bytes for as long as `self` (and so the mapping) lives,
        // which bounds the returned lifetime. `AtomicU64` has the layout of
        // `u64` and permits shared mutation, so other processes writing the
        // same word atomically is exactly what it is for. The region is only
        // ever accessed atomically: counters and descriptors never overlap
        // the payload slots that `write`/`read` copy.
        unsafe { &*self.map.as_mut_ptr().add(offset).cast::<AtomicU64>() }
    }

    fn control(&self, rank: usize) -> usize {
        assert!(rank < self.world, "rank {rank} of {}", self.world);
        HEADER_BYTES + rank * CONTROL_BYTES
    }

    /// A progress counter of `rank`.
    pub fn counter(&self, rank: usize, which: Counter) -> &AtomicU64 {
        self.word(self.control(rank) + 8 * which as usize)
    }

    /// Word `i` of the call descriptor `rank` stored with slot `buf`.
    pub fn desc(&self, rank: usize, buf: usize, i: usize) -> &AtomicU64 {
        assert!(buf < NBUF && i < DESC_WORDS);
        self.word(self.control(rank) + 8 * (3 + buf * DESC_WORDS + i))
    }

    /// Byte offset of `len` bytes at `offset` in slot `buf` of `rank`, bounds-checked.
    fn slot_range(&self, rank: usize, buf: usize, offset: usize, len: usize) -> usize {
        assert!(rank < self.world && buf < NBUF);
        assert!(
            offset
                .checked_add(len)
                .is_some_and(|end| end <= self.slot_bytes),
            "{len} bytes at {offset} overflow a {}-byte slot",
            self.slot_bytes
        );
        HEADER_BYTES + self.world * CONTROL_BYTES + (rank * NBUF + buf) * self.slot_bytes + offset
    }

    /// Copies `src` into slot `buf` of `rank` at byte `offset`.
    pub fn write<T: Pod>(&self, rank: usize, buf: usize, offset: usize, src: &[T]) {
        let bytes: &[u8] = bytemuck::cast_slice(src);
        let at = self.slot_range(rank, buf, offset, bytes.len());
        // SAFETY: `slot_range` checked that `at..at + len` lies in one slot
        // of the mapping, which outlives this call. Only raw pointers touch
        // the mapping, so no Rust reference to shared bytes exists, and the
        // private `src` cannot overlap a file mapping we never hand out as a
        // slice. Peers read these bytes only after this rank's release store
        // of `Written`/`Reduced` (see `collectives.rs`), so the copy does not
        // race with a well-behaved reader.
        unsafe {
            std::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                self.map.as_mut_ptr().add(at),
                bytes.len(),
            )
        }
    }

    /// Copies from slot `buf` of `rank` at byte `offset` into `dst`.
    pub fn read<T: Pod>(&self, rank: usize, buf: usize, offset: usize, dst: &mut [T]) {
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(dst);
        let at = self.slot_range(rank, buf, offset, bytes.len());
        // SAFETY: as in `write`: in bounds, raw pointers only, no overlap
        // with the private `dst`. The caller read the writer's counter with
        // acquire ordering first, so the bytes are complete; and `T: Pod`,
        // so even bytes from a peer that broke the protocol are valid `T`s.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.map.as_ptr().add(at),
                bytes.as_mut_ptr(),
                bytes.len(),
            )
        }
    }
}

/// Allocates the file's pages now. `/dev/shm` is often small (64 MiB in a
/// default container) and a mapped page that cannot be allocated kills the
/// process with `SIGBUS` when first touched; here it is an error instead,
/// and the job falls back to sockets.
#[cfg(target_os = "linux")]
fn reserve(file: &File, len: usize) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let len = len
        .try_into()
        .map_err(|_| io::Error::other("segment size overflows off_t"))?;
    nix::fcntl::posix_fallocate(file.as_raw_fd(), 0, len).map_err(io::Error::from)
}

/// Elsewhere pages are allocated on first touch.
#[cfg(not(target_os = "linux"))]
fn reserve(_file: &File, _len: usize) -> io::Result<()> {
    Ok(())
}

/// Read-write, and private to the user running the job.
fn open_options() -> OpenOptions {
    let mut o = OpenOptions::new();
    o.read(true).write(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut o, 0o600);
    o
}

/// A segment file that is removed when dropped (unless already removed).
pub(crate) struct SegmentFile {
    path: Option<PathBuf>,
}

impl SegmentFile {
    /// Takes charge of removing `path` (a file this process created).
    pub fn new(path: PathBuf) -> Self {
        Self { path: Some(path) }
    }

    /// Removes the file now: mappings stay valid, the name is freed.
    pub fn unlink(&mut self) {
        if let Some(path) = self.path.take() {
            if let Err(e) = std::fs::remove_file(&path) {
                tracing::warn!(path = %path.display(), error = %e, "removing the shared-memory file");
            }
        }
    }
}

impl Drop for SegmentFile {
    fn drop(&mut self) {
        self.unlink();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use super::*;

    fn temp_path(name: &str) -> PathBuf {
        std::env::temp_dir().join(format!("accel-seg-test-{name}-{}", std::process::id()))
    }

    #[test]
    fn a_second_mapping_sees_the_first_ones_bytes_and_counters() {
        let path = temp_path("share");
        let mut file = SegmentFile::new(path.clone());
        let a = Segment::create(&path, 2, 128, 42).unwrap();
        let b = Segment::open(&path, 2, 128, 42).unwrap();
        file.unlink();
        assert!(!path.exists());
        a.write(1, 1, 8, &[1.5f32, -2.0]);
        a.counter(1, Counter::Written).store(7, Ordering::Release);
        assert_eq!(b.counter(1, Counter::Written).load(Ordering::Acquire), 7);
        let mut got = [0f32; 2];
        b.read(1, 1, 8, &mut got);
        assert_eq!(got, [1.5, -2.0]);
        // Slots of other ranks and buffers are separate.
        let mut other = [9u8; 16];
        b.read(0, 1, 0, &mut other);
        assert_eq!(other, [0; 16]);
    }

    #[test]
    fn opening_checks_the_nonce_and_creating_never_reuses_a_file() {
        let path = temp_path("nonce");
        let _file = SegmentFile::new(path.clone());
        let _a = Segment::create(&path, 3, 64, 1).unwrap();
        assert!(Segment::open(&path, 3, 64, 2).is_err());
        assert!(Segment::open(&path, 2, 64, 1).is_err());
        assert!(Segment::create(&path, 3, 64, 1).is_err());
    }

    #[test]
    #[should_panic(expected = "overflow")]
    fn a_copy_past_the_slot_panics() {
        let path = temp_path("bounds");
        let _file = SegmentFile::new(path.clone());
        let a = Segment::create(&path, 1, 64, 1).unwrap();
        a.write(0, 0, 60, &[0u8; 8]);
    }
}
