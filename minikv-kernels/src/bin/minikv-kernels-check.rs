//! Compiles every kernel with NVRTC for each architecture of
//! `minikv_kernels::nvrtc::ARCHS` and, given `ptxas`, assembles the PTX and
//! reports registers, static shared memory, stack and spills per kernel as
//! JSON on stdout. With `--cubin-out DIR`, also writes a CUBIN per
//! architecture of `CUBIN_ARCHS` under the name the CUDA backend looks for
//! (a GPU machine then needs no NVRTC).
//!
//! `LD_LIBRARY_PATH=third_party/cuda/lib minikv-kernels-check [--ptxas PATH] [--out DIR] [--cubin-out DIR]`
//!
//! An architecture is compiled once (its PTX and its CUBIN come from the
//! same compilation), in a process of its own (this binary run with
//! `--compile-one ARCH`), as many at once as the machine has cores: the
//! compilations share nothing, whatever NVRTC's own thread safety, and a
//! 2-core machine checks the kernels in about half the time.

use minikv_kernels::nvrtc::{
    ARCHS, CUBIN_ARCHS, KERNELS, compile_ptx, compile_ptx_and_cubin, cubin_name,
};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

fn main() {
    if let Err(e) = run() {
        eprintln!("minikv-kernels-check: {e}");
        std::process::exit(1);
    }
}

/// The command line.
struct Args {
    ptxas: Option<PathBuf>,
    out: PathBuf,
    cubin_out: Option<PathBuf>,
    /// `--compile-one ARCH`: compile this architecture and write its files.
    one: Option<String>,
}

fn parse_args() -> Result<Args, String> {
    let mut args = std::env::args().skip(1);
    let mut a = Args {
        ptxas: None,
        out: std::env::temp_dir().join("minikv-kernels-check"),
        cubin_out: None,
        one: None,
    };
    while let Some(arg) = args.next() {
        let mut value = |what: &str| args.next().ok_or(format!("{arg} needs {what}"));
        match arg.as_str() {
            "--ptxas" => a.ptxas = Some(PathBuf::from(value("a path")?)),
            "--out" => a.out = PathBuf::from(value("a folder")?),
            "--cubin-out" => a.cubin_out = Some(PathBuf::from(value("a folder")?)),
            "--compile-one" => a.one = Some(value("an architecture")?),
            other => return Err(format!("unknown argument `{other}`")),
        }
    }
    Ok(a)
}

fn run() -> Result<(), String> {
    let a = parse_args()?;
    std::fs::create_dir_all(&a.out).map_err(|e| format!("{}: {e}", a.out.display()))?;
    if let Some(dir) = &a.cubin_out {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    if let Some(arch) = &a.one {
        return compile_one(arch, &a);
    }
    // The checked architectures first: each also waits for ptxas.
    let mut jobs: Vec<&str> = ARCHS.to_vec();
    if a.cubin_out.is_some() {
        jobs.extend(CUBIN_ARCHS.iter().filter(|x| !ARCHS.contains(x)));
    }
    let logs = run_jobs(&jobs, &a)?;
    let mut report = serde_json::Map::new();
    for (arch, log) in jobs.iter().zip(&logs) {
        if !ARCHS.contains(arch) {
            continue;
        }
        let file = ptx_file(&a.out, arch);
        let ptx = std::fs::read_to_string(&file).map_err(|e| format!("{}: {e}", file.display()))?;
        let mut kernels = serde_json::Map::new();
        for k in KERNELS {
            if !ptx.contains(&format!(".entry {k}(")) {
                return Err(format!("{arch}: kernel {k} missing from the PTX"));
            }
            kernels.insert(k.into(), json!({"ptx": true}));
        }
        if let Some(log) = log {
            parse_ptxas(log, &mut kernels);
        }
        report.insert(arch.to_string(), Value::Object(kernels));
    }
    if let Some(dir) = &a.cubin_out {
        let mut cubins = serde_json::Map::new();
        for arch in CUBIN_ARCHS {
            let file = dir.join(cubin_name(arch));
            let bytes = std::fs::metadata(&file)
                .map_err(|e| format!("{}: {e}", file.display()))?
                .len();
            cubins.insert(arch.into(), json!({"file": file, "bytes": bytes}));
        }
        report.insert("cubins".into(), Value::Object(cubins));
    }
    println!(
        "{}",
        serde_json::to_string_pretty(&Value::Object(report)).expect("json")
    );
    Ok(())
}

fn ptx_file(out: &Path, arch: &str) -> PathBuf {
    out.join(format!("minikv.{arch}.ptx"))
}

/// What a job gives: its `ptxas -v` log, if it ran ptxas, or the error.
type JobResult = Result<Option<String>, String>;

/// Runs every job on as many threads as there are cores, each compiling in
/// a child process; returns each job's `ptxas -v` log (checked
/// architectures, given `--ptxas`). After a failure no new job starts, and
/// the first failure in job order is the error.
fn run_jobs(jobs: &[&str], a: &Args) -> Result<Vec<Option<String>>, String> {
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(jobs.len());
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let results: Mutex<Vec<Option<JobResult>>> = Mutex::new(vec![None; jobs.len()]);
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= jobs.len() || failed.load(Ordering::Relaxed) {
                        break;
                    }
                    let r = job(jobs[i], a);
                    failed.fetch_or(r.is_err(), Ordering::Relaxed);
                    results.lock().expect("no job panics")[i] = Some(r);
                }
            });
        }
    });
    let results = results.into_inner().expect("no job panics");
    let mut logs = Vec::with_capacity(jobs.len());
    for (arch, r) in jobs.iter().zip(results) {
        match r {
            Some(Ok(log)) => logs.push(log),
            Some(Err(e)) => return Err(e),
            None => return Err(format!("{arch}: not compiled (an earlier job failed)")),
        }
    }
    Ok(logs)
}

/// One architecture: compiles it in a child process, then assembles its
/// PTX with `ptxas -v` when it is a checked one.
fn job(arch: &str, a: &Args) -> JobResult {
    let exe = std::env::current_exe().map_err(|e| format!("this executable: {e}"))?;
    let mut cmd = Command::new(&exe);
    cmd.args(["--compile-one", arch]).arg("--out").arg(&a.out);
    if let Some(dir) = &a.cubin_out {
        cmd.arg("--cubin-out").arg(dir);
    }
    let o = cmd
        .output()
        .map_err(|e| format!("{}: {e}", exe.display()))?;
    if !o.status.success() {
        let msg = String::from_utf8_lossy(&o.stderr);
        let msg = msg.trim().trim_start_matches("minikv-kernels-check: ");
        return Err(format!("{arch}: {msg}"));
    }
    let Some(p) = a.ptxas.as_ref().filter(|_| ARCHS.contains(&arch)) else {
        return Ok(None);
    };
    let o = Command::new(p)
        .args(["-v", &format!("-arch={arch}"), "-o", "/dev/null"])
        .arg(ptx_file(&a.out, arch))
        .output()
        .map_err(|e| format!("{}: {e}", p.display()))?;
    let log = String::from_utf8_lossy(&o.stderr).to_string();
    if !o.status.success() {
        return Err(format!("ptxas failed for {arch}: {log}"));
    }
    Ok(Some(log))
}

/// `--compile-one ARCH`: compiles once and writes the PTX (a checked
/// architecture) and the CUBIN (with `--cubin-out`, one of `CUBIN_ARCHS`),
/// each through a temporary file renamed into place.
fn compile_one(arch: &str, a: &Args) -> Result<(), String> {
    let wants_ptx = ARCHS.contains(&arch);
    let cubin_dir = a.cubin_out.as_ref().filter(|_| CUBIN_ARCHS.contains(&arch));
    if !wants_ptx && cubin_dir.is_none() {
        return Err(format!("{arch}: neither checked nor prebuilt"));
    }
    let (ptx, cubin) = match cubin_dir {
        Some(_) => compile_ptx_and_cubin(arch).map(|(p, c)| (p, Some(c))),
        None => compile_ptx(arch).map(|p| (p, None)),
    }
    .map_err(|e| e.to_string())?;
    if wants_ptx {
        write_atomically(&ptx_file(&a.out, arch), ptx.as_bytes())?;
    }
    if let (Some(dir), Some(b)) = (cubin_dir, cubin) {
        write_atomically(&dir.join(cubin_name(arch)), &b)?;
    }
    Ok(())
}

fn write_atomically(file: &Path, bytes: &[u8]) -> Result<(), String> {
    let mut tmp = file.as_os_str().to_owned();
    tmp.push(".tmp");
    std::fs::write(&tmp, bytes).map_err(|e| format!("{}: {e}", file.display()))?;
    std::fs::rename(&tmp, file).map_err(|e| format!("{}: {e}", file.display()))
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
