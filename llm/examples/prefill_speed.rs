//! Prefill throughput of the reference model at several lengths, on a licence text repeated as
//! needed: `cargo run --profile bench -p kvc-llm --example prefill_speed [GGUF] [N...]`
//! (defaults: the path `tools/fetch-model` prints, 512 2048 4096). Best of 3 runs per length.

use std::path::PathBuf;
use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1).peekable();
    let path = match args.peek() {
        Some(a) if a.parse::<usize>().is_err() => PathBuf::from(args.next().unwrap_or_default()),
        _ => PathBuf::from("models/SmolLM2-135M-Instruct.Q4_1.gguf"),
    };
    let lengths: Vec<usize> = match args.map(|a| a.parse()).collect::<Result<Vec<_>, _>>()? {
        l if l.is_empty() => vec![512, 2048, 4096],
        l => l,
    };
    let model = kvc_llm::Model::load(&path)?;
    let text = include_str!("../../testdata/texts/GPL-3");
    let once = model.tokenizer().encode(text)?;
    let longest = lengths.iter().copied().max().unwrap_or(0);
    let tokens: Vec<u32> = once.iter().copied().cycle().take(longest).collect();
    for n in lengths {
        let best = (0..3)
            .map(|_| {
                let t0 = Instant::now();
                model
                    .prefill(&tokens[..n])
                    .map(|_| t0.elapsed().as_secs_f64())
            })
            .collect::<Result<Vec<_>, _>>()?
            .into_iter()
            .fold(f64::INFINITY, f64::min);
        println!(
            "prefill {n:>5} tokens: {best:>6.2} s, {:>6.0} tokens/s",
            n as f64 / best
        );
    }
    Ok(())
}
