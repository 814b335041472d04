//! accel-dist's etcd client against a real etcd (Debian's `etcd-server`),
//! started by the test on loopback ports of its own with a data folder of its
//! own, and killed at the end. Skipped, saying why, where `etcd` is not
//! installed (`apt-get install etcd-server`).

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use accel_core::dist::rendezvous::{join_round, Etcd, Round, RoundSpec};

/// A free loopback port (bound, noted, released).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap()
}

/// An etcd serving `127.0.0.1:<port>` from `dir`, killed when dropped.
struct Server {
    child: Child,
    endpoint: String,
}

impl Server {
    fn start(dir: &Path) -> Option<Self> {
        let (client, peer) = (free_port(), free_port());
        let client_url = format!("http://127.0.0.1:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let child = Command::new("etcd")
            .args(["--name", "accel-test", "--data-dir"])
            .arg(dir.join("data"))
            .args(["--listen-client-urls", &client_url])
            .args(["--advertise-client-urls", &client_url])
            .args(["--listen-peer-urls", &peer_url])
            .args(["--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", &format!("accel-test={peer_url}")])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("etcd.log")).unwrap())
            .spawn();
        let child = match child {
            Ok(child) => child,
            Err(e) => {
                eprintln!("skipped: etcd could not be started ({e}); apt-get install etcd-server");
                return None;
            }
        };
        let server = Self {
            child,
            endpoint: format!("127.0.0.1:{client}"),
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while Etcd::connect(&server.endpoint, Duration::from_secs(1)).is_err() {
            assert!(
                Instant::now() < deadline,
                "etcd did not answer within 30 s: {}",
                std::fs::read_to_string(dir.join("etcd.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        Some(server)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn keys_transactions_and_leases_behave_as_etcd_documents_them() {
    let tmp = tempfile::tempdir().unwrap();
    let Some(mut server) = Server::start(tmp.path()) else {
        return;
    };
    let etcd = Etcd::connect(&server.endpoint, Duration::from_secs(5)).unwrap();

    // Plain keys and prefixes, in key order.
    etcd.put("job/members/b", b"host-b", 0).unwrap();
    etcd.put("job/members/a", b"host-a", 0).unwrap();
    etcd.put("jobx", b"other", 0).unwrap();
    let a = etcd.get("job/members/a").unwrap().unwrap();
    assert_eq!(a.value, b"host-a");
    assert!(etcd.get("job/none").unwrap().is_none());
    let members: Vec<String> = etcd
        .get_prefix("job/members/")
        .unwrap()
        .into_iter()
        .map(|e| e.key)
        .collect();
    assert_eq!(members, ["job/members/a", "job/members/b"]);

    // Create only where absent; swap only at the revision read.
    assert!(etcd.create("job/round", b"1", 0).unwrap());
    assert!(!etcd.create("job/round", b"2", 0).unwrap());
    let round = etcd.get("job/round").unwrap().unwrap();
    assert_eq!(round.value, b"1");
    assert!(etcd.swap("job/round", round.mod_revision, b"2", 0).unwrap());
    // A launcher that read round 1 lost the race: its swap fails.
    assert!(!etcd.swap("job/round", round.mod_revision, b"3", 0).unwrap());
    assert_eq!(etcd.get("job/round").unwrap().unwrap().value, b"2");

    // A lease keeps its keys while it is renewed, and drops them when not.
    let kept = etcd.grant(Duration::from_secs(2)).unwrap();
    let lapsed = etcd.grant(Duration::from_secs(2)).unwrap();
    etcd.put("job/alive/kept", b"", kept).unwrap();
    etcd.put("job/alive/lapsed", b"", lapsed).unwrap();
    assert_eq!(etcd.get("job/alive/kept").unwrap().unwrap().lease, kept);
    let deadline = Instant::now() + Duration::from_secs(10);
    while etcd.get("job/alive/lapsed").unwrap().is_some() {
        assert!(
            Instant::now() < deadline,
            "a lease that was not renewed kept its key"
        );
        assert!(etcd.keep_alive(kept).unwrap() > Duration::ZERO);
        std::thread::sleep(Duration::from_millis(300));
    }
    assert!(etcd.get("job/alive/kept").unwrap().is_some());
    let err = etcd.keep_alive(lapsed).unwrap_err().to_string();
    assert!(
        err.contains("expired") && err.contains("keep_alive"),
        "{err}"
    );
    // Revoking drops the keys at once.
    etcd.revoke(kept).unwrap();
    assert!(etcd.get("job/alive/kept").unwrap().is_none());

    assert_eq!(etcd.delete_prefix("job/").unwrap(), 3);
    assert!(etcd.get_prefix("job/").unwrap().is_empty());
    assert_eq!(etcd.get("jobx").unwrap().unwrap().value, b"other");

    // etcd gone: a call fails within the client's timeout, naming the endpoint.
    server.child.kill().unwrap();
    server.child.wait().unwrap();
    let started = Instant::now();
    let err = etcd.get("job/round").unwrap_err().to_string();
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    assert!(
        err.contains(&server.endpoint) && err.contains("job/round"),
        "{err}"
    );
}

fn spec(
    node: &str,
    (min, max): (usize, usize),
    last_call: Duration,
    timeout: Duration,
) -> RoundSpec {
    RoundSpec {
        job: "job-7".into(),
        node: node.into(),
        min_nodes: min,
        max_nodes: max,
        last_call,
        timeout,
        lease_ttl: Duration::from_secs(2),
    }
}

/// Each node a thread with its own client, as each machine's launcher is.
fn join_all(
    endpoint: &str,
    nodes: &[(&str, Option<u64>)],
    spec_of: impl Fn(&str) -> RoundSpec,
) -> Vec<Round> {
    let handles: Vec<_> = nodes
        .iter()
        .map(|&(node, after)| {
            let (endpoint, spec) = (endpoint.to_string(), spec_of(node));
            std::thread::spawn(move || {
                let etcd = Etcd::connect(&endpoint, Duration::from_secs(5)).unwrap();
                join_round(&etcd, &spec, after).unwrap()
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// The rounds all nodes got are one round: same number and members, each
/// node at its own rank.
fn one_round(rounds: &[Round], nodes: &[&str]) -> u64 {
    let first = &rounds[0];
    let mut members = first.members.clone();
    members.sort();
    assert_eq!(members, nodes, "{rounds:?}");
    for (r, node) in rounds.iter().zip(nodes) {
        assert_eq!(
            (r.number, &r.members),
            (first.number, &first.members),
            "{rounds:?}"
        );
        assert_eq!(r.members[r.rank], *node, "{rounds:?}");
    }
    first.number
}

#[test]
fn launchers_agree_on_rounds_restarts_and_lost_nodes() {
    let tmp = tempfile::tempdir().unwrap();
    let Some(server) = Server::start(tmp.path()) else {
        return;
    };
    let ep = server.endpoint.as_str();
    let (second, minute) = (Duration::from_secs(1), Duration::from_secs(60));

    // Three launchers, 3 nodes wanted: round 0, without waiting for a last call.
    let started = Instant::now();
    let abc = ["a", "b", "c"];
    let rounds = join_all(ep, &abc.map(|n| (n, None)), |n| {
        spec(n, (3, 3), minute, minute)
    });
    assert_eq!(one_round(&rounds, &abc), 0);
    assert!(started.elapsed() < 20 * second, "{:?}", started.elapsed());

    // Node c's machine dies: its lease lapses (revoked here, at once). The others
    // name it, and restart with 2 to 3 nodes: round 1 closes after the last call.
    let etcd = Etcd::connect(ep, 5 * second).unwrap();
    rounds[2].clone().leave(&etcd).unwrap();
    assert_eq!(rounds[0].lost(&etcd).unwrap(), ["c"]);
    assert!(rounds[1].lost(&etcd).unwrap() == ["c"]);
    let started = Instant::now();
    let ab = join_all(ep, &[("a", Some(0)), ("b", Some(0))], |n| {
        spec(n, (2, 3), second, minute)
    });
    assert_eq!(one_round(&ab, &["a", "b"]), 1);
    assert!(started.elapsed() >= second, "closed before its last call");
    assert!(ab[0].lost(&etcd).unwrap().is_empty());

    // c comes back while round 1 runs: it waits, and joins the next restart.
    let again = join_all(ep, &[("a", Some(1)), ("b", Some(1)), ("c", None)], |n| {
        spec(n, (2, 3), 3 * second, minute)
    });
    assert_eq!(one_round(&again, &abc), 2);

    // Settings that cannot work, and a round that never fills, are named.
    let bad = join_round(&etcd, &spec("d", (3, 2), second, second), None).unwrap_err();
    assert!(bad.to_string().contains("3:2 nodes"), "{bad}");
    let alone = RoundSpec {
        job: "job-8".into(),
        ..spec("d", (2, 2), second, 2 * second)
    };
    let err = join_round(&etcd, &alone, None).unwrap_err().to_string();
    assert!(
        err.contains("job-8") && err.contains("\"d\"") && err.contains("at least 2"),
        "{err}"
    );
}
