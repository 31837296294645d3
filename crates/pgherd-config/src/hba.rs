//! Host-based access rules: which authentication method a connection gets, first match wins,
//! as in pg_hba.conf. Pure matching, no IO.

use std::net::IpAddr;

use ipnet::IpNet;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuthMethod {
    ScramSha256,
    /// md5, upgraded to SCRAM when the user only has a SCRAM verifier (as PostgreSQL does).
    Md5,
    Trust,
    /// TLS client certificate whose common name is the user name.
    Cert,
    Reject,
}

impl AuthMethod {
    pub fn parse(s: &str) -> Option<AuthMethod> {
        Some(match s {
            "scram-sha-256" => AuthMethod::ScramSha256,
            "md5" => AuthMethod::Md5,
            "trust" => AuthMethod::Trust,
            "cert" => AuthMethod::Cert,
            "reject" => AuthMethod::Reject,
            _ => return None,
        })
    }

    pub fn as_str(&self) -> &'static str {
        match self {
            AuthMethod::ScramSha256 => "scram-sha-256",
            AuthMethod::Md5 => "md5",
            AuthMethod::Trust => "trust",
            AuthMethod::Cert => "cert",
            AuthMethod::Reject => "reject",
        }
    }
}

/// Which transports a rule covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnectionType {
    /// `host`: TLS or not.
    Any,
    /// `hostssl`: TLS only.
    Tls,
    /// `hostnossl`: plain TCP only.
    Plain,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NameMatch {
    All,
    Names(Vec<String>),
}

impl NameMatch {
    fn matches(&self, name: &str) -> bool {
        match self {
            NameMatch::All => true,
            NameMatch::Names(names) => names.iter().any(|n| n == name),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HbaRule {
    pub connection: ConnectionType,
    pub databases: NameMatch,
    pub users: NameMatch,
    /// `None` matches every address.
    pub address: Option<IpNet>,
    pub method: AuthMethod,
}

/// What is known about a connection when its rule is chosen.
#[derive(Debug, Clone, Copy)]
pub struct ConnectionFacts<'a> {
    pub address: IpAddr,
    pub tls: bool,
    pub user: &'a str,
    pub database: &'a str,
}

impl HbaRule {
    pub fn matches(&self, facts: &ConnectionFacts<'_>) -> bool {
        let transport = match self.connection {
            ConnectionType::Any => true,
            ConnectionType::Tls => facts.tls,
            ConnectionType::Plain => !facts.tls,
        };
        transport
            && self.databases.matches(facts.database)
            && self.users.matches(facts.user)
            && self
                .address
                .is_none_or(|net| net.contains(&canonical(facts.address)))
    }
}

/// IPv4 clients on a dual-stack socket appear as `::ffff:a.b.c.d`; rules are written in IPv4.
fn canonical(addr: IpAddr) -> IpAddr {
    match addr {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(addr, IpAddr::V4),
        v4 => v4,
    }
}

/// The method of the first rule that matches, with the rule's index; `None` means no rule
/// matched and the connection must be refused.
pub fn choose_method(
    rules: &[HbaRule],
    facts: &ConnectionFacts<'_>,
) -> Option<(usize, AuthMethod)> {
    rules
        .iter()
        .enumerate()
        .find(|(_, r)| r.matches(facts))
        .map(|(i, r)| (i, r.method))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(
        conn: ConnectionType,
        db: &[&str],
        user: &[&str],
        addr: Option<&str>,
        method: AuthMethod,
    ) -> HbaRule {
        let names = |v: &[&str]| {
            if v == ["all"] {
                NameMatch::All
            } else {
                NameMatch::Names(v.iter().map(|s| s.to_string()).collect())
            }
        };
        HbaRule {
            connection: conn,
            databases: names(db),
            users: names(user),
            address: addr.map(|a| a.parse().unwrap()),
            method,
        }
    }

    fn check(rules: &[HbaRule], addr: &str, tls: bool, user: &str, db: &str) -> Option<AuthMethod> {
        let facts = ConnectionFacts {
            address: addr.parse().unwrap(),
            tls,
            user,
            database: db,
        };
        choose_method(rules, &facts).map(|(_, m)| m)
    }

    #[test]
    fn first_match_wins() {
        let rules = [
            rule(
                ConnectionType::Any,
                &["all"],
                &["mallory"],
                None,
                AuthMethod::Reject,
            ),
            rule(
                ConnectionType::Tls,
                &["all"],
                &["all"],
                None,
                AuthMethod::Cert,
            ),
            rule(
                ConnectionType::Any,
                &["app"],
                &["all"],
                Some("10.0.0.0/8"),
                AuthMethod::Md5,
            ),
            rule(
                ConnectionType::Plain,
                &["all"],
                &["all"],
                Some("127.0.0.1/32"),
                AuthMethod::Trust,
            ),
        ];
        assert_eq!(
            check(&rules, "127.0.0.1", false, "mallory", "app"),
            Some(AuthMethod::Reject)
        );
        assert_eq!(
            check(&rules, "10.1.2.3", true, "alice", "app"),
            Some(AuthMethod::Cert)
        );
        assert_eq!(
            check(&rules, "10.1.2.3", false, "alice", "app"),
            Some(AuthMethod::Md5)
        );
        assert_eq!(check(&rules, "10.1.2.3", false, "alice", "other"), None);
        assert_eq!(
            check(&rules, "127.0.0.1", false, "alice", "other"),
            Some(AuthMethod::Trust)
        );
        assert_eq!(
            check(&rules, "::ffff:127.0.0.1", false, "alice", "other"),
            Some(AuthMethod::Trust)
        );
        assert_eq!(check(&rules, "::1", false, "alice", "other"), None);
    }
}
