//! A read over several shards: each link runs the rewritten statement at once, and the rows
//! are merged (`pgherd_route::merge_rows`) into the one answer the client sees, in the row
//! format the servers used, hidden columns cut and averages typed as numeric.
//!
//! Rows stream: an ordered read is a k-way merge (`pgherd_route::merge_stream::KWay`) that
//! reads each shard as the client takes rows and holds one row per shard; an unordered one
//! passes each shard's rows on in turn; once the LIMIT is reached the rest is read and
//! dropped. Only a grouped read (aggregates, GROUP BY) holds the shards' rows, up to
//! [`MAX_FAN_OUT_BYTES`], before it combines them.

use pgherd_route::merge_plan::FanOut;
use pgherd_route::merge_rows::{ColumnType, Format, MergeError, Merger, Row, TextRules};
use pgherd_route::merge_stream::{Finisher, KWay, Taken};
use pgherd_wire::backend::{self, tag as btag, FieldDescription};
use pgherd_wire::frontend::BindValues;
use pgherd_wire::{PgError, SqlState, WireError};

use super::answer::Answer;
use super::link::{encode_message, Bound, Link, Query};
use super::Failed;

/// Rows a grouped fan-out, or a DISTINCT, may hold for one statement before it is refused.
pub const MAX_FAN_OUT_BYTES: usize = 64 << 20;

/// One shard's answer, read as the merge needs it.
struct ShardRows<'l> {
    link: &'l mut Link,
    fields: Option<Vec<FieldDescription>>,
    /// The first row, read ahead to learn the row description.
    first: Option<Row>,
    error: Option<PgError>,
    /// Read to its `ReadyForQuery` (or its connection failed): no more rows.
    ended: bool,
}

impl<'l> ShardRows<'l> {
    fn new(link: &'l mut Link) -> Self {
        ShardRows {
            link,
            fields: None,
            first: None,
            error: None,
            ended: false,
        }
    }

    /// Reads up to the first row (or the end), which brings the row description.
    async fn prime(&mut self, answer: &mut Answer<'_>) {
        self.first = self.read_row(answer).await;
    }

    /// The next row; `None` at the end or on an error (kept in `error`; the link is then read
    /// to its end and stays usable).
    async fn next_row(&mut self, answer: &mut Answer<'_>) -> Option<Row> {
        match self.first.take() {
            Some(row) => Some(row),
            None => self.read_row(answer).await,
        }
    }

    async fn read_row(&mut self, answer: &mut Answer<'_>) -> Option<Row> {
        while !self.ended {
            let (tag, body) = match self.link.next().await {
                Ok(message) => message,
                Err(e) => {
                    self.error.get_or_insert(e);
                    self.ended = true;
                    return None;
                }
            };
            let shard = self.link.shard;
            let bad = |e: WireError| {
                PgError::error(SqlState::PROTOCOL_VIOLATION, format!("shard {shard}: {e}"))
            };
            match tag {
                btag::ROW_DESCRIPTION => match backend::parse_row_fields(&body) {
                    Ok(fields) => self.fields = Some(fields),
                    Err(e) => self.fail(bad(e)),
                },
                btag::DATA_ROW if self.error.is_none() => match backend::parse_data_row(&body) {
                    Ok(values) => {
                        return Some(values.into_iter().map(|v| v.map(<[u8]>::to_vec)).collect())
                    }
                    Err(e) => self.fail(bad(e)),
                },
                btag::ERROR_RESPONSE => self.fail(super::link::server_error(shard, &body)),
                btag::NOTICE_RESPONSE | btag::PARAMETER_STATUS => {
                    encode_message(answer.out, &(tag, body))
                }
                btag::READY_FOR_QUERY => self.ended = true,
                _ => {}
            }
        }
        None
    }

    fn fail(&mut self, error: PgError) {
        self.error.get_or_insert(error);
    }

    /// Reads what is left to the end, dropping the rows.
    async fn drain(&mut self, answer: &mut Answer<'_>) {
        self.first = None;
        while self.read_row(answer).await.is_some() {}
    }
}

/// Runs `plan` on `links` (with the client's parameters, if `bound`) and sends the merged
/// answer (without `ReadyForQuery`) to `answer`; `text` says how the database's text orders.
pub async fn run(
    links: &mut [Link],
    plan: &FanOut,
    text: &TextRules,
    bound: Option<&Bound>,
    answer: &mut Answer<'_>,
) -> Result<(), Failed> {
    let shard_bound = bound.map(|b| shard_bound(b, plan)).transpose()?;
    let query = Query {
        sql: &plan.shard_sql,
        bound: shard_bound.as_ref(),
    };
    for link in links.iter_mut() {
        link.send_query(query).await?;
    }
    let mut shards: Vec<ShardRows> = links.iter_mut().map(ShardRows::new).collect();
    for shard in &mut shards {
        shard.prime(answer).await;
    }
    let describe = bound.is_none_or(|b| b.describe);
    let merged = stream(&mut shards, plan, text, describe, answer).await;
    if let Err(Failed::Client(gone)) = merged {
        return Err(Failed::Client(gone));
    }
    // Every link is read to its end, so it can serve again, whatever became of the merge.
    for shard in &mut shards {
        shard.drain(answer).await;
    }
    let given = merged?;
    if let Some(error) = shards.iter_mut().find_map(|s| s.error.take()) {
        return Err(Failed::Statement(error));
    }
    backend::encode_command_complete(answer.out, &format!("SELECT {given}"))
        .map_err(|e| Failed::Statement(too_large(e)))?;
    Ok(())
}

/// The merged rows, from the shards' first rows on; how many the client got.
async fn stream(
    shards: &mut [ShardRows<'_>],
    plan: &FanOut,
    text: &TextRules,
    describe: bool,
    answer: &mut Answer<'_>,
) -> Result<u64, Failed> {
    if let Some(error) = shards.iter_mut().find_map(|s| s.error.take()) {
        return Err(Failed::Statement(error));
    }
    let fields = shards
        .first()
        .and_then(|s| s.fields.clone())
        .ok_or_else(|| {
            Failed::Statement(PgError::error(
                SqlState::PROTOCOL_VIOLATION,
                "a shard answered a SELECT without a row description",
            ))
        })?;
    let first_rows: Vec<&Row> = shards.iter().filter_map(|s| s.first.as_ref()).collect();
    let merger = Merger::new(
        plan.merge.clone(),
        &column_types(&fields),
        &first_rows,
        text,
    )
    .map_err(merged)?;
    if describe {
        backend::encode_row_description(answer.out, &described(fields, &merger))
            .map_err(|e| Failed::Statement(too_large(e)))?;
    }
    let mut client = ClientRows {
        finisher: Finisher::new(&merger, MAX_FAN_OUT_BYTES),
        given: 0,
    };
    if plan.merge.grouping.is_some() {
        let rows = hold_all(shards, answer).await?;
        for row in merger.combine(rows).map_err(merged)? {
            if !client.give(row, answer).await? {
                break;
            }
        }
    } else if plan.merge.order_by.is_empty() {
        'shards: for shard in shards.iter_mut() {
            while let Some(row) = shard.next_row(answer).await {
                if !client.give(row, answer).await? {
                    break 'shards;
                }
            }
            failed_shard(shard)?;
        }
    } else {
        let mut kway = KWay::new(&merger, shards.len());
        loop {
            while let Some(i) = kway.wants() {
                let row = shards[i].next_row(answer).await;
                failed_shard(&mut shards[i])?;
                kway.offer(i, row);
            }
            let Some(row) = kway.next_row() else {
                break;
            };
            if !client.give(row.map_err(merged)?, answer).await? {
                break;
            }
        }
    }
    Ok(client.given)
}

/// The client's side of the stream.
struct ClientRows<'m> {
    finisher: Finisher<'m>,
    given: u64,
}

impl ClientRows<'_> {
    /// Sends `row` unless the merge drops it; false once no more rows are wanted.
    async fn give(&mut self, row: Row, answer: &mut Answer<'_>) -> Result<bool, Failed> {
        match self.finisher.take(row).map_err(merged)? {
            Taken::Row(row) => {
                backend::encode_data_row(answer.out, row.iter().map(|v| v.as_deref()))
                    .map_err(|e| Failed::Statement(too_large(e)))?;
                self.given += 1;
                answer.grown().await?;
                Ok(!self.finisher.is_done())
            }
            Taken::Skipped => Ok(true),
            Taken::Done => Ok(false),
        }
    }
}

/// A shard's error stops the merge: its rows would be missing.
fn failed_shard(shard: &mut ShardRows<'_>) -> Result<(), Failed> {
    match shard.error.take() {
        Some(error) => Err(Failed::Statement(error)),
        None => Ok(()),
    }
}

/// Every shard's rows, for a grouping (at most [`MAX_FAN_OUT_BYTES`] of them).
async fn hold_all(
    shards: &mut [ShardRows<'_>],
    answer: &mut Answer<'_>,
) -> Result<Vec<Row>, Failed> {
    let mut rows = Vec::new();
    let mut held_bytes = 0usize;
    for shard in shards.iter_mut() {
        while let Some(row) = shard.next_row(answer).await {
            held_bytes += row.iter().flatten().map(|v| v.len() + 8).sum::<usize>();
            if held_bytes > MAX_FAN_OUT_BYTES {
                return Err(merged(MergeError::TooLarge {
                    what: "the shards' rows",
                    max_bytes: MAX_FAN_OUT_BYTES,
                }));
            }
            rows.push(row);
        }
        failed_shard(shard)?;
    }
    Ok(rows)
}

fn column_types(fields: &[FieldDescription]) -> Vec<ColumnType> {
    fields
        .iter()
        .map(|f| ColumnType {
            oid: f.type_oid,
            format: if f.format == 1 {
                Format::Binary
            } else {
                Format::Text
            },
        })
        .collect()
}

/// The client's row description: the shards', with an average typed as numeric whatever
/// type the shards' sums had (in the format the client asked for).
fn described(fields: Vec<FieldDescription>, merger: &Merger) -> Vec<FieldDescription> {
    fields
        .into_iter()
        .zip(merger.output_types())
        .map(|(field, merged)| {
            if merged.oid == field.type_oid {
                field
            } else {
                FieldDescription {
                    table_oid: 0,
                    column: 0,
                    type_oid: merged.oid,
                    type_len: -1,
                    type_modifier: -1,
                    format: match merged.format {
                        Format::Binary => 1,
                        Format::Text => 0,
                    },
                    ..field
                }
            }
        })
        .collect()
}

fn merged(e: MergeError) -> Failed {
    Failed::Statement(PgError::error(e.sqlstate(), e.to_string()))
}

fn too_large(e: WireError) -> PgError {
    PgError::error(SqlState::PROGRAM_LIMIT_EXCEEDED, e.to_string())
}

/// The client's parameters for the shards' statement: the merge reads the shards' row
/// description, and the hidden columns come back in text.
fn shard_bound(bound: &Bound, plan: &FanOut) -> Result<Bound, PgError> {
    let mut values = BindValues::parse(&bound.bind_rest)
        .map_err(|e| PgError::error(SqlState::PROTOCOL_VIOLATION, e.to_string()))?;
    if values.result_formats.len() > 1 {
        let hidden = plan.merge.hidden_columns;
        values.result_formats.extend(std::iter::repeat_n(0, hidden));
    }
    let mut rest = bytes::BytesMut::with_capacity(bound.bind_rest.len() + 16);
    values.encode_rest(&mut rest);
    Ok(Bound {
        param_types: bound.param_types.clone(),
        bind_rest: rest.freeze(),
        describe: true,
    })
}
