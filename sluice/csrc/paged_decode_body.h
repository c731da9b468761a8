/* The decode kernel's body, included by paged_decode.cpp once per pair of element types: Q_T is the type of q,
 * out and the new K/V rows, KV_T the caches'. Q_LOAD / LOAD read one of each as float32, Q_LOADV / LOADV VW of
 * them; Q_STORE and STORE write a float32 back as each type; NAME(f) names this pair's functions. Arithmetic is
 * float32 for every pair. A bfloat16 cache under float32 queries halves the cache and keeps the query and the
 * output in float32. */
static int NAME(decode_range)(const Q_T *q, const KV_T *key_cache, const KV_T *value_cache,
                        const int64_t *block_tables, int64_t table_stride, const int64_t *seq_lens,
                        const int64_t *items, int64_t num_items, Q_T *out, int64_t num_heads,
                        int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, int64_t max_len,
                        int64_t head_span);

static int NAME(sluice_paged_decode)(const Q_T *q, const KV_T *key_cache, const KV_T *value_cache,
                        const int64_t *block_tables, int64_t table_stride, const int64_t *seq_lens,
                        const int64_t *items, int64_t num_items, Q_T *out, int64_t num_seqs, int64_t num_heads,
                        int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                        int64_t num_threads) {
    int failed = 0;
    int64_t max_len = 1, tokens = 0;
    for (int64_t i = 0; i < num_seqs; i++) {
        max_len = seq_lens[i] > max_len ? seq_lens[i] : max_len;
        tokens += seq_lens[i];
    }
    /* Tiny calls stay on this thread: a parallel region costs a fork and join. Above that, even one sequence's
     * KV heads share the threads: its rows come from memory, not cache, at decode (the layers' weights stream
     * through it in between), and two cores wait on twice as many. SmolLM2, one sequence of 150 tokens, in a
     * decode step: 34 -> 22.5 us a layer. (The linears' kernels fork on every call anyway.) */
    const int parallel = num_threads > 1 && num_items * num_kv_heads > 1 &&
                         tokens * num_heads * head_dim >= PARALLEL_MIN_WORK;
    /* KV heads per work item: all of a sequence's where there are runs enough to keep every thread busy (a row's
     * pass then streams its tokens' rows whole), else fewer, so that few sequences still share the threads. */
    const int64_t wanted = parallel ? 4 * num_threads : 1;
    const int64_t spans = num_items >= wanted ? 1 : std::min(num_kv_heads, (wanted + num_items - 1) / num_items);
    const int64_t head_span = (num_kv_heads + spans - 1) / spans;
#pragma omp parallel num_threads((int)num_threads) if (parallel) reduction(| : failed)
    {
        failed |= NAME(decode_range)(q, key_cache, value_cache, block_tables, table_stride, seq_lens, items,
                                     num_items, out, num_heads, num_kv_heads, head_dim, block_size, scale, max_len,
                                     head_span);
    }
    return failed;
}

/* One layer's decodes: store each sequence's new K and V rows [n, Hkv, D] in their cache slots (key NULL: the
 * caller already stored them, as in a step that mixes decodes and prefills), then attend. */
int NAME(sluice_paged_decode_step)(const DecodePlan *p, const Q_T *q, const Q_T *key, const Q_T *value,
                                   KV_T *key_cache, KV_T *value_cache, Q_T *out) {
    const int64_t row = p->num_kv_heads * p->head_dim;
    for (int64_t i = 0; key != NULL && i < p->num_seqs; i++) {
        KV_T *k = key_cache + p->slot_mapping[i] * row, *v = value_cache + p->slot_mapping[i] * row;
        if (sizeof(Q_T) == sizeof(KV_T)) { /* one type: a copy */
            memcpy(k, key + i * row, (size_t)row * sizeof(KV_T));
            memcpy(v, value + i * row, (size_t)row * sizeof(KV_T));
        } else { /* rounded to the cache's type, as torch's cast would */
            for (int64_t j = 0; j < row; j++) {
                k[j] = STORE(Q_LOAD(key[i * row + j]));
                v[j] = STORE(Q_LOAD(value[i * row + j]));
            }
        }
    }
    return NAME(sluice_paged_decode)(q, key_cache, value_cache, p->block_tables, p->table_stride, p->seq_lens,
                                     p->items, p->num_items, out, p->num_seqs, p->num_heads, p->num_kv_heads,
                                     p->head_dim, p->block_size, p->scale, p->num_threads);
}

/* Where token t's K or V row of this head lies in the paged cache. */
#define KV_ROW(cache, t) ((cache) + table[(t) / block_size] * block_stride + ((t) % block_size) * token_stride + head)

#ifdef SLUICE_DECODE_SIMD
/* Head g0 + j's row of token t in `cache` as V vectors; the first head of a work item prefetches every head's,
 * kPrefetchTokens tokens ahead (span bytes). */
static inline __attribute__((always_inline)) void NAME(span_row)(
        const KV_T *cache, const int64_t *table, int64_t t, int64_t len, int64_t j, int64_t g0, int64_t block_size,
        int64_t token_stride, int64_t span, const int64_t V, vf *row) {
    const int64_t D = V * VW, head = g0 * D, block_stride = block_size * token_stride;
    if (j == 0 && t + kPrefetchTokens < len) sluice::prefetch(KV_ROW(cache, t + kPrefetchTokens), span);
    const KV_T *r = KV_ROW(cache, t) + j * D;
    for (int64_t v = 0; v < V; v++) row[v] = LOADV(r + VW * v);
}

/* One row's attention for KV heads [g0, g1), G query heads each. A token's rows of those heads lie side by side in
 * the cache, a token's stride apart from the next token's: head by head over every token, each pass would take 128
 * bytes of a page and move on, and the cache lines of the next head, and the pages, would be fetched again. So the
 * tokens go in chunks whose rows of all these heads stay in L2: the first head of a chunk prefetches each token's
 * whole span, the others read it from cache. A head's queries and sums stay in registers, with group_simd's
 * products and sums in its order, so its bits. Scratch: acc (g1 - g0) * G * D floats, sums one per query, scores a
 * row of max_len per query. */
static inline __attribute__((always_inline)) void NAME(heads_simd)(
        const Q_T *q, const KV_T *key_cache, const KV_T *value_cache, const int64_t *table, int64_t len,
        Q_T *out, int64_t g0, int64_t g1, int64_t block_size, int64_t token_stride, float scale, float *scores,
        int64_t max_len, float *acc, float *sums, const int64_t V, const int64_t G) {
    const int64_t D = V * VW, heads = g1 - g0;
    const int64_t span = heads * D * (int64_t)sizeof(KV_T), chunk = std::max<int64_t>(16, kChunkBytes / span);
    vf qv[8][MAX_D / VW], a[8][MAX_D / VW];
    /* Pass 1: scores. */
    for (int64_t c0 = 0; c0 < len; c0 += chunk) {
        const int64_t c1 = std::min(len, c0 + chunk);
        for (int64_t j = 0; j < heads; j++) {
            for (int64_t h = 0; h < G; h++)
                for (int64_t v = 0; v < V; v++)
                    qv[h][v] = V_MUL(Q_LOADV(q + ((g0 + j) * G + h) * D + VW * v), V_SET1(scale));
            int64_t t = c0;
#if VW == 16
            /* SCORE_TILE tokens at a time: one transposed reduction per query and tile (reduce8_store, V_HSUM's
             * bits) in place of a shuffle tree per token and query. One or two queries keep the tile's sums in
             * registers; more would spill them, so their K rows go to a float tile in L1 that each query reads,
             * up to 64 dims: a wider row has more products per tree, and the tile's stores and loads then cost
             * more than the trees they save. AVX2 keeps a sum per token: its 16 registers spill either way. */
            for (; G <= 2 && t + SCORE_TILE <= c1; t += SCORE_TILE) {
                vf s[2][SCORE_TILE];
                for (int64_t i = 0; i < SCORE_TILE; i++) {
                    vf kv[MAX_D / VW];
                    NAME(span_row)(key_cache, table, t + i, len, j, g0, block_size, token_stride, span, V, kv);
                    for (int64_t h = 0; h < G; h++) {
                        s[h][i] = V_MUL(qv[h][0], kv[0]);
                        for (int64_t v = 1; v < V; v++) s[h][i] = V_FMADD(qv[h][v], kv[v], s[h][i]);
                    }
                }
                for (int64_t h = 0; h < G; h++) reduce8_store(s[h], scores + (j * G + h) * max_len + t);
            }
            for (; V <= 4 && t + SCORE_TILE <= c1; t += SCORE_TILE) {
                float ktile[SCORE_TILE * MAX_D];
                const float *k[SCORE_TILE];
                for (int64_t i = 0; i < SCORE_TILE; i++) {
                    vf kv[MAX_D / VW];
                    NAME(span_row)(key_cache, table, t + i, len, j, g0, block_size, token_stride, span, V, kv);
                    for (int64_t v = 0; v < V; v++) V_STOREU(ktile + i * D + VW * v, kv[v]);
                    k[i] = ktile + i * D;
                }
                for (int64_t h = 0; h < G; h++) score_tile(qv[h], k, V, scores + (j * G + h) * max_len + t);
            }
#endif
            for (; t < c1; t++) {
                vf kv[MAX_D / VW];
                NAME(span_row)(key_cache, table, t, len, j, g0, block_size, token_stride, span, V, kv);
                for (int64_t h = 0; h < G; h++) {
                    vf s = V_MUL(qv[h][0], kv[0]);
                    for (int64_t v = 1; v < V; v++) s = V_FMADD(qv[h][v], kv[v], s);
                    scores[(j * G + h) * max_len + t] = V_HSUM(s);
                }
            }
        }
    }
    for (int64_t n = 0; n < heads * G; n++) sums[n] = softmax_numerators(scores + n * max_len, len);
    /* Pass 2: the weighted values, each head's sums in registers over a chunk, in acc between chunks. */
    for (int64_t c0 = 0; c0 < len; c0 += chunk) {
        const int64_t c1 = std::min(len, c0 + chunk);
        for (int64_t j = 0; j < heads; j++) {
            float *aj = acc + j * G * D;
            for (int64_t h = 0; h < G; h++)
                for (int64_t v = 0; v < V; v++) a[h][v] = c0 == 0 ? V_ZERO() : V_LOADU(aj + h * D + VW * v);
            for (int64_t t = c0; t < c1; t++) {
                vf vv[MAX_D / VW];
                NAME(span_row)(value_cache, table, t, len, j, g0, block_size, token_stride, span, V, vv);
                for (int64_t h = 0; h < G; h++) {
                    const vf p = V_SET1(scores[(j * G + h) * max_len + t]);
                    for (int64_t v = 0; v < V; v++) a[h][v] = V_FMADD(p, vv[v], a[h][v]);
                }
            }
            for (int64_t h = 0; h < G; h++)
                for (int64_t v = 0; v < V; v++) V_STOREU(aj + h * D + VW * v, a[h][v]);
        }
    }
    for (int64_t n = 0; n < heads * G; n++) {
        const vf inv = V_SET1(sums[n] > 0.f ? 1.f / sums[n] : 0.f);
        float row[MAX_D];
        for (int64_t v = 0; v < V; v++) V_STOREU(row + VW * v, V_MUL(V_LOADU(acc + n * D + VW * v), inv));
        Q_T *o = out + (g0 * G + n) * D;
        for (int64_t d = 0; d < D; d++) o[d] = Q_STORE(row[d]);
    }
}

/* Rows [t0, t0 + n) of this head's K or V (`cache`) as float32 into rows[]: in place for a float32 cache, else
 * converted into `tile` (n x D floats); rows up to kPrefetchTokens ahead, below `hi`, are prefetched. */
static inline void NAME(f32_rows)(const KV_T *cache, const int64_t *table, int64_t head, int64_t block_size,
                                  int64_t token_stride, int64_t t0, int64_t n, int64_t hi, int64_t V, float *tile,
                                  const float **rows) {
    const int64_t D = V * VW, block_stride = block_size * token_stride;
    for (int64_t i = 0; i < n; i++) {
        if (t0 + i + kPrefetchTokens < hi) sluice::prefetch(KV_ROW(cache, t0 + i + kPrefetchTokens), D * sizeof(KV_T));
        const KV_T *row = KV_ROW(cache, t0 + i);
        if (sizeof(KV_T) == sizeof(float)) {
            rows[i] = (const float *)row;
            continue;
        }
        for (int64_t v = 0; v < V; v++) V_STOREU(tile + i * D + VW * v, LOADV(row + VW * v));
        rows[i] = tile + i * D;
    }
}

/* KV head g's attention for R > 1 query rows of one sequence (a verify step's: row j sees lens[j] tokens), R x G
 * queries, each K and V row read from the cache once for all of them: scores SCORE_TILE tokens at a time per query
 * (one reduction for the tile), values VALUE_TILE tokens at a time with up to eight vectors of a query's output in
 * registers. `tile`: VALUE_TILE x D floats of scratch. */
static inline __attribute__((always_inline)) void NAME(rows_simd)(
        const Q_T *q, const KV_T *key_cache, const KV_T *value_cache, const int64_t *table, const int64_t *lens,
        Q_T *out, int64_t g, int64_t H, int64_t block_size, int64_t token_stride, float scale, float *scores,
        int64_t max_len, float *tile, const int64_t V, const int64_t G, const int64_t R) {
    const int64_t D = V * VW, head = g * D, NQ = R * G;
    vf qv[MAX_QUERIES][MAX_D / VW];
    int64_t seen_by[MAX_QUERIES], hi = 0; /* the tokens query n sees: its row's length */
    for (int64_t n = 0; n < NQ; n++) {
        seen_by[n] = lens[n / G];
        hi = seen_by[n] > hi ? seen_by[n] : hi;
        for (int64_t v = 0; v < V; v++)
            qv[n][v] = V_MUL(Q_LOADV(q + (n / G) * H * D + (g * G + n % G) * D + VW * v), V_SET1(scale));
    }
    /* Pass 1: scores. A row's scores past its own length are computed with the tile's others and never read. */
    const int64_t full = hi - hi % SCORE_TILE;
    for (int64_t t0 = 0; t0 < full; t0 += SCORE_TILE) {
        const float *k[SCORE_TILE];
        NAME(f32_rows)(key_cache, table, head, block_size, token_stride, t0, SCORE_TILE, hi, V, tile, k);
        for (int64_t n = 0; n < NQ; n++) {
            if (t0 >= seen_by[n]) continue;
            score_tile(qv[n], k, V, scores + n * max_len + t0);
        }
    }
    for (int64_t t = full; t < hi; t++) {
        const float *k;
        NAME(f32_rows)(key_cache, table, head, block_size, token_stride, t, 1, hi, V, tile, &k);
        for (int64_t n = 0; n < NQ; n++) {
            if (t >= seen_by[n]) continue;
            vf s = V_MUL(qv[n][0], V_LOADU(k));
            for (int64_t v = 1; v < V; v++) s = V_FMADD(qv[n][v], V_LOADU(k + VW * v), s);
            scores[n * max_len + t] = V_HSUM(s);
        }
    }
    float sums[MAX_QUERIES]; /* over each row's own length */
    for (int64_t n = 0; n < NQ; n++) sums[n] = softmax_numerators(scores + n * max_len, seen_by[n]);
    /* Pass 2: the weighted values, a tile of rows at a time (a 128-wide head on AVX2 takes two turns a query). */
    float accs[MAX_QUERIES][MAX_D];
    for (int64_t n = 0; n < NQ; n++)
        for (int64_t v = 0; v < V; v++) V_STOREU(accs[n] + VW * v, V_ZERO());
    for (int64_t t0 = 0; t0 < hi; t0 += VALUE_TILE) {
        const int64_t tn = hi - t0 < VALUE_TILE ? hi - t0 : VALUE_TILE;
        const float *vr[VALUE_TILE];
        NAME(f32_rows)(value_cache, table, head, block_size, token_stride, t0, tn, hi, V, tile, vr);
        for (int64_t n = 0; n < NQ; n++) {
            const int64_t seen = seen_by[n] - t0 < tn ? seen_by[n] - t0 : tn;
            const float *p = scores + n * max_len + t0;
            for (int64_t c = 0; c < V; c += 8) {
                const int64_t cv = V - c < 8 ? V - c : 8;
                vf a[8];
                for (int64_t v = 0; v < cv; v++) a[v] = V_LOADU(accs[n] + VW * (c + v));
                for (int64_t i = 0; i < seen; i++) {
                    const vf pb = V_SET1(p[i]);
                    for (int64_t v = 0; v < cv; v++) a[v] = V_FMADD(pb, V_LOADU(vr[i] + VW * (c + v)), a[v]);
                }
                for (int64_t v = 0; v < cv; v++) V_STOREU(accs[n] + VW * (c + v), a[v]);
            }
        }
    }
    for (int64_t n = 0; n < NQ; n++) {
        const float inv = sums[n] > 0.f ? 1.f / sums[n] : 0.f;
        Q_T *o = out + (n / G) * H * D + (g * G + n % G) * D;
        for (int64_t d = 0; d < D; d++) o[d] = Q_STORE(accs[n][d] * inv);
    }
}

/* The vector path for KV head g of R > 1 rows of one sequence (row j sees lens[j] tokens); 0 where its shape is not
 * one it covers (then the portable loop runs). */
static int NAME(rows_head_simd)(const Q_T *q, const KV_T *key_cache, const KV_T *value_cache, const int64_t *table,
                                const int64_t *lens, int64_t R, Q_T *out, int64_t g, int64_t H, int64_t Hkv,
                                int64_t D, int64_t block_size, float scale, float *scores, int64_t max_len,
                                float *tile) {
    const int64_t G = H / Hkv, token_stride = Hkv * D;
    if (!simd_covers(H, Hkv, D) || R * G > MAX_QUERIES) return 0;
#define ROWS(Dc) NAME(rows_simd)(q, key_cache, value_cache, table, lens, out, g, H, block_size, token_stride, scale, \
                                 scores, max_len, tile, (Dc) / VW, G, R)
    if (D == 64) ROWS(64);
    else if (D == 128) ROWS(128);
    else ROWS(D);
#undef ROWS
    return 1;
}

/* The vector path for one row's KV heads [g0, g1); 0 where its shape is not one it covers. */
static int NAME(heads_row_simd)(const Q_T *q, const KV_T *key_cache, const KV_T *value_cache, const int64_t *table,
                                int64_t len, Q_T *out, int64_t g0, int64_t g1, int64_t H, int64_t Hkv, int64_t D,
                                int64_t block_size, float scale, float *scores, int64_t max_len, float *acc,
                                float *sums) {
    const int64_t G = H / Hkv, token_stride = Hkv * D;
    if (!simd_covers(H, Hkv, D)) return 0;
#define HEADS(Dc, Gc) NAME(heads_simd)(q, key_cache, value_cache, table, len, out, g0, g1, block_size, token_stride, \
                                       scale, scores, max_len, acc, sums, (Dc) / VW, Gc)
    if (D == 64 && G == 1) HEADS(64, 1);
    else if (D == 64 && G == 2) HEADS(64, 2);
    else if (D == 64 && G == 3) HEADS(64, 3);
    else if (D == 64 && G == 4) HEADS(64, 4);
    else if (D == 128 && G == 1) HEADS(128, 1);
    else if (D == 128 && G == 2) HEADS(128, 2);
    else if (D == 128 && G == 4) HEADS(128, 4);
    else HEADS(D, G);
#undef HEADS
    return 1;
}
#endif

/* Every work item this thread is handed; 1 if its scratch buffers cannot be allocated. */
static int NAME(decode_range)(const Q_T *q, const KV_T *key_cache, const KV_T *value_cache,
                        const int64_t *block_tables, int64_t table_stride, const int64_t *seq_lens,
                        const int64_t *items, int64_t num_items, Q_T *out, int64_t num_heads,
                        int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, int64_t max_len,
                        int64_t head_span) {
    const int64_t groups = num_heads / num_kv_heads, D = head_dim, H = num_heads;
    const int64_t token_stride = num_kv_heads * D, block_stride = block_size * token_stride;
    const int64_t queries = H > MAX_QUERIES ? H : MAX_QUERIES;
    /* scores [queries][max_len]; acc [H][D] */
    float *scores = (float *)malloc(sizeof(float) * (size_t)(queries * max_len));
    float *acc = (float *)malloc(sizeof(float) * (size_t)(H * D));
    float *sums = (float *)malloc(sizeof(float) * (size_t)H);
    float *qi = (float *)malloc(sizeof(float) * (size_t)(H * D)); /* this sequence's query, as float32 */
    float *tile = (float *)malloc(sizeof(float) * (size_t)(VALUE_TILE_ROWS * D)); /* the vector path's K/V rows */
    /* No early return on failure: every thread of the team must reach the `omp for` below. */
    const int ok = scores && acc && sums && qi && tile;
    /* One work item per run of rows (items: first row, row count; rows of a run share a sequence) and span of
     * head_span KV heads, so that even one sequence's heads can share the threads. dynamic: an item's work is its
     * sequence's length. */
    const int64_t spans = (num_kv_heads + head_span - 1) / head_span;
#pragma omp for schedule(dynamic)
    for (int64_t w = 0; w < num_items * spans; w++) {
        if (!ok) continue;
        const int64_t first = items[2 * (w / spans)], count = items[2 * (w / spans) + 1];
        const int64_t g0 = w % spans * head_span, g1 = std::min(num_kv_heads, g0 + head_span);
        const int64_t *table = block_tables + first * table_stride;
        const Q_T *qr = q + first * H * D;
        Q_T *outr = out + first * H * D;
        int64_t g = g0; /* the first KV head left to the portable loop below: g1 where the vector path took all */
#ifdef SLUICE_DECODE_SIMD
        if (count == 1 && NAME(heads_row_simd)(qr, key_cache, value_cache, table, seq_lens[first], outr, g0, g1, H,
                                               num_kv_heads, D, block_size, scale, scores, max_len, acc, sums))
            g = g1;
        while (count > 1 && g < g1 && NAME(rows_head_simd)(qr, key_cache, value_cache, table, seq_lens + first, count,
                                                          outr, g, H, num_kv_heads, D, block_size, scale, scores,
                                                          max_len, tile))
            g++;
#endif
        for (; g < g1; g++) {
            for (int64_t i = first; i < first + count; i++) { /* the portable loop, a row at a time */
                const int64_t len = seq_lens[i];
                const int64_t h0 = g * groups, h1 = h0 + groups; /* the query heads that read KV head g */
                for (int64_t j = h0 * D; j < h1 * D; j++) qi[j] = Q_LOAD(q[i * H * D + j]);
                /* Pass 1: scores, one query head at a time over four tokens at once: four independent sums per d-loop
                 * keep the vector FMAs busy, where one dot product at a time waits on each FMA's latency. */
                for (int64_t hq = h0; hq < h1; hq++) {
                    const float *qh = qi + hq * D;
                    const int64_t head = g * D;
                    float *sc = scores + hq * max_len, m = -INFINITY;
                    int64_t t = 0;
                    for (; t + 4 <= len; t += 4) {
                        const KV_T *k0 = KV_ROW(key_cache, t);
                        const KV_T *k1 = KV_ROW(key_cache, t + 1);
                        const KV_T *k2 = KV_ROW(key_cache, t + 2);
                        const KV_T *k3 = KV_ROW(key_cache, t + 3);
                        float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
                        /* simd: these sums may be reordered (the vector lanes), the one loop that is allowed to. */
    #pragma omp simd reduction(+ : s0, s1, s2, s3)
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
    #pragma omp simd reduction(+ : s)
                        for (int64_t d = 0; d < D; d++) s += qh[d] * LOAD(kt[d]);
                        sc[t] = s * scale;
                    }
                    for (t = 0; t < len; t++) m = sc[t] > m ? sc[t] : m;
                    float sum = 0.f;
                    for (t = 0; t < len; t++) { sc[t] = expf(sc[t] - m); sum += sc[t]; }
                    sums[hq] = sum;
                }
                /* Pass 2: weighted sum of the values, two tokens per update of the head's accumulator. */
                memset(acc + h0 * D, 0, sizeof(float) * (size_t)(groups * D));
                for (int64_t hq = h0; hq < h1; hq++) {
                    const float *sc = scores + hq * max_len;
                    const int64_t head = g * D;
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
                for (int64_t hq = h0; hq < h1; hq++) {
                    const float inv = sums[hq] > 0.f ? 1.f / sums[hq] : 0.f;
                    Q_T *o = out + (i * H + hq) * D;
                    for (int64_t d = 0; d < D; d++) o[d] = Q_STORE(acc[hq * D + d] * inv);
                }
            }
        }
    }
    free(scores); free(acc); free(sums); free(qi); free(tile);
    return !ok;
}

#undef KV_ROW
