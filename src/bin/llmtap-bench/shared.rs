//! The shared PostgreSQL store at scale (`LLMTAP_BENCH_PG_URL`, an empty database): `sessions` one-call
//! sessions written through the real store writer with the ship log on, delivered to PostgreSQL the way the
//! `shared-store` sink does (its batches, one transaction each, one at a time), then the viewer's sessions list
//! timed on both stores side by side.

use std::sync::Arc;
use std::time::Instant;

use llmtap::config::{SharedStoreUrl, StoreConfig};
use llmtap::export::shared_store::{BATCH, batch_of};
use llmtap::model::record::ExportSeq;
use llmtap::store::postgres::PgStore;
use llmtap::store::{LogTable, StoreError, StoreReader};

pub fn run(sessions: usize) {
    let Ok(url) = std::env::var("LLMTAP_BENCH_PG_URL") else {
        println!("shared store: skipped (set LLMTAP_BENCH_PG_URL to an empty PostgreSQL database)");
        return;
    };
    let dir = std::env::temp_dir().join(format!("llmtap-bench-shared-{}", std::process::id()));
    if let Err(e) = measure(&dir, &url, sessions) {
        eprintln!("llmtap-bench shared-store: {e}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

fn measure(dir: &std::path::Path, url: &str, sessions: usize) -> Result<(), StoreError> {
    let config = StoreConfig {
        url: Some(SharedStoreUrl::parse(url).map_err(|message| StoreError::Shared {
            store: "shared store".into(),
            message,
        })?),
        replica: Some("bench".into()),
        ..StoreConfig::default()
    };
    let t0 = Instant::now();
    let start = super::viewer::build_flood(dir, sessions, config)?;
    println!(
        "shared store: {sessions} one-call sessions stored locally in {:.1} s",
        t0.elapsed().as_secs_f64()
    );

    let pg = Arc::new(PgStore::connect(url)?);
    pg.check()?;
    let reader = StoreReader::open(dir)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(StoreError::Thread)?;
    let t0 = Instant::now();
    let mut after = ExportSeq(0);
    let (mut entries_sent, mut rows) = (0usize, 0usize);
    // Reading the records back and encoding them (the sink's build, on a blocking thread) vs. the database.
    let (mut building, mut shipping) = (std::time::Duration::ZERO, std::time::Duration::ZERO);
    loop {
        let entries = reader.log_entries(LogTable::Ship, after, BATCH)?;
        let Some(last) = entries.last() else { break };
        after = last.seq;
        entries_sent += entries.len();
        let t = Instant::now();
        let batch = batch_of(&reader, &entries)?;
        building += t.elapsed();
        rows += batch.len();
        let t = Instant::now();
        rt.block_on(pg.ship(Arc::new(batch), "bench".into()))?;
        shipping += t.elapsed();
    }
    let secs = t0.elapsed().as_secs_f64();
    println!(
        "shared store: delivered {sessions} calls ({entries_sent} ship-log entries, {rows} rows) in {secs:.1} s: \
         {:.0} calls/s, {:.0} rows/s, one batch at a time ({:.1} s reading and encoding, {:.1} s in PostgreSQL)",
        sessions as f64 / secs,
        rows as f64 / secs,
        building.as_secs_f64(),
        shipping.as_secs_f64()
    );
    println!("  SQLite:");
    super::viewer::measure_flood(&reader, sessions, start)?;
    println!("  PostgreSQL:");
    super::viewer::measure_flood(pg.as_ref(), sessions, start)?;
    Ok(())
}
