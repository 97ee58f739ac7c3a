//! `zrun eval`: a model's loss on held-out tokens, the number a user
//! compares a fine-tuned model with its base by (`transformers`' perplexity
//! over a text, Megatron's evaluation).
//!
//! zrun checks the arguments and the data, then runs `zworker eval DIR FILE
//! FORMAT STRIDE MAX_TOKENS EOS`. The model is read as `zrun sample` reads it
//! (a checkpoint, or a Hugging Face directory with its bf16 matrices kept
//! so), and the file as training reads it (`zmodel::Corpus`: memory-mapped,
//! each id checked against the vocabulary, a loss mask from the manifest
//! beside it). Every target token is scored once, with the context of a
//! window of at most `seq_len` tokens, as Hugging Face's sliding-window
//! perplexity scores it: windows start every STRIDE tokens, and each scores
//! the targets the ones before it did not. At STRIDE = `seq_len` they are
//! training's windows (each target after the tokens of its own window);
//! a smaller STRIDE gives each target more context, for more forwards.
//! Targets a mask leaves out are not scored. With an EOS id (`zrun eval
//! --separate-documents`), each document (ended by that id) is scored as
//! a text of its own: its windows start at its first token, and the
//! target after the id, the next document's first token, is not scored.
//!
//! A window is one forward through the blocks (no backward, no
//! optimizer), then the head over its rows in chunks, so that the
//! `rows × vocab` logits of a large vocabulary are never held whole. It
//! prints one JSON line: the targets scored, the windows run and the sum
//! of their losses (nats); and every ten seconds, on stderr, how far it is.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use zconfig::DataFormat;
use zmodel::Corpus;

/// Rows of a window whose logits are computed at once.
const ROWS: usize = 64;
/// How often a long evaluation says how far it is.
const PROGRESS: Duration = Duration::from_secs(10);

/// `zworker eval DIR FILE FORMAT STRIDE MAX_TOKENS EOS` (arguments checked
/// by zrun; MAX_TOKENS 0: the whole file; EOS `-`: the file is one text).
pub fn run(args: &[String]) -> Result<()> {
    let [dir, file, format, stride, max_tokens, eos] = args else {
        bail!("usage: zworker eval DIR FILE FORMAT STRIDE MAX_TOKENS EOS (zrun eval runs it)");
    };
    let eos: Option<u32> = match eos.as_str() {
        "-" => None,
        id => Some(id.parse().context("EOS")?),
    };
    let format: DataFormat = serde_json::from_value(serde_json::Value::String(format.clone()))
        .with_context(|| format!("FORMAT {format}"))?;
    let stride: usize = stride.parse().context("STRIDE")?;
    let max_tokens: usize = max_tokens.parse().context("MAX_TOKENS")?;
    let loaded = crate::sample::load(Path::new(dir))?;
    let config = loaded.model.config();
    let (seq_len, vocab) = (config.seq_len, config.vocab_size);
    if stride == 0 || stride > seq_len {
        bail!("STRIDE {stride} is not in 1..={seq_len}");
    }
    let corpus = Corpus::load(&Some(file.clone()), format, vocab, 0)?;
    let n = match max_tokens {
        0 => corpus.len(),
        m => corpus.len().min(m),
    };
    if n < 2 {
        bail!("{file}: {n} tokens: nothing to score (a target needs a token before it)");
    }
    let texts: Vec<std::ops::Range<usize>> = match eos {
        None => std::iter::once(0..n).collect(),
        Some(id) => corpus
            .documents(id)?
            .into_iter()
            .filter(|d| d.start < n)
            .map(|d| d.start..d.end.min(n))
            .collect(),
    };
    let now = Instant::now();
    let mut tally = Tally {
        scored: 0,
        windows: 0,
        loss: 0.0,
        started: now,
        said: now,
    };
    for text in texts {
        score(&loaded, &corpus, text, stride, n, &mut tally)?;
    }
    println!(
        "{}",
        serde_json::json!({"tokens": tally.scored, "windows": tally.windows, "loss_sum": tally.loss})
    );
    Ok(())
}

/// What the windows have scored so far.
struct Tally {
    scored: u64,
    windows: u64,
    loss: f64,
    /// When the evaluation started and last said how far it is (on
    /// stderr, every PROGRESS).
    started: Instant,
    said: Instant,
}

/// Scores the targets of `text` (tokens of the corpus, of `n` evaluated)
/// from its own tokens alone, in windows every `stride` tokens.
fn score(
    loaded: &crate::sample::Loaded,
    corpus: &Corpus,
    text: std::ops::Range<usize>,
    stride: usize,
    n: usize,
    tally: &mut Tally,
) -> Result<()> {
    let (seq_len, vocab) = (
        loaded.model.config().seq_len,
        loaded.model.config().vocab_size,
    );
    let (mut ids, mut mask) = (Vec::new(), Vec::new());
    // Targets up to `done` are scored; window [begin, end) predicts
    // tokens begin + 1 .. end from the ones before them.
    let (mut begin, mut done) = (text.start, text.start);
    while text.len() >= 2 {
        let end = (begin + seq_len + 1).min(text.end);
        ids.clear();
        mask.clear();
        corpus.read(begin, end - begin, &mut ids)?;
        corpus.read_mask(begin, end - begin, &mut mask);
        let inputs = &ids[..ids.len() - 1];
        let x = loaded.hidden(inputs, &mut loaded.caches())?;
        let x = x.squeeze(0)?;
        // Rows before `first` predict targets an earlier window scored.
        let first = done.saturating_sub(begin);
        for from in (first..inputs.len()).step_by(ROWS) {
            let rows = ROWS.min(inputs.len() - from);
            let logits = loaded.rows_logits(&x.narrow(0, from, rows)?)?;
            for (r, row) in logits.chunks_exact(vocab).enumerate() {
                let target = from + r + 1;
                if mask[target] {
                    tally.loss += nll(row, ids[target] as usize);
                    tally.scored += 1;
                }
            }
        }
        tally.windows += 1;
        done = end - 1;
        if tally.said.elapsed() >= PROGRESS && end < n {
            tally.said = Instant::now();
            let s = tally.started.elapsed().as_secs_f64();
            eprintln!(
                "zrun: eval: {done} of {} targets, {s:.0} s, {:.0} tokens/s",
                n - 1,
                done as f64 / s
            );
        }
        if end == text.end {
            break;
        }
        begin += stride;
    }
    Ok(())
}

/// The negative log-likelihood of `target` under softmax(`logits`), in
/// f64.
fn nll(logits: &[f32], target: usize) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits.iter().map(|&z| (z as f64 - max).exp()).sum();
    max + sum.ln() - logits[target] as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nll_is_the_log_softmax() {
        let logits = [1.0f32, 2.0, 3.0];
        let z: f64 = logits.iter().map(|&l| (l as f64).exp()).sum();
        for t in 0..3 {
            let want = -((logits[t] as f64).exp() / z).ln();
            assert!((nll(&logits, t) - want).abs() < 1e-12);
        }
        // Large logits do not overflow.
        assert!((nll(&[1000.0, 1000.0], 0) - 2f64.ln()).abs() < 1e-12);
    }
}
