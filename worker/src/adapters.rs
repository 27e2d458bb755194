//! The LoRA adapters a worker serves ([`AdapterRegistry`]): those named at start-up (`--lora NAME=DIR`), those
//! loaded and unloaded at run time (vLLM's `/v1/load_lora_adapter`), and, with `--lora-on-demand`, those a request
//! names that sit under `--lora-dir` as `DIR/NAME` (vLLM's filesystem LoRA resolver). Run-time and on-demand loads
//! only come from directories under `--lora-dir`. The registry is the one owner of the name → adapter map;
//! requests take an `Arc` of their adapter when they are submitted, so unloading or evicting one never disturbs
//! the requests already running with it. When the map is full, an on-demand load evicts the least recently used
//! adapter that was itself loaded on demand and that no request holds.

use std::collections::{HashMap, HashSet};
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use crate::engine::{EngineConfig, EngineError, LoraSpec, TierPlacement};
use crate::model::lora::{MAX_LORA_RANK, check_lora_name};
use crate::model::{LoraAdapter, ModelConfig};

/// Most adapters `--max-loras` may allow.
pub const MAX_LOADED_LORAS: usize = 1024;
/// Longest run-time adapter path, in bytes.
pub const MAX_LORA_PATH: usize = 4096;
/// Most names [`AdapterRegistry::available`] announces, and most directory entries it reads to find them.
pub const MAX_AVAILABLE_LORAS: usize = 256;
const MAX_SCANNED_ENTRIES: usize = 4096;
/// How long a scan of `--lora-dir` is reused: `Health` asks for it on every probe.
const SCAN_TTL: Duration = Duration::from_secs(2);

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
    /// On demand, with every slot taken by an adapter that is pinned or that running requests hold: the request
    /// may go to another worker, or come back once one finishes.
    #[error("LoRA adapter {1:?} cannot be loaded now: all {0} adapter slots (--max-loras) are pinned or in use")]
    AllInUse(usize, String),
    #[error("{0}")]
    Invalid(String),
}

/// How an adapter came to be loaded, which decides whether it may be evicted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// `--lora NAME=DIR`: stays while the worker runs (unless unloaded).
    StartUp,
    /// `LoadLora` (the router's admin endpoint): stays until unloaded.
    Admin,
    /// A request named it (`--lora-on-demand`): evicted when the slot is wanted and no request holds it.
    OnDemand,
}

#[derive(Debug)]
struct Loaded {
    adapter: Arc<LoraAdapter>,
    origin: Origin,
    /// The registry's clock at its last use: the least recent idle on-demand adapter is evicted first.
    last_used: AtomicU64,
}

/// Counters of the loads and evictions since start-up (`Stats`).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct AdapterCounters {
    /// Adapters loaded at run time (admin and on demand).
    pub loads: u64,
    /// Loads that a request caused (`--lora-on-demand`).
    pub on_demand_loads: u64,
    /// On-demand adapters evicted to make room.
    pub evictions: u64,
    /// Time spent reading and checking the adapters loaded at run time.
    pub load_seconds: f64,
    /// Adapter directories read at run time (admin and on demand), whether the load then succeeded or not.
    pub reads: u64,
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
    /// Whether a request may name an adapter under `runtime_dir` that is not loaded yet.
    on_demand: bool,
    loaded: RwLock<HashMap<String, Loaded>>,
    /// Ticks on every use; orders [`Loaded::last_used`].
    clock: AtomicU64,
    /// One run-time load (admin or on demand) at a time: loads of the same missing adapter wait for the first
    /// one's rather than each reading the files (up to 2 GiB), and a full map is not raced for.
    loading: Mutex<()>,
    counters: Mutex<AdapterCounters>,
    /// The last scan of `runtime_dir` ([`AdapterRegistry::available`]) and when it was taken.
    scan: Mutex<Option<(Instant, Arc<Vec<String>>)>>,
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
        if cfg.lora_on_demand && cfg.lora_dir.is_none() {
            return Err(config("--lora-on-demand loads adapters from --lora-dir: give it".into()));
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
                let entry =
                    Loaded { adapter: Arc::new(adapter), origin: Origin::StartUp, last_used: AtomicU64::new(0) };
                loaded.insert(name.clone(), entry);
            }
        }
        Ok(AdapterRegistry {
            shape,
            base_model: base_model.to_string(),
            max_rank: cfg.max_lora_rank,
            max_loaded: cfg.max_loras,
            runtime_dir,
            on_demand: cfg.lora_on_demand,
            loaded: RwLock::new(loaded),
            clock: AtomicU64::new(1),
            loading: Mutex::new(()),
            counters: Mutex::new(AdapterCounters::default()),
            scan: Mutex::new(None),
        })
    }

    /// The adapter loaded under `name` (which counts as a use of it).
    pub fn get(&self, name: &str) -> Result<Arc<LoraAdapter>, AdapterError> {
        let loaded = self.read();
        let entry = loaded.get(name).ok_or_else(|| AdapterError::Unknown(name.to_string()))?;
        entry.last_used.store(self.clock.fetch_add(1, Ordering::Relaxed), Ordering::Relaxed);
        Ok(Arc::clone(&entry.adapter))
    }

    /// The adapter `name`, loaded first from `--lora-dir`/`name` when it is not and `--lora-on-demand` allows it.
    /// Reads the adapter's files on the calling thread: call it from a blocking context.
    pub fn resolve(&self, name: &str) -> Result<Arc<LoraAdapter>, AdapterError> {
        match self.get(name) {
            Err(AdapterError::Unknown(_)) if self.on_demand => {}
            found => return found,
        }
        let (Some(root), Some(shape)) = (&self.runtime_dir, &self.shape) else {
            return Err(AdapterError::Unknown(name.to_string()));
        };
        if check_lora_name(name).is_err() || name == self.base_model {
            return Err(AdapterError::Unknown(name.to_string()));
        }
        let _one_load = self.loading.lock().unwrap_or_else(|p| p.into_inner());
        // Loaded while this call waited for the one before it.
        if let Ok(adapter) = self.get(name) {
            return Ok(adapter);
        }
        // A request for an adapter the directory lacks names a model this worker does not have.
        let dir = resolve_under(root, name).map_err(|_| AdapterError::Unknown(name.to_string()))?;
        if !self.has_room() {
            return Err(AdapterError::AllInUse(self.max_loaded, name.to_string()));
        }
        let started = Instant::now();
        let adapter = self.read_adapter(name, &dir, root, shape)?;
        let adapter = self.insert(name, adapter, Origin::OnDemand, started.elapsed(), false)?;
        log_loaded(&adapter, &dir, "on demand");
        Ok(adapter)
    }

    /// Every adapter loaded now, by name.
    pub fn list(&self) -> Vec<Arc<LoraAdapter>> {
        self.list_with_origin().into_iter().map(|(adapter, _)| adapter).collect()
    }

    /// Every adapter loaded now, by name, with how it came.
    pub fn list_with_origin(&self) -> Vec<(Arc<LoraAdapter>, Origin)> {
        let mut all: Vec<(Arc<LoraAdapter>, Origin)> =
            self.read().values().map(|e| (Arc::clone(&e.adapter), e.origin)).collect();
        all.sort_by(|a, b| a.0.name().cmp(b.0.name()));
        all
    }

    /// Loads the PEFT adapter at `path` (relative to `--lora-dir`) under `name`, to stay until unloaded. Reads and
    /// checks the files before taking the map's lock (they may be large), but after the one-load-at-a-time lock, so
    /// that concurrent loads of one name read it once and the rest are refused as existing. With
    /// `--lora-on-demand`, an idle on-demand adapter gives up its slot when the map is full.
    pub fn load(&self, name: &str, path: &str) -> Result<Arc<LoraAdapter>, AdapterError> {
        self.load_admin(name, path, false)
    }

    /// Loads the adapter at `path` under `name` in place of the one loaded under that name now (vLLM's
    /// `load_inplace`), or as [`AdapterRegistry::load`] does when none is. The new files are read and checked
    /// before the map is touched, and the swap is one write under the map's lock: a request sees the old adapter or
    /// the new one, never neither, and a refused adapter leaves the old one serving. The swap reuses the old one's
    /// slot, so a full map neither refuses it nor gives up an on-demand adapter for it. Requests already holding
    /// the old `Arc` finish with it.
    pub fn replace(&self, name: &str, path: &str) -> Result<Arc<LoraAdapter>, AdapterError> {
        self.load_admin(name, path, true)
    }

    /// [`AdapterRegistry::load`], or with `replace` [`AdapterRegistry::replace`].
    fn load_admin(&self, name: &str, path: &str, replace: bool) -> Result<Arc<LoraAdapter>, AdapterError> {
        let Some(root) = &self.runtime_dir else { return Err(AdapterError::RuntimeOff) };
        let Some(shape) = &self.shape else { return Err(AdapterError::RuntimeOff) };
        check_lora_name(name).map_err(AdapterError::Invalid)?;
        if name == self.base_model {
            return Err(AdapterError::Invalid(format!("adapter name {name:?} is the base model's")));
        }
        let _one_load = self.loading.lock().unwrap_or_else(|p| p.into_inner());
        let loaded = self.read().contains_key(name);
        if loaded && !replace {
            return Err(AdapterError::Exists(name.to_string()));
        }
        // Only a new name needs a slot; the room check is repeated under the write lock in `insert`.
        if !loaded && !self.has_room() {
            return Err(AdapterError::Full(self.read().len()));
        }
        let dir = resolve_under(root, path)?;
        let started = Instant::now();
        let adapter = self.read_adapter(name, &dir, root, shape)?;
        let adapter = self.insert(name, adapter, Origin::Admin, started.elapsed(), replace)?;
        log_loaded(&adapter, &dir, if replace { "run time, in place" } else { "run time" });
        Ok(adapter)
    }

    /// Unloads `name`. Requests running with it keep their copy until they finish; its cached blocks stay under
    /// its salted hashes until evicted (a later adapter of the same name and weights finds them again).
    pub fn unload(&self, name: &str) -> Result<(), AdapterError> {
        let removed = self.write().remove(name);
        match removed {
            Some(_) => {
                tracing::info!(adapter = name, "LoRA adapter unloaded");
                Ok(())
            }
            None => Err(AdapterError::Unknown(name.to_string())),
        }
    }

    /// Whether requests may name adapters under `--lora-dir` that are not loaded yet (`--lora-on-demand`).
    pub fn on_demand(&self) -> bool {
        self.on_demand
    }

    /// Most adapters loaded at once (`--max-loras`).
    pub fn max_loaded(&self) -> usize {
        self.max_loaded
    }

    /// Loads and evictions since start-up.
    pub fn counters(&self) -> AdapterCounters {
        *self.counters.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The mean time a run-time load has taken here, in seconds (0 before the first).
    pub fn mean_load_seconds(&self) -> f64 {
        let c = self.counters();
        if c.loads == 0 { 0.0 } else { c.load_seconds / c.loads as f64 }
    }

    /// With `--lora-on-demand`, the adapters a request may name though they are not loaded: the names of the
    /// directories under `--lora-dir` that hold an `adapter_config.json` (at most [`MAX_AVAILABLE_LORAS`], sorted;
    /// a scan is reused for a couple of seconds). Empty otherwise.
    pub fn available(&self) -> Arc<Vec<String>> {
        let Some(root) = self.runtime_dir.as_ref().filter(|_| self.on_demand) else { return Arc::default() };
        let mut scan = self.scan.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((at, names)) = scan.as_ref()
            && at.elapsed() < SCAN_TTL
        {
            return Arc::clone(names);
        }
        let names = Arc::new(scan_adapters(root, &self.base_model));
        *scan = Some((Instant::now(), Arc::clone(&names)));
        names
    }

    /// Whether a run-time load could take a slot now: a free one, or an idle on-demand adapter's.
    pub fn has_room(&self) -> bool {
        let loaded = self.read();
        loaded.len() < self.max_loaded || (self.on_demand && evictable(&loaded).is_some())
    }

    /// Puts `adapter` in the map under `name`, evicting the least recently used idle on-demand adapter when the map
    /// is full, and counts the load of `took`. With `swap`, an adapter loaded under `name` is replaced in its slot
    /// instead of refusing the name as existing.
    fn insert(
        &self,
        name: &str,
        adapter: LoraAdapter,
        origin: Origin,
        took: Duration,
        swap: bool,
    ) -> Result<Arc<LoraAdapter>, AdapterError> {
        let adapter = Arc::new(adapter);
        let mut loaded = self.write();
        let present = loaded.contains_key(name);
        if present && !swap {
            return Err(AdapterError::Exists(name.to_string()));
        }
        let mut evicted = None;
        // A swap keeps the count: only a new name may need a slot freed.
        if !present && loaded.len() >= self.max_loaded {
            let victim = if self.on_demand { evictable(&loaded) } else { None };
            let Some(victim) = victim else {
                return Err(match origin {
                    Origin::OnDemand => AdapterError::AllInUse(self.max_loaded, name.to_string()),
                    _ => AdapterError::Full(loaded.len()),
                });
            };
            loaded.remove(&victim);
            evicted = Some(victim);
        }
        let last_used = AtomicU64::new(self.clock.fetch_add(1, Ordering::Relaxed));
        loaded.insert(name.to_string(), Loaded { adapter: Arc::clone(&adapter), origin, last_used });
        drop(loaded);
        let mut c = self.counters.lock().unwrap_or_else(|p| p.into_inner());
        c.loads += 1;
        c.on_demand_loads += u64::from(origin == Origin::OnDemand);
        c.evictions += u64::from(evicted.is_some());
        c.load_seconds += took.as_secs_f64();
        drop(c);
        if let Some(victim) = evicted {
            tracing::info!(adapter = victim, for_adapter = name, "LoRA adapter evicted (least recently used)");
        }
        Ok(adapter)
    }

    /// Reads and checks the adapter in `dir`, whose files must lie inside `root` too (checking the directory alone
    /// would let a link inside it lead out), counting the read.
    fn read_adapter(
        &self,
        name: &str,
        dir: &Path,
        root: &Path,
        shape: &ModelConfig,
    ) -> Result<LoraAdapter, AdapterError> {
        self.counters.lock().unwrap_or_else(|p| p.into_inner()).reads += 1;
        LoraAdapter::load_within(name, dir, Some(root), shape, self.max_rank)
            .map_err(|e| AdapterError::Invalid(e.to_string()))
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, HashMap<String, Loaded>> {
        // A panic while holding the lock cannot leave the map half-written (inserts and removes are single calls).
        self.loaded.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, HashMap<String, Loaded>> {
        self.loaded.write().unwrap_or_else(|p| p.into_inner())
    }
}

/// The least recently used on-demand adapter that no request holds (the map's `Arc` is its only one).
fn evictable(loaded: &HashMap<String, Loaded>) -> Option<String> {
    loaded
        .iter()
        .filter(|(_, e)| e.origin == Origin::OnDemand && Arc::strong_count(&e.adapter) == 1)
        .min_by_key(|(_, e)| e.last_used.load(Ordering::Relaxed))
        .map(|(name, _)| name.clone())
}

/// The adapter names under `root`: directories (or links to them inside `root`) whose name is a valid adapter
/// name other than `base_model` and that hold an `adapter_config.json`. Bounded in entries read and names kept.
fn scan_adapters(root: &Path, base_model: &str) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(root) else { return Vec::new() };
    let mut names: Vec<String> = entries
        .take(MAX_SCANNED_ENTRIES)
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|name| check_lora_name(name).is_ok() && name != base_model)
        .filter(|name| resolve_under(root, name).is_ok_and(|dir| dir.join("adapter_config.json").is_file()))
        .collect();
    names.sort();
    names.truncate(MAX_AVAILABLE_LORAS);
    names
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::lora::tests::tiny as shape;
    use crate::model::lora::{SyntheticLora, write_synthetic_peft};

    /// Runs `f` on another thread, failing the test if it has not returned within 10 s (a blocking open would
    /// otherwise hang the test rather than fail it).
    fn promptly<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(f());
        });
        rx.recv_timeout(Duration::from_secs(10)).expect("the load did not return within 10 s")
    }

    #[cfg(unix)]
    #[test]
    fn run_time_loads_read_only_regular_files_inside_the_lora_dir() {
        let base = std::env::temp_dir().join(format!("pagoda-adapters-files-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        let (root, outside) = (base.join("loras"), base.join("outside"));
        let spec = SyntheticLora { rank: 2, ..Default::default() };
        for dir in [root.join("good"), root.join("escape"), root.join("fifo"), root.join("zero"), outside.clone()] {
            write_synthetic_peft(&dir, &shape(), &spec).unwrap();
        }
        let link = |target: &Path, dir: &str| {
            let weights = root.join(dir).join("adapter_model.safetensors");
            std::fs::remove_file(&weights).unwrap();
            std::os::unix::fs::symlink(target, &weights).unwrap();
        };
        link(&outside.join("adapter_model.safetensors"), "escape");
        link(Path::new("/dev/zero"), "zero");
        let fifo = root.join("fifo").join("adapter_model.safetensors");
        std::fs::remove_file(&fifo).unwrap();
        assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());

        let cfg = EngineConfig { lora_dir: Some(root.clone()), lora_on_demand: true, ..EngineConfig::default() };
        let registry = Arc::new(AdapterRegistry::open(Some(shape()), "base", &cfg).unwrap());
        let err = registry.load("escape", "escape").unwrap_err().to_string();
        assert!(err.contains("outside"), "{err}");
        for name in ["fifo", "zero"] {
            let r = Arc::clone(&registry);
            let err = promptly(move || r.resolve(name).map(|_| ())).unwrap_err();
            assert!(matches!(err, AdapterError::Invalid(_)), "{name}: {err}");
        }
        // The one-load lock was not left held: later loads go through.
        let r = Arc::clone(&registry);
        assert!(promptly(move || r.load("good", "good").is_ok()));
        let _ = std::fs::remove_dir_all(&base);
    }
    /// A replace swaps the adapter in one step: a reader running throughout always finds one under the name (the
    /// old one, then the new one). With every slot taken it still goes through and evicts nothing; a replacement
    /// whose files do not load leaves the old adapter serving.
    #[test]
    fn replace_swaps_in_one_step_in_a_full_map_and_keeps_the_old_adapter_when_the_new_one_fails() {
        let root = std::env::temp_dir().join(format!("pagoda-adapters-replace-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        for (dir, seed) in [("v1", 1), ("v2", 2), ("idle", 3)] {
            write_synthetic_peft(&root.join(dir), &shape(), &SyntheticLora { rank: 2, seed, ..Default::default() })
                .unwrap();
        }
        std::fs::create_dir_all(root.join("broken")).unwrap();
        std::fs::write(root.join("broken").join("adapter_config.json"), "{").unwrap();
        let cfg = EngineConfig {
            lora_dir: Some(root.clone()),
            lora_on_demand: true,
            max_loras: 2,
            ..EngineConfig::default()
        };
        let registry = Arc::new(AdapterRegistry::open(Some(shape()), "base", &cfg).unwrap());
        let old = registry.load("sql", "v1").unwrap();
        // An idle on-demand adapter fills the map: a load that wanted a slot would evict it.
        registry.resolve("idle").unwrap();
        assert_eq!(registry.list().len(), 2);

        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let reader = {
            let (registry, stop) = (Arc::clone(&registry), Arc::clone(&stop));
            std::thread::spawn(move || {
                let mut seen = HashSet::new();
                while !stop.load(Ordering::Relaxed) {
                    let adapter = registry.get("sql").expect("the adapter was missing during the replace");
                    seen.insert(adapter.cache_id().to_string());
                }
                seen
            })
        };
        let new = registry.replace("sql", "v2").unwrap();
        // Let the reader see the new one too before it stops.
        std::thread::sleep(Duration::from_millis(20));
        stop.store(true, Ordering::Relaxed);
        let seen = reader.join().unwrap();
        assert_ne!(old.cache_id(), new.cache_id());
        assert!(seen.iter().all(|id| id == old.cache_id() || id == new.cache_id()), "{seen:?}");
        assert_eq!(registry.get("sql").unwrap().cache_id(), new.cache_id());
        let names: Vec<String> = registry.list().iter().map(|a| a.name().to_string()).collect();
        assert_eq!(names, ["idle", "sql"], "nothing was evicted for the replace");
        assert_eq!(registry.counters().evictions, 0);
        // The request that held the old adapter still has it, intact.
        assert_eq!(old.name(), "sql");

        for path in ["broken", "missing", "../v1"] {
            let err = registry.replace("sql", path).unwrap_err();
            assert!(matches!(err, AdapterError::Invalid(_)), "{path}: {err}");
            assert_eq!(registry.get("sql").unwrap().cache_id(), new.cache_id(), "{path}: the old one stays");
        }
        // A name not loaded yet needs a slot like any load; the idle on-demand one gives way for it.
        registry.replace("fresh", "v1").unwrap();
        let names: Vec<String> = registry.list().iter().map(|a| a.name().to_string()).collect();
        assert_eq!(names, ["fresh", "sql"]);
        assert!(matches!(registry.replace("more", "v1"), Err(AdapterError::Full(2))));
        let _ = std::fs::remove_dir_all(&root);
    }
}
