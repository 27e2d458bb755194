//! GGUF reader on the real SmolLM2-135M-Instruct Q4_1 file.

use pagoda_worker::model::{GgmlType, Gguf, ModelError};

fn model_path() -> std::path::PathBuf {
    match std::env::var_os("PAGODA_MODEL") {
        Some(p) => p.into(),
        None => std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf"),
    }
}

#[test]
fn real_file_header_metadata_and_tensors() {
    let g = Gguf::open(model_path()).expect("open model (set PAGODA_MODEL or put it in models/)");
    assert_eq!(g.version(), 3);
    assert_eq!(g.alignment(), 32);
    assert_eq!(g.get_str("general.architecture").unwrap(), "llama");
    assert_eq!(g.get_u32("llama.block_count").unwrap(), 30);
    assert_eq!(g.get_u32("llama.embedding_length").unwrap(), 576);
    assert_eq!(g.get_u32("llama.attention.head_count").unwrap(), 9);
    assert_eq!(g.get_u32("llama.attention.head_count_kv").unwrap(), 3);
    assert_eq!(g.get_f32("llama.rope.freq_base").unwrap(), 100000.0);
    assert_eq!(g.get_str("tokenizer.ggml.model").unwrap(), "gpt2");
    assert_eq!(g.get_str_array("tokenizer.ggml.tokens").unwrap().len(), 49152);
    assert_eq!(g.get_str_array("tokenizer.ggml.merges").unwrap().len(), 48900);
    assert_eq!(g.get_int_array("tokenizer.ggml.token_type").unwrap().len(), 49152);
    assert!(!g.get_bool("tokenizer.ggml.add_bos_token").unwrap());
    assert!(g.get_str("tokenizer.chat_template").unwrap().contains("<|im_start|>"));
    assert_eq!(g.metadata_keys().len(), 33);

    assert_eq!(g.tensors().len(), 272);
    let emb = g.tensor_info("token_embd.weight").unwrap();
    assert_eq!(emb.dims, vec![576, 49152]);
    assert_eq!(emb.ggml_type, GgmlType::Q8_0);
    assert_eq!(g.tensor_bytes("token_embd.weight").unwrap().len(), 49152 * 576 / 32 * 34);
    let q = g.tensor_info("blk.0.attn_q.weight").unwrap();
    assert_eq!(q.ggml_type, GgmlType::Q4_1);
    assert_eq!(g.tensor_bytes("blk.0.attn_q.weight").unwrap().len(), 576 * 576 / 32 * 20);
    let norm = g.tensor_bytes("blk.0.attn_norm.weight").unwrap();
    assert_eq!(norm.len(), 576 * 4);
    assert!(g.tensor_info("output.weight").is_none());
    for t in g.tensors() {
        assert_eq!(g.info_bytes(t).unwrap().len() as u64, t.n_bytes);
    }
}

#[test]
fn real_file_truncated_is_an_error() {
    let bytes = std::fs::read(model_path()).expect("read model");
    let g = Gguf::open(model_path()).unwrap();
    let cuts = [0, 3, 8, 23, 100, 1000, 100_000, 1_000_000, g.data_offset() as usize - 1, bytes.len() - 1];
    for cut in cuts {
        match Gguf::from_bytes(bytes[..cut].to_vec()) {
            Err(ModelError::Corrupt(_)) => {}
            other => panic!("cut at {cut}: expected Corrupt, got {other:?}"),
        }
    }
}

#[test]
fn real_file_corrupt_lengths_are_errors() {
    let bytes = std::fs::read(model_path()).expect("read model");
    // The first metadata key's length lives at offset 24; make it absurd.
    let mut b = bytes[..2_000_000].to_vec();
    b[24..32].copy_from_slice(&(u64::MAX - 3).to_le_bytes());
    assert!(matches!(Gguf::from_bytes(b), Err(ModelError::Corrupt(_))));
    // Tensor count absurd.
    let mut b = bytes[..2_000_000].to_vec();
    b[8..16].copy_from_slice(&(1u64 << 50).to_le_bytes());
    assert!(matches!(Gguf::from_bytes(b), Err(ModelError::Corrupt(_))));
    // A missing file is an I/O error.
    assert!(matches!(Gguf::open("/nonexistent/x.gguf"), Err(ModelError::Io { .. })));
}
