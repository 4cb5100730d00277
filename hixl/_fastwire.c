/* hixl._fastwire: the socket data path's lone op in C, on both sides (docs/data-path.md §4).
 *
 * An optional build (setup.py): without a compiler hixl runs the same path in Python, and
 * HIXL_FASTWIRE=0 forces that (hixl.transports.tcp.FASTWIRE). This is a second
 * implementation of hixl/wire.py's hot path, kept in step by tests/test_fastwire.py, which
 * compares the bytes both build and parse.
 *
 * Client: single() sends one WRITE or READ frame (header, and a WRITE's payload, in one
 * sendmsg) and reads its reply: a reply that is byte for byte the expected OK finishes here
 * (a READ's data lands in the caller's memory); any other reply is handed back to Python
 * (hixl.wire.ClientProtocol.on_reply_header), which decodes it and builds the typed error.
 * Every blocking call is bounded by SO_RCVTIMEO/SO_SNDTIMEO armed from the deadline, the
 * way hixl.transports.tcp._Connection._arm does; the GIL is released around each syscall.
 *
 * Copies: copy_runs() moves the (dst, src, length) runs of an array batch in one C loop
 * without the GIL (hixl.memory.copy_arrays); copy_stream() is one move with streaming
 * (non-temporal) stores, and copy_runs(..., stream=1) streams its runs: for writes into
 * memory this process will not read next (another process's segment), 1.3-1.6x a
 * memmove from 4 KiB to 8784 KiB on the VMs this project measures on (docs/benchmarks.md).
 *
 * Agent: serve() answers lone WRITE/READ frames and vector requests (serve_vector) of one
 * authenticated connection, one after another, until a frame is anything else: that
 * frame's bytes are handed back to the Python loop (server/agent/data_server.py), which
 * serves it as before. A frame is served here
 * only when it is alone on the stream (one receive brought exactly it) and accepted by the
 * same checks as wire.ServerProtocol.on_header_at (magic, version, opcode, length, a
 * segment the agent's resolve() returns, its epoch, bounds, permission, allow-list); a
 * refusal is Python's to answer, so reply codes and texts are the Python path's.
 *
 * Memory safety (issue 14, item 3): the checks, the pin and a WRITE's copy run with the GIL
 * held, so no deregister (Python) interleaves with them. The segment's memory is pinned for
 * the whole op by a memoryview on it, exactly as the Python path's window pins it: the
 * agent's unmap of a deregistered segment is refused (BufferError, deferred) while a view
 * exists, so memory is never unmapped under a memmove or a sendmsg. The GIL is released
 * only around the blocking recv and send calls. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/uio.h>
#include <time.h>

#define HDR 48
#define MAGIC 0x4858
#define VERSION 1
#define FLAG_VECTOR 8 /* wire.FLAG_VECTOR */
#define OP_WRITE 2
#define OP_READ 3
#define OP_REPLY 4
#define MAX_PAYLOAD (64ULL << 20)
#define COPY_MAX (16 << 10) /* a lone READ up to this is read with its reply header */
#define ARM_MIN_S 0.01
#define ARM_MAX_S 3600.0

/* single() statuses */
#define S_OK 0
#define S_OTHER 1   /* a reply that is not the expected OK: its header is in the scratch */
#define S_TIMEOUT 2 /* the deadline passed */
#define S_CLOSED 3  /* EOF */
#define S_ERRNO 4   /* a socket error, errno in the second field */
/* serve() statuses */
#define V_HANDBACK 0 /* n bytes in the ring, for Python to serve */
#define V_IDLE 1     /* SO_RCVTIMEO passed with nothing read */
#define V_EOF 2      /* EOF between frames */
#define V_STALLED 3  /* SO_SNDTIMEO passed with nothing sent */
#define V_ERRNO 4    /* a socket error */
#define V_PAYLOAD_STALLED 5 /* SO_RCVTIMEO passed inside a vector WRITE's payload */
#define V_GONE 6     /* EOF inside a vector WRITE's payload */
#define V_SERVED 7   /* (serve_vector) served: the next frame is read */
#define MAX_VECTOR_RANGES 512 /* wire.MAX_VECTOR_RANGES */
#define VECTOR_MAX_VALUE ((1ULL << 62) - 1) /* wire._VECTOR_MAX_VALUE */

/* ------------------------------------------------------------------ the header */

static inline void put16(unsigned char *p, uint16_t v) { p[0] = v >> 8; p[1] = v; }
static inline void put32(unsigned char *p, uint32_t v) {
    p[0] = v >> 24; p[1] = v >> 16; p[2] = v >> 8; p[3] = v;
}
static inline void put64(unsigned char *p, uint64_t v) {
    put32(p, (uint32_t)(v >> 32)); put32(p + 4, (uint32_t)v);
}
static inline uint16_t get16(const unsigned char *p) { return (uint16_t)(p[0] << 8 | p[1]); }
static inline uint32_t get32(const unsigned char *p) {
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}
static inline uint64_t get64(const unsigned char *p) {
    return (uint64_t)get32(p) << 32 | get32(p + 4);
}

/* wire.HEADER ("!HBBHHIIQQQQ"): magic, version, opcode, flags, reason, status, epoch,
 * request_id, segment_id, addr, length */
static void build(unsigned char *h, unsigned opcode, unsigned flags, unsigned reason,
                  uint32_t status, uint32_t epoch, uint64_t rid, uint64_t segment,
                  uint64_t addr, uint64_t length) {
    put16(h, MAGIC); h[2] = VERSION; h[3] = (unsigned char)opcode; put16(h + 4, flags);
    put16(h + 6, reason); put32(h + 8, status); put32(h + 12, epoch); put64(h + 16, rid);
    put64(h + 24, segment); put64(h + 32, addr); put64(h + 40, length);
}

static double monotonic(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t); /* time.monotonic()'s clock on Linux */
    return (double)t.tv_sec + t.tv_nsec * 1e-9;
}

/* A syscall interrupted by a signal: let Python run its handlers (needs the GIL). -1: one
 * raised (the exception is set). */
static int interrupted(void) {
    int rc;
    PyGILState_STATE g = PyGILState_Ensure();
    rc = PyErr_CheckSignals();
    PyGILState_Release(g);
    return rc;
}

/* ------------------------------------------------------------------ client: single() */

typedef struct {
    int fd;
    double deadline, armed;
} conn_t;

/* _Connection._arm: bound the next blocking call by the deadline; -1 once it has passed,
 * -2 on a setsockopt error (errno set). */
static int arm(conn_t *c) {
    double remaining = c->deadline - monotonic();
    if (remaining <= 0) return -1;
    if (c->armed > 0 && c->armed <= remaining && c->armed * 4 >= remaining) return 0;
    double value = remaining > 2 * ARM_MIN_S ? (remaining / 2 < ARM_MAX_S ? remaining / 2 : ARM_MAX_S)
                                             : remaining;
    struct timeval tv;
    tv.tv_sec = (time_t)value;
    long usec = (long)((value - (double)tv.tv_sec) * 1e6);
    tv.tv_usec = usec > 0 ? usec : (tv.tv_sec ? 0 : 1);
    if (setsockopt(c->fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv) ||
        setsockopt(c->fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv))
        return -2;
    c->armed = value;
    return 0;
}

/* Send every byte of iov[0..cnt) (modified in place). Returns a status (S_OK, S_TIMEOUT,
 * S_ERRNO with *err) or -1 with a Python exception set (a signal handler raised). */
static int send_all(conn_t *c, struct iovec *iov, int cnt, int *err) {
    while (cnt) {
        struct msghdr m;
        memset(&m, 0, sizeof m);
        m.msg_iov = iov; m.msg_iovlen = cnt;
        ssize_t s = sendmsg(c->fd, &m, MSG_NOSIGNAL);
        if (s < 0) {
            if (errno == EINTR) { if (interrupted()) return -1; continue; }
            if (errno == EAGAIN || errno == EWOULDBLOCK) { /* SO_SNDTIMEO: re-arm */
                int a = arm(c);
                if (a == -1) return S_TIMEOUT;
                if (a == -2) { *err = errno; return S_ERRNO; }
                continue;
            }
            *err = errno;
            return S_ERRNO;
        }
        size_t left = (size_t)s;
        while (cnt && left >= iov->iov_len) { left -= iov->iov_len; iov++; cnt--; }
        if (cnt) { iov->iov_base = (char *)iov->iov_base + left; iov->iov_len -= left; }
        if (cnt) {
            int a = arm(c);
            if (a == -1) return S_TIMEOUT;
            if (a == -2) { *err = errno; return S_ERRNO; }
        }
    }
    return S_OK;
}

/* Fill p[got..size) with blocking reads (_Connection._recv_rest). */
static int recv_rest(conn_t *c, unsigned char *p, size_t size, size_t got, int *err) {
    while (got < size) {
        int a = arm(c);
        if (a == -1) return S_TIMEOUT;
        if (a == -2) { *err = errno; return S_ERRNO; }
        ssize_t n = recv(c->fd, p + got, size - got, MSG_WAITALL);
        if (n < 0) {
            if (errno == EINTR) { if (interrupted()) return -1; continue; }
            if (errno == EAGAIN || errno == EWOULDBLOCK) continue;
            *err = errno;
            return S_ERRNO;
        }
        if (n == 0) return S_CLOSED;
        got += (size_t)n;
    }
    return S_OK;
}

/* single(fd, opcode, request_id, segment_id, epoch, remote_addr, local_addr, length,
 *        scratch, deadline, armed) -> (status, extra, armed)
 *
 * `scratch`: the connection's writable reply buffer (at least 48 + 16 KiB). `armed`: the
 * SO_RCVTIMEO/SO_SNDTIMEO now set (0: none), returned as it is after the call. S_OTHER:
 * `extra` bytes followed the reply header in the scratch. S_ERRNO: `extra` is the errno. */
static PyObject *single(PyObject *self, PyObject *args) {
    int fd, opcode;
    unsigned int epoch;
    unsigned long long rid, segment, raddr, laddr, length;
    Py_buffer scratch;
    conn_t c;
    if (!PyArg_ParseTuple(args, "iiKKIKKKw*dd", &fd, &opcode, &rid, &segment, &epoch, &raddr,
                          &laddr, &length, &scratch, &c.deadline, &c.armed))
        return NULL;
    c.fd = fd;
    if ((opcode != OP_WRITE && opcode != OP_READ) || length == 0 || length > MAX_PAYLOAD ||
        scratch.len < HDR + COPY_MAX) {
        PyBuffer_Release(&scratch);
        PyErr_SetString(PyExc_ValueError, "single(): a WRITE or READ of 1..MAX_PAYLOAD bytes, "
                                          "and a scratch of at least 48 + 16 KiB");
        return NULL;
    }
    unsigned char header[HDR], ok[HDR];
    build(header, opcode, 0, 0, 0, epoch, rid, segment, raddr, length);
    build(ok, OP_REPLY, 0, 0, 0, 0, rid, 0, 0, opcode == OP_READ ? length : 0);
    unsigned char *buf = scratch.buf, *local = (unsigned char *)(uintptr_t)laddr;
    int status = S_OK, err = 0;
    Py_ssize_t extra = 0;
    Py_BEGIN_ALLOW_THREADS
    do {
        int a = arm(&c);
        if (a == -1) { status = S_TIMEOUT; break; }
        if (a == -2) { status = S_ERRNO; err = errno; break; }
        struct iovec iov[2] = {{header, HDR}, {local, (size_t)length}};
        status = send_all(&c, iov, opcode == OP_WRITE ? 2 : 1, &err);
        if (status) break;
        size_t more = opcode == OP_READ && length <= COPY_MAX ? (size_t)length : 0;
        ssize_t got;
        for (;;) {
            got = recv(fd, buf, HDR + more, more ? 0 : MSG_WAITALL);
            if (got < 0 && errno == EINTR) {
                if (interrupted()) { status = -1; break; }
                continue;
            }
            break;
        }
        if (status) break;
        if (got < 0 && errno != EAGAIN && errno != EWOULDBLOCK) { status = S_ERRNO; err = errno; break; }
        if (got < HDR) { /* cut short by a timeout, EOF or a signal */
            status = recv_rest(&c, buf, HDR, got > 0 ? (size_t)got : 0, &err);
            if (status) break;
            got = HDR;
        }
        got -= HDR;
        if (memcmp(buf, ok, HDR)) { status = S_OTHER; extra = got; break; }
        if (opcode == OP_READ) {
            if (got) memcpy(local, buf + HDR, (size_t)got);
            if ((unsigned long long)got != length)
                status = recv_rest(&c, local, (size_t)length, (size_t)got, &err);
        }
    } while (0);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&scratch);
    if (status == -1) return NULL;
    return Py_BuildValue("(ind)", status, status == S_ERRNO ? (Py_ssize_t)err : extra, c.armed);
}

/* ------------------------------------------------------------------ agent: serve() */

static PyObject *s_epoch, *s_base, *s_end, *s_readable, *s_writable, *s_allowed, *s_memory;

/* a Python int attribute as u64; -1 with an exception set when it is not one */
static int attr_u64(PyObject *obj, PyObject *name, uint64_t *out) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (!v) return -1;
    unsigned long long x = PyLong_AsUnsignedLongLong(v);
    Py_DECREF(v);
    if (x == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    *out = x;
    return 0;
}

static int attr_true(PyObject *obj, PyObject *name) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (!v) return -1;
    int t = PyObject_IsTrue(v);
    Py_DECREF(v);
    return t;
}

/* The memory of an accepted lone WRITE/READ, checked exactly as on_header_at accepts it
 * (GIL held). Returns a new memoryview pinning the segment's memory and sets *at to the
 * op's first byte; NULL without an exception when the frame is not accepted (Python then
 * answers it: the refusal and its text are the Python path's); NULL with one on a failure. */
static PyObject *accept_op(PyObject *resolve, PyObject *identity, int opcode,
                           uint64_t segment_id, uint32_t epoch, uint64_t addr, uint64_t length,
                           unsigned char **at) {
    PyObject *key = PyLong_FromUnsignedLongLong(segment_id), *seg, *mv = NULL;
    if (!key) return NULL;
    seg = PyObject_CallOneArg(resolve, key);
    Py_DECREF(key);
    if (!seg) return NULL;
    if (seg == Py_None) goto refuse;
    uint64_t s_ep, base, end;
    /* values a Python int may hold but a u64 cannot: not ours to judge */
    if (attr_u64(seg, s_epoch, &s_ep) || attr_u64(seg, s_base, &base) ||
        attr_u64(seg, s_end, &end)) {
        PyErr_Clear();
        goto refuse;
    }
    /* addr + length <= end, without overflow (length <= MAX_PAYLOAD) */
    if (s_ep != epoch || addr < base || addr > end || length > end - addr) goto refuse;
    int perm = attr_true(seg, opcode == OP_WRITE ? s_writable : s_readable);
    if (perm < 0) goto fail;
    if (!perm) goto refuse;
    PyObject *allowed = PyObject_GetAttr(seg, s_allowed);
    if (!allowed) goto fail;
    if (allowed != Py_None) {
        int in = PySequence_Contains(allowed, identity);
        Py_DECREF(allowed);
        if (in < 0) goto fail;
        if (!in) goto refuse;
    } else {
        Py_DECREF(allowed);
    }
    PyObject *memory = PyObject_GetAttr(seg, s_memory);
    if (!memory) goto fail;
    mv = PyMemoryView_FromObject(memory); /* shares the segment view's buffer: the pin */
    Py_DECREF(memory);
    if (!mv) goto fail;
    Py_buffer *b = PyMemoryView_GET_BUFFER(mv);
    uint64_t offset = addr - base;
    if (!PyBuffer_IsContiguous(b, 'C') || b->len < 0 || offset > (uint64_t)b->len ||
        length > (uint64_t)b->len - offset || (opcode == OP_WRITE && b->readonly)) {
        Py_CLEAR(mv); /* not the segment the checks describe: Python's to answer */
        goto refuse;
    }
    *at = (unsigned char *)b->buf + offset;
    Py_DECREF(seg);
    return mv;
refuse:
    Py_DECREF(seg);
    return NULL;
fail:
    Py_DECREF(seg);
    return NULL;
}

/* Send (`receive` 0: a serve() reply) or receive (1: a vector WRITE's payload, MSG_WAITALL)
 * every byte of iov[0..cnt) (modified in place), the GIL released. V_HANDBACK when all
 * moved; SO_SNDTIMEO / SO_RCVTIMEO passing gives V_STALLED / V_PAYLOAD_STALLED, EOF on a
 * receive V_GONE, another error V_ERRNO with *err; -1 with a Python exception set when a
 * signal handler raised. */
static int move_iovs(int fd, struct iovec *v, int cnt, int receive, int *err) {
    int status = V_HANDBACK, sig = 0;
    Py_BEGIN_ALLOW_THREADS
    while (cnt) {
        struct msghdr m;
        memset(&m, 0, sizeof m);
        m.msg_iov = v; m.msg_iovlen = cnt;
        ssize_t moved = receive ? recvmsg(fd, &m, MSG_WAITALL) : sendmsg(fd, &m, MSG_NOSIGNAL);
        if (moved < 0) {
            if (errno == EINTR) { if (interrupted()) { sig = 1; break; } continue; }
            status = errno != EAGAIN && errno != EWOULDBLOCK ? V_ERRNO
                     : receive ? V_PAYLOAD_STALLED : V_STALLED;
            *err = errno;
            break;
        }
        if (moved == 0 && receive) { status = V_GONE; break; }
        size_t left = (size_t)moved;
        while (cnt && left >= v->iov_len) { left -= v->iov_len; v++; cnt--; }
        if (cnt) { v->iov_base = (char *)v->iov_base + left; v->iov_len -= left; }
    }
    Py_END_ALLOW_THREADS
    return sig ? -1 : status;
}

/* A vector WRITE or READ whose header is at r[0:HDR] of the ring (`*n` bytes in it, the
 * ring `size` long), served whole in C when it is alone on the stream and accepted by the
 * checks wire.ServerProtocol.on_table makes (every range's address and length, their sum,
 * and the segment's identity, epoch, rights and bounds over the ranges' span, by
 * accept_op): its table is read into the ring after the header, a WRITE's payload lands
 * in the ranges (what the ring holds copied, the rest received straight into segment
 * memory), a READ's ranges are sent after the reply header. Why: the Python loop spent
 * ~100 us of agent time per vector around the data (the table's numpy checks, the run
 * bookkeeping), on the path of every KV layer that goes over a socket.
 *
 * V_SERVED when it was answered; V_HANDBACK when it is Python's (anything unusual, any
 * refusal: its reply and text are the Python path's), with ring[0:*n] holding every byte
 * read of it; another status (with *err for V_ERRNO) when the stream failed; -1 with a
 * Python exception set. The segment stays pinned by accept_op's view until the op's
 * bytes have moved, as on the Python path. */
static int serve_vector(int fd, unsigned char *r, Py_ssize_t size, ssize_t *n,
                        PyObject *resolve, PyObject *identity, PyObject *on_op,
                        double arrived, int *err) {
    int opcode = r[3];
    uint64_t count = get64(r + 32), length = get64(r + 40);
    if (get16(r + 4) != FLAG_VECTOR || (opcode != OP_WRITE && opcode != OP_READ) ||
        count == 0 || count > MAX_VECTOR_RANGES || length == 0 || length > MAX_PAYLOAD)
        return V_HANDBACK;
    size_t table = (size_t)count * 16, framed = HDR + table;
    if ((Py_ssize_t)framed > size) return V_HANDBACK;
    if ((size_t)*n < framed) { /* the rest of the table; short (a stall, EOF): Python's */
        ssize_t got;
        for (;;) {
            Py_BEGIN_ALLOW_THREADS
            got = recv(fd, r + *n, framed - (size_t)*n, MSG_WAITALL);
            *err = errno;
            Py_END_ALLOW_THREADS
            if (got < 0 && *err == EINTR) {
                if (PyErr_CheckSignals()) return -1;
                continue;
            }
            break;
        }
        if (got > 0) *n += got;
        if ((size_t)*n < framed) return V_HANDBACK;
    }
    size_t extra = (size_t)*n - framed; /* payload bytes the ring holds */
    if (opcode == OP_READ ? extra != 0 : extra > length) return V_HANDBACK; /* not alone */
    uint64_t lo = UINT64_MAX, hi = 0, sum = 0;
    for (uint64_t i = 0; i < count; i++) {
        uint64_t addr = get64(r + HDR + 16 * i), len = get64(r + HDR + 16 * i + 8);
        if (addr > VECTOR_MAX_VALUE || len == 0 || len > MAX_PAYLOAD) return V_HANDBACK;
        sum += len;
        if (addr < lo) lo = addr;
        if (addr + len > hi) hi = addr + len;
    }
    if (sum != length) return V_HANDBACK;
    unsigned char *at = NULL;
    PyObject *pin = accept_op(resolve, identity, opcode, get64(r + 24), get32(r + 12), lo,
                              hi - lo, &at);
    if (!pin) return PyErr_Occurred() ? -1 : V_HANDBACK;
    uint64_t rid = get64(r + 16);
    unsigned char reply[HDR];
    struct iovec iov[MAX_VECTOR_RANGES + 1];
    int status, cnt = 0;
    if (opcode == OP_WRITE) {
        const unsigned char *came = r + framed; /* GIL held: no deregister runs meanwhile */
        for (uint64_t i = 0; i < count; i++) {
            unsigned char *dst = at + (get64(r + HDR + 16 * i) - lo);
            size_t len = (size_t)get64(r + HDR + 16 * i + 8), take = extra < len ? extra : len;
            memcpy(dst, came, take);
            came += take, extra -= take;
            if (take < len) iov[cnt++] = (struct iovec){dst + take, len - take};
        }
        status = cnt ? move_iovs(fd, iov, cnt, 1, err) : V_HANDBACK;
        Py_CLEAR(pin); /* dropped before the reply leaves, as on the Python path */
        if (status != V_HANDBACK) return status;
    } else {
        iov[cnt++] = (struct iovec){reply, HDR};
        for (uint64_t i = 0; i < count; i++)
            iov[cnt++] = (struct iovec){at + (get64(r + HDR + 16 * i) - lo),
                                        (size_t)get64(r + HDR + 16 * i + 8)};
    }
    PyObject *res = PyObject_CallFunction(on_op, "iKd", opcode, (unsigned long long)length,
                                          monotonic() - arrived);
    if (!res) {
        Py_XDECREF(pin);
        return -1;
    }
    Py_DECREF(res);
    build(reply, OP_REPLY, 0, 0, 0, 0, rid, 0, 0, opcode == OP_READ ? length : 0);
    if (opcode == OP_WRITE) { /* the reply alone */
        iov[0] = (struct iovec){reply, HDR};
        cnt = 1;
    }
    status = move_iovs(fd, iov, cnt, 0, err);
    Py_XDECREF(pin); /* a READ's ranges: their bytes have left */
    return status == V_HANDBACK ? V_SERVED : status;
}

/* serve(fd, ring, want, resolve, identity, on_op) -> (status, n)
 *
 * Answer lone accepted WRITE/READ frames on an authenticated connection until a receive
 * brings anything else. Each receive asks for up to `want` bytes (the first; then the whole
 * ring) into `ring`. V_HANDBACK: the last receive's `n` bytes are in ring[0:n], unserved.
 * `on_op(opcode, size, seconds)` counts each served op before its reply is sent (seconds:
 * from the frame's arrival to then); an exception from it propagates. */
static PyObject *serve(PyObject *self, PyObject *args) {
    int fd;
    Py_ssize_t want;
    Py_buffer ring;
    PyObject *resolve, *identity, *on_op;
    if (!PyArg_ParseTuple(args, "iw*nOOO", &fd, &ring, &want, &resolve, &identity, &on_op))
        return NULL;
    unsigned char *r = ring.buf;
    if (want < HDR || want > ring.len) {
        PyBuffer_Release(&ring);
        PyErr_SetString(PyExc_ValueError, "serve(): want must be in [48, len(ring)]");
        return NULL;
    }
    int status = V_HANDBACK;
    ssize_t n = 0;
    int err = 0;
    for (;;) {
        Py_BEGIN_ALLOW_THREADS
        n = recv(fd, r, (size_t)want, 0);
        err = errno;
        Py_END_ALLOW_THREADS
        if (n < 0) {
            if (err == EINTR) {
                if (PyErr_CheckSignals()) goto error;
                continue;
            }
            status = err == EAGAIN || err == EWOULDBLOCK ? V_IDLE : V_ERRNO;
            n = status == V_ERRNO ? err : 0;
            break;
        }
        if (n == 0) { status = V_EOF; break; }
        double arrived = monotonic();
        if (n < HDR || get16(r) != MAGIC || r[2] != VERSION) break;
        if (get16(r + 4) & FLAG_VECTOR) { /* a vector request: served here when it can be */
            status = serve_vector(fd, r, ring.len, &n, resolve, identity, on_op, arrived, &err);
            if (status < 0) goto error;
            if (status == V_SERVED) {
                status = V_HANDBACK;
                want = HDR; /* a large payload may follow: read the next header alone */
                continue;
            }
            if (status != V_HANDBACK) n = status == V_ERRNO ? err : 0;
            break;
        }
        /* a lone op: one receive brought exactly one whole frame, less than it asked (the
         * socket held nothing more: wire's "drained") */
        if (n >= want) break;
        int opcode = r[3];
        uint64_t length = get64(r + 40);
        if (length == 0 || length > MAX_PAYLOAD) break;
        if (opcode == OP_WRITE ? (uint64_t)n != HDR + length : opcode != OP_READ || n != HDR)
            break;
        unsigned char *at = NULL;
        PyObject *pin = accept_op(resolve, identity, opcode, get64(r + 24), get32(r + 12),
                                  get64(r + 32), length, &at);
        if (!pin) {
            if (PyErr_Occurred()) goto error;
            break; /* refused or unusual: Python answers it */
        }
        uint64_t rid = get64(r + 16);
        if (opcode == OP_WRITE) { /* GIL held: no deregister runs while we copy */
            memcpy(at, r + HDR, (size_t)length);
            Py_CLEAR(pin); /* dropped before the reply leaves, as on the Python path */
        }
        PyObject *res = PyObject_CallFunction(on_op, "iKd", opcode, (unsigned long long)length,
                                              monotonic() - arrived);
        if (!res) { Py_XDECREF(pin); goto error; }
        Py_DECREF(res);
        unsigned char reply[HDR];
        build(reply, OP_REPLY, 0, 0, 0, 0, rid, 0, 0, opcode == OP_READ ? length : 0);
        struct iovec iov[2] = {{reply, HDR}, {at, (size_t)length}};
        status = move_iovs(fd, iov, opcode == OP_READ ? 2 : 1, 0, &err);
        Py_XDECREF(pin); /* a READ's window: the data has left */
        if (status < 0) goto error;
        if (status != V_HANDBACK) { n = status == V_ERRNO ? err : 0; break; }
        want = ring.len; /* after a small payload the next frames are read greedily */
    }
    PyBuffer_Release(&ring);
    return Py_BuildValue("(in)", status, (Py_ssize_t)n);
error:
    PyBuffer_Release(&ring);
    return NULL;
}

/* ------------------------------------------------------------------ copies: copy_runs() */

/* an int64 array argument: C-contiguous, 8-byte integers (numpy int64 / uint64) */
static int int64_buffer(PyObject *obj, Py_buffer *b, const char *what) {
    if (PyObject_GetBuffer(obj, b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT)) return -1;
    const char *f = b->format ? b->format : "B";
    if (*f == '<' || *f == '=' || *f == '@') f++;
    if (b->itemsize != 8 || f[1] || !strchr("lqLQ", f[0])) {
        PyErr_Format(PyExc_TypeError, "%s must be an int64 array", what);
        PyBuffer_Release(b);
        return -1;
    }
    return 0;
}

#if defined(__x86_64__)
#include <emmintrin.h>
#define STREAM_STORES 1
#endif
#define STREAM_MIN 4096 /* below a page a streamed copy gains nothing */

/* Copy n bytes with streaming stores (SSE2, baseline on x86-64): the destination's lines
 * are not read for ownership first and do not displace the cache. No fence: the caller
 * issues one after its last copy (stream_fence). Overlapping ranges, short copies and
 * other CPUs get memmove. */
static void copy_bytes(char *d, const char *s, size_t n, int stream) {
#ifdef STREAM_STORES
    if (stream && n >= STREAM_MIN && (d + n <= s || s + n <= d)) {
        size_t head = (16 - ((uintptr_t)d & 15)) & 15;
        memcpy(d, s, head);
        d += head, s += head, n -= head;
        for (; n >= 64; n -= 64, d += 64, s += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)s);
            __m128i b = _mm_loadu_si128((const __m128i *)(s + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(s + 32));
            __m128i e = _mm_loadu_si128((const __m128i *)(s + 48));
            _mm_stream_si128((__m128i *)d, a);
            _mm_stream_si128((__m128i *)(d + 16), b);
            _mm_stream_si128((__m128i *)(d + 32), c);
            _mm_stream_si128((__m128i *)(d + 48), e);
        }
        memcpy(d, s, n);
        return;
    }
#endif
    memmove(d, s, n);
}

/* Streamed stores are weakly ordered: fence them before anything the caller writes next
 * (a commit, a signal word) can be seen. */
static void stream_fence(int stream) {
#ifdef STREAM_STORES
    if (stream) _mm_sfence();
#endif
}

/* copy_stream(dst, src, length): one move (addresses as ints, as for ctypes.memmove) with
 * streaming stores, the GIL released; the caller checked the ranges and keeps them mapped. */
static PyObject *copy_stream(PyObject *self, PyObject *args) {
    unsigned long long dst, src;
    Py_ssize_t length;
    if (!PyArg_ParseTuple(args, "KKn", &dst, &src, &length)) return NULL;
    if (length < 0) {
        PyErr_SetString(PyExc_ValueError, "copy_stream(): length is negative");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    copy_bytes((char *)(uintptr_t)dst, (const char *)(uintptr_t)src, (size_t)length, 1);
    stream_fence(1);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* The segment's liveness word at `word` still reads `expect` (the segment is still served)
 * and the owner agent's life word at `life` still names a live thread (a robust futex the
 * kernel marks FUTEX_OWNER_DIED when the agent dies; hixl.segment_states): the checks a
 * READ transfer makes after its copy. Plain loads, after an acquire fence that keeps them
 * behind the copy's loads (a seqlock reader's second check). */
static int still_served(uint64_t word, uint64_t expect, uint64_t life) {
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    if (*(volatile const uint64_t *)(uintptr_t)word != expect) return 0;
    uint32_t owner = *(volatile const uint32_t *)(uintptr_t)life;
    return (owner & 0x3FFFFFFFu) != 0 && (owner & 0x40000000u) == 0;
}

/* n tuples of `width` unsigned ints from a list or tuple of tuples, into out[n * width]
 * (PyMem_Free it); NULL with an exception when the shape or a value is wrong. */
static uint64_t *int_rows(PyObject *rows, Py_ssize_t width, Py_ssize_t *n, const char *what) {
    PyObject *seq = PySequence_Fast(rows, what);
    if (seq == NULL) return NULL;
    *n = PySequence_Fast_GET_SIZE(seq);
    uint64_t *out = PyMem_Malloc((size_t)(*n * width + 1) * sizeof(uint64_t));
    if (out == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < *n; i++) {
        PyObject *row = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyTuple_Check(row) || PyTuple_GET_SIZE(row) != width) {
            PyErr_Format(PyExc_TypeError, "read_checked(): %s[%zd] is not a %zd-tuple", what, i,
                         width);
            goto fail;
        }
        for (Py_ssize_t k = 0; k < width; k++) {
            PyObject *item = PyTuple_GET_ITEM(row, k);
            long long value = PyLong_AsLongLong(item);
            if (value == -1 && PyErr_Occurred()) {
                PyErr_Clear();  /* above 2^63 (an address or an id): take it unsigned */
                value = (long long)PyLong_AsUnsignedLongLong(item);
                if (PyErr_Occurred()) goto fail;
            }
            out[i * width + k] = (uint64_t)value;
        }
    }
    Py_DECREF(seq);
    return out;
fail:
    Py_DECREF(seq);
    PyMem_Free(out);
    return NULL;
}

/* read_checked(moves, checks): memmove each (dst, src, length) of `moves`, mapped peer
 * ranges into this process's memory, then each (word, expect, life) of `checks`
 * (still_served), in one call with the GIL released. True when every check holds. For
 * the store's repeated get of cached keys (hixl.transports.fabric.MappedRange, read_all),
 * where Python calls around a 64 KiB memmove cost half as much as the copy. A negative
 * length refuses the call before any byte moves. */
static PyObject *read_checked(PyObject *self, PyObject *args) {
    PyObject *omoves, *ochecks;
    if (!PyArg_ParseTuple(args, "OO", &omoves, &ochecks)) return NULL;
    Py_ssize_t n, m;
    uint64_t *moves = int_rows(omoves, 3, &n, "moves"), *checks = NULL;
    if (moves == NULL || (checks = int_rows(ochecks, 3, &m, "checks")) == NULL) {
        PyMem_Free(moves);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if ((int64_t)moves[i * 3 + 2] < 0) {
            PyErr_Format(PyExc_ValueError, "read_checked(): moves[%zd] has a negative length", i);
            PyMem_Free(moves);
            PyMem_Free(checks);
            return NULL;
        }
    }
    int served = 1;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++)
        memmove((void *)(uintptr_t)moves[i * 3], (const void *)(uintptr_t)moves[i * 3 + 1],
                (size_t)moves[i * 3 + 2]);
    for (Py_ssize_t i = 0; i < m && served; i++)
        served = still_served(checks[i * 3], checks[i * 3 + 1], checks[i * 3 + 2]);
    Py_END_ALLOW_THREADS
    PyMem_Free(moves);
    PyMem_Free(checks);
    return PyBool_FromLong(served);
}

/* copy_runs(dst, src, lengths, stream=0): memmove(dst[i], src[i], lengths[i]) for every i; three
 * int64 arrays of one length (hixl.memory.copy_arrays' moves). One C loop with the GIL
 * released, instead of a ctypes call (or a numpy gather and scatter) per move: 4 KiB pages
 * at memory speed. The caller checked every range (the engine's bounds checks) and keeps
 * the memory mapped for the call, as for ctypes.memmove; moves must not overlap one
 * another. A negative length refuses the whole call before any byte moves. `stream`: the
 * runs are copied with streaming stores (copy_bytes), fenced once at the end. */
static PyObject *copy_runs(PyObject *self, PyObject *args) {
    PyObject *od, *os, *ol;
    int stream = 0;
    if (!PyArg_ParseTuple(args, "OOO|p", &od, &os, &ol, &stream)) return NULL;
    /* a buffer not (or no longer) held has obj NULL: PyBuffer_Release skips it */
    Py_buffer d = {0}, s = {0}, l = {0};
    PyObject *result = NULL;
    if (int64_buffer(od, &d, "copy_runs(): dst") || int64_buffer(os, &s, "copy_runs(): src") ||
        int64_buffer(ol, &l, "copy_runs(): lengths"))
        goto done;
    Py_ssize_t n = l.len / 8;
    const int64_t *dp = d.buf, *sp = s.buf, *lp = l.buf;
    if (d.len != l.len || s.len != l.len) {
        PyErr_SetString(PyExc_ValueError, "copy_runs(): dst, src and lengths differ in length");
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (lp[i] < 0) {
            PyErr_Format(PyExc_ValueError, "copy_runs(): lengths[%zd] is negative", i);
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++)
        copy_bytes((char *)(uintptr_t)dp[i], (const char *)(uintptr_t)sp[i], (size_t)lp[i],
                   stream);
    stream_fence(stream);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&d);
    PyBuffer_Release(&s);
    PyBuffer_Release(&l);
    return result;
}

/* One span of frame_spans as its tuple: (first op, last op, segment slot, table, local
 * addresses, local lengths) for ranges [a, b) (their first/last op, segment, local and
 * remote address and size in rf, rl, rs, lo, re, sz). */
static PyObject *span_tuple(Py_ssize_t a, Py_ssize_t b, const int64_t *rf, const int64_t *rl,
                            const int64_t *rs, const int64_t *lo, const int64_t *re,
                            const int64_t *sz) {
    Py_ssize_t rows = 0, pieces = 0;
    for (Py_ssize_t r = a; r < b; r++) {
        if (r == a || re[r] != re[r - 1] + sz[r - 1]) rows++;
        if (r == a || lo[r] != lo[r - 1] + sz[r - 1]) pieces++;
    }
    PyObject *table = PyBytes_FromStringAndSize(NULL, rows * 16);
    PyObject *addrs = PyList_New(pieces), *lens = PyList_New(pieces);
    if (!table || !addrs || !lens) goto fail;
    unsigned char *t = (unsigned char *)PyBytes_AS_STRING(table);
    Py_ssize_t row = -1, piece = -1;
    uint64_t row_at = 0, row_len = 0;
    int64_t piece_at = 0, piece_len = 0;
    for (Py_ssize_t r = a; r <= b; r++) {
        int new_row = r == b || r == a || re[r] != re[r - 1] + sz[r - 1];
        int new_piece = r == b || r == a || lo[r] != lo[r - 1] + sz[r - 1];
        if (new_row && row >= 0) {
            put64(t + row * 16, row_at);
            put64(t + row * 16 + 8, row_len);
        }
        if (new_piece && piece >= 0) {
            PyObject *x = PyLong_FromLongLong(piece_at), *y = PyLong_FromLongLong(piece_len);
            if (!x || !y) {
                Py_XDECREF(x);
                Py_XDECREF(y);
                goto fail;
            }
            PyList_SET_ITEM(addrs, piece, x);
            PyList_SET_ITEM(lens, piece, y);
        }
        if (r == b) break;
        if (new_row) row++, row_at = (uint64_t)re[r], row_len = 0;
        if (new_piece) piece++, piece_at = lo[r], piece_len = 0;
        row_len += (uint64_t)sz[r];
        piece_len += sz[r];
    }
    return Py_BuildValue("(LLLNNN)", (long long)rf[a], (long long)rl[b - 1], (long long)rs[a],
                         table, addrs, lens);
fail:
    Py_XDECREF(table);
    Py_XDECREF(addrs);
    Py_XDECREF(lens);
    return NULL;
}

/* frame_spans(seg, local, remote, lengths, limit, max_ranges): how an array batch goes
 * as vector requests (hixl.transports.tcp._frame_spans, which this computes exactly, in
 * one pass instead of some twenty numpy calls: ~100 us per KV layer after its copy had
 * cooled the caches). Ops that continue each other on both sides are one range (one range
 * per op when such a range would pass `limit` bytes); each span takes the next ranges of
 * one segment, at most `max_ranges` of them and no more than `limit` bytes past its
 * first. Per span, a tuple: (first op, last op, segment slot, its range table as
 * big-endian (address, length) u64 pairs, one per run of ranges that continue each
 * other in the segment, and the local side as a list of addresses and one of lengths,
 * one per run that continues locally). Four int64 arrays of one length. */
static PyObject *frame_spans(PyObject *self, PyObject *args) {
    PyObject *oseg, *olocal, *oremote, *olengths;
    long long limit;
    Py_ssize_t max_ranges;
    if (!PyArg_ParseTuple(args, "OOOOLn", &oseg, &olocal, &oremote, &olengths, &limit,
                          &max_ranges))
        return NULL;
    Py_buffer bs = {0}, bl = {0}, br = {0}, bn = {0};
    PyObject *result = NULL;
    int64_t *work = NULL;
    if (int64_buffer(oseg, &bs, "frame_spans(): seg") ||
        int64_buffer(olocal, &bl, "frame_spans(): local") ||
        int64_buffer(oremote, &br, "frame_spans(): remote") ||
        int64_buffer(olengths, &bn, "frame_spans(): lengths"))
        goto done;
    Py_ssize_t n = bn.len / 8;
    if (bs.len != bn.len || bl.len != bn.len || br.len != bn.len) {
        PyErr_SetString(PyExc_ValueError, "frame_spans(): the arrays differ in length");
        goto done;
    }
    if (max_ranges < 1 || limit < 1) {
        PyErr_SetString(PyExc_ValueError, "frame_spans(): limit and max_ranges must be positive");
        goto done;
    }
    const int64_t *seg = bs.buf, *local = bl.buf, *remote = br.buf, *len = bn.buf;
    work = PyMem_Malloc((size_t)(n ? n : 1) * 6 * sizeof(int64_t));
    if (!work) {
        PyErr_NoMemory();
        goto done;
    }
    /* per range: first op, last op, segment, local address, remote address, bytes */
    int64_t *rf = work, *rl = work + n, *rs = work + 2 * n, *lo = work + 3 * n,
            *re = work + 4 * n, *sz = work + 5 * n;
    Py_ssize_t ranges = 0;
    int64_t largest = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (len[i] < 0) {
            PyErr_Format(PyExc_ValueError, "frame_spans(): lengths[%zd] is negative", i);
            goto done;
        }
        if (i && seg[i] == seg[i - 1] && remote[i] == remote[i - 1] + len[i - 1] &&
            local[i] == local[i - 1] + len[i - 1]) {
            rl[ranges - 1] = i;
            sz[ranges - 1] += len[i];
        } else {
            rf[ranges] = rl[ranges] = i;
            rs[ranges] = seg[i], lo[ranges] = local[i], re[ranges] = remote[i];
            sz[ranges] = len[i];
            ranges++;
        }
        if (sz[ranges - 1] > largest) largest = sz[ranges - 1];
    }
    if (largest > limit) { /* a run over the frame limit: one range per op instead */
        for (Py_ssize_t i = 0; i < n; i++) {
            rf[i] = rl[i] = i;
            rs[i] = seg[i], lo[i] = local[i], re[i] = remote[i], sz[i] = len[i];
        }
        ranges = n;
    }
    result = PyList_New(0);
    if (!result) goto done;
    for (Py_ssize_t start = 0; start < ranges;) {
        int64_t room = limit;
        Py_ssize_t stop = start;
        while (stop < ranges && stop - start < max_ranges && rs[stop] == rs[start] &&
               sz[stop] <= room) {
            room -= sz[stop];
            stop++;
        }
        if (stop == start) stop++; /* a range over the limit alone */
        PyObject *span = span_tuple(start, stop, rf, rl, rs, lo, re, sz);
        if (!span || PyList_Append(result, span)) {
            Py_XDECREF(span);
            Py_CLEAR(result);
            goto done;
        }
        Py_DECREF(span);
        start = stop;
    }
done:
    PyMem_Free(work);
    PyBuffer_Release(&bs);
    PyBuffer_Release(&bl);
    PyBuffer_Release(&br);
    PyBuffer_Release(&bn);
    return result;
}

/* recv_scatter(fd, memory, starts, lengths): receive sum(lengths) bytes from blocking
 * socket `fd` into the ranges memory[starts[i]:starts[i] + lengths[i]], in order (a vector
 * WRITE's payload, server/agent/data_server.py), IOV_MAX ranges per recvmsg with
 * MSG_WAITALL, the GIL released around each. `memory` (the segment) is held as a buffer
 * for the call, which pins it as a view does; every range is checked inside it first.
 * Returns the bytes received: short only at end-of-file. SO_RCVTIMEO passing with nothing
 * read raises BlockingIOError, as socket.recvmsg_into does. Why: building a memoryview per
 * range and the iovec lists in Python cost ~170 us per 512 ranges of 4 KiB, a fifth of
 * their transfer. */
#ifndef IOV_MAX
#define IOV_MAX 1024
#endif
static PyObject *recv_scatter(PyObject *self, PyObject *args) {
    int fd;
    Py_buffer m = {0}, st = {0}, ln = {0};
    PyObject *ostarts, *olengths, *result = NULL;
    if (!PyArg_ParseTuple(args, "iw*OO", &fd, &m, &ostarts, &olengths)) return NULL;
    if (int64_buffer(ostarts, &st, "recv_scatter(): starts") ||
        int64_buffer(olengths, &ln, "recv_scatter(): lengths"))
        goto done;
    Py_ssize_t n = ln.len / 8;
    const int64_t *sp = st.buf, *lp = ln.buf;
    if (st.len != ln.len) {
        PyErr_SetString(PyExc_ValueError, "recv_scatter(): starts and lengths differ in length");
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (sp[i] < 0 || lp[i] < 0 || sp[i] > m.len || lp[i] > m.len - sp[i]) {
            PyErr_Format(PyExc_ValueError, "recv_scatter(): range %zd [%lld, +%lld) is outside "
                         "the %zd-byte memory", i, (long long)sp[i], (long long)lp[i], m.len);
            goto done;
        }
    }
    struct iovec iov[IOV_MAX];
    char *base = m.buf;
    Py_ssize_t index = 0, done_in = 0;  /* the first range not wholly filled, bytes in it */
    long long total = 0;
    while (index < n) {
        int count = 0;
        for (Py_ssize_t i = index; i < n && count < IOV_MAX; i++, count++) {
            Py_ssize_t skip = i == index ? done_in : 0;
            iov[count].iov_base = base + sp[i] + skip;
            iov[count].iov_len = (size_t)(lp[i] - skip);
        }
        struct msghdr msg = {0};
        msg.msg_iov = iov;
        msg.msg_iovlen = (size_t)count;
        ssize_t got;
        Py_BEGIN_ALLOW_THREADS
        got = recvmsg(fd, &msg, MSG_WAITALL);
        Py_END_ALLOW_THREADS
        if (got < 0) {
            if (errno == EINTR) {
                if (PyErr_CheckSignals()) goto done;
                continue;
            }
            PyErr_SetFromErrno(PyExc_OSError);  /* EAGAIN: BlockingIOError */
            goto done;
        }
        if (got == 0) break;  /* end-of-file: the caller sees the short count */
        total += got;
        while (got > 0 && index < n) {  /* advance past what the call filled */
            Py_ssize_t left = lp[index] - done_in;
            if (got >= left) {
                got -= left;
                index++;
                done_in = 0;
            } else {
                done_in += got;
                got = 0;
            }
        }
    }
    result = PyLong_FromLongLong(total);
done:
    PyBuffer_Release(&m);
    PyBuffer_Release(&st);
    PyBuffer_Release(&ln);
    return result;
}

/* ------------------------------------------------------------------ for the tests */

/* header(opcode, flags, reason, status, epoch, request_id, segment_id, addr, length) -> the
 * 48 bytes wire.HEADER.pack(MAGIC, VERSION, ...) makes */
static PyObject *header(PyObject *self, PyObject *args) {
    unsigned int opcode, flags, reason, status, epoch;
    unsigned long long rid, segment, addr, length;
    if (!PyArg_ParseTuple(args, "IIIIIKKKK", &opcode, &flags, &reason, &status, &epoch, &rid,
                          &segment, &addr, &length))
        return NULL;
    if (opcode > 0xff || flags > 0xffff || reason > 0xffff) {
        PyErr_SetString(PyExc_OverflowError, "header(): a field out of its range");
        return NULL;
    }
    unsigned char h[HDR];
    build(h, opcode, flags, reason, status, epoch, rid, segment, addr, length);
    return PyBytes_FromStringAndSize((const char *)h, HDR);
}

/* unpack(buffer) -> the 11 fields wire.HEADER.unpack gives */
static PyObject *unpack(PyObject *self, PyObject *arg) {
    Py_buffer b;
    if (PyObject_GetBuffer(arg, &b, PyBUF_SIMPLE)) return NULL;
    if (b.len != HDR) {
        PyBuffer_Release(&b);
        PyErr_SetString(PyExc_ValueError, "unpack(): 48 bytes");
        return NULL;
    }
    const unsigned char *p = b.buf;
    PyObject *t = Py_BuildValue("(IIIIIIIKKKK)", get16(p), p[2], p[3], get16(p + 4),
                                get16(p + 6), get32(p + 8), get32(p + 12),
                                (unsigned long long)get64(p + 16),
                                (unsigned long long)get64(p + 24),
                                (unsigned long long)get64(p + 32),
                                (unsigned long long)get64(p + 40));
    PyBuffer_Release(&b);
    return t;
}

static PyMethodDef methods[] = {
    {"single", single, METH_VARARGS, "One WRITE/READ frame and its reply (client side)."},
    {"serve", serve, METH_VARARGS, "Answer lone accepted WRITE/READ frames (agent side)."},
    {"copy_runs", copy_runs, METH_VARARGS, "memmove per (dst, src, length) of int64 arrays."},
    {"copy_stream", copy_stream, METH_VARARGS, "One move with streaming (non-temporal) stores."},
    {"recv_scatter", recv_scatter, METH_VARARGS, "Receive into many ranges of one buffer."},
    {"read_checked", read_checked, METH_VARARGS, "memmoves, then segment and life words."},
    {"frame_spans", frame_spans, METH_VARARGS, "An array batch's vector requests."},
    {"header", header, METH_VARARGS, "The 48-byte header wire.py packs."},
    {"unpack", unpack, METH_O, "The fields of a 48-byte header."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "hixl._fastwire",
                                    "The socket data path's lone op in C (optional build).",
                                    -1, methods};

PyMODINIT_FUNC PyInit__fastwire(void) {
#define INTERN(var, text) if (!(var = PyUnicode_InternFromString(text))) return NULL
    INTERN(s_epoch, "epoch");
    INTERN(s_base, "base");
    INTERN(s_end, "end");
    INTERN(s_readable, "readable");
    INTERN(s_writable, "writable");
    INTERN(s_allowed, "allowed");
    INTERN(s_memory, "memory");
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    if (PyModule_AddIntConstant(m, "HEADER_SIZE", HDR) ||
        PyModule_AddIntConstant(m, "COPY_MAX", COPY_MAX) ||
        PyModule_AddIntConstant(m, "OK", S_OK) || PyModule_AddIntConstant(m, "OTHER", S_OTHER) ||
        PyModule_AddIntConstant(m, "TIMEOUT", S_TIMEOUT) ||
        PyModule_AddIntConstant(m, "CLOSED", S_CLOSED) ||
        PyModule_AddIntConstant(m, "ERRNO", S_ERRNO) ||
        PyModule_AddIntConstant(m, "HANDBACK", V_HANDBACK) ||
        PyModule_AddIntConstant(m, "IDLE", V_IDLE) || PyModule_AddIntConstant(m, "EOF", V_EOF) ||
        PyModule_AddIntConstant(m, "STALLED", V_STALLED) ||
        PyModule_AddIntConstant(m, "SOCKET_ERROR", V_ERRNO) ||
        PyModule_AddIntConstant(m, "PAYLOAD_STALLED", V_PAYLOAD_STALLED) ||
        PyModule_AddIntConstant(m, "GONE", V_GONE)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
