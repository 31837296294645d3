//! The config file as pgherd's commands change it (`clone`, `remove`, `shard move`,
//! `shard split`): its `[[nodes]]` entries (and a split's layout) edited in place with the rest of the text (comments included) kept, the
//! result checked before it stays, and the running pgherd asked to reload.

use std::path::Path;
use std::time::Duration;

use pgherd_config::Config;

use crate::local::Where;

/// Changes the config file's `[[nodes]]` entries with `edit`, as [`edit_document`] does.
pub(crate) fn edit_nodes(
    path: &Path,
    change: &str,
    edit: impl FnOnce(&mut toml_edit::ArrayOfTables) -> Result<(), String>,
) -> Result<(), String> {
    edit_document(path, change, |document| edit(nodes_of(document)?))
}

/// The document's `[[nodes]]` entries.
pub(crate) fn nodes_of(
    document: &mut toml_edit::DocumentMut,
) -> Result<&mut toml_edit::ArrayOfTables, String> {
    document
        .get_mut("nodes")
        .and_then(toml_edit::Item::as_array_of_tables_mut)
        .ok_or_else(|| "the config has no [[nodes]] entries".to_owned())
}

/// Changes the config file with `edit`, the rest of its text (comments included) kept;
/// checks the result loads, and puts the file back as it was if not (`change` says what the
/// result would have been, for that error).
pub(crate) fn edit_document(
    path: &Path,
    change: &str,
    edit: impl FnOnce(&mut toml_edit::DocumentMut) -> Result<(), String>,
) -> Result<(), String> {
    let before = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut document: toml_edit::DocumentMut = before
        .parse()
        .map_err(|e| format!("{}: {e}", path.display()))?;
    edit(&mut document).map_err(|e| format!("{}: {e}", path.display()))?;
    pgherd_config::write_private_file(path, &document.to_string())
        .map_err(|e| format!("{}: {e}", path.display()))?;
    if let Err(e) = Config::load(path) {
        let _ = pgherd_config::write_private_file(path, &before);
        return Err(format!(
            "the config {change} does not load, so it was left as it was ({e}); change it by hand"
        ));
    }
    Ok(())
}

/// Asks the running pgherd, if there is one, to reload its config; `why` says what a reload
/// by hand would do if it cannot be asked.
pub(crate) fn reload_running(at: &Where, config: &Config, why: &str) {
    let running = config.proxy.listen.first().is_some_and(|addr| {
        std::net::TcpStream::connect_timeout(
            &crate::operate::connectable(*addr),
            Duration::from_millis(500),
        )
        .is_ok()
    });
    if !running {
        eprintln!("pgherd is not running: it reads the changed config when it starts");
        return;
    }
    if let Err(e) = crate::operate::admin_command(at, "RELOAD") {
        eprintln!("pgherd: the running pgherd did not reload ({e}); reload it {why}");
    }
}
