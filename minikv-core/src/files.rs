//! Reading user-named files with a size bound.
//!
//! Every file a user names (a config, a text, a dataset, a results file) is
//! read through [`read_bounded`]: a device such as `/dev/zero` or a pipe
//! reports no length, so the bound is enforced on the bytes actually read,
//! never on the file's metadata.

use crate::{Error, Result};
use std::io::Read;
use std::path::Path;

/// One mebibyte.
pub const MIB: u64 = 1 << 20;

/// Reads at most `max` bytes of `path`; more is an [`Error::Input`] naming
/// the file, the bound and `what` the file should be.
///
/// ```
/// let p = std::env::temp_dir().join("minikv-files-doc.txt");
/// std::fs::write(&p, "twelve bytes").unwrap();
/// assert_eq!(minikv_core::files::read_bounded(&p, 12, "a text").unwrap().len(), 12);
/// let e = minikv_core::files::read_bounded(&p, 11, "a text").unwrap_err();
/// assert!(e.to_string().contains("more than 11 bytes"));
/// ```
pub fn read_bounded(path: &Path, max: u64, what: &str) -> Result<Vec<u8>> {
    let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let mut bytes = Vec::new();
    file.take(max.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(|e| Error::io(path, e))?;
    if bytes.len() as u64 > max {
        return Err(Error::Input(format!(
            "{}: more than {max} bytes; {what} is expected to be smaller",
            path.display()
        )));
    }
    Ok(bytes)
}

/// [`read_bounded`], then UTF-8: anything else is an error naming the file.
pub fn read_text_bounded(path: &Path, max: u64, what: &str) -> Result<String> {
    let bytes = read_bounded(path, max, what)?;
    String::from_utf8(bytes).map_err(|e| {
        Error::Input(format!(
            "{}: not UTF-8 text (invalid byte at offset {})",
            path.display(),
            e.utf8_error().valid_up_to()
        ))
    })
}
