//! Identical startup settings shared between clients, and the settings each distinct
//! startup packet made remembered by the packet: drivers of one application all send the
//! same ones, each idle client should cost as little as possible, and a login should not
//! make again what an earlier one made.

use std::sync::Arc;

use super::{Settings, StartupFlags};

/// Both tables' keys: foldhash with a fixed seed (a crafted collision only costs a miss, as
/// each hit compares the whole entry).
fn fixed_hash<V: std::hash::Hash + ?Sized>(value: &V) -> u64 {
    std::hash::BuildHasher::hash_one(&foldhash::fast::FixedState::default(), value)
}

/// Shares identical startup settings between clients: drivers of one application all send
/// the same ones, and each idle client should cost as little as possible.
#[derive(Debug, Default)]
pub struct Interner {
    by_hash: parking_lot::Mutex<std::collections::HashMap<u64, std::sync::Weak<Settings>>>,
    /// What a startup packet's parameters made, by the parameters as sent: most logins send
    /// what an earlier one did, and making the settings again (options parsed, names
    /// lower-cased, a statement built per setting) was most of a login's own work.
    by_startup: parking_lot::Mutex<StartupMemos>,
}

#[derive(Debug, Default)]
struct StartupMemos {
    by_hash: std::collections::HashMap<u64, StartupMemo>,
    /// Logins not remembered because the table was full, since it was last swept of what no
    /// client uses: a sweep waits for a few, so a stream of logins that each send their own
    /// parameters does not walk a full table every time.
    turned_away: usize,
}

impl StartupMemos {
    /// Lets go of the settings no client uses. Packets that differ only in what makes no
    /// setting (the user, the database, the order of the parameters) share one interned
    /// `Arc`, so the memo's own references to it are counted, not taken as one.
    fn sweep_unused(&mut self) {
        let mut held: std::collections::HashMap<*const Settings, usize> =
            std::collections::HashMap::new();
        for memo in self.by_hash.values() {
            *held.entry(Arc::as_ptr(&memo.settings)).or_default() += 1;
        }
        self.by_hash.retain(|_, memo| {
            let by_memo = held.get(&Arc::as_ptr(&memo.settings)).copied().unwrap_or(0);
            Arc::strong_count(&memo.settings) > by_memo
        });
    }
}

#[derive(Debug)]
struct StartupMemo {
    params: Vec<(String, String)>,
    /// Held, not weak: an application that connects per transaction has no client left
    /// between two logins to keep its settings alive, and it is the one that logs in most.
    settings: Arc<Settings>,
    flags: StartupFlags,
}

impl Interner {
    /// Forgotten entries are swept once the table holds this many.
    const SWEEP_AT: usize = 4096;
    /// Distinct startup packets remembered at most: a memo entry keeps a copy of the
    /// parameters, and clients that each send their own (an application name per process)
    /// must not make every idle client carry one.
    const STARTUP_MEMO_MAX: usize = 256;
    /// Logins turned away from a full memo before it is swept of what no client uses.
    const STARTUP_SWEEP_AFTER: usize = 64;

    pub fn intern(&self, settings: Settings) -> Arc<Settings> {
        if settings.is_empty() {
            return Arc::default();
        }
        let key = fixed_hash(&settings);
        let mut map = self.by_hash.lock();
        if let Some(existing) = map.get(&key).and_then(std::sync::Weak::upgrade) {
            if *existing == settings {
                return existing;
            }
        }
        if map.len() >= Self::SWEEP_AT {
            map.retain(|_, w| w.strong_count() > 0);
        }
        let shared = Arc::new(settings);
        map.insert(key, Arc::downgrade(&shared));
        shared
    }

    /// The settings and routing flags a startup packet's `params` make: remembered from an
    /// earlier login that sent the same, or made by `make` and interned.
    pub(super) fn settings_for_startup(
        &self,
        params: &[(String, String)],
        make: impl FnOnce(&[(String, String)]) -> (Settings, StartupFlags),
    ) -> (Arc<Settings>, StartupFlags) {
        let key = fixed_hash(params);
        if let Some(memo) = self.by_startup.lock().by_hash.get(&key) {
            if memo.params == params {
                return (memo.settings.clone(), memo.flags);
            }
        }
        let (settings, flags) = make(params);
        let settings = self.intern(settings);
        let memo = StartupMemo {
            params: params.to_vec(),
            settings: settings.clone(),
            flags,
        };
        let mut memos = self.by_startup.lock();
        let memos = &mut *memos;
        if memos.by_hash.len() >= Self::STARTUP_MEMO_MAX && !memos.by_hash.contains_key(&key) {
            memos.turned_away += 1;
            if memos.turned_away < Self::STARTUP_SWEEP_AFTER {
                return (settings, flags);
            }
            memos.turned_away = 0;
            memos.sweep_unused();
        }
        if memos.by_hash.len() < Self::STARTUP_MEMO_MAX || memos.by_hash.contains_key(&key) {
            memos.by_hash.insert(key, memo);
        }
        (settings, flags)
    }

    #[cfg(test)]
    fn startup_memo_len(&self) -> usize {
        self.by_startup.lock().by_hash.len()
    }
}

#[cfg(test)]
mod tests {
    use super::super::startup_settings;
    use super::*;

    fn owned(list: &[(&str, &str)]) -> Vec<(String, String)> {
        list.iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect()
    }

    /// [`startup_settings`], counting in `made` how often it ran.
    fn counting(
        made: &std::cell::Cell<usize>,
    ) -> impl Fn(&[(String, String)]) -> (Settings, StartupFlags) + Copy + '_ {
        move |p| {
            made.set(made.get() + 1);
            startup_settings(p)
        }
    }

    /// A login that sends what an earlier one sent gets its settings without making them
    /// again, even with no client left from the earlier login (a client that connects per
    /// transaction); one that differs in a value gets its own; the memo stays bounded, and
    /// when full it lets go of what no client uses, never of what one does.
    #[test]
    fn startup_settings_are_remembered_by_the_parameters_sent() {
        let interner = Interner::default();
        let made = std::cell::Cell::new(0);
        let make = counting(&made);
        let sent = owned(&[
            ("user", "u"),
            ("database", "d"),
            ("application_name", "app"),
            ("options", "-c default_transaction_read_only=on"),
        ]);
        let (first, flags) = interner.settings_for_startup(&sent, make);
        let (second, again) = interner.settings_for_startup(&sent, make);
        assert_eq!(made.get(), 1);
        assert!(Arc::ptr_eq(&first, &second));
        assert_eq!(again, flags);
        assert!(flags.default_transaction_read_only);
        let kept = (*first).clone();
        drop((first, second));
        let (after_the_last_left, flags) = interner.settings_for_startup(&sent, make);
        assert_eq!(made.get(), 1);
        assert_eq!(*after_the_last_left, kept);
        assert!(flags.default_transaction_read_only);

        let other = owned(&[("user", "u"), ("application_name", "other")]);
        let (third, _) = interner.settings_for_startup(&other, make);
        assert_eq!(made.get(), 2);
        assert_ne!(*third, kept);
        drop(third);
        let bare = owned(&[("user", "u"), ("database", "d")]);
        let (none, bare_flags) = interner.settings_for_startup(&bare, make);
        let (_, _) = interner.settings_for_startup(&bare, make);
        assert_eq!(made.get(), 3);
        assert!(none.is_empty());
        assert_eq!(bare_flags, StartupFlags::default());

        for i in 0..1000 {
            let name = format!("app{i}");
            let _ = interner.settings_for_startup(&owned(&[("application_name", &name)]), make);
        }
        assert_eq!(made.get(), 1003);
        assert!(interner.startup_memo_len() <= Interner::STARTUP_MEMO_MAX);
        // Used all along: still remembered. Used by no one: let go, and made again.
        let (_, _) = interner.settings_for_startup(&sent, make);
        assert_eq!(made.get(), 1003);
        let (_, _) = interner.settings_for_startup(&other, make);
        assert_eq!(made.get(), 1004);
    }

    /// Packets that differ only in the database make the same settings, shared. While a
    /// client uses them, a full memo keeps every packet that makes them; once none does, a
    /// sweep lets go of all of them, though each is held by the others' entries too.
    #[test]
    fn a_full_memo_lets_go_of_settings_only_its_own_entries_share() {
        let interner = Interner::default();
        let made = std::cell::Cell::new(0);
        let make = counting(&made);
        let tenant = |n: usize| {
            let database = format!("tenant{n}");
            owned(&[("database", &database), ("application_name", "app")])
        };
        let newcomer = |n: usize| owned(&[("application_name", &format!("new{n}"))]);
        let (kept, _) = interner.settings_for_startup(&tenant(0), make);
        for n in 1..Interner::STARTUP_MEMO_MAX {
            let _ = interner.settings_for_startup(&tenant(n), make);
        }
        assert_eq!(interner.startup_memo_len(), Interner::STARTUP_MEMO_MAX);
        assert_eq!(made.get(), Interner::STARTUP_MEMO_MAX);
        for n in 0..Interner::STARTUP_SWEEP_AFTER {
            let _ = interner.settings_for_startup(&newcomer(n), make);
        }
        assert_eq!(interner.startup_memo_len(), Interner::STARTUP_MEMO_MAX);
        let (again, _) = interner.settings_for_startup(&tenant(1), make);
        assert!(Arc::ptr_eq(&kept, &again));

        drop((kept, again));
        for n in 0..Interner::STARTUP_SWEEP_AFTER {
            let _ = interner.settings_for_startup(&newcomer(n), make);
        }
        // Swept to nothing, then the packet that set the sweep off is remembered.
        assert_eq!(interner.startup_memo_len(), 1);
        let before = made.get();
        let _ = interner.settings_for_startup(&tenant(1), make);
        assert_eq!(made.get(), before + 1, "tenant 1 was let go");
    }
}
