//! The rendezvous store and communicator setup, with ranks as threads.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use accel_dist::{
    Communicator, Error, ProcessGroup, ProcessGroupConfig, ReduceOp, Result, StoreServer,
    TcpCommunicator, TcpStore,
};

fn loopback() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

#[test]
fn the_host_reports_the_port_it_got_and_clients_share_keys() -> Result<()> {
    let host = TcpStore::host(loopback(), "tok", Duration::from_secs(5))?;
    assert!(host.is_host());
    assert_ne!(host.addr().port(), 0);
    let client = TcpStore::connect(host.addr(), "tok", Duration::from_secs(5))?;
    client.set("a", b"1")?;
    assert_eq!(host.get("a")?, b"1");
    assert_eq!(host.add("n", 5)?, 5);
    assert_eq!(client.add("n", -2)?, 3);
    assert_eq!(client.get("n")?, b"3");
    assert_eq!(host.num_keys()?, 2);
    assert!(client.check(&["a", "n"])?);
    assert!(!client.check(&["a", "zz"])?);
    assert!(host.delete("a")?);
    assert!(!host.delete("a")?);
    assert_eq!(client.num_keys()?, 1);
    let err = client.add("missing-int", 1).and_then(|_| {
        client.set("text", b"x")?;
        client.add("text", 1)
    });
    assert!(err.unwrap_err().to_string().contains("text"));
    Ok(())
}

#[test]
fn get_blocks_until_another_rank_sets_the_key() -> Result<()> {
    let host = Arc::new(TcpStore::host(loopback(), "tok", Duration::from_secs(5))?);
    let addr = host.addr();
    let setter = std::thread::spawn(move || -> Result<()> {
        let c = TcpStore::connect(addr, "tok", Duration::from_secs(5))?;
        std::thread::sleep(Duration::from_millis(100));
        c.set("late", b"here")
    });
    let start = Instant::now();
    assert_eq!(host.get("late")?, b"here");
    assert!(start.elapsed() >= Duration::from_millis(90));
    host.wait(&["late"])?;
    setter.join().unwrap()
}

#[test]
fn a_missing_key_times_out_with_its_name_and_the_address() -> Result<()> {
    let host = TcpStore::host(loopback(), "tok", Duration::from_millis(200))?;
    let start = Instant::now();
    let err = host.get("never").unwrap_err();
    assert!(start.elapsed() < Duration::from_secs(5));
    let msg = err.to_string();
    assert!(matches!(err, Error::StoreTimeout { .. }), "{msg}");
    assert!(
        msg.contains("\"never\"") && msg.contains(&host.addr().to_string()),
        "{msg}"
    );
    let err = host.wait(&["never", "other"]).unwrap_err();
    assert!(err.to_string().contains("never"), "{err}");
    Ok(())
}

#[test]
fn a_stray_connection_is_refused() -> Result<()> {
    let host = TcpStore::host(loopback(), "job-secret", Duration::from_secs(5))?;
    // A client of another job.
    let err = TcpStore::connect(host.addr(), "other-job", Duration::from_secs(5))
        .err()
        .unwrap();
    assert!(matches!(err, Error::Refused { .. }), "{err}");
    assert!(err.to_string().contains("job token mismatch"), "{err}");
    // Something that is not an accel-rs client at all.
    let mut raw = TcpStream::connect(host.addr()).unwrap();
    raw.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    raw.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut answer = Vec::new();
    let _ = raw.read_to_end(&mut answer);
    assert!(
        answer.len() < 200,
        "the store talked to a stray client: {answer:?}"
    );
    // Neither left a trace, and the real job still works.
    assert_eq!(host.num_keys()?, 0);
    TcpStore::connect(host.addr(), "job-secret", Duration::from_secs(5))?.set("k", b"v")?;
    assert_eq!(host.num_keys()?, 1);
    Ok(())
}

#[test]
fn connecting_retries_until_the_store_is_up() -> Result<()> {
    // Find a free port, then start the store on it a little later.
    let addr = StoreServer::bind(loopback(), "tok")?.local_addr();
    let late = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(200));
        StoreServer::bind(addr, "tok").map(|s| {
            std::thread::sleep(Duration::from_millis(500));
            drop(s)
        })
    });
    let client = TcpStore::connect(addr, "tok", Duration::from_secs(5))?;
    client.set("k", b"v")?;
    late.join().unwrap()?;
    let err = TcpStore::connect(addr, "tok", Duration::from_millis(300))
        .err()
        .unwrap();
    assert!(matches!(err, Error::StoreUnreachable { .. }), "{err}");
    assert!(err.to_string().contains(&addr.to_string()), "{err}");
    Ok(())
}

#[test]
fn a_barrier_names_the_ranks_that_did_not_arrive() -> Result<()> {
    let host = Arc::new(TcpStore::host(loopback(), "tok", Duration::from_secs(5))?);
    let addr = host.addr();
    let others: Vec<_> = (1..3)
        .map(|rank| {
            std::thread::spawn(move || -> Result<()> {
                let c = TcpStore::connect(addr, "tok", Duration::from_secs(5))?;
                c.barrier("start", rank, 3)?;
                c.barrier("start", rank, 3)
            })
        })
        .collect();
    host.barrier("start", 0, 3)?;
    host.barrier("start", 0, 3)?;
    for t in others {
        t.join().unwrap()?;
    }
    let mut lonely = TcpStore::connect(addr, "tok", Duration::from_secs(5))?;
    lonely.set_timeout(Duration::from_millis(200));
    let err = lonely.barrier("end", 1, 3).unwrap_err();
    assert!(
        matches!(&err, Error::BarrierTimeout { missing, .. } if missing == &[0, 2]),
        "{err}"
    );
    Ok(())
}

#[test]
fn communicators_connect_through_a_store_hosted_by_rank_zero() -> Result<()> {
    let host = TcpStore::host(loopback(), "tok", Duration::from_secs(10))?;
    let addr = host.addr();
    let rank = |r: usize| {
        std::thread::spawn(move || -> Result<Vec<f32>> {
            let cfg = ProcessGroupConfig::default()
                .with_rank(r, 3)
                .with_master("127.0.0.1", addr.port())
                .with_job_token("tok")
                .with_timeout(Duration::from_secs(10));
            let store = TcpStore::from_config(&ProcessGroupConfig {
                use_agent_store: true,
                ..cfg.clone()
            })?;
            let comm = TcpCommunicator::connect(&store, r, 3, cfg.timeout)?;
            let mut v = vec![r as f32; 5];
            comm.all_reduce((&mut v).into(), ReduceOp::Sum)?;
            comm.barrier()?;
            Ok(v)
        })
    };
    let others = [rank(1), rank(2)];
    let comm = TcpCommunicator::connect(&host, 0, 3, Duration::from_secs(10))?;
    let mut v = vec![0f32; 5];
    comm.all_reduce((&mut v).into(), ReduceOp::Sum)?;
    comm.barrier()?;
    assert_eq!(v, [3.0; 5]);
    for t in others {
        assert_eq!(t.join().unwrap()?, [3.0; 5]);
    }
    Ok(())
}

#[test]
fn a_rank_that_never_shows_up_is_named() -> Result<()> {
    let host = TcpStore::host(loopback(), "tok", Duration::from_millis(300))?;
    let start = Instant::now();
    let err = TcpCommunicator::connect(&host, 0, 2, Duration::from_millis(300))
        .err()
        .unwrap();
    assert!(start.elapsed() < Duration::from_secs(5));
    assert!(matches!(err, Error::PeerTimeout { rank: 1, .. }), "{err}");
    Ok(())
}

#[test]
fn a_single_process_group_uses_the_local_communicator() -> Result<()> {
    let group = ProcessGroup::init(ProcessGroupConfig::default())?;
    let comm = group.communicator();
    let mut v = vec![2.0f64];
    comm.all_reduce((&mut v).into(), ReduceOp::Mean)?;
    assert_eq!(v, [2.0]);
    Ok(())
}

#[test]
fn many_clients_through_many_barriers_each_get_exactly_their_own_answers() -> Result<()> {
    // Every barrier wakes the waiters of the one before while new requests
    // arrive: a waiter answered twice shifts that client's answers by one.
    let world = 8;
    let host = TcpStore::host(loopback(), "tok", Duration::from_secs(20))?;
    let addr = host.addr();
    let ranks: Vec<_> = (0..world)
        .map(|rank| {
            std::thread::spawn(move || -> Result<()> {
                let c = TcpStore::connect(addr, "tok", Duration::from_secs(20))?;
                for round in 0..40 {
                    c.barrier("loop", rank, world)?;
                    let key = format!("r{round}/{rank}");
                    c.set(&key, key.as_bytes())?;
                    let peer = format!("r{round}/{}", (rank + 1) % world);
                    assert_eq!(c.get(&peer)?, peer.as_bytes());
                }
                Ok(())
            })
        })
        .collect();
    for r in ranks {
        r.join().unwrap()?;
    }
    drop(host);
    Ok(())
}

#[test]
fn a_store_that_died_is_an_error_at_once_not_at_the_timeout() -> Result<()> {
    let server = StoreServer::bind(loopback(), "tok")?;
    let addr = server.local_addr();
    let client = TcpStore::connect(addr, "tok", Duration::from_secs(120))?;
    client.set("k", b"v")?;
    drop(server);
    let start = Instant::now();
    let err = client.set("k", b"w").unwrap_err();
    assert!(
        start.elapsed() < Duration::from_secs(8),
        "after {:?}",
        start.elapsed()
    );
    assert!(err.to_string().contains(&addr.to_string()), "{err}");
    Ok(())
}
