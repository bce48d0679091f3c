//! `[store]`: the local SQLite store's batching and retention, and the team's shared PostgreSQL store.

use serde::{Deserialize, Deserializer, de::Error};

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StoreConfig {
    /// Records per write transaction at most (at least 1).
    #[serde(deserialize_with = "super::serde_units::at_least_one")]
    pub batch_size: usize,
    /// 0 = keep forever.
    pub retention_days: u64,
    /// 0 = unbounded.
    pub max_traces: u64,
    /// The team's shared PostgreSQL store, when configured: where this replica delivers its records and what
    /// the viewer and the API read.
    pub url: Option<SharedStoreUrl>,
    /// This replica's name in the shared store; None: a random id kept in the data dir (stable across
    /// restarts).
    #[serde(deserialize_with = "non_empty")]
    pub replica: Option<String>,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            batch_size: 4096,
            retention_days: 30,
            max_traces: 0,
            url: None,
            replica: None,
        }
    }
}

/// `postgres://…`. It may hold a password, so it is never shown as is: `Debug` prints it redacted.
#[derive(Clone)]
pub struct SharedStoreUrl(String);

impl SharedStoreUrl {
    /// Err: why it is not a PostgreSQL URL (the URL shown redacted).
    pub fn parse(url: &str) -> Result<SharedStoreUrl, String> {
        if is_postgres_url(url) {
            Ok(SharedStoreUrl(url.to_owned()))
        } else {
            Err(format!(
                "{} is not a PostgreSQL URL (postgres://user@host:5432/db)",
                redacted_url(url)
            ))
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for SharedStoreUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&redacted_url(&self.0))
    }
}

impl<'de> Deserialize<'de> for SharedStoreUrl {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        SharedStoreUrl::parse(&String::deserialize(d)?).map_err(D::Error::custom)
    }
}

fn non_empty<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    Ok(Option::<String>::deserialize(d)?.filter(|s| !s.is_empty()))
}

/// A URL that names the shared store.
pub fn is_postgres_url(s: &str) -> bool {
    s.starts_with("postgres://") || s.starts_with("postgresql://")
}

/// `url` with any password replaced by `***` (`postgres://user:***@host/db`).
pub fn redacted_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return "postgres://(unparsable)".into();
    };
    let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    // A password may also come as a query parameter (libpq's `?password=`).
    let tail = match tail.split_once("password=") {
        Some((before, after)) => {
            let end = after.find('&').unwrap_or(after.len());
            format!("{before}password=***{}", &after[end..])
        }
        None => tail.to_owned(),
    };
    let url = format!("{scheme}://{authority}{tail}");
    match authority.rsplit_once('@') {
        Some((userinfo, host)) => match userinfo.split_once(':') {
            Some((user, _password)) => format!("{scheme}://{user}:***@{host}{tail}"),
            None => url,
        },
        None => url,
    }
}
