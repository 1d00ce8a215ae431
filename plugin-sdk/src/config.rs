//! Plugin configuration: the `key=value` pairs given to `init`.

use crate::PluginError;
use std::str::FromStr;

/// The configuration a plugin receives in `init`, with typed look-ups.
///
/// ```
/// use edl_plugin_sdk::Config;
/// let cfg = Config::from_pairs(&[("every", "50")]);
/// assert_eq!(cfg.get_or("every", 10u64).unwrap(), 50);
/// assert_eq!(cfg.get_or("by", 1u32).unwrap(), 1);
/// assert!(cfg.expect_only(&["every"]).is_ok());
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Config {
    entries: Vec<(String, String)>,
    /// Asked to describe itself ([`DESCRIBE`] given): the keys `init` looks
    /// up, each with its default and type as it reads them.
    described: std::cell::RefCell<Option<Vec<ConfigKey>>>,
}

/// The key that asks a plugin's `init` to describe its configuration
/// instead of starting (`edl-runtime plugin inspect` gives it).
pub const DESCRIBE: &str = "edl.describe";
/// What a described `init` fails with, before the description (JSON).
pub const DESCRIBED: &str = "edl-configuration:";

/// One key a plugin's configuration takes, as its `init` looked it up.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ConfigKey {
    pub key: String,
    /// Its default as text; None where `init` reads it without one.
    pub default: Option<String>,
    /// Its type, where `init` parsed it.
    pub kind: Option<String>,
}

impl Config {
    /// A configuration from owned pairs.
    pub fn new(mut entries: Vec<(String, String)>) -> Self {
        let describe = entries.iter().any(|(k, _)| k == DESCRIBE);
        entries.retain(|(k, _)| k != DESCRIBE);
        Config { entries, described: std::cell::RefCell::new(describe.then(Vec::new)) }
    }

    /// Notes that `init` looked `key` up (when describing).
    fn note(&self, key: &str, default: Option<String>, kind: Option<&str>) {
        if let Some(keys) = self.described.borrow_mut().as_mut() {
            match keys.iter_mut().find(|k| k.key == key) {
                Some(k) => {
                    k.default = k.default.take().or(default);
                    k.kind = k.kind.take().or(kind.map(str::to_string));
                }
                None => keys.push(ConfigKey { key: key.into(), default, kind: kind.map(str::to_string) }),
            }
        }
    }

    /// After `init`: when asked to describe the configuration, the keys it
    /// looked up, as an error the host reads (the SDK's export glue calls
    /// this; a plugin need not).
    pub fn described(&self) -> Result<(), PluginError> {
        match self.described.borrow().as_ref() {
            None => Ok(()),
            Some(keys) => Err(PluginError::InvalidConfig(format!(
                "{DESCRIBED}{}",
                serde_json::to_string(keys).unwrap_or_default()
            ))),
        }
    }

    /// A configuration from borrowed pairs (handy in tests).
    pub fn from_pairs(pairs: &[(&str, &str)]) -> Self {
        Config::new(pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect())
    }

    /// All pairs, in the order given.
    pub fn entries(&self) -> &[(String, String)] {
        &self.entries
    }

    /// The raw value of `key` (the last one wins when given twice).
    pub fn raw(&self, key: &str) -> Option<&str> {
        self.note(key, None, None);
        self.entries.iter().rev().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }

    /// The value of `key` parsed as `T`, or `default` when absent.
    pub fn get_or<T: FromStr + std::fmt::Display>(&self, key: &str, default: T) -> Result<T, PluginError> {
        self.note(key, Some(default.to_string()), Some(std::any::type_name::<T>()));
        match self.raw(key) {
            None => Ok(default),
            Some(v) => v.trim().parse().map_err(|_| {
                PluginError::InvalidConfig(format!(
                    "`{key}` = {v:?} is not a valid {}",
                    std::any::type_name::<T>()
                ))
            }),
        }
    }

    /// Fails on any key not in `known`, naming it and the accepted ones.
    pub fn expect_only(&self, known: &[&str]) -> Result<(), PluginError> {
        known.iter().for_each(|k| self.note(k, None, None));
        match self.entries.iter().find(|(k, _)| !known.contains(&k.as_str())) {
            None => Ok(()),
            Some((k, _)) => {
                Err(PluginError::InvalidConfig(format!("unknown key `{k}` (accepted: {})", known.join(", "))))
            }
        }
    }
}

impl From<Vec<(String, String)>> for Config {
    fn from(entries: Vec<(String, String)>) -> Self {
        Config::new(entries)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn asked_to_describe_itself_a_configuration_lists_what_init_looked_up() {
        let cfg = Config::from_pairs(&[(DESCRIBE, "1")]);
        cfg.expect_only(&["every", "by", "start"]).unwrap();
        assert_eq!(cfg.get_or("every", 100u64).unwrap(), 100);
        assert_eq!(cfg.get_or("by", 1u32).unwrap(), 1);
        assert_eq!(cfg.raw("start"), None);
        let Err(PluginError::InvalidConfig(said)) = cfg.described() else { panic!("not described") };
        let keys: Vec<ConfigKey> = serde_json::from_str(said.strip_prefix(DESCRIBED).unwrap()).unwrap();
        let shown: Vec<(&str, Option<&str>)> =
            keys.iter().map(|k| (k.key.as_str(), k.default.as_deref())).collect();
        assert_eq!(shown, [("every", Some("100")), ("by", Some("1")), ("start", None)]);
        assert_eq!(keys[0].kind.as_deref(), Some("u64"));
        // Not asked: nothing is recorded and init goes on as ever.
        let plain = Config::from_pairs(&[("every", "5")]);
        assert_eq!(plain.get_or("every", 100u64).unwrap(), 5);
        assert!(plain.described().is_ok());
    }
}
