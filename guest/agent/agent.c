/*
 * thinvm-agent: run shell commands for the host over a virtio-serial port.
 *
 * The host side is a chardev socket that connects, disconnects and, after a
 * live migration, reconnects on another machine.  The agent therefore never
 * exits on a lost connection: it drops whatever was in flight and waits for
 * the next one.  The wire protocol is described in README.md.
 */
#define _GNU_SOURCE
#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "reclaim.h"

#define DEFAULT_PORT_NAME	"org.thinvm.agent"
#define VIRTIO_PORTS_DIR	"/sys/class/virtio-ports"

#define LINE_MAX_LEN		256	/* longest request line we accept */
#define TOKEN_MAX_LEN		64
#define CMD_MAX_LEN		(1U << 20)
#define TRIM_MAX_TIMEOUT_MS	3600000U	/* an hour: surely a typo beyond */
#define READ_CHUNK		65536

/*
 * A request split over reads is normal; one that stays incomplete this
 * long means the host went away mid-request (or sent a bogus EXEC length)
 * and the rest of it will never come.
 */
#define PARTIAL_TIMEOUT_MS	5000

/* How long to sleep when the host side is closed and no SIGIO arrives. */
#define HOST_WAIT_MS		1000
#define PORT_RETRY_MS		200

/*
 * The host's "port open" and its request travel on different virtqueues,
 * and the guest driver handles them in different contexts: the request can
 * reach us while the driver still believes the host is away.  A reply that
 * finds the port closed waits this long for the state to catch up before
 * it is dropped.
 */
#define REPLY_GRACE_MS		2000
#define PORT_LOG_EVERY_MS	60000

struct buf {
	char *data;
	size_t len;
	size_t cap;
	bool overflow;		/* allocation failed, later bytes dropped */
};

struct agent {
	const char *port_name;
	const char *device;	/* fixed device path, NULL: search sysfs */
	int fixed_fd;		/* inherited fd (tests), -1 if none */
	int fd;

	/* Parser state for the byte stream coming from the host. */
	char line[LINE_MAX_LEN + 1];
	size_t line_len;
	bool line_overflow;
	char *cmd;		/* non-NULL while reading an EXEC payload */
	size_t cmd_len;
	size_t cmd_want;
};

static void log_msg(const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	fputs("thinvm-agent: ", stderr);
	vfprintf(stderr, fmt, ap);
	fputc('\n', stderr);
	va_end(ap);
}

static long long now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1000LL + ts.tv_nsec / 1000000;
}

static void sleep_ms(long ms)
{
	struct timespec ts = { ms / 1000, (ms % 1000) * 1000000L };

	while (nanosleep(&ts, &ts) < 0 && errno == EINTR)
		;
}

static int read_small_file(const char *path, char *out, size_t size)
{
	ssize_t n;
	int fd;

	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return -1;
	n = read(fd, out, size - 1);
	close(fd);
	if (n < 0)
		return -1;
	out[n] = '\0';
	out[strcspn(out, "\n")] = '\0';
	return 0;
}

/*
 * busybox mdev does not create the /dev/virtio-ports/<name> links that udev
 * would, and /dev may not even be devtmpfs, so make the vportNpM node from
 * the major:minor in sysfs if it is missing.
 */
static int ensure_dev_node(const char *node, const char *sysdev)
{
	unsigned int maj, min;
	char devno[32];
	struct stat st;

	if (stat(node, &st) == 0 && S_ISCHR(st.st_mode))
		return 0;
	if (read_small_file(sysdev, devno, sizeof(devno)) < 0)
		return -1;
	if (sscanf(devno, "%u:%u", &maj, &min) != 2)
		return -1;
	unlink(node);
	if (mknod(node, S_IFCHR | 0600, makedev(maj, min)) < 0) {
		log_msg("mknod %s: %s", node, strerror(errno));
		return -1;
	}
	return 0;
}

/* Find the vportNpM whose sysfs name matches and return its /dev path. */
static int find_port(const char *name, char *node, size_t size)
{
	char path[PATH_MAX], value[256];
	struct dirent *de;
	int ret = -1;
	DIR *dir;

	dir = opendir(VIRTIO_PORTS_DIR);
	if (!dir)
		return -1;
	while ((de = readdir(dir))) {
		if (de->d_name[0] == '.')
			continue;
		snprintf(path, sizeof(path), VIRTIO_PORTS_DIR "/%s/name",
			 de->d_name);
		if (read_small_file(path, value, sizeof(value)) < 0 ||
		    strcmp(value, name))
			continue;
		snprintf(node, size, "/dev/%s", de->d_name);
		snprintf(path, sizeof(path), VIRTIO_PORTS_DIR "/%s/dev",
			 de->d_name);
		ret = ensure_dev_node(node, path);
		break;
	}
	closedir(dir);
	return ret;
}

/*
 * Non-blocking so that a write to a host that went away can be abandoned
 * instead of blocking until some later connection; O_ASYNC so that the
 * virtio_console driver sends SIGIO when the host (re)connects.
 */
static int setup_fd(int fd)
{
	int flags = fcntl(fd, F_GETFL);

	if (flags < 0)
		return -1;
	if (fcntl(fd, F_SETOWN, getpid()) < 0)
		return -1;
	return fcntl(fd, F_SETFL, flags | O_NONBLOCK | O_ASYNC);
}

static int try_open(struct agent *a)
{
	char node[PATH_MAX];
	const char *path = a->device;
	int fd;

	if (!path) {
		if (find_port(a->port_name, node, sizeof(node)) < 0)
			return -1;
		path = node;
	}
	fd = open(path, O_RDWR | O_CLOEXEC | O_NOCTTY);
	if (fd < 0)
		return -1;
	if (setup_fd(fd) < 0) {
		close(fd);
		return -1;
	}
	log_msg("using %s", path);
	return fd;
}

/* The port appears some time after virtio_console loads; keep looking. */
static void open_port(struct agent *a)
{
	long long last_log = 0;

	for (;;) {
		a->fd = try_open(a);
		if (a->fd >= 0)
			return;
		if (!last_log || now_ms() - last_log >= PORT_LOG_EVERY_MS) {
			log_msg("waiting for virtio port %s",
				a->device ? a->device : a->port_name);
			last_log = now_ms();
		}
		sleep_ms(PORT_RETRY_MS);
	}
}

static void close_port(struct agent *a)
{
	if (a->fd == a->fixed_fd)
		return;
	close(a->fd);
	a->fd = -1;
}

static void reset_input(struct agent *a)
{
	a->line_len = 0;
	a->line_overflow = false;
	free(a->cmd);
	a->cmd = NULL;
	a->cmd_len = 0;
	a->cmd_want = 0;
}

static bool input_pending(const struct agent *a)
{
	return a->line_len || a->line_overflow || a->cmd;
}

/*
 * While the host side is closed, read() returns 0 and poll() reports
 * POLLHUP at once, so both would spin.  Sleep until the driver's SIGIO
 * says the connection state changed, with a timeout in case it never does
 * (e.g. the fd is not a virtio port).  SIGIO stays blocked all the time,
 * so one sent between the failed read and this wait is not lost.
 */
static void wait_for_host_ms(long ms)
{
	struct timespec ts = { ms / 1000, (ms % 1000) * 1000000L };
	sigset_t set;

	sigemptyset(&set);
	sigaddset(&set, SIGIO);
	sigtimedwait(&set, NULL, &ts);
}

static void wait_for_host(void)
{
	wait_for_host_ms(HOST_WAIT_MS);
}

/* Count dropped replies; log the first few and then every 100th. */
static void note_reply_dropped(void)
{
	static unsigned long dropped;

	dropped++;
	if (dropped <= 3 || dropped % 100 == 0)
		log_msg("host closed the port: reply dropped (%lu so far)",
			dropped);
}

/*
 * Wait until the port can take more data.  Returns 0 when it can, -1 when
 * the host is gone: still closed REPLY_GRACE_MS after the first sign.
 */
static int wait_port_writable(struct agent *a, long long *closed_since)
{
	struct pollfd pfd = { .fd = a->fd, .events = POLLOUT };

	if (poll(&pfd, 1, *closed_since ? PORT_RETRY_MS : -1) < 0)
		return errno == EINTR ? 0 : -1;
	if (pfd.revents & POLLOUT) {
		*closed_since = 0;
		return 0;
	}
	if (!(pfd.revents & (POLLHUP | POLLERR)))
		return 0;
	if (!*closed_since)
		*closed_since = now_ms();
	else if (now_ms() - *closed_since >= REPLY_GRACE_MS)
		return -1;
	/* POLLHUP is level-triggered: sleep until the state changes. */
	wait_for_host_ms(PORT_RETRY_MS);
	return 0;
}

/*
 * Write all of buf, or give up if the host disconnects: a reply to a
 * connection that is gone must not be delivered to the next one.
 */
static int port_write(struct agent *a, const void *buf, size_t len)
{
	const char *p = buf;
	long long closed_since = 0;
	ssize_t n;

	while (len) {
		n = write(a->fd, p, len);
		if (n > 0) {
			p += n;
			len -= n;
			continue;
		}
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0 && errno != EAGAIN)
			return -1;
		if (wait_port_writable(a, &closed_since) < 0) {
			note_reply_dropped();
			return -1;
		}
	}
	return 0;
}

static int port_printf(struct agent *a, const char *fmt, ...)
{
	char msg[LINE_MAX_LEN];
	va_list ap;
	int n;

	va_start(ap, fmt);
	n = vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	if (n < 0 || (size_t)n >= sizeof(msg))
		return -1;
	return port_write(a, msg, n);
}

static void buf_append(struct buf *b, const char *data, size_t len)
{
	size_t cap;
	char *p;

	if (b->overflow)
		return;
	if (b->len + len > b->cap) {
		cap = b->cap ? b->cap : 4096;
		while (cap < b->len + len)
			cap *= 2;
		p = realloc(b->data, cap);
		if (!p) {
			b->overflow = true;
			return;
		}
		b->data = p;
		b->cap = cap;
	}
	memcpy(b->data + b->len, data, len);
	b->len += len;
}

/* Runs in the forked child; never returns. */
static void exec_child(const char *cmd, int out_fd, int err_fd)
{
	sigset_t none;
	int null_fd;

	sigemptyset(&none);
	sigprocmask(SIG_SETMASK, &none, NULL);
	signal(SIGPIPE, SIG_DFL);
	setsid();
	null_fd = open("/dev/null", O_RDONLY);
	if (null_fd < 0 || dup2(null_fd, 0) < 0 || dup2(out_fd, 1) < 0 ||
	    dup2(err_fd, 2) < 0)
		_exit(127);
	execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
	_exit(127);
}

/*
 * Drain both pipes at once: a command that fills one of them while we
 * block on the other would deadlock.  Returns when both reach EOF, which
 * happens once the command and everything that inherited its stdout and
 * stderr are done with them.
 *
 * The port is watched too (POLLHUP needs no events bit): if the host
 * disconnects meanwhile, the reply belongs to nobody and must not be
 * handed to whoever connects next.  Returns -1 in that case.
 */
static int drain_pipes(int port_fd, int out_fd, int err_fd, struct buf *out,
		       struct buf *err)
{
	struct pollfd pfd[3] = {
		{ .fd = out_fd, .events = POLLIN },
		{ .fd = err_fd, .events = POLLIN },
		{ .fd = port_fd, .events = 0 },
	};
	struct buf *dst[2] = { out, err };
	char chunk[READ_CHUNK];
	bool host_gone = false;
	ssize_t n;
	int i;

	while (pfd[0].fd >= 0 || pfd[1].fd >= 0) {
		if (poll(pfd, 3, -1) < 0) {
			if (errno == EINTR)
				continue;
			break;
		}
		if (pfd[2].revents & (POLLHUP | POLLERR)) {
			/* Level-triggered: stop watching or it spins. */
			host_gone = true;
			pfd[2].fd = -1;
		}
		for (i = 0; i < 2; i++) {
			if (pfd[i].fd < 0 || !pfd[i].revents)
				continue;
			n = read(pfd[i].fd, chunk, sizeof(chunk));
			if (n > 0)
				buf_append(dst[i], chunk, n);
			else if (n == 0 || errno != EINTR)
				pfd[i].fd = -1;
		}
	}
	return host_gone ? -1 : 0;
}

static int wait_status(pid_t pid)
{
	int status;

	while (waitpid(pid, &status, 0) < 0) {
		if (errno != EINTR)
			return 127;
	}
	if (WIFSIGNALED(status))
		return 128 + WTERMSIG(status);
	return WEXITSTATUS(status);
}

static int reply_done(struct agent *a, int status, const struct buf *out,
		      const struct buf *err)
{
	if (port_printf(a, "DONE %d %zu %zu\n", status, out->len, err->len))
		return -1;
	if (port_write(a, out->data, out->len))
		return -1;
	return port_write(a, err->data, err->len);
}

static int reply_failure(struct agent *a, int status, const char *why)
{
	struct buf out = { 0 }, err = { 0 };
	char msg[256];

	snprintf(msg, sizeof(msg), "thinvm-agent: %s\n", why);
	err.data = msg;
	err.len = strlen(msg);
	return reply_done(a, status, &out, &err);
}

static int run_command(struct agent *a, const char *cmd, size_t len)
{
	struct buf out = { 0 }, err = { 0 };
	int out_pipe[2], err_pipe[2];
	int status, ret;
	pid_t pid;

	/* sh -c takes a C string; running a truncated command would lie. */
	if (memchr(cmd, '\0', len))
		return reply_failure(a, 126, "command contains a NUL byte");
	if (pipe2(out_pipe, O_CLOEXEC) < 0)
		return reply_failure(a, 126, strerror(errno));
	if (pipe2(err_pipe, O_CLOEXEC) < 0) {
		close(out_pipe[0]);
		close(out_pipe[1]);
		return reply_failure(a, 126, strerror(errno));
	}
	pid = fork();
	if (pid == 0)
		exec_child(cmd, out_pipe[1], err_pipe[1]);
	close(out_pipe[1]);
	close(err_pipe[1]);
	if (pid < 0) {
		close(out_pipe[0]);
		close(err_pipe[0]);
		return reply_failure(a, 126, strerror(errno));
	}
	ret = drain_pipes(a->fd, out_pipe[0], err_pipe[0], &out, &err);
	close(out_pipe[0]);
	close(err_pipe[0]);
	status = wait_status(pid);
	if (out.overflow || err.overflow)
		log_msg("out of memory: command output truncated");
	if (!ret)
		ret = reply_done(a, status, &out, &err);
	free(out.data);
	free(err.data);
	return ret;
}

static bool valid_token(const char *tok)
{
	size_t len = strlen(tok);
	size_t i;

	if (!len || len > TOKEN_MAX_LEN)
		return false;
	for (i = 0; i < len; i++) {
		if (!isgraph((unsigned char)tok[i]))
			return false;
	}
	return true;
}

/* Strict decimal: digits only, no sign, no leading spaces, no overflow. */
static bool parse_length(const char *s, size_t *out)
{
	unsigned long long v;
	char *end;

	if (!isdigit((unsigned char)*s))
		return false;
	errno = 0;
	v = strtoull(s, &end, 10);
	if (errno || *end || v > CMD_MAX_LEN)
		return false;
	*out = v;
	return true;
}

static int finish_exec(struct agent *a)
{
	char *cmd = a->cmd;
	size_t len = a->cmd_len;
	int ret;

	a->cmd = NULL;
	a->cmd_len = 0;
	a->cmd_want = 0;
	cmd[len] = '\0';
	ret = run_command(a, cmd, len);
	free(cmd);
	return ret;
}

static int start_exec(struct agent *a, size_t len)
{
	/* One extra byte for the terminating NUL that sh -c needs. */
	a->cmd = malloc(len + 1);
	if (!a->cmd)
		return port_printf(a, "ERR unknown\n");
	a->cmd_len = 0;
	a->cmd_want = len;
	/* No payload bytes will arrive to complete an empty command. */
	return len ? 0 : finish_exec(a);
}

/* "JSON <n>" and n bytes: the answer to every reclaimer request. */
static int reply_json(struct agent *a, const char *json, int len)
{
	if (len < 0)
		return port_printf(a, "ERR unknown\n");
	if (port_printf(a, "JSON %d\n", len))
		return -1;
	return port_write(a, json, len);
}

/* "TRIM <max_bytes> <timeout_ms>", both strict decimals. */
static int handle_trim(struct agent *a, const char *args)
{
	char json[RECLAIM_JSON_MAX];
	unsigned long long max_bytes, timeout_ms;
	char *end;

	if (!isdigit((unsigned char)*args))
		return port_printf(a, "ERR unknown\n");
	errno = 0;
	max_bytes = strtoull(args, &end, 10);
	if (errno || *end != ' ' || !isdigit((unsigned char)end[1]))
		return port_printf(a, "ERR unknown\n");
	timeout_ms = strtoull(end + 1, &end, 10);
	if (errno || *end || timeout_ms > TRIM_MAX_TIMEOUT_MS)
		return port_printf(a, "ERR unknown\n");
	return reply_json(a, json, reclaim_trim(max_bytes, timeout_ms, json,
						sizeof(json)));
}

static int handle_reclaim(struct agent *a, const char *what)
{
	char json[RECLAIM_JSON_MAX];
	int n;

	if (!strcmp(what, "status"))
		n = reclaim_status(json, sizeof(json));
	else if (!strcmp(what, "on") || !strcmp(what, "off"))
		n = reclaim_set_background(!strcmp(what, "on"), json,
					   sizeof(json));
	else
		return port_printf(a, "ERR unknown\n");
	return reply_json(a, json, n);
}

static int handle_line(struct agent *a, const char *line)
{
	size_t len;

	if (!strncmp(line, "PING ", 5) && valid_token(line + 5))
		return port_printf(a, "PONG %s\n", line + 5);
	if (!strncmp(line, "EXEC ", 5) && parse_length(line + 5, &len))
		return start_exec(a, len);
	if (!strncmp(line, "TRIM ", 5))
		return handle_trim(a, line + 5);
	if (!strncmp(line, "RECLAIM ", 8))
		return handle_reclaim(a, line + 8);
	return port_printf(a, "ERR unknown\n");
}

/* Consume EXEC payload bytes; returns how many of data were used. */
static size_t feed_payload(struct agent *a, const char *data, size_t len,
			   int *ret)
{
	size_t take = a->cmd_want - a->cmd_len;

	if (take > len)
		take = len;
	memcpy(a->cmd + a->cmd_len, data, take);
	a->cmd_len += take;
	if (a->cmd_len == a->cmd_want)
		*ret = finish_exec(a);
	return take;
}

/*
 * Consume request-line bytes up to and including a newline.  Overlong
 * lines are skipped to their end and answered like any other garbage, so
 * the host's PING resynchronises the stream.
 */
static size_t feed_line(struct agent *a, const char *data, size_t len,
			int *ret)
{
	const char *nl = memchr(data, '\n', len);
	size_t take = nl ? (size_t)(nl - data) : len;

	if (!a->line_overflow && a->line_len + take <= LINE_MAX_LEN) {
		memcpy(a->line + a->line_len, data, take);
		a->line_len += take;
	} else {
		a->line_overflow = true;
	}
	if (!nl)
		return take;
	a->line[a->line_len] = '\0';
	if (a->line_overflow || memchr(a->line, '\0', a->line_len))
		*ret = port_printf(a, "ERR unknown\n");
	else
		*ret = handle_line(a, a->line);
	a->line_len = 0;
	a->line_overflow = false;
	return take + 1;
}

/* Returns -1 if a reply could not be delivered (host went away). */
static int feed(struct agent *a, const char *data, size_t len)
{
	int ret = 0;
	size_t used;

	while (len && !ret) {
		if (a->cmd)
			used = feed_payload(a, data, len, &ret);
		else
			used = feed_line(a, data, len, &ret);
		data += used;
		len -= used;
	}
	return ret;
}

/* The connection is gone: forget it and wait for the next one. */
static void host_lost(struct agent *a)
{
	reset_input(a);
	wait_for_host();
}

static void serve(struct agent *a)
{
	struct pollfd pfd = { .events = POLLIN };
	static char data[READ_CHUNK];
	ssize_t n;
	int rc;

	for (;;) {
		pfd.fd = a->fd;
		rc = poll(&pfd, 1, input_pending(a) ? PARTIAL_TIMEOUT_MS : -1);
		if (rc == 0) {
			log_msg("dropping incomplete request");
			reset_input(a);
			continue;
		}
		n = read(a->fd, data, sizeof(data));
		if (n > 0) {
			if (feed(a, data, n) < 0)
				host_lost(a);
			continue;
		}
		if (n < 0 && (errno == EAGAIN || errno == EINTR))
			continue;
		if (n == 0 || errno == EPIPE || errno == ECONNRESET) {
			host_lost(a);
			continue;
		}
		/* ENODEV, EIO, ...: the port itself is gone; find it again. */
		log_msg("read: %s; reopening", strerror(errno));
		reset_input(a);
		if (a->fixed_fd >= 0) {
			sleep_ms(HOST_WAIT_MS);
			continue;
		}
		close_port(a);
		open_port(a);
	}
}

static void usage(FILE *f)
{
	fprintf(f,
		"usage: thinvm-agent [--port NAME | --device PATH | --fd N] [--reclaim]\n"
		"  --port NAME    virtio-serial port name (default %s)\n"
		"  --device PATH  use this character device instead\n"
		"  --fd N         serve an inherited fd (for tests)\n"
		"  --reclaim      start with background reclaim on\n",
		DEFAULT_PORT_NAME);
}

static int parse_fd(const char *s)
{
	char *end;
	long v;

	errno = 0;
	v = strtol(s, &end, 10);
	if (errno || end == s || *end || v < 0 || v > INT_MAX)
		return -1;
	return v;
}

static int parse_args(struct agent *a, bool *reclaim, int argc, char **argv)
{
	static const struct option opts[] = {
		{ "port", required_argument, NULL, 'p' },
		{ "device", required_argument, NULL, 'd' },
		{ "fd", required_argument, NULL, 'f' },
		{ "reclaim", no_argument, NULL, 'r' },
		{ "help", no_argument, NULL, 'h' },
		{ NULL, 0, NULL, 0 },
	};
	int c;

	while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
		switch (c) {
		case 'p':
			a->port_name = optarg;
			break;
		case 'd':
			a->device = optarg;
			break;
		case 'f':
			a->fixed_fd = parse_fd(optarg);
			if (a->fixed_fd < 0)
				return -1;
			break;
		case 'r':
			*reclaim = true;
			break;
		case 'h':
			usage(stdout);
			exit(0);
		default:
			return -1;
		}
	}
	return optind == argc ? 0 : -1;
}

int main(int argc, char **argv)
{
	struct agent a = {
		.port_name = DEFAULT_PORT_NAME,
		.fixed_fd = -1,
		.fd = -1,
	};
	bool reclaim = false;
	sigset_t set;

	if (parse_args(&a, &reclaim, argc, argv) < 0) {
		usage(stderr);
		return 2;
	}
	/* A host that disconnects mid-reply must not kill us. */
	signal(SIGPIPE, SIG_IGN);
	sigemptyset(&set);
	sigaddset(&set, SIGIO);
	sigprocmask(SIG_BLOCK, &set, NULL);
	setvbuf(stderr, NULL, _IOLBF, 0);
	/* After the mask: the reclaim thread must never take SIGIO. */
	reclaim_init(reclaim);

	if (a.fixed_fd >= 0) {
		a.fd = a.fixed_fd;
		if (setup_fd(a.fd) < 0) {
			log_msg("fd %d: %s", a.fd, strerror(errno));
			return 1;
		}
	} else {
		open_port(&a);
	}
	fputs("thinvm: agent started\n", stderr);
	serve(&a);
	return 0;
}
