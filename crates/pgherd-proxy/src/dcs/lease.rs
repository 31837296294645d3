//! The lease of a session with etcd: kept from the last session while etcd still has it,
//! renewed on one keep-alive stream, and its expiry counted from when each renewal was sent.

use std::time::{Duration, Instant};

use etcd_client::{Client, LeaseKeepAliveStream, LeaseKeeper};

use super::{Dcs, DcsError};

/// A lease kept alive by one session.
pub(super) struct LiveLease {
    pub(super) id: i64,
    /// The last session's lease, kept: its record and any leader key are still on it.
    pub(super) kept: bool,
    keeper: LeaseKeeper,
    renewals: LeaseKeepAliveStream,
    /// When etcd lets the lease expire unless it is renewed: counted from when the last
    /// renewal was sent, which is before etcd got it.
    pub(super) until: Instant,
}

impl LiveLease {
    /// Starts keeping lease `id` alive. Opening the stream renews the lease once (etcd-client
    /// reads that answer itself and fails if the lease is gone), so every later answer on it
    /// is the one to the renewal just sent.
    async fn start(dcs: &Dcs, client: &mut Client, id: i64) -> Result<LiveLease, DcsError> {
        let sent = Instant::now();
        let (keeper, renewals) = match dcs.within(client.lease_keep_alive(id)).await {
            Err(DcsError::Etcd(etcd_client::Error::LeaseKeepAliveError(_))) => {
                return Err(DcsError::LeaseExpired)
            }
            opened => opened?,
        };
        Ok(LiveLease {
            id,
            kept: false,
            keeper,
            renewals,
            until: sent + Duration::from_secs(dcs.settings.lease_ttl_s),
        })
    }

    pub(super) async fn renew(&mut self, dcs: &Dcs) -> Result<(), DcsError> {
        let sent = Instant::now();
        dcs.within(self.keeper.keep_alive()).await?;
        self.until = sent + renewal_ttl(dcs, &mut self.renewals).await?;
        Ok(())
    }
}

/// The TTL the next answer on the keep-alive stream grants; an error if the lease is gone.
async fn renewal_ttl(dcs: &Dcs, renewals: &mut LeaseKeepAliveStream) -> Result<Duration, DcsError> {
    let answer = dcs
        .within(renewals.message())
        .await?
        .ok_or(DcsError::KeepAliveClosed)?;
    match u64::try_from(answer.ttl()) {
        Ok(ttl) if ttl > 0 => Ok(Duration::from_secs(ttl)),
        _ => Err(DcsError::LeaseExpired),
    }
}

/// The lease of a new session: the last session's while etcd still has it (the leader key
/// and the instance's record stay on it), else a new one.
pub(super) async fn open_lease(dcs: &Dcs, client: &mut Client) -> Result<LiveLease, DcsError> {
    let last = dcs.status.lock().lease;
    if let Some(id) = last {
        match LiveLease::start(dcs, client, id).await {
            Err(DcsError::LeaseExpired) => {}
            Ok(live) => return Ok(LiveLease { kept: true, ..live }),
            Err(e) => return Err(e),
        }
    }
    let ttl = dcs.settings.lease_ttl_s as i64;
    let id = dcs.within(client.lease_grant(ttl, None)).await?.id();
    dcs.status.lock().lease = Some(id);
    LiveLease::start(dcs, client, id).await
}
