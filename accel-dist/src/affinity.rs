//! CPU affinity for launched ranks (Accelerate's `set_numa_affinity`).
//!
//! Ranks sharing a machine otherwise all spread their threads over every
//! core and thrash each other's caches; pinning each local rank to its own
//! slice of a NUMA node keeps its memory local and its thread pool sized to
//! the cores it really has (std's `available_parallelism`, and so rayon,
//! follow the affinity mask).

use nix::sched::{sched_getaffinity, sched_setaffinity, CpuSet};
use nix::unistd::Pid;

use crate::{Error, Result};

/// The variable `accel launch --enable_cpu_affinity` sets, as Accelerate's.
pub const ENV_CPU_AFFINITY: &str = "ACCELERATE_CPU_AFFINITY";

/// Parses a kernel CPU list such as `0-3,8,10-11`.
pub fn parse_cpu_list(list: &str) -> Option<Vec<usize>> {
    let mut cpus = vec![];
    for part in list.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                cpus.extend(a.trim().parse::<usize>().ok()?..=b.trim().parse::<usize>().ok()?)
            }
            None => cpus.push(part.trim().parse().ok()?),
        }
    }
    Some(cpus)
}

/// The CPUs this process may run on.
fn allowed_cpus() -> Result<Vec<usize>> {
    let set = sched_getaffinity(Pid::from_raw(0)).map_err(|e| Error::Io {
        context: "reading the CPU affinity".into(),
        source: e.into(),
    })?;
    Ok((0..CpuSet::count())
        .filter(|&c| set.is_set(c).unwrap_or(false))
        .collect())
}

/// The CPUs of each NUMA node that this process may use, from
/// `/sys/devices/system/node`; one node with every allowed CPU where that is absent.
pub fn numa_nodes() -> Result<Vec<Vec<usize>>> {
    let allowed = allowed_cpus()?;
    let mut nodes: Vec<(usize, Vec<usize>)> = std::fs::read_dir("/sys/devices/system/node")
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let id: usize = e.file_name().to_str()?.strip_prefix("node")?.parse().ok()?;
            let list = std::fs::read_to_string(e.path().join("cpulist")).ok()?;
            let cpus: Vec<usize> = parse_cpu_list(&list)?
                .into_iter()
                .filter(|c| allowed.contains(c))
                .collect();
            (!cpus.is_empty()).then_some((id, cpus))
        })
        .collect();
    nodes.sort();
    Ok(if nodes.is_empty() {
        vec![allowed]
    } else {
        nodes.into_iter().map(|(_, c)| c).collect()
    })
}

/// The CPUs local rank `local_rank` of `local_world_size` gets: ranks are
/// spread over the nodes in order, and the ranks of one node split its CPUs
/// evenly (at least one CPU each).
pub fn cpus_for_rank(
    nodes: &[Vec<usize>],
    local_rank: usize,
    local_world_size: usize,
) -> Vec<usize> {
    let n = nodes.len().max(1);
    let node = local_rank * n / local_world_size.max(1);
    let on_node: Vec<usize> = (0..local_world_size)
        .filter(|&r| r * n / local_world_size.max(1) == node)
        .collect();
    let index = on_node.iter().position(|&r| r == local_rank).unwrap_or(0);
    let cpus = &nodes[node.min(n - 1)];
    let per = (cpus.len() / on_node.len().max(1)).max(1);
    let start = (index * per).min(cpus.len().saturating_sub(1));
    cpus[start..(start + per).min(cpus.len())].to_vec()
}

/// Pins this process to its share of the machine's CPUs; returns the CPUs.
pub fn set_numa_affinity(local_rank: usize, local_world_size: usize) -> Result<Vec<usize>> {
    let cpus = cpus_for_rank(&numa_nodes()?, local_rank, local_world_size);
    let mut set = CpuSet::new();
    for &c in &cpus {
        set.set(c).map_err(|e| Error::Io {
            context: format!("CPU {c} in the affinity mask"),
            source: e.into(),
        })?;
    }
    sched_setaffinity(Pid::from_raw(0), &set).map_err(|e| Error::Io {
        context: format!("pinning local rank {local_rank} to CPUs {cpus:?}"),
        source: e.into(),
    })?;
    Ok(cpus)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_parse_like_the_kernel_writes_them() {
        assert_eq!(
            parse_cpu_list("0-3,8,10-11\n"),
            Some(vec![0, 1, 2, 3, 8, 10, 11])
        );
        assert_eq!(parse_cpu_list("x"), None);
    }

    #[test]
    fn ranks_spread_over_nodes_and_split_each_node() {
        let nodes = vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]];
        let got: Vec<Vec<usize>> = (0..4).map(|r| cpus_for_rank(&nodes, r, 4)).collect();
        assert_eq!(got, vec![vec![0, 1], vec![2, 3], vec![4, 5], vec![6, 7]]);
        // More ranks than CPUs: each still gets one.
        assert_eq!(cpus_for_rank(&[vec![0, 1]], 2, 3), vec![1]);
    }

    #[test]
    fn pinning_restricts_the_allowed_cpus() {
        let before = allowed_cpus().unwrap();
        // Run in a thread: affinity is per thread on Linux, so the test
        // harness's other threads keep theirs.
        let got = std::thread::spawn(|| {
            let cpus = set_numa_affinity(0, 2).unwrap();
            (cpus, allowed_cpus().unwrap())
        })
        .join()
        .unwrap();
        assert_eq!(got.0, got.1);
        assert!(!got.1.is_empty() && got.1.iter().all(|c| before.contains(c)));
    }
}
