//! Seeded random shift of up to `max-shift` pixels (2 by default, as Hinton et
//! al. jittered MNIST) and normalisation, on a whole columnar batch at once.
//!
//! The shift of a sample depends only on the batch seed and the sample's id,
//! so the teachers and the student see the same augmented sample, and a
//! re-read of a sample gives the same pixels. Input: uint8 pixels (or float32
//! in [0, 1]) shaped [N, H, W], [N, H, W, 1] or [N, H*W] with a square image;
//! output: float32 `(x - mean) / std` (or x in [0, 1] with `normalize=false`).

use edl_plugin_sdk::{Batch, Config, Dtype, PluginError, ReaderTransform};
use std::mem::MaybeUninit;

#[derive(Debug)]
pub struct Augment {
    max_shift: u32,
    normalize: bool,
    mean: f32,
    std: f32,
}

impl Default for Augment {
    fn default() -> Self {
        // MNIST's pixel mean and standard deviation.
        Augment { max_shift: 2, normalize: true, mean: 0.1307, std: 0.3081 }
    }
}

/// splitmix64: a good 64-bit mix of (seed, id).
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// The (dx, dy) shift of sample `id` under `seed`, each in [-max, max].
pub fn shift_of(seed: u64, id: u64, max: u32) -> (i32, i32) {
    if max == 0 {
        return (0, 0);
    }
    let r = mix(seed ^ mix(id));
    let span = 2 * max as u64 + 1;
    ((r % span) as i32 - max as i32, ((r >> 32) % span) as i32 - max as i32)
}

impl Augment {
    fn image_dims(shape: &[u32]) -> Result<(usize, usize), PluginError> {
        match shape {
            [_, h, w] | [_, h, w, 1] => Ok((*h as usize, *w as usize)),
            [_, d] => {
                let side = (*d as f64).sqrt().round() as usize;
                if side * side == *d as usize {
                    Ok((side, side))
                } else {
                    Err(PluginError::InvalidInput(format!(
                        "shape {shape:?}: {d} values per sample is not a square image"
                    )))
                }
            }
            _ => Err(PluginError::InvalidInput(format!(
                "shape {shape:?}: expected [N, H, W], [N, H, W, 1] or [N, H*W]"
            ))),
        }
    }
}

impl ReaderTransform for Augment {
    fn init(&mut self, config: &Config) -> Result<(), PluginError> {
        config.expect_only(&["max-shift", "normalize", "mean", "std"])?;
        let d = Augment::default();
        self.max_shift = config.get_or("max-shift", d.max_shift)?;
        self.normalize = config.get_or("normalize", d.normalize)?;
        self.mean = config.get_or("mean", d.mean)?;
        self.std = config.get_or("std", d.std)?;
        if self.std <= 0.0 {
            return Err(PluginError::InvalidConfig("`std` must be positive".into()));
        }
        Ok(())
    }

    fn apply(&mut self, batch: Batch) -> Result<Batch, PluginError> {
        batch.validate()?;
        let (h, w) = Self::image_dims(&batch.shape)?;
        let (mean, inv_std) = if self.normalize { (self.mean, 1.0 / self.std) } else { (0.0, 1.0) };
        let value_bytes = |x: f32| ((x - mean) * inv_std).to_le_bytes();
        // uint8 input goes through a 256-entry table of output bytes, indexed
        // by the byte itself (no bounds check), and every output pixel is
        // written exactly once.
        let pixel = |x: f32| value_bytes(x).map(MaybeUninit::new);
        let mut lut = [[MaybeUninit::new(0u8); 4]; 256];
        for (v, entry) in lut.iter_mut().enumerate() {
            *entry = pixel(v as f32 / 255.0);
        }
        let background = pixel(0.0);
        let n = batch.len();
        let plane = h * w;
        let total = n * plane * 4;
        // The output is written into uninitialised capacity: zeroing 4 bytes
        // per pixel first would cost as much as the transform itself.
        let mut data: Vec<u8> = Vec::with_capacity(total);
        let floats = batch.to_f32();
        let (pixels, _) = data.spare_capacity_mut()[..total].as_chunks_mut::<4>();
        for (i, dst) in pixels.chunks_exact_mut(plane).enumerate() {
            let (dx, dy) = shift_of(batch.seed, batch.ids[i], self.max_shift);
            // Destination columns [x0, x1) read source columns [x0 - dx, x1 - dx).
            let x0 = (dx.max(0) as usize).min(w);
            let x1 = ((w as i32 + dx.min(0)).max(0) as usize).max(x0);
            for (y, row) in dst.chunks_exact_mut(w).enumerate() {
                let sy = y as i32 - dy;
                if sy < 0 || sy >= h as i32 || x0 == x1 {
                    row.fill(background);
                    continue;
                }
                row[..x0].fill(background);
                row[x1..].fill(background);
                let start = i * plane + sy as usize * w + (x0 as i32 - dx) as usize;
                let inner = &mut row[x0..x1];
                let len = inner.len();
                match &floats {
                    None => {
                        for (d, &s) in inner.iter_mut().zip(&batch.data[start..start + len]) {
                            *d = lut[s as usize];
                        }
                    }
                    Some(f) => {
                        for (d, &s) in inner.iter_mut().zip(&f[start..start + len]) {
                            *d = pixel(s);
                        }
                    }
                }
            }
        }
        // SAFETY: the loop above wrote every pixel of every row of every sample.
        unsafe { data.set_len(total) };
        Ok(Batch { data, dtype: Dtype::Float32, ..batch })
    }
}

edl_plugin_sdk::export_reader_transform!(Augment);

#[cfg(test)]
mod tests {
    use super::*;
    use edl_plugin_sdk::testing;

    fn dot_batch(ids: &[u64], seed: u64) -> Batch {
        // One bright pixel at (14, 14) of each 28x28 sample.
        let mut data = vec![0u8; ids.len() * 784];
        for i in 0..ids.len() {
            data[i * 784 + 14 * 28 + 14] = 255;
        }
        Batch {
            data,
            shape: vec![ids.len() as u32, 28, 28],
            dtype: Dtype::Uint8,
            labels: vec![7; ids.len()],
            ids: ids.to_vec(),
            seed,
        }
    }

    #[test]
    fn shifts_each_sample_by_its_own_seeded_offset() {
        let mut a = testing::transform::<Augment>(&[("normalize", "false")]).unwrap();
        let ids: Vec<u64> = (0..64).collect();
        let out = a.apply(dot_batch(&ids, 42)).unwrap();
        let px = out.to_f32().unwrap();
        let mut seen = std::collections::HashSet::new();
        for (i, &id) in ids.iter().enumerate() {
            let (dx, dy) = shift_of(42, id, 2);
            assert!(dx.abs() <= 2 && dy.abs() <= 2);
            seen.insert((dx, dy));
            let at = ((14 + dy) * 28 + 14 + dx) as usize;
            let img = &px[i * 784..(i + 1) * 784];
            assert_eq!(img[at], 1.0);
            assert_eq!(img.iter().filter(|&&v| v != 0.0).count(), 1);
        }
        assert!(seen.len() > 10, "offsets should vary: {seen:?}");
    }

    #[test]
    fn same_seed_and_id_give_the_same_pixels_in_any_batch() {
        let mut a = testing::transform::<Augment>(&[]).unwrap();
        let one = a.apply(dot_batch(&[5, 9], 7)).unwrap().to_f32().unwrap();
        let other = a.apply(dot_batch(&[9], 7)).unwrap().to_f32().unwrap();
        assert_eq!(&one[784..], &other[..]);
    }

    #[test]
    fn normalises_with_mean_and_std() {
        let mut a = testing::transform::<Augment>(&[("max-shift", "0")]).unwrap();
        let out = a.apply(dot_batch(&[1], 0)).unwrap().to_f32().unwrap();
        assert!((out[0] - (-0.1307 / 0.3081)).abs() < 1e-6);
        assert!((out[14 * 28 + 14] - (1.0 - 0.1307) / 0.3081).abs() < 1e-5);
    }

    #[test]
    fn rejects_bad_shapes() {
        let mut a = testing::transform::<Augment>(&[]).unwrap();
        let mut b = dot_batch(&[1], 0);
        b.shape = vec![1, 780];
        b.data.truncate(780);
        assert!(matches!(a.apply(b), Err(PluginError::InvalidInput(_))));
        let mut b = dot_batch(&[1, 2], 0);
        b.labels.pop();
        assert!(matches!(a.apply(b), Err(PluginError::InvalidInput(_))));
    }
}
