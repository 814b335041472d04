//! Broken and hostile local clients against the store and the peer
//! handshake, with real sockets: idle floods past the descriptor limit,
//! tricklers, huge frames, rogue rank claims, empty tokens.
//!
//! The raw clients here speak the wire protocol from its documentation
//! (`rendezvous` and `backend/tcp/handshake.rs`), HMAC included, so they
//! also check the protocol as written.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use accel_dist::{
    Communicator, Error, ReduceOp, Result, StoreLimits, StoreServer, TcpCommunicator, TcpStore,
};
use hmac::{Hmac, Mac};
use sha2::Sha256;

const TOKEN: &str = "hostile-test-token";

fn loopback() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

fn mac(label: &[u8], parts: &[&[u8]]) -> [u8; 32] {
    let mut m = Hmac::<Sha256>::new_from_slice(TOKEN.as_bytes()).unwrap();
    m.update(label);
    for p in parts {
        m.update(&(p.len() as u64).to_le_bytes());
        m.update(p);
    }
    m.finalize().into_bytes().into()
}

fn send(s: &mut TcpStream, body: &[u8]) {
    let mut f = (body.len() as u32).to_le_bytes().to_vec();
    f.extend_from_slice(body);
    s.write_all(&f).unwrap();
}

fn recv(s: &mut TcpStream) -> Vec<u8> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len).unwrap();
    let mut body = vec![0; u32::from_le_bytes(len) as usize];
    s.read_exact(&mut body).unwrap();
    body
}

/// `[status, len:u32, bytes...]` -> bytes.
fn field(answer: &[u8]) -> &[u8] {
    &answer[5..]
}

/// A store connection authenticated by hand.
fn raw_client(addr: SocketAddr) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let client = [7u8; 32];
    send(&mut s, &[&b"ACCELKV2"[..], &client].concat());
    let answer = recv(&mut s);
    assert_eq!(answer[0], 0, "{answer:?}");
    let server = field(&answer).to_vec();
    send(&mut s, &mac(b"accel-store-client", &[&server, &client]));
    let answer = recv(&mut s);
    assert_eq!(
        answer[0],
        0,
        "refused: {:?}",
        String::from_utf8_lossy(&answer)
    );
    assert_eq!(
        field(&answer),
        mac(b"accel-store-server", &[&client, &server])
    );
    s
}

fn str_field(s: &str) -> Vec<u8> {
    [&(s.len() as u32).to_le_bytes()[..], s.as_bytes()].concat()
}

/// The message of an ERROR answer, or panics.
fn error_message(answer: &[u8]) -> String {
    assert_eq!(answer[0], 5, "not an error: {answer:?}");
    String::from_utf8_lossy(field(answer)).into_owned()
}

/// `dist_worker store` under an open-file limit: the child and its port.
fn store_process(fd_limit: usize) -> (Child, SocketAddr) {
    let worker = env!("CARGO_BIN_EXE_dist_worker");
    let mut child = Command::new("bash")
        .arg("-c")
        .arg(format!("ulimit -n {fd_limit} && exec {worker} store"))
        .env("ACCEL_JOB_TOKEN", TOKEN)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.as_mut().unwrap())
        .read_line(&mut line)
        .unwrap();
    let port: u16 = line
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("port? {line:?}"));
    (child, SocketAddr::from(([127, 0, 0, 1], port)))
}

/// (CPU seconds, resident KiB) of a process, from /proc.
fn usage(pid: u32) -> (f64, u64) {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let fields: Vec<&str> = stat
        .rsplit(')')
        .next()
        .unwrap()
        .split_whitespace()
        .collect();
    let ticks: f64 = fields[11].parse::<f64>().unwrap() + fields[12].parse::<f64>().unwrap();
    let tck = Command::new("getconf").arg("CLK_TCK").output().unwrap();
    let tck: f64 = String::from_utf8_lossy(&tck.stdout).trim().parse().unwrap();
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let rss = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    (ticks / tck, rss)
}

/// Raises this process's soft open-file limit so it can hold the flood.
fn room_for(n: u64) -> bool {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
    if soft < n + 200 && hard >= n + 200 {
        setrlimit(Resource::RLIMIT_NOFILE, hard.min(1 << 20), hard).unwrap();
    }
    getrlimit(Resource::RLIMIT_NOFILE).unwrap().0 >= n + 200
}

#[test]
fn eleven_hundred_idle_strays_cost_the_store_no_cpu_and_a_client_still_gets_in() {
    const STRAYS: usize = 1100;
    assert!(room_for(STRAYS as u64), "this test needs 1300 open files");
    // 1024 as in the report; 48 is below the cap on unauthenticated
    // connections, so accepting runs out of descriptors and must drop strays.
    for fd_limit in [1024, 48] {
        let (mut child, addr) = store_process(fd_limit);
        let (flood0, _) = usage(child.id());
        let strays: Vec<TcpStream> = (0..STRAYS)
            .filter_map(|_| TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok())
            .collect();
        assert!(
            strays.len() > STRAYS / 2,
            "only {} strays got in",
            strays.len()
        );
        std::thread::sleep(Duration::from_millis(300));
        let (cpu0, _) = usage(child.id());
        eprintln!(
            "fd limit {fd_limit}: the flood cost the store {:.2} s of CPU",
            cpu0 - flood0
        );
        let window = Duration::from_secs(2);
        std::thread::sleep(window);
        let (cpu1, _) = usage(child.id());
        let share = (cpu1 - cpu0) / window.as_secs_f64();
        assert!(
            share < 0.2,
            "fd limit {fd_limit}: the store used {:.0}% CPU",
            share * 100.0
        );
        let start = Instant::now();
        let store = TcpStore::connect(addr, TOKEN, Duration::from_secs(5)).unwrap();
        store.set("k", b"v").unwrap();
        assert_eq!(store.get("k").unwrap(), b"v");
        let took = start.elapsed();
        assert!(
            took < Duration::from_secs(1),
            "fd limit {fd_limit}: answered after {took:?}"
        );
        eprintln!(
            "fd limit {fd_limit}: store CPU {:.1}%, a client answered in {took:?}",
            share * 100.0
        );
        drop(strays);
        drop(child.stdin.take());
        assert!(child.wait().unwrap().success());
    }
}

#[test]
fn a_frame_of_a_gibibyte_is_refused_after_authentication_and_memory_stays_flat() {
    let (mut child, addr) = store_process(1024);
    let mut s = raw_client(addr);
    let (_, rss0) = usage(child.id());
    // A SET announcing 1 GiB, followed by 64 MiB of it.
    s.write_all(&(1u32 << 30).to_le_bytes()).unwrap();
    let chunk = vec![0u8; 1 << 20];
    for _ in 0..64 {
        if s.write_all(&chunk).is_err() {
            break; // the store closed the connection
        }
    }
    let answer = recv(&mut s);
    let msg = error_message(&answer);
    assert!(msg.contains("exceeds the limit of 4194304"), "{msg}");
    let (_, rss1) = usage(child.id());
    assert!(
        rss1 < rss0 + (8 << 10),
        "store RSS went from {rss0} to {rss1} KiB"
    );
    // The store goes on serving.
    let store = TcpStore::connect(addr, TOKEN, Duration::from_secs(5)).unwrap();
    store.set("k", b"v").unwrap();
    drop(child.stdin.take());
    child.wait().unwrap();
}

#[test]
fn wrong_and_empty_tokens_and_old_clients_are_refused_by_name() {
    let host = TcpStore::host(loopback(), TOKEN, Duration::from_secs(5)).unwrap();
    let err = TcpStore::connect(host.addr(), "another-job", Duration::from_secs(5))
        .err()
        .unwrap();
    assert!(err.to_string().contains("job token mismatch"), "{err}");
    for err in [
        TcpStore::connect(host.addr(), "", Duration::from_secs(1))
            .err()
            .unwrap(),
        StoreServer::bind(loopback(), "").err().unwrap(),
    ] {
        assert!(
            matches!(
                err,
                Error::Env {
                    var: "ACCEL_JOB_TOKEN",
                    ..
                }
            ),
            "{err}"
        );
    }
    // A client of the previous protocol sent the token in clear.
    let mut old = TcpStream::connect(host.addr()).unwrap();
    send(&mut old, &[&b"ACCELKV1"[..], &str_field(TOKEN)].concat());
    let answer = recv(&mut old);
    assert_eq!(answer[0], 1);
    assert!(String::from_utf8_lossy(&answer).contains("version mismatch"));
}

#[test]
fn a_client_silent_past_the_idle_timeout_is_closed_and_reconnects_with_its_claims() -> Result<()> {
    let limits = StoreLimits {
        idle_timeout: Duration::from_millis(200),
        ..StoreLimits::default()
    };
    let server = StoreServer::bind_with(loopback(), TOKEN, limits)?;
    let addr = server.local_addr();
    let store = TcpStore::connect(addr, TOKEN, Duration::from_secs(5))?;
    store.claim_rank(3)?;
    store.set("accel/rank/3/a", b"1")?;
    let mut raw = raw_client(addr);
    std::thread::sleep(Duration::from_millis(600));
    // The raw client was closed...
    let mut buf = [0u8; 1];
    assert_eq!(raw.read(&mut buf).unwrap_or(0), 0);
    // ...and the store's client reconnected, still owning rank 3's keys.
    store.set("accel/rank/3/b", b"2")?;
    assert_eq!(store.get("accel/rank/3/a")?, b"1");
    // A waiting client is not idle.
    let waiter = TcpStore::connect(addr, TOKEN, Duration::from_secs(5))?;
    let setter = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(500));
        store.set("late", b"x")
    });
    assert_eq!(waiter.get("late")?, b"x");
    setter.join().unwrap()
}

/// Waits for rank 0's published mesh record and returns its TCP address.
fn rank0_listener(observer: &TcpStore) -> SocketAddr {
    let record = observer.get("accel/rank/0/tcp/0").unwrap();
    let v: serde_json::Value = serde_json::from_slice(&record).unwrap();
    v["tcp"].as_str().unwrap().parse().unwrap()
}

/// Connects and sends a byte every 300 ms until `stop` or an error.
fn trickle(addr: SocketAddr, stop: mpsc::Receiver<()>) {
    let Ok(mut s) = TcpStream::connect(addr) else {
        return;
    };
    while stop.recv_timeout(Duration::from_millis(300)).is_err() {
        if s.write_all(&[1]).is_err() {
            return;
        }
    }
}

fn sum_of_ranks(store: &TcpStore, rank: usize, timeout: Duration) -> Result<f32> {
    sum_in_world(store, rank, 2, timeout)
}

fn sum_in_world(store: &TcpStore, rank: usize, world: usize, timeout: Duration) -> Result<f32> {
    let comm = TcpCommunicator::connect(store, rank, world, timeout)?;
    let mut v = vec![rank as f32 + 1.0];
    comm.all_reduce((&mut v).into(), ReduceOp::Sum)?;
    Ok(v[0])
}

#[test]
fn tricklers_at_the_handshake_port_neither_stall_the_mesh_nor_delay_its_timeout() {
    let host = TcpStore::host(loopback(), TOKEN, Duration::from_secs(20)).unwrap();
    let addr = host.addr();
    let observer = TcpStore::connect(addr, TOKEN, Duration::from_secs(20)).unwrap();
    let rank0 = std::thread::spawn(move || sum_of_ranks(&host, 0, Duration::from_secs(20)));
    let listener = rank0_listener(&observer);
    let stops: Vec<_> = (0..3)
        .map(|_| {
            let (tx, rx) = mpsc::channel();
            std::thread::spawn(move || trickle(listener, rx));
            tx
        })
        .collect();
    let idle: Vec<_> = (0..20)
        .filter_map(|_| TcpStream::connect(listener).ok())
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    let start = Instant::now();
    let rank1 = TcpStore::connect(addr, TOKEN, Duration::from_secs(20)).unwrap();
    assert_eq!(
        sum_of_ranks(&rank1, 1, Duration::from_secs(20)).unwrap(),
        3.0
    );
    assert_eq!(rank0.join().unwrap().unwrap(), 3.0);
    let took = start.elapsed();
    assert!(took < Duration::from_secs(3), "took {took:?}");
    eprintln!("the mesh formed {took:?} after rank 1 started, past 3 tricklers and 20 idle strays");
    drop((stops, idle));

    // A lone rank 0 under the same attack fails at its timeout, naming rank 1.
    let timeout = Duration::from_millis(1500);
    let host = TcpStore::host(loopback(), TOKEN, timeout).unwrap();
    let observer = TcpStore::connect(host.addr(), TOKEN, timeout).unwrap();
    let start = Instant::now();
    let lone = std::thread::spawn(move || sum_of_ranks(&host, 0, timeout));
    let listener = rank0_listener(&observer);
    let _stops: Vec<_> = (0..3)
        .map(|_| {
            let (tx, rx) = mpsc::channel();
            std::thread::spawn(move || trickle(listener, rx));
            tx
        })
        .collect();
    let err = lone.join().unwrap().unwrap_err();
    assert!(matches!(err, Error::PeerTimeout { rank: 1, .. }), "{err}");
    let took = start.elapsed();
    assert!(
        took < timeout + Duration::from_secs(1),
        "failed after {took:?}"
    );
    eprintln!("a lone rank 0 with a {timeout:?} timeout failed after {took:?}: {err}");
}

#[test]
fn a_rogue_with_the_token_cannot_claim_a_rank_or_take_its_place_in_the_mesh() {
    // World 3 with rank 1 late: rank 2 has published its record and waits
    // for rank 1's, so rank 0 is accepting and rank 2's commitment is out.
    let timeout = Duration::from_secs(20);
    let host = TcpStore::host(loopback(), TOKEN, timeout).unwrap();
    let addr = host.addr();
    let observer = TcpStore::connect(addr, TOKEN, timeout).unwrap();
    let rank0 = std::thread::spawn(move || sum_in_world(&host, 0, 3, timeout));
    let rank2 = std::thread::spawn(move || {
        let store = TcpStore::connect(addr, TOKEN, timeout)?;
        store.claim_rank(2)?;
        sum_in_world(&store, 2, 3, timeout)
    });
    let listener = rank0_listener(&observer);
    observer.get("accel/rank/2/tcp/0").unwrap();

    // In the store: rank 2 is taken, its keys and rank 0's are not writable.
    let mut rogue = raw_client(addr);
    let claim = [
        &[8u8][..],
        &2u32.to_le_bytes(),
        &32u32.to_le_bytes(),
        &[9; 32],
    ]
    .concat();
    send(&mut rogue, &claim);
    let msg = error_message(&recv(&mut rogue));
    assert!(msg.contains("rank 2 is already claimed"), "{msg}");
    for key in ["accel/rank/2/tcp/0", "accel/rank/0/tcp/0"] {
        send(
            &mut rogue,
            &[&[1u8][..], &str_field(key), &str_field("x")].concat(),
        );
        let msg = error_message(&recv(&mut rogue));
        assert!(msg.contains("has not claimed"), "{key}: {msg}");
    }

    // At rank 0's listener: the token is proven, rank 2 is not.
    let mut s = TcpStream::connect(listener).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let client = [3u8; 32];
    let context = [
        &2u32.to_le_bytes()[..],
        &3u32.to_le_bytes(),
        &0u64.to_le_bytes(),
    ]
    .concat();
    send(&mut s, &[&b"ACCELTC2"[..], &context, &client].concat());
    let answer = recv(&mut s);
    assert_eq!(answer[0], 0, "{}", String::from_utf8_lossy(&answer));
    let server = field(&answer).to_vec();
    let proof = mac(b"accel-mesh-client", &[&server, &client, &context]);
    let body = [
        &32u32.to_le_bytes()[..],
        &proof,
        &32u32.to_le_bytes(),
        &[0; 32],
    ]
    .concat();
    send(&mut s, &body);
    let answer = recv(&mut s);
    assert_eq!(answer[0], 1);
    let reason = String::from_utf8_lossy(&answer);
    assert!(
        reason.contains("secret does not match rank 2's commitment"),
        "{reason}"
    );

    // Rank 1 arrives and the job computes.
    let rank1 = TcpStore::connect(addr, TOKEN, timeout).unwrap();
    assert_eq!(sum_in_world(&rank1, 1, 3, timeout).unwrap(), 6.0);
    assert_eq!(rank0.join().unwrap().unwrap(), 6.0);
    assert_eq!(rank2.join().unwrap().unwrap(), 6.0);
}

fn open_descriptors(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count()
}

#[test]
fn a_client_that_leaves_while_waiting_on_a_key_is_closed_at_once() {
    let (mut child, addr) = store_process(1024);
    let before = open_descriptors(child.id());
    let mut waiter = raw_client(addr);
    // GET "never" with a wait of an hour.
    send(
        &mut waiter,
        &[&[2u8][..], &str_field("never"), &3_600_000u64.to_le_bytes()].concat(),
    );
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(open_descriptors(child.id()), before + 1);
    drop(waiter);
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(open_descriptors(child.id()), before);
    drop(child.stdin.take());
    child.wait().unwrap();
}
