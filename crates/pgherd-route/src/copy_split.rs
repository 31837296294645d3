//! `COPY ... FROM STDIN` into a sharded table, without IO: the statement's format read from
//! its options, the client's data cut into rows as the server would cut them (text and CSV),
//! and each row's key field read, so the executor (`pgherd-proxy/src/exec/copy.rs`) can send
//! each row to the shard holding its key. Of a `COPY ... TO STDOUT`, whether its output has a
//! header line.

use pg_query::protobuf::node::Node as NodeEnum;
use pg_query::protobuf::CopyStmt;

/// How the rows are written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CopyFormat {
    Text {
        delimiter: u8,
        null: Vec<u8>,
    },
    Csv {
        delimiter: u8,
        quote: u8,
        escape: u8,
        null: Vec<u8>,
    },
}

/// What the executor needs of a `COPY ... FROM STDIN`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CopyIn {
    pub format: CopyFormat,
    /// The first line names the columns: every shard gets it (and skips it).
    pub header: bool,
    /// The columns the rows hold, as listed (empty: every column, in the table's order).
    pub columns: Vec<String>,
}

/// Why a COPY's data cannot be split.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CopyError {
    #[error("COPY {0} through a sharded endpoint")]
    Unsupported(String),
    #[error("COPY data row {row}: {reason}")]
    Row { row: u64, reason: String },
    /// The row's key has no shard (or is not a key of the column's type).
    #[error("COPY data row {row}: {source}")]
    Key {
        row: u64,
        source: crate::shard_plan::ResolveError,
    },
}

impl CopyError {
    pub fn sqlstate(&self) -> pgherd_wire::SqlState {
        match self {
            CopyError::Unsupported(_) => pgherd_wire::SqlState::FEATURE_NOT_SUPPORTED,
            CopyError::Row { .. } => pgherd_wire::SqlState::BAD_COPY_FILE_FORMAT,
            CopyError::Key { source, .. } => source.sqlstate(),
        }
    }
}

/// The format of a `COPY ... FROM STDIN`, from its options.
pub fn copy_in(copy: &CopyStmt) -> Result<CopyIn, CopyError> {
    let unsupported = |what: &str| CopyError::Unsupported(what.to_owned());
    if !copy.is_from {
        return Err(unsupported("TO (reading a sharded table out)"));
    }
    if copy.is_program || !copy.filename.is_empty() {
        return Err(unsupported("FROM a file or program (only FROM STDIN)"));
    }
    let mut csv = false;
    let (mut delimiter, mut null, mut quote, mut escape) = (None, None, None, None);
    let mut header = false;
    for (name, text) in options(copy) {
        match name {
            "format" => match text.as_deref() {
                Some("csv") => csv = true,
                Some("text") => csv = false,
                _ => return Err(unsupported("in a format other than text or CSV")),
            },
            "delimiter" => delimiter = text,
            "null" => null = text,
            "quote" => quote = text,
            "escape" => escape = text,
            "header" => {
                header = header_on(text.as_deref());
                if text.as_deref() == Some("match") {
                    return Err(unsupported("with HEADER MATCH"));
                }
            }
            "encoding" => return Err(unsupported("with ENCODING")),
            // FREEZE, FORCE_NOT_NULL, FORCE_NULL, DEFAULT: the same on every shard.
            _ => {}
        }
    }
    let single = |value: Option<String>, default: u8, what: &str| match value {
        None => Ok(default),
        Some(v) if v.len() == 1 => Ok(v.as_bytes()[0]),
        Some(_) => Err(unsupported(&format!("with a {what} that is not one byte"))),
    };
    let format = if csv {
        let quote = single(quote, b'"', "QUOTE")?;
        CopyFormat::Csv {
            delimiter: single(delimiter, b',', "DELIMITER")?,
            quote,
            escape: single(escape, quote, "ESCAPE")?,
            null: null.unwrap_or_default().into_bytes(),
        }
    } else {
        CopyFormat::Text {
            delimiter: single(delimiter, b'\t', "DELIMITER")?,
            null: null.unwrap_or_else(|| "\\N".into()).into_bytes(),
        }
    };
    let columns = copy
        .attlist
        .iter()
        .filter_map(|c| crate::tree::string(c).map(str::to_owned))
        .collect();
    Ok(CopyIn {
        format,
        header,
        columns,
    })
}

/// Of a `COPY ... TO STDOUT` over several shards: whether each shard's output starts with a
/// header line, which the client must get once. Text and CSV only (each shard's binary
/// output has a header and trailer of its own).
pub fn copy_out_header(copy: &CopyStmt) -> Result<bool, CopyError> {
    let unsupported = |what: &str| CopyError::Unsupported(what.to_owned());
    let mut header = false;
    for (name, text) in options(copy) {
        match name {
            "format" if !matches!(text.as_deref(), Some("csv" | "text")) => {
                return Err(unsupported("TO in a format other than text or CSV"))
            }
            "header" => header = header_on(text.as_deref()),
            _ => {}
        }
    }
    Ok(header)
}

/// A COPY's options: each name, and its value as text (keywords in lower case).
fn options(copy: &CopyStmt) -> impl Iterator<Item = (&str, Option<String>)> {
    copy.options.iter().filter_map(|option| match &option.node {
        Some(NodeEnum::DefElem(def)) => {
            Some((def.defname.as_str(), option_text(def.arg.as_deref())))
        }
        _ => None,
    })
}

/// `HEADER` as written (`HEADER` alone, `true`, `on`, `1`, `match`): whether there is one.
fn header_on(value: Option<&str>) -> bool {
    !matches!(value, Some("false" | "off" | "0"))
}

fn option_text(arg: Option<&pg_query::protobuf::Node>) -> Option<String> {
    match arg?.node.as_ref()? {
        NodeEnum::String(s) => Some(keyword_case(&s.sval)),
        NodeEnum::Boolean(b) => Some(if b.boolval { "true" } else { "false" }.into()),
        NodeEnum::Integer(i) => Some(i.ival.to_string()),
        _ => None,
    }
}

/// Format names and HEADER's words are keywords (any case); delimiters and null strings are
/// taken as written.
fn keyword_case(text: &str) -> String {
    match text.to_lowercase().as_str() {
        k @ ("csv" | "text" | "binary" | "match" | "true" | "false" | "on" | "off") => k.to_owned(),
        _ => text.to_owned(),
    }
}

/// Cuts a COPY data stream into rows as they arrive, whatever the CopyData boundaries.
#[derive(Debug)]
pub struct RowSplitter {
    format: CopyFormat,
    pending: Vec<u8>,
    /// Where scanning `pending` goes on, and the CSV quoting state there.
    scanned: usize,
    in_quotes: bool,
    escaped: bool,
    /// `\.` was read: the rest is ignored, as the server ignores it.
    ended: bool,
    rows: u64,
}

impl RowSplitter {
    pub fn new(format: CopyFormat) -> RowSplitter {
        RowSplitter {
            format,
            pending: Vec::new(),
            scanned: 0,
            in_quotes: false,
            escaped: false,
            ended: false,
            rows: 0,
        }
    }

    /// Rows read so far.
    pub fn rows(&self) -> u64 {
        self.rows
    }

    /// Takes in `data`; hands each complete row (with its line end) to `row`.
    pub fn push(
        &mut self,
        data: &[u8],
        row: &mut dyn FnMut(&[u8]) -> Result<(), CopyError>,
    ) -> Result<(), CopyError> {
        if self.ended {
            return Ok(());
        }
        self.pending.extend_from_slice(data);
        let mut start = 0;
        while let Some(end) = self.row_end(start)? {
            let line = &self.pending[start..end];
            start = end;
            self.rows += 1;
            if is_end_marker(line) {
                self.ended = true;
                break;
            }
            row(line)?;
        }
        self.pending.drain(..start);
        self.scanned -= start.min(self.scanned);
        if self.ended {
            self.pending.clear();
            self.scanned = 0;
        }
        Ok(())
    }

    /// The data ended (CopyDone): a last row without its line end is a row too.
    pub fn finish(
        &mut self,
        row: &mut dyn FnMut(&[u8]) -> Result<(), CopyError>,
    ) -> Result<(), CopyError> {
        if self.ended || self.pending.is_empty() {
            return Ok(());
        }
        if self.in_quotes {
            return Err(CopyError::Row {
                row: self.rows + 1,
                reason: "unterminated CSV quoted field".into(),
            });
        }
        self.rows += 1;
        let last = std::mem::take(&mut self.pending);
        if is_end_marker(&last) {
            return Ok(());
        }
        row(&last)
    }

    /// The end (exclusive) of the row starting at `start`, if it is complete.
    fn row_end(&mut self, start: usize) -> Result<Option<usize>, CopyError> {
        let from = self.scanned.max(start);
        let csv = match self.format {
            CopyFormat::Csv { quote, escape, .. } => Some((quote, escape)),
            CopyFormat::Text { .. } => None,
        };
        for i in from..self.pending.len() {
            let byte = self.pending[i];
            if let Some((quote, escape)) = csv {
                if self.in_quotes {
                    if self.escaped {
                        self.escaped = false;
                    } else if byte == escape && escape != quote {
                        self.escaped = true;
                    } else if byte == quote {
                        self.in_quotes = false;
                    }
                    continue;
                }
                if byte == quote {
                    self.in_quotes = true;
                    continue;
                }
            }
            if byte == b'\r' && self.pending.get(i + 1).is_some_and(|b| *b != b'\n') {
                // PostgreSQL also takes lone carriage returns as line ends (for a whole file);
                // pgherd cuts rows at \n and \r\n only, so it refuses rather than misplace them.
                return Err(CopyError::Row {
                    row: self.rows + 1,
                    reason: "a line ending in a lone carriage return (pgherd splits rows ending in \\n or \\r\\n)".into(),
                });
            }
            if byte == b'\n' {
                self.scanned = i + 1;
                return Ok(Some(i + 1));
            }
        }
        self.scanned = self.pending.len();
        Ok(None)
    }
}

fn is_end_marker(line: &[u8]) -> bool {
    matches!(line, b"\\.\n" | b"\\.\r\n" | b"\\.")
}

/// The value of field `index` of a row (`None`: NULL), as the server would read it; `row`
/// is the number for errors.
pub fn key_field(
    format: &CopyFormat,
    line: &[u8],
    index: usize,
    row: u64,
) -> Result<Option<String>, CopyError> {
    let line = line.strip_suffix(b"\n").unwrap_or(line);
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let fault = |reason: &str| CopyError::Row {
        row,
        reason: reason.to_owned(),
    };
    let value = match format {
        CopyFormat::Text { delimiter, null } => {
            let raw = line
                .split(|b| b == delimiter)
                .nth(index)
                .ok_or_else(|| fault("missing data for the shard key column"))?;
            if raw == null.as_slice() {
                return Ok(None);
            }
            unescape_text(raw)
                .ok_or_else(|| fault("an invalid backslash escape in the shard key"))?
        }
        CopyFormat::Csv {
            delimiter,
            quote,
            escape,
            null,
        } => {
            let (raw, quoted) = csv_field(line, index, *delimiter, *quote, *escape)
                .ok_or_else(|| fault("missing data for the shard key column"))?;
            if !quoted && raw == *null {
                return Ok(None);
            }
            raw
        }
    };
    String::from_utf8(value)
        .map(Some)
        .map_err(|_| fault("a shard key that is not UTF-8"))
}

/// A text-format field with its backslash escapes read.
fn unescape_text(raw: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(raw.len());
    let mut i = 0;
    while i < raw.len() {
        let byte = raw[i];
        i += 1;
        if byte != b'\\' {
            out.push(byte);
            continue;
        }
        let next = *raw.get(i)?;
        i += 1;
        match next {
            b'b' => out.push(8),
            b'f' => out.push(12),
            b'n' => out.push(b'\n'),
            b'r' => out.push(b'\r'),
            b't' => out.push(b'\t'),
            b'v' => out.push(11),
            b'0'..=b'7' => {
                let mut value = u32::from(next - b'0');
                for _ in 0..2 {
                    match raw.get(i) {
                        Some(d @ b'0'..=b'7') => {
                            value = value * 8 + u32::from(d - b'0');
                            i += 1;
                        }
                        _ => break,
                    }
                }
                out.push(value as u8);
            }
            b'x' if raw.get(i).is_some_and(u8::is_ascii_hexdigit) => {
                let mut value = 0u32;
                for _ in 0..2 {
                    match raw.get(i).and_then(|d| (*d as char).to_digit(16)) {
                        Some(d) => {
                            value = value * 16 + d;
                            i += 1;
                        }
                        None => break,
                    }
                }
                out.push(value as u8);
            }
            other => out.push(other),
        }
    }
    Some(out)
}

/// A CSV field's value and whether it was quoted.
fn csv_field(
    line: &[u8],
    index: usize,
    delimiter: u8,
    quote: u8,
    escape: u8,
) -> Option<(Vec<u8>, bool)> {
    let mut field = 0;
    let mut value = Vec::new();
    let mut quoted = false;
    let mut in_quotes = false;
    let mut i = 0;
    while i < line.len() {
        let byte = line[i];
        i += 1;
        if in_quotes {
            // The escape character takes the quote or itself literally (a doubled quote, when
            // they are one character).
            let next = line.get(i).copied();
            if byte == escape && (next == Some(quote) || next == Some(escape)) {
                if field == index {
                    value.extend(next);
                }
                i += 1;
                continue;
            }
            if byte == quote {
                in_quotes = false;
            } else if field == index {
                value.push(byte);
            }
            continue;
        }
        if byte == delimiter {
            if field == index {
                return Some((value, quoted));
            }
            field += 1;
            value.clear();
            quoted = false;
        } else if byte == quote {
            in_quotes = true;
            quoted = true;
        } else if field == index {
            value.push(byte);
        }
    }
    (field == index).then_some((value, quoted))
}

#[cfg(test)]
#[path = "copy_split_tests.rs"]
mod tests;
