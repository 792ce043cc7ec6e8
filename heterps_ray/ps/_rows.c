/* heterps_ray.ps._rows: the compact row store behind heterps_ray.ps.table.SparseTable.
 *
 * Rows live in fixed-size segments (SEG_ROWS rows each, allocated as the table grows and never
 * copied), so growing the table never holds two copies of it. A row is
 *
 *     int64 key | [uint32 count | uint32 last_seen] | float32 w[dim] | float32 acc[acc_width]
 *
 * (count and last_seen only when the table tracks keys: admission, TTL or a row cap). Keys map to
 * rows through an open-addressing index of uint32 row numbers (linear probing, load <= 3/4,
 * backward-shift deletion, so no tombstones); the key itself is read from the row. Freed rows go on
 * a free list and are reused first. Keys not yet admitted are counted in a second store of the same
 * kind with no weights (key | count | last_seen).
 *
 * Numerics match the numpy code they replace, bit for bit (built with -ffp-contract=off: no fused
 * multiply-add): initial rows from splitmix64 of (key, seed) as float64 then float32; gradients of
 * repeated keys summed in float64 in the order given; Adagrad in float32 as torch.optim.Adagrad.
 *
 * Changes (incremental checkpoints): once recording is started (track_changes(0), at a table's
 * first snapshot or restore; off before, so a job without checkpoints pays nothing), every write
 * of a row (insert, push, counters) sets its bit in a dirty bitmap by row number, and every removed
 * key (TTL, eviction, admission of a candidate) is appended to a log. A checkpoint takes them
 * (track_changes(1): dirty bits move to `pending`, the log's entries so far are marked taken) and
 * forgets them only once it is durable (track_changes(2)); a checkpoint that fails to be written
 * leaves them pending, so the next one still carries them.
 *
 * Arrays cross as buffers (no numpy headers needed to build): the Python side allocates the outputs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <errno.h>
#include <pthread.h>
#include <sys/uio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define SEG_SHIFT 16
#define SEG_ROWS ((uint64_t)1 << SEG_SHIFT)
#define SEG_MASK (SEG_ROWS - 1)
#define GOLDEN 0x9E3779B97F4A7C15ULL
#define ADAGRAD_EPS 1e-10f
#define NO_ROW UINT32_MAX

static inline uint64_t mix64(uint64_t x) { /* splitmix64 finaliser of x + golden */
    uint64_t z = x + GOLDEN;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

/* Large blocks (segments, big indexes) are mapped directly and their pages faulted in ahead, a
 * range at a time (MADV_POPULATE_WRITE), instead of one trap per 4 KiB page as rows are written:
 * filling a table otherwise spent more time in page faults than in the table. */
#define BIG_BLOCK ((size_t)1 << 20)
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
static void *big_alloc(size_t size, int populate) { /* zeroed */
    if (size < BIG_BLOCK) return calloc(size, 1);
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return NULL;
    if (populate) madvise(p, size, MADV_POPULATE_WRITE); /* best effort: faults happen anyway */
    return p;
}
static void big_free(void *p, size_t size) {
    if (!p) return;
    if (size < BIG_BLOCK) free(p);
    else munmap(p, size);
}
static void populate(char *start, size_t len) { /* fault in [start, start + len) */
    uintptr_t page = 4096, a = (uintptr_t)start & ~(page - 1), b = ((uintptr_t)start + len + page - 1) & ~(page - 1);
    if (b > a) madvise((void *)a, b - a, MADV_POPULATE_WRITE);
}

/* ------------------------------------------------------------------------------------------ */
/* Store: segmented rows + index + free list                                                     */

typedef struct {
    int dim, acc_w, track;
    size_t row_bytes, w_off;
    char **segs;
    size_t nsegs, segs_cap;
    uint64_t top;  /* row numbers < top have been handed out */
    uint64_t live; /* rows in use */
    uint32_t *free_rows;
    size_t nfree, free_cap;
    uint32_t *slots; /* row + 1; 0: empty */
    uint8_t *tags;   /* per slot: 8 bits of the key's hash (never 0), 0: empty */
    uint64_t cap;    /* slots (power of two) */
    uint64_t removals; /* rows freed so far: a row number is stable while this stays the same */
    uint64_t ready;    /* rows < ready have their pages faulted in */
    /* change recording (see the top of the file) */
    int recording;
    uint64_t *dirty, *pending; /* a bit per row number: written since the last take / taken, not durable */
    size_t bit_words;          /* words of each bitmap: they cover every allocated segment */
    int64_t *removed;          /* keys removed, in order; [0, ntaken) belong to the taken checkpoint */
    size_t nremoved, ntaken, removed_cap;
} store_t;

static int store_init(store_t *s, int dim, int acc_w, int track) {
    memset(s, 0, sizeof(*s));
    s->dim = dim;
    s->acc_w = acc_w;
    s->track = track;
    s->w_off = 8 + (track ? 8 : 0);
    s->row_bytes = s->w_off + 4 * (size_t)(dim + acc_w);
    s->cap = 1024;
    s->slots = big_alloc(s->cap * sizeof(uint32_t), 0);
    s->tags = big_alloc(s->cap, 0);
    return s->slots && s->tags ? 0 : -1;
}

static void store_free(store_t *s) {
    free(s->dirty);
    free(s->pending);
    free(s->removed);
    for (size_t i = 0; i < s->nsegs; i++) big_free(s->segs[i], SEG_ROWS * s->row_bytes);
    free(s->segs);
    free(s->free_rows);
    big_free(s->slots, s->cap * sizeof(uint32_t));
    big_free(s->tags, s->cap);
    memset(s, 0, sizeof(*s));
}

static inline char *row_ptr(const store_t *s, uint32_t r) {
    return s->segs[r >> SEG_SHIFT] + (size_t)(r & SEG_MASK) * s->row_bytes;
}
static inline int64_t row_key(const store_t *s, uint32_t r) {
    int64_t k;
    memcpy(&k, row_ptr(s, r), 8);
    return k;
}
static inline uint32_t *row_meta(const store_t *s, uint32_t r) { /* [count, last_seen] */
    return (uint32_t *)(row_ptr(s, r) + 8);
}
static inline float *row_w(const store_t *s, uint32_t r) { return (float *)(row_ptr(s, r) + s->w_off); }
static inline float *row_acc(const store_t *s, uint32_t r) { return row_w(s, r) + s->dim; }

/* row r takes item j of the caller's weights, accumulators and [count, last_seen] buffers (each may be
   absent: buf NULL); without counters a row is seen once, now */
static void row_from_buffers(store_t *s, uint32_t r, int64_t j, const Py_buffer *wb, const Py_buffer *ab,
                             const Py_buffer *mb, uint32_t step) {
    if (wb->buf) memcpy(row_w(s, r), (const float *)wb->buf + (size_t)j * s->dim, 4 * (size_t)s->dim);
    if (ab->buf) memcpy(row_acc(s, r), (const float *)ab->buf + (size_t)j * s->acc_w, 4 * (size_t)s->acc_w);
    if (s->track) {
        uint32_t *m = row_meta(s, r);
        if (mb->buf) memcpy(m, (const uint32_t *)mb->buf + 2 * (size_t)j, 8);
        else {
            m[0] = 1;
            m[1] = step;
        }
        if (!m[0]) m[0] = 1; /* count 0 marks a free row */
    }
}

/* row r was written (it is below the segments' end, which the bitmaps cover) */
static inline void store_mark(store_t *s, uint32_t r) {
    if (s->recording) s->dirty[r >> 6] |= (uint64_t)1 << (r & 63);
}

/* bitmaps covering `segs` segments (zero-extended) */
static int store_bits_cover(store_t *s, size_t segs) {
    size_t words = segs * (SEG_ROWS / 64);
    if (words <= s->bit_words) return 0;
    uint64_t *d = realloc(s->dirty, words * 8);
    if (!d) return -1;
    s->dirty = d;
    uint64_t *p = realloc(s->pending, words * 8);
    if (!p) return -1;
    s->pending = p;
    memset(d + s->bit_words, 0, (words - s->bit_words) * 8);
    memset(p + s->bit_words, 0, (words - s->bit_words) * 8);
    s->bit_words = words;
    return 0;
}

static size_t store_nbytes(const store_t *s) {
    /* allocated segments count whole, except the last one: only its used rows are touched */
    size_t rows = s->nsegs ? (s->nsegs - 1) * SEG_ROWS + (s->top - (s->nsegs - 1) * SEG_ROWS) : 0;
    return rows * s->row_bytes + s->cap * (sizeof(uint32_t) + 1) + s->free_cap * sizeof(uint32_t) +
           s->segs_cap * sizeof(char *);
}

/* the tag of a hash: its top 8 bits, never 0 (the index's position uses the low bits) */
static inline uint8_t tag_of(uint64_t h) {
    uint8_t t = (uint8_t)(h >> 56);
    return t ? t : 1;
}

/* slot of `key`, or (when absent) the empty slot where it would go; *found = row or NO_ROW.
 * Only slots whose tag matches read the row's key (1 in 255 of the others do). */
static inline uint64_t store_find(const store_t *s, int64_t key, uint32_t *found) {
    uint64_t mask = s->cap - 1, hash = mix64((uint64_t)key), h = hash & mask;
    uint8_t tag = tag_of(hash), t;
    while ((t = s->tags[h])) {
        if (t == tag && row_key(s, s->slots[h] - 1) == key) {
            *found = s->slots[h] - 1;
            return h;
        }
        h = (h + 1) & mask;
    }
    *found = NO_ROW;
    return h;
}

/* row of each of keys[0..n) or NO_ROW, without changing anything. Three passes over the keys so
 * the cache misses of many keys overlap (index slots first, then the rows they point to) instead
 * of one key's misses after another's. */
static void store_lookup_batch(const store_t *s, const int64_t *keys, int64_t n, uint32_t *row) {
    enum { AHEAD = 16 };
    uint64_t mask = s->cap - 1;
    for (int64_t i = 0; i < n + AHEAD; i++) {
        if (i < n) __builtin_prefetch(&s->tags[mix64((uint64_t)keys[i]) & mask]);
        int64_t j = i - AHEAD / 2; /* its tags are in cache by now: fetch the row that matches */
        if (j >= 0 && j < n) {
            uint64_t hash = mix64((uint64_t)keys[j]), h = hash & mask;
            uint8_t tag = tag_of(hash), t;
            while ((t = s->tags[h]) && t != tag) h = (h + 1) & mask;
            if (t) __builtin_prefetch(row_ptr(s, s->slots[h] - 1));
        }
        j = i - AHEAD;
        if (j >= 0) store_find(s, keys[j], &row[j]);
    }
}

/* a bigger index: rows are walked in row order (their keys read in sequence), not slot order */
static int store_grow_index(store_t *s, uint64_t cap) {
    uint32_t *slots = big_alloc(cap * sizeof(uint32_t), 1);
    uint8_t *tags = big_alloc(cap, 1);
    if (!slots || !tags) {
        big_free(slots, cap * sizeof(uint32_t));
        big_free(tags, cap);
        return -1;
    }
    uint64_t mask = cap - 1;
    for (uint64_t r = 0; r < s->top; r++) {
        if (r + 16 < s->top) { /* the slots the row 16 on will probe */
            uint64_t h = mix64((uint64_t)row_key(s, (uint32_t)(r + 16))) & mask;
            __builtin_prefetch(&tags[h], 1);
            __builtin_prefetch(&slots[h], 1);
        }
        /* untracked stores never free a row; a tracked free row has count 0 */
        if (s->track && !row_meta(s, (uint32_t)r)[0]) continue;
        uint64_t hash = mix64((uint64_t)row_key(s, (uint32_t)r)), h = hash & mask;
        while (tags[h]) h = (h + 1) & mask;
        tags[h] = tag_of(hash);
        slots[h] = (uint32_t)r + 1;
    }
    big_free(s->slots, s->cap * sizeof(uint32_t));
    big_free(s->tags, s->cap);
    s->slots = slots;
    s->tags = tags;
    s->cap = cap;
    return 0;
}

static int store_add_segment(store_t *s) {
    if (s->nsegs == s->segs_cap) {
        size_t c = s->segs_cap ? 2 * s->segs_cap : 16;
        char **segs = realloc(s->segs, c * sizeof(char *));
        if (!segs) return -1;
        s->segs = segs;
        s->segs_cap = c;
    }
    if (s->recording && store_bits_cover(s, s->nsegs + 1) < 0) return -1;
    char *seg = big_alloc(SEG_ROWS * s->row_bytes, 0);
    if (!seg) return -1;
    s->segs[s->nsegs++] = seg;
    return 0;
}

/* make room for `extra` more keys: the index (load <= 3/4) and the pages of the rows to come */
static int store_reserve(store_t *s, uint64_t extra) {
    uint64_t need = s->live + extra, cap = s->cap;
    while (4 * need > 3 * cap) cap *= 2;
    if (cap != s->cap && store_grow_index(s, cap) < 0) return -1;
    uint64_t end = s->top + (extra > s->nfree ? extra - s->nfree : 0);
    while (s->ready < end) {
        uint64_t seg = s->ready >> SEG_SHIFT, stop = (seg + 1) << SEG_SHIFT;
        if (stop > end) stop = end;
        if (seg >= s->nsegs && store_add_segment(s) < 0) return -1;
        populate(s->segs[seg] + (s->ready & SEG_MASK) * s->row_bytes, (stop - s->ready) * s->row_bytes);
        s->ready = stop;
    }
    return 0;
}

/* a new row for `key` at the empty slot `slot` (found by store_find after store_reserve) */
static uint32_t store_add(store_t *s, int64_t key, uint64_t slot) {
    uint32_t r;
    if (s->nfree) {
        r = s->free_rows[--s->nfree];
        if (!s->nfree && s->free_cap > 4096) { /* all reused: give the list's memory back */
            free(s->free_rows);
            s->free_rows = NULL;
            s->free_cap = 0;
        }
    } else {
        if (s->top >= (uint64_t)NO_ROW - 1) return NO_ROW;
        if ((s->top >> SEG_SHIFT) >= s->nsegs && store_add_segment(s) < 0) return NO_ROW;
        r = (uint32_t)s->top++;
    }
    memcpy(row_ptr(s, r), &key, 8);
    s->slots[slot] = r + 1;
    s->tags[slot] = tag_of(mix64((uint64_t)key));
    s->live++;
    store_mark(s, r);
    return r;
}

/* remove the key at `slot` (backward-shift deletion) and free its row */
static int store_remove_slot(store_t *s, uint64_t slot) {
    uint64_t mask = s->cap - 1, i = slot, j = slot;
    uint32_t r = s->slots[slot] - 1;
    for (;;) {
        j = (j + 1) & mask;
        uint32_t v = s->slots[j];
        if (!v) break;
        uint64_t k = mix64((uint64_t)row_key(s, v - 1)) & mask;
        /* move v back to i unless its home k lies cyclically in (i, j] */
        int stay = (i <= j) ? (i < k && k <= j) : (i < k || k <= j);
        if (!stay) {
            s->slots[i] = v;
            s->tags[i] = s->tags[j];
            i = j;
        }
    }
    s->slots[i] = 0;
    s->tags[i] = 0;
    if (s->nfree == s->free_cap) {
        size_t c = s->free_cap ? 2 * s->free_cap : 1024;
        uint32_t *f = realloc(s->free_rows, c * sizeof(uint32_t));
        if (!f) return -1;
        s->free_rows = f;
        s->free_cap = c;
    }
    if (s->recording) {
        if (s->nremoved == s->removed_cap) {
            size_t c = s->removed_cap ? 2 * s->removed_cap : 1024;
            int64_t *k = realloc(s->removed, c * sizeof(int64_t));
            if (!k) return -1;
            s->removed = k;
            s->removed_cap = c;
        }
        s->removed[s->nremoved++] = row_key(s, r);
    }
    s->free_rows[s->nfree++] = r;
    s->removals++;
    if (s->track) row_meta(s, r)[0] = 0; /* count 0 marks a free row */
    s->live--;
    return 0;
}

static int store_remove_key(store_t *s, int64_t key) {
    uint32_t r;
    uint64_t slot = store_find(s, key, &r);
    return r == NO_ROW ? 0 : store_remove_slot(s, slot);
}

/* Evict (tracked stores) until at most `target` rows stay: the rows of lowest score go first,
 * score = last_seen (lru) or count (lfu); ties at the cut in row order. Returns rows evicted. */
static int64_t store_evict_to(store_t *s, uint64_t target, int lfu) {
    if (!s->track || s->live <= target) return 0;
    uint64_t drop = s->live - target;
    uint64_t *hist = calloc(65536, sizeof(uint64_t));
    if (!hist) return -1;
    uint32_t hi = 0, cut;
    uint64_t below = 0; /* rows with score < the bin found */
    for (int pass = 0; pass < 2; pass++) {
        memset(hist, 0, 65536 * sizeof(uint64_t));
        for (uint64_t r = 0; r < s->top; r++) {
            uint32_t *m = row_meta(s, (uint32_t)r);
            if (!m[0]) continue;
            uint32_t score = lfu ? m[0] : m[1];
            if (pass == 0) hist[score >> 16]++;
            else if ((score >> 16) == hi) hist[score & 0xFFFF]++;
        }
        uint64_t acc = 0;
        uint32_t b = 0;
        while (acc + hist[b] < drop - below) acc += hist[b++];
        below += acc;
        if (pass == 0) hi = b;
        else cut = (hi << 16) | b;
    }
    free(hist);
    uint64_t ties = drop - below; /* rows of score == cut to drop */
    int64_t evicted = 0;
    for (uint64_t r = 0; r < s->top; r++) {
        uint32_t *m = row_meta(s, (uint32_t)r);
        if (!m[0]) continue;
        uint32_t score = lfu ? m[0] : m[1];
        if (score < cut || (score == cut && ties && ties--)) {
            if (store_remove_key(s, row_key(s, (uint32_t)r)) < 0) return -1;
            evicted++;
        }
    }
    return evicted;
}

/* drop tracked rows whose last_seen + ttl < now */
static int64_t store_expire(store_t *s, uint32_t now, uint32_t ttl) {
    if (!s->track || !ttl) return 0;
    int64_t n = 0;
    for (uint64_t r = 0; r < s->top; r++) {
        uint32_t *m = row_meta(s, (uint32_t)r);
        if (m[0] && (uint64_t)m[1] + ttl < now) {
            if (store_remove_key(s, row_key(s, (uint32_t)r)) < 0) return -1;
            n++;
        }
    }
    return n;
}

/* ------------------------------------------------------------------------------------------ */
/* The table object                                                                             */

typedef struct {
    PyObject_HEAD
    store_t rows, cand;
    int dim, rowwise, track;
    uint64_t seed_mix;
    double scale;
    float lr, init_acc;
    uint32_t admit_after, ttl, lfu;
    uint64_t max_rows;
    uint32_t step;
    int64_t admitted, expired, evicted;
    /* the last creating pull's distinct keys and rows: a push of the same keys right after it (the
     * usual pull, forward, backward, push) reuses the rows instead of looking the keys up again */
    int64_t *last_keys;
    uint32_t *last_rows;
    int64_t last_n, last_cap;
    uint64_t last_removals;
    char *scratch; /* the per-call working arrays, kept between calls (no page churn per call) */
    size_t scratch_cap;
} Rows;

#define ALIGN8(x) (((x) + 7) & ~(size_t)7)

static char *scratch(Rows *t, size_t bytes) {
    if (bytes > t->scratch_cap) {
        free(t->scratch);
        t->scratch = malloc(bytes);
        t->scratch_cap = t->scratch ? bytes : 0;
    }
    return t->scratch;
}

static uint64_t dedup_cap(int64_t n) {
    uint64_t cap = 16;
    while (cap < 2 * (uint64_t)n) cap *= 2;
    return cap;
}

static int remember(Rows *t, const int64_t *keys, const uint32_t *row, int64_t n) {
    if (n > t->last_cap) {
        free(t->last_keys);
        free(t->last_rows);
        t->last_keys = malloc((size_t)n * 8);
        t->last_rows = malloc((size_t)n * 4);
        t->last_cap = t->last_keys && t->last_rows ? n : 0;
        if (!t->last_cap) {
            t->last_n = -1;
            return -1;
        }
    }
    memcpy(t->last_keys, keys, (size_t)n * 8);
    memcpy(t->last_rows, row, (size_t)n * 4);
    t->last_n = n;
    t->last_removals = t->rows.removals;
    return 0;
}

static void forget(Rows *t) {
    free(t->scratch);
    t->scratch = NULL;
    t->scratch_cap = 0;
    free(t->last_keys);
    free(t->last_rows);
    t->last_keys = NULL;
    t->last_rows = NULL;
    t->last_n = -1;
    t->last_cap = 0;
}

static inline int expired(const Rows *t, const store_t *s, uint32_t r) {
    return t->ttl && (uint64_t)row_meta(s, r)[1] + t->ttl < t->step;
}

static void initial_row(const Rows *t, int64_t key, float *out) {
    uint64_t base = mix64((uint64_t)key ^ t->seed_mix);
    for (int c = 0; c < t->dim; c++) {
        uint64_t bits = mix64(base + (uint64_t)(c + 1) * GOLDEN);
        double unit = (double)(int64_t)(bits >> 11) * (1.0 / 9007199254740992.0); /* < 2^53: exact */
        out[c] = (float)((2.0 * unit - 1.0) * t->scale);
    }
}

/* a fresh row (initial weights) for an absent key; NO_ROW when out of memory */
static uint32_t new_row(Rows *t, int64_t key, uint32_t count) {
    uint32_t r;
    uint64_t slot = store_find(&t->rows, key, &r);
    r = store_add(&t->rows, key, slot);
    if (r == NO_ROW) return r;
    initial_row(t, key, row_w(&t->rows, r));
    float *acc = row_acc(&t->rows, r);
    for (int c = 0; c < t->rows.acc_w; c++) acc[c] = t->init_acc;
    if (t->track) {
        uint32_t *m = row_meta(&t->rows, r);
        m[0] = count ? count : 1;
        m[1] = t->step;
    }
    return r;
}

/* Distinct keys of keys[0..n) in order of first occurrence: writes uniq[] and inv[] (n each);
 * returns the number of distinct keys, or -1 when out of memory. */
static int64_t dedup(const int64_t *keys, int64_t n, int64_t *uniq, int64_t *inv, int64_t *tab) {
    uint64_t cap = dedup_cap(n);
    memset(tab, 0xFF, cap * sizeof(int64_t)); /* -1: empty */
    uint64_t mask = cap - 1;
    int64_t nu = 0;
    for (int64_t i = 0; i < n; i++) {
        uint64_t h = mix64((uint64_t)keys[i]) & mask;
        for (;;) {
            int64_t u = tab[h];
            if (u < 0) {
                tab[h] = nu;
                uniq[nu] = keys[i];
                inv[i] = nu++;
                break;
            }
            if (uniq[u] == keys[i]) {
                inv[i] = u;
                break;
            }
            h = (h + 1) & mask;
        }
    }
    return nu;
}

/* before creating up to `n` rows: evict to the cap (1/16 of it more, so sweeps are rare) */
static int make_room(Rows *t, store_t *s, uint64_t n) {
    if (t->max_rows && s->live + n > t->max_rows) {
        uint64_t slack = t->max_rows / 16, target = t->max_rows > n + slack ? t->max_rows - n - slack : 0;
        int64_t e = store_evict_to(s, target, (int)t->lfu);
        if (e < 0) return -1;
        if (s == &t->rows) t->evicted += e;
    }
    return store_reserve(s, n);
}

/* Look up (and, with `create`, count and admit) distinct keys; row[i] = row number, or NO_ROW for
 * a key that reads the default (not admitted, or absent with create off). */
static int resolve(Rows *t, const int64_t *keys, int64_t n, int create, uint32_t *row) {
    if (create) {
        if (make_room(t, &t->rows, (uint64_t)n) < 0) return -1;
        if (t->admit_after > 1 && make_room(t, &t->cand, (uint64_t)n) < 0) return -1;
    }
    store_lookup_batch(&t->rows, keys, n, row);
    uint64_t mask = t->rows.cap - 1, cmask = t->cand.cap - 1;
    for (int64_t i = 0; i < n; i++) {
        int64_t key = keys[i];
        uint32_t r = row[i];
        if (create && i + 16 < n) { /* what the key 16 on will touch: its insert or its counters */
            uint64_t hash = mix64((uint64_t)keys[i + 16]);
            if (row[i + 16] == NO_ROW) {
                __builtin_prefetch(&t->rows.tags[hash & mask], 1);
                __builtin_prefetch(&t->rows.slots[hash & mask], 1);
                if (t->admit_after > 1) __builtin_prefetch(&t->cand.tags[hash & cmask]);
            } else if (t->track) {
                __builtin_prefetch(row_meta(&t->rows, row[i + 16]), 1);
            }
        }
        if (r != NO_ROW && t->track && expired(t, &t->rows, r)) {
            if (!create) {
                row[i] = NO_ROW;
                continue;
            }
            if (store_remove_key(&t->rows, key) < 0) return -1;
            t->expired++;
            r = NO_ROW;
        }
        if (r != NO_ROW) {
            if (create && t->track) {
                uint32_t *m = row_meta(&t->rows, r);
                if (m[0] < UINT32_MAX) m[0]++;
                m[1] = t->step;
                store_mark(&t->rows, r);
            }
            row[i] = r;
            continue;
        }
        if (!create) {
            row[i] = NO_ROW;
            continue;
        }
        uint32_t count = 1;
        if (t->admit_after > 1) {
            uint32_t c;
            uint64_t cs = store_find(&t->cand, key, &c);
            if (c != NO_ROW && expired(t, &t->cand, c)) {
                row_meta(&t->cand, c)[0] = 0 + 1; /* expired: counting starts again */
                row_meta(&t->cand, c)[1] = t->step;
                count = 1;
                store_mark(&t->cand, c);
            } else if (c != NO_ROW) {
                uint32_t *m = row_meta(&t->cand, c);
                count = m[0] + 1;
                m[0] = count;
                m[1] = t->step;
                store_mark(&t->cand, c);
            }
            if (count < t->admit_after) {
                if (c == NO_ROW) {
                    c = store_add(&t->cand, key, cs);
                    if (c == NO_ROW) return -1;
                    row_meta(&t->cand, c)[0] = 1;
                    row_meta(&t->cand, c)[1] = t->step;
                }
                row[i] = NO_ROW;
                continue;
            }
            if (c != NO_ROW && store_remove_slot(&t->cand, cs) < 0) return -1;
            t->admitted++;
        }
        r = new_row(t, key, count);
        if (r == NO_ROW) return -1;
        row[i] = r;
    }
    return 0;
}

static int get_buf(PyObject *obj, Py_buffer *b, int writable, Py_ssize_t itemsize, Py_ssize_t n,
                   const char *what) {
    if (PyObject_GetBuffer(obj, b, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0) return -1;
    if (b->len != itemsize * n) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes, expected %zd", what, b->len, itemsize * n);
        PyBuffer_Release(b);
        return -1;
    }
    return 0;
}

static int Rows_init(Rows *t, PyObject *args, PyObject *kw) {
    static char *names[] = {"dim",   "seed_mix",   "scale", "lr",  "init_accumulator", "rowwise",
                            "track", "admit_after", "ttl",   "max_rows", "lfu", NULL};
    int dim, rowwise, track;
    unsigned long long seed_mix, max_rows;
    double scale, lr, init_acc;
    unsigned int admit_after, ttl, lfu;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iKdddppIIKI", names, &dim, &seed_mix, &scale, &lr, &init_acc,
                                     &rowwise, &track, &admit_after, &ttl, &max_rows, &lfu))
        return -1;
    store_free(&t->rows);
    store_free(&t->cand);
    forget(t);
    t->dim = dim;
    t->rowwise = rowwise;
    t->track = track;
    t->seed_mix = seed_mix;
    t->scale = scale;
    t->lr = (float)lr;
    t->init_acc = (float)init_acc;
    t->admit_after = admit_after;
    t->ttl = ttl;
    t->max_rows = max_rows;
    t->lfu = lfu;
    t->step = 0;
    t->admitted = t->expired = t->evicted = 0;
    if (store_init(&t->rows, dim, rowwise ? 1 : dim, track) < 0 || store_init(&t->cand, 0, 0, 1) < 0) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static void Rows_dealloc(Rows *t) {
    forget(t);
    store_free(&t->rows);
    store_free(&t->cand);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

/* pull(keys int64[n], out float32[n, dim], unique, create, step) */
static PyObject *Rows_pull(Rows *t, PyObject *args) {
    PyObject *ko, *oo;
    int unique, create;
    unsigned int step;
    if (!PyArg_ParseTuple(args, "OOppI", &ko, &oo, &unique, &create, &step)) return NULL;
    Py_buffer kb, ob;
    if (PyObject_GetBuffer(ko, &kb, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    int64_t n = kb.len / 8;
    if (get_buf(oo, &ob, 1, 4 * (Py_ssize_t)t->dim, n, "out") < 0) {
        PyBuffer_Release(&kb);
        return NULL;
    }
    const int64_t *keys = kb.buf;
    float *out = ob.buf;
    int64_t *uniq = NULL, *inv = NULL, nu = n;
    uint32_t *row = NULL;
    int fail = 0;
    if (create) t->step = step;
    size_t nn = (size_t)(n ? n : 1);
    char *mem = scratch(t, nn * 20 + 8 + dedup_cap(n) * 8);
    if (!mem) {
        fail = 1;
    } else {
        row = (uint32_t *)mem;
        uniq = (int64_t *)(mem + ALIGN8(nn * 4));
        inv = uniq + nn;
        if (!unique) nu = dedup(keys, n, uniq, inv, inv + nn);
    }
    if (!fail && row && resolve(t, unique ? keys : uniq, nu, create, row) == 0 &&
        (!create || remember(t, unique ? keys : uniq, row, nu) == 0)) {
        size_t wb = 4 * (size_t)t->dim;
        /* a key without a row: zeros where admission is on, else its initial row (create off) */
        int zeros = t->admit_after > 1;
        for (int64_t i = 0; i < n; i++) {
            int64_t u = unique ? i : inv[i];
            float *o = out + (size_t)i * t->dim;
            if (row[u] != NO_ROW) memcpy(o, row_w(&t->rows, row[u]), wb);
            else if (zeros) memset(o, 0, wb);
            else initial_row(t, unique ? keys[i] : uniq[u], o);
        }
    } else {
        fail = 1;
    }
    PyBuffer_Release(&kb);
    PyBuffer_Release(&ob);
    if (fail) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static void adagrad(Rows *t, uint32_t r, const float *g) {
    float *w = row_w(&t->rows, r), *acc = row_acc(&t->rows, r);
    if (t->rowwise) { /* FBGEMM's exact row-wise Adagrad: one accumulator, mean of g^2 */
        double s = 0.0;
        for (int c = 0; c < t->dim; c++) s += (double)g[c] * (double)g[c];
        float a = acc[0] + (float)(s / t->dim);
        acc[0] = a;
        float mult = t->lr / (sqrtf(a) + ADAGRAD_EPS);
        for (int c = 0; c < t->dim; c++) w[c] -= mult * g[c];
        return;
    }
    for (int c = 0; c < t->dim; c++) {
        float a = acc[c] + g[c] * g[c];
        acc[c] = a;
        w[c] -= (t->lr * g[c]) / (sqrtf(a) + ADAGRAD_EPS);
    }
}

/* push(keys int64[n], grads float32[n, dim], unique) -> keys applied */
static PyObject *Rows_push(Rows *t, PyObject *args) {
    PyObject *ko, *go;
    int unique;
    if (!PyArg_ParseTuple(args, "OOp", &ko, &go, &unique)) return NULL;
    Py_buffer kb, gb;
    if (PyObject_GetBuffer(ko, &kb, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    int64_t n = kb.len / 8;
    if (get_buf(go, &gb, 0, 4 * (Py_ssize_t)t->dim, n, "grads") < 0) {
        PyBuffer_Release(&kb);
        return NULL;
    }
    const int64_t *keys = kb.buf;
    const float *grads = gb.buf;
    int64_t *uniq = NULL, *inv = NULL, nu = n, applied = 0;
    float *summed = NULL;
    int fail = 0;
    int dim = t->dim;
    size_t nn = (size_t)(n ? n : 1);
    char *mem = scratch(t, nn * 20 + 16 + dedup_cap(n) * 8 + (unique ? 0 : nn * dim * 12));
    uint32_t *row = NULL;
    if (!mem) {
        fail = 1;
    } else {
        row = (uint32_t *)mem;
        uniq = (int64_t *)(mem + ALIGN8(nn * 4));
        inv = uniq + nn;
        double *sum = (double *)(inv + nn);
        summed = (float *)(sum + nn * dim);
        if (!unique) {
            nu = dedup(keys, n, uniq, inv, (int64_t *)(mem + ALIGN8((size_t)((char *)(summed + nn * dim) - mem))));
            memset(sum, 0, (size_t)nu * dim * sizeof(double));
            for (int64_t i = 0; i < n; i++) {
                double *s = sum + (size_t)inv[i] * dim;
                const float *g = grads + (size_t)i * dim;
                for (int c = 0; c < dim; c++) s[c] += (double)g[c];
            }
            for (int64_t j = 0; j < nu * dim; j++) summed[j] = (float)sum[j];
        }
    }
    const int64_t *ks = unique ? keys : uniq;
    const float *gs = unique ? grads : summed;
    int known = !fail && nu == t->last_n && t->rows.removals == t->last_removals &&
                memcmp(ks, t->last_keys, (size_t)nu * 8) == 0;
    if (known) {
        memcpy(row, t->last_rows, (size_t)nu * 4);
    } else if (!fail) {
        if (t->admit_after <= 1 && make_room(t, &t->rows, (uint64_t)nu) < 0) fail = 1;
        else store_lookup_batch(&t->rows, ks, nu, row);
    }
    for (int64_t i = 0; !fail && i < nu; i++) {
        uint32_t r = row[i];
        if (!known && r != NO_ROW && t->track && expired(t, &t->rows, r)) {
            if (store_remove_key(&t->rows, ks[i]) < 0) {
                fail = 1;
                break;
            }
            t->expired++;
            r = NO_ROW;
        }
        if (r == NO_ROW) {
            if (t->admit_after > 1) continue; /* not admitted: the default row does not learn */
            /* a push before any pull (e.g. async mode) starts from the initial row */
            r = new_row(t, ks[i], 1);
            if (r == NO_ROW) {
                fail = 1;
                break;
            }
        }
        if (i + 8 < nu && row[i + 8] != NO_ROW) { /* the row 8 keys on, while this one updates */
            char *p = row_ptr(&t->rows, row[i + 8]);
            for (size_t b = 0; b < t->rows.row_bytes; b += 64) __builtin_prefetch(p + b, 1);
        }
        adagrad(t, r, gs + (size_t)i * dim);
        store_mark(&t->rows, r);
        applied++;
    }
    PyBuffer_Release(&kb);
    PyBuffer_Release(&gb);
    if (fail) return PyErr_NoMemory();
    return PyLong_FromLongLong(applied);
}

/* the weights, accumulators and meta buffers of an export of n rows (each None: not wanted) */
static int get_field_bufs(store_t *s, PyObject *wo, PyObject *ao, PyObject *mo, int64_t n, Py_buffer *wb,
                          Py_buffer *ab, Py_buffer *mb) {
    if (wo != Py_None && get_buf(wo, wb, 1, 4 * (Py_ssize_t)s->dim, n, "weights") < 0) return -1;
    if (ao != Py_None && get_buf(ao, ab, 1, 4 * (Py_ssize_t)s->acc_w, n, "accumulators") < 0) return -1;
    if (mo != Py_None && get_buf(mo, mb, 1, 8, n, "meta") < 0) return -1;
    if (mo != Py_None && !s->track) {
        PyErr_SetString(PyExc_ValueError, "this table keeps no counters");
        return -1;
    }
    return 0;
}

static void release_bufs(Py_buffer *kb, Py_buffer *wb, Py_buffer *ab, Py_buffer *mb) {
    PyBuffer_Release(kb);
    if (wb->obj) PyBuffer_Release(wb);
    if (ab->obj) PyBuffer_Release(ab);
    if (mb->obj) PyBuffer_Release(mb);
}

/* row r of store s into position j of the export buffers (weights, accumulators, meta where given) */
static inline void copy_row_out(store_t *s, uint32_t r, int64_t j, Py_buffer *kb, Py_buffer *wb, Py_buffer *ab,
                                Py_buffer *mb) {
    ((int64_t *)kb->buf)[j] = row_key(s, r);
    if (wb->buf) memcpy((float *)wb->buf + (size_t)j * s->dim, row_w(s, r), 4 * (size_t)s->dim);
    if (ab->buf) memcpy((float *)ab->buf + (size_t)j * s->acc_w, row_acc(s, r), 4 * (size_t)s->acc_w);
    if (mb->buf) memcpy((uint32_t *)mb->buf + 2 * (size_t)j, row_meta(s, r), 8);
}

/* export(which, keys int64[n], weights float32[n, dim] | None, acc float32[n, w] | None,
 *        meta uint32[n, 2] | None): which 0 = rows, 1 = candidates; n = live count */
static PyObject *Rows_export(Rows *t, PyObject *args) {
    int which;
    PyObject *ko, *wo, *ao, *mo;
    if (!PyArg_ParseTuple(args, "iOOOO", &which, &ko, &wo, &ao, &mo)) return NULL;
    store_t *s = which ? &t->cand : &t->rows;
    int64_t n = (int64_t)s->live;
    Py_buffer kb, wb = {0}, ab = {0}, mb = {0};
    if (get_buf(ko, &kb, 1, 8, n, "keys") < 0) return NULL;
    int ok = get_field_bufs(s, wo, ao, mo, n, &wb, &ab, &mb) == 0;
    if (ok) {
        int64_t j = 0;
        for (uint64_t i = 0; i < s->cap; i++) {
            uint32_t v = s->slots[i];
            if (!v) continue;
            uint32_t r = v - 1;
            copy_row_out(s, r, j++, &kb, &wb, &ab, &mb);
        }
    }
    release_bufs(&kb, &wb, &ab, &mb);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

/* export_from(which, cursor, keys int64[m], weights float32[m, dim] | None, acc float32[m, w] | None,
 *             meta uint32[m, 2] | None) -> (rows written, next cursor): up to m live rows in row order
 * from row number `cursor` on (start at 0; the store is done when the rows written add up to its
 * live count). Each call walks the same order while the store is unchanged, so a snapshot can stream
 * one field at a time in chunks instead of copying the whole table at once. Row order, not index
 * order: it walks memory in sequence, and it is the order rows were made in, which is random to the
 * hash, so a restore inserting rows in it probes no longer than in any order (index order into a
 * smaller index would pile keys into long runs). */
static PyObject *Rows_export_from(Rows *t, PyObject *args) {
    int which;
    unsigned long long cursor;
    PyObject *ko, *wo, *ao, *mo;
    if (!PyArg_ParseTuple(args, "iKOOOO", &which, &cursor, &ko, &wo, &ao, &mo)) return NULL;
    store_t *s = which ? &t->cand : &t->rows;
    Py_buffer kb, wb = {0}, ab = {0}, mb = {0};
    if (PyObject_GetBuffer(ko, &kb, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) return NULL;
    int64_t m = kb.len / 8;
    int ok = get_field_bufs(s, wo, ao, mo, m, &wb, &ab, &mb) == 0;
    int64_t j = 0;
    uint64_t r64 = cursor;
    if (ok) {
        for (; r64 < s->top && j < m; r64++) {
            uint32_t r = (uint32_t)r64;
            if (s->track) {
                if (!row_meta(s, r)[0]) continue; /* count 0: a free row */
            } else if (s->nfree) {                /* untracked: a free row is one the index does not point to */
                uint32_t found;
                store_find(s, row_key(s, r), &found);
                if (found != r) continue;
            }
            copy_row_out(s, r, j++, &kb, &wb, &ab, &mb);
        }
    }
    release_bufs(&kb, &wb, &ab, &mb);
    if (!ok) return NULL;
    return Py_BuildValue("(LK)", (long long)j, (unsigned long long)r64);
}

/* load(which, keys int64[n], weights | None, acc | None, meta uint32[n, 2] | None): replace the
 * store's contents; raises ValueError on a repeated key */
static PyObject *Rows_load(Rows *t, PyObject *args) {
    int which;
    PyObject *ko, *wo, *ao, *mo;
    if (!PyArg_ParseTuple(args, "iOOOO", &which, &ko, &wo, &ao, &mo)) return NULL;
    store_t *s = which ? &t->cand : &t->rows;
    Py_buffer kb, wb = {0}, ab = {0}, mb = {0};
    if (PyObject_GetBuffer(ko, &kb, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    t->last_n = -1;
    int64_t n = kb.len / 8;
    int ok = 1;
    if (wo != Py_None && get_buf(wo, &wb, 0, 4 * (Py_ssize_t)s->dim, n, "weights") < 0) ok = 0;
    if (ok && ao != Py_None && get_buf(ao, &ab, 0, 4 * (Py_ssize_t)s->acc_w, n, "accumulators") < 0) ok = 0;
    if (ok && mo != Py_None && get_buf(mo, &mb, 0, 8, n, "meta") < 0) ok = 0;
    if (ok) {
        int dim = s->dim, acc_w = s->acc_w, track = s->track;
        store_free(s);
        if (store_init(s, dim, acc_w, track) < 0 || store_reserve(s, (uint64_t)n) < 0) {
            PyErr_NoMemory();
            ok = 0;
        }
    }
    for (int64_t j = 0; ok && j < n; j++) {
        int64_t key = ((const int64_t *)kb.buf)[j];
        uint32_t r;
        uint64_t slot = store_find(s, key, &r);
        if (r != NO_ROW) {
            PyErr_SetString(PyExc_ValueError, "state keys must be distinct");
            ok = 0;
            break;
        }
        r = store_add(s, key, slot);
        if (r == NO_ROW) {
            PyErr_NoMemory();
            ok = 0;
            break;
        }
        row_from_buffers(s, r, j, &wb, &ab, &mb, t->step);
    }
    if (!ok) { /* leave an empty store rather than a partial one */
        int dim = s->dim, acc_w = s->acc_w, track = s->track;
        store_free(s);
        store_init(s, dim, acc_w, track);
    }
    PyBuffer_Release(&kb);
    if (wb.obj) PyBuffer_Release(&wb);
    if (ab.obj) PyBuffer_Release(&ab);
    if (mb.obj) PyBuffer_Release(&mb);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------------------------------ */
/* Changes since the last durable checkpoint                                                     */

static int store_track_start(store_t *s) {
    if (store_bits_cover(s, s->nsegs ? s->nsegs : 1) < 0) return -1;
    memset(s->dirty, 0, s->bit_words * 8);
    memset(s->pending, 0, s->bit_words * 8);
    s->nremoved = s->ntaken = 0;
    s->recording = 1;
    return 0;
}

static uint64_t store_take(store_t *s) { /* -> rows pending (live or not) */
    uint64_t n = 0;
    for (size_t i = 0; i < s->bit_words; i++) {
        s->pending[i] |= s->dirty[i];
        s->dirty[i] = 0;
        n += (uint64_t)__builtin_popcountll(s->pending[i]);
    }
    s->ntaken = s->nremoved;
    return n;
}

static void store_commit(store_t *s) {
    memset(s->pending, 0, s->bit_words * 8);
    memmove(s->removed, s->removed + s->ntaken, (s->nremoved - s->ntaken) * sizeof(int64_t));
    s->nremoved -= s->ntaken;
    s->ntaken = 0;
}

/* track_changes(op): 0 start recording (what the table holds now is the base), 1 take the changes
 * for a checkpoint -> (rows, removed, candidate rows, candidate removed) as upper bounds of what
 * export_changes writes, 2 the taken checkpoint is durable: forget its changes */
static PyObject *Rows_track_changes(Rows *t, PyObject *args) {
    int op;
    if (!PyArg_ParseTuple(args, "i", &op)) return NULL;
    if (op == 0) {
        if (store_track_start(&t->rows) < 0 || store_track_start(&t->cand) < 0) return PyErr_NoMemory();
        Py_RETURN_NONE;
    }
    if (!t->rows.recording) {
        PyErr_SetString(PyExc_RuntimeError, "changes are not recorded (no snapshot or restore yet)");
        return NULL;
    }
    if (op == 1) {
        uint64_t a = store_take(&t->rows), b = store_take(&t->cand);
        return Py_BuildValue("(KnKn)", (unsigned long long)a, (Py_ssize_t)t->rows.ntaken, (unsigned long long)b,
                             (Py_ssize_t)t->cand.ntaken);
    }
    if (op == 2) {
        store_commit(&t->rows);
        store_commit(&t->cand);
        Py_RETURN_NONE;
    }
    PyErr_SetString(PyExc_ValueError, "op must be 0 (start), 1 (take) or 2 (commit)");
    return NULL;
}

/* export_changes(which, keys int64[m], weights | None, acc | None, meta uint32[m, 2] | None,
 *                removed int64[k]) -> rows written: the live rows among the pending ones (m: the
 *                bound track_changes(1) gave) and the taken removed keys (k: exactly as given) */
static PyObject *Rows_export_changes(Rows *t, PyObject *args) {
    int which;
    PyObject *ko, *wo, *ao, *mo, *ro;
    if (!PyArg_ParseTuple(args, "iOOOOO", &which, &ko, &wo, &ao, &mo, &ro)) return NULL;
    store_t *s = which ? &t->cand : &t->rows;
    Py_buffer kb, wb = {0}, ab = {0}, mb = {0}, rb = {0};
    if (PyObject_GetBuffer(ko, &kb, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) return NULL;
    int64_t m = kb.len / 8;
    int ok = 1;
    if (wo != Py_None && get_buf(wo, &wb, 1, 4 * (Py_ssize_t)s->dim, m, "weights") < 0) ok = 0;
    if (ok && ao != Py_None && get_buf(ao, &ab, 1, 4 * (Py_ssize_t)s->acc_w, m, "accumulators") < 0) ok = 0;
    if (ok && mo != Py_None && get_buf(mo, &mb, 1, 8, m, "meta") < 0) ok = 0;
    if (ok && get_buf(ro, &rb, 1, 8, (Py_ssize_t)s->ntaken, "removed") < 0) ok = 0;
    int64_t j = 0;
    if (ok) {
        memcpy(rb.buf, s->removed, s->ntaken * sizeof(int64_t));
        for (size_t w = 0; w < s->bit_words; w++) {
            for (uint64_t bits = s->pending[w]; bits; bits &= bits - 1) {
                uint64_t r64 = w * 64 + (uint64_t)__builtin_ctzll(bits);
                if (r64 >= s->top) break;
                uint32_t r = (uint32_t)r64, found;
                if (s->track && !row_meta(s, r)[0]) continue; /* freed since */
                int64_t key = row_key(s, r);
                store_find(s, key, &found);
                if (found != r) continue; /* freed since (an untracked store, or a key moved) */
                if (j >= m) {
                    PyErr_SetString(PyExc_ValueError, "more changed rows than the bound given");
                    ok = 0;
                    break;
                }
                ((int64_t *)kb.buf)[j] = key;
                if (wb.buf) memcpy((float *)wb.buf + (size_t)j * s->dim, row_w(s, r), 4 * (size_t)s->dim);
                if (ab.buf) memcpy((float *)ab.buf + (size_t)j * s->acc_w, row_acc(s, r), 4 * (size_t)s->acc_w);
                if (mb.buf) memcpy((uint32_t *)mb.buf + 2 * (size_t)j, row_meta(s, r), 8);
                j++;
            }
            if (!ok) break;
        }
    }
    PyBuffer_Release(&kb);
    if (wb.obj) PyBuffer_Release(&wb);
    if (ab.obj) PyBuffer_Release(&ab);
    if (mb.obj) PyBuffer_Release(&mb);
    if (rb.obj) PyBuffer_Release(&rb);
    if (!ok) return NULL;
    return PyLong_FromLongLong(j);
}

/* apply(which, keys int64[n], weights | None, acc | None, meta uint32[n, 2] | None, removed int64[k]):
 * a checkpoint's changes onto the store: the removed keys go, then each row is set (added if absent) */
static PyObject *Rows_apply(Rows *t, PyObject *args) {
    int which;
    PyObject *ko, *wo, *ao, *mo, *ro;
    if (!PyArg_ParseTuple(args, "iOOOOO", &which, &ko, &wo, &ao, &mo, &ro)) return NULL;
    store_t *s = which ? &t->cand : &t->rows;
    Py_buffer kb, rb, wb = {0}, ab = {0}, mb = {0};
    if (PyObject_GetBuffer(ko, &kb, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (PyObject_GetBuffer(ro, &rb, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&kb);
        return NULL;
    }
    t->last_n = -1;
    int64_t n = kb.len / 8, k = rb.len / 8;
    int ok = 1;
    if (wo != Py_None && get_buf(wo, &wb, 0, 4 * (Py_ssize_t)s->dim, n, "weights") < 0) ok = 0;
    if (ok && ao != Py_None && get_buf(ao, &ab, 0, 4 * (Py_ssize_t)s->acc_w, n, "accumulators") < 0) ok = 0;
    if (ok && mo != Py_None && get_buf(mo, &mb, 0, 8, n, "meta") < 0) ok = 0;
    for (int64_t i = 0; ok && i < k; i++)
        if (store_remove_key(s, ((const int64_t *)rb.buf)[i]) < 0) ok = 0;
    if (ok && store_reserve(s, (uint64_t)n) < 0) ok = 0;
    if (!ok && !PyErr_Occurred()) PyErr_NoMemory();
    for (int64_t j = 0; ok && j < n; j++) {
        int64_t key = ((const int64_t *)kb.buf)[j];
        uint32_t r;
        uint64_t slot = store_find(s, key, &r);
        if (r == NO_ROW) r = store_add(s, key, slot);
        if (r == NO_ROW) {
            PyErr_NoMemory();
            ok = 0;
            break;
        }
        row_from_buffers(s, r, j, &wb, &ab, &mb, t->step);
    }
    PyBuffer_Release(&kb);
    PyBuffer_Release(&rb);
    if (wb.obj) PyBuffer_Release(&wb);
    if (ab.obj) PyBuffer_Release(&ab);
    if (mb.obj) PyBuffer_Release(&mb);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------------------------------ */
/* The RAM side of a disk tier (heterps_ray.ps.disk_tier): which keys are here, rows out to disk as
 * whole records (the row's own bytes: key | count | last_seen | w | acc), and records back in.      */

/* has(keys int64[n], found uint8[n], touch): found 1 for the keys with a row here; with `touch`
 * (a tracked store) their last_seen becomes the clock, so a spill made for this call keeps them */
static PyObject *Rows_has(Rows *t, PyObject *args) {
    PyObject *ko, *fo;
    int touch;
    if (!PyArg_ParseTuple(args, "OOp", &ko, &fo, &touch)) return NULL;
    Py_buffer kb, fb;
    if (PyObject_GetBuffer(ko, &kb, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    int64_t n = kb.len / 8;
    if (get_buf(fo, &fb, 1, 1, n, "found") < 0) {
        PyBuffer_Release(&kb);
        return NULL;
    }
    uint32_t *row = (uint32_t *)scratch(t, (size_t)(n ? n : 1) * 4);
    if (row) {
        store_lookup_batch(&t->rows, kb.buf, n, row);
        for (int64_t i = 0; i < n; i++) {
            ((uint8_t *)fb.buf)[i] = row[i] != NO_ROW;
            if (row[i] != NO_ROW && touch && t->track) row_meta(&t->rows, row[i])[1] = t->step;
        }
    }
    PyBuffer_Release(&kb);
    PyBuffer_Release(&fb);
    if (!row) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* spill(target, records uint8[m, row_bytes], keep_now) -> rows spilled: like the cap's eviction (the
 * rows of lowest score go first, score = last_seen or count), but with `keep_now` rows seen at the
 * current clock stay (the call being served needs them), and each row leaves as a record in `records` (m >= live - target)
 * before it is removed. Removals are logged for deltas as any removal (the disk tier reads them). */
static PyObject *Rows_spill(Rows *t, PyObject *args) {
    unsigned long long target;
    PyObject *oo;
    int keep_now;
    if (!PyArg_ParseTuple(args, "KOp", &target, &oo, &keep_now)) return NULL;
    store_t *s = &t->rows;
    if (!s->track) {
        PyErr_SetString(PyExc_ValueError, "spill needs a tracked store (last_seen per row)");
        return NULL;
    }
    Py_buffer ob;
    if (PyObject_GetBuffer(oo, &ob, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) return NULL;
    uint64_t room = (uint64_t)ob.len / s->row_bytes, drop = s->live > target ? s->live - target : 0;
    if (drop > room) drop = room;
    uint64_t *hist = drop ? calloc(65536, sizeof(uint64_t)) : NULL;
    if (drop && !hist) {
        PyBuffer_Release(&ob);
        return PyErr_NoMemory();
    }
    uint32_t hi = 0, cut = 0;
    uint64_t below = 0, candidates = 0;
    for (int pass = 0; drop && pass < 2; pass++) { /* the score at the cut, in two 16-bit passes */
        memset(hist, 0, 65536 * sizeof(uint64_t));
        for (uint64_t r = 0; r < s->top; r++) {
            uint32_t *m = row_meta(s, (uint32_t)r);
            if (!m[0] || (keep_now && m[1] == t->step)) continue;
            uint32_t score = t->lfu ? m[0] : m[1];
            if (pass == 0) {
                hist[score >> 16]++;
                candidates++;
            } else if ((score >> 16) == hi) {
                hist[score & 0xFFFF]++;
            }
        }
        if (pass == 0 && candidates < drop) drop = candidates;
        if (!drop) break;
        uint64_t acc = 0;
        uint32_t b = 0;
        while (b < 65535 && acc + hist[b] < drop - below) acc += hist[b++];
        below += acc;
        if (pass == 0) hi = b;
        else cut = (hi << 16) | b;
    }
    free(hist);
    uint64_t ties = drop - below, out = 0;
    for (uint64_t r = 0; drop && r < s->top && out < drop; r++) {
        uint32_t *m = row_meta(s, (uint32_t)r);
        if (!m[0] || (keep_now && m[1] == t->step)) continue;
        uint32_t score = t->lfu ? m[0] : m[1];
        if (score < cut || (score == cut && ties && ties--)) {
            memcpy((char *)ob.buf + out * s->row_bytes, row_ptr(s, (uint32_t)r), s->row_bytes);
            out++;
            if (store_remove_key(s, row_key(s, (uint32_t)r)) < 0) {
                PyBuffer_Release(&ob);
                return PyErr_NoMemory();
            }
        }
    }
    t->last_n = -1;
    PyBuffer_Release(&ob);
    return PyLong_FromUnsignedLongLong(out);
}

/* insert(records uint8[n, row_bytes]): rows back from disk, each its record's bytes exactly (key,
 * counters, weights, accumulators); a key already here is overwritten. Marked changed for deltas. */
static PyObject *Rows_insert(Rows *t, PyObject *args) {
    PyObject *ro;
    if (!PyArg_ParseTuple(args, "O", &ro)) return NULL;
    store_t *s = &t->rows;
    Py_buffer rb;
    if (PyObject_GetBuffer(ro, &rb, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (rb.len % (Py_ssize_t)s->row_bytes) {
        PyErr_Format(PyExc_ValueError, "records: %zd bytes, not a multiple of the row's %zu", rb.len, s->row_bytes);
        PyBuffer_Release(&rb);
        return NULL;
    }
    int64_t n = rb.len / (Py_ssize_t)s->row_bytes;
    int ok = store_reserve(s, (uint64_t)n) == 0;
    for (int64_t j = 0; ok && j < n; j++) {
        const char *rec = (const char *)rb.buf + (size_t)j * s->row_bytes;
        int64_t key;
        memcpy(&key, rec, 8);
        uint32_t r;
        uint64_t slot = store_find(s, key, &r);
        if (r == NO_ROW) r = store_add(s, key, slot);
        if (r == NO_ROW) {
            ok = 0;
            break;
        }
        memcpy(row_ptr(s, r), rec, s->row_bytes);
        store_mark(s, r);
    }
    PyBuffer_Release(&rb);
    if (!ok) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* repack() -> segments returned: where at least a segment's worth of rows and a quarter of the rows
 * handed out are free, the live rows above `live` move down into the free rows below it, so rows
 * [0, live) are in use, and the segments above go back to the system. A disk tier calls it when its
 * RAM share shrinks (the index of the rows on disk grew): freed rows are otherwise only reused. A
 * moved row is marked changed (the next delta carries it). */
static PyObject *Rows_repack(Rows *t, PyObject *Py_UNUSED(ignored)) {
    store_t *s = &t->rows;
    uint64_t live = s->live, top = s->top;
    if (!s->track || top - live < SEG_ROWS || 4 * (top - live) < top) return PyLong_FromLong(0);
    uint64_t hi = top;
    for (size_t i = 0; i < s->nfree; i++) {
        uint32_t f = s->free_rows[i];
        if (f >= live) continue;
        while (hi > live && !row_meta(s, (uint32_t)(hi - 1))[0]) hi--;
        uint32_t r = (uint32_t)(hi - 1), found;
        uint64_t slot = store_find(s, row_key(s, r), &found);
        memcpy(row_ptr(s, f), row_ptr(s, r), s->row_bytes);
        s->slots[slot] = f + 1;
        row_meta(s, r)[0] = 0;
        store_mark(s, f);
        hi--;
    }
    free(s->free_rows);
    s->free_rows = NULL;
    s->nfree = s->free_cap = 0;
    s->top = live;
    size_t keep = (size_t)((live + SEG_ROWS - 1) >> SEG_SHIFT), freed = s->nsegs > keep ? s->nsegs - keep : 0;
    for (size_t i = keep; i < s->nsegs; i++) big_free(s->segs[i], SEG_ROWS * s->row_bytes);
    s->nsegs = keep;
    if (keep && (live & SEG_MASK)) { /* the last segment's pages above `live`: returned too */
        uintptr_t page = 4096, a = ((uintptr_t)row_ptr(s, (uint32_t)live) + page - 1) & ~(page - 1);
        uintptr_t b = (uintptr_t)s->segs[keep - 1] + SEG_ROWS * s->row_bytes;
        if (b > a) madvise((void *)a, b - a, MADV_DONTNEED);
    }
    if (s->ready > live) s->ready = live;
    for (uint64_t r = live; r < (uint64_t)s->bit_words * 64; r++) { /* no row above `live` is changed */
        s->dirty[r >> 6] &= ~((uint64_t)1 << (r & 63));
        s->pending[r >> 6] &= ~((uint64_t)1 << (r & 63));
    }
    s->removals++; /* row numbers changed: the pull -> push reuse of rows is off */
    t->last_n = -1;
    return PyLong_FromSize_t(freed);
}

/* Reads in flight. A call's records are first read from the page cache alone (preadv2 with
 * RWF_NOWAIT: a record whose pages are not cached is left, not waited for), on the calling thread:
 * a cached read takes a microsecond, less than starting a thread. The records left wait on the device,
 * so they are split into `depth` runs of consecutive ones, each read by a thread of its own: up to
 * `depth` reads wait on the device at once (one at a time, a disk tier read 32.6k rows/s here).
 * Where the kernel has no RWF_NOWAIT every record is left to the threads. io_uring would keep as many
 * in flight from one thread; containers often forbid it, and these need nothing but pthreads. */
#define PREAD_MIN_PER_THREAD 4
#define PREAD_MAX_THREADS 256

typedef struct {
    int fd;
    const int64_t *offsets;
    const int64_t *which; /* the records this run reads: which[begin..end) */
    char *out;
    size_t size;
    int64_t begin, end, bad; /* bad: the first record that read short, or -1 */
} PreadRun;

static void *pread_run(void *arg) {
    PreadRun *run = (PreadRun *)arg;
    for (int64_t j = run->begin; j < run->end; j++) {
        int64_t i = run->which[j];
        if (pread(run->fd, run->out + (size_t)i * run->size, run->size, (off_t)run->offsets[i]) !=
            (ssize_t)run->size) {
            run->bad = i;
            break;
        }
    }
    return NULL;
}

/* The records [0, n) that the page cache does not hold whole, into `left`; their count. */
static int64_t read_cached(int fd, const int64_t *offsets, char *out, size_t size, int64_t n, int64_t *left) {
    int64_t count = 0;
    int nowait = 1;
    for (int64_t i = 0; i < n; i++) {
        if (nowait) {
            struct iovec iov = {out + (size_t)i * size, size};
            ssize_t got = preadv2(fd, &iov, 1, (off_t)offsets[i], RWF_NOWAIT);
            if (got == (ssize_t)size) continue;
            if (got < 0 && errno != EAGAIN) nowait = 0; /* no RWF_NOWAIT here: the threads read all */
        }
        left[count++] = i;
    }
    return count;
}

/* Reads records [0, n), those not cached with up to `depth` threads; the first record that read
 * short, or -1; -2 where memory for the list ran out. */
static int64_t pread_all(int fd, const int64_t *offsets, char *out, size_t size, int64_t n, int depth) {
    int64_t *left = malloc((size_t)(n ? n : 1) * sizeof(int64_t));
    if (!left) return -2;
    int64_t pending = read_cached(fd, offsets, out, size, n, left);
    int64_t threads = pending / PREAD_MIN_PER_THREAD;
    if (threads > depth) threads = depth;
    if (threads > PREAD_MAX_THREADS) threads = PREAD_MAX_THREADS;
    int64_t bad = -1;
    if (threads < 2) {
        PreadRun one = {fd, offsets, left, out, size, 0, pending, -1};
        pread_run(&one);
        bad = one.bad;
    } else {
        PreadRun runs[PREAD_MAX_THREADS];
        pthread_t ids[PREAD_MAX_THREADS];
        int started[PREAD_MAX_THREADS];
        for (int64_t t = 0; t < threads; t++) {
            runs[t] = (PreadRun){fd, offsets, left, out, size, pending * t / threads, pending * (t + 1) / threads, -1};
            started[t] = pthread_create(&ids[t], NULL, pread_run, &runs[t]) == 0;
            if (!started[t]) pread_run(&runs[t]); /* no thread left: this one reads the run itself */
        }
        for (int64_t t = 0; t < threads; t++) {
            if (started[t]) pthread_join(ids[t], NULL);
            if (runs[t].bad >= 0 && (bad < 0 || runs[t].bad < bad)) bad = runs[t].bad;
        }
    }
    free(left);
    return bad;
}

/* pread_records(fd, offsets int64[n], out uint8[n, record_bytes], depth=1): record i from file offset
 * offsets[i], without the GIL, up to `depth` reads in flight (the rows of a disk tier; a short read
 * raises). Offsets in ascending order keep each thread's reads close together on the device. */
static PyObject *pread_records(PyObject *Py_UNUSED(module), PyObject *args) {
    int fd, depth = 1;
    PyObject *oo, *bo;
    if (!PyArg_ParseTuple(args, "iOO|i", &fd, &oo, &bo, &depth)) return NULL;
    if (depth < 1) {
        PyErr_Format(PyExc_ValueError, "depth: expected at least 1 read in flight, got %d", depth);
        return NULL;
    }
    Py_buffer ob, bb;
    if (PyObject_GetBuffer(oo, &ob, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (PyObject_GetBuffer(bo, &bb, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&ob);
        return NULL;
    }
    int64_t n = ob.len / 8, bad = -1;
    size_t size = n ? (size_t)bb.len / (size_t)n : 0;
    const int64_t *offsets = (const int64_t *)ob.buf;
    if (n && (size_t)bb.len != size * (size_t)n) {
        PyErr_SetString(PyExc_ValueError, "out: not n records");
    } else {
        Py_BEGIN_ALLOW_THREADS
        bad = pread_all(fd, offsets, (char *)bb.buf, size, n, depth);
        Py_END_ALLOW_THREADS
        if (bad == -2)
            PyErr_NoMemory();
        else if (bad >= 0)
            PyErr_Format(PyExc_OSError, "short read of record %lld at offset %lld", (long long)bad,
                         (long long)offsets[bad]);
    }
    PyBuffer_Release(&ob);
    PyBuffer_Release(&bb);
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------------------------------ */
/* Rows by number: the index of a tier above this store (heterps_ray.ps.device_table)             */

/* rows(keys int64[n], out int64[n], create): each key's row number, or -1 for an absent key. With
 * `create` (distinct keys; an untracked store without admission, used as a plain index) absent keys
 * get rows first. A lookup (create off) runs without the GIL: the caller keeps writers out (lookups
 * may run at once). */
static PyObject *Rows_rows(Rows *t, PyObject *args) {
    PyObject *ko, *oo;
    int create;
    if (!PyArg_ParseTuple(args, "OOp", &ko, &oo, &create)) return NULL;
    if (create && (t->track || t->admit_after > 1)) {
        PyErr_SetString(PyExc_ValueError, "rows(create=True) needs a store without admission or counters");
        return NULL;
    }
    Py_buffer kb, ob;
    if (PyObject_GetBuffer(ko, &kb, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    int64_t n = kb.len / 8;
    if (get_buf(oo, &ob, 1, 8, n, "out") < 0) {
        PyBuffer_Release(&kb);
        return NULL;
    }
    const int64_t *keys = kb.buf;
    int64_t *out = ob.buf;
    /* a buffer of the call's own, not the object's scratch: lookups may run in several threads at once */
    uint32_t *row = malloc((size_t)(n ? n : 1) * 4);
    int fail = row == NULL;
    if (!fail && create) {
        t->last_n = -1;
        fail = resolve(t, keys, n, 1, row) < 0;
    } else if (!fail) {
        Py_BEGIN_ALLOW_THREADS
        store_lookup_batch(&t->rows, keys, n, row);
        Py_END_ALLOW_THREADS
    }
    for (int64_t i = 0; !fail && i < n; i++) out[i] = row[i] == NO_ROW ? -1 : (int64_t)row[i];
    free(row);
    PyBuffer_Release(&kb);
    PyBuffer_Release(&ob);
    if (fail) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* get(keys int64[n], weights float32[n, dim], acc float32[n, acc_w], found uint8[n]): the rows of the
 * keys present (found 1), nothing written for the others (found 0); counters and the clock unchanged */
static PyObject *Rows_get(Rows *t, PyObject *args) {
    PyObject *ko, *wo, *ao, *fo;
    if (!PyArg_ParseTuple(args, "OOOO", &ko, &wo, &ao, &fo)) return NULL;
    Py_buffer kb, wb = {0}, ab = {0}, fb = {0};
    if (PyObject_GetBuffer(ko, &kb, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    int64_t n = kb.len / 8;
    int ok = get_buf(wo, &wb, 1, 4 * (Py_ssize_t)t->rows.dim, n, "weights") == 0 &&
             get_buf(ao, &ab, 1, 4 * (Py_ssize_t)t->rows.acc_w, n, "accumulators") == 0 &&
             get_buf(fo, &fb, 1, 1, n, "found") == 0;
    uint32_t *row = ok ? (uint32_t *)scratch(t, (size_t)(n ? n : 1) * 4) : NULL;
    if (ok && !row) {
        PyErr_NoMemory();
        ok = 0;
    }
    if (ok) {
        store_lookup_batch(&t->rows, kb.buf, n, row);
        size_t wbytes = 4 * (size_t)t->rows.dim, abytes = 4 * (size_t)t->rows.acc_w;
        for (int64_t i = 0; i < n; i++) {
            uint8_t hit = row[i] != NO_ROW && !(t->track && expired(t, &t->rows, row[i]));
            ((uint8_t *)fb.buf)[i] = hit;
            if (!hit) continue;
            memcpy((char *)wb.buf + (size_t)i * wbytes, row_w(&t->rows, row[i]), wbytes);
            memcpy((char *)ab.buf + (size_t)i * abytes, row_acc(&t->rows, row[i]), abytes);
        }
    }
    PyBuffer_Release(&kb);
    if (wb.obj) PyBuffer_Release(&wb);
    if (ab.obj) PyBuffer_Release(&ab);
    if (fb.obj) PyBuffer_Release(&fb);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

/* set(keys int64[n], weights float32[n, dim], acc float32[n, acc_w]) -> keys absent: the weights and
 * accumulators of the keys present are replaced (a tier above writing its rows back), each row marked
 * changed for the next delta checkpoint; counters unchanged, absent keys skipped */
static PyObject *Rows_set(Rows *t, PyObject *args) {
    PyObject *ko, *wo, *ao;
    if (!PyArg_ParseTuple(args, "OOO", &ko, &wo, &ao)) return NULL;
    Py_buffer kb, wb = {0}, ab = {0};
    if (PyObject_GetBuffer(ko, &kb, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    int64_t n = kb.len / 8, absent = 0;
    int ok = get_buf(wo, &wb, 0, 4 * (Py_ssize_t)t->rows.dim, n, "weights") == 0 &&
             get_buf(ao, &ab, 0, 4 * (Py_ssize_t)t->rows.acc_w, n, "accumulators") == 0;
    uint32_t *row = ok ? (uint32_t *)scratch(t, (size_t)(n ? n : 1) * 4) : NULL;
    if (ok && !row) {
        PyErr_NoMemory();
        ok = 0;
    }
    if (ok) {
        store_lookup_batch(&t->rows, kb.buf, n, row);
        size_t wbytes = 4 * (size_t)t->rows.dim, abytes = 4 * (size_t)t->rows.acc_w;
        for (int64_t i = 0; i < n; i++) {
            if (row[i] == NO_ROW) {
                absent++;
                continue;
            }
            memcpy(row_w(&t->rows, row[i]), (const char *)wb.buf + (size_t)i * wbytes, wbytes);
            memcpy(row_acc(&t->rows, row[i]), (const char *)ab.buf + (size_t)i * abytes, abytes);
            store_mark(&t->rows, row[i]);
        }
    }
    PyBuffer_Release(&kb);
    if (wb.obj) PyBuffer_Release(&wb);
    if (ab.obj) PyBuffer_Release(&ab);
    if (!ok) return NULL;
    return PyLong_FromLongLong(absent);
}

/* expire(): drop expired rows and candidates now (lookups already ignore them) -> rows dropped */
static PyObject *Rows_expire(Rows *t, PyObject *Py_UNUSED(ignored)) {
    int64_t a = store_expire(&t->rows, t->step, t->ttl);
    int64_t b = a < 0 ? -1 : store_expire(&t->cand, t->step, t->ttl);
    if (a < 0 || b < 0) return PyErr_NoMemory();
    t->expired += a;
    return PyLong_FromLongLong(a);
}

static PyObject *Rows_info(Rows *t, PyObject *Py_UNUSED(ignored)) {
    return Py_BuildValue("{s:K,s:K,s:n,s:n,s:I,s:L,s:L,s:L,s:n,s:n,s:K}", "rows", (unsigned long long)t->rows.live,
                         "candidates", (unsigned long long)t->cand.live, "bytes",
                         (Py_ssize_t)(store_nbytes(&t->rows) + (t->admit_after > 1 ? store_nbytes(&t->cand) : 0)),
                         "row_bytes", (Py_ssize_t)t->rows.row_bytes, "step", t->step, "admitted",
                         (long long)t->admitted, "expired", (long long)t->expired, "evicted",
                         (long long)t->evicted, "index_slots", (Py_ssize_t)t->rows.cap, "recording",
                         (Py_ssize_t)t->rows.recording, "removals", (unsigned long long)t->rows.removals);
}

/* set_clock(step): the step of the last creating pull (a state's, when one is loaded) */
static PyObject *Rows_set_clock(Rows *t, PyObject *args) {
    unsigned int step;
    if (!PyArg_ParseTuple(args, "I", &step)) return NULL;
    t->step = step;
    Py_RETURN_NONE;
}

static Py_ssize_t Rows_len(Rows *t) { return (Py_ssize_t)t->rows.live; }

/* ------------------------------------------------------------------------------------------ */
/* Distinct counting for datasets' _meta.json (heterps_ray.data.writer.DistinctCounter)           */

static inline uint64_t hash_bytes(const uint8_t *p, int64_t n) {
    uint64_t h = 0x243F6A8885A308D3ULL ^ (uint64_t)n, w;
    for (; n >= 8; p += 8, n -= 8) {
        memcpy(&w, p, 8);
        h = mix64(h ^ w);
    }
    w = 0;
    memcpy(&w, p, (size_t)n);
    return mix64(h ^ w);
}

/* hll_add_strings(registers uint8[2^p], p, offsets int32 buffer, data buffer | None,
 *                 validity buffer | None, offset, length): add the values of an Arrow string array
 *                 (a null counts as the empty string) to HyperLogLog registers */
static PyObject *hll_add_strings(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *ro, *oo, *dob, *vo;
    int p;
    Py_ssize_t offset, length;
    if (!PyArg_ParseTuple(args, "OiOOOnn", &ro, &p, &oo, &dob, &vo, &offset, &length)) return NULL;
    if (p < 4 || p > 20) {
        PyErr_SetString(PyExc_ValueError, "p must be in [4, 20]");
        return NULL;
    }
    Py_buffer rb, ob, db = {0}, vb = {0};
    if (get_buf(ro, &rb, 1, 1, (Py_ssize_t)1 << p, "registers") < 0) return NULL;
    if (PyObject_GetBuffer(oo, &ob, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&rb);
        return NULL;
    }
    int ok = 1;
    if (dob != Py_None && PyObject_GetBuffer(dob, &db, PyBUF_SIMPLE) < 0) ok = 0;
    if (ok && vo != Py_None && PyObject_GetBuffer(vo, &vb, PyBUF_SIMPLE) < 0) ok = 0;
    if (ok && ob.len < (offset + length + 1) * 4) {
        PyErr_SetString(PyExc_ValueError, "offsets buffer too short");
        ok = 0;
    }
    if (ok && vb.buf && vb.len * 8 < offset + length) {
        PyErr_SetString(PyExc_ValueError, "validity buffer too short");
        ok = 0;
    }
    if (ok) {
        const int32_t *off = (const int32_t *)ob.buf + offset;
        static const uint8_t empty[8] = {0};
        const uint8_t *data = db.buf ? (const uint8_t *)db.buf : empty, *valid = vb.buf;
        uint8_t *reg = rb.buf;
        if (length && (off[length] > db.len || off[0] < 0)) {
            PyErr_SetString(PyExc_ValueError, "data buffer too short");
            ok = 0;
        }
        for (Py_ssize_t i = 0; ok && i < length; i++) {
            Py_ssize_t bit = offset + i;
            int present = !valid || (valid[bit >> 3] >> (bit & 7)) & 1;
            uint64_t h = present ? hash_bytes(data + off[i], off[i + 1] - off[i]) : hash_bytes(empty, 0);
            uint64_t idx = h >> (64 - p), rest = (h << p) | ((uint64_t)1 << (p - 1));
            uint8_t rank = (uint8_t)(__builtin_clzll(rest) + 1);
            if (rank > reg[idx]) reg[idx] = rank;
        }
    }
    PyBuffer_Release(&rb);
    PyBuffer_Release(&ob);
    if (db.obj) PyBuffer_Release(&db);
    if (vb.obj) PyBuffer_Release(&vb);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------------------------------ */
/* Key hashing of categorical values (heterps_ray.data.criteo.hash_slot)                          */

#define SIP_ROTL(x, b) (uint64_t)(((x) << (b)) | ((x) >> (64 - (b))))
#define SIP_ROUND                                                                                 \
    do {                                                                                          \
        v0 += v1; v1 = SIP_ROTL(v1, 13); v1 ^= v0; v0 = SIP_ROTL(v0, 32);                         \
        v2 += v3; v3 = SIP_ROTL(v3, 16); v3 ^= v2;                                                \
        v0 += v3; v3 = SIP_ROTL(v3, 21); v3 ^= v0;                                                \
        v2 += v1; v1 = SIP_ROTL(v1, 17); v1 ^= v2; v2 = SIP_ROTL(v2, 32);                         \
    } while (0)

static inline uint64_t load_le64(const uint8_t *p) {
    return (uint64_t)p[0] | (uint64_t)p[1] << 8 | (uint64_t)p[2] << 16 | (uint64_t)p[3] << 24 |
           (uint64_t)p[4] << 32 | (uint64_t)p[5] << 40 | (uint64_t)p[6] << 48 | (uint64_t)p[7] << 56;
}

/* SipHash-2-4 with a 64-bit result (Aumasson & Bernstein's reference; what pandas' hash_array
 * computes for a string, before its own final mixing) */
static uint64_t siphash24(const uint8_t *in, int64_t len, uint64_t k0, uint64_t k1) {
    uint64_t v0 = 0x736f6d6570736575ULL ^ k0, v1 = 0x646f72616e646f6dULL ^ k1;
    uint64_t v2 = 0x6c7967656e657261ULL ^ k0, v3 = 0x7465646279746573ULL ^ k1;
    uint64_t b = (uint64_t)len << 56;
    const uint8_t *end = in + (len - (len & 7));
    for (; in != end; in += 8) {
        uint64_t m = load_le64(in);
        v3 ^= m;
        SIP_ROUND;
        SIP_ROUND;
        v0 ^= m;
    }
    switch (len & 7) {
    case 7: b |= (uint64_t)in[6] << 48; /* fall through */
    case 6: b |= (uint64_t)in[5] << 40; /* fall through */
    case 5: b |= (uint64_t)in[4] << 32; /* fall through */
    case 4: b |= (uint64_t)in[3] << 24; /* fall through */
    case 3: b |= (uint64_t)in[2] << 16; /* fall through */
    case 2: b |= (uint64_t)in[1] << 8;  /* fall through */
    case 1: b |= (uint64_t)in[0]; break;
    case 0: break;
    }
    v3 ^= b;
    SIP_ROUND;
    SIP_ROUND;
    v0 ^= b;
    v2 ^= 0xff;
    SIP_ROUND;
    SIP_ROUND;
    SIP_ROUND;
    SIP_ROUND;
    return v0 ^ v1 ^ v2 ^ v3;
}

/* siphash_strings(out uint64[length], key bytes[16], offsets int32 buffer, data buffer | None,
 *                 offset, length): SipHash-2-4 of each value of an Arrow string array without
 *                 nulls (its UTF-8 bytes), without the GIL: the reader thread hashes while the
 *                 training thread runs */
static PyObject *siphash_strings(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *out_o, *oo, *dob;
    const char *key;
    Py_ssize_t key_len, offset, length;
    if (!PyArg_ParseTuple(args, "Oy#OOnn", &out_o, &key, &key_len, &oo, &dob, &offset, &length)) return NULL;
    if (key_len != 16 || offset < 0 || length < 0) {
        PyErr_SetString(PyExc_ValueError, "need a 16-byte key, offset >= 0, length >= 0");
        return NULL;
    }
    Py_buffer outb, ob, db = {0};
    if (get_buf(out_o, &outb, 1, 8, length, "out") < 0) return NULL;
    if (PyObject_GetBuffer(oo, &ob, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&outb);
        return NULL;
    }
    int ok = 1;
    if (dob != Py_None && PyObject_GetBuffer(dob, &db, PyBUF_SIMPLE) < 0) ok = 0;
    if (ok && ob.len < (offset + length + 1) * 4) {
        PyErr_SetString(PyExc_ValueError, "offsets buffer too short");
        ok = 0;
    }
    const int32_t *off = (const int32_t *)ob.buf + offset;
    if (ok && length && (off[0] < 0 || off[length] > db.len || off[length] < off[0])) {
        PyErr_SetString(PyExc_ValueError, "data buffer too short");
        ok = 0;
    }
    if (ok) {
        static const uint8_t empty[8] = {0};
        const uint8_t *data = db.buf ? (const uint8_t *)db.buf : empty;
        const uint64_t k0 = load_le64((const uint8_t *)key), k1 = load_le64((const uint8_t *)key + 8);
        uint64_t *res = outb.buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < length; i++) {
            int64_t n = off[i + 1] - off[i];
            res[i] = siphash24(n > 0 ? data + off[i] : empty, n > 0 ? n : 0, k0, k1);
        }
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&outb);
    PyBuffer_Release(&ob);
    if (db.obj) PyBuffer_Release(&db);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"hll_add_strings", hll_add_strings, METH_VARARGS,
     "hll_add_strings(registers, p, offsets, data, validity, offset, length)"},
    {"siphash_strings", siphash_strings, METH_VARARGS,
     "siphash_strings(out, key, offsets, data, offset, length)"},
    {"pread_records", pread_records, METH_VARARGS, "pread_records(fd, offsets, out, depth=1)"},
    {NULL, NULL, 0, NULL},
};

static PyMethodDef Rows_methods[] = {
    {"pull", (PyCFunction)Rows_pull, METH_VARARGS, "pull(keys, out, unique, create, step)"},
    {"push", (PyCFunction)Rows_push, METH_VARARGS, "push(keys, grads, unique) -> keys applied"},
    {"export", (PyCFunction)Rows_export, METH_VARARGS, "export(which, keys, weights, acc, meta)"},
    {"export_from", (PyCFunction)Rows_export_from, METH_VARARGS,
     "export_from(which, cursor, keys, weights, acc, meta) -> (rows written, next cursor)"},
    {"load", (PyCFunction)Rows_load, METH_VARARGS, "load(which, keys, weights, acc, meta)"},
    {"expire", (PyCFunction)Rows_expire, METH_NOARGS, "drop expired rows -> count"},
    {"info", (PyCFunction)Rows_info, METH_NOARGS, "sizes and counters"},
    {"set_clock", (PyCFunction)Rows_set_clock, METH_VARARGS, "set_clock(step)"},
    {"track_changes", (PyCFunction)Rows_track_changes, METH_VARARGS, "track_changes(0 start | 1 take | 2 commit)"},
    {"export_changes", (PyCFunction)Rows_export_changes, METH_VARARGS,
     "export_changes(which, keys, weights, acc, meta, removed) -> rows written"},
    {"rows", (PyCFunction)Rows_rows, METH_VARARGS, "rows(keys, out, create): row numbers, -1 absent"},
    {"get", (PyCFunction)Rows_get, METH_VARARGS, "get(keys, weights, acc, found)"},
    {"set", (PyCFunction)Rows_set, METH_VARARGS, "set(keys, weights, acc) -> keys absent"},
    {"apply", (PyCFunction)Rows_apply, METH_VARARGS, "apply(which, keys, weights, acc, meta, removed)"},
    {"has", (PyCFunction)Rows_has, METH_VARARGS, "has(keys, found, touch)"},
    {"spill", (PyCFunction)Rows_spill, METH_VARARGS, "spill(target, records, keep_now) -> rows spilled"},
    {"insert", (PyCFunction)Rows_insert, METH_VARARGS, "insert(records)"},
    {"repack", (PyCFunction)Rows_repack, METH_NOARGS, "repack() -> segments returned"},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods Rows_seq = {.sq_length = (lenfunc)Rows_len};

static PyTypeObject RowsType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "heterps_ray.ps._rows.Rows",
    .tp_basicsize = sizeof(Rows),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Compact embedding rows (see heterps_ray.ps.table.SparseTable)",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Rows_init,
    .tp_dealloc = (destructor)Rows_dealloc,
    .tp_methods = Rows_methods,
    .tp_as_sequence = &Rows_seq,
};

static struct PyModuleDef rows_module = {
    PyModuleDef_HEAD_INIT, .m_name = "_rows", .m_doc = "Compact embedding rows", .m_size = -1,
    .m_methods = module_methods};

PyMODINIT_FUNC PyInit__rows(void) {
    if (PyType_Ready(&RowsType) < 0) return NULL;
    PyObject *m = PyModule_Create(&rows_module);
    if (!m) return NULL;
    Py_INCREF(&RowsType);
    if (PyModule_AddObject(m, "Rows", (PyObject *)&RowsType) < 0) {
        Py_DECREF(&RowsType);
        Py_DECREF(m);
        return NULL;
    }
    PyModule_AddIntConstant(m, "SEG_ROWS", (long)SEG_ROWS);
    return m;
}
