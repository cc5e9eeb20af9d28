//! One progress bar per downloaded file, labelled with its place in the checkpoint.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// The file name takes the room the rest leaves (and is cut to fit an 80-column terminal).
const TEMPLATE: &str = "{prefix} {wide_msg} [{bar:20}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}";

/// The `hf-hub` download callback behind a bar on stderr.
///
/// `hf-hub` calls `init` at the start of every attempt, then `update(bytes already on disk)` when
/// it resumes a partial file; `init` therefore rewinds the bar, so a resumed download shows the
/// true position instead of counting the resumed part twice.
pub(crate) struct FileProgress {
    bar: ProgressBar,
    visible: bool,
}

impl FileProgress {
    /// A bar labelled `label` (e.g. `[2/5]`) and `file`, drawn on stderr from the first `init`
    /// (when the size is known) when `visible` (indicatif draws nothing when stderr is not a
    /// terminal), otherwise hidden but still counting.
    pub(crate) fn new(visible: bool, label: &str, file: &str) -> Self {
        let bar = ProgressBar::hidden();
        // The template is a constant that parses; fall back to the default style regardless.
        if let Ok(style) = ProgressStyle::with_template(TEMPLATE) {
            bar.set_style(style.progress_chars("=> "));
        }
        bar.set_prefix(label.to_string());
        bar.set_message(file.to_string());
        Self { bar, visible }
    }

    /// The underlying bar (position = bytes on disk, length = file size).
    #[cfg(test)]
    pub(crate) fn bar(&self) -> &ProgressBar {
        &self.bar
    }
}

impl hf_hub::api::Progress for FileProgress {
    fn init(&mut self, size: usize, _filename: &str) {
        self.bar.set_length(size as u64);
        self.bar.set_position(0);
        if self.visible && self.bar.is_hidden() {
            self.bar.set_draw_target(ProgressDrawTarget::stderr());
        }
    }

    fn update(&mut self, size: usize) {
        self.bar.inc(size as u64);
    }

    fn finish(&mut self) {
        self.bar.finish();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hf_hub::api::Progress;

    #[test]
    fn resumed_attempt_counts_once() {
        let mut p = FileProgress::new(false, "[1/2]", "model.safetensors");
        // First attempt: 40 of 100 bytes, then the connection drops.
        p.init(100, "model.safetensors");
        p.init(100, "model.safetensors");
        p.update(0);
        p.update(40);
        assert_eq!(p.bar().position(), 40);
        // Retry: hf-hub re-inits and reports the 40 bytes already on disk, then the rest.
        p.init(100, "model.safetensors");
        p.update(40);
        p.update(60);
        p.finish();
        assert_eq!(p.bar().position(), 100);
        assert_eq!(p.bar().length(), Some(100));
        assert!(p.bar().is_finished());
    }
}
