//! Compile check of every `kernels/cuda/*.cu` through NVRTC for sm_80 and sm_90. NVRTC needs no GPU, so this runs
//! in CI (scripts/check-cuda.sh puts a pip-installed libnvrtc on LD_LIBRARY_PATH). Without libnvrtc the test is
//! skipped with a message, unless PAGODA_REQUIRE_NVRTC=1 makes that a failure.
#![cfg(feature = "cuda")]

use pagoda_kernels::cuda::compile::{self, MODULES};

#[test]
fn every_module_compiles_for_sm80_and_sm90() {
    if !compile::nvrtc_available() {
        assert!(
            std::env::var("PAGODA_REQUIRE_NVRTC").map_or(true, |v| v != "1"),
            "PAGODA_REQUIRE_NVRTC=1 but libnvrtc could not be loaded (LD_LIBRARY_PATH={:?})",
            std::env::var("LD_LIBRARY_PATH").unwrap_or_default()
        );
        eprintln!("skipped: libnvrtc not found (set LD_LIBRARY_PATH to the folder holding libnvrtc.so.13)");
        return;
    }
    let version = compile::nvrtc_version().expect("nvrtc version");
    eprintln!("NVRTC {}.{}", version.0, version.1);
    for arch in ["sm_80", "sm_90"] {
        for m in MODULES {
            let ptx = compile::compile_ptx(m, arch).unwrap_or_else(|e| panic!("{e}"));
            for f in m.functions {
                assert!(ptx.contains(&format!(".entry {f}(")), "{}.cu for {arch}: PTX has no entry point {f}", m.name);
            }
            eprintln!("{arch} {}.cu: {} kernels, {} bytes of PTX", m.name, m.functions.len(), ptx.len());
        }
    }
}

#[test]
fn cache_round_trip_and_key_changes_with_arch() {
    if !compile::nvrtc_available() {
        eprintln!("skipped: libnvrtc not found");
        return;
    }
    let dir = std::env::temp_dir().join(format!("pagoda-ptx-test-{}", std::process::id()));
    let cache = compile::PtxCache::new(&dir);
    let m = &MODULES[0];
    let (a, s1) = cache.get_or_compile(m, "sm_80").expect("compile");
    let (b, s2) = cache.get_or_compile(m, "sm_80").expect("cached");
    assert_eq!(s1, compile::CacheStatus::Stored);
    assert_eq!(s2, compile::CacheStatus::Hit);
    assert_eq!(a, b);
    let v = compile::nvrtc_version().expect("version");
    assert_ne!(cache.path_for(m, "sm_80", v), cache.path_for(m, "sm_90", v));
    assert_ne!(cache.path_for(m, "sm_80", v), cache.path_for(m, "sm_80", (v.0, v.1 + 1)));
    let _ = std::fs::remove_dir_all(&dir);
}
