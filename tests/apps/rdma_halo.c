/*
 * rdma_halo RANK PEER PORT ITERS WORDS: two ranks, one RC QP between them, through
 * ib-quiesce's C interface (the example of ib_quiesce.h).
 *
 * Each rank holds WORDS 64-bit words of state. Every iteration it RDMA-writes the state into
 * the peer's halo buffer (two buffers, by iteration parity), then SENDs a message carrying the
 * iteration and the checksum of what it wrote, waits for the peer's message, checks that the
 * halo the peer wrote has that checksum (RC delivers the write before the send), and mixes the
 * halo into its state. A lost, duplicated or torn message or write fails the run.
 *
 * Rank 0 listens on TCP PORT, rank 1 connects to PEER:PORT; they exchange endpoints, the halo
 * addresses and keys once, then close the connection (after that, only verbs traffic).
 * Prints "rank R iter N" every 500 iterations, and at the end
 * "rank R done iters N checksum X vqpn V qpn Q vkey K rkey Y rebuilds B".
 */
#include <arpa/inet.h>
#include <errno.h>
#include <inttypes.h>
#include <netdb.h>
#include <netinet/in.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "ib_quiesce.h"

#define RECVS 4
#define WR_WRITE 1
#define WR_SEND 2
#define WR_RECV 100

struct msg {
    uint64_t iter;
    uint64_t sum;
};

struct hello {
    char endpoint[IBQ_ENDPOINT_MAX];
    uint64_t halo;
    uint32_t key;
};

static int rank;

static void die(const char *what) {
    fprintf(stderr, "rank %d: %s: %s\n", rank, what, ibq_last_error());
    exit(1);
}

static uint64_t checksum(const uint64_t *w, long n) {
    uint64_t h = 0xcbf29ce484222325ULL;
    for (long i = 0; i < n; i++) {
        h ^= w[i];
        h *= 0x100000001b3ULL;
    }
    return h;
}

static int full_io(int fd, void *buf, size_t len, int out) {
    char *p = buf;
    while (len > 0) {
        ssize_t n = out ? write(fd, p, len) : read(fd, p, len);
        if (n <= 0) {
            if (n < 0 && errno == EINTR)
                continue;
            return -1;
        }
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

/* The bootstrap connection: rank 0 accepts, rank 1 connects (retrying for up to 60 s). */
static int bootstrap(const char *peer, const char *port) {
    struct addrinfo hints = {0}, *ai;
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = rank == 0 ? AI_PASSIVE : 0;
    if (getaddrinfo(rank == 0 ? NULL : peer, port, &hints, &ai) != 0) {
        fprintf(stderr, "rank %d: cannot resolve %s:%s\n", rank, peer, port);
        exit(1);
    }
    int fd = -1;
    if (rank == 0) {
        int l = socket(AF_INET, SOCK_STREAM, 0), one = 1;
        setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(l, ai->ai_addr, ai->ai_addrlen) || listen(l, 1)) {
            perror("bind/listen");
            exit(1);
        }
        fd = accept(l, NULL, NULL);
        close(l);
    } else {
        for (int i = 0; i < 600; i++) {
            fd = socket(AF_INET, SOCK_STREAM, 0);
            if (connect(fd, ai->ai_addr, ai->ai_addrlen) == 0)
                break;
            close(fd);
            fd = -1;
            usleep(100000);
        }
    }
    freeaddrinfo(ai);
    if (fd < 0) {
        fprintf(stderr, "rank %d: no connection to the peer\n", rank);
        exit(1);
    }
    return fd;
}

int main(int argc, char **argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: rdma_halo RANK PEER PORT ITERS WORDS\n");
        return 2;
    }
    rank = atoi(argv[1]);
    long iters = atol(argv[4]), words = atol(argv[5]);
    if ((rank != 0 && rank != 1) || iters < 1 || words < 1) {
        fprintf(stderr, "rdma_halo: bad arguments\n");
        return 2;
    }
    setvbuf(stdout, NULL, _IOLBF, 0);

    /* One registered region: two halo buffers, the outgoing state, messages. */
    size_t halo_bytes = (size_t)words * 8;
    size_t bytes = 3 * halo_bytes + (RECVS + 1) * sizeof(struct msg);
    char *region = aligned_alloc(4096, (bytes + 4095) / 4096 * 4096);
    if (!region)
        return 1;
    memset(region, 0, bytes);
    uint64_t *halo[2] = {(uint64_t *)region, (uint64_t *)(region + halo_bytes)};
    uint64_t *state = (uint64_t *)(region + 2 * halo_bytes);
    struct msg *inbox = (struct msg *)(region + 3 * halo_bytes);
    struct msg *outbox = inbox + RECVS;
    for (long i = 0; i < words; i++)
        state[i] = 0x9e3779b97f4a7c15ULL * (uint64_t)(i + 1) + (uint64_t)rank;

    uint32_t key, cq, qp;
    if (ibq_open(getenv("IBQ_DEVICE")))
        die("ibq_open");
    if (ibq_reg_mr(region, bytes, IBQ_ACCESS_LOCAL_WRITE | IBQ_ACCESS_REMOTE_WRITE, &key))
        die("ibq_reg_mr");
    if (ibq_create_cq(64, &cq))
        die("ibq_create_cq");
    if (ibq_create_qp(cq, cq, 16, RECVS, &qp))
        die("ibq_create_qp");

    struct hello mine = {0}, theirs = {0};
    if (ibq_endpoint(qp, mine.endpoint, sizeof mine.endpoint))
        die("ibq_endpoint");
    mine.halo = (uint64_t)(uintptr_t)region;
    mine.key = key;
    int fd = bootstrap(argv[2], argv[3]);
    if (full_io(fd, &mine, sizeof mine, 1) || full_io(fd, &theirs, sizeof theirs, 0)) {
        fprintf(stderr, "rank %d: endpoint exchange failed\n", rank);
        return 1;
    }
    for (int i = 0; i < RECVS; i++)
        if (ibq_post_recv(qp, WR_RECV + i, &inbox[i], sizeof(struct msg), key))
            die("ibq_post_recv");
    if (ibq_connect(qp, theirs.endpoint))
        die("ibq_connect");
    /* Both sides have posted their receives before either sends. */
    char go = 1;
    if (full_io(fd, &go, 1, 1) || full_io(fd, &go, 1, 0)) {
        fprintf(stderr, "rank %d: start barrier failed\n", rank);
        return 1;
    }
    close(fd);
    printf("rank %d start vqpn %x qpn %x vkey %x rkey %x\n", rank, qp, ibq_real_qpn(qp), key,
           ibq_real_rkey(key));

    struct ibq_wc wc[16];
    /* Receive slots completed and not yet consumed, in order: the peer's next message can
     * arrive before this rank's own sends complete. */
    int ready[RECVS], rhead = 0, rcount = 0;
    for (long it = 0; it < iters; it++) {
        int slot = (int)(it & 1);
        outbox->iter = (uint64_t)it;
        outbox->sum = checksum(state, words);
        if (ibq_post_send(qp, WR_WRITE, IBQ_WRITE, state, (uint32_t)halo_bytes, key,
                          theirs.halo + (uint64_t)slot * halo_bytes, theirs.key, 1))
            die("ibq_post_send(write)");
        if (ibq_post_send(qp, WR_SEND, IBQ_SEND, outbox, sizeof *outbox, key, 0, 0, 1))
            die("ibq_post_send(send)");
        int sent = 0;
        while (sent < 2 || rcount == 0) {
            int n = ibq_poll_cq(cq, 16, wc);
            if (n < 0)
                die("ibq_poll_cq");
            for (int i = 0; i < n; i++) {
                if (wc[i].status != 0) {
                    fprintf(stderr, "rank %d: iteration %ld: completion %" PRIu64
                            " failed with status %u\n", rank, it, wc[i].wr_id, wc[i].status);
                    return 1;
                }
                if (wc[i].opcode == IBQ_WC_RECV)
                    ready[(rhead + rcount++) % RECVS] = (int)(wc[i].wr_id - WR_RECV);
                else
                    sent++;
            }
        }
        int got = ready[rhead];
        rhead = (rhead + 1) % RECVS;
        rcount--;
        struct msg m = inbox[got];
        if (m.iter != (uint64_t)it || m.sum != checksum(halo[slot], words)) {
            fprintf(stderr, "rank %d: iteration %ld: peer message for iteration %" PRIu64
                    " does not match the halo it wrote\n", rank, it, m.iter);
            return 1;
        }
        if (ibq_post_recv(qp, WR_RECV + (uint64_t)got, &inbox[got], sizeof(struct msg), key))
            die("ibq_post_recv");
        for (long i = 0; i < words; i++)
            state[i] = (state[i] ^ (state[i] >> 31)) * 0xbf58476d1ce4e5b9ULL +
                       halo[slot][(i + 1) % words] + (uint64_t)it;
        if ((it + 1) % 500 == 0)
            printf("rank %d iter %ld\n", rank, it + 1);
    }
    printf("rank %d done iters %ld checksum %016" PRIx64 " vqpn %x qpn %x vkey %x rkey %x "
           "rebuilds %" PRIu64 "\n",
           rank, iters, checksum(state, words), qp, ibq_real_qpn(qp), key, ibq_real_rkey(key),
           ibq_rebuilds());
    return 0;
}
