/*
 * heat: 2-D heat equation (Jacobi) with halo exchange, used as a checkpoint/restart test job.
 *
 *   heat N ITERS [SLEEP_US]
 *
 * Global grid N x N doubles (two buffers), block-row decomposition over the ranks (N need not be
 * divisible by the number of ranks), fixed boundaries: top row 100.0, other edges 0.0; the interior
 * starts from a deterministic pattern. Each iteration exchanges halo rows (MPI_Isend, MPI_Irecv,
 * then MPI_Testall with sleeps between polls), then optionally sleeps SLEEP_US microseconds. Every max(1, ITERS/20) iterations rank 0 prints
 * "iter K/ITERS" (and appends the same line to $HEAT_LOG if set). At the end rank 0 prints
 * "checksum <16 hex digits>": XOR over rows of FNV-1a-64(global row index, row bytes), which is
 * independent of the number of ranks and bitwise reproducible (each cell's update uses only its
 * four neighbours from the previous iteration, in a fixed order).
 * The result is printed before MPI_Finalize, which may hang with some MPICH/UCX setups.
 *
 * Benchmarks give it memory of its own to write: with HEAT_BALLAST_MIB=M each rank also holds M
 * MiB, written once at start, and rewrites HEAT_BALLAST_PCT % of it (10 by default; one window
 * that moves through it) at its next iteration after each SIGUSR1, then prints
 * "ballast K rewritten" (K-th time, on stderr). The checksum does not depend on it. With
 * HEAT_BALLAST_RANDOM=1 the ballast starts as pseudo-random bytes instead of ones.
 */
#include <mpi.h>
#include <inttypes.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static uint64_t fnv1a(uint64_t h, const void *data, size_t len)
{
    const unsigned char *p = data;
    for (size_t i = 0; i < len; i++) {
        h ^= p[i];
        h *= 0x100000001b3ULL;
    }
    return h;
}

/*
 * Waits for the four halo requests, polling a little and then sleeping between polls: the test
 * machines run more ranks than cores (and guests one core), where an MPI that busy-polls in its
 * blocking calls (MPICH over UCX does) keeps the core from the rank it waits for.
 */
static void wait_politely(MPI_Request *req)
{
    MPI_Status st[4];
    int done = 0;
    for (long polls = 0; !done; polls++) {
        MPI_Testall(4, req, &done, st);
        if (!done && polls >= 64) {
            struct timespec ts = {0, 50000};
            nanosleep(&ts, NULL);
        }
    }
}

static volatile sig_atomic_t ballast_asked;

static void ask_ballast(int sig)
{
    (void)sig;
    ballast_asked = 1;
}

/* HEAT_BALLAST_MIB MiB (or none), written; *window is HEAT_BALLAST_PCT % of it in bytes. */
static unsigned char *make_ballast(size_t *bytes, size_t *window)
{
    const char *mib = getenv("HEAT_BALLAST_MIB"), *pct = getenv("HEAT_BALLAST_PCT");
    *bytes = mib && *mib ? (size_t)strtoul(mib, NULL, 10) << 20 : 0;
    if (*bytes == 0)
        return NULL;
    unsigned long p = pct && *pct ? strtoul(pct, NULL, 10) : 10;
    *window = *bytes / 100 * (p > 100 ? 100 : p);
    unsigned char *b = malloc(*bytes);
    if (!b) {
        fprintf(stderr, "heat: out of memory for the ballast\n");
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    /* HEAT_BALLAST_RANDOM=1: bytes no compression or deduplication shrinks (xorshift64,
     * seeded by the process), as an application's data would be; else all ones. */
    const char *rnd = getenv("HEAT_BALLAST_RANDOM");
    if (rnd && strcmp(rnd, "1") == 0) {
        uint64_t x = 0x9e3779b97f4a7c15ULL ^ ((uint64_t)getpid() << 17) ^ (uint64_t)time(NULL);
        for (size_t i = 0; i + 8 <= *bytes; i += 8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            memcpy(b + i, &x, 8);
        }
    } else {
        memset(b, 1, *bytes);
    }
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = ask_ballast;
    sa.sa_flags = SA_RESTART;
    sigaction(SIGUSR1, &sa, NULL);
    return b;
}

static long parse_long(const char *s, const char *what)
{
    char *end;
    long v = strtol(s, &end, 10);
    if (*s == '\0' || *end != '\0' || v < 0) {
        fprintf(stderr, "heat: bad %s '%s'\n", what, s);
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    return v;
}

int main(int argc, char **argv)
{
    int rank, size;
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);

    if (argc < 3 || argc > 4) {
        if (rank == 0)
            fprintf(stderr, "usage: heat N ITERS [SLEEP_US]\n");
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    const long n = parse_long(argv[1], "N");
    const long iters = parse_long(argv[2], "ITERS");
    const long sleep_us = argc > 3 ? parse_long(argv[3], "SLEEP_US") : 0;
    if (n < 3) {
        if (rank == 0)
            fprintf(stderr, "heat: N must be >= 3\n");
        MPI_Abort(MPI_COMM_WORLD, 2);
    }

    /* Block rows: the first (n % size) ranks own one extra row. */
    const long base = n / size, extra = n % size;
    const long nrows = base + (rank < extra ? 1 : 0);
    const long row0 = rank * base + (rank < extra ? rank : extra);

    /* Local rows 1..nrows are owned, rows 0 and nrows+1 are halos. */
    const size_t stride = (size_t)n;
    const size_t cells = (size_t)(nrows + 2) * stride;
    double *u = calloc(cells, sizeof(double));
    double *v = calloc(cells, sizeof(double));
    if (!u || !v) {
        fprintf(stderr, "heat: out of memory\n");
        MPI_Abort(MPI_COMM_WORLD, 1);
    }

    for (long i = 1; i <= nrows; i++) {
        long g = row0 + i - 1;
        for (long j = 0; j < n; j++) {
            double x;
            if (g == 0)
                x = 100.0;
            else if (g == n - 1 || j == 0 || j == n - 1)
                x = 0.0;
            else
                x = (double)((g * 31 + j * 17) % 97) / 4.0;
            u[i * stride + j] = v[i * stride + j] = x;
        }
    }

    FILE *log = NULL;
    if (rank == 0) {
        const char *path = getenv("HEAT_LOG");
        if (path && *path) {
            log = fopen(path, "a");
            if (!log)
                perror("heat: HEAT_LOG");
        }
    }

    size_t ballast_bytes, ballast_window, ballast_at = 0;
    long ballast_steps = 0;
    unsigned char *ballast = make_ballast(&ballast_bytes, &ballast_window);

    const int up = rank > 0 ? rank - 1 : MPI_PROC_NULL;
    const int down = rank < size - 1 ? rank + 1 : MPI_PROC_NULL;
    const long report = iters / 20 > 1 ? iters / 20 : 1;

    for (long k = 1; k <= iters; k++) {
        /* first owned row -> up, receive bottom halo from down; and vice versa */
        MPI_Request req[4];
        MPI_Irecv(&u[(nrows + 1) * stride], (int)n, MPI_DOUBLE, down, 0, MPI_COMM_WORLD, &req[0]);
        MPI_Irecv(&u[0 * stride], (int)n, MPI_DOUBLE, up, 1, MPI_COMM_WORLD, &req[1]);
        MPI_Isend(&u[1 * stride], (int)n, MPI_DOUBLE, up, 0, MPI_COMM_WORLD, &req[2]);
        MPI_Isend(&u[nrows * stride], (int)n, MPI_DOUBLE, down, 1, MPI_COMM_WORLD, &req[3]);
        wait_politely(req);

        for (long i = 1; i <= nrows; i++) {
            long g = row0 + i - 1;
            double *dst = &v[i * stride];
            const double *c = &u[i * stride];
            if (g == 0 || g == n - 1) {
                memcpy(dst, c, stride * sizeof(double));
                continue;
            }
            const double *a = c - stride, *b = c + stride;
            dst[0] = c[0];
            for (long j = 1; j < n - 1; j++)
                dst[j] = 0.25 * (a[j] + b[j] + c[j - 1] + c[j + 1]);
            dst[n - 1] = c[n - 1];
        }
        double *t = u;
        u = v;
        v = t;

        if (sleep_us > 0)
            usleep((useconds_t)sleep_us);

        if (ballast && ballast_asked) {
            ballast_asked = 0;
            ballast_steps++;
            for (size_t done = 0; done < ballast_window;) {
                size_t len = ballast_window - done;
                if (len > ballast_bytes - ballast_at)
                    len = ballast_bytes - ballast_at;
                memset(ballast + ballast_at, (int)(ballast_steps & 0xff) | 2, len);
                done += len;
                ballast_at = (ballast_at + len) % ballast_bytes;
            }
            fprintf(stderr, "ballast %ld rewritten\n", ballast_steps);
        }

        if (rank == 0 && (k % report == 0 || k == iters)) {
            printf("iter %ld/%ld\n", k, iters);
            fflush(stdout);
            if (log) {
                fprintf(log, "iter %ld/%ld\n", k, iters);
                fflush(log);
            }
        }
    }

    uint64_t h = 0;
    for (long i = 1; i <= nrows; i++) {
        uint64_t g = (uint64_t)(row0 + i - 1);
        uint64_t rh = fnv1a(0xcbf29ce484222325ULL, &g, sizeof g);
        rh = fnv1a(rh, &u[i * stride], stride * sizeof(double));
        h ^= rh;
    }
    uint64_t total = 0;
    MPI_Reduce(&h, &total, 1, MPI_UINT64_T, MPI_BXOR, 0, MPI_COMM_WORLD);
    if (rank == 0) {
        printf("checksum %016" PRIx64 "\n", total);
        fflush(stdout);
        if (log)
            fclose(log);
    }

    free(ballast);
    free(u);
    free(v);
    MPI_Finalize();
    return 0;
}
