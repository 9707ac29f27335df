//! Unit tests of ResKV.

use super::*;

fn data(t: usize, d: usize) -> (Vec<f32>, Vec<f32>) {
    let k = (0..t * d)
        .map(|i| ((i * 37 % 101) as f32 / 50.0 - 1.0) * 2.0)
        .collect();
    let v = (0..t * d)
        .map(|i| (i * 53 % 97) as f32 / 48.0 - 1.0)
        .collect();
    (k, v)
}

#[test]
fn one_cluster_per_evicted_token_is_exact() {
    // Every evicted token its own cluster (count 1, bias 0), no gate: the
    // same softmax as the full prompt, up to fp16 storage.
    let (t, d) = (40, 8);
    let (k, v) = data(t, d);
    let main: Vec<u32> = (0..t as u32).filter(|p| p % 3 == 0).collect();
    let ev: Vec<u32> = (0..t as u32).filter(|p| p % 3 != 0).collect();
    let rows = HeadRows {
        keys: &k,
        values: &v,
        d,
    };
    let c = Clusters::build(rows, &ev, ev.len(), 3, 1.0);
    assert_eq!(c.len(), ev.len());
    let q: Vec<f32> = (0..4 * d).map(|i| (i as f32 * 0.3).sin()).collect();
    let full = full_outputs(&q, rows, t);
    let s = residual_stats(&q, &full, rows, &main, &ev, &c, None);
    // Up to the fp16 rounding of the stored entries (2^-11 relative).
    assert!(s.eta < 1e-3 && s.denominator_error < 1e-3, "{s:?}");
    assert!(s.numerator_error < 2e-3 && s.output_error < 2e-3, "{s:?}");
    assert!(s.output_error_dropped > 0.1, "{s:?}");
}

#[test]
fn clusters_conserve_members_and_means() {
    let (t, d) = (64, 4);
    let (k, v) = data(t, d);
    let ev: Vec<u32> = (5..60).collect();
    let rows = HeadRows {
        keys: &k,
        values: &v,
        d,
    };
    let c = Clusters::build(rows, &ev, 7, 5, 1.0);
    assert!(c.len() <= 7 && !c.is_empty());
    assert_eq!(c.counts.iter().sum::<u32>() as usize, ev.len());
    // Weighted mean of cluster means = mean of the evicted values.
    for ch in 0..d {
        let direct: f32 = ev.iter().map(|&p| v[p as usize * d + ch]).sum::<f32>() / 55.0;
        let via: f32 = (0..c.len())
            .map(|j| c.values[j * d + ch] * c.counts[j] as f32)
            .sum::<f32>()
            / 55.0;
        // fp16 storage of the means: |error| <= 2^-11 |mean| per cluster.
        assert!((direct - via).abs() < 1e-3, "{direct} vs {via}");
    }
    for (b, &n) in c.bias.iter().zip(&c.counts) {
        assert_eq!(*b, (n as f32).ln());
    }
    // Deterministic.
    assert_eq!(c, Clusters::build(rows, &ev, 7, 5, 1.0));
}

#[test]
fn gate_formula() {
    let g = Gate {
        tau: 0.25,
        alpha: 12.0,
        g_min: 0.0,
    };
    // s = tau: sigmoid(0) = 1/2.
    assert!((g.log_g(0.25) - 0.5f32.ln()).abs() < 1e-6);
    // Sharp main attention (s = 1): sigmoid(-9).
    let want = (1.0 / (1.0 + 9f32.exp())).ln();
    assert!((g.log_g(1.0) - want).abs() < 1e-5);
    // Two equal logits: s = 1/2.
    assert!((g.log_g_of_logits(&[0.3, 0.3]) - g.log_g(0.5)).abs() < 1e-6);
    let floor = Gate { g_min: 0.5, ..g };
    assert!((floor.log_g(1.0) - 0.5f32.ln()).abs() < 1e-6);
}

#[test]
fn validation_names_the_field() {
    for (c, field) in [
        (
            ResKvConfig {
                ratio: 1.5,
                ..Default::default()
            },
            "cache.compensator.ratio",
        ),
        (
            ResKvConfig {
                iters: 0,
                ..Default::default()
            },
            "cache.compensator.iters",
        ),
    ] {
        assert!(c.validate().unwrap_err().to_string().contains(field));
    }
    assert!(ResKvConfig::default().validate().is_ok());
    let e = serde_json::from_value::<ResKvConfig>(serde_json::json!({"ratoi": 0.1}));
    assert!(e.unwrap_err().to_string().contains("ratoi"));
}
