//! Config errors that name the file, the line and column, and the field.

use std::fmt;
use std::ops::Range;
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub file: PathBuf,
    /// 1-based; 0 when the problem has no place in the file (it could not be read, or a
    /// required section is missing).
    pub line: usize,
    pub column: usize,
    /// Dotted path of the field, e.g. `hba[2].address`; empty for syntax errors.
    pub field: String,
    pub message: String,
}

impl ConfigError {
    pub fn unplaced(file: &Path, field: impl Into<String>, message: impl Into<String>) -> Self {
        ConfigError {
            file: file.to_owned(),
            line: 0,
            column: 0,
            field: field.into(),
            message: message.into(),
        }
    }

    pub fn at(
        file: &Path,
        source: &str,
        span: Option<Range<usize>>,
        field: impl Into<String>,
        message: impl Into<String>,
    ) -> Self {
        let (line, column) = span.map_or((0, 0), |s| line_column(source, s.start));
        ConfigError {
            file: file.to_owned(),
            line,
            column,
            field: field.into(),
            message: message.into(),
        }
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.file.display())?;
        if self.line > 0 {
            write!(f, ":{}:{}", self.line, self.column)?;
        }
        if !self.field.is_empty() {
            write!(f, ": {}", self.field)?;
        }
        write!(f, ": {}", self.message)
    }
}

impl std::error::Error for ConfigError {}

/// 1-based line and column (in characters) of a byte offset.
pub fn line_column(source: &str, offset: usize) -> (usize, usize) {
    let offset = offset.min(source.len());
    let before = &source[..offset];
    let line = before.matches('\n').count() + 1;
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    let column = source[line_start..offset].chars().count() + 1;
    (line, column)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_are_one_based() {
        let src = "a = 1\nbb = 2\n";
        assert_eq!(line_column(src, 0), (1, 1));
        assert_eq!(line_column(src, 6), (2, 1));
        assert_eq!(line_column(src, 11), (2, 6));
    }
}
