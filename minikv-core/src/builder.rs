//! Config + model spec -> ready cache.

use crate::attention::{AttentionBackend, make_backend};
use crate::config::{CacheConfig, RunConfig};
use crate::layered::LayeredCache;
use crate::{KvCache, ModelSpec, Result};
use std::sync::Arc;

/// Builds caches for one model shape. `Config -> init()`, as in burn.
#[derive(Debug, Clone)]
pub struct CacheBuilder {
    spec: ModelSpec,
    backend: Arc<dyn AttentionBackend>,
}

impl CacheBuilder {
    /// A builder using the default CPU backend (`tiled`).
    pub fn new(spec: ModelSpec) -> Self {
        Self {
            spec,
            backend: Arc::new(crate::attention::TiledBackend::default()),
        }
    }

    /// Uses `backend` for attention and storage.
    pub fn backend(mut self, backend: Arc<dyn AttentionBackend>) -> Self {
        self.backend = backend;
        self
    }

    /// Uses the backend registered as `name` (`tiled`, `reference`, or any
    /// backend a linked crate registers, e.g. `cuda`).
    pub fn named_backend(self, name: &str) -> Result<Self> {
        Ok(self.backend(make_backend(name)?))
    }

    /// The model shape.
    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    /// Builds a cache from a cache config. A model with sliding-window
    /// layers gets a [`HybridCache`](crate::hybrid::HybridCache): rings for
    /// those layers, the config's cache for the global ones.
    pub fn build(&self, cfg: &CacheConfig) -> Result<Box<dyn KvCache>> {
        if self.spec.has_windows() {
            return Ok(Box::new(crate::hybrid::HybridCache::new(
                cfg.clone(),
                self.spec.clone(),
                self.backend.clone(),
            )?));
        }
        Ok(Box::new(LayeredCache::new(
            cfg.clone(),
            self.spec.clone(),
            self.backend.clone(),
        )?))
    }
}

/// Builds the cache of a run config with its registered backend.
pub fn build_cache(cfg: &RunConfig, spec: ModelSpec) -> Result<Box<dyn KvCache>> {
    CacheBuilder::new(spec)
        .named_backend(&cfg.backend)?
        .build(&cfg.cache)
}
