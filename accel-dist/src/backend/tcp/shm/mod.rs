//! Collectives through shared memory between ranks on one host.
//!
//! Over sockets every byte is copied twice by the kernel (into the socket
//! buffer, out of it) and each segment costs system calls; with 2 ranks on
//! 2 cores those copies were half of all cycles of a 64 MiB all-reduce.
//! When every rank of a communicator is on one host, they instead map one
//! file under `/dev/shm` and exchange data through it: a rank copies what
//! its peers need into its own slot, and the peers read it from there,
//! reducing straight into their buffers (see `collectives.rs` for the
//! step protocol and `segment.rs` for the layout and the only `unsafe`).
//!
//! Setting up (after the socket mesh is connected), through the store:
//!
//! 1. rank 0 creates `/dev/shm/accel-dist-<token hash>-<generation>-<pid>-<nonce>`
//!    (`O_EXCL`, mode 0600, so two jobs, or two communicators of one job,
//!    never share a file) and publishes its path and a random nonce;
//! 2. every other rank maps it and checks the nonce in its header; a rank
//!    on another host (no such file) or with shared memory switched off
//!    reports failure;
//! 3. once every rank has reported, rank 0 unlinks the file: the mappings
//!    live on, and nothing is left behind even if a rank is killed later.
//!
//! Only if every rank mapped it is it used, so ranks always agree. The
//! socket mesh stays: it carries small calls (the direct path wins there),
//! point-to-point messages, and, while a shared-memory call waits, it is
//! how a dead peer or an abort from another rank is noticed (see
//! `wait.rs`). Failures thus read exactly as on the socket path: the
//! timeout names the rank that did not arrive, and every survivor names
//! the rank that died.

mod collectives;
mod segment;
mod wait;

pub(crate) use collectives::{all_gather, all_reduce, broadcast, reduce_scatter, Call};

use std::hash::{BuildHasher, Hash, Hasher};
use std::path::PathBuf;
use std::sync::Mutex;

use segment::{Segment, SegmentFile};

use crate::rendezvous::OWNED_PREFIX;
use crate::{Error, Result, TcpStore};

/// The environment variable that switches shared memory off (`0`, `false` or `off`).
pub const ENV_SHM: &str = "ACCEL_DIST_SHM";

/// The segment of a communicator and the step counter of its protocol.
pub(crate) struct SharedMemory {
    seg: Segment,
    /// The next step number; the same on every rank between calls.
    step: Mutex<u64>,
}

impl SharedMemory {
    /// Runs one call; calls are already serialized by the communicator.
    pub fn run<R>(
        &self,
        mesh: &super::Mesh,
        expect: super::wire::Header,
        total_bytes: usize,
        body: impl FnOnce(&mut Call<'_>) -> R,
    ) -> R {
        let mut step = self.step.lock().unwrap_or_else(|p| p.into_inner());
        body(&mut Call::new(
            mesh,
            &self.seg,
            &mut step,
            expect,
            total_bytes,
        ))
    }
}

/// Whether [`ENV_SHM`] leaves shared memory allowed.
pub(crate) fn env_allows() -> bool {
    match std::env::var(ENV_SHM) {
        Ok(v) => !matches!(
            v.trim().to_ascii_lowercase().as_str(),
            "0" | "false" | "off" | "no"
        ),
        Err(_) => true,
    }
}

/// What rank 0 announces.
#[derive(serde::Serialize, serde::Deserialize)]
struct Announce {
    path: PathBuf,
    nonce: u64,
    slot_bytes: usize,
}

/// Sets up a shared segment for all `world` ranks if every one can map it.
///
/// Every rank calls this (also with `wanted` false, so the others learn it
/// will not take part). Returns `None` when any rank cannot or will not.
pub(crate) fn negotiate(
    store: &TcpStore,
    rank: usize,
    world: usize,
    wanted: bool,
    slot_bytes: usize,
) -> Result<Option<SharedMemory>> {
    let generation = store.next_generation("shm");
    // Each rank's keys are its own and write-once (see the store), so no
    // other process can point the ranks at another file.
    store.claim_rank(rank)?;
    let key = |r: usize, name: &str| format!("{OWNED_PREFIX}{r}/shm/{generation}/{name}");
    // Room for one element per rank in a reduce-scatter step, cache-line sized.
    let slot_bytes = slot_bytes.max(8 * world).next_multiple_of(64);
    let (seg, mut file) = if rank == 0 {
        let created = if wanted {
            create(store, generation, world, slot_bytes)
        } else {
            None
        };
        let announce = created.as_ref().map(|(_, _, a)| a);
        let record = serde_json::to_vec(&announce).expect("plain fields serialize");
        store.set(&key(0, "segment"), &record)?;
        match created {
            Some((seg, file, _)) => (Some(seg), Some(file)),
            None => (None, None),
        }
    } else {
        let record = get(store, &key(0, "segment"), 0, world)?;
        let announce: Option<Announce> = serde_json::from_slice(&record).unwrap_or(None);
        let seg = announce.filter(|_| wanted).and_then(|a| {
            Segment::open(&a.path, world, a.slot_bytes, a.nonce)
                .map_err(|e| tracing::debug!(rank, error = %e, "shared memory unavailable"))
                .ok()
        });
        (seg, None)
    };
    let ok = if seg.is_some() { b"1" } else { b"0" };
    store.set(&key(rank, "ok"), ok)?;
    let mut all = true;
    for q in (0..world).filter(|&q| q != rank) {
        all &= get(store, &key(q, "ok"), q, world)? == b"1";
    }
    // Every rank has mapped the file or given up: the name is no longer needed.
    if let Some(file) = file.as_mut() {
        file.unlink();
    }
    tracing::debug!(
        rank,
        shared_memory = all && seg.is_some(),
        "shared memory negotiated"
    );
    Ok(seg.filter(|_| all).map(|seg| SharedMemory {
        seg,
        step: Mutex::new(0),
    }))
}

/// Creates and maps a fresh segment file (rank 0); `None` if that fails.
fn create(
    store: &TcpStore,
    generation: u64,
    world: usize,
    slot_bytes: usize,
) -> Option<(Segment, SegmentFile, Announce)> {
    // RandomState is seeded from the OS: a nonce no other segment shares.
    let random = std::collections::hash_map::RandomState::new();
    let nonce = random.hash_one((std::process::id(), std::time::SystemTime::now()));
    let mut token = std::collections::hash_map::DefaultHasher::new();
    store.token().hash(&mut token);
    let path = PathBuf::from(format!(
        "/dev/shm/accel-dist-{:016x}-{}-{}-{nonce:016x}",
        token.finish(),
        generation,
        std::process::id(),
    ));
    match Segment::create(&path, world, slot_bytes, nonce) {
        Ok(seg) => Some((
            seg,
            SegmentFile::new(path.clone()),
            Announce {
                path,
                nonce,
                slot_bytes,
            },
        )),
        Err(e) => {
            tracing::debug!(path = %path.display(), error = %e, "cannot create shared memory");
            None
        }
    }
}

/// A store key a peer publishes, naming the peer if it never appears.
fn get(store: &TcpStore, key: &str, peer: usize, world: usize) -> Result<Vec<u8>> {
    store.get(key).map_err(|e| match e {
        Error::StoreTimeout { waited, .. } => Error::PeerTimeout {
            op: "connect",
            rank: peer,
            waited,
            world,
        },
        e => e,
    })
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use std::net::SocketAddr;
    use std::time::Duration;

    use crate::{Communicator, ReduceOp, Result, TcpCommunicator, TcpConfig, TcpStore};

    /// Runs `body` on `world` in-process ranks connected with `configs[rank]`.
    fn world<T: Send + 'static>(
        token: &str,
        configs: Vec<TcpConfig>,
        body: fn(TcpCommunicator) -> Result<T>,
    ) -> Vec<T> {
        let n = configs.len();
        let host = TcpStore::host(
            SocketAddr::from(([127, 0, 0, 1], 0)),
            token,
            Duration::from_secs(10),
        )
        .unwrap();
        let addr = host.addr();
        let mut configs = configs.into_iter();
        let first = configs.next().unwrap();
        let others: Vec<_> = configs
            .enumerate()
            .map(|(i, config)| {
                let token = token.to_string();
                std::thread::spawn(move || {
                    let store = TcpStore::connect(addr, &token, Duration::from_secs(10))?;
                    body(TcpCommunicator::connect_with(&store, i + 1, n, config)?)
                })
            })
            .collect();
        let mut out =
            vec![body(TcpCommunicator::connect_with(&host, 0, n, first).unwrap()).unwrap()];
        out.extend(others.into_iter().map(|t| t.join().unwrap().unwrap()));
        out
    }

    fn segment_files(token: &str) -> Vec<String> {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        std::hash::Hash::hash(token, &mut h);
        let prefix = format!("accel-dist-{:016x}-", std::hash::Hasher::finish(&h));
        std::fs::read_dir("/dev/shm")
            .map(|d| {
                d.filter_map(|e| e.ok()?.file_name().into_string().ok())
                    .filter(|name| name.starts_with(&prefix))
                    .collect()
            })
            .unwrap_or_default()
    }

    #[test]
    fn ranks_on_one_host_share_a_segment_whose_file_is_already_gone() {
        if !std::path::Path::new("/dev/shm").is_dir() {
            return;
        }
        let token = format!("shm-unit-{}", std::process::id());
        let config = TcpConfig::default()
            .with_direct_max_bytes(0)
            .with_shm_slot_bytes(64);
        let sums = world(&token, vec![config; 3], |comm| {
            assert!(comm.shared_memory());
            let r = comm.rank() as f64;
            // 101 elements: not divisible by the world nor by the 8-element slot.
            let mut v: Vec<f64> = (0..101).map(|i| r * 1000.0 + i as f64).collect();
            comm.all_reduce((&mut v).into(), ReduceOp::Sum)?;
            comm.barrier()?;
            Ok(v)
        });
        let want: Vec<f64> = (0..101).map(|i| 3000.0 + 3.0 * i as f64).collect();
        for v in sums {
            assert_eq!(v, want);
        }
        assert_eq!(segment_files(&token), Vec::<String>::new());
    }

    #[test]
    fn one_rank_without_shared_memory_keeps_every_rank_on_sockets() {
        let token = format!("shm-off-{}", std::process::id());
        let on = TcpConfig::default().with_direct_max_bytes(0);
        let configs = vec![on.clone(), on.with_shared_memory(false)];
        let got = world(&token, configs, |comm| {
            let mut v = vec![comm.rank() as u32 + 1; 1000];
            comm.all_reduce((&mut v).into(), ReduceOp::Max)?;
            Ok((comm.shared_memory(), v[999]))
        });
        assert_eq!(got, [(false, 2), (false, 2)]);
        assert_eq!(segment_files(&token), Vec::<String>::new());
    }
}
