//! The LoRA adapters a worker serves ([`AdapterRegistry`]): those named at start-up (`--lora NAME=DIR`) and those
//! loaded and unloaded at run time (vLLM's `/v1/load_lora_adapter`), which only come from directories under
//! `--lora-dir`. The registry is the one owner of the name → adapter map; requests take an `Arc` of their adapter
//! when they are submitted, so unloading one never disturbs the requests already running with it.

use std::collections::{HashMap, HashSet};
use std::path::{Component, Path, PathBuf};
use std::sync::{Arc, RwLock};

use crate::engine::{EngineConfig, EngineError, LoraSpec, TierPlacement};
use crate::model::lora::{MAX_LORA_RANK, check_lora_name};
use crate::model::{LoraAdapter, ModelConfig};

/// Most adapters `--max-loras` may allow.
pub const MAX_LOADED_LORAS: usize = 1024;
/// Longest run-time adapter path, in bytes.
pub const MAX_LORA_PATH: usize = 4096;

/// Why an adapter could not be found, loaded or unloaded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdapterError {
    #[error("LoRA adapter {0:?} is not loaded on this worker")]
    Unknown(String),
    #[error("LoRA adapter {0:?} is already loaded")]
    Exists(String),
    #[error("run-time LoRA loading is off on this worker: start it with --lora-dir")]
    RuntimeOff,
    #[error("{0} LoRA adapters are loaded already (--max-loras)")]
    Full(usize),
    #[error("{0}")]
    Invalid(String),
}

/// The adapters loaded now, and what bounds loading more.
#[derive(Debug)]
pub struct AdapterRegistry {
    /// The model's shape, which every adapter must fit; `None` when the runner cannot apply adapters.
    shape: Option<ModelConfig>,
    /// The base model's id: no adapter may take it (a request naming it means the base model).
    base_model: String,
    max_rank: usize,
    max_loaded: usize,
    /// Where run-time loads come from (canonical); `None`: run-time loading is off.
    runtime_dir: Option<PathBuf>,
    loaded: RwLock<HashMap<String, Arc<LoraAdapter>>>,
}

impl AdapterRegistry {
    /// Checks the configuration and loads the start-up adapters for the model `base_model` of `shape` (`None`: a
    /// runner that cannot apply adapters, which refuses any).
    pub fn open(
        shape: Option<ModelConfig>,
        base_model: &str,
        cfg: &EngineConfig,
    ) -> Result<AdapterRegistry, EngineError> {
        let config = |m: String| EngineError::Config(m);
        let wanted = !cfg.lora.is_empty() || cfg.lora_dir.is_some();
        if wanted && shape.is_none() {
            return Err(config(
                "--lora / --lora-dir: this backend does not serve LoRA adapters (the CPU backend does)".into(),
            ));
        }
        if wanted && matches!(cfg.placement, TierPlacement::EvicPress(_)) {
            return Err(config(
                "--lora / --lora-dir cannot be combined with --tier-placement evicpress (its profiler decodes with \
                 the base model)"
                    .into(),
            ));
        }
        if !(1..=MAX_LORA_RANK).contains(&cfg.max_lora_rank) {
            return Err(config(format!("--max-lora-rank must be in 1..={MAX_LORA_RANK}")));
        }
        if !(1..=MAX_LOADED_LORAS).contains(&cfg.max_loras) {
            return Err(config(format!("--max-loras must be in 1..={MAX_LOADED_LORAS}")));
        }
        if cfg.lora.len() > cfg.max_loras {
            return Err(config(format!("{} --lora adapters, more than --max-loras {}", cfg.lora.len(), cfg.max_loras)));
        }
        let mut seen = HashSet::new();
        if let Some(dup) = cfg.lora.iter().find(|s| !seen.insert(s.name.as_str())) {
            return Err(config(format!("--lora {}: the name is given twice", dup.name)));
        }
        if let Some(clash) = cfg.lora.iter().find(|s| s.name == base_model) {
            return Err(config(format!("--lora {}: that is the base model's name", clash.name)));
        }
        let runtime_dir = match &cfg.lora_dir {
            None => None,
            Some(dir) => {
                let canonical = dir.canonicalize().map_err(|e| config(format!("--lora-dir {}: {e}", dir.display())))?;
                if !canonical.is_dir() {
                    return Err(config(format!("--lora-dir {}: not a directory", dir.display())));
                }
                Some(canonical)
            }
        };
        let mut loaded = HashMap::new();
        if let Some(shape) = &shape {
            for LoraSpec { name, dir } in &cfg.lora {
                let adapter =
                    LoraAdapter::load(name, dir, shape, cfg.max_lora_rank).map_err(|e| config(e.to_string()))?;
                log_loaded(&adapter, dir, "start-up");
                loaded.insert(name.clone(), Arc::new(adapter));
            }
        }
        Ok(AdapterRegistry {
            shape,
            base_model: base_model.to_string(),
            max_rank: cfg.max_lora_rank,
            max_loaded: cfg.max_loras,
            runtime_dir,
            loaded: RwLock::new(loaded),
        })
    }

    /// The adapter loaded under `name`.
    pub fn get(&self, name: &str) -> Result<Arc<LoraAdapter>, AdapterError> {
        self.read().get(name).cloned().ok_or_else(|| AdapterError::Unknown(name.to_string()))
    }

    /// Every adapter loaded now, by name.
    pub fn list(&self) -> Vec<Arc<LoraAdapter>> {
        let mut all: Vec<Arc<LoraAdapter>> = self.read().values().cloned().collect();
        all.sort_by(|a, b| a.name().cmp(b.name()));
        all
    }

    /// Loads the PEFT adapter at `path` (relative to `--lora-dir`) under `name`. Reads and checks the files before
    /// taking the map's lock (they may be large); a name loaded meanwhile still wins.
    pub fn load(&self, name: &str, path: &str) -> Result<Arc<LoraAdapter>, AdapterError> {
        let Some(root) = &self.runtime_dir else { return Err(AdapterError::RuntimeOff) };
        let Some(shape) = &self.shape else { return Err(AdapterError::RuntimeOff) };
        check_lora_name(name).map_err(AdapterError::Invalid)?;
        if name == self.base_model {
            return Err(AdapterError::Invalid(format!("adapter name {name:?} is the base model's")));
        }
        self.check_room(name)?;
        let dir = resolve_under(root, path)?;
        let adapter = Arc::new(
            LoraAdapter::load(name, &dir, shape, self.max_rank).map_err(|e| AdapterError::Invalid(e.to_string()))?,
        );
        let mut loaded = self.loaded.write().unwrap_or_else(|p| p.into_inner());
        if loaded.contains_key(name) {
            return Err(AdapterError::Exists(name.to_string()));
        }
        if loaded.len() >= self.max_loaded {
            return Err(AdapterError::Full(loaded.len()));
        }
        loaded.insert(name.to_string(), Arc::clone(&adapter));
        drop(loaded);
        log_loaded(&adapter, &dir, "run time");
        Ok(adapter)
    }

    /// Unloads `name`. Requests running with it keep their copy until they finish; its cached blocks stay under
    /// its salted hashes until evicted (a later adapter of the same name and weights finds them again).
    pub fn unload(&self, name: &str) -> Result<(), AdapterError> {
        let removed = self.loaded.write().unwrap_or_else(|p| p.into_inner()).remove(name);
        match removed {
            Some(_) => {
                tracing::info!(adapter = name, "LoRA adapter unloaded");
                Ok(())
            }
            None => Err(AdapterError::Unknown(name.to_string())),
        }
    }

    fn check_room(&self, name: &str) -> Result<(), AdapterError> {
        let loaded = self.read();
        if loaded.contains_key(name) {
            return Err(AdapterError::Exists(name.to_string()));
        }
        if loaded.len() >= self.max_loaded {
            return Err(AdapterError::Full(loaded.len()));
        }
        Ok(())
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, HashMap<String, Arc<LoraAdapter>>> {
        // A panic while holding the lock cannot leave the map half-written (inserts and removes are single calls).
        self.loaded.read().unwrap_or_else(|p| p.into_inner())
    }
}

fn log_loaded(adapter: &LoraAdapter, dir: &Path, when: &str) {
    tracing::info!(
        adapter = adapter.name(),
        dir = %dir.display(),
        rank = adapter.rank(),
        cache_id = adapter.cache_id(),
        when,
        "LoRA adapter loaded"
    );
}

/// `path` inside `root` (canonical): relative, without `..`, and still inside `root` once symlinks are resolved.
fn resolve_under(root: &Path, path: &str) -> Result<PathBuf, AdapterError> {
    let invalid = |why: &str| AdapterError::Invalid(format!("lora_path {path:?}: {why}"));
    if path.is_empty() || path.len() > MAX_LORA_PATH {
        return Err(invalid(&format!("must be 1 to {MAX_LORA_PATH} bytes")));
    }
    let rel = Path::new(path);
    if !rel.components().all(|c| matches!(c, Component::Normal(_) | Component::CurDir)) {
        return Err(invalid("must be relative to the worker's --lora-dir, without `..`"));
    }
    let full = root.join(rel).canonicalize().map_err(|e| invalid(&format!("cannot open it: {e}")))?;
    if !full.starts_with(root) {
        return Err(invalid("leads outside the worker's --lora-dir"));
    }
    if !full.is_dir() {
        return Err(invalid("is not a directory"));
    }
    Ok(full)
}
