//! A write to the copies of a table every shard holds that reads the transaction's time
//! (`now()`, `CURRENT_TIMESTAMP`, ...; `pgherd_route::pin`): the values are computed once, on
//! the first shard the write reaches, inside the transaction, and bound as parameters (in
//! binary) on every shard, so every copy gets what one server would have written.

use bytes::{BufMut, Bytes, BytesMut};
use pgherd_route::pin::Pinned;
use pgherd_wire::backend::{self, tag as btag};
use pgherd_wire::frontend::BindValues;
use pgherd_wire::{PgError, SqlState};

use super::extended::{split_messages, type_at};
use super::link::{encode_message, Bound, Link, Query};
use super::{each, Failed};

/// Runs `pinned` (the client's `query` with its times as parameters) on every link; the
/// values come from the link of `first_shard` (the shard the transaction began on first,
/// whose start time is the transaction's), else the first link.
pub async fn write(
    links: &mut [Link],
    query: Query<'_>,
    pinned: &Pinned,
    first_shard: Option<u32>,
    out: &mut BytesMut,
) -> Result<(), Failed> {
    let at = links
        .iter()
        .position(|l| Some(l.shard) == first_shard)
        .unwrap_or(0);
    let Some(first) = links.get_mut(at) else {
        return Ok(());
    };
    let computed = compute(first, pinned).await?;
    let bound = bind(query.bound, pinned, &computed).map_err(Failed::Statement)?;
    let with_values = Query {
        sql: &pinned.sql,
        bound: Some(&bound),
    };
    let mut answer = BytesMut::new();
    each::write(links, with_values, true, None, &mut answer).await?;
    // A simple query's answer has no NoData, which the extended statement's has.
    let simple = query.bound.is_none();
    split_messages(answer)
        .iter()
        .filter(|m| !(simple && m.0 == btag::NO_DATA))
        .for_each(|m| encode_message(out, m));
    Ok(())
}

/// The pinned expressions' values on `link`, in binary: what binary dates and times say does
/// not depend on DateStyle or the time zone abbreviations, as their text would.
async fn compute(link: &mut Link, pinned: &Pinned) -> Result<Vec<Option<Vec<u8>>>, Failed> {
    let expressions: Vec<&str> = pinned
        .values
        .iter()
        .map(|v| v.expression.as_str())
        .collect();
    let select = format!("SELECT {}", expressions.join(", "));
    let mut rest = BytesMut::new();
    BindValues {
        param_formats: Vec::new(),
        values: Vec::new(),
        result_formats: vec![1],
    }
    .encode_rest(&mut rest);
    let binary_rows = Bound {
        param_types: Bytes::from_static(&[0, 0]),
        bind_rest: rest.freeze(),
        describe: false,
    };
    link.send_query(Query {
        sql: &select,
        bound: Some(&binary_rows),
    })
    .await?;
    let answer = link.ask_answer().await?;
    if let Some(refused) = answer.refused {
        return Err(Failed::Statement(refused));
    }
    let row: Option<Vec<Option<Vec<u8>>>> = answer.last_row.and_then(|body| {
        backend::parse_data_row(&body)
            .ok()
            .map(|values| values.into_iter().map(|v| v.map(<[u8]>::to_vec)).collect())
    });
    match row {
        Some(values) if values.len() == pinned.values.len() => Ok(values),
        _ => Err(Failed::Statement(PgError::error(
            SqlState::PROTOCOL_VIOLATION,
            format!(
                "shard {} did not compute the {} values asked",
                link.shard,
                pinned.values.len()
            ),
        ))),
    }
}

/// The client's parameters (none for a simple query), then the computed values in binary,
/// each typed as the expression it stands for.
fn bind(
    client: Option<&Bound>,
    pinned: &Pinned,
    computed: &[Option<Vec<u8>>],
) -> Result<Bound, PgError> {
    let protocol =
        |e: pgherd_wire::WireError| PgError::error(SqlState::PROTOCOL_VIOLATION, e.to_string());
    let client_values = client
        .map(|b| BindValues::parse(&b.bind_rest))
        .transpose()
        .map_err(protocol)?;
    let given = client_values.as_ref().map_or(0, |v| v.values.len());
    if given != pinned.client_params {
        return Err(PgError::error(
            SqlState::PROTOCOL_VIOLATION,
            format!(
                "bind message supplies {given} parameters, but the statement requires {}",
                pinned.client_params
            ),
        ));
    }
    let count = pinned.client_params + pinned.values.len();
    let count = u16::try_from(count)
        .map_err(|_| PgError::error(SqlState::PROGRAM_LIMIT_EXCEEDED, "too many parameters"))?;
    let mut types = BytesMut::with_capacity(2 + 4 * usize::from(count));
    types.put_u16(count);
    for i in 0..pinned.client_params {
        types.put_u32(client.map_or(0, |b| type_at(&b.param_types, i)));
    }
    pinned.values.iter().for_each(|v| types.put_u32(v.type_oid));
    let mut param_formats = Vec::with_capacity(usize::from(count));
    let mut values = Vec::with_capacity(usize::from(count));
    if let Some(client_values) = &client_values {
        for (i, value) in client_values.values.iter().enumerate() {
            param_formats.push(i16::from(client_values.is_binary(i)));
            values.push(*value);
        }
    }
    for value in computed {
        param_formats.push(1);
        values.push(value.as_deref());
    }
    let mut rest = BytesMut::new();
    BindValues {
        param_formats,
        values,
        result_formats: client_values.map(|v| v.result_formats).unwrap_or_default(),
    }
    .encode_rest(&mut rest);
    Ok(Bound {
        param_types: types.freeze(),
        bind_rest: rest.freeze(),
        describe: client.is_none_or(|b| b.describe),
    })
}
