//! The PQ search kernel (`kernels/pq_search.cu`), compiled for the host: for batches of queries
//! over pq-core's packed codes, the same token indices as `pq_core::search` with the query's
//! (or GQA group's) score table, on proptest codebooks (ties, infinities and NaN scores
//! included) and on the real 512-token fixture's keys and stored queries, codebooks trained as
//! `kvc pq` trains them.

use codec_cuda::pq::{PqBatch, PqStatus, MAX_TABLE_ENTRIES};
use codec_cuda::CudaError;
use pq_core::{
    group_score_table, k_for_fraction, pack, scores, search, select, Codebook, Method, PqParams,
};
use proptest::prelude::*;

/// pq-core's selection for `queries` (`[G, D]`) over the first `tokens` tokens' codes.
fn reference(
    cb: &Codebook,
    codes: &[u16],
    queries: &[f32],
    tokens: usize,
    (k, n_init, n_local): (usize, usize, usize),
) -> Vec<u32> {
    let table = group_score_table(queries, cb).unwrap();
    let codes = &codes[..tokens * cb.m()];
    let got = search(codes, &table, k, n_init, n_local).unwrap();
    // `search` is `select` over the scores (pq-core's own promise, checked here once more).
    let by_scores = select(&scores(codes, &table).unwrap(), k, n_init, n_local).unwrap();
    assert_eq!(got, by_scores);
    got
}

/// Values for codewords and queries: small integers (many exact ties), ordinary reals, or huge
/// magnitudes whose products and sums overflow to infinities and NaN.
fn value(kind: u8) -> BoxedStrategy<f32> {
    match kind {
        0 => (-2i32..=2).prop_map(|x| x as f32).boxed(),
        1 => (-1.0f32..1.0).boxed(),
        _ => prop_oneof![
            (-2i32..=2).prop_map(|x| x as f32 * 1.5e38),
            (-1.0f32..1.0),
            Just(0.0f32),
            Just(-0.0f32),
        ]
        .boxed(),
    }
}

/// A codebook shape: method, dim, m, bits.
fn shape() -> impl Strategy<Value = (Method, usize, usize, u8)> {
    prop_oneof![
        (1usize..=3, 1u8..=7, 1usize..=6).prop_map(|(m, b, d)| (Method::Residual, d, m, b)),
        (1usize..=3, 1u8..=7, 1usize..=3).prop_map(|(m, b, per)| (Method::Product, m * per, m, b)),
        Just((Method::Residual, 4, 1, 12)),
    ]
}

/// One proptest case: a codebook, codes, and queries with their parameters.
#[derive(Debug, Clone)]
struct Case {
    cb: Codebook,
    codes: Vec<u16>,
    tokens: usize,
    /// (queries [G, D], tokens seen, k, n_init, n_local).
    queries: Vec<(Vec<f32>, usize, usize, usize, usize)>,
}

fn case() -> impl Strategy<Value = Case> {
    (shape(), 0u8..3, 0usize..400).prop_flat_map(|((method, d, m, b), kind, tokens)| {
        let n_cw = m
            * (1usize << b)
            * match method {
                Method::Product => d / m,
                Method::Residual => d,
            };
        let query = (1usize..=3, 0..=tokens, 0usize..300, 0usize..8, 0usize..80)
            .prop_flat_map(move |(g, seen, k, n_init, n_local)| {
                (
                    proptest::collection::vec(value(kind), g * d),
                    Just((seen, k, n_init, n_local)),
                )
            })
            .prop_map(|(q, (seen, k, n_init, n_local))| (q, seen, k, n_init, n_local));
        (
            proptest::collection::vec(value(kind), n_cw),
            proptest::collection::vec(0u16..(1u16 << b).max(1), tokens * m),
            proptest::collection::vec(query, 1..5),
        )
            .prop_map(move |(cw, codes, queries)| Case {
                cb: Codebook::from_parts(method, d, m, b, 1, cw).unwrap(),
                codes,
                tokens,
                queries,
            })
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(160))]

    /// Every query of a batch selects exactly pq-core's tokens, with its ranking keys in
    /// shared memory, in the scratch buffer, or either by its length.
    #[test]
    fn kernel_selects_what_pq_core_selects(c in case(), keep in 0u32..400) {
        let packed = pack(&c.codes, c.cb.bits()).unwrap();
        let mut batch = PqBatch::new(&c.cb).unwrap();
        let head = batch.add_head(&c.cb, &packed, c.tokens).unwrap();
        for (q, seen, k, n_init, n_local) in &c.queries {
            batch.add_query(head, q, *seen, *k, *n_init, *n_local).unwrap();
        }
        for shared_keys in [u32::MAX, 0, keep] {
            let got = batch.search_host_keeping(shared_keys).unwrap();
            for (i, (q, seen, k, n_init, n_local)) in c.queries.iter().enumerate() {
                prop_assert_eq!(got.status(i), Some(PqStatus::Ok));
                let want = reference(&c.cb, &c.codes, q, *seen, (*k, *n_init, *n_local));
                prop_assert_eq!(got.tokens(i), &want[..], "query {} keeping {}", i, shared_keys);
            }
        }
    }

    /// Any query header: a defined status and no out-of-bounds access; the other query of the
    /// batch is unaffected.
    #[test]
    fn arbitrary_query_headers_never_crash(
        fields in any::<(u64, u64, u64, u64, u64, u32, u32, u32, u32, u32)>(),
        which in 0u8..10,
    ) {
        let cb = Codebook::from_parts(Method::Residual, 4, 2, 3, 1, vec![0.25; 2 * 8 * 4]).unwrap();
        let codes: Vec<u16> = (0..2 * 50).map(|i| (i * 7 % 8) as u16).collect();
        let packed = pack(&codes, 3).unwrap();
        let mut batch = PqBatch::new(&cb).unwrap();
        let head = batch.add_head(&cb, &packed, 50).unwrap();
        let q = [1.0, -0.5, 0.25, 2.0];
        batch.add_query(head, &q, 50, 10, 2, 5).unwrap();
        batch.add_query(head, &q, 40, 10, 2, 5).unwrap();
        let item = &mut batch.queries_mut()[0];
        match which {
            0 => item.query_start = fields.0,
            1 => item.codebook_start = fields.1,
            2 => item.codes_start = fields.2,
            3 => item.keys_start = fields.3,
            4 => item.out_start = fields.4,
            5 => item.tokens = fields.5,
            6 => item.group_heads = fields.6,
            7 => item.k = fields.7,
            8 => item.n_init = fields.8,
            _ => item.n_local = fields.9,
        }
        let got = batch.search_host().unwrap();
        prop_assert!(matches!(got.status(0), Some(PqStatus::Ok | PqStatus::BadRange)));
        prop_assert_eq!(got.status(1), Some(PqStatus::Ok));
        let want = reference(&cb, &codes, &q, 40, (10, 2, 5));
        prop_assert_eq!(got.tokens(1), &want[..]);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    /// Tokens appended to a head added with room (`append_tokens`, a decode step's new keys),
    /// a few at a time: after each append, every query selects pq-core's tokens over what it
    /// sees: the queries that saw all of the head's tokens see the new ones too (their k and
    /// windows clamped anew), a query over a prefix keeps its prefix. Any bits per code (codes
    /// straddling bytes), room left over or filled; and a second head after the first keeps
    /// its own selection.
    #[test]
    fn appended_tokens_select_what_pq_core_selects(
        c in case(),
        steps in proptest::collection::vec(0usize..30, 1..5),
        spare in 0usize..3,
    ) {
        let m = c.cb.m();
        let bits = c.cb.bits();
        let added: usize = steps.iter().sum();
        let all_tokens = c.tokens + added;
        let mut rng = (c.tokens as u64) << 20 | added as u64;
        let mut next = move || {
            rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (rng >> 33) as u16
        };
        let mut codes = c.codes.clone();
        codes.extend((0..added * m).map(|_| next() & ((1u32 << bits) - 1) as u16));
        let mut batch = PqBatch::new(&c.cb).unwrap();
        let first = &codes[..c.tokens * m];
        let room = added + spare;
        let head = batch.add_head_with_room(&c.cb, &pack(first, bits).unwrap(), c.tokens, room).unwrap();
        // A second head (the same codes reversed, no room) after the first's room.
        let other_codes: Vec<u16> = codes.iter().rev().copied().collect();
        let other = batch.add_head(&c.cb, &pack(&other_codes, bits).unwrap(), all_tokens).unwrap();
        // Each case query over all the tokens (it follows) or over a shorter prefix (it
        // stays).
        let mut queries = Vec::new();
        for (q, seen, k, n_init, n_local) in &c.queries {
            let follows = seen % 2 == 0 || *seen == c.tokens;
            let seen = if follows { c.tokens } else { *seen };
            batch.add_query(head, q, seen, *k, *n_init, *n_local).unwrap();
            queries.push((q.clone(), seen, follows, (*k, *n_init, *n_local)));
        }
        let (q0, _, _, windows) = &queries[0];
        let other_query = batch.add_query(other, q0, all_tokens, windows.0, windows.1, windows.2).unwrap();
        let other_want = reference(&c.cb, &other_codes, q0, all_tokens, *windows);
        let mut tokens = c.tokens;
        for step in steps {
            batch.append_tokens(head, &codes[tokens * m..(tokens + step) * m]).unwrap();
            tokens += step;
            for shared_keys in [u32::MAX, 0] {
                let got = batch.search_host_keeping(shared_keys).unwrap();
                for (i, (q, seen, follows, windows)) in queries.iter().enumerate() {
                    let seen = if *follows { tokens } else { *seen };
                    prop_assert_eq!(got.status(i), Some(PqStatus::Ok));
                    let want = reference(&c.cb, &codes, q, seen, *windows);
                    prop_assert_eq!(got.tokens(i), &want[..], "query {} at {} tokens", i, tokens);
                }
                prop_assert_eq!(got.tokens(other_query), &other_want[..]);
            }
        }
        // Past the room: refused, nothing changed.
        let over = vec![0u16; (spare + 1) * m];
        prop_assert!(batch.append_tokens(head, &over).is_err());
        prop_assert!(batch.append_tokens(other, &over[..m]).is_err());
        let got = batch.search_host().unwrap();
        let (q, _, _, windows) = &queries[0];
        let seen = if queries[0].2 { tokens } else { queries[0].1 };
        prop_assert_eq!(got.tokens(0), &reference(&c.cb, &codes, q, seen, *windows)[..]);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(12))]

    /// Long contexts, which launch 512 and 1024 threads per block: codes drawn from a few
    /// values (many exact ties) or from all, queries seeing a prefix or all of the tokens, k from
    /// one token to all of the rest; keys in shared memory or in the scratch buffer.
    #[test]
    fn long_contexts_select_what_pq_core_selects(
        tokens in 4000usize..24_000,
        few_codes in any::<bool>(),
        seed in any::<u64>(),
        queries in proptest::collection::vec((0.5f64..=1.0, 0.0f64..=1.0, 0usize..8, 0usize..200), 1..4),
    ) {
        let mut rng = seed;
        let mut next = move || {
            rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (rng >> 33) as u32
        };
        let (m, bits, d) = (2usize, 6u8, 8usize);
        let cw: Vec<f32> = (0..m * 64 * (d / m)).map(|_| next() as f32 / 2e9 - 1.0).collect();
        let cb = Codebook::from_parts(Method::Product, d, m, bits, 1, cw).unwrap();
        let span = if few_codes { 3 } else { 64 };
        let codes: Vec<u16> = (0..tokens * m).map(|_| (next() % span) as u16).collect();
        let mut batch = PqBatch::new(&cb).unwrap();
        let head = batch.add_head(&cb, &pack(&codes, bits).unwrap(), tokens).unwrap();
        let mut want = Vec::new();
        for (seen_share, k_share, n_init, n_local) in &queries {
            let seen = (tokens as f64 * seen_share) as usize;
            let k = (seen as f64 * k_share) as usize;
            let q: Vec<f32> = (0..d).map(|_| next() as f32 / 2e9 - 1.0).collect();
            batch.add_query(head, &q, seen, k, *n_init, *n_local).unwrap();
            want.push(reference(&cb, &codes, &q, seen, (k, *n_init, *n_local)));
        }
        for shared_keys in [u32::MAX, 0] {
            let got = batch.search_host_keeping(shared_keys).unwrap();
            for (i, w) in want.iter().enumerate() {
                prop_assert_eq!(got.status(i), Some(PqStatus::Ok));
                prop_assert_eq!(got.tokens(i), &w[..], "query {} keeping {}", i, shared_keys);
            }
        }
    }
}

/// The real fixture: per (layer, KV head) a codebook trained as `kvc pq` trains it (kvc's
/// default residual codes, and the paper's product codes on layer 0), then every stored query
/// head alone and every GQA group, each over the tokens up to its position (causal), with
/// k = T/5 and windows 4 + 64: one launch per layer and method.
#[test]
fn real_fixture_selections_are_pq_cores() {
    let d = kvc_io::load_dump(&kvc_io::fixtures::sample()).expect("fixture present");
    let s = d.kv.shape;
    let (kv_heads, dim, t) = (s.kv_heads as usize, s.head_dim as usize, s.tokens as usize);
    let q_all = d.q.as_ref().expect("the fixture has queries");
    let (q_heads, n_q, q_start) = (d.q_heads, d.n_q(), d.q_start as usize);
    let group = q_heads / kv_heads;
    let mut checked = 0;
    let runs = [
        (0usize, Method::Residual),
        (1, Method::Residual),
        (0, Method::Product),
    ];
    for (layer, method) in runs {
        let keys = d.kv.k[layer].to_f32_vec();
        let queries = &q_all[layer];
        let base = PqParams {
            method,
            ..PqParams::default()
        };
        let mut heads = Vec::new();
        for h in 0..kv_heads {
            let head_keys: Vec<f32> = (0..t)
                .flat_map(|tok| {
                    let at = (tok * kv_heads + h) * dim;
                    keys[at..at + dim].iter().copied()
                })
                .collect();
            let params = PqParams {
                seed: base.seed ^ ((layer * kv_heads + h) as u64),
                ..base
            };
            let cb = Codebook::train(&head_keys, dim, &params).unwrap();
            let codes = cb.encode(&head_keys).unwrap();
            heads.push((cb, codes));
        }
        let mut batch = PqBatch::new(&heads[0].0).unwrap();
        let ids: Vec<_> = heads
            .iter()
            .map(|(cb, codes)| {
                batch
                    .add_head(cb, &pack(codes, cb.bits()).unwrap(), t)
                    .unwrap()
            })
            .collect();
        let mut want = Vec::new();
        for i in 0..n_q {
            let seen = (q_start + i + 1).min(t);
            let k = k_for_fraction(seen, 1, 5).unwrap();
            let row = |qh: usize| &queries[(i * q_heads + qh) * dim..(i * q_heads + qh + 1) * dim];
            for qh in 0..q_heads {
                let h = qh / group;
                batch.add_query(ids[h], row(qh), seen, k, 4, 64).unwrap();
                want.push(reference(
                    &heads[h].0,
                    &heads[h].1,
                    row(qh),
                    seen,
                    (k, 4, 64),
                ));
            }
            for h in 0..kv_heads {
                let g: Vec<f32> = (h * group..(h + 1) * group)
                    .flat_map(row)
                    .copied()
                    .collect();
                batch.add_query(ids[h], &g, seen, k, 4, 64).unwrap();
                want.push(reference(&heads[h].0, &heads[h].1, &g, seen, (k, 4, 64)));
            }
        }
        let got = batch.search_host().unwrap();
        for (i, w) in want.iter().enumerate() {
            assert_eq!(got.status(i), Some(PqStatus::Ok));
            assert_eq!(got.tokens(i), &w[..], "layer {layer} {method:?} query {i}");
        }
        checked += want.len();
    }
    println!("{checked} selections compared");
    assert!(checked > 0);
}

/// A batch whose query values are replaced (`PqBatch::set_query_values`, a server's next
/// decode step over the same heads) selects what a batch built with those values selects;
/// values of another length or not finite are refused and change nothing.
#[test]
fn replaced_query_values_select_as_a_batch_built_with_them() {
    let (mut batch, _) = support_batch(&[0.25, -0.5]);
    let (fresh, values) = support_batch(&[-0.75, 1.5]);
    assert!(batch.search_host().unwrap().tokens(0) != fresh.search_host().unwrap().tokens(0));
    let before = batch.search_host().unwrap();
    let refused = |r: Result<(), CudaError>| matches!(r, Err(CudaError::Input { .. }));
    assert!(refused(batch.set_query_values(&values[1..])));
    let mut nan = values.clone();
    nan[3] = f32::NAN;
    assert!(refused(batch.set_query_values(&nan)));
    let still = batch.search_host().unwrap();
    assert!((0..batch.len()).all(|i| still.tokens(i) == before.tokens(i)));
    batch.set_query_values(&values).unwrap();
    let (got, want) = (batch.search_host().unwrap(), fresh.search_host().unwrap());
    assert_eq!(got.len(), want.len());
    for i in 0..want.len() {
        assert_eq!(got.status(i), Some(PqStatus::Ok));
        assert_eq!(got.tokens(i), want.tokens(i), "query {i}");
    }
}

/// A batch of one head (48 tokens of codes, 8 dims, 2 books of 4 bits) and three queries
/// (one of a GQA group of two), each query's values the ones `seed` scales; and all of its
/// query values.
fn support_batch(seed: &[f32; 2]) -> (PqBatch, Vec<f32>) {
    let cw: Vec<f32> = (0..2 * 16 * 8)
        .map(|i| ((i * 37 % 29) as f32 - 14.0) / 7.0)
        .collect();
    let cb = Codebook::from_parts(Method::Residual, 8, 2, 4, 1, cw).unwrap();
    let codes: Vec<u16> = (0..2 * 48).map(|i| (i * 11 % 16) as u16).collect();
    let mut batch = PqBatch::new(&cb).unwrap();
    let head = batch.add_head(&cb, &pack(&codes, 4).unwrap(), 48).unwrap();
    let row = |k: usize| -> Vec<f32> {
        (0..8)
            .map(|j| seed[k % 2] * (((j * 5 + k * 3) % 7) as f32 - 3.0))
            .collect()
    };
    let mut values = Vec::new();
    for (q, tokens, group) in [(0, 48, 1), (1, 30, 2), (3, 17, 1)] {
        let v: Vec<f32> = (q..q + group).flat_map(row).collect();
        batch.add_query(head, &v, tokens, 6, 2, 4).unwrap();
        values.extend(v);
    }
    (batch, values)
}

#[test]
fn batch_inputs_are_checked() {
    let cb = Codebook::from_parts(Method::Residual, 4, 2, 3, 1, vec![0.5; 2 * 8 * 4]).unwrap();
    let codes: Vec<u16> = vec![5; 2 * 3];
    let packed = pack(&codes, 3).unwrap();
    let mut batch = PqBatch::new(&cb).unwrap();
    fn input<T>(r: Result<T, CudaError>) -> bool {
        matches!(r, Err(CudaError::Input { .. }))
    }
    // Wrong length, non-zero padding (18 bits used of 24), another shape.
    assert!(input(batch.add_head(&cb, &packed[..2], 3)));
    let mut padded = packed.clone();
    padded[2] |= 0x80;
    assert!(input(batch.add_head(&cb, &padded, 3)));
    let other = Codebook::from_parts(Method::Product, 4, 2, 3, 1, vec![0.5; 2 * 8 * 2]).unwrap();
    assert!(input(batch.add_head(&other, &pack(&codes, 3).unwrap(), 3)));
    let head = batch.add_head(&cb, &packed, 3).unwrap();
    // Not whole rows, non-finite, more tokens than the head, an empty group.
    assert!(input(batch.add_query(head, &[1.0; 5], 3, 1, 0, 0)));
    assert!(input(batch.add_query(
        head,
        &[1.0, f32::NAN, 0.0, 0.0],
        3,
        1,
        0,
        0
    )));
    assert!(input(batch.add_query(head, &[1.0; 4], 4, 1, 0, 0)));
    assert!(input(batch.add_query(head, &[], 3, 1, 0, 0)));
    // Room past 2^32 tokens; appends of part of a token, of a code of more than 3 bits, to a
    // head of another batch, past the room: refused, the selection unchanged.
    assert!(input(batch.add_head_with_room(
        &cb,
        &packed,
        3,
        u32::MAX as usize
    )));
    let roomy = batch.add_head_with_room(&cb, &packed, 3, 2).unwrap();
    batch
        .add_query(roomy, &[1.0, -1.0, 0.5, 0.0], 3, 1, 0, 1)
        .unwrap();
    let before = batch.search_host().unwrap().tokens(0).to_vec();
    assert!(input(batch.append_tokens(roomy, &[1, 2, 3])));
    assert!(input(batch.append_tokens(roomy, &[1, 8])));
    let mut three = PqBatch::new(&cb).unwrap();
    for _ in 0..3 {
        three.add_head(&cb, &packed, 3).unwrap();
    }
    let foreign = three.add_head_with_room(&cb, &packed, 3, 1).unwrap();
    assert!(input(batch.append_tokens(foreign, &[1, 2])));
    assert!(input(batch.append_tokens(roomy, &[1, 2, 3, 4, 5, 6])));
    assert_eq!(batch.search_host().unwrap().tokens(0), &before[..]);
    batch.append_tokens(roomy, &[7, 7, 7, 7]).unwrap();
    assert!(input(batch.append_tokens(roomy, &[7, 7])));
    // The local window moved onto the appended tokens.
    assert_eq!(before.last(), Some(&2));
    assert_eq!(batch.search_host().unwrap().tokens(0).last(), Some(&4));
    // A table larger than the kernel's shared memory.
    let big = Codebook::from_parts(Method::Residual, 1, 3, 12, 1, vec![0.0; 3 << 12]).unwrap();
    const { assert!(3 << 12 > MAX_TABLE_ENTRIES) };
    assert!(input(PqBatch::new(&big)));
    // An empty batch runs.
    assert!(PqBatch::new(&cb).unwrap().search_host().unwrap().is_empty());
}
