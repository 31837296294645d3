//! The file as written: serde mirrors of `pgherd.toml` with defaults. Nothing here is trusted
//! until `validate` turns it into a [`crate::Config`].

use std::collections::BTreeMap;

use serde::Deserialize;

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    #[serde(default)]
    pub pgherd: RawProxy,
    pub tls: Option<RawClientTls>,
    #[serde(default)]
    pub server_tls: RawServerTls,
    #[serde(default)]
    pub cluster: RawCluster,
    #[serde(default)]
    pub nodes: Vec<RawNode>,
    #[serde(default)]
    pub pool: RawPool,
    #[serde(default)]
    pub databases: BTreeMap<String, RawDatabase>,
    #[serde(default)]
    pub users: BTreeMap<String, RawUser>,
    #[serde(default)]
    pub auth: RawAuth,
    #[serde(default)]
    pub hba: Vec<RawHba>,
    #[serde(default)]
    pub routing: RawRouting,
    #[serde(default)]
    pub failover: RawFailover,
    #[serde(default)]
    pub replication: RawReplication,
    #[serde(default)]
    pub api: RawApi,
    pub dcs: Option<crate::dcs::RawDcs>,
    pub sharding: Option<crate::sharding::RawSharding>,
    #[serde(default)]
    pub cache: crate::cache::RawCache,
    #[serde(default)]
    pub sets: crate::sets::RawSets,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct RawApi {
    #[serde(default)]
    pub listen: Vec<String>,
    pub token: Option<String>,
    pub token_file: Option<String>,
    pub token_env: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawReplication {
    #[serde(default = "default_durability")]
    pub durability: String,
    #[serde(default = "default_sync_standbys")]
    pub sync_standbys: u32,
    #[serde(default = "default_synchronous_commit")]
    pub synchronous_commit: String,
    pub user: Option<String>,
    pub password: Option<String>,
    pub password_file: Option<String>,
    pub password_env: Option<String>,
}

impl Default for RawReplication {
    fn default() -> Self {
        RawReplication {
            durability: default_durability(),
            sync_standbys: default_sync_standbys(),
            synchronous_commit: default_synchronous_commit(),
            user: None,
            password: None,
            password_file: None,
            password_env: None,
        }
    }
}

fn default_durability() -> String {
    "sync".to_owned()
}
fn default_sync_standbys() -> u32 {
    1
}
fn default_synchronous_commit() -> String {
    "on".to_owned()
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawFailover {
    #[serde(default)]
    pub enabled: bool,
    #[serde(default = "default_max_lag_on_failover_bytes")]
    pub max_lag_on_failover_bytes: u64,
    pub notify_command: Option<String>,
    #[serde(default = "default_switchover_drain_ms")]
    pub switchover_drain_ms: u64,
    #[serde(default)]
    pub auto_rejoin: bool,
    pub fence_command: Option<String>,
}

impl Default for RawFailover {
    fn default() -> Self {
        RawFailover {
            enabled: false,
            max_lag_on_failover_bytes: default_max_lag_on_failover_bytes(),
            notify_command: None,
            switchover_drain_ms: default_switchover_drain_ms(),
            auto_rejoin: false,
            fence_command: None,
        }
    }
}

fn default_switchover_drain_ms() -> u64 {
    10_000
}

fn default_max_lag_on_failover_bytes() -> u64 {
    16 << 20
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRouting {
    #[serde(default = "default_max_lag_bytes")]
    pub max_lag_bytes: u64,
    #[serde(default = "default_max_lag_ms")]
    pub max_lag_ms: u64,
    #[serde(default = "default_read_your_writes_wait_ms")]
    pub read_your_writes_wait_ms: u64,
    #[serde(default = "default_rejoin_after_checks")]
    pub rejoin_after_checks: u32,
    #[serde(default = "default_decision_cache_entries")]
    pub decision_cache_entries: usize,
    #[serde(default = "default_max_parse_bytes")]
    pub max_parse_bytes: usize,
}

impl Default for RawRouting {
    fn default() -> Self {
        RawRouting {
            max_lag_bytes: default_max_lag_bytes(),
            max_lag_ms: default_max_lag_ms(),
            read_your_writes_wait_ms: default_read_your_writes_wait_ms(),
            rejoin_after_checks: default_rejoin_after_checks(),
            decision_cache_entries: default_decision_cache_entries(),
            max_parse_bytes: default_max_parse_bytes(),
        }
    }
}

fn default_max_lag_bytes() -> u64 {
    16 << 20
}
fn default_max_lag_ms() -> u64 {
    5_000
}
fn default_read_your_writes_wait_ms() -> u64 {
    20
}
fn default_rejoin_after_checks() -> u32 {
    3
}
fn default_max_parse_bytes() -> usize {
    32 << 10
}
fn default_decision_cache_entries() -> usize {
    10_000
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawProxy {
    #[serde(default = "default_listen")]
    pub listen: Vec<String>,
    #[serde(default)]
    pub workers: usize,
    #[serde(default = "default_max_client_connections")]
    pub max_client_connections: usize,
    #[serde(default = "default_admin_reserved_connections")]
    pub admin_reserved_connections: usize,
    #[serde(default = "default_auth_failure_delay_ms")]
    pub auth_failure_delay_ms: u64,
    #[serde(default = "default_max_message_bytes")]
    pub max_message_bytes: usize,
    #[serde(default = "default_client_login_timeout_ms")]
    pub client_login_timeout_ms: u64,
    #[serde(default)]
    pub client_idle_timeout_ms: u64,
    #[serde(default = "default_client_park_after_ms")]
    pub client_park_after_ms: u64,
    #[serde(default = "default_shutdown_timeout_ms")]
    pub shutdown_timeout_ms: u64,
    #[serde(default)]
    pub admin_users: Vec<String>,
    #[serde(default)]
    pub stats_users: Vec<String>,
    #[serde(default = "default_log_format")]
    pub log_format: String,
    #[serde(default = "default_log_level")]
    pub log_level: String,
    #[serde(default)]
    pub state_file: Option<String>,
    #[serde(default)]
    pub zone: Option<String>,
}

impl Default for RawProxy {
    fn default() -> Self {
        RawProxy {
            listen: default_listen(),
            workers: 0,
            max_client_connections: default_max_client_connections(),
            admin_reserved_connections: default_admin_reserved_connections(),
            auth_failure_delay_ms: default_auth_failure_delay_ms(),
            max_message_bytes: default_max_message_bytes(),
            client_login_timeout_ms: default_client_login_timeout_ms(),
            client_idle_timeout_ms: 0,
            client_park_after_ms: default_client_park_after_ms(),
            shutdown_timeout_ms: default_shutdown_timeout_ms(),
            admin_users: Vec::new(),
            stats_users: Vec::new(),
            log_format: default_log_format(),
            log_level: default_log_level(),
            state_file: None,
            zone: None,
        }
    }
}

fn default_listen() -> Vec<String> {
    vec!["127.0.0.1:6432".to_owned()]
}
fn default_max_client_connections() -> usize {
    10_000
}
fn default_admin_reserved_connections() -> usize {
    3
}
fn default_auth_failure_delay_ms() -> u64 {
    250
}
fn default_max_message_bytes() -> usize {
    256 << 20
}
fn default_client_park_after_ms() -> u64 {
    1_000
}
fn default_client_login_timeout_ms() -> u64 {
    60_000
}
fn default_shutdown_timeout_ms() -> u64 {
    30_000
}
fn default_log_format() -> String {
    "human".to_owned()
}
fn default_log_level() -> String {
    "info".to_owned()
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawClientTls {
    #[serde(default = "default_client_tls_mode")]
    pub mode: String,
    pub cert_file: String,
    pub key_file: String,
    pub client_ca_file: Option<String>,
}

fn default_client_tls_mode() -> String {
    "allow".to_owned()
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawServerTls {
    #[serde(default = "default_server_tls_mode")]
    pub mode: String,
    pub ca_file: Option<String>,
}

impl Default for RawServerTls {
    fn default() -> Self {
        RawServerTls {
            mode: default_server_tls_mode(),
            ca_file: None,
        }
    }
}

fn default_server_tls_mode() -> String {
    "disable".to_owned()
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawCluster {
    #[serde(default = "default_cluster_user")]
    pub user: String,
    pub password: Option<String>,
    pub password_file: Option<String>,
    pub password_env: Option<String>,
    #[serde(default = "default_cluster_database")]
    pub database: String,
    #[serde(default = "default_health_check_period_ms")]
    pub health_check_period_ms: u64,
    #[serde(default = "default_health_check_timeout_ms")]
    pub health_check_timeout_ms: u64,
    #[serde(default = "default_health_check_failures_before_down")]
    pub health_check_failures_before_down: u32,
    #[serde(default = "default_primary_wait_ms")]
    pub primary_wait_ms: u64,
}

impl Default for RawCluster {
    fn default() -> Self {
        RawCluster {
            user: default_cluster_user(),
            password: None,
            password_file: None,
            password_env: None,
            database: default_cluster_database(),
            health_check_period_ms: default_health_check_period_ms(),
            health_check_timeout_ms: default_health_check_timeout_ms(),
            health_check_failures_before_down: default_health_check_failures_before_down(),
            primary_wait_ms: default_primary_wait_ms(),
        }
    }
}

fn default_cluster_user() -> String {
    "postgres".to_owned()
}
fn default_cluster_database() -> String {
    "postgres".to_owned()
}
/// With 3 failures before down: a dead primary is down in under a second, a hung one (no
/// answer) in about three.
fn default_health_check_period_ms() -> u64 {
    250
}
fn default_health_check_timeout_ms() -> u64 {
    1_000
}
fn default_health_check_failures_before_down() -> u32 {
    3
}
fn default_primary_wait_ms() -> u64 {
    10_000
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawNode {
    pub name: String,
    #[serde(default = "default_node_host")]
    pub host: String,
    pub port: u16,
    pub socket_dir: Option<String>,
    pub data_dir: Option<String>,
    pub netns: Option<String>,
    #[serde(default = "default_node_weight")]
    pub weight: u32,
    #[serde(default = "default_node_priority")]
    pub priority: u32,
    pub zone: Option<String>,
    #[serde(default = "default_true")]
    pub sync: bool,
    /// The shard the node belongs to (`[sharding]`); 0 without sharding.
    #[serde(default)]
    pub shard: u32,
}

fn default_true() -> bool {
    true
}

fn default_node_priority() -> u32 {
    1
}

fn default_node_weight() -> u32 {
    1
}

fn default_node_host() -> String {
    "127.0.0.1".to_owned()
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawPool {
    #[serde(default = "default_pool_mode")]
    pub mode: String,
    #[serde(default = "default_pool_max_size")]
    pub max_size: u32,
    #[serde(default)]
    pub min_size: u32,
    #[serde(default = "default_wait_timeout_ms")]
    pub wait_timeout_ms: u64,
    #[serde(default = "default_server_idle_timeout_ms")]
    pub server_idle_timeout_ms: u64,
    #[serde(default = "default_server_lifetime_ms")]
    pub server_lifetime_ms: u64,
    #[serde(default = "default_server_connect_timeout_ms")]
    pub server_connect_timeout_ms: u64,
    #[serde(default = "default_server_reset_query")]
    pub server_reset_query: String,
    #[serde(default = "default_prepared_statements_per_server")]
    pub prepared_statements_per_server: usize,
}

impl Default for RawPool {
    fn default() -> Self {
        RawPool {
            mode: default_pool_mode(),
            max_size: default_pool_max_size(),
            min_size: 0,
            wait_timeout_ms: default_wait_timeout_ms(),
            server_idle_timeout_ms: default_server_idle_timeout_ms(),
            server_lifetime_ms: default_server_lifetime_ms(),
            server_connect_timeout_ms: default_server_connect_timeout_ms(),
            server_reset_query: default_server_reset_query(),
            prepared_statements_per_server: default_prepared_statements_per_server(),
        }
    }
}

fn default_pool_mode() -> String {
    "transaction".to_owned()
}
fn default_pool_max_size() -> u32 {
    20
}
fn default_wait_timeout_ms() -> u64 {
    30_000
}
fn default_server_idle_timeout_ms() -> u64 {
    600_000
}
fn default_server_lifetime_ms() -> u64 {
    3_600_000
}
fn default_server_connect_timeout_ms() -> u64 {
    5_000
}
fn default_server_reset_query() -> String {
    "DISCARD ALL".to_owned()
}
fn default_prepared_statements_per_server() -> usize {
    256
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct RawDatabase {
    pub dbname: Option<String>,
    pub mode: Option<String>,
    pub max_size: Option<u32>,
    pub min_size: Option<u32>,
    pub route: Option<String>,
    pub consistency: Option<String>,
    pub balance: Option<String>,
    #[serde(default)]
    pub primary_reads: bool,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct RawUser {
    pub scram: Option<String>,
    pub md5: Option<String>,
    pub server_password: Option<String>,
    pub server_password_file: Option<String>,
    pub server_password_env: Option<String>,
    pub mode: Option<String>,
    pub route: Option<String>,
    pub consistency: Option<String>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct RawAuth {
    pub query: Option<String>,
    pub user: Option<String>,
    pub password: Option<String>,
    pub password_file: Option<String>,
    pub password_env: Option<String>,
    pub database: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawHba {
    #[serde(default = "default_hba_type", rename = "type")]
    pub conn_type: String,
    #[serde(default = "all")]
    pub databases: Vec<String>,
    #[serde(default = "all")]
    pub users: Vec<String>,
    #[serde(default = "all_address")]
    pub address: String,
    pub method: String,
}

fn default_hba_type() -> String {
    "host".to_owned()
}
fn all() -> Vec<String> {
    vec!["all".to_owned()]
}
fn all_address() -> String {
    "all".to_owned()
}
