//! The body of the cargo-fuzz target `load_gguf` (feature `fuzzing`), shared with the replay of
//! its committed inputs in `tests/gguf.rs`.

use crate::Model;
use std::io::Cursor;
use std::path::Path;

/// Any bytes as a GGUF file: loading is `Ok` or a typed error, never a panic (and, under the
/// fuzzer's memory limit, never an allocation beyond what the bytes pay for). A model that
/// loads tokenizes a text into ids within its vocabulary, decodes them, and prefills a token
/// into one logit per vocabulary entry.
pub fn load_gguf(data: &[u8]) {
    let model = match Model::read(Cursor::new(data), Path::new("fuzz input")) {
        Ok(m) => m,
        Err(e) => {
            // Every error displays.
            let _ = e.to_string();
            return;
        }
    };
    let c = *model.config();
    assert_eq!(c.vocab, model.tokenizer().vocab_size());
    if let Ok(ids) = model.tokenizer().encode("ab 12 <|endoftext|>é") {
        assert!(ids.iter().all(|&i| (i as usize) < c.vocab), "{ids:?}");
        model
            .tokenizer()
            .decode(&ids)
            .expect("ids of an encoding decode");
    }
    let p = model
        .prefill(&[0])
        .expect("a loaded model prefills its token 0");
    assert_eq!(p.logits.len(), c.vocab);
}
