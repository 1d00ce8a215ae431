//! A reader transform that breaks the batch contract on demand (`mode=...`):
//! `fewer-labels`, `empty`, `wider`, `nan`, `huge` (100x the rows),
//! `foreign-ids`, `reverse` (a permutation: allowed), or `pass`.

use edl_plugin_sdk::{Batch, Config, PluginError, ReaderTransform};

#[derive(Default)]
pub struct Hostile {
    mode: String,
}

impl ReaderTransform for Hostile {
    fn init(&mut self, config: &Config) -> Result<(), PluginError> {
        config.expect_only(&["mode"])?;
        self.mode = config.get_or("mode", "pass".to_string())?;
        Ok(())
    }

    fn apply(&mut self, mut batch: Batch) -> Result<Batch, PluginError> {
        let rows = batch.ids.len();
        let row_bytes = batch.data.len() / rows.max(1);
        match self.mode.as_str() {
            "fewer-labels" => {
                batch.labels.truncate(rows / 2);
            }
            "empty" => {
                batch.data.clear();
                batch.labels.clear();
                batch.ids.clear();
                batch.shape[0] = 0;
            }
            "wider" => {
                batch.data.extend(std::iter::repeat_n(0u8, rows * 4));
                if let Some(w) = batch.shape.get_mut(1) {
                    *w += 1;
                }
            }
            "nan" if batch.data.len() >= 4 => {
                batch.data[..4].copy_from_slice(&f32::NAN.to_le_bytes());
            }
            "huge" => {
                let (data, labels, ids) = (batch.data.clone(), batch.labels.clone(), batch.ids.clone());
                for _ in 1..100 {
                    batch.data.extend_from_slice(&data);
                    batch.labels.extend_from_slice(&labels);
                    batch.ids.extend_from_slice(&ids);
                }
                batch.shape[0] *= 100;
            }
            "foreign-ids" => {
                if let Some(id) = batch.ids.first_mut() {
                    *id += 1_000_000;
                }
            }
            "reverse" => {
                batch.ids.reverse();
                batch.labels.reverse();
                let rows_data: Vec<Vec<u8>> =
                    batch.data.chunks(row_bytes.max(1)).map(<[u8]>::to_vec).collect();
                batch.data = rows_data.into_iter().rev().flatten().collect();
            }
            _ => {}
        }
        Ok(batch)
    }
}

edl_plugin_sdk::export_reader_transform!(Hostile);
