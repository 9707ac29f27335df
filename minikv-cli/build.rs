//! Records the source revision at build time (`MINIKV_GIT_REV`: the short
//! commit, `-dirty` when tracked files differ from it, `unknown` outside a
//! git checkout), so results name the code that produced them without the
//! binary running git in its source tree at run time.

use std::path::Path;
use std::process::Command;

fn git(root: &Path, args: &[&str]) -> Option<String> {
    Command::new("git")
        .arg("-C")
        .arg(root)
        .args(args)
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
}

fn main() {
    let manifest = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets it");
    let root = Path::new(&manifest).join("..");
    let rev = match git(&root, &["rev-parse", "--short=12", "HEAD"]) {
        Some(r) => {
            let dirty = git(&root, &["status", "--porcelain", "--untracked-files=no"])
                .is_some_and(|s| !s.is_empty());
            if dirty { format!("{r}-dirty") } else { r }
        }
        None => "unknown".into(),
    };
    println!("cargo:rustc-env=MINIKV_GIT_REV={rev}");
    // Rerun when the commit, the index or any tracked source changes.
    if let Some(dir) = git(&root, &["rev-parse", "--absolute-git-dir"]) {
        println!("cargo:rerun-if-changed={dir}/HEAD");
        println!("cargo:rerun-if-changed={dir}/index");
        if let Some(head) = git(&root, &["symbolic-ref", "-q", "HEAD"]) {
            println!("cargo:rerun-if-changed={dir}/{head}");
        }
    }
    for entry in std::fs::read_dir(&root).into_iter().flatten().flatten() {
        let p = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with("minikv-") && p.is_dir() {
            println!("cargo:rerun-if-changed={}", p.join("src").display());
            println!("cargo:rerun-if-changed={}", p.join("Cargo.toml").display());
        }
    }
    for f in ["Cargo.toml", "Cargo.lock", "configs"] {
        println!("cargo:rerun-if-changed={}", root.join(f).display());
    }
}
