//! accel-dist's etcd client against a real etcd (Debian's `etcd-server`),
//! started by the test on loopback ports of its own with a data folder of its
//! own, and killed at the end. Skipped, saying why, where `etcd` is not
//! installed (`apt-get install etcd-server`).

use std::time::{Duration, Instant};

use accel_core::dist::rendezvous::{join_round, Etcd, Round, RoundSpec};

use accel_tests::etcd::Server;

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

    // The whole job dies (every lease gone): a launcher of a new start with
    // the same id is not left waiting for a round nobody runs.
    for r in &again {
        r.clone().leave(&etcd).unwrap();
    }
    let fresh = join_all(ep, &[("d", None)], |n| spec(n, (1, 1), second, minute));
    assert_eq!(one_round(&fresh, &["d"]), 3);

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

const LAUNCH: &str = env!("CARGO_BIN_EXE_accel_launch");

/// One `accel launch --rdzv_backend etcd` "machine" of job `job` running
/// `bash -c script` on 2 ranks (a job of `nnodes` machines); its output
/// goes to `dir/launch{k}.{out,err}`.
fn launcher(
    dir: &std::path::Path,
    (endpoint, job): (&str, &str),
    (k, nnodes): (usize, &str),
    extra: &[&str],
    script: &str,
) -> std::process::Child {
    let max: usize = nnodes.rsplit(':').next().unwrap().parse().unwrap();
    let log = |s: &str| std::fs::File::create(dir.join(format!("launch{k}.{s}"))).unwrap();
    std::process::Command::new(LAUNCH)
        .args(["launch", "--cpu", "--num_cpu_threads_per_process", "1"])
        .args(["--num_processes", &(2 * max).to_string()])
        .args(["--nnodes", nnodes, "--machine_rank", &k.to_string()])
        .args(["--rdzv_backend", "etcd", "--rdzv_endpoint", endpoint])
        .args(["--rdzv_id", job, "--rdzv_last_call", "1"])
        .args(extra)
        .args(["bash", "-c", script])
        .env("ACCEL_JOB_TOKEN", "the-machines-share-it")
        .stdout(log("out"))
        .stderr(log("err"))
        .spawn()
        .unwrap()
}

fn wait_ok(children: Vec<std::process::Child>, dir: &std::path::Path) -> Vec<bool> {
    let ended: Vec<bool> = children
        .into_iter()
        .map(|mut c| c.wait().unwrap().success())
        .collect();
    ended
        .into_iter()
        .enumerate()
        .map(|(k, ok)| {
            if !ok {
                let err = std::fs::read_to_string(dir.join(format!("launch{k}.err")));
                eprintln!("launcher {k}: {}", err.unwrap_or_default());
            }
            ok
        })
        .collect()
}

/// Two machines of job `job` running `script` with `extra` launch flags,
/// waited for: whether each ended well.
fn two_machines(
    dir: &std::path::Path,
    (endpoint, job): (&str, &str),
    extra: &[&str],
    script: &str,
) -> Vec<bool> {
    let children = (0..2)
        .map(|k| launcher(dir, (endpoint, job), (k, "2"), extra, script))
        .collect();
    wait_ok(children, dir)
}

/// Every rank logs `RANK WORLD_SIZE RESTART` and checks that the round's
/// store answers at `MASTER_ADDR:MASTER_PORT`; then `rest` runs.
fn rank_script(log: &std::path::Path, rest: &str) -> String {
    format!(
        "echo \"$RANK $WORLD_SIZE $TORCHELASTIC_RESTART_COUNT\" >> {log} && \
         test \"$ACCEL_USE_AGENT_STORE\" = 1 && exec 3<>/dev/tcp/$MASTER_ADDR/$MASTER_PORT && {rest}",
        log = log.display()
    )
}

fn logged(log: &std::path::Path) -> Vec<String> {
    let mut lines: Vec<String> = std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .map(String::from)
        .collect();
    lines.sort();
    lines
}

#[test]
fn a_rank_failing_on_one_machine_restarts_every_machine_through_etcd() {
    let tmp = tempfile::tempdir().unwrap();
    let Some(server) = Server::start(tmp.path()) else {
        return;
    };
    let log = tmp.path().join("starts");
    // Round 0: rank 3 (machine 1) fails at once; machine 0's ranks would
    // run 60 s unless stopped. Round 1: every rank ends well.
    let script = rank_script(
        &log,
        "if [ $TORCHELASTIC_RESTART_COUNT = 0 ]; then \
           if [ $RANK = 3 ]; then exit 3; else sleep 60; fi; fi",
    );
    let started = Instant::now();
    let ep = (server.endpoint.as_str(), "job-a");
    assert_eq!(
        two_machines(tmp.path(), ep, &["--max_restarts", "1"], &script),
        [true, true]
    );
    assert!(
        started.elapsed() < Duration::from_secs(40),
        "machine 0's ranks were not stopped: {:?}",
        started.elapsed()
    );
    let starts: Vec<String> = (0..2)
        .flat_map(|restart| (0..4).map(move |r| format!("{r} 4 {restart}")))
        .collect();
    let mut starts = starts;
    starts.sort();
    assert_eq!(logged(&log), starts);
    let err0 = std::fs::read_to_string(tmp.path().join("launch0.err")).unwrap();
    assert!(
        err0.contains("rank 3 on node m00001") && err0.contains("restart 1 of 1"),
        "{err0}"
    );
    // The job ended well: its keys are gone.
    let etcd = Etcd::connect(&server.endpoint, Duration::from_secs(5)).unwrap();
    assert!(etcd.get_prefix("accel/job-a/").unwrap().is_empty());

    // With the restarts spent, the failure ends the job on every machine.
    let _ = std::fs::remove_file(&log);
    let fail = rank_script(&log, "if [ $RANK = 0 ]; then exit 5; else sleep 60; fi");
    let ep = (server.endpoint.as_str(), "job-b");
    assert_eq!(two_machines(tmp.path(), ep, &[], &fail), [false, false]);
    let err1 = std::fs::read_to_string(tmp.path().join("launch1.err")).unwrap();
    assert!(
        err1.contains("rank 0 on node m00000") && err1.contains("restarts are spent"),
        "{err1}"
    );

    // Machine 1's ranks finish the job while a rank of machine 0 fails: no
    // round can start again, and machine 0 says so at once instead of
    // waiting --rdzv_timeout for a partner.
    let _ = std::fs::remove_file(&log);
    let late = rank_script(&log, "test $RANK != 0 || { sleep 2; exit 5; }");
    let started = Instant::now();
    let ep = (server.endpoint.as_str(), "job-f");
    assert_eq!(
        two_machines(tmp.path(), ep, &["--max_restarts", "1"], &late),
        [false, true]
    );
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "{:?}",
        started.elapsed()
    );
    let err0 = std::fs::read_to_string(tmp.path().join("launch0.err")).unwrap();
    assert!(err0.contains("had finished the job"), "{err0}");
}

#[test]
fn a_round_takes_min_nodes_after_the_last_call_and_goes_on_without_etcd() {
    let tmp = tempfile::tempdir().unwrap();
    let Some(mut server) = Server::start(tmp.path()) else {
        return;
    };
    let log = tmp.path().join("starts");
    // 2 of up to 3 machines: the round starts after the last call with 4
    // ranks; etcd is killed while they run, and they end well.
    let script = rank_script(&log, "sleep 3");
    let children: Vec<_> = (0..2)
        .map(|k| {
            let ep = (server.endpoint.as_str(), "job-c");
            launcher(tmp.path(), ep, (k, "2:3"), &[], &script)
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(30);
    while logged(&log).len() < 4 {
        assert!(Instant::now() < deadline, "no round: {:?}", logged(&log));
        std::thread::sleep(Duration::from_millis(50));
    }
    server.child.kill().unwrap();
    server.child.wait().unwrap();
    assert_eq!(wait_ok(children, tmp.path()), [true, true]);
    assert_eq!(logged(&log), ["0 4 0", "1 4 0", "2 4 0", "3 4 0"]);
    let err0 = std::fs::read_to_string(tmp.path().join("launch0.err")).unwrap();
    assert!(err0.contains("goes on without etcd"), "{err0}");

    // A rendezvous with etcd gone waits --rdzv_timeout, then names it.
    let started = Instant::now();
    let alone = launcher(
        tmp.path(),
        (server.endpoint.as_str(), "job-d"),
        (0, "1"),
        &["--rdzv_timeout", "2"],
        "true",
    );
    assert_eq!(wait_ok(vec![alone], tmp.path()), [false]);
    let waited = started.elapsed();
    assert!(
        (Duration::from_secs(2)..Duration::from_secs(15)).contains(&waited),
        "{waited:?}"
    );
    let err = std::fs::read_to_string(tmp.path().join("launch0.err")).unwrap();
    assert!(
        err.contains(&server.endpoint) && err.contains("rdzv_timeout"),
        "{err}"
    );
}

#[test]
fn a_machine_arriving_mid_round_is_admitted_by_a_restart_that_does_not_count() {
    let tmp = tempfile::tempdir().unwrap();
    let Some(server) = Server::start(tmp.path()) else {
        return;
    };
    let log = tmp.path().join("starts");
    // Round 0 would run a minute; round 1 ends at once. No restarts allowed:
    // admitting the third machine is not one.
    let script = rank_script(
        &log,
        "if [ $TORCHELASTIC_RESTART_COUNT = 0 ]; then sleep 60; fi",
    );
    let ep = (server.endpoint.as_str(), "job-e");
    let mut children: Vec<_> = (0..2)
        .map(|k| launcher(tmp.path(), ep, (k, "2:3"), &[], &script))
        .collect();
    let deadline = Instant::now() + Duration::from_secs(30);
    while logged(&log).len() < 4 {
        assert!(Instant::now() < deadline, "no round: {:?}", logged(&log));
        std::thread::sleep(Duration::from_millis(50));
    }
    let started = Instant::now();
    children.push(launcher(tmp.path(), ep, (2, "2:3"), &[], &script));
    assert_eq!(wait_ok(children, tmp.path()), [true, true, true]);
    assert!(
        started.elapsed() < Duration::from_secs(40),
        "{:?}",
        started.elapsed()
    );
    let mut want: Vec<String> = (0..4).map(|r| format!("{r} 4 0")).collect();
    want.extend((0..6).map(|r| format!("{r} 6 1")));
    want.sort();
    assert_eq!(logged(&log), want);
    let err0 = std::fs::read_to_string(tmp.path().join("launch0.err")).unwrap();
    assert!(err0.contains("not counted as a restart"), "{err0}");
}
