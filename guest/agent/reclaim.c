// SPDX-License-Identifier: GPL-2.0
/*
 * Guest reclaimer: proactive reclaim of cold page cache, gated by memory
 * pressure, followed by compaction, so that free page reporting hands the
 * freed memory back to the host in whole blocks.
 *
 * It lives in the agent, on a thread of its own, rather than in a separate
 * daemon: the agent is what the host talks to, so the counters it reports
 * and the on-demand trim it runs need no IPC, and both guest images already
 * start (and restart) the agent.  The thread only ever sleeps, reads /proc
 * and writes a few bytes to memory.reclaim; a lock keeps it and an
 * on-demand trim from reclaiming at the same time.
 *
 * The mechanism is the root cgroup's memory.reclaim (Linux 5.19+, cgroup
 * v2): the kernel picks the coldest pages from its own LRU (or MGLRU)
 * lists, so we only decide how much and when.  The "when" is senpai's:
 * small steps while the memory stall time that PSI reports stays low, and
 * a back-off as soon as it rises or as soon as pages we evicted come back
 * (workingset refaults).  docs/working-set.md explains the choice.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "reclaim.h"

#define MiB			(1ULL << 20)
#define PAGE_BYTES		4096ULL

/*
 * Never shrink the page cache (the file LRU lists) below the largest of
 * these: a fixed minimum, a fraction of memory, and the kernel's own
 * working-set estimate (the active file list) plus a margin.  What is
 * left above the floor is what a step may take.
 */
#define FLOOR_MIN		(64 * MiB)
#define FLOOR_TOTAL_DIV		32	/* 1/32 of MemTotal */
#define FLOOR_MARGIN_DIV	64	/* active file + 1/64 of MemTotal */
#define STEP_MIN		(4 * MiB)

/*
 * Background: 1% of memory per step, at most a 2% CPU duty cycle, so
 * that a guest that reads files all the time pays at most 2% of a vCPU.
 */
#define BG_STEP_DIV		100
#define BG_TICK_MS		1000
#define BG_IDLE_MS		5000	/* nothing to take: look again later */
#define BG_DUTY_PCT		2
#define BG_BACKOFF_MIN_MS	5000
#define BG_BACKOFF_MAX_MS	60000
#define BG_COMPACT_EVERY	(64 * MiB)
#define BG_FLOOR_HOLD_MS	60000	/* then the working set is read afresh */
#define BG_LEARNED_HOLD_MS	600000	/* a floor refaults taught us, see learn() */
#define BG_SETTLE_MS		10000	/* younger page cache is not taken */

/*
 * Memory freed in one go reaches the host at once (report_freed()): the
 * background thread looks at MemFree this often, and a rise of at least
 * the larger of these since its last look is reported now.
 */
#define FREED_LOOK_MS		1000
#define FREED_MIN		(64 * MiB)
#define FREED_TOTAL_DIV		32	/* 1/32 of MemTotal */

/* On demand the host is waiting: larger steps, a 50% duty cycle. */
#define TRIM_STEP_DIV		32
#define TRIM_GAP_MS		100
#define TRIM_DUTY_PCT		50
#define TRIM_COOL_MS		500	/* wait after a back-off */
#define TRIM_MAX_BACKOFFS	3	/* in a row: give up */
#define TRIM_MAX_IDLE_STEPS	2	/* steps that freed nothing: give up */

/*
 * Back off when other tasks stalled on memory for more than 1% of the
 * time since our last step (senpai's threshold is of that order), or
 * when more than 1 MiB of evicted pages were faulted back in since the
 * previous check: those were not cold.
 */
#define STALL_LIMIT_PERMILLE	10
#define REFAULT_LIMIT_PAGES	256

struct meminfo {
	uint64_t total;
	uint64_t free;
	uint64_t available;
	uint64_t cached;	/* Buffers + Cached */
	uint64_t active_file;
	uint64_t file_lru;	/* Active(file) + Inactive(file) */
};

/* A point in time: PSI's stall total and the kernel's page counters. */
struct sample {
	long long t_us;
	uint64_t stall_us;	/* /proc/pressure/memory "some" total */
	uint64_t refaults;	/* pages */
	uint64_t steal;		/* pages reclaimed by anyone */
};

struct counters {
	uint64_t reclaimed_bytes;
	uint64_t steps;
	uint64_t backoffs;
	uint64_t refault_pages;
	uint64_t compactions;
	uint64_t trims;
	uint64_t cpu_us;
	uint64_t freed_reports;	/* report_now writes by report_freed() */
};

struct reclaimer {
	pthread_mutex_t lock;
	pthread_cond_t cond;	/* background switched on or off */
	bool background;
	bool available;
	bool psi;
	char reclaim_path[320];
	char error[160];
	unsigned long epoch;	/* bumped by every trim */
	uint64_t last_refaults;	/* to count refaults seen while active */
	/*
	 * The floors every reclaim keeps to, the background's steps and
	 * trims alike: a trim that read its floor afresh followed the active
	 * list its predecessor had just deactivated, and the next trim went
	 * lower again (see held_floor()).
	 */
	uint64_t held_floor;	/* see held_floor(); 0: read afresh */
	long long held_us;	/* when it was last read afresh */
	uint64_t learned_floor;	/* see learn(); 0 if none */
	long long learned_us;	/* when learned_floor was last raised */
	/* Refaults counted so far, and since when: learn_slow_refaults() */
	uint64_t counted_refaults;
	long long counted_us;
	struct counters c;
	pthread_t thread;	/* the background thread, if have_thread */
	bool have_thread;
};

static struct reclaimer rc = {
	.lock = PTHREAD_MUTEX_INITIALIZER,
};

static long long mono_us(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1000000LL + ts.tv_nsec / 1000;
}

static long long thread_cpu_us(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
	return ts.tv_sec * 1000000LL + ts.tv_nsec / 1000;
}

/*
 * All the CPU the background thread used, its idle ticks' reads of
 * meminfo, vmstat and PSI included: what the mode costs the guest.
 * cpu_ms counts only the reclaim and compaction work.
 */
static uint64_t background_thread_cpu_ms(void)
{
	struct timespec ts;
	clockid_t clock;

	if (!rc.have_thread || pthread_getcpuclockid(rc.thread, &clock) ||
	    clock_gettime(clock, &ts))
		return 0;
	return ts.tv_sec * 1000ULL + ts.tv_nsec / 1000000;
}

static void nap_ms(long long ms)
{
	struct timespec ts = { ms / 1000, (ms % 1000) * 1000000L };

	while (ms > 0 && nanosleep(&ts, &ts) < 0 && errno == EINTR)
		;
}

static ssize_t read_file(const char *path, char *buf, size_t size)
{
	ssize_t n, total = 0;
	int fd;

	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return -1;
	while ((size_t)total < size - 1) {
		n = read(fd, buf + total, size - 1 - total);
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			break;
		total += n;
	}
	close(fd);
	buf[total] = '\0';
	return total;
}

static int write_file(const char *path, const char *text)
{
	size_t len = strlen(text);
	ssize_t n;
	int fd, err;

	fd = open(path, O_WRONLY | O_CLOEXEC);
	if (fd < 0)
		return -errno;
	n = write(fd, text, len);
	err = n < 0 ? -errno : 0;
	close(fd);
	return err;
}

static int read_meminfo(struct meminfo *m)
{
	static const struct {
		const char *key;
		size_t off;
	} keys[] = {
		{ "MemTotal:", offsetof(struct meminfo, total) },
		{ "MemFree:", offsetof(struct meminfo, free) },
		{ "MemAvailable:", offsetof(struct meminfo, available) },
		{ "Buffers:", offsetof(struct meminfo, cached) },
		{ "Cached:", offsetof(struct meminfo, cached) },
		{ "Active(file):", offsetof(struct meminfo, active_file) },
		{ "Active(file):", offsetof(struct meminfo, file_lru) },
		{ "Inactive(file):", offsetof(struct meminfo, file_lru) },
	};
	char buf[8192], key[64];
	unsigned long long kib;
	char *line, *save;
	size_t i;

	memset(m, 0, sizeof(*m));
	if (read_file("/proc/meminfo", buf, sizeof(buf)) <= 0)
		return -1;
	for (line = strtok_r(buf, "\n", &save); line;
	     line = strtok_r(NULL, "\n", &save)) {
		if (sscanf(line, "%63s %llu", key, &kib) != 2)
			continue;
		for (i = 0; i < sizeof(keys) / sizeof(keys[0]); i++) {
			if (!strcmp(key, keys[i].key))
				*(uint64_t *)((char *)m + keys[i].off) +=
					kib * 1024;
		}
	}
	return m->total ? 0 : -1;
}

/*
 * Pages reclaimed by anyone (pgsteal_anon + pgsteal_file) and refaults
 * of evicted pages (anon + file; one counter before 5.9).
 */
static int read_vmstat(uint64_t *steal, uint64_t *refaults)
{
	static char buf[16384];
	unsigned long long v;
	char *line, *save;
	char key[64];

	*steal = 0;
	*refaults = 0;
	if (read_file("/proc/vmstat", buf, sizeof(buf)) <= 0)
		return -1;
	for (line = strtok_r(buf, "\n", &save); line;
	     line = strtok_r(NULL, "\n", &save)) {
		if (sscanf(line, "%63s %llu", key, &v) != 2)
			continue;
		if (!strcmp(key, "pgsteal_anon") || !strcmp(key, "pgsteal_file"))
			*steal += v;
		else if (!strcmp(key, "workingset_refault_anon") ||
			 !strcmp(key, "workingset_refault_file") ||
			 !strcmp(key, "workingset_refault"))
			*refaults += v;
	}
	return 0;
}

/* The "some" total of /proc/pressure/memory, in microseconds. */
static int read_stall(uint64_t *us)
{
	unsigned long long total;
	char buf[512];
	char *p;

	if (read_file("/proc/pressure/memory", buf, sizeof(buf)) <= 0)
		return -1;
	p = strstr(buf, "some ");
	if (!p)
		return -1;
	p = strstr(p, "total=");
	if (!p || sscanf(p, "total=%llu", &total) != 1)
		return -1;
	*us = total;
	return 0;
}

/* Called with rc.lock held. */
static void take_sample(struct sample *s, bool count_refaults)
{
	s->t_us = mono_us();
	rc.psi = read_stall(&s->stall_us) == 0;
	if (!rc.psi)
		s->stall_us = 0;
	read_vmstat(&s->steal, &s->refaults);
	if (count_refaults && s->refaults > rc.last_refaults)
		rc.c.refault_pages += s->refaults - rc.last_refaults;
	rc.last_refaults = s->refaults;
}

/*
 * Should we stop taking memory?  `quiet` was sampled right after our last
 * step, so the stall time from there to `now` is other tasks' (reclaim
 * itself can count as a stall); refaults count from `prev`, the check
 * before, since a page we just evicted may come back during the step.
 */
static const char *pressure(const struct sample *prev,
			    const struct sample *quiet,
			    const struct sample *now)
{
	long long window = now->t_us - quiet->t_us;

	/* A failed read leaves a counter at 0: never a reason to stop. */
	if (now->refaults > prev->refaults &&
	    now->refaults - prev->refaults > REFAULT_LIMIT_PAGES)
		return "refaults";
	if (rc.psi && window > 0 && now->stall_us > quiet->stall_us &&
	    (now->stall_us - quiet->stall_us) * 1000 >
	    (uint64_t)window * STALL_LIMIT_PERMILLE)
		return "pressure";
	return NULL;
}

static uint64_t floor_bytes(const struct meminfo *m)
{
	uint64_t floor = FLOOR_MIN;

	if (m->total / FLOOR_TOTAL_DIV > floor)
		floor = m->total / FLOOR_TOTAL_DIV;
	if (m->active_file + m->total / FLOOR_MARGIN_DIV > floor)
		floor = m->active_file + m->total / FLOOR_MARGIN_DIV;
	return floor;
}

/*
 * The floor reclaim keeps to: the highest seen since it was last read
 * afresh (see renew_floor()), by any trim or background step.
 * Reclaiming deactivates part of the active file list (the classic LRU
 * refills a short inactive list from it, and any refault makes it do
 * so), which lowers Active(file) and with it floor_bytes(): a floor
 * read afresh before every step follows the kernel down into the hot
 * set it is there to protect (seen on 6.1: a trim of a guest that had
 * read a large data set once took half of its hot subset; and when
 * each trim read it afresh, a host asking for a trim every second
 * walked its guests' hot files down the same way, fleet-overcommit
 * 2026-11-29).
 */
static uint64_t held_floor(const struct meminfo *m)
{
	uint64_t floor = floor_bytes(m);

	if (floor > rc.held_floor)
		rc.held_floor = floor;
	return rc.held_floor;
}

/* The page cache a step must leave: the held floor and the learned one. */
static uint64_t kept_floor(const struct meminfo *m)
{
	return held_floor(m) + rc.learned_floor;
}

/* What a step may take from `cache` bytes of page cache: above the floor. */
static uint64_t above_floor(const struct meminfo *m, uint64_t cache)
{
	uint64_t floor = kept_floor(m);

	return cache > floor ? cache - floor : 0;
}

/* What a trim step may take: all the page cache above the floor. */
static uint64_t room(const struct meminfo *m)
{
	return above_floor(m, m->file_lru);
}

/*
 * Ask the kernel for `bytes`; returns what the pgsteal counters say was
 * reclaimed.  memory.reclaim fails with EAGAIN when it got less than
 * asked, which is still progress; any other error disables us.
 */
static uint64_t reclaim_bytes(uint64_t bytes)
{
	uint64_t steal0, steal1, refaults;
	long long cpu = thread_cpu_us();
	char text[32];
	int err;

	read_vmstat(&steal0, &refaults);
	snprintf(text, sizeof(text), "%" PRIu64, bytes);
	err = write_file(rc.reclaim_path, text);
	read_vmstat(&steal1, &refaults);
	rc.c.cpu_us += thread_cpu_us() - cpu;
	rc.c.steps++;
	if (err && err != -EAGAIN) {
		snprintf(rc.error, sizeof(rc.error), "memory.reclaim: %s",
			 strerror(-err));
		rc.available = false;
		return 0;
	}
	if (steal1 < steal0)
		return 0;
	/*
	 * Not capped at `bytes`: the kernel overshoots (it reclaims in
	 * batches, memcg by memcg).  kswapd may add to the count meanwhile,
	 * but then memory is short and the next check backs off.
	 */
	steal1 = (steal1 - steal0) * PAGE_BYTES;
	rc.c.reclaimed_bytes += steal1;
	return steal1;
}

/* Gather free pages into whole blocks, which is what reporting sends. */
static bool compact(void)
{
	long long cpu = thread_cpu_us();
	int err;

	err = write_file("/proc/sys/vm/compact_memory", "1");
	rc.c.cpu_us += thread_cpu_us() - cpu;
	if (err)
		return false;
	rc.c.compactions++;
	return true;
}

/* Where thinvm_balloon's devices are (guest/balloon/report.c). */
#define BALLOON_DEVICES "/sys/bus/virtio/drivers/thinvm_balloon"

/*
 * Have what a trim freed reported to the host now, not at the kernel's
 * pace (a pass every 2 s, a sixteenth of each free list per pass): our
 * driver's report_now runs the passes back to back.  False without our
 * driver, or with free page reporting off (no report_now then).
 */
static bool report_now(void)
{
	char path[512];
	struct dirent *d;
	bool done = false;
	DIR *dir;

	dir = opendir(BALLOON_DEVICES);
	if (!dir)
		return false;
	while (!done && (d = readdir(dir))) {
		if (strncmp(d->d_name, "virtio", 6))
			continue;
		snprintf(path, sizeof(path), "%s/%s/report_now",
			 BALLOON_DEVICES, d->d_name);
		done = access(path, W_OK) == 0 && !write_file(path, "1");
	}
	closedir(dir);
	return done;
}

/* Sleep long enough that `cpu_us` of work is at most duty_pct of the time. */
static long long duty_sleep_ms(long long cpu_us, int duty_pct, long long min_ms)
{
	long long ms = cpu_us * (100 - duty_pct) / duty_pct / 1000;

	return ms > min_ms ? ms : min_ms;
}

/* Find the root cgroup's memory.reclaim; called with rc.lock held. */
static void probe(void)
{
	char mnt[256], type[64], line[1024];
	bool found = false;
	FILE *f;

	if (rc.available)
		return;
	f = fopen("/proc/self/mounts", "re");
	while (f && fgets(line, sizeof(line), f)) {
		if (sscanf(line, "%*s %255s %63s", mnt, type) == 2 &&
		    !strcmp(type, "cgroup2")) {
			found = true;
			break;
		}
	}
	if (f)
		fclose(f);
	if (!found) {
		snprintf(rc.error, sizeof(rc.error), "no cgroup2 mount");
		return;
	}
	snprintf(rc.reclaim_path, sizeof(rc.reclaim_path),
		 "%s/memory.reclaim", mnt);
	if (access(rc.reclaim_path, W_OK)) {
		snprintf(rc.error, sizeof(rc.error), "memory.reclaim in %.64s: %s",
			 mnt, strerror(errno));
		return;
	}
	rc.available = true;
	rc.error[0] = '\0';
}

/*
 * With MGLRU on, the active file list is the two youngest generations,
 * where page cache read through read() rarely goes: the floor's working
 * set estimate sees nothing, and only refaults (and MGLRU's own tiers,
 * once it saw them) protect a hot set.  Reported so the host knows.
 */
static bool lru_gen_enabled(void)
{
	char buf[32];

	if (read_file("/sys/kernel/mm/lru_gen/enabled", buf, sizeof(buf)) <= 0)
		return false;
	return strtoul(buf, NULL, 0) != 0;
}

/* Wait up to `ms` or until the mode changes; called with rc.lock held. */
static void wait_locked(long long ms)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	ts.tv_sec += ms / 1000;
	ts.tv_nsec += (ms % 1000) * 1000000L;
	if (ts.tv_nsec >= 1000000000L) {
		ts.tv_sec++;
		ts.tv_nsec -= 1000000000L;
	}
	pthread_cond_timedwait(&rc.cond, &rc.lock, &ts);
}

struct bg_state {
	long long next_tick_us;	/* when background_tick() runs next */
	uint64_t last_free;	/* MemFree at the last look; 0: none yet */
	unsigned long freed_epoch;	/* rc.epoch at the last look */
	unsigned long epoch;
	bool fresh;		/* no samples yet: next tick only measures */
	struct sample prev, quiet;
	long long backoff_ms;
	uint64_t since_compact;
	/*
	 * The file LRU's size when the current window began, and when the
	 * one before it began; 0 us: no window yet.  See settled_cache().
	 */
	long long window_us;
	uint64_t window_lru;
	uint64_t settled_lru;
};

/*
 * The page cache as it stood BG_SETTLE_MS to twice that ago, at most what
 * there is now: what a background step may take from, above the floor.
 * Page cache read a moment ago is not known to be cold: a program reads
 * its hot files for the first time along with everything else, and
 * reclaim takes the oldest pages first, which are the first read.  (A
 * 1 GiB 6.1 guest reading 384 MiB once and then 64 MiB of it again and
 * again: the one step the background took, 17 MiB, came during the
 * first read, from its start, and all of it came back, 4383 pages.)
 * Reading what is already cached again does not grow the cache, so a
 * guest that keeps reading the same files is trimmed as before.
 */
static uint64_t settled_cache(const struct bg_state *st,
			      const struct meminfo *m)
{
	return st->settled_lru < m->file_lru ? st->settled_lru : m->file_lru;
}

/* Start a new window when the current one is BG_SETTLE_MS old. */
static void keep_windows(struct bg_state *st, const struct meminfo *m,
			 long long t_us)
{
	if (!st->window_us) {
		st->window_us = t_us;
		st->window_lru = m->file_lru;
		st->settled_lru = 0;
	} else if (t_us - st->window_us >= BG_SETTLE_MS * 1000LL) {
		st->settled_lru = st->window_lru;
		st->window_lru = m->file_lru;
		st->window_us = t_us;
	}
}

/*
 * Refaults after our steps (a background tick's or a trim's) mean we
 * reclaimed into the working set: what came back is in use, and the
 * active list may not show it (MGLRU keeps page cache read through
 * read() out of it, and our own steps deactivate it).  It is added to
 * the floor, up to the page cache there is, and kept for longer than a
 * floor read from the lists: every further refault learned adds to it
 * and renews it, and it lapses when nothing refaulted for
 * BG_LEARNED_HOLD_MS, so a working set that shrank is given back then.
 * Only what came back counts, not the page cache as it stood: refaults
 * of a hot set while a large file is read once would otherwise make
 * that whole file a floor.
 */
static void learn(const struct sample *prev, const struct sample *now)
{
	uint64_t from = prev->refaults;
	struct meminfo m;

	/* What learn_slow_refaults() already added is not added twice. */
	if (rc.counted_us && rc.counted_refaults > from)
		from = rc.counted_refaults;
	if (now->refaults <= from)
		return;
	rc.counted_refaults = now->refaults;
	rc.counted_us = now->t_us;
	if (read_meminfo(&m))
		return;
	rc.learned_floor += (now->refaults - from) * PAGE_BYTES;
	if (rc.learned_floor > m.file_lru)
		rc.learned_floor = m.file_lru;
	rc.learned_us = now->t_us;
}

/*
 * Refaults are learned however slowly they come.  A hot set we cut into
 * comes back a little after each use, which a single check (at most a
 * second apart while we reclaim) may never see as more than
 * REFAULT_LIMIT_PAGES; and a trim starts its checks afresh, so what
 * came back since the previous trim was not looked at at all
 * (fleet-overcommit 2026-11-30: at 6 guests some refaulted several
 * thousand pages of their hot files in a run while their host asked
 * for trims every few seconds).  Counted from the last count learned,
 * they are learned once they add up to more than the limit within
 * BG_LEARNED_HOLD_MS; a trickle slower than that starts counting
 * afresh.  Whoever evicted them, a refault says the page was in use.
 */
static void learn_slow_refaults(const struct sample *now)
{
	struct sample counted = { .refaults = rc.counted_refaults };

	/* Only a failed read (which leaves 0) goes backwards. */
	if (now->refaults < rc.counted_refaults)
		return;
	if (!rc.counted_us ||
	    now->t_us - rc.counted_us > BG_LEARNED_HOLD_MS * 1000LL) {
		rc.counted_refaults = now->refaults;
		rc.counted_us = now->t_us;
		return;
	}
	if (now->refaults - rc.counted_refaults > REFAULT_LIMIT_PAGES)
		learn(&counted, now);
}

/* Let the held floor, and the learned one, lapse when their time is up. */
static void renew_floor(long long t_us)
{
	if (t_us - rc.held_us > BG_FLOOR_HOLD_MS * 1000LL) {
		/* A hot set may also cool down: do not hold it for ever. */
		rc.held_floor = 0;
		rc.held_us = t_us;
	}
	if (rc.learned_floor &&
	    t_us - rc.learned_us > BG_LEARNED_HOLD_MS * 1000LL)
		rc.learned_floor = 0;
}

/*
 * One background tick with rc.lock held; returns how long to wait.
 * @m is /proc/meminfo as the loop read it just before, NULL if it could
 * not be read.
 */
static long long background_tick(struct bg_state *st,
				 const struct meminfo *m)
{
	struct sample now;
	const char *why;
	uint64_t avail, step, got;
	long long cpu;

	if (st->fresh || st->epoch != rc.epoch) {
		/* Just switched on, or a trim ran: start a clean window. */
		take_sample(&st->prev, false);
		learn_slow_refaults(&st->prev);
		st->quiet = st->prev;
		st->epoch = rc.epoch;
		st->fresh = false;
		return BG_TICK_MS;
	}
	take_sample(&now, true);
	why = pressure(&st->prev, &st->quiet, &now);
	if (why && !strcmp(why, "refaults"))
		learn(&st->prev, &now);
	else
		learn_slow_refaults(&now);
	if (why) {
		rc.c.backoffs++;
		st->backoff_ms = st->backoff_ms ?
			st->backoff_ms * 2 : BG_BACKOFF_MIN_MS;
		if (st->backoff_ms > BG_BACKOFF_MAX_MS)
			st->backoff_ms = BG_BACKOFF_MAX_MS;
		st->prev = st->quiet = now;
		return st->backoff_ms;
	}
	st->backoff_ms = 0;
	st->prev = now;
	renew_floor(now.t_us);
	/* Only settled page cache, see settled_cache(). */
	avail = m ? above_floor(m, settled_cache(st, m)) : 0;
	if (avail < STEP_MIN) {
		if (st->since_compact && compact())
			st->since_compact = 0;
		take_sample(&st->quiet, true);
		st->prev = st->quiet;
		return BG_IDLE_MS;
	}
	step = m->total / BG_STEP_DIV;
	if (step < STEP_MIN)
		step = STEP_MIN;
	if (step > avail)
		step = avail;
	cpu = thread_cpu_us();
	got = reclaim_bytes(step);
	/* What our own step freed is the kernel's to report, at its pace. */
	if (st->last_free)
		st->last_free += got;
	st->since_compact += got;
	if (st->since_compact >= BG_COMPACT_EVERY && compact())
		st->since_compact = 0;
	cpu = thread_cpu_us() - cpu;
	take_sample(&st->quiet, true);
	if (got < step / 4)
		return BG_IDLE_MS;
	return duty_sleep_ms(cpu, BG_DUTY_PCT, BG_TICK_MS);
}

/*
 * Have memory the guest just freed in one go (a process that exited, a
 * cache dropped) reported now.  The kernel reports free pages at its own
 * pace, a sixteenth of each free list every 2 s, about 30 s for a large
 * free; meanwhile the host still holds that memory, and a host that
 * overcommits swaps other guest memory out for it.  Only large rises
 * count, so memory freed in passing is left to the kernel's pace; the
 * passes themselves are the kernel's, run sooner, not more of them.
 * Without our driver (no report_now) this does nothing.  Returns whether
 * it let go of rc.lock to ask for a pass.
 */
static bool report_freed(struct bg_state *st, const struct meminfo *m)
{
	uint64_t min;
	bool reported, asked = false;

	if (st->freed_epoch != rc.epoch) {
		/* A trim ran: it freed memory and had it reported itself. */
		st->freed_epoch = rc.epoch;
		st->last_free = m->free;
		return false;
	}
	min = m->total / FREED_TOTAL_DIV > FREED_MIN ?
	      m->total / FREED_TOTAL_DIV : FREED_MIN;
	if (st->last_free && m->free >= st->last_free + min) {
		/* The passes take a while: let a TRIM or STATUS through. */
		pthread_mutex_unlock(&rc.lock);
		reported = report_now();
		pthread_mutex_lock(&rc.lock);
		if (reported)
			rc.c.freed_reports++;
		asked = true;
	}
	st->last_free = m->free;
	return asked;
}

static void *background_main(void *unused)
{
	struct bg_state st = { .fresh = true };
	struct meminfo m;
	bool have_m;
	long long wait_ms;

	(void)unused;
	pthread_mutex_lock(&rc.lock);
	for (;;) {
		while (!rc.background) {
			st.fresh = true;
			st.next_tick_us = 0;
			st.last_free = 0;
			st.window_us = 0;
			pthread_cond_wait(&rc.cond, &rc.lock);
		}
		probe();
		if (!rc.available) {
			wait_locked(BG_IDLE_MS);
			continue;
		}
		/*
		 * One read of /proc/meminfo serves all three, once a second:
		 * the windows of settled_cache() go on while ticks back off.
		 */
		have_m = !read_meminfo(&m);
		if (have_m)
			keep_windows(&st, &m, mono_us());
		if (have_m && report_freed(&st, &m)) {
			/* It let the lock go while the kernel reported: a STOP
			 * may have come through, and a trim may have run.
			 */
			if (!rc.background)
				continue;
			have_m = !read_meminfo(&m);
		}
		if (mono_us() >= st.next_tick_us) {
			wait_ms = background_tick(&st, have_m ? &m : NULL);
			st.next_tick_us = mono_us() + wait_ms * 1000LL;
		}
		wait_ms = (st.next_tick_us - mono_us()) / 1000;
		if (wait_ms > FREED_LOOK_MS)
			wait_ms = FREED_LOOK_MS;
		wait_locked(wait_ms > 0 ? wait_ms : 1);
	}
	return NULL;
}

void reclaim_init(bool background)
{
	pthread_condattr_t attr;

	pthread_condattr_init(&attr);
	pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
	pthread_cond_init(&rc.cond, &attr);
	pthread_condattr_destroy(&attr);

	pthread_mutex_lock(&rc.lock);
	rc.background = background;
	probe();
	pthread_mutex_unlock(&rc.lock);
	if (pthread_create(&rc.thread, NULL, background_main, NULL)) {
		/* Trims still work on the main thread; only the mode is lost. */
		fprintf(stderr, "thinvm-agent: no reclaim thread: %s\n",
			strerror(errno));
		rc.background = false;
		return;
	}
	pthread_detach(rc.thread);
	rc.have_thread = true;
	if (background)
		fputs("thinvm-agent: background reclaim on\n", stderr);
}

/* Append the status object's members; called with rc.lock held. */
static int status_members(char *out, size_t size)
{
	return snprintf(out, size,
		"\"available\":%s,\"background\":%s,\"psi\":%s,\"lru_gen\":%s,"
		"\"error\":\"%s\",\"reclaimed_bytes\":%" PRIu64
		",\"steps\":%" PRIu64 ",\"backoffs\":%" PRIu64
		",\"refault_pages\":%" PRIu64 ",\"compactions\":%" PRIu64
		",\"trims\":%" PRIu64 ",\"cpu_ms\":%" PRIu64
		",\"learned_floor_bytes\":%" PRIu64
		",\"thread_cpu_ms\":%" PRIu64
		",\"freed_reports\":%" PRIu64,
		rc.available ? "true" : "false",
		rc.background ? "true" : "false",
		rc.psi ? "true" : "false", lru_gen_enabled() ? "true" : "false",
		rc.error,
		rc.c.reclaimed_bytes, rc.c.steps, rc.c.backoffs,
		rc.c.refault_pages, rc.c.compactions, rc.c.trims,
		rc.c.cpu_us / 1000, rc.learned_floor,
		background_thread_cpu_ms(), rc.c.freed_reports);
}

static int status_locked(char *out, size_t size)
{
	int n;

	n = snprintf(out, size, "{");
	n += status_members(out + n, size - n);
	n += snprintf(out + n, size - n, "}");
	return (size_t)n < size ? n : -1;
}

int reclaim_status(char *out, size_t size)
{
	uint64_t stall;
	int n;

	pthread_mutex_lock(&rc.lock);
	probe();
	rc.psi = read_stall(&stall) == 0;
	n = status_locked(out, size);
	pthread_mutex_unlock(&rc.lock);
	return n;
}

int reclaim_set_background(bool on, char *out, size_t size)
{
	pthread_mutex_lock(&rc.lock);
	rc.background = on;
	pthread_cond_broadcast(&rc.cond);
	pthread_mutex_unlock(&rc.lock);
	return reclaim_status(out, size);
}

struct trim {
	uint64_t max_bytes;
	long long deadline_us;
	uint64_t reclaimed;
	uint64_t steps;
	uint64_t backoffs;
	uint64_t refaults_before;
	const char *stop;
};

static long long remaining_ms(const struct trim *t)
{
	long long us = t->deadline_us - mono_us();

	return us > 0 ? us / 1000 : 0;
}

static void nap_within(const struct trim *t, long long ms)
{
	long long left = remaining_ms(t);

	nap_ms(ms < left ? ms : left);
}

/* The trim loop proper, with rc.lock held. */
static void trim_loop(struct trim *t, uint64_t step_max)
{
	struct sample prev, quiet, now;
	unsigned int in_row = 0, idle = 0;
	const char *why;
	struct meminfo m;
	uint64_t step, got;
	long long cpu;

	take_sample(&prev, false);
	/* What came back since our last reclaim counts before this one. */
	learn_slow_refaults(&prev);
	quiet = prev;
	t->refaults_before = prev.refaults;
	for (;;) {
		if (!remaining_ms(t)) {
			t->stop = "timeout";
			return;
		}
		if (t->max_bytes && t->reclaimed >= t->max_bytes) {
			t->stop = "max_bytes";
			return;
		}
		if (read_meminfo(&m) || room(&m) < STEP_MIN) {
			t->stop = "floor";
			return;
		}
		take_sample(&now, true);
		why = pressure(&prev, &quiet, &now);
		if (why && !strcmp(why, "refaults"))
			learn(&prev, &now);
		else
			learn_slow_refaults(&now);
		prev = now;
		if (why) {
			t->backoffs++;
			rc.c.backoffs++;
			if (++in_row >= TRIM_MAX_BACKOFFS) {
				t->stop = why;
				return;
			}
			nap_within(t, TRIM_COOL_MS);
			take_sample(&quiet, true);
			prev = quiet;
			continue;
		}
		in_row = 0;
		step = room(&m);
		if (step > step_max)
			step = step_max;
		if (t->max_bytes && step > t->max_bytes - t->reclaimed)
			step = t->max_bytes - t->reclaimed;
		cpu = thread_cpu_us();
		got = reclaim_bytes(step);
		cpu = thread_cpu_us() - cpu;
		t->reclaimed += got;
		t->steps++;
		if (!rc.available) {
			t->stop = "error";
			return;
		}
		idle = got ? 0 : idle + 1;
		if (idle >= TRIM_MAX_IDLE_STEPS) {
			t->stop = "no_progress";
			return;
		}
		take_sample(&quiet, true);
		nap_within(t, duty_sleep_ms(cpu, TRIM_DUTY_PCT, TRIM_GAP_MS));
	}
}

int reclaim_trim(uint64_t max_bytes, unsigned int timeout_ms, char *out,
		 size_t size)
{
	struct trim t = { .max_bytes = max_bytes };
	struct meminfo before, after;
	long long start = mono_us();
	struct sample end;
	uint64_t step;
	bool compacted = false;
	bool reported = false;
	long long reclaim_ms;
	int n;

	pthread_mutex_lock(&rc.lock);
	probe();
	if (!rc.available) {
		n = status_locked(out, size);
		pthread_mutex_unlock(&rc.lock);
		return n;
	}
	rc.epoch++;
	rc.c.trims++;
	t.deadline_us = start + timeout_ms * 1000LL;
	renew_floor(start);
	read_meminfo(&before);
	step = before.total / TRIM_STEP_DIV;
	if (step < STEP_MIN)
		step = STEP_MIN;
	trim_loop(&t, step);
	if (t.reclaimed)
		compacted = compact();
	reclaim_ms = (mono_us() - start) / 1000;
	if (t.reclaimed)
		reported = report_now();
	take_sample(&end, true);
	read_meminfo(&after);
	n = snprintf(out, size,
		"{\"reclaimed_bytes_trim\":%" PRIu64 ",\"steps_trim\":%" PRIu64
		",\"backoffs_trim\":%" PRIu64 ",\"refault_pages_trim\":%" PRIu64
		",\"compacted\":%s,\"reported_now\":%s,\"reclaim_ms\":%lld"
		",\"stop\":\"%s\",\"elapsed_ms\":%lld"
		",\"floor_bytes\":%" PRIu64 ",\"cache_before\":%" PRIu64
		",\"cache_after\":%" PRIu64 ",\"free_before\":%" PRIu64
		",\"free_after\":%" PRIu64 ",",
		t.reclaimed, t.steps, t.backoffs,
		end.refaults > t.refaults_before ?
			end.refaults - t.refaults_before : 0,
		compacted ? "true" : "false", reported ? "true" : "false",
		reclaim_ms, t.stop,
		(mono_us() - start) / 1000, kept_floor(&after),
		before.cached, after.cached, before.free, after.free);
	if (n > 0 && (size_t)n < size)
		n += status_members(out + n, size - n);
	if (n > 0 && (size_t)n < size)
		n += snprintf(out + n, size - n, "}");
	pthread_mutex_unlock(&rc.lock);
	return n > 0 && (size_t)n < size ? n : -1;
}
