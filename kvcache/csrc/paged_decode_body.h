/* The decode kernel's body, included by paged_decode.c once per element type: KV_T is the type of q, the caches
 * and out; LOAD(x) reads one as float32, STORE(x) writes a float32 back; NAME(f) names this type's functions.
 * Arithmetic is float32 for every type. */
static int NAME(decode_range)(const KV_T *q, const KV_T *key_cache, const KV_T *value_cache,
                        const int64_t *block_tables, int64_t table_stride, const int64_t *seq_lens,
                        KV_T *out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                        int64_t head_dim, int64_t block_size, float scale, int64_t max_len);

int NAME(sluice_paged_decode)(const KV_T *q, const KV_T *key_cache, const KV_T *value_cache,
                        const int64_t *block_tables, int64_t table_stride, const int64_t *seq_lens,
                        KV_T *out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                        int64_t head_dim, int64_t block_size, float scale, int64_t num_threads) {
    int failed = 0;
    int64_t max_len = 1, tokens = 0;
    for (int64_t i = 0; i < num_seqs; i++) {
        max_len = seq_lens[i] > max_len ? seq_lens[i] : max_len;
        tokens += seq_lens[i];
    }
    /* Small batches stay on this thread: a parallel region costs a fork and join, and afterwards torch's OpenMP
     * workers spin for a while, taking a core from the server's event loop. */
    const int parallel = num_threads > 1 && num_seqs > 1 && tokens * num_heads * head_dim >= PARALLEL_MIN_WORK;
#pragma omp parallel num_threads((int)num_threads) if (parallel) reduction(| : failed)
    {
        failed |= NAME(decode_range)(q, key_cache, value_cache, block_tables, table_stride, seq_lens, out, num_seqs,
                               num_heads, num_kv_heads, head_dim, block_size, scale, max_len);
    }
    return failed;
}

/* Where token t's K or V row of this head lies in the paged cache. */
#define KV_ROW(cache, t) ((cache) + table[(t) / block_size] * block_stride + ((t) % block_size) * token_stride + head)

/* Every sequence this thread is handed; 1 if its scratch buffers cannot be allocated. */
static int NAME(decode_range)(const KV_T *q, const KV_T *key_cache, const KV_T *value_cache,
                        const int64_t *block_tables, int64_t table_stride, const int64_t *seq_lens,
                        KV_T *out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                        int64_t head_dim, int64_t block_size, float scale, int64_t max_len) {
    const int64_t groups = num_heads / num_kv_heads, D = head_dim, H = num_heads;
    const int64_t token_stride = num_kv_heads * D, block_stride = block_size * token_stride;
    /* scores [H][max_len]; acc [H][D] */
    float *scores = malloc(sizeof(float) * (size_t)(H * max_len));
    float *acc = malloc(sizeof(float) * (size_t)(H * D));
    float *sums = malloc(sizeof(float) * (size_t)H);
    float *qi = malloc(sizeof(float) * (size_t)(H * D)); /* this sequence's query, as float32 */
    /* No early return on failure: every thread of the team must reach the `omp for` below. */
    const int ok = scores && acc && sums && qi;
    /* dynamic: the work per sequence is its length, and lengths differ */
#pragma omp for schedule(dynamic)
    for (int64_t i = 0; i < num_seqs; i++) {
        if (!ok) continue;
        const int64_t len = seq_lens[i];
        const int64_t *table = block_tables + i * table_stride;
        for (int64_t j = 0; j < H * D; j++) qi[j] = LOAD(q[i * H * D + j]);
        /* Pass 1: scores, one query head at a time over four tokens at once: four independent sums per d-loop
         * keep the vector FMAs busy, where one dot product at a time waits on each FMA's latency. */
        for (int64_t hq = 0; hq < H; hq++) {
            const float *qh = qi + hq * D;
            const int64_t head = (hq / groups) * D;
            float *sc = scores + hq * max_len, m = -INFINITY;
            int64_t t = 0;
            for (; t + 4 <= len; t += 4) {
                const KV_T *k0 = KV_ROW(key_cache, t);
                const KV_T *k1 = KV_ROW(key_cache, t + 1);
                const KV_T *k2 = KV_ROW(key_cache, t + 2);
                const KV_T *k3 = KV_ROW(key_cache, t + 3);
                float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
                for (int64_t d = 0; d < D; d++) {
                    s0 += qh[d] * LOAD(k0[d]);
                    s1 += qh[d] * LOAD(k1[d]);
                    s2 += qh[d] * LOAD(k2[d]);
                    s3 += qh[d] * LOAD(k3[d]);
                }
                sc[t] = s0 * scale, sc[t + 1] = s1 * scale, sc[t + 2] = s2 * scale, sc[t + 3] = s3 * scale;
            }
            for (; t < len; t++) {
                const KV_T *kt = KV_ROW(key_cache, t);
                float s = 0.f;
                for (int64_t d = 0; d < D; d++) s += qh[d] * LOAD(kt[d]);
                sc[t] = s * scale;
            }
            for (t = 0; t < len; t++) m = sc[t] > m ? sc[t] : m;
            float sum = 0.f;
            for (t = 0; t < len; t++) { sc[t] = expf(sc[t] - m); sum += sc[t]; }
            sums[hq] = sum;
        }
        /* Pass 2: weighted sum of the values, two tokens per update of the head's accumulator. */
        memset(acc, 0, sizeof(float) * (size_t)(H * D));
        for (int64_t hq = 0; hq < H; hq++) {
            const float *sc = scores + hq * max_len;
            const int64_t head = (hq / groups) * D;
            float *a = acc + hq * D;
            int64_t t = 0;
            for (; t + 2 <= len; t += 2) {
                const KV_T *v0 = KV_ROW(value_cache, t);
                const KV_T *v1 = KV_ROW(value_cache, t + 1);
                const float p0 = sc[t], p1 = sc[t + 1];
                for (int64_t d = 0; d < D; d++) a[d] += p0 * LOAD(v0[d]) + p1 * LOAD(v1[d]);
            }
            for (; t < len; t++) {
                const KV_T *vt = KV_ROW(value_cache, t);
                const float p = sc[t];
                for (int64_t d = 0; d < D; d++) a[d] += p * LOAD(vt[d]);
            }
        }
        for (int64_t hq = 0; hq < H; hq++) {
            const float inv = sums[hq] > 0.f ? 1.f / sums[hq] : 0.f;
            KV_T *o = out + (i * H + hq) * D;
            for (int64_t d = 0; d < D; d++) o[d] = STORE(acc[hq * D + d] * inv);
        }
    }
    free(scores); free(acc); free(sums); free(qi);
    return !ok;
}

#undef KV_ROW
