//! Any bytes as a GGUF model file through `kvc_llm::Model`'s loader: a typed error or a model
//! that tokenizes and prefills, never a panic. Body: `kvc_llm::fuzzing::load_gguf`.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| kvc_llm::fuzzing::load_gguf(data));
