//! A network for fault drills and tests: every node in its own network namespace behind a
//! bridge, so one can be cut off from everyone by taking its link down (packets dropped, not
//! refused: the node keeps running and its peers hear nothing). Needs root and iproute2.

use crate::LocalNode;

/// A network for a cluster whose nodes each run in their own namespace: a bridge on the host
/// (10.X.0.1) and per node a namespace with a veth pair, the node's end at 10.X.0.(i+2).
/// Nodes reach each other through the bridge (no IP forwarding needed); cutting a node is
/// taking its host-side veth down. Removed when dropped.
pub struct Network {
    /// Names the namespaces: `{prefix}-{id}-{i}`.
    prefix: &'static str,
    id: u32,
    subnet: u8,
    nodes: usize,
}

impl Network {
    /// `prefix` names the namespaces (`ip netns list` shows who made them); the process id
    /// and a count of the process's networks keep two networks apart (tests of one process
    /// run at once), in their names and their subnets.
    pub fn create(prefix: &'static str, nodes: usize) -> Result<Network, String> {
        static MADE: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let made = MADE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let id = (std::process::id() % 10_000) * 10 + made % 10;
        let subnet = 100 + (id % 100) as u8;
        let network = Network {
            prefix,
            id,
            subnet,
            nodes,
        };
        let bridge = network.bridge();
        ip(&["link", "add", &bridge, "type", "bridge"])?;
        ip(&[
            "addr",
            "add",
            &format!("10.{subnet}.0.1/24"),
            "dev",
            &bridge,
        ])?;
        ip(&["link", "set", &bridge, "up"])?;
        for i in 0..nodes {
            let (ns, host_end, node_end) = network.names(i);
            ip(&["netns", "add", &ns])?;
            ip(&[
                "link", "add", &host_end, "type", "veth", "peer", "name", &node_end,
            ])?;
            ip(&["link", "set", &node_end, "netns", &ns])?;
            ip(&["link", "set", &host_end, "master", &bridge])?;
            ip(&["link", "set", &host_end, "up"])?;
            ip(&[
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{}/24", network.address(i)),
                "dev",
                &node_end,
            ])?;
            ip(&["-n", &ns, "link", "set", &node_end, "up"])?;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
        }
        Ok(network)
    }

    fn bridge(&self) -> String {
        format!("phb{}", self.id)
    }

    /// (namespace, host-side veth, node-side veth).
    fn names(&self, i: usize) -> (String, String, String) {
        (
            format!("{}-{}-{i}", self.prefix, self.id),
            format!("phv{}h{i}", self.id),
            format!("phv{}n{i}", self.id),
        )
    }

    fn address(&self, i: usize) -> String {
        format!("10.{}.0.{}", self.subnet, i + 2)
    }

    /// Takes the node's link to everyone down, or brings it back up: its host-side veth.
    pub fn set_link(&self, node: &LocalNode, up: bool) -> Result<(), String> {
        let i = (0..self.nodes)
            .find(|&i| node.netns.as_deref() == Some(self.names(i).0.as_str()))
            .ok_or_else(|| format!("node {} runs in none of these namespaces", node.name))?;
        let host_end = self.names(i).1;
        ip(&["link", "set", &host_end, if up { "up" } else { "down" }])
    }

    /// (namespace, address) per node, for the cluster.
    pub fn nodes(&self) -> Vec<(String, String)> {
        (0..self.nodes)
            .map(|i| (self.names(i).0, self.address(i)))
            .collect()
    }
}

impl Drop for Network {
    fn drop(&mut self) {
        for i in 0..self.nodes {
            let _ = ip(&["netns", "del", &self.names(i).0]);
        }
        let _ = ip(&["link", "del", &self.bridge()]);
    }
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = std::process::Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("cannot run ip (iproute2): {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {} (network namespaces need root)",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}
