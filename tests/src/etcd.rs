//! A real etcd (Debian's `etcd-server`) for the rendezvous tests, started
//! on ports of its own with a data folder of its own and killed when
//! dropped: on loopback, or inside a network namespace of
//! [`Hosts`](crate::hosts::Hosts) at the address given.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use accel_core::dist::rendezvous::Etcd;

/// A running etcd.
pub struct Server {
    /// The process (kill it to take etcd away mid-test).
    pub child: Child,
    /// Its client endpoint, `host:port`.
    pub endpoint: String,
}

impl Server {
    /// An etcd serving `127.0.0.1:<free port>` from `dir`; `None`, having
    /// said why, where `etcd` is not installed (the caller skips).
    pub fn start(dir: &Path) -> Option<Self> {
        let (client, peer) = (crate::free_port(), crate::free_port());
        Self::start_with(dir, Command::new("etcd"), "127.0.0.1", (client, peer))
    }

    /// An etcd run as `etcd` (a command that starts the program, e.g. inside
    /// a namespace) listening on `host`'s `ports` (client, peer).
    pub fn start_with(
        dir: &Path,
        mut etcd: Command,
        host: &str,
        (client, peer): (u16, u16),
    ) -> Option<Self> {
        let client_url = format!("http://{host}:{client}");
        let peer_url = format!("http://{host}:{peer}");
        let child = etcd
            .args(["--name", "accel-test", "--data-dir"])
            .arg(dir.join("etcd-data"))
            .args(["--listen-client-urls", &client_url])
            .args(["--advertise-client-urls", &client_url])
            .args(["--listen-peer-urls", &peer_url])
            .args(["--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", &format!("accel-test={peer_url}")])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("etcd.log")).unwrap())
            .spawn();
        let mut child = match child {
            Ok(child) => child,
            Err(e) => {
                eprintln!("skipped: etcd could not be started ({e}); apt-get install etcd-server");
                return None;
            }
        };
        let endpoint = format!("{host}:{client}");
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                // `ip netns exec` runs, but etcd itself is missing.
                eprintln!(
                    "skipped: etcd exited at once ({status}): {}",
                    std::fs::read_to_string(dir.join("etcd.log")).unwrap_or_default()
                );
                return None;
            }
            // The probe runs here, outside any namespace: inside one, the
            // caller checks reachability itself.
            if host != "127.0.0.1" || Etcd::connect(&endpoint, Duration::from_secs(1)).is_ok() {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "etcd did not answer within 30 s: {}",
                std::fs::read_to_string(dir.join("etcd.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        Some(Self { child, endpoint })
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
