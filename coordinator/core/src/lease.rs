//! The lease table: which job may use which GPUs of which node, until when, under which
//! fencing epoch.
//!
//! Epochs come from one counter that only goes up, so a lease granted later always carries a
//! higher epoch than every lease before it; agents refuse a lease older than one they have
//! honoured on the same GPU.
//!
//! The table keeps two indexes beside the leases themselves, so that the hot paths cost what
//! one node holds, not what the whole cluster holds: the leases of each node (renewal on a
//! heartbeat, the free GPUs of a node) and the leases by expiry (what expired, the next
//! deadline).
//!
//! Beside the leases it keeps the *stragglers*: leases that expired because their node went
//! silent, whose container may still be running there until the node's fail-safe has stopped
//! it. Their job is not started elsewhere meanwhile ([`crate::Core`] holds it in the queue).

use std::collections::{BTreeMap, BTreeSet};

use nightshift_common::UnixMillis;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    pub id: u64,
    pub epoch: u64,
    pub job: u64,
    /// The node's rank in its job's gang (0 for a single-node job).
    pub rank: u32,
    pub node: String,
    pub gpus: Vec<u32>,
    pub granted_at: UnixMillis,
    pub expires_at: UnixMillis,
    /// Taken back by the coordinator: the agent must stop the job. The lease still owns its
    /// GPUs until the agent reports the container gone.
    pub revoked: bool,
    /// The node's desired-state version that first listed this lease.
    pub granted_version: u64,
    /// Its agent has reported the member able to start (its image on the host) or started:
    /// a gang's members are told to start once all of theirs are. Once true it stays so.
    /// Not persisted: after a restart the agents' next reports tell again.
    pub ready: bool,
}

/// An expired lease of a silent node whose container may still run: until `until` (the
/// bound the agent's fail-safe keeps, or the operator's `restart_elsewhere_after_s`), or
/// until the node reports the container gone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Straggler {
    pub lease: u64,
    pub epoch: u64,
    pub job: u64,
    pub node: String,
    /// No other attempt of the job starts before this.
    pub until: UnixMillis,
    /// The node's desired-state version that no longer lists the lease: a report from an
    /// agent that has applied it lists every container it still has.
    pub released_version: u64,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct LeaseTable {
    leases: BTreeMap<u64, Lease>,
    /// Lease ids by node.
    by_node: BTreeMap<String, BTreeSet<u64>>,
    /// `(expires_at, id)` of every lease.
    by_expiry: BTreeSet<(UnixMillis, u64)>,
    next_id: u64,
    next_epoch: u64,
    /// Stragglers by `(node, lease id)`. Not persisted: after a restart only their time bound
    /// (the job's `not_before`) holds their jobs back.
    stragglers: BTreeMap<(String, u64), Straggler>,
}

impl LeaseTable {
    pub(crate) fn restore(leases: Vec<Lease>, next_id: u64, next_epoch: u64) -> Self {
        let max_id = leases.iter().map(|l| l.id).max().unwrap_or(0);
        let max_epoch = leases.iter().map(|l| l.epoch).max().unwrap_or(0);
        let mut table = Self {
            next_id: next_id.max(max_id + 1).max(1),
            next_epoch: next_epoch.max(max_epoch + 1).max(1),
            ..Self::default()
        };
        for l in leases {
            table.insert(l);
        }
        table
    }

    fn insert(&mut self, lease: Lease) {
        self.by_node
            .entry(lease.node.clone())
            .or_default()
            .insert(lease.id);
        self.by_expiry.insert((lease.expires_at, lease.id));
        self.leases.insert(lease.id, lease);
    }

    pub(crate) fn next_id(&self) -> u64 {
        self.next_id.max(1)
    }

    pub(crate) fn next_epoch(&self) -> u64 {
        self.next_epoch.max(1)
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn grant(
        &mut self,
        now: UnixMillis,
        ttl_ms: u64,
        job: u64,
        rank: u32,
        node: &str,
        gpus: Vec<u32>,
        granted_version: u64,
    ) -> &Lease {
        let id = self.next_id();
        let epoch = self.next_epoch();
        self.next_id = id + 1;
        self.next_epoch = epoch + 1;
        let lease = Lease {
            id,
            epoch,
            job,
            rank,
            node: node.to_owned(),
            gpus,
            granted_at: now,
            expires_at: now + ttl_ms,
            revoked: false,
            granted_version,
            ready: false,
        };
        self.insert(lease);
        &self.leases[&id]
    }

    pub(crate) fn get(&self, id: u64) -> Option<&Lease> {
        self.leases.get(&id)
    }

    pub(crate) fn revoke(&mut self, id: u64) {
        if let Some(l) = self.leases.get_mut(&id) {
            l.revoked = true;
        }
    }

    /// Marks the lease's member ready; true when it was not before.
    pub(crate) fn mark_ready(&mut self, id: u64) -> bool {
        match self.leases.get_mut(&id) {
            Some(l) if !l.ready => {
                l.ready = true;
                true
            }
            _ => false,
        }
    }

    pub(crate) fn release(&mut self, id: u64) -> Option<Lease> {
        let lease = self.leases.remove(&id)?;
        if let Some(ids) = self.by_node.get_mut(&lease.node) {
            ids.remove(&id);
            if ids.is_empty() {
                self.by_node.remove(&lease.node);
            }
        }
        self.by_expiry.remove(&(lease.expires_at, id));
        Some(lease)
    }

    /// Extends every lease of `node` to `now + ttl`: the node has just been heard from.
    pub(crate) fn renew(&mut self, node: &str, now: UnixMillis, ttl_ms: u64) {
        let Some(ids) = self.by_node.get(node) else {
            return;
        };
        for id in ids {
            let Some(l) = self.leases.get_mut(id) else {
                continue;
            };
            let expires_at = l.expires_at.max(now + ttl_ms);
            if expires_at != l.expires_at {
                self.by_expiry.remove(&(l.expires_at, l.id));
                self.by_expiry.insert((expires_at, l.id));
                l.expires_at = expires_at;
            }
        }
    }

    /// Leases whose time is up at `now`, by id.
    pub(crate) fn expired(&self, now: UnixMillis) -> Vec<u64> {
        let mut ids: Vec<u64> = self
            .by_expiry
            .range(..=(now, u64::MAX))
            .map(|(_, id)| *id)
            .collect();
        ids.sort_unstable();
        ids
    }

    /// The leases of `node`, by id.
    pub(crate) fn on_node<'a>(
        &'a self,
        node: &'a str,
    ) -> impl Iterator<Item = &'a Lease> + Clone + 'a {
        self.by_node
            .get(node)
            .into_iter()
            .flatten()
            .filter_map(|id| self.leases.get(id))
    }

    pub(crate) fn all(&self) -> impl Iterator<Item = &Lease> {
        self.leases.values()
    }

    pub(crate) fn next_expiry(&self) -> Option<UnixMillis> {
        self.by_expiry.first().map(|(at, _)| *at)
    }

    pub(crate) fn add_straggler(&mut self, s: Straggler) {
        self.stragglers.insert((s.node.clone(), s.lease), s);
    }

    /// The stragglers of `node`, by lease id (usually none, found without allocating).
    pub(crate) fn stragglers_on(&self, node: &str) -> Vec<Straggler> {
        if self.stragglers.is_empty() {
            return Vec::new();
        }
        self.stragglers
            .range((node.to_owned(), 0)..=(node.to_owned(), u64::MAX))
            .map(|(_, s)| s.clone())
            .collect()
    }

    pub(crate) fn stragglers(&self) -> impl Iterator<Item = &Straggler> {
        self.stragglers.values()
    }

    pub(crate) fn forget_straggler(&mut self, node: &str, lease: u64) -> Option<Straggler> {
        self.stragglers.remove(&(node.to_owned(), lease))
    }

    /// Forgets the stragglers whose bound has passed at `now`.
    pub(crate) fn forget_stragglers_until(&mut self, now: UnixMillis) {
        if !self.stragglers.is_empty() {
            self.stragglers.retain(|_, s| s.until > now);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn epochs_only_go_up_even_after_restore() {
        let mut t = LeaseTable::default();
        let a = t.grant(0, 10, 1, 0, "n", vec![0], 1).epoch;
        let b = t.grant(0, 10, 2, 0, "n", vec![1], 1).epoch;
        assert!(b > a);
        let kept: Vec<Lease> = t.all().cloned().collect();
        let mut restored = LeaseTable::restore(kept, 0, 0);
        let c = restored.grant(0, 10, 3, 0, "n", vec![2], 1).epoch;
        assert!(c > b);
    }

    #[test]
    fn renew_never_shortens_a_lease() {
        let mut t = LeaseTable::default();
        let id = t.grant(0, 100, 1, 0, "n", vec![0], 1).id;
        t.renew("n", 10, 50);
        assert_eq!(t.get(id).unwrap().expires_at, 100);
        t.renew("n", 80, 50);
        assert_eq!(t.get(id).unwrap().expires_at, 130);
        assert_eq!(t.expired(130), vec![id]);
    }

    #[test]
    fn the_indexes_follow_grants_renewals_and_releases() {
        let mut t = LeaseTable::default();
        let a = t.grant(0, 100, 1, 0, "n1", vec![0], 1).id;
        let b = t.grant(0, 50, 2, 0, "n2", vec![0, 1], 1).id;
        let c = t.grant(0, 70, 3, 0, "n1", vec![2], 1).id;
        let on = |t: &LeaseTable, node: &str| t.on_node(node).map(|l| l.id).collect::<Vec<_>>();
        assert_eq!(on(&t, "n1"), vec![a, c]);
        assert_eq!(on(&t, "n2"), vec![b]);
        let held: Vec<u32> = t.on_node("n1").flat_map(|l| l.gpus.clone()).collect();
        assert_eq!(held, vec![0, 2]);
        assert_eq!(t.next_expiry(), Some(50));
        assert_eq!(t.expired(70), vec![b, c]);
        t.renew("n1", 60, 100);
        assert_eq!(t.expired(100), vec![b]);
        assert_eq!(t.next_expiry(), Some(50));
        t.release(b);
        assert_eq!(on(&t, "n2"), Vec::<u64>::new());
        assert_eq!(t.next_expiry(), Some(160));
        assert_eq!(t.expired(160), vec![a, c]);
        let restored = LeaseTable::restore(t.all().cloned().collect(), 0, 0);
        assert_eq!(on(&restored, "n1"), vec![a, c]);
        assert_eq!(restored.next_expiry(), Some(160));
    }
}
