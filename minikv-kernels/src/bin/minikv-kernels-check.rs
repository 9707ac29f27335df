//! Compiles every kernel with NVRTC for each architecture of
//! `minikv_kernels::nvrtc::ARCHS` and, given `ptxas`, assembles the PTX and
//! reports registers, static shared memory, stack and spills per kernel as
//! JSON on stdout. With `--cubin-out DIR`, also writes a CUBIN per
//! architecture of `CUBIN_ARCHS` under the name the CUDA backend looks for
//! (a GPU machine then needs no NVRTC).
//!
//! `LD_LIBRARY_PATH=third_party/cuda/lib minikv-kernels-check [--ptxas PATH] [--out DIR] [--cubin-out DIR]`

use minikv_kernels::nvrtc::{ARCHS, CUBIN_ARCHS, KERNELS, compile_cubin, compile_ptx, cubin_name};
use serde_json::{Value, json};
use std::path::PathBuf;
use std::process::Command;

fn main() {
    if let Err(e) = run() {
        eprintln!("minikv-kernels-check: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), String> {
    let mut args = std::env::args().skip(1);
    let (mut ptxas, mut out) = (None, std::env::temp_dir().join("minikv-kernels-check"));
    let mut cubin_out: Option<PathBuf> = None;
    while let Some(a) = args.next() {
        match a.as_str() {
            "--ptxas" => ptxas = Some(PathBuf::from(args.next().ok_or("--ptxas needs a path")?)),
            "--out" => out = PathBuf::from(args.next().ok_or("--out needs a folder")?),
            "--cubin-out" => {
                cubin_out = Some(PathBuf::from(
                    args.next().ok_or("--cubin-out needs a folder")?,
                ))
            }
            other => return Err(format!("unknown argument `{other}`")),
        }
    }
    std::fs::create_dir_all(&out).map_err(|e| format!("{}: {e}", out.display()))?;
    let mut report = serde_json::Map::new();
    for arch in ARCHS {
        let ptx = compile_ptx(arch).map_err(|e| e.to_string())?;
        let file = out.join(format!("minikv.{arch}.ptx"));
        std::fs::write(&file, &ptx).map_err(|e| format!("{}: {e}", file.display()))?;
        let mut kernels = serde_json::Map::new();
        for k in KERNELS {
            if !ptx.contains(&format!(".entry {k}(")) {
                return Err(format!("{arch}: kernel {k} missing from the PTX"));
            }
            kernels.insert(k.into(), json!({"ptx": true}));
        }
        if let Some(p) = &ptxas {
            let o = Command::new(p)
                .args(["-v", &format!("-arch={arch}"), "-o", "/dev/null"])
                .arg(&file)
                .output()
                .map_err(|e| format!("{}: {e}", p.display()))?;
            let log = String::from_utf8_lossy(&o.stderr).to_string();
            if !o.status.success() {
                return Err(format!("ptxas failed for {arch}: {log}"));
            }
            parse_ptxas(&log, &mut kernels);
        }
        report.insert(arch.into(), Value::Object(kernels));
    }
    if let Some(dir) = &cubin_out {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let mut cubins = serde_json::Map::new();
        for arch in CUBIN_ARCHS {
            let b = compile_cubin(arch).map_err(|e| e.to_string())?;
            let file = dir.join(cubin_name(arch));
            let tmp = file.with_extension("cubin.tmp");
            std::fs::write(&tmp, &b).map_err(|e| format!("{}: {e}", tmp.display()))?;
            std::fs::rename(&tmp, &file).map_err(|e| format!("{}: {e}", file.display()))?;
            cubins.insert(arch.into(), json!({"file": file, "bytes": b.len()}));
        }
        report.insert("cubins".into(), Value::Object(cubins));
    }
    println!(
        "{}",
        serde_json::to_string_pretty(&Value::Object(report)).expect("json")
    );
    Ok(())
}

/// Reads `ptxas -v`'s "Compiling entry function 'k'" / "Used N registers,
/// M bytes smem" / "N bytes stack frame, N bytes spill stores, N bytes spill
/// loads" lines.
fn parse_ptxas(log: &str, kernels: &mut serde_json::Map<String, Value>) {
    let mut current: Option<String> = None;
    let num = |s: &str, before: &str| -> Option<u64> {
        let i = s.find(before)?;
        s[..i].split_whitespace().last()?.parse().ok()
    };
    for line in log.lines() {
        if let Some(i) = line.find("Compiling entry function '") {
            let rest = &line[i + "Compiling entry function '".len()..];
            current = rest.split('\'').next().map(str::to_owned);
        } else if let Some(k) = current.as_ref().and_then(|k| kernels.get_mut(k)) {
            if let Some(r) = num(line, "registers") {
                k["registers"] = json!(r);
                k["shared_bytes"] = json!(num(line, "bytes smem").unwrap_or(0));
            }
            if let Some(s) = num(line, "bytes spill stores") {
                k["spill_stores"] = json!(s);
                k["spill_loads"] = json!(num(line, "bytes spill loads").unwrap_or(0));
                k["stack_bytes"] = json!(num(line, "bytes stack frame").unwrap_or(0));
            }
        }
    }
}
