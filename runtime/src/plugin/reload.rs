//! Hot reload: a plugin that follows its file. At a call boundary, at most
//! once per poll interval, the file's metadata is checked; a changed file is
//! loaded and replaces the running plugin. A new version that fails to load
//! is logged and the running one is kept (the next change is tried again).

use super::{
    AdapterPlugin, Backend, Error, Plugin, PluginHost, PolicyPlugin, TeacherPolicyPlugin, TransformPlugin,
};
use edl_plugin_sdk::{
    Action, Batch, ClusterView, Hyperparams, PluginInfo, ResizeEvent, TeacherPlan, TeacherView,
};
use std::{
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, Instant, SystemTime},
};

type Loader<T> = fn(&PluginHost, &Path, &[(String, String)]) -> Result<Box<T>, Error>;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Stamp {
    modified: Option<SystemTime>,
    len: u64,
    inode: u64,
}

fn stamp(path: &Path) -> Option<Stamp> {
    let meta = std::fs::metadata(path).ok()?;
    #[cfg(unix)]
    let inode = std::os::unix::fs::MetadataExt::ino(&meta);
    #[cfg(not(unix))]
    let inode = 0;
    Some(Stamp { modified: meta.modified().ok(), len: meta.len(), inode })
}

/// A plugin that reloads itself when its file changes.
pub struct Reloading<T: ?Sized> {
    host: Arc<PluginHost>,
    path: PathBuf,
    config: Vec<(String, String)>,
    loader: Loader<T>,
    current: Box<T>,
    stamp: Option<Stamp>,
    poll: Duration,
    last_check: Instant,
    reloads: u32,
    last_error: Option<String>,
}

impl<T: ?Sized + Plugin> Reloading<T> {
    fn new(
        host: Arc<PluginHost>,
        path: &Path,
        config: &[(String, String)],
        loader: Loader<T>,
    ) -> Result<Self, Error> {
        let stamp = stamp(path);
        let current = loader(&host, path, config)?;
        Ok(Reloading {
            host,
            path: path.to_path_buf(),
            config: config.to_vec(),
            loader,
            current,
            stamp,
            poll: Duration::from_millis(250),
            last_check: Instant::now(),
            reloads: 0,
            last_error: None,
        })
    }

    /// Checks the file at most this often (default 250 ms; zero checks at every call).
    pub fn with_poll_interval(mut self, poll: Duration) -> Self {
        self.poll = poll;
        self
    }

    /// How many times a new version was loaded.
    pub fn reloads(&self) -> u32 {
        self.reloads
    }

    /// Why the last changed file was not loaded, if it was not.
    pub fn last_error(&self) -> Option<&str> {
        self.last_error.as_deref()
    }

    fn refresh(&mut self) {
        if self.last_check.elapsed() < self.poll {
            return;
        }
        self.last_check = Instant::now();
        let now = stamp(&self.path);
        if now == self.stamp || now.is_none() {
            return;
        }
        self.stamp = now;
        match (self.loader)(&self.host, &self.path, &self.config) {
            Ok(mut next) => {
                self.hand_memory_over(next.as_mut());
                tracing::info!(
                    "{}: reloaded plugin {} {} (was {})",
                    self.path.display(),
                    next.info().name,
                    next.info().version,
                    self.current.info().version
                );
                self.current = next;
                self.reloads += 1;
                self.last_error = None;
            }
            Err(e) => {
                tracing::warn!("keeping the running plugin; the changed file did not load: {e}");
                self.last_error = Some(e.to_string());
            }
        }
    }
}

impl<T: ?Sized + Plugin> Reloading<T> {
    /// The running version's memory goes on in the new one; a version that
    /// cannot read it starts from its `init`, and the log says why.
    fn hand_memory_over(&mut self, next: &mut T) {
        let moved = self.current.save_state().and_then(|saved| match saved {
            Some(bytes) => next.load_state(&bytes),
            None => Ok(false),
        });
        if let Err(e) = moved {
            tracing::warn!(
                "{}: the new version starts without the running one's memory: {e}",
                self.path.display()
            );
        }
    }
}

impl<T: ?Sized + Plugin> Plugin for Reloading<T> {
    fn info(&self) -> &PluginInfo {
        self.current.info()
    }

    fn backend(&self) -> Backend {
        self.current.backend()
    }

    fn save_state(&mut self) -> Result<Option<Vec<u8>>, Error> {
        self.current.save_state()
    }

    fn load_state(&mut self, bytes: &[u8]) -> Result<bool, Error> {
        self.current.load_state(bytes)
    }
}

impl Reloading<dyn PolicyPlugin> {
    /// A scaling policy that follows `path`.
    pub fn policy(host: Arc<PluginHost>, path: &Path, config: &[(String, String)]) -> Result<Self, Error> {
        Reloading::new(host, path, config, |h, p, c| h.load_policy(p, c))
    }
}

impl Reloading<dyn AdapterPlugin> {
    /// A batch adapter that follows `path`.
    pub fn adapter(host: Arc<PluginHost>, path: &Path, config: &[(String, String)]) -> Result<Self, Error> {
        Reloading::new(host, path, config, |h, p, c| h.load_adapter(p, c))
    }
}

impl Reloading<dyn TransformPlugin> {
    /// A reader transform that follows `path`.
    pub fn transform(host: Arc<PluginHost>, path: &Path, config: &[(String, String)]) -> Result<Self, Error> {
        Reloading::new(host, path, config, |h, p, c| h.load_transform(p, c))
    }
}

impl Reloading<dyn TeacherPolicyPlugin> {
    /// A teacher policy that follows `path`.
    pub fn teacher_policy(
        host: Arc<PluginHost>,
        path: &Path,
        config: &[(String, String)],
    ) -> Result<Self, Error> {
        Reloading::new(host, path, config, |h, p, c| h.load_teacher_policy(p, c))
    }
}

impl TeacherPolicyPlugin for Reloading<dyn TeacherPolicyPlugin> {
    fn decide(&mut self, view: &TeacherView) -> Result<TeacherPlan, Error> {
        self.refresh();
        self.current.decide(view)
    }
}

impl PolicyPlugin for Reloading<dyn PolicyPlugin> {
    fn decide(&mut self, view: &ClusterView) -> Result<Vec<Action>, Error> {
        self.refresh();
        self.current.decide(view)
    }

    fn on_training(&mut self, stats: &edl_plugin_sdk::TrainingStats) -> Result<bool, Error> {
        self.refresh();
        self.current.on_training(stats)
    }

    fn decide_servers(&mut self, view: &edl_plugin_sdk::ServerView) -> Result<Option<u32>, Error> {
        self.refresh();
        self.current.decide_servers(view)
    }

    fn decide_spares(&mut self, view: &edl_plugin_sdk::SpareView) -> Result<Option<u32>, Error> {
        self.refresh();
        self.current.decide_spares(view)
    }
}

impl AdapterPlugin for Reloading<dyn AdapterPlugin> {
    fn on_resize(&mut self, event: &ResizeEvent, current: &Hyperparams) -> Result<Hyperparams, Error> {
        self.refresh();
        self.current.on_resize(event, current)
    }

    fn on_step(&mut self, step: u64, current: &Hyperparams) -> Result<Hyperparams, Error> {
        self.refresh();
        self.current.on_step(step, current)
    }

    fn on_training(&mut self, stats: &edl_plugin_sdk::TrainingStats) -> Result<bool, Error> {
        self.refresh();
        self.current.on_training(stats)
    }
}

impl TransformPlugin for Reloading<dyn TransformPlugin> {
    fn apply(&mut self, batch: &Batch) -> Result<Batch, Error> {
        self.refresh();
        self.current.apply(batch)
    }
}
