//! Results files: append-only JSONL logs of keyed rows that survive kills,
//! corrupt lines and concurrent writers.
//!
//! * Every access happens under an exclusive advisory lock on a sidecar
//!   `<file>.lock` (std's `File::lock`), so several sweeps may append to one
//!   file: a key is written once, and lines never interleave.
//! * A line that is not a result row (not UTF-8, not JSON, no `key`, a torn
//!   last line left by a kill, or a second row with a key already present) is
//!   never silently dropped and never costs the rows after it: it is moved
//!   to `<file>.rejected` with its line number and the reason, reported, and
//!   the valid rows are kept in order (the file is rewritten atomically).

use minikv_core::{Error, Result};
use serde_json::{Value, json};
use std::collections::HashSet;
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

/// A line moved aside.
#[derive(Debug, Clone, PartialEq)]
pub struct Rejected {
    /// 1-based line number in the file as it was.
    pub line: usize,
    /// Why it is not a row.
    pub reason: String,
    /// The line (lossy UTF-8), at most 200 characters.
    pub text: String,
}

/// An open results log.
#[derive(Debug)]
pub struct ResultsLog {
    path: PathBuf,
    lock_path: PathBuf,
    keys: HashSet<String>,
    /// Bytes of the file already scanned.
    scanned: u64,
}

/// Parses one line (without its newline) as a result row: a UTF-8 JSON
/// object with a string `key` and `task` and an object `metrics`. Returns the
/// key and the row, or why the line is not a row.
pub fn parse_row(line: &[u8]) -> std::result::Result<(String, Value), String> {
    let s = std::str::from_utf8(line).map_err(|_| "not valid UTF-8".to_string())?;
    let v: Value = serde_json::from_str(s).map_err(|e| format!("not JSON: {e}"))?;
    let key = v.get("key").and_then(Value::as_str).map(str::to_owned);
    match key {
        Some(k) if v["task"].is_string() && v["metrics"].is_object() => Ok((k, v)),
        _ => Err("not a result row (needs `key`, `task` and `metrics`)".into()),
    }
}

/// Classifies one complete line of the log: a row with a new key, or why not.
fn classify(line: &[u8], keys: &HashSet<String>) -> std::result::Result<String, String> {
    let (key, _) = parse_row(line)?;
    if keys.contains(&key) {
        return Err(format!("duplicate key {key}"));
    }
    Ok(key)
}

fn sidecar(path: &Path, ext: &str) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(ext);
    PathBuf::from(s)
}

impl ResultsLog {
    /// Opens (creating) `path`, repairing it if needed; returns the lines moved
    /// aside to `<path>.rejected`.
    pub fn open(path: &Path) -> Result<(Self, Vec<Rejected>)> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        }
        // A symlinked results file is the file it points to: rows go there,
        // and a repair rewrites the target, not the link.
        let path = match std::fs::symlink_metadata(path) {
            Ok(m) if m.file_type().is_symlink() => {
                std::fs::canonicalize(path).map_err(|e| Error::io(path, e))?
            }
            _ => path.to_owned(),
        };
        let path = path.as_path();
        let mut log = Self {
            path: path.to_owned(),
            lock_path: sidecar(path, ".lock"),
            keys: HashSet::new(),
            scanned: 0,
        };
        let rejected = log.locked(|l| l.rescan_all())?;
        Ok((log, rejected))
    }

    /// Runs `f` holding the exclusive lock.
    fn locked<T>(&mut self, f: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&self.lock_path)
            .map_err(|e| Error::io(&self.lock_path, e))?;
        lock.lock().map_err(|e| Error::io(&self.lock_path, e))?;
        let r = f(self);
        let _ = lock.unlock();
        r
    }

    /// Reads the whole file; if any line is not a row, moves it aside and
    /// rewrites the file with the rows alone (atomic rename).
    fn rescan_all(&mut self) -> Result<Vec<Rejected>> {
        let bytes = match std::fs::read(&self.path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(Error::io(&self.path, e)),
        };
        self.keys.clear();
        let mut good = Vec::with_capacity(bytes.len());
        let mut rejected = Vec::new();
        let n_lines = bytes.split(|&b| b == b'\n').count();
        for (i, line) in bytes.split(|&b| b == b'\n').enumerate() {
            let last = i + 1 == n_lines;
            if last && line.is_empty() {
                break; // the file ends with a newline
            }
            let verdict = if last {
                Err("torn last line (no newline: a writer was killed)".to_string())
            } else if line.iter().all(u8::is_ascii_whitespace) {
                Err("blank line".to_string())
            } else {
                classify(line, &self.keys)
            };
            match verdict {
                Ok(k) => {
                    self.keys.insert(k);
                    good.extend_from_slice(line);
                    good.push(b'\n');
                }
                Err(reason) => rejected.push(Rejected {
                    line: i + 1,
                    reason,
                    text: String::from_utf8_lossy(line).chars().take(200).collect(),
                }),
            }
        }
        if !rejected.is_empty() {
            let meta = std::fs::metadata(&self.path).map_err(|e| Error::io(&self.path, e))?;
            if meta.permissions().readonly() {
                return Err(Error::Input(format!(
                    "{}: {} line(s) are not result rows, and the file is read-only, so they cannot be moved aside (make it writable, or remove the lines; first: line {}: {})",
                    self.path.display(),
                    rejected.len(),
                    rejected[0].line,
                    rejected[0].reason
                )));
            }
            let tmp = sidecar(&self.path, ".tmp");
            let write = || -> std::io::Result<()> {
                let mut f = File::create(&tmp)?;
                f.write_all(&good)?;
                f.sync_all()?;
                // The rewrite keeps the file's mode, owner and group.
                std::fs::set_permissions(&tmp, meta.permissions())?;
                #[cfg(unix)]
                {
                    use std::os::unix::fs::MetadataExt;
                    let _ = std::os::unix::fs::chown(&tmp, Some(meta.uid()), Some(meta.gid()));
                }
                Ok(())
            };
            if let Err(e) = write() {
                let _ = std::fs::remove_file(&tmp);
                return Err(Error::io(&tmp, e));
            }
            if let Err(e) = self.move_aside(&rejected) {
                let _ = std::fs::remove_file(&tmp);
                return Err(e);
            }
            if let Err(e) = std::fs::rename(&tmp, &self.path) {
                let _ = std::fs::remove_file(&tmp);
                return Err(Error::io(&self.path, e));
            }
        }
        self.scanned = good.len() as u64;
        Ok(rejected)
    }

    fn move_aside(&self, rejected: &[Rejected]) -> Result<()> {
        let p = sidecar(&self.path, ".rejected");
        let mut f = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&p)
            .map_err(|e| Error::io(&p, e))?;
        // An entry already there (a repair that failed after writing it) is
        // not written twice.
        let before = std::fs::read_to_string(&p).unwrap_or_default();
        let known: HashSet<&str> = before.lines().collect();
        let mut text = String::new();
        for r in rejected {
            let entry =
                json!({"file": self.path, "line": r.line, "reason": r.reason, "text": r.text})
                    .to_string();
            if !known.contains(entry.as_str()) {
                text += &entry;
                text.push('\n');
            }
        }
        f.write_all(text.as_bytes())
            .and_then(|_| f.sync_all())
            .map_err(|e| Error::io(&p, e))
    }

    /// Picks up rows other writers appended since the last look (under the lock).
    fn refresh(&mut self) -> Result<Vec<Rejected>> {
        let mut f = match File::open(&self.path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                self.keys.clear();
                self.scanned = 0;
                return Ok(Vec::new());
            }
            Err(e) => return Err(Error::io(&self.path, e)),
        };
        let len = f.metadata().map_err(|e| Error::io(&self.path, e))?.len();
        if len < self.scanned {
            return self.rescan_all(); // replaced by someone else's repair
        }
        let mut tail = Vec::new();
        f.seek(SeekFrom::Start(self.scanned))
            .and_then(|_| f.read_to_end(&mut tail))
            .map_err(|e| Error::io(&self.path, e))?;
        if tail.is_empty() {
            return Ok(Vec::new());
        }
        if !tail.ends_with(b"\n") {
            return self.rescan_all();
        }
        let mut new = Vec::new();
        for line in tail[..tail.len() - 1].split(|&b| b == b'\n') {
            match classify(line, &self.keys) {
                Ok(k) => new.push(k),
                Err(_) => return self.rescan_all(),
            }
        }
        self.keys.extend(new);
        self.scanned = len;
        Ok(Vec::new())
    }

    /// Whether a row with `key` is in the file (rows other writers added
    /// included); lines found broken meanwhile are moved aside and returned.
    pub fn contains(&mut self, key: &str) -> Result<(bool, Vec<Rejected>)> {
        self.locked(|l| {
            let r = l.refresh()?;
            Ok((l.keys.contains(key), r))
        })
    }

    /// Appends `row` (which carries `key`) unless a row with that key is
    /// already there; returns whether it was written. One write per line,
    /// synced, under the lock.
    pub fn append(&mut self, key: &str, row: &Value) -> Result<bool> {
        debug_assert_eq!(row["key"].as_str(), Some(key));
        self.locked(|l| {
            l.refresh()?;
            if l.keys.contains(key) {
                return Ok(false);
            }
            let line = format!("{}\n", serde_json::to_string(row).expect("json"));
            let mut f = OpenOptions::new()
                .create(true)
                .append(true)
                .open(&l.path)
                .map_err(|e| Error::io(&l.path, e))?;
            f.write_all(line.as_bytes())
                .and_then(|_| f.sync_data())
                .map_err(|e| Error::io(&l.path, e))?;
            l.scanned += line.len() as u64;
            l.keys.insert(key.to_owned());
            Ok(true)
        })
    }

    /// Keys present.
    pub fn keys(&self) -> &HashSet<String> {
        &self.keys
    }
}

/// Prints what was moved aside.
pub fn report_rejected(path: &Path, rejected: &[Rejected]) {
    if rejected.is_empty() {
        return;
    }
    eprintln!(
        "warning: {}: {} line(s) were not result rows and were moved to {}.rejected:",
        path.display(),
        rejected.len(),
        path.display()
    );
    for r in rejected.iter().take(5) {
        eprintln!("  line {}: {}", r.line, r.reason);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(k: &str) -> Value {
        json!({"key": k, "task": "fidelity", "metrics": {"kl": 0.5}})
    }

    #[test]
    fn bad_lines_are_moved_aside_and_rows_after_them_kept() {
        let dir = std::env::temp_dir().join(format!("minikv-results-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("r.jsonl");
        let mut bytes = Vec::new();
        for k in ["a", "b"] {
            bytes.extend_from_slice(format!("{}\n", row(k)).as_bytes());
        }
        bytes.extend_from_slice(b"bad\n");
        bytes.extend_from_slice(&[0xff, 0xfe, b'\n']); // not UTF-8
        bytes.extend_from_slice(format!("{}\n", row("c")).as_bytes());
        bytes.extend_from_slice(format!("{}\n", row("a")).as_bytes()); // duplicate
        bytes.extend_from_slice(b"{\"key\": \"tor"); // torn
        std::fs::write(&p, &bytes).unwrap();
        let (mut log, rej) = ResultsLog::open(&p).unwrap();
        let lines: Vec<usize> = rej.iter().map(|r| r.line).collect();
        assert_eq!(lines, vec![3, 4, 6, 7]);
        assert!(rej[1].reason.contains("UTF-8") && rej[2].reason.contains("duplicate"));
        assert_eq!(log.keys().len(), 3);
        let kept = std::fs::read_to_string(&p).unwrap();
        assert_eq!(kept.lines().count(), 3);
        let aside = std::fs::read_to_string(dir.join("r.jsonl.rejected")).unwrap();
        assert_eq!(aside.lines().count(), 4);
        // A key is written once.
        assert!(!log.append("b", &row("b")).unwrap());
        assert!(log.append("d", &row("d")).unwrap());
        // Another writer's rows are seen.
        let (mut other, _) = ResultsLog::open(&p).unwrap();
        assert!(other.append("e", &row("e")).unwrap());
        assert!(log.contains("e").unwrap().0);
        assert!(!log.append("e", &row("e")).unwrap());
        assert_eq!(std::fs::read_to_string(&p).unwrap().lines().count(), 5);
        std::fs::remove_dir_all(&dir).ok();
    }
}
