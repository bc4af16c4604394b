/*
 * thinvm-mem: memory workloads and checks run inside a thinvm guest.
 *
 * Every subcommand prints one line of JSON on stdout so the host can parse
 * it; diagnostics go to stderr.  Exit status: 0 ok, 1 failed (a check
 * found bad data, or the system refused), 2 bad usage.
 *
 * Guests usually run under TCG, where every instruction is emulated, so
 * the inner loops here are kept to a store or a compare per 64-bit word.
 */
#define _GNU_SOURCE
#include <elf.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#define PAGE_BYTES	4096UL
#define PAGE_WORDS	(PAGE_BYTES / sizeof(uint64_t))
#define PAGES_PER_MIB	256UL
#define MAX_MIB		(1UL << 20)		/* 1 TiB, far beyond any guest */
#define IO_PAGES	256UL			/* 1 MiB per read()/write() */
#define GOLDEN		0x9E3779B97F4A7C15ULL
#define MIX_MUL1	0xBF58476D1CE4E5B9ULL
#define MIX_MUL2	0x94D049BB133111EBULL

#define SLICE_NS	10000000LL		/* dirty: pacing granularity */
#define MAX_CATCHUP_NS	(10 * SLICE_NS)

#define EXIT_FAILED	1
#define EXIT_USAGE	2

/* Options a subcommand may accept. */
enum {
	OPT_SEED	= 1 << 0,
	OPT_PIDFILE	= 1 << 1,
	OPT_PAGE	= 1 << 2,
	OPT_RATE	= 1 << 3,
	OPT_SECONDS	= 1 << 4,
};

#define MAX_POS 3

struct args {
	const char *pos[MAX_POS];
	int npos;
	const char *seed;
	const char *pidfile;
	const char *page;
	const char *rate;
	const char *seconds;
};

struct verify_result {
	uint64_t pages;
	uint64_t bad;
	int64_t first_bad;
};

static const char *prog = "thinvm-mem";

static void usage(void)
{
	fprintf(stderr,
		"usage: %s touch MIB\n"
		"       %s hold MIB [--seed S] [--pidfile F]\n"
		"       %s pattern write PATH MIB --seed S\n"
		"       %s pattern verify PATH --seed S\n"
		"       %s pattern corrupt PATH --page K\n"
		"       %s dirty MIB --rate MIBPS --seconds S\n"
		"       %s kcore-scan [CORE] --seed S\n",
		prog, prog, prog, prog, prog, prog, prog);
}

static void vreport(const char *fmt, va_list ap)
{
	fprintf(stderr, "%s: ", prog);
	vfprintf(stderr, fmt, ap);
	fputc('\n', stderr);
}

static int usage_error(const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	vreport(fmt, ap);
	va_end(ap);
	usage();
	return EXIT_USAGE;
}

static int fail(const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	vreport(fmt, ap);
	va_end(ap);
	return EXIT_FAILED;
}

static int64_t now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static double ms_since(int64_t start)
{
	return (now_ns() - start) / 1e6;
}

/* Strict unsigned decimal: no sign, no spaces, no suffix, no overflow. */
static bool parse_u64(const char *s, uint64_t min, uint64_t max, uint64_t *out)
{
	unsigned long long v;
	char *end;

	if (!s || *s < '0' || *s > '9')
		return false;
	errno = 0;
	v = strtoull(s, &end, 10);
	if (errno || *end || v < min || v > max)
		return false;
	*out = v;
	return true;
}

static const char **opt_slot(struct args *a, const char *name,
			     unsigned int allowed)
{
	if (!strcmp(name, "--seed") && (allowed & OPT_SEED))
		return &a->seed;
	if (!strcmp(name, "--pidfile") && (allowed & OPT_PIDFILE))
		return &a->pidfile;
	if (!strcmp(name, "--page") && (allowed & OPT_PAGE))
		return &a->page;
	if (!strcmp(name, "--rate") && (allowed & OPT_RATE))
		return &a->rate;
	if (!strcmp(name, "--seconds") && (allowed & OPT_SECONDS))
		return &a->seconds;
	return NULL;
}

/* Split argv into positionals and "--name value" options. */
static int parse_args(int argc, char **argv, unsigned int allowed,
		      int npos, struct args *a)
{
	const char **slot;
	int i;

	memset(a, 0, sizeof(*a));
	for (i = 0; i < argc; i++) {
		if (strncmp(argv[i], "--", 2)) {
			if (a->npos == MAX_POS || a->npos == npos)
				return usage_error("unexpected argument '%s'",
						   argv[i]);
			a->pos[a->npos++] = argv[i];
			continue;
		}
		slot = opt_slot(a, argv[i], allowed);
		if (!slot)
			return usage_error("unknown option '%s'", argv[i]);
		if (i + 1 == argc)
			return usage_error("%s needs a value", argv[i]);
		*slot = argv[++i];
	}
	if (a->npos != npos)
		return usage_error("missing argument");
	return 0;
}

static int parse_mib(const char *s, uint64_t *mib)
{
	if (!parse_u64(s, 1, MAX_MIB, mib))
		return usage_error("bad size '%s': want MiB, 1..%lu", s,
				   MAX_MIB);
	return 0;
}

static int parse_seed(const char *s, uint64_t *seed)
{
	if (!s)
		return usage_error("--seed S is required");
	if (!parse_u64(s, 0, UINT64_MAX, seed))
		return usage_error("bad seed '%s'", s);
	return 0;
}

/* splitmix64's finaliser: cheap, and every input bit affects the output. */
static uint64_t mix(uint64_t z)
{
	z = (z ^ (z >> 30)) * MIX_MUL1;
	z = (z ^ (z >> 27)) * MIX_MUL2;
	return z ^ (z >> 31);
}

static uint64_t mix64(uint64_t seed, uint64_t page)
{
	return mix(mix(seed + GOLDEN) + page * GOLDEN);
}

/*
 * w[i] = mix64(seed, page) ^ (i * GOLDEN).  Every page differs, so pages
 * that are lost, zeroed or swapped all show up, and the per-word cost is
 * one add and one xor.
 */
static void fill_page(uint64_t *w, uint64_t seed, uint64_t page)
{
	uint64_t base = mix64(seed, page), k = 0;
	size_t i;

	for (i = 0; i < PAGE_WORDS; i++, k += GOLDEN)
		w[i] = base ^ k;
}

static bool page_ok(const uint64_t *w, uint64_t seed, uint64_t page)
{
	uint64_t base = mix64(seed, page), k = 0;
	size_t i;

	for (i = 0; i < PAGE_WORDS; i++, k += GOLDEN) {
		if (w[i] != (base ^ k))
			return false;
	}
	return true;
}

static void note_page(struct verify_result *r, bool ok)
{
	if (!ok) {
		if (!r->bad)
			r->first_bad = r->pages;
		r->bad++;
	}
	r->pages++;
}

/* Without a seed, pages carry their index + 1 in the first word. */
static void touch_pages(char *mem, uint64_t pages)
{
	uint64_t i;

	for (i = 0; i < pages; i++)
		*(uint64_t *)(mem + i * PAGE_BYTES) = i + 1;
}

static void verify_touched(const char *mem, struct verify_result *r)
{
	uint64_t i, pages = r->pages;

	r->pages = 0;
	for (i = 0; i < pages; i++)
		note_page(r, *(const uint64_t *)(mem + i * PAGE_BYTES) == i + 1);
}

static void fill_pattern(char *mem, uint64_t pages, uint64_t seed)
{
	uint64_t i;

	for (i = 0; i < pages; i++)
		fill_page((uint64_t *)(mem + i * PAGE_BYTES), seed, i);
}

static void verify_pattern(const char *mem, uint64_t seed,
			   struct verify_result *r)
{
	uint64_t i, pages = r->pages;

	r->pages = 0;
	for (i = 0; i < pages; i++)
		note_page(r, page_ok((const uint64_t *)(mem + i * PAGE_BYTES),
				     seed, i));
}

static char *map_anon(uint64_t mib)
{
	void *p = mmap(NULL, mib << 20, PROT_READ | PROT_WRITE,
		       MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);

	return p == MAP_FAILED ? NULL : p;
}

static int write_full(int fd, const void *buf, size_t len)
{
	const char *p = buf;
	ssize_t n;

	while (len) {
		n = write(fd, p, len);
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			return -1;
		p += n;
		len -= n;
	}
	return 0;
}

/* Returns bytes read; short only at end of file. */
static ssize_t read_full(int fd, void *buf, size_t len)
{
	char *p = buf;
	size_t done = 0;
	ssize_t n;

	while (done < len) {
		n = read(fd, p + done, len - done);
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0)
			return -1;
		if (n == 0)
			break;
		done += n;
	}
	return done;
}

static int cmd_touch(int argc, char **argv)
{
	struct args a;
	uint64_t mib;
	int64_t start;
	char *mem;
	int ret;

	ret = parse_args(argc, argv, 0, 1, &a);
	if (!ret)
		ret = parse_mib(a.pos[0], &mib);
	if (ret)
		return ret;
	start = now_ns();
	mem = map_anon(mib);
	if (!mem)
		return fail("mmap %lu MiB: %s", (unsigned long)mib,
			    strerror(errno));
	touch_pages(mem, mib * PAGES_PER_MIB);
	munmap(mem, mib << 20);
	printf("{\"touched_mib\":%lu,\"ms\":%.3f}\n", (unsigned long)mib,
	       ms_since(start));
	return 0;
}

/* ---- hold ---------------------------------------------------------- */

struct hold {
	char *mem;
	uint64_t mib;
	bool seeded;
	uint64_t seed;
	const char *pidfile;
};

static int write_file_atomic(const char *path, const char *text)
{
	char tmp[4096];
	int fd, ret;

	snprintf(tmp, sizeof(tmp), "%s.tmp", path);
	fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
	if (fd < 0)
		return -1;
	ret = write_full(fd, text, strlen(text));
	if (close(fd) < 0)
		ret = -1;
	if (!ret)
		ret = rename(tmp, path);
	if (ret)
		unlink(tmp);
	return ret;
}

/* SIGUSR1: check the memory is still what we wrote, report in /run. */
static void hold_verify(const struct hold *h)
{
	struct verify_result r = { h->mib * PAGES_PER_MIB, 0, -1 };
	char path[64], json[256];
	int64_t start = now_ns();

	if (h->seeded)
		verify_pattern(h->mem, h->seed, &r);
	else
		verify_touched(h->mem, &r);
	snprintf(json, sizeof(json),
		 "{\"pid\":%d,\"pages\":%lu,\"bad\":%lu,\"first_bad\":%ld,\"ms\":%.3f}\n",
		 (int)getpid(), (unsigned long)r.pages, (unsigned long)r.bad,
		 (long)r.first_bad, ms_since(start));
	snprintf(path, sizeof(path), "/run/thinvm-hold-%d.json", (int)getpid());
	write_file_atomic(path, json);
}

static void hold_serve(const struct hold *h, const sigset_t *set)
{
	int sig;

	for (;;) {
		sig = sigwaitinfo(set, NULL);
		if (sig == SIGUSR1)
			hold_verify(h);
		else if (sig == SIGTERM || sig == SIGINT)
			break;
	}
	if (h->pidfile)
		unlink(h->pidfile);
}

static int hold_fill(struct hold *h)
{
	char text[32];

	h->mem = map_anon(h->mib);
	if (!h->mem)
		return fail("mmap %lu MiB: %s", (unsigned long)h->mib,
			    strerror(errno));
	if (h->seeded)
		fill_pattern(h->mem, h->mib * PAGES_PER_MIB, h->seed);
	else
		touch_pages(h->mem, h->mib * PAGES_PER_MIB);
	if (h->pidfile) {
		snprintf(text, sizeof(text), "%d\n", (int)getpid());
		if (write_file_atomic(h->pidfile, text))
			return fail("pidfile %s: %s", h->pidfile,
				    strerror(errno));
	}
	return 0;
}

/*
 * Detach from whoever ran us: the agent waits for EOF on stdout and
 * stderr, so the daemon must not keep them open.
 */
static void detach_stdio(int keep_fd)
{
	int fd, null_fd = open("/dev/null", O_RDWR);

	if (null_fd >= 0) {
		dup2(null_fd, 0);
		dup2(null_fd, 1);
		dup2(null_fd, 2);
	}
	for (fd = 3; fd < 1024; fd++) {
		if (fd != keep_fd)
			close(fd);
	}
}

static void hold_child(struct hold *h, int ready_fd)
{
	sigset_t set;

	/* Blocked before anything else: SIGUSR1 would otherwise kill us. */
	sigemptyset(&set);
	sigaddset(&set, SIGUSR1);
	sigaddset(&set, SIGTERM);
	sigaddset(&set, SIGINT);
	sigprocmask(SIG_BLOCK, &set, NULL);
	signal(SIGHUP, SIG_IGN);
	setsid();
	if (hold_fill(h))
		_exit(EXIT_FAILED);
	detach_stdio(ready_fd);
	if (write_full(ready_fd, "R", 1))
		_exit(EXIT_FAILED);
	close(ready_fd);
	hold_serve(h, &set);
	_exit(0);
}

static int cmd_hold(int argc, char **argv)
{
	struct hold h = { 0 };
	struct args a;
	int ready[2], ret;
	unsigned char c;
	pid_t pid;

	ret = parse_args(argc, argv, OPT_SEED | OPT_PIDFILE, 1, &a);
	if (!ret)
		ret = parse_mib(a.pos[0], &h.mib);
	if (!ret && a.seed) {
		h.seeded = true;
		ret = parse_seed(a.seed, &h.seed);
	}
	if (ret)
		return ret;
	h.pidfile = a.pidfile;
	if (pipe(ready) < 0)
		return fail("pipe: %s", strerror(errno));
	fflush(NULL);
	pid = fork();
	if (pid < 0)
		return fail("fork: %s", strerror(errno));
	if (pid == 0) {
		close(ready[0]);
		hold_child(&h, ready[1]);
	}
	close(ready[1]);
	/* Report only once the memory is really allocated and filled. */
	if (read_full(ready[0], &c, 1) != 1)
		return fail("child %d failed to fill its memory", (int)pid);
	printf("{\"pid\":%d,\"mib\":%lu}\n", (int)pid, (unsigned long)h.mib);
	return 0;
}

/* ---- pattern ------------------------------------------------------- */

static int pattern_write(int argc, char **argv)
{
	uint64_t mib, seed, page, pages, i;
	int64_t start = now_ns();
	static uint64_t buf[IO_PAGES * PAGE_WORDS];
	struct args a;
	int fd, ret;

	ret = parse_args(argc, argv, OPT_SEED, 2, &a);
	if (!ret)
		ret = parse_mib(a.pos[1], &mib);
	if (!ret)
		ret = parse_seed(a.seed, &seed);
	if (ret)
		return ret;
	fd = open(a.pos[0], O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
	if (fd < 0)
		return fail("%s: %s", a.pos[0], strerror(errno));
	pages = mib * PAGES_PER_MIB;
	for (page = 0; page < pages; page += IO_PAGES) {
		for (i = 0; i < IO_PAGES; i++)
			fill_page(buf + i * PAGE_WORDS, seed, page + i);
		if (write_full(fd, buf, sizeof(buf))) {
			close(fd);
			return fail("write %s: %s", a.pos[0], strerror(errno));
		}
	}
	if (close(fd) < 0)
		return fail("close %s: %s", a.pos[0], strerror(errno));
	printf("{\"pages\":%lu,\"ms\":%.3f}\n", (unsigned long)pages,
	       ms_since(start));
	return 0;
}

static int verify_fd(int fd, uint64_t seed, struct verify_result *r)
{
	static uint64_t buf[IO_PAGES * PAGE_WORDS];
	uint64_t i, n;
	ssize_t got;

	for (;;) {
		got = read_full(fd, buf, sizeof(buf));
		if (got < 0)
			return -1;
		if (got % PAGE_BYTES) {
			errno = EINVAL;
			return -1;
		}
		n = got / PAGE_BYTES;
		for (i = 0; i < n; i++)
			note_page(r, page_ok(buf + i * PAGE_WORDS, seed,
					     r->pages));
		if (n < IO_PAGES)
			return 0;
	}
}

static int pattern_verify(int argc, char **argv)
{
	struct verify_result r = { 0, 0, -1 };
	int64_t start = now_ns();
	struct args a;
	uint64_t seed;
	int fd, ret;

	ret = parse_args(argc, argv, OPT_SEED, 1, &a);
	if (!ret)
		ret = parse_seed(a.seed, &seed);
	if (ret)
		return ret;
	fd = open(a.pos[0], O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return fail("%s: %s", a.pos[0], strerror(errno));
	ret = verify_fd(fd, seed, &r);
	close(fd);
	if (ret < 0)
		return fail("%s: %s", a.pos[0], errno == EINVAL ?
			    "size is not a whole number of pages" :
			    strerror(errno));
	printf("{\"pages\":%lu,\"bad\":%lu,\"first_bad\":%ld,\"ms\":%.3f}\n",
	       (unsigned long)r.pages, (unsigned long)r.bad,
	       (long)r.first_bad, ms_since(start));
	return r.bad ? EXIT_FAILED : 0;
}

static int pattern_corrupt(int argc, char **argv)
{
	struct args a;
	struct stat st;
	uint64_t page;
	off_t off;
	int fd, ret;
	unsigned char c;

	ret = parse_args(argc, argv, OPT_PAGE, 1, &a);
	if (ret)
		return ret;
	if (!parse_u64(a.page, 0, UINT64_MAX / PAGE_BYTES, &page))
		return usage_error("bad page '%s'", a.page ? a.page : "(none)");
	fd = open(a.pos[0], O_RDWR | O_CLOEXEC);
	if (fd < 0)
		return fail("%s: %s", a.pos[0], strerror(errno));
	if (fstat(fd, &st) < 0 || page >= (uint64_t)st.st_size / PAGE_BYTES) {
		close(fd);
		return fail("%s: no page %lu", a.pos[0], (unsigned long)page);
	}
	/* Mid-page, so a check that only looks at a page's head misses it. */
	off = page * PAGE_BYTES + PAGE_BYTES / 2 + 7;
	ret = pread(fd, &c, 1, off) == 1 ? 0 : -1;
	c ^= 0xff;
	if (!ret)
		ret = pwrite(fd, &c, 1, off) == 1 ? 0 : -1;
	if (close(fd) < 0)
		ret = -1;
	if (ret)
		return fail("%s: %s", a.pos[0], strerror(errno));
	printf("{\"page\":%lu,\"offset\":%ld}\n", (unsigned long)page,
	       (long)off);
	return 0;
}

static int cmd_pattern(int argc, char **argv)
{
	if (argc < 1)
		return usage_error("pattern needs write, verify or corrupt");
	if (!strcmp(argv[0], "write"))
		return pattern_write(argc - 1, argv + 1);
	if (!strcmp(argv[0], "verify"))
		return pattern_verify(argc - 1, argv + 1);
	if (!strcmp(argv[0], "corrupt"))
		return pattern_corrupt(argc - 1, argv + 1);
	return usage_error("unknown pattern subcommand '%s'", argv[0]);
}

/* ---- dirty --------------------------------------------------------- */

struct dirty {
	char *mem;
	uint64_t pages;
	uint64_t next;		/* round-robin cursor */
	uint64_t written;
	uint64_t stamp;		/* value stored, so every write changes it */
	uint64_t rate;		/* MiB/s, 0 = unpaced */
	uint64_t credit;	/* pages * 100 owed to the current slice */
	int64_t max_slice_ns;
};

static void dirty_pages(struct dirty *d, uint64_t n)
{
	while (n--) {
		*(uint64_t *)(d->mem + d->next * PAGE_BYTES) = ++d->stamp;
		if (++d->next == d->pages)
			d->next = 0;
		d->written++;
	}
}

/* A slice's share of rate: rate * 256 pages/s over 100 slices/s. */
static void paced_slice(struct dirty *d)
{
	uint64_t n;

	d->credit += d->rate * PAGES_PER_MIB;
	n = d->credit / 100;
	d->credit %= 100;
	dirty_pages(d, n);
}

/* Unpaced: write for one slice's worth of time, checking the clock rarely. */
static void unpaced_slice(struct dirty *d, int64_t start)
{
	do {
		dirty_pages(d, 64);
	} while (now_ns() - start < SLICE_NS);
}

static void sleep_until(int64_t t)
{
	struct timespec ts = { t / 1000000000LL, t % 1000000000LL };

	while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) ==
	       EINTR)
		;
}

static void dirty_run(struct dirty *d, int64_t end)
{
	int64_t t0, t1, deadline = now_ns();

	while ((t0 = now_ns()) < end) {
		if (d->rate)
			paced_slice(d);
		else
			unpaced_slice(d, t0);
		t1 = now_ns();
		if (t1 - t0 > d->max_slice_ns)
			d->max_slice_ns = t1 - t0;
		if (!d->rate)
			continue;
		/*
		 * After a stall (e.g. the VM paused for migration) drop the
		 * missed slices rather than dirtying them all in a burst.
		 */
		deadline += SLICE_NS;
		if (deadline < t1 - MAX_CATCHUP_NS)
			deadline = t1;
		sleep_until(deadline < end ? deadline : end);
	}
}

static int cmd_dirty(int argc, char **argv)
{
	struct dirty d = { 0 };
	uint64_t mib, seconds;
	int64_t start;
	struct args a;
	double secs;
	int ret;

	ret = parse_args(argc, argv, OPT_RATE | OPT_SECONDS, 1, &a);
	if (!ret)
		ret = parse_mib(a.pos[0], &mib);
	if (ret)
		return ret;
	if (!parse_u64(a.rate, 0, 1UL << 30, &d.rate))
		return usage_error("bad --rate '%s': want MiB/s, 0 = unpaced",
				   a.rate ? a.rate : "(none)");
	if (!parse_u64(a.seconds, 1, 1UL << 30, &seconds))
		return usage_error("bad --seconds '%s'",
				   a.seconds ? a.seconds : "(none)");
	d.pages = mib * PAGES_PER_MIB;
	d.mem = map_anon(mib);
	if (!d.mem)
		return fail("mmap %lu MiB: %s", (unsigned long)mib,
			    strerror(errno));
	/* Fault the working set in first so the run measures dirtying only. */
	touch_pages(d.mem, d.pages);
	start = now_ns();
	dirty_run(&d, start + (int64_t)seconds * 1000000000LL);
	secs = (now_ns() - start) / 1e9;
	printf("{\"mib\":%lu,\"seconds\":%lu,\"rate_mibps\":%lu,"
	       "\"pages_written\":%lu,\"achieved_mibps\":%.3f,"
	       "\"max_slice_ms\":%.3f}\n",
	       (unsigned long)mib, (unsigned long)seconds,
	       (unsigned long)d.rate, (unsigned long)d.written,
	       d.written / (double)PAGES_PER_MIB / secs, d.max_slice_ns / 1e6);
	munmap(d.mem, mib << 20);
	return 0;
}

/* ---- kcore-scan ---------------------------------------------------- */

/*
 * Does any page of guest RAM still hold a page of `pattern write --seed
 * S`?  /proc/kcore is an ELF core of the kernel's address space; its RAM
 * segments are the direct map, so they cover every page of RAM, free or
 * not, once.  (Pages that are not RAM, or are offline such as balloon
 * pages, read as zeros.)
 *
 * A page matches if its first 64 bytes are the head of the pattern page
 * of any index for that seed: words 1..7 equal word 0 ^ (i * GOLDEN), and
 * word 0 = mix64(S, p) for a page index p below MAX_PATTERN_PAGES.  Every
 * step of mix() is a bijection, so p is recomputed from word 0 instead of
 * being searched for.  A page from another seed recomputes to a random
 * 64-bit p and fails with probability 1 - 2^-36.
 */

#define KCORE_PATH		"/proc/kcore"
#define KERNEL_TEXT_BASE	0xffffffff80000000ULL	/* x86-64 kernel image */
#define HEAD_WORDS		8
#define MAX_PATTERN_PAGES	(MAX_MIB * PAGES_PER_MIB)

struct head_sig {
	uint64_t seed_mix;	/* mix(seed + GOLDEN) */
	uint64_t inv_golden;
	uint64_t inv_mul1;
	uint64_t inv_mul2;
};

struct scan_result {
	uint64_t pages;
	uint64_t matches;
	uint64_t unreadable;
	unsigned int segments;
};

/* Inverse of an odd number modulo 2^64 (Newton: 3, 6, ..., 96 bits). */
static uint64_t mul_inverse(uint64_t a)
{
	uint64_t x = a;
	int i;

	for (i = 0; i < 5; i++)
		x *= 2 - a * x;
	return x;
}

/* Inverse of y = x ^ (x >> s). */
static uint64_t unxorshift(uint64_t y, unsigned int s)
{
	uint64_t x = y;
	unsigned int i;

	for (i = s; i < 64; i += s)
		x ^= y >> i;
	return x;
}

static uint64_t unmix(const struct head_sig *sig, uint64_t z)
{
	z = unxorshift(z, 31) * sig->inv_mul2;
	z = unxorshift(z, 27) * sig->inv_mul1;
	return unxorshift(z, 30);
}

static void head_sig_init(struct head_sig *sig, uint64_t seed)
{
	sig->seed_mix = mix(seed + GOLDEN);
	sig->inv_golden = mul_inverse(GOLDEN);
	sig->inv_mul1 = mul_inverse(MIX_MUL1);
	sig->inv_mul2 = mul_inverse(MIX_MUL2);
}

static bool head_matches(const uint64_t *w, const struct head_sig *sig)
{
	uint64_t k = GOLDEN, page;
	size_t i;

	for (i = 1; i < HEAD_WORDS; i++, k += GOLDEN) {
		if (w[i] != (w[0] ^ k))
			return false;
	}
	page = (unmix(sig, w[0]) - sig->seed_mix) * sig->inv_golden;
	return page < MAX_PATTERN_PAGES;
}

static void scan_pages(const char *buf, uint64_t pages,
		       const struct head_sig *sig, struct scan_result *r)
{
	uint64_t i;

	for (i = 0; i < pages; i++) {
		if (head_matches((const uint64_t *)(buf + i * PAGE_BYTES), sig))
			r->matches++;
	}
	r->pages += pages;
}

/* A chunk that cannot be read as a whole is retried page by page. */
static void scan_range(int fd, uint64_t off, uint64_t len, char *buf,
		       const struct head_sig *sig, struct scan_result *r)
{
	uint64_t done, n, i;

	for (done = 0; done < len; done += n) {
		n = len - done < IO_PAGES * PAGE_BYTES ?
		    len - done : IO_PAGES * PAGE_BYTES;
		if (pread(fd, buf, n, off + done) == (ssize_t)n) {
			scan_pages(buf, n / PAGE_BYTES, sig, r);
			continue;
		}
		for (i = 0; i < n; i += PAGE_BYTES) {
			if (pread(fd, buf, PAGE_BYTES, off + done + i) ==
			    (ssize_t)PAGE_BYTES)
				scan_pages(buf, 1, sig, r);
			else
				r->unreadable++;
		}
	}
}

/* RAM has a physical address; the kernel image's alias of it is skipped. */
static bool is_ram_segment(const Elf64_Phdr *ph)
{
	return ph->p_type == PT_LOAD && ph->p_paddr != (Elf64_Addr)-1 &&
	       ph->p_vaddr < KERNEL_TEXT_BASE && ph->p_filesz >= PAGE_BYTES;
}

static int read_headers(int fd, const char *path, Elf64_Phdr **phdrs,
			unsigned int *count)
{
	Elf64_Ehdr eh;
	size_t len;

	if (pread(fd, &eh, sizeof(eh), 0) != (ssize_t)sizeof(eh) ||
	    memcmp(eh.e_ident, ELFMAG, SELFMAG) ||
	    eh.e_ident[EI_CLASS] != ELFCLASS64 ||
	    eh.e_phentsize != sizeof(Elf64_Phdr))
		return fail("%s: not a 64-bit ELF core", path);
	len = (size_t)eh.e_phnum * sizeof(Elf64_Phdr);
	*phdrs = malloc(len ? len : 1);
	if (!*phdrs)
		return fail("out of memory");
	if (pread(fd, *phdrs, len, eh.e_phoff) != (ssize_t)len) {
		free(*phdrs);
		return fail("%s: cannot read program headers", path);
	}
	*count = eh.e_phnum;
	return 0;
}

static int cmd_kcore_scan(int argc, char **argv)
{
	static uint64_t buf[IO_PAGES * PAGE_WORDS];
	struct scan_result r = { 0 };
	int64_t start = now_ns();
	struct head_sig sig;
	Elf64_Phdr *ph = NULL;
	unsigned int n = 0, i;
	const char *path;
	uint64_t seed;
	struct args a;
	int fd, ret;

	/* CORE is optional (a test file instead of /proc/kcore): odd argc. */
	ret = parse_args(argc, argv, OPT_SEED, argc % 2, &a);
	if (!ret)
		ret = parse_seed(a.seed, &seed);
	if (ret)
		return ret;
	path = a.npos ? a.pos[0] : KCORE_PATH;
	head_sig_init(&sig, seed);
	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return fail("%s: %s", path, strerror(errno));
	ret = read_headers(fd, path, &ph, &n);
	if (ret) {
		close(fd);
		return ret;
	}
	for (i = 0; i < n; i++) {
		if (!is_ram_segment(&ph[i]))
			continue;
		r.segments++;
		scan_range(fd, ph[i].p_offset,
			   ph[i].p_filesz & ~(PAGE_BYTES - 1), (char *)buf,
			   &sig, &r);
	}
	free(ph);
	close(fd);
	if (!r.segments)
		return fail("%s: no RAM segments", path);
	printf("{\"pages_scanned\":%lu,\"matches\":%lu,\"unreadable\":%lu,"
	       "\"segments\":%u,\"ms\":%.3f}\n",
	       (unsigned long)r.pages, (unsigned long)r.matches,
	       (unsigned long)r.unreadable, r.segments, ms_since(start));
	return 0;
}

int main(int argc, char **argv)
{
	if (argc < 2) {
		usage();
		return EXIT_USAGE;
	}
	if (!strcmp(argv[1], "touch"))
		return cmd_touch(argc - 2, argv + 2);
	if (!strcmp(argv[1], "hold"))
		return cmd_hold(argc - 2, argv + 2);
	if (!strcmp(argv[1], "pattern"))
		return cmd_pattern(argc - 2, argv + 2);
	if (!strcmp(argv[1], "dirty"))
		return cmd_dirty(argc - 2, argv + 2);
	if (!strcmp(argv[1], "kcore-scan"))
		return cmd_kcore_scan(argc - 2, argv + 2);
	if (!strcmp(argv[1], "-h") || !strcmp(argv[1], "--help")) {
		usage();
		return 0;
	}
	return usage_error("unknown command '%s'", argv[1]);
}
