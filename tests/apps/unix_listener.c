/* unix_listener PATH: binds a Unix stream socket at PATH (mode 0777: umask 0), listens, and
 * sleeps. A job with a named socket, for the test that races a link into the socket's place
 * while the engine restores it. */
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

int main(int argc, char **argv)
{
	if (argc != 2) {
		fprintf(stderr, "usage: unix_listener PATH\n");
		return 2;
	}
	struct sockaddr_un a = { .sun_family = AF_UNIX };
	if (strlen(argv[1]) >= sizeof(a.sun_path)) {
		fprintf(stderr, "unix_listener: path too long\n");
		return 2;
	}
	strcpy(a.sun_path, argv[1]);
	umask(0);
	int s = socket(AF_UNIX, SOCK_STREAM, 0);
	if (s < 0 || bind(s, (struct sockaddr *)&a, sizeof(a)) != 0 || listen(s, 8) != 0) {
		perror("unix_listener");
		return 1;
	}
	printf("listening on %s\n", argv[1]);
	fflush(stdout);
	for (;;)
		sleep(1);
}
