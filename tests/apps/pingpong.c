/*
 * pingpong: MPI ping-pong between ranks 0 and 1, for measuring a transport.
 *
 *   pingpong BYTES ITERS
 *
 * After 10 warm-up round trips, rank 0 times ITERS round trips of BYTES bytes and prints
 * "pingpong bytes B iters N latency_us L bandwidth_MBps W": L is half the mean round trip,
 * W is BYTES over that half (decimal megabytes per second).
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (argc != 3 || size < 2) {
        if (rank == 0)
            fprintf(stderr, "usage: pingpong BYTES ITERS (2 or more ranks)\n");
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    long bytes = atol(argv[1]), iters = atol(argv[2]);
    char *buf = malloc(bytes > 0 ? bytes : 1);
    memset(buf, rank, bytes > 0 ? bytes : 1);
    for (long i = -10; i < iters; i++) {
        static double t0;
        if (i == 0) {
            MPI_Barrier(MPI_COMM_WORLD);
            t0 = MPI_Wtime();
        }
        if (rank == 0) {
            MPI_Send(buf, bytes, MPI_CHAR, 1, 0, MPI_COMM_WORLD);
            MPI_Recv(buf, bytes, MPI_CHAR, 1, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        } else if (rank == 1) {
            MPI_Recv(buf, bytes, MPI_CHAR, 0, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
            MPI_Send(buf, bytes, MPI_CHAR, 0, 0, MPI_COMM_WORLD);
        }
        if (i == iters - 1 && rank == 0) {
            double half = (MPI_Wtime() - t0) / iters / 2;
            printf("pingpong bytes %ld iters %ld latency_us %.2f bandwidth_MBps %.2f\n", bytes, iters,
                   half * 1e6, bytes / half / 1e6);
        }
    }
    free(buf);
    MPI_Finalize();
    return 0;
}
