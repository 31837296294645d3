//! A read over several shards: each link runs the rewritten statement at once, the answers
//! are read in parallel, and the rows merged (`pgherd_route::merge_rows`) into the one answer
//! the client sees, in the row format the servers used, hidden columns cut and averages typed
//! as numeric.
//!
//! The shards' rows are buffered (up to [`MAX_FAN_OUT_BYTES`] per statement) before the merge:
//! a streaming k-way merge is still to come.

use bytes::BytesMut;
use futures_util::future::join_all;
use pgherd_route::merge_plan::FanOut;
use pgherd_route::merge_rows::{ColumnType, Format, Merger, Row};
use pgherd_wire::backend::{self, tag as btag, FieldDescription};
use pgherd_wire::frontend::BindValues;
use pgherd_wire::{PgError, SqlState};

use super::link::{encode_message, Bound, Link, Message, Query};

/// Rows a fan-out may hold for one statement before it is refused.
pub const MAX_FAN_OUT_BYTES: usize = 64 << 20;

/// What one shard answered.
#[derive(Default)]
struct ShardAnswer {
    fields: Option<Vec<FieldDescription>>,
    rows: Vec<Row>,
    /// Notices and reported parameters, passed on.
    asides: Vec<Message>,
    error: Option<PgError>,
}

/// Reads one link's answer to its end. An error of the statement is kept (the link is read to
/// its `ReadyForQuery` and stays usable); an error of the connection ends the read.
async fn collect(link: &mut Link, budget: &std::sync::atomic::AtomicUsize) -> ShardAnswer {
    use std::sync::atomic::Ordering;
    let mut answer = ShardAnswer::default();
    loop {
        let (tag, body) = match link.next().await {
            Ok(message) => message,
            Err(e) => {
                answer.error.get_or_insert(e);
                return answer;
            }
        };
        let bad = |e: pgherd_wire::WireError| {
            PgError::error(
                SqlState::PROTOCOL_VIOLATION,
                format!("shard {}: {e}", link.shard),
            )
        };
        match tag {
            btag::ROW_DESCRIPTION => match backend::parse_row_fields(&body) {
                Ok(fields) => answer.fields = Some(fields),
                Err(e) => answer.error = Some(bad(e)),
            },
            btag::DATA_ROW if answer.error.is_none() => {
                if budget.fetch_add(body.len(), Ordering::Relaxed) + body.len() > MAX_FAN_OUT_BYTES
                {
                    answer.error = Some(PgError::error(
                        SqlState::PROGRAM_LIMIT_EXCEEDED,
                        format!(
                            "the shards' rows of this statement exceed the {} MiB pgherd merges at once",
                            MAX_FAN_OUT_BYTES >> 20
                        ),
                    ).with_hint("add a LIMIT, or a WHERE on the shard key"));
                    answer.rows = Vec::new();
                    continue;
                }
                match backend::parse_data_row(&body) {
                    Ok(values) => answer
                        .rows
                        .push(values.into_iter().map(|v| v.map(<[u8]>::to_vec)).collect()),
                    Err(e) => answer.error = Some(bad(e)),
                }
            }
            btag::ERROR_RESPONSE => {
                answer
                    .error
                    .get_or_insert(super::link::server_error(link.shard, &body));
            }
            btag::NOTICE_RESPONSE | btag::PARAMETER_STATUS => answer.asides.push((tag, body)),
            btag::READY_FOR_QUERY => return answer,
            _ => {}
        }
    }
}

/// Runs `plan` on `links` (with the client's parameters, if `bound`) and appends the merged
/// answer (without `ReadyForQuery`) to `out`.
pub async fn run(
    links: &mut [Link],
    plan: &FanOut,
    bound: Option<&Bound>,
    out: &mut BytesMut,
) -> Result<(), PgError> {
    let shard_bound = bound.map(|b| shard_bound(b, plan)).transpose()?;
    let query = Query {
        sql: &plan.shard_sql,
        bound: shard_bound.as_ref(),
    };
    for link in links.iter_mut() {
        link.send_query(query).await?;
    }
    let budget = std::sync::atomic::AtomicUsize::new(0);
    let answers = join_all(links.iter_mut().map(|link| collect(link, &budget))).await;
    for answer in &answers {
        for aside in &answer.asides {
            encode_message(out, aside);
        }
    }
    let mut answers_without_error = Vec::with_capacity(answers.len());
    for answer in answers {
        if let Some(error) = answer.error {
            return Err(error);
        }
        answers_without_error.push(answer);
    }
    let describe = bound.is_none_or(|b| b.describe);
    merge(answers_without_error, plan, describe, out)
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
    let mut rest = BytesMut::with_capacity(bound.bind_rest.len() + 16);
    values.encode_rest(&mut rest);
    Ok(Bound {
        param_types: bound.param_types.clone(),
        bind_rest: rest.freeze(),
        describe: true,
    })
}

fn merge(
    answers: Vec<ShardAnswer>,
    plan: &FanOut,
    describe: bool,
    out: &mut BytesMut,
) -> Result<(), PgError> {
    let merge_error =
        |e: pgherd_route::merge_rows::MergeError| PgError::error(e.sqlstate(), e.to_string());
    let Some(fields) = answers.first().and_then(|a| a.fields.clone()) else {
        return Err(PgError::error(
            SqlState::PROTOCOL_VIOLATION,
            "a shard answered a SELECT without a row description",
        ));
    };
    let columns: Vec<ColumnType> = fields
        .iter()
        .map(|f| ColumnType {
            oid: f.type_oid,
            format: if f.format == 1 {
                Format::Binary
            } else {
                Format::Text
            },
        })
        .collect();
    // Text is ordered only as bytes (a C collation); reading the database's collation to
    // tell is still to come, so text sorts are refused by the merge.
    let text_bytewise = false;
    let merger = Merger::new(plan.merge.clone(), &columns, text_bytewise).map_err(merge_error)?;
    let rows: Vec<Row> = if plan.merge.grouping.is_some() {
        merger
            .combine(answers.into_iter().flat_map(|a| a.rows))
            .map_err(merge_error)?
    } else {
        merger
            .merge_sorted(answers.into_iter().map(|a| a.rows.into_iter()).collect())
            .collect::<Result<_, _>>()
            .map_err(merge_error)?
    };
    let rows = merger.finish(rows).map_err(merge_error)?;
    let output = merger.output_types();
    let described: Vec<FieldDescription> = fields
        .into_iter()
        .zip(&output)
        .map(|(field, merged)| {
            if merged.oid == field.type_oid {
                field
            } else {
                // An average: numeric, whatever type the shards' sums had.
                FieldDescription {
                    table_oid: 0,
                    column: 0,
                    type_oid: merged.oid,
                    type_len: -1,
                    type_modifier: -1,
                    format: 0,
                    ..field
                }
            }
        })
        .collect();
    let encode_error =
        |e: pgherd_wire::WireError| PgError::error(SqlState::PROGRAM_LIMIT_EXCEEDED, e.to_string());
    if describe {
        backend::encode_row_description(out, &described).map_err(encode_error)?;
    }
    for row in &rows {
        backend::encode_data_row(out, row.iter().map(|v| v.as_deref())).map_err(encode_error)?;
    }
    backend::encode_command_complete(out, &format!("SELECT {}", rows.len()))
        .map_err(encode_error)?;
    Ok(())
}
