//! The CUDA sources (`kernels/cuda/*.cu`, embedded at build time), their NVRTC compilation to PTX for a given
//! architecture, and the on-disk PTX cache keyed by an xxh3 hash of sources + architecture + NVRTC version.
//!
//! NVRTC needs no GPU, so [`compile_all`] also serves the CI compile check on machines without one.

use super::error::CudaError;
use std::path::{Path, PathBuf};

/// Helpers every module is compiled with (prepended to each `.cu`).
pub const COMMON: &str = include_str!("../../cuda/common.cuh");
/// The split-K decode attention template, generic over its K/V row source (attention and encoded attention).
const DECODE_SPLIT: (&str, &str) = ("decode_split.cuh", include_str!("../../cuda/decode_split.cuh"));
/// The read side of the encoded block layout (codecs and encoded attention).
const CODEC_LAYOUT: (&str, &str) = ("codec_layout.cuh", include_str!("../../cuda/codec_layout.cuh"));

/// The names of one KV format's split-K decode kernels, `{prefix}hd{HD}_g{G}` for HD in 64, 128, 256 and G in 1,
/// 2, 4, 8, in that order (see [`decode_kernel`]).
macro_rules! decode_kernel_names {
    ($($prefix:literal),+) => {
        [$(
            concat!($prefix, "hd64_g1"), concat!($prefix, "hd64_g2"), concat!($prefix, "hd64_g4"),
            concat!($prefix, "hd64_g8"), concat!($prefix, "hd128_g1"), concat!($prefix, "hd128_g2"),
            concat!($prefix, "hd128_g4"), concat!($prefix, "hd128_g8"), concat!($prefix, "hd256_g1"),
            concat!($prefix, "hd256_g2"), concat!($prefix, "hd256_g4"), concat!($prefix, "hd256_g8"),
        )+]
    };
}

/// Decode kernels per format: the f16 arenas, and the encoded formats in the order of
/// [`super::codecs::GPU_CODECS`].
const F16_DECODE_KERNELS: [&str; 12] = decode_kernel_names!("paged_decode_");
const ENCODED_DECODE_KERNELS: [&str; 48] = decode_kernel_names!(
    "paged_decode_int8_",
    "paged_decode_fp8_e4m3_",
    "paged_decode_int4_kivi_",
    "paged_decode_int2_kivi_"
);
/// Query heads per CTA the decode kernels are instantiated for, in the order of `decode_kernel_names!`.
const HEADS_PER_CTA: [usize; 4] = [1, 2, 4, 8];

/// The split-K decode kernel for head dim `hd`, `g` query heads per CTA, over f16 arenas (`codec` `None`) or over
/// blocks encoded with `codec`.
pub(crate) fn decode_kernel(
    codec: Option<crate::codec::Codec>,
    hd: usize,
    g: usize,
) -> Result<&'static str, CudaError> {
    let unsupported = || CudaError::Unsupported(format!("decode head_dim {hd} with {g} heads per CTA over {codec:?}"));
    let hd_i = super::attention::HEAD_DIMS.iter().position(|&x| x == hd).ok_or_else(unsupported)?;
    let g_i = HEADS_PER_CTA.iter().position(|&x| x == g).ok_or_else(unsupported)?;
    let i = hd_i * HEADS_PER_CTA.len() + g_i;
    match codec {
        None => Ok(F16_DECODE_KERNELS[i]),
        Some(c) => {
            let f = super::codecs::GPU_CODECS
                .iter()
                .position(|&x| x == c)
                .ok_or_else(|| CudaError::Unsupported(format!("attention over {c} blocks on the GPU")))?;
            Ok(ENCODED_DECODE_KERNELS[f * F16_DECODE_KERNELS.len() + i])
        }
    }
}

/// One `.cu` file: its name, source and the `extern "C"` kernels it defines.
#[derive(Debug, Clone, Copy)]
pub struct KernelSource {
    /// File stem, e.g. `"attention"`.
    pub name: &'static str,
    /// The file's text.
    pub source: &'static str,
    /// Shared headers compiled before it, in order: (file name, text).
    pub headers: &'static [(&'static str, &'static str)],
    /// Compiled and loaded on the first launch of one of its kernels rather than when a context opens: modules
    /// that serving does not use, whose compile and driver JIT would only slow every worker's start.
    pub lazy: bool,
    /// Kernels it exports.
    pub functions: &'static [&'static str],
}

/// Every CUDA module of the backend.
pub const MODULES: &[KernelSource] = &[
    KernelSource {
        name: "elementwise",
        lazy: false,
        source: include_str!("../../cuda/elementwise.cu"),
        headers: &[],
        functions: &[
            "rmsnorm_f32",
            "rmsnorm_f16",
            "rope_f32",
            "rope_split_qkv_f32",
            "silu_mul_f32",
            "silu_mul_stacked_f16",
            "embedding_f16",
            "dequant_q4_1_f16",
            "dequant_q8_0_f16",
            "f32_to_f16",
            "f16_to_f32",
            "argmax_rows",
        ],
    },
    KernelSource {
        name: "kv",
        lazy: false,
        source: include_str!("../../cuda/kv.cu"),
        headers: &[],
        functions: &[
            "kv_write_f16",
            "copy_blocks_f16",
            "gather_blocks_f16",
            "scatter_blocks_f16",
            "slot_norms_f16",
            "anchor_cosine_f16",
            "unit_key_sum_f16",
            "window_scores_f16",
        ],
    },
    KernelSource {
        name: "codecs",
        lazy: false,
        source: include_str!("../../cuda/codecs.cu"),
        headers: &[CODEC_LAYOUT],
        functions: &["encode_blocks_q8", "encode_blocks_kivi", "decode_blocks"],
    },
    KernelSource {
        name: "attention",
        lazy: false,
        source: include_str!("../../cuda/attention.cu"),
        headers: &[DECODE_SPLIT],
        functions: &[
            "paged_decode_hd64_g1",
            "paged_decode_hd64_g2",
            "paged_decode_hd64_g4",
            "paged_decode_hd64_g8",
            "paged_decode_hd128_g1",
            "paged_decode_hd128_g2",
            "paged_decode_hd128_g4",
            "paged_decode_hd128_g8",
            "paged_decode_hd256_g1",
            "paged_decode_hd256_g2",
            "paged_decode_hd256_g4",
            "paged_decode_hd256_g8",
            "paged_decode_reduce",
            "paged_prefill_hd64",
            "paged_prefill_hd128",
            "paged_prefill_hd256",
        ],
    },
    KernelSource {
        name: "encoded_attention",
        lazy: true,
        source: include_str!("../../cuda/encoded_attention.cu"),
        headers: &[DECODE_SPLIT, CODEC_LAYOUT],
        functions: &ENCODED_DECODE_KERNELS,
    },
];

/// Options passed to NVRTC besides the architecture.
const NVRTC_OPTIONS: &[&str] = &["--std=c++17"];

/// True when `libnvrtc` can be loaded (LD_LIBRARY_PATH and the default search path are consulted).
pub fn nvrtc_available() -> bool {
    // SAFETY: only tries to dlopen the library by its usual names.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// NVRTC's (major, minor) version.
pub fn nvrtc_version() -> Result<(i32, i32), CudaError> {
    if !nvrtc_available() {
        return Err(CudaError::NvrtcUnavailable);
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: the library is present (checked above); the call writes two ints.
    let status = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    if status != cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(CudaError::Compile { module: "-", arch: "-".into(), log: format!("nvrtcVersion: {status:?}") });
    }
    Ok((major, minor))
}

/// `sm_XY` for a compute capability.
pub fn arch_for(major: i32, minor: i32) -> String {
    format!("sm_{major}{minor}")
}

/// The full text NVRTC compiles for `m`: [`COMMON`], the module's headers, then the module.
pub fn full_source(m: &KernelSource) -> String {
    let mut text = String::from(COMMON);
    for (name, header) in m.headers {
        text.push_str(&format!("\n#line 1 \"{name}\"\n{header}"));
    }
    text.push_str(&format!("\n#line 1 \"{}.cu\"\n{}", m.name, m.source));
    text
}

/// Compiles one module to PTX for `arch` (`"sm_80"`, `"sm_90"`, ...). Needs libnvrtc, not a GPU.
pub fn compile_ptx(m: &KernelSource, arch: &str) -> Result<String, CudaError> {
    if !nvrtc_available() {
        return Err(CudaError::NvrtcUnavailable);
    }
    let compute = arch
        .strip_prefix("sm_")
        .filter(|d| !d.is_empty() && d.chars().all(|c| c.is_ascii_alphanumeric()))
        .ok_or_else(|| CudaError::invalid("compile_ptx", format!("architecture {arch:?} is not of the form sm_XY")))?;
    let mut options: Vec<String> = NVRTC_OPTIONS.iter().map(|s| s.to_string()).collect();
    options.push(format!("--gpu-architecture=compute_{compute}"));
    let opts = cudarc::nvrtc::CompileOptions { options, name: Some(format!("{}.cu", m.name)), ..Default::default() };
    match cudarc::nvrtc::compile_ptx_with_opts(full_source(m), opts) {
        Ok(ptx) => Ok(ptx.to_src()),
        Err(cudarc::nvrtc::CompileError::CompileError { log, nvrtc, .. }) => Err(CudaError::Compile {
            module: m.name,
            arch: arch.to_string(),
            log: format!("{nvrtc:?}\n{}", log.to_string_lossy()),
        }),
        Err(e) => Err(CudaError::Compile { module: m.name, arch: arch.to_string(), log: format!("{e:?}") }),
    }
}

/// Compiles every module for `arch`; returns (module name, PTX) pairs.
pub fn compile_all(arch: &str) -> Result<Vec<(&'static str, String)>, CudaError> {
    MODULES.iter().map(|m| Ok((m.name, compile_ptx(m, arch)?))).collect()
}

/// Whether a module's PTX came from the cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheStatus {
    /// Read from the cache.
    Hit,
    /// Compiled and stored.
    Stored,
    /// Compiled; storing it failed (the reason), so the next start compiles again.
    NotStored(String),
}

/// Directory of cached PTX files, one per (module, architecture, source hash).
#[derive(Debug, Clone)]
pub struct PtxCache {
    dir: PathBuf,
}

impl PtxCache {
    /// `$PAGODA_CUDA_CACHE`, else `$XDG_CACHE_HOME/pagoda/ptx`, else `$HOME/.cache/pagoda/ptx`, else a folder in the
    /// system temp dir.
    pub fn default_dir() -> PathBuf {
        let env = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
        if let Some(d) = env("PAGODA_CUDA_CACHE") {
            return d;
        }
        if let Some(d) = env("XDG_CACHE_HOME") {
            return d.join("pagoda").join("ptx");
        }
        if let Some(d) = env("HOME") {
            return d.join(".cache").join("pagoda").join("ptx");
        }
        std::env::temp_dir().join("pagoda-ptx")
    }

    /// A cache in `dir` (created on first store).
    pub fn new(dir: impl Into<PathBuf>) -> PtxCache {
        PtxCache { dir: dir.into() }
    }

    /// The cache folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The cache file for `m` on `arch` with NVRTC `version`.
    pub fn path_for(&self, m: &KernelSource, arch: &str, version: (i32, i32)) -> PathBuf {
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        let headers = m.headers.iter().map(|(_, text)| *text);
        let rest = [m.source, arch, &format!("nvrtc {}.{}", version.0, version.1), env!("CARGO_PKG_VERSION")];
        for part in std::iter::once(COMMON).chain(headers).chain(rest) {
            h.update(part.as_bytes());
            h.update(&[0]);
        }
        for o in NVRTC_OPTIONS {
            h.update(o.as_bytes());
            h.update(&[0]);
        }
        self.dir.join(format!("{}-{arch}-{:032x}.ptx", m.name, h.digest128()))
    }

    /// The PTX of `m` for `arch`, from the cache when present, else compiled and stored atomically.
    pub fn get_or_compile(&self, m: &KernelSource, arch: &str) -> Result<(String, CacheStatus), CudaError> {
        let path = self.path_for(m, arch, nvrtc_version()?);
        if let Ok(ptx) = std::fs::read_to_string(&path)
            && ptx.contains(".entry")
        {
            return Ok((ptx, CacheStatus::Hit));
        }
        let ptx = compile_ptx(m, arch)?;
        let status = match self.store(&path, &ptx) {
            Ok(()) => CacheStatus::Stored,
            Err(e) => CacheStatus::NotStored(e.to_string()),
        };
        Ok((ptx, status))
    }

    /// Drops a cached entry (used when the driver rejects cached PTX).
    pub fn evict(&self, m: &KernelSource, arch: &str) -> Result<(), CudaError> {
        let path = self.path_for(m, arch, nvrtc_version()?);
        match std::fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(source) => Err(CudaError::Cache { path: path.display().to_string(), source }),
        }
    }

    fn store(&self, path: &Path, ptx: &str) -> Result<(), CudaError> {
        let err = |source| CudaError::Cache { path: path.display().to_string(), source };
        std::fs::create_dir_all(&self.dir).map_err(err)?;
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        std::fs::write(&tmp, ptx).map_err(err)?;
        std::fs::rename(&tmp, path).map_err(err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_kernel_names_follow_the_shapes_and_codecs() {
        for (hd, g) in [(64, 1), (128, 4), (256, 8)] {
            assert_eq!(decode_kernel(None, hd, g).unwrap(), format!("paged_decode_hd{hd}_g{g}"));
            for codec in super::super::codecs::GPU_CODECS {
                let name = decode_kernel(Some(codec), hd, g).unwrap();
                assert_eq!(name, format!("paged_decode_{}_hd{hd}_g{g}", codec.name()));
            }
        }
        assert!(decode_kernel(None, 96, 1).is_err() && decode_kernel(None, 64, 3).is_err());
        assert!(decode_kernel(Some(crate::codec::Codec::F16), 64, 1).is_err());
    }
}
