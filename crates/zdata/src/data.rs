//! Corpora and batching.
//!
//! A corpus is one token stream (text files' bytes, u16 token files, or a seeded
//! synthetic stream). It is cut into non-overlapping windows of `seq_len + 1`
//! tokens; each epoch visits the windows in a seeded random order. Global sample
//! `g` of the run is window `perm_epoch[g mod windows]`. Step `s` consumes global
//! samples `s·G .. (s+1)·G` with `G = micro_batch · grad_accum · world`, and rank r's
//! micro-batch a takes the `micro_batch` samples at `(a·world + r)·micro_batch`.
//! So ranks read disjoint samples, and the global batch of a step does not depend
//! on how it is split over ranks and micro-batches: 2 workers × 8 sequences see
//! exactly what 1 worker × 2 micro-batches × 8 sequences sees.
//!
//! A token file may come with a loss mask (`zrun prepare
//! --assistant-only-loss`, named by the manifest beside it): targets it marks
//! as not trained on become [`IGNORED`], and every micro-batch's loss is its
//! counted targets' sum divided by the step's counted targets over the
//! step's micro-batches (`N / (grad_accum · world)`, [`Batch::divisor`]): so
//! the step's gradient is that of the mean over the step's counted targets,
//! whatever the split, as transformers' Trainer counts them since 4.46 (a
//! mean per micro-batch would weigh a micro-batch of few trained tokens as
//! much as one of many, and depend on the split). Every rank counts the
//! whole step's targets itself (a byte per target, read from the map): no
//! collective.

use std::path::PathBuf;
use std::sync::Arc;

use memmap2::{Advice, Mmap};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use zconfig::curriculum::CurriculumSpec;
use zconfig::manifest::DataManifest;
use zconfig::{data_files, DataFormat};

use crate::blend::BlendSchedule;
use crate::documents::Documents;
use crate::packing::{Overflow, Packed};
use crate::IGNORED;

/// Why data could not be loaded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DataError {
    /// A file could not be read.
    #[error("{path}: {cause}")]
    Io {
        /// File.
        path: PathBuf,
        /// Cause (shown in the message, so not also a `source`).
        cause: std::io::Error,
    },
    /// The data cannot serve this model.
    #[error("data: {0}")]
    Invalid(String),
}

/// A token stream, or a stretch of one (the held-out tail is a stretch of
/// the same files). Cheap to clone.
#[derive(Debug, Clone)]
pub struct Corpus {
    source: Arc<Source>,
    start: usize,
    end: usize,
    vocab: usize,
}

/// Where a corpus's tokens live.
#[derive(Debug)]
enum Source {
    /// Generated tokens.
    Memory(Vec<u32>),
    /// Files, memory-mapped in order: a rank's pages are read from disk only
    /// when its windows touch them, so no rank reads the corpus whole.
    Files(Vec<TokenFile>),
}

/// One memory-mapped data file.
#[derive(Debug)]
struct TokenFile {
    path: PathBuf,
    map: Mmap,
    /// 1 (text bytes), 2 (u16) or 4 (u32).
    width: usize,
    /// Index of its first token in the whole stream.
    first: usize,
    /// Its tokens.
    len: usize,
    /// Its loss mask, a byte per token (1: a target the loss counts).
    mask: Option<Mmap>,
}

impl TokenFile {
    fn token(&self, i: usize) -> u32 {
        zconfig::spec::token_id(&self.map[i * self.width..(i + 1) * self.width])
    }
}

/// Tokens in the synthetic corpus.
const SYNTHETIC_TOKENS: usize = 1 << 20;

impl Corpus {
    /// Maps the files a data spec's `path` (or `val_path`) names; token ids are
    /// checked against `vocab` as they are read.
    pub fn load(
        path: &Option<String>,
        format: DataFormat,
        vocab: usize,
        seed: u64,
    ) -> Result<Corpus, DataError> {
        let Some(width) = format.bytes_per_token() else {
            return Ok(Corpus::synthetic(vocab, seed));
        };
        let mut files = Vec::new();
        let mut first = 0;
        for path in data_files(path, format).map_err(DataError::Invalid)? {
            let io = |cause| DataError::Io {
                path: path.clone(),
                cause,
            };
            let file = std::fs::File::open(&path).map_err(io)?;
            let bytes = file.metadata().map_err(io)?.len() as usize;
            if !bytes.is_multiple_of(width) {
                return Err(DataError::Invalid(format!(
                    "{}: {bytes} bytes are not a whole number of {width}-byte tokens",
                    path.display()
                )));
            }
            if bytes == 0 {
                continue;
            }
            // SAFETY: the map is read-only; zrun's data files are not written
            // while a job reads them (a file truncated underneath would fault,
            // as a read of it would fail).
            let map = unsafe { Mmap::map(&file) }.map_err(io)?;
            // Windows are read in a shuffled order: read-ahead would fetch
            // pages other ranks (or no one) read.
            let _ = map.advise(Advice::Random);
            let len = bytes / width;
            let mask =
                match DataManifest::mask_of(&path, bytes as u64).map_err(DataError::Invalid)? {
                    Some((mask_path, _)) => {
                        let mask_io = |cause| DataError::Io {
                            path: mask_path.clone(),
                            cause,
                        };
                        let file = std::fs::File::open(&mask_path).map_err(mask_io)?;
                        // SAFETY: as the token file's map above.
                        let map = unsafe { Mmap::map(&file) }.map_err(mask_io)?;
                        let _ = map.advise(Advice::Random);
                        Some(map)
                    }
                    None => None,
                };
            files.push(TokenFile {
                path,
                map,
                width,
                first,
                len,
                mask,
            });
            first += len;
        }
        Ok(Corpus {
            source: Arc::new(Source::Files(files)),
            start: 0,
            end: first,
            vocab,
        })
    }

    /// A learnable stream: each token is followed by one of four seeded successors
    /// 90% of the time, by a uniform token otherwise (about 1.7 nats of entropy
    /// per token for a large vocabulary, against ln(vocab) for a fresh model).
    pub fn synthetic(vocab: usize, seed: u64) -> Corpus {
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x5EED_DA7A);
        let successors: Vec<[u32; 4]> = (0..vocab)
            .map(|_| std::array::from_fn(|_| rng.random_range(0..vocab) as u32))
            .collect();
        let mut tokens = Vec::with_capacity(SYNTHETIC_TOKENS);
        let mut cur = 0u32;
        for _ in 0..SYNTHETIC_TOKENS {
            tokens.push(cur);
            cur = if rng.random_bool(0.9) {
                successors[cur as usize][rng.random_range(0..4)]
            } else {
                rng.random_range(0..vocab) as u32
            };
        }
        Corpus::from_tokens(tokens, vocab)
    }

    /// A corpus of these tokens.
    pub fn from_tokens(tokens: Vec<u32>, vocab: usize) -> Corpus {
        let end = tokens.len();
        Corpus {
            source: Arc::new(Source::Memory(tokens)),
            start: 0,
            end,
            vocab,
        }
    }

    /// Splits off the last `fraction` of the tokens (for validation): the
    /// training part, and the held-out part when `fraction` > 0.
    pub fn split_tail(self, fraction: f64) -> (Corpus, Option<Corpus>) {
        if fraction <= 0.0 {
            return (self, None);
        }
        let held = ((self.len() as f64 * fraction) as usize).min(self.len());
        let cut = self.end - held;
        let tail = Corpus {
            start: cut,
            ..self.clone()
        };
        (Corpus { end: cut, ..self }, Some(tail))
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.end - self.start
    }

    /// Whether there are no tokens.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether some of its files come with a loss mask.
    pub fn masked(&self) -> bool {
        match &*self.source {
            Source::Memory(_) => false,
            Source::Files(files) => files.iter().any(|f| f.mask.is_some()),
        }
    }

    /// Whether each of tokens `at .. at + n` is trained on, appended to
    /// `out` (all are, in a file without a mask).
    pub fn read_mask(&self, at: usize, n: usize, out: &mut Vec<bool>) {
        let (lo, hi) = (self.start + at, self.start + at + n);
        assert!(
            hi <= self.end,
            "a read past the corpus: {hi} > {}",
            self.end
        );
        let Source::Files(files) = &*self.source else {
            out.extend(std::iter::repeat_n(true, n));
            return;
        };
        let mut f = files.partition_point(|f| f.first + f.len <= lo);
        let mut i = lo;
        while i < hi {
            let file = &files[f];
            let stop = hi.min(file.first + file.len);
            let span = i - file.first..stop - file.first;
            match &file.mask {
                Some(mask) => out.extend(mask[span].iter().map(|&m| m != 0)),
                None => out.extend(std::iter::repeat_n(true, span.len())),
            }
            i = stop;
            f += 1;
        }
    }

    /// The documents of this corpus: token ranges each ended by `eos`
    /// (included), the last one by the corpus's end.
    pub fn documents(&self, eos: u32) -> Result<Vec<std::ops::Range<usize>>, DataError> {
        const CHUNK: usize = 1 << 20;
        let (mut docs, mut begins, mut chunk) = (Vec::new(), 0, Vec::with_capacity(CHUNK));
        for at in (0..self.len()).step_by(CHUNK) {
            chunk.clear();
            self.read(at, CHUNK.min(self.len() - at), &mut chunk)?;
            for (i, &id) in chunk.iter().enumerate() {
                if id == eos {
                    docs.push(begins..at + i + 1);
                    begins = at + i + 1;
                }
            }
        }
        if begins < self.len() {
            docs.push(begins..self.len());
        }
        Ok(docs)
    }

    /// Appends tokens `at .. at + n` of this corpus to `out`, checking each
    /// against the vocabulary.
    pub fn read(&self, at: usize, n: usize, out: &mut Vec<u32>) -> Result<(), DataError> {
        let (lo, hi) = (self.start + at, self.start + at + n);
        assert!(
            hi <= self.end,
            "a read past the corpus: {hi} > {}",
            self.end
        );
        match &*self.source {
            Source::Memory(t) => out.extend_from_slice(&t[lo..hi]),
            Source::Files(files) => {
                // The file holding `lo`, then on through the next ones.
                let mut f = files.partition_point(|f| f.first + f.len <= lo);
                let mut i = lo;
                while i < hi {
                    let file = &files[f];
                    let stop = hi.min(file.first + file.len);
                    for k in i - file.first..stop - file.first {
                        let t = file.token(k);
                        if t as usize >= self.vocab {
                            return Err(DataError::Invalid(format!(
                                "{}: token {t} at token offset {k} (byte {}) is not below vocab_size {}",
                                file.path.display(),
                                k * file.width,
                                self.vocab
                            )));
                        }
                        out.push(t);
                    }
                    i = stop;
                    f += 1;
                }
            }
        }
        Ok(())
    }
}

/// Inputs and next-token targets of one micro-batch, row-major `[rows, seq_len]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    /// Input tokens.
    pub inputs: Vec<u32>,
    /// Targets (inputs shifted by one), [`IGNORED`] where a loss mask
    /// leaves one out.
    pub targets: Vec<u32>,
    /// Sequences.
    pub rows: usize,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// What the sum of the micro-batch's counted losses is divided by:
    /// `rows · seq_len` (the mean) without a loss mask; with one (or with
    /// documents kept apart), the step's counted targets over its
    /// micro-batches (see the module doc).
    pub divisor: f64,
    /// Where documents begin, when they are kept apart
    /// ([`Batcher::separate_documents`]).
    pub documents: Option<Documents>,
}

/// One source of the batches (a blend's part, or the whole data): a corpus
/// and its windows' order, an epoch at a time.
#[derive(Debug)]
struct Part {
    corpus: Corpus,
    windows: usize,
    epoch: Option<(u64, Vec<u32>)>,
    /// Sequences of whole documents, when they are packed
    /// ([`Batcher::pack_documents`]); else windows of the stream.
    packed: Option<Packed>,
}

/// This rank's share of every global batch.
#[derive(Debug)]
pub struct Batcher {
    /// The data's sources: one, or a blend's ([`Batcher::blended`]).
    parts: Vec<Part>,
    /// Which source each global sample comes from, for a blend.
    blend: Option<BlendSchedule>,
    seq_len: usize,
    micro_batch: usize,
    grad_accum: usize,
    world: usize,
    rank: usize,
    seed: u64,
    /// Resumed runs: the step and global sample the run restarted at.
    base_step: u64,
    base_sample: u64,
    /// With a loss mask or documents kept apart: the step last counted and
    /// its counted targets.
    counted: Option<(u64, u64)>,
    /// The end-of-text id after which a new document begins, when documents
    /// are kept apart.
    eos: Option<u32>,
    /// `train.curriculum`: each step trains on the first tokens of its
    /// sequences ([`Batcher::with_curriculum`]).
    curriculum: Option<CurriculumSpec>,
}

impl Batcher {
    /// A batcher for `rank` of `world`.
    pub fn new(
        corpus: Corpus,
        seq_len: usize,
        micro_batch: usize,
        grad_accum: usize,
        world: usize,
        rank: usize,
        seed: u64,
    ) -> Result<Batcher, DataError> {
        let shape = (seq_len, micro_batch, grad_accum, world, rank, seed);
        Batcher::blended(vec![(corpus, 1.0)], shape)
    }

    /// A batcher for `rank` of `world` whose samples come from several
    /// corpora, each its weight's share of them ([`crate::blend`]); each
    /// corpus's windows are visited in an order of their own, an epoch of
    /// them at a time (a small source's repeat sooner). `shape`: `seq_len,
    /// micro_batch, grad_accum, world, rank, seed`, as [`Batcher::new`]
    /// takes them.
    pub fn blended(
        sources: Vec<(Corpus, f64)>,
        shape: (usize, usize, usize, usize, usize, u64),
    ) -> Result<Batcher, DataError> {
        let (seq_len, micro_batch, grad_accum, world, rank, seed) = shape;
        let mut parts = Vec::with_capacity(sources.len());
        let mut weights = Vec::with_capacity(sources.len());
        for (i, (corpus, weight)) in sources.into_iter().enumerate() {
            let windows = corpus.len().saturating_sub(1) / seq_len;
            if windows == 0 {
                let which = match i {
                    0 => String::new(),
                    _ => format!("blend part {i}: "),
                };
                return Err(DataError::Invalid(format!(
                    "{which}{} tokens cannot fill one sequence of seq_len + 1 = {}",
                    corpus.len(),
                    seq_len + 1
                )));
            }
            parts.push(Part {
                corpus,
                windows,
                epoch: None,
                packed: None,
            });
            weights.push(weight);
        }
        Ok(Batcher {
            blend: (parts.len() > 1).then(|| BlendSchedule::new(&weights)),
            parts,
            seq_len,
            micro_batch,
            grad_accum,
            world,
            rank,
            seed,
            base_step: 0,
            base_sample: 0,
            counted: None,
            eos: None,
            curriculum: None,
        })
    }

    /// Packs whole documents (each ended by `eos`, kept apart as
    /// [`Batcher::separate_documents`] keeps them) into the sequences,
    /// best fit decreasing ([`crate::packing`]; documents longer than a
    /// sequence cut or split as `overflow` says), in place of windows of
    /// the stream. Reads the whole corpus once to find the documents.
    pub fn pack_documents(mut self, eos: u32, overflow: Overflow) -> Result<Batcher, DataError> {
        // A blend packs each source apart: a sequence holds one source's
        // documents, and the blend chooses among the sequences.
        for part in &mut self.parts {
            let documents = part.corpus.documents(eos)?;
            let packed = Packed::best_fit_decreasing(&documents, self.seq_len + 1, overflow);
            part.windows = packed.len();
            part.packed = Some(packed);
        }
        Ok(self.separate_documents(eos))
    }

    /// Keeps the documents of every sequence apart ([`crate::documents`]):
    /// a new one begins after each `eos`, and the target after an `eos` (the
    /// next document's first token) is not trained on.
    pub fn separate_documents(self, eos: u32) -> Batcher {
        Batcher {
            eos: Some(eos),
            ..self
        }
    }

    /// Trains each step on the first tokens of its sequences, as many as
    /// `curriculum` says for the step (DeepSpeed's sequence-length
    /// curriculum, [`zconfig::curriculum`]): the sequences are read whole,
    /// as without it, and their inputs, targets, loss mask and documents
    /// cut alike; the loss is the mean over the tokens kept.
    pub fn with_curriculum(self, curriculum: Option<CurriculumSpec>) -> Batcher {
        Batcher { curriculum, ..self }
    }

    /// The tokens of each sequence that step `step` trains on.
    pub fn step_seq_len(&self, step: u64) -> usize {
        self.curriculum
            .as_ref()
            .map_or(self.seq_len, |c| c.seq_len(step, self.seq_len))
    }

    /// The sequences of whole documents of each source, when packed.
    pub fn packed(&self) -> Vec<&Packed> {
        self.parts
            .iter()
            .filter_map(|p| p.packed.as_ref())
            .collect()
    }

    /// Windows in one epoch (of every source together, for a blend).
    pub fn windows(&self) -> usize {
        self.parts.iter().map(|p| p.windows).sum()
    }

    /// Global sample `sample`'s source and window in it.
    fn window_of(&mut self, sample: u64) -> (usize, usize) {
        let (source, nth) = match &mut self.blend {
            Some(blend) => blend.place(sample),
            None => (0, sample),
        };
        let part = &mut self.parts[source];
        let epoch = nth / part.windows as u64;
        if part.epoch.as_ref().is_none_or(|(e, _)| *e != epoch) {
            let mut perm: Vec<u32> = (0..part.windows as u32).collect();
            // Each source shuffles by a seed of its own (the first by the
            // job's, as a job of one source does).
            let seed = self.seed ^ (source as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            perm.shuffle(&mut ChaCha8Rng::seed_from_u64(
                seed.wrapping_add(epoch.wrapping_mul(0x1000_0001)),
            ));
            part.epoch = Some((epoch, perm));
        }
        let (_, perm) = part.epoch.as_ref().expect("set above");
        (source, perm[(nth % part.windows as u64) as usize] as usize)
    }

    fn per_step(&self) -> u64 {
        (self.micro_batch * self.grad_accum * self.world) as u64
    }

    /// Continues a run that had consumed `samples` global samples after `step`
    /// steps (perhaps with another world size or batch split).
    pub fn resume_at(&mut self, step: u64, samples: u64) {
        self.base_step = step;
        self.base_sample = samples;
    }

    /// Global samples consumed once `steps` steps are done.
    pub fn samples_consumed(&self, steps: u64) -> u64 {
        self.base_sample + steps.saturating_sub(self.base_step) * self.per_step()
    }

    /// This rank's micro-batch `micro` of optimizer step `step` (both 0-based).
    /// Fails on a token id outside the vocabulary (naming file and offset).
    pub fn batch(&mut self, step: u64, micro: usize) -> Result<Batch, DataError> {
        let first = self.samples_consumed(step)
            + ((micro * self.world + self.rank) * self.micro_batch) as u64;
        let t = self.step_seq_len(step);
        let mut inputs = Vec::with_capacity(self.micro_batch * t);
        let mut targets = Vec::with_capacity(self.micro_batch * t);
        let mut window = Vec::with_capacity(t + 1);
        let mut trained = Vec::with_capacity(t);
        let mut pieces = Vec::new();
        let mut firsts = Vec::with_capacity(self.micro_batch * t);
        let counting = self.parts.iter().any(|p| p.corpus.masked()) || self.eos.is_some();
        for i in 0..self.micro_batch as u64 {
            let k = self.window_of(first + i);
            self.window(k, &mut window, &mut trained, &mut pieces)?;
            if let Some(eos) = self.eos {
                firsts_of(&window[..t], eos, &pieces, &mut firsts);
            }
            inputs.extend_from_slice(&window[..t]);
            targets.extend(
                window[1..=t]
                    .iter()
                    .zip(&trained)
                    .map(|(&id, &on)| if on { id } else { IGNORED }),
            );
        }
        let rows = self.micro_batch;
        let divisor = match counting {
            // One counted target at least: a step whose targets are all
            // left out has a zero loss and zero gradients, not 0/0.
            true => {
                let counted = self.step_counted(step)?.max(1) as f64;
                counted / (self.grad_accum * self.world) as f64
            }
            false => (rows * t) as f64,
        };
        let documents = self.eos.map(|_| Documents::from_firsts(firsts, t));
        Ok(Batch {
            inputs,
            targets,
            rows,
            seq_len: t,
            divisor,
            documents,
        })
    }

    /// Window `k` (of source `k.0`)'s `t + 1` tokens into `tokens`, into `trained` whether
    /// each of its `t` targets is trained on, and into `pieces` where its
    /// packed documents (or their pieces) begin (none unless packed):
    /// trained is the loss mask's say, with documents kept apart not after
    /// an end-of-text id nor across a piece's start (a document whose end
    /// has no end-of-text id: the corpus's last, or a split one's piece),
    /// and never on a packed sequence's padding (end-of-text ids after its
    /// documents).
    fn window(
        &self,
        (source, k): (usize, usize),
        tokens: &mut Vec<u32>,
        trained: &mut Vec<bool>,
        pieces: &mut Vec<usize>,
    ) -> Result<(), DataError> {
        let t = self.seq_len;
        let Part { corpus, packed, .. } = &self.parts[source];
        tokens.clear();
        trained.clear();
        pieces.clear();
        match (packed, self.eos) {
            (Some(packed), Some(eos)) => {
                // Per token of the sequence: whether it is a target the
                // mask trains (padding is none).
                for doc in packed.sequence(k) {
                    pieces.push(tokens.len());
                    corpus.read(doc.start, doc.len(), tokens)?;
                    corpus.read_mask(doc.start, doc.len(), trained);
                }
                tokens.resize(t + 1, eos);
                trained.resize(t + 1, false);
                for &at in pieces.iter() {
                    trained[at] = false;
                }
                trained.remove(0);
            }
            _ => {
                let start = k * t;
                corpus.read(start, t + 1, tokens)?;
                corpus.read_mask(start + 1, t, trained);
            }
        }
        if let Some(eos) = self.eos {
            for (on, &input) in trained.iter_mut().zip(tokens.iter()) {
                *on &= input != eos;
            }
        }
        Ok(())
    }

    /// The targets that step `step`'s loss counts, over every rank and
    /// micro-batch (kept for the step's other micro-batches).
    fn step_counted(&mut self, step: u64) -> Result<u64, DataError> {
        if let Some((s, n)) = self.counted {
            if s == step {
                return Ok(n);
            }
        }
        let first = self.samples_consumed(step);
        let t = self.seq_len;
        let kept = self.step_seq_len(step);
        let (mut trained, mut window) = (Vec::with_capacity(t), Vec::with_capacity(t + 1));
        let mut pieces = Vec::new();
        let mut n = 0u64;
        for sample in first..first + self.per_step() {
            let k = self.window_of(sample);
            match self.eos {
                // A loss mask alone: its bytes, not the window's tokens
                // (pages of other ranks' windows).
                None => {
                    trained.clear();
                    let (source, k) = k;
                    self.parts[source]
                        .corpus
                        .read_mask(k * t + 1, t, &mut trained);
                }
                Some(_) => self.window(k, &mut window, &mut trained, &mut pieces)?,
            }
            n += trained[..kept].iter().filter(|&&on| on).count() as u64;
        }
        self.counted = Some((step, n));
        Ok(n)
    }
}

/// Appends, per token of a sequence's `inputs`, where its document begins:
/// after each `eos`, and at each of `pieces` (where a packed document, or a
/// piece of a split one, begins).
fn firsts_of(inputs: &[u32], eos: u32, pieces: &[usize], out: &mut Vec<u32>) {
    let mut begins = 0;
    let mut next_piece = pieces.iter().peekable();
    for (i, &id) in inputs.iter().enumerate() {
        if next_piece.next_if(|&&at| at <= i).is_some() {
            begins = i as u32;
        }
        out.push(begins);
        if id == eos {
            begins = i as u32 + 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counting(n: usize) -> Corpus {
        Corpus::from_tokens((0..n as u32).collect(), n)
    }

    fn all(c: &Corpus) -> Vec<u32> {
        let mut out = Vec::new();
        c.read(0, c.len(), &mut out).unwrap();
        out
    }

    #[test]
    fn ranks_read_disjoint_samples_and_the_split_does_not_change_the_global_batch() {
        let one = |accum, world, rank| {
            Batcher::new(counting(10_000), 16, 4, accum, world, rank, 9).unwrap()
        };
        // 1 worker, 2 micro-batches == 2 workers, 1 micro-batch each.
        let mut solo = one(2, 1, 0);
        let (mut r0, mut r1) = (one(1, 2, 0), one(1, 2, 1));
        for step in 0..5 {
            assert_eq!(solo.batch(step, 0).unwrap(), r0.batch(step, 0).unwrap());
            assert_eq!(solo.batch(step, 1).unwrap(), r1.batch(step, 0).unwrap());
            assert_ne!(
                r0.batch(step, 0).unwrap().inputs,
                r1.batch(step, 0).unwrap().inputs
            );
        }
        let b = r0.batch(0, 0).unwrap();
        assert_eq!(b.inputs.len(), 64);
        for row in 0..4 {
            // Targets are inputs shifted by one.
            assert_eq!(b.targets[row * 16], b.inputs[row * 16] + 1);
        }
    }

    #[test]
    fn a_resumed_batcher_continues_at_the_same_sample_with_another_split() {
        let two = Batcher::new(counting(10_000), 16, 4, 1, 2, 0, 9).unwrap();
        let consumed = two.samples_consumed(3);
        assert_eq!(consumed, 24);
        // Resume on 1 rank with 8 sequences: its step 3 is what ranks 0 and 1 would have read.
        let mut one = Batcher::new(counting(10_000), 16, 8, 1, 1, 0, 9).unwrap();
        one.resume_at(3, consumed);
        let mut r0 = Batcher::new(counting(10_000), 16, 4, 1, 2, 0, 9).unwrap();
        let mut r1 = Batcher::new(counting(10_000), 16, 4, 1, 2, 1, 9).unwrap();
        let mut want = r0.batch(3, 0).unwrap().inputs;
        want.extend(r1.batch(3, 0).unwrap().inputs);
        assert_eq!(one.batch(3, 0).unwrap().inputs, want);
    }

    /// A blend: each source its weight's share of the sequences, every
    /// window of a source once in each of its epochs (the small one's
    /// sooner), and the global batch whatever the split or a resume.
    #[test]
    fn a_blend_gives_each_source_its_share_and_keeps_the_split_and_resume_invariants() {
        // Source 0's tokens are below 1000, source 1's from 1000 on; 17 and
        // 5 windows of 16.
        let big = Corpus::from_tokens((0..17 * 16 + 1).collect(), 2000);
        let small = Corpus::from_tokens((1000..1000 + 5 * 16 + 1).collect(), 2000);
        let blend = |accum, world, rank| {
            let sources = vec![(big.clone(), 3.0), (small.clone(), 1.0)];
            Batcher::blended(sources, (16, 2, accum, world, rank, 9)).unwrap()
        };
        let (mut solo, mut r0, mut r1) = (blend(2, 1, 0), blend(1, 2, 0), blend(1, 2, 1));
        let mut rows = Vec::new();
        for step in 0..40 {
            let (a, b) = (solo.batch(step, 0).unwrap(), solo.batch(step, 1).unwrap());
            assert_eq!(a, r0.batch(step, 0).unwrap(), "step {step}");
            assert_eq!(b, r1.batch(step, 0).unwrap(), "step {step}");
            for batch in [a, b] {
                rows.extend(batch.inputs.chunks(16).map(|r| r[0]));
            }
        }
        // 160 sequences: 120 from the first source, 40 from the second.
        let (first, second): (Vec<u32>, Vec<u32>) = rows.iter().partition(|&&t| t < 1000);
        assert_eq!((first.len(), second.len()), (120, 40));
        // Every epoch of a source visits each of its windows once.
        for (rows, windows) in [(&first, 17), (&second, 5)] {
            for epoch in rows.chunks(windows).filter(|e| e.len() == windows) {
                let mut seen = epoch.to_vec();
                seen.sort();
                seen.dedup();
                assert_eq!(seen.len(), windows, "an epoch repeated a window: {epoch:?}");
            }
        }
        // A resume at another split reads on where the run was.
        let mut resumed = blend(1, 1, 0);
        resumed.resume_at(7, solo.samples_consumed(7));
        let mut want = solo.batch(7, 0).unwrap().inputs;
        want.extend(solo.batch(7, 1).unwrap().inputs);
        let mut got = resumed.batch(7, 0).unwrap().inputs;
        got.extend(resumed.batch(7, 1).unwrap().inputs);
        assert_eq!(got, want);
    }

    /// Documents kept apart: each batch says where its documents begin, the
    /// target after an end-of-text id is left out, and the divisor counts
    /// the step's other targets, whatever the split (1 worker with 2
    /// micro-batches, 2 workers with 1 each).
    #[test]
    fn documents_kept_apart_leave_out_the_target_after_each_end() {
        // Every 5th token is the end-of-text id 0.
        let tokens: Vec<u32> = (0..2000u32)
            .map(|i| if i % 5 == 4 { 0 } else { 1 + i % 7 })
            .collect();
        let corpus = Corpus::from_tokens(tokens, 8);
        let one = |accum, world, rank| {
            Batcher::new(corpus.clone(), 16, 2, accum, world, rank, 9)
                .unwrap()
                .separate_documents(0)
        };
        let (mut solo, mut r0, mut r1) = (one(2, 1, 0), one(1, 2, 0), one(1, 2, 1));
        for step in 0..3 {
            let (a, b) = (solo.batch(step, 0).unwrap(), solo.batch(step, 1).unwrap());
            assert_eq!(a, r0.batch(step, 0).unwrap());
            assert_eq!(b, r1.batch(step, 0).unwrap());
            let mut left_out = 0;
            for batch in [&a, &b] {
                let docs = batch.documents.as_ref().expect("documents");
                assert_eq!(*docs, Documents::after_eos(&batch.inputs, 16, 0));
                for (&input, &target) in batch.inputs.iter().zip(&batch.targets) {
                    assert_eq!(target == IGNORED, input == 0);
                    left_out += usize::from(input == 0);
                }
            }
            // 4 sequences of 16 targets, 3 or 4 of each after an end; the
            // divisor is the step's counted targets over its 2 micro-batches.
            assert!((12..=16).contains(&left_out), "{left_out}");
            assert_eq!(a.divisor, (64 - left_out) as f64 / 2.0);
            assert_eq!(a.divisor, b.divisor);
        }
    }

    /// A curriculum's step is the uncut step's batch cut to the step's
    /// length, row by row: inputs, targets, where documents begin (counted
    /// again over the kept tokens) and the divisor (the kept targets the
    /// step trains on, over its micro-batches); the batches of a step past
    /// the curriculum are the uncut ones.
    #[test]
    fn a_curriculum_step_is_the_uncut_batch_cut_to_its_length() {
        use zconfig::curriculum::{CurriculumSchedule, CurriculumSpec};
        let tokens: Vec<u32> = (0..4000u32)
            .map(|i| if i % 5 == 4 { 0 } else { 1 + i % 7 })
            .collect();
        let corpus = Corpus::from_tokens(tokens, 8);
        let curriculum = CurriculumSpec {
            min_difficulty: 8,
            max_difficulty: None,
            schedule_type: CurriculumSchedule::FixedDiscrete,
            total_curriculum_step: None,
            difficulty_step: None,
            root_degree: None,
            difficulty: vec![5, 11, 32],
            max_step: vec![1, 2],
        };
        let one = |cut: bool| {
            let b = Batcher::new(corpus.clone(), 32, 2, 2, 1, 0, 9)
                .unwrap()
                .separate_documents(0);
            b.with_curriculum(cut.then(|| curriculum.clone()))
        };
        let (mut uncut, mut cut) = (one(false), one(true));
        for (step, t) in [(0, 5), (1, 11), (2, 32), (3, 32)] {
            assert_eq!(cut.step_seq_len(step), t);
            let mut kept_targets = 0;
            let (mut whole, mut short) = (Vec::new(), Vec::new());
            for micro in 0..2 {
                let (w, c) = (
                    uncut.batch(step, micro).unwrap(),
                    cut.batch(step, micro).unwrap(),
                );
                assert_eq!((c.rows, c.seq_len), (2, t));
                for row in 0..2 {
                    let (wr, cr) = (row * 32..row * 32 + t, row * t..(row + 1) * t);
                    assert_eq!(c.inputs[cr.clone()], w.inputs[wr.clone()], "step {step}");
                    assert_eq!(c.targets[cr], w.targets[wr], "step {step}");
                }
                assert_eq!(c.documents, Some(Documents::after_eos(&c.inputs, t, 0)));
                kept_targets += c.targets.iter().filter(|&&x| x != IGNORED).count();
                whole.push(w);
                short.push(c);
            }
            for c in &short {
                assert_eq!(c.divisor, kept_targets as f64 / 2.0, "step {step}");
            }
            if t == 32 {
                assert_eq!(short, whole);
            }
        }
    }

    /// Packed whole: each sequence holds whole documents (the target
    /// after each end-of-text id and the padding's left out), an epoch
    /// holds every document once, and the divisor counts the step's
    /// trained targets.
    #[test]
    fn packed_documents_are_whole_and_their_padding_untrained() {
        // Documents of 3 to 9 tokens, each ended by the id 0.
        let mut tokens = Vec::new();
        for d in 0..40u32 {
            tokens.extend((0..2 + d % 7).map(|j| 1 + (d + j) % 6));
            tokens.push(0);
        }
        let corpus = Corpus::from_tokens(tokens.clone(), 8);
        let docs = corpus.documents(0).unwrap();
        assert_eq!(docs.len(), 40);
        let mut b = Batcher::new(corpus, 15, 1, 1, 1, 0, 3)
            .unwrap()
            .pack_documents(0, Overflow::Truncate)
            .unwrap();
        let mut seen = Vec::new();
        for step in 0..b.windows() as u64 {
            let batch = b.batch(step, 0).unwrap();
            let mut window = batch.inputs.clone();
            // The last token: its target, or where that is left out (after
            // an end-of-text id) padding, as no document fits in one token.
            let last = *batch.targets.last().unwrap();
            window.push(if last == IGNORED { 0 } else { last });
            // Whole documents, then padding (end-of-text ids).
            let mut at = 0;
            while at < 16 {
                let doc = docs
                    .iter()
                    .find(|&d| tokens[d.clone()] == window[at..(at + d.len()).min(16)]);
                match doc {
                    Some(d) if window[at] != 0 => {
                        seen.push(d.start);
                        at += d.len();
                    }
                    _ => {
                        assert!(window[at..].iter().all(|&id| id == 0), "{window:?}");
                        break;
                    }
                }
            }
            let counted = batch.targets.iter().filter(|&&t| t != IGNORED).count();
            assert_eq!(batch.divisor, counted.max(1) as f64);
            for (j, (&input, &target)) in batch.inputs.iter().zip(&batch.targets).enumerate() {
                assert_eq!(target == IGNORED, input == 0, "position {j} of {window:?}");
            }
        }
        seen.sort();
        assert_eq!(seen, docs.iter().map(|d| d.start).collect::<Vec<_>>());
    }

    /// `bfd_split`: a document three sequences long becomes pieces packed
    /// as documents of their own, and the corpus's last document, which
    /// no end-of-text id ends, stays apart from whatever follows it in its
    /// sequence; every token is in a sequence, each piece's tokens see
    /// back to its first alone, and no target crosses a piece's start.
    #[test]
    fn split_documents_train_every_token_in_pieces_kept_apart() {
        // Documents of 3 to 9 tokens ended by the id 0, one of 40, and a
        // last one of 10 with no end (the only 10: its sequence's room of 6
        // is the best fit of the next document of 6).
        let mut tokens = Vec::new();
        for d in 0..30u32 {
            let len = if d == 7 { 39 } else { 2 + d % 7 };
            tokens.extend((0..len).map(|j| 1 + (d + j) % 6));
            tokens.push(0);
        }
        tokens.extend([5, 4, 3, 2, 1, 5, 4, 3, 2, 1]);
        let corpus = Corpus::from_tokens(tokens.clone(), 8);
        let n = corpus.len();
        let mut b = Batcher::new(corpus, 15, 1, 1, 1, 0, 3)
            .unwrap()
            .pack_documents(0, Overflow::Split)
            .unwrap();
        let packed = b.packed()[0].clone();
        assert_eq!(
            (packed.split(), packed.cut(), packed.tokens()),
            ((1, 3), (0, 0), n)
        );
        let mut seen = vec![0; n];
        let mut after_no_end = 0;
        for step in 0..b.windows() as u64 {
            let (_, k) = b.window_of(step);
            let batch = b.batch(step, 0).unwrap();
            let firsts = batch.documents.as_ref().unwrap().firsts(0).to_vec();
            // Per token of the t + 1: the start of the piece it is in.
            let mut piece_of = vec![None; 16];
            let mut at = 0;
            let mut before: Option<&std::ops::Range<usize>> = None;
            for piece in packed.sequence(k) {
                after_no_end += usize::from(before.is_some_and(|p| tokens[p.end - 1] != 0));
                before = Some(piece);
                for (j, c) in piece.clone().enumerate() {
                    seen[c] += 1;
                    piece_of[at + j] = Some(at);
                    if at + j < 15 {
                        assert_eq!(batch.inputs[at + j], tokens[c], "token {c}");
                    }
                }
                at += piece.len();
            }
            for j in 0..15 {
                if let Some(start) = piece_of[j] {
                    assert_eq!(firsts[j] as usize, start, "step {step}, token {j}");
                }
                // Trained: within a piece, not after an end-of-text id.
                let trained =
                    piece_of[j + 1].is_some_and(|start| start <= j) && batch.inputs[j] != 0;
                assert_eq!(
                    batch.targets[j] != IGNORED,
                    trained,
                    "step {step}, target {j}"
                );
            }
        }
        assert!(seen.iter().all(|&c| c == 1), "every token once: {seen:?}");
        assert!(after_no_end > 0, "no piece followed one without an end");
    }

    #[test]
    fn an_epoch_visits_every_window_once() {
        let mut b = Batcher::new(counting(1601), 16, 1, 1, 1, 0, 3).unwrap();
        assert_eq!(b.windows(), 100);
        let mut seen: Vec<u32> = (0..100).map(|s| b.batch(s, 0).unwrap().inputs[0]).collect();
        seen.sort();
        assert_eq!(seen, (0..100).map(|w| w * 16).collect::<Vec<_>>());
    }

    #[test]
    fn text_and_token_files_load_and_bad_ids_are_refused() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("a.txt"), b"hello").unwrap();
        std::fs::write(d.path().join("b.txt"), b" world").unwrap();
        let pat = Some(format!("{}/*.txt", d.path().display()));
        let c = Corpus::load(&pat, DataFormat::Text, 256, 0).unwrap();
        assert_eq!(c.len(), 11);
        std::fs::write(d.path().join("t.bin"), [1u8, 0, 200, 0]).unwrap();
        let pat = Some(format!("{}/t.bin", d.path().display()));
        assert_eq!(
            Corpus::load(&pat, DataFormat::TokensU16, 256, 0)
                .unwrap()
                .len(),
            2
        );
        // An id outside the vocabulary fails the read that meets it, naming
        // the file and the offset.
        let small = Corpus::load(&pat, DataFormat::TokensU16, 100, 0).unwrap();
        let mut out = Vec::new();
        small.read(0, 1, &mut out).unwrap();
        let e = small.read(0, 2, &mut out).unwrap_err().to_string();
        assert!(
            e.contains("t.bin: token 200 at token offset 1 (byte 2) is not below vocab_size 100"),
            "{e}"
        );
    }

    #[test]
    fn synthetic_corpus_is_seeded() {
        let s = |seed| all(&Corpus::synthetic(50, seed));
        assert_eq!(s(1), s(1));
        assert_ne!(s(1), s(2));
    }

    /// Files are one stream: a read that crosses from one file into the
    /// next, in u32 and u16 and text, returns the bytes' tokens in order.
    #[test]
    fn reads_cross_file_boundaries_in_every_width() {
        let d = tempfile::tempdir().unwrap();
        let ids: Vec<u32> = vec![3, 70_000, 5, 65_536, 9, 1];
        let le = |v: &[u32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        std::fs::write(d.path().join("a.bin"), le(&ids[..2])).unwrap();
        std::fs::write(d.path().join("b.bin"), le(&ids[2..3])).unwrap();
        std::fs::write(d.path().join("c.bin"), le(&ids[3..])).unwrap();
        let pat = Some(format!("{}/*.bin", d.path().display()));
        let c = Corpus::load(&pat, DataFormat::TokensU32, 70_001, 0).unwrap();
        assert_eq!(all(&c), ids);
        let mut out = Vec::new();
        c.read(1, 4, &mut out).unwrap();
        assert_eq!(out, ids[1..5]);
        let (train, val) = c.split_tail(0.5);
        assert_eq!(
            (all(&train), all(&val.unwrap())),
            (ids[..3].to_vec(), ids[3..].to_vec())
        );
        std::fs::write(d.path().join("x.u16"), [1u8, 0, 2, 0]).unwrap();
        std::fs::write(d.path().join("y.u16"), [3u8, 1]).unwrap();
        let pat = Some(format!("{}/*.u16", d.path().display()));
        let c = Corpus::load(&pat, DataFormat::TokensU16, 1000, 0).unwrap();
        assert_eq!(all(&c), [1, 2, 259]);
        let pat = Some(format!("{}/[xy].u16", d.path().display()));
        let c = Corpus::load(&pat, DataFormat::Text, 256, 0).unwrap();
        assert_eq!(all(&c), [1, 0, 2, 0, 3, 1]);
    }

    /// A loss mask beside the token file (named by its manifest) turns the
    /// left-out targets into IGNORED, and every micro-batch of a step, on
    /// every rank and split, divides by the step's count of trained
    /// targets over its micro-batches; a mask of another file's length is
    /// refused.
    #[test]
    fn a_loss_mask_leaves_targets_out_and_each_step_divides_by_its_count() {
        let d = tempfile::tempdir().unwrap();
        let n = 2000u32;
        let ids: Vec<u8> = (0..n).flat_map(|i| (i as u16).to_le_bytes()).collect();
        // Trained: tokens whose id is not a multiple of 3 or 7.
        let on = |id: u32| !id.is_multiple_of(3) && !id.is_multiple_of(7);
        let mask: Vec<u8> = (0..n).map(|i| u8::from(on(i))).collect();
        std::fs::write(d.path().join("train.bin"), &ids).unwrap();
        std::fs::write(d.path().join("train.mask"), &mask).unwrap();
        let manifest = |bytes: usize, masked: bool| {
            let mut file = serde_json::json!({"tokens": n, "bytes": bytes,
                "max_token_id": n - 1, "documents": 1});
            if masked {
                file["mask"] = serde_json::json!({"file": "train.mask", "trained": 0});
            }
            let m = serde_json::json!({
                "tokenizer": "t.json", "tokenizer_sha256": "0", "vocab_size": n,
                "format": "tokens_u16", "eos_id": null, "files": {"train.bin": file}
            });
            std::fs::write(d.path().join("manifest.json"), m.to_string()).unwrap();
        };
        manifest(ids.len(), true);
        let pat = Some(format!("{}/train.bin", d.path().display()));
        let c = Corpus::load(&pat, DataFormat::TokensU16, n as usize, 0).unwrap();
        assert!(c.masked());
        let (seq, mb) = (16, 4);
        for (accum, world) in [(1, 1), (2, 1), (1, 2), (2, 2)] {
            for step in 0..3u64 {
                let (mut counted, mut divisors) = (0usize, Vec::new());
                for rank in 0..world {
                    let mut b = Batcher::new(c.clone(), seq, mb, accum, world, rank, 9).unwrap();
                    for micro in 0..accum {
                        let batch = b.batch(step, micro).unwrap();
                        for (i, &t) in batch.targets.iter().enumerate() {
                            // The target after input x is x + 1 (counting ids).
                            let want = batch.inputs[i] + 1;
                            match on(want) {
                                true => assert_eq!(t, want),
                                false => assert_eq!(t, IGNORED),
                            }
                        }
                        counted += batch.targets.iter().filter(|&&t| t != IGNORED).count();
                        divisors.push(batch.divisor);
                    }
                }
                // The step's micro-batches all divide by N / (accum · world).
                let want = counted as f64 / (accum * world) as f64;
                assert!(
                    divisors.iter().all(|&x| x == want),
                    "{divisors:?} vs {want}"
                );
            }
        }
        manifest(ids.len() + 2, true);
        let e = Corpus::load(&pat, DataFormat::TokensU16, n as usize, 0).unwrap_err();
        assert!(e.to_string().contains("prepare it again"), "{e}");
        manifest(ids.len(), true);
        std::fs::write(d.path().join("train.mask"), &mask[1..]).unwrap();
        let e = Corpus::load(&pat, DataFormat::TokensU16, n as usize, 0).unwrap_err();
        assert!(e.to_string().contains("not one per token"), "{e}");
        // Without the manifest's mask the same file trains on every target.
        manifest(ids.len(), false);
        let plain = Corpus::load(&pat, DataFormat::TokensU16, n as usize, 0).unwrap();
        assert!(!plain.masked());
        let mut b = Batcher::new(plain, seq, mb, 1, 1, 0, 9).unwrap();
        let batch = b.batch(0, 0).unwrap();
        assert!(!batch.targets.contains(&IGNORED));
        assert_eq!(batch.divisor, (seq * mb) as f64);
    }

    #[test]
    fn the_held_out_tail_is_disjoint_from_training_data() {
        let (train, val) = counting(1000).split_tail(0.1);
        let val = val.unwrap();
        assert_eq!((train.len(), val.len()), (900, 100));
        assert_eq!((all(&train)[899], all(&val)[0]), (899, 900));
        let (all, none) = counting(10).split_tail(0.0);
        assert!(none.is_none() && all.len() == 10);
    }
}
