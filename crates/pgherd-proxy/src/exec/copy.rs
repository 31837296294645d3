//! `COPY ... FROM STDIN` through a sharded endpoint: every shard starts the COPY, the client
//! gets one CopyInResponse, and its data is cut into rows (`pgherd_route::copy_split`), each
//! sent to the shard of its key (to every shard, for a table every shard holds), in batches.
//! The COPY runs inside the session's transaction, so it commits on every shard or on none.

use bytes::{BufMut, BytesMut};
use futures_util::future::join_all;
use pgherd_route::copy_split::{key_field, CopyError, RowSplitter};
use pgherd_route::shard_route::CopyPlan;
use pgherd_wire::frontend::{self, tag as ftag};
use pgherd_wire::{PgError, SqlState};

use super::link::{encode_message, Link};
use super::{Failed, ShardedSession};
use crate::error::client_io;
use crate::msgio::{read_message, write_flush, ReadError};

/// Rows for one shard are sent once this much is gathered.
const BATCH_BYTES: usize = 64 << 10;

impl ShardedSession {
    /// Runs a COPY FROM STDIN over `links` (one per shard, in shard order); its count goes to
    /// `out`.
    pub(super) async fn copy_in(
        &mut self,
        plan: &CopyPlan,
        sql: &str,
        links: &mut [Link],
        out: &mut BytesMut,
    ) -> Result<(), Failed> {
        let key_index = match &plan.key {
            None => None,
            Some(key) => Some(match key.index {
                Some(index) => index,
                None => key_position(links, &key.table, &key.column).await?,
            }),
        };
        let started = join_all(links.iter_mut().map(|link| link.start_copy_in(sql))).await;
        let mut response = None;
        let mut refusal = None;
        for answer in started {
            match answer {
                Ok(Ok(body)) => {
                    response.get_or_insert(body);
                }
                Ok(Err(e)) | Err(e) => {
                    refusal.get_or_insert(e);
                }
            }
        }
        if let Some(refused) = refusal {
            abandon(links, "another shard refused the COPY").await;
            return Err(Failed::Statement(refused));
        }
        let Some(response) = response else {
            return Ok(());
        };
        // What the statements before it in the same query string answered goes first.
        let mut start = out.split();
        encode_message(
            &mut start,
            &(pgherd_wire::backend::tag::COPY_IN_RESPONSE, response),
        );
        write_flush(&mut self.client, &start)
            .await
            .map_err(|e| Failed::Client(client_io(e)))?;
        match self.stream_rows(plan, key_index, links).await {
            Ok(()) => {}
            Err(Failed::Statement(e)) => {
                abandon(links, &e.message).await;
                return Err(Failed::Statement(e));
            }
            Err(end) => return Err(end),
        }
        let mut done = BytesMut::new();
        pgherd_wire::backend::encode_empty(&mut done, ftag::COPY_DONE);
        for link in links.iter_mut() {
            link.send_encoded(&done).await?;
        }
        let counts = join_all(links.iter_mut().map(Link::finish_copy)).await;
        let mut rows = Vec::with_capacity(counts.len());
        for count in counts {
            rows.push(count?.map_err(Failed::Statement)?);
        }
        // A table every shard holds took every row on each shard: its count once.
        let total: u64 = if plan.key.is_some() {
            rows.iter().sum()
        } else {
            rows.first().copied().unwrap_or(0)
        };
        pgherd_wire::backend::encode_command_complete(out, &format!("COPY {total}"))
            .map_err(|e| Failed::Statement(PgError::error(SqlState::INTERNAL_ERROR, e.to_string())))
    }

    /// Reads the client's CopyData to its CopyDone, sending each row to its shard.
    async fn stream_rows(
        &mut self,
        plan: &CopyPlan,
        key_index: Option<usize>,
        links: &mut [Link],
    ) -> Result<(), Failed> {
        let max_message_bytes = self.app.config().proxy.max_message_bytes;
        let format = plan.copy.format.clone();
        let mut splitter = RowSplitter::new(format.clone());
        let mut batches: Vec<BytesMut> = vec![BytesMut::new(); links.len()];
        let mut header = plan.copy.header;
        let map = &self.layout.map;
        let table = plan.key.as_ref().map(|k| k.table.as_str()).unwrap_or("");
        let mut place = |line: &[u8], batches: &mut Vec<BytesMut>, row: u64| {
            // The header line goes to every shard: each skips its own first line.
            let all = std::mem::take(&mut header) || key_index.is_none();
            let index = match key_index {
                Some(index) if !all => index,
                _ => {
                    batches.iter_mut().for_each(|batch| batch.put_slice(line));
                    return Ok(());
                }
            };
            let key = key_field(&format, line, index, row)?;
            let shard = map
                .shard_of_value(table, key.as_deref())
                .map_err(|source| CopyError::Key { row, source })?;
            if let Some(batch) = batches.get_mut(shard as usize) {
                batch.put_slice(line);
            }
            Ok(())
        };
        loop {
            let (tag, body) =
                read_message(&mut self.client, &mut self.client_in, max_message_bytes)
                    .await
                    .map_err(|e| match e {
                        ReadError::Eof => Failed::Client(crate::error::Disconnect::ClientClosed),
                        ReadError::Io(e) => Failed::Client(client_io(e)),
                        ReadError::Wire(e) => Failed::Client(crate::error::Disconnect::Protocol(e)),
                    })?;
            match tag {
                ftag::COPY_DATA => {
                    let mut row = splitter.rows();
                    splitter
                        .push(&body, &mut |line| {
                            row += 1;
                            place(line, &mut batches, row)
                        })
                        .map_err(copy_error)?;
                    send_full(links, &mut batches, BATCH_BYTES).await?;
                }
                ftag::COPY_DONE => {
                    let mut row = splitter.rows();
                    splitter
                        .finish(&mut |line| {
                            row += 1;
                            place(line, &mut batches, row)
                        })
                        .map_err(copy_error)?;
                    return send_full(links, &mut batches, 0).await;
                }
                ftag::COPY_FAIL => {
                    let reason = String::from_utf8_lossy(body.strip_suffix(&[0]).unwrap_or(&body))
                        .into_owned();
                    return Err(Failed::Statement(PgError::error(
                        SqlState::QUERY_CANCELED,
                        format!("COPY from stdin failed: {reason}"),
                    )));
                }
                ftag::FLUSH | ftag::SYNC => {}
                other => {
                    return Err(Failed::Statement(PgError::error(
                        SqlState::PROTOCOL_VIOLATION,
                        format!("unexpected message type 0x{other:02X} during COPY from stdin"),
                    )))
                }
            }
        }
    }
}

/// Sends each shard's gathered rows once there are at least `least` bytes of them.
async fn send_full(
    links: &mut [Link],
    batches: &mut [BytesMut],
    least: usize,
) -> Result<(), Failed> {
    for (link, batch) in links.iter_mut().zip(batches.iter_mut()) {
        if batch.is_empty() || batch.len() < least {
            continue;
        }
        let mut message = BytesMut::with_capacity(batch.len() + 5);
        message.put_u8(ftag::COPY_DATA);
        message.put_i32(batch.len() as i32 + 4);
        message.put_slice(batch);
        batch.clear();
        link.send_encoded(&message).await?;
    }
    Ok(())
}

/// Ends the COPY on every shard with CopyFail, reading each answer (its error) to the end.
async fn abandon(links: &mut [Link], reason: &str) {
    let mut fail = BytesMut::new();
    if frontend::encode_copy_fail(&mut fail, reason.as_bytes()).is_err() {
        let _ = frontend::encode_copy_fail(&mut fail, b"the COPY failed");
    }
    for link in links.iter_mut() {
        if link.is_copying() && link.send_encoded(&fail).await.is_ok() {
            let _ = link.finish_copy().await;
        }
    }
}

/// Where the key column is among the table's columns, as the first shard's catalog says.
async fn key_position(links: &mut [Link], table: &str, column: &str) -> Result<usize, Failed> {
    let Some(link) = links.first_mut() else {
        return Err(Failed::Statement(PgError::error(
            SqlState::INTERNAL_ERROR,
            "a COPY without shards",
        )));
    };
    let table = crate::node_ops::quote_literal(table);
    let column = crate::node_ops::quote_literal(column);
    // No row if the table has no such column.
    let sql = format!(
        "SELECT (SELECT count(*) FROM pg_catalog.pg_attribute a WHERE a.attrelid = k.attrelid \
         AND a.attnum > 0 AND NOT a.attisdropped AND a.attnum < k.attnum) \
         FROM pg_catalog.pg_attribute k WHERE k.attrelid = {table}::regclass \
         AND k.attname = {column} AND NOT k.attisdropped"
    );
    let answer = link.ask_own(&sql).await?;
    if let Some(refused) = answer.refused {
        return Err(Failed::Statement(refused));
    }
    answer.value.and_then(|v| v.parse().ok()).ok_or_else(|| {
        Failed::Statement(PgError::error(
            SqlState::UNDEFINED_COLUMN,
            format!("column {column} of {table} was not found"),
        ))
    })
}

fn copy_error(e: CopyError) -> Failed {
    Failed::Statement(PgError::error(e.sqlstate(), e.to_string()))
}
