/* A verbs program that posts with rdma-core's newer calls (ibv_create_qp_ex with send
 * operations, ibv_qp_to_qp_ex, ibv_wr_start ... ibv_wr_complete), as libraries other than UCX
 * do: for the verbs layer's extended QP.
 *
 * Opens the first verbs device, registers one region and connects two RC QPs of its own to
 * each other (RoCE: its port's IPv4-mapped GID, or GID 0). Every 100 ms, tick T, one session
 * on QP A:
 *   - RDMA write of a 64-byte pattern of T into a target area,
 *   - RDMA read of the target back (fenced, signalled),
 *   - atomic fetch-and-add of 1 to a counter (signalled),
 *   - send with immediate T and T as 4 bytes of inline data (signalled) to QP B,
 * then waits for the three completions on A and the receive on B, and checks: the read-back
 * is the pattern, the fetched counter is T - 1 (the counter lives in the process: one lost or
 * repeated atomic over a checkpoint breaks it), the immediate and the payload are T.
 *
 *   verbs_wr SECONDS
 *
 * Prints "ready" once connected, then "tick T ok O bad B" each tick (a bad tick names what was
 * wrong on stderr), and "done ok O bad B" after SECONDS. Exits 2 on a usage error, 3 when a
 * verbs call fails (naming it), 4 when a completion does not come within 10 s. */
#include <arpa/inet.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <infiniband/verbs.h>

#define PAT 64
enum { SRC = 0, TARGET = 64, BACK = 128, COUNTER = 192, FETCHED = 200, RECV = 256, SIZE = 4096 };

static struct ibv_context *ctx;
static struct ibv_pd *pd;
static struct ibv_cq *cq_a, *cq_b;
static struct ibv_mr *mr;
static struct ibv_qp *qp_a, *qp_b;
static uint8_t *buf;
static int gid_index = -1;
static union ibv_gid gid;

static void die(const char *what, int err)
{
    fprintf(stderr, "verbs_wr: %s failed: %s\n", what, strerror(err));
    exit(3);
}

static struct ibv_qp *new_qp(struct ibv_cq *cq)
{
    struct ibv_qp_init_attr_ex a;
    struct ibv_qp *qp;

    memset(&a, 0, sizeof a);
    a.send_cq = cq;
    a.recv_cq = cq;
    a.qp_type = IBV_QPT_RC;
    a.cap.max_send_wr = 16;
    a.cap.max_recv_wr = 4;
    a.cap.max_send_sge = 1;
    a.cap.max_recv_sge = 1;
    a.cap.max_inline_data = 64;
    a.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
    a.pd = pd;
    a.send_ops_flags = IBV_QP_EX_WITH_RDMA_WRITE | IBV_QP_EX_WITH_RDMA_READ |
                       IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD | IBV_QP_EX_WITH_SEND_WITH_IMM;
    qp = ibv_create_qp_ex(ctx, &a);
    if (!qp)
        die("ibv_create_qp_ex", errno);
    return qp;
}

/* INIT, RTR to `peer`, RTS. */
static void connect_to(struct ibv_qp *qp, uint32_t peer)
{
    struct ibv_qp_attr a;
    int rc;

    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_INIT;
    a.port_num = 1;
    a.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;
    rc = ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
    if (rc)
        die("ibv_modify_qp(INIT)", rc);
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_RTR;
    a.path_mtu = IBV_MTU_1024;
    a.dest_qp_num = peer;
    a.rq_psn = 0;
    a.max_dest_rd_atomic = 1;
    a.min_rnr_timer = 12;
    a.ah_attr.is_global = 1;
    a.ah_attr.grh.dgid = gid;
    a.ah_attr.grh.sgid_index = gid_index;
    a.ah_attr.grh.hop_limit = 1;
    a.ah_attr.port_num = 1;
    rc = ibv_modify_qp(qp, &a,
                       IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                           IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
    if (rc)
        die("ibv_modify_qp(RTR)", rc);
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_RTS;
    a.timeout = 14;
    a.retry_cnt = 7;
    a.rnr_retry = 7;
    a.sq_psn = 0;
    a.max_rd_atomic = 1;
    rc = ibv_modify_qp(qp, &a,
                       IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                           IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC);
    if (rc)
        die("ibv_modify_qp(RTS)", rc);
}

static double now(void)
{
    struct timespec t;

    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

/* Waits for `n` completions on `cq` into `wc`; each must have succeeded. */
static void wait_for(struct ibv_cq *cq, int n, struct ibv_wc *wc, const char *what)
{
    double until = now() + 10;
    int got = 0;

    while (got < n) {
        int k = ibv_poll_cq(cq, n - got, wc + got);

        if (k < 0)
            die("ibv_poll_cq", EIO);
        got += k;
        if (k == 0 && now() > until) {
            fprintf(stderr, "verbs_wr: %d of %d completions of %s in 10 s\n", got, n, what);
            exit(4);
        }
    }
    for (int i = 0; i < n; i++)
        if (wc[i].status != IBV_WC_SUCCESS) {
            fprintf(stderr, "verbs_wr: %s: completion of wr %llu: %s\n", what,
                    (unsigned long long)wc[i].wr_id, ibv_wc_status_str(wc[i].status));
            exit(3);
        }
}

/* One tick's session and checks; returns 1 if all was right. */
static int tick(uint32_t t)
{
    struct ibv_qp_ex *x = ibv_qp_to_qp_ex(qp_a);
    uint64_t base = (uintptr_t)buf;
    struct ibv_recv_wr r, *rbad;
    struct ibv_sge rs;
    struct ibv_wc wc[4];
    uint32_t be = htonl(t);
    int rc, ok = 1;

    for (int i = 0; i < PAT; i++)
        buf[SRC + i] = (uint8_t)(t * 31 + i);
    memset(buf + BACK, 0, PAT);
    memset(buf + RECV, 0, 8);
    rs.addr = base + RECV;
    rs.length = 64;
    rs.lkey = mr->lkey;
    memset(&r, 0, sizeof r);
    r.wr_id = 100 + t;
    r.sg_list = &rs;
    r.num_sge = 1;
    rc = ibv_post_recv(qp_b, &r, &rbad);
    if (rc)
        die("ibv_post_recv", rc);

    ibv_wr_start(x);
    x->wr_id = 1;
    x->wr_flags = 0;
    ibv_wr_rdma_write(x, mr->rkey, base + TARGET);
    ibv_wr_set_sge(x, mr->lkey, base + SRC, PAT);
    x->wr_id = 2;
    x->wr_flags = IBV_SEND_SIGNALED | IBV_SEND_FENCE;
    ibv_wr_rdma_read(x, mr->rkey, base + TARGET);
    ibv_wr_set_sge(x, mr->lkey, base + BACK, PAT);
    x->wr_id = 3;
    x->wr_flags = IBV_SEND_SIGNALED;
    ibv_wr_atomic_fetch_add(x, mr->rkey, base + COUNTER, 1);
    ibv_wr_set_sge(x, mr->lkey, base + FETCHED, 8);
    x->wr_id = 4;
    x->wr_flags = IBV_SEND_SIGNALED | IBV_SEND_INLINE;
    ibv_wr_send_imm(x, be);
    ibv_wr_set_inline_data(x, &t, sizeof t);
    rc = ibv_wr_complete(x);
    if (rc)
        die("ibv_wr_complete", rc);

    wait_for(cq_a, 3, wc, "QP A's session");
    wait_for(cq_b, 1, wc + 3, "QP B's receive");
    if (memcmp(buf + BACK, buf + SRC, PAT)) {
        fprintf(stderr, "verbs_wr: tick %u: the read-back is not the pattern written\n", t);
        ok = 0;
    }
    uint64_t fetched;
    memcpy(&fetched, buf + FETCHED, 8);
    if (fetched != t - 1) {
        fprintf(stderr, "verbs_wr: tick %u: the counter was %llu, not %u\n", t,
                (unsigned long long)fetched, t - 1);
        ok = 0;
    }
    uint32_t payload;
    memcpy(&payload, buf + RECV, 4);
    if (!(wc[3].wc_flags & IBV_WC_WITH_IMM) || wc[3].imm_data != be || payload != t ||
        wc[3].wr_id != 100 + t) {
        fprintf(stderr, "verbs_wr: tick %u: received imm %u payload %u wr %llu\n", t,
                ntohl(wc[3].imm_data), payload, (unsigned long long)wc[3].wr_id);
        ok = 0;
    }
    return ok;
}

int main(int argc, char **argv)
{
    struct ibv_device **list;
    static const uint8_t v4[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
    int seconds, n;
    unsigned ok = 0, bad = 0;

    if (argc != 2 || (seconds = atoi(argv[1])) <= 0) {
        fprintf(stderr, "usage: verbs_wr SECONDS\n");
        return 2;
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
    list = ibv_get_device_list(&n);
    if (!list || n == 0)
        die("ibv_get_device_list (no device)", ENODEV);
    ctx = ibv_open_device(list[0]);
    if (!ctx)
        die("ibv_open_device", errno);
    for (int i = 0; i < 16 && gid_index < 0; i++) {
        union ibv_gid g;

        if (ibv_query_gid(ctx, 1, i, &g) == 0 && !memcmp(g.raw, v4, 12))
            gid_index = i, gid = g;
    }
    if (gid_index < 0) {
        gid_index = 0;
        if (ibv_query_gid(ctx, 1, 0, &gid))
            die("ibv_query_gid", errno);
    }
    pd = ibv_alloc_pd(ctx);
    if (!pd)
        die("ibv_alloc_pd", errno);
    buf = aligned_alloc(4096, SIZE);
    if (!buf)
        die("aligned_alloc", ENOMEM);
    memset(buf, 0, SIZE);
    mr = ibv_reg_mr(pd, buf, SIZE,
                    IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ |
                        IBV_ACCESS_REMOTE_ATOMIC);
    if (!mr)
        die("ibv_reg_mr", errno);
    cq_a = ibv_create_cq(ctx, 16, NULL, NULL, 0);
    cq_b = ibv_create_cq(ctx, 16, NULL, NULL, 0);
    if (!cq_a || !cq_b)
        die("ibv_create_cq", errno);
    qp_a = new_qp(cq_a);
    qp_b = new_qp(cq_b);
    if (!ibv_qp_to_qp_ex(qp_a))
        die("ibv_qp_to_qp_ex (no extended QP)", EOPNOTSUPP);
    connect_to(qp_a, qp_b->qp_num);
    connect_to(qp_b, qp_a->qp_num);
    printf("ready\n");

    double end = now() + seconds;
    for (uint32_t t = 1; now() < end; t++) {
        if (tick(t))
            ok++;
        else
            bad++;
        printf("tick %u ok %u bad %u\n", t, ok, bad);
        usleep(100 * 1000);
    }
    printf("done ok %u bad %u\n", ok, bad);
    return 0;
}
