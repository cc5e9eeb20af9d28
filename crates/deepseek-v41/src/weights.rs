//! `weights.toml`: the catalog of supported checkpoints (hub repo + pinned revision, or a local
//! folder), with their files, config, tokenizer and dtype. `generate --model <name>` resolves
//! names here; the repository's file is built into the crate ([`WeightsCatalog::embedded`]), so
//! a copied binary needs no file at a fixed path.

use std::path::{Path, PathBuf};
use std::str::FromStr;

use candle_core::DType;
use serde::Deserialize;

/// Errors of loading or querying a [`WeightsCatalog`].
#[derive(Debug, thiserror::Error)]
pub enum WeightsError {
    /// The catalog file could not be read.
    #[error("cannot read weights catalog {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// Not valid TOML, or a field has the wrong type or is unknown.
    #[error("weights catalog {what}: {message}")]
    Parse {
        /// The file, or "string".
        what: String,
        /// The parser's message (with line and column).
        message: String,
    },
    /// An entry is inconsistent (e.g. both `repo` and `local`).
    #[error("weights catalog entry `{name}`: {message}")]
    Invalid {
        /// The entry's name.
        name: String,
        /// What is wrong.
        message: String,
    },
    /// No entry has this name.
    #[error("no model named `{name}` in the weights catalog; known: {}", known.join(", "))]
    UnknownModel {
        /// The requested name.
        name: String,
        /// The names of the catalog.
        known: Vec<String>,
    },
    /// The entry has no tokenizer, so it cannot encode prompts or decode text.
    #[error(
        "model `{name}` has no tokenizer in the weights catalog, so it cannot generate text; \
         models that can: {}",
        usable.join(", ")
    )]
    NoTokenizer {
        /// The entry's name.
        name: String,
        /// The entries that have a tokenizer.
        usable: Vec<String>,
    },
    /// No entry has `default = true`.
    #[error("the weights catalog has no entry with `default = true`; known: {}", known.join(", "))]
    NoDefault {
        /// The names of the catalog.
        known: Vec<String>,
    },
}

impl From<WeightsError> for candle_core::Error {
    fn from(e: WeightsError) -> Self {
        candle_core::Error::wrap(e)
    }
}

/// Result of the weights module.
pub type Result<T> = std::result::Result<T, WeightsError>;

/// Where an entry's files live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WeightsSource<'a> {
    /// A Hugging Face hub repository at a pinned revision (commit).
    Hub {
        /// `owner/name`.
        repo: &'a str,
        /// The pinned revision.
        revision: &'a str,
    },
    /// A folder; relative paths are relative to the catalog file's folder (see
    /// [`WeightsCatalog::local_dir`]).
    Local(&'a Path),
}

/// Which safetensors files hold the weights.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WeightFiles<'a> {
    /// A sharded checkpoint: the `model.safetensors.index.json` name.
    Index(&'a str),
    /// The listed files.
    Files(&'a [String]),
}

/// One `[[model]]` entry of `weights.toml`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WeightsEntry {
    /// The name `--model` accepts.
    pub name: String,
    /// One line for humans.
    #[serde(default)]
    pub description: String,
    /// Hub repository (`owner/name`); exclusive with `local`.
    pub repo: Option<String>,
    /// Pinned hub revision; required with `repo`.
    pub revision: Option<String>,
    /// Local folder; exclusive with `repo`.
    pub local: Option<PathBuf>,
    /// Safetensors files; exclusive with `index`.
    #[serde(default)]
    pub files: Vec<String>,
    /// `model.safetensors.index.json` of a sharded checkpoint; exclusive with `files`.
    pub index: Option<String>,
    /// The `config.json` file name (default `config.json`).
    #[serde(default = "default_config")]
    pub config: String,
    /// The `tokenizer.json` file name, if the checkpoint has a tokenizer.
    pub tokenizer: Option<String>,
    /// Activation dtype name: `bf16` (default), `f16` or `f32`.
    pub dtype: Option<String>,
    /// The model `generate` runs without `--model`.
    #[serde(default)]
    pub default: bool,
}

fn default_config() -> String {
    "config.json".to_string()
}

impl WeightsEntry {
    /// Hub repository or local folder; fails for an entry that has neither or both (never for an
    /// entry of a loaded catalog, which is validated).
    pub fn source(&self) -> Result<WeightsSource<'_>> {
        match (&self.repo, &self.revision, &self.local) {
            (Some(repo), Some(revision), None) => Ok(WeightsSource::Hub { repo, revision }),
            (None, None, Some(local)) => Ok(WeightsSource::Local(local)),
            _ => Err(self.invalid("give either `repo` with a pinned `revision`, or `local`".into())),
        }
    }

    /// The index file or the list of safetensors files.
    pub fn weight_files(&self) -> WeightFiles<'_> {
        match &self.index {
            Some(index) => WeightFiles::Index(index),
            None => WeightFiles::Files(&self.files),
        }
    }

    /// The activation dtype (`bf16` when not given).
    pub fn dtype(&self) -> Result<DType> {
        match self.dtype.as_deref() {
            None | Some("bf16") => Ok(DType::BF16),
            Some("f16") => Ok(DType::F16),
            Some("f32") => Ok(DType::F32),
            Some(other) => Err(self.invalid(format!("dtype `{other}` is not one of bf16, f16, f32"))),
        }
    }

    fn invalid(&self, message: String) -> WeightsError {
        WeightsError::Invalid { name: self.name.clone(), message }
    }

    fn validate(&self) -> Result<()> {
        if self.name.trim().is_empty() {
            return Err(self.invalid("the name is empty".into()));
        }
        match (&self.repo, &self.revision, &self.local) {
            (Some(_), _, Some(_)) => return Err(self.invalid("has both `repo` and `local`; give one".into())),
            (None, _, None) => return Err(self.invalid("has neither `repo` nor `local`".into())),
            (Some(_), None, None) => return Err(self.invalid("`repo` needs a pinned `revision`".into())),
            (None, Some(_), Some(_)) => return Err(self.invalid("`revision` only applies to `repo`".into())),
            _ => {}
        }
        self.source()?;
        match (&self.index, self.files.is_empty()) {
            (Some(_), false) => return Err(self.invalid("has both `index` and `files`; give one".into())),
            (None, true) => return Err(self.invalid("lists no weights: give `files` or `index`".into())),
            _ => {}
        }
        self.dtype().map(|_| ())
    }
}

/// The text of the repository's `weights.toml`, built into the crate.
pub const EMBEDDED: &str = include_str!("../../../weights.toml");

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CatalogFile {
    #[serde(default)]
    model: Vec<WeightsEntry>,
}

/// The parsed `weights.toml`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WeightsCatalog {
    models: Vec<WeightsEntry>,
    base_dir: Option<PathBuf>,
}

impl FromStr for WeightsCatalog {
    type Err = WeightsError;

    /// Parses and validates catalog text; relative `local` folders stay relative (to the
    /// current directory).
    fn from_str(s: &str) -> Result<Self> {
        Self::parse(s, "string", None)
    }
}

impl WeightsCatalog {
    /// Reads and validates a `weights.toml`; relative `local` folders are resolved against the
    /// file's folder.
    pub fn load(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| WeightsError::Io { path: path.into(), source })?;
        let base = path.parent().map(|p| if p.as_os_str().is_empty() { Path::new(".") } else { p });
        Self::parse(&text, &path.display().to_string(), base.map(Path::to_path_buf))
    }

    fn parse(text: &str, what: &str, base_dir: Option<PathBuf>) -> Result<Self> {
        let file: CatalogFile =
            toml::from_str(text).map_err(|e| WeightsError::Parse { what: what.to_string(), message: e.to_string() })?;
        for (i, entry) in file.model.iter().enumerate() {
            entry.validate()?;
            if file.model[..i].iter().any(|e| e.name == entry.name) {
                return Err(entry.invalid("the name is used twice".into()));
            }
        }
        let defaults: Vec<&str> = file.model.iter().filter(|e| e.default).map(|e| e.name.as_str()).collect();
        if defaults.len() > 1 {
            return Err(WeightsError::Invalid {
                name: defaults.join(", "),
                message: "more than one entry has `default = true`".into(),
            });
        }
        Ok(Self { models: file.model, base_dir })
    }

    /// All entries, in file order.
    pub fn models(&self) -> &[WeightsEntry] {
        &self.models
    }

    /// The entry names, in file order.
    pub fn names(&self) -> Vec<&str> {
        self.models.iter().map(|m| m.name.as_str()).collect()
    }

    fn known(&self) -> Vec<String> {
        self.names().into_iter().map(String::from).collect()
    }

    /// The catalog built into the crate: the repository's `weights.toml` at build time. Relative
    /// `local` folders stay relative (see [`WeightsCatalog::local_dir`]).
    pub fn embedded() -> Result<Self> {
        Self::parse(EMBEDDED, "built-in weights.toml", None)
    }

    /// The entry called `name`, checked to have a tokenizer (it can generate text); the errors
    /// list the known names, or the names that can generate.
    pub fn get_for_generation(&self, name: &str) -> Result<&WeightsEntry> {
        let entry = self.get(name)?;
        if entry.tokenizer.is_none() {
            let usable = self.models.iter().filter(|m| m.tokenizer.is_some()).map(|m| m.name.clone()).collect();
            return Err(WeightsError::NoTokenizer { name: name.to_string(), usable });
        }
        Ok(entry)
    }

    /// The entry called `name`; the error lists the known names.
    pub fn get(&self, name: &str) -> Result<&WeightsEntry> {
        self.models
            .iter()
            .find(|m| m.name == name)
            .ok_or_else(|| WeightsError::UnknownModel { name: name.to_string(), known: self.known() })
    }

    /// The entry with `default = true`.
    pub fn default_model(&self) -> Result<&WeightsEntry> {
        self.models.iter().find(|m| m.default).ok_or_else(|| WeightsError::NoDefault { known: self.known() })
    }

    /// The folder of a local entry, resolved against the catalog file's folder (for a catalog
    /// from [`WeightsCatalog::load`]); `None` for hub entries.
    pub fn local_dir(&self, entry: &WeightsEntry) -> Option<PathBuf> {
        let local = entry.local.as_deref()?;
        Some(match &self.base_dir {
            Some(base) if local.is_relative() => base.join(local),
            _ => local.to_path_buf(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn repo_catalog_path() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../weights.toml")
    }

    fn parse_err(text: &str) -> String {
        text.parse::<WeightsCatalog>().unwrap_err().to_string()
    }

    const HUB: &str = "[[model]]\nname = \"a\"\nrepo = \"o/a\"\nrevision = \"abc\"\nfiles = [\"m.safetensors\"]\n";

    #[test]
    fn repository_catalog() {
        let cat = WeightsCatalog::load(repo_catalog_path()).unwrap();
        assert_eq!(cat.names(), ["deepseek-v4.1-flash", "v41-tiny-golden", "v41-shakespeare-tiny"]);

        let flash = cat.get("deepseek-v4.1-flash").unwrap();
        assert_eq!(
            flash.source().unwrap(),
            WeightsSource::Hub {
                repo: "deepseek-ai/DeepSeek-V4.1-Flash",
                revision: "dba1be0a40aa45a94ad051997016db3960a90277"
            }
        );
        assert_eq!(flash.weight_files(), WeightFiles::Index("model.safetensors.index.json"));
        assert_eq!(flash.tokenizer.as_deref(), Some("tokenizer.json"));
        assert_eq!(flash.dtype().unwrap(), DType::BF16);
        assert!(cat.local_dir(flash).is_none());

        let default = cat.default_model().unwrap();
        assert_eq!(default.name, "v41-shakespeare-tiny");
        let dir = cat.local_dir(default).unwrap();
        for file in ["config.json", "tokenizer.json", "model.safetensors", "PROVENANCE.md"] {
            assert!(dir.join(file).is_file(), "{} missing", dir.join(file).display());
        }
        assert_eq!(default.weight_files(), WeightFiles::Files(&["model.safetensors".to_string()]));
        assert_eq!(default.tokenizer.as_deref(), Some("tokenizer.json"));

        let golden = cat.get("v41-tiny-golden").unwrap();
        assert!(cat.local_dir(golden).unwrap().join("config.json").is_file());
        assert!(!golden.default);
    }

    #[test]
    fn embedded_catalog_is_the_repository_file_and_rejects_models_without_tokenizer() {
        let file = WeightsCatalog::load(repo_catalog_path()).unwrap();
        let embedded = WeightsCatalog::embedded().unwrap();
        assert_eq!(embedded.models(), file.models());
        assert!(embedded.local_dir(embedded.default_model().unwrap()).unwrap().is_relative());
        let err = embedded.get_for_generation("v41-tiny-golden").unwrap_err().to_string();
        assert!(err.contains("v41-tiny-golden") && err.contains("no tokenizer") && err.contains("v41-shakespeare-tiny"), "{err}");
        assert!(!err.contains("models that can: deepseek-v4.1-flash, v41-tiny-golden"), "{err}");
        assert_eq!(embedded.get_for_generation("v41-shakespeare-tiny").unwrap().name, "v41-shakespeare-tiny");
        assert!(embedded.get_for_generation("nope").unwrap_err().to_string().contains("no model named"));
    }

    #[test]
    fn unknown_name_lists_known_names() {
        let cat = WeightsCatalog::load(repo_catalog_path()).unwrap();
        let err = cat.get("deepseek-v5").unwrap_err().to_string();
        assert!(err.contains("deepseek-v5"), "{err}");
        for name in cat.names() {
            assert!(err.contains(name), "{err}");
        }
    }

    #[test]
    fn from_str_defaults() {
        let cat: WeightsCatalog = HUB.parse().unwrap();
        let a = cat.get("a").unwrap();
        assert_eq!(a.config, "config.json");
        assert_eq!(a.description, "");
        assert_eq!(a.tokenizer, None);
        assert!(!a.default);
        let err = cat.default_model().unwrap_err().to_string();
        assert!(err.contains("default = true") && err.contains('a'), "{err}");
        assert!("".parse::<WeightsCatalog>().unwrap().models().is_empty());
    }

    #[test]
    fn local_dirs_stay_relative_without_a_file() {
        let cat: WeightsCatalog =
            "[[model]]\nname = \"l\"\nlocal = \"models/x\"\nfiles = [\"m.safetensors\"]\ndefault = true\n"
                .parse()
                .unwrap();
        let l = cat.default_model().unwrap();
        assert_eq!(l.source().unwrap(), WeightsSource::Local(Path::new("models/x")));
        assert_eq!(cat.local_dir(l).unwrap(), PathBuf::from("models/x"));
    }

    #[test]
    fn invalid_catalogs_are_rejected_with_the_reason() {
        let cases = [
            (format!("{HUB}{HUB}"), "used twice"),
            (HUB.replace("revision = \"abc\"\n", ""), "pinned `revision`"),
            (HUB.replace("files", "local = \"x\"\nfiles"), "both `repo` and `local`"),
            (HUB.replace("repo = \"o/a\"\nrevision = \"abc\"\n", ""), "neither `repo` nor `local`"),
            (HUB.replace("files = [\"m.safetensors\"]", "files = []"), "give `files` or `index`"),
            (HUB.replace("files", "index = \"i.json\"\nfiles"), "both `index` and `files`"),
            (format!("{HUB}dtype = \"fp8\"\n"), "dtype `fp8`"),
            (format!("{HUB}default = true\n{}default = true\n", HUB.replace("\"a\"", "\"b\"")), "more than one"),
            (format!("{HUB}revison = \"x\"\n"), "revison"),
            ("[[model]]\nname = \"a\"\nrepo = 3\n".to_string(), "repo"),
            ("[[model]\n".to_string(), "weights catalog string"),
            ("name = \"top-level\"\n".to_string(), "name"),
        ];
        for (text, want) in cases {
            let err = parse_err(&text);
            assert!(err.contains(want), "want {want:?} in {err:?} for\n{text}");
        }
        let err = WeightsCatalog::load("/nonexistent/weights.toml").unwrap_err().to_string();
        assert!(err.contains("/nonexistent/weights.toml"), "{err}");
    }
}
