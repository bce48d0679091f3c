//! The spill's files: `<data_dir>/spill/<sequence>.seg`, each an 8-byte header then records (see
//! [`super::record`]), numbered in the order they were written. One thread owns them (the spill stage), so
//! nothing here locks.
//!
//! Writing appends to the newest segment (a new one past [`SEGMENT_BYTES`]). Reading takes the oldest
//! segment whole: it is read into one buffer, deleted, and its records handed out from memory; when the
//! oldest is the one being written, it is closed first and the next record starts a new one. Deleting on
//! read rather than after the store commits means a record is never processed twice (a second pass through
//! derivation would store its steps again under a new trajectory), at the price that a kill -9 loses the one
//! segment being handed out, as it loses what the in-memory queue holds (documented in docs/operations.md).
//!
//! Files are created 0600 in a 0700 directory: they hold prompts and responses as the store does (headers
//! were redacted before capture, see `proxy::redact`).

use std::collections::VecDeque;
use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use bytes::Bytes;

use super::record::{self, RecordError};
use crate::capture::RawExchange;

/// A segment is closed once it holds this much: reading takes a whole segment into memory, so this bounds
/// that memory (plus one record, which may be larger).
pub const SEGMENT_BYTES: u64 = 8 * 1024 * 1024;
/// First bytes of every segment: the format, so that a future format is refused rather than misread.
const MAGIC: &[u8; 8] = b"LLMTSPL1";

#[derive(Debug, thiserror::Error)]
pub enum SpillError {
    #[error("spill is full (capture.spill_bytes)")]
    Full,
    #[error("spill file {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("spill file {path}: {source}")]
    Record { path: PathBuf, source: RecordError },
    #[error("spill file {path} is not a spill segment")]
    Header { path: PathBuf },
}

struct Writer {
    seq: u64,
    file: File,
}

/// The segments on disk and the records of the one being handed out.
pub struct Segments {
    dir: PathBuf,
    /// Segments on disk, oldest first: (sequence, bytes).
    on_disk: VecDeque<(u64, u64)>,
    /// The newest segment while it is open for appending (the last of `on_disk`).
    writer: Option<Writer>,
    next_seq: u64,
    /// Records read from a deleted segment, not handed out yet, with their frame lengths, and that segment's
    /// number (to write them back under it at shutdown).
    loaded: VecDeque<(RawExchange, u64)>,
    loaded_seq: u64,
    /// Bytes of segments on disk plus frames in `loaded`: what `capture.spill_bytes` bounds.
    bytes: u64,
    scratch: Vec<u8>,
}

impl Segments {
    /// Open (creating) the spill directory; segments a previous run left are the backlog, oldest first.
    pub fn open(dir: &Path) -> Result<Segments, SpillError> {
        let io = |source| SpillError::Io {
            path: dir.to_owned(),
            source,
        };
        create_dir(dir).map_err(io)?;
        let mut on_disk = Vec::new();
        for entry in std::fs::read_dir(dir).map_err(io)? {
            let entry = entry.map_err(io)?;
            let name = entry.file_name();
            let Some(seq) = name
                .to_str()
                .and_then(|n| n.strip_suffix(".seg"))
                .and_then(|n| n.parse::<u64>().ok())
            else {
                continue;
            };
            let len = entry.metadata().map_err(io)?.len();
            on_disk.push((seq, len));
        }
        on_disk.sort_unstable();
        let next_seq = on_disk.last().map_or(0, |(s, _)| s + 1);
        let bytes = on_disk.iter().map(|(_, l)| l).sum();
        Ok(Segments {
            dir: dir.to_owned(),
            on_disk: on_disk.into(),
            writer: None,
            next_seq,
            loaded: VecDeque::new(),
            loaded_seq: 0,
            bytes,
            scratch: Vec::new(),
        })
    }

    /// Nothing waiting, on disk or loaded.
    pub fn is_empty(&self) -> bool {
        self.on_disk.is_empty() && self.loaded.is_empty()
    }

    /// Bytes waiting (the `llmtap_capture_spill_bytes` gauge).
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    fn path(&self, seq: u64) -> PathBuf {
        self.dir.join(format!("{seq:020}.seg"))
    }

    /// Append `exchange` unless the spill would then hold more than `limit` bytes. Returns the frame's length.
    /// A failed write closes the segment (its tail may be torn; reading stops there) so the next record
    /// starts a clean one.
    pub fn append(&mut self, exchange: &RawExchange, limit: u64) -> Result<u64, SpillError> {
        self.scratch.clear();
        let seq = match &self.writer {
            Some(w) => w.seq,
            None => self.next_seq,
        };
        let frame = record::encode(exchange, &mut self.scratch).map_err(|source| SpillError::Record {
            path: self.path(seq),
            source,
        })? as u64;
        let header = if self.writer.is_none() { MAGIC.len() as u64 } else { 0 };
        if self.bytes + frame + header > limit {
            return Err(SpillError::Full);
        }
        if self.writer.is_none() {
            let path = self.path(seq);
            let mut file = create_file(&path).map_err(|source| SpillError::Io { path: path.clone(), source })?;
            self.next_seq += 1;
            self.on_disk.push_back((seq, 0));
            let written = file.write_all(MAGIC);
            self.grow(MAGIC.len() as u64);
            written.map_err(|source| SpillError::Io { path, source })?;
            self.writer = Some(Writer { seq, file });
        }
        let Some(w) = self.writer.as_mut() else {
            return Err(SpillError::Full);
        };
        if let Err(source) = w.file.write_all(&self.scratch) {
            self.writer = None;
            // What reached the file is on disk and counted until the segment is read (and found torn).
            let path = self.path(seq);
            let len = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
            if let Some((_, l)) = self.on_disk.back_mut() {
                self.bytes = self.bytes - *l + len;
                *l = len;
            }
            return Err(SpillError::Io { path, source });
        }
        self.grow(frame);
        if self.on_disk.back().is_some_and(|(_, l)| *l >= SEGMENT_BYTES) {
            self.writer = None;
        }
        Ok(frame)
    }

    fn grow(&mut self, by: u64) {
        self.bytes += by;
        if let Some((_, l)) = self.on_disk.back_mut() {
            *l += by;
        }
    }

    /// The oldest waiting exchange and its frame length, loading the next segment when needed. Errors are
    /// reported through `on_error` (a damaged segment yields the records before the damage); `None` when the
    /// spill is empty.
    pub fn take(&mut self, on_error: &mut dyn FnMut(SpillError)) -> Option<(RawExchange, u64)> {
        while self.loaded.is_empty() {
            let (seq, len) = self.on_disk.pop_front()?;
            if self.writer.as_ref().is_some_and(|w| w.seq == seq) {
                self.writer = None;
            }
            self.bytes -= len;
            self.loaded_seq = seq;
            let path = self.path(seq);
            let read = read_all(&path);
            if let Err(source) = std::fs::remove_file(&path) {
                on_error(SpillError::Io { path: path.clone(), source });
            }
            let buffer = match read {
                Ok(b) => Bytes::from(b),
                Err(source) => {
                    on_error(SpillError::Io { path, source });
                    continue;
                }
            };
            if !buffer.starts_with(MAGIC) {
                on_error(SpillError::Header { path });
                continue;
            }
            let mut at = MAGIC.len();
            while at < buffer.len() {
                match record::decode(&buffer, at) {
                    Ok((exchange, frame)) => {
                        at += frame;
                        self.bytes += frame as u64;
                        self.loaded.push_back((exchange, frame as u64));
                    }
                    Err(source) => {
                        // Nothing after a bad frame can be trusted to start a record: the rest is skipped.
                        on_error(SpillError::Record { path, source });
                        break;
                    }
                }
            }
        }
        let (exchange, frame) = self.loaded.pop_front()?;
        self.bytes -= frame;
        Some((exchange, frame))
    }

    /// Give back what [`Segments::take`] returned (the pipeline had no room): it is next again.
    pub fn put_back(&mut self, exchange: RawExchange, frame: u64) {
        self.bytes += frame;
        self.loaded.push_front((exchange, frame));
    }

    /// At shutdown: write the loaded records back under their segment's number (older than every segment
    /// still on disk), so the next start hands them out first.
    pub fn persist_loaded(&mut self) -> Result<(), SpillError> {
        if self.loaded.is_empty() {
            return Ok(());
        }
        let path = self.path(self.loaded_seq);
        let io = |source| SpillError::Io {
            path: path.clone(),
            source,
        };
        let mut out = MAGIC.to_vec();
        for (exchange, _) in &self.loaded {
            record::encode(exchange, &mut out).map_err(|source| SpillError::Record {
                path: path.clone(),
                source,
            })?;
        }
        let mut file = create_file(&path).map_err(io)?;
        file.write_all(&out).map_err(io)?;
        file.sync_all().map_err(io)?;
        self.loaded.clear();
        Ok(())
    }

    /// Flush the open segment to disk (at shutdown: what the spill holds must outlive the process).
    pub fn sync(&mut self) -> Result<(), SpillError> {
        if let Some(w) = &self.writer {
            let path = self.path(w.seq);
            w.file.sync_all().map_err(|source| SpillError::Io { path, source })?;
        }
        Ok(())
    }
}

fn read_all(path: &Path) -> std::io::Result<Vec<u8>> {
    let mut file = File::open(path)?;
    let mut out = Vec::new();
    file.read_to_end(&mut out)?;
    Ok(out)
}

#[cfg(unix)]
fn create_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    if dir.is_dir() {
        // Narrowed like the store's files: an earlier copy left readable by others is fixed on open.
        let mode = std::fs::metadata(dir)?.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode & 0o700))?;
        }
        return Ok(());
    }
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)
}

#[cfg(not(unix))]
fn create_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)
}

/// A new segment, 0600 (replacing a file of that name: only `persist_loaded` reuses a number, for a segment
/// it deleted).
fn create_file(path: &Path) -> std::io::Result<File> {
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    options.open(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(s: &mut Segments) -> Vec<u128> {
        let mut errors = Vec::new();
        let out = std::iter::from_fn(|| s.take(&mut |e| errors.push(e.to_string())))
            .map(|(e, _)| e.id.as_u128())
            .collect();
        assert!(errors.is_empty(), "{errors:?}");
        out
    }

    fn big(id: u128) -> RawExchange {
        let mut e = RawExchange::for_test(id);
        e.request.body = [Bytes::from(vec![b'x'; 3 * 1024 * 1024])].into();
        e
    }

    /// Records come back in the order written, across segments and across a reopen; appends that arrive
    /// while a segment is being handed out go after it; the byte count returns to zero and files are gone.
    #[test]
    fn records_come_back_in_order_across_segments_and_reopening() {
        let dir = tempfile::tempdir().expect("tempdir");
        let spill = dir.path().join("spill");
        let mut s = Segments::open(&spill).expect("open");
        for id in 0..5 {
            s.append(&big(id), u64::MAX).expect("append");
        }
        assert!(s.on_disk.len() >= 2, "{} segments", s.on_disk.len());
        let first = s.take(&mut |e| panic!("{e}")).expect("first").0.id.as_u128();
        assert_eq!(first, 0);
        s.append(&big(5), u64::MAX).expect("append");
        drop(s);
        // A restart: what was loaded and not written back is lost (that is what persist_loaded is for), the
        // rest comes back in order after reopening.
        let mut s = Segments::open(&spill).expect("reopen");
        let rest = ids(&mut s);
        assert_eq!(rest.last(), Some(&5));
        assert!(rest.windows(2).all(|w| w[0] < w[1]), "{rest:?}");
        assert_eq!(s.bytes(), 0);
        assert_eq!(std::fs::read_dir(&spill).expect("dir").count(), 0, "consumed segments deleted");
    }

    #[test]
    fn loaded_records_written_back_at_shutdown_come_first_after_a_restart() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut s = Segments::open(dir.path()).expect("open");
        for id in 0..10 {
            s.append(&RawExchange::for_test(id), u64::MAX).expect("append");
        }
        let (e, f) = s.take(&mut |e| panic!("{e}")).expect("take");
        assert_eq!(e.id.as_u128(), 0);
        let (e1, _) = s.take(&mut |e| panic!("{e}")).expect("take");
        s.put_back(e1, f);
        s.append(&RawExchange::for_test(10), u64::MAX).expect("append");
        s.persist_loaded().expect("persist");
        s.sync().expect("sync");
        drop(s);
        let mut s = Segments::open(dir.path()).expect("reopen");
        assert_eq!(ids(&mut s), (1..=10).collect::<Vec<_>>());
    }

    #[test]
    fn the_limit_refuses_what_does_not_fit() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut s = Segments::open(dir.path()).expect("open");
        let frame = s.append(&RawExchange::for_test(1), 200).expect("fits");
        assert_eq!(s.bytes(), frame + MAGIC.len() as u64);
        let mut refused = 0;
        for id in 2..20 {
            if matches!(s.append(&RawExchange::for_test(id), 200), Err(SpillError::Full)) {
                refused += 1;
            }
        }
        assert!(refused > 0 && s.bytes() <= 200, "{refused} refused, {} bytes", s.bytes());
    }

    /// A torn tail (kill -9 mid-write) and a damaged header: the records before the damage come back, each
    /// damage is one error, nothing panics, and the files are removed.
    #[test]
    fn a_torn_tail_and_a_foreign_file_are_errors_not_panics() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut s = Segments::open(dir.path()).expect("open");
        for id in 0..3 {
            s.append(&RawExchange::for_test(id), u64::MAX).expect("append");
        }
        drop(s);
        let seg = dir.path().join(format!("{:020}.seg", 0));
        let len = std::fs::metadata(&seg).expect("segment").len();
        let f = std::fs::OpenOptions::new().write(true).open(&seg).expect("open");
        f.set_len(len - 5).expect("truncate");
        std::fs::write(dir.path().join(format!("{:020}.seg", 1)), b"not a segment").expect("write");
        let mut s = Segments::open(dir.path()).expect("reopen");
        let mut errors = Vec::new();
        let got: Vec<u128> = std::iter::from_fn(|| s.take(&mut |e| errors.push(e.to_string())))
            .map(|(e, _)| e.id.as_u128())
            .collect();
        assert_eq!(got, [0, 1]);
        assert_eq!(errors.len(), 2, "{errors:?}");
        assert!(errors[0].contains("cut short"), "{errors:?}");
        assert_eq!(s.bytes(), 0);
        assert_eq!(std::fs::read_dir(dir.path()).expect("dir").count(), 0);
    }

    #[cfg(unix)]
    #[test]
    fn files_are_private() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let spill = dir.path().join("spill");
        let mut s = Segments::open(&spill).expect("open");
        s.append(&RawExchange::for_test(1), u64::MAX).expect("append");
        let mode = |p: &Path| std::fs::metadata(p).expect("meta").permissions().mode() & 0o777;
        assert_eq!(mode(&spill), 0o700);
        assert_eq!(mode(&spill.join(format!("{:020}.seg", 0))), 0o600);
    }
}
