//! A sharded session leaving for a new pgherd process during an upgrade (`crate::handover`),
//! and one arriving. It moves between statements outside a transaction block, holding no link
//! to a shard: all it is then is pgherd's (settings, prepared statements, cancel key, route,
//! per-shard read-your-writes positions) and fits a [`ClientRecord`], with the bytes the
//! client sent that were not read as a message yet.

use std::os::fd::OwnedFd;
use std::sync::Arc;

use bytes::BytesMut;

use super::{Extended, ShardReads, ShardedSession};
use crate::app::{App, PoolCache};
use crate::clients::ClientShared;
use crate::handover::ClientRecord;
use crate::relay::params::SessionParams;
use crate::relay::{client_for_handover, Movable, RoutingSetup};
use crate::shards::Shards;
use crate::stream::Stream;

impl ShardedSession {
    /// A session of a sharded endpoint, as its login or its move sets it up.
    pub fn new(
        app: Arc<App>,
        shared: Arc<ClientShared>,
        client: Stream,
        client_in: BytesMut,
        params: SessionParams,
        routing: RoutingSetup,
        shards: Arc<Shards>,
    ) -> ShardedSession {
        let server_database = app
            .config()
            .resolve(shared.database(), shared.user())
            .map_or_else(|| shared.database().to_string(), |r| r.server_dbname);
        let layout = shards.layout();
        let reads = ShardReads::new(
            &routing,
            params.flags.default_transaction_read_only,
            layout.count(),
        );
        ShardedSession {
            reads,
            router: routing
                .router
                .unwrap_or_else(|| app.router(&server_database)),
            pools: (0..layout.count()).map(|_| PoolCache::default()).collect(),
            layout,
            app,
            shared,
            client,
            client_in,
            params,
            shards,
            server_database,
            tx: None,
            schema_changed_at: None,
            extended: Extended::default(),
            catalog_awaited: false,
            session_shard: None,
        }
    }

    /// Whether the session can move now (it is between statements: the caller knows).
    pub(super) fn movable(&self) -> Movable {
        if self.client.is_tls() {
            return Movable::Never(
                "it uses TLS, whose session keys stay in this process's TLS library",
            );
        }
        if self.tx.is_some() || !self.extended.is_settled() || !self.params.is_settled() {
            return Movable::Later;
        }
        Movable::Now
    }

    /// The client's connection (a duplicate of its descriptor) and the record of its session,
    /// for the new process.
    pub fn take_for_handover(&self) -> Result<(OwnedFd, ClientRecord), String> {
        let (connection, settings) =
            client_for_handover(self.movable(), &self.client, &self.params)?;
        let shared = &self.shared;
        let session = &self.reads.session;
        Ok((
            connection,
            ClientRecord {
                addr: shared.addr,
                user: shared.user().to_string(),
                database: shared.database().to_string(),
                process_id: shared.key.process_id,
                secret_key: shared.key.secret_key,
                unread: self.client_in.to_vec(),
                settings,
                custom_settings: Vec::new(),
                statements: self.extended.records(),
                unnamed: None,
                route_override: session.override_route.map(|r| r.as_str().to_owned()),
                default_read_only: session.default_read_only,
                standard_conforming_strings: self.params.flags.standard_conforming_strings,
                min_lsn: 0,
                write_unconfirmed: false,
                session_mode: false,
                server: None,
                sharded: true,
                shard_positions: self.reads.positions(),
            },
        ))
    }

    /// Takes up what a moved session was (its settings and unread bytes came with its setup).
    pub fn resume(&mut self, record: &ClientRecord) {
        self.extended.adopt(&record.statements);
        self.reads.adopt_positions(&record.shard_positions);
        self.reads.session.override_route = record
            .route_override
            .as_deref()
            .and_then(pgherd_config::Route::parse);
        self.reads.session.default_read_only = record.default_read_only;
    }
}
