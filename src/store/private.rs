//! The store holds every captured prompt and response: only the user llmtap runs as may read it.
//!
//! Modes are set explicitly rather than by changing the process umask: a umask is process-wide (it would also
//! apply to files other parts of llmtap create) and only ever removes bits, so it cannot fix a store an earlier
//! version left 0644. The database file is created 0600 before SQLite opens it; SQLite gives the `-wal` and
//! `-shm` files it creates the database file's mode (it `fchmod`s them, so the umask does not matter). Files an
//! earlier llmtap left readable by others are narrowed whenever llmtap opens the store for writing. A data directory llmtap
//! creates is 0700; an existing one is left as the user made it.

use std::path::Path;

use super::StoreError;

#[cfg(unix)]
pub(super) fn create_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    if dir.is_dir() {
        return Ok(());
    }
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)
}

#[cfg(not(unix))]
pub(super) fn create_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)
}

/// Create the database file 0600 if it is missing; narrow it and its `-wal`/`-shm` to the owner if they exist.
#[cfg(unix)]
pub(super) fn prepare_files(db: &Path) -> Result<(), StoreError> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let err = |path: &Path| {
        let path = path.to_owned();
        move |source| StoreError::Permissions { path, source }
    };
    if !db.exists() {
        // `create_new`: a file that appeared meanwhile (another llmtap) is not ours to create.
        match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(db)
        {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(err(db)(e)),
        }
    }
    let mut sidecars = [db.to_owned(), db.to_owned(), db.to_owned()];
    sidecars[1].as_mut_os_string().push("-wal");
    sidecars[2].as_mut_os_string().push("-shm");
    for path in &sidecars {
        let Ok(meta) = std::fs::metadata(path) else { continue };
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            // A read-only store is reported by the write check that follows, with its path: not here.
            let _ = std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode & 0o700));
        }
    }
    Ok(())
}

#[cfg(not(unix))]
pub(super) fn prepare_files(_db: &Path) -> Result<(), StoreError> {
    Ok(())
}
