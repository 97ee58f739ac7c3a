//! The safetensors files that hold a Hugging Face model's weights: one
//! `model.safetensors`, or the shards that `model.safetensors.index.json`
//! maps. `transformers`' `save_pretrained` splits a model past its
//! `max_shard_size` (most published models of a billion parameters and
//! more come that way), and its loader takes `model.safetensors` first,
//! then the index, as this does.
//!
//! The shards' own headers say what each holds; the index is held to them
//! (every tensor it names is in the shard it names), a tensor in two shards
//! is refused rather than one of them picked, and a shard is a file beside
//! the index, never a path that leads elsewhere.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use crate::hf::{HF_WEIGHTS, HF_WEIGHTS_INDEX};
use crate::stream::TensorFile;
use crate::{invalid, io, CkptError};

/// A model's weight files, opened (headers only), and where each tensor is.
pub(crate) struct HfFiles {
    files: Vec<TensorFile>,
    /// Tensor name → (index into `files`, shape).
    tensors: HashMap<String, (usize, Vec<usize>)>,
    /// What an error about a missing tensor names: the file, or the index.
    named: PathBuf,
}

impl HfFiles {
    /// The weights in `path`: a directory (`model.safetensors`, else the
    /// shards of `model.safetensors.index.json`) or a safetensors file.
    pub(crate) fn open(path: &Path) -> Result<HfFiles, CkptError> {
        if !path.is_dir() {
            return HfFiles::of(vec![TensorFile::open(path)?], path);
        }
        let single = path.join(HF_WEIGHTS);
        if single.is_file() {
            return HfFiles::of(vec![TensorFile::open(&single)?], &single);
        }
        let index = path.join(HF_WEIGHTS_INDEX);
        if index.is_file() {
            return HfFiles::sharded(&index);
        }
        let pickled = ["pytorch_model.bin", "pytorch_model.bin.index.json"]
            .iter()
            .any(|f| path.join(f).exists());
        Err(invalid(
            path,
            format!(
                "no {HF_WEIGHTS} or {HF_WEIGHTS_INDEX} in this directory{}",
                match pickled {
                    true =>
                        " (PyTorch's pickled pytorch_model.bin is not read: save the model \
                             with save_pretrained(dir, safe_serialization=True))",
                    false => "",
                }
            ),
        ))
    }

    fn of(files: Vec<TensorFile>, named: &Path) -> Result<HfFiles, CkptError> {
        let mut tensors = HashMap::new();
        for (i, f) in files.iter().enumerate() {
            for (name, shape) in f.tensors() {
                if let Some((j, _)) = tensors.insert(name.clone(), (i, shape)) {
                    return Err(invalid(
                        f.path(),
                        format!("{name} is also in {}", files[j].path().display()),
                    ));
                }
            }
        }
        Ok(HfFiles {
            files,
            tensors,
            named: named.to_path_buf(),
        })
    }

    fn sharded(index: &Path) -> Result<HfFiles, CkptError> {
        let text = std::fs::read(index).map_err(io(index))?;
        let bad = |what: String| invalid(index, format!("not a safetensors index: {what}"));
        let value: serde_json::Value =
            serde_json::from_slice(&text).map_err(|e| bad(e.to_string()))?;
        let map = value
            .get("weight_map")
            .and_then(serde_json::Value::as_object)
            .ok_or_else(|| bad("no \"weight_map\" object".into()))?;
        let mut placed = Vec::with_capacity(map.len());
        for (tensor, shard) in map {
            let shard = shard
                .as_str()
                .ok_or_else(|| bad(format!("weight_map.{tensor} is {shard}, not a file name")))?;
            // A file beside the index: no directory part, not `..`.
            if Path::new(shard).file_name() != Some(shard.as_ref()) || shard == ".." {
                return Err(bad(format!(
                    "weight_map.{tensor} is {shard:?}, not a file name beside the index"
                )));
            }
            placed.push((tensor.as_str(), shard));
        }
        let dir = index.parent().unwrap_or(Path::new("."));
        let names: Vec<&str> = placed
            .iter()
            .map(|&(_, s)| s)
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        if names.is_empty() {
            return Err(bad("its weight_map is empty".into()));
        }
        let files = names
            .iter()
            .map(|n| {
                let p = dir.join(n);
                match p.is_file() {
                    true => TensorFile::open(&p),
                    false => Err(invalid(
                        index,
                        format!("names {n}, which is not in {}", dir.display()),
                    )),
                }
            })
            .collect::<Result<Vec<_>, _>>()?;
        let out = HfFiles::of(files, index)?;
        for (tensor, shard) in placed {
            let at = names.binary_search(&shard).expect("every shard was named");
            if out.tensors.get(tensor).map(|t| t.0) != Some(at) {
                return Err(invalid(
                    index,
                    format!("puts {tensor} in {shard}, which does not hold it"),
                ));
            }
        }
        Ok(out)
    }

    /// Every tensor's name and shape.
    pub(crate) fn shapes(&self) -> HashMap<String, Vec<usize>> {
        self.tensors
            .iter()
            .map(|(n, (_, s))| (n.clone(), s.clone()))
            .collect()
    }

    /// The file that holds `name`, or (for one that is missing) the file or
    /// index an error should name.
    pub(crate) fn path_of(&self, name: &str) -> &Path {
        match self.tensors.get(name) {
            Some(&(i, _)) => self.files[i].path(),
            None => &self.named,
        }
    }

    /// Tensor `name`'s values as f32.
    pub(crate) fn read(&self, name: &str) -> Result<Vec<f32>, CkptError> {
        self.file_of(name)?.read(name)
    }

    /// Tensor `name`'s bf16 bits, if it is stored in bf16.
    pub(crate) fn read_bf16(&self, name: &str) -> Result<Option<Vec<u16>>, CkptError> {
        self.file_of(name)?.read_bf16(name)
    }

    fn file_of(&self, name: &str) -> Result<&TensorFile, CkptError> {
        match self.tensors.get(name) {
            Some(&(i, _)) => Ok(&self.files[i]),
            None => Err(invalid(&self.named, format!("tensor {name} is missing"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hf::{self, HF_CONFIG};
    use crate::stream::StreamWriter;
    use zconfig::spec::ModelSpec;

    fn llama() -> ModelSpec {
        serde_json::from_value(serde_json::json!({
            "kind": "llama", "vocab_size": 16, "d_model": 8, "n_layers": 2,
            "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 6
        }))
        .unwrap()
    }

    /// `m` saved as a Hugging Face directory, every value distinct.
    fn saved(m: &ModelSpec) -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        let params = m.param_shapes();
        let (mut shapes, mut next) = (params.iter(), 0f32);
        hf::write_dir(m, &params, d.path(), || {
            Ok(shapes.next().map(|(_, s)| {
                (0..s.iter().product::<usize>())
                    .map(|_| {
                        next += 1.0;
                        next / 1024.0
                    })
                    .collect()
            }))
        })
        .unwrap();
        d
    }

    /// Splits the directory's `model.safetensors` into `n` shards, tensors
    /// dealt round, with the index `transformers` writes beside them.
    fn shard(dir: &Path, n: usize) -> serde_json::Value {
        let single = TensorFile::open(&dir.join(HF_WEIGHTS)).unwrap();
        let tensors = single.tensors();
        let mut map = serde_json::Map::new();
        for s in 0..n {
            let file = format!("model-{:05}-of-{n:05}.safetensors", s + 1);
            let mine: Vec<_> = tensors.iter().skip(s).step_by(n).cloned().collect();
            let mut w = StreamWriter::create(&dir.join(&file), &mine, None).unwrap();
            for (name, _) in &mine {
                w.write(&single.read(name).unwrap()).unwrap();
                map.insert(name.clone(), file.clone().into());
            }
            w.finish().unwrap();
        }
        std::fs::remove_file(dir.join(HF_WEIGHTS)).unwrap();
        let index = serde_json::json!({"metadata": {"total_size": 0}, "weight_map": map});
        write_index(dir, &index);
        index
    }

    fn write_index(dir: &Path, index: &serde_json::Value) {
        std::fs::write(dir.join(HF_WEIGHTS_INDEX), index.to_string()).unwrap();
    }

    fn read(m: &ModelSpec, dir: &Path) -> Result<crate::Weights, String> {
        let params = m.param_shapes();
        let w = hf::HfWeights::open(m, &params, dir).map_err(|e| e.to_string())?;
        params
            .into_iter()
            .map(|(n, s)| Ok((n.clone(), (s, w.read(&n).map_err(|e| e.to_string())?))))
            .collect()
    }

    #[test]
    fn shards_read_as_the_one_file_they_were_cut_from() {
        let m = llama();
        let d = saved(&m);
        let whole = read(&m, d.path()).unwrap();
        // What was written: every parameter's values in turn, 1/1024 apart
        // (so a piece put in the wrong place, transposed or not, shows).
        let mut next = 0f32;
        for (name, shape) in m.param_shapes() {
            let want: Vec<f32> = (0..shape.iter().product::<usize>())
                .map(|_| {
                    next += 1.0;
                    next / 1024.0
                })
                .collect();
            assert_eq!(whole[&name], (shape, want), "{name}");
        }
        shard(d.path(), 3);
        assert_eq!(read(&m, d.path()).unwrap(), whole);
        // As transformers does, model.safetensors is taken before the index.
        let other = saved(&llama());
        std::fs::copy(other.path().join(HF_WEIGHTS), d.path().join(HF_WEIGHTS)).unwrap();
        write_index(d.path(), &serde_json::json!("not an index"));
        assert_eq!(read(&m, d.path()).unwrap(), whole);
    }

    type Edit<'a> = Box<dyn Fn(&mut serde_json::Value) + 'a>;

    #[test]
    fn an_index_that_disagrees_with_its_shards_is_refused_naming_it() {
        let m = llama();
        let d = saved(&m);
        let index = shard(d.path(), 2);
        let first = index["weight_map"]
            .as_object()
            .unwrap()
            .keys()
            .next()
            .unwrap()
            .clone();
        let edited = |edit: &dyn Fn(&mut serde_json::Value)| {
            let mut i = index.clone();
            edit(&mut i);
            write_index(d.path(), &i);
            read(&m, d.path()).unwrap_err()
        };
        let cases: Vec<(Edit, &str)> = vec![
            (
                Box::new(|i| *i = serde_json::json!([])),
                "no \"weight_map\" object",
            ),
            (
                Box::new(|i| i["weight_map"] = serde_json::json!({})),
                "its weight_map is empty",
            ),
            (
                Box::new(|i| i["weight_map"][&first] = 3.into()),
                "is 3, not a file name",
            ),
            (
                Box::new(|i| {
                    i["weight_map"][&first] = "../model-00001-of-00002.safetensors".into()
                }),
                "not a file name beside the index",
            ),
            (
                Box::new(|i| i["weight_map"][&first] = "..".into()),
                "not a file name beside",
            ),
            (
                Box::new(|i| i["weight_map"][&first] = "model-00003-of-00002.safetensors".into()),
                "names model-00003-of-00002.safetensors, which is not in",
            ),
        ];
        for (edit, says) in cases {
            let e = edited(&*edit);
            assert!(
                e.contains(HF_WEIGHTS_INDEX) && e.contains(says),
                "{says}: {e}"
            );
        }
        // A tensor put in the other shard than the one holding it.
        let e = edited(&|i| {
            let w = &mut i["weight_map"][&first];
            *w = match w.as_str().unwrap().starts_with("model-00001") {
                true => "model-00002-of-00002.safetensors",
                false => "model-00001-of-00002.safetensors",
            }
            .into();
        });
        assert!(e.contains(&format!("puts {first} in model-0000")), "{e}");
        // A tensor the index leaves out still counts where its shard holds it.
        write_index(d.path(), &index);
        let whole = read(&m, d.path()).unwrap();
        let mut left_out = index.clone();
        left_out["weight_map"]
            .as_object_mut()
            .unwrap()
            .remove(&first);
        write_index(d.path(), &left_out);
        assert_eq!(read(&m, d.path()).unwrap(), whole);
        std::fs::write(d.path().join(HF_WEIGHTS_INDEX), "{").unwrap();
        assert!(read(&m, d.path())
            .unwrap_err()
            .contains("not a safetensors index"));
    }

    #[test]
    fn a_tensor_in_two_shards_or_a_damaged_shard_is_refused_naming_the_shard() {
        let m = llama();
        let d = saved(&m);
        let index = shard(d.path(), 2);
        let second = d.path().join("model-00002-of-00002.safetensors");
        let kept = std::fs::read(&second).unwrap();
        // Shard 2 rewritten to hold one of shard 1's tensors as well.
        let one = TensorFile::open(&d.path().join("model-00001-of-00002.safetensors")).unwrap();
        let two = TensorFile::open(&second).unwrap();
        let (twice, shape) = one.tensors()[0].clone();
        let mut tensors = two.tensors();
        tensors.push((twice.clone(), shape));
        let values: Vec<Vec<f32>> = tensors
            .iter()
            .map(|(n, _)| two.read(n).or_else(|_| one.read(n)).unwrap())
            .collect();
        let tmp = d.path().join("rewritten");
        let mut w = StreamWriter::create(&tmp, &tensors, None).unwrap();
        values.iter().for_each(|v| w.write(v).unwrap());
        w.finish().unwrap();
        std::fs::rename(&tmp, &second).unwrap();
        let e = read(&m, d.path()).unwrap_err();
        assert!(
            e.contains("model-00002-of-00002.safetensors")
                && e.contains(&format!("{twice} is also in")),
            "{e}"
        );
        // Shard 2 cut short.
        std::fs::write(&second, &kept[..kept.len() - 4]).unwrap();
        let e = read(&m, d.path()).unwrap_err();
        assert!(e.contains("model-00002-of-00002.safetensors"), "{e}");
        std::fs::write(&second, &kept).unwrap();
        write_index(d.path(), &index);
        read(&m, d.path()).unwrap();
    }

    #[test]
    fn a_directory_without_weights_says_which_files_it_looked_for() {
        let m = llama();
        let d = saved(&m);
        std::fs::remove_file(d.path().join(HF_WEIGHTS)).unwrap();
        let e = read(&m, d.path()).unwrap_err();
        assert!(
            e.contains(&format!("no {HF_WEIGHTS} or {HF_WEIGHTS_INDEX}")),
            "{e}"
        );
        assert!(!e.contains("pytorch_model.bin"), "{e}");
        std::fs::write(d.path().join("pytorch_model.bin"), b"pickle").unwrap();
        let e = read(&m, d.path()).unwrap_err();
        assert!(
            e.contains("pytorch_model.bin") && e.contains("safe_serialization"),
            "{e}"
        );
        assert!(d.path().join(HF_CONFIG).is_file());
    }

    /// A tied model's file may carry its head anyway (as some exports do):
    /// taken where it is the embedding, refused as an untied head where not.
    #[test]
    fn a_tied_models_head_in_the_file_must_be_its_embedding() {
        let mut m = llama();
        m.tie_embeddings = Some(true);
        let d = saved(&m);
        let whole = read(&m, d.path()).unwrap();
        let path = d.path().join(HF_WEIGHTS);
        let with_head = |head: &dyn Fn(Vec<f32>) -> Vec<f32>| {
            let file = TensorFile::open(&path).unwrap();
            let mut tensors = file.tensors();
            tensors.retain(|(n, _)| n != "lm_head.weight");
            let embedding = tensors
                .iter()
                .find(|(n, _)| n == "model.embed_tokens.weight")
                .unwrap()
                .clone();
            tensors.push(("lm_head.weight".into(), embedding.1));
            let tmp = d.path().join("rewritten");
            let mut w = StreamWriter::create(&tmp, &tensors, None).unwrap();
            for (name, _) in &tensors {
                w.write(&match name.as_str() {
                    "lm_head.weight" => head(file.read(&embedding.0).unwrap()),
                    _ => file.read(name).unwrap(),
                })
                .unwrap();
            }
            w.finish().unwrap();
            drop(file);
            std::fs::rename(&tmp, &path).unwrap();
        };
        with_head(&|e| e);
        assert_eq!(read(&m, d.path()).unwrap(), whole);
        with_head(&|mut e| {
            e[0] += 1.0;
            e
        });
        let e = read(&m, d.path()).unwrap_err();
        assert!(
            e.contains("lm_head.weight belongs to no parameter") && e.contains("untied"),
            "{e}"
        );
    }
}
