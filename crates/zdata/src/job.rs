//! A job spec's data, built one way for the workers that train on it and
//! for zrun, which counts an epoch's sequences before launch
//! (`train.epochs`): the sources (`data.path`, or each of `data.blend`'s)
//! with their weights, their held-out tails under `data.val_fraction` (or
//! `data.val_path`), and the batcher over them as `data.packing` and
//! `data.separate_documents` say.

use zconfig::spec::Packing;
use zconfig::JobSpec;

use crate::packing::Overflow;
use crate::{Batcher, Corpus, DataError};

/// A job's training and validation sources, each with its weight.
pub struct Sources {
    /// What trains: each source's part before its held-out tail.
    pub train: Vec<(Corpus, f64)>,
    /// What validates: `data.val_path`, or each source's held-out tail
    /// blended as its source is; empty without validation data.
    pub held_out: Vec<(Corpus, f64)>,
}

impl Sources {
    /// Opens (memory-maps) `spec`'s data.
    pub fn open(spec: &JobSpec) -> Result<Sources, DataError> {
        let d = &spec.data;
        let (vocab, seed) = (spec.model.vocab_size, spec.train.seed);
        let mut train = Vec::new();
        let mut held_out = Vec::new();
        for (_, path, weight) in d.sources() {
            let (part, tail) =
                Corpus::load(&path, d.format, vocab, seed)?.split_tail(d.val_fraction);
            train.push((part, weight));
            held_out.extend(tail.map(|c| (c, weight)));
        }
        if d.val_path.is_some() {
            held_out = vec![(Corpus::load(&d.val_path, d.format, vocab, seed)?, 1.0)];
        }
        Ok(Sources { train, held_out })
    }
}

/// The batcher of `rank` of `world` over `sources` at `spec`'s sequence
/// length, micro-batch and seed, `accum` micro-batches a step: documents
/// kept apart (at the same end-of-text id in training and validation) and
/// packed as the job says.
pub fn batcher(
    spec: &JobSpec,
    sources: Vec<(Corpus, f64)>,
    accum: usize,
    world: usize,
    rank: usize,
) -> Result<Batcher, DataError> {
    let d = &spec.data;
    let eos = match d.separate_documents {
        true => Some(d.document_eos().map_err(DataError::Invalid)?),
        false => None,
    };
    let shape = (
        spec.model.seq_len,
        spec.train.micro_batch_size,
        accum,
        world,
        rank,
        spec.train.seed,
    );
    let b = Batcher::blended(sources, shape)?;
    Ok(match (eos, d.packing) {
        (Some(eos), Packing::Bfd) => b.pack_documents(eos, Overflow::Truncate)?,
        (Some(eos), Packing::BfdSplit) => b.pack_documents(eos, Overflow::Split)?,
        (Some(eos), Packing::Wrapped) => b.separate_documents(eos),
        (None, _) => b,
    })
}

/// The sequences of one epoch of `spec`'s training data: its windows, or
/// its packed sequences (of every source together, for a blend). Reads the
/// whole data once where documents are packed, as each worker does.
pub fn sequences_per_epoch(spec: &JobSpec) -> Result<u64, DataError> {
    let sources = Sources::open(spec)?;
    Ok(batcher(spec, sources.train, 1, 1, 0)?.windows() as u64)
}
