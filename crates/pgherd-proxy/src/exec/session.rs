//! What a sharded session keeps that a server would: the shard `pgherd.shard` names, and the
//! commands answered from it without a shard's statement (`DEALLOCATE`, `DISCARD`).

use bytes::BytesMut;
use pgherd_route::shard_route::{Execution, SessionCommand};
use pgherd_route::SHARD_SETTING;
use pgherd_wire::{PgError, SqlState};

use super::link::encode_message;
use super::ShardedSession;
use crate::relay::params::Change;

impl ShardedSession {
    /// The shard `pgherd.shard` names for the session, if it is set.
    pub(super) fn session_shard(&mut self) -> Result<Option<u32>, PgError> {
        let Some(sql) = self.params.current(SHARD_SETTING) else {
            return Ok(None);
        };
        if let Some((read, shard)) = &self.session_shard {
            if read == sql {
                return Ok(Some(*shard));
            }
        }
        // A value pgherd cannot read back from the statement names none.
        let Some(value) = pgherd_route::setting_value(sql) else {
            return Ok(None);
        };
        let sql = sql.to_owned();
        let shard = self.router.shard_setting(&value)?;
        self.session_shard = Some((sql, shard));
        Ok(Some(shard))
    }

    /// Carries out a session command pgherd answers itself; its command tag.
    pub(super) async fn session_command(
        &mut self,
        command: &SessionCommand,
        out: &mut BytesMut,
    ) -> Result<String, PgError> {
        match command {
            SessionCommand::DiscardAll => {
                self.discard_all(out).await?;
                Ok("DISCARD ALL".to_owned())
            }
            SessionCommand::DiscardNothing(tag) => Ok((*tag).to_owned()),
            SessionCommand::Deallocate(None) => {
                self.extended.deallocate_all();
                Ok("DEALLOCATE ALL".to_owned())
            }
            SessionCommand::Deallocate(Some(name)) => {
                if self.extended.deallocate(name.as_bytes()) {
                    Ok("DEALLOCATE".to_owned())
                } else {
                    Err(PgError::error(
                        SqlState::INVALID_SQL_STATEMENT_NAME,
                        format!("prepared statement \"{name}\" does not exist"),
                    ))
                }
            }
        }
    }

    /// `DISCARD ALL`: the session's settings back to its startup packet's, its statements and
    /// portals forgotten. The client hears the reported parameters that change as a server
    /// would report them: a shard's session carrying the client's settings is reset and given
    /// the startup settings again (then closed).
    async fn discard_all(&mut self, out: &mut BytesMut) -> Result<(), PgError> {
        if self.tx.is_some() {
            return Err(PgError::error(
                SqlState::ACTIVE_SQL_TRANSACTION,
                "DISCARD ALL cannot run inside a transaction block",
            ));
        }
        let shards = self.shards_for(&Execution::AnyShard);
        let mut links = self.open_links(&shards).await?;
        self.params.record(vec![Change::ResetAll]);
        self.params.end_transaction(true);
        self.extended.forget_all();
        let Some(link) = links.first_mut() else {
            return Ok(());
        };
        link.close_after_use();
        link.take_reported();
        let startup = self.params.apply_sql();
        for sql in std::iter::once("RESET ALL").chain(startup.as_deref()) {
            if let Some(refused) = link.run_own(sql).await? {
                return Err(refused);
            }
        }
        for reported in link.take_reported() {
            encode_message(out, &reported);
        }
        Ok(())
    }
}
