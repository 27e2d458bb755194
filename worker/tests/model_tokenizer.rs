//! Tokenizer and chat template built from the real GGUF, checked against the independent Hugging Face reference
//! in `fixtures/tokenizer_reference.json` (written by `scripts/reference/tokenizer_reference.py`).

use pagoda_worker::model::{ChatMessage, ChatTemplate, Gguf, Tokenizer};
use serde_json::Value;

fn model_path() -> std::path::PathBuf {
    match std::env::var_os("PAGODA_MODEL") {
        Some(p) => p.into(),
        None => std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf"),
    }
}

fn fixture() -> Value {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer_reference.json");
    serde_json::from_str(&std::fs::read_to_string(path).expect("read fixture")).expect("parse fixture")
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().expect("id array").iter().map(|x| x.as_u64().expect("id") as u32).collect()
}

fn load() -> (Gguf, Tokenizer) {
    let g = Gguf::open(model_path()).expect("open model (set PAGODA_MODEL or put it in models/)");
    let t = Tokenizer::from_gguf(&g).expect("tokenizer");
    (g, t)
}

#[test]
fn encode_matches_reference_exactly() {
    let (_g, tok) = load();
    let fx = fixture();
    let mut failures = Vec::new();
    let texts = fx["texts"].as_array().unwrap();
    assert!(texts.len() >= 30);
    for t in texts {
        let text = t["text"].as_str().unwrap();
        let want = ids(&t["ids"]);
        let got = tok.encode(text, false);
        if got != want {
            failures.push(format!("{text:?}\n  want {want:?}\n  got  {got:?}"));
        }
        if let Some(with_special) = t["ids_add_special"].as_array() {
            let want: Vec<u32> = with_special.iter().map(|x| x.as_u64().unwrap() as u32).collect();
            assert_eq!(tok.encode(text, true), want, "add_special for {text:?}");
        }
    }
    assert!(failures.is_empty(), "{} mismatches:\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn decode_matches_reference_and_round_trips() {
    let (_g, tok) = load();
    let fx = fixture();
    for t in fx["texts"].as_array().unwrap() {
        let text = t["text"].as_str().unwrap();
        let want = ids(&t["ids"]);
        assert_eq!(tok.decode(&want, false), t["decoded"].as_str().unwrap(), "decode {text:?}");
        assert_eq!(tok.decode(&want, false), text, "round trip {text:?}");
        assert_eq!(tok.decode(&want, true), t["decoded_skip_special"].as_str().unwrap(), "skip special {text:?}");
        // Per-token bytes concatenate to the text: what incremental detokenisation relies on.
        let bytes: Vec<u8> = want.iter().flat_map(|&id| tok.token_bytes(id).unwrap().to_vec()).collect();
        assert_eq!(bytes, text.as_bytes(), "token bytes {text:?}");
    }
}

#[test]
fn special_ids_and_vocab() {
    let (_g, tok) = load();
    let fx = fixture();
    assert_eq!(tok.vocab_size(), fx["vocab_size"].as_u64().unwrap() as usize);
    assert_eq!(tok.bos_id(), Some(fx["bos_token_id"].as_u64().unwrap() as u32));
    assert_eq!(tok.eos_id(), Some(fx["eos_token_id"].as_u64().unwrap() as u32));
    assert_eq!(tok.pad_id(), Some(fx["pad_token_id"].as_u64().unwrap() as u32));
    let im_end = tok.token_to_id("<|im_end|>").unwrap();
    assert_eq!(im_end, 2);
    assert!(tok.eos_token_ids().contains(&im_end));
    assert!(tok.eos_token_ids().contains(&tok.token_to_id("<|endoftext|>").unwrap()));
    assert!(!tok.eos_token_ids().contains(&tok.token_to_id("<|im_start|>").unwrap()));
    assert!(tok.is_special(1) && tok.is_special(2) && !tok.is_special(3000));
    assert_eq!(tok.token_bytes(49152), None);
    assert_eq!(tok.token_text(1).as_deref(), Some("<|im_start|>"));
    assert_eq!(tok.pre_tokenizer(), "smollm");
    // Out-of-range ids are skipped, never a panic.
    assert_eq!(tok.decode(&[u32::MAX, 19556], false), "Hello");
}

#[test]
fn incremental_detokenisation_by_token_bytes() {
    let (_g, tok) = load();
    let text = "emoji 😀👍🏽 and 你好 done";
    let ids = tok.encode(text, false);
    let mut pending = Vec::new();
    let mut out = String::new();
    for id in ids {
        pending.extend_from_slice(tok.token_bytes(id).unwrap());
        let valid = match std::str::from_utf8(&pending) {
            Ok(s) => s.len(),
            Err(e) => e.valid_up_to(),
        };
        out.push_str(std::str::from_utf8(&pending[..valid]).unwrap());
        pending.drain(..valid);
    }
    assert!(pending.is_empty());
    assert_eq!(out, text);
}

#[test]
fn chat_template_matches_reference() {
    let (g, tok) = load();
    let tmpl = ChatTemplate::from_gguf(&g).expect("chat template");
    let fx = fixture();
    assert_eq!(tmpl.bos_token(), fx["bos_token"].as_str().unwrap());
    assert_eq!(tmpl.eos_token(), fx["eos_token"].as_str().unwrap());
    for chat in fx["chats"].as_array().unwrap() {
        let messages: Vec<ChatMessage> = serde_json::from_value(chat["messages"].clone()).unwrap();
        let add_gen = chat["add_generation_prompt"].as_bool().unwrap();
        let rendered = tmpl.render(&messages, add_gen).expect("render");
        assert_eq!(rendered, chat["rendered"].as_str().unwrap());
        assert_eq!(tok.encode(&rendered, false), ids(&chat["ids"]), "ids of {rendered:?}");
    }
}
