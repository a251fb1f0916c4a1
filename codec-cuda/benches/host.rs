//! Criterion benches of the host side of a GPU decode, which runs on every call and needs no
//! device (`cargo bench -p kvc-codec-cuda --bench host`): building a [`DecodePlan`] of the real
//! fixture decoded 8 times over (every chunk's CRC checked and its blocks read, their lane
//! words borrowed from the stream; `DecodePlan::add_streams` on 1 and 2 threads; on 1 with
//! the CRCs left to the decode, `DecodePlan::set_crc_at_decode`), and building
//! its chain of launches (`DecodePlan::time_chain`, what every upload does first; the tables,
//! table maps and channel constants of the stream's (profile, level) built in each, as in a
//! `Gpu`'s first call, or kept, as in every later one, or kept with the maps and constants
//! resident on the device, as `Gpu` decodes now keep them), in bytes of compressed input, at
//! levels 0, 6 and 11 (and, resident, with a profile learned with the fixture's queries, whose
//! blocks have exponent tables); and the encode's chunks copied into vectors on 1, 2 and 4 threads
//! (`encode_plan::copy_chunks`, what `Gpu::encode_uploaded_with` spares); and, for a decode
//! from page-locked memory, where the 8 copies' words and chunks lie in the bytes they lie in
//! back to back (`DecodePlan::time_gather_parts`).

#[path = "support/mod.rs"]
mod support;

use std::time::Duration;

use codec_cuda::encode_plan::{copy_chunks, Source};
use codec_cuda::CudaError;
use criterion::measurement::WallTime;
use criterion::{BenchmarkGroup, Criterion, Throughput};

fn main() {
    let mut c = Criterion::default()
        .sample_size(20)
        .measurement_time(Duration::from_secs(3))
        .configure_from_args();
    let (d, profile) = support::fixture();
    let copies = 8;
    let mut g = c.benchmark_group("decode plan, 8 copies of the fixture");
    for level in [0, 6, 11] {
        let bytes = support::stream_bytes(&d.kv, &profile, level);
        let stream = support::open(&bytes);
        let streams = vec![&stream; copies];
        g.throughput(Throughput::Bytes((copies * bytes.len()) as u64));
        for (threads, crc_at_decode) in [(1, false), (2, false), (1, true)] {
            let crc = if crc_at_decode {
                ", CRCs at decode"
            } else {
                ""
            };
            g.bench_function(format!("level {level}, {threads} threads{crc}"), |b| {
                b.iter(|| support::decode_plan_with(&streams, threads, crc_at_decode))
            });
        }
    }
    g.finish();
    let mut g = c.benchmark_group("decode chain built on the host, 8 copies of the fixture");
    for level in [0, 6, 11] {
        let bytes = support::stream_bytes(&d.kv, &profile, level);
        let stream = support::open(&bytes);
        let plan = support::decode_plan(&stream, copies);
        g.throughput(Throughput::Bytes((copies * bytes.len()) as u64));
        bench_builds(&mut g, level, |reps, constants| match constants {
            Constants::Resident => plan.time_chain_resident(reps),
            c => plan.time_chain(reps, c == Constants::Kept),
        });
    }
    g.finish();
    // The same with a profile learned with the fixture's queries (step exponents on, as `kvc
    // profile` learns them): each coded block then has an exponent table of its own.
    let with_q = support::profile_with_queries(&d);
    let name = "decode chain built on the host, 8 copies of the fixture, step exponents on";
    let mut g = c.benchmark_group(name);
    for level in [0, 6, 11] {
        let bytes = support::stream_bytes(&d.kv, &with_q, level);
        let stream = support::open(&bytes);
        let plan = support::decode_plan(&stream, copies);
        g.throughput(Throughput::Bytes((copies * bytes.len()) as u64));
        g.bench_function(format!("level {level}, constants resident"), |b| {
            b.iter_custom(|n| {
                Duration::from_secs_f64(plan.time_chain_resident(n as usize).unwrap())
            })
        });
    }
    g.finish();
    // What a decode from page-locked memory adds on the host: where each block's words and
    // each chunk lie in the buffer the copies lie in, back to back, and the ranges to copy.
    let mut g = c.benchmark_group("decode words found in host bytes, 8 copies of the fixture");
    for level in [0, 6, 11] {
        let bytes = support::stream_bytes(&d.kv, &profile, level);
        let buf = bytes.repeat(copies);
        let streams: Vec<_> = buf.chunks(bytes.len()).map(support::open).collect();
        g.throughput(Throughput::Bytes(buf.len() as u64));
        // With the CRCs checked the chunks make the runs; without, every block's words do.
        for (crc, name) in [(true, "CRCs at decode"), (false, "CRCs not checked")] {
            let plan = support::decode_plan_with(&streams.iter().collect::<Vec<_>>(), 1, crc);
            g.bench_function(format!("level {level}, {name}"), |b| {
                b.iter_custom(|n| {
                    Duration::from_secs_f64(plan.time_gather_parts(&buf, n as usize).unwrap())
                })
            });
        }
    }
    g.finish();
    let mut g = c.benchmark_group("encode chain built on the host, 8 copies of the fixture");
    let profile = with_q;
    let ctx = support::encode_context(&d, &profile);
    let (src, source) = Source::of_view(&d.kv.view());
    g.throughput(Throughput::Bytes((copies * src.len()) as u64));
    for level in [0, 6, 11] {
        let (plan, _) = support::encode_plan(&ctx, source, level, copies);
        bench_builds(&mut g, level, |reps, constants| match constants {
            Constants::Resident => plan.time_chain_resident(reps),
            c => plan.time_chain(reps, c == Constants::Kept),
        });
    }
    g.finish();
    // The last step of `Gpu::encode_uploaded` on the host, which `encode_uploaded_with`
    // spares: the sealed chunks (level 6, as the device bench encodes them) copied out of the
    // readback buffer into a vector each, on its upload threads.
    let mut g = c.benchmark_group("encode chunks copied into vectors, 8 copies of the fixture");
    let (one, _) = support::encode_plan(&ctx, source, 6, 1);
    let chunks = one.encode_host(&src).expect("host-run encode");
    let sealed: Vec<u8> = (0..copies).flat_map(|_| chunks.concat()).collect();
    let places: Vec<_> = (chunks.iter().cycle().take(copies * chunks.len()))
        .scan(0, |at, c| {
            *at += c.len();
            Some(*at - c.len()..*at)
        })
        .collect();
    let read: Vec<&[u8]> = places.iter().map(|p| &sealed[p.clone()]).collect();
    g.throughput(Throughput::Bytes(sealed.len() as u64));
    for threads in [1, 2, 4] {
        g.bench_function(format!("level 6, {threads} threads"), |b| {
            b.iter(|| copy_chunks(&read, threads))
        });
    }
    g.finish();
    c.final_summary();
}

/// How a bench's chains get their level constants.
#[derive(Clone, Copy, PartialEq)]
enum Constants {
    /// Built in every build, as in a `Gpu`'s first call.
    Built,
    /// Built before the first and kept, as a `Gpu` keeps them.
    Kept,
    /// Kept, and their maps and constants resident on the device, as `Gpu` calls keep them
    /// now.
    Resident,
}

/// A bench of `g` at `level` for each way of getting the level constants, `time(reps, how)`
/// giving the seconds `reps` chain builds take.
fn bench_builds(
    g: &mut BenchmarkGroup<'_, WallTime>,
    level: u8,
    time: impl Fn(usize, Constants) -> Result<f64, CudaError>,
) {
    for (how, name) in [
        (Constants::Built, "level constants built"),
        (Constants::Kept, "level constants kept"),
        (Constants::Resident, "constants resident"),
    ] {
        g.bench_function(format!("level {level}, {name}"), |b| {
            b.iter_custom(|n| Duration::from_secs_f64(time(n as usize, how).unwrap()))
        });
    }
}
