//! The sharded side of the scaling benchmark (`pgherd bench shards`): the thesis's benchmarks
//! 3 and 4 over 1–4 shards. Each shard is a one-node cluster under the same CPU quota as the
//! master/slave cluster's nodes; for each shard count N a database `shards<N>` holds pgbench's
//! tables loaded through a sharded pgherd over the first N shards (`pgbench_accounts` spread
//! by `aid`, the other tables on every shard), and the benchmark's sharded pgherd over N shards
//! serves it as the database `bench`, so the same pgbench runs against it and against the
//! master/slave cluster behind an unsharded pgherd; [`report`] is the run report's sharding
//! table.

use std::fmt::Write as _;
use std::path::Path;

use pgherd_cluster::LocalNode;

use super::scaling::{peak, Medians, ScalingTarget, ScalingWorkload};
use super::targets::{start_pgherd, BenchCluster, BenchUser, PgherdSetup, ProxyProcess};
use super::{fmt, pgbench_init};

/// One-node clusters, shard `k` the `k`-th.
pub struct ShardClusters {
    clusters: Vec<BenchCluster>,
    scale: u32,
    /// How `pgbench_accounts` is spread: `[[sharding.tables]]`'s method lines for `n` shards.
    layout: fn(usize, u32) -> String,
}

/// `pgbench_accounts` by a hash of `aid`.
pub fn hash_layout(_shards: usize, _scale: u32) -> String {
    String::new()
}

/// `pgbench_accounts` by `aid` ranges of equal size (pgbench's keys run from 1 to 100,000
/// per scale unit).
pub fn range_layout(shards: usize, scale: u32) -> String {
    let rows = 100_000 * u64::from(scale);
    let starts: Vec<String> = (0..shards as u64)
        .map(|k| (1 + k * rows / shards as u64).to_string())
        .collect();
    format!("method = \"range\"\nstarts = [{}]\n", starts.join(", "))
}

/// How the benchmark's pgherds are set up, whatever they front.
pub struct ProxySettings<'a> {
    pub user: &'a BenchUser,
    pub pool_size: u32,
    pub workers: usize,
}

impl ShardClusters {
    /// `count` one-node clusters under `dir` (all with the first one's superuser password,
    /// which pgherd logs in with), each loaded for every shard count in `counts` it belongs to;
    /// `layout` says how pgherd spreads `pgbench_accounts` ([`hash_layout`], [`range_layout`]).
    pub fn create(
        dir: &Path,
        (count, layout): (usize, fn(usize, u32) -> String),
        settings: &[(String, String)],
        proxy: &ProxySettings,
        (counts, scale): (&[usize], u32),
        pgbench: &Path,
    ) -> Result<ShardClusters, String> {
        eprintln!(
            "creating {count} one-node shard(s) in {} ...",
            dir.display()
        );
        let mut settings = settings.to_vec();
        // Writes over several shards (pgbench -i's COPY) commit with two-phase commit.
        settings.push(("max_prepared_transactions".into(), "10".into()));
        let mut clusters: Vec<BenchCluster> = Vec::with_capacity(count);
        for k in 0..count {
            let cluster = BenchCluster::create(
                &dir.join(format!("shard{k}")),
                0,
                settings.clone(),
                &[proxy.user],
            )?;
            if let Some(first) = clusters.first() {
                cluster.sql(
                    "postgres",
                    &format!(
                        "ALTER ROLE postgres PASSWORD '{}'",
                        first.superuser_password
                    ),
                )?;
            }
            clusters.push(cluster);
        }
        let shards = ShardClusters {
            clusters,
            layout,
            scale,
        };
        for &n in counts {
            for cluster in &shards.clusters[..n] {
                cluster.sql(
                    "postgres",
                    &format!("CREATE DATABASE shards{n} OWNER {}", proxy.user.name),
                )?;
            }
            let loader =
                shards.start_named_pgherd(n, proxy, &format!("pgherd-shards{n}-load"), false)?;
            eprintln!("loading pgbench's tables over {n} shard(s) through pgherd ...");
            pgbench_init(pgbench, &proxy.user.url(loader.port, "bench"), scale)?;
            for cluster in &shards.clusters[..n] {
                cluster.sql(&format!("shards{n}"), "VACUUM ANALYZE")?;
                cluster.sql("postgres", "CHECKPOINT")?;
            }
        }
        Ok(shards)
    }

    /// A sharded pgherd over the first `n` shards, serving database `bench` from `shards<n>`.
    pub fn start_pgherd(&self, n: usize, proxy: &ProxySettings) -> Result<ProxyProcess, String> {
        self.start_named_pgherd(n, proxy, &format!("pgherd-shards{n}"), false)
    }

    /// [`Self::start_pgherd`] with its files named `name`, and the superuser on its admin
    /// console if `admin`.
    pub fn start_named_pgherd(
        &self,
        n: usize,
        proxy: &ProxySettings,
        name: &str,
        admin: bool,
    ) -> Result<ProxyProcess, String> {
        let mut extra = format!(
            "[databases.bench]\ndbname = \"shards{n}\"\n\n[sharding]\n\
             [[sharding.tables]]\ntable = \"pgbench_accounts\"\ncolumn = \"aid\"\ntype = \"integer\"\n{}\n",
            (self.layout)(n, self.scale)
        );
        for (k, cluster) in self.clusters.iter().enumerate().take(n).skip(1) {
            let node = cluster.cluster.primary();
            extra.push_str(&format!(
                "[[nodes]]\nname = \"shard{k}\"\nhost = \"{}\"\nport = {}\nshard = {k}\n\n",
                node.host, node.port
            ));
        }
        let first = self
            .clusters
            .first()
            .ok_or_else(|| "no shard cluster".to_owned())?;
        start_pgherd(
            first,
            &PgherdSetup {
                nodes: 1,
                users: &[proxy.user],
                pool_size: proxy.pool_size,
                workers: proxy.workers,
                database_keys: "",
                ha: false,
                admin,
                baseline: None,
                instance: Some((name, &extra)),
            },
        )
    }

    /// Shard `k`'s cluster.
    pub fn cluster(&self, k: usize) -> Option<&BenchCluster> {
        self.clusters.get(k)
    }

    /// Every shard's node, with the name its CPU quota group takes.
    pub fn nodes(&self) -> impl Iterator<Item = (String, &LocalNode)> {
        self.clusters
            .iter()
            .enumerate()
            .map(|(k, c)| (quota_name(k), c.cluster.primary()))
    }
}

/// The CPU quota group of shard `k`'s node.
pub fn quota_name(k: usize) -> String {
    format!("shard{k}")
}

/// The sharding goals: index-scan TPS on N shards against the master/slave cluster on N
/// nodes (at least 0.9), the aggregate's fan-out on N shards against N times one node (at
/// least 0.8), both as peaks over client counts.
pub fn report(r: &mut String, workloads: &[ScalingWorkload], nodes: &[usize], m: &Medians) {
    let _ = writeln!(
        r,
        "\n### Sharding (the thesis's benchmarks 3 and 4)\n\nPeak TPS over client counts. \
         Goals: index-scan on N shards at least 0.9 x pgherd master/slave on N nodes; aggregate \
         on N shards at least 0.8 x N x one node direct.\n"
    );
    let _ = writeln!(
        r,
        "| workload | N | sharded peak | master/slave peak | sharded / master-slave | direct 1 node | sharded / (N x direct) |"
    );
    let _ = writeln!(r, "|---|---:|---:|---:|---:|---:|---:|");
    for &workload in workloads {
        let direct = peak(m, workload, ScalingTarget::Direct, 1).0;
        for &n in nodes {
            let (s, sc) = peak(m, workload, ScalingTarget::PgherdShards, n);
            let (h, hc) = peak(m, workload, ScalingTarget::Pgherd, n);
            let _ = writeln!(
                r,
                "| {} | {n} | {} ({sc}) | {} ({hc}) | {} | {} | {} |",
                workload.name(),
                fmt(s, 0),
                fmt(h, 0),
                fmt(s / h, 2),
                fmt(direct, 0),
                fmt(s / (n as f64 * direct), 2)
            );
        }
    }
}
