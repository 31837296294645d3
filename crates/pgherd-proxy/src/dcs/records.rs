//! What each instance says of itself in etcd: its record (addresses, pid, the leader's view it
//! routes by) on its lease, and its member key on no lease (the lease of its latest session,
//! whether that session routes by a view, its failsafe), from which the leader tells which
//! instances may still route writes in failsafe (`agreement::Sightings`).

use etcd_client::{Client, Compare, CompareOp, GetOptions, PutOptions, Txn, TxnOp, TxnOpResponse};
use pgherd_failover::agreement;

use super::{Dcs, DcsError};
use crate::app::App;

/// What an instance says of itself in etcd (on its lease: it is gone once the lease is).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct InstanceRecord {
    pub instance: String,
    pub listen: Vec<String>,
    pub api: Vec<String>,
    pub pid: u32,
    /// The leader's view it routes by (the lease it was written with, and its version):
    /// before a promotion the leader waits until every instance with a lease routes by its
    /// current one.
    #[serde(default)]
    pub view_lease: i64,
    #[serde(default)]
    pub version: u64,
}

/// The instances registered under `/<scope>/instances/` (each with the lease it is on) and
/// the members under `/<scope>/members/`, read at one revision.
pub(super) struct Listed {
    pub(super) records: Vec<(InstanceRecord, i64)>,
    members: Vec<MemberValue>,
}

/// A member key: the instance, the lease of its latest session, whether that session routes
/// by a view, and its failsafe. Its value is "<lease> <view lease> <view version> <failsafe
/// ms>" ("0 0" for the view before it routes by one).
#[derive(Debug, Clone, PartialEq, Eq)]
struct MemberValue {
    instance: String,
    session: i64,
    routed: bool,
    failsafe_ms: u64,
}

impl MemberValue {
    fn text(lease: i64, (view_lease, version): (i64, u64), failsafe_ms: u64) -> String {
        format!("{lease} {view_lease} {version} {failsafe_ms}")
    }

    /// (session, routed, failsafe) from a value; `None` if it is not one.
    fn parse(value: &str) -> Option<MemberValue> {
        let mut parts = value.split(' ');
        let mut next = || parts.next().and_then(|p| p.parse::<i64>().ok());
        let (session, view_lease, _version, failsafe_ms) = (next()?, next()?, next()?, next()?);
        Some(MemberValue {
            instance: String::new(),
            session,
            routed: view_lease != 0,
            failsafe_ms: u64::try_from(failsafe_ms).ok()?,
        })
    }
}

impl Listed {
    pub(super) fn of(
        dcs: &Dcs,
        records: Option<etcd_client::GetResponse>,
        members: Option<etcd_client::GetResponse>,
    ) -> Listed {
        let members_prefix = dcs.key("members/");
        Listed {
            records: records.map_or_else(Vec::new, |g| {
                g.kvs()
                    .iter()
                    .map(|kv| (record_of(dcs, kv), kv.lease()))
                    .collect()
            }),
            members: members.map_or_else(Vec::new, |g| {
                g.kvs()
                    .iter()
                    .filter_map(|kv| {
                        let instance = kv.key_str().ok()?.strip_prefix(&members_prefix)?;
                        // One this version cannot read (another version's) is taken for a
                        // session that routed, with this instance's failsafe.
                        let member = kv.value_str().ok().and_then(MemberValue::parse).unwrap_or(
                            MemberValue {
                                instance: String::new(),
                                session: -kv.mod_revision(),
                                routed: true,
                                failsafe_ms: dcs.configured_failsafe_ms(),
                            },
                        );
                        Some(MemberValue {
                            instance: instance.to_owned(),
                            ..member
                        })
                    })
                    .collect()
            }),
        }
    }
}

/// An instance's record; one this version cannot read (another version's) is taken for an
/// instance that routes by no view the leader knows, so the leader waits for it.
fn record_of(dcs: &Dcs, kv: &etcd_client::KeyValue) -> InstanceRecord {
    serde_json::from_slice(kv.value()).unwrap_or_else(|_| InstanceRecord {
        instance: kv
            .key_str()
            .ok()
            .and_then(|k| k.strip_prefix(&dcs.key("instances/")))
            .unwrap_or("")
            .to_owned(),
        listen: Vec::new(),
        api: Vec::new(),
        pid: 0,
        view_lease: 0,
        version: 0,
    })
}

pub(super) async fn list_instances(dcs: &Dcs, client: &mut Client) -> Result<Listed, DcsError> {
    let txn = Txn::new().and_then(listing_reads(dcs).to_vec());
    let response = dcs.within(client.txn(txn)).await?;
    let mut answers = gets(response);
    Ok(Listed::of(dcs, answers.next(), answers.next()))
}

/// The reads of a listing (records, then members), for a transaction; [`Listed::of`] takes
/// their answers.
pub(super) fn listing_reads(dcs: &Dcs) -> [TxnOp; 2] {
    let prefix = |name: &str| TxnOp::get(dcs.key(name), Some(GetOptions::new().with_prefix()));
    [prefix("instances/"), prefix("members/")]
}

/// A transaction's answers to its reads, in order.
pub(super) fn gets(
    response: etcd_client::TxnResponse,
) -> impl Iterator<Item = etcd_client::GetResponse> {
    response
        .op_responses()
        .into_iter()
        .filter_map(|answer| match answer {
            TxnOpResponse::Get(get) => Some(get),
            _ => None,
        })
}

/// Puts this instance's record (addresses, pid) on its lease, for `pgherd status`.
pub(super) async fn register(
    app: &App,
    dcs: &Dcs,
    client: &mut Client,
    lease: i64,
    (view_lease, version): (i64, u64),
) -> Result<(), DcsError> {
    let config = app.config();
    let record = InstanceRecord {
        instance: dcs.instance.clone(),
        listen: config
            .proxy
            .listen
            .iter()
            .map(ToString::to_string)
            .collect(),
        api: config.api.listen.iter().map(ToString::to_string).collect(),
        pid: std::process::id(),
        view_lease,
        version,
    };
    let record = serde_json::to_string(&record).map_err(|e| DcsError::BadView(e.to_string()))?;
    // The member key with it, on no lease: once the lease is gone the leader still knows this
    // session may route writes in failsafe for a while.
    let txn = Txn::new().and_then(vec![
        TxnOp::put(
            dcs.key(&format!("instances/{}", dcs.instance)),
            record,
            Some(PutOptions::new().with_lease(lease)),
        ),
        TxnOp::put(
            dcs.key(&format!("members/{}", dcs.instance)),
            MemberValue::text(lease, (view_lease, version), dcs.configured_failsafe_ms()),
            None,
        ),
    ]);
    dcs.within(client.txn(txn)).await?;
    Ok(())
}

impl Dcs {
    /// Notes which members have a record, as a read that has just come back found them.
    pub(super) fn sighted(&self, listed: &Listed) {
        let members = listed.members.iter().map(|member| agreement::Member {
            instance: &member.instance,
            session: member.session,
            routed: member.routed,
            failsafe_ms: member.failsafe_ms,
            // Its record on that very lease: another process under the same name (a
            // copied config) does not hide this one.
            live: listed
                .records
                .iter()
                .any(|(r, lease)| r.instance == member.instance && *lease == member.session),
        });
        self.sightings.lock().read(self.now_ms(), members);
    }

    /// Removes the member keys of instances whose failsafe is over (each only if it still
    /// names the session that ended).
    pub(super) async fn forget_members(&self, client: &mut Client) -> Result<(), DcsError> {
        let forgettable = self.sightings.lock().forgettable(self.now_ms());
        for (instance, session) in forgettable {
            let key = self.key(&format!("members/{instance}"));
            let answer = self.within(client.get(key.clone(), None)).await?;
            let Some(kv) = answer.kvs().first() else {
                continue;
            };
            let value = kv.value_str().unwrap_or("");
            if MemberValue::parse(value).map(|m| m.session) != Some(session) {
                continue;
            }
            // Only if untouched since: a new run of the instance keeps its own.
            let txn = Txn::new()
                .when(vec![Compare::mod_revision(
                    key.clone(),
                    CompareOp::Equal,
                    kv.mod_revision(),
                )])
                .and_then(vec![TxnOp::delete(key, None)]);
            self.within(client.txn(txn)).await?;
        }
        Ok(())
    }
}
