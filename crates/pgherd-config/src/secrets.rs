//! Where secrets come from: a password or token in the TOML, in a file (not readable by every
//! user) or in an environment variable, at most one of them; and which inline field makes the
//! config file itself a secret.

use crate::file_mode;
use crate::raw::RawConfig;
use crate::validate::{field_path, Checker, Seg};
use crate::ConfigError;

impl Checker<'_> {
    /// A secret given in the TOML (`field`), in a file (`field_file`, relative to the config
    /// file; not readable by every user; one trailing newline dropped) or in an environment
    /// variable (`field_env`): at most one of them.
    pub(crate) fn secret(
        &self,
        table: &[Seg],
        field: &str,
        given: [&Option<String>; 3],
    ) -> Result<Option<String>, ConfigError> {
        let names = [
            field.to_owned(),
            format!("{field}_file"),
            format!("{field}_env"),
        ];
        let at = |i: usize| {
            let mut path = table.to_vec();
            path.push(Seg::from(names[i].as_str()));
            path
        };
        let set: Vec<usize> = (0..3).filter(|&i| given[i].is_some()).collect();
        if let [_, second, ..] = set.as_slice() {
            return Err(self.error(
                &at(*second),
                format!(
                    "set only one of {}, {} and {}",
                    names[0], names[1], names[2]
                ),
            ));
        }
        let Some(&which) = set.first() else {
            return Ok(None);
        };
        let Some(value) = given[which] else {
            return Ok(None);
        };
        let secret = match which {
            0 => value.clone(),
            1 => {
                let path = self.file_path(value);
                let mode = file_mode(&path).map_err(|e| {
                    self.error(&at(1), format!("cannot read {}: {e}", path.display()))
                })?;
                if mode & 0o004 != 0 {
                    return Err(self.error(
                        &at(1),
                        format!(
                            "{} is readable by every user (mode {:04o}); run `chmod 600 {}`",
                            path.display(),
                            mode & 0o7777,
                            path.display()
                        ),
                    ));
                }
                let text = std::fs::read_to_string(&path).map_err(|e| {
                    self.error(&at(1), format!("cannot read {}: {e}", path.display()))
                })?;
                let text = text.strip_suffix('\n').unwrap_or(&text);
                text.strip_suffix('\r').unwrap_or(text).to_owned()
            }
            _ => std::env::var(value).map_err(|_| {
                self.error(
                    &at(2),
                    format!("the environment variable {value} is not set (or not UTF-8)"),
                )
            })?,
        };
        if secret.is_empty() {
            return Err(self.error(&at(which), "is empty"));
        }
        Ok(Some(secret))
    }
}

/// The first field that holds a password, a password-equivalent hash or a token: what others
/// must not be able to read.
pub(crate) fn secret_field(raw: &RawConfig) -> Option<Vec<Seg>> {
    if raw.cluster.password.is_some() {
        return Some(field_path!["cluster", "password"].to_vec());
    }
    if raw.api.token.is_some() {
        return Some(field_path!["api", "token"].to_vec());
    }
    if raw.auth.password.is_some() {
        return Some(field_path!["auth", "password"].to_vec());
    }
    if raw.replication.password.is_some() {
        return Some(field_path!["replication", "password"].to_vec());
    }
    if raw.dcs.as_ref().is_some_and(|d| d.password.is_some()) {
        return Some(field_path!["dcs", "password"].to_vec());
    }
    raw.users.iter().find_map(|(name, u)| {
        if u.server_password.is_some() {
            Some(field_path!["users", name.as_str(), "server_password"].to_vec())
        } else if u.md5.is_some() {
            // An md5 hash logs in to PostgreSQL as well as the password does.
            Some(field_path!["users", name.as_str(), "md5"].to_vec())
        } else {
            None
        }
    })
}
