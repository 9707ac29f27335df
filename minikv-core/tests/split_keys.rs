//! `SplitKeys` (ThinK's pruned prompt keys beside full-width decoded keys)
//! against a plain reference: every read of the store equals the same read
//! of the rows it should hold (prompt rows with the pruned channels zeroed,
//! decoded rows whole, all fp16), across the boundary between its parts,
//! after swap-removes on both sides and drains across it.

use half::f16;
use minikv_core::SplitKeys;
use minikv_core::channels::ChannelSubsetFp;
use minikv_core::storage::{Fp16Rows, FpStore};

const D: usize = 4;
const KEPT: [u16; 2] = [0, 2];

fn row(i: usize) -> Vec<f32> {
    (0..D)
        .map(|c| ((i * 7 + c * 3) as f32 * 0.37).sin() * 2.0)
        .collect()
}

fn h(x: f32) -> f32 {
    f16::from_f32(x).to_f32()
}

fn pruned(r: &[f32]) -> Vec<f32> {
    (0..D)
        .map(|c| {
            if KEPT.contains(&(c as u16)) {
                h(r[c])
            } else {
                0.0
            }
        })
        .collect()
}

/// The store and its reference rows, fed 5 prompt rows then 4 decoded ones.
fn build() -> (SplitKeys, Vec<Vec<f32>>) {
    let head = ChannelSubsetFp::new(Box::new(Fp16Rows::new(KEPT.len(), 4)), KEPT.to_vec(), D);
    let mut s = SplitKeys::new(head, Box::new(Fp16Rows::new(D, 4)));
    let prompt: Vec<f32> = (0..5).flat_map(row).collect();
    s.push(&prompt);
    let mut want: Vec<Vec<f32>> = (0..5).map(|i| pruned(&row(i))).collect();
    for i in 5..9 {
        s.push(&row(i));
        want.push(row(i).iter().map(|&x| h(x)).collect());
    }
    (s, want)
}

fn check(s: &SplitKeys, want: &[Vec<f32>]) {
    let n = want.len();
    assert_eq!(s.len(), n);
    let mut all = vec![0.0; n * D];
    s.to_f32(&mut all);
    assert_eq!(all, want.concat());
    let g = 2;
    let q: Vec<f32> = (0..g * D).map(|i| 0.5 - 0.21 * i as f32).collect();
    let dot = |j: usize, t: usize| -> f32 { (0..D).map(|c| q[j * D + c] * want[t][c]).sum() };
    let stride = n + 3;
    let mut out = vec![0.0; g * stride];
    s.scores(&q, g, &mut out, stride);
    for j in 0..g {
        for t in 0..n {
            assert!(
                (out[j * stride + t] - dot(j, t)).abs() < 1e-4,
                "scores {j} {t}"
            );
        }
    }
    let ranges = |rs: &[(usize, usize)]| -> Vec<std::ops::Range<usize>> {
        rs.iter()
            .filter(|&&(a, b)| a < b && b <= n)
            .map(|&(a, b)| a..b)
            .collect()
    };
    let m = n.saturating_sub(1);
    for rows in ranges(&[(0, n), (1, 3), (2, m), (n.saturating_sub(2), n)]) {
        let mut out = vec![0.0; g * stride];
        s.scores_rows(&q, g, &mut out, stride, rows.clone());
        for j in 0..g {
            for t in rows.clone() {
                let got = out[j * stride + t - rows.start];
                assert!(
                    (got - dot(j, t)).abs() < 1e-4,
                    "scores_rows {rows:?} {j} {t}"
                );
            }
        }
    }
    let p: Vec<f32> = (0..g * stride).map(|i| 0.1 + 0.03 * i as f32).collect();
    for rows in ranges(&[(0, n), (1, 3), (2, m)]) {
        let mut got = vec![0.0; g * D];
        if rows == (0..n) {
            s.accumulate(&p, g, stride, &mut got);
        } else {
            let pr: Vec<f32> = (0..g * stride)
                .map(|i| p.get(i + rows.start).copied().unwrap_or(0.0))
                .collect();
            s.accumulate_rows(&pr, g, stride, &mut got, rows.clone());
        }
        for j in 0..g {
            for c in 0..D {
                let e: f32 = rows.clone().map(|t| p[j * stride + t] * want[t][c]).sum();
                assert!(
                    (got[j * D + c] - e).abs() < 1e-4,
                    "accumulate {rows:?} {j} {c}"
                );
            }
        }
    }
}

#[test]
fn split_keys_reads_as_its_rows() {
    let (mut s, mut want) = build();
    check(&s, &want);
    // A decoded row removed: the last row takes its place, whole.
    s.swap_remove(6);
    want.swap_remove(6);
    check(&s, &want);
    // A prompt row removed: the last (decoded) row moves in through the
    // pruned channels.
    s.swap_remove(1);
    let last = want.pop().unwrap();
    want[1] = pruned(&last);
    check(&s, &want);
    // A drain across the boundary returns the rows in order.
    let mut out = Vec::new();
    s.drain_front(6, &mut out);
    assert_eq!(out, want[..6].concat());
    want.drain(..6);
    check(&s, &want);
    // A decoded row appended after the drain is whole.
    s.push(&row(20));
    want.push(row(20).iter().map(|&x| h(x)).collect());
    check(&s, &want);
}
