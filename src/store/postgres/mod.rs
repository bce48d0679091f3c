//! The shared store: one PostgreSQL database that every replica of a team delivers its records into, and that
//! the viewer, the CLI (`--store URL`) and the gRPC API can read the whole team's data from.
//!
//! Each replica keeps its local SQLite store as the spool: the store writer logs every record it commits in
//! `ship_log`, and the `shared-store` sink (`export::shared_store`) reads that log behind its own persisted
//! cursor and upserts the records here, in one transaction per batch. A database outage or a replica killed
//! with -9 therefore loses nothing (the records wait in the replica's file and the cursor did not move), and a
//! batch delivered twice changes nothing (every row is keyed by its id).
//!
//! Rows from different replicas merge by id: traces and steps have ids that agree across replicas, so a step
//! that two replicas derived is one row. A trajectory's summary is a sum over the calls one replica saw, so each
//! replica keeps its own part (`trajectory_parts`, keyed by trajectory and replica) and readers add the parts up
//! (`TrajectorySummary::absorb`). `sessions` holds one row per session key for the newest-first list.
//!
//! Blocking callers (the viewer's and the API's blocking pool, the CLI) use the [`Query`](super::Query) methods,
//! which run on this store's own small runtime; the shipping sink awaits [`PgStore::ship`].

mod annotations;
mod costs;
mod doc;
mod query;
mod schema;
mod search;
mod ship;

use std::future::Future;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use tokio::sync::OnceCell;

pub use ship::ShipBatch;

use super::StoreError;

/// The name of the shipping sink's cursor (in the local store's `cursors`), its metrics and its log lines.
pub const SHIP_CURSOR: &str = "shared-store";

/// The file in the data dir that keeps this replica's generated name.
const REPLICA_FILE: &str = "replica-id";

/// This replica's name in the shared store: the configured one, else a random id generated once and kept in
/// the data dir, so that a replica restarted over the same data dir (after `kill -9`, say) goes on writing its
/// own trajectory parts instead of adding a second copy of them.
pub fn replica_id(data_dir: &std::path::Path, configured: Option<&str>) -> std::io::Result<String> {
    if let Some(name) = configured {
        return Ok(name.to_owned());
    }
    let path = data_dir.join(REPLICA_FILE);
    match std::fs::read_to_string(&path) {
        Ok(id) if !id.trim().is_empty() => return Ok(id.trim().to_owned()),
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    std::fs::create_dir_all(data_dir)?;
    let id = format!("replica-{}", uuid::Uuid::now_v7().simple());
    // Written aside and renamed: two processes starting at once both end up with one name.
    let tmp = data_dir.join(format!("{REPLICA_FILE}.{}", std::process::id()));
    std::fs::write(&tmp, &id)?;
    std::fs::rename(&tmp, &path)?;
    Ok(std::fs::read_to_string(&path)?.trim().to_owned())
}

/// Connections one llmtap keeps to the database: readers of the viewer and API, and the shipping sink.
const POOL_SIZE: usize = 8;
/// How long getting a connection may take before the caller is told the store is unreachable.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

pub struct PgStore {
    /// Owns the pool's connections (their tasks run here), so that blocking readers on any thread, and the
    /// exporter's runtime, reach the database the same way. Taken apart without blocking on drop.
    rt: Option<tokio::runtime::Runtime>,
    pool: Pool,
    /// The URL without its password, for logs and errors.
    display: String,
    /// Migrations ran on this process's first connection.
    schema: Arc<OnceCell<()>>,
}

impl Drop for PgStore {
    fn drop(&mut self) {
        // Dropping a runtime blocks until its tasks end, which panics on an async thread (the API's handlers
        // hold the store): let it go in the background instead.
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

pub use crate::config::{is_postgres_url as is_url, redacted_url as redacted};

impl PgStore {
    /// A store for `url` (`postgres://user:password@host:port/db?sslmode=require`). Connects lazily: a replica
    /// starts while the database is down, and its records wait in its spool until the database is back.
    /// TLS (when the URL's `sslmode` asks for it, or `prefer`, the default, finds it offered) verifies the
    /// server against the Mozilla roots.
    pub fn connect(url: &str) -> Result<PgStore, StoreError> {
        let display = redacted(url);
        let config = tokio_postgres::Config::from_str(url).map_err(|e| StoreError::Shared {
            store: display.clone(),
            message: format!("not a PostgreSQL URL: {e}"),
        })?;
        let mut roots = rustls::RootCertStore::empty();
        roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
        let tls = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .map_err(|e| StoreError::Shared {
                store: display.clone(),
                message: format!("TLS setup: {e}"),
            })?
            .with_root_certificates(roots)
            .with_no_client_auth();
        let tls = tokio_postgres_rustls::MakeRustlsConnect::new(tls);
        let manager = Manager::from_config(
            config,
            tls,
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("llmtap-pg")
            .enable_all()
            .build()
            .map_err(StoreError::Thread)?;
        let pool = Pool::builder(manager)
            .max_size(POOL_SIZE)
            .runtime(deadpool_postgres::Runtime::Tokio1)
            .create_timeout(Some(CONNECT_TIMEOUT))
            .wait_timeout(Some(CONNECT_TIMEOUT))
            .build()
            .map_err(|e| StoreError::Shared {
                store: display.clone(),
                message: e.to_string(),
            })?;
        Ok(PgStore {
            rt: Some(rt),
            pool,
            display,
            schema: Arc::new(OnceCell::new()),
        })
    }

    /// The URL without its password.
    pub fn describe(&self) -> &str {
        &self.display
    }

    /// Connect now and bring the schema up to date: what the CLI does first, so that a wrong URL is one clear
    /// error.
    pub fn check(&self) -> Result<(), StoreError> {
        self.block(|c| async move {
            drop(c);
            Ok(())
        })
    }

    /// Run `f` with a pooled connection (schema ensured) on this store's runtime, and wait for it: for blocking
    /// callers only.
    fn block<T, F, Fut>(&self, f: F) -> Result<T, StoreError>
    where
        F: FnOnce(deadpool_postgres::Object) -> Fut,
        Fut: Future<Output = Result<T, StoreError>>,
    {
        let Some(rt) = &self.rt else {
            return Err(self.error("the store is shutting down"));
        };
        rt.block_on(async {
            let client = self.client().await?;
            f(client).await
        })
    }

    /// Run `f` with a pooled connection on this store's runtime, from any async context.
    async fn spawn<T, F, Fut>(&self, f: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(deadpool_postgres::Object) -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, StoreError>> + Send + 'static,
    {
        let Some(rt) = &self.rt else {
            return Err(self.error("the store is shutting down"));
        };
        let pool = self.pool.clone();
        let schema = self.schema.clone();
        let display = self.display.clone();
        let task = rt.spawn(async move {
            let client = connected(&pool, &schema, &display).await?;
            f(client).await
        });
        task.await.map_err(|e| self.error(&format!("store task failed: {e}")))?
    }

    async fn client(&self) -> Result<deadpool_postgres::Object, StoreError> {
        connected(&self.pool, &self.schema, &self.display).await
    }

    fn error(&self, message: &str) -> StoreError {
        StoreError::Shared {
            store: self.display.clone(),
            message: message.to_owned(),
        }
    }
}

/// A connection from the pool, after the schema is known to be current (migrated once per process).
async fn connected(pool: &Pool, schema: &OnceCell<()>, display: &str) -> Result<deadpool_postgres::Object, StoreError> {
    let mut client = pool.get().await.map_err(|e| StoreError::Shared {
        store: display.to_owned(),
        message: format!("cannot connect: {e}"),
    })?;
    schema.get_or_try_init(|| schema::migrate(&mut client, display)).await?;
    Ok(client)
}

/// A query parameter built at run time (the viewer's filters decide which there are).
pub(super) type Param = Box<dyn tokio_postgres::types::ToSql + Sync + Send>;

/// `params` as `Client::query` takes them.
pub(super) fn param_refs(params: &[Param]) -> Vec<&(dyn tokio_postgres::types::ToSql + Sync)> {
    params
        .iter()
        .map(|p| p.as_ref() as &(dyn tokio_postgres::types::ToSql + Sync))
        .collect()
}

/// A database error with the server's own message (tokio-postgres's `Display` says only "db error").
pub(super) fn db_error(display: &str, e: tokio_postgres::Error) -> StoreError {
    let message = match e.as_db_error() {
        Some(db) => format!("{}: {}", db.code().code(), db.message()),
        None => match std::error::Error::source(&e) {
            Some(source) => format!("{e}: {source}"),
            None => e.to_string(),
        },
    };
    StoreError::Shared {
        store: display.to_owned(),
        message,
    }
}

/// Whether a failed delivery may succeed later as it is (the database is down, restarting, overloaded, or two
/// replicas' transactions met in a deadlock) rather than refusing the data.
pub fn is_transient(e: &StoreError) -> bool {
    match e {
        StoreError::Shared { message, .. } => {
            // SQLSTATE classes 08 (connection), 40 (rollback: serialization, deadlock), 53 (resources), 57
            // (operator intervention: shutdown, restart), 58 (system); anything without a code is the network.
            let code = message.split(':').next().unwrap_or("");
            let is_code = code.len() == 5 && code.chars().all(|c| c.is_ascii_alphanumeric());
            !is_code || ["08", "40", "53", "57", "58"].iter().any(|c| code.starts_with(c))
        }
        _ => false,
    }
}

/// Whether the database refused llmtap's credentials or rights (SQLSTATE class 28, or 42501): a setting to fix,
/// not data to drop.
pub fn is_refused_credentials(e: &StoreError) -> bool {
    match e {
        StoreError::Shared { message, .. } => {
            let text = message.rsplit("cannot connect: ").next().unwrap_or(message);
            text.starts_with("28") || text.starts_with("42501") || text.contains("password authentication failed")
        }
        _ => false,
    }
}

impl PgStore {
    /// Deliver one batch of records from replica `replica`, in one transaction (all or nothing).
    pub async fn ship(self: &Arc<Self>, batch: Arc<ShipBatch>, replica: String) -> Result<(), StoreError> {
        let display = self.display.clone();
        self.spawn(move |mut client| async move { ship::upsert(&mut client, &batch, &replica, &display).await })
            .await
    }

    /// Delete what is older than `cutoff_us` (Unix micros): the shared store's retention, run by the shipping
    /// sinks of every replica (deleting the same rows twice is harmless).
    pub async fn retain(self: &Arc<Self>, cutoff_us: i64) -> Result<u64, StoreError> {
        let display = self.display.clone();
        self.spawn(move |client| async move { ship::retain(&client, cutoff_us, &display).await })
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_url_is_shown_without_its_password() {
        assert_eq!(redacted("postgres://u:s3cret@db:5432/x"), "postgres://u:***@db:5432/x");
        assert_eq!(
            redacted("postgresql://db/x?user=u&password=s3cret&sslmode=require"),
            "postgresql://db/x?user=u&password=***&sslmode=require"
        );
        assert_eq!(redacted("postgres://u@db/x"), "postgres://u@db/x");
        assert!(!redacted("postgres://u:p@ss@db/x").contains("p@ss"));
    }

    #[test]
    fn connection_and_rollback_failures_are_retried_and_refusals_are_not() {
        let e = |message: &str| StoreError::Shared {
            store: "s".into(),
            message: message.into(),
        };
        assert!(is_transient(&e("cannot connect: connection refused")));
        assert!(is_transient(&e("40P01: deadlock detected")));
        assert!(is_transient(&e(
            "57P01: terminating connection due to administrator command"
        )));
        assert!(!is_transient(&e("22P02: invalid input syntax")));
        assert!(!is_transient(&e("42501: permission denied for table traces")));
    }
}
