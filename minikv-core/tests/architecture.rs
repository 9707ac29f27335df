//! The architecture invariants of docs/ARCHITECTURE.md that a test can check
//! from the source tree: crate dependencies and which names a crate may use.

use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Names of the `[dependencies]` of a crate (not dev-dependencies).
fn deps(krate: &str) -> Vec<String> {
    let text = std::fs::read_to_string(root().join(krate).join("Cargo.toml")).unwrap();
    let v: toml::Table = toml::from_str(&text).unwrap();
    v.get("dependencies")
        .and_then(|d| d.as_table())
        .map(|t| t.keys().cloned().collect())
        .unwrap_or_default()
}

/// Every `.rs` file under `dir`, with its text.
fn rs_files(dir: &Path) -> Vec<(PathBuf, String)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(rs_files(&p));
        } else if p.extension().is_some_and(|x| x == "rs") {
            let text = std::fs::read_to_string(&p).unwrap();
            out.push((p, text));
        }
    }
    out
}

/// Every non-comment line of every `.rs` file under `dir`.
fn code_lines(dir: &Path) -> Vec<(PathBuf, String)> {
    let mut out = Vec::new();
    for (p, text) in rs_files(dir) {
        for l in text.lines() {
            if !l.trim_start().starts_with("//") {
                out.push((p.clone(), l.to_string()));
            }
        }
    }
    out
}

#[test]
fn core_depends_on_no_minikv_crate_and_never_on_cuda() {
    for d in deps("minikv-core") {
        assert!(
            !d.starts_with("minikv") && d != "cudarc",
            "minikv-core depends on {d}"
        );
    }
}

#[test]
fn models_depend_on_core_alone_and_name_only_traits() {
    let minikv: Vec<String> = deps("minikv-models")
        .into_iter()
        .filter(|d| d.starts_with("minikv"))
        .collect();
    assert_eq!(minikv, ["minikv-core"]);
    // Concrete caches, backends and component crates are never named by a model.
    let banned = [
        "LayeredCache",
        "AttentionProbe",
        "TiledBackend",
        "ReferenceBackend",
        "CacheBuilder",
        "minikv_policies",
        "minikv_quant",
        "minikv_kernels",
    ];
    for (file, line) in code_lines(&root().join("minikv-models/src")) {
        for b in banned {
            assert!(!line.contains(b), "{} names {b}: {line}", file.display());
        }
    }
}

#[test]
fn every_crate_depends_only_toward_core() {
    for (krate, allowed) in [
        ("minikv-policies", &["minikv-core"][..]),
        ("minikv-quant", &["minikv-core"]),
        // The CUDA backend implements minikv-quant's min-max scheme on the
        // device; only its tests check it against minikv-quant (a
        // dev-dependency, not listed here).
        ("minikv-kernels", &["minikv-core"]),
        ("minikv-eval", &["minikv-core", "minikv-models"]),
        // The engine batches models over caches it builds from a config;
        // it names no component, policy or quantizer crate.
        ("minikv-engine", &["minikv-core", "minikv-models"]),
        // The server speaks HTTP over the engine; the cache config it gets
        // is data, so it names no component crate either.
        (
            "minikv-server",
            &["minikv-core", "minikv-models", "minikv-engine"],
        ),
    ] {
        for d in deps(krate).iter().filter(|d| d.starts_with("minikv")) {
            assert!(allowed.contains(&d.as_str()), "{krate} depends on {d}");
        }
    }
}

/// Backend names appear only where each backend registers itself: nothing
/// outside the registry matches on them.
#[test]
fn backend_names_only_at_their_registration() {
    for name in ["\"tiled\"", "\"reference\"", "\"cuda\""] {
        for krate in [
            "minikv-core",
            "minikv-policies",
            "minikv-quant",
            "minikv-models",
            "minikv-eval",
            "minikv-engine",
            "minikv-server",
            "minikv-cli",
        ] {
            for (file, line) in code_lines(&root().join(krate).join("src")) {
                if !line.contains(name) {
                    continue;
                }
                let f = file.to_string_lossy();
                let ok = f.ends_with("attention/mod.rs") // registrations
                    || f.ends_with("attention/tiled.rs") // its own name()
                    || f.ends_with("attention/reference.rs")
                    || (f.ends_with("config.rs") && line.contains("\"tiled\".into()")); // the default
                assert!(ok, "{f} matches on a backend name: {line}");
            }
        }
    }
}

/// Every non-comment line of a crate's `src/` outside test code (files named
/// `tests.rs` or `*_tests.rs`, and everything after a `#[cfg(test)]`).
fn non_test_lines(krate: &str) -> Vec<(PathBuf, String)> {
    let mut out = Vec::new();
    let mut in_tests: Option<PathBuf> = None;
    for (file, line) in code_lines(&root().join(krate).join("src")) {
        let name = file.file_name().unwrap().to_string_lossy().into_owned();
        if name == "tests.rs" || name.ends_with("_tests.rs") {
            continue;
        }
        if in_tests.as_ref() == Some(&file) {
            continue;
        }
        if line.trim() == "#[cfg(test)]" {
            in_tests = Some(file);
            continue;
        }
        out.push((file, line));
    }
    out
}

/// Evaluation tasks are components: their names are matched only where each
/// task registers itself (`minikv-eval/src/tasks/`, and the RULER generator's
/// own table); the CLI, sweep and report look tasks up in the registry and
/// use what each declares (input, metric, family).
#[test]
fn task_names_only_at_their_registration() {
    let names = [
        "perplexity",
        "fidelity",
        "generation",
        "passkey",
        "needle",
        "kv-retrieval",
        "attention-error",
        "dataset",
        "ruler-",
    ];
    for krate in [
        "minikv-core",
        "minikv-models",
        "minikv-eval",
        "minikv-engine",
        "minikv-server",
        "minikv-cli",
    ] {
        for (file, line) in non_test_lines(krate) {
            let f = file.to_string_lossy();
            if f.contains("minikv-eval/src/tasks/") || f.contains("minikv-eval/src/ruler/") {
                continue;
            }
            for n in names {
                let q = if n.ends_with('-') {
                    format!("\"{n}")
                } else {
                    format!("\"{n}\"")
                };
                let matched = matches_name(&line, &q);
                assert!(!matched, "{f} matches on the task name {n}: {line}");
            }
        }
    }
}

/// Whether a line matches on, compares with, looks up or lists the quoted
/// name `q` (with its quotes; a prefix such as `"ruler-` has no closing one).
fn matches_name(line: &str, q: &str) -> bool {
    [
        format!("{q} =>"),
        format!("{q} |"),
        format!("| {q}"),
        format!("== {q}"),
        format!("!= {q}"),
        format!("({q}"),
        format!("[{q},"),
    ]
    .iter()
    .any(|p| line.contains(p.as_str()))
}

/// Component names (every `register!(Kind, "name", ...)` of the crates that
/// register components) are matched only in their own registration files:
/// the cache finds components by `type`, and consumers of a cache's
/// diagnostics flatten them without naming a part.
#[test]
fn component_names_only_at_their_registration() {
    let mut names = Vec::new();
    for krate in ["minikv-policies", "minikv-quant", "minikv-core"] {
        let lines = non_test_lines(krate);
        for (i, (_, line)) in lines.iter().enumerate() {
            let t = line.trim_start();
            let call_start = ["register!(", "crate::register!(", "minikv_core::register!("]
                .iter()
                .any(|m| t.starts_with(m));
            if !call_start {
                continue;
            }
            // The name is the first string literal of the call (which may
            // span lines).
            let call: String = lines[i..(i + 4).min(lines.len())]
                .iter()
                .map(|(_, l)| l.as_str())
                .collect();
            if let Some(name) = call.split('"').nth(1) {
                names.push(name.to_string());
            }
        }
    }
    assert!(
        names.len() > 30,
        "found only {} registered components",
        names.len()
    );
    for krate in [
        "minikv-models",
        "minikv-eval",
        "minikv-engine",
        "minikv-server",
        "minikv-cli",
    ] {
        for (file, line) in non_test_lines(krate) {
            for n in &names {
                let q = format!("\"{n}\"");
                assert!(
                    !matches_name(&line, &q),
                    "{} matches on the component name {n}: {line}",
                    file.display()
                );
            }
        }
    }
}

/// Every `.rs` file under every crate's `src/`, with its text.
fn src_files() -> Vec<(PathBuf, String)> {
    let mut files = Vec::new();
    for e in std::fs::read_dir(root()).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        if name.starts_with("minikv-") && p.join("src").is_dir() {
            files.extend(rs_files(&p.join("src")));
        }
    }
    assert!(files.len() > 50, "found only {} source files", files.len());
    files
}

/// The 512-bit kernels are chosen through `minikv_core::cpu::avx512()`
/// alone, so `MINIKV_MAX_ISA=avx2` keeps every one of them out: no source
/// outside `cpu.rs` asks the CPU for AVX-512F itself (unit tests may).
#[test]
fn avx512_is_chosen_only_through_the_cap() {
    let mut crates = Vec::new();
    for e in std::fs::read_dir(root()).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        if name.starts_with("minikv-") && p.join("src").is_dir() {
            crates.push(name);
        }
    }
    let mut found = Vec::new();
    for krate in &crates {
        for (file, line) in non_test_lines(krate) {
            let asks = line.contains("is_x86_feature_detected!(\"avx512f\")");
            if asks && !file.ends_with("minikv-core/src/cpu.rs") {
                found.push(format!("{}: {}", file.display(), line.trim()));
            }
        }
    }
    assert!(crates.len() >= 9, "found only {crates:?}");
    assert!(
        found.is_empty(),
        "AVX-512F detected past the cap: {found:?}"
    );
}

/// No source file under a crate's `src/` exceeds 600 lines (a file that grows
/// past it is split by concern; unit tests live in their own file).
#[test]
fn no_source_file_exceeds_600_lines() {
    let long: Vec<String> = src_files()
        .iter()
        .map(|(p, text)| (p, text.lines().count()))
        .filter(|(_, n)| *n > 600)
        .map(|(p, n)| format!("{} ({n} lines)", p.display()))
        .collect();
    assert!(long.is_empty(), "over 600 lines: {long:?}");
}

/// The start of a function definition: its indentation and name. A function
/// is a line starting with `fn` (after visibility and qualifiers) that does
/// not end in `;`.
fn starts_fn(line: &str) -> Option<(usize, String)> {
    let t = line.trim_start();
    let indent = line.len() - t.len();
    let mut rest = t;
    for q in [
        "pub(crate) ",
        "pub(super) ",
        "pub ",
        "const ",
        "unsafe ",
        "async ",
    ] {
        rest = rest.strip_prefix(q).unwrap_or(rest);
    }
    let name = rest.strip_prefix("fn ")?;
    if line.trim_end().ends_with(';') {
        return None;
    }
    let name: String = name
        .chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect();
    Some((indent, name))
}

/// No function in a crate's `src/` exceeds 120 lines, signature to closing
/// brace (a longer one is split into named steps); a function ends at the
/// first `}` line at its indentation.
#[test]
fn no_function_exceeds_120_lines() {
    let mut long = Vec::new();
    for (p, text) in src_files() {
        let lines: Vec<&str> = text.lines().collect();
        for (i, l) in lines.iter().enumerate() {
            let Some((indent, name)) = starts_fn(l) else {
                continue;
            };
            let close = " ".repeat(indent) + "}";
            let end = lines[i + 1..]
                .iter()
                .position(|m| {
                    m.starts_with(&close)
                        && m[indent + 1..]
                            .chars()
                            .next()
                            .is_none_or(|c| " ;)".contains(c))
                })
                .map_or(lines.len(), |k| i + 1 + k);
            let n = end - i + 1;
            if n > 120 {
                long.push(format!("{}: fn {name} ({n} lines)", p.display()));
            }
        }
    }
    assert!(long.is_empty(), "functions over 120 lines: {long:#?}");
}

/// The core registers only the default of each decode-time extension point
/// (`frozen`, `quest`, `minikv`): decode-time eviction, other page scores and
/// KIVI's residual rule live outside it and reach storage through the
/// public views (`StoredHeads`, the rule's counts).
#[test]
fn core_holds_only_the_decode_time_defaults() {
    use minikv_core::components::{self, ExtensionPoint as P};
    let mut got: Vec<(P, &str)> = components::all()
        .into_iter()
        .filter(|c| matches!(c.point, P::Decode | P::PageScore | P::Residual))
        .map(|c| (c.point, c.name))
        .collect();
    got.sort();
    assert_eq!(
        got,
        [
            (P::Decode, "frozen"),
            (P::PageScore, "quest"),
            (P::Residual, "minikv")
        ]
    );
}
