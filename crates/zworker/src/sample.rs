//! `zrun sample`: text from a checkpoint, generated on the CPU.
//!
//! zrun checks the arguments and the checkpoint (exit 2 on bad input) and
//! runs `zworker sample DIR PROMPT TOKENS TEMPERATURE TOP_K TOP_P MIN_P
//! REPETITION_PENALTY SEED`, so that the launcher stays free of the model. The worker reads the parameters whole
//! (a tiled checkpoint's tiles put back together; or a Hugging Face GPT-2 or
//! LLaMA directory's, mapped to zrun's names), takes the prompt as bytes
//! (a byte-level model) or as token ids (zrun holds the tokenizer), and for each new
//! token draws from the last position's logits: greedy at temperature 0,
//! else softmax(logits / T) over the `top_k` largest (all when 0), and of
//! those the fewest most likely whose probabilities reach `top_p` (nucleus
//! sampling, Hugging Face's `top_p`; 1: all), of those the ones at least
//! `min_p` times as likely as the likeliest (Hugging Face's `min_p`), with a
//! seeded generator so that a seed repeats its text. Before any of it, the
//! logits of tokens already in the text take Hugging Face's
//! `repetition_penalty` (greedy too, as `generate` applies it). Each token is written
//! to stdout as it is drawn.
//!
//! Weights published in bf16 (most Hugging Face models) stay bf16: each
//! matrix a directory stores in bf16 is held as its bits, and the products
//! widen the values exactly as they read them (`zgemm::gemm_widening_b`),
//! so the text is that of the same values in f32, in half the memory and
//! half the bytes a token reads. A one-row product is bound by those
//! bytes: a 1.2B-parameter LLaMA (2.47 GB in bf16) on a 2-core Zen 2 went
//! from 157-173 ms a token held in f32 to 95. The head's matrix is held
//! transposed (see `load`). Vectors (norms, biases) and GPT-2's position
//! table are f32.
//!
//! The context is the last `seq_len` tokens. Each block keeps the keys and
//! values of the tokens it has run (`zmodel::KvCache`), so a new token costs
//! one row through the model (every weight read once, its attention over
//! the kept keys) rather than a forward over the whole context, and only the
//! last position's logits are computed. Until the first version of this
//! (the sixty-ninth session), each token ran the forward over its whole
//! context and the head over every position: 300 tokens of a GPT-2-small
//! shape took 80 s on a 2-core EPYC. Once the context is `seq_len` long it
//! slides, its positions move, and each token runs the window afresh.

use std::collections::HashMap;
use std::io::Write;
use std::path::Path;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use zckpt::WeightSource;
use zmodel::{BlockParams, EmbeddingParams, Gpt, HeadParams, KvCache};

/// How to draw the next token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// 0: the most likely token; else the softmax's temperature.
    pub temperature: f64,
    /// Draw among this many most likely tokens (0: all).
    pub top_k: usize,
    /// Then among the fewest most likely whose probabilities (at the
    /// temperature, over the top k) add up to at least this; 1: all.
    pub top_p: f64,
    /// Then among those at least this share of the likeliest one's
    /// probability; 0: all.
    pub min_p: f64,
}

/// Hugging Face's `repetition_penalty` (CTRL's): the logit of each token
/// already in the text (the prompt's or drawn) divided by the penalty where
/// positive, multiplied by it where not, before the draw; in f32, as
/// `generate` scales the model's f32 logits.
pub struct RepetitionPenalty {
    factor: f32,
    /// Whether each id of the vocabulary is in the text, and those that are.
    seen: Vec<bool>,
    ids: Vec<u32>,
}

impl RepetitionPenalty {
    /// The penalty `factor` over a vocabulary of `vocab` ids, the text so
    /// far `text`; none for a factor of 1.
    pub fn new(factor: f64, vocab: usize, text: &[u32]) -> Option<RepetitionPenalty> {
        if factor == 1.0 {
            return None;
        }
        let mut penalty = RepetitionPenalty {
            factor: factor as f32,
            seen: vec![false; vocab],
            ids: Vec::new(),
        };
        text.iter().for_each(|&id| penalty.saw(id));
        Some(penalty)
    }

    /// Notes that `id` is in the text.
    pub fn saw(&mut self, id: u32) {
        if !std::mem::replace(&mut self.seen[id as usize], true) {
            self.ids.push(id);
        }
    }

    /// Penalises the logits of the tokens in the text.
    pub fn apply(&self, logits: &mut [f32]) {
        for &id in &self.ids {
            let l = &mut logits[id as usize];
            *l = match *l < 0.0 {
                true => *l * self.factor,
                false => *l / self.factor,
            };
        }
    }
}

/// The next token from `logits` under `s`, drawing from `rng`. The draw
/// walks the candidates in order: most likely first among the top k or
/// under a `top_p` below 1, else by token id (no sort of the whole
/// vocabulary a token where none is needed: it was a twentieth of a
/// GPT-2-sized model's token).
pub fn pick(logits: &[f32], s: Sampling, rng: &mut impl Rng) -> u32 {
    // Largest first; ties keep the lower token first.
    let larger = |a: &usize, b: &usize| logits[*b].total_cmp(&logits[*a]).then(a.cmp(b));
    let mut order: Vec<usize> = (0..logits.len()).collect();
    if s.temperature == 0.0 || s.top_k == 1 {
        return order.into_iter().min_by(larger).unwrap_or(0) as u32;
    }
    if s.top_k > 0 && s.top_k < order.len() {
        order.select_nth_unstable_by(s.top_k - 1, larger);
        order.truncate(s.top_k);
        order.sort_unstable_by(larger);
    } else if s.top_p < 1.0 {
        order.sort_unstable_by(larger);
    }
    let top = order
        .iter()
        .map(|&i| f64::from(logits[i]))
        .fold(f64::NEG_INFINITY, f64::max);
    let mut weights: Vec<f64> = order
        .iter()
        .map(|&i| ((f64::from(logits[i]) - top) / s.temperature).exp())
        .collect();
    if s.top_p < 1.0 {
        // The nucleus: the sorted prefix whose share reaches top_p.
        let total: f64 = weights.iter().sum();
        let mut share = 0.0;
        let keep = weights
            .iter()
            .position(|w| {
                share += w / total;
                share >= s.top_p
            })
            .map_or(weights.len(), |i| i + 1);
        weights.truncate(keep);
        order.truncate(keep);
    }
    if s.min_p > 0.0 {
        // Relative to the likeliest kept (the largest weight, which is the
        // share's denominator's largest term as much as the numerator's).
        let floor = s.min_p * weights.iter().copied().fold(0.0, f64::max);
        (order, weights) = order
            .iter()
            .zip(&weights)
            .filter(|&(_, &w)| w >= floor)
            .unzip();
    }
    let mut u = rng.random::<f64>() * weights.iter().sum::<f64>();
    for (&i, w) in order.iter().zip(&weights) {
        if u < *w {
            return i as u32;
        }
        u -= w;
    }
    order[order.len() - 1] as u32
}

/// A model and its parameters, read from a checkpoint.
pub(crate) struct Loaded {
    pub(crate) model: Gpt,
    embedding: EmbeddingParams<Tensor>,
    blocks: Vec<BlockParams<Tensor>>,
    head: HeadParams<Tensor>,
}

/// A parameter's values as [`load`] keeps them.
enum Values {
    F32(Vec<f32>),
    /// A matrix a Hugging Face directory stores in bf16: its bits.
    Bf16(Vec<u16>),
}

impl Values {
    /// `rows × cols` values (row-major) as their transpose.
    fn transposed(self, rows: usize, cols: usize) -> Values {
        match self {
            Values::F32(v) => Values::F32(zckpt::hf::transposed(&v, rows, cols)),
            Values::Bf16(b) => Values::Bf16(zckpt::hf::transposed(&b, rows, cols)),
        }
    }

    /// A CPU tensor of `shape` (f32, or bf16 as they are).
    fn tensor(self, shape: &[usize]) -> Result<Tensor> {
        use half::vec::HalfBitsVecExt;
        Ok(match self {
            Values::F32(v) => Tensor::from_vec(v, shape, &Device::Cpu)?,
            Values::Bf16(b) => {
                Tensor::from_vec(b.reinterpret_into::<half::bf16>(), shape, &Device::Cpu)?
            }
        })
    }
}

/// The model in `dir`, a checkpoint or a Hugging Face model directory
/// (`config.json` beside `model.safetensors`).
pub(crate) fn load(dir: &Path) -> Result<Loaded> {
    let mut read: Vec<(String, Vec<usize>, Values)> = Vec::new();
    let m = if dir.join(zckpt::hf::HF_CONFIG).is_file() {
        let m = zckpt::hf::model_spec(dir)?;
        let shapes = m.param_shapes();
        let weights = zckpt::InitWeights::open(dir, &m, &shapes)?;
        let (mut kept, mut kept_bytes) = (0, 0);
        for (name, shape) in shapes {
            // Matrices stored in bf16 stay so (see the module's docs).
            let bits = match shape.len() {
                2 => weights.read_bf16(&name)?,
                _ => None,
            };
            let values = match bits {
                Some(bits) => {
                    (kept, kept_bytes) = (kept + 1, kept_bytes + 2 * bits.len());
                    Values::Bf16(bits)
                }
                None => Values::F32(weights.read(&name)?),
            };
            read.push((name, shape, values));
        }
        if kept > 0 {
            eprintln!(
                "zrun: {kept} weight matrices kept in bf16 as {} stores them ({:.2} GB; f32 would take twice that)",
                dir.display(),
                kept_bytes as f64 / 1e9
            );
        }
        m
    } else {
        let ckpt = zckpt::Checkpoint::open(dir)?;
        let mut assembler = zckpt::Assembler::default();
        for (g, entry) in ckpt.manifest.groups.iter().enumerate() {
            let flat = ckpt.full_group(g, "params")?;
            for (name, shape, values) in assembler.add(entry, &flat).map_err(anyhow::Error::msg)? {
                read.push((name, shape, Values::F32(values)));
            }
        }
        assembler.finish().map_err(anyhow::Error::msg)?;
        // The model's whole context, as its export (`max_position_embeddings`)
        // declares it to `transformers` and to the branch above: a GPT-2
        // fine-tuned on shorter sequences keeps its position table.
        let mut m = ckpt.manifest.model;
        m.seq_len = m.context();
        m
    };
    // The head's matrix (`[vocab, d]`; a tied model's token table) is held
    // as its transpose, `[d, vocab]` storage under a `[vocab, d]` view,
    // which `Gpt::last_logits` reads as stored: a one-row product streams
    // rows of it at the memory's speed, where the columns of `[vocab, d]`
    // ran at half that in bf16 (a LLaMA-1B head: 15 against 34 GB/s).
    let head = match m.tied() {
        true => format!("{}.weight", m.token_table_name()),
        false => "lm_head.weight".to_string(),
    };
    let mut named = HashMap::new();
    for (name, shape, values) in read {
        let t = match shape[..] {
            [rows, cols] if name == head => {
                values.transposed(rows, cols).tensor(&[cols, rows])?.t()?
            }
            _ => values.tensor(&shape)?,
        };
        named.insert(name, t);
    }
    let model = Gpt::new(&m)?;
    let layout = model.layout();
    let groups = model.groups();
    let params = |g: usize| -> Result<Vec<Tensor>> {
        groups[g]
            .params
            .iter()
            .map(|p| {
                named
                    .get(&p.name)
                    .cloned()
                    .with_context(|| format!("{}: no parameter {}", dir.display(), p.name))
            })
            .collect()
    };
    let l = m.n_layers;
    let mut embedding = EmbeddingParams::from_vec(params(0)?, layout)?;
    // GPT-2's position table is added to the embedded rows, not multiplied.
    embedding.wpe = embedding.wpe.map(|w| w.to_dtype(DType::F32)).transpose()?;
    Ok(Loaded {
        embedding,
        blocks: (1..=l)
            .map(|b| Ok(BlockParams::from_vec(params(b)?, layout)?))
            .collect::<Result<_>>()?,
        head: HeadParams::from_vec(params(l + 1)?, layout)?,
        model,
    })
}

impl Loaded {
    /// Runs `tokens` through the model after those `caches` (one a block)
    /// hold, keeping their keys and values: the logits of the token after
    /// the last.
    fn feed(&self, tokens: &[u32], caches: &mut [KvCache]) -> Result<Vec<f32>> {
        let x = self.hidden(tokens, caches)?;
        Ok(self
            .model
            .last_logits(&self.head, Some(&self.embedding.wte), &x)?)
    }

    /// The last block's output `[1, t, d]` for `tokens`, after the ones
    /// `caches` hold (which keep these too).
    pub(crate) fn hidden(&self, tokens: &[u32], caches: &mut [KvCache]) -> Result<Tensor> {
        let start = caches.first().map_or(0, KvCache::tokens);
        let ids = Tensor::from_slice(tokens, (1, tokens.len()), &Device::Cpu)?;
        let mut x = self.model.embed_from(&self.embedding, &ids, start)?;
        for (b, cache) in self.blocks.iter().zip(caches.iter_mut()) {
            x = self.model.block_cached(b, &x, cache)?;
        }
        Ok(x)
    }

    /// The logits after each row of `rows` `[n, d]` (of [`Loaded::hidden`]),
    /// `n × vocab`.
    pub(crate) fn rows_logits(&self, rows: &Tensor) -> Result<Vec<f32>> {
        Ok(self
            .model
            .rows_logits(&self.head, Some(&self.embedding.wte), rows)?)
    }

    /// The logits after `context`, whose last token `caches` do not hold
    /// yet: that token alone through the model, or the context's last
    /// `seq_len` tokens afresh where the window slides (every position
    /// moves) or where LongRoPE's frequencies change as the sequence grows
    /// past the original context (every kept key turns again, as
    /// transformers' Phi-3 drops its cache there).
    fn next_logits(&self, context: &[u32], caches: &mut Vec<KvCache>) -> Result<Vec<f32>> {
        let config = self.model.config();
        let kept = caches.first().map_or(0, KvCache::tokens);
        let turns_again = config.rotary_switches_after() == Some(kept);
        match kept < config.seq_len && !turns_again {
            true => self.feed(&context[context.len() - 1..], caches),
            false => {
                *caches = self.caches();
                let window = &context[context.len().saturating_sub(config.seq_len)..];
                self.feed(window, caches)
            }
        }
    }

    /// Empty caches, one a block.
    pub(crate) fn caches(&self) -> Vec<KvCache> {
        vec![KvCache::default(); self.blocks.len()]
    }
}

/// `zworker sample DIR PROMPT TOKENS TEMPERATURE TOP_K TOP_P MIN_P
/// REPETITION_PENALTY SEED [--stop IDS] [--ids]` (arguments checked by
/// zrun). Without `--ids`: writes the
/// prompt and `TOKENS` drawn bytes to stdout. With `--ids` (zrun encodes and
/// decodes with a tokenizer): PROMPT is comma-separated token ids, and each
/// drawn id is written on a line of its own as it is drawn. Drawing one of
/// the comma-separated `--stop` ids ends the text (it is not written).
pub fn run(args: &[String]) -> Result<()> {
    let (args, ids) = match args {
        [rest @ .., last] if last == "--ids" => (rest, true),
        _ => (args, false),
    };
    let (args, stop_ids) = match args {
        [rest @ .., flag, list] if flag == "--stop" => {
            let stop = list
                .split(',')
                .map(|t| t.trim().parse::<u32>().context("a --stop id"))
                .collect::<Result<Vec<_>>>()?;
            (rest, stop)
        }
        _ => (args, Vec::new()),
    };
    let [dir, prompt, tokens, temperature, top_k, top_p, min_p, penalty, seed] = args else {
        bail!(
            "usage: zworker sample DIR PROMPT TOKENS TEMPERATURE TOP_K TOP_P MIN_P REPETITION_PENALTY SEED [--stop IDS] [--ids] (zrun sample runs it)"
        );
    };
    let n: usize = tokens.parse().context("TOKENS")?;
    let sampling = Sampling {
        temperature: temperature.parse().context("TEMPERATURE")?,
        top_k: top_k.parse().context("TOP_K")?,
        top_p: top_p.parse().context("TOP_P")?,
        min_p: min_p.parse().context("MIN_P")?,
    };
    let penalty: f64 = penalty.parse().context("REPETITION_PENALTY")?;
    let mut rng = ChaCha8Rng::seed_from_u64(seed.parse().context("SEED")?);
    let started = std::time::Instant::now();
    let loaded = load(Path::new(dir))?;
    let loading = started.elapsed();
    let config = loaded.model.config();
    let (seq_len, vocab) = (config.seq_len, config.vocab_size);
    let mut out = std::io::stdout().lock();
    let mut context: Vec<u32> = if ids {
        prompt
            .split(',')
            .map(|t| t.trim().parse::<u32>().context("a prompt id"))
            .collect::<Result<_>>()?
    } else {
        out.write_all(prompt.as_bytes())?;
        out.flush()?;
        prompt.bytes().map(u32::from).collect()
    };
    if let Some(bad) = context.iter().find(|&&t| t as usize >= vocab) {
        bail!("prompt token {bad} is outside the model's vocabulary of {vocab}");
    }
    if context.is_empty() {
        bail!("an empty prompt");
    }
    let mut penalty = RepetitionPenalty::new(penalty, vocab, &context);
    drop(out);
    // On a pool thread with the others kept awake, as training runs: a
    // token is about fifty short products, and waking the other thread for
    // each took as long as the second thread saved (300 tokens of a
    // GPT-2-small shape, 2 threads: 10.2 s, 1 thread: 10.4 s).
    let stop = std::sync::atomic::AtomicBool::new(false);
    rayon::scope(|s| {
        let _awake = crate::awake::KeepAwake::start(s, &stop);
        let mut out = std::io::stdout().lock();
        let window = |context: &[u32]| context[context.len().saturating_sub(seq_len)..].to_vec();
        let mut caches = loaded.caches();
        let prompt_started = std::time::Instant::now();
        let mut logits = loaded.feed(&window(&context), &mut caches)?;
        let prompt = prompt_started.elapsed();
        let drawing = std::time::Instant::now();
        let mut drawn = 0;
        for i in 0..n {
            if let Some(p) = &penalty {
                p.apply(&mut logits);
            }
            let next = pick(&logits, sampling, &mut rng);
            if stop_ids.contains(&next) {
                break;
            }
            let written = match ids {
                true => writeln!(out, "{next}"),
                false => out.write_all(&[next as u8]),
            };
            // A reader that has all it wants (`zrun sample … | head`, or
            // zrun's own stdout closed) ends the drawing, quietly.
            match written.and_then(|()| out.flush()) {
                Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => return Ok(()),
                written => written?,
            }
            context.push(next);
            if let Some(p) = &mut penalty {
                p.saw(next);
            }
            drawn += 1;
            if i + 1 == n {
                break;
            }
            logits = loaded.next_logits(&context, &mut caches)?;
        }
        if !ids {
            match out.write_all(b"\n") {
                Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {}
                written => written?,
            }
        }
        // Each token after the first is one row through the model (the
        // first came with the prompt's logits).
        let per_token = match drawn {
            0 | 1 => String::new(),
            _ => format!(
                ", {:.1} ms a token after the first",
                drawing.elapsed().as_secs_f64() * 1e3 / (drawn - 1) as f64
            ),
        };
        eprintln!(
            "zrun: {drawn} tokens drawn; loading {:.1} s, the prompt's {} tokens {:.2} s{per_token}",
            loading.as_secs_f64(),
            window(&context[..context.len() - drawn]).len(),
            prompt.as_secs_f64()
        );
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A LongRoPE model (original context 4) generating past its original
    /// context: the token that crosses it turns every kept key again, so
    /// its logits are those of the whole sequence fed afresh, not those of
    /// the keys kept from before (which differ: the check can fail);
    /// before and after, a token is fed alone.
    #[test]
    fn longrope_turns_every_key_again_where_its_factors_switch() {
        let m: zconfig::spec::ModelSpec = serde_json::from_value(serde_json::json!({
            "kind": "llama", "vocab_size": 16, "d_model": 16, "n_layers": 1,
            "n_heads": 2, "ffn_hidden": 24, "seq_len": 16,
            "rope_scaling": {"rope_type": "longrope", "factor": 4.0,
                "original_max_position_embeddings": 4,
                "short_factor": [1.0, 1.5, 2.0, 3.0],
                "long_factor": [1.0, 3.0, 7.0, 20.0]}
        }))
        .unwrap();
        let model = Gpt::new(&m).unwrap();
        // Weights 3 times the initial ones: attention far from uniform, so
        // that the keys' angles show in the logits.
        let mut values = (0..model.groups().len())
            .flat_map(|g| model.init_group(g, 7))
            .map(|v| v.iter().map(|x| 3.0 * x).collect())
            .collect::<Vec<_>>()
            .into_iter();
        let d = tempfile::tempdir().unwrap();
        zckpt::hf::write_dir(&m, &m.param_shapes(), d.path(), || Ok(values.next())).unwrap();
        let loaded = load(d.path()).unwrap();
        let context: Vec<u32> = (0..6).map(|i| (i * 5 + 3) % 16).collect();
        let afresh = |n: usize| loaded.feed(&context[..n], &mut loaded.caches()).unwrap();
        let mut caches = loaded.caches();
        loaded.feed(&context[..3], &mut caches).unwrap();
        // Within the original context: one token on the kept keys.
        let within = loaded.next_logits(&context[..4], &mut caches).unwrap();
        assert_eq!(caches[0].tokens(), 4);
        close(&within, &afresh(4));
        let mut kept = caches.clone();
        let crossing = loaded.next_logits(&context[..5], &mut caches).unwrap();
        assert_eq!(crossing, afresh(5));
        let on_the_kept_keys = loaded.feed(&context[4..5], &mut kept).unwrap();
        let moved = on_the_kept_keys
            .iter()
            .zip(&crossing)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(moved > 1e-3, "the long factors moved the logits by {moved}");
        // Past it, one token on the keys turned again.
        let past = loaded.next_logits(&context, &mut caches).unwrap();
        assert_eq!(caches[0].tokens(), 6);
        close(&past, &afresh(6));
    }

    fn close(a: &[f32], b: &[f32]) {
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!(
                (x - y).abs() <= 1e-5 * (1.0 + y.abs()),
                "logit {i}: {x} vs {y}"
            );
        }
    }

    #[test]
    fn greedy_takes_the_largest_and_top_k_limits_the_draw() {
        let logits = [0.5f32, 2.0, -1.0, 2.0, 1.5];
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let greedy = Sampling {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
        };
        // Ties go to the lower token.
        assert_eq!(pick(&logits, greedy, &mut rng), 1);
        let top2 = Sampling {
            temperature: 1.0,
            top_k: 2,
            top_p: 1.0,
            min_p: 0.0,
        };
        let mut counts = [0usize; 5];
        for _ in 0..2000 {
            counts[pick(&logits, top2, &mut rng) as usize] += 1;
        }
        assert_eq!(counts[0] + counts[2] + counts[4], 0, "{counts:?}");
        // Equal logits: about half each.
        assert!((800..1200).contains(&counts[1]), "{counts:?}");
        // Ties at the cut keep the lower tokens, as a sort would.
        let tied = [1.0f32, 3.0, 3.0, 3.0, 0.0, 3.0];
        let mut seen = [0usize; 6];
        for _ in 0..500 {
            seen[pick(&tied, top2, &mut rng) as usize] += 1;
        }
        assert_eq!(seen[0] + seen[3] + seen[4] + seen[5], 0, "{seen:?}");
        assert!(seen[1] > 0 && seen[2] > 0, "{seen:?}");
    }

    /// Nucleus sampling against its definition: over softmax(0, 1, 2)
    /// (0.090, 0.245, 0.665), top-p 0.5 keeps token 2 alone, 0.8 keeps 2
    /// and 1 (0.665 < 0.8 ≤ 0.910), drawn in proportion (token 1: 0.269),
    /// and 0.95 all three; with a top k too, its share is of the top k's.
    #[test]
    fn top_p_keeps_the_fewest_likeliest_tokens_that_reach_it() {
        let logits = [0.0f32, 1.0, 2.0];
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let mut draw = |top_k: usize, top_p: f64| {
            let s = Sampling {
                temperature: 1.0,
                top_k,
                top_p,
                min_p: 0.0,
            };
            let mut counts = [0usize; 3];
            for _ in 0..20_000 {
                counts[pick(&logits, s, &mut rng) as usize] += 1;
            }
            counts
        };
        assert_eq!(draw(0, 0.5), [0, 0, 20_000]);
        let c = draw(0, 0.8);
        assert_eq!(c[0], 0, "{c:?}");
        let p1 = 1.0f64.exp() / (1.0f64.exp() + 2.0f64.exp());
        let sd = (20_000.0 * p1 * (1.0 - p1)).sqrt();
        assert!((c[1] as f64 - 20_000.0 * p1).abs() < 4.0 * sd, "{c:?}");
        assert!(draw(0, 0.95).iter().all(|&n| n > 0));
        // Of the top two (0.269, 0.731), 0.7 keeps token 2 alone.
        assert_eq!(draw(2, 0.7), [0, 0, 20_000]);
    }

    /// min-p against its definition: over softmax(0, 1, 2) the shares of
    /// the likeliest are e^-2 (0.135), e^-1 (0.368) and 1: min-p 0.3 keeps
    /// tokens 1 and 2, 0.5 token 2 alone, 0.1 all three; after a top k.
    #[test]
    fn min_p_keeps_the_tokens_near_the_likeliest() {
        let logits = [0.0f32, 1.0, 2.0];
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let mut draw = |top_k: usize, min_p: f64| {
            let s = Sampling {
                temperature: 1.0,
                top_k,
                top_p: 1.0,
                min_p,
            };
            let mut counts = [0usize; 3];
            for _ in 0..5_000 {
                counts[pick(&logits, s, &mut rng) as usize] += 1;
            }
            counts
        };
        let c = draw(0, 0.3);
        assert!(c[0] == 0 && c[1] > 0 && c[2] > c[1], "{c:?}");
        assert_eq!(draw(0, 0.5), [0, 0, 5_000]);
        assert!(draw(0, 0.1).iter().all(|&n| n > 0));
        assert_eq!(draw(1, 0.1), [0, 0, 5_000]);
    }

    /// The penalty divides a seen token's positive logit and multiplies a
    /// negative one, once however often the token was seen; unseen ones
    /// keep theirs; 1 is no penalty.
    #[test]
    fn the_repetition_penalty_scales_seen_tokens_once() {
        let mut logits = [2.0f32, -1.0, 0.5, 3.0];
        let mut p = RepetitionPenalty::new(2.0, 4, &[0, 1, 0]).unwrap();
        p.apply(&mut logits);
        assert_eq!(logits, [1.0, -2.0, 0.5, 3.0]);
        p.saw(3);
        p.saw(3);
        p.apply(&mut logits);
        assert_eq!(logits, [0.5, -4.0, 0.5, 1.5]);
        assert!(RepetitionPenalty::new(1.0, 4, &[0]).is_none());
    }

    #[test]
    fn draws_follow_the_softmax_at_the_temperature() {
        let logits = [0.0f32, 1.0, 2.0];
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        for t in [0.5, 1.0, 2.0] {
            let s = Sampling {
                temperature: t,
                top_k: 0,
                top_p: 1.0,
                min_p: 0.0,
            };
            let n = 20_000;
            let mut counts = [0f64; 3];
            for _ in 0..n {
                counts[pick(&logits, s, &mut rng) as usize] += 1.0;
            }
            let z: f64 = logits.iter().map(|&l| (f64::from(l) / t).exp()).sum();
            for (i, c) in counts.iter().enumerate() {
                let p = (f64::from(logits[i]) / t).exp() / z;
                // Four standard deviations of a binomial count.
                let sd = (n as f64 * p * (1.0 - p)).sqrt();
                assert!(
                    (c - n as f64 * p).abs() < 4.0 * sd + 1.0,
                    "T {t}: token {i} drawn {c} times, expected {:.0}",
                    n as f64 * p
                );
            }
        }
    }
}
