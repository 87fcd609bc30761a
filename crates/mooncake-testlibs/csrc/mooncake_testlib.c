/*
 * Faithful C-ABI test implementation of the Mooncake Transfer Engine C API.
 *
 * THIS IS NOT MOONCAKE. It is a small, independent implementation written for
 * Ferry's tests: it exports the C symbols of one Mooncake release generation
 * (chosen with -DTL_GEN=N at compile time) with the same argument lists, the
 * same struct layouts and the same observable contract, and it really moves
 * bytes: every engine listens on a loopback TCP socket and serves reads and
 * writes into its registered regions, so engines in one process and engines
 * in different processes talk the same way.
 *
 *   TL_GEN 0  before v0.2.0 (late 2024): createTransferEngine(metadata) +
 *             initTransferEngine + installOrGetTransport; batch/status calls
 *             take the transport handle
 *   TL_GEN 1  v0.2.0: 4-argument createTransferEngine
 *   TL_GEN 2  v0.3.0: 5-argument createTransferEngine, getLocalIpAndPort,
 *             openSegmentNoCache, removeLocalSegment, P2PHANDSHAKE metadata
 *   TL_GEN 3  v0.3.5: submitTransferWithNotify, getNotifsFromEngine,
 *             genNotifyInEngine
 *   TL_GEN 4  v0.3.6: freeNotifsMsgBuf
 *   TL_GEN 5  v0.3.12 (current): discoverTopology, warmupEfaSegment,
 *             getNicLoadStats, showLinks, enableGracefulShutdown
 *
 * Behaviours reproduced from real builds:
 *  - target_offset is a raw virtual address inside the peer's registered
 *    memory;
 *  - error codes are negative up to TL_GEN 2 and positive from TL_GEN 3
 *    (not implemented: -303 / 999);
 *  - TCP transport before v0.3.12 (TL_GEN <= 4; measured on v0.2.0,
 *    v0.3.0, v0.3.5, v0.3.6): a WRITE is reported COMPLETED once its payload
 *    is handed over, before the peer has written it; the bytes land some
 *    time later (land_delay, below), front to back, the last byte of a
 *    request last, and a READ meanwhile sees the old bytes;
 *  - TCP transport before v0.3.12 (TL_GEN <= 4): the serving side checks no
 *    address: a WRITE lands wherever the request points (mapped but
 *    unregistered memory is overwritten; unmapped or read-only memory makes
 *    the landing fail with EFAULT and it is silently dropped, the client
 *    having seen COMPLETED); a READ is served from wherever it points and is
 *    FAILED when that memory cannot be read;
 *  - from v0.3.12 (TL_GEN 5) a READ or WRITE outside the peer's registered
 *    regions is FAILED (nothing written), and a WRITE is COMPLETED only
 *    after its bytes are in the peer's memory;
 *  - notifications (measured on v0.3.5, v0.3.6 and the current build, read
 *    in their sources): a TCP engine of TL_GEN 3 and 4 rejects every
 *    notification sent to it (only the RDMA transport installed the handler
 *    before v0.3.8) and the sender's genNotifyInEngine returns ERR_METADATA;
 *    "notify=accept" (below) gives TL_GEN 4 the behaviour of v0.3.8-v0.3.10,
 *    which export the same symbols; TL_GEN 5 accepts them;
 *  - TL_GEN 3 (v0.3.5): getNotifsFromEngine returns name/msg pointers to
 *    strings it has already destroyed (here: a static garbage buffer);
 *    only the array is the caller's to free();
 *  - freeBatchID refuses a batch with a task that is not terminal;
 *  - a batch id is the raw pointer of the batch (never reuse a freed one);
 *  - with metadata "P2PHANDSHAKE" (TL_GEN >= 2) the engine announces the
 *    host part of local_server_name (ip_or_host_name is ignored), listens on
 *    an ephemeral port, and its segment name is "<that host>:<port>", what
 *    getLocalIpAndPort returns (v0.3.0 and later);
 *  - with a metadata server, TL_GEN >= 2 ignores ip_or_host_name and
 *    rpc_port: it announces MC_TCP_BIND_ADDRESS or the first LAN address,
 *    on a port it picks (v0.3.0 and later);
 *  - with a metadata server, TL_GEN 1 publishes the rpc_port it is given,
 *    even 0 (it then listens on a port nobody is told about), and a port
 *    that cannot be bound terminates the process, as the C++ exception that
 *    leaves v0.2.0's C API does.
 *
 * Known differences from real builds: none measured so far in what Ferry
 * uses. Structural ones: old builds open one TCP connection per request,
 * this library keeps one per opened segment and serves the requests on it
 * one after the other; submitTransferWithNotify sends the notification after
 * the batch's tasks here, right after submitting on v0.3.5 and on the first
 * completed status poll on v0.3.6 (Ferry never calls it); v0.3.6-v0.3.8
 * crash the serving process on a transfer to unmapped memory (their error
 * log prints the address as a string), which this library does not.
 *
 * Test-only conventions (no real Mooncake has them):
 *  - the metadata service is a directory: "file://<dir>"; an engine writes
 *    "<dir>/<local_server_name>" containing "host:port" (stand-in for the
 *    http/etcd/redis metadata servers real builds need);
 *  - a NIC priority matrix (installTransport's args[0], which real tcp
 *    transports ignore) containing "stall=<ms>" makes that engine's server
 *    sleep <ms> milliseconds before serving each read or write (to test
 *    deadlines);
 *  - on TL_GEN <= 4, the same matrix containing "land_delay=<ms>" (default
 *    2, 0 allowed) sets how long after receiving a WRITE's payload that
 *    engine lands it; the payloads received but not landed yet are held in
 *    memory, at most 256 MiB per engine or "land_cap_mib=<n>" MiB (a sender
 *    then waits for room: back-pressure, not an error), and those still
 *    pending when the engine is destroyed are dropped;
 *  - the same matrix containing "notify=accept" makes a TL_GEN 4 engine
 *    accept notifications (v0.3.8-v0.3.10);
 *  - the same matrix containing "unreg_refuse_len=<n>" makes that engine
 *    keep every region of exactly <n> bytes when asked to let it go:
 *    unregisterLocalMemory returns ERR_CONTEXT and keeps it (peers can still
 *    reach it), and unregisterLocalMemoryBatch, best-effort over the list
 *    as the real TCP transport is, releases the other addresses and
 *    returns its first error (the real call returns one code for the whole
 *    list and does not say which addresses it released). It stands for a
 *    transport that could not release a region (an RDMA memory region
 *    whose deregistration failed), for the tests of Ferry's bookkeeping;
 *  - the same matrix containing "reg_fail_len=<n>" makes that engine refuse
 *    to register a region of exactly <n> bytes (ERR_INVALID_ARGUMENT, from
 *    registerLocalMemory and for the whole registerLocalMemoryBatch list):
 *    with two locations, a later group of a Ferry batch fails after an
 *    earlier one was registered;
 *  - openSegment of the name "ferry-testlib:refuse-notifications" opens
 *    nothing (it fails, -1) and makes that engine reject every notification
 *    sent to it from then on, as a TCP engine of v0.3.5-v0.3.7 does (for
 *    the conformance check of a notification failing after the data).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#ifndef TL_GEN
#error "define TL_GEN"
#endif

#define EXPORT __attribute__((visibility("default")))
#define HIDDEN __attribute__((visibility("hidden")))

#if TL_GEN <= 2
#define CODE(x) (-(x))
#define NOT_IMPLEMENTED (-303)
#else
#define CODE(x) (x)
#define NOT_IMPLEMENTED 999
#endif

/* The TCP transport before v0.3.12: no address check on the serving side,
 * and a WRITE is complete for the client before the peer has written it. */
#define OLD_TCP (TL_GEN <= 4)

#define E_INVALID_ARGUMENT 1
#define E_TOO_MANY_REQUESTS 2
#define E_ADDRESS_NOT_REGISTERED 3
#define E_BATCH_BUSY 4
#define E_DEVICE_NOT_FOUND 6
#define E_ADDRESS_OVERLAPPED 7
#define E_SOCKET 102
#define E_METADATA 200
#define E_CONTEXT 202

#ifdef TL_OMIT_SUBMIT
#define SUBMIT_VISIBILITY HIDDEN
#else
#define SUBMIT_VISIBILITY EXPORT
#endif

#define STATUS_WAITING 0
#define STATUS_PENDING 1
#define STATUS_INVALID 2
#define STATUS_CANCELED 3
#define STATUS_COMPLETED 4
#define STATUS_TIMEOUT 5
#define STATUS_FAILED 6

/* Old TCP transport (TL_GEN <= 4) landings: default delay between the
 * server receiving a WRITE's payload and applying it, the most payload bytes
 * one engine holds (received but not yet applied; a server connection waits
 * for room beyond that), and the most one landing carries. */
#define LAND_DELAY_DEFAULT_MS 2
#define LAND_CAP_BYTES ((size_t)256 << 20)
#define LAND_CHUNK_BYTES ((size_t)16 << 20)
#define MAX_SEGS 1024
#define MAX_CONNS 1024
#define ENGINE_MAGIC 0x4d43454eu
#define BATCH_MAGIC 0x4d434241u
#define XPORT_MAGIC 0x4d435854u

struct transfer_request {
    int opcode;
    void *source;
    int32_t target_id;
    uint64_t target_offset;
    uint64_t length;
};

struct transfer_status {
    int status;
    uint64_t transferred_bytes;
};

struct buffer_entry {
    void *addr;
    size_t length;
};

typedef struct notify_msg {
    char *name;
    char *msg;
} notify_msg_t;

typedef struct {
    uintptr_t addr;
    size_t len;
} region_t;

typedef struct {
    int used;
    char name[256];
    int fd;
    pthread_mutex_t mu;
} seg_t;

struct engine;
struct work;

/* A WRITE payload received by an old-TCP server (TL_GEN <= 4), waiting for
 * the engine's lander thread to apply it at `due`. */
typedef struct landing {
    struct landing *next;
    uintptr_t addr;
    char *buf;
    size_t len;
    struct timespec due; /* CLOCK_MONOTONIC */
} landing_t;

/* A served connection. Every thread the library starts is joined before
 * destroyTransferEngine returns, so no thread runs library code once the
 * library may be unloaded. */
typedef struct {
    int fd;
    int done;
    pthread_t thr;
} conn_t;

#define TL_WORKERS 4

typedef struct {
    uint32_t magic;
    struct engine *eng;
    char proto[32];
} xport_t;

typedef struct engine {
    uint32_t magic;
    pthread_rwlock_t mem;
    region_t *regions;
    size_t nregions, capregions;

    pthread_mutex_t mu;
    pthread_cond_t cv;
    seg_t segs[MAX_SEGS];
    notify_msg_t *notifs;
    size_t nnotifs, capnotifs;
    conn_t conns[MAX_CONNS];
    int nconns;
    struct work *jobs_head, *jobs_tail;
    pthread_t workers[TL_WORKERS];
    int nworkers;
    int stopping;

    int listen_fd;
    int accept_started;
    pthread_t accept_thr;
    char host[128];
    int port;
    char name[256];
    char metadata_dir[512];
    int p2p;
    int stall_ms;
    int land_delay_ms;
    /* Test-only: regions of this many bytes are never released (0: none). */
    size_t refuse_unregister_len;
    size_t refuse_register_len;
    /* Whether this engine's server accepts notifications (TCP engines of
     * v0.3.5-v0.3.7 reject them: only the RDMA transport installed the
     * handler until v0.3.8). */
    int notify_accept;
    xport_t xport;
    int transport_installed;

    /* Old TCP transport (TL_GEN <= 4): the lander applies received WRITE
     * payloads in FIFO order. land_bytes counts the payload bytes reserved
     * by server connections plus those queued, at most LAND_CAP_BYTES. */
    pthread_mutex_t land_mu;
    pthread_cond_t land_cv; /* the lander waits for work or for a due time */
    pthread_cond_t room_cv; /* server connections wait for room */
    landing_t *land_head, *land_tail;
    size_t land_bytes;
    size_t land_cap;
    int land_stop;
    int lander_started;
    pthread_t lander;
} engine_t;

typedef struct {
    struct transfer_request req;
    int status;
    uint64_t transferred;
} task_t;

typedef struct {
    uint32_t magic;
    engine_t *eng;
    size_t cap;
    size_t count;
    task_t *tasks;
} batch_t;

/* ---------------------------------------------------------------- wire */

enum { OP_HELLO = 0, OP_READ = 1, OP_WRITE = 2, OP_NOTIFY = 3 };

typedef struct {
    uint32_t op;
    uint32_t pad;
    uint64_t a;
    uint64_t b;
} frame_t;

typedef struct {
    int32_t rc;
    uint32_t pad;
} reply_t;

static int write_all(int fd, const void *buf, size_t n) {
    const char *p = buf;
    while (n > 0) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return -1;
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

static int read_all(int fd, void *buf, size_t n) {
    char *p = buf;
    while (n > 0) {
        ssize_t r = recv(fd, p, n, 0);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return -1;
        p += r;
        n -= (size_t)r;
    }
    return 0;
}

static int drain(int fd, uint64_t n) {
    char buf[4096];
    while (n > 0) {
        size_t k = n < sizeof buf ? (size_t)n : sizeof buf;
        if (read_all(fd, buf, k)) return -1;
        n -= k;
    }
    return 0;
}

static void sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) && errno == EINTR) {
    }
}

/* Whether [addr, addr+len) lies inside one registered region. Caller holds
 * e->mem (read or write). */
static int covered(engine_t *e, uint64_t addr, uint64_t len) {
    uint64_t end;
    if (len == 0 || __builtin_add_overflow(addr, len, &end)) return 0;
    for (size_t i = 0; i < e->nregions; i++) {
        uint64_t ra = e->regions[i].addr, re = ra + e->regions[i].len;
        if (addr >= ra && end <= re) return 1;
    }
    return 0;
}

/* ---------------------------------------------------------------- old TCP */

/* The TCP transport of real builds before v0.3.12 (TL_GEN <= 4) serves a
 * request without looking at the registered regions: it recv()s a WRITE's
 * payload straight into the address the request names (front to back, in
 * 64 KiB chunks) and send()s a READ's bytes straight from it. Its client
 * reports a WRITE completed once the payload is handed to the socket.
 *
 * Here a server connection receives a WRITE's payload into heap buffers,
 * answers at once (so the client's task is COMPLETED before the bytes land)
 * and queues the buffers for the engine's lander thread, which applies each
 * one land_delay_ms later: front to back, the last byte strictly last,
 * through process_vm_writev on this process, so that an unmapped or
 * read-only target is dropped (EFAULT, as recv() fails there) instead of
 * crashing, and mapped but unregistered memory is written. READs go through
 * process_vm_readv and never wait for pending landings. */

/* Copies len bytes from src (ours) to dst with the kernel checking dst;
 * returns how many bytes were copied, front to back, before a failure. */
static size_t vm_write(uintptr_t dst, const char *src, size_t len) {
    size_t done = 0;
    while (done < len) {
        struct iovec l = {(void *)(src + done), len - done};
        struct iovec r = {(void *)(dst + done), len - done};
        ssize_t n = process_vm_writev(getpid(), &l, 1, &r, 1, 0);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) break;
        done += (size_t)n;
    }
    return done;
}

/* Copies len bytes from src (checked by the kernel) to dst (ours); 0 when
 * all of them were copied. */
static int vm_read(char *dst, uintptr_t src, size_t len) {
    size_t done = 0;
    while (done < len) {
        struct iovec l = {dst + done, len - done};
        struct iovec r = {(void *)(src + done), len - done};
        ssize_t n = process_vm_readv(getpid(), &l, 1, &r, 1, 0);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return -1;
        done += (size_t)n;
    }
    return 0;
}

/* Whether every page of [addr, addr+len) can be read (one byte of each page
 * is read through process_vm_readv). */
static int vm_readable(uint64_t addr, uint64_t len) {
    uint64_t end;
    if (len == 0) return 1;
    if (__builtin_add_overflow(addr, len, &end)) return 0;
    uint64_t pg = (uint64_t)sysconf(_SC_PAGESIZE);
    enum { K = 256 };
    struct iovec rem[K];
    char sink[K];
    uint64_t p = addr;
    while (p < end) {
        int k = 0;
        while (k < K && p < end) {
            rem[k].iov_base = (void *)(uintptr_t)p;
            rem[k].iov_len = 1;
            k++;
            if (__builtin_add_overflow(p & ~(pg - 1), pg, &p)) p = end;
        }
        struct iovec loc = {sink, (size_t)k};
        ssize_t n;
        do {
            n = process_vm_readv(getpid(), &loc, 1, rem, (unsigned long)k, 0);
        } while (n < 0 && errno == EINTR);
        if (n != k) return 0;
    }
    return 1;
}

static void ts_add_ms(struct timespec *t, int ms) {
    t->tv_sec += ms / 1000;
    t->tv_nsec += (long)(ms % 1000) * 1000000L;
    if (t->tv_nsec >= 1000000000L) {
        t->tv_sec++;
        t->tv_nsec -= 1000000000L;
    }
}

static int ts_before(const struct timespec *a, const struct timespec *b) {
    return a->tv_sec < b->tv_sec || (a->tv_sec == b->tv_sec && a->tv_nsec < b->tv_nsec);
}

/* Applies one landing: all but the last byte, front to back, then (after a
 * release fence) the last byte, so that whoever sees the last byte sees the
 * whole payload. A target that faults drops the rest of the landing. */
static void land_apply(const landing_t *l) {
    if (l->len == 0) return;
    size_t front = l->len - 1;
    if (vm_write(l->addr, l->buf, front) != front) return;
    __atomic_thread_fence(__ATOMIC_RELEASE);
    vm_write(l->addr + front, l->buf + front, 1);
}

static void *lander_loop(void *p) {
    engine_t *e = p;
    pthread_mutex_lock(&e->land_mu);
    for (;;) {
        while (!e->land_stop && !e->land_head) pthread_cond_wait(&e->land_cv, &e->land_mu);
        if (e->land_stop) break;
        landing_t *l = e->land_head;
        struct timespec now;
        clock_gettime(CLOCK_MONOTONIC, &now);
        if (ts_before(&now, &l->due)) {
            /* Only this thread dequeues, and the engine frees the queue only
             * after joining it: l stays valid; look again after the wait. */
            pthread_cond_timedwait(&e->land_cv, &e->land_mu, &l->due);
            continue;
        }
        e->land_head = l->next;
        if (!e->land_head) e->land_tail = NULL;
        pthread_mutex_unlock(&e->land_mu);
        land_apply(l);
        free(l->buf);
        pthread_mutex_lock(&e->land_mu);
        e->land_bytes -= l->len;
        pthread_cond_broadcast(&e->room_cv);
        free(l);
    }
    pthread_mutex_unlock(&e->land_mu);
    return NULL;
}

/* Reserves room for n payload bytes, waiting while the engine would hold
 * more than land_cap (back-pressure; a reservation larger than the cap
 * waits for an empty queue); -1 once the engine is being destroyed. */
static int land_reserve(engine_t *e, size_t n) {
    pthread_mutex_lock(&e->land_mu);
    while (!e->land_stop && e->land_bytes > 0 && e->land_bytes + n > e->land_cap)
        pthread_cond_wait(&e->room_cv, &e->land_mu);
    int ok = !e->land_stop;
    if (ok) e->land_bytes += n;
    pthread_mutex_unlock(&e->land_mu);
    return ok ? 0 : -1;
}

static void land_unreserve_locked(engine_t *e, size_t n) {
    e->land_bytes -= n;
    pthread_cond_broadcast(&e->room_cv);
}

static void land_unreserve(engine_t *e, size_t n) {
    pthread_mutex_lock(&e->land_mu);
    land_unreserve_locked(e, n);
    pthread_mutex_unlock(&e->land_mu);
}

/* Queues buf (n reserved bytes, taken over) to land at addr after the
 * engine's land delay; -1 (buf freed) once the engine is being destroyed. */
static int land_push(engine_t *e, uintptr_t addr, char *buf, size_t n) {
    landing_t *l = malloc(sizeof *l);
    pthread_mutex_lock(&e->land_mu);
    if (!l || e->land_stop) {
        land_unreserve_locked(e, n);
        pthread_mutex_unlock(&e->land_mu);
        free(l);
        free(buf);
        return -1;
    }
    l->next = NULL;
    l->addr = addr;
    l->buf = buf;
    l->len = n;
    clock_gettime(CLOCK_MONOTONIC, &l->due);
    ts_add_ms(&l->due, __atomic_load_n(&e->land_delay_ms, __ATOMIC_RELAXED));
    if (e->land_tail)
        e->land_tail->next = l;
    else
        e->land_head = l;
    e->land_tail = l;
    pthread_cond_signal(&e->land_cv);
    pthread_mutex_unlock(&e->land_mu);
    return 0;
}

/* Stops the lander: landings not yet applied are dropped. */
static void lander_stop(engine_t *e) {
    pthread_mutex_lock(&e->land_mu);
    e->land_stop = 1;
    pthread_cond_broadcast(&e->land_cv);
    pthread_cond_broadcast(&e->room_cv);
    pthread_mutex_unlock(&e->land_mu);
    if (e->lander_started) pthread_join(e->lander, NULL);
    e->lander_started = 0;
    pthread_mutex_lock(&e->land_mu);
    landing_t *l = e->land_head;
    e->land_head = e->land_tail = NULL;
    while (l) {
        landing_t *next = l->next;
        e->land_bytes -= l->len;
        free(l->buf);
        free(l);
        l = next;
    }
    pthread_mutex_unlock(&e->land_mu);
}

/* Serves an old-TCP WRITE: no address check; the reply goes out once the
 * payload is received, before it lands. Non-zero: drop the connection. */
static int old_serve_write(engine_t *e, int fd, const frame_t *f) {
    reply_t r = {0, 0};
    if (write_all(fd, &r, sizeof r)) return -1;
    pthread_mutex_lock(&e->land_mu);
    size_t chunk = e->land_cap < LAND_CHUNK_BYTES ? e->land_cap : LAND_CHUNK_BYTES;
    pthread_mutex_unlock(&e->land_mu);
    uint64_t addr = f->a, left = f->b;
    while (left > 0) {
        size_t n = left < chunk ? (size_t)left : chunk;
        if (land_reserve(e, n)) return -1;
        char *buf = malloc(n);
        if (!buf || read_all(fd, buf, n)) {
            free(buf);
            land_unreserve(e, n);
            return -1;
        }
        if (land_push(e, (uintptr_t)addr, buf, n)) return -1;
        addr += n;
        left -= n;
    }
    return write_all(fd, &r, sizeof r);
}

/* Serves an old-TCP READ: no address check, the bytes as they are now
 * (pending landings are not waited for); memory that cannot be read fails
 * the request. Non-zero: drop the connection. */
static int old_serve_read(engine_t *e, int fd, const frame_t *f) {
    (void)e;
    reply_t r = {0, 0};
    if (!vm_readable(f->a, f->b)) {
        r.rc = CODE(E_SOCKET);
        return write_all(fd, &r, sizeof r);
    }
    if (write_all(fd, &r, sizeof r)) return -1;
    size_t chunk = f->b < ((uint64_t)1 << 20) ? (size_t)f->b : ((size_t)1 << 20);
    char *buf = malloc(chunk ? chunk : 1);
    if (!buf) return -1;
    int broken = 0;
    for (uint64_t off = 0; off < f->b && !broken; off += chunk) {
        size_t n = f->b - off < chunk ? (size_t)(f->b - off) : chunk;
        /* Unmapped since the check: the stream cannot go on. */
        broken = vm_read(buf, (uintptr_t)(f->a + off), n) || write_all(fd, buf, n);
    }
    free(buf);
    return broken ? -1 : 0;
}

/* ---------------------------------------------------------------- server */

typedef struct {
    engine_t *eng;
    int fd;
} conn_arg_t;

static void push_notify(engine_t *e, const char *name, const char *msg) {
    pthread_mutex_lock(&e->mu);
    if (e->nnotifs == e->capnotifs) {
        size_t cap = e->capnotifs ? e->capnotifs * 2 : 16;
        notify_msg_t *n = realloc(e->notifs, cap * sizeof *n);
        if (!n) {
            pthread_mutex_unlock(&e->mu);
            return;
        }
        e->notifs = n;
        e->capnotifs = cap;
    }
    e->notifs[e->nnotifs].name = strdup(name);
    e->notifs[e->nnotifs].msg = strdup(msg);
    e->nnotifs++;
    pthread_mutex_unlock(&e->mu);
}

static void *serve_conn(void *p) {
    conn_arg_t *a = p;
    engine_t *e = a->eng;
    int fd = a->fd;
    free(a);
    for (;;) {
        frame_t f;
        reply_t r = {0, 0};
        if (read_all(fd, &f, sizeof f)) break;
        if (f.op == OP_HELLO) {
            r.rc = (int32_t)ENGINE_MAGIC;
            if (write_all(fd, &r, sizeof r)) break;
        } else if (f.op == OP_READ || f.op == OP_WRITE) {
            if (e->stall_ms > 0) sleep_ms(e->stall_ms);
#if OLD_TCP
            if (f.op == OP_READ ? old_serve_read(e, fd, &f) : old_serve_write(e, fd, &f)) break;
#else
            pthread_rwlock_rdlock(&e->mem);
            int ok = covered(e, f.a, f.b);
            r.rc = ok ? 0 : CODE(E_ADDRESS_NOT_REGISTERED);
            int broken = write_all(fd, &r, sizeof r) != 0;
            if (!broken && ok) {
                if (f.op == OP_READ) {
                    broken = write_all(fd, (void *)(uintptr_t)f.a, f.b) != 0;
                } else {
                    broken = read_all(fd, (void *)(uintptr_t)f.a, f.b) != 0;
                    if (!broken) broken = write_all(fd, &r, sizeof r) != 0;
                }
            }
            pthread_rwlock_unlock(&e->mem);
            if (broken) break;
#endif
        } else if (f.op == OP_NOTIFY) {
            if (f.a > (1u << 20) || f.b > (1u << 24)) break;
            char *name = calloc(1, f.a + 1), *msg = calloc(1, f.b + 1);
            int broken = !name || !msg || read_all(fd, name, f.a) || read_all(fd, msg, f.b);
            if (!broken) {
                if (__atomic_load_n(&e->notify_accept, __ATOMIC_RELAXED))
                    push_notify(e, name, msg);
                else
                    r.rc = CODE(E_METADATA); /* the empty reply real builds send */
                broken = write_all(fd, &r, sizeof r) != 0;
            }
            free(name);
            free(msg);
            if (broken) break;
        } else {
            break;
        }
    }
    pthread_mutex_lock(&e->mu);
    for (int i = 0; i < e->nconns; i++) {
        if (!e->conns[i].done && e->conns[i].fd == fd) {
            e->conns[i].done = 1;
            break;
        }
    }
    close(fd);
    pthread_mutex_unlock(&e->mu);
    return NULL;
}

/* Joins finished connection threads. Caller holds e->mu. */
static void reap_conns(engine_t *e) {
    int j = 0;
    for (int i = 0; i < e->nconns; i++) {
        if (e->conns[i].done)
            pthread_join(e->conns[i].thr, NULL);
        else
            e->conns[j++] = e->conns[i];
    }
    e->nconns = j;
}

static void *accept_loop(void *p) {
    engine_t *e = p;
    for (;;) {
        int fd = accept(e->listen_fd, NULL, NULL);
        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED) continue;
            break;
        }
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        pthread_mutex_lock(&e->mu);
        reap_conns(e);
        conn_arg_t *a = malloc(sizeof *a);
        if (e->stopping || e->nconns >= MAX_CONNS || !a) {
            pthread_mutex_unlock(&e->mu);
            free(a);
            close(fd);
            continue;
        }
        a->eng = e;
        a->fd = fd;
        conn_t *c = &e->conns[e->nconns];
        c->fd = fd;
        c->done = 0;
        if (pthread_create(&c->thr, NULL, serve_conn, a)) {
            pthread_mutex_unlock(&e->mu);
            free(a);
            close(fd);
            continue;
        }
        e->nconns++;
        pthread_mutex_unlock(&e->mu);
    }
    return NULL;
}

static void *worker_loop(void *p);

/* ---------------------------------------------------------------- engine */

static engine_t *engine_new(const char *metadata) {
    engine_t *e = calloc(1, sizeof *e);
    if (!e) return NULL;
    e->magic = ENGINE_MAGIC;
    pthread_rwlock_init(&e->mem, NULL);
    pthread_mutex_init(&e->mu, NULL);
    pthread_cond_init(&e->cv, NULL);
    for (int i = 0; i < MAX_SEGS; i++) pthread_mutex_init(&e->segs[i].mu, NULL);
    e->listen_fd = -1;
    e->xport.magic = XPORT_MAGIC;
    e->xport.eng = e;
    e->land_delay_ms = LAND_DELAY_DEFAULT_MS;
    e->notify_accept = TL_GEN >= 5;
    e->land_cap = LAND_CAP_BYTES;
    pthread_mutex_init(&e->land_mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&e->land_cv, &ca);
    pthread_condattr_destroy(&ca);
    pthread_cond_init(&e->room_cv, NULL);
    if (metadata && strcmp(metadata, "P2PHANDSHAKE") == 0 && TL_GEN >= 2) {
        e->p2p = 1;
    } else if (metadata && strncmp(metadata, "file://", 7) == 0 && strlen(metadata + 7) > 0 &&
               strlen(metadata + 7) < sizeof e->metadata_dir) {
        strcpy(e->metadata_dir, metadata + 7);
    } else {
        fprintf(stderr,
                "mooncake-testlib (gen %d): unsupported metadata connection string \"%s\"\n",
                TL_GEN, metadata ? metadata : "(null)");
        free(e);
        return NULL;
    }
    return e;
}

/* The first non-loopback IPv4 address of this machine, as current builds'
 * findLocalIpAddresses() picks it; -1 if there is none. */
static int first_lan_address(char *out, size_t outlen) {
    struct ifaddrs *ifs = NULL, *i;
    if (getifaddrs(&ifs)) return -1;
    int found = -1;
    for (i = ifs; i && found; i = i->ifa_next) {
        if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET) continue;
        struct sockaddr_in *sin = (struct sockaddr_in *)i->ifa_addr;
        if ((ntohl(sin->sin_addr.s_addr) >> 24) == 127) continue;
        if (inet_ntop(AF_INET, &sin->sin_addr, out, (socklen_t)outlen)) found = 0;
    }
    freeifaddrs(ifs);
    return found;
}

static int engine_init(engine_t *e, const char *name, const char *host, uint64_t port) {
    if (!name || !host || strlen(name) >= sizeof e->name || strlen(host) >= sizeof e->host)
        return CODE(E_INVALID_ARGUMENT);
    strcpy(e->name, name);
    strcpy(e->host, host);
#if TL_GEN >= 2
    if (e->p2p) {
        /* v0.3.0+, P2PHANDSHAKE: the announced host is the host part of
         * local_server_name (ip_or_host_name is ignored), the port is one
         * the library picks, and the segment name is host:port. */
        const char *colon = strrchr(name, ':');
        size_t n = colon ? (size_t)(colon - name) : strlen(name);
        if (n == 0 || n >= sizeof e->host) return CODE(E_INVALID_ARGUMENT);
        memcpy(e->host, name, n);
        e->host[n] = 0;
    } else {
        /* v0.3.0+, metadata server: ip_or_host_name and rpc_port are
         * ignored; the address is MC_TCP_BIND_ADDRESS or the first LAN
         * address, the port one the library picks. */
        const char *bind = getenv("MC_TCP_BIND_ADDRESS");
        if (bind && *bind && strlen(bind) < sizeof e->host) {
            strcpy(e->host, bind);
        } else if (first_lan_address(e->host, sizeof e->host)) {
            fprintf(stderr, "mooncake-testlib (gen %d): not valid LAN address found\n", TL_GEN);
            return -1;
        }
        port = 0;
    }
#endif

    struct addrinfo hints, *res = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE;
    char portstr[16];
    snprintf(portstr, sizeof portstr, "%d", e->p2p ? 0 : (int)(port & 0xffff));
    /* v0.2.0's TCP transport binds the wildcard address. */
    if (getaddrinfo(TL_GEN == 1 ? NULL : e->host, portstr, &hints, &res) || !res)
        return CODE(E_SOCKET);
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (fd < 0 || bind(fd, res->ai_addr, res->ai_addrlen) || listen(fd, 128)) {
        freeaddrinfo(res);
        if (fd >= 0) close(fd);
#if TL_GEN == 1
        /* v0.2.0 era: asio's acceptor throws on a port clash, the exception
         * leaves through the C API and terminates the process. */
        fprintf(stderr, "mooncake-testlib (gen %d): bind: address already in use: "
                        "terminate called after throwing an instance of 'std::system_error'\n",
                TL_GEN);
        abort();
#endif
        return CODE(E_SOCKET);
    }
    freeaddrinfo(res);
    struct sockaddr_in sin;
    socklen_t sl = sizeof sin;
    getsockname(fd, (struct sockaddr *)&sin, &sl);
    e->port = ntohs(sin.sin_port);
    e->listen_fd = fd;
    if (e->metadata_dir[0]) {
        char path[1024];
        snprintf(path, sizeof path, "%s/%s", e->metadata_dir, e->name);
        FILE *f = fopen(path, "w");
        if (!f) {
            close(fd);
            e->listen_fd = -1;
            return CODE(E_METADATA);
        }
        /* v0.2.0 era publishes the rpc_port it was given, even 0 (its
         * transport then listens on a port nobody is told about). */
        fprintf(f, "%s:%d", e->host, TL_GEN == 1 ? (int)(port & 0xffff) : e->port);
        fclose(f);
    }
#if OLD_TCP
    if (pthread_create(&e->lander, NULL, lander_loop, e)) {
        close(fd);
        e->listen_fd = -1;
        return CODE(E_CONTEXT);
    }
    e->lander_started = 1;
#endif
    if (pthread_create(&e->accept_thr, NULL, accept_loop, e)) {
        close(fd);
        e->listen_fd = -1;
        return CODE(E_CONTEXT);
    }
    e->accept_started = 1;
    for (int i = 0; i < TL_WORKERS; i++) {
        if (pthread_create(&e->workers[i], NULL, worker_loop, e)) break;
        e->nworkers++;
    }
    return e->nworkers > 0 ? 0 : CODE(E_CONTEXT);
}

static void engine_destroy(engine_t *e) {
    if (!e || e->magic != ENGINE_MAGIC) return;
    /* Workers finish the queued jobs, then exit. */
    pthread_mutex_lock(&e->mu);
    e->stopping = 1;
    pthread_cond_broadcast(&e->cv);
    pthread_mutex_unlock(&e->mu);
    for (int i = 0; i < e->nworkers; i++) pthread_join(e->workers[i], NULL);
    if (e->listen_fd >= 0) shutdown(e->listen_fd, SHUT_RDWR);
    if (e->accept_started) pthread_join(e->accept_thr, NULL);
    if (e->listen_fd >= 0) close(e->listen_fd);
    /* Before the connections: one may be waiting for room to land. */
    lander_stop(e);
    pthread_mutex_lock(&e->mu);
    for (int i = 0; i < e->nconns; i++)
        if (!e->conns[i].done) shutdown(e->conns[i].fd, SHUT_RDWR);
    int n = e->nconns;
    pthread_t thr[MAX_CONNS];
    for (int i = 0; i < n; i++) thr[i] = e->conns[i].thr;
    e->nconns = 0;
    pthread_mutex_unlock(&e->mu);
    for (int i = 0; i < n; i++) pthread_join(thr[i], NULL);
    for (int i = 0; i < MAX_SEGS; i++)
        if (e->segs[i].used) close(e->segs[i].fd);
    if (e->metadata_dir[0] && e->name[0]) {
        char path[1024];
        snprintf(path, sizeof path, "%s/%s", e->metadata_dir, e->name);
        unlink(path);
    }
    for (size_t i = 0; i < e->nnotifs; i++) {
        free(e->notifs[i].name);
        free(e->notifs[i].msg);
    }
    free(e->notifs);
    free(e->regions);
    pthread_cond_destroy(&e->land_cv);
    pthread_cond_destroy(&e->room_cv);
    pthread_mutex_destroy(&e->land_mu);
    e->magic = 0;
    free(e);
}

static engine_t *as_engine(void *h) {
    engine_t *e = h;
    return (e && e->magic == ENGINE_MAGIC) ? e : NULL;
}

#if TL_GEN == 0
/* Before v0.2.0 the batch and status calls take the transport handle. */
static engine_t *batch_owner(void *h) {
    xport_t *x = h;
    return (x && x->magic == XPORT_MAGIC) ? x->eng : NULL;
}
#else
static engine_t *batch_owner(void *h) { return as_engine(h); }
#endif

/* ---------------------------------------------------------------- segments */

static int connect_to(const char *hostport) {
    char host[256];
    const char *colon = strrchr(hostport, ':');
    if (!colon || (size_t)(colon - hostport) >= sizeof host) return -1;
    memcpy(host, hostport, (size_t)(colon - hostport));
    host[colon - hostport] = 0;
    struct addrinfo hints, *res = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    if (getaddrinfo(host, colon + 1, &hints, &res) || !res) return -1;
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0 || connect(fd, res->ai_addr, res->ai_addrlen)) {
        freeaddrinfo(res);
        if (fd >= 0) close(fd);
        return -1;
    }
    freeaddrinfo(res);
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    frame_t f = {OP_HELLO, 0, 0, 0};
    reply_t r;
    if (write_all(fd, &f, sizeof f) || read_all(fd, &r, sizeof r) ||
        r.rc != (int32_t)ENGINE_MAGIC) {
        close(fd);
        return -1;
    }
    return fd;
}

static int resolve_segment(engine_t *e, const char *name, char *out, size_t outlen) {
    if (e->p2p || !e->metadata_dir[0]) {
        snprintf(out, outlen, "%s", name);
        return 0;
    }
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", e->metadata_dir, name);
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    size_t n = fread(out, 1, outlen - 1, f);
    fclose(f);
    out[n] = 0;
    return n > 0 ? 0 : -1;
}

static int32_t open_segment_impl(void *engine, const char *name, int use_cache) {
    engine_t *e = as_engine(engine);
    if (!e || !name || strlen(name) >= 256) return -1;
    if (strcmp(name, "ferry-testlib:refuse-notifications") == 0) {
        __atomic_store_n(&e->notify_accept, 0, __ATOMIC_RELAXED);
        return -1;
    }
    if (use_cache) {
        pthread_mutex_lock(&e->mu);
        for (int i = 1; i < MAX_SEGS; i++) {
            if (e->segs[i].used && strcmp(e->segs[i].name, name) == 0) {
                pthread_mutex_unlock(&e->mu);
                return i;
            }
        }
        pthread_mutex_unlock(&e->mu);
    }
    char hostport[300];
    if (resolve_segment(e, name, hostport, sizeof hostport)) return -1;
    int fd = connect_to(hostport);
    if (fd < 0) return -1;
    pthread_mutex_lock(&e->mu);
    for (int i = 1; i < MAX_SEGS; i++) {
        if (!e->segs[i].used) {
            e->segs[i].used = 1;
            e->segs[i].fd = fd;
            strcpy(e->segs[i].name, name);
            pthread_mutex_unlock(&e->mu);
            return i;
        }
    }
    pthread_mutex_unlock(&e->mu);
    close(fd);
    return -1;
}

EXPORT int32_t openSegment(void *engine, const char *name) {
    return open_segment_impl(engine, name, 1);
}

#if TL_GEN >= 2
EXPORT int32_t openSegmentNoCache(void *engine, const char *name) {
    return open_segment_impl(engine, name, 0);
}

EXPORT int removeLocalSegment(void *engine, const char *name) {
    (void)name;
    return as_engine(engine) ? 0 : CODE(E_INVALID_ARGUMENT);
}
#endif

EXPORT int closeSegment(void *engine, int32_t id) {
    engine_t *e = as_engine(engine);
    if (!e || id <= 0 || id >= MAX_SEGS) return CODE(E_INVALID_ARGUMENT);
    seg_t *s = &e->segs[id];
    pthread_mutex_lock(&s->mu);
    pthread_mutex_lock(&e->mu);
    int rc = CODE(E_INVALID_ARGUMENT);
    if (s->used) {
        close(s->fd);
        s->used = 0;
        s->name[0] = 0;
        rc = 0;
    }
    pthread_mutex_unlock(&e->mu);
    pthread_mutex_unlock(&s->mu);
    return rc;
}

/* ---------------------------------------------------------------- memory */

static int location_ok(const char *location) {
    if (!location) return CODE(E_INVALID_ARGUMENT);
    if (strcmp(location, "*") == 0 || strncmp(location, "cpu", 3) == 0) return 0;
    return CODE(E_DEVICE_NOT_FOUND);
}

static int overlaps_any(engine_t *e, uintptr_t addr, size_t len) {
    for (size_t i = 0; i < e->nregions; i++) {
        uintptr_t ra = e->regions[i].addr;
        if (addr < ra + e->regions[i].len && ra < addr + len) return 1;
    }
    return 0;
}

static int add_region(engine_t *e, uintptr_t addr, size_t len) {
    if (e->nregions == e->capregions) {
        size_t cap = e->capregions ? e->capregions * 2 : 16;
        region_t *r = realloc(e->regions, cap * sizeof *r);
        if (!r) return CODE(302);
        e->regions = r;
        e->capregions = cap;
    }
    e->regions[e->nregions].addr = addr;
    e->regions[e->nregions].len = len;
    e->nregions++;
    return 0;
}

/* `keep`: honour "unreg_refuse_len" (an unregister call), or not (the
 * rollback of a registration that failed). */
static int remove_region(engine_t *e, uintptr_t addr, int keep) {
    for (size_t i = 0; i < e->nregions; i++) {
        if (e->regions[i].addr == addr) {
            if (keep && e->refuse_unregister_len && e->regions[i].len == e->refuse_unregister_len)
                return CODE(E_CONTEXT);
            e->regions[i] = e->regions[--e->nregions];
            return 0;
        }
    }
    return CODE(E_ADDRESS_NOT_REGISTERED);
}

EXPORT int registerLocalMemory(void *engine, void *addr, size_t length, const char *location,
                               int remote_accessible) {
    (void)remote_accessible;
    engine_t *e = as_engine(engine);
    if (!e || !addr || length == 0 || (uintptr_t)addr + length < (uintptr_t)addr)
        return CODE(E_INVALID_ARGUMENT);
    int rc = location_ok(location);
    if (rc) return rc;
    pthread_rwlock_wrlock(&e->mem);
    if (e->refuse_register_len && length == e->refuse_register_len)
        rc = CODE(E_INVALID_ARGUMENT);
    else if (overlaps_any(e, (uintptr_t)addr, length))
        rc = CODE(E_ADDRESS_OVERLAPPED);
    else
        rc = add_region(e, (uintptr_t)addr, length);
    pthread_rwlock_unlock(&e->mem);
    return rc;
}

EXPORT int unregisterLocalMemory(void *engine, void *addr) {
    engine_t *e = as_engine(engine);
    if (!e) return CODE(E_INVALID_ARGUMENT);
    pthread_rwlock_wrlock(&e->mem);
    int rc = remove_region(e, (uintptr_t)addr, 1);
    pthread_rwlock_unlock(&e->mem);
    return rc;
}

#if TL_GEN >= 1
EXPORT int registerLocalMemoryBatch(void *engine, struct buffer_entry *list, size_t n,
                                    const char *location) {
    engine_t *e = as_engine(engine);
    if (!e || (n > 0 && !list)) return CODE(E_INVALID_ARGUMENT);
    int rc = location_ok(location);
    if (rc) return rc;
    pthread_rwlock_wrlock(&e->mem);
    for (size_t i = 0; i < n && !rc; i++) {
        uintptr_t a = (uintptr_t)list[i].addr;
        size_t l = list[i].length;
        if (!a || l == 0 || a + l < a) rc = CODE(E_INVALID_ARGUMENT);
        else if (e->refuse_register_len && l == e->refuse_register_len)
            rc = CODE(E_INVALID_ARGUMENT);
        else if (overlaps_any(e, a, l)) rc = CODE(E_ADDRESS_OVERLAPPED);
        for (size_t j = 0; j < i && !rc; j++) {
            uintptr_t b = (uintptr_t)list[j].addr;
            if (a < b + list[j].length && b < a + l) rc = CODE(E_ADDRESS_OVERLAPPED);
        }
    }
    size_t added = 0;
    for (size_t i = 0; i < n && !rc; i++, added++)
        rc = add_region(e, (uintptr_t)list[i].addr, list[i].length);
    if (rc)
        for (size_t i = 0; i < added; i++) remove_region(e, (uintptr_t)list[i].addr, 0);
    pthread_rwlock_unlock(&e->mem);
    return rc;
}

EXPORT int unregisterLocalMemoryBatch(void *engine, void **addrs, size_t n) {
    engine_t *e = as_engine(engine);
    if (!e || (n > 0 && !addrs)) return CODE(E_INVALID_ARGUMENT);
    int rc = 0;
    pthread_rwlock_wrlock(&e->mem);
    for (size_t i = 0; i < n; i++) {
        int r = remove_region(e, (uintptr_t)addrs[i], 1);
        if (r && !rc) rc = r;
    }
    pthread_rwlock_unlock(&e->mem);
    return rc;
}
#endif

/* ---------------------------------------------------------------- transfers */

/* 0 when the peer took the notification, CODE(E_METADATA) when it rejected
 * it (as real builds report a rejection), CODE(E_SOCKET) otherwise. */
static int send_notify_on(seg_t *s, const char *name, const char *msg) {
    frame_t f = {OP_NOTIFY, 0, strlen(name), strlen(msg)};
    reply_t r = {0, 0};
    pthread_mutex_lock(&s->mu);
    int bad = !s->used || write_all(s->fd, &f, sizeof f) || write_all(s->fd, name, f.a) ||
              write_all(s->fd, msg, f.b) || read_all(s->fd, &r, sizeof r);
    pthread_mutex_unlock(&s->mu);
    if (bad) return CODE(E_SOCKET);
    return r.rc == 0 ? 0 : CODE(E_METADATA);
}

static int run_task(engine_t *e, struct transfer_request *q) {
    if (q->length == 0) return STATUS_COMPLETED;
    if (q->target_id <= 0 || q->target_id >= MAX_SEGS) return STATUS_FAILED;
    seg_t *s = &e->segs[q->target_id];
    int status = STATUS_FAILED;
    pthread_rwlock_rdlock(&e->mem);
    if (!covered(e, (uintptr_t)q->source, q->length)) {
        pthread_rwlock_unlock(&e->mem);
        return STATUS_FAILED;
    }
    pthread_mutex_lock(&s->mu);
    if (s->used && (q->opcode == 0 || q->opcode == 1)) {
        frame_t f = {q->opcode == 0 ? OP_READ : OP_WRITE, 0, q->target_offset, q->length};
        reply_t r;
        if (!write_all(s->fd, &f, sizeof f) && !read_all(s->fd, &r, sizeof r)) {
            if (r.rc != 0) {
                /* Refused by the peer (status stays FAILED). */
            } else if (q->opcode == 0) {
                if (!read_all(s->fd, q->source, q->length)) status = STATUS_COMPLETED;
            } else {
                if (!write_all(s->fd, q->source, q->length) && !read_all(s->fd, &r, sizeof r) &&
                    r.rc == 0)
                    status = STATUS_COMPLETED;
            }
        }
    }
    pthread_mutex_unlock(&s->mu);
    pthread_rwlock_unlock(&e->mem);
    return status;
}

typedef struct work {
    struct work *next;
    batch_t *b;
    size_t start, n;
    int has_notify;
    char *nname, *nmsg;
} work_t;

static void run_job(engine_t *e, work_t *w) {
    batch_t *b = w->b;
    int *st = calloc(w->n ? w->n : 1, sizeof *st);
    int all_ok = 1;
    for (size_t i = 0; i < w->n; i++) {
        int r = st ? run_task(e, &b->tasks[w->start + i].req) : STATUS_FAILED;
        if (st) st[i] = r;
        if (r != STATUS_COMPLETED) all_ok = 0;
    }
    if (w->has_notify && all_ok && w->n > 0) {
        int32_t tid = b->tasks[w->start].req.target_id;
        if (tid > 0 && tid < MAX_SEGS) send_notify_on(&e->segs[tid], w->nname, w->nmsg);
    }
    for (size_t i = 0; i < w->n; i++) {
        int r = st ? st[i] : STATUS_FAILED;
        b->tasks[w->start + i].transferred =
            r == STATUS_COMPLETED ? b->tasks[w->start + i].req.length : 0;
        /* Last touch of the batch: once every status is terminal, the owner
         * may free it. */
        __atomic_store_n(&b->tasks[w->start + i].status, r, __ATOMIC_RELEASE);
    }
    free(st);
    free(w->nname);
    free(w->nmsg);
    free(w);
}

static void *worker_loop(void *p) {
    engine_t *e = p;
    for (;;) {
        pthread_mutex_lock(&e->mu);
        while (!e->jobs_head && !e->stopping) pthread_cond_wait(&e->cv, &e->mu);
        work_t *w = e->jobs_head;
        if (w) {
            e->jobs_head = w->next;
            if (!e->jobs_head) e->jobs_tail = NULL;
        }
        pthread_mutex_unlock(&e->mu);
        if (!w) return NULL; /* stopping and nothing left */
        run_job(e, w);
    }
}

static batch_t *as_batch(uint64_t id) {
    batch_t *b = (batch_t *)(uintptr_t)id;
    return (b && id != UINT64_MAX && b->magic == BATCH_MAGIC) ? b : NULL;
}

static uint64_t allocate_impl(engine_t *e, size_t size) {
    if (!e) return UINT64_MAX;
    batch_t *b = calloc(1, sizeof *b);
    if (!b) return UINT64_MAX;
    b->tasks = calloc(size ? size : 1, sizeof *b->tasks);
    if (!b->tasks) {
        free(b);
        return UINT64_MAX;
    }
    b->magic = BATCH_MAGIC;
    b->eng = e;
    b->cap = size;
    return (uint64_t)(uintptr_t)b;
}

static int submit_impl(engine_t *e, uint64_t id, struct transfer_request *entries, size_t count,
                       const notify_msg_t *notify) {
    batch_t *b = as_batch(id);
    if (!e || !b || b->eng != e || (count > 0 && !entries)) return CODE(E_INVALID_ARGUMENT);
    if (!e->transport_installed) return CODE(E_CONTEXT);
    if (count > b->cap - b->count) return CODE(E_TOO_MANY_REQUESTS);
    work_t *w = calloc(1, sizeof *w);
    if (!w) return CODE(302);
    size_t start = b->count;
    for (size_t i = 0; i < count; i++) {
        b->tasks[start + i].req = entries[i];
        b->tasks[start + i].status = STATUS_PENDING;
        b->tasks[start + i].transferred = 0;
    }
    b->count += count;
    w->b = b;
    w->start = start;
    w->n = count;
    if (notify) {
        w->has_notify = 1;
        w->nname = strdup(notify->name ? notify->name : "");
        w->nmsg = strdup(notify->msg ? notify->msg : "");
    }
    pthread_mutex_lock(&e->mu);
    if (e->jobs_tail)
        e->jobs_tail->next = w;
    else
        e->jobs_head = w;
    e->jobs_tail = w;
    pthread_cond_broadcast(&e->cv);
    pthread_mutex_unlock(&e->mu);
    return 0;
}

static int status_impl(engine_t *e, uint64_t id, size_t task, struct transfer_status *out) {
    batch_t *b = as_batch(id);
    if (!e || !b || b->eng != e || !out || task >= b->count) return CODE(E_INVALID_ARGUMENT);
    out->status = __atomic_load_n(&b->tasks[task].status, __ATOMIC_ACQUIRE);
    out->transferred_bytes = out->status == STATUS_COMPLETED ? b->tasks[task].transferred : 0;
    return 0;
}

static int free_impl(engine_t *e, uint64_t id) {
    batch_t *b = as_batch(id);
    if (!e || !b || b->eng != e) return CODE(E_INVALID_ARGUMENT);
    for (size_t i = 0; i < b->count; i++) {
        int s = __atomic_load_n(&b->tasks[i].status, __ATOMIC_ACQUIRE);
        if (s == STATUS_WAITING || s == STATUS_PENDING) return CODE(E_BATCH_BUSY);
    }
    b->magic = 0;
    free(b->tasks);
    free(b);
    return 0;
}

EXPORT uint64_t allocateBatchID(void *handle, size_t batch_size) {
    return allocate_impl(batch_owner(handle), batch_size);
}

SUBMIT_VISIBILITY int submitTransfer(void *handle, uint64_t batch_id,
                                     struct transfer_request *entries, size_t count) {
    return submit_impl(batch_owner(handle), batch_id, entries, count, NULL);
}

EXPORT int getTransferStatus(void *handle, uint64_t batch_id, size_t task_id,
                             struct transfer_status *status) {
    return status_impl(batch_owner(handle), batch_id, task_id, status);
}

EXPORT int freeBatchID(void *handle, uint64_t batch_id) {
    return free_impl(batch_owner(handle), batch_id);
}

/* ---------------------------------------------------------------- creation */

/* Test-only convention: a NIC priority matrix (args[0], ignored by real tcp
 * transports) naming "stall=<ms>" makes this engine's server sleep <ms>
 * before serving each read or write; on TL_GEN <= 4, "land_delay=<ms>" (0
 * allowed) sets how long after receiving a WRITE's payload it lands, and
 * "land_cap_mib=<n>" (n >= 1) how many MiB of received payload it holds
 * before a sender waits for room. */
static void parse_test_args(engine_t *e, void **args) {
    if (!args || !args[0]) return;
    const char *m = args[0];
    const char *stall = strstr(m, "stall=");
    if (stall) e->stall_ms = atoi(stall + 6);
    if (strstr(m, "notify=accept")) __atomic_store_n(&e->notify_accept, 1, __ATOMIC_RELAXED);
    const char *refuse = strstr(m, "unreg_refuse_len=");
    if (refuse) {
        long long n = atoll(refuse + 17);
        pthread_rwlock_wrlock(&e->mem);
        e->refuse_unregister_len = n > 0 ? (size_t)n : 0;
        pthread_rwlock_unlock(&e->mem);
    }
    const char *refuse_reg = strstr(m, "reg_fail_len=");
    if (refuse_reg) {
        long long n = atoll(refuse_reg + 13);
        pthread_rwlock_wrlock(&e->mem);
        e->refuse_register_len = n > 0 ? (size_t)n : 0;
        pthread_rwlock_unlock(&e->mem);
    }
    const char *delay = strstr(m, "land_delay=");
    if (delay) {
        int ms = atoi(delay + 11);
        if (ms >= 0) __atomic_store_n(&e->land_delay_ms, ms, __ATOMIC_RELAXED);
    }
    const char *cap = strstr(m, "land_cap_mib=");
    if (cap) {
        long mib = atol(cap + 13);
        if (mib >= 1 && (unsigned long)mib <= (SIZE_MAX >> 20)) {
            pthread_mutex_lock(&e->land_mu);
            e->land_cap = (size_t)mib << 20;
            pthread_cond_broadcast(&e->room_cv);
            pthread_mutex_unlock(&e->land_mu);
        }
    }
}

#if TL_GEN == 0
EXPORT void *createTransferEngine(const char *metadata_uri) { return engine_new(metadata_uri); }

EXPORT int initTransferEngine(void *engine, const char *local_server_name,
                              const char *connectable_name, uint64_t rpc_port) {
    engine_t *e = as_engine(engine);
    if (!e) return CODE(E_INVALID_ARGUMENT);
    return engine_init(e, local_server_name, connectable_name, rpc_port);
}

EXPORT void *installOrGetTransport(void *engine, const char *proto, void **args) {
    engine_t *e = as_engine(engine);
    if (!e || !proto || strcmp(proto, "tcp") != 0) return NULL;
    parse_test_args(e, args);
    snprintf(e->xport.proto, sizeof e->xport.proto, "%s", proto);
    e->transport_installed = 1;
    return &e->xport;
}
#else
static void *create_impl(const char *metadata, const char *name, const char *host,
                         uint64_t port) {
    engine_t *e = engine_new(metadata);
    if (!e) return NULL;
    if (engine_init(e, name, host, port)) {
        engine_destroy(e);
        return NULL;
    }
    return e;
}

#if TL_GEN == 1
EXPORT void *createTransferEngine(const char *metadata_conn_string,
                                  const char *local_server_name, const char *ip_or_host_name,
                                  uint64_t rpc_port) {
    return create_impl(metadata_conn_string, local_server_name, ip_or_host_name, rpc_port);
}
#else
EXPORT void *createTransferEngine(const char *metadata_conn_string,
                                  const char *local_server_name, const char *ip_or_host_name,
                                  uint64_t rpc_port, int auto_discover) {
    (void)auto_discover;
    return create_impl(metadata_conn_string, local_server_name, ip_or_host_name, rpc_port);
}

EXPORT int getLocalIpAndPort(void *engine, char *buf_out, size_t buf_len) {
    engine_t *e = as_engine(engine);
    if (!e || !buf_out || buf_len == 0) return CODE(E_INVALID_ARGUMENT);
    snprintf(buf_out, buf_len, "%s:%d", e->host, e->port);
    return 0;
}
#endif

EXPORT void *installTransport(void *engine, const char *proto, void **args) {
    engine_t *e = as_engine(engine);
    if (!e || !proto || strcmp(proto, "tcp") != 0) return NULL;
    parse_test_args(e, args);
    snprintf(e->xport.proto, sizeof e->xport.proto, "%s", proto);
    e->transport_installed = 1;
    return &e->xport;
}

EXPORT int syncSegmentCache(void *engine) {
    return as_engine(engine) ? 0 : CODE(E_INVALID_ARGUMENT);
}
#endif

EXPORT int uninstallTransport(void *engine, const char *proto) {
    engine_t *e = as_engine(engine);
    if (!e || !proto || strcmp(proto, e->xport.proto) != 0) return CODE(E_INVALID_ARGUMENT);
    e->transport_installed = 0;
    return 0;
}

EXPORT void destroyTransferEngine(void *engine) { engine_destroy(as_engine(engine)); }

/* ---------------------------------------------------------------- notify */

#if TL_GEN >= 3
EXPORT int submitTransferWithNotify(void *engine, uint64_t batch_id,
                                    struct transfer_request *entries, size_t count,
                                    notify_msg_t notify_msg) {
    return submit_impl(as_engine(engine), batch_id, entries, count, &notify_msg);
}

#if TL_GEN == 3
/* What v0.3.5's name/msg pointers point at: strings it destroyed before
 * returning. Here: a static buffer of garbage (not heap memory), so that
 * reading gives nonsense and freeing crashes, as with the real build. */
static char destroyed_string[] = "\xdd\xdd\xdd\xdd\xdd\xdd\xdd\xdd";
#endif

/* Returns a malloc'd array, NULL when there is none. From TL_GEN 4 its
 * strings are malloc'd too (freeNotifsMsgBuf frees all); on TL_GEN 3 they
 * are already destroyed (v0.3.5): only the array is the caller's. */
EXPORT notify_msg_t *getNotifsFromEngine(void *engine, int *size) {
    engine_t *e = as_engine(engine);
    if (!size) return NULL;
    *size = 0;
    if (!e) return NULL;
    pthread_mutex_lock(&e->mu);
    notify_msg_t *out = NULL;
    if (e->nnotifs > 0) {
        out = e->notifs;
        *size = (int)e->nnotifs;
        e->notifs = NULL;
        e->nnotifs = e->capnotifs = 0;
    }
    pthread_mutex_unlock(&e->mu);
#if TL_GEN == 3
    for (int i = 0; i < *size; i++) {
        free(out[i].name);
        free(out[i].msg);
        out[i].name = out[i].msg = destroyed_string;
    }
#endif
    return out;
}

EXPORT int genNotifyInEngine(void *engine, uint64_t target_id, notify_msg_t notify_msg) {
    engine_t *e = as_engine(engine);
    if (!e || target_id == 0 || target_id >= MAX_SEGS || !notify_msg.name || !notify_msg.msg)
        return CODE(E_INVALID_ARGUMENT);
    return send_notify_on(&e->segs[target_id], notify_msg.name, notify_msg.msg);
}
#endif

#if TL_GEN >= 4
EXPORT int freeNotifsMsgBuf(notify_msg_t *msg, int size) {
    for (int i = 0; i < size; i++) {
        free(msg[i].name);
        free(msg[i].msg);
    }
    free(msg);
    return 0;
}
#endif

/* ---------------------------------------------------------------- v0.3.11+ */

#if TL_GEN >= 5
EXPORT int discoverTopology(void *engine) { return as_engine(engine) ? 0 : CODE(E_CONTEXT); }

EXPORT int warmupEfaSegment(void *engine, const char *segment_name) {
    (void)engine;
    (void)segment_name;
    return 0;
}

EXPORT int getNicLoadStats(void *engine, char *buf_out, size_t buf_len) {
    if (!as_engine(engine) || !buf_out || buf_len == 0) return NOT_IMPLEMENTED;
    snprintf(buf_out, buf_len, "{}");
    return 0;
}

EXPORT int showLinks(void *engine, char *buf_out, size_t buf_len, int json) {
    if (!as_engine(engine) || !buf_out || buf_len == 0) return -1;
    snprintf(buf_out, buf_len, "%s", json ? "[]" : "");
    return 0;
}

EXPORT void enableGracefulShutdown(void *engine) { (void)engine; }
#endif
