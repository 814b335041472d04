//! Hosts made of network namespaces for multi-machine tests: `n` namespaces,
//! each a "host" with its own address on a private subnet, joined by veth
//! pairs to a bridge inside a switch namespace of their own. Everything is
//! created under names unique to this process and deleted on drop (also
//! when a test fails), and no address outside the namespaces is used.
//! Faults are queueing disciplines on a host's link (`netem` delay where the
//! kernel has it, `tbf` rate limits) and the link set down.

use std::process::{Command, Output};

/// A set of namespace hosts; dropped, it deletes them.
pub struct Hosts {
    names: Vec<String>,
    switch: String,
    subnet: u8,
}

fn ip(args: &[&str]) -> std::io::Result<Output> {
    Command::new("ip").args(args).output()
}

fn must(out: std::io::Result<Output>, what: &str) -> Result<(), String> {
    match out {
        Ok(o) if o.status.success() => Ok(()),
        Ok(o) => Err(format!(
            "{what}: {}",
            String::from_utf8_lossy(&o.stderr).trim()
        )),
        Err(e) => Err(format!("{what}: {e}")),
    }
}

impl Hosts {
    /// `n` hosts at `10.231.<subnet>.1..=n`, or why they cannot be made
    /// here (not root, no `ip`, namespaces refused): the caller skips.
    pub fn new(n: usize) -> Result<Self, String> {
        // Names and a subnet per instance: tests of one binary run in parallel.
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let k = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tag = format!("{}x{k}", std::process::id() % 100_000);
        let subnet = ((std::process::id() % 50) * 4 + k % 4) as u8 + 20;
        let hosts = Self {
            names: (0..n).map(|i| format!("acc{tag}h{i}")).collect(),
            switch: format!("acc{tag}sw"),
            subnet,
        };
        hosts.build()?;
        Ok(hosts)
    }

    fn build(&self) -> Result<(), String> {
        for ns in self.names.iter().chain([&self.switch]) {
            must(ip(&["netns", "add", ns]), "ip netns add")?;
            must(ip(&["-n", ns, "link", "set", "lo", "up"]), "lo up")?;
        }
        let sw = self.switch.as_str();
        must(
            ip(&["-n", sw, "link", "add", "br0", "type", "bridge"]),
            "bridge",
        )?;
        must(ip(&["-n", sw, "link", "set", "br0", "up"]), "bridge up")?;
        // The switch's own address, for services every host reaches (etcd).
        let hub = format!("{}/24", self.hub_addr());
        must(
            ip(&["-n", sw, "addr", "add", &hub, "dev", "br0"]),
            "hub address",
        )?;
        for (i, ns) in self.names.iter().enumerate() {
            let (host_end, switch_end) = (format!("v{i}"), format!("s{i}"));
            // Created inside the host namespace, the switch end moved out:
            // nothing is ever added to the namespace the tests run in.
            must(
                ip(&[
                    "-n",
                    ns,
                    "link",
                    "add",
                    &host_end,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    &switch_end,
                    "netns",
                    sw,
                ]),
                "veth",
            )?;
            must(
                ip(&["-n", sw, "link", "set", &switch_end, "master", "br0"]),
                "enslave",
            )?;
            must(
                ip(&["-n", sw, "link", "set", &switch_end, "up"]),
                "switch end up",
            )?;
            let addr = format!("{}/24", self.addr(i));
            must(
                ip(&["-n", ns, "addr", "add", &addr, "dev", &host_end]),
                "address",
            )?;
            must(
                ip(&["-n", ns, "link", "set", &host_end, "up"]),
                "host end up",
            )?;
        }
        Ok(())
    }

    /// Host `i`'s address.
    pub fn addr(&self, i: usize) -> String {
        format!("10.231.{}.{}", self.subnet, i + 1)
    }

    /// The switch's address: a service there (etcd) is cut off from a
    /// host whose link is down, as a partitioned machine is.
    pub fn hub_addr(&self) -> String {
        format!("10.231.{}.254", self.subnet)
    }

    /// A command run inside the switch's namespace (at [`Self::hub_addr`]).
    pub fn hub_command(&self, program: &str) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.switch, program]);
        c
    }

    /// SIGKILL to every process inside host `i`: the machine dies.
    pub fn kill_all(&self, i: usize) {
        let pids = ip(&["netns", "pids", &self.names[i]])
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        for pid in pids.split_whitespace() {
            let _ = Command::new("kill").args(["-KILL", pid]).status();
        }
    }

    /// A command run inside host `i`.
    pub fn command(&self, i: usize, program: &str) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.names[i], program]);
        c
    }

    /// A queueing discipline on host `i`'s link: `["netem", "delay", "5ms"]`,
    /// `["tbf", "rate", "1gbit", ...]`. `Err` names what the kernel refused
    /// (`netem` is a module some kernels lack).
    pub fn qdisc(&self, i: usize, spec: &[&str]) -> Result<(), String> {
        let dev = format!("v{i}");
        let mut args = vec!["qdisc", "replace", "dev", dev.as_str(), "root"];
        args.extend(spec);
        must(
            Command::new("ip")
                .args(["netns", "exec", &self.names[i], "tc"])
                .args(&args)
                .output(),
            &format!("tc {}", spec.first().unwrap_or(&"")),
        )
    }

    /// Host `i`'s link down (a partition) or up again.
    pub fn link(&self, i: usize, up: bool) -> Result<(), String> {
        let dev = format!("s{i}");
        let state = if up { "up" } else { "down" };
        must(
            ip(&["-n", &self.switch, "link", "set", &dev, state]),
            "link",
        )
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        // Deleting a namespace kills nothing; processes still in it keep it
        // alive until they exit, and their links go with it.
        for ns in self.names.iter().chain([&self.switch]) {
            let _ = ip(&["netns", "del", ns]);
        }
    }
}
