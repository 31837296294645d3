//! The simulation's instances agreeing through the modelled etcd, as the proxy's `dcs`
//! session and `failover::agreed` do, by `pgherd_failover::agreement`: faults of instances and
//! etcd, each instance's session turn, its lease's write gate, and the recording of a view
//! before an IO.

use pgherd_failover::agreement::{self, Adoption, LeaderKey, Member, Promotion, WriteLease};
use pgherd_failover::control::Io;
use pgherd_failover::{Change, ClusterState};
use rand::Rng;

use super::instance::Instance;
use crate::{describe, Sim, REQUEST_TIMEOUT_MS, TICK_MS};

impl Sim {
    /// Instance crashes and restarts, stalls, links to etcd lost and back, etcd down and up.
    pub(crate) fn instance_faults(&mut self, tick: usize, now_ms: u64) {
        let Some(dcs) = &mut self.dcs else { return };
        let nodes = self.cluster.len();
        for k in 0..self.instances.len() {
            let roll: f64 = self.rng.gen();
            let instance = &mut self.instances[k];
            match roll {
                r if r < 0.01 && instance.alive => {
                    instance.alive = false;
                    self.trace
                        .push(format!("tick {tick}: {} crashes", instance.name));
                }
                r if r < 0.06 && !instance.alive => {
                    *instance = Instance::start(instance.name.clone(), nodes, true);
                    self.trace
                        .push(format!("tick {tick}: {} starts again", instance.name));
                }
                r if r < 0.075 && instance.runs(tick) => {
                    let ticks = self
                        .rng
                        .gen_range(1..=(3 * dcs.lease_ttl_ms / TICK_MS) as usize);
                    instance.stalled_until = tick + ticks;
                    self.trace.push(format!(
                        "tick {tick}: {} stops for {ticks} s",
                        instance.name
                    ));
                }
                r if r < 0.085 => {
                    let node = self.rng.gen_range(0..nodes);
                    instance.cut_from_node[node] = !instance.cut_from_node[node];
                }
                r if r < 0.095 => instance.cut_from_etcd = true,
                r if r < 0.2 => instance.cut_from_etcd = false,
                _ => {}
            }
        }
        let roll: f64 = self.rng.gen();
        if dcs.etcd.up && roll < 0.01 {
            dcs.etcd.up = false;
            self.trace.push(format!("tick {tick}: etcd down"));
        } else if !dcs.etcd.up && roll < 0.15 {
            dcs.etcd.restart(now_ms, dcs.lease_ttl_ms);
            self.trace.push(format!("tick {tick}: etcd back"));
        }
    }

    /// One turn of instance `k`'s etcd session (`pgherd_proxy::dcs::session`): renew the lease
    /// (the last one while etcd has it, else a new one), campaign, adopt or publish the view.
    /// Out of reach, nothing changes: the instance keeps what it knew.
    pub(crate) fn dcs_turn(&mut self, k: usize, now_ms: u64) {
        let Some(dcs) = &mut self.dcs else { return };
        let instance = &mut self.instances[k];
        if !dcs.etcd.up || instance.cut_from_etcd {
            return;
        }
        let etcd = &mut dcs.etcd;
        etcd.expire(now_ms);
        let lease = match instance.lease {
            Some(lease) if etcd.renew(lease, now_ms, dcs.lease_ttl_ms) => lease,
            _ => {
                // As the proxy: a new lease has no record a leader waits for; the instance
                // routes no writes until it has one and has read the view.
                let lease = etcd.grant(now_ms, dcs.lease_ttl_ms);
                instance.change(Change::AwaitView(true));
                etcd.register(&instance.name, lease, (0, 0), dcs.failsafe_ms[k]);
                instance.routed = (0, 0);
                lease
            }
        };
        instance.lease = Some(lease);
        instance.lease_until_ms = now_ms + dcs.lease_ttl_ms;
        if etcd.campaign(&instance.name, lease) {
            self.stats.leaderships += 1;
            self.trace
                .push(format!("  {} leads (lease {lease})", instance.name));
        }
        // The campaign's transaction reads the instances' records too.
        read_records(instance, etcd, now_ms);
        let key = etcd.leader.as_ref().map(|(instance, lease)| LeaderKey {
            instance,
            lease: *lease,
        });
        let leadership = agreement::leadership(&instance.name, lease, key);
        instance.leading_until_ms = agreement::leading_until_ms(
            leadership.leading,
            instance.lease_until_ms,
            REQUEST_TIMEOUT_MS,
        );
        instance.leading = leadership.leading;
        self.follow(k);
        if leadership.leading {
            if let Some(dcs) = &mut self.dcs {
                let instance = &self.instances[k];
                dcs.etcd.publish(&instance.name, lease, &instance.state);
                // Members whose failsafe is over go (as the proxy's leader does).
                for (name, session) in instance.sightings.forgettable(now_ms) {
                    dcs.etcd.forget(&name, session);
                }
            }
        }
    }

    /// Instance `k`, in touch with etcd, reads the shared view and adopts it unless it wrote it
    /// itself, and puts its record (the version of the leader's view it routes by) on its
    /// lease.
    pub(crate) fn follow(&mut self, k: usize) {
        let Some(dcs) = &mut self.dcs else { return };
        let instance = &mut self.instances[k];
        let Some(lease) = instance.lease else { return };
        if let Some(view) = &dcs.etcd.view {
            let (by, with) = (&view.written_by, view.lease);
            let state = Box::new(view.state.clone());
            let before = instance.state.version;
            match agreement::adoption(&instance.name, lease, instance.leading, by, with) {
                Adoption::Keep => {}
                Adoption::Follow => instance.change(Change::Follow(state)),
                Adoption::TakeOver => instance.change(Change::Adopt(state)),
            }
            if instance.state.version != before {
                self.trace.push(format!(
                    "  {} adopts {}'s view: {}",
                    instance.name,
                    by,
                    describe(&instance.state)
                ));
            }
            instance.routed = (view.lease, view.state.version);
        }
        if instance.leading {
            // As the proxy's record: a leader routes by its own view.
            instance.routed = (lease, instance.state.version);
        }
        let routed = instance.routed;
        dcs.etcd
            .register(&instance.name, lease, routed, dcs.failsafe_ms[k]);
        // Writes flow once the record says which view the instance routes by.
        if instance.state.awaiting_view && routed.0 != 0 {
            instance.change(Change::AwaitView(false));
        }
    }

    /// Where instance `k` stands for routing writes (`pgherd_proxy::dcs::Dcs::write_lease`).
    fn write_lease(&self, k: usize, now_ms: u64) -> Option<WriteLease> {
        let dcs = self.dcs.as_ref()?;
        let instance = &self.instances[k];
        Some(agreement::write_lease(
            instance.lease.map(|_| instance.lease_until_ms),
            REQUEST_TIMEOUT_MS,
            dcs.failsafe_ms[k],
            now_ms,
        ))
    }

    /// The write gate's lease reason on instance `k` (`pgherd_proxy::dcs`): writes are refused
    /// once its lease and failsafe may have run out.
    pub(crate) fn lease_gate(&mut self, k: usize, now_ms: u64) {
        let Some(lease) = self.write_lease(k, now_ms) else {
            return;
        };
        let lapsed = !lease.may_route_writes();
        let instance = &mut self.instances[k];
        if lapsed != instance.state.lease_lapsed {
            instance.change(Change::LeaseLapsed(lapsed));
        }
    }

    /// Whether instance `k` routes writes past its lease now.
    pub(crate) fn in_failsafe(&self, k: usize, now_ms: u64) -> bool {
        matches!(
            self.write_lease(k, now_ms),
            Some(WriteLease::Failsafe { .. })
        )
    }

    /// Whether instance `k` may act for the cluster now (always, alone).
    pub(crate) fn may_act(&self, k: usize, now_ms: u64) -> bool {
        self.dcs.is_none() || agreement::may_act(self.instances[k].leading_until_ms, now_ms)
    }

    /// The proxy's `failover::agreed`: with several instances, the view is in etcd before an
    /// IO on a node runs, written only by the instance that still leads; before a promotion,
    /// every other instance with a lease routes by it.
    pub(crate) fn agreed(&mut self, k: usize, io: &Io, now_ms: u64) -> Result<(), String> {
        if matches!(io, Io::CutOff { .. }) || self.dcs.is_none() {
            return Ok(());
        }
        let state = self.instances[k].state.clone();
        self.recorded(k, &state, now_ms)?;
        if let Io::Promote { .. } = io {
            // The proxy waits here (a while) for the others to take this view: those in touch
            // with etcd do, at their next read.
            for j in (0..self.instances.len()).filter(|&j| j != k) {
                let other = &self.instances[j];
                let in_touch = other.runs((now_ms / TICK_MS) as usize) && !other.cut_from_etcd;
                if in_touch {
                    self.follow(j);
                }
            }
            let Some(dcs) = &mut self.dcs else {
                return Ok(());
            };
            let instance = &mut self.instances[k];
            read_records(instance, &dcs.etcd, now_ms);
            let lease = instance.lease.unwrap_or(0);
            let lagging = dcs.etcd.lagging(&instance.name, lease, state.version);
            let failsafe_over_at_ms = instance.sightings.failsafe_over_at_ms();
            match agreement::may_promote(lagging, failsafe_over_at_ms, now_ms) {
                Promotion::Go => {}
                Promotion::Lagging(lagging) => {
                    self.stats.waited_for_lagging += 1;
                    return Err(format!(
                        "{lagging} instance(s) with a lease do not route by this view yet"
                    ));
                }
                Promotion::Failsafe { until_ms } => {
                    self.stats.waited_for_failsafe += 1;
                    return Err(format!(
                        "an instance that vanished may route writes in failsafe until {until_ms} ms"
                    ));
                }
            }
        }
        Ok(())
    }

    /// The proxy's `failover::recorded`: instance `k` still leads, and `state` is the view in
    /// etcd.
    pub(crate) fn recorded(
        &mut self,
        k: usize,
        state: &ClusterState,
        now_ms: u64,
    ) -> Result<(), String> {
        let refused = |sim: &mut Sim, why: &str| {
            sim.stats.refused_without_lease += 1;
            Err(format!("{} {why}", sim.instances[k].name))
        };
        if !self.may_act(k, now_ms) {
            return refused(self, "does not lead the cluster any more");
        }
        let Some(dcs) = &mut self.dcs else {
            return Ok(());
        };
        let instance = &self.instances[k];
        if !dcs.etcd.up || instance.cut_from_etcd {
            return refused(self, "cannot reach etcd");
        }
        dcs.etcd.expire(now_ms);
        let lease = instance.lease.unwrap_or(0);
        if !dcs.etcd.publish(&instance.name, lease, state) {
            return refused(self, "does not hold the leader key");
        }
        Ok(())
    }
}

/// The members and their records as `instance` reads them (`pgherd_proxy::dcs`: in the
/// campaign's transaction, and before a promotion).
fn read_records(instance: &mut Instance, etcd: &super::etcd::Etcd, now_ms: u64) {
    let members = etcd
        .members
        .iter()
        .map(|(name, &(session, routed, failsafe_ms))| Member {
            instance: name,
            session,
            routed,
            failsafe_ms,
            live: etcd.records.contains_key(name),
        });
    instance.sightings.read(now_ms, members);
}
