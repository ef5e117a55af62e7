/* Processes that make new queue pairs after a restart: for the verbs layer's virtual QP numbers.
 *
 * Two of these run as one job on one node (`verbs_newqp DIR p q` and `verbs_newqp DIR q p`). Each
 * opens the first verbs device and makes UD QPs; each QP's number (as the program sees it, the
 * layer's virtual one) and the port's GID go to DIR/ME.K (K: the QP's index, 0 first). Every
 * 100 ms each process sends, from its QP 0, one message to every QP of its peer it has read
 * from DIR/PEER.K, saying which of the peer's QPs it is for; a message that arrives on another QP
 * than the one it names was misrouted: two QPs answered to one number. When DIR/more-N appears
 * (N = 1, 2, ...), the process makes BATCH more QPs. Before its first QP it makes and destroys
 * BATCH QPs, so that its real numbers are not the device's first: a restart on a fresh device
 * then hands out again, to new QPs, numbers the first QPs still hold as virtual ones.
 *
 *   verbs_newqp DIR ME PEER
 *
 * DIR/ME.status, rewritten every tick: "tick T qps Q peers P sent S ok O bad B src R" (R:
 * messages whose completion named another source QP than the peer's QP 0). Runs until
 * killed. Exits 2 on a usage error, 3 when a verbs call fails (naming it).
 *
 * NEWQP_GID_NTH=K: use the K-th IPv4-mapped GID of the port (0: the first), so that two
 * processes on one node have different addresses. NEWQP_MEET=1: read nothing of the peer until
 * DIR/meet exists, holding meanwhile only an address handle to itself; a peer met only after a
 * checkpoint is one whose endpoints the verbs layer was not sent, and must ask for. */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <infiniband/verbs.h>

#define MAXQ 64
#define BATCH 8
#define RECVS 4
#define SLOT 128 /* 40 bytes of GRH, then the message */
#define QKEY 0x11111111

struct msg {
    uint32_t for_qp; /* the receiver's QP index */
    uint32_t from;   /* the sender's tick */
};

static struct ibv_context *ctx;
static struct ibv_pd *pd;
static struct ibv_cq *cq;
static struct ibv_mr *mr;
static char *buf; /* MAXQ * RECVS receive slots, then one send slot */
static struct ibv_qp *qps[MAXQ];
static int nq;
static struct ibv_ah *ahs[MAXQ];
static uint32_t peer_qpn[MAXQ];
static int npeer;
static int gid_index = -1;
static union ibv_gid gid;
static const char *dir, *me, *peer;

static void die(const char *what, int err)
{
    fprintf(stderr, "verbs_newqp %s: %s failed: %s\n", me, what, strerror(err));
    exit(3);
}

static void modify(struct ibv_qp *qp, struct ibv_qp_attr *a, int mask, const char *what)
{
    int rc = ibv_modify_qp(qp, a, mask);

    if (rc)
        die(what, rc);
}

static struct ibv_qp *new_qp(void)
{
    struct ibv_qp_init_attr init;
    struct ibv_qp_attr a;
    struct ibv_qp *qp;

    memset(&init, 0, sizeof init);
    init.send_cq = cq;
    init.recv_cq = cq;
    init.qp_type = IBV_QPT_UD;
    init.cap.max_send_wr = MAXQ;
    init.cap.max_recv_wr = RECVS;
    init.cap.max_send_sge = 1;
    init.cap.max_recv_sge = 1;
    qp = ibv_create_qp(pd, &init);
    if (!qp)
        die("ibv_create_qp", errno);
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_INIT;
    a.port_num = 1;
    a.qkey = QKEY;
    modify(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY, "INIT");
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_RTR;
    modify(qp, &a, IBV_QP_STATE, "RTR");
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_RTS;
    modify(qp, &a, IBV_QP_STATE | IBV_QP_SQ_PSN, "RTS");
    return qp;
}

static void post_recv(int k, int slot)
{
    struct ibv_sge sge = {
        .addr = (uintptr_t)(buf + (k * RECVS + slot) * SLOT),
        .length = SLOT,
        .lkey = mr->lkey,
    };
    struct ibv_recv_wr wr = {.wr_id = (uint64_t)k * RECVS + slot, .sg_list = &sge, .num_sge = 1}, *bad;
    int rc = ibv_post_recv(qps[k], &wr, &bad);

    if (rc)
        die("ibv_post_recv", rc);
}

/* Writes PATH atomically. */
static void put(const char *path, const char *text)
{
    char tmp[512];
    FILE *f;

    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    f = fopen(tmp, "w");
    if (!f || fputs(text, f) < 0 || fclose(f) || rename(tmp, path))
        die(path, errno);
}

static void add_qp(void)
{
    char path[512], text[128], hex[33];
    int i;

    if (nq == MAXQ)
        return;
    qps[nq] = new_qp();
    for (i = 0; i < RECVS; i++)
        post_recv(nq, i);
    for (i = 0; i < 16; i++)
        sprintf(hex + 2 * i, "%02x", gid.raw[i]);
    snprintf(text, sizeof text, "%u %s\n", qps[nq]->qp_num, hex);
    snprintf(path, sizeof path, "%s/%s.%d", dir, me, nq);
    put(path, text);
    nq++;
}

/* Reads the peer's next QP, if published: its number and GID, and an address handle for it. */
static int learn_peer(void)
{
    char path[512], hex[33];
    struct ibv_ah_attr a;
    unsigned qpn;
    FILE *f;
    int i;

    if (npeer == MAXQ)
        return 0;
    snprintf(path, sizeof path, "%s/%s.%d", dir, peer, npeer);
    f = fopen(path, "r");
    if (!f)
        return 0;
    i = fscanf(f, "%u %32s", &qpn, hex);
    fclose(f);
    if (i != 2)
        return 0;
    memset(&a, 0, sizeof a);
    a.is_global = 1;
    a.port_num = 1;
    a.grh.sgid_index = gid_index;
    a.grh.hop_limit = 1;
    for (i = 0; i < 16; i++)
        sscanf(hex + 2 * i, "%2hhx", &a.grh.dgid.raw[i]);
    ahs[npeer] = ibv_create_ah(pd, &a);
    if (!ahs[npeer])
        die("ibv_create_ah", errno);
    peer_qpn[npeer++] = qpn;
    return 1;
}

int main(int argc, char **argv)
{
    struct ibv_device **devs;
    long sent = 0, ok = 0, bad = 0, strange = 0;
    int n, i, tick, batches = 0, nth, meet;
    struct ibv_ah *self = NULL;

    if (argc != 4) {
        fprintf(stderr, "usage: verbs_newqp DIR ME PEER\n");
        return 2;
    }
    dir = argv[1], me = argv[2], peer = argv[3];
    setvbuf(stdout, NULL, _IOLBF, 0);
    devs = ibv_get_device_list(&n);
    if (!devs || n == 0)
        die("ibv_get_device_list (no device)", errno ? errno : ENODEV);
    ctx = ibv_open_device(devs[0]);
    if (!ctx)
        die("ibv_open_device", errno);
    /* The NEWQP_GID_NTH-th IPv4-mapped GID (RoCE), else index 0. */
    nth = getenv("NEWQP_GID_NTH") ? atoi(getenv("NEWQP_GID_NTH")) : 0;
    meet = getenv("NEWQP_MEET") && atoi(getenv("NEWQP_MEET"));
    for (i = 0; i < 16 && gid_index < 0; i++) {
        union ibv_gid g;
        static const uint8_t v4[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};

        if (ibv_query_gid(ctx, 1, i, &g) == 0 && !memcmp(g.raw, v4, 12) && nth-- == 0)
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
    cq = ibv_create_cq(ctx, MAXQ * (RECVS + MAXQ), NULL, NULL, 0);
    if (!cq)
        die("ibv_create_cq", errno);
    buf = calloc(MAXQ * RECVS + 1, SLOT);
    mr = ibv_reg_mr(pd, buf, (MAXQ * RECVS + 1) * SLOT, IBV_ACCESS_LOCAL_WRITE);
    if (!buf || !mr)
        die("ibv_reg_mr", errno);
    for (i = 0; i < BATCH; i++)
        if (ibv_destroy_qp(new_qp()))
            die("ibv_destroy_qp", errno);
    add_qp();
    if (meet) {
        struct ibv_ah_attr a;

        memset(&a, 0, sizeof a);
        a.is_global = 1;
        a.port_num = 1;
        a.grh.sgid_index = gid_index;
        a.grh.hop_limit = 1;
        a.grh.dgid = gid;
        self = ibv_create_ah(pd, &a);
        if (!self)
            die("ibv_create_ah (itself)", errno);
    }
    printf("ready qp %u gid index %d\n", qps[0]->qp_num, gid_index);
    for (tick = 0;; tick++) {
        struct timespec t = {0, 100 * 1000 * 1000};
        struct ibv_wc wc[32];
        char path[512], text[160];
        int k;

        snprintf(path, sizeof path, "%s/more-%d", dir, batches + 1);
        if (access(path, F_OK) == 0) {
            for (i = 0; i < BATCH; i++)
                add_qp();
            batches++;
            printf("batch %d: %d qps\n", batches, nq);
        }
        snprintf(path, sizeof path, "%s/meet", dir);
        while ((!meet || access(path, F_OK) == 0) && learn_peer())
            ;
        for (k = 0; k < npeer; k++) {
            struct msg *m = (struct msg *)(buf + MAXQ * RECVS * SLOT);
            struct ibv_sge sge = {.addr = (uintptr_t)m, .length = sizeof *m, .lkey = mr->lkey};
            struct ibv_send_wr wr, *badwr;
            int rc;

            m->for_qp = k;
            m->from = tick;
            memset(&wr, 0, sizeof wr);
            wr.sg_list = &sge;
            wr.num_sge = 1;
            wr.opcode = IBV_WR_SEND;
            wr.send_flags = IBV_SEND_SIGNALED | IBV_SEND_INLINE;
            wr.wr.ud.ah = ahs[k];
            wr.wr.ud.remote_qpn = peer_qpn[k];
            wr.wr.ud.remote_qkey = QKEY;
            rc = ibv_post_send(qps[0], &wr, &badwr);
            if (rc)
                die("ibv_post_send", rc);
            sent++;
        }
        nanosleep(&t, NULL);
        while ((n = ibv_poll_cq(cq, 32, wc)) > 0) {
            for (i = 0; i < n; i++) {
                struct msg *m;
                int q = (int)(wc[i].wr_id / RECVS), slot = (int)(wc[i].wr_id % RECVS);

                if (wc[i].status != IBV_WC_SUCCESS) {
                    fprintf(stderr, "verbs_newqp %s: completion %s\n", me,
                            ibv_wc_status_str(wc[i].status));
                    exit(3);
                }
                if (!(wc[i].opcode & IBV_WC_RECV))
                    continue;
                m = (struct msg *)(buf + wc[i].wr_id * SLOT + 40);
                if (q < nq && m->for_qp == (uint32_t)q && wc[i].qp_num == qps[q]->qp_num) {
                    ok++;
                } else {
                    bad++;
                    printf("misrouted: a message for qp #%u arrived on qp #%d (%u)\n", m->for_qp, q,
                           wc[i].qp_num);
                }
                /* Every message comes from the peer's QP 0, which the completion must name by
                 * the number the peer published, wherever the peer is now. */
                if (npeer > 0 && wc[i].src_qp != peer_qpn[0]) {
                    strange++;
                    printf("source qp %u, not the peer's qp 0 (%u)\n", wc[i].src_qp, peer_qpn[0]);
                }
                post_recv(q, slot);
            }
        }
        if (n < 0)
            die("ibv_poll_cq", -n);
        snprintf(text, sizeof text, "tick %d qps %d peers %d sent %ld ok %ld bad %ld src %ld\n",
                 tick, nq, npeer, sent, ok, bad, strange);
        snprintf(path, sizeof path, "%s/%s.status", dir, me);
        put(path, text);
    }
}
