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
}

impl Config {
    /// A configuration from owned pairs.
    pub fn new(entries: Vec<(String, String)>) -> Self {
        Config { entries }
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
        self.entries.iter().rev().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }

    /// The value of `key` parsed as `T`, or `default` when absent.
    pub fn get_or<T: FromStr>(&self, key: &str, default: T) -> Result<T, PluginError> {
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
