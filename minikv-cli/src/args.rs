//! Validated command-line numbers: every numeric flag has a range, checked
//! while parsing, so a bad value is an error naming the flag (clap prints
//! `invalid value 'X' for '--flag'`) before anything is allocated.

/// An integer in `lo..=hi`.
fn int_in(s: &str, lo: u64, hi: u64) -> Result<usize, String> {
    let v: u64 = s
        .trim()
        .parse()
        .map_err(|_| format!("expected a whole number in {lo}..={hi}"))?;
    if !(lo..=hi).contains(&v) {
        return Err(format!("must be in {lo}..={hi}"));
    }
    usize::try_from(v).map_err(|_| "too large for this machine".into())
}

/// A finite number in `[lo, hi]`.
fn float_in(s: &str, lo: f64, hi: f64) -> Result<f64, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("expected a number in [{lo}, {hi}]"))?;
    if !v.is_finite() || !(lo..=hi).contains(&v) {
        return Err(format!("must be a finite number in [{lo}, {hi}]"));
    }
    Ok(v)
}

/// Token counts (prompts, contexts, cached tokens): 1 ..= 2^24.
pub fn tokens(s: &str) -> Result<usize, String> {
    int_in(s, 1, 1 << 24)
}

/// Tokens to generate or score after a context: 1 ..= 2^20.
/// A token count that may be 0 (at most 2^24).
pub fn tokens_or_zero(s: &str) -> Result<usize, String> {
    if s.trim() == "0" {
        return Ok(0);
    }
    tokens(s)
}

pub fn new_tokens(s: &str) -> Result<usize, String> {
    int_in(s, 1, 1 << 20)
}

/// Model layers: 1 ..= 4096.
pub fn layers(s: &str) -> Result<usize, String> {
    int_in(s, 1, 4096)
}

/// Attention heads: 1 ..= 256.
pub fn heads(s: &str) -> Result<usize, String> {
    int_in(s, 1, 256)
}

/// A head dimension for the attention benchmark: a multiple of 16 (its
/// quantization group) in 16 ..= 1024.
pub fn head_dim(s: &str) -> Result<usize, String> {
    let d = int_in(s, 16, 1024)?;
    if !d.is_multiple_of(16) {
        return Err("must be a multiple of 16 (the benchmark's quantization group)".into());
    }
    Ok(d)
}

/// Trials, text windows, seeds: 1 ..= 100000.
pub fn count(s: &str) -> Result<usize, String> {
    int_in(s, 1, 100_000)
}

/// Seeds of a sweep: 1 ..= 100000.
pub fn seeds(s: &str) -> Result<u64, String> {
    count(s).map(|n| n as u64)
}

/// Parallel jobs: 1 ..= 256.
pub fn jobs(s: &str) -> Result<usize, String> {
    int_in(s, 1, 256)
}

/// Benchmark time per variant, seconds: (0, 3600].
pub fn seconds(s: &str) -> Result<f64, String> {
    match float_in(s, 0.0, 3600.0) {
        Ok(v) if v > 0.0 => Ok(v),
        _ => Err("must be a finite number in (0, 3600]".into()),
    }
}

/// A fraction in [0, 1] (passkey depth).
pub fn unit(s: &str) -> Result<f64, String> {
    float_in(s, 0.0, 1.0)
}

/// Sampling temperature: 0 (greedy) or in [0.001, 1000] (below, 1/T
/// overflows the logits).
pub fn temperature(s: &str) -> Result<f32, String> {
    let v = float_in(s, 0.0, 1000.0)?;
    if v != 0.0 && v < 1e-3 {
        return Err("must be 0 (greedy) or in [0.001, 1000]".into());
    }
    Ok(v as f32)
}

/// Nucleus mass: (0, 1].
pub fn top_p(s: &str) -> Result<f32, String> {
    match float_in(s, 0.0, 1.0) {
        Ok(v) if v > 0.0 => Ok(v as f32),
        _ => Err("must be a finite number in (0, 1]".into()),
    }
}

/// Top-K logits to print: 1 ..= 1000.
pub fn top_k(s: &str) -> Result<usize, String> {
    int_in(s, 1, 1000)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_and_messages() {
        assert_eq!(tokens("512"), Ok(512));
        assert!(tokens("0").unwrap_err().contains("1..=16777216"));
        assert!(tokens("18446744073709551615").is_err());
        assert!(tokens("-3").unwrap_err().contains("whole number"));
        assert!(head_dim("0").is_err() && head_dim("24").is_err() && head_dim("64").is_ok());
        for bad in ["inf", "nan", "-1", "0", "1e9"] {
            assert!(seconds(bad).is_err(), "{bad}");
        }
        assert!(temperature("1e-40").is_err() && temperature("1e308").is_err());
        assert!(temperature("-1").unwrap_err().contains("[0, 1000]"));
        assert_eq!(temperature("0"), Ok(0.0));
        for bad in ["-1", "1.5", "nan"] {
            assert!(unit(bad).is_err(), "{bad}");
        }
        assert!(seeds("0").is_err() && layers("100000000").is_err());
    }
}
