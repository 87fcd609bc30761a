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
 *  - up to TL_GEN 2, a WRITE to an address the peer has not registered is
 *    reported COMPLETED without writing anything (the old quirk); from
 *    TL_GEN 3 it is FAILED;
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
 * Known differences from real builds, still to be reproduced (measured on
 * real v0.2.0 … v0.3.6 builds; their TCP transport changed in v0.3.12):
 *  - real builds before v0.3.12 report a WRITE completed once it is handed
 *    to the socket, before the peer has written it; this library waits for
 *    the peer's reply;
 *  - real builds before v0.3.12 write wherever the request points at the
 *    peer (mapped but unregistered memory is overwritten, unmapped is
 *    dropped) and report success; this library reports COMPLETED without
 *    writing up to TL_GEN 2 and FAILED from TL_GEN 3.
 *
 * Test-only conventions (no real Mooncake has them):
 *  - the metadata service is a directory: "file://<dir>"; an engine writes
 *    "<dir>/<local_server_name>" containing "host:port" (stand-in for the
 *    http/etcd/redis metadata servers real builds need);
 *  - a NIC priority matrix (installTransport's args[0], which real tcp
 *    transports ignore) containing "stall=<ms>" makes that engine's server
 *    sleep <ms> milliseconds before serving each read or write (to test
 *    deadlines).
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
#define OLD_WRITE_QUIRK 1
#else
#define CODE(x) (x)
#define NOT_IMPLEMENTED 999
#define OLD_WRITE_QUIRK 0
#endif

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
    xport_t xport;
    int transport_installed;
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
        } else if (f.op == OP_NOTIFY) {
            if (f.a > (1u << 20) || f.b > (1u << 24)) break;
            char *name = calloc(1, f.a + 1), *msg = calloc(1, f.b + 1);
            int broken = !name || !msg || read_all(fd, name, f.a) || read_all(fd, msg, f.b);
            if (!broken) {
                push_notify(e, name, msg);
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

static int remove_region(engine_t *e, uintptr_t addr) {
    for (size_t i = 0; i < e->nregions; i++) {
        if (e->regions[i].addr == addr) {
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
    if (overlaps_any(e, (uintptr_t)addr, length))
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
    int rc = remove_region(e, (uintptr_t)addr);
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
        for (size_t i = 0; i < added; i++) remove_region(e, (uintptr_t)list[i].addr);
    pthread_rwlock_unlock(&e->mem);
    return rc;
}

EXPORT int unregisterLocalMemoryBatch(void *engine, void **addrs, size_t n) {
    engine_t *e = as_engine(engine);
    if (!e || (n > 0 && !addrs)) return CODE(E_INVALID_ARGUMENT);
    int rc = 0;
    pthread_rwlock_wrlock(&e->mem);
    for (size_t i = 0; i < n; i++) {
        int r = remove_region(e, (uintptr_t)addrs[i]);
        if (r && !rc) rc = r;
    }
    pthread_rwlock_unlock(&e->mem);
    return rc;
}
#endif

/* ---------------------------------------------------------------- transfers */

static int send_notify_on(seg_t *s, const char *name, const char *msg) {
    frame_t f = {OP_NOTIFY, 0, strlen(name), strlen(msg)};
    reply_t r;
    pthread_mutex_lock(&s->mu);
    int bad = !s->used || write_all(s->fd, &f, sizeof f) || write_all(s->fd, name, f.a) ||
              write_all(s->fd, msg, f.b) || read_all(s->fd, &r, sizeof r) || r.rc != 0;
    pthread_mutex_unlock(&s->mu);
    return bad ? -1 : 0;
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
                /* Old builds: a write to an unregistered remote address is
                 * reported completed although nothing was written. */
                if (OLD_WRITE_QUIRK && q->opcode == 1 &&
                    r.rc == CODE(E_ADDRESS_NOT_REGISTERED))
                    status = STATUS_COMPLETED;
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

#if TL_GEN == 0
EXPORT void *createTransferEngine(const char *metadata_uri) { return engine_new(metadata_uri); }

EXPORT int initTransferEngine(void *engine, const char *local_server_name,
                              const char *connectable_name, uint64_t rpc_port) {
    engine_t *e = as_engine(engine);
    if (!e) return CODE(E_INVALID_ARGUMENT);
    return engine_init(e, local_server_name, connectable_name, rpc_port);
}

EXPORT void *installOrGetTransport(void *engine, const char *proto, void **args) {
    (void)args;
    engine_t *e = as_engine(engine);
    if (!e || !proto || strcmp(proto, "tcp") != 0) return NULL;
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
    /* Test-only convention: a NIC priority matrix (ignored by real tcp
     * transports) naming "stall=<ms>" makes this engine's server sleep <ms>
     * before serving each read or write. */
    if (args && args[0]) {
        const char *stall = strstr((const char *)args[0], "stall=");
        if (stall) e->stall_ms = atoi(stall + 6);
    }
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

/* Returns a malloc'd array of malloc'd strings, NULL when there is none. */
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
    return out;
}

EXPORT int genNotifyInEngine(void *engine, uint64_t target_id, notify_msg_t notify_msg) {
    engine_t *e = as_engine(engine);
    if (!e || target_id == 0 || target_id >= MAX_SEGS || !notify_msg.name || !notify_msg.msg)
        return CODE(E_INVALID_ARGUMENT);
    return send_notify_on(&e->segs[target_id], notify_msg.name, notify_msg.msg)
               ? CODE(E_SOCKET)
               : 0;
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
