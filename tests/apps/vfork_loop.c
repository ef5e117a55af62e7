/* vfork_loop: starts /bin/true through vfork() over and over, the way a shell, posix_spawn()
 * or system() start commands. The child sleeps SLEEP_US microseconds (default 20000) before it
 * calls exec, so the parent spends most of its time blocked in vfork(), in uninterruptible
 * sleep: where a freeze for a snapshot tends to land. Prints "iter N" every 20 commands.
 *   vfork_loop [SLEEP_US]
 */
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

int main(int argc, char **argv)
{
    static long sleep_us;
    static unsigned long n;
    sleep_us = argc > 1 ? atol(argv[1]) : 20000;
    for (;;) {
        pid_t child = vfork();
        if (child == 0) {
            /* Only system calls between vfork and exec: the child runs on the parent's stack. */
            usleep((useconds_t)sleep_us);
            execl("/bin/true", "true", (char *)NULL);
            _exit(127);
        }
        if (child < 0) {
            perror("vfork");
            return 1;
        }
        int status;
        if (waitpid(child, &status, 0) < 0) {
            perror("waitpid");
            return 1;
        }
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
            fprintf(stderr, "child failed: status %d\n", status);
            return 1;
        }
        if (++n % 20 == 0) {
            printf("iter %lu\n", n);
            fflush(stdout);
        }
    }
}
