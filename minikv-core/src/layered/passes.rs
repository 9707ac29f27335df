//! Context-reconstruction passes (KVzip): during prefill a component may ask
//! the model to run extra tokens over the prompt; their attention feeds the
//! component's scores and they are then dropped from every layer.

use super::{LayeredCache, staging};
use crate::{Error, Needs, Phase, Result};

impl LayeredCache {
    pub(super) fn start_pass(&mut self, context: std::ops::Range<usize>) -> Result<()> {
        let Some(sink) = self.needs.reconstruction else {
            return Err(Error::Unsupported(
                "no component of this cache asked for a reconstruction pass".into(),
            ));
        };
        if self.phase != Phase::Prefill || self.pass.is_some() {
            return Err(Error::Unsupported(
                "a reconstruction pass starts during prefill, one at a time".into(),
            ));
        }
        let t0 = self.layers[0].seen;
        if self.layers.iter().any(|l| l.seen != t0)
            || context.start >= context.end
            || context.end > t0
        {
            return Err(Error::Input(format!(
                "reconstruction pass over {context:?}: the prompt holds {t0} tokens in every layer"
            )));
        }
        self.pass = Some((
            staging::Pass { context, t0, sink },
            std::time::Instant::now(),
        ));
        Ok(())
    }

    pub(super) fn finish_pass(&mut self) -> Result<()> {
        let Some((pass, t)) = self.pass.take() else {
            return Err(Error::Unsupported("end_pass without begin_pass".into()));
        };
        for l in &mut self.layers {
            self.pass_stats.0 += l.seen - pass.t0;
            // Truncated rows end the append-only history.
            if let Some(h) = l.staging.truncate(&self.spec, pass.t0) {
                self.backend.release_history(h);
            }
            l.seen = pass.t0;
        }
        self.pass_stats.1 += t.elapsed().as_secs_f64();
        Ok(())
    }

    /// Prefill attention of `n` new queries; during a pass, over the prompt
    /// and the pass's tokens, feeding the pass's scores and no other signal.
    pub(super) fn prefill_attend(
        &mut self,
        layer: usize,
        q: &[f32],
        n: usize,
        out: &mut [f32],
    ) -> Result<()> {
        let l = &mut self.layers[layer];
        let t = l.seen;
        match &self.pass {
            None => l
                .staging
                .attend(self.backend.as_ref(), &self.spec, self.needs, t, q, n, out),
            Some((pass, _)) => {
                // A pass's tokens feed no other signal.
                l.staging.attend(
                    self.backend.as_ref(),
                    &self.spec,
                    Needs::default(),
                    t,
                    q,
                    n,
                    out,
                )?;
                l.staging.pass_scores(&self.spec, pass, q, n, t);
                Ok(())
            }
        }
    }
}
