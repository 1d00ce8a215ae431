//! The plugins' memory (WIT `state`): saved with the job's progress at each
//! commit and in every checkpoint, and given to the plugins of a coordinator
//! that takes the job over or resumes it, so a policy's search and an
//! adapter's schedule go on where they were instead of from `init`.

use super::Coordinator;
use crate::leader::record::PluginMemory;
use base64::{Engine as _, engine::general_purpose::STANDARD};
use std::sync::atomic::{AtomicBool, Ordering};

impl Coordinator<'_> {
    /// The plugins' memory now. A plugin that fails to save is named in a
    /// warning and saved as keeping none: a successor then starts it afresh.
    pub(super) fn plugin_memory(&mut self) -> PluginMemory {
        let policy = self.policy.save_state();
        let adapter = self.adapter.as_mut().map(|a| a.save_state()).transpose();
        // Said once per plugin: a memory that cannot be saved at one commit
        // usually cannot at the next.
        static WARNED: [AtomicBool; 2] = [AtomicBool::new(false), AtomicBool::new(false)];
        let encode = |which: usize, saved: Result<Option<Vec<u8>>, crate::plugin::Error>| match saved {
            // An SDK plugin that keeps no memory saves nothing.
            Ok(bytes) => bytes.filter(|b| !b.is_empty()).map(|b| STANDARD.encode(b)),
            Err(e) => {
                if !WARNED[which].swap(true, Ordering::Relaxed) {
                    let what = ["policy", "adapter"][which];
                    tracing::warn!("the {what}'s memory is not saved (a successor starts it afresh): {e}");
                }
                None
            }
        };
        PluginMemory { policy: encode(0, policy), adapter: encode(1, adapter.map(Option::flatten)) }
    }

    /// Gives the plugins the memory saved at `at` (a step, said in the
    /// note). A plugin that cannot take it starts from `init`, and the note
    /// says why; the job goes on either way.
    pub(super) fn restore_plugin_memory(&mut self, m: &PluginMemory, at: u64) {
        let mut restored = Vec::new();
        if let Some(saved) = &m.policy {
            let loaded = decode(saved).and_then(|b| self.policy.load_state(&b).map_err(|e| e.to_string()));
            self.said_restore("policy", loaded, &mut restored);
        }
        if let (Some(saved), Some(adapter)) = (&m.adapter, self.adapter.as_mut()) {
            let loaded = decode(saved).and_then(|b| adapter.load_state(&b).map_err(|e| e.to_string()));
            self.said_restore("adapter", loaded, &mut restored);
        }
        if !restored.is_empty() {
            self.note(format!("the {} went on with its memory of step {at}", restored.join(" and the ")));
        }
    }

    /// Gives the adapter alone the memory saved at `at`, when the job goes
    /// back to that step's checkpoint with its workers gone: the
    /// hyperparameters go back there, and what the adapter remembers of
    /// them (a rate's ramp) with them. A checkpoint without the adapter's
    /// memory is one where it kept none, or where its memory could not be
    /// saved: either way a coordinator taking the job over there would start
    /// it afresh, and so does this one (an empty memory, where it takes one).
    pub(super) fn restore_adapter_memory(&mut self, m: &PluginMemory, at: u64) {
        let Some(adapter) = self.adapter.as_mut() else { return };
        let Some(saved) = &m.adapter else {
            if let Err(e) = adapter.load_state(&[]) {
                tracing::debug!("the adapter keeps its memory: it takes no empty one ({e})");
            }
            return;
        };
        match decode(saved).and_then(|b| adapter.load_state(&b).map_err(|e| e.to_string())) {
            Ok(true) => self.note(format!("the adapter went back to its memory of step {at}")),
            Ok(false) => {}
            Err(e) => {
                self.note(format!("the adapter keeps its memory: that of step {at} did not load ({e})"))
            }
        }
    }

    fn said_restore(
        &mut self,
        what: &'static str,
        loaded: Result<bool, String>,
        restored: &mut Vec<&'static str>,
    ) {
        match loaded {
            Ok(true) => restored.push(what),
            Ok(false) => {}
            Err(e) => self.note(format!("the {what} starts afresh: its saved memory did not load ({e})")),
        }
    }
}

fn decode(saved: &str) -> Result<Vec<u8>, String> {
    STANDARD.decode(saved).map_err(|e| format!("not base64: {e}"))
}
