//! Where and how to download: endpoint, cache folder, token, offline mode, progress, retries,
//! resolved from the environment variables the Python `huggingface_hub` library reads.

use std::path::{Path, PathBuf};

/// The public hub.
pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

/// Download retries within one call when [`HubOptions::from_env`] builds the options.
pub const DEFAULT_RETRIES: usize = 3;

/// Settings of a [`Hub`](super::Hub) client.
///
/// [`from_env`](Self::from_env) reads, with the precedence of Python's `huggingface_hub`:
///
/// | setting | variables, first set wins | default |
/// | --- | --- | --- |
/// | `cache_dir` | `HF_HUB_CACHE`, `HUGGINGFACE_HUB_CACHE`, `$HF_HOME/hub` | `$XDG_CACHE_HOME/huggingface/hub`, else `~/.cache/huggingface/hub` |
/// | `endpoint` | `HF_ENDPOINT` (a trailing `/` is dropped) | [`DEFAULT_ENDPOINT`] |
/// | `token` | `HF_TOKEN`, `HUGGING_FACE_HUB_TOKEN`, the file `HF_TOKEN_PATH`, the file `$HF_HOME/token` | none |
/// | `offline` | `HF_HUB_OFFLINE` (`1`, `ON`, `YES`, `TRUE`, any case) | false |
/// | `progress` | off when `HF_HUB_DISABLE_PROGRESS_BARS` is true | on |
///
/// `HF_HOME` itself defaults to `$XDG_CACHE_HOME/huggingface`, else `~/.cache/huggingface`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HubOptions {
    /// Base URL of the hub, without a trailing `/`; files are requested at
    /// `{endpoint}/{repo}/resolve/{revision}/{file}`.
    pub endpoint: String,
    /// The hub cache folder (the `hub` folder of `HF_HOME`), laid out as `huggingface_hub` does:
    /// `models--{owner}--{name}/{blobs,refs,snapshots}`.
    pub cache_dir: PathBuf,
    /// Bearer token sent with every request.
    pub token: Option<String>,
    /// Cache only: never touch the network; a file that is not cached is an error naming it.
    pub offline: bool,
    /// Show a progress bar per downloaded file on stderr (drawn only when stderr is a terminal).
    pub progress: bool,
    /// How many times one call resumes a download whose connection failed, before giving up.
    pub retries: usize,
}

impl HubOptions {
    /// Options from the process environment (see the table on [`HubOptions`]).
    pub fn from_env() -> Self {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// Options from the variables `var` returns (`None` = unset; an empty value counts as unset),
    /// with the precedence of [`from_env`](Self::from_env). Only the token file is read from disk.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Self {
        let var = |name: &str| var(name).filter(|v| !v.is_empty());
        let home = || {
            var("HOME")
                .or_else(|| var("USERPROFILE"))
                .map_or_else(|| PathBuf::from("."), PathBuf::from)
        };
        let hf_home = var("HF_HOME").map(PathBuf::from).unwrap_or_else(|| {
            var("XDG_CACHE_HOME")
                .map_or_else(|| home().join(".cache"), PathBuf::from)
                .join("huggingface")
        });
        let cache_dir = var("HF_HUB_CACHE")
            .or_else(|| var("HUGGINGFACE_HUB_CACHE"))
            .map_or_else(|| hf_home.join("hub"), PathBuf::from);
        let endpoint = var("HF_ENDPOINT").unwrap_or_else(|| DEFAULT_ENDPOINT.to_string());
        let token = var("HF_TOKEN").or_else(|| var("HUGGING_FACE_HUB_TOKEN")).or_else(|| {
            let path = var("HF_TOKEN_PATH").map_or_else(|| hf_home.join("token"), PathBuf::from);
            read_token(&path)
        });
        Self {
            endpoint: endpoint.trim_end_matches('/').to_string(),
            cache_dir,
            token,
            offline: var("HF_HUB_OFFLINE").is_some_and(|v| is_true(&v)),
            progress: !var("HF_HUB_DISABLE_PROGRESS_BARS").is_some_and(|v| is_true(&v)),
            retries: DEFAULT_RETRIES,
        }
    }

    /// Replaces the endpoint (a trailing `/` is dropped).
    pub fn with_endpoint(mut self, endpoint: impl Into<String>) -> Self {
        self.endpoint = endpoint.into().trim_end_matches('/').to_string();
        self
    }

    /// Replaces the cache folder.
    pub fn with_cache_dir(mut self, cache_dir: impl Into<PathBuf>) -> Self {
        self.cache_dir = cache_dir.into();
        self
    }

    /// Replaces the token.
    pub fn with_token(mut self, token: Option<String>) -> Self {
        self.token = token;
        self
    }

    /// Turns offline (cache-only) mode on or off.
    pub fn with_offline(mut self, offline: bool) -> Self {
        self.offline = offline;
        self
    }

    /// Turns the progress bars on or off.
    pub fn with_progress(mut self, progress: bool) -> Self {
        self.progress = progress;
        self
    }

    /// Replaces the number of in-call retries.
    pub fn with_retries(mut self, retries: usize) -> Self {
        self.retries = retries;
        self
    }
}

/// `huggingface_hub`'s reading of a boolean variable.
fn is_true(value: &str) -> bool {
    matches!(value.trim().to_ascii_uppercase().as_str(), "1" | "ON" | "YES" | "TRUE")
}

/// The trimmed content of a token file, if it exists and is not blank.
fn read_token(path: &Path) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    let token = text.trim();
    (!token.is_empty()).then(|| token.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn opts(vars: &[(&str, &str)]) -> HubOptions {
        let map: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        HubOptions::from_vars(|k| map.get(k).cloned())
    }

    #[test]
    fn defaults_under_home() {
        let o = opts(&[("HOME", "/home/u")]);
        assert_eq!(o.cache_dir, PathBuf::from("/home/u/.cache/huggingface/hub"));
        assert_eq!(o.endpoint, DEFAULT_ENDPOINT);
        assert_eq!(o.token, None);
        assert!(!o.offline);
        assert!(o.progress);
        assert_eq!(o.retries, DEFAULT_RETRIES);
    }

    #[test]
    fn cache_precedence() {
        let all = [
            ("HOME", "/h"),
            ("XDG_CACHE_HOME", "/xdg"),
            ("HF_HOME", "/hf"),
            ("HUGGINGFACE_HUB_CACHE", "/legacy"),
            ("HF_HUB_CACHE", "/hub"),
        ];
        let expect = [
            "/hub",
            "/legacy",
            "/hf/hub",
            "/xdg/huggingface/hub",
            "/h/.cache/huggingface/hub",
        ];
        for (drop, want) in expect.iter().enumerate() {
            let o = opts(&all[..all.len() - drop]);
            assert_eq!(o.cache_dir, PathBuf::from(want), "with {:?}", &all[..all.len() - drop]);
        }
        // An empty value counts as unset.
        assert_eq!(
            opts(&[("HF_HOME", "/hf"), ("HF_HUB_CACHE", "")]).cache_dir,
            PathBuf::from("/hf/hub")
        );
    }

    #[test]
    fn endpoint_offline_progress() {
        let o = opts(&[
            ("HF_ENDPOINT", "http://127.0.0.1:9/"),
            ("HF_HUB_OFFLINE", "1"),
            ("HF_HUB_DISABLE_PROGRESS_BARS", "true"),
        ]);
        assert_eq!(o.endpoint, "http://127.0.0.1:9");
        assert!(o.offline);
        assert!(!o.progress);
        for v in ["1", "on", "Yes", "TRUE"] {
            assert!(opts(&[("HF_HUB_OFFLINE", v)]).offline, "{v}");
        }
        for v in ["0", "off", "no", "false", "2"] {
            assert!(!opts(&[("HF_HUB_OFFLINE", v)]).offline, "{v}");
        }
    }

    #[test]
    fn token_precedence() {
        let dir = std::env::temp_dir().join(format!("dsv41-hub-token-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("token"), "  hf_file\n").unwrap();
        std::fs::write(dir.join("other"), "hf_path\n").unwrap();
        let home = dir.to_str().unwrap();
        let other = dir.join("other");
        let other = other.to_str().unwrap();
        assert_eq!(opts(&[("HF_HOME", home)]).token.as_deref(), Some("hf_file"));
        assert_eq!(
            opts(&[("HF_HOME", home), ("HF_TOKEN_PATH", other)]).token.as_deref(),
            Some("hf_path")
        );
        assert_eq!(
            opts(&[("HF_HOME", home), ("HUGGING_FACE_HUB_TOKEN", "hf_legacy")])
                .token
                .as_deref(),
            Some("hf_legacy")
        );
        assert_eq!(
            opts(&[
                ("HF_HOME", home),
                ("HUGGING_FACE_HUB_TOKEN", "hf_legacy"),
                ("HF_TOKEN", "hf_env")
            ])
            .token
            .as_deref(),
            Some("hf_env")
        );
        std::fs::write(dir.join("token"), " \n").unwrap();
        assert_eq!(opts(&[("HF_HOME", home)]).token, None);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
