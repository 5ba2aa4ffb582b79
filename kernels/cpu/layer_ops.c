/* A decoder layer's small ops on the CPU, each one call where PyTorch takes several:
 * - tandem_rms_norm: the residual add and RMSNorm;
 * - tandem_silu_and_mul: SwiGLU's silu(gate) * up;
 * - tandem_rope_decode_attention: RoPE of the query and key heads, the new key and value written
 *   into the paged KV cache, and each decode token's attention over its sequence's cached
 *   context (a softmax over the scores, then the weighted sum of the values);
 * - tandem_dequantize_int4: a group-quantized weight's int4 planes to one bfloat16 matrix.
 * Float32 arithmetic throughout. The caller (kernels/cpu_ops.py) checks shapes, dtypes and strides; its
 * docstrings give the arguments' meaning. tandem_rope_decode_attention returns 0, -1 (out of
 * memory) or -2 (a sequence longer than its block table holds; nothing written). Built with -O3 for the host's vector ISA. */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline __attribute__((always_inline)) float dot(const float *a, const float *b, int64_t n) {
    float acc = 0.0f;
    for (int64_t i = 0; i < n; i++) acc += a[i] * b[i];
    return acc;
}

/* e^x in a form the compiler vectorizes (libm's expf is a call per element): x = n ln2 + r with
 * |r| <= ln2 / 2 (ln2 in two parts, Cody and Waite's reduction), e^r by its degree-7 Taylor
 * polynomial (truncation error below 1e-8 relative), 2^n from the exponent bits. Relative error
 * under 1e-7 (two float32 ulps) over [-87, 88]; x is clamped to it, so e^x stays a normal float
 * (~1.6e-38 where expf would give a denormal or 0, ~1.7e38 where it would overflow to inf). */
static inline __attribute__((always_inline)) float exp_clamped(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float n = __builtin_rintf(x * 1.44269504088896341f);
    /* fused multiply-adds, so that -fassociative-math cannot merge the two parts of ln2 */
    const float r = __builtin_fmaf(n, 2.12194440e-4f, __builtin_fmaf(n, -0.693359375f, x));
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { int32_t i; float f; } two_n = {.i = ((int32_t)n + 127) << 23};
    return p * two_n.f;
}

/* Rotate-half RoPE of one head x[head_dim] into y. */
static void rope(const float *x, const float *cos, const float *sin, int64_t half, float *y) {
    for (int64_t i = 0; i < half; i++) {
        float x1 = x[i], x2 = x[i + half];
        y[i] = x1 * cos[i] - x2 * sin[i];
        y[i + half] = x2 * cos[i] + x1 * sin[i];
    }
}

/* One query head's attention over its sequence's paged context, the context a block at a time
 * (no division per position): scores, softmax, then the weighted sum of V into o[head_dim]; zeros
 * for an empty context (a padding row's). */
static inline __attribute__((always_inline)) void attend(
    const float *qh, const float *k_cache, const float *v_cache, const int32_t *table, int64_t len,
    int64_t block_size, int64_t block_stride, int64_t offset_stride, int64_t head, int64_t head_dim, float scale,
    float *scores, float *o) {
    memset(o, 0, sizeof(float) * (size_t)head_dim);
    if (len == 0) return; /* a padding row: zeros, as the PyTorch path gives */
    float max_score = -INFINITY;
    for (int64_t start = 0; start < len; start += block_size) {
        const float *k = k_cache + (int64_t)table[start / block_size] * block_stride + head;
        const int64_t n = len - start < block_size ? len - start : block_size;
        for (int64_t j = 0; j < n; j++) {
            float score = dot(qh, k + j * offset_stride, head_dim) * scale;
            scores[start + j] = score;
            if (score > max_score) max_score = score;
        }
    }
    float total = 0.0f;
    for (int64_t j = 0; j < len; j++) {
        scores[j] = exp_clamped(scores[j] - max_score);
        total += scores[j];
    }
    for (int64_t start = 0; start < len; start += block_size) {
        const float *v = v_cache + (int64_t)table[start / block_size] * block_stride + head;
        const int64_t n = len - start < block_size ? len - start : block_size;
        for (int64_t j = 0; j < n; j++) {
            const float p = scores[start + j], *vj = v + j * offset_stride;
            for (int64_t d = 0; d < head_dim; d++) o[d] += p * vj[d];
        }
    }
    const float inv_total = 1.0f / total;
    for (int64_t d = 0; d < head_dim; d++) o[d] *= inv_total;
}

/* attend() compiled for the common head sizes as constants (unrolled, no remainder loops). */
static void attend_head(const float *qh, const float *k_cache, const float *v_cache, const int32_t *table,
                        int64_t len, int64_t block_size, int64_t block_stride, int64_t offset_stride, int64_t head,
                        int64_t head_dim, float scale, float *scores, float *o) {
    if (head_dim == 64)
        attend(qh, k_cache, v_cache, table, len, block_size, block_stride, offset_stride, head, 64, scale, scores, o);
    else if (head_dim == 128)
        attend(qh, k_cache, v_cache, table, len, block_size, block_stride, offset_stride, head, 128, scale, scores, o);
    else
        attend(qh, k_cache, v_cache, table, len, block_size, block_stride, offset_stride, head, head_dim, scale,
               scores, o);
}

/* What every thread of one tandem_rope_decode_attention call reads. */
struct attention_job {
    const float *q; /* [num_tokens, num_q_heads, head_dim], after RoPE */
    const float *k_cache, *v_cache;
    const int32_t *block_tables, *seq_lens;
    int64_t num_q_heads, group, head_dim, block_size, block_table_stride;
    int64_t cache_block_stride, cache_offset_stride, cache_head_stride, out_row_stride;
    float scale;
    float *out;
    int64_t max_len;
};

struct attention_share {
    const struct attention_job *job;
    int64_t first, last; /* (token, query head) items [first, last) */
    int status;
};

static void *attend_share(void *arg) {
    struct attention_share *share = arg;
    const struct attention_job *job = share->job;
    float *scores = malloc(sizeof(float) * (size_t)job->max_len);
    if (scores == NULL) {
        share->status = -1;
        return NULL;
    }
    for (int64_t item = share->first; item < share->last; item++) {
        const int64_t t = item / job->num_q_heads, h = item % job->num_q_heads;
        attend_head(job->q + item * job->head_dim, job->k_cache, job->v_cache,
                    job->block_tables + t * job->block_table_stride, job->seq_lens[t], job->block_size,
                    job->cache_block_stride, job->cache_offset_stride, (h / job->group) * job->cache_head_stride,
                    job->head_dim, job->scale, scores, job->out + t * job->out_row_stride + h * job->head_dim);
    }
    free(scores);
    share->status = 0;
    return NULL;
}

/* Context positions (summed over a call's query heads) below which one thread does all: a
 * thread's start and join (~20 us) would cost more than the split saves. */
#define PARALLEL_MIN_POSITIONS 16384
#define MAX_THREADS 64

int tandem_rope_decode_attention(
    const float *qkv, int64_t num_tokens, int64_t qkv_row_stride,
    int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim,
    const float *cos, const float *sin, int64_t rope_row_stride,
    float *k_cache, float *v_cache, int64_t block_size,
    int64_t cache_block_stride, int64_t cache_offset_stride, int64_t cache_head_stride,
    const int64_t *slot_mapping, const int32_t *block_tables, int64_t block_table_stride,
    const int32_t *seq_lens, int64_t max_blocks_per_seq, float scale, float *out, int64_t out_row_stride,
    int64_t num_threads) {
    const int64_t half = head_dim / 2;
    int64_t max_len = 1, positions = 0;
    for (int64_t t = 0; t < num_tokens; t++) {
        if (seq_lens[t] > max_len) max_len = seq_lens[t];
        positions += seq_lens[t] * num_q_heads;
    }
    if (max_len > max_blocks_per_seq * block_size) return -2; /* past its block table: nothing is read */
    float *q = malloc(sizeof(float) * (size_t)(num_tokens * num_q_heads * head_dim));
    if (q == NULL) return -1;
    /* RoPE and the cache writes first: every token's K/V is in place before any attention reads */
    for (int64_t t = 0; t < num_tokens; t++) {
        const float *row = qkv + t * qkv_row_stride;
        const float *c = cos + t * rope_row_stride, *s = sin + t * rope_row_stride;
        for (int64_t h = 0; h < num_q_heads; h++)
            rope(row + h * head_dim, c, s, half, q + (t * num_q_heads + h) * head_dim);
        int64_t slot = slot_mapping[t];
        if (slot >= 0) {
            int64_t base = (slot / block_size) * cache_block_stride + (slot % block_size) * cache_offset_stride;
            const float *k_new = row + num_q_heads * head_dim, *v_new = k_new + num_kv_heads * head_dim;
            for (int64_t g = 0; g < num_kv_heads; g++) {
                rope(k_new + g * head_dim, c, s, half, k_cache + base + g * cache_head_stride);
                memcpy(v_cache + base + g * cache_head_stride, v_new + g * head_dim, sizeof(float) * (size_t)head_dim);
            }
        }
    }
    const struct attention_job job = {q, k_cache, v_cache, block_tables, seq_lens, num_q_heads,
                                      num_q_heads / num_kv_heads, head_dim, block_size, block_table_stride,
                                      cache_block_stride, cache_offset_stride, cache_head_stride, out_row_stride,
                                      scale, out, max_len};
    const int64_t items = num_tokens * num_q_heads;
    int64_t threads = positions < PARALLEL_MIN_POSITIONS ? 1 : num_threads;
    if (threads > items) threads = items;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads < 1) threads = 1;
    struct attention_share shares[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int64_t i = 0; i < threads; i++)
        shares[i] = (struct attention_share){&job, items * i / threads, items * (i + 1) / threads, -1};
    for (int64_t i = 1; i < threads; i++) /* a thread that cannot start leaves its share to this one */
        started[i] = pthread_create(&ids[i], NULL, attend_share, &shares[i]) == 0;
    attend_share(&shares[0]);
    int status = shares[0].status;
    for (int64_t i = 1; i < threads; i++) {
        if (started[i])
            pthread_join(ids[i], NULL);
        else
            attend_share(&shares[i]);
        if (shares[i].status != 0) status = -1;
    }
    free(q);
    return status;
}

void tandem_rms_norm(const float *x, int64_t x_row_stride, const float *residual, int64_t residual_row_stride,
                     float *residual_out, const float *weight, int64_t num_rows, int64_t size, float eps,
                     float *out) {
    for (int64_t r = 0; r < num_rows; r++) {
        const float *xr = x + r * x_row_stride;
        float *o = out + r * size;
        const float *h = xr;
        if (residual != NULL) {
            const float *res = residual + r * residual_row_stride;
            float *sum = residual_out + r * size;
            for (int64_t i = 0; i < size; i++) sum[i] = xr[i] + res[i];
            h = sum;
        }
        float squares = dot(h, h, size);
        float inv = 1.0f / sqrtf(squares / (float)size + eps);
        for (int64_t i = 0; i < size; i++) o[i] = h[i] * inv * weight[i];
    }
}

void tandem_silu_and_mul(const float *x, int64_t x_row_stride, int64_t num_rows, int64_t size, float *out) {
    for (int64_t r = 0; r < num_rows; r++) {
        const float *gate = x + r * x_row_stride, *up = gate + size;
        float *o = out + r * size;
        for (int64_t i = 0; i < size; i++) o[i] = gate[i] / (1.0f + exp_clamped(-gate[i])) * up[i];
    }
}

static inline __attribute__((always_inline)) float from_bf16(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* float32 -> bfloat16 bits, rounded to nearest even (dequantized weights are finite) */
static inline __attribute__((always_inline)) uint16_t to_bf16(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

/* The weights of one (row, group) span of a plane: element j in the low nibble of byte j and
 * element j + half in its high one, so that both halves are written contiguously (16 bytes at a
 * time, vectorized). */
static inline __attribute__((always_inline)) void plane_terms(const uint8_t *restrict b, float s, float z,
                                                              float *restrict lo, float *restrict hi, int add) {
    for (int j = 0; j < 16; j++) {
        const float l = (float)((int32_t)(b[j] & 15) - 8) * s + z, h = (float)((int32_t)(b[j] >> 4) - 8) * s + z;
        lo[j] = add ? lo[j] + l : l;
        hi[j] = add ? hi[j] + h : h;
    }
}

/* One thread: between PyTorch's ops its OpenMP threads keep spinning on the other cores, and a
 * second thread here lost to them (a SmolLM2 prefill's dequantization took 97 ms on two
 * threads, 55 on one, 2-core Xeon). */
void tandem_dequantize_int4(const uint8_t *restrict nibbles, const uint16_t *restrict scales_and_zeros,
                            int64_t num_planes, int64_t rows, int64_t cols, int64_t group_size, uint16_t *restrict out) {
    const int64_t groups = cols / group_size, half = group_size / 2, plane_bytes = rows * (cols / 2);
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *restrict b = nibbles + r * (cols / 2) + g * half;
            const uint16_t *restrict sz = scales_and_zeros + (g * rows + r) * 2;
            uint16_t *restrict o = out + r * cols + g * group_size;
            const float s = from_bf16(sz[0]), z = from_bf16(sz[1]);
            if (num_planes == 1) { /* 4-bit codes: the weights straight out */
                for (int64_t c = 0; c < half; c += 16) {
                    for (int j = 0; j < 16; j++) {
                        o[c + j] = to_bf16((float)((int32_t)(b[c + j] & 15) - 8) * s + z);
                        o[half + c + j] = to_bf16((float)((int32_t)(b[c + j] >> 4) - 8) * s + z);
                    }
                }
                continue;
            }
            for (int64_t c = 0; c < half; c += 16) {
                float lo[16], hi[16];
                plane_terms(b + c, s, z, lo, hi, 0);
                for (int64_t p = 1; p < num_planes; p++) {
                    const uint16_t *restrict szp = sz + p * groups * rows * 2;
                    plane_terms(b + p * plane_bytes + c, from_bf16(szp[0]), from_bf16(szp[1]), lo, hi, 1);
                }
                for (int j = 0; j < 16; j++) {
                    o[c + j] = to_bf16(lo[j]);
                    o[half + c + j] = to_bf16(hi[j]);
                }
            }
        }
    }
}
