//! Downloading checkpoints from the Hugging Face hub (cargo feature `hub`, on by default).
//!
//! A [`HubCheckpoint`] names a model repository, a revision (pin a commit hash so that every file
//! comes from the same commit), the weights — a list of safetensors files, or the
//! `model.safetensors.index.json` of a sharded checkpoint, whose `weight_map` names the shards —
//! and extra files such as `config.json` and `tokenizer.json`. [`fetch`] returns local paths.
//!
//! The client is `hf-hub`'s synchronous one (ureq + rustls), so the cache is the one
//! `huggingface_hub` shares with Python: `{cache}/models--{owner}--{name}/blobs/{etag}` holds the
//! bytes, `snapshots/{commit}/{file}` links to them and `refs/{revision}` records the commit a
//! revision resolved to. A file already in the cache is used without any network request; a
//! branch revision such as `main` is therefore resolved once and then read from the cache.
//! [`HubOptions::from_env`] honours `HF_HOME`, `HF_HUB_CACHE` / `HUGGINGFACE_HUB_CACHE`,
//! `HF_ENDPOINT`, `HF_TOKEN`, `HF_HUB_OFFLINE` and `HF_HUB_DISABLE_PROGRESS_BARS`.
//!
//! **Resume.** `hf-hub` writes a download to `blobs/{etag}.part` and renames it when complete. If
//! the connection fails, it asks again with `Range: bytes={bytes on disk}-` and appends, up to
//! [`HubOptions::retries`] times within one call; a `.part` left by a failed or killed call is
//! resumed the same way by the next call. It does not check the final size or hash: the server's
//! `Content-Length` is what catches a connection closed early.
//!
//! **Example.** A hub entry of the `weights.toml` catalog, downloaded (or found in the cache)
//! and loaded, as `examples/generate.rs --model <name>` does (`no_run`: this entry is the
//! ~475 GiB release):
//!
//! ```no_run
//! # fn main() -> anyhow::Result<()> {
//! use candle_core::{DType, Device};
//! use deepseek_v41::hub::{fetch, HubCheckpoint, HubOptions, HubWeights};
//! use deepseek_v41::model::Pretrained;
//! use deepseek_v41::weights::{WeightFiles, WeightsCatalog, WeightsSource};
//! use deepseek_v41::Numerics;
//!
//! let catalog = WeightsCatalog::load(concat!(env!("CARGO_MANIFEST_DIR"), "/../../weights.toml"))?;
//! let entry = catalog.get("deepseek-v4.1-flash")?;
//! let WeightsSource::Hub { repo, revision } = entry.source()? else { panic!("a hub entry") };
//! let weights = match entry.weight_files() {
//!     WeightFiles::Index(index) => HubWeights::Index(index.to_string()),
//!     WeightFiles::Files(files) => HubWeights::Files(files.to_vec()),
//! };
//! let extra = std::iter::once(entry.config.clone()).chain(entry.tokenizer.clone());
//! let spec = HubCheckpoint::new(repo, revision, weights).with_extra_files(extra);
//! let fetched = fetch(&spec, &HubOptions::from_env())?;
//! // Every file of a revision lies in one snapshot folder of the hub cache.
//! let dir = fetched.extra_files[0].parent().expect("a snapshot folder");
//! // On the CPU every FP8 / MXFP4 weight is dequantized at load: the host needs room for all of them.
//! let p = Pretrained::load_dir(dir, Numerics::REFERENCE, DType::BF16, &Device::Cpu)?;
//! # Ok(())
//! # }
//! ```

mod error;
mod options;
mod progress;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use hf_hub::api::sync::{Api, ApiBuilder};
use hf_hub::{Cache, Repo, RepoType};
use serde::Deserialize;

use error::FileRef;
pub use error::HubError;
pub use options::{HubOptions, DEFAULT_ENDPOINT, DEFAULT_RETRIES};
use progress::FileProgress;

/// Result of the hub module.
pub type Result<T> = std::result::Result<T, HubError>;

/// Which safetensors files of a repository hold the weights.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HubWeights {
    /// A sharded checkpoint: the index file (`model.safetensors.index.json`); every shard its
    /// `weight_map` names is fetched once, the shards in sorted order.
    Index(String),
    /// These files, in this order (a name given twice is fetched once).
    Files(Vec<String>),
}

/// A checkpoint on the hub: what [`fetch`] downloads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HubCheckpoint {
    /// Model repository id, `owner/name`.
    pub repo: String,
    /// Branch, tag or commit hash; a commit hash pins every file to one commit.
    pub revision: String,
    /// The weight files.
    pub weights: HubWeights,
    /// Other files to fetch with the weights (`config.json`, `tokenizer.json`, ...).
    pub extra_files: Vec<String>,
}

impl HubCheckpoint {
    /// A checkpoint with no extra files.
    pub fn new(repo: impl Into<String>, revision: impl Into<String>, weights: HubWeights) -> Self {
        Self {
            repo: repo.into(),
            revision: revision.into(),
            weights,
            extra_files: Vec::new(),
        }
    }

    /// Adds files to fetch with the weights.
    pub fn with_extra_files<S: Into<String>>(mut self, files: impl IntoIterator<Item = S>) -> Self {
        self.extra_files.extend(files.into_iter().map(Into::into));
        self
    }
}

/// Local paths of a fetched [`HubCheckpoint`] (links inside the cache's snapshot folder).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FetchedCheckpoint {
    /// The index file, for [`HubWeights::Index`].
    pub index: Option<PathBuf>,
    /// The safetensors files: the deduplicated shards of the index, or the listed files.
    pub weights: Vec<PathBuf>,
    /// The extra files, in the order of [`HubCheckpoint::extra_files`].
    pub extra_files: Vec<PathBuf>,
}

impl FetchedCheckpoint {
    /// What [`ReleaseCheckpoint::open`](crate::loader::ReleaseCheckpoint::open) takes: the index
    /// (which brings its shards and is cross-checked against them) if there is one, otherwise the
    /// weight files.
    pub fn loader_paths(&self) -> Vec<PathBuf> {
        match &self.index {
            Some(index) => vec![index.clone()],
            None => self.weights.clone(),
        }
    }
}

/// Fetches `spec` with a client built from `options` (see [`Hub::fetch`]).
pub fn fetch(spec: &HubCheckpoint, options: &HubOptions) -> Result<FetchedCheckpoint> {
    Hub::new(options.clone())?.fetch(spec)
}

/// A hub client: the options and, unless offline, the `hf-hub` HTTP client.
#[derive(Debug)]
pub struct Hub {
    options: HubOptions,
    api: Option<Api>,
}

impl Hub {
    /// A client with these options (no request is made yet; offline mode builds no HTTP client).
    pub fn new(options: HubOptions) -> Result<Self> {
        let api = if options.offline {
            None
        } else {
            let api = ApiBuilder::from_cache(Cache::new(options.cache_dir.clone()))
                .with_endpoint(options.endpoint.clone())
                .with_token(options.token.clone())
                .with_retries(options.retries)
                .with_user_agent(env!("CARGO_PKG_NAME"), env!("CARGO_PKG_VERSION"))
                .build()
                .map_err(HubError::Client)?;
            Some(api)
        };
        Ok(Self { options, api })
    }

    /// A client configured from the environment ([`HubOptions::from_env`]).
    pub fn from_env() -> Result<Self> {
        Self::new(HubOptions::from_env())
    }

    /// The options this client uses.
    pub fn options(&self) -> &HubOptions {
        &self.options
    }

    /// The cached copy of `file` of `repo` at `revision`, if there is one. `revision` is looked
    /// up in `refs/` (where downloads record what a branch resolved to); a 40-hex commit hash
    /// is also looked up directly in `snapshots/`.
    pub fn cached(&self, repo: &str, revision: &str, file: &str) -> Result<Option<PathBuf>> {
        check_repo(repo)?;
        check_revision(revision)?;
        check_file(file)?;
        let dir = self.options.cache_dir.join(Repo::model(repo.to_string()).folder_name());
        let commit = match std::fs::read_to_string(dir.join("refs").join(revision)) {
            Ok(text) => text.trim().to_string(),
            Err(_) if is_commit_hash(revision) => revision.to_string(),
            Err(_) => return Ok(None),
        };
        if commit.is_empty() {
            return Ok(None);
        }
        let path = dir.join("snapshots").join(commit).join(file);
        Ok(path.is_file().then_some(path))
    }

    /// The local path of `file` of `repo` at `revision`: the cached copy, else (unless offline)
    /// a download with a progress bar.
    pub fn file(&self, repo: &str, revision: &str, file: &str) -> Result<PathBuf> {
        self.get(repo, revision, file, "")
    }

    /// Fetches every file of `spec`: the index first (then the shards it names), or the listed
    /// weight files, then the extra files.
    pub fn fetch(&self, spec: &HubCheckpoint) -> Result<FetchedCheckpoint> {
        let (repo, revision) = (spec.repo.as_str(), spec.revision.as_str());
        check_repo(repo)?;
        check_revision(revision)?;
        let (index, names) = match &spec.weights {
            HubWeights::Index(name) => {
                let path = self.get(repo, revision, name, "[index]")?;
                let shards = shard_names(&path, repo, revision, name)?;
                (Some(path), shards)
            }
            HubWeights::Files(files) if files.is_empty() => {
                return Err(HubError::InvalidName {
                    what: "weight file list",
                    value: String::new(),
                    detail: "names no file",
                })
            }
            HubWeights::Files(files) => {
                let mut seen = BTreeSet::new();
                (None, files.iter().filter(|f| seen.insert(*f)).cloned().collect())
            }
        };
        let total = names.len() + spec.extra_files.len();
        let mut paths = Vec::with_capacity(total);
        for (i, name) in names.iter().chain(&spec.extra_files).enumerate() {
            paths.push(self.get(repo, revision, name, &format!("[{}/{total}]", i + 1))?);
        }
        let extra_files = paths.split_off(names.len());
        Ok(FetchedCheckpoint {
            index,
            weights: paths,
            extra_files,
        })
    }

    fn get(&self, repo: &str, revision: &str, file: &str, label: &str) -> Result<PathBuf> {
        if let Some(path) = self.cached(repo, revision, file)? {
            return Ok(path);
        }
        let Some(api) = &self.api else {
            return Err(HubError::NotCached {
                repo: repo.to_string(),
                revision: revision.to_string(),
                file: file.to_string(),
                cache: self.options.cache_dir.clone(),
            });
        };
        let progress = FileProgress::new(self.options.progress, label, file);
        api.repo(Repo::with_revision(
            repo.to_string(),
            RepoType::Model,
            revision.to_string(),
        ))
        .download_with_progress(file, progress)
        .map_err(|e| {
            FileRef {
                repo,
                revision,
                file,
                endpoint: &self.options.endpoint,
            }
            .error(e)
        })
    }
}

#[derive(Deserialize)]
struct IndexJson {
    weight_map: std::collections::BTreeMap<String, String>,
}

/// The distinct shard names of an index, sorted, as paths inside the repository (relative to the
/// index's own folder).
fn shard_names(path: &Path, repo: &str, revision: &str, file: &str) -> Result<Vec<String>> {
    let bad = |detail: String| HubError::BadIndex {
        repo: repo.to_string(),
        revision: revision.to_string(),
        file: file.to_string(),
        path: path.to_path_buf(),
        detail,
    };
    let text = std::fs::read_to_string(path).map_err(|e| bad(format!("cannot read it: {e}")))?;
    let index: IndexJson = serde_json::from_str(&text).map_err(|e| bad(format!("not a safetensors index: {e}")))?;
    let shards: BTreeSet<&String> = index.weight_map.values().collect();
    if shards.is_empty() {
        return Err(bad("its weight_map is empty".to_string()));
    }
    let folder = file.rsplit_once('/').map(|(dir, _)| dir);
    shards
        .into_iter()
        .map(|shard| {
            check_file(shard).map_err(|e| bad(format!("it names a shard that cannot be fetched: {e}")))?;
            Ok(folder.map_or_else(|| shard.clone(), |dir| format!("{dir}/{shard}")))
        })
        .collect()
}

fn is_commit_hash(revision: &str) -> bool {
    revision.len() == 40 && revision.bytes().all(|b| b.is_ascii_hexdigit())
}

/// `true` when `value` is `/`-separated parts none of which is empty, `.` or `..`, with no `\`.
fn is_relative_path(value: &str) -> bool {
    !value.contains('\\') && value.split('/').all(|part| !matches!(part, "" | "." | ".."))
}

fn invalid(what: &'static str, value: &str, detail: &'static str) -> HubError {
    HubError::InvalidName {
        what,
        value: value.to_string(),
        detail,
    }
}

fn check_repo(repo: &str) -> Result<()> {
    if !is_relative_path(repo) || repo.split('/').count() > 2 {
        return Err(invalid("repository id", repo, "expected `owner/name`"));
    }
    Ok(())
}

fn check_revision(revision: &str) -> Result<()> {
    if !is_relative_path(revision) {
        return Err(invalid("revision", revision, "expected a branch, tag or commit hash"));
    }
    Ok(())
}

fn check_file(file: &str) -> Result<()> {
    if !is_relative_path(file) {
        return Err(invalid(
            "file name",
            file,
            "expected a relative path inside the repository",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked() {
        for good in ["config.json", "sub/model.safetensors"] {
            assert!(check_file(good).is_ok(), "{good}");
        }
        for bad in ["", "/etc/passwd", "../x", "a/../../x", "a//b", "a\\b", "./a", "a/"] {
            let err = check_file(bad).unwrap_err().to_string();
            assert!(err.contains("invalid file name"), "{bad}: {err}");
        }
        assert!(check_repo("deepseek-ai/DeepSeek-V4.1-Flash").is_ok());
        assert!(check_repo("gpt2").is_ok());
        for bad in ["", "a/b/c", "../a", "/a"] {
            assert!(check_repo(bad).is_err(), "{bad}");
        }
        assert!(check_revision("refs/pr/1").is_ok());
        assert!(check_revision("..").is_err());
        assert!(is_commit_hash("dba1be0a40aa45a94ad051997016db3960a90277"));
        assert!(!is_commit_hash("main"));
    }

    #[test]
    fn index_shards_are_deduplicated_sorted_and_checked() {
        let dir = std::env::temp_dir().join(format!("dsv41-hub-index-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("model.safetensors.index.json");
        let write = |map: serde_json::Value| {
            std::fs::write(
                &path,
                serde_json::json!({"metadata": {}, "weight_map": map}).to_string(),
            )
            .unwrap()
        };
        write(serde_json::json!({"a": "s-2.safetensors", "b": "s-1.safetensors", "c": "s-2.safetensors"}));
        let names = shard_names(&path, "o/r", "main", "model.safetensors.index.json").unwrap();
        assert_eq!(names, ["s-1.safetensors", "s-2.safetensors"]);
        let nested = shard_names(&path, "o/r", "main", "sub/model.safetensors.index.json").unwrap();
        assert_eq!(nested, ["sub/s-1.safetensors", "sub/s-2.safetensors"]);

        write(serde_json::json!({"a": "../escape.safetensors"}));
        let err = shard_names(&path, "o/r", "main", "i.json").unwrap_err().to_string();
        assert!(err.contains("../escape.safetensors") && err.contains("o/r"), "{err}");
        write(serde_json::json!({}));
        let err = shard_names(&path, "o/r", "main", "i.json").unwrap_err().to_string();
        assert!(err.contains("weight_map is empty"), "{err}");
        std::fs::write(&path, "{not json").unwrap();
        let err = shard_names(&path, "o/r", "main", "i.json").unwrap_err().to_string();
        assert!(err.contains("not a safetensors index"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn offline_cache_lookup() {
        let dir = std::env::temp_dir().join(format!("dsv41-hub-cache-{}", std::process::id()));
        let commit = "0123456789abcdef0123456789abcdef01234567";
        let repo_dir = dir.join("models--o--r");
        std::fs::create_dir_all(repo_dir.join("snapshots").join(commit)).unwrap();
        std::fs::write(repo_dir.join("snapshots").join(commit).join("config.json"), "{}").unwrap();
        let hub = Hub::new(HubOptions::from_vars(|_| None).with_cache_dir(&dir).with_offline(true)).unwrap();
        // A commit revision is found without a ref; a branch needs `refs/{branch}`.
        let want = Some(repo_dir.join("snapshots").join(commit).join("config.json"));
        assert_eq!(hub.cached("o/r", commit, "config.json").unwrap(), want);
        assert_eq!(hub.cached("o/r", "main", "config.json").unwrap(), None);
        std::fs::create_dir_all(repo_dir.join("refs")).unwrap();
        std::fs::write(repo_dir.join("refs").join("main"), commit).unwrap();
        assert_eq!(hub.cached("o/r", "main", "config.json").unwrap(), want);
        let err = hub.file("o/r", "main", "tokenizer.json").unwrap_err().to_string();
        assert!(
            err.contains("`tokenizer.json` of o/r at revision main") && err.contains("HF_HUB_OFFLINE"),
            "{err}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
