/* What the verbs layer (libckpt_verbs.so) cannot take through a checkpoint, in use by a
 * program that otherwise uses verbs plainly: the agent must refuse to checkpoint it at initial
 * sync, and the program must run on.
 *
 * Opens the first verbs device, makes a PD, a CQ and a UD QP brought to RTS, then, by MODE:
 *   none   nothing more (what the layer takes through a checkpoint: the control case);
 *   fd     also opens the device file (/dev/infiniband/uverbsN) itself and keeps it open:
 *          HCA state the layer does not know and cannot release;
 *   mcast  attaches the QP to the multicast group ff0e::1 (LID 0), which nothing rebuilds;
 * and prints "tick N" every 100 ms for SECONDS seconds.
 *
 *   verbs_refusals MODE SECONDS
 *
 * Prints "ready", "ready fd F on PATH" or "ready mcast attached" once set up; exits 2 on a usage
 * error, 3 when a verbs call fails (naming it). */
#include <errno.h>
#include <fcntl.h>
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

int main(int argc, char **argv)
{
    struct ibv_device **devs;
    struct ibv_context *ctx;
    struct ibv_pd *pd;
    struct ibv_cq *cq;
    struct ibv_qp *qp;
    struct ibv_qp_init_attr init;
    int n, seconds, i;

    if (argc != 3 ||
        (strcmp(argv[1], "none") && strcmp(argv[1], "fd") && strcmp(argv[1], "mcast")) ||
        (seconds = atoi(argv[2])) <= 0) {
        fprintf(stderr, "usage: verbs_refusals none|fd|mcast SECONDS\n");
        return 2;
    }
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
    qp = ibv_create_qp(pd, &init);
    if (!qp)
        die("ibv_create_qp", errno);
    to_rts(qp);

    if (!strcmp(argv[1], "none")) {
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
        nanosleep(&t, NULL);
    }
    printf("done\n");
    return 0;
}
