//! The hub module's error type: every failure names the repository, the revision and the file.

use std::path::PathBuf;

use hf_hub::api::sync::ApiError;

/// Everything that can go wrong while fetching checkpoint files from the Hugging Face hub.
///
/// Converts into [`candle_core::Error`] (as a wrapped error whose message is this `Display`), so
/// `candle_core::Result` code can use `?`.
#[derive(Debug, thiserror::Error)]
pub enum HubError {
    /// Offline mode (`HF_HUB_OFFLINE=1` or [`HubOptions::offline`](super::HubOptions::offline))
    /// and the file is not in the cache.
    #[error(
        "`{file}` of {repo} at revision {revision} is not in the hub cache {cache} and offline \
         mode is on (HF_HUB_OFFLINE): download it once with network access, or unset HF_HUB_OFFLINE"
    )]
    NotCached {
        /// `owner/name`.
        repo: String,
        /// The requested revision.
        revision: String,
        /// The file inside the repository.
        file: String,
        /// The hub cache folder that was searched.
        cache: PathBuf,
    },
    /// The hub (or the server it redirected to) answered with an HTTP error status.
    #[error("the hub answered HTTP {status} for `{file}` of {repo} at revision {revision} ({url}){detail}")]
    Http {
        /// `owner/name`.
        repo: String,
        /// The requested revision.
        revision: String,
        /// The file inside the repository.
        file: String,
        /// The HTTP status code.
        status: u16,
        /// The URL that answered.
        url: String,
        /// The hub's own explanation (`X-Error-Code` / `X-Error-Message`) and a hint, starting
        /// with `": "`, or empty.
        detail: String,
    },
    /// Any other download failure: connection refused or dropped (after the retries), a reply
    /// without the headers the hub sends, a local I/O error, a cache lock held by another process.
    #[error("downloading `{file}` of {repo} at revision {revision} from {endpoint} failed: {source}")]
    Download {
        /// `owner/name`.
        repo: String,
        /// The requested revision.
        revision: String,
        /// The file inside the repository.
        file: String,
        /// The hub endpoint.
        endpoint: String,
        /// The `hf-hub` client's error.
        #[source]
        source: ApiError,
    },
    /// The sharded checkpoint's index cannot be read or names no usable shard.
    #[error("index `{file}` of {repo} at revision {revision} ({path}): {detail}")]
    BadIndex {
        /// `owner/name`.
        repo: String,
        /// The requested revision.
        revision: String,
        /// The index file's name inside the repository.
        file: String,
        /// Its local path.
        path: PathBuf,
        /// What is wrong.
        detail: String,
    },
    /// A repository id or file name that cannot be used (empty, absolute, or with `..`).
    #[error("invalid {what} {value:?}: {detail}")]
    InvalidName {
        /// `repository id`, `revision` or `file name`.
        what: &'static str,
        /// The offending value.
        value: String,
        /// Why it is rejected.
        detail: &'static str,
    },
    /// The HTTP client could not be set up.
    #[error("cannot set up the hub client: {0}")]
    Client(#[source] ApiError),
}

impl From<HubError> for candle_core::Error {
    fn from(e: HubError) -> Self {
        candle_core::Error::wrap(e)
    }
}

/// The file a request was about, to attach to the client's errors.
pub(crate) struct FileRef<'a> {
    pub repo: &'a str,
    pub revision: &'a str,
    pub file: &'a str,
    pub endpoint: &'a str,
}

impl FileRef<'_> {
    /// Sorts an `hf-hub` error: an HTTP status becomes [`HubError::Http`] with the hub's own
    /// explanation, anything else [`HubError::Download`].
    pub(crate) fn error(&self, err: ApiError) -> HubError {
        match err {
            ApiError::RequestError(boxed) => match *boxed {
                ureq::Error::Status(status, response) => HubError::Http {
                    repo: self.repo.to_string(),
                    revision: self.revision.to_string(),
                    file: self.file.to_string(),
                    status,
                    url: response.get_url().to_string(),
                    detail: status_detail(status, &response),
                },
                other => self.download(ApiError::RequestError(Box::new(other))),
            },
            other => self.download(other),
        }
    }

    fn download(&self, source: ApiError) -> HubError {
        HubError::Download {
            repo: self.repo.to_string(),
            revision: self.revision.to_string(),
            file: self.file.to_string(),
            endpoint: self.endpoint.to_string(),
            source,
        }
    }
}

/// `": <X-Error-Code>: <X-Error-Message> (hint)"` from an error reply, or empty.
fn status_detail(status: u16, response: &ureq::Response) -> String {
    let mut parts: Vec<String> = ["x-error-code", "x-error-message"]
        .iter()
        .filter_map(|h| response.header(h))
        .map(str::to_string)
        .collect();
    match status {
        401 | 403 => {
            parts.push("the repository may be gated or private: set HF_TOKEN to a token with access".to_string())
        }
        404 => parts.push("check the repository id, the revision and the file name".to_string()),
        _ => {}
    }
    if parts.is_empty() {
        String::new()
    } else {
        format!(": {}", parts.join(": "))
    }
}
