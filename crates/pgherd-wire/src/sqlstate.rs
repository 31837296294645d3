//! SQLSTATE codes pgherd sends or inspects, named as PostgreSQL's errcodes.txt names them.

use std::fmt;

/// A five-character SQLSTATE code.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct SqlState([u8; 5]);

impl SqlState {
    pub const SUCCESSFUL_COMPLETION: SqlState = SqlState(*b"00000");
    pub const CONNECTION_FAILURE: SqlState = SqlState(*b"08006");
    pub const SQLCLIENT_UNABLE_TO_ESTABLISH_SQLCONNECTION: SqlState = SqlState(*b"08001");
    pub const SQLSERVER_REJECTED_ESTABLISHMENT_OF_SQLCONNECTION: SqlState = SqlState(*b"08004");
    pub const PROTOCOL_VIOLATION: SqlState = SqlState(*b"08P01");
    pub const FEATURE_NOT_SUPPORTED: SqlState = SqlState(*b"0A000");
    pub const INVALID_PARAMETER_VALUE: SqlState = SqlState(*b"22023");
    pub const INVALID_TEXT_REPRESENTATION: SqlState = SqlState(*b"22P02");
    pub const CHARACTER_NOT_IN_REPERTOIRE: SqlState = SqlState(*b"22021");
    pub const BAD_COPY_FILE_FORMAT: SqlState = SqlState(*b"22P04");
    pub const NUMERIC_VALUE_OUT_OF_RANGE: SqlState = SqlState(*b"22003");
    pub const CHECK_VIOLATION: SqlState = SqlState(*b"23514");
    pub const READ_ONLY_SQL_TRANSACTION: SqlState = SqlState(*b"25006");
    pub const IN_FAILED_SQL_TRANSACTION: SqlState = SqlState(*b"25P02");
    pub const ACTIVE_SQL_TRANSACTION: SqlState = SqlState(*b"25001");
    pub const NO_ACTIVE_SQL_TRANSACTION: SqlState = SqlState(*b"25P01");
    pub const INVALID_SAVEPOINT_SPECIFICATION: SqlState = SqlState(*b"3B001");
    pub const TRANSACTION_RESOLUTION_UNKNOWN: SqlState = SqlState(*b"08007");
    pub const TRANSACTION_ROLLBACK: SqlState = SqlState(*b"40000");
    pub const T_R_SERIALIZATION_FAILURE: SqlState = SqlState(*b"40001");
    pub const INVALID_SQL_STATEMENT_NAME: SqlState = SqlState(*b"26000");
    pub const INVALID_CURSOR_NAME: SqlState = SqlState(*b"34000");
    pub const INVALID_AUTHORIZATION_SPECIFICATION: SqlState = SqlState(*b"28000");
    pub const INVALID_PASSWORD: SqlState = SqlState(*b"28P01");
    pub const INVALID_CATALOG_NAME: SqlState = SqlState(*b"3D000");
    pub const SYNTAX_ERROR: SqlState = SqlState(*b"42601");
    pub const DUPLICATE_PREPARED_STATEMENT: SqlState = SqlState(*b"42P05");
    pub const DUPLICATE_CURSOR: SqlState = SqlState(*b"42P03");
    pub const INSUFFICIENT_PRIVILEGE: SqlState = SqlState(*b"42501");
    pub const UNDEFINED_OBJECT: SqlState = SqlState(*b"42704");
    pub const UNDEFINED_TABLE: SqlState = SqlState(*b"42P01");
    pub const UNDEFINED_COLUMN: SqlState = SqlState(*b"42703");
    pub const UNDEFINED_FUNCTION: SqlState = SqlState(*b"42883");
    pub const INVALID_SCHEMA_NAME: SqlState = SqlState(*b"3F000");
    pub const TOO_MANY_CONNECTIONS: SqlState = SqlState(*b"53300");
    pub const CONFIGURATION_LIMIT_EXCEEDED: SqlState = SqlState(*b"53400");
    pub const PROGRAM_LIMIT_EXCEEDED: SqlState = SqlState(*b"54000");
    pub const QUERY_CANCELED: SqlState = SqlState(*b"57014");
    pub const ADMIN_SHUTDOWN: SqlState = SqlState(*b"57P01");
    pub const CANNOT_CONNECT_NOW: SqlState = SqlState(*b"57P03");
    pub const IDLE_SESSION_TIMEOUT: SqlState = SqlState(*b"57P05");
    pub const OBJECT_NOT_IN_PREREQUISITE_STATE: SqlState = SqlState(*b"55000");
    pub const OBJECT_IN_USE: SqlState = SqlState(*b"55006");
    pub const SYSTEM_ERROR: SqlState = SqlState(*b"58000");
    pub const INTERNAL_ERROR: SqlState = SqlState(*b"XX000");
    pub const DATA_CORRUPTED: SqlState = SqlState(*b"XX001");

    /// Builds a code from its text; `None` unless it is five ASCII digits or upper-case letters.
    pub fn from_code(code: &str) -> Option<SqlState> {
        let bytes: [u8; 5] = code.as_bytes().try_into().ok()?;
        bytes
            .iter()
            .all(|b| b.is_ascii_digit() || b.is_ascii_uppercase())
            .then_some(SqlState(bytes))
    }

    pub fn code(&self) -> &str {
        // The constructor only admits ASCII, so this cannot fail.
        std::str::from_utf8(&self.0).unwrap_or("XX000")
    }

    /// The two-character class, e.g. "08" for connection exceptions.
    pub fn class(&self) -> &str {
        &self.code()[..2]
    }
}

impl fmt::Debug for SqlState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SqlState({})", self.code())
    }
}

impl fmt::Display for SqlState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.code())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_roundtrip_and_reject_garbage() {
        assert_eq!(
            SqlState::from_code("28P01"),
            Some(SqlState::INVALID_PASSWORD)
        );
        assert_eq!(SqlState::INVALID_PASSWORD.class(), "28");
        assert_eq!(SqlState::from_code("28p01"), None);
        assert_eq!(SqlState::from_code("2801"), None);
        assert_eq!(SqlState::from_code("28P011"), None);
    }
}
