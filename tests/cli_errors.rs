//! The `generate` example under bad and extreme input (issue 20's list): each case must exit
//! with a non-zero status and a clear message on stderr, never a panic (exit code 101 or
//! "panicked") or an abort. Runs the binary `cargo test` builds next to the test executables
//! (`target/<profile>/examples/generate`); every case except the last fails before the weights
//! load, so the whole file takes a few seconds. Also the `--dry-run` plan, which loads nothing.

use std::path::PathBuf;
use std::process::{Command, Output};

fn generate_bin() -> PathBuf {
    // target/<profile>/deps/cli_errors-<hash> -> target/<profile>/examples/generate
    let exe = std::env::current_exe().expect("test executable path");
    let profile_dir = exe.parent().and_then(|d| d.parent()).expect("target/<profile>");
    let bin = profile_dir.join("examples").join(format!("generate{}", std::env::consts::EXE_SUFFIX));
    let build = "`cargo test` builds the examples, `cargo test --test cli_errors` does not: run `cargo build --release --example generate`";
    assert!(bin.is_file(), "{} not found: {build}", bin.display());
    let modified = |p: &std::path::Path| std::fs::metadata(p).and_then(|m| m.modified()).expect("mtime");
    let source = repo_root().join("examples/generate.rs");
    assert!(modified(&bin) >= modified(&source), "{} is older than {}: {build}", bin.display(), source.display());
    bin
}

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn run(args: &[&str]) -> Output {
    Command::new(generate_bin())
        .args(args)
        .current_dir(repo_root())
        .env_remove("DEEPSEEK_V41_WEIGHTS")
        .output()
        .expect("spawn generate")
}

/// Fails unless `args` exits non-zero without a panic and stderr holds every `want`.
fn rejects(args: &[&str], want: &[&str]) -> Result<(), String> {
    let out = run(args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let code = out.status.code();
    let mut problems = Vec::new();
    if out.status.success() {
        problems.push("exited with success".to_string());
    }
    if code == Some(101) || code.is_none() || stderr.contains("panicked") {
        problems.push(format!("panicked or was killed (exit {code:?})"));
    }
    for w in want {
        if !stderr.contains(w) {
            problems.push(format!("stderr lacks {w:?}"));
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(format!("generate {args:?}: {}\n--- stderr:\n{stderr}", problems.join("; ")))
    }
}

#[test]
fn every_bad_input_gets_a_clear_error_and_no_panic() {
    let long_prompt = "To be, or not to be, that is the question. ".repeat(600);
    let missing = repo_root().join("no/such/model-folder");
    let missing = missing.to_str().expect("utf-8 path");
    let file = repo_root().join("weights.toml");
    let file = file.to_str().expect("utf-8 path");
    let cases: Vec<(Vec<&str>, Vec<&str>)> = vec![
        (vec!["--max-new-tokens", "18446744073709551615"], vec!["max_position_embeddings = 4096", "--max-new-tokens"]),
        (vec!["--max-new-tokens", "100000000000"], vec!["max_position_embeddings = 4096", "at most"]),
        (vec!["--max-new-tokens", "99999999999999999999999"], vec!["--max-new-tokens"]),
        (vec!["--max-new-tokens", "-1"], vec!["--max-new-tokens"]),
        (vec!["--prompt", &long_prompt], vec!["prompt tokens", "shorten the prompt"]),
        (vec!["--temperature", "-1"], vec!["temperature must be finite and >= 0", "-1"]),
        (vec!["--temperature", "nan"], vec!["temperature must be finite"]),
        (vec!["--temperature", "inf"], vec!["temperature must be finite"]),
        (vec!["--temperature", "hot"], vec!["--temperature"]),
        (vec!["--top-p", "0"], vec!["top_p must be in (0, 1]"]),
        (vec!["--top-p", "1.5"], vec!["top_p must be in (0, 1]", "1.5"]),
        (vec!["--top-p", "-0.5"], vec!["top_p must be in (0, 1]"]),
        (vec!["--model", missing], vec!["model folder not found", "no/such/model-folder"]),
        (vec!["--model", "./nope"], vec!["model folder not found"]),
        (vec!["--model", file], vec!["is a file"]),
        (vec!["--model", "deepseek-v5"], vec!["no model named `deepseek-v5`", "v41-shakespeare-tiny"]),
        (vec!["--model", "v41-tiny-golden"], vec!["v41-tiny-golden", "no tokenizer", "v41-shakespeare-tiny"]),
        (vec!["--model", "tests/fixtures/v41-tiny"], vec!["no tokenizer.json"]),
        (vec!["--chat"], vec!["--chat", "chat template"]),
        (vec!["--weights", "no/such/weights.toml", "--model", "x"], vec!["no/such/weights.toml"]),
        (vec!["--device", "gpu"], vec!["--device"]),
        (vec!["--no-such-flag"], vec!["--no-such-flag"]),
    ];
    let mut cases = cases;
    if !cfg!(feature = "cuda") {
        cases.push((vec!["--device", "cuda"], vec!["--features cuda"]));
        cases.push((vec!["--cache", "packed"], vec!["--features cuda"]));
    }
    let failures: Vec<String> = cases.iter().filter_map(|(args, want)| rejects(args, want).err()).collect();
    assert!(failures.is_empty(), "{} of {} cases failed:\n{}", failures.len(), cases.len(), failures.join("\n\n"));
}

#[test]
fn help_lists_the_catalog_and_a_run_reports_prefill_and_decode_speed() {
    let help = run(&["--help"]);
    assert!(help.status.success());
    let text = String::from_utf8_lossy(&help.stdout);
    for name in ["deepseek-v4.1-flash", "v41-tiny-golden", "v41-shakespeare-tiny"] {
        assert!(text.contains(name), "--help lacks {name}:\n{text}");
    }
    // A short run from a folder that is not the repository: the built-in catalog still works,
    // the speeds are reported separately, nothing is drawn when stderr is piped.
    let out = Command::new(generate_bin())
        .args(["--max-new-tokens", "3", "--temperature", "0", "--prompt", "-HAMLET."])
        .current_dir(std::env::temp_dir())
        .env_remove("DEEPSEEK_V41_WEIGHTS")
        .output()
        .expect("spawn generate");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("prefill: ") && stderr.contains("decode: 2 tokens"), "{stderr}");
    assert!(!stderr.contains('\r') && !stderr.contains("\x1b["), "progress drawn on a pipe: {stderr:?}");
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("-HAMLET."));
}

/// `--dry-run` plans from a folder holding only `config.json` (the released Flash config): no
/// weights, no tokenizer, no GPU or CUDA build for `--device cuda`; it prints the table and a
/// total line and exits with success.
#[test]
fn dry_run_plans_from_a_config_alone() {
    let out = run(&["--model", "tests/fixtures/deepseek-v41-flash", "--dry-run", "--device", "cuda", "--cache", "packed"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}\n{stdout}", String::from_utf8_lossy(&out.stderr));
    for want in ["routed experts", "MXFP4", "Engram tables", "mapped FP8 rows", "dry run of", "on cuda", "890.0 B/token", "no weights read"] {
        assert!(stdout.contains(want), "--dry-run output lacks {want:?}:\n{stdout}");
    }
    let out = run(&["--model", "tests/fixtures/deepseek-v41-flash", "--dry-run", "--quantized-weights", "dequantized", "--device", "cuda"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && !stdout.contains("MXFP4") && stdout.contains("bf16"), "{stdout}");
}
