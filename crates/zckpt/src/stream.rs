//! safetensors files written and read a tensor at a time, so that a shard as
//! large as a rank's whole model state (tens of GB under NVMe offload) never
//! has to be in memory at once.
//!
//! The format's header lists every tensor's offsets before any data, so the
//! writer is told the tensors' names and shapes up front; safetensors'
//! own `Metadata` builds and validates that header, and parses it when
//! reading. Data is checksummed (CRC-32C) as it streams out and in.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Metadata, TensorInfo};
use safetensors::Dtype as StDtype;

use crate::{invalid, io, CkptError};

/// Bytes of the header-length prefix.
const N_LEN: usize = 8;
/// Bytes read at a time when checksumming a file.
const CHUNK: usize = 8 << 20;

/// Writes an f32 safetensors file tensor by tensor, to a temporary name that
/// [`StreamWriter::finish`] fsyncs and renames; dropped unfinished (an error
/// on the way), it removes the temporary file.
pub struct StreamWriter {
    path: PathBuf,
    tmp: PathBuf,
    out: Option<BufWriter<File>>,
    /// Elements of each tensor still to come, in file order.
    lens: Vec<usize>,
    next: usize,
    crc: u32,
    bytes: u64,
    /// Renamed into place: nothing to clean up.
    done: bool,
}

impl StreamWriter {
    /// Starts `path` with f32 tensors `tensors` (name, shape), written in this
    /// order, and optional `__metadata__`.
    pub fn create(
        path: &Path,
        tensors: &[(String, Vec<usize>)],
        metadata: Option<HashMap<String, String>>,
    ) -> Result<StreamWriter, CkptError> {
        let mut at = 0;
        let infos: Vec<(String, TensorInfo)> = tensors
            .iter()
            .map(|(name, shape)| {
                let bytes = shape.iter().product::<usize>() * 4;
                let info = TensorInfo {
                    dtype: StDtype::F32,
                    shape: shape.clone(),
                    data_offsets: (at, at + bytes),
                };
                at += bytes;
                (name.clone(), info)
            })
            .collect();
        let meta = Metadata::new(metadata, infos).map_err(|e| invalid(path, e.to_string()))?;
        let mut header = serde_json::to_vec(&meta).map_err(|e| invalid(path, e.to_string()))?;
        // The format pads the header with spaces to a multiple of 8 bytes.
        header.resize(header.len().next_multiple_of(N_LEN), b' ');
        let dir = path.parent().unwrap_or(Path::new("."));
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        let tmp = crate::temporary_path(path);
        let file = File::create(&tmp).map_err(io(&tmp))?;
        let mut w = StreamWriter {
            path: path.to_path_buf(),
            tmp,
            out: Some(BufWriter::with_capacity(CHUNK, file)),
            lens: tensors
                .iter()
                .map(|(_, s)| s.iter().product::<usize>())
                .collect(),
            next: 0,
            crc: 0,
            bytes: 0,
            done: false,
        };
        w.put(&(header.len() as u64).to_le_bytes())?;
        w.put(&header)?;
        Ok(w)
    }

    fn put(&mut self, bytes: &[u8]) -> Result<(), CkptError> {
        let out = self.out.as_mut().expect("writer open until finish");
        out.write_all(bytes).map_err(io(&self.tmp))?;
        self.crc = crc32c::crc32c_append(self.crc, bytes);
        self.bytes += bytes.len() as u64;
        Ok(())
    }

    /// Writes the next tensor's values, which must have its length.
    pub fn write(&mut self, values: &[f32]) -> Result<(), CkptError> {
        let Some(&want) = self.lens.get(self.next) else {
            return Err(invalid(&self.path, "more tensors written than declared"));
        };
        if values.len() != want {
            return Err(invalid(
                &self.path,
                format!(
                    "tensor {} has {} elements, its header says {want}",
                    self.next,
                    values.len()
                ),
            ));
        }
        self.next += 1;
        self.put(bytemuck::cast_slice(values))
    }

    /// Fsyncs and renames the finished file into place; returns its size and
    /// CRC-32C.
    pub fn finish(mut self) -> Result<(u64, u32), CkptError> {
        if self.next != self.lens.len() {
            return Err(invalid(
                &self.path,
                format!("{} of {} tensors written", self.next, self.lens.len()),
            ));
        }
        let out = self.out.take().expect("writer open until finish");
        let file = out.into_inner().map_err(|e| CkptError::Io {
            path: self.tmp.clone(),
            cause: e.into_error(),
        })?;
        file.sync_all().map_err(io(&self.tmp))?;
        crate::fault_delay();
        std::fs::rename(&self.tmp, &self.path).map_err(io(&self.path))?;
        self.done = true;
        if let Ok(d) = File::open(self.path.parent().unwrap_or(Path::new("."))) {
            let _ = d.sync_all();
        }
        Ok((self.bytes, self.crc))
    }
}

impl Drop for StreamWriter {
    fn drop(&mut self) {
        // Unfinished (a full disk, most often): the partial file must not be
        // left behind to fill the disk further.
        if !self.done {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

/// A safetensors file opened for reading single tensors: only its header is
/// held, and no descriptor (a checkpoint holds one a rank; each read opens
/// the file).
#[derive(Debug)]
pub struct TensorFile {
    path: PathBuf,
    meta: Metadata,
    /// Where the data starts.
    data_at: u64,
}

impl TensorFile {
    /// Opens `path` and parses its header; checks that the header describes
    /// the whole file.
    pub fn open(path: &Path) -> Result<TensorFile, CkptError> {
        let mut file = File::open(path).map_err(io(path))?;
        let size = file.metadata().map_err(io(path))?.len();
        let mut n = [0u8; N_LEN];
        file.read_exact(&mut n)
            .map_err(|_| invalid(path, "not a safetensors file: too short"))?;
        let n = u64::from_le_bytes(n);
        if n > size.saturating_sub(N_LEN as u64) || n > 100 << 20 {
            return Err(invalid(
                path,
                format!("not a safetensors file: a {n}-byte header"),
            ));
        }
        let mut header = vec![0u8; n as usize];
        file.read_exact(&mut header).map_err(io(path))?;
        let meta: Metadata = serde_json::from_slice(&header)
            .map_err(|e| invalid(path, format!("not a safetensors file: {e}")))?;
        let data_at = N_LEN as u64 + n;
        if data_at + meta.data_len() as u64 != size {
            return Err(invalid(
                path,
                format!(
                    "{size} bytes, its header describes {}",
                    data_at + meta.data_len() as u64
                ),
            ));
        }
        Ok(TensorFile {
            path: path.to_path_buf(),
            meta,
            data_at,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Tensor names and shapes, in file order.
    pub fn tensors(&self) -> Vec<(String, Vec<usize>)> {
        self.meta
            .offset_keys()
            .into_iter()
            .map(|name| {
                let shape = self.meta.info(&name).map(|i| i.shape.clone());
                (name, shape.unwrap_or_default())
            })
            .collect()
    }

    /// Tensor `name`'s values as f32 (f32, or bf16 / f16 as published
    /// weights often are, widened exactly).
    pub fn read(&self, name: &str) -> Result<Vec<f32>, CkptError> {
        let info = self.info(name)?;
        match info.dtype {
            StDtype::F32 => self.values::<f32>(info),
            StDtype::BF16 => Ok(self
                .values::<u16>(info)?
                .iter()
                .map(|&b| half::bf16::from_bits(b).to_f32())
                .collect()),
            StDtype::F16 => Ok(self
                .values::<u16>(info)?
                .iter()
                .map(|&b| half::f16::from_bits(b).to_f32())
                .collect()),
            other => Err(invalid(
                &self.path,
                format!("{name} is {other:?}, expected F32, BF16 or F16"),
            )),
        }
    }

    /// Tensor `name`'s values as bf16 bits where the file stores it in bf16
    /// (a sampler keeps such weights as they are: half the bytes of f32);
    /// `None` for another dtype.
    pub fn read_bf16(&self, name: &str) -> Result<Option<Vec<u16>>, CkptError> {
        let info = self.info(name)?;
        match info.dtype {
            StDtype::BF16 => Ok(Some(self.values::<u16>(info)?)),
            _ => Ok(None),
        }
    }

    fn info(&self, name: &str) -> Result<&safetensors::tensor::TensorInfo, CkptError> {
        self.meta
            .info(name)
            .ok_or_else(|| invalid(&self.path, format!("tensor {name} is missing")))
    }

    /// A tensor's bytes as values of `T` (its dtype's width).
    fn values<T: bytemuck::Pod>(
        &self,
        info: &safetensors::tensor::TensorInfo,
    ) -> Result<Vec<T>, CkptError> {
        let (s, e) = info.data_offsets;
        let mut out = vec![T::zeroed(); (e - s) / std::mem::size_of::<T>()];
        File::open(&self.path)
            .and_then(|f| {
                f.read_exact_at(bytemuck::cast_slice_mut(&mut out), self.data_at + s as u64)
            })
            .map_err(io(&self.path))?;
        Ok(out)
    }
}

/// `path`'s size and CRC-32C, read a chunk at a time.
pub fn checksum(path: &Path) -> Result<(u64, u32), CkptError> {
    let mut file = File::open(path).map_err(io(path))?;
    let mut buf = vec![0u8; CHUNK];
    let (mut size, mut crc) = (0u64, 0u32);
    loop {
        let n = file.read(&mut buf).map_err(io(path))?;
        if n == 0 {
            return Ok((size, crc));
        }
        crc = crc32c::crc32c_append(crc, &buf[..n]);
        size += n as u64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::SafeTensors;

    /// Published weights are often bf16 or f16: read widened, exactly.
    #[test]
    fn half_precision_tensors_are_read_widened() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("h.safetensors");
        let values = [1.5f32, -0.25, 65504.0];
        let bf: Vec<u16> = values
            .iter()
            .map(|&v| half::bf16::from_f32(v).to_bits())
            .collect();
        let f: Vec<u16> = values
            .iter()
            .map(|&v| half::f16::from_f32(v).to_bits())
            .collect();
        let views = [
            (
                "bf",
                safetensors::Dtype::BF16,
                bytemuck::cast_slice::<u16, u8>(&bf),
            ),
            (
                "f",
                safetensors::Dtype::F16,
                bytemuck::cast_slice::<u16, u8>(&f),
            ),
        ]
        .map(|(n, dt, b)| {
            (
                n,
                safetensors::tensor::TensorView::new(dt, vec![3], b).unwrap(),
            )
        });
        safetensors::serialize_to_file(views, None, &path).unwrap();
        let file = TensorFile::open(&path).unwrap();
        let widened = |v: &[u16], bf: bool| -> Vec<f32> {
            v.iter()
                .map(|&b| match bf {
                    true => half::bf16::from_bits(b).to_f32(),
                    false => half::f16::from_bits(b).to_f32(),
                })
                .collect()
        };
        assert_eq!(file.read("bf").unwrap(), widened(&bf, true));
        assert_eq!(file.read("f").unwrap(), widened(&f, false));
        assert_eq!(file.read("f").unwrap(), values);
    }

    #[test]
    fn streamed_files_read_back_with_the_crate_and_with_ours() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("t.safetensors");
        let tensors = vec![
            ("b".to_string(), vec![2, 3]),
            ("a".to_string(), vec![5]),
            ("empty".to_string(), vec![0]),
        ];
        let meta: HashMap<String, String> = [("format".into(), "pt".into())].into();
        let mut w = StreamWriter::create(&path, &tensors, Some(meta)).unwrap();
        w.write(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap();
        w.write(&[-1.5; 5]).unwrap();
        w.write(&[]).unwrap();
        let (bytes, crc) = w.finish().unwrap();
        let all = std::fs::read(&path).unwrap();
        assert_eq!((bytes, crc), (all.len() as u64, crc32c::crc32c(&all)));
        assert_eq!(checksum(&path).unwrap(), (bytes, crc));
        // The crate's own reader agrees.
        let st = SafeTensors::deserialize(&all).unwrap();
        let b = st.tensor("b").unwrap();
        assert_eq!(b.shape(), [2, 3]);
        assert_eq!(
            b.data(),
            bytemuck::cast_slice::<f32, u8>(&[1., 2., 3., 4., 5., 6.])
        );
        let (_, m) = SafeTensors::read_metadata(&all).unwrap();
        assert_eq!(m.metadata().as_ref().unwrap()["format"], "pt");
        // And ours.
        let f = TensorFile::open(&path).unwrap();
        assert_eq!(f.read("a").unwrap(), vec![-1.5; 5]);
        assert_eq!(f.tensors()[0], ("b".to_string(), vec![2, 3]));
        assert!(f
            .read("c")
            .unwrap_err()
            .to_string()
            .contains("tensor c is missing"));
        assert!(!d.path().join("t.tmp").exists());
    }

    #[test]
    fn a_writer_checks_lengths_and_an_unfinished_one_leaves_nothing() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("t.safetensors");
        let tensors = vec![("x".to_string(), vec![4]), ("y".to_string(), vec![2])];
        let mut w = StreamWriter::create(&path, &tensors, None).unwrap();
        let e = w.write(&[1.0; 3]).unwrap_err().to_string();
        assert!(
            e.contains("tensor 0 has 3 elements, its header says 4"),
            "{e}"
        );
        w.write(&[1.0; 4]).unwrap();
        assert!(d.path().join("t.tmp").exists());
        let e = w.finish().unwrap_err().to_string();
        assert!(e.contains("1 of 2 tensors written"), "{e}");
        assert!(!d.path().join("t.tmp").exists() && !path.exists());
    }

    #[test]
    fn a_failed_rename_leaves_no_temporary_file() {
        let d = tempfile::tempdir().unwrap();
        // The rename fails: the target is a directory that is not empty.
        let path = d.path().join("t.safetensors");
        std::fs::create_dir_all(path.join("occupied")).unwrap();
        let mut w = StreamWriter::create(&path, &[("x".to_string(), vec![4])], None).unwrap();
        w.write(&[1.0; 4]).unwrap();
        assert!(w.finish().is_err());
        assert!(!d.path().join("t.tmp").exists());
    }

    #[test]
    fn a_truncated_file_is_refused_naming_it() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("t.safetensors");
        let mut w = StreamWriter::create(&path, &[("x".to_string(), vec![4])], None).unwrap();
        w.write(&[1.0; 4]).unwrap();
        w.finish().unwrap();
        let all = std::fs::read(&path).unwrap();
        std::fs::write(&path, &all[..all.len() - 4]).unwrap();
        let e = TensorFile::open(&path).err().unwrap().to_string();
        assert!(
            e.contains("t.safetensors") && e.contains("its header describes"),
            "{e}"
        );
        std::fs::write(&path, [0xff; 16]).unwrap();
        let e = TensorFile::open(&path).err().unwrap().to_string();
        assert!(e.contains("not a safetensors file"), "{e}");
        // A header length past the end of the file (but below the size cap).
        let mut short = 1000u64.to_le_bytes().to_vec();
        short.extend_from_slice(b"{}");
        std::fs::write(&path, &short).unwrap();
        let e = TensorFile::open(&path).err().unwrap().to_string();
        assert!(
            e.contains("not a safetensors file: a 1000-byte header"),
            "{e}"
        );
        // Larger than the cap (100 MiB), in a file that is long enough (sparse).
        let huge = (100u64 << 20) + 8;
        std::fs::write(&path, huge.to_le_bytes()).unwrap();
        let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        f.set_len(8 + huge + 16).unwrap();
        let e = TensorFile::open(&path).err().unwrap().to_string();
        assert!(e.contains(&format!("a {huge}-byte header")), "{e}");
    }

    /// A file of no tensors is a header that fills the file, and valid.
    #[test]
    fn a_file_without_tensors_opens() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("t.safetensors");
        let w = StreamWriter::create(&path, &[], None).unwrap();
        w.finish().unwrap();
        let f = TensorFile::open(&path).unwrap();
        assert!(f.tensors().is_empty());
    }
}
