/*
 * ib_quiesce.h - the C interface of ib-quiesce (link with -lib_quiesce).
 *
 * A process creates its InfiniBand verbs objects through these calls instead of libibverbs.
 * The identifiers it gets back (QP numbers, memory keys) are virtual: they stay valid while
 * ckpt drains and releases every object before a checkpoint and recreates them afterwards,
 * in the same process or in one restarted from the checkpoint, with new real ones.
 *
 * Under a ckpt agent (CKPT_IBQ_SOCKET set by the agent) ibq_open() also starts the control
 * thread that the agent drives; elsewhere the library is a plain verbs wrapper.
 *
 * Calls return 0 (or a count) on success and -1 on failure; ibq_last_error() then says why.
 * Calls made while a checkpoint has the channel quiesced wait until it is rebuilt.
 * One channel per process; calls are thread-safe.
 */
#ifndef IB_QUIESCE_H
#define IB_QUIESCE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Access flags of ibq_reg_mr (the values of IBV_ACCESS_*). */
#define IBQ_ACCESS_LOCAL_WRITE 0x1
#define IBQ_ACCESS_REMOTE_WRITE 0x2
#define IBQ_ACCESS_REMOTE_READ 0x4

/* Operations of ibq_post_send. */
#define IBQ_SEND 0
#define IBQ_WRITE 1

/* Completion opcodes. */
#define IBQ_WC_SEND 0
#define IBQ_WC_RECV 1

/* Room for a serialized endpoint, including the terminating NUL. */
#define IBQ_ENDPOINT_MAX 4096

struct ibq_wc {
    uint64_t wr_id;
    uint32_t status;   /* 0: success; otherwise the verbs status */
    uint32_t opcode;   /* IBQ_WC_SEND or IBQ_WC_RECV */
    uint32_t byte_len; /* bytes received */
    uint32_t qpn;      /* virtual QP number */
};

/* Opens `device` (NULL or "": the first with an active port) and allocates the PD. */
int ibq_open(const char *device);
/* Registers len bytes at addr; *key is the virtual key, used as both lkey and rkey. */
int ibq_reg_mr(void *addr, size_t len, int access, uint32_t *key);
/* Creates a completion queue with room for cqe entries. */
int ibq_create_cq(int cqe, uint32_t *cq);
/* Creates an RC QP; *qpn is its virtual QP number. */
int ibq_create_qp(uint32_t send_cq, uint32_t recv_cq, uint32_t max_send_wr,
                  uint32_t max_recv_wr, uint32_t *qpn);
/* Writes QP qpn's endpoint (a NUL-terminated text) for the peer to pass to ibq_connect.
 * The text names every MR of the channel: IBQ_ENDPOINT_MAX always holds it for up to 160 MRs.
 * With a smaller buffer it fails, and ibq_last_error() says how many bytes are needed. */
int ibq_endpoint(uint32_t qpn, char *buf, size_t len);
/* Connects QP qpn to the peer QP whose ibq_endpoint() text is `peer`. */
int ibq_connect(uint32_t qpn, const char *peer);
/* Posts a send (IBQ_SEND) or an RDMA write (IBQ_WRITE to remote_addr, peer's virtual rkey). */
int ibq_post_send(uint32_t qpn, uint64_t wr_id, int op, const void *addr, uint32_t len,
                  uint32_t lkey, uint64_t remote_addr, uint32_t rkey, int signaled);
/* Posts a receive. */
int ibq_post_recv(uint32_t qpn, uint64_t wr_id, void *addr, uint32_t len, uint32_t lkey);
/* Polls up to max completions into wc; returns how many. */
int ibq_poll_cq(uint32_t cq, int max, struct ibq_wc *wc);
/* The current real QP number and rkey behind virtual ones (0 if unknown). */
uint32_t ibq_real_qpn(uint32_t qpn);
uint32_t ibq_real_rkey(uint32_t key);
/* Rebuilds completed since the process started. */
uint64_t ibq_rebuilds(void);
/* Why the last failed call on this thread failed. */
const char *ibq_last_error(void);

#ifdef __cplusplus
}
#endif

#endif
