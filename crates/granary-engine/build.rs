//! With the `cuda` feature: the engine's own CUDA kernels
//! (`kernels/*.cu`), compiled to PTX with the toolkit candle's kernels are
//! built with (`nvcc` from `CUDA_ROOT`/`CUDA_PATH`/`PATH`, for
//! `CUDA_COMPUTE_CAP` or the visible GPU), and named in `$OUT_DIR/ptx.rs`.

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    #[cfg(feature = "cuda")]
    if let Err(e) = cuda() {
        eprintln!("error: the engine's CUDA kernels did not build: {e}");
        std::process::exit(1);
    }
}

#[cfg(feature = "cuda")]
fn cuda() -> cudaforge::Result<()> {
    println!("cargo::rerun-if-changed=kernels");
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    cudaforge::KernelBuilder::new()
        .source_dir("kernels")
        .arg("-std=c++17")
        .arg("-O3")
        .build_ptx()?
        .write(out.join("ptx.rs"))
}
