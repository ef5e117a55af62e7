/*
 * memwrite MIB PERCENT STEPS SLEEP_MS: a single process that holds MIB MiB of memory and, once
 * per step, rewrites PERCENT % of it (one contiguous window that moves through the buffer, as a
 * solver updating one block per sweep would), then sleeps SLEEP_MS. Prints "iter K" after each
 * step and "checksum X" at the end. Used to measure deduplication of flushed checkpoints.
 *
 * SLEEP_MS -1: the first step runs at once, each later one when the process gets SIGUSR1 (one
 * step per signal), so that a benchmark decides exactly what is written between two dumps.
 */
#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static uint64_t next(uint64_t *x) {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    return *x;
}

static volatile sig_atomic_t step_asked;

static void ask_step(int sig) {
    (void)sig;
    step_asked = 1;
}

/* Waits for SIGUSR1 (blocked outside this wait, so that none is lost between two waits). */
static void wait_step(const sigset_t *unblocked) {
    while (!step_asked)
        sigsuspend(unblocked);
    step_asked = 0;
}

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: memwrite MIB PERCENT STEPS SLEEP_MS\n");
        return 2;
    }
    size_t bytes = (size_t)atol(argv[1]) << 20;
    int percent = atoi(argv[2]);
    long steps = atol(argv[3]);
    long sleep_ms = atol(argv[4]);
    if (bytes == 0 || percent <= 0 || percent > 100 || steps < 0 || sleep_ms < -1) {
        fprintf(stderr, "memwrite: bad arguments\n");
        return 2;
    }
    sigset_t unblocked;
    if (sleep_ms == -1) {
        sigset_t usr1;
        sigemptyset(&usr1);
        sigaddset(&usr1, SIGUSR1);
        sigprocmask(SIG_BLOCK, &usr1, &unblocked);
        struct sigaction sa = {0};
        sa.sa_handler = ask_step;
        sigaction(SIGUSR1, &sa, NULL);
    }
    size_t words = bytes / 8;
    uint64_t *buf = malloc(words * 8);
    if (!buf) {
        perror("malloc");
        return 1;
    }
    uint64_t x = 0x9e3779b97f4a7c15ULL;
    for (size_t i = 0; i < words; i++)
        buf[i] = next(&x);
    size_t window = words * (size_t)percent / 100;
    size_t at = 0;
    struct timespec ts = {sleep_ms / 1000, (sleep_ms % 1000) * 1000000L};
    for (long k = 0; k < steps; k++) {
        if (sleep_ms == -1 && k > 0)
            wait_step(&unblocked);
        for (size_t i = 0; i < window; i++)
            buf[(at + i) % words] = next(&x);
        at = (at + window) % words;
        printf("iter %ld\n", k + 1);
        fflush(stdout);
        /* A checkpoint interrupts the sleep (EINTR): sleep out the rest, so that exactly one
         * step happens per period whatever the checkpoints do. */
        struct timespec left = ts;
        while (sleep_ms > 0 && nanosleep(&left, &left) == -1 && errno == EINTR)
            ;
    }
    uint64_t sum = 0;
    for (size_t i = 0; i < words; i++)
        sum += buf[i] * (i | 1);
    printf("checksum %016llx\n", (unsigned long long)sum);
    free(buf);
    return 0;
}
