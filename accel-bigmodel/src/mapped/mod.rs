//! Memory maps, and tensors whose storage is a checkpoint's own pages: the one
//! file of accel-bigmodel that uses `unsafe`.
//!
//! Why tensors over the page cache: loading a checkpoint by reading it into
//! fresh memory costs a page fault and a zero-filled page per 4 KiB before
//! the copy even starts. In the VMs this project runs on that is 0.7-2 s per
//! GB, while mapping a file that is in the page cache and touching it costs
//! about 0.015 s per GB (the kernel maps 16 cached pages per fault). PyTorch
//! gets the same with `torch.load(mmap=True)` and safetensors' `safe_open`.
//!
//! candle 0.11 keeps a CPU tensor's elements in an owned `Vec`, which is
//! freed through the global allocator. A `Vec` may therefore point into a
//! file mapping only if the global allocator recognises such a pointer when
//! it is freed and does not hand it to malloc. [`MappedAlloc`] is that
//! allocator: a wrapper around any other (the system's by default) that the
//! final binary installs with `#[global_allocator]`. A library cannot
//! install it (a program has one global allocator, and it may want its own),
//! so without it every load reads into memory as before; [`enabled`] says
//! which path a load takes.
//!
//! A mapped tensor lives in a private (copy-on-write) mapping: writing to it
//! (`Var::set`) changes this process's copy only, never the file. When its
//! `Vec` is freed, the pages that lay wholly inside it are dropped from the
//! process (`MADV_DONTNEED`), so a disk-offloaded block whose weights are
//! mapped for one forward leaves nothing resident behind; the page cache
//! keeps them for the next forward. Two live tensors never share bytes: a
//! second request for bytes already handed out is refused and read instead.

use std::alloc::{GlobalAlloc, Layout, System};
use std::fs::File;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use candle_core::{DType, Device, Tensor, WithDType};
use memmap2::{Mmap, MmapMut, MmapOptions, UncheckedAdvice};

mod files;
mod setting;

pub(crate) use files::MappedFiles;
pub use setting::enabled;

use crate::dtype::with_pod_type;
use crate::error::{Error, Result};

/// Maps `file` read-only (the headers and bytes of [`crate::MmapFile`]).
pub(crate) fn map_read_only(file: &File, path: &Path) -> Result<Mmap> {
    // SAFETY: `Mmap::map` is unsafe because the returned `&[u8]` aliases the
    // file's pages: if another process writes the file while it is mapped, the
    // bytes change under a shared reference (undefined behaviour in Rust's
    // model), and if it truncates the file, touching the lost pages raises
    // SIGBUS. The contract of this crate, documented on `MmapFile` and
    // `CheckpointSource`, is that checkpoints are read-only inputs that nobody
    // modifies while they are loaded, the same contract as candle's
    // `from_mmaped_safetensors` and Python's `safe_open`. Within that
    // contract: the map is read-only (PROT_READ), so we never write through
    // it; it is owned by `MmapFile` together with the header validated against
    // it, so every slice handed out lies inside the mapping (offsets were
    // checked against the mapped length); and the mapping outlives every slice
    // because slices borrow `&self`. Writers in this workspace (accel-core's
    // checkpoint saver) never modify a file in place: they write a temporary
    // file and rename it over the old one, which leaves existing mappings of
    // the old inode intact.
    #[allow(unsafe_code)]
    let map = unsafe { Mmap::map(file) };
    map.map_err(|e| Error::io("memory-mapping", path, e))
}

/// Drops the pages of `[offset, offset + len)` of a read-only mapping from
/// the process (`MADV_DONTNEED`, whole pages around the range): a tensor
/// copied out of a checkpoint stops counting in the resident set, so
/// reading a model never holds its file's pages as well as the copies. A
/// later read faults them in again from the page cache, unchanged.
pub(crate) fn drop_read_pages(map: &Mmap, offset: usize, len: usize) {
    let page = page_size();
    let lo = offset / page * page;
    // memmap2 refuses a hint past the file's end: the last page is given
    // as its bytes up to the end.
    let hi = (offset + len).next_multiple_of(page).min(map.len());
    if hi <= lo {
        return;
    }
    // SAFETY: the mapping is read-only and shared with the file, which
    // nobody modifies while it is loaded (see `map_read_only`); dropping
    // its pages only makes later reads fault them in again from the page
    // cache with the same bytes, so slices borrowed from it stay valid and
    // unchanged. A refused hint leaves the pages resident, nothing else.
    #[allow(unsafe_code)]
    let _ = unsafe { map.unchecked_advise_range(UncheckedAdvice::DontNeed, lo, hi - lo) };
}

/// How many files can be mapped for tensors at once; a load beyond that
/// reads the further files into memory.
const SLOTS: usize = 128;

/// Set by [`MappedAlloc`] on its first allocation: only then may a `Vec`
/// point into a mapping.
pub(super) static INSTALLED: AtomicBool = AtomicBool::new(false);
/// Slots holding a mapping: zero means no pointer can be mapped, so freeing
/// costs one load more than the inner allocator.
static ACTIVE: AtomicUsize = AtomicUsize::new(0);
/// One past the highest slot ever used: frees scan only that far.
static USED: AtomicUsize = AtomicUsize::new(0);
static REGISTRY: [Slot; SLOTS] = [const { Slot::new() }; SLOTS];

struct Slot {
    // The mapping's address range; `lo == 0` while the slot is free. Read
    // without the lock by every free, so they are atomics.
    lo: AtomicUsize,
    hi: AtomicUsize,
    state: Mutex<SlotState>,
}

struct SlotState {
    map: Option<MmapMut>,
    /// Start address and byte length of every live `Vec` over the mapping.
    live: Vec<(usize, usize)>,
    /// Pages holding bytes of a freed `Vec` (perhaps written) that a live
    /// neighbour still shares; see [`drop_pages`].
    stale: Vec<usize>,
    /// Whether the [`MappedRegion`] handle is alive (it can hand out more).
    handle: bool,
}

impl Slot {
    const fn new() -> Self {
        Slot {
            lo: AtomicUsize::new(0),
            hi: AtomicUsize::new(0),
            state: Mutex::new(SlotState {
                map: None,
                live: Vec::new(),
                stale: Vec::new(),
                handle: false,
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, SlotState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn contains(&self, p: usize) -> bool {
        let lo = self.lo.load(Ordering::Acquire);
        lo != 0 && lo <= p && p < self.hi.load(Ordering::Acquire)
    }

    /// Clears the slot once neither a handle nor a `Vec` uses its mapping;
    /// the caller drops the returned map (the `munmap`) after unlocking.
    fn retire(&self, state: &mut SlotState) -> Option<MmapMut> {
        if state.handle || !state.live.is_empty() || state.map.is_none() {
            return None;
        }
        // Unpublish before unmapping: once the range is unmapped, malloc may
        // reuse it, and its pointers must not match this slot.
        self.lo.store(0, Ordering::SeqCst);
        self.hi.store(0, Ordering::SeqCst);
        ACTIVE.fetch_sub(1, Ordering::SeqCst);
        state.stale.clear();
        state.map.take()
    }
}

fn page_size() -> usize {
    static PAGE: AtomicUsize = AtomicUsize::new(0);
    match PAGE.load(Ordering::Relaxed) {
        0 => {
            // SAFETY: sysconf has no preconditions; it reads a constant.
            #[allow(unsafe_code)]
            let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
            let p = usize::try_from(p).ok().filter(|p| *p > 0).unwrap_or(4096);
            PAGE.store(p, Ordering::Relaxed);
            p
        }
        p => p,
    }
}

/// The slot whose mapping contains `p`.
fn slot_of(p: usize) -> Option<&'static Slot> {
    if ACTIVE.load(Ordering::Acquire) == 0 {
        return None;
    }
    let used = USED.load(Ordering::Acquire).min(SLOTS);
    REGISTRY[..used].iter().find(|s| s.contains(p))
}

/// Ends the `Vec` starting at `p` if it lies in a mapping: drops its pages
/// from the process and unmaps the file once nothing uses it. `false` when
/// `p` is not mapped memory (the inner allocator's).
fn release(p: usize) -> bool {
    let Some(slot) = slot_of(p) else {
        return false;
    };
    let retired = {
        let mut state = slot.lock();
        if let Some(i) = state.live.iter().position(|&(s, _)| s == p) {
            let (start, len) = state.live.swap_remove(i);
            drop_pages(slot, &mut state, start, len);
        }
        slot.retire(&mut state)
    };
    drop(retired);
    true
}

/// Drops the pages of the freed range `[start, start + len)` from the
/// process, so that they stop counting as resident and any writes to them
/// are forgotten (the next tensor over these bytes reads the file again).
///
/// A page the range shares with a live `Vec` (a neighbouring tensor's first
/// or last bytes) cannot be dropped yet: it is remembered as stale, no new
/// tensor may claim bytes on it, and it is dropped once its last live user
/// goes.
fn drop_pages(slot: &Slot, state: &mut SlotState, start: usize, len: usize) {
    let page = page_size();
    let base = slot.lo.load(Ordering::Acquire);
    let SlotState {
        map, live, stale, ..
    } = state;
    let Some(map) = map.as_ref() else {
        return;
    };
    let shared = |pg: usize| live.iter().any(|&(s, l)| s < pg + page && pg < s + l);
    // The kernel rounds a hint's length up to whole pages, and memmap2
    // refuses one reaching past the file's length: the file's last page is
    // passed as its bytes up to the end of the file.
    let end = base + map.len();
    let advise = |from: usize, to: usize| {
        let to = to.min(end);
        if to > from {
            // SAFETY: [from, to) is whole pages inside the mapping that no
            // live `Vec` overlaps (`shared` is false for each, and stale
            // pages are never claimed). Dropping pages of a private file
            // mapping makes later reads see the file again; nothing reads
            // them until a new `Vec` claims them. A refused hint only leaves
            // the pages resident (and their bytes as they were: a stale page
            // whose hint failed stays stale).
            #[allow(unsafe_code)]
            let r = unsafe {
                map.unchecked_advise_range(UncheckedAdvice::DontNeed, from - base, to - from)
            };
            r.is_ok()
        } else {
            true
        }
    };
    let (mut lo, mut hi) = (start / page * page, (start + len).next_multiple_of(page));
    if shared(lo) {
        stale.push(lo);
        lo += page;
    }
    if hi > lo && shared(hi - page) {
        stale.push(hi - page);
        hi -= page;
    }
    if !advise(lo, hi) {
        stale.extend((lo..hi).step_by(page));
    }
    stale.retain(|&pg| shared(pg) || !advise(pg, pg + page));
}

/// A global allocator that lets tensors live in memory-mapped checkpoint
/// files; everything else goes to the wrapped allocator.
///
/// Install it in a program that loads checkpoints for inference:
///
/// ```
/// #[global_allocator]
/// static ALLOC: accel_bigmodel::MappedAlloc = accel_bigmodel::MappedAlloc::system();
///
/// fn main() {
///     let _ = vec![0u8; 16]; // every allocation goes to the wrapped allocator
///     assert!(accel_bigmodel::mapped::enabled() || std::env::var("ACCEL_MMAP_WEIGHTS").as_deref() == Ok("0"));
/// }
/// ```
///
/// Loads then map CPU-resident and disk-offloaded weights instead of
/// reading them (see the module docs); set `ACCEL_MMAP_WEIGHTS=0` to read
/// them anyway. Its cost on every free is one atomic load while nothing is
/// mapped, and a scan of the mapped files' address ranges otherwise.
#[derive(Debug, Default)]
pub struct MappedAlloc<A = System> {
    inner: A,
}

impl MappedAlloc<System> {
    /// Wrapping the system allocator.
    pub const fn system() -> Self {
        MappedAlloc { inner: System }
    }
}

impl<A> MappedAlloc<A> {
    /// Wrapping `inner` (for example another crate's allocator).
    pub const fn new(inner: A) -> Self {
        MappedAlloc { inner }
    }
}

fn mark_installed() {
    if !INSTALLED.load(Ordering::Relaxed) {
        INSTALLED.store(true, Ordering::Relaxed);
    }
}

// SAFETY: every block handed out comes from `inner` and goes back to it,
// except blocks inside a registered mapping, which `inner` never handed out
// (address ranges of live mappings and of malloc's memory are disjoint):
// those are released to the registry instead. `realloc` of a mapped block
// moves it into a block of `inner` first, so the result is always `inner`'s.
#[allow(unsafe_code)]
unsafe impl<A: GlobalAlloc> GlobalAlloc for MappedAlloc<A> {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        mark_installed();
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { self.inner.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        mark_installed();
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { self.inner.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if !release(ptr as usize) {
            // SAFETY: not mapped, so `inner` allocated it with `layout`.
            unsafe { self.inner.dealloc(ptr, layout) }
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if slot_of(ptr as usize).is_none() {
            // SAFETY: not mapped, so `inner` allocated it with `layout`.
            return unsafe { self.inner.realloc(ptr, layout, new_size) };
        }
        // SAFETY: the caller guarantees `new_size` is a valid size for
        // `layout.align()`; the copy stays within both blocks.
        unsafe {
            let new = self
                .inner
                .alloc(Layout::from_size_align_unchecked(new_size, layout.align()));
            if !new.is_null() {
                std::ptr::copy_nonoverlapping(ptr, new, layout.size().min(new_size));
                release(ptr as usize);
            }
            new
        }
    }
}

/// What is mapped now.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MappedStats {
    /// Files mapped (by a loader or by live tensors).
    pub files: usize,
    /// Live tensors over mapped files.
    pub tensors: usize,
    /// Their bytes.
    pub bytes: usize,
}

/// Counts the mapped files and the live tensors over them.
pub fn stats() -> MappedStats {
    let mut s = MappedStats::default();
    for slot in &REGISTRY {
        let state = slot.lock();
        if state.map.is_some() {
            s.files += 1;
            s.tensors += state.live.len();
            s.bytes += state.live.iter().map(|(_, l)| l).sum::<usize>();
        }
    }
    s
}

/// Whether `t`'s storage lies in a mapped file.
pub fn is_mapped(t: &Tensor) -> bool {
    accel_kernels::storage_key(t).is_some_and(|p| slot_of(p).is_some())
}

/// A file mapped copy-on-write whose byte ranges become tensors without a
/// copy. The mapping lives until this handle and every tensor over it are
/// gone.
#[derive(Debug)]
pub(crate) struct MappedRegion {
    slot: usize,
    base: usize,
    len: usize,
}

impl MappedRegion {
    /// Maps `path`; `Ok(None)` when tensors cannot be mapped here (see
    /// [`enabled`]), the file is empty, or every slot is taken.
    pub(crate) fn open(path: &Path) -> Result<Option<Arc<Self>>> {
        if !enabled() {
            return Ok(None);
        }
        let file = File::open(path).map_err(|e| Error::io("opening", path, e))?;
        // SAFETY: the crate's read-only contract on checkpoint files (see
        // `map_read_only`). The mapping is private: writes through a tensor
        // over it change this process's pages only, never the file.
        #[allow(unsafe_code)]
        let map = unsafe { MmapOptions::new().map_copy(&file) };
        let map = map.map_err(|e| Error::io("memory-mapping", path, e))?;
        if map.is_empty() {
            return Ok(None);
        }
        let (base, len) = (map.as_ptr() as usize, map.len());
        let mut map = Some(map);
        for (i, slot) in REGISTRY.iter().enumerate() {
            let mut state = slot.lock();
            if state.map.is_some() {
                continue;
            }
            state.map = map.take();
            state.handle = true;
            slot.hi.store(base + len, Ordering::SeqCst);
            slot.lo.store(base, Ordering::SeqCst);
            USED.fetch_max(i + 1, Ordering::SeqCst);
            ACTIVE.fetch_add(1, Ordering::SeqCst);
            return Ok(Some(Arc::new(MappedRegion { slot: i, base, len })));
        }
        Ok(None)
    }

    /// The `dtype` tensor of `shape` stored at byte `offset`, over the
    /// mapping itself; `None` when its bytes are out of range, misaligned
    /// for `dtype`, of a dtype without a plain element type, or already
    /// handed out to a live tensor (the caller then reads a copy).
    pub(crate) fn tensor(&self, offset: u64, dtype: DType, shape: &[usize]) -> Option<Tensor> {
        let n = shape.iter().product::<usize>().max(1);
        let bytes = n.checked_mul(dtype.size_in_bytes())?;
        let offset = usize::try_from(offset).ok()?;
        if bytes == 0 || offset.checked_add(bytes)? > self.len {
            return None;
        }
        let start = self.base + offset;
        with_pod_type!(dtype, |T| self.claim::<T>(start, n, shape), _ => None)
    }

    fn claim<T: WithDType + bytemuck::Pod>(
        &self,
        start: usize,
        n: usize,
        shape: &[usize],
    ) -> Option<Tensor> {
        let v = self.claim_vec::<T>(start, n)?;
        // On error the `Vec` is dropped inside candle, which releases it.
        Tensor::from_vec(v, shape, &Device::Cpu).ok()
    }

    /// The `n` elements at address `start` as a `Vec` over the mapping.
    fn claim_vec<T: bytemuck::Pod>(&self, start: usize, n: usize) -> Option<Vec<T>> {
        if !start.is_multiple_of(std::mem::align_of::<T>()) {
            return None;
        }
        let bytes = n * std::mem::size_of::<T>();
        {
            let mut state = REGISTRY[self.slot].lock();
            let overlaps = |&(s, l): &(usize, usize)| s < start + bytes && start < s + l;
            let page = page_size();
            let on_stale = |&pg: &usize| pg < start + bytes && start < pg + page;
            if state.live.iter().any(overlaps) || state.stale.iter().any(on_stale) {
                return None;
            }
            state.live.push((start, bytes));
        }
        // SAFETY: `Vec::from_raw_parts` needs a pointer the global allocator
        // will accept back with this layout, aligned, valid for reads and
        // writes of `n` initialised `T`s that nothing else owns:
        // - the global allocator is `MappedAlloc` (`enabled` checked it
        //   when the region was opened), and its `dealloc`/`realloc` hand a
        //   pointer inside a registered mapping to `release`, never to the
        //   inner allocator; the mapping stays registered while `live` lists
        //   this `Vec`;
        // - `start` is aligned for `T` (checked above) and `[start, start +
        //   bytes)` lies inside the mapping (checked by `tensor`);
        // - the mapping is readable and writable (a private file mapping),
        //   its bytes are initialised (file contents, zero past the end of
        //   the file's last page) and `T: Pod` accepts every bit pattern;
        // - no other live `Vec` overlaps these bytes, and none lies on a
        //   stale page (checked under the lock before `live` took this
        //   range), so these bytes are the file's;
        // - the capacity is `n`, so the `Vec` never writes past the range,
        //   and growing it goes through `realloc`, which moves it out.
        #[allow(unsafe_code)]
        let v = unsafe { Vec::from_raw_parts(start as *mut T, n, n) };
        Some(v)
    }
}

impl Drop for MappedRegion {
    fn drop(&mut self) {
        let slot = &REGISTRY[self.slot];
        let retired = {
            let mut state = slot.lock();
            state.handle = false;
            slot.retire(&mut state)
        };
        drop(retired);
    }
}

#[cfg(test)]
mod tests;
