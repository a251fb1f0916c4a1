//! The server under N concurrent fetches (issue 18's "32 concurrent fetches"): one process
//! serves a store and runs N fetch clients at once, then reports the server's counters and
//! throughput and each fetch's time. Client and server share the machine's cores, and every
//! client decodes what it gets, so the figure is the whole system's, not the link's.
//!
//! ```text
//! cargo run --profile bench -p kvc-net --example load -- ROOT CONTEXT [CLIENTS [LEVEL]]
//! ```

use std::time::{Duration, Instant};

use codec_core::adapt::Choice;
use kvc_net::client::{fetch, FetchOptions};
use kvc_net::rate::Limiter;
use kvc_net::server::{Server, ServerConfig, Stats};

#[tokio::main]
async fn main() -> Result<(), String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [root, context, rest @ ..] = args.as_slice() else {
        return Err("usage: load ROOT CONTEXT [CLIENTS [LEVEL]]".into());
    };
    let clients: usize = rest
        .first()
        .map_or(Ok(32), |s| s.parse())
        .map_err(|e| format!("{e}"))?;
    let level: Option<u8> = rest
        .get(1)
        .map(|s| s.parse())
        .transpose()
        .map_err(|e| format!("{e}"))?;
    let server = Server::bind(
        "127.0.0.1:0",
        ServerConfig::new(root.into()),
        Limiter::unlimited(),
    )
    .await
    .map_err(|e| e.to_string())?;
    server.preload(context).await?;
    let addr = server.local_addr().map_err(|e| e.to_string())?.to_string();
    let stats = server.stats();
    tokio::spawn(server.run());
    let start = Instant::now();
    let tasks: Vec<_> = (0..clients)
        .map(|_| {
            let (addr, context) = (addr.clone(), context.clone());
            let mut opts = FetchOptions::new(Duration::from_secs(60));
            opts.force = level.map(Choice::Level);
            opts.io_timeout = Duration::from_secs(60);
            tokio::spawn(async move { fetch(&addr, &context, &opts).await })
        })
        .collect();
    let mut times = Vec::new();
    let mut errors = 0;
    for t in tasks {
        match t.await.map_err(|e| e.to_string())? {
            Ok(f) => times.push(f.total_s),
            Err(e) => {
                eprintln!("fetch failed: {e}");
                errors += 1;
            }
        }
    }
    let wall = start.elapsed().as_secs_f64();
    times.sort_by(f64::total_cmp);
    let sent = Stats::get(&stats.bytes_sent) as f64;
    println!(
        "{clients} concurrent fetches of {context} ({}): {} ok, {errors} failed; \
         server: {} connections, {} done, {} refused, {} busy",
        level.map_or("adaptive".to_string(), |l| format!("level {l}")),
        times.len(),
        Stats::get(&stats.connections),
        Stats::get(&stats.completed),
        Stats::get(&stats.refused),
        Stats::get(&stats.busy),
    );
    if let (Some(first), Some(last)) = (times.first(), times.last()) {
        println!(
            "{:.1} MB sent in {wall:.2} s: {:.1} MB/s; per fetch {first:.2}-{last:.2} s (median {:.2} s)",
            sent / 1e6,
            sent / wall / 1e6,
            times[times.len() / 2],
        );
    }
    Ok(())
}
