/* scripts/socket_floor.py's prototype (issue 14, item 4): the socket path's single op with no Python in the
 * way, to measure what a compiled piece would buy. NOT part of hixl: built into a temp dir by
 * the script (gcc, the interpreter's headers); hixl's wire format, no error texts, no partial
 * sends (one 4 KiB frame always fits an idle unix stream's buffer). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <arpa/inet.h>
#include <string.h>
#include <time.h>
#include <errno.h>
#include <stdint.h>
#include <endian.h>

#define HDR 48
#pragma pack(push, 1)
typedef struct { uint16_t magic; uint8_t version, op; uint16_t flags, reason; uint32_t pad, epoch;
                 uint64_t rid, segment, addr, length; } header_t;
#pragma pack(pop)

static void build(header_t *h, int op, uint32_t epoch, uint64_t rid, uint64_t seg, uint64_t addr, uint64_t len) {
    memset(h, 0, HDR); h->magic = htons(0x4858); h->version = 1; h->op = op; h->epoch = htonl(epoch);
    h->rid = htobe64(rid); h->segment = htobe64(seg); h->addr = htobe64(addr); h->length = htobe64(len);
}
static int recv_all(int fd, char *p, size_t n) {
    while (n) { ssize_t r = recv(fd, p, n, MSG_WAITALL); if (r <= 0) { if (r < 0 && errno == EINTR) continue; return -1; } p += r; n -= r; }
    return 0;
}
static int send_all(int fd, struct iovec *iov, int cnt) {
    struct msghdr m = {0}; m.msg_iov = iov; m.msg_iovlen = cnt;
    size_t total = 0; for (int i = 0; i < cnt; i++) total += iov[i].iov_len;
    ssize_t s = sendmsg(fd, &m, 0);
    return s == (ssize_t)total ? 0 : -1;   /* prototype: small frames go in one call */
}
/* one op: 0 ok, -1 io error, >0 the reply's reason code */
static int one(int fd, int op, uint32_t epoch, uint64_t rid, uint64_t seg, uint64_t raddr, char *local, uint64_t len, char *scratch) {
    header_t h; build(&h, op, epoch, rid, seg, raddr, len);
    struct iovec iov[2] = {{&h, HDR}, {local, len}};
    if (send_all(fd, iov, op == 2 ? 2 : 1)) return -1;
    if (op == 3) {
        ssize_t r = recv(fd, scratch, HDR + len, MSG_WAITALL);
        if (r < HDR) return -1;
        header_t *rep = (header_t *)scratch;
        if (rep->flags || rep->reason) return ntohs(rep->reason) ? ntohs(rep->reason) : 1;
        if (r < (ssize_t)(HDR + len) && recv_all(fd, scratch + r, HDR + len - r)) return -1;
        memcpy(local, scratch + HDR, len);
    } else {
        if (recv_all(fd, scratch, HDR)) return -1;
        header_t *rep = (header_t *)scratch;
        if (rep->flags || rep->reason) return ntohs(rep->reason) ? ntohs(rep->reason) : 1;
    }
    return 0;
}
static char scratch_g[1 << 17];

static PyObject *single(PyObject *self, PyObject *args) {
    int fd, op; unsigned int epoch; unsigned long long rid, seg, raddr, laddr, len;
    if (!PyArg_ParseTuple(args, "iiIKKKKK", &fd, &op, &epoch, &rid, &seg, &raddr, &laddr, &len)) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = one(fd, op, epoch, rid, seg, raddr, (char *)laddr, len, scratch_g);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
}
static PyObject *client_loop(PyObject *self, PyObject *args) {
    int fd, op, n; unsigned int epoch; unsigned long long rid, seg, raddr, laddr, len; Py_buffer out;
    if (!PyArg_ParseTuple(args, "iiIKKKKKiw*", &fd, &op, &epoch, &rid, &seg, &raddr, &laddr, &len, &n, &out)) return NULL;
    int64_t *ns = out.buf; int rc = 0;
    Py_BEGIN_ALLOW_THREADS
    for (int i = 0; i < n && !rc; i++) {
        struct timespec a, b; clock_gettime(CLOCK_MONOTONIC, &a);
        rc = one(fd, op, epoch, rid + i, seg, raddr, (char *)laddr, len, scratch_g);
        clock_gettime(CLOCK_MONOTONIC, &b); ns[i] = (b.tv_sec - a.tv_sec) * 1000000000LL + b.tv_nsec - a.tv_nsec;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&out);
    return PyLong_FromLong(rc);
}
/* serve one accepted connection: HELLO -> OK, WRITE/READ against buf -> OK (+data) */
static PyObject *serve(PyObject *self, PyObject *args) {
    int fd; unsigned long long base, size;
    if (!PyArg_ParseTuple(args, "iKK", &fd, &base, &size)) return NULL;
    static char ring[1 << 17];
    Py_BEGIN_ALLOW_THREADS
    for (;;) {
        header_t h;
        if (recv_all(fd, (char *)&h, HDR)) break;
        uint64_t len = be64toh(h.length), addr = be64toh(h.addr), rid = be64toh(h.rid);
        header_t rep; build(&rep, 4, 0, rid, 0, 0, 0);
        if (h.op == 1) { if (len && recv_all(fd, ring, len)) break; struct iovec v[1] = {{&rep, HDR}}; if (send_all(fd, v, 1)) break; continue; }
        if (addr < base || addr + len > base + size) break;
        if (h.op == 2) { if (recv_all(fd, (char *)addr, len)) break; struct iovec v[1] = {{&rep, HDR}}; if (send_all(fd, v, 1)) break; }
        else { rep.length = htobe64(len); struct iovec v[2] = {{&rep, HDR}, {(char *)addr, len}}; if (send_all(fd, v, 2)) break; }
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}
static PyMethodDef M[] = {{"single", single, METH_VARARGS, ""}, {"client_loop", client_loop, METH_VARARGS, ""},
                          {"serve", serve, METH_VARARGS, ""}, {NULL}};
static struct PyModuleDef D = {PyModuleDef_HEAD_INIT, "fastwire", NULL, -1, M};
PyMODINIT_FUNC PyInit_fastwire(void) { return PyModule_Create(&D); }
