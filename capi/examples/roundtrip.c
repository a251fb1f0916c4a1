/*
 * kvc C ABI example: learn a profile from a cache, encode it in chunks, inspect the stream,
 * decode it whole and one chunk at a time into our own buffers, and show how each kind of bad
 * input is reported. Exits 0 when every step behaves as documented.
 *
 *   cargo build --release -p kvc-capi
 *   cc -O2 -Icapi/include capi/examples/roundtrip.c target/release/libkvc_capi.a \
 *      -lpthread -ldl -lm -o roundtrip && ./roundtrip
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvc.h"

#define LAYERS 2
#define HEADS 2
#define DIM 16
#define TOKENS 100
#define CHANNELS (HEADS * DIM)
#define ELEMS (TOKENS * CHANNELS)

static int failures = 0;

/* Checks a call's status against the expected one and prints the library's message. */
static void expect(const char *what, int32_t got, int32_t want) {
    if (got != want) {
        fprintf(stderr, "FAIL %s: status %d (%s), expected %d (%s): %s\n", what, got,
                kvc_status_name(got), want, kvc_status_name(want), kvc_last_error_message());
        failures++;
    } else if (got != KVC_OK) {
        printf("ok   %-34s -> %s [%s] %s\n", what, kvc_status_name(got), kvc_last_error_check(),
               kvc_last_error_message());
    } else {
        printf("ok   %s\n", what);
    }
}

int main(void) {
    /* A smooth synthetic cache: per layer K and V [TOKENS, HEADS, DIM] f32. */
    float *k[LAYERS], *v[LAYERS];
    for (int l = 0; l < LAYERS; l++) {
        k[l] = malloc(sizeof(float) * ELEMS);
        v[l] = malloc(sizeof(float) * ELEMS);
        for (int i = 0; i < ELEMS; i++) {
            int t = i / CHANNELS, c = i % CHANNELS;
            k[l][i] = sinf(0.05f * t + 0.3f * c + l) + 0.1f * (float)(c % 5);
            v[l][i] = cosf(0.07f * t - 0.2f * c) * 0.5f;
        }
    }
    kvc_cache cache = {KVC_DTYPE_F32, LAYERS, TOKENS, HEADS, DIM,
                       (const void *const *)k, (const void *const *)v};

    /* A profile learned from the cache (a server learns one per model, once). */
    kvc_profile *profile = NULL;
    expect("learn a profile", kvc_profile_learn(&cache, NULL, 1, NULL, &profile), KVC_OK);

    kvc_encode_params params;
    kvc_encode_params_default(&params);
    params.level = 5;
    params.chunk_tokens = 32; /* 4 chunks: 32, 32, 32, 4 tokens */
    params.model_id = "example";
    kvc_bytes stream = {NULL, 0};
    expect("encode (profile referenced)", kvc_encode(&cache, NULL, profile, &params, &stream), KVC_OK);
    printf("     %zu bytes for %d elements (%.2f bits each)\n", stream.len, 2 * LAYERS * ELEMS,
           8.0 * stream.len / (2.0 * LAYERS * ELEMS));

    kvc_stream *s = NULL;
    expect("open", kvc_stream_open(stream.data, stream.len, profile, &s), KVC_OK);
    kvc_stream_info info;
    expect("info", kvc_stream_inspect(s, &info), KVC_OK);
    printf("     %u layers x %u heads x %u dims, %u tokens, dtype %u, %u chunks, %u levels\n",
           info.layers, info.kv_heads, info.head_dim, info.tokens, info.dtype, info.chunks,
           info.levels);
    if (info.tokens != TOKENS || info.chunks != 4 || info.profile_embedded) failures++;

    /* Decode everything into our buffers, as f32. */
    float *dk[LAYERS], *dv[LAYERS];
    for (int l = 0; l < LAYERS; l++) {
        dk[l] = malloc(sizeof(float) * ELEMS);
        dv[l] = malloc(sizeof(float) * ELEMS);
    }
    size_t cap = sizeof(float) * ELEMS;
    expect("decode all", kvc_stream_decode(s, 0, TOKENS, KVC_DTYPE_F32, (void *const *)dk,
                                           (void *const *)dv, cap), KVC_OK);
    double err = 0, norm = 0;
    for (int l = 0; l < LAYERS; l++)
        for (int i = 0; i < ELEMS; i++) {
            err += (dk[l][i] - k[l][i]) * (dk[l][i] - k[l][i]);
            norm += k[l][i] * k[l][i];
        }
    printf("     K relative error %.4f\n", sqrt(err / norm));
    if (!(sqrt(err / norm) < 0.2)) failures++;

    /* Chunk 2 alone, into the start of the same buffers; it must equal the full decode. */
    kvc_chunk_info chunk;
    expect("chunk 2 info", kvc_stream_chunk(s, 2, &chunk), KVC_OK);
    float *ck[LAYERS], *cv[LAYERS];
    for (int l = 0; l < LAYERS; l++) {
        ck[l] = malloc(sizeof(float) * chunk.tokens * CHANNELS);
        cv[l] = malloc(sizeof(float) * chunk.tokens * CHANNELS);
    }
    expect("decode chunk 2", kvc_stream_decode_chunk(s, 2, KVC_DTYPE_F32, (void *const *)ck,
                                                     (void *const *)cv,
                                                     sizeof(float) * chunk.tokens * CHANNELS),
           KVC_OK);
    for (int l = 0; l < LAYERS; l++)
        if (memcmp(ck[l], dk[l] + chunk.token_start * CHANNELS,
                   sizeof(float) * chunk.tokens * CHANNELS) != 0)
            failures++;

    /* Profiles travel as bytes; the hash names them. */
    kvc_bytes saved = {NULL, 0};
    kvc_profile *loaded = NULL;
    uint8_t h1[32], h2[32];
    expect("save profile", kvc_profile_save(profile, &saved), KVC_OK);
    expect("load profile", kvc_profile_load(saved.data, saved.len, &loaded), KVC_OK);
    kvc_profile_hash(profile, h1);
    kvc_profile_hash(loaded, h2);
    if (memcmp(h1, h2, 32) != 0 || memcmp(h1, info.profile_hash, 32) != 0) failures++;

    /* Every kind of bad input is a status and a message, never a crash. */
    kvc_stream *bad = NULL;
    kvc_profile *loaded_bad = NULL;
    const uint8_t junk[] = "not a stream at all, not even close";
    expect("open junk", kvc_stream_open(junk, sizeof junk, NULL, &bad), KVC_ERR_HEADER);
    expect("open without its profile", kvc_stream_open(stream.data, stream.len, NULL, &bad),
           KVC_ERR_PROFILE_MISMATCH);
    expect("load junk as a profile", kvc_profile_load(junk, sizeof junk, &loaded_bad),
           KVC_ERR_PROFILE);
    expect("open into a null out-pointer", kvc_stream_open(stream.data, stream.len, profile, NULL),
           KVC_ERR_ARGUMENT);
    expect("load into a null out-pointer", kvc_profile_load(saved.data, saved.len, NULL),
           KVC_ERR_ARGUMENT);
    kvc_cache no_tokens = cache; /* 2^40 channels over no data: refused, nothing that size made */
    no_tokens.tokens = 0;
    no_tokens.kv_heads = no_tokens.head_dim = 1u << 20;
    expect("learn from no tokens", kvc_profile_learn(&no_tokens, NULL, 1, NULL, &loaded_bad),
           KVC_ERR_ENCODE);
    stream.data[stream.len - 1] ^= 1; /* the last chunk's CRC */
    expect("open a damaged stream", kvc_stream_open(stream.data, stream.len, profile, &bad), KVC_OK);
    expect("decode its last chunk", kvc_stream_decode_chunk(bad, 3, KVC_DTYPE_F32,
                                                            (void *const *)ck, (void *const *)cv,
                                                            sizeof(float) * chunk.tokens * CHANNELS),
           KVC_ERR_CHUNK);
    expect("decode into short buffers", kvc_stream_decode(s, 0, TOKENS, KVC_DTYPE_F32,
                                                          (void *const *)dk, (void *const *)dv,
                                                          cap - 4), KVC_ERR_OUTPUT);
    expect("decode chunk 9", kvc_stream_decode_chunk(s, 9, KVC_DTYPE_F32, (void *const *)dk,
                                                     (void *const *)dv, cap), KVC_ERR_OUT_OF_RANGE);
    expect("decode into one buffer twice", kvc_stream_decode(s, 0, TOKENS, KVC_DTYPE_F32,
                                                             (void *const *)dk, (void *const *)dk,
                                                             cap), KVC_ERR_ARGUMENT);
    params.level = 200;
    kvc_bytes none = {NULL, 0};
    expect("encode at a level the profile lacks", kvc_encode(&cache, NULL, profile, &params, &none),
           KVC_ERR_ENCODE);
    expect("null stream", kvc_stream_inspect(NULL, &info), KVC_ERR_ARGUMENT);

    kvc_stream_free(bad);
    kvc_stream_free(s);
    kvc_profile_free(loaded);
    kvc_profile_free(profile);
    kvc_bytes_free(&saved);
    kvc_bytes_free(&stream);
    for (int l = 0; l < LAYERS; l++) {
        free(k[l]); free(v[l]); free(dk[l]); free(dv[l]); free(ck[l]); free(cv[l]);
    }
    if (failures) {
        fprintf(stderr, "%d failures\n", failures);
        return 1;
    }
    printf("all steps behaved as documented\n");
    return 0;
}
