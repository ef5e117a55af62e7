/* What the verbs layer (libckpt_verbs.so) cannot take through a checkpoint, in use by a
 * program that otherwise uses verbs plainly: the agent must refuse to checkpoint it at initial
 * sync, and the program must run on.
 *
 * Opens the first verbs device, makes a PD, a CQ and a UD QP brought to RTS, then, by MODE:
 *   none   nothing more (what the layer takes through a checkpoint: the control case);
 *   fd     also opens the device file (/dev/infiniband/uverbsN) itself and keeps it open:
 *          HCA state the layer does not know and cannot release;
 *   mcast  attaches the QP to the multicast group ff0e::1 (LID 0), which nothing rebuilds;
 *   event  gives the QP a shared receive queue armed with a limit, sends to itself until the
 *          device reports IBV_EVENT_SRQ_LIMIT_REACHED, gets that event and acknowledges it only
 *          once the file $VERBS_REFUSALS_ACK exists (a checkpoint may come between: the
 *          device's destroy of the SRQ waits for the acknowledgement, which the layer must
 *          give for it, and then keep the program's own from reaching the new SRQ);
 * and prints "tick N" every 100 ms for SECONDS seconds.
 *
 *   verbs_refusals MODE SECONDS
 *
 * Prints "ready", "ready fd F on PATH", "ready mcast attached" or "ready srq" once set up (and
 * in event mode "event srq limit reached", then "event acknowledged"); exits 2 on a usage error,
 * 3 when a verbs call fails (naming it). */
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <infiniband/verbs.h>

static void die(const char *what, int err)
{
    fprintf(stderr, "verbs_refusals: %s failed: %s\n", what, strerror(err));
    exit(3);
}

/* A UD QP goes INIT (port, P_Key, Q_Key), RTR, RTS (send PSN). */
static void to_rts(struct ibv_qp *qp)
{
    struct ibv_qp_attr a;
    int rc;

    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_INIT;
    a.pkey_index = 0;
    a.port_num = 1;
    a.qkey = 0x11111111;
    rc = ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY);
    if (rc)
        die("ibv_modify_qp(INIT)", rc);
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_RTR;
    rc = ibv_modify_qp(qp, &a, IBV_QP_STATE);
    if (rc)
        die("ibv_modify_qp(RTR)", rc);
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_RTS;
    a.sq_psn = 0;
    rc = ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_SQ_PSN);
    if (rc)
        die("ibv_modify_qp(RTS)", rc);
}

/* Event mode: the SRQ, its receive buffers, and an address handle to this QP itself. */
static struct ibv_srq *srq;
static struct ibv_mr *mr;
static char *buf;
static struct ibv_ah *self_ah;
static int got_event, acked, sent;
static struct ibv_async_event held;

#define SLOT 256
#define RECVS 8

static void arm_srq(struct ibv_context *ctx, struct ibv_pd *pd)
{
    static const uint8_t v4[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
    struct ibv_srq_attr limit;
    struct ibv_ah_attr ah;
    union ibv_gid gid;
    int i, rc, index = -1;

    buf = calloc(RECVS + 1, SLOT);
    mr = buf ? ibv_reg_mr(pd, buf, (RECVS + 1) * SLOT, IBV_ACCESS_LOCAL_WRITE) : NULL;
    if (!mr)
        die("ibv_reg_mr", errno);
    for (i = 0; i < RECVS; i++) {
        struct ibv_sge sge = {.addr = (uintptr_t)(buf + i * SLOT), .length = SLOT, .lkey = mr->lkey};
        struct ibv_recv_wr wr = {.wr_id = i, .sg_list = &sge, .num_sge = 1}, *bad;

        rc = ibv_post_srq_recv(srq, &wr, &bad);
        if (rc)
            die("ibv_post_srq_recv", rc);
    }
    /* The device reports the event once fewer than 4 receives are left. */
    memset(&limit, 0, sizeof limit);
    limit.srq_limit = 4;
    rc = ibv_modify_srq(srq, &limit, IBV_SRQ_LIMIT);
    if (rc)
        die("ibv_modify_srq(IBV_SRQ_LIMIT)", rc);
    /* RoCE: the first IPv4-mapped GID, else index 0. */
    for (i = 0; i < 16 && index < 0; i++)
        if (ibv_query_gid(ctx, 1, i, &gid) == 0 && !memcmp(gid.raw, v4, 12))
            index = i;
    if (index < 0) {
        index = 0;
        if (ibv_query_gid(ctx, 1, 0, &gid))
            die("ibv_query_gid", errno);
    }
    memset(&ah, 0, sizeof ah);
    ah.is_global = 1;
    ah.grh.dgid = gid;
    ah.grh.sgid_index = index;
    ah.grh.hop_limit = 1;
    ah.port_num = 1;
    self_ah = ibv_create_ah(pd, &ah);
    if (!self_ah)
        die("ibv_create_ah", errno);
    /* Events are taken without waiting, once a tick. */
    i = fcntl(ctx->async_fd, F_GETFL);
    if (i < 0 || fcntl(ctx->async_fd, F_SETFL, i | O_NONBLOCK) < 0)
        die("fcntl(async_fd, O_NONBLOCK)", errno);
}

static void event_tick(struct ibv_context *ctx, struct ibv_cq *cq, struct ibv_qp *qp)
{
    struct ibv_wc wc[8];
    const char *ack = getenv("VERBS_REFUSALS_ACK");
    int n;

    while ((n = ibv_poll_cq(cq, 8, wc)) > 0)
        for (int i = 0; i < n; i++)
            if (wc[i].status != IBV_WC_SUCCESS) {
                fprintf(stderr, "verbs_refusals: completion %s\n", ibv_wc_status_str(wc[i].status));
                exit(3);
            }
    if (n < 0)
        die("ibv_poll_cq", -n);
    if (!got_event && sent < RECVS) {
        struct ibv_sge sge = {.addr = (uintptr_t)(buf + RECVS * SLOT), .length = 16, .lkey = mr->lkey};
        struct ibv_send_wr wr, *bad;
        int rc;

        memset(&wr, 0, sizeof wr);
        wr.sg_list = &sge;
        wr.num_sge = 1;
        wr.opcode = IBV_WR_SEND;
        wr.send_flags = IBV_SEND_SIGNALED;
        wr.wr.ud.ah = self_ah;
        wr.wr.ud.remote_qpn = qp->qp_num;
        wr.wr.ud.remote_qkey = 0x11111111;
        rc = ibv_post_send(qp, &wr, &bad);
        if (rc)
            die("ibv_post_send", rc);
        sent++;
    }
    if (!got_event) {
        if (ibv_get_async_event(ctx, &held) == 0) {
            if (held.event_type != IBV_EVENT_SRQ_LIMIT_REACHED || held.element.srq != srq) {
                fprintf(stderr, "verbs_refusals: unexpected event %s\n",
                        ibv_event_type_str(held.event_type));
                exit(3);
            }
            got_event = 1;
            printf("event srq limit reached\n");
        } else if (errno != EAGAIN) {
            die("ibv_get_async_event", errno);
        }
    } else if (!acked && ack && access(ack, F_OK) == 0) {
        ibv_ack_async_event(&held);
        acked = 1;
        printf("event acknowledged\n");
    }
}

int main(int argc, char **argv)
{
    struct ibv_device **devs;
    struct ibv_context *ctx;
    struct ibv_pd *pd;
    struct ibv_cq *cq;
    struct ibv_qp *qp;
    struct ibv_qp_init_attr init;
    int n, seconds, i, event;

    if (argc != 3 ||
        (strcmp(argv[1], "none") && strcmp(argv[1], "fd") && strcmp(argv[1], "mcast") &&
         strcmp(argv[1], "event")) ||
        (seconds = atoi(argv[2])) <= 0) {
        fprintf(stderr, "usage: verbs_refusals none|fd|mcast|event SECONDS\n");
        return 2;
    }
    event = !strcmp(argv[1], "event");
    setvbuf(stdout, NULL, _IOLBF, 0);
    devs = ibv_get_device_list(&n);
    if (!devs || n == 0)
        die("ibv_get_device_list (no device)", errno ? errno : ENODEV);
    ctx = ibv_open_device(devs[0]);
    if (!ctx)
        die("ibv_open_device", errno);
    pd = ibv_alloc_pd(ctx);
    if (!pd)
        die("ibv_alloc_pd", errno);
    cq = ibv_create_cq(ctx, 16, NULL, NULL, 0);
    if (!cq)
        die("ibv_create_cq", errno);
    memset(&init, 0, sizeof init);
    init.send_cq = cq;
    init.recv_cq = cq;
    init.qp_type = IBV_QPT_UD;
    init.cap.max_send_wr = 4;
    init.cap.max_recv_wr = 4;
    init.cap.max_send_sge = 1;
    init.cap.max_recv_sge = 1;
    if (event) {
        struct ibv_srq_init_attr sa;

        memset(&sa, 0, sizeof sa);
        sa.attr.max_wr = 16;
        sa.attr.max_sge = 1;
        srq = ibv_create_srq(pd, &sa);
        if (!srq)
            die("ibv_create_srq", errno);
        init.srq = srq;
    }
    qp = ibv_create_qp(pd, &init);
    if (!qp)
        die("ibv_create_qp", errno);
    to_rts(qp);

    if (event) {
        arm_srq(ctx, pd);
        printf("ready srq\n");
    } else if (!strcmp(argv[1], "none")) {
        printf("ready\n");
    } else if (!strcmp(argv[1], "fd")) {
        char path[96];
        int fd;

        snprintf(path, sizeof path, "/dev/infiniband/%s", devs[0]->dev_name);
        fd = open(path, O_RDWR);
        if (fd < 0)
            die(path, errno);
        printf("ready fd %d on %s\n", fd, path);
    } else {
        union ibv_gid group;
        int rc;

        memset(&group, 0, sizeof group);
        group.raw[0] = 0xff;
        group.raw[1] = 0x0e;
        group.raw[15] = 0x01;
        rc = ibv_attach_mcast(qp, &group, 0);
        if (rc)
            die("ibv_attach_mcast(ff0e::1)", rc);
        printf("ready mcast attached\n");
    }
    for (i = 0; i < seconds * 10; i++) {
        struct timespec t = {0, 100 * 1000 * 1000};

        printf("tick %d\n", i);
        if (event)
            event_tick(ctx, cq, qp);
        nanosleep(&t, NULL);
    }
    printf("done\n");
    return 0;
}
