//! The spill's files: `<data_dir>/spill/<sequence>.seg`, each an 8-byte header then records (see
//! [`super::record`]), numbered in the order they were written. One thread owns them (the spill stage), so
//! nothing here locks.
//!
//! Writing appends to the newest segment (a new one past [`SEGMENT_BYTES`]), a batch of records per write (see
//! [`Segments::append`] and [`Segments::flush`]). Reading takes the oldest
//! segment into memory (closing it first if it is the one being written: the next record starts a new one)
//! and hands its records out in order. Before a batch of records is handed to the pipeline, the offset past
//! it is written to the segment's cursor file `<sequence>.pos`; a segment is deleted once all of it has been
//! handed out. After a kill -9, reading resumes at the cursor: a record is never handed out twice (a second
//! pass through derivation would store its steps again under a new trajectory), and what a kill -9 can lose
//! is what had been handed over to the pipeline and was not stored yet, as without a spill, and the records of
//! a routing pass not yet written (the stage writes them at the end of each pass). The cursor is
//! written without `fsync`: it must survive the process dying, not the machine.
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
/// Records are written in batches of about this many bytes (see [`Segments::wants_flush`]).
pub const FLUSH_BYTES: usize = 256 * 1024;
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

/// The segment being handed out: its records still in memory and where its cursor is kept.
struct Current {
    seq: u64,
    /// Records not handed out yet: (exchange, frame length, offset just past it in the segment).
    records: VecDeque<(RawExchange, u64, u64)>,
    cursor: Option<File>,
}

/// The segments on disk and the records of the one being handed out.
pub struct Segments {
    dir: PathBuf,
    /// Segments not started yet, oldest first: (sequence, bytes).
    on_disk: VecDeque<(u64, u64)>,
    /// The newest segment while it is open for appending (the last of `on_disk`).
    writer: Option<Writer>,
    next_seq: u64,
    current: Option<Current>,
    /// Bytes of segments not started (records appended and not yet written included) plus frames of
    /// `current` not handed out: what `capture.spill_bytes` bounds.
    bytes: u64,
    /// Records appended since the last flush, framed, in order (see [`Segments::append`]).
    pending: Vec<u8>,
}

impl Segments {
    /// Open (creating) the spill directory; segments a previous run left are the backlog, oldest first,
    /// each from its cursor.
    pub fn open(dir: &Path) -> Result<Segments, SpillError> {
        let io = |source| SpillError::Io {
            path: dir.to_owned(),
            source,
        };
        create_dir(dir).map_err(io)?;
        let mut on_disk = Vec::new();
        let mut cursors = Vec::new();
        for entry in std::fs::read_dir(dir).map_err(io)? {
            let entry = entry.map_err(io)?;
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            if let Some(seq) = name.strip_suffix(".seg").and_then(|n| n.parse::<u64>().ok()) {
                let len = entry.metadata().map_err(io)?.len();
                on_disk.push((seq, len));
            } else if let Some(seq) = name.strip_suffix(".pos").and_then(|n| n.parse::<u64>().ok()) {
                cursors.push(seq);
            }
        }
        on_disk.sort_unstable();
        let spill = Segments {
            dir: dir.to_owned(),
            next_seq: on_disk.last().map_or(0, |(s, _)| s + 1),
            bytes: on_disk.iter().map(|(_, l)| l).sum(),
            on_disk: on_disk.into(),
            writer: None,
            current: None,
            pending: Vec::new(),
        };
        // A cursor whose segment is gone: the segment was finished and deleted just before a crash.
        for seq in cursors {
            if !spill.on_disk.iter().any(|(s, _)| *s == seq) {
                let _ = std::fs::remove_file(spill.cursor_path(seq));
            }
        }
        Ok(spill)
    }

    /// Nothing waiting, on disk or loaded.
    pub fn is_empty(&self) -> bool {
        self.on_disk.is_empty() && self.current.is_none()
    }

    /// Bytes waiting (the `llmtap_capture_spill_bytes` gauge).
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    fn path(&self, seq: u64) -> PathBuf {
        self.dir.join(format!("{seq:020}.seg"))
    }

    fn cursor_path(&self, seq: u64) -> PathBuf {
        self.dir.join(format!("{seq:020}.pos"))
    }

    /// Append `exchange` unless the spill would then hold more than `limit` bytes. Returns the frame's length.
    /// The record is only encoded here: it reaches the file with the next [`Segments::flush`], one write for
    /// every record appended since (a write per record costs the spill thread more than encoding it). Until
    /// then it counts against `limit` like a written one.
    pub fn append(&mut self, exchange: &RawExchange, limit: u64) -> Result<u64, SpillError> {
        let seq = match &self.writer {
            Some(w) => w.seq,
            None => self.next_seq,
        };
        let at = self.pending.len();
        let frame = record::encode(exchange, &mut self.pending).map_err(|source| SpillError::Record {
            path: self.path(seq),
            source,
        })? as u64;
        let header = if self.writer.is_none() { MAGIC.len() as u64 } else { 0 };
        if self.bytes + frame + header > limit {
            self.pending.truncate(at);
            return Err(SpillError::Full);
        }
        if self.writer.is_none() {
            let path = self.path(seq);
            let opened = create_file(&path).and_then(|mut file| {
                reserve_blocks(&file);
                file.write_all(MAGIC).map(|()| file)
            });
            let file = match opened {
                Ok(file) => file,
                Err(source) => {
                    self.pending.truncate(at);
                    let _ = std::fs::remove_file(&path);
                    return Err(SpillError::Io { path, source });
                }
            };
            self.next_seq += 1;
            self.on_disk.push_back((seq, 0));
            self.grow(MAGIC.len() as u64);
            self.writer = Some(Writer { seq, file });
        }
        self.grow(frame);
        Ok(frame)
    }

    /// Records are waiting for [`Segments::flush`] and it is time to write them: they fill a write of
    /// [`FLUSH_BYTES`], or the open segment is full (the next record must start a new one).
    pub fn wants_flush(&self) -> bool {
        self.pending.len() >= FLUSH_BYTES
            || (!self.pending.is_empty() && self.on_disk.back().is_some_and(|(_, l)| *l >= SEGMENT_BYTES))
    }

    /// Write the records appended since the last flush, in one write. On failure none of them counts as
    /// spilled (the caller drops them) and the segment is closed: its tail may be torn and reading stops there,
    /// so the next record starts a clean segment.
    pub fn flush(&mut self) -> Result<(), SpillError> {
        // `append` opens the segment before it keeps a record, and every place that closes it writes or
        // drops what is pending first: records are pending only while a segment is open.
        let (Some(w), false) = (self.writer.as_mut(), self.pending.is_empty()) else {
            return Ok(());
        };
        let seq = w.seq;
        if let Err(source) = w.file.write_all(&self.pending) {
            self.writer = None;
            self.pending.clear();
            // What reached the file is on disk and counted until the segment is read (and found torn).
            let path = self.path(seq);
            let len = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
            if let Some((_, l)) = self.on_disk.back_mut() {
                self.bytes = self.bytes - *l + len;
                *l = len;
            }
            return Err(SpillError::Io { path, source });
        }
        self.pending.clear();
        if self.pending.capacity() > 2 * FLUSH_BYTES {
            // One large record grew the buffer: do not keep that much memory for the next batch.
            self.pending = Vec::with_capacity(FLUSH_BYTES);
        }
        if self.on_disk.back().is_some_and(|(_, l)| *l >= SEGMENT_BYTES) {
            self.writer = None;
        }
        Ok(())
    }

    fn grow(&mut self, by: u64) {
        self.bytes += by;
        if let Some((_, l)) = self.on_disk.back_mut() {
            *l += by;
        }
    }

    /// Up to `max` of the oldest waiting exchanges, in order, with their cursors already moved past them (so
    /// the caller must hand them on: they are not read again). Errors (a damaged segment yields the records
    /// before the damage) go to `on_error`.
    /// Records appended and not flushed are written first (a caller that must know which exchanges a failed
    /// write lost flushes before taking, as the spill stage does).
    pub fn take(&mut self, max: usize, on_error: &mut dyn FnMut(SpillError)) -> Vec<RawExchange> {
        if let Err(e) = self.flush() {
            on_error(e);
        }
        let mut out = Vec::new();
        while out.len() < max {
            if self.current.is_none() && !self.load_next(on_error) {
                break;
            }
            let Some(current) = self.current.as_mut() else { break };
            let mut end = None;
            while out.len() < max {
                let Some((exchange, frame, after)) = current.records.pop_front() else {
                    break;
                };
                self.bytes -= frame;
                end = Some(after);
                out.push(exchange);
            }
            let seq = current.seq;
            if current.records.is_empty() {
                // All handed out: the segment and its cursor go.
                self.current = None;
                for path in [self.path(seq), self.cursor_path(seq)] {
                    match std::fs::remove_file(&path) {
                        Ok(()) => {}
                        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                        Err(source) => on_error(SpillError::Io { path, source }),
                    }
                }
            } else if let Some(end) = end {
                self.save_cursor(seq, end, on_error);
            }
        }
        out
    }

    fn save_cursor(&mut self, seq: u64, at: u64, on_error: &mut dyn FnMut(SpillError)) {
        let path = self.cursor_path(seq);
        let Some(current) = self.current.as_mut() else { return };
        if current.cursor.is_none() {
            match create_file(&path) {
                Ok(f) => current.cursor = Some(f),
                Err(source) => return on_error(SpillError::Io { path, source }),
            }
        }
        if let Some(mut f) = current.cursor.as_ref() {
            use std::io::{Seek, SeekFrom};
            let written = f.seek(SeekFrom::Start(0)).and_then(|_| f.write_all(&at.to_le_bytes()));
            if let Err(source) = written {
                on_error(SpillError::Io { path, source });
            }
        }
    }

    /// Read the oldest segment not started into memory, from its cursor. False when none is left.
    fn load_next(&mut self, on_error: &mut dyn FnMut(SpillError)) -> bool {
        while let Some((seq, len)) = self.on_disk.pop_front() {
            if self.writer.as_ref().is_some_and(|w| w.seq == seq) {
                self.writer = None;
            }
            self.bytes -= len;
            let path = self.path(seq);
            let buffer = match read_all(&path) {
                Ok(b) => Bytes::from(b),
                Err(source) => {
                    on_error(SpillError::Io {
                        path: path.clone(),
                        source,
                    });
                    let _ = std::fs::remove_file(&path);
                    continue;
                }
            };
            let mut records = VecDeque::new();
            if buffer.starts_with(MAGIC) {
                let mut at = read_cursor(&self.cursor_path(seq)).unwrap_or(0).max(MAGIC.len() as u64) as usize;
                while at < buffer.len() {
                    match record::decode(&buffer, at) {
                        Ok((exchange, frame)) => {
                            at += frame;
                            self.bytes += frame as u64;
                            records.push_back((exchange, frame as u64, at as u64));
                        }
                        Err(source) => {
                            // Nothing after a bad frame can be trusted to start a record: the rest is skipped.
                            on_error(SpillError::Record {
                                path: path.clone(),
                                source,
                            });
                            break;
                        }
                    }
                }
            } else {
                on_error(SpillError::Header { path: path.clone() });
            }
            if records.is_empty() {
                let _ = std::fs::remove_file(&path);
                let _ = std::fs::remove_file(self.cursor_path(seq));
                continue;
            }
            self.current = Some(Current {
                seq,
                records,
                cursor: None,
            });
            return true;
        }
        false
    }

    /// Write what is pending and flush the open segment to disk (at shutdown: what the spill holds must
    /// outlive the process).
    pub fn sync(&mut self) -> Result<(), SpillError> {
        self.flush()?;
        if let Some(w) = &self.writer {
            let path = self.path(w.seq);
            w.file.sync_all().map_err(|source| SpillError::Io { path, source })?;
        }
        Ok(())
    }
}

impl Drop for Segments {
    /// Records appended and not flushed are written: a caller that lets go of the spill without
    /// [`Segments::sync`] still leaves them on disk.
    fn drop(&mut self) {
        let _ = self.flush();
    }
}

fn read_cursor(path: &Path) -> Option<u64> {
    let bytes = std::fs::read(path).ok()?;
    Some(u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?))
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

/// Allocate a new segment's blocks up front (its size stays 0 until written). Appending into allocated blocks
/// skips the filesystem's per-page block reservation (ext4's delayed allocation), which was a third of the spill
/// thread's time at saturation. Best effort: a filesystem without `fallocate`, or a full one, gets plain appends.
#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
fn reserve_blocks(file: &File) {
    use std::os::fd::AsRawFd;
    // SAFETY: a valid open file descriptor; the call only allocates blocks past the end of the file.
    let _ = unsafe {
        libc::fallocate(
            file.as_raw_fd(),
            libc::FALLOC_FL_KEEP_SIZE,
            0,
            SEGMENT_BYTES as libc::off_t,
        )
    };
}

#[cfg(not(target_os = "linux"))]
fn reserve_blocks(_: &File) {}

/// A new segment or cursor file, 0600.
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

    fn take_all(s: &mut Segments, max: usize) -> (Vec<u128>, Vec<String>) {
        let mut errors = Vec::new();
        let mut out = Vec::new();
        loop {
            let batch = s.take(max, &mut |e| errors.push(e.to_string()));
            if batch.is_empty() {
                break;
            }
            out.extend(batch.into_iter().map(|e| e.id.as_u128()));
        }
        (out, errors)
    }

    fn ids(s: &mut Segments) -> Vec<u128> {
        let (out, errors) = take_all(s, 3);
        assert!(errors.is_empty(), "{errors:?}");
        out
    }

    fn files(dir: &Path) -> usize {
        std::fs::read_dir(dir).expect("dir").count()
    }

    fn big(id: u128) -> RawExchange {
        let mut e = RawExchange::for_test(id);
        e.request.body = [Bytes::from(vec![b'x'; 3 * 1024 * 1024])].into();
        e
    }

    /// Records come back in the order written, across segments; appends made while a segment is being
    /// handed out go after it; the byte count returns to zero and every file is gone.
    #[test]
    fn records_come_back_in_order_across_segments() {
        let dir = tempfile::tempdir().expect("tempdir");
        let spill = dir.path().join("spill");
        let mut s = Segments::open(&spill).expect("open");
        for id in 0..5 {
            s.append(&big(id), u64::MAX).expect("append");
            assert!(s.wants_flush(), "3 MiB is more than one write's worth");
            s.flush().expect("flush");
        }
        assert!(s.on_disk.len() >= 2, "{} segments", s.on_disk.len());
        let first: Vec<u128> = s
            .take(1, &mut |e| panic!("{e}"))
            .iter()
            .map(|e| e.id.as_u128())
            .collect();
        assert_eq!(first, [0]);
        s.append(&big(5), u64::MAX).expect("append");
        assert_eq!(ids(&mut s), [1, 2, 3, 4, 5]);
        assert_eq!(s.bytes(), 0);
        assert!(s.is_empty());
        assert_eq!(files(&spill), 0, "consumed segments and cursors deleted");
        // The spill is used again after running dry.
        s.append(&RawExchange::for_test(6), u64::MAX).expect("append");
        assert_eq!(ids(&mut s), [6]);
    }

    /// A restart (kill -9 included: nothing is flushed here) resumes each segment at its cursor: what was
    /// handed out is not handed out again, nothing else is lost.
    #[test]
    fn a_restart_resumes_at_the_cursor() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut s = Segments::open(dir.path()).expect("open");
        for id in 0..10 {
            s.append(&RawExchange::for_test(id), u64::MAX).expect("append");
        }
        let handed: Vec<u128> = s
            .take(3, &mut |e| panic!("{e}"))
            .iter()
            .map(|e| e.id.as_u128())
            .collect();
        assert_eq!(handed, [0, 1, 2]);
        s.append(&RawExchange::for_test(10), u64::MAX).expect("append");
        drop(s);
        let mut s = Segments::open(dir.path()).expect("reopen");
        assert!(!s.is_empty());
        assert!(s.bytes() > 0);
        s.append(&RawExchange::for_test(11), u64::MAX).expect("append");
        assert_eq!(ids(&mut s), (3..=11).collect::<Vec<_>>());
        assert_eq!(files(dir.path()), 0);
    }

    /// Appended records reach the file together at the flush, and a spill dropped without one still writes
    /// them.
    #[test]
    fn records_are_written_at_the_flush_and_at_drop() {
        let dir = tempfile::tempdir().expect("tempdir");
        let seg = dir.path().join(format!("{:020}.seg", 0));
        let mut s = Segments::open(dir.path()).expect("open");
        for id in 0..3 {
            s.append(&RawExchange::for_test(id), u64::MAX).expect("append");
        }
        assert!(!s.wants_flush(), "three small records are not a write's worth");
        let on_disk = || std::fs::metadata(&seg).expect("segment").len();
        assert_eq!(on_disk(), MAGIC.len() as u64, "nothing written before the flush");
        s.flush().expect("flush");
        assert_eq!(on_disk(), s.bytes());
        s.append(&RawExchange::for_test(3), u64::MAX).expect("append");
        drop(s);
        let mut s = Segments::open(dir.path()).expect("reopen");
        assert_eq!(ids(&mut s), [0, 1, 2, 3]);
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
        assert!(
            refused > 0 && s.bytes() <= 200,
            "{refused} refused, {} bytes",
            s.bytes()
        );
    }

    /// A torn tail (kill -9 mid-write) and a file that is not a segment: the records before the damage come
    /// back, each damage is one error, nothing panics, and the files are removed.
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
        std::fs::write(dir.path().join(format!("{:020}.pos", 7)), b"orphan").expect("write");
        let mut s = Segments::open(dir.path()).expect("reopen");
        let (got, errors) = take_all(&mut s, 10);
        assert_eq!(got, [0, 1]);
        assert_eq!(errors.len(), 2, "{errors:?}");
        assert!(errors[0].contains("cut short"), "{errors:?}");
        assert!(errors[1].contains("not a spill segment"), "{errors:?}");
        assert_eq!(s.bytes(), 0);
        assert_eq!(files(dir.path()), 0);
    }

    #[cfg(unix)]
    #[test]
    fn files_are_private() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let spill = dir.path().join("spill");
        let mut s = Segments::open(&spill).expect("open");
        for id in 0..3 {
            s.append(&RawExchange::for_test(id), u64::MAX).expect("append");
        }
        assert_eq!(s.take(1, &mut |e| panic!("{e}")).len(), 1);
        let mode = |p: &Path| std::fs::metadata(p).expect("meta").permissions().mode() & 0o777;
        assert_eq!(mode(&spill), 0o700);
        assert_eq!(mode(&spill.join(format!("{:020}.seg", 0))), 0o600);
        assert_eq!(mode(&spill.join(format!("{:020}.pos", 0))), 0o600);
    }
}
