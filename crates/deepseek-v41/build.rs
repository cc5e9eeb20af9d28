//! Build script: a no-op without the `cuda` feature. With it, compiles the CUDA kernels of the
//! repository's top-level `kernels/` folder (`kernels/*.cu`, headers in `kernels/include/`) into
//! the static library `libdsv41_kernels.a` with nvcc (through the `cudaforge` crate), and links
//! it together with the CUDA runtime. Needs nvcc 13.0 (scripts/install-cuda.sh) and
//! `CUDA_COMPUTE_CAP` (90 for H100 / H200) when no GPU is visible. With the `cuda-diag` feature the
//! sparse attention kernels are compiled with their diagnostics (`-DDSV41_SA_DIAG=1`, see
//! `kernels/include/dsv41_sparse_attention_common.cuh`).

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    // Without the feature this is a no-op (`cuda` is not compiled in).
    #[cfg(feature = "cuda")]
    if let Err(e) = cuda::build() {
        panic!("building the CUDA kernels failed: {e}");
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use std::path::{Path, PathBuf};

    pub fn build() -> Result<(), Box<dyn std::error::Error>> {
        let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?);
        let kernels = manifest.join("../../kernels").canonicalize()?;
        let include = kernels.join("include");
        let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);

        // New or removed files in the folders also trigger a rebuild.
        println!("cargo::rerun-if-changed={}", kernels.display());
        println!("cargo::rerun-if-changed={}", include.display());
        let headers = files_with_ext(&include, &["h", "cuh"])?;
        for h in &headers {
            println!("cargo::rerun-if-changed={}", h.display());
        }
        let sources = files_with_ext(&kernels, &["cu"])?;
        if sources.is_empty() {
            return Err(format!("no .cu files in {}", kernels.display()).into());
        }
        for s in &sources {
            println!("cargo::rerun-if-changed={}", s.display());
        }
        println!("cargo::rerun-if-env-changed=CUDA_COMPUTE_CAP");
        println!("cargo::rerun-if-env-changed=CUDA_HOME");

        let lib = out_dir.join("libdsv41_kernels.a");
        let mut builder = cudaforge::KernelBuilder::new()
            .source_files(sources)
            .watch(headers)
            .include_path(&include)
            .out_dir(out_dir.join("dsv41_kernels"))
            .arg("-std=c++17")
            .arg("-O3")
            .arg("--expt-relaxed-constexpr")
            .arg("-lineinfo");
        // The sparse attention diagnostics (phase traces, timing-only modes): a diagnostic build only.
        if cfg!(feature = "cuda-diag") {
            builder = builder.arg("-DDSV41_SA_DIAG=1");
        }
        builder.build_lib(&lib)?;

        println!("cargo::rustc-link-search=native={}", out_dir.display());
        println!("cargo::rustc-link-lib=static=dsv41_kernels");
        for var in ["CUDA_HOME", "CUDA_PATH", "CUDA_ROOT"] {
            if let Some(root) = std::env::var_os(var) {
                for sub in ["lib64", "lib"] {
                    let dir = Path::new(&root).join(sub);
                    if dir.is_dir() {
                        println!("cargo::rustc-link-search=native={}", dir.display());
                    }
                }
                break;
            }
        }
        println!("cargo::rustc-link-lib=dylib=cudart");
        println!("cargo::rustc-link-lib=dylib=stdc++");
        Ok(())
    }

    fn files_with_ext(dir: &Path, exts: &[&str]) -> std::io::Result<Vec<PathBuf>> {
        let mut out = Vec::new();
        if dir.is_dir() {
            for entry in std::fs::read_dir(dir)? {
                let p = entry?.path();
                if p.is_file() && p.extension().and_then(|e| e.to_str()).is_some_and(|e| exts.contains(&e)) {
                    out.push(p);
                }
            }
        }
        out.sort();
        Ok(out)
    }
}
