//! `[dcs]`: the etcd cluster several pgherd instances agree through (leader lease, the shared
//! cluster view). Absent: one instance, as before.

use std::path::PathBuf;

use serde::Deserialize;

use crate::validate::{field_path, Checker, Seg};
use crate::ConfigError;

/// Where and how the instances of one cluster agree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DcsSettings {
    /// etcd client URLs (`http://host:port`).
    pub endpoints: Vec<String>,
    /// Key prefix shared by the instances of one cluster: `/<scope>/leader`, `/<scope>/view`,
    /// `/<scope>/instances/<name>`.
    pub scope: String,
    /// This instance's name among them; `None`: the host name and the first listen port.
    pub instance: Option<String>,
    /// The leader lease: a leader that cannot renew it stops acting before it expires, and
    /// another instance takes over after it expired.
    pub lease_ttl_s: u64,
    /// How long one request to etcd may take.
    pub request_timeout_ms: u64,
    /// How long past its lease an instance cut off from etcd goes on routing writes to the
    /// primary of the last view it read (while that answers and is not fenced); a leader
    /// waits that long after an instance vanished before it promotes. 0: writes stop with the
    /// lease.
    pub failsafe_s: u64,
    /// Run (through `sh -c`) when this instance becomes the leader or stops being it, with
    /// `PGHERD_ROLE` (`leader`, `follower`) and `PGHERD_INSTANCE`: to move a virtual IP.
    pub on_role_change: Option<String>,
    /// TLS to etcd (`https://` endpoints).
    pub tls: Option<DcsTls>,
    /// An etcd user and its password (etcd with authentication enabled).
    pub user: Option<(String, String)>,
}

/// How pgherd checks etcd's certificate, and the certificate it shows etcd (for etcd's
/// `--client-cert-auth`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DcsTls {
    pub ca_file: PathBuf,
    /// (certificate, key) files.
    pub identity: Option<(PathBuf, PathBuf)>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawDcs {
    #[serde(default)]
    pub endpoints: Vec<String>,
    #[serde(default = "default_scope")]
    pub scope: String,
    pub instance: Option<String>,
    #[serde(default = "default_lease_ttl_s")]
    pub lease_ttl_s: u64,
    #[serde(default = "default_request_timeout_ms")]
    pub request_timeout_ms: u64,
    /// Absent: as long as the lease.
    pub failsafe_s: Option<u64>,
    pub on_role_change: Option<String>,
    pub ca_file: Option<String>,
    pub cert_file: Option<String>,
    pub key_file: Option<String>,
    pub username: Option<String>,
    pub password: Option<String>,
    pub password_file: Option<String>,
    pub password_env: Option<String>,
}

fn default_scope() -> String {
    "pgherd".to_owned()
}
fn default_lease_ttl_s() -> u64 {
    10
}
fn default_request_timeout_ms() -> u64 {
    2_000
}

/// Names that are safe in an etcd key and a log line.
fn is_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 64
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':'))
}

pub(crate) fn dcs(
    c: &Checker<'_>,
    raw: Option<&RawDcs>,
) -> Result<Option<DcsSettings>, ConfigError> {
    let Some(raw) = raw else {
        return Ok(None);
    };
    if raw.endpoints.is_empty() {
        return Err(c.error(
            &field_path!["dcs", "endpoints"],
            "name at least one etcd endpoint, e.g. [\"http://127.0.0.1:2379\"]",
        ));
    }
    // With `ca_file`, etcd is reached over TLS: endpoints are https.
    let scheme = if raw.ca_file.is_some() {
        "https"
    } else {
        "http"
    };
    let mut endpoints = Vec::new();
    for (i, endpoint) in raw.endpoints.iter().enumerate() {
        let url = if endpoint.contains("://") {
            endpoint.clone()
        } else {
            format!("{scheme}://{endpoint}")
        };
        let host_port = url.split_once("://").map_or("", |(_, rest)| rest);
        if !url.starts_with(&format!("{scheme}://"))
            || host_port
                .rsplit_once(':')
                .is_none_or(|(h, p)| h.is_empty() || p.parse::<u16>().is_err())
        {
            return Err(c.error(
                &field_path!["dcs", "endpoints", i],
                match scheme {
                    "https" => format!("{endpoint:?} is not an etcd client URL over TLS, e.g. \"https://127.0.0.1:2379\" (ca_file is set)"),
                    _ => format!("{endpoint:?} is not an etcd client URL, e.g. \"http://127.0.0.1:2379\" (for https, set ca_file)"),
                },
            ));
        }
        endpoints.push(url);
    }
    let tls = dcs_tls(c, raw)?;
    let password = c.secret(
        &field_path!["dcs"],
        "password",
        [&raw.password, &raw.password_file, &raw.password_env],
    )?;
    let user = together(
        c,
        (
            raw.username.clone(),
            "username",
            "needs a password (password, password_file or password_env)",
        ),
        (
            password,
            "password",
            "needs username, the etcd user it is the password of",
        ),
    )?;
    if !is_name(&raw.scope) || raw.scope.contains(':') {
        return Err(c.error(
            &field_path!["dcs", "scope"],
            "letters, digits, '-', '_' and '.' only, at most 64",
        ));
    }
    if let Some(instance) = raw.instance.as_deref().filter(|i| !is_name(i)) {
        return Err(c.error(
            &field_path!["dcs", "instance"],
            format!("{instance:?}: letters, digits, '-', '_', '.' and ':' only, at most 64"),
        ));
    }
    if !(2..=300).contains(&raw.lease_ttl_s) {
        return Err(c.error(
            &field_path!["dcs", "lease_ttl_s"],
            "between 2 and 300 seconds",
        ));
    }
    // At least 100 ms: an instance closes its write gate that long before etcd can let its
    // lease go, and checks every 50 ms.
    if raw.request_timeout_ms < 100 || raw.request_timeout_ms >= raw.lease_ttl_s * 1000 / 3 {
        return Err(c.error(
            &field_path!["dcs", "request_timeout_ms"],
            format!(
                "at least 100 ms and below a third of the lease ({} ms), so a leader renews its lease in time",
                raw.lease_ttl_s * 1000 / 3
            ),
        ));
    }
    let failsafe_s = raw.failsafe_s.unwrap_or(raw.lease_ttl_s);
    if failsafe_s > 3600 {
        return Err(c.error(
            &field_path!["dcs", "failsafe_s"],
            "at most 3600 seconds (a failover waits that long after an instance vanished)",
        ));
    }
    Ok(Some(DcsSettings {
        endpoints,
        scope: raw.scope.clone(),
        instance: raw.instance.clone(),
        lease_ttl_s: raw.lease_ttl_s,
        request_timeout_ms: raw.request_timeout_ms,
        failsafe_s,
        on_role_change: raw.on_role_change.clone(),
        tls,
        user,
    }))
}

/// `ca_file`, and `cert_file` with `key_file` (both or neither, and only with `ca_file`).
fn dcs_tls(c: &Checker<'_>, raw: &RawDcs) -> Result<Option<DcsTls>, ConfigError> {
    let identity = together(
        c,
        (
            raw.cert_file.as_deref().map(|f| c.file_path(f)),
            "cert_file",
            "needs key_file, the certificate's private key",
        ),
        (
            raw.key_file.as_deref().map(|f| c.file_path(f)),
            "key_file",
            "needs cert_file, the certificate it is the key of",
        ),
    )?;
    match (&raw.ca_file, identity) {
        (Some(ca), identity) => Ok(Some(DcsTls {
            ca_file: c.file_path(ca),
            identity,
        })),
        (None, None) => Ok(None),
        (None, Some(_)) => Err(c.error(
            &field_path!["dcs", "cert_file"],
            "a client certificate needs TLS to etcd: set ca_file, the CA that signed etcd's certificate",
        )),
    }
}

/// Two `[dcs]` settings that go together: both, or neither. Each comes with its field name and
/// what to say when it is given without the other.
fn together<A, B>(
    c: &Checker<'_>,
    (a, a_field, a_alone): (Option<A>, &str, &str),
    (b, b_field, b_alone): (Option<B>, &str, &str),
) -> Result<Option<(A, B)>, ConfigError> {
    match (a, b) {
        (Some(a), Some(b)) => Ok(Some((a, b))),
        (None, None) => Ok(None),
        (Some(_), None) => Err(c.error(&field_path!["dcs", a_field], a_alone)),
        (None, Some(_)) => Err(c.error(&field_path!["dcs", b_field], b_alone)),
    }
}
