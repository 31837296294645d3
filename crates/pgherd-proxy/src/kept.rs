//! The operator's levers that outlive a restart: `DETACH` and `PAUSE` are kept in
//! `[pgherd] state_file` (JSON, by node and database name) each time they change, and put back
//! into the cluster view at startup. Only the operator's decisions are kept; failover's
//! (elected primary, fenced nodes) are decided anew from what the nodes answer.

use std::path::Path;

use parking_lot::Mutex;
use pgherd_failover::{Change, ClusterState};
use serde::{Deserialize, Serialize};

use crate::app::App;

/// What the state file holds.
#[derive(Debug, Default, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Kept {
    /// Node names taken out of traffic.
    #[serde(default)]
    detached: Vec<String>,
    /// `PAUSE` without a database.
    #[serde(default)]
    paused_all: bool,
    /// Databases paused by name.
    #[serde(default)]
    paused: Vec<String>,
}

/// One save at a time, so an older view never overwrites a newer one's file.
static SAVING: Mutex<()> = Mutex::new(());

/// Writes the view's operator levers to the state file (a new file renamed over the old, so a
/// crash never leaves half a file).
pub fn save(app: &App) -> Result<(), String> {
    let _one = SAVING.lock();
    let path = app.config().proxy.state_file.clone();
    let kept = from_view(app, &app.nodes.view());
    let mut text = serde_json::to_string_pretty(&kept).map_err(|e| e.to_string())?;
    text.push('\n');
    let partial = path.with_extension("json.partial");
    std::fs::write(&partial, text)
        .and_then(|()| std::fs::rename(&partial, &path))
        .map_err(|e| format!("cannot write {}: {e}", path.display()))
}

fn from_view(app: &App, view: &ClusterState) -> Kept {
    Kept {
        detached: view
            .detached
            .iter()
            .map(|&id| app.nodes.name_of(id))
            .collect(),
        paused_all: view.paused_all,
        paused: view.paused.iter().cloned().collect(),
    }
}

/// Puts the kept levers back into the view; returns what it restored, for the log. A file that
/// cannot be read or parsed is an error: starting without a DETACH the operator made could
/// send traffic to a node taken out on purpose.
pub fn restore(app: &App) -> Result<Vec<String>, String> {
    let path = app.config().proxy.state_file.clone();
    let Some(kept) = read(&path)? else {
        return Ok(Vec::new());
    };
    let mut restored = Vec::new();
    for name in &kept.detached {
        match app.nodes.get(name) {
            Some(node) => {
                app.nodes.change(Change::Detach(node.id));
                restored.push(format!("{name} detached"));
            }
            None => {
                tracing::warn!(node = %name, file = %path.display(), "a node kept detached is no longer in the config; forgotten")
            }
        }
    }
    if kept.paused_all {
        app.nodes.change(Change::Pause(None));
        restored.push("all databases paused".to_owned());
    }
    for database in &kept.paused {
        app.nodes.change(Change::Pause(Some(database.clone())));
        restored.push(format!("database \"{database}\" paused"));
    }
    Ok(restored)
}

fn read(path: &Path) -> Result<Option<Kept>, String> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => {
            return Err(format!(
                "cannot read the state file {}: {e}",
                path.display()
            ))
        }
    };
    serde_json::from_str(&text).map(Some).map_err(|e| {
        format!(
            "{}:{}:{}: the state file is not valid: {e} (it keeps DETACH and PAUSE across restarts; fix or delete it)",
            path.display(),
            e.line(),
            e.column()
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_state_file_reads_back_and_bad_ones_name_the_place() {
        let dir = std::env::temp_dir().join(format!("pgherd-kept-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("state.json");
        assert_eq!(read(&path), Ok(None));
        std::fs::write(&path, r#"{"detached": ["pg2"], "paused": ["app"]}"#).unwrap();
        assert_eq!(
            read(&path),
            Ok(Some(Kept {
                detached: vec!["pg2".into()],
                paused_all: false,
                paused: vec!["app".into()],
            }))
        );
        std::fs::write(&path, "{\n  \"detached\": [\"pg2\",]\n}").unwrap();
        let err = read(&path).unwrap_err();
        assert!(err.starts_with(&format!("{}:2:", path.display())), "{err}");
        std::fs::write(&path, r#"{"detach": ["pg2"]}"#).unwrap();
        assert!(read(&path).unwrap_err().contains("unknown field"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
