use super::*;

#[test]
fn every_task_is_registered_once_with_its_metric() {
    let names = names();
    let mut unique = names.clone();
    unique.dedup();
    assert_eq!(names, unique, "task names are unique");
    // The tasks the CLI documents (docs/tasks.md), by name.
    for n in [
        "perplexity",
        "fidelity",
        "generation",
        "attention-error",
        "passkey",
        "needle",
        "kv-retrieval",
        "dataset",
        "ruler-niah-single-number",
        "ruler-vt",
        "ruler-cwe",
        "ruler-fwe",
    ] {
        assert!(find(n).is_some(), "{n} registered");
    }
    // Every RULER-style generator is a task of the `ruler` family, and only they.
    let ruler: Vec<&str> = crate::ruler::all().iter().map(|g| g.name()).collect();
    assert_eq!(ruler.len(), 9);
    let family: Vec<&str> = all()
        .into_iter()
        .filter(|t| t.family() == Some("ruler"))
        .map(|t| t.name())
        .collect();
    assert_eq!(ruler, family);
    assert_eq!(names.len(), 8 + ruler.len());
    let m = |n: &str| find(n).unwrap().metric();
    assert_eq!(
        (m("fidelity").name, m("fidelity").higher_is_better),
        ("kl", false)
    );
    assert_eq!(m("perplexity").name, "ppl");
    assert_eq!(m("passkey").outcomes, Outcomes::Binary);
    assert_eq!(m("ruler-vt").outcomes, Outcomes::Score);
    assert_eq!(find("ruler-vt").unwrap().family(), Some("ruler"));
    assert_eq!(find("dataset").unwrap().family(), None);
    assert_eq!(find("dataset").unwrap().input(), Input::Dataset);
    let e = get("perplexty").err().unwrap().to_string();
    assert!(
        e.contains("unknown task `perplexty`") && e.contains("fidelity"),
        "{e}"
    );
}

#[test]
fn diagnostics_flatten_without_knowing_the_component() {
    let stats = |values: &[(&str, f64)], per_layer: Vec<Vec<(&str, f64)>>| minikv_core::Stats {
        values: values.iter().map(|(k, x)| (k.to_string(), *x)).collect(),
        per_layer: per_layer
            .into_iter()
            .map(|l| l.into_iter().map(|(k, x)| (k.to_string(), x)).collect())
            .collect(),
    };
    let mut diag = Diagnostics::new();
    diag.insert(
        "anycomp".into(),
        stats(
            &[("eta", 0.25), ("k", 3.0)],
            vec![
                vec![("eta", 0.1), ("k", 2.0)],
                vec![("eta", 0.4), ("k", 4.0)],
            ],
        ),
    );
    diag.insert(
        "quest".into(),
        stats(&[("bytes_read_per_token", 12.0)], vec![]),
    );
    let mut v = json!({"kl": 0.5});
    add_diagnostics(&mut v, &diag);
    assert_eq!(v["anycomp_eta"], json!(0.25));
    assert_eq!(v["anycomp_k"], json!(3.0));
    assert_eq!(v["anycomp_eta_per_layer"], json!([0.1, 0.4]));
    assert_eq!(v["anycomp_k_per_layer"], json!([2.0, 4.0]));
    assert_eq!(v["quest_bytes_read_per_token"], json!(12.0));
    assert_eq!(v["kl"], json!(0.5));
    assert!(v.get("quest_bytes_read_per_token_per_layer").is_none());
}

#[test]
fn trials_average_with_intervals_that_fit_the_metric() {
    let rows = vec![
        json!({"kl": 0.0, "ppl": 10.0, "curve": [1.0, 2.0]}),
        json!({"kl": 0.02, "ppl": 40.0, "curve": [3.0, 4.0]}),
        json!({"kl": 0.16, "ppl": 20.0, "curve": [5.0, 6.0]}),
    ];
    let m = mean_rows(&rows);
    assert!((m["kl"].as_f64().unwrap() - 0.06).abs() < 1e-12);
    assert_eq!(m["curve"], json!([3.0, 4.0]));
    // KL is non-negative: its interval is floored at 0 (a t interval would
    // start below it); perplexity's is on the log scale, above 0.
    assert_eq!(m["kl_ci95"][0], json!(0.0));
    assert!(m["ppl_ci95"][0].as_f64().unwrap() > 0.0);
    assert_eq!(m["per_trial"].as_array().unwrap().len(), 3);
}
