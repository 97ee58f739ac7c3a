//! Memory-centric tiling (`model.tile_size`): which output columns each tile of
//! a linear layer holds. Arithmetic only, so that validation, the estimator and
//! the model agree on it.
//!
//! A tile is a run of whole chunks of [`TILE_COLUMNS`] output columns, the
//! last tile of a layer shorter. (A tiled layer's bits equal the whole
//! one's whatever the tiles: its input gradient's products continue one sum
//! tile after tile, see zmodel's `linear` module.)

use std::ops::Range;

use serde::{Deserialize, Serialize};

/// Output columns per chunk: a tile is a whole number of chunks.
pub const TILE_COLUMNS: usize = 256;

/// Which columns (last dimension) of a parameter a tile holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ColumnTile {
    /// Its first column.
    pub start: usize,
    /// Columns of the whole parameter.
    pub of: usize,
}

impl ColumnTile {
    /// The whole parameter's shape, from a tile's `shape` (its last
    /// dimension widened to `of`).
    pub fn whole_shape(&self, shape: &[usize]) -> Vec<usize> {
        let mut whole = shape.to_vec();
        if let Some(last) = whole.last_mut() {
            *last = self.of;
        }
        whole
    }

    /// The tile's values out of the whole parameter's `whole` (row-major,
    /// rows of `of` columns), `width` columns a row.
    pub fn cut(&self, whole: &[f32], width: usize) -> Vec<f32> {
        whole
            .chunks_exact(self.of)
            .flat_map(|row| &row[self.start..self.start + width])
            .copied()
            .collect()
    }

    /// Writes the tile's `values` (`width` columns a row) into the whole
    /// parameter's `whole`.
    pub fn put(&self, values: &[f32], width: usize, whole: &mut [f32]) {
        if width == 0 {
            return;
        }
        for (row, tile) in whole
            .chunks_exact_mut(self.of)
            .zip(values.chunks_exact(width))
        {
            row[self.start..self.start + width].copy_from_slice(tile);
        }
    }
}

/// Why a tile size cannot be used for a layer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "a tile of {layer} is at least {TILE_COLUMNS} output columns of {inputs} inputs \
     ({min} elements), more than the tile size {tile_size}"
)]
pub struct TileError {
    /// The layer, e.g. `mlp.c_fc`.
    pub layer: String,
    /// Its input width.
    pub inputs: usize,
    /// The smallest tile of it.
    pub min: usize,
    /// What was asked for.
    pub tile_size: usize,
}

/// The output-column tiles of `layer`, a weight `[inputs, outputs]`, under
/// `tile_size` (elements): one whole tile when the weight has at most
/// `tile_size` elements or at most [`TILE_COLUMNS`] output columns (nothing to
/// split on), else tiles of as many whole chunks as fit.
pub fn column_tiles(
    layer: &str,
    inputs: usize,
    outputs: usize,
    tile_size: Option<usize>,
) -> Result<Vec<Range<usize>>, TileError> {
    let whole = std::iter::once(0..outputs).collect();
    let Some(n) = tile_size else {
        return Ok(whole);
    };
    if inputs * outputs <= n || outputs <= TILE_COLUMNS {
        return Ok(whole);
    }
    let width = n / inputs / TILE_COLUMNS * TILE_COLUMNS;
    if width == 0 {
        return Err(TileError {
            layer: layer.to_string(),
            inputs,
            min: inputs * TILE_COLUMNS,
            tile_size: n,
        });
    }
    Ok((0..outputs)
        .step_by(width)
        .map(|s| s..(s + width).min(outputs))
        .collect())
}

/// What `model.tile_size` does to `m`'s blocks, in a sentence: which
/// linears are split into how many tiles, and which stay whole although
/// larger (at most one chunk of output columns). `None` without tiling.
pub fn describe_tiling(m: &crate::spec::ModelSpec) -> Option<String> {
    let n = m.tile_size?.0 as usize;
    let mut split = Vec::new();
    let mut whole = Vec::new();
    for (layer, inputs, outputs) in m.block_linears() {
        let tiles = column_tiles(layer, inputs, outputs, Some(n)).ok()?.len();
        if tiles > 1 {
            split.push(format!("{layer} in {tiles} tiles"));
        } else if inputs * outputs > n {
            whole.push(format!(
                "{layer} ({inputs}x{outputs}) stays whole: its {outputs} output columns are at most one tile of {TILE_COLUMNS}"
            ));
        }
    }
    let split = match split.is_empty() {
        true => "no linear is split".to_string(),
        false => format!("every block's {}", split.join(", ")),
    };
    let mut out = format!("model.tile_size {n}: {split}");
    for w in whole {
        out.push_str("; ");
        out.push_str(&w);
    }
    Some(out)
}

#[cfg(test)]
// A plan of one whole tile is a Vec of one range, not a Vec of its indices.
#[allow(clippy::single_range_in_vec_init)]
mod tests {
    use super::*;

    #[test]
    fn tiles_are_whole_chunks_that_fit() {
        let t = |i, o, n| column_tiles("mlp.c_fc", i, o, n);
        assert_eq!(t(128, 512, None).unwrap(), vec![0..512]);
        // Fits whole.
        assert_eq!(t(128, 512, Some(65536)).unwrap(), vec![0..512]);
        // 32768 / 128 = 256 columns a tile.
        assert_eq!(
            t(128, 640, Some(32768)).unwrap(),
            vec![0..256, 256..512, 512..640]
        );
        // Rounded down to whole chunks: 600 columns fit, 512 are whole chunks.
        assert_eq!(
            t(100, 1200, Some(60_000)).unwrap(),
            vec![0..512, 512..1024, 1024..1200]
        );
        // One chunk of output columns cannot be split.
        assert_eq!(t(512, 256, Some(1000)).unwrap(), vec![0..256]);
        let e = t(128, 512, Some(1000)).unwrap_err();
        let tile = ColumnTile { start: 1, of: 3 };
        let whole = [0., 1., 2., 3., 4., 5.];
        assert_eq!(tile.cut(&whole, 2), vec![1., 2., 4., 5.]);
        let mut back = [9.; 6];
        tile.put(&[1., 2., 4., 5.], 2, &mut back);
        assert_eq!(back, [9., 1., 2., 9., 4., 5.]);
        assert_eq!(e.min, 128 * 256);
        assert!(e.to_string().contains("mlp.c_fc"), "{e}");
        let mut m: crate::spec::ModelSpec =
            serde_json::from_value(serde_json::json!({"d_model": 128})).unwrap();
        assert_eq!(describe_tiling(&m), None);
        m.tile_size = Some(crate::spec::Size(32768));
        assert_eq!(
            describe_tiling(&m).unwrap(),
            "model.tile_size 32768: every block's attn.c_attn in 2 tiles, mlp.c_fc in 2 tiles; \
             mlp.c_proj (512x128) stays whole: its 128 output columns are at most one tile of 256"
        );
    }
}
