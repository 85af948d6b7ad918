/* kvserve: a storage daemon's native data plane (kvcache/server/native_plane.py says why).
 *
 * One epoll instance serves the daemon's whole loop. File descriptors the Python loop owns
 * (the listener, its wake pipe, connections in their handshake, TLS connections, and any
 * connection whose request Python answers) are "foreign": their readiness is only reported
 * back. Authenticated plain-TCP connections the loop "adopts" are native: their requests are
 * read here, and the two that are pure lookups in the index are answered here without Python:
 *
 *   GET whose every item is either a live hit of the wanted stripe with no expiry slide due
 *       (the "quiet" GET of kvcache.server.records.quiet_get) or a plain miss (no such
 *       shard, or a shard of another stripe than the one named): header and items with
 *       send(), the records straight from the segment files with sendfile(). Misses are
 *       what a degraded load sends: a client whose holder is down asks the node that stands
 *       in for it, which holds the shard only once it has been repaired there;
 *   HAS (which shards of these keys are live).
 *
 * Anything else (another op, a flag, a class this engine was not given, an expiry to slide, a shard index out of range, a reply too large) is handed back
 * whole: the connection becomes foreign again and Python takes its buffered bytes
 * (kvs_take) and answers as it always did. So the engine never decides what Python would
 * decide differently; it only skips Python where the answer is a plain read.
 *
 * The index is read through an LMDB environment of this library's own, opened on the same
 * data file with MDB_RDONLY | MDB_NOLOCK: it touches neither the lock file nor the reader
 * table of the daemon's own (py-lmdb) environment. That is safe because every read
 * transaction here starts and ends inside one kvs_step call, on the loop thread, which is
 * also the only thread that writes: no write transaction runs while one of these reads does,
 * so no page it reads can be freed under it.
 *
 * Segment files are opened here by name (<dir>/<id>.seg, ids never reused) and kept open; a
 * reply in flight holds a reference to each segment it sends from, so a segment the store
 * drops (kvs_forget_segment) is closed only when the last such reply is out.
 *
 * Time: a request's "now" is CLOCK_REALTIME plus the offset Python gives each step (the
 * daemon's clock is wall time, or wall time plus a test's offset); deadlines use
 * CLOCK_MONOTONIC.
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <lmdb.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/sendfile.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#define KVS_ABI 4

/* The wire (docs/spec/wire.md). */
#define HDR 48
#define OP_GET 2
#define OP_HAS 3
#define GET_ITEM 32
#define HAS_ITEM 16
#define GET_REPLY_ITEM 8
#define HAS_REPLY_ITEM 16
#define FLAG_REPLY 1
#define STATUS_NOT_FOUND 1 /* kvcache.wire.Status.NOT_FOUND */
#define CLASS_FIELD 16
/* The index (kvcache/server/records.py): tenant 8 | block key 16 -> 32-byte rows: index u16,
 * class u16, size u32, expiry u32 (whole seconds), stripe u64, written u32, segment u32,
 * offset u32, all big-endian. */
#define TENANT 8
#define BLOCK_KEY 24
#define ROW 32
#define ROW_EXPIRY_MS(row) ((uint64_t)be32((row) + 8) * 1000u)
#define ROW_STRIPE(row) be64((row) + 12)
#define ROW_SEG(row) be32((row) + 24)
#define ROW_OFF(row) be32((row) + 28)
#define MAX_SHARD_INDEX 254

#define NBUCKETS 17 /* 16 latency bounds and +Inf */
#define MAX_CLASSES 256
#define EPOLL_BATCH 256
#define TIMEOUT_CHECK_S 0.1

/* What kvs_step reports for a descriptor. */
enum { EV_FOREIGN = 1, EV_HANDOFF = 2, EV_CLOSED = 3 };
/* Why a native connection was closed (EV_CLOSED's aux). */
enum {
    WHY_PEER = 1,
    WHY_RECV = 2,
    WHY_SEND = 3,
    WHY_SEND_TIMEOUT = 4,
    WHY_REQUEST_TIMEOUT = 5,
    WHY_SLOW_REQUEST = 6,
    WHY_NOMEM = 7,
    WHY_PEER_MID_REQUEST = 8, /* the peer closed with part of a request sent: truncated */
};
/* Why a request was handed to Python (counters, for tests and stats). */
enum {
    HAND_OP = 0,       /* not GET or HAS, or a header this engine does not answer */
    HAND_CLASS = 1,    /* a traffic class it was not given */
    HAND_DISABLED = 2, /* the loop said not now (pending touches, damage, debug log) */
    HAND_GET = 3,      /* a GET that is not quiet (miss, stripe, slide, index, size) */
    HAND_HAS = 4,      /* a HAS it could not answer (an LMDB error) */
    HAND_SEGMENT = 5,  /* a segment file it could not open */
    N_HAND = 6,
};
enum { OWN_NONE = 0, OWN_NATIVE = 1, OWN_FOREIGN = 2, OWN_HANDED = 3 };
/* kvs_step's flags. */
enum { KVS_ANSWER = 1, KVS_PENDING = 2 };
/* kvs_watch's events: EPOLLIN / EPOLLOUT, and this bit for the loop's wake pipe (see kvs_step). */
#define KVS_PRIORITY 0x40000000u
/* A connection's buffers are given back once a request is done if they grew past this. */
#define KEEP_BUFFER (1u << 20)
/* recv calls one readable connection gets per wake-up (then the others get their turn). */
#define RECV_BUDGET 4

typedef struct {
    uint64_t requests, items_ok, items_missed, bytes_in, bytes_out;
    uint64_t buckets[NBUCKETS];
    double latency_sum;
} kvs_opstats;

/* Cumulative; read with kvs_stats_read (a seqlock: readers on other threads retry). */
typedef struct {
    uint64_t seq;
    uint64_t handed[N_HAND];
    uint64_t closed_timeouts;
    kvs_opstats has;
    kvs_opstats get[MAX_CLASSES];
} kvs_stats;

typedef struct {
    int fd;
    int kind;
    uint32_t aux;
    uint32_t pad;
} kvs_event;

typedef struct kvs_seg {
    uint32_t id;
    int fd;
    int refs;
    int dropped;
} kvs_seg;

typedef struct {
    kvs_seg *seg;
    uint64_t off, len;
} kvs_run;

typedef struct {
    int owner;
    int priority;    /* the loop's wake pipe: handled before any native request */
    uint32_t events; /* registered with epoll (0: not registered) */
    uint8_t tenant[TENANT];
    uint8_t *in;
    size_t cap, start, end;
    double request_started; /* monotonic, when the first byte of the buffered request came */
    uint64_t request_bytes;
    double last_progress;
    int ready; /* buffered bytes to parse before reading (adopted with a prefix) */
    /* The reply being sent: header and items, then runs of records. */
    uint8_t *out;
    size_t out_cap, out_len, out_sent;
    kvs_run *runs;
    size_t runs_cap, nruns, run_i;
} kvs_conn;

typedef struct {
    uint8_t field[CLASS_FIELD];
    int64_t delta_ms;
    int slot;
} kvs_class;

typedef struct {
    int epfd;
    kvs_conn **conns;
    int nconns;
    /* Index reads. */
    MDB_env *env;
    MDB_dbi dbi;
    MDB_txn *txn;
    MDB_cursor *cur;
    char segdir[PATH_MAX];
    kvs_seg **segs; /* sorted by id */
    size_t nsegs, segs_cap;
    kvs_class classes[MAX_CLASSES];
    int nclasses;
    /* Limits. */
    uint32_t max_items;
    uint64_t max_reply;
    double send_timeout_s, request_timeout_s, request_grace_s, min_request_rate;
    double bounds[NBUCKETS - 1];
    /* This step's settings. */
    double offset_s;
    int native_ok;
    int pending;
    double last_timeouts;
    kvs_event *ev;
    size_t nev, ev_cap;
    int *ready_fds;
    size_t nready, ready_cap;
    kvs_stats stats;
    char error[256];
} kvs_engine;

int kvs_abi_version(void) { return KVS_ABI; }

size_t kvs_stats_size(void) { return sizeof(kvs_stats); }

size_t kvs_event_size(void) { return sizeof(kvs_event); }

/* ------------------------------------------------------------------------------- helpers */

static inline uint16_t be16(const uint8_t *p) { return (uint16_t)((p[0] << 8) | p[1]); }
static inline uint32_t be32(const uint8_t *p) {
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}
static inline uint64_t be64(const uint8_t *p) { return ((uint64_t)be32(p) << 32) | be32(p + 4); }
static inline uint16_t le16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static inline uint32_t le32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}
static inline uint64_t le64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}
static inline void put32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }
static inline void put64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }
static inline void put16(uint8_t *p, uint16_t v) { memcpy(p, &v, 2); }

static double mono_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* The daemon's clock in milliseconds, as the store computes it: int((time.time() + offset)
 * * 1000). */
static int64_t now_ms(const kvs_engine *e) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    double t = (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9 + e->offset_s;
    return (int64_t)(t * 1000.0);
}

static int grow(void **buf, size_t *cap, size_t need, size_t unit) {
    if (need <= *cap) return 0;
    size_t n = *cap ? *cap : 16;
    while (n < need) n *= 2;
    void *p = realloc(*buf, n * unit);
    if (!p) return -1;
    *buf = p;
    *cap = n;
    return 0;
}

/* kvs_step reserves room for an event per descriptor first, so this never fails. */
static void emit(kvs_engine *e, int fd, int kind, uint32_t aux) {
    e->ev[e->nev++] = (kvs_event){fd, kind, aux, 0};
}

/* The one writer (the loop thread, inside kvs_step) makes the sequence odd while it updates. */
static void stats_begin(kvs_engine *e) { __atomic_add_fetch(&e->stats.seq, 1, __ATOMIC_SEQ_CST); }
static void stats_end(kvs_engine *e) { __atomic_add_fetch(&e->stats.seq, 1, __ATOMIC_SEQ_CST); }

static void count_hand(kvs_engine *e, int why) {
    stats_begin(e);
    e->stats.handed[why]++;
    stats_end(e);
}

static void observe(kvs_engine *e, kvs_opstats *s, double seconds, uint64_t items_ok,
                    uint64_t items_missed, uint64_t bytes_in, uint64_t bytes_out) {
    int b = 0;
    while (b < NBUCKETS - 1 && seconds > e->bounds[b]) b++;
    stats_begin(e);
    s->requests++;
    s->items_ok += items_ok;
    s->items_missed += items_missed;
    s->bytes_in += bytes_in;
    s->bytes_out += bytes_out;
    s->buckets[b]++;
    s->latency_sum += seconds;
    stats_end(e);
}

/* Copy the cumulative stats into out (sizeof(kvs_stats) bytes), consistently. */
void kvs_stats_read(kvs_engine *e, void *out) {
    for (;;) {
        uint64_t before = __atomic_load_n(&e->stats.seq, __ATOMIC_ACQUIRE);
        if (before & 1) continue;
        memcpy(out, &e->stats, sizeof(kvs_stats));
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        if (__atomic_load_n(&e->stats.seq, __ATOMIC_ACQUIRE) == before) return;
    }
}

const char *kvs_error(kvs_engine *e) { return e->error; }

/* ------------------------------------------------------------------------------ segments */

static size_t seg_pos(const kvs_engine *e, uint32_t id) {
    size_t lo = 0, hi = e->nsegs;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (e->segs[mid]->id < id)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

static kvs_seg *seg_get(kvs_engine *e, uint32_t id) {
    size_t at = seg_pos(e, id);
    if (at < e->nsegs && e->segs[at]->id == id) return e->segs[at];
    char path[PATH_MAX + 16];
    snprintf(path, sizeof path, "%s/%08x.seg", e->segdir, id);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return NULL;
    kvs_seg *s = malloc(sizeof *s);
    if (!s || grow((void **)&e->segs, &e->segs_cap, e->nsegs + 1, sizeof(kvs_seg *)) < 0) {
        free(s);
        close(fd);
        return NULL;
    }
    *s = (kvs_seg){id, fd, 0, 0};
    memmove(e->segs + at + 1, e->segs + at, (e->nsegs - at) * sizeof(kvs_seg *));
    e->segs[at] = s;
    e->nsegs++;
    return s;
}

static void seg_release(kvs_seg *s) {
    if (--s->refs == 0 && s->dropped) {
        close(s->fd);
        free(s);
    }
}

/* The store dropped segment ``id``: close it once no reply in flight sends from it. Returns
 * 1 while a reply still holds it (its file must then not be reused), else 0. */
int kvs_forget_segment(kvs_engine *e, uint32_t id) {
    size_t at = seg_pos(e, id);
    if (at >= e->nsegs || e->segs[at]->id != id) return 0;
    kvs_seg *s = e->segs[at];
    memmove(e->segs + at, e->segs + at + 1, (e->nsegs - at - 1) * sizeof(kvs_seg *));
    e->nsegs--;
    if (s->refs == 0) {
        close(s->fd);
        free(s);
        return 0;
    }
    s->dropped = 1;
    return 1;
}

/* ------------------------------------------------------------------------------- classes */

void kvs_class_clear(kvs_engine *e) { e->nclasses = 0; }

/* Answer GETs naming the 16-byte class field ``field`` (all zeros: no class) natively: a
 * hit is quiet when its expiry is above now + delta_ms; stats go to ``slot``. */
int kvs_class_set(kvs_engine *e, const uint8_t *field, int64_t delta_ms, int slot) {
    if (slot < 0 || slot >= MAX_CLASSES) return -1;
    for (int i = 0; i < e->nclasses; i++) {
        if (memcmp(e->classes[i].field, field, CLASS_FIELD) == 0) {
            e->classes[i].delta_ms = delta_ms;
            e->classes[i].slot = slot;
            return 0;
        }
    }
    if (e->nclasses >= MAX_CLASSES) return -1;
    kvs_class *c = &e->classes[e->nclasses++];
    memcpy(c->field, field, CLASS_FIELD);
    c->delta_ms = delta_ms;
    c->slot = slot;
    return 0;
}

static const kvs_class *class_of(const kvs_engine *e, const uint8_t *field) {
    for (int i = 0; i < e->nclasses; i++)
        if (memcmp(e->classes[i].field, field, CLASS_FIELD) == 0) return &e->classes[i];
    return NULL;
}

/* -------------------------------------------------------------------------------- engine */

kvs_engine *kvs_new(const char *lmdb_dir, uint64_t map_size, const char *segdir,
                    uint32_t max_items, uint64_t max_reply, double send_timeout_s,
                    double request_timeout_s, double request_grace_s, double min_request_rate,
                    const double *bounds, char *error, size_t error_len) {
    kvs_engine *e = calloc(1, sizeof *e);
    if (!e) {
        snprintf(error, error_len, "out of memory");
        return NULL;
    }
    e->epfd = -1;
    int rc;
    const char *step = "epoll_create1";
    e->epfd = epoll_create1(EPOLL_CLOEXEC);
    if (e->epfd < 0) {
        rc = errno;
        snprintf(error, error_len, "%s: %s", step, strerror(rc));
        free(e);
        return NULL;
    }
    if (strlen(segdir) >= PATH_MAX) {
        snprintf(error, error_len, "segment directory path too long");
        close(e->epfd);
        free(e);
        return NULL;
    }
    strcpy(e->segdir, segdir);
    step = "mdb_env_create";
    rc = mdb_env_create(&e->env);
    if (!rc) {
        step = "mdb_env_set_maxdbs";
        rc = mdb_env_set_maxdbs(e->env, 4);
    }
    if (!rc) {
        step = "mdb_env_set_mapsize";
        rc = mdb_env_set_mapsize(e->env, map_size);
    }
    if (!rc) {
        step = "mdb_env_open";
        rc = mdb_env_open(e->env, lmdb_dir, MDB_RDONLY | MDB_NOLOCK | MDB_NORDAHEAD, 0);
    }
    if (!rc) {
        step = "mdb_txn_begin";
        rc = mdb_txn_begin(e->env, NULL, MDB_RDONLY, &e->txn);
    }
    if (!rc) {
        step = "mdb_dbi_open(index)";
        rc = mdb_dbi_open(e->txn, "index", 0, &e->dbi);
    }
    if (!rc) { /* the handle outlives a committed transaction only */
        step = "mdb_txn_commit";
        rc = mdb_txn_commit(e->txn);
        e->txn = NULL;
    }
    if (!rc) {
        step = "mdb_txn_begin";
        rc = mdb_txn_begin(e->env, NULL, MDB_RDONLY, &e->txn);
    }
    if (!rc) {
        step = "mdb_cursor_open";
        rc = mdb_cursor_open(e->txn, e->dbi, &e->cur);
    }
    if (rc) {
        snprintf(error, error_len, "%s: %s", step, mdb_strerror(rc));
        if (e->cur) mdb_cursor_close(e->cur);
        if (e->txn) mdb_txn_abort(e->txn);
        if (e->env) mdb_env_close(e->env);
        close(e->epfd);
        free(e);
        return NULL;
    }
    mdb_txn_reset(e->txn);
    e->max_items = max_items;
    e->max_reply = max_reply;
    e->send_timeout_s = send_timeout_s;
    e->request_timeout_s = request_timeout_s;
    e->request_grace_s = request_grace_s;
    e->min_request_rate = min_request_rate;
    memcpy(e->bounds, bounds, sizeof e->bounds);
    e->last_timeouts = mono_s();
    return e;
}

static kvs_conn *conn_at(kvs_engine *e, int fd) {
    if (fd < 0) return NULL;
    if (fd >= e->nconns) {
        int n = e->nconns ? e->nconns : 64;
        while (n <= fd) n *= 2;
        kvs_conn **p = realloc(e->conns, (size_t)n * sizeof *p);
        if (!p) return NULL;
        memset(p + e->nconns, 0, (size_t)(n - e->nconns) * sizeof *p);
        e->conns = p;
        e->nconns = n;
    }
    if (!e->conns[fd]) e->conns[fd] = calloc(1, sizeof(kvs_conn));
    return e->conns[fd];
}

static int set_events(kvs_engine *e, int fd, kvs_conn *c, uint32_t events) {
    if (events == c->events) return 0;
    struct epoll_event ev = {.events = events, .data.fd = fd};
    int rc;
    if (!events)
        rc = epoll_ctl(e->epfd, EPOLL_CTL_DEL, fd, NULL);
    else
        rc = epoll_ctl(e->epfd, c->events ? EPOLL_CTL_MOD : EPOLL_CTL_ADD, fd, &ev);
    if (rc < 0 && !(events == 0 && (errno == EBADF || errno == ENOENT))) return -1;
    c->events = events;
    return 0;
}

static void reply_release(kvs_conn *c) {
    for (size_t i = c->run_i; i < c->nruns; i++) seg_release(c->runs[i].seg);
    c->nruns = c->run_i = 0;
    c->out_len = c->out_sent = 0;
}

static void conn_reset(kvs_conn *c) {
    reply_release(c);
    free(c->in);
    free(c->out);
    free(c->runs);
    memset(c, 0, sizeof *c);
}

/* Python's loop watches ``fd`` for ``events`` (EPOLLIN/EPOLLOUT; 0: no longer). */
int kvs_watch(kvs_engine *e, int fd, uint32_t events) {
    kvs_conn *c = conn_at(e, fd);
    if (!c) return -ENOMEM;
    if (c->owner == OWN_NATIVE || c->owner == OWN_HANDED) return -EBUSY; /* take it first */
    int priority = (events & KVS_PRIORITY) != 0;
    events &= ~KVS_PRIORITY;
    if (set_events(e, fd, c, events) < 0) return -errno;
    c->owner = events ? OWN_FOREIGN : OWN_NONE;
    c->priority = events ? priority : 0;
    if (c->in) { /* what a hand-off left: Python has taken it */
        free(c->in);
        c->in = NULL;
        c->cap = c->start = c->end = 0;
    }
    return 0;
}

/* Python's loop hands an authenticated, idle plain-TCP connection to the engine; ``prefix``
 * holds bytes it already received past its last request (that request began arriving at
 * ``started``, monotonic seconds, and ``received`` bytes of it came). On failure the
 * connection stays Python's, as it was. */
int kvs_adopt(kvs_engine *e, int fd, const uint8_t *tenant, const uint8_t *prefix, size_t len,
              double started, uint64_t received) {
    kvs_conn *c = conn_at(e, fd);
    if (!c) return -ENOMEM;
    if (c->owner == OWN_NATIVE || c->owner == OWN_HANDED) return -EBUSY;
    if (grow((void **)&e->ready_fds, &e->ready_cap, e->nready + 1, sizeof(int)) < 0) return -ENOMEM;
    uint8_t *in = NULL;
    size_t cap = 0;
    if (len) {
        cap = len < 65536 ? 65536 : len;
        in = malloc(cap);
        if (!in) return -ENOMEM;
        memcpy(in, prefix, len);
    }
    if (set_events(e, fd, c, EPOLLIN) < 0) {
        int err = errno;
        free(in);
        return -err;
    }
    uint32_t registered = c->events;
    conn_reset(c);
    c->events = registered;
    memcpy(c->tenant, tenant, TENANT);
    c->owner = OWN_NATIVE;
    double now = mono_s();
    c->last_progress = now;
    if (len) {
        c->in = in;
        c->cap = cap;
        c->end = len;
        c->request_started = started > 0 ? started : now;
        c->request_bytes = received > len ? received : len;
        e->ready_fds[e->nready++] = fd;
        c->ready = 1;
    }
    return 0;
}

/* After EV_HANDOFF: the connection's buffered bytes (they start with the request Python
 * must answer). *data stays valid until the next call on this engine; the connection is
 * Python's from now on (not watched until it says so). */
size_t kvs_take(kvs_engine *e, int fd, const uint8_t **data, double *started,
                uint64_t *received) {
    *data = NULL;
    *started = 0;
    *received = 0;
    if (fd < 0 || fd >= e->nconns || !e->conns[fd] || e->conns[fd]->owner != OWN_HANDED) return 0;
    kvs_conn *c = e->conns[fd];
    *started = c->request_started;
    *received = c->request_bytes;
    size_t n = c->end - c->start;
    /* The bytes are moved to the front of the buffer and the buffer kept (freed on the next
     * adopt or forget of this descriptor). */
    if (c->start && n) memmove(c->in, c->in + c->start, n);
    c->start = 0;
    c->end = n;
    *data = c->in;
    c->owner = c->events ? OWN_FOREIGN : OWN_NONE;
    return n;
}

/* The descriptor is being closed by Python: forget it (no event). */
void kvs_forget(kvs_engine *e, int fd) {
    if (fd < 0 || fd >= e->nconns || !e->conns[fd]) return;
    kvs_conn *c = e->conns[fd];
    if (c->events) epoll_ctl(e->epfd, EPOLL_CTL_DEL, fd, NULL);
    conn_reset(c);
}

/* Whether ``fd`` is a native connection (for tests and assertions). */
int kvs_is_native(kvs_engine *e, int fd) {
    return fd >= 0 && fd < e->nconns && e->conns[fd] && e->conns[fd]->owner == OWN_NATIVE;
}

void kvs_free(kvs_engine *e) {
    if (!e) return;
    for (int fd = 0; fd < e->nconns; fd++) {
        if (e->conns[fd]) {
            conn_reset(e->conns[fd]);
            free(e->conns[fd]);
        }
    }
    free(e->conns);
    for (size_t i = 0; i < e->nsegs; i++) {
        close(e->segs[i]->fd);
        free(e->segs[i]);
    }
    free(e->segs);
    mdb_cursor_close(e->cur);
    mdb_txn_abort(e->txn);
    mdb_env_close(e->env);
    close(e->epfd);
    free(e->ev);
    free(e->ready_fds);
    free(e);
}

/* ------------------------------------------------------------------------------ requests */

static void closed(kvs_engine *e, int fd, kvs_conn *c, uint32_t why) {
    if (c->events) epoll_ctl(e->epfd, EPOLL_CTL_DEL, fd, NULL);
    conn_reset(c);
    if (why == WHY_SEND_TIMEOUT || why == WHY_REQUEST_TIMEOUT || why == WHY_SLOW_REQUEST) {
        stats_begin(e);
        e->stats.closed_timeouts++;
        stats_end(e);
    }
    emit(e, fd, EV_CLOSED, why);
}

static void handoff(kvs_engine *e, int fd, kvs_conn *c, int why) {
    if (c->events) epoll_ctl(e->epfd, EPOLL_CTL_DEL, fd, NULL);
    c->events = 0;
    c->owner = OWN_HANDED;
    c->ready = 0;
    count_hand(e, why);
    emit(e, fd, EV_HANDOFF, (uint32_t)why);
}

static int begin_read(kvs_engine *e) {
    if (mdb_txn_renew(e->txn) != 0) return -1;
    if (mdb_cursor_renew(e->txn, e->cur) != 0) {
        mdb_txn_reset(e->txn);
        return -1;
    }
    return 0;
}

/* The quiet GET (see the top of this file): 1 if the reply is queued on ``c``, 0 if Python
 * must answer, -1 out of memory. */
static int answer_get(kvs_engine *e, kvs_conn *c, const uint8_t *hdr, const uint8_t *items,
                      uint32_t n, int64_t delta_ms, int *why, uint32_t *missed) {
    size_t out_len = HDR + (size_t)n * GET_REPLY_ITEM;
    if (grow((void **)&c->out, &c->out_cap, out_len, 1) < 0 ||
        grow((void **)&c->runs, &c->runs_cap, n, sizeof(kvs_run)) < 0)
        return -1;
    *why = HAND_GET;
    if (begin_read(e) < 0) return 0;
    uint64_t quiet_above = (uint64_t)(now_ms(e) + delta_ms);
    uint8_t key[BLOCK_KEY], search[ROW];
    memcpy(key, c->tenant, TENANT);
    memset(search, 0, sizeof search);
    uint8_t *reply = c->out + HDR;
    uint64_t total = 0;
    size_t nruns = 0;
    uint32_t seg = 0;
    uint64_t end = 0;
    int ok = 1;
    for (uint32_t i = 0; i < n && ok; i++) {
        const uint8_t *item = items + (size_t)i * GET_ITEM;
        uint16_t index = le16(item + 16);
        if (index > MAX_SHARD_INDEX) {
            ok = 0;
            break;
        }
        memcpy(key + TENANT, item, 16);
        search[0] = (uint8_t)(index >> 8);
        search[1] = (uint8_t)index;
        MDB_val k = {BLOCK_KEY, key}, v = {ROW, search};
        int rc = mdb_cursor_get(e->cur, &k, &v, MDB_GET_BOTH_RANGE);
        if (rc != 0 && rc != MDB_NOTFOUND) {
            ok = 0;
            break;
        }
        const uint8_t *row = v.mv_data;
        uint64_t want = le64(item + 24);
        if (rc == 0 && v.mv_size != ROW) {
            ok = 0;
            break;
        }
        if (rc == MDB_NOTFOUND || be16(row) != index || (want != 0 && want != ROW_STRIPE(row))) {
            /* A miss, as Python answers it: NOT_FOUND, no length, nothing to slide. */
            memset(reply + (size_t)i * GET_REPLY_ITEM, 0, GET_REPLY_ITEM);
            reply[(size_t)i * GET_REPLY_ITEM] = STATUS_NOT_FOUND;
            (*missed)++;
            continue;
        }
        if (ROW_EXPIRY_MS(row) <= quiet_above) {
            ok = 0;
            break;
        }
        uint32_t size = be32(row + 4), s = ROW_SEG(row), off = ROW_OFF(row);
        memset(reply + (size_t)i * GET_REPLY_ITEM, 0, 4);
        put32(reply + (size_t)i * GET_REPLY_ITEM + 4, size);
        total += size;
        if (total > e->max_reply) {
            ok = 0;
            break;
        }
        if (nruns && s == seg && off == end) {
            c->runs[nruns - 1].len += size;
        } else {
            c->runs[nruns++] = (kvs_run){(kvs_seg *)(uintptr_t)s, off, size};
            seg = s;
        }
        end = (uint64_t)off + size;
    }
    mdb_txn_reset(e->txn);
    if (!ok) return 0;
    /* The runs name segment ids until here: resolve them (opening files as needed). */
    for (size_t j = 0; j < nruns; j++) {
        kvs_seg *s = seg_get(e, (uint32_t)(uintptr_t)c->runs[j].seg);
        if (!s) {
            for (size_t i = 0; i < j; i++) seg_release(c->runs[i].seg);
            *why = HAND_SEGMENT;
            return 0;
        }
        s->refs++;
        c->runs[j].seg = s;
    }
    uint8_t *h = c->out;
    memset(h, 0, HDR);
    h[0] = 'K';
    h[1] = 'V';
    h[2] = 2;
    h[3] = OP_GET;
    put16(h + 4, FLAG_REPLY);
    memcpy(h + 8, hdr + 8, 8); /* request id */
    put32(h + 16, n);
    put64(h + 24, total);
    c->out_len = out_len;
    c->out_sent = 0;
    c->nruns = nruns;
    c->run_i = 0;
    return 1;
}

/* HAS: one record (ordinal, shard index, stripe) per live shard of each asked key, in the
 * asked order and, within a key, in shard-index order. 1 queued, 0 Python, -1 no memory. */
static int answer_has(kvs_engine *e, kvs_conn *c, const uint8_t *hdr, const uint8_t *items,
                      uint32_t n, int *why) {
    *why = HAND_HAS;
    if (grow((void **)&c->out, &c->out_cap, HDR + (size_t)n * HAS_REPLY_ITEM, 1) < 0) return -1;
    if (begin_read(e) < 0) return 0;
    uint64_t now = (uint64_t)now_ms(e);
    uint8_t key[BLOCK_KEY];
    memcpy(key, c->tenant, TENANT);
    size_t m = 0;
    int ok = 1;
    for (uint32_t i = 0; i < n && ok; i++) {
        memcpy(key + TENANT, items + (size_t)i * HAS_ITEM, 16);
        MDB_val k = {BLOCK_KEY, key}, v;
        int rc = mdb_cursor_get(e->cur, &k, &v, MDB_SET);
        if (rc == MDB_NOTFOUND) continue;
        if (rc != 0) {
            ok = 0;
            break;
        }
        rc = mdb_cursor_get(e->cur, &k, &v, MDB_GET_MULTIPLE);
        while (rc == 0 && ok) {
            if (v.mv_size % ROW) {
                ok = 0;
                break;
            }
            size_t rows = v.mv_size / ROW;
            if (grow((void **)&c->out, &c->out_cap, HDR + (m + rows) * HAS_REPLY_ITEM, 1) < 0) {
                mdb_txn_reset(e->txn);
                return -1;
            }
            for (size_t r = 0; r < rows; r++) {
                const uint8_t *row = (const uint8_t *)v.mv_data + r * ROW;
                if (ROW_EXPIRY_MS(row) <= now) {
                    /* Expired by its row; a hit not yet written may have moved it on. */
                    if (e->pending) {
                        ok = 0;
                        break;
                    }
                    continue;
                }
                uint8_t *rec = c->out + HDR + m * HAS_REPLY_ITEM;
                put32(rec, i);
                put16(rec + 4, be16(row));
                put16(rec + 6, 0);
                put64(rec + 8, ROW_STRIPE(row));
                m++;
            }
            if (ok) rc = mdb_cursor_get(e->cur, &k, &v, MDB_NEXT_MULTIPLE);
        }
        if (ok && rc != MDB_NOTFOUND) ok = 0;
    }
    mdb_txn_reset(e->txn);
    if (!ok) return 0;
    uint8_t *h = c->out;
    memset(h, 0, HDR);
    h[0] = 'K';
    h[1] = 'V';
    h[2] = 2;
    h[3] = OP_HAS;
    put16(h + 4, FLAG_REPLY);
    memcpy(h + 8, hdr + 8, 8);
    put32(h + 16, (uint32_t)m);
    c->out_len = HDR + m * HAS_REPLY_ITEM;
    c->out_sent = 0;
    c->nruns = c->run_i = 0;
    return 1;
}

/* Send what the socket takes: 0 all sent, 1 the socket is full, -1 the connection failed. */
static int send_reply(kvs_conn *c, int fd) {
    while (c->out_sent < c->out_len) {
        int flags = MSG_NOSIGNAL | MSG_DONTWAIT | (c->run_i < c->nruns ? MSG_MORE : 0);
        ssize_t r = send(fd, c->out + c->out_sent, c->out_len - c->out_sent, flags);
        if (r < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) return 1;
            return -1;
        }
        c->out_sent += (size_t)r;
        c->last_progress = mono_s();
    }
    while (c->run_i < c->nruns) {
        kvs_run *run = &c->runs[c->run_i];
        off_t off = (off_t)run->off;
        ssize_t r = sendfile(fd, run->seg->fd, &off, run->len);
        if (r < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) return 1;
            return -1;
        }
        if (r == 0) return -1; /* the file ended short of the run: never send a short reply */
        run->off += (uint64_t)r;
        run->len -= (uint64_t)r;
        c->last_progress = mono_s();
        if (!run->len) {
            seg_release(run->seg);
            c->run_i++;
        }
    }
    c->nruns = c->run_i = 0;
    c->out_len = c->out_sent = 0;
    return 0;
}

static int sending(const kvs_conn *c) { return c->out_len > 0 || c->nruns > 0; }

/* A reply is out: give back buffers a large request grew past KEEP_BUFFER (a thousand idle
 * connections must not each keep the largest reply they ever built). */
static void trim(kvs_conn *c) {
    if (c->out_cap > KEEP_BUFFER) {
        free(c->out);
        c->out = NULL;
        c->out_cap = 0;
    }
    if (c->runs_cap * sizeof(kvs_run) > KEEP_BUFFER) {
        free(c->runs);
        c->runs = NULL;
        c->runs_cap = 0;
    }
    if (c->cap > KEEP_BUFFER && c->end - c->start <= 65536) {
        size_t n = c->end - c->start;
        uint8_t *in = malloc(65536);
        if (in) {
            memcpy(in, c->in + c->start, n);
            free(c->in);
            c->in = in;
            c->cap = 65536;
            c->start = 0;
            c->end = n;
        }
    }
}

/* Whether the request header at ``h`` is one this engine answers; sets *item (its items'
 * size) and *cls (GET: its class entry). Anything else is Python's to check and answer. */
static int native_request(const kvs_engine *e, const uint8_t *h, size_t *item,
                          const kvs_class **cls, int *why) {
    *why = HAND_OP;
    if (h[0] != 'K' || h[1] != 'V' || h[2] != 2) return 0;
    if (le16(h + 4) != 0 || le16(h + 6) != 0) return 0; /* flags, status */
    uint32_t count = le32(h + 16);
    if (count == 0 || count > e->max_items || le32(h + 20) != 0 || le64(h + 24) != 0) return 0;
    if (h[3] == OP_GET)
        *item = GET_ITEM;
    else if (h[3] == OP_HAS)
        *item = HAS_ITEM;
    else
        return 0;
    *why = HAND_CLASS;
    *cls = class_of(e, h + 32);
    if (!*cls) return 0;
    return 1;
}

/* Parse and answer the buffered requests of native connection ``c``: 0 wants more bytes,
 * 1 a reply is waiting for the socket, 2 handed to Python, -1 closed. */
static int process(kvs_engine *e, int fd, kvs_conn *c) {
    while (c->end - c->start >= HDR) {
        const uint8_t *h = c->in + c->start;
        size_t item = 0;
        const kvs_class *cls = NULL;
        int why;
        if (!e->native_ok) {
            handoff(e, fd, c, HAND_DISABLED);
            return 2;
        }
        if (!native_request(e, h, &item, &cls, &why)) {
            handoff(e, fd, c, why);
            return 2;
        }
        uint32_t n = le32(h + 16);
        size_t need = HDR + (size_t)n * item;
        if (c->end - c->start < need) {
            if (c->cap - c->start < need) {
                if (c->start) {
                    memmove(c->in, c->in + c->start, c->end - c->start);
                    c->end -= c->start;
                    c->start = 0;
                }
                if (grow((void **)&c->in, &c->cap, need, 1) < 0) {
                    closed(e, fd, c, WHY_NOMEM);
                    return -1;
                }
            }
            return 0;
        }
        double t0 = mono_s();
        uint32_t missed = 0;
        int rc = h[3] == OP_GET ? answer_get(e, c, h, h + HDR, n, cls->delta_ms, &why, &missed)
                                : answer_has(e, c, h, h + HDR, n, &why);
        if (rc < 0) {
            closed(e, fd, c, WHY_NOMEM);
            return -1;
        }
        if (rc == 0) {
            handoff(e, fd, c, why);
            return 2;
        }
        uint64_t data = h[3] == OP_GET ? le64(c->out + 24) : 0;
        uint64_t out_bytes = c->out_len + data;
        int slot = cls->slot;
        c->start += need;
        if (c->start == c->end) {
            c->start = c->end = 0;
        } else {
            c->request_started = t0;
            c->request_bytes = c->end - c->start;
        }
        /* Counted before the reply leaves (as the Python loop does): whoever reads the
         * counters after the reply arrived sees it. */
        double took = mono_s() - t0;
        if (item == GET_ITEM)
            observe(e, &e->stats.get[slot], took, n - missed, missed, need, out_bytes);
        else
            observe(e, &e->stats.has, took, 0, 0, need, out_bytes);
        int sent = send_reply(c, fd);
        if (sent < 0) {
            closed(e, fd, c, WHY_SEND);
            return -1;
        }
        if (sent == 1) {
            if (set_events(e, fd, c, EPOLLOUT) < 0) {
                closed(e, fd, c, WHY_SEND);
                return -1;
            }
            return 1;
        }
        trim(c);
    }
    return 0;
}

static void on_readable(kvs_engine *e, int fd, kvs_conn *c) {
    /* At most RECV_BUDGET receives, then the other ready connections get theirs: epoll,
     * level-triggered, reports this one again while it has bytes. */
    for (int budget = RECV_BUDGET; budget > 0; budget--) {
        if (c->end == c->cap) {
            if (c->start) {
                memmove(c->in, c->in + c->start, c->end - c->start);
                c->end -= c->start;
                c->start = 0;
            } else if (grow((void **)&c->in, &c->cap, c->cap ? c->cap * 2 : 65536, 1) < 0) {
                closed(e, fd, c, WHY_NOMEM);
                return;
            }
        }
        size_t room = c->cap - c->end;
        ssize_t r = recv(fd, c->in + c->end, room, MSG_DONTWAIT);
        if (r == 0) {
            closed(e, fd, c, c->start == c->end ? WHY_PEER : WHY_PEER_MID_REQUEST);
            return;
        }
        if (r < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) return;
            closed(e, fd, c, WHY_RECV);
            return;
        }
        double now = mono_s();
        if (c->start == c->end) {
            c->request_started = now;
            c->request_bytes = 0;
        }
        c->end += (size_t)r;
        c->request_bytes += (uint64_t)r;
        c->last_progress = now;
        if (process(e, fd, c) != 0) return;
        if ((size_t)r < room) return; /* the socket is drained */
    }
}

static void on_writable(kvs_engine *e, int fd, kvs_conn *c) {
    int sent = send_reply(c, fd);
    if (sent < 0) {
        closed(e, fd, c, WHY_SEND);
        return;
    }
    if (sent == 1) return;
    trim(c);
    if (set_events(e, fd, c, EPOLLIN) < 0) {
        closed(e, fd, c, WHY_SEND);
        return;
    }
    /* Requests that came in meanwhile (a client sends the next one after this reply, or
     * pipelines): answer them before waiting again. */
    if (process(e, fd, c) == 0 && c->owner == OWN_NATIVE) on_readable(e, fd, c);
}

/* Cut off native connections whose reply stalled or whose request arrives too slowly (the
 * same rules as the Python loop's, kvcache.server.admission). */
static void check_timeouts(kvs_engine *e, double now) {
    for (int fd = 0; fd < e->nconns; fd++) {
        kvs_conn *c = e->conns[fd];
        if (!c || c->owner != OWN_NATIVE) continue;
        if (sending(c)) {
            if (now - c->last_progress > e->send_timeout_s) closed(e, fd, c, WHY_SEND_TIMEOUT);
        } else if (c->end > c->start) {
            double elapsed = now - c->request_started;
            if (elapsed > e->request_timeout_s)
                closed(e, fd, c, WHY_REQUEST_TIMEOUT);
            else if (elapsed > e->request_grace_s &&
                     (double)c->request_bytes < e->min_request_rate * elapsed)
                closed(e, fd, c, WHY_SLOW_REQUEST);
        }
    }
}

/* One turn of the loop: wait up to ``timeout_ms`` (-1: no limit) for descriptors, answer
 * what native connections ask, and return the number of events for Python (kvs_events).
 * Returns as soon as there is an event for Python, or when the time is up. ``offset_s`` is
 * the daemon clock's offset from wall time. ``flags``: KVS_ANSWER (else every request goes
 * to Python), KVS_PENDING (hits wait to be written: a row past its expiry may be alive). */
long kvs_step(kvs_engine *e, int timeout_ms, double offset_s, int flags) {
    e->nev = 0;
    e->offset_s = offset_s;
    e->native_ok = flags & KVS_ANSWER;
    e->pending = flags & KVS_PENDING;
    /* Room for every event this step can emit: one per ready descriptor, a close per
     * connection past a deadline, one per connection adopted with buffered requests. */
    if (grow((void **)&e->ev, &e->ev_cap, (size_t)e->nconns + 2 * EPOLL_BATCH + e->nready,
             sizeof(kvs_event)) < 0) {
        snprintf(e->error, sizeof e->error, "out of memory for events");
        return -1;
    }
    double start = mono_s();
    double deadline = timeout_ms < 0 ? -1.0 : start + timeout_ms / 1000.0;
    /* Connections adopted with buffered requests first. */
    while (e->nready) {
        int fd = e->ready_fds[--e->nready];
        kvs_conn *c = fd < e->nconns ? e->conns[fd] : NULL;
        if (c && c->owner == OWN_NATIVE && c->ready) {
            c->ready = 0;
            process(e, fd, c);
        }
    }
    struct epoll_event evs[EPOLL_BATCH];
    for (;;) {
        int wait_ms = 0;
        if (!e->nev) {
            if (deadline < 0) {
                wait_ms = -1;
            } else {
                double left = deadline - mono_s();
                wait_ms = left > 0 ? (int)(left * 1000.0 + 0.999) : 0;
            }
            /* Wake for the timeout checks too. */
            if (wait_ms < 0 || wait_ms > (int)(TIMEOUT_CHECK_S * 1000)) {
                wait_ms = (int)(TIMEOUT_CHECK_S * 1000);
            }
        }
        int n = epoll_wait(e->epfd, evs, EPOLL_BATCH, wait_ms);
        if (n < 0) {
            if (errno == EINTR) return (long)e->nev;
            snprintf(e->error, sizeof e->error, "epoll_wait: %s", strerror(errno));
            return -1;
        }
        /* The Python loop's descriptors are reported. If its wake pipe is among them (a
         * clock or policy change, a call from another thread), the native ones of this
         * batch wait for the next step (epoll reports them again), so no request that came
         * after the change is answered before Python has applied it. */
        int woken = 0;
        for (int i = 0; i < n; i++) {
            int fd = evs[i].data.fd;
            kvs_conn *c = fd < e->nconns ? e->conns[fd] : NULL;
            if (c && c->owner == OWN_FOREIGN) {
                emit(e, fd, EV_FOREIGN, evs[i].events);
                woken |= c->priority;
            }
        }
        for (int i = 0; i < n && !woken; i++) {
            int fd = evs[i].data.fd;
            uint32_t mask = evs[i].events;
            kvs_conn *c = fd < e->nconns ? e->conns[fd] : NULL;
            if (!c || c->owner != OWN_NATIVE) continue;
            if (sending(c)) {
                if (mask & (EPOLLOUT | EPOLLERR | EPOLLHUP)) on_writable(e, fd, c);
            } else if (mask & (EPOLLIN | EPOLLERR | EPOLLHUP)) {
                on_readable(e, fd, c);
            }
        }
        double now = mono_s();
        if (now - e->last_timeouts >= TIMEOUT_CHECK_S) {
            e->last_timeouts = now;
            check_timeouts(e, now);
        }
        if (e->nev) return (long)e->nev;
        if (deadline >= 0 && now >= deadline) return 0;
    }
}

/* The events of the last kvs_step. */
const kvs_event *kvs_events(kvs_engine *e) { return e->ev; }
