//! Next-token distributions compared with a reference's: KL(reference || other) in nats per
//! position and top-1 agreement. One place for the measure `kvc judge` and `kvc blend-eval`
//! report.

/// A reference's log-probabilities and argmax at each position.
pub(crate) struct Reference {
    vocab: usize,
    log_p: Vec<Vec<f64>>,
    argmax: Vec<usize>,
}

impl Reference {
    /// From logits `[positions, vocab]` row-major.
    pub(crate) fn new(logits: &[f32], vocab: usize) -> Reference {
        let log_p: Vec<Vec<f64>> = logits.chunks_exact(vocab).map(log_softmax).collect();
        let argmax = log_p.iter().map(|r| argmax(r)).collect();
        Reference {
            vocab,
            log_p,
            argmax,
        }
    }

    pub(crate) fn vocab(&self) -> usize {
        self.vocab
    }

    /// Mean KL(reference || `logits`) over the positions, and the share of positions whose
    /// argmax agrees (`logits` has the reference's positions).
    pub(crate) fn kl_top1(&self, logits: &[f32]) -> (f64, f64) {
        let (mut kl, mut agree) = (0f64, 0usize);
        for (i, row) in logits.chunks_exact(self.vocab).enumerate() {
            let lq = log_softmax(row);
            let lp = &self.log_p[i];
            kl += lp
                .iter()
                .zip(&lq)
                .map(|(&a, &b)| a.exp() * (a - b))
                .sum::<f64>();
            agree += usize::from(argmax(&lq) == self.argmax[i]);
        }
        let n = self.log_p.len().max(1) as f64;
        (kl / n, agree as f64 / n)
    }
}

pub(crate) fn log_softmax(row: &[f32]) -> Vec<f64> {
    let max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)) as f64;
    let z: f64 = row
        .iter()
        .map(|&x| (x as f64 - max).exp())
        .sum::<f64>()
        .ln()
        + max;
    row.iter().map(|&x| x as f64 - z).collect()
}

/// Index of the largest value (the first of equals).
fn argmax(v: &[f64]) -> usize {
    v.iter()
        .enumerate()
        .fold((0, f64::NEG_INFINITY), |(bi, bv), (i, &x)| {
            if x > bv {
                (i, x)
            } else {
                (bi, bv)
            }
        })
        .0
}
